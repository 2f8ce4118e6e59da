"""The console entry ``preflight``.

The commands that run before every job (``node``, ``slurm prolog|epilog|healthcheck``) and the
fleet audit are parsed here, from their declarations, without importing typer (~250 ms with
pydantic and rich). Everything else, and anything the fast parser does not fully understand,
goes to the typer application built from the same declarations (:mod:`preflight.cli.app`).
"""

from __future__ import annotations

import importlib
import sys
from typing import NoReturn

from preflight.cli.spec import COMMAND_MODULES, Command, finish, parse


def declared(word: str) -> tuple[Command, ...]:
    """The commands declared under the first word ``word`` (none for an unknown word)."""
    module = COMMAND_MODULES.get(word)
    return importlib.import_module(module).COMMANDS if module else ()


def fast_command(arguments: list[str]) -> tuple[Command, list[str]] | None:
    """The fast command ``arguments`` name, and the arguments after its name."""
    for command in declared(arguments[0]) if arguments else ():
        if command.fast and arguments[: len(command.path)] == list(command.path):
            return command, arguments[len(command.path):]
    return None


def main(argv: list[str] | None = None) -> NoReturn:
    """Run ``preflight``; exits the process."""
    arguments = list(sys.argv[1:] if argv is None else argv)
    found = fast_command(arguments)
    if found is not None:
        command, rest = found
        values = parse(command, rest)
        if values is not None:
            finish(command.run(values))
    from preflight.cli.app import run_app

    run_app(arguments)
