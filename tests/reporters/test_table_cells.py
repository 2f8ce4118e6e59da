"""The table's evidence cell: what was read, and for an undecided finding why it stays so."""

from __future__ import annotations

from preflight.model import Evidence, Finding, Severity, Status
from preflight.reporters.table import _evidence

USAGE = Evidence("nvmlDeviceGetBAR1MemoryInfo", "bar1Used 80 GiB of 128 GiB", "at most 50% mapped on an idle GPU")


def finding(status: Status, reason: str = "", *evidence: Evidence) -> Finding:
    return Finding("GDR003", "peermem-gpu-mapping-rejected", "BAR1", status, Severity.WARNING, "GPU0", evidence, reason=reason)


def test_an_unknown_finding_shows_why_before_what_was_read() -> None:
    """The evidence of an unknown finding alone reads like the verdict it is not."""
    why = "bar1Used 80 GiB of 128 GiB, but 1 compute process(es) run on the GPU, whose buffers are mapped through BAR1"
    cell = _evidence(finding(Status.UNKNOWN, why, USAGE))
    assert cell.splitlines() == [why, "nvmlDeviceGetBAR1MemoryInfo: bar1Used 80 GiB of 128 GiB (expected at most 50% mapped on an idle GPU)"]


def test_a_present_finding_shows_its_evidence_and_a_bare_reason_alone() -> None:
    assert _evidence(finding(Status.PRESENT, "", USAGE)).startswith("nvmlDeviceGetBAR1MemoryInfo:")
    assert _evidence(finding(Status.NOT_APPLICABLE, "no RDMA devices")) == "no RDMA devices"
