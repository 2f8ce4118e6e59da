"""``preflight explain``: match a failed run's logs to catalogued references."""

from __future__ import annotations

import sys

from preflight.cli.spec import Argument, Command, Option, Values, error

#: explain's outcome -> exit code (documented in the command's help)
EXIT_CODES = {"no-input": 3, "nothing-found": 0, "uncatalogued": 1, "stalled": 1, "candidates": 1, "confirmed": 2}


def run_explain(values: Values) -> int:
    from preflight.catalogue import CatalogueError
    from preflight.discovery import known_references
    from preflight.explain import check_candidates, explain, load_catalogue
    from preflight.explain.render import exit_status, no_input_message, render_json, render_text
    from preflight.text import printable
    from preflight.registry import RegistrationError

    output_format, check, root, config = values["output_format"], values["check"], values["root"], values["config"]
    if output_format not in ("text", "json"):
        return error("--format must be text or json")
    for option, value, role in (
        ("--root", root, "the node --check examines"),
        ("--config", config, "the site config --check runs with"),
    ):
        if value and not check:
            return error(f"{option} needs --check (it gives {role})")
    if check and root is not None:
        problem = _root_problem(root)
        if problem:
            return error(problem)
    if not values["inputs"] and sys.stdin.isatty():
        return error("give log files or directories, or pipe a log in (preflight explain FILE... | -)")
    try:
        # Site check directories and plugins ship references too; their signatures are matched
        # like the catalogue's (the directories' modules are not imported for that).
        site = known_references(values["checks_dirs"]).extra.values()
        explanation = explain(list(values["inputs"]), catalogue=load_catalogue(extra=site))
    except (CatalogueError, RegistrationError) as problem:
        return error(str(problem))
    if check and explanation.candidates:
        check_candidates(explanation, root or "/", config, values["checks_dirs"])
    sys.stdout.write(render_json(explanation) if output_format == "json" else render_text(explanation))
    sys.stdout.flush()
    # On stderr, as other commands say what they could not read: a report redirected to a file
    # (an epilog's) must not hide why a log was left out.
    for skipped in explanation.stats.problem_lines():
        print(f"preflight: {printable(skipped, 500)}", file=sys.stderr)
    if exit_status(explanation) == "no-input":
        print(f"preflight: error: {no_input_message(explanation)}", file=sys.stderr)
    if explanation.check_error:  # the candidates stand, but the node asked about gave no verdict
        return error(f"--check: {explanation.check_error}")
    return EXIT_CODES[exit_status(explanation)]


def _root_problem(root: str) -> str:
    """Why a ``--root`` directory is no node root, found before any log is read ("" if none)."""
    from preflight.sources import RootError, open_root
    from preflight.sources.archive import is_archive

    if is_archive(root):
        return ""  # a snapshot archive is unpacked (and judged) by --check itself
    try:
        open_root(root)
    except RootError as problem:
        return str(problem)
    return ""


EXPLAIN = Command(
    path=("explain",),
    help="""Match a failed run's logs to catalogued references, best first, with evidence and fixes.

    Exit codes: 0 no failure found, 1 candidates found, a failure no reference describes (its
    first line is named), or a run that stopped in NCCL's output without an error or a finish
    (NCCL's last line is named), 2 a candidate confirmed by --check, 3 no input could be read
    or all was empty, bad arguments, or --check could not examine the node (the candidates are still shown).
    """,
    run=run_explain,
    argument=Argument(
        "inputs", "FILE|DIR|-", "Log files, .gz files, directories of per-rank logs, or - for stdin (the default).",
        many=True, required=False,
    ),
    options=(
        Option("--format", "output_format", "text or json.", default="text"),
        Option("--check", "check", "Run the node checks that can confirm or refute each candidate, and those of the references a symptom candidate lists as related.", kind="flag"),
        Option("--root", "root", "With --check: the node to check (a recorded root, or a snapshot archive; default /)."),
        Option("--config", "config", "With --check: site config."),
        Option(
            "--checks-dir", "checks_dirs",
            "A site check directory: its references' signatures are matched too, and with --check its checks run.",
            kind="many",
        ),
    ),
    probe_threads=True,
    fast=True,  # typer and pydantic would add about a quarter of a second to every explain
)
COMMANDS = (EXPLAIN,)
