"""The JSON report's encoder: msgspec's, with the standard library's ASCII escapes wherever the
text is not plain ASCII, so every report reads the same on any terminal or log."""

from __future__ import annotations

import json

import pytest

from preflight.reporters.json_report import dumps


@pytest.mark.parametrize(
    "document",
    [
        {"subject": "eth\udcff0"},  # an undecodable byte of an interface name, kept as a surrogate
        {"subject": "nœud-é"},
        {"numbers": [1, 2.5e-7, 1e300, -0.0], "none": None, "flags": [True, False], "nested": {"": []}},
    ],
)
def test_reports_are_ascii_json_that_reads_back_the_same(document: dict[str, object]) -> None:
    text = dumps(document)
    assert text.isascii()
    assert json.loads(text) == document
    assert text.startswith("{\n  \"")  # indented, as the golden report and users' diffs expect
