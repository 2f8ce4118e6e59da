"""The table a person reads at a glance: findings grouped by severity, worst first, each with
its evidence, then one fix per reference, then a one-line summary. Everything fits the terminal's
width (``COLUMNS``, else the terminal, else 80 columns): free-text columns are wrapped."""

from __future__ import annotations

import shutil
import textwrap

from tabulate import tabulate

from preflight import __version__
from preflight.engine import Report
from preflight.model import Finding, Severity, Status
from preflight.text import printable, printable_lines

_EVIDENCE_WIDTH = 72  # on a wide terminal too: longer lines are hard to read
_FIX_WIDTH = 96
_GAP = 2  # tabulate's "simple" format puts two spaces between columns
_NARROWEST = 10  # a wrapped column is never narrower, however narrow the terminal
_HEADERS = ["ID", "Symbol", "Subject", "Evidence"]
# Symbol, Subject and Evidence (or reason) columns wrap; evidence gets twice the others' share.
_FINDING_WRAP = {1: 1, 2: 1, 3: 2}


def terminal_width() -> int:
    """``COLUMNS``, else the width of the terminal on stdout, else 80 (output into a pipe)."""
    return shutil.get_terminal_size().columns


def _shares(room: int, natural: dict[int, int], weights: dict[int, int]) -> dict[int, int]:
    """Widths for the wrapped columns: a column narrower than its weighted share of ``room`` keeps
    its natural width and leaves the rest to the others (water-filling)."""
    widths: dict[int, int] = {}
    pending = dict(natural)
    while pending:
        unit = room / sum(weights[column] for column in pending)
        fitting = {column: width for column, width in pending.items() if width <= unit * weights[column]}
        if not fitting:
            floored = {column: max(_NARROWEST, int(unit * weights[column])) for column in pending}
            # A column floored at the narrowest width took room its share did not have: the
            # widest others give it back, so the table keeps to the page (a re-wrapped table line
            # falls apart).
            excess = sum(floored.values()) - max(room, 0)
            while excess > 0:
                widest = max(floored, key=floored.__getitem__)
                if floored[widest] <= _NARROWEST:
                    break
                floored[widest] -= 1
                excess -= 1
            widths.update(floored)
            break
        for column, width in fitting.items():
            widths[column] = width
            room -= width
            del pending[column]
    return widths


def _wrap(cell: str, width: int) -> str:
    # Never at a hyphen: versions, host lists and paths stay whole where a space allows it.
    lines = [part for line in cell.split("\n") for part in (textwrap.wrap(line, width, break_on_hyphens=False) or [""])]
    return "\n".join(lines)


def fit_table(
    rows: list[list[str]], headers: list[str], wrap: dict[int, int], widest: dict[int, int] | None = None, width: int | None = None
) -> str:
    """A tabulate table whose columns ``wrap`` (index -> weight) are wrapped so that its lines fit
    ``width`` (default: :func:`terminal_width`); ``widest`` caps a column even when there is room."""
    width = terminal_width() if width is None else width
    # tabulate pads a header by two: a column is never narrower than that.
    natural = [
        max(len(header) + 2, *(len(line) for row in rows for line in row[index].split("\n"))) for index, header in enumerate(headers)
    ]
    natural = [min(size, (widest or {}).get(index, size)) for index, size in enumerate(natural)]
    fixed = sum(size for index, size in enumerate(natural) if index not in wrap) + _GAP * (len(headers) - 1)
    widths = _shares(width - fixed, {index: natural[index] for index in wrap}, wrap)
    fitted = [[_wrap(cell, widths[index]) if index in widths else cell for index, cell in enumerate(row)] for row in rows]
    return tabulate(fitted, headers=headers)


def _evidence(finding: Finding) -> str:
    """What was read, and for an undecided finding why it stays so (its reason, first: the
    evidence alone reads like a verdict)."""
    shown = [f"{item.source}: {item.observed}" + (f" (expected {item.expected})" if item.expected else "") for item in finding.evidence]
    if finding.reason and (finding.status is not Status.PRESENT or not shown):
        shown.insert(0, finding.reason)
    return "\n".join(shown)


def _table(rows: list[list[str]], width: int) -> str:
    # Subjects, evidence and reasons come from the node (interface names, environment values,
    # file contents): escape sequences in them are shown, never obeyed by the terminal.
    shown = [[printable_lines(cell) for cell in row] for row in rows]
    return fit_table(shown, _HEADERS, _FINDING_WRAP, {3: _EVIDENCE_WIDTH}, width)


def _rows(findings: list[Finding]) -> list[list[str]]:
    return [[f.reference_id, f.symbol, f.subject, _evidence(f)] for f in findings]


# A check with findings of several statuses counts once, under the first of these it has.
_CHECK_STATUS_ORDER = (Status.PRESENT, Status.UNKNOWN, Status.ABSENT, Status.NOT_APPLICABLE)


def _count(number: int, noun: str) -> str:
    """``1 check``, ``2 checks``."""
    return f"{number} {noun}{'' if number == 1 else 's'}"


def _summary(report: Report) -> str:
    """Checks by status (they add up to the header's count), and the present findings by severity:
    one check can find a problem on several subjects."""
    statuses: dict[str, set[Status]] = {}
    for finding in report.findings:
        statuses.setdefault(finding.reference_id, set()).add(finding.status)
    checks = {status: 0 for status in _CHECK_STATUS_ORDER}
    for found in statuses.values():
        checks[next(status for status in _CHECK_STATUS_ORDER if status in found)] += 1
    present = [f for f in report.findings if f.status is Status.PRESENT]
    text = f"{_count(len(statuses), 'check')}: {checks[Status.PRESENT]} present"
    if present:
        by_severity = [f"{sum(1 for f in present if f.severity is s)} {s.value}" for s in Severity if any(f.severity is s for f in present)]
        text += f" ({_count(len(present), 'finding')}: {', '.join(by_severity)})"
    return (
        f"{text}, {checks[Status.UNKNOWN]} unknown, {checks[Status.ABSENT]} absent, "
        f"{checks[Status.NOT_APPLICABLE]} not applicable."
    )


def _fill(text: str, width: int, indent: str = "") -> str:
    """Prose wrapped at spaces only: paths and commands stay whole (a longer one overflows)."""
    return textwrap.fill(text, width, initial_indent=indent, subsequent_indent=indent, break_long_words=False, break_on_hyphens=False)


def _join_fitting(parts: list[str], width: int, separator: str = " · ") -> str:
    """``parts`` joined by ``separator``, a new line where the next part would pass ``width``:
    each part (``root /path``) stays whole on one line."""
    lines = [parts[0]]
    for part in parts[1:]:
        if len(lines[-1]) + len(separator) + len(part) <= width:
            lines[-1] += separator + part
        else:
            lines[-1] += separator.rstrip()
            lines.append(part)
    return "\n".join(lines)


def render(report: Report, show_all: bool) -> str:
    width = terminal_width()
    header = [
        f"preflight {__version__}", f"host {printable(report.hostname)}", f"profile {report.profile}", f"root {printable(report.root)}",
        f"{_count(len({f.reference_id for f in report.findings}), 'check')} in {report.duration_s:.2f} s",
    ]
    sections = [_join_fitting(header, width)]
    present = [f for f in report.findings if f.status is Status.PRESENT]
    for severity in Severity:
        group = [f for f in present if f.severity is severity]
        if group:
            sections.append(f"\n{severity.value.upper()}\n" + _table(_rows(group), width))
    unknown = [f for f in report.findings if f.status is Status.UNKNOWN]
    if unknown:
        sections.append("\nUNKNOWN (could not decide)\n" + _table(_rows(unknown), width))
    if show_all:
        for status, title in ((Status.ABSENT, "ABSENT"), (Status.NOT_APPLICABLE, "NOT APPLICABLE")):
            group = [f for f in report.findings if f.status is status]
            if group:
                rows = [[f.reference_id, f.symbol, f.subject, f.reason] for f in group]
                sections.append(f"\n{title}\n" + _table(rows, width))
    if present:
        fixes = ["\nHOW TO FIX"]
        seen: set[tuple[str, str]] = set()
        for finding in present:
            key = (finding.reference_id, finding.fix)
            if key in seen:
                continue
            seen.add(key)
            fixes.append(_fill(f"{finding.reference_id} {finding.symbol} ({finding.title})", width))
            fixes.append(_fill(finding.fix, min(_FIX_WIDTH + 4, width), "    "))
        sections.append("\n".join(fixes))
    failed = [p for p in report.probes if p.status != "ok"]
    if failed:
        lines = [_fill(f"{p.name}: {printable(p.error or p.status)}", width, "  ") for p in failed]
        sections.append("\nPROBES THAT DID NOT FINISH\n" + "\n".join(lines))
    sections.append("\n" + _fill(_summary(report), width))
    return "\n".join(sections) + "\n"
