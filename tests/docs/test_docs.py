"""The documentation stays true to the code.

- ``docs/checks.md`` is what ``docs/gen_checks_table.py`` writes today, and its rows say what the
  catalogue and the registry say;
- every relative link in README.md and docs/ reaches a file (and a heading, when it names one);
- the README stays short and shows the test command CI runs;
- every ``preflight`` command line in the docs uses commands and options the CLI has;
- the operator guide describes every node check, and the Python examples are valid Python.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path
from types import ModuleType

import pytest

from conftest import REPO, load_script, preflight_command
from preflight.discovery import build_registry
from preflight.tomlcompat import parse_toml

README = REPO / "README.md"
DOCS = REPO / "docs"
README_MAX_LINES = 200


def markdown_files() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


def generator() -> ModuleType:
    """docs/gen_checks_table.py, which is a script and not part of the package."""
    return load_script(DOCS / "gen_checks_table.py")


# ---- Markdown helpers ---------------------------------------------------------------------------

FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.M | re.S)
INLINE_CODE = re.compile(r"`([^`]+)`")
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of every fenced code block."""
    return [(match[1].strip(), match[2]) for match in FENCE.finditer(text)]


def prose(text: str) -> str:
    """``text`` without fenced blocks and inline code, where brackets are not links."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = INLINE_CODE.sub(r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    for line in FENCE.sub("", path.read_text(encoding="utf-8")).splitlines():
        match = re.match(r"#{1,6} +(.*?) *#*$", line)
        if match:
            anchor, n = slug(match[1]), 1
            while anchor in found:  # GitHub numbers repeated headings: name, name-1, name-2
                anchor, n = f"{slug(match[1])}-{n}", n + 1
            found.add(anchor)
    return found


def broken_links(path: Path) -> list[str]:
    """Relative links of a Markdown file whose file, or heading within it, does not exist."""
    problems = []
    for target in LINK.findall(prose(path.read_text(encoding="utf-8"))):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:: not this test's business
            continue
        file_part, _, fragment = target.partition("#")
        destination = (path.parent / file_part).resolve() if file_part else path
        if not destination.exists():
            problems.append(f"{path.name}: {target}: no such file")
        elif fragment and destination.suffix == ".md" and fragment not in anchors(destination):
            problems.append(f"{path.name}: {target}: no heading #{fragment}")
    return problems


# ---- The generated checks table ---------------------------------------------------------------


def test_checks_table_is_current() -> None:
    expected = generator().generate()
    assert (DOCS / "checks.md").read_text(encoding="utf-8") == expected, (
        "docs/checks.md is stale: run .venv/bin/python docs/gen_checks_table.py"
    )


def test_check_mode_fails_on_a_stale_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    module = generator()
    table = tmp_path / "checks.md"
    assert module.main(["--output", str(table)]) == 0
    assert module.main(["--check", "--output", str(table)]) == 0
    table.write_text(table.read_text(encoding="utf-8").replace("| error |", "| warning |", 1), encoding="utf-8")
    assert module.main(["--check", "--output", str(table)]) == 1
    assert "is stale" in capsys.readouterr().err


def table_rows(text: str) -> dict[str, list[str]]:
    """Rows of the checks table by reference ID, cells unescaped."""
    rows: dict[str, list[str]] = {}
    for line in text.splitlines():
        match = re.match(r"\| \[([A-Z]+[0-9]{3})\]", line)
        if match:
            cells = [re.sub(r"\\(.)", r"\1", cell).strip() for cell in re.split(r"(?<!\\)\|", line)[1:-1]]
            assert match[1] not in rows, f"{match[1]} has two rows"
            rows[match[1]] = cells
    return rows


def test_checks_table_says_what_the_catalogue_and_registry_say() -> None:
    rows = table_rows((DOCS / "checks.md").read_text(encoding="utf-8"))
    registry = build_registry(plugins=False)
    documents = [parse_toml(path.read_text(encoding="utf-8")) for path in sorted((REPO / "references").glob("*.toml"))]
    assert sorted(rows) == sorted(document["id"] for document in documents)
    for document in documents:
        _, title, severity, decided_by, signatures = rows[document["id"]]
        assert title == document["title"], document["id"]
        assert severity == document["severity"], document["id"]
        assert int(signatures) == len(document.get("signatures", [])), document["id"]
        spec = registry.checks.get(document["id"])
        detect = document["detect"]
        if spec is not None:
            kind = "node check" if "node" in detect["modes"] else "config check"
            assert decided_by.startswith(f"{kind} ({', '.join(spec.profiles)})"), document["id"]
            fleet_part = f"; fleet comparison (`preflight fleet`: {', '.join(detect.get('fleet', []))})"
            assert decided_by.endswith(fleet_part) == bool(detect.get("fleet")), document["id"]
        elif detect.get("fleet"):
            assert decided_by == f"fleet comparison (`preflight fleet`: {', '.join(detect['fleet'])})", document["id"]
        elif detect.get("why_log_only"):
            assert decided_by == "log only: " + detect["why_log_only"], document["id"]
        else:
            assert decided_by == "log only for now; a check could read: " + detect["candidate"], document["id"]


def test_titles_with_markup_characters_are_escaped() -> None:
    cell = generator().cell
    assert cell("a | b") == r"a \| b"
    assert cell("`x` *y* <z>") == r"\`x\` \*y\* \<z>"
    assert cell("NCCL_BUFFSIZE [state == ncclSuccess]") == "NCCL_BUFFSIZE [state == ncclSuccess]"
    assert cell("_lead and trail_") == r"\_lead and trail\_"


# ---- Links, length, commands ------------------------------------------------------------------


@pytest.mark.parametrize("path", markdown_files(), ids=lambda path: str(path.relative_to(REPO)))
def test_relative_links_resolve(path: Path) -> None:
    assert broken_links(path) == []


def test_a_broken_link_is_reported(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Real heading\n", encoding="utf-8")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n[fine](other.md#real-heading) [here](#page) [web](https://example.org/x)\n"
        "[gone](missing.md) [bad anchor](other.md#no-such-heading)\n\n"
        "```\n[in code](not-a-link.md)\n```\n",
        encoding="utf-8",
    )
    assert broken_links(page) == [
        "page.md: missing.md: no such file",
        "page.md: other.md#no-such-heading: no heading #no-such-heading",
    ]


def test_readme_is_short() -> None:
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move detail into docs/"


def test_readme_shows_the_test_command_ci_runs() -> None:
    ci_lines = (REPO / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    ci_command = next(line for line in ci_lines if ".venv/bin/pytest" in line)
    readme_lines = [line for language, body in fenced_blocks(README.read_text(encoding="utf-8")) if language == "sh" for line in body.splitlines()]
    assert ci_command in readme_lines
    assert any("preflight node --root examples/nodes/hgx-h100" in line for line in readme_lines)


@lru_cache(maxsize=None)
def cli_help(*words: str) -> str:
    result = subprocess.run(
        [*preflight_command(), *words, "--help"], capture_output=True, text=True, timeout=60,
        env={**os.environ, "COLUMNS": "300"},
        cwd=tempfile.gettempdir(),  # never let the source tree shadow the installed package
    )
    assert result.returncode == 0, f"preflight {' '.join(words)} --help: {result.stderr}"
    return result.stdout


def subcommands(help_text: str) -> set[str]:
    """Command names listed in a help text's Commands section (typer's boxed or plain layout)."""
    match = re.search(r"^(?:╭─ )?Commands\b.*$", help_text, re.M)
    if match is None:
        return set()
    return set(re.findall(r"^(?:│ |  )([a-z][a-z-]*) {2,}", help_text[match.end():], re.M))


def documented_command_lines(path: Path) -> list[str]:
    """What follows ``preflight`` in every command line of a page: code blocks (with their
    continuation lines joined) and inline code."""
    text = path.read_text(encoding="utf-8")
    pieces: list[str] = []
    for _, body in fenced_blocks(text):
        lines: list[str] = []
        for line in body.splitlines():
            if lines and line.strip().startswith(("[", "--")):  # a wrapped usage line
                lines[-1] += " " + line.strip()
            else:
                lines.append(line)
        pieces += lines
    pieces += [code.replace("\n", " ") for code in INLINE_CODE.findall(FENCE.sub("", text))]
    found = []
    for piece in pieces:
        piece = re.sub(r"^\$ ", "", piece.split(" #", 1)[0])
        for command in re.split(r";|&&| \| |\$\(", piece):
            found += re.findall(r"(?:^|[\s/])preflight[ \t]+([^\n]*)", command)
    return found


def unknown_commands_and_options(arguments: str) -> list[str]:
    """The commands and options of one documented command line that the CLI does not have."""
    tokens = arguments.split()
    paths: list[tuple[str, ...]] = [()]
    while tokens and re.fullmatch(r"[a-z][a-z-]*(\|[a-z][a-z-]*)*", tokens[0]) and subcommands(cli_help(*paths[0])):
        names = tokens.pop(0).split("|")
        unknown = [name for name in names if name not in subcommands(cli_help(*paths[0]))]
        if unknown:
            return [f"preflight {' '.join(paths[0] + (name,))}: no such command" for name in unknown]
        paths = [path + (name,) for path in paths for name in names]
    problems = []
    for option in sorted({match for token in tokens for match in re.findall(r"^\[*(--[a-z][a-z-]*)", token)}):
        for path in paths:
            if not re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", cli_help(*path)):
                problems.append(f"preflight {' '.join(path)} {option}: no such option")
    return problems


def test_the_command_checker_catches_inventions() -> None:
    assert unknown_commands_and_options("node --root DIR --show-all") == []
    assert unknown_commands_and_options("slurm prolog|epilog --timeout 5") == []
    assert unknown_commands_and_options("node --no-such-option") == ["preflight node --no-such-option: no such option"]
    assert unknown_commands_and_options("slurm prolog|teardown") == ["preflight slurm teardown: no such command"]


@pytest.mark.parametrize("path", markdown_files(), ids=lambda path: str(path.relative_to(REPO)))
def test_documented_commands_and_options_exist(path: Path) -> None:
    problems = [problem for line in documented_command_lines(path) for problem in unknown_commands_and_options(line)]
    assert problems == []


# ---- What the pages must cover ------------------------------------------------------------------


def test_operator_guide_describes_every_node_check() -> None:
    text = (DOCS / "operators" / "node.md").read_text(encoding="utf-8")
    section = text.split("\n## What each check looks at\n", 1)[1].split("\n## ", 1)[0]
    described = re.findall(r"^\| ([A-Z]+[0-9]{3}) \|", section, re.M)
    assert len(described) == len(set(described)), "a check is described twice"
    assert sorted(described) == sorted(build_registry(plugins=False).checks)


def test_python_examples_are_valid_python() -> None:
    blocks = [
        (path, body)
        for path in markdown_files()
        for language, body in fenced_blocks(path.read_text(encoding="utf-8"))
        if language.split(" ", 1)[0] == "python"  # "python file=NAME" too
    ]
    assert blocks, "no Python example found: the docs lost their check example"
    for path, body in blocks:
        try:
            ast.parse(body)
        except SyntaxError as error:
            pytest.fail(f"{path.relative_to(REPO)}: {error}")


# ---- The site-check example runs as written -----------------------------------------------------


def example_files(text: str) -> dict[str, str]:
    """The files a page shows as fenced blocks whose info string names them (```python
    file=checks.d/acme.py), by relative path."""
    files = {}
    for info, body in fenced_blocks(text):
        for word in info.split()[1:]:
            if word.startswith("file="):
                files[word[len("file="):]] = body
    return files


def test_the_site_check_example_runs_as_written(tmp_path: Path) -> None:
    """writing-a-check.md's site check: its files, copied out of the page into a directory a
    site would use, and its command line, run as printed, give the verdict the page shows."""
    import json
    import shlex

    page = (DOCS / "contributors" / "writing-a-check.md").read_text(encoding="utf-8")
    files = example_files(page)
    assert sorted(files) == ["checks.d/ACME001.toml", "checks.d/acme_kernel.py"]
    for name, body in files.items():
        path = tmp_path / name
        path.parent.mkdir(exist_ok=True)
        path.parent.chmod(0o755)  # a check directory others may write is refused
        path.write_text(body, encoding="utf-8")
        path.chmod(0o644)
    (tmp_path / "examples").symlink_to(REPO / "examples")  # the command names the example node relatively
    (command,) = [
        line for language, body in fenced_blocks(page) if language == "sh" for line in body.splitlines() if "--checks-dir checks.d" in line
    ]
    words = shlex.split(command)
    assert words[0] == "preflight"
    result = subprocess.run([*preflight_command(), *words[1:]], capture_output=True, text=True, timeout=60, cwd=str(tmp_path))
    assert result.returncode == 2, result.stderr  # the page: "the command exits 2"
    (verdict_block,) = [body for language, body in fenced_blocks(page) if language == "json verdict"]
    documented = json.loads(verdict_block)
    (finding,) = json.loads(result.stdout)["findings"]
    assert {key: finding[key] for key in documented} == documented


def test_example_files_are_found_by_their_marks() -> None:
    text = "```python file=a/b.py\nx = 1\n```\n\n```python\ny = 2\n```\n\n```toml file=a/C001.toml\nid = 1\n```\n"
    assert example_files(text) == {"a/b.py": "x = 1\n", "a/C001.toml": "id = 1\n"}
