"""The typer application, built from the command declarations (:mod:`preflight.cli.spec`): help,
errors and every command the fast entry does not take."""

from __future__ import annotations

import importlib
import inspect
import sys
from typing import Any, List, NoReturn, Optional

import typer

from preflight import __version__
from preflight.cli.spec import COMMAND_MODULES, Command, Values, finish, finish_values
from preflight.exitcodes import ExitCode

#: -h as well as --help, as most tools take it
_HELP_OPTIONS = {"help_option_names": ["-h", "--help"]}
#: the value type typer converts to, by option kind; ``None`` defaults make the value optional
_TYPES: dict[str, Any] = {"text": str, "number": float, "integer": int, "flag": bool, "many": List[str], "tokens": List[str]}


def _parameters(command: Command) -> list[inspect.Parameter]:
    parameters = []
    argument = command.argument
    if argument is not None:
        default = typer.Argument(... if argument.required else None, metavar=argument.metavar, help=_paragraphs(argument.help))
        annotation: Any = List[str] if argument.many else (str if argument.required else Optional[str])
        parameters.append(inspect.Parameter(argument.field, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation))
    for option in command.options:
        value = {"flag": False, "many": [], "tokens": []}.get(option.kind, option.default)
        annotation = _TYPES[option.kind]
        if value is None:
            annotation = Optional[annotation]
        info = typer.Option(value, option.flag, help=_paragraphs(option.help), envvar=option.envvar, show_envvar=False, min=option.minimum)
        parameters.append(inspect.Parameter(option.field, inspect.Parameter.KEYWORD_ONLY, default=info, annotation=annotation))
    return parameters


def _callback(command: Command) -> Any:
    def callback(**raw: Any) -> None:
        values: Values = finish_values(command, raw)
        code = command.run(values)
        if command.probe_threads:
            finish(code)
        raise typer.Exit(code)

    parameters = _parameters(command)
    callback.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]
    callback.__annotations__ = {p.name: p.annotation for p in parameters}
    callback.__name__ = callback.__qualname__ = "_".join(command.path)
    return callback


def _paragraphs(text: str) -> str:
    """``text`` with each paragraph on one line: typer's rich help keeps a docstring's line breaks,
    so a paragraph wrapped at 100 columns in the source came out broken mid-sentence at 80. Square
    brackets are escaped: rich would take ``[slurm]`` for a style and drop it."""
    from rich.markup import escape

    return "\n\n".join(escape(" ".join(paragraph.split())) for paragraph in inspect.cleandoc(text).split("\n\n"))


def _version(value: bool) -> None:
    if value:
        typer.echo(f"preflight {__version__}")
        raise typer.Exit(0)


def build_app() -> typer.Typer:
    app = typer.Typer(
        help="Find GPU/RDMA node misconfigurations before a job starts.",
        no_args_is_help=True,
        add_completion=True,  # --install-completion, --show-completion (bash, zsh, fish, PowerShell)
        pretty_exceptions_enable=False,
        context_settings=_HELP_OPTIONS,
    )

    @app.callback()
    def main(
        version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version and exit."),
    ) -> None:
        """preflight: catalogued GPU/RDMA misconfigurations, with evidence and a fix."""

    groups: dict[str, typer.Typer] = {}
    for module_name in COMMAND_MODULES.values():
        module = importlib.import_module(module_name)
        for command in module.COMMANDS:
            target = app
            if len(command.path) == 2:
                group = command.path[0]
                if group not in groups:
                    groups[group] = typer.Typer(help=_paragraphs(module.GROUP_HELP), no_args_is_help=True, context_settings=_HELP_OPTIONS)
                    app.add_typer(groups[group], name=group)
                target = groups[group]
            target.command(command.path[-1], help=_paragraphs(command.help), context_settings=_HELP_OPTIONS)(_callback(command))
    return app


def _usage_exit(arguments: list[str]) -> int:
    """The exit code of a command line the CLI refuses. A job's prolog or epilog exits 0: slurmd
    drains the node and requeues the job on any other code (slurm.conf(5), Prolog), and a typo
    in a site's own prolog script must not drain the fleet (docs/operators/slurm.md)."""
    if arguments[:1] == ["slurm"] and arguments[1:2] in (["prolog"], ["epilog"]):
        print(f"preflight: no verdict ({arguments[1]}): the command line above was not understood", file=sys.stderr)
        return ExitCode.OK
    return ExitCode.NO_VERDICT


def run_app(arguments: list[str]) -> NoReturn:
    """Run the typer application on ``arguments``; exits the process."""
    try:
        result = build_app()(args=arguments, prog_name="preflight", standalone_mode=False)
    except Exception as error:
        # The CLI framework's usage errors carry show() and exit_code (click's exit code 2
        # would collide with "errors present"); everything else is a real bug and propagates.
        show = getattr(error, "show", None)
        if callable(show) and hasattr(error, "exit_code"):
            show()
            sys.exit(_usage_exit(arguments))
        if type(error).__name__ == "Abort":
            sys.exit(ExitCode.NO_VERDICT)
        raise
    sys.exit(result if isinstance(result, int) else 0)
