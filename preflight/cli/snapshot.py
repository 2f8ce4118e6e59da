"""``preflight snapshot``: record what the checks read on a node into a replayable archive."""

from __future__ import annotations

from preflight.cli.node import CHECKS_DIR
from preflight.cli.spec import Argument, Command, Option, Values


def run_snapshot(values: Values) -> int:
    from preflight.snapshot import SnapshotArgs
    from preflight.snapshot import run_snapshot as record

    return record(SnapshotArgs(**values))


SNAPSHOT = Command(
    path=("snapshot",),
    help="""Record what the checks read on this node into OUT.tar.gz, to replay with
    `preflight node --root OUT.tar.gz` anywhere (bug reports, test fixtures).

    Exit codes: 0 written, 3 nothing written (bad arguments, unreadable root, unwritable OUT).
    """,
    run=run_snapshot,
    argument=Argument("output", "OUT.tar.gz", "Where to write the snapshot: a name ending in .tar.gz or .tgz."),
    options=(
        Option("--root", "root", "Record this recorded root (directory or snapshot) instead of the live node.", default="/"),
        Option("--config", "config", "Site config; it is stored in the snapshot as the node's own."),
        Option("--profile", "profile", "prolog or full (default: the config's [run] profile, full, which reads everything prolog does)."),
        Option("--scrub", "scrub", "Replace identifiers: hostnames,addresses,guids,macs,serials,users or all.", kind="tokens"),
        Option(
            "--scrub-key", "scrub_key",
            "Secret key of the scrub mapping; the same key maps the same value to the same placeholder on every node "
            "(default: a random key, consistent within this snapshot only). Also read from $PREFLIGHT_SCRUB_KEY.",
            envvar="PREFLIGHT_SCRUB_KEY",
        ),
        Option("--timeout", "timeout", "Deadline for the recording run, seconds (default: the config's [run] timeout, 10 s).", kind="number"),
        CHECKS_DIR,
    ),
    probe_threads=True,
)
COMMANDS = (SNAPSHOT,)
