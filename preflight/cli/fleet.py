"""``preflight fleet``: compare node reports across a fleet."""

from __future__ import annotations

from preflight.cli.spec import Argument, Command, Option, Values


def run_fleet(values: Values) -> int:
    from preflight.fleet import run_fleet as compare

    return compare(
        list(values["inputs"]), values["output_format"], values["output"], values["ignore_fact"], node_names=values["node_names"]
    )


FLEET = Command(
    path=("fleet",),
    help="""Aggregate node reports: which nodes have each reference present or unknown, and the odd
    one out within each hardware class (driver, firmware, NCCL, MTU, GID index, memlock, ACS...).

    Exit codes: 0 all agree and nothing at warning or above, 1 warnings present or a file
    skipped, 2 an error/critical finding present or a node is the odd one out (or a tie),
    3 no verdict (no usable report, bad arguments).
    """,
    run=run_fleet,
    argument=Argument("inputs", "REPORT|DIR", "`preflight node --format json` reports, or directories of *.json reports.", many=True, required=False),
    options=(
        Option("--format", "output_format", "table, json (schema preflight-fleet/1), markdown or html (one static page).", default="table"),
        Option("--output", "output", "Write the fleet report to FILE (replaced whole) instead of stdout."),
        Option("--ignore-fact", "ignore_fact", "Do not compare this fact (its key, as in the JSON), comma-separated.", kind="tokens"),
        Option(
            "--node-names", "node_names",
            "Name nodes by the host name in each report (host) or by the report's file name less .json (file: the "
            "inventory name, for reports the Ansible role collected).",
            default="host",
        ),
    ),
    # A fleet audit of 10,000 reports has a 3 s budget, and typer's import would be a tenth of it.
    fast=True,
)
COMMANDS = (FLEET,)
