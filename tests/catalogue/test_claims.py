"""Every reference's facts were checked against primary sources, claim by claim, and what was
checked is kept beside it (references/claims/<ID>.toml) so a later release can be re-checked.

A claim is ``verified`` (the source shows it), ``corrected`` (it was wrong and the reference now
says what the source shows) or ``unverifiable`` (with a note saying what was searched). A claim
left ``wrong`` fails this test; so does a source that names a branch instead of a tag or commit,
since a branch moves and the check could no longer be repeated.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from preflight.catalogue import load_all

CLAIMS = Path(__file__).resolve().parents[2] / "references" / "claims"
REFERENCE_IDS = sorted(reference.id for reference in load_all())
STATUSES = {"verified", "corrected", "unverifiable"}
FIELDS = {"summary", "causes", "fix", "signatures", "evidence", "detect"}
MIN_CLAIMS = 6
_MOVING_REF = re.compile(r"github\.com/[^/]+/[^/]+/(?:blob|tree)/(?:master|main|HEAD|develop)/")


def test_every_reference_has_a_claims_file() -> None:
    assert sorted(path.stem for path in CLAIMS.glob("*.toml")) == REFERENCE_IDS


@pytest.mark.parametrize("reference_id", REFERENCE_IDS)
def test_claims_are_checked_and_repeatable(reference_id: str) -> None:
    document = tomllib.loads((CLAIMS / f"{reference_id}.toml").read_text())
    assert document["reference"] == reference_id
    claims = document["claim"]
    assert len(claims) >= MIN_CLAIMS
    for number, claim in enumerate(claims, 1):
        where = f"{reference_id} claim #{number}"
        assert claim["status"] in STATUSES, f"{where}: status {claim['status']!r} (a wrong claim must be corrected)"
        assert claim["field"] in FIELDS, where
        assert claim["claim"].strip() and claim["note"].strip(), where
        assert claim["source"].startswith(("https://", "http://")), f"{where}: source is not a URL"
        assert not _MOVING_REF.search(claim["source"]), f"{where}: source names a branch: {claim['source']}"
        if claim["status"] == "corrected":
            assert claim.get("correction", "").strip(), f"{where}: corrected without saying to what"
