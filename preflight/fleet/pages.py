"""Fleet reports as documents for people: Markdown (GitHub-flavoured tables) and one static HTML
page (inline CSS, no script, nothing fetched), both built from the same content.

The centre of both is the matrix: one row per node, grouped by hardware class, one column per
reference that is present or unknown on some node, each cell showing the node's worst status for
that reference (coloured by severity in HTML) with the evidence behind it (a ``title`` tooltip in
HTML, the cell text in Markdown). Then the odd-one-out table, the hardware classes and the
skipped files.

Every string shown comes from untrusted reports (host names are checked, but evidence, values and
file names are free text): it goes through :func:`printable` (no control characters, bounded
length) and then through the format's escaping, :func:`html.escape` or :func:`markdown_cell`.
"""

from __future__ import annotations

import html
from collections.abc import Sequence

from msgspec import Struct

from preflight import __version__
from preflight.fleet.compare import TIE, Comparison, Fleet, NodeMention, fleet_exit_code
from preflight.fleet.render import compress_hosts, mixed_runs, printable

#: Cell kinds, worst first: a present finding's severity, or "unknown".
KINDS = ("critical", "error", "warning", "info", "unknown")
_SHORT = {"critical": "C", "error": "E", "warning": "W", "info": "I", "unknown": "?"}
_HOSTS_SHOWN = 300  # characters of a host list in a cell


class Cell(Struct, frozen=True):
    kind: str  # one of KINDS
    detail: str  # subjects and evidence (present) or reasons (unknown), one per line


class OddRow(Struct, frozen=True):
    fact: str
    group: str
    hosts: str
    value: str
    majority: str


def _cell(present: NodeMention | None, unknown: NodeMention | None) -> Cell | None:
    if present is None and unknown is None:
        return None
    lines = []
    if present is not None:
        lines.append(f"{present.severity} on {', '.join(present.subjects)}")
        lines.extend(present.detail)
    if unknown is not None:
        lines.append(f"unknown on {', '.join(unknown.subjects)}")
        lines.extend(unknown.detail)
    kind = present.severity if present is not None else "unknown"
    return Cell(kind, "\n".join(printable(line, 300) for line in lines))


def matrix(fleet: Fleet) -> list[tuple[str, list[tuple[str, list[Cell | None]]]]]:
    """(class label, [(host, one cell per reference of ``fleet.references``)]) per class."""
    present = [{m.host: m for m in row.present} for row in fleet.references]
    unknown = [{m.host: m for m in row.unknown} for row in fleet.references]
    return [
        (group.hardware.label, [
            (host, [_cell(p.get(host), u.get(host)) for p, u in zip(present, unknown)]) for host in group.hosts
        ])
        for group in fleet.classes
    ]


def _hosts(hosts: Sequence[str]) -> str:
    text = compress_hosts(hosts)
    return text if len(text) <= _HOSTS_SHOWN else f"{text[:_HOSTS_SHOWN - 20]}... ({len(hosts)} nodes)"


def odd_rows(comparisons: Sequence[Comparison]) -> list[OddRow]:
    rows = []
    for c in comparisons:
        if c.verdict == TIE:
            split = "; ".join(f"{printable(g.value, 100)}: {_hosts(g.hosts)}" for g in c.values)
            rows.append(OddRow(c.fact.label, printable(c.group, 100), "(tie: no majority)", split, ""))
            continue
        majority = f"{printable(c.common or '', 100)} ({len(c.values[0].hosts)} nodes)"
        for group in c.values[1:]:
            rows.append(OddRow(c.fact.label, printable(c.group, 100), _hosts(group.hosts), printable(group.value, 100), majority))
    return rows


_REFERENCE_HEADERS = ("ID", "Symbol", "Title", "Worst", "Present on", "Unknown on")


def _reference_rows(fleet: Fleet) -> list[list[str]]:
    return [[row.id, row.symbol, printable(row.title, 200), row.worst.value if row.worst else "",
             _hosts([m.host for m in row.present]), _hosts([m.host for m in row.unknown])] for row in fleet.references]


def _summary(fleet: Fleet) -> str:
    classes = len(fleet.classes)
    return (f"{len(fleet.nodes)} nodes · {classes} hardware {'class' if classes == 1 else 'classes'} · "
            f"{len(fleet.disagreements)} disagreements · {len(fleet.skipped)} files skipped · "
            f"exit code {int(fleet_exit_code(fleet))}"
            + (f" · mixed runs, compare with care: {mixed}" if (mixed := mixed_runs(fleet)) else ""))


# -- Markdown --------------------------------------------------------------------------------------

#: Characters Markdown would act on inside a table cell; each is shown literally when escaped
#: with a backslash (CommonMark allows that for any ASCII punctuation).
#: The backslash comes first, so that the escapes added for the others are not escaped again.
_MARKDOWN_SPECIAL = "\\`*_[]<>|~&!#"


def markdown_cell(value: str) -> str:
    """``value`` as literal text in a GFM table cell: one line, nothing Markdown or HTML acts on."""
    escaped = value
    for char in _MARKDOWN_SPECIAL:  # str.replace per character: 3x faster than translate()
        if char in escaped:
            escaped = escaped.replace(char, "\\" + char)
    return "<br>".join(line for line in escaped.replace("\r", "\n").split("\n") if line) or " "


def _markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(markdown_cell(h) for h in headers) + " |", "|" + "---|" * len(headers)]
    lines.extend("| " + " | ".join(markdown_cell(cell) for cell in row) + " |" for row in rows)
    return "\n".join(lines)


#: One table of a page: (title, headers, rows); None stands where the findings matrix goes,
#: which each format draws its own way.
Section = tuple[str, Sequence[str], list[list[str]]] | None


def _sections(fleet: Fleet) -> list[Section]:
    """The tables of a fleet page, in order, for both formats."""
    sections: list[Section] = []
    odd = odd_rows(fleet.disagreements)
    if odd:
        sections.append(("Odd one out", ["Fact", "Class", "Odd nodes", "Their value", "Most nodes have"],
                         [[r.fact, r.group, r.hosts, r.value, r.majority] for r in odd]))
    shown = [f for f in fleet.findings if f.status in ("present", "unknown")]
    if shown:
        sections.append(("Fleet findings", ["ID", "Symbol", "Severity", "Status", "Class", "Nodes: their value", "Most nodes have"], [
            [f.id, f.symbol, f.severity, f.status, printable(f.group, 200),
             "; ".join(f"{e.host}: {printable(e.observed, 100)}" for e in f.evidence[:20]) or printable(f.reason, 300),
             "(tie: no majority)" if f.tie else printable(f.majority or "", 100)]
            for f in shown
        ]))
    if fleet.references:
        sections.append(None)
        sections.append(("References", _REFERENCE_HEADERS, _reference_rows(fleet)))
    if fleet.classes:
        sections.append(("Hardware classes", ["Nodes", "Class", "Hosts"],
                         [[str(len(g.hosts)), printable(g.hardware.label, 200), _hosts(g.hosts)] for g in fleet.classes]))
    if fleet.skipped:
        sections.append(("Skipped files", ["File", "Reason"],
                         [[printable(s.file, 200), printable(s.reason, 300)] for s in fleet.skipped]))
    return sections


def _markdown_matrix(fleet: Fleet) -> str:
    headers = ["Node", *(row.id for row in fleet.references)]
    blocks = []
    for label, hosts in matrix(fleet):
        rows = [[host, *(f"{_SHORT[c.kind]} {c.detail}" if c else "" for c in cells)] for host, cells in hosts]
        blocks.append(f"### {markdown_cell(printable(label, 200))}\n\n" + _markdown_table(headers, rows))
    legend = ", ".join(f"{short} {kind}" for kind, short in _SHORT.items())
    return f"## Findings per node\n\nPresent findings by severity ({legend}), with their evidence.\n\n" + "\n\n".join(blocks)


def render_markdown(fleet: Fleet) -> str:
    parts = [f"# preflight fleet\n\npreflight {__version__} · {markdown_cell(_summary(fleet))}"]
    for section in _sections(fleet):
        if section is None:
            parts.append(_markdown_matrix(fleet))
        else:
            title, headers, rows = section
            parts.append(f"## {title}\n\n" + _markdown_table(headers, rows))
    return "\n\n".join(parts) + "\n"


# -- HTML ------------------------------------------------------------------------------------------

_CSS = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 1.5em; color: #111; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; }
th, td { border: 1px solid #ccc; padding: 2px 6px; text-align: left; vertical-align: top; }
th { background: #f3f4f6; }
table.matrix td.c { text-align: center; min-width: 1.6em; cursor: help; }
tr.class th { background: #e5e7eb; text-align: left; }
.critical { background: #7f1d1d; color: #fff; }
.error { background: #dc2626; color: #fff; }
.warning { background: #f59e0b; }
.info { background: #bfdbfe; }
.unknown { background: #d1d5db; }
.legend span { display: inline-block; padding: 0 6px; margin-right: 4px; border: 1px solid #ccc; }
"""


def _e(value: str) -> str:
    return html.escape(value, quote=True)


def _html_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    head = "".join(f"<th>{_e(h)}</th>" for h in headers)
    body = "\n".join("<tr>" + "".join(f"<td>{_e(cell)}</td>" for cell in row) + "</tr>" for row in rows)
    return f"<table>\n<tr>{head}</tr>\n{body}\n</table>"


def _matrix_html(fleet: Fleet) -> str:
    columns = "".join(
        f'<th title="{_e(printable(row.symbol + ": " + row.title, 300))}">{_e(row.id)}</th>' for row in fleet.references
    )
    lines = ['<table class="matrix">', f"<tr><th>Node</th>{columns}</tr>"]
    for label, hosts in matrix(fleet):
        lines.append(f'<tr class="class"><th colspan="{len(fleet.references) + 1}">{_e(printable(label, 200))} '
                     f"({len(hosts)} nodes)</th></tr>")
        for host, cells in hosts:
            shown = "".join(
                f'<td class="c {cell.kind}" title="{_e(cell.detail)}">{_SHORT[cell.kind]}</td>' if cell else '<td class="c"></td>'
                for cell in cells
            )
            lines.append(f"<tr><th>{_e(host)}</th>{shown}</tr>")
    lines.append("</table>")
    return "\n".join(lines)


def render_html(fleet: Fleet) -> str:
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en">',
        '<head><meta charset="utf-8"><title>preflight fleet</title>',
        f"<style>{_CSS}</style></head>",
        "<body>",
        f"<h1>preflight fleet</h1>\n<p>preflight {_e(__version__)} · {_e(_summary(fleet))}</p>",
    ]
    for section in _sections(fleet):
        if section is None:
            legend = "".join(f'<span class="{kind}">{_SHORT[kind]} {kind}</span>' for kind in KINDS)
            parts.append(f'<h2>Findings per node</h2>\n<p class="legend">{legend} · hover a cell for its evidence</p>\n'
                         + _matrix_html(fleet))
        else:
            title, headers, rows = section
            parts.append(f"<h2>{title}</h2>\n" + _html_table(headers, rows))
    parts.append("</body>\n</html>\n")
    return "\n".join(parts)
