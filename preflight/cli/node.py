"""``preflight node``: inspect this node (or a recorded root) and report."""

from __future__ import annotations

import sys
import time

from preflight.cli.spec import Command, Option, Values, error

OUTPUT_FORMATS = ("table", "json", "prometheus", "junit")

ROOT = Option("--root", "root", "Treat this directory (a recorded node) as /.", default="/")
CONFIG = Option("--config", "config", "Site config (default: /etc/preflight/preflight.toml on the node).")
CHECKS_DIR = Option("--checks-dir", "checks_dirs", "Also load check modules from this directory.", kind="many")


def run_node(values: Values) -> int:
    """Print the report, return the exit code. Never raises. ``--root`` may name a snapshot
    archive, replayed from a private temporary copy removed afterwards."""
    from preflight.catalogue import CatalogueError
    from preflight.config import ConfigError
    from preflight.exitcodes import ExitCode, exit_code
    from preflight.model import Status
    from preflight.registry import RegistrationError
    from preflight.reporters import render
    from preflight.text import printable
    from preflight.run import (
        UsageProblem,
        check_profile,
        check_timeout,
        inspect_node,
        open_node,
        unpack_budget,
    )
    from preflight.sources import RootError
    from preflight.sources.archive import ArchiveError, opened_root

    timeout: float | None = values["timeout"]
    try:
        if values["output_format"] not in OUTPUT_FORMATS:
            raise UsageProblem(f"--format {values['output_format']!r}: choose one of {', '.join(OUTPUT_FORMATS)}")
        check_profile(values["profile"])
        check_timeout(timeout)
        begin = time.monotonic()
        with opened_root(values["root"], begin + unpack_budget(values["root"], timeout, values["config"])) as (directory, label):
            node = open_node(directory, values["config"])
            spent = time.monotonic() - begin
            report = inspect_node(
                node,
                profile=values["profile"],
                timeout_s=(timeout if timeout is not None else node.config.timeout_s) - spent,
                select=values["select"],
                ignore=values["ignore"],
                checks_dirs=values["checks_dirs"],
                apart=True,
            )
            if label != directory:
                report = report.with_root(label)  # the archive, not its temporary copy
            output = render(report, values["output_format"], values["show_all"])
    except (UsageProblem, RootError, ConfigError, RegistrationError, CatalogueError, ArchiveError) as problem:
        return error(str(problem))
    sys.stdout.write(output)
    code = exit_code(report.findings, node.config.unknown_policy)
    if code is ExitCode.OK and report.findings and all(f.status is Status.UNKNOWN for f in report.findings):
        # Nothing was decided (a deadline spent before any probe answered, a root of nothing):
        # that is no verdict, not a healthy node.
        first = report.findings[0]
        return error(f"no verdict: every check is unknown ({first.reference_id}: {printable(first.reason, 200)})")
    return code


NODE = Command(
    path=("node",),
    help="""Inspect this node (or --root) and report catalogued misconfigurations.

    Exit codes: 0 nothing at warning or above, 1 warnings, 2 errors or critical,
    3 no verdict (bad arguments, unreadable root, broken config or plugin, every check unknown).
    """,
    run=run_node,
    options=(
        ROOT,
        CONFIG,
        Option("--select", "select", "Only these references: ID prefixes or symbols, comma-separated.", kind="tokens"),
        Option("--ignore", "ignore", "Skip these references: ID prefixes or symbols.", kind="tokens"),
        Option("--profile", "profile", "prolog (fast subset) or full (default: the config's [run] profile, full)."),
        Option("--format", "output_format", "table, json, prometheus or junit.", default="table"),
        Option("--timeout", "timeout", "Deadline for the whole run, seconds (default: the config's [run] timeout, 10 s).", kind="number"),
        Option("--show-all", "show_all", "Also list absent and not-applicable references.", kind="flag"),
        CHECKS_DIR,
    ),
    fast=True,
    probe_threads=True,
)
COMMANDS = (NODE,)
