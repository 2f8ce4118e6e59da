"""Write docs/checks.md: every reference of the catalogue and how preflight decides it.

The table is built from the two places that decide it, never by hand: the reference files
(``references/<ID>.toml``: ID, title, severity, log signatures, and ``[detect]``: node or config
evidence, a fleet comparison, or why only logs show it) and the registry of built-in
checks (``preflight.discovery.build_registry``: which references a node check decides, in which
profiles, from which module). Run it from a checkout after adding or changing a reference or a
check::

    .venv/bin/python docs/gen_checks_table.py           # rewrite docs/checks.md
    .venv/bin/python docs/gen_checks_table.py --check   # exit 1 when docs/checks.md is stale

``tests/docs/test_docs.py`` regenerates the table and compares it with the committed file, so a stale
table fails the test suite.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from preflight.discovery import build_registry
from preflight.model import REFERENCE_ID
from preflight.registry import Registry
from preflight.tomlcompat import parse_toml

REPO = Path(__file__).resolve().parent.parent
REFERENCES = REPO / "references"
OUTPUT = REPO / "docs" / "checks.md"

# Characters that would turn a title into markup instead of showing it as written: a pipe ends
# the table cell; backslash, backtick, asterisk and angle bracket start escapes, code, emphasis
# or HTML. Underscores and brackets inside words ("NCCL_BUFFSIZE", "[state == ncclSuccess]")
# render literally in GitHub's Markdown and stay unescaped, so titles read as they are written.
_MARKUP = re.compile(r"([\\|`*<])")
_EDGE_UNDERSCORE = re.compile(r"(?<![A-Za-z0-9])_|_(?![A-Za-z0-9])")


def load_references(directory: Path) -> list[dict[str, Any]]:
    """Every ``<ID>.toml`` of the catalogue directory, parsed, in file-name order."""
    documents = []
    for path in sorted(directory.glob("*.toml")):
        if not REFERENCE_ID.match(path.stem):
            continue
        document = parse_toml(path.read_text(encoding="utf-8"))
        if document.get("id") != path.stem:
            raise SystemExit(f"{path}: id {document.get('id')!r} does not match the file name")
        documents.append(document)
    return documents


def family(ref_id: str) -> str:
    """The area prefix of a reference ID: ``PCI`` for ``PCI003``."""
    return ref_id.rstrip("0123456789")


def cell(text: str) -> str:
    """``text`` as a Markdown table cell that shows exactly ``text``."""
    return _EDGE_UNDERSCORE.sub(r"\\_", _MARKUP.sub(r"\\\1", text))


def module_path(module: str) -> str:
    """The repository file of a built-in check module (``preflight.checks.pci`` -> ``checks/pci.py``)."""
    prefix = "preflight.checks."
    if not module.startswith(prefix):
        raise SystemExit(f"{module}: not a built-in check module (installed plugins are left out of the table)")
    return "checks/" + module[len(prefix) :].replace(".", "/") + ".py"


def decided_by(document: Mapping[str, Any], registry: Registry) -> str:
    """How the reference is decided: by a check (a node check when the reference names node
    evidence, else a config check on the job's settings; its profiles and module), by comparing
    nodes in ``preflight fleet``, or only from logs, with the reference's reason or the evidence a
    check still to be written would read."""
    ref_id = str(document["id"])
    detect = document.get("detect", {})
    spec = registry.checks.get(ref_id)
    if spec is not None:
        path = module_path(spec.origin)
        kind = "node check" if "node" in detect.get("modes", []) else "config check"
        also = f"; fleet comparison (`preflight fleet`: {', '.join(detect['fleet'])})" if detect.get("fleet") else ""
        return f"{kind} ({', '.join(spec.profiles)}), [`{path}`](../{path}){also}"
    if detect.get("fleet"):
        return f"fleet comparison (`preflight fleet`: {', '.join(detect['fleet'])})"
    if detect.get("why_log_only"):
        return "log only: " + cell(str(detect["why_log_only"]).strip())
    if detect.get("candidate"):
        return "log only for now; a check could read: " + cell(str(detect["candidate"]).strip())
    return "log only (`preflight explain`)"


def render(references: Sequence[Mapping[str, Any]], registry: Registry) -> str:
    """The whole of docs/checks.md."""
    ids = [str(document["id"]) for document in references]
    detects = {str(document["id"]): document.get("detect", {}) for document in references}
    checked = [ref_id for ref_id in ids if ref_id in registry.checks]
    on_node = [ref_id for ref_id in checked if "node" in detects[ref_id].get("modes", [])]
    in_prolog = [ref_id for ref_id in checked if "prolog" in registry.checks[ref_id].profiles]
    rest = [ref_id for ref_id in ids if ref_id not in registry.checks]
    fleet = [ref_id for ref_id in rest if detects[ref_id].get("fleet")]
    also_fleet = [ref_id for ref_id in checked if detects[ref_id].get("fleet")]
    why = [ref_id for ref_id in rest if detects[ref_id].get("why_log_only")]
    candidates = [ref_id for ref_id in rest if detects[ref_id].get("candidate")]
    families = sorted({family(ref_id) for ref_id in ids})
    lines = [
        "# Checks and references",
        "",
        "<!-- Generated by docs/gen_checks_table.py from references/*.toml and the check registry;",
        "     do not edit by hand: run `.venv/bin/python docs/gen_checks_table.py`. -->",
        "",
        f"The catalogue holds {len(ids)} references. {len(checked)} are decided before the job by a check "
        f"(`preflight node`): {len(on_node)} node checks read the node itself and {len(checked) - len(on_node)} "
        f"config checks read the job's settings (environment and nccl.conf) and installed versions; "
        f"{len(in_prolog)} of them also run in the `prolog` profile, the rest in `full` only. "
        f"{len(fleet)} {'is' if len(fleet) == 1 else 'are'} decided by comparing nodes with `preflight fleet`, "
        f"and {len(also_fleet)} checked {'one is' if len(also_fleet) == 1 else 'ones are'} also decided there "
        "(a fleet finding with the reference's ID where nodes that should agree differ). "
        f"The other {len(rest) - len(fleet)} are recognised only in a failed run's logs (`preflight explain`): "
        f"for {len(why)} no evidence exists before the job, and the row says why; for {len(candidates)} "
        "evidence exists and a check is still to be written, and the row says what it would read. "
        "Signatures are the log patterns `preflight explain` matches for a reference. "
        "`preflight references show ID` prints a whole reference; "
        "[the operator guide](operators/node.md) says what each node check looks at.",
        "",
        "Families: " + " · ".join(f"[{name}](#{name.lower()})" for name in families),
    ]
    for name in families:
        lines += ["", f"## {name}", "", "| ID | Title | Severity | Decided by | Signatures |", "|---|---|---|---|---|"]
        for document in references:
            ref_id = str(document["id"])
            if family(ref_id) != name:
                continue
            signatures = len(document.get("signatures", []))
            link = f"[{ref_id}](../references/{ref_id}.toml)"
            lines.append(f"| {link} | {cell(str(document['title']))} | {document['severity']} | {decided_by(document, registry)} | {signatures} |")
    return "\n".join(lines) + "\n"


def generate() -> str:
    """docs/checks.md as the catalogue and the built-in checks make it today."""
    # Installed plugins would make the table depend on the machine that ran the script.
    return render(load_references(REFERENCES), build_registry(plugins=False))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write docs/checks.md from the catalogue and the check registry.")
    parser.add_argument("--check", action="store_true", help="exit 1 if the file differs from what would be written")
    parser.add_argument("--output", type=Path, default=OUTPUT, help="the file to write or check (default: docs/checks.md)")
    args = parser.parse_args(argv)
    output: Path = args.output
    text = generate()
    if args.check:
        try:
            current = output.read_text(encoding="utf-8")
        except FileNotFoundError:
            current = ""
        if current != text:
            print(f"{output} is stale: run docs/gen_checks_table.py", file=sys.stderr)
            return 1
        return 0
    output.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
