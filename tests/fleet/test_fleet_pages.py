"""``preflight fleet --format markdown|html`` on hand-built report sets: the matrix of nodes x
references grouped by hardware class, the odd-one-out table, and the escaping of everything a
report brings (a hostile host name cannot get past the loader, so hostile text comes in through
evidence, reasons, titles, fact values and file names)."""

from __future__ import annotations

import re
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

from conftest import Runner
from preflight.exitcodes import ExitCode
from preflight.fleet import audit
from preflight.fleet.pages import markdown_cell, render_html, render_markdown
from test_fleet import finding, report, set_mtu, write_all

HOSTILE = '<script>alert("x")</script> | a\nb & c\'d'
VOID = {"meta", "br", "hr", "img", "input", "link"}


class Page(HTMLParser):
    """Collects tags, attributes and text, and checks that elements nest properly."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.stack: list[str] = []
        self.errors: list[str] = []
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))
        if tag not in VOID:
            self.stack.append(tag)

    def handle_endtag(self, tag: str) -> None:
        if not self.stack or self.stack.pop() != tag:
            self.errors.append(f"unexpected </{tag}>")

    def handle_data(self, data: str) -> None:
        self.text.append(data)


def parse(page: str) -> Page:
    parser = Page()
    parser.feed(page)
    parser.close()
    assert parser.errors == [] and parser.stack == []
    return parser


def hostile_fleet(tmp_path: Path) -> Any:
    evidence = [{"source": "/proc/1/limits", "observed": HOSTILE, "expected": "unlimited|x"}]
    documents = [
        report("gpu001", [finding("MEM001", subject="slurmd", evidence=evidence)]),
        report("gpu002", [finding("DNS001", status="unknown", reason=HOSTILE)]),
        report("gpu003", [finding("NCCL002", severity="warning", title=HOSTILE)]),
        report("gpu004"),
        report("gpu005", [finding("MEM001", severity="critical", subject="job")]),
    ]
    documents[3]["facts"]["gpus"]["driver_version"] = HOSTILE
    directory = write_all(tmp_path / "r", documents)
    (directory / "evil<script>|.json").write_text("{")
    return audit([str(directory)])


def test_the_html_page_is_one_well_formed_document_with_nothing_fetched(tmp_path: Path) -> None:
    page = render_html(hostile_fleet(tmp_path))
    parsed = parse(page)
    assert page.startswith("<!DOCTYPE html>")
    assert "http://" not in page and "https://" not in page and "src=" not in page.lower()
    assert not [tag for tag, _ in parsed.tags if tag in ("script", "link", "img", "iframe", "object")]
    # The hostile text is there, as text: escaped in the source, intact once parsed.
    assert "<script>alert" not in page and "&lt;script&gt;alert(&quot;x&quot;)" in page
    titles = [attrs.get("title") or "" for _, attrs in parsed.tags]
    assert any('<script>alert("x")</script> | a\\nb & c\'d' in title for title in titles)  # evidence, newline shown as \n
    assert any('<script>alert("x")' in text for text in parsed.text)  # the odd driver value


def test_the_html_matrix_groups_nodes_by_class_and_colours_cells_by_worst_status(tmp_path: Path) -> None:
    parsed = parse(render_html(hostile_fleet(tmp_path)))
    header = [attrs for tag, attrs in parsed.tags if tag == "th" and attrs.get("title")]
    assert len(header) == 3  # DNS001, MEM001, NCCL002: the references with a present or unknown finding
    cells = [(attrs.get("class"), attrs.get("title")) for tag, attrs in parsed.tags if tag == "td" and "c" in (attrs.get("class") or "").split()]
    assert len(cells) == 5 * 3  # every node, every column
    kinds = [cls.split()[1] if cls and len(cls.split()) > 1 else "" for cls, _ in cells]
    # Rows gpu001..gpu005 (one class), columns DNS001, MEM001, NCCL002.
    assert kinds == ["", "error", "", "unknown", "", "", "", "", "warning", "", "", "", "", "critical", ""]
    assert "class" in [attrs.get("class") for tag, attrs in parsed.tags if tag == "tr"]
    text = "".join(parsed.text)
    assert "8x NVIDIA H100 80GB HBM3 / MT4129 (5 nodes)" in text
    assert "Odd one out" in text and "NVIDIA driver" in text and "gpu004" in text


def test_markdown_tables_escape_pipes_newlines_and_html(tmp_path: Path) -> None:
    text = render_markdown(hostile_fleet(tmp_path))
    assert "<script>" not in text and "\\<script\\>" in text
    # Every unescaped pipe is a column separator: all rows of a table have as many (a newline in a
    # cell would also break its row in two, with fewer).
    tables = re.findall(r"((?:^\|.*\n)+)", text, flags=re.M)
    assert len(tables) == 5
    for table in tables:
        counts = {len(re.findall(r"(?<!\\)\|", row)) for row in table.splitlines()}
        assert len(counts) == 1, table
    assert "## Odd one out" in text and "## Findings per node" in text and "## Skipped files" in text
    assert "evil\\<script\\>\\|.json" in text
    assert "| gpu001 |   | E error on slurmd<br>" in text  # MEM001 on gpu001, DNS001 empty


def test_markdown_cell_is_one_line_of_literal_text() -> None:
    assert markdown_cell("a|b\nc\r\nd") == "a\\|b<br>c<br>d"
    assert markdown_cell("[x](javascript:y) *b* `c` <i>") == "\\[x\\](javascript:y) \\*b\\* \\`c\\` \\<i\\>"
    assert markdown_cell("") == " "


def test_a_clean_fleet_page_has_no_matrix_and_says_so_in_the_summary(tmp_path: Path) -> None:
    fleet = audit([str(write_all(tmp_path / "r", [report("a1"), report("a2")]))])
    page = render_html(fleet)
    parse(page)
    assert 'class="matrix"' not in page and "0 disagreements" in page and "exit code 0" in page
    assert "Findings per node" not in render_markdown(fleet)


def test_cli_writes_html_and_markdown(run_cli: Runner, tmp_path: Path) -> None:
    documents = [report(f"gpu00{i}") for i in range(1, 5)]
    set_mtu(documents[2], "ibp26s0", 2044)
    directory = write_all(tmp_path / "r", documents)
    output = tmp_path / "fleet.html"
    result = run_cli("fleet", "--format", "html", "--output", str(output), str(directory))
    assert result.returncode == ExitCode.ERROR, result.stderr
    parse(output.read_text())
    assert "MTU of RDMA netdevs" in output.read_text()
    markdown = run_cli("fleet", "--format", "markdown", str(directory))
    assert markdown.returncode == ExitCode.ERROR and "| MTU of RDMA netdevs |" in markdown.stdout
