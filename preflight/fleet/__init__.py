"""``preflight fleet REPORT... | DIR``: aggregate node reports and find the odd one out.

* :mod:`preflight.fleet.load` reads reports as untrusted input;
* :mod:`preflight.fleet.facts` is the table of compared facts (one line each);
* :mod:`preflight.fleet.compare` groups nodes by hardware class and decides disagreements;
* :mod:`preflight.fleet.render` writes the table and the JSON (``preflight-fleet/1``);
* :mod:`preflight.fleet.pages` writes Markdown and a static HTML page (nodes x references).
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import tempfile
from collections.abc import Iterator, Sequence

from preflight.exitcodes import ExitCode
from preflight.fleet.compare import Fleet, build_fleet, fleet_exit_code
from preflight.fleet.facts import FACTS
from preflight.fleet.load import MAX_REPORT_BYTES, NODE_NAMES, file_identity, load_reports
from preflight.fleet.render import printable, render_json, render_table

FLEET_FORMATS = ("table", "json", "markdown", "html")

__all__ = ["FLEET_FORMATS", "Fleet", "audit", "run_fleet"]


class FleetUsageError(Exception):
    """The command cannot run as asked."""


def audit(
    inputs: Sequence[str], ignore_facts: Sequence[str] = (), max_bytes: int = MAX_REPORT_BYTES, node_names: str = "host"
) -> Fleet:
    known = {fact.key for fact in FACTS}
    unknown = [key for key in ignore_facts if key not in known]
    if unknown:
        raise FleetUsageError(f"--ignore-fact {', '.join(unknown)}: not a compared fact (choose from {', '.join(sorted(known))})")
    if node_names not in NODE_NAMES:
        raise FleetUsageError(f"--node-names {node_names!r}: choose one of {', '.join(NODE_NAMES)}")
    nodes, skipped = load_reports(inputs, max_bytes, node_names=node_names)
    return build_fleet(nodes, skipped, ignore_facts)


@contextlib.contextmanager
def _cyclic_gc_paused() -> Iterator[None]:
    """An audit and its rendering make millions of objects and no reference cycles: the cyclic
    collector would walk them again and again (about a tenth of a 10,000-node audit) and free
    nothing. Reference counting still frees everything; forked workers inherit the pause."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _write(path: str, text: str) -> None:
    """Replace ``path`` whole, so that a reader never sees half a report."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, temporary = tempfile.mkstemp(prefix=".fleet-", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.chmod(temporary, 0o644)
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise


def run_fleet(
    inputs: Sequence[str],
    output_format: str = "table",
    output: str | None = None,
    ignore_facts: Sequence[str] = (),
    max_bytes: int = MAX_REPORT_BYTES,
    node_names: str = "host",
) -> int:
    """The command: write the fleet report, return the exit code (see :func:`fleet_exit_code`)."""
    try:
        if output_format not in FLEET_FORMATS:
            raise FleetUsageError(f"--format {output_format!r}: choose one of {', '.join(FLEET_FORMATS)}")
        if not inputs:
            raise FleetUsageError("give report files or a directory of them")
        with _cyclic_gc_paused():
            fleet = audit(inputs, ignore_facts, max_bytes, node_names)
            text = render(fleet, output_format)
    except FleetUsageError as error:
        print(f"preflight: error: {error}", file=sys.stderr)
        return ExitCode.NO_VERDICT
    for skipped in fleet.skipped:
        print(f"preflight fleet: skipped {printable(skipped.file, 300)}: {printable(skipped.reason, 300)}", file=sys.stderr)
    if not fleet.nodes:
        print("preflight: error: no usable node report"
              + (f" among {len(fleet.skipped)} files" if fleet.skipped else " (no *.json files found)"), file=sys.stderr)
    overwritten = _input_at(output, fleet) if output else None
    if overwritten is not None:
        print(f"preflight: error: --output {output} is the report {overwritten} that was compared; write the fleet report elsewhere", file=sys.stderr)
        return ExitCode.NO_VERDICT
    if output:
        try:
            _write(output, text)
        except OSError as error:
            print(f"preflight: error: --output {output}: {error.strerror or error}", file=sys.stderr)
            return ExitCode.NO_VERDICT
    else:
        _print(text, output_format)
    return fleet_exit_code(fleet)


def _input_at(output: str, fleet: Fleet) -> str | None:
    """The node report file (usable or not) that ``output`` names, which writing would destroy;
    an earlier fleet report there may be replaced."""
    if not os.path.lexists(output):
        return None
    target = file_identity(output)
    read = [node.file for node in fleet.nodes] + [skipped.file for skipped in fleet.skipped if not skipped.fleet_document]
    return next((file for file in read if file_identity(file) == target), None)


def _print(text: str, output_format: str) -> None:
    """JSON is UTF-8 whatever the locale says (RFC 8259): a node's non-ASCII text must not
    fail on a terminal set to another encoding."""
    binary = getattr(sys.stdout, "buffer", None)
    if output_format == "json" and binary is not None:
        sys.stdout.flush()
        binary.write(text.encode("utf-8"))  # dumps() leaves no lone surrogate
        binary.flush()
    else:
        sys.stdout.write(text)


def render(fleet: Fleet, output_format: str) -> str:
    """``output_format``: table, json, markdown or html."""
    if output_format == "json":
        return render_json(fleet)
    if output_format in ("markdown", "html"):
        from preflight.fleet.pages import render_html, render_markdown

        return render_markdown(fleet) if output_format == "markdown" else render_html(fleet)
    return render_table(fleet)
