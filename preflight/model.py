"""The vocabulary every other module speaks: statuses, severities, evidence and findings.

Everything here is a frozen record (a msgspec Struct) or an enum so that facts and findings can be passed between
threads, compared in tests and serialised to JSON without surprises.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable
from typing import Any

from msgspec import Struct

#: Stable reference IDs look like lint codes: an area of 2-5 capitals and three digits.
REFERENCE_ID = re.compile(r"^[A-Z]{2,5}[0-9]{3}\Z")  # \Z: "$" would let a final newline through
#: Symbols name the misconfiguration in kebab case, e.g. ``memlock-limit-too-low``.
SYMBOL = re.compile(r"^[a-z0-9]+(?:-[a-z0-9]+)*\Z")


class Status(str, enum.Enum):
    """The verdict for one (reference, subject) pair."""

    PRESENT = "present"
    ABSENT = "absent"
    NOT_APPLICABLE = "not_applicable"
    UNKNOWN = "unknown"


class Severity(str, enum.Enum):
    """How bad a present finding is; ``rank`` orders them for reports and exit codes."""

    CRITICAL = "critical"
    ERROR = "error"
    WARNING = "warning"
    INFO = "info"

    @property
    def rank(self) -> int:
        return _SEVERITY_RANK[self]


_SEVERITY_RANK = {Severity.INFO: 0, Severity.WARNING: 1, Severity.ERROR: 2, Severity.CRITICAL: 3}


class Evidence(Struct, frozen=True):
    """One observation behind a finding: what was seen, what was expected, and where."""

    source: str  # a path as seen on the node ("/proc/self/limits") or an API ("nvmlDeviceGetCount")
    observed: str
    expected: str = ""

    def to_json(self) -> dict[str, str]:
        return {"source": self.source, "observed": self.observed, "expected": self.expected}


class Finding(Struct, frozen=True):
    """The verdict of one check for one subject on one node."""

    reference_id: str
    symbol: str
    title: str
    status: Status
    severity: Severity
    subject: str  # "node", "mlx5_0/1", "GPU3", "slurmd", ...
    evidence: tuple[Evidence, ...] = ()
    fix: str = ""
    reason: str = ""  # why the status is unknown or not_applicable

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.reference_id,
            "symbol": self.symbol,
            "title": self.title,
            "status": self.status.value,
            "severity": self.severity.value,
            "subject": self.subject,
            "evidence": [item.to_json() for item in self.evidence],
            "fix": self.fix,
            "reason": self.reason,
        }


class Observation(Struct, frozen=True):
    """What a check yields: a present finding about one subject, before the engine adds the
    reference's title, fix and (site-adjusted) severity."""

    subject: str
    evidence: tuple[Evidence, ...]
    # A check may lower the severity of a weaker sub-case (a risk rather than a certainty);
    # the site's override still wins.
    severity: Severity | None = None
    fix: str = ""  # a subject-specific fix; the reference's fix is used when empty
    status: Status = Status.PRESENT  # or UNKNOWN for a subject whose facts could not be read
    reason: str = ""


def present(
    subject: str,
    *evidence: Evidence,
    severity: Severity | None = None,
    fix: str = "",
) -> Observation:
    """Build the observation a check yields when the misconfiguration is present."""
    return Observation(subject=subject, evidence=tuple(evidence), severity=severity, fix=fix)


def undecided(subject: str, reason: str, *evidence: Evidence) -> Observation:
    """Build the observation for a subject whose facts could not be read: it becomes
    ``unknown`` with ``reason`` rather than a silent ``absent``."""
    return Observation(subject=subject, evidence=tuple(evidence), status=Status.UNKNOWN, reason=reason)


def merge_by_subject(observations: Iterable[Observation]) -> list[Observation]:
    """One observation per subject (one report row): a present one wins over an undecided one;
    two present ones join their evidence and keep the stronger severity (None is the
    reference's own, the strongest here)."""
    merged: dict[str, Observation] = {}
    for item in observations:
        earlier = merged.get(item.subject)
        if earlier is None or (earlier.status is not Status.PRESENT and item.status is Status.PRESENT):
            merged[item.subject] = item
        elif earlier.status is Status.PRESENT and item.status is Status.PRESENT:
            severity = None if earlier.severity is None or item.severity is None else max(earlier.severity, item.severity, key=lambda s: s.rank)
            fix = earlier.fix if earlier.fix == item.fix else ""
            merged[item.subject] = Observation(item.subject, earlier.evidence + item.evidence, severity, fix)
    return list(merged.values())


class NotApplicable(Exception):
    """Raised by a check when the reference cannot apply to this node (no GPUs, no RDMA...)."""


class Unknown(Exception):
    """Raised by a check when the facts it needs could not be read."""


class Unread(Struct, frozen=True):
    """What a check gets in place of an optional probe's facts (``@check(..., optional=...)``)
    when that probe failed: which probe and why, so that the check can judge what it can without
    them and say what it cannot."""

    probe: str
    reason: str

    def __str__(self) -> str:
        return f"probe {self.probe}: {self.reason}"


#: What an optional probe's facts are when a caller gives none (a test calling a check directly):
#: the check then judges as it does without them.
NOT_GIVEN = Unread("", "not given by the caller")


class ProbeOutcome(Struct, frozen=True):
    """How one probe went: its facts (or None), status, duration and the reason it failed."""

    name: str
    status: str  # "ok" | "error" | "timeout"
    duration_s: float
    facts: Any = None
    error: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "status": self.status,
            "duration_s": round(self.duration_s, 6),
            "error": self.error,
        }


class Reference(Struct, frozen=True):
    """One catalogued failure mode, loaded from ``references/<ID>.toml``."""

    id: str
    symbol: str
    title: str
    area: str
    severity: Severity
    summary: str
    fix: tuple[str, ...]
    detect: tuple[str, ...] = ()
    checks: tuple[str, ...] = ()
    why_log_only: str = ""  # [detect]: why no evidence exists before the job ("" when some does)
    candidate: str = ""  # [detect]: the evidence a check still to be written would read
    fleet: tuple[str, ...] = ()  # [detect]: fleet fact keys whose comparison decides it
    # [detect]: what the checks test when they test only some of the causes; a clean result then
    # cannot rule the reference out ("" when the checks cover every node-side cause)
    tests_only: str = ""
    causes: tuple[str, ...] = ()
    evidence: tuple[dict[str, str], ...] = ()
    related: tuple[str, ...] = ()
    signatures: tuple[dict[str, Any], ...] = ()
    sources: tuple[str, ...] = ()
    old_ids: tuple[str, ...] = ()

    @property
    def fix_text(self) -> str:
        return " ".join(self.fix)


def selects(token: str, reference: Reference) -> bool:
    """``--select``/``--ignore`` tokens match an ID prefix (``MEM``, ``MEM001``) or a symbol."""
    return reference.id.startswith(token.upper()) or token.lower() == reference.symbol
