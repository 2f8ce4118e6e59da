"""The table a person reads at a glance: findings grouped by severity, worst first, each with
its evidence, then one fix per reference, then a one-line summary."""

from __future__ import annotations

import textwrap

from tabulate import tabulate

from preflight import __version__
from preflight.engine import Report
from preflight.model import Finding, Severity, Status
from preflight.text import printable, printable_lines

_EVIDENCE_WIDTH = 72


def _evidence(finding: Finding) -> str:
    if not finding.evidence:
        return finding.reason
    parts = []
    for item in finding.evidence:
        expected = f" (expected {item.expected})" if item.expected else ""
        parts.append(textwrap.fill(f"{item.source}: {item.observed}{expected}", _EVIDENCE_WIDTH))
    return "\n".join(parts)


def _rows(findings: list[Finding]) -> list[list[str]]:
    # Subjects, evidence and reasons come from the node (interface names, environment values,
    # file contents): escape sequences in them are shown, never obeyed by the terminal.
    return [[f.reference_id, f.symbol, printable_lines(f.subject), printable_lines(_evidence(f))] for f in findings]


def _summary(report: Report) -> str:
    present = [f for f in report.findings if f.status is Status.PRESENT]
    by_severity = [
        f"{sum(1 for f in present if f.severity is severity)} {severity.value}"
        for severity in Severity
        if any(f.severity is severity for f in present)
    ]
    counts = {status: sum(1 for f in report.findings if f.status is status) for status in Status}
    text = f"{counts[Status.PRESENT]} present"
    if by_severity:
        text += f" ({', '.join(by_severity)})"
    return (
        f"{text}, {counts[Status.UNKNOWN]} unknown, {counts[Status.ABSENT]} absent, "
        f"{counts[Status.NOT_APPLICABLE]} not applicable."
    )


def render(report: Report, show_all: bool) -> str:
    header = (
        f"preflight {__version__} · host {printable(report.hostname)} · profile {report.profile} · "
        f"root {printable(report.root)} · {len({f.reference_id for f in report.findings})} checks in {report.duration_s:.2f} s"
    )
    sections = [header]
    headers = ["ID", "Symbol", "Subject", "Evidence"]
    present = [f for f in report.findings if f.status is Status.PRESENT]
    for severity in Severity:
        group = [f for f in present if f.severity is severity]
        if group:
            sections.append(f"\n{severity.value.upper()}\n" + tabulate(_rows(group), headers=headers))
    unknown = [f for f in report.findings if f.status is Status.UNKNOWN]
    if unknown:
        sections.append("\nUNKNOWN (could not decide)\n" + tabulate(_rows(unknown), headers=headers))
    if show_all:
        for status, title in ((Status.ABSENT, "ABSENT"), (Status.NOT_APPLICABLE, "NOT APPLICABLE")):
            group = [f for f in report.findings if f.status is status]
            if group:
                rows = [[f.reference_id, f.symbol, printable_lines(f.subject), printable_lines(f.reason)] for f in group]
                sections.append(f"\n{title}\n" + tabulate(rows, headers=headers))
    if present:
        fixes = ["\nHOW TO FIX"]
        seen: set[tuple[str, str]] = set()
        for finding in present:
            key = (finding.reference_id, finding.fix)
            if key in seen:
                continue
            seen.add(key)
            fixes.append(f"{finding.reference_id} {finding.symbol} ({finding.title})")
            fixes.append(textwrap.indent(textwrap.fill(finding.fix, 96), "    "))
        sections.append("\n".join(fixes))
    failed = [p for p in report.probes if p.status != "ok"]
    if failed:
        sections.append("\nPROBES THAT DID NOT FINISH\n" + "\n".join(f"  {p.name}: {printable(p.error or p.status)}" for p in failed))
    sections.append("\n" + _summary(report))
    return "\n".join(sections) + "\n"
