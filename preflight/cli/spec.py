"""Every command and option of ``preflight``, declared once.

Each command module (``preflight/cli/node.py``, ``slurm.py``, ...) declares its commands as
:class:`Command` values. Two readers use the same declarations:

* :mod:`preflight.cli.start`, the console entry, parses the commands that run before every job
  (``node``, ``slurm prolog|epilog|healthcheck``, ``fleet``) itself: typer costs ~250 ms to import,
  more than the whole prolog budget;
* :mod:`preflight.cli.app` builds the typer application from them, for help, completion, errors
  and every other command.

Anything the fast parser does not fully understand (``--help``, a typo, a missing or malformed
value) goes to typer, which explains it; both then call the same ``run`` function.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from msgspec import Struct

from preflight.exitcodes import ExitCode

#: How an option's value is read: one string, a float, an int, a switch, a repeatable string, or
#: a repeatable comma-separated list of tokens (``--select MEM,GDR001 --select dns``).
KINDS = ("text", "number", "integer", "flag", "many", "tokens")


class Option(Struct, frozen=True):
    flag: str  # "--root"
    field: str  # the name the command's run function receives
    help: str
    kind: str = "text"
    default: Any = None  # for text/number/integer; flags default to False, many/tokens to ()
    minimum: int | None = None  # integers only
    envvar: str | None = None  # typer only: the fast path never reads the environment


class Argument(Struct, frozen=True):
    field: str
    metavar: str
    help: str
    many: bool = False
    required: bool = True


class Command(Struct, frozen=True):
    path: tuple[str, ...]  # ("node",), ("slurm", "prolog")
    help: str  # first line: the summary; the rest, e.g. exit codes, shows in --help
    run: Callable[[dict[str, Any]], int]
    options: tuple[Option, ...] = ()
    argument: Argument | None = None
    fast: bool = False  # start.py may parse it without typer
    probe_threads: bool = False  # its runs start probe threads: exit through finish()


Values = dict[str, Any]

#: first word of the command line -> the module that declares its commands (``COMMANDS``), in
#: the order ``preflight --help`` lists them
COMMAND_MODULES = {
    "node": "preflight.cli.node",
    "snapshot": "preflight.cli.snapshot",
    "explain": "preflight.cli.explain",
    "references": "preflight.cli.references",
    "probes": "preflight.cli.probes",
    "fleet": "preflight.cli.fleet",
    "slurm": "preflight.cli.slurm",
}


def finish(code: int) -> NoReturn:
    """Exit, without waiting for probe threads stuck in the kernel (they are daemon threads,
    but interpreter shutdown can still block on a thread holding a C-level lock)."""
    stuck = [thread for thread in threading.enumerate() if thread.name.startswith("probe-") and thread.is_alive()]
    if stuck:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def split_tokens(values: Sequence[str]) -> tuple[str, ...]:
    """``--select MEM,GDR001 --select dns`` -> ``("MEM", "GDR001", "dns")``."""
    return tuple(token.strip() for value in values for token in value.split(",") if token.strip())


def defaults(command: Command) -> Values:
    values: Values = {}
    for option in command.options:
        values[option.field] = {"flag": False, "many": (), "tokens": ()}.get(option.kind, option.default)
    if command.argument is not None:
        values[command.argument.field] = () if command.argument.many else None
    return values


class OptionNamesNothing(Exception):
    """A list option given with nothing in it (``--scrub ""`` from an unset shell variable): it
    would act as if it were not given (a snapshot left unscrubbed, every check selected). Shown
    and exited on like the CLI framework's usage errors (:func:`preflight.cli.app.run_app`)."""

    exit_code = 2

    def show(self) -> None:
        print(f"preflight: error: {self}", file=sys.stderr)


def finish_values(command: Command, raw: Values) -> Values:
    """Values as the run function receives them, whichever parser read them: repeatable options
    as tuples, token lists split at commas. OptionNamesNothing for a list option given empty."""
    values = defaults(command)
    for option in command.options:
        value = raw.get(option.field)
        if value is None:
            continue
        if option.kind == "tokens":
            given = list(value)
            value = split_tokens(given)
            if given and not value:
                shown = " ".join(f"{option.flag} {item!r}" for item in given)
                raise OptionNamesNothing(f"{shown} names nothing (a comma-separated list was expected)")
        elif option.kind == "many":
            value = tuple(value)
        values[option.field] = value
    if command.argument is not None and raw.get(command.argument.field) is not None:
        value = raw[command.argument.field]
        values[command.argument.field] = tuple(value) if command.argument.many else value
    return values


def parse(command: Command, argv: Sequence[str]) -> Values | None:
    """The fast parser: values by field, or None when anything is not a well-formed known option
    or argument (typer then explains). Arguments may come anywhere, as click allows; one that
    starts with "-" still counts as an unknown option, except "-" itself (stdin, for click too)."""
    by_flag = {option.flag: option for option in command.options}
    raw: Values = {}
    arguments: list[str] = []
    index = 0
    while index < len(argv):
        item = argv[index]
        if command.argument is not None and (item == "-" or not item.startswith("-")):  # "-": stdin
            arguments.append(item)
            index += 1
            continue
        flag, has_inline, inline = item.partition("=")
        option = by_flag.get(flag)
        if option is None:
            return None
        if option.kind == "flag":
            if has_inline:
                return None
            raw[option.field] = True
            index += 1
            continue
        if has_inline:
            text, index = inline, index + 1
        elif index + 1 < len(argv):
            text, index = argv[index + 1], index + 2
        else:
            return None
        value = _converted(option, text)
        if value is None:
            return None
        if option.kind in ("many", "tokens"):
            raw[option.field] = [*raw.get(option.field, []), value]
        elif option.field in raw:
            return None  # given twice: typer's rules decide
        else:
            raw[option.field] = value
    if command.argument is not None:
        if command.argument.required and not arguments:
            return None
        if len(arguments) > 1 and not command.argument.many:
            return None
        raw[command.argument.field] = arguments if command.argument.many else (arguments[0] if arguments else None)
    try:
        return finish_values(command, raw)
    except OptionNamesNothing:
        return None  # typer's path raises it again, and says so


def _converted(option: Option, text: str) -> Any:
    try:
        if option.kind == "number":
            return float(text)
        if option.kind == "integer":
            number = int(text)
            return None if option.minimum is not None and number < option.minimum else number
    except ValueError:
        return None
    return text


def error(message: str) -> int:
    """Say why the command gave up, the way every command does, and return the exit code."""
    print(f"preflight: error: {message}", file=sys.stderr)
    return ExitCode.NO_VERDICT


def values_for(command: Command, **given: Any) -> Values:
    """A command's values as its run function receives them: the declared defaults, then
    ``given`` (for callers that run a command in-process, such as tests and benchmarks)."""
    unknown = set(given) - set(defaults(command))
    if unknown:
        raise TypeError(f"{' '.join(command.path)} has no options {sorted(unknown)}")
    return {**defaults(command), **given}
