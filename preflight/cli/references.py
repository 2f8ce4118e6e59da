"""``preflight references list|search|show``: the catalogue of known failure modes."""

from __future__ import annotations

import json

from preflight.cli.spec import Argument, Command, Option, Values, error
from preflight.model import REFERENCE_ID, Reference

FORMAT_TABLE = Option("--format", "output_format", "table or json.", default="table")
CHECKS_DIR = Option(
    "--checks-dir", "checks_dirs", "Also the references shipped in this site check directory (installed plugins' always).", kind="many"
)


def known(values: Values) -> list[Reference] | int:
    """Every reference the command should see (packaged, plugins', --checks-dir's), or the exit
    code of the error that says why it cannot."""
    from preflight.catalogue import CatalogueError
    from preflight.discovery import known_references
    from preflight.registry import RegistrationError

    try:
        return known_references(values["checks_dirs"]).all()
    except (CatalogueError, RegistrationError) as problem:
        return error(str(problem))


def reference_json(reference: Reference) -> dict[str, object]:
    return {
        "id": reference.id,
        "symbol": reference.symbol,
        "title": reference.title,
        "area": reference.area,
        "severity": reference.severity.value,
        "detect": {
            "modes": list(reference.detect),
            "checks": list(reference.checks),
            "why_log_only": reference.why_log_only,
            "candidate": reference.candidate,
            "fleet": list(reference.fleet),
            "tests_only": reference.tests_only,
        },
        "summary": reference.summary,
        "causes": list(reference.causes),
        "evidence": list(reference.evidence),
        "fix": list(reference.fix),
        "related": list(reference.related),
        "signatures": list(reference.signatures),
        "sources": list(reference.sources),
    }


def run_list(values: Values) -> int:
    if values["output_format"] not in ("table", "json"):
        return error("--format must be table or json")
    references = known(values)
    if isinstance(references, int):
        return references
    if values["output_format"] == "json":
        print(json.dumps([reference_json(r) for r in references], indent=2))
        return 0
    from preflight.reporters.table import fit_table

    rows = [[r.id, r.severity.value, r.symbol, r.title] for r in references]
    print(fit_table(rows, ["ID", "Severity", "Symbol", "Title"], wrap={2: 1, 3: 2}))
    return 0


def run_search(values: Values) -> int:
    if values["output_format"] not in ("table", "json"):
        return error("--format must be table or json")
    references = known(values)
    if isinstance(references, int):
        return references
    words = list(values["words"])
    found = search_references(references, words)
    if values["output_format"] == "json":
        print(json.dumps([reference_json(r) for r in found], indent=2))
        return 0 if found else 1  # as in the table: a script may test "is there a reference for X"
    if not found:
        print(f"No reference mentions {' '.join(words)!r}.")
        return 1
    from preflight.reporters.table import fit_table

    print(fit_table([[r.id, r.severity.value, r.title] for r in found], ["ID", "Severity", "Title"], wrap={2: 1}))
    return 0


def search_references(references: list[Reference], words: list[str]) -> list[Reference]:
    """References containing every word (case-insensitive), title matches first."""
    needles = [word.lower() for word in words if word.strip()]

    def text_of(reference: Reference) -> str:
        examples = [example for item in reference.signatures for example in item.get("examples", [])]
        parts = [reference.id, reference.symbol, reference.title, reference.area, reference.summary]
        return "\n".join([*parts, *reference.causes, *reference.fix, *examples]).lower()

    hits = [r for r in references if all(needle in text_of(r) for needle in needles)]
    return sorted(hits, key=lambda r: (not all(n in r.title.lower() for n in needles), r.id))


def run_show(values: Values) -> int:
    from preflight.catalogue import CatalogueError, load_reference

    ref_id = values["ref_id"]
    if REFERENCE_ID.match(ref_id.upper()) and not values["checks_dirs"]:
        try:  # the common case reads one file, not the whole catalogue
            reference = load_reference(ref_id.upper())
        except CatalogueError:
            reference = None
    else:
        reference = None
    if reference is None:
        references = known(values)
        if isinstance(references, int):
            return references
        matches = [r for r in references if r.id == ref_id.upper() or r.symbol == ref_id]
        if not matches:
            return error(f"no reference with ID or symbol {ref_id!r}")
        reference = matches[0]
    if values["output_format"] == "json":
        print(json.dumps(reference_json(reference), indent=2))
        return 0
    if values["output_format"] != "text":
        return error("--format must be text or json")
    print(render_reference(reference))
    return 0


def render_reference(reference: Reference) -> str:
    """A reference as a person reads it in a terminal: prose wrapped at spaces to the terminal's
    width (96 columns at most), never inside a word, path or URL; shell commands and log patterns
    whole, each on a line of its own, so that they can be pasted."""
    import textwrap

    from preflight.reporters.table import terminal_width

    width = min(96, terminal_width())

    def fill(text: str, first: str = "", rest: str = "") -> str:
        return textwrap.fill(text, width, initial_indent=first, subsequent_indent=rest, break_long_words=False, break_on_hyphens=False)

    def block(title: str, items: list[str], numbered: bool = False, commands: list[str] | None = None) -> list[str]:
        if not items:
            return []
        out = [f"\n{title}"]
        for number, item in enumerate(items, 1):
            first = f"  {f'{number}.' if numbered else '-'} "
            out.append(fill(item, first, " " * len(first)))
            if commands and commands[number - 1]:
                out.append(f"{' ' * len(first)}$ {commands[number - 1]}")
        return out

    lines = [
        fill(f"{reference.id} {reference.symbol} [{reference.severity.value}, {reference.area}]"),
        fill(reference.title),
        "",
        fill(reference.summary),
    ]
    lines += block("Causes", list(reference.causes))
    evidence = [item["what"] + (f"  [checked by {item['check']}]" if item.get("check") else "") for item in reference.evidence]
    lines += block("Evidence to collect", evidence, commands=[item.get("command", "") for item in reference.evidence])
    lines += block("Fix", list(reference.fix), numbered=True)
    if reference.signatures:
        lines += ["\nLog signatures (for preflight explain)", *(f"  - [{s['role']}] {s['pattern']}" for s in reference.signatures)]
    lines += block("Related", list(reference.related))
    lines += block("Sources", list(reference.sources))
    detect = ", ".join(reference.detect) + (f" (checks: {', '.join(reference.checks)})" if reference.checks else "")
    lines += ["", f"Detectable from: {detect}"]
    if reference.fleet:
        lines.append(f"Compared across nodes by preflight fleet: {', '.join(reference.fleet)}")
    if reference.tests_only:
        lines += ["", "The node checks test only:", fill(reference.tests_only, "  ", "  ")]
    if reference.why_log_only:
        lines += ["", "Why only in logs:", fill(reference.why_log_only, "  ", "  ")]
    if reference.candidate:
        lines += ["", "Evidence a node check could read (not written yet):", fill(reference.candidate, "  ", "  ")]
    return "\n".join(lines)


COMMANDS = (
    Command(("references", "list"), "List every catalogued reference.", run_list, options=(FORMAT_TABLE, CHECKS_DIR)),
    Command(
        ("references", "search"),
        "Find references whose title, summary, causes, fix or signature examples mention TEXT. Exit codes: 0 found, 1 nothing matches, 3 bad arguments.",
        run_search,
        argument=Argument("words", "TEXT", "Words to look for (all must occur).", many=True),
        options=(FORMAT_TABLE, CHECKS_DIR),
    ),
    Command(
        ("references", "show"),
        "Show one reference: summary, causes, evidence to collect, fix and sources.",
        run_show,
        argument=Argument("ref_id", "ID", "A reference ID such as MEM001, or its symbol."),
        options=(Option("--format", "output_format", "text or json.", default="text"), CHECKS_DIR),
    ),
)
#: The help of the command group
GROUP_HELP = "The catalogue of known failure modes."
