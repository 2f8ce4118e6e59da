"""JUnit XML: one testcase per reference; present is a failure, unknown an error, not
applicable skipped, so CI dashboards show node readiness like a test run."""

from __future__ import annotations

from xml.etree import ElementTree

from preflight.engine import Report
from preflight.model import Finding, Status
from preflight.text import printable, printable_lines


def _details(findings: list[Finding]) -> str:
    lines = []
    for finding in findings:
        lines.append(f"[{finding.status.value}] {finding.subject}: {finding.reason}".rstrip(": "))
        for item in finding.evidence:
            expected = f" (expected {item.expected})" if item.expected else ""
            lines.append(f"  {item.source}: {item.observed}{expected}")
        if finding.fix and finding.status is Status.PRESENT:
            lines.append(f"  fix: {finding.fix}")
    return "\n".join(lines)


def render(report: Report, show_all: bool) -> str:
    grouped: dict[str, list[Finding]] = {}
    for finding in report.findings:
        grouped.setdefault(finding.reference_id, []).append(finding)
    suite = ElementTree.Element(
        "testsuite",
        name=f"preflight {report.hostname}",
        tests=str(len(grouped)),
        time=f"{report.duration_s:.3f}",
    )
    counts = {"failures": 0, "errors": 0, "skipped": 0}
    for ref_id in sorted(grouped):
        findings = grouped[ref_id]
        first = findings[0]
        case = ElementTree.SubElement(
            suite, "testcase", classname=f"preflight.{first.symbol}", name=f"{ref_id} {first.title}"
        )
        statuses = {finding.status for finding in findings}
        if Status.PRESENT in statuses:
            counts["failures"] += 1
            present = [f for f in findings if f.status is Status.PRESENT]
            failure = ElementTree.SubElement(case, "failure", type=first.severity.value, message=f"{ref_id} present on {len(present)} subject(s)")
            failure.text = _details(present)
        elif Status.UNKNOWN in statuses:
            counts["errors"] += 1
            error = ElementTree.SubElement(case, "error", type="unknown", message="; ".join(f.reason for f in findings)[:500])
            error.text = _details(findings)
        elif statuses == {Status.NOT_APPLICABLE}:
            counts["skipped"] += 1
            ElementTree.SubElement(case, "skipped", message=first.reason or "not applicable")
    for key, value in counts.items():
        suite.set(key, str(value))
    # Node data may hold escape sequences and characters XML cannot carry: shown as escapes.
    for element in suite.iter():
        if element.text:
            element.text = printable_lines(element.text)
        for name, attribute in element.attrib.items():
            element.set(name, printable(attribute))
    return ElementTree.tostring(suite, encoding="unicode", xml_declaration=True) + "\n"
