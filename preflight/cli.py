"""The ``preflight`` command line (typer).

``preflight node`` usually starts through the launcher's fast path, which skips importing typer
(~250 ms with pydantic) and calls the same :func:`preflight.commands.run_node`; this module
serves help, errors, and every other command.
"""

from __future__ import annotations

import json
import os
import sys
from typing import List, Optional

import typer

from preflight import __version__
from preflight.catalogue import CatalogueError, load_all, load_reference
from preflight.commands import NodeArgs, UsageProblem, finish, run_node
from preflight.launcher import split_tokens
from preflight.exitcodes import ExitCode
from preflight.model import REFERENCE_ID, Reference

app = typer.Typer(
    help="Find GPU/RDMA node misconfigurations before a job starts.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
references_app = typer.Typer(help="The catalogue of known failure modes.", no_args_is_help=True)
app.add_typer(references_app, name="references")


def _version(value: bool) -> None:
    if value:
        typer.echo(f"preflight {__version__}")
        raise typer.Exit(0)


@app.callback()
def main(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version and exit."),
) -> None:
    """preflight: catalogued GPU/RDMA misconfigurations, with evidence and a fix."""


@app.command()
def node(
    root: str = typer.Option("/", "--root", help="Treat this directory (a recorded node) as /."),
    config: Optional[str] = typer.Option(None, "--config", help="Site config (default: /etc/preflight/preflight.toml on the node)."),
    select: List[str] = typer.Option([], "--select", help="Only these references: ID prefixes or symbols, comma-separated."),
    ignore: List[str] = typer.Option([], "--ignore", help="Skip these references: ID prefixes or symbols."),
    profile: Optional[str] = typer.Option(None, "--profile", help="prolog (fast subset) or full (default)."),
    output_format: str = typer.Option("table", "--format", help="table, json, prometheus or junit."),
    timeout: Optional[float] = typer.Option(None, "--timeout", help="Deadline for the whole run, seconds (default 10)."),
    show_all: bool = typer.Option(False, "--show-all", help="Also list absent and not-applicable references."),
    checks_dir: List[str] = typer.Option([], "--checks-dir", help="Also load check modules from this directory."),
) -> None:
    """Inspect this node (or --root) and report catalogued misconfigurations.

    Exit codes: 0 nothing at warning or above, 1 warnings, 2 errors or critical,
    3 no verdict (bad arguments, unreadable root, broken config or plugin).
    """
    args = NodeArgs(
        root=root,
        config=config,
        select=split_tokens(select),
        ignore=split_tokens(ignore),
        profile=profile,
        output_format=output_format,
        timeout=timeout,
        show_all=show_all,
        checks_dirs=tuple(checks_dir),
    )
    finish(run_node(args))


@app.command()
def snapshot(
    output: str = typer.Argument(..., metavar="OUT.tar.gz", help="Where to write the snapshot: a name ending in .tar.gz or .tgz."),
    root: str = typer.Option("/", "--root", help="Record this recorded root (directory or snapshot) instead of the live node."),
    config: Optional[str] = typer.Option(None, "--config", help="Site config; it is stored in the snapshot as the node's own."),
    profile: Optional[str] = typer.Option(None, "--profile", help="prolog or full (default: full, which reads everything prolog does)."),
    scrub: List[str] = typer.Option([], "--scrub", help="Replace identifiers: hostnames,addresses,guids,macs,serials,users or all."),
    scrub_key: Optional[str] = typer.Option(
        None, "--scrub-key", envvar="PREFLIGHT_SCRUB_KEY", show_envvar=False,
        help="Secret key of the scrub mapping; the same key maps the same value to the same placeholder on every node "
        "(default: a random key, consistent within this snapshot only). Also read from $PREFLIGHT_SCRUB_KEY.",
    ),
    timeout: Optional[float] = typer.Option(None, "--timeout", help="Deadline for the recording run, seconds (default 10)."),
) -> None:
    """Record what the checks read on this node into OUT.tar.gz, to replay with
    `preflight node --root OUT.tar.gz` anywhere (bug reports, test fixtures).

    Exit codes: 0 written, 3 nothing written (bad arguments, unreadable root, unwritable OUT).
    """
    from preflight.snapshot import SnapshotArgs, run_snapshot

    args = SnapshotArgs(
        output=output,
        root=root,
        config=config,
        profile=profile,
        scrub=split_tokens(scrub),
        scrub_key=scrub_key,
        timeout=timeout,
    )
    raise typer.Exit(run_snapshot(args))


@app.command()
def explain(
    inputs: List[str] = typer.Argument(None, metavar="[FILE|DIR|-]...", help="Log files, .gz files, directories of per-rank logs, or - for stdin (the default)."),
    output_format: str = typer.Option("text", "--format", help="text or json."),
    check: bool = typer.Option(False, "--check", help="Run the node checks that can confirm or refute each candidate."),
    root: Optional[str] = typer.Option(None, "--root", help="With --check: the node to check (a recorded root, or a snapshot archive; default /)."),
    config: Optional[str] = typer.Option(None, "--config", help="With --check: site config."),
) -> None:
    """Match a failed run's logs to catalogued references, best first, with evidence and fixes.

    Exit codes: 0 no failure found, 1 candidates found, or a failure no reference describes
    (its first line is named), 2 a candidate confirmed by --check, 3 no input could be read,
    bad arguments, or --check could not examine the node (the candidates are still shown).
    """
    from preflight.explain import check_candidates
    from preflight.explain import explain as run_explain
    from preflight.explain.render import exit_status, render_json, render_text

    if output_format not in ("text", "json"):
        _fail("--format must be text or json")
    for option, value, role in (("--root", root, "the node --check examines"), ("--config", config, "the site config --check runs with")):
        if value is not None and not check:
            _fail(f"{option} needs --check (it gives {role})")
    if check and root is not None:
        _check_root(root)
    if not inputs and sys.stdin.isatty():
        _fail("give log files or directories, or pipe a log in (preflight explain FILE... | -)")
    try:
        explanation = run_explain(list(inputs or []))
    except CatalogueError as error:
        _fail(str(error))
        return
    if check and explanation.candidates:
        check_candidates(explanation, root or "/", config)
    typer.echo(render_json(explanation) if output_format == "json" else render_text(explanation), nl=False)
    if explanation.check_error:  # the candidates stand, but the node asked about gave no verdict
        _fail(f"--check: {explanation.check_error}")
    codes = {"no-input": ExitCode.NO_VERDICT, "nothing-found": ExitCode.OK, "uncatalogued": 1, "candidates": 1, "confirmed": 2}
    raise typer.Exit(int(codes[exit_status(explanation)]))


def _check_root(root: str) -> None:
    """Refuse a ``--root`` directory that is no node root before reading any log."""
    from preflight.sources import RootError, open_root
    from preflight.sources.archive import is_archive

    if is_archive(root):
        return  # a snapshot archive is unpacked (and judged) by --check itself
    try:
        open_root(root)
    except RootError as error:
        _fail(str(error))


def _reference_json(reference: Reference) -> dict[str, object]:
    return {
        "id": reference.id,
        "symbol": reference.symbol,
        "title": reference.title,
        "area": reference.area,
        "severity": reference.severity.value,
        "detect": {"modes": list(reference.detect), "checks": list(reference.checks)},
        "summary": reference.summary,
        "causes": list(reference.causes),
        "evidence": list(reference.evidence),
        "fix": list(reference.fix),
        "related": list(reference.related),
        "signatures": list(reference.signatures),
        "sources": list(reference.sources),
    }


def _fail(message: str) -> None:
    typer.echo(f"preflight: error: {message}", err=True)
    raise typer.Exit(ExitCode.NO_VERDICT)


@references_app.command("list")
def references_list(
    output_format: str = typer.Option("table", "--format", help="table or json."),
) -> None:
    """List every catalogued reference."""
    try:
        references = load_all()
    except CatalogueError as error:
        _fail(str(error))
        return
    if output_format == "json":
        typer.echo(json.dumps([_reference_json(r) for r in references], indent=2))
        return
    if output_format != "table":
        _fail("--format must be table or json")
    from preflight.reporters.table import fit_table

    rows = [[r.id, r.severity.value, r.symbol, r.title] for r in references]
    typer.echo(fit_table(rows, ["ID", "Severity", "Symbol", "Title"], wrap={2: 1, 3: 2}))


@references_app.command("search")
def references_search(
    words: List[str] = typer.Argument(..., metavar="TEXT...", help="Words to look for (all must occur)."),
    output_format: str = typer.Option("table", "--format", help="table or json."),
) -> None:
    """Find references whose title, summary, causes, fix or signature examples mention TEXT."""
    if output_format not in ("table", "json"):
        _fail("--format must be table or json")
    try:
        references = load_all()
    except CatalogueError as error:
        _fail(str(error))
        return
    found = search_references(references, words)
    if output_format == "json":
        typer.echo(json.dumps([_reference_json(r) for r in found], indent=2))
        return
    if not found:
        typer.echo(f"No reference mentions {' '.join(words)!r}.")
        raise typer.Exit(1)
    from preflight.reporters.table import fit_table

    typer.echo(fit_table([[r.id, r.severity.value, r.title] for r in found], ["ID", "Severity", "Title"], wrap={2: 1}))


def search_references(references: list[Reference], words: List[str]) -> list[Reference]:
    """References containing every word (case-insensitive), title matches first."""
    needles = [word.lower() for word in words if word.strip()]

    def text_of(reference: Reference) -> str:
        examples = [example for item in reference.signatures for example in item.get("examples", [])]
        parts = [reference.id, reference.symbol, reference.title, reference.area, reference.summary]
        return "\n".join([*parts, *reference.causes, *reference.fix, *examples]).lower()

    hits = [r for r in references if all(needle in text_of(r) for needle in needles)]
    return sorted(hits, key=lambda r: (not all(n in r.title.lower() for n in needles), r.id))


@references_app.command("show")
def references_show(
    ref_id: str = typer.Argument(..., metavar="ID", help="A reference ID such as MEM001, or its symbol."),
    output_format: str = typer.Option("text", "--format", help="text or json."),
) -> None:
    """Show one reference: summary, causes, evidence to collect, fix and sources."""
    try:
        if REFERENCE_ID.match(ref_id.upper()):
            reference = load_reference(ref_id.upper())
        else:
            matches = [r for r in load_all() if r.symbol == ref_id]
            if not matches:
                raise UsageProblem(f"no reference with ID or symbol {ref_id!r}")
            reference = matches[0]
    except (CatalogueError, UsageProblem) as error:
        _fail(str(error))
        return
    if output_format == "json":
        typer.echo(json.dumps(_reference_json(reference), indent=2))
        return
    if output_format != "text":
        _fail("--format must be text or json")
    typer.echo(render_reference(reference))


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
    return "\n".join(lines)


@app.command()
def fleet(
    inputs: List[str] = typer.Argument(None, metavar="REPORT...|DIR", help="`preflight node --format json` reports, or directories of *.json reports."),
    output_format: str = typer.Option("table", "--format", help="table, json (schema preflight-fleet/1), markdown or html (one static page)."),
    output: Optional[str] = typer.Option(None, "--output", help="Write the fleet report to FILE (replaced whole) instead of stdout."),
    ignore_fact: List[str] = typer.Option([], "--ignore-fact", help="Do not compare this fact (its key, as in the JSON), comma-separated."),
    node_names: str = typer.Option("host", "--node-names", help="Name nodes by the host name in each report (host) or by the report's file name less .json (file: the inventory name, for reports the Ansible role collected)."),
) -> None:
    """Aggregate node reports: which nodes have each reference present or unknown, and the odd
    one out within each hardware class (driver, firmware, NCCL, MTU, GID index, memlock, ACS...).

    Exit codes: 0 all agree and nothing at warning or above, 1 warnings present or a file
    skipped, 2 an error/critical finding present or a node is the odd one out (or a tie),
    3 no verdict (no usable report, bad arguments).
    """
    from preflight.fleet import run_fleet

    raise typer.Exit(run_fleet(list(inputs or []), output_format, output, split_tokens(ignore_fact), node_names=node_names))


# ---- preflight slurm -----------------------------------------------------------------------
# prolog, epilog and healthcheck usually start through the launcher's fast path (no typer import);
# these commands serve --help, errors and `slurm config`. A test keeps the option sets equal.

slurm_app = typer.Typer(help="Run under Slurm: prolog, epilog, health check; print slurm.conf lines.", no_args_is_help=True)
app.add_typer(slurm_app, name="slurm")
_PROLOG_EXIT_CODES = (
    "Exit codes: 0 the job may run (also when preflight itself could not decide: the reason goes to stderr, "
    "syslog and the last-result file); 2 findings at or above the configured drain_severity are present: the "
    "node is drained (reason printed, sent to syslog, set with one bounded scontrol call), Slurm requeues a "
    "batch job held and cancels an srun job."
)
_EPILOG_EXIT_CODES = (
    "Exit codes: 0 nothing drains the node (also when preflight itself could not decide); 2 findings at or "
    "above the configured drain_severity are present: the node is drained with a preflight reason, unless it "
    "is already drained or down with a reason (the failed prolog's, an operator's), which is kept."
)


def _run_slurm_mode(mode: str, root: str, config: Optional[str], timeout: Optional[float], checks_dir: List[str]) -> None:
    from preflight.slurm import SlurmArgs, run_slurm

    finish(run_slurm(SlurmArgs(mode=mode, root=root, config=config, timeout=timeout, checks_dirs=tuple(checks_dir))))


_ROOT_OPTION = typer.Option("/", "--root", help="Treat this directory (a recorded node) as /.")
_CONFIG_OPTION = typer.Option(None, "--config", help="Site config (default: /etc/preflight/preflight.toml on the node).")
_TIMEOUT_OPTION = typer.Option(None, "--timeout", help="Budget for the whole run, scontrol included (default: the config's slurm.timeout, 8 s).")
_HEALTHCHECK_TIMEOUT_OPTION = typer.Option(
    None, "--timeout", help="Budget for the whole run, scontrol included; below 60 (default: the config's slurm.healthcheck_timeout, 50 s)."
)
_CHECKS_DIR_OPTION = typer.Option([], "--checks-dir", help="Also load check modules from this directory.")


@slurm_app.command("prolog", help=f"Slurm Prolog: the prolog profile, scoped to the job (SLURM_JOB_GPUS).\n\n{_PROLOG_EXIT_CODES}")
def slurm_prolog(
    root: str = _ROOT_OPTION, config: Optional[str] = _CONFIG_OPTION,
    timeout: Optional[float] = _TIMEOUT_OPTION, checks_dir: List[str] = _CHECKS_DIR_OPTION,
) -> None:
    _run_slurm_mode("prolog", root, config, timeout, checks_dir)


@slurm_app.command(
    "epilog",
    help="Slurm Epilog: after each job (also one whose prolog failed), the configured epilog_profile (default "
    f"prolog) scoped to the job's GPUs, so a node the job left broken takes no further job.\n\n{_EPILOG_EXIT_CODES}",
)
def slurm_epilog(
    root: str = _ROOT_OPTION, config: Optional[str] = _CONFIG_OPTION,
    timeout: Optional[float] = _TIMEOUT_OPTION, checks_dir: List[str] = _CHECKS_DIR_OPTION,
) -> None:
    _run_slurm_mode("epilog", root, config, timeout, checks_dir)


@slurm_app.command("healthcheck")
def slurm_healthcheck(
    root: str = _ROOT_OPTION, config: Optional[str] = _CONFIG_OPTION,
    timeout: Optional[float] = _HEALTHCHECK_TIMEOUT_OPTION, checks_dir: List[str] = _CHECKS_DIR_OPTION,
) -> None:
    """HealthCheckProgram or cron: the full profile; drains the node with a "preflight:" reason, resumes a node it drained once clean, never touches a reason someone else set.

    Exit codes: 0 nothing drains the node, 2 it has findings that drain it, 3 no verdict.
    """
    _run_slurm_mode("healthcheck", root, config, timeout, checks_dir)


@slurm_app.command("config")
def slurm_config(
    config: Optional[str] = typer.Option(None, "--config", help="Site config whose [slurm] timeouts to use (default: /etc/preflight/preflight.toml if present); passed on to the wrappers."),
    wrapper_dir: Optional[str] = typer.Option(None, "--wrapper-dir", help="Write the three wrapper scripts into this existing directory (mode 0755) and name them there; without it they are printed as comments, named in /etc/slurm."),
    interval: int = typer.Option(300, "--interval", min=1, help="HealthCheckInterval, seconds."),
    message_timeout: int = typer.Option(10, "--message-timeout", min=1, help="The cluster's MessageTimeout (Slurm's default: 10); PrologEpilogTimeout stays within it."),
) -> None:
    """Print the slurm.conf lines (Prolog, Epilog, PrologFlags, PrologEpilogTimeout, HealthCheckProgram, HealthCheckInterval), ready to include, and write or show the wrapper scripts they name.

    Exit codes: 0 done, 3 refused (a broken config, a [slurm] timeout that PrologEpilogTimeout cannot cover, an unusable --wrapper-dir).
    """
    import os

    from preflight.commands import load_host_config
    from preflight.config import ConfigError
    from preflight.slurm import (
        commented_wrappers, preflight_program, prolog_timeout_problem, slurm_conf_lines, wrapper_dir_problem, wrapper_scripts,
        write_wrappers,
    )

    try:
        settings = load_host_config(config, "").slurm
    except ConfigError as error:
        _fail(str(error))
        return
    problem = prolog_timeout_problem(settings, message_timeout) or (wrapper_dir_problem(wrapper_dir) if wrapper_dir is not None else "")
    if problem:
        _fail(problem)
    directory = (wrapper_dir or "/etc/slurm").rstrip("/") or "/"
    wrappers = wrapper_scripts(preflight_program(), directory, os.path.abspath(config) if config else None)
    lines = slurm_conf_lines(settings, directory, interval, message_timeout)
    if wrapper_dir is None:
        typer.echo(lines + commented_wrappers(wrappers), nl=False)
        return
    problem = write_wrappers(wrappers)
    if problem:
        _fail(problem)
    typer.echo(lines, nl=False)
    typer.echo(f"preflight: wrote {', '.join(wrappers)} (mode 0755)", err=True)
