"""Fleet reports for people (table; Markdown and HTML in :mod:`preflight.fleet.pages`) and
machines (JSON, schema ``preflight-fleet/1`` in ``preflight/schemas/fleet-v1.schema.json``).

Everything shown comes from untrusted reports: the table escapes characters a terminal would
act on (escape sequences, carriage returns) and shortens long cells; JSON escapes them itself.
"""

from __future__ import annotations

import dataclasses
import json
import textwrap
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import msgspec

from preflight import __version__
from preflight.fleet import shape
from preflight.fleet.compare import DISAGREEMENTS, SAME, TIE, Comparison, Fleet, FleetFinding, fleet_exit_code
from preflight.hostlist import number_runs
from preflight.text import printable as _printable

FLEET_SCHEMA = "preflight-fleet/1"
_HOSTS_SHOWN = 120  # characters of a host list in a table cell


def printable(value: str, limit: int = 200) -> str:
    """:func:`preflight.text.printable` with the fleet pages' default length."""
    return _printable(value, limit)


def compress_hosts(hosts: Iterable[str]) -> str:
    """``gpu001 gpu002 gpu003 gpu007 login`` -> ``gpu[001-003,007],login`` (Slurm hostlist); fully
    qualified names fold on their short name's number: ``gpu[01-02].dc1.example``."""
    runs: dict[tuple[str, int, str], list[int]] = {}
    plain: list[str] = []
    for host in sorted(set(hosts)):
        short, dot, domain = host.partition(".")
        prefix = short.rstrip("0123456789")  # linear, whatever a report names its host
        digits = short[len(prefix):]
        if digits:
            runs.setdefault((prefix, len(digits), dot + domain), []).append(int(digits))
        else:
            plain.append(host)
    items = list(plain)
    for (prefix, width, suffix), numbers in runs.items():
        numbers.sort()
        ranges = [f"{start:0{width}d}" if start == end else f"{start:0{width}d}-{end:0{width}d}" for start, end in number_runs(numbers)]
        single = len(numbers) == 1
        items.append(f"{prefix}{numbers[0]:0{width}d}{suffix}" if single else f"{prefix}[{','.join(ranges)}]{suffix}")
    return ",".join(sorted(items))


def _hosts_cell(hosts: Sequence[str]) -> str:
    text = compress_hosts(hosts)
    return text if len(text) <= _HOSTS_SHOWN else f"{text[:_HOSTS_SHOWN - 20]}... ({len(hosts)} nodes)"


# -- JSON ------------------------------------------------------------------------------------------

def _plain(value: Any) -> Any:
    """The JSON object of a dataclass :func:`fleet_json` leaves in place (``json.dumps``'s
    ``default``; msgspec writes dataclasses itself, with the same fields in the same order)."""
    if isinstance(value, msgspec.Struct):
        return {field: getattr(value, field) for field in value.__struct_fields__}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {field.name: getattr(value, field.name) for field in dataclasses.fields(value)}
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def _comparison_json(comparison: Comparison) -> dict[str, Any]:
    return {
        "fact": comparison.fact.key,
        "label": comparison.fact.label,
        "scope": comparison.fact.scope,
        "group": comparison.group,
        "verdict": comparison.verdict,
        "common": comparison.common,
        "values": list(comparison.values),  # ValueGroup: {"value", "hosts"}
        "odd": list(comparison.odd),
        "unknown": list(comparison.unknown),
        "expectations": [
            {"host": e.host, "reference": e.reference_id, "observed": e.observed, "expected": e.expected}
            for e in comparison.expectations
        ],
    }


def _finding_json(finding: FleetFinding) -> dict[str, Any]:
    return {
        "id": finding.id,
        "symbol": finding.symbol,
        "title": finding.title,
        "severity": finding.severity,
        "status": finding.status,
        "fact": finding.fact,
        "scope": finding.scope,
        "group": finding.group,
        "majority": finding.majority,
        "tie": finding.tie,
        "nodes": list(finding.nodes),
        "unknown_nodes": list(finding.unknown_nodes),
        "evidence": [{"host": e.host, "source": e.source, "observed": e.observed, "expected": e.expected} for e in finding.evidence],
        "reason": finding.reason,
    }


def fleet_json(fleet: Fleet) -> dict[str, Any]:
    """The fleet report as JSON values, except that node mentions and value groups stay
    dataclasses (tens of thousands of them at fleet scale): serialize with :func:`dumps`."""
    return {
        "schema": FLEET_SCHEMA,
        "tool": {"name": "preflight", "version": __version__},
        "summary": {
            "nodes": len(fleet.nodes),
            "classes": len(fleet.classes),
            "skipped": len(fleet.skipped),
            "disagreements": len(fleet.disagreements),
            "odd_nodes": sorted({host for c in fleet.disagreements for host in c.odd}),
            "nodes_with_present": sorted({m.host for row in fleet.references for m in row.present}),
            "fleet_findings_present": sum(1 for f in fleet.findings if f.status == "present"),
            "exit_code": int(fleet_exit_code(fleet)),
        },
        "facts": [{"key": fact.key, "label": fact.label, "scope": fact.scope} for fact in fleet.facts],
        "classes": [
            {
                "label": group.hardware.label,
                "gpu_model": group.hardware.gpu_model,
                "gpu_count": group.hardware.gpu_count,
                "nic_model": group.hardware.nic_model,
                "hosts": list(group.hosts),
            }
            for group in fleet.classes
        ],
        "nodes": [
            {
                "name": node.name,
                "host": node.host,
                "file": node.file,
                "profile": node.profile,
                "tool_version": node.tool_version,
                "class": node.hardware.label,
                "findings": dict(node.counts),
                "failed_probes": dict(node.failed_probes),
            }
            for node in fleet.nodes
        ],
        "references": [
            {
                "id": row.id,
                "symbol": row.symbol,
                "title": row.title,
                "worst_severity": row.worst.value if row.worst else None,
                "present": row.present,  # NodeMention: {"host", "severity", "subjects", "detail"}
                "unknown": row.unknown,
            }
            for row in fleet.references
        ],
        "comparisons": [_comparison_json(c) for c in fleet.comparisons],
        "findings": [_finding_json(f) for f in fleet.findings],
        "skipped": [{"file": s.file, "reason": s.reason} for s in fleet.skipped],
    }


_FAST_DUMPS: Callable[[Any], bytes] | None = shape.encode  # tests take it away: the fallback must agree


def dumps(value: Any) -> str:
    """Compact JSON of ``value`` (from :func:`fleet_json`). msgspec writes the 20 MB of a
    10,000-node report several times faster than the standard encoder; a string it refuses (a
    lone surrogate, which the standard parser lets a report carry) goes to the standard one."""
    if _FAST_DUMPS is not None:
        try:
            return _FAST_DUMPS(value).decode("utf-8")
        except (TypeError, ValueError):  # a lone surrogate, which the standard encoder escapes
            pass
    return json.dumps(value, default=_plain, separators=(",", ":"))


def render_json(fleet: Fleet) -> str:
    """One top-level field a line, and one item of each list a line: readable and diffable
    without the cost of indenting every nested value."""
    fields = []
    for key, value in fleet_json(fleet).items():
        if isinstance(value, (list, tuple)) and value:
            items = ",\n    ".join(map(dumps, value))
            fields.append(f"  {json.dumps(key)}: [\n    {items}\n  ]")
        else:
            fields.append(f"  {json.dumps(key)}: {dumps(value)}")
    return "{\n" + ",\n".join(fields) + "\n}\n"


# -- table -----------------------------------------------------------------------------------------

def _odd_rows(comparisons: Sequence[Comparison]) -> list[list[str]]:
    rows = []
    for c in comparisons:
        if c.verdict == TIE:
            split = "; ".join(f"{printable(g.value, 60)}: {_hosts_cell(g.hosts)}" for g in c.values)
            rows.append([c.fact.label, printable(c.group, 60), "(tie: no majority)", split, ""])
            continue
        majority = f"{printable(c.common or '', 60)} ({len(c.values[0].hosts)} nodes)"
        for group in c.values[1:]:
            rows.append([c.fact.label, printable(c.group, 60), _hosts_cell(group.hosts), printable(group.value, 60), majority])
    return rows


def _reference_rows(fleet: Fleet) -> list[list[str]]:
    rows = []
    for row in fleet.references:
        present = _hosts_cell([m.host for m in row.present]) if row.present else ""
        unknown = _hosts_cell([m.host for m in row.unknown]) if row.unknown else ""
        worst = row.worst.value if row.worst else ""
        rows.append([row.id, row.symbol, worst, present, unknown])
    return rows


def _finding_rows(findings: Sequence[FleetFinding]) -> list[list[str]]:
    rows = []
    for f in findings:
        if f.status == "present":
            seen = "; ".join(f"{printable(e.host)}: {printable(e.observed, 60)}" for e in f.evidence[:10])
            more = f" (and {len(f.evidence) - 10} more)" if len(f.evidence) > 10 else ""
            expected = "(tie: no majority)" if f.tie else printable(f.majority or "", 60)
            rows.append([f.id, f.severity, f.status, printable(f.group, 60), seen + more, expected])
        elif f.status == "unknown":
            rows.append([f.id, f.severity, f.status, printable(f.group, 60), printable(f.reason, 200), ""])
    return rows


def mixed_runs(fleet: Fleet) -> str:
    """``profiles: full 4, prolog 1 · preflight versions: ...``: the profiles and preflight
    versions of the reports when they differ, "" when every report shares them. A node whose report
    ran the prolog profile shows no finding for a check only the full profile runs, which is not
    "found nothing"."""
    parts = []
    for label, values in (("profiles", [n.profile for n in fleet.nodes]), ("preflight versions", [n.tool_version for n in fleet.nodes])):
        counts: dict[str, int] = {}
        for value in values:
            counts[value] = counts.get(value, 0) + 1
        if len(counts) > 1:
            shown = sorted(counts.items(), key=lambda item: (-item[1], item[0]))[:MIXED_SHOWN]
            more = f", {len(counts) - MIXED_SHOWN} more" if len(counts) > MIXED_SHOWN else ""
            parts.append(f"{label}: " + ", ".join(f"{printable(value or '?', 40)} {count}" for value, count in shown) + more)
    return " · ".join(parts)


MIXED_SHOWN = 4  # distinct profiles or versions named in the summary line


def render_table(fleet: Fleet, width: int | None = None) -> str:
    """The fleet as text tables that fit ``width`` columns (default: the terminal's, as node
    tables do): long values wrap inside their column instead of running past the edge."""
    from preflight.reporters.table import fit_table

    disagreements = fleet.disagreements
    sections = [
        f"preflight {__version__} fleet · {len(fleet.nodes)} nodes · {len(fleet.classes)} hardware "
        f"{'class' if len(fleet.classes) == 1 else 'classes'} · {len(fleet.skipped)} files skipped"
        + (f"\nmixed runs, compare with care: {mixed}" if (mixed := mixed_runs(fleet)) else "")
    ]
    if fleet.classes:
        rows = [[str(len(g.hosts)), printable(g.hardware.label, 80), _hosts_cell(g.hosts)] for g in fleet.classes]
        sections.append("\nHARDWARE CLASSES (nodes are compared within their class)\n" + fit_table(rows, ["Nodes", "Class", "Hosts"], {1: 1, 2: 1}, width=width))
    if disagreements:
        headers = ["Fact", "Class", "Odd nodes", "Their value", "Most nodes have"]
        sections.append(
            "\nODD ONE OUT\n" + fit_table(_odd_rows(disagreements), headers, {1: 1, 2: 2, 3: 3, 4: 3}, {1: 40, 2: 40, 3: 40, 4: 40}, width)
        )
    shown = [f for f in fleet.findings if f.status in ("present", "unknown")]
    if shown:
        headers = ["ID", "Severity", "Status", "Class", "Nodes: their value", "Most nodes have"]
        sections.append(
            "\nFLEET FINDINGS (references decided by nodes disagreeing)\n"
            + fit_table(_finding_rows(shown), headers, {3: 1, 4: 3, 5: 2}, {3: 40, 4: 60, 5: 40}, width)
        )
    expectations = [e for c in fleet.comparisons for e in c.expectations]
    if expectations:
        rows = [[printable(e.host), e.reference_id, printable(e.observed, 60), printable(e.expected, 60)] for e in expectations]
        sections.append(
            "\nEXPECTED VS ACTUAL (site expectations, from the nodes' findings)\n"
            + fit_table(rows, ["Host", "ID", "Observed", "Expected"], {2: 1, 3: 1}, width=width)
        )
    if fleet.references:
        headers = ["ID", "Symbol", "Worst", "Present on", "Unknown on"]
        sections.append(
            "\nREFERENCES PRESENT OR UNKNOWN\n" + fit_table(_reference_rows(fleet), headers, {3: 1, 4: 1}, {3: 50, 4: 50}, width)
        )
    failed = sorted({(name, node.name) for node in fleet.nodes for name in node.failed_probes})
    if failed:
        by_probe: dict[str, list[str]] = {}
        for name, host in failed:
            by_probe.setdefault(name, []).append(host)
        sections.append("\nPROBES THAT GAVE NO FACTS (their facts count as unknown)\n" + "\n".join(
            f"  {printable(name, 60)}: {_hosts_cell(hosts)}" for name, hosts in sorted(by_probe.items())
        ))
    renamed = [node for node in fleet.nodes if node.name != node.host]
    if renamed:
        sections.append("\nNODE NAMES (the report file's name, then the host name the report gives)\n" + "\n".join(
            f"  {node.name}: {node.host}" for node in renamed  # both match HOST_NAME: nothing to escape
        ))
    if fleet.skipped:
        sections.append("\nSKIPPED FILES\n" + "\n".join(f"  {printable(s.file, 120)}: {printable(s.reason, 200)}" for s in fleet.skipped))
    agree = sum(1 for c in fleet.comparisons if c.verdict == SAME)
    compared = sum(1 for c in fleet.comparisons if c.verdict == SAME or c.verdict in DISAGREEMENTS)
    nodes_with_present = {m.host for row in fleet.references for m in row.present}
    sections.append(
        f"\n{agree} of {compared} comparisons agree, {len(disagreements)} disagree; "
        f"{len(nodes_with_present)} of {len(fleet.nodes)} nodes have present findings; "
        f"{sum(1 for f in fleet.findings if f.status == 'present')} fleet findings present. "
        f"Exit code {int(fleet_exit_code(fleet))}."
    )
    return _fit_lines("\n".join(sections), width) + "\n"


def _fit_lines(text: str, width: int | None) -> str:
    """Wrap the plain lines (headings, lists, the summary) that are wider than the terminal; the
    tables already fit. A wrapped line continues indented under its own start."""
    from preflight.reporters.table import terminal_width

    limit = terminal_width() if width is None else width
    out = []
    for line in text.split("\n"):
        if len(line) <= limit:
            out.append(line)
            continue
        indent = " " * (len(line) - len(line.lstrip(" ")))
        out.extend(textwrap.wrap(line, limit, initial_indent="", subsequent_indent=indent + "    ", break_on_hyphens=False, break_long_words=False) or [line])
    return "\n".join(out)
