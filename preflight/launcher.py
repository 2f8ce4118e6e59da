"""Console entry point ``preflight``.

The prolog runs ``preflight node`` before every job, and typer costs ~250 ms to import (it pulls
in pydantic and rich), about 15x a bare interpreter. So this module parses the common, well-formed
``preflight node ...`` command lines itself and calls :func:`preflight.commands.run_node`
directly. Anything it does not fully understand (``--help``, a typo, a missing value, any other
command) goes to the typer application, which prints proper help and errors. A test keeps the
option set here equal to the typer command's.
"""

from __future__ import annotations

import sys

# option -> (NodeArgs field, takes a value, repeatable)
NODE_OPTIONS: dict[str, tuple[str, bool, bool]] = {
    "--root": ("root", True, False),
    "--config": ("config", True, False),
    "--select": ("select", True, True),
    "--ignore": ("ignore", True, True),
    "--profile": ("profile", True, False),
    "--format": ("output_format", True, False),
    "--timeout": ("timeout", True, False),
    "--show-all": ("show_all", False, False),
    "--checks-dir": ("checks_dirs", True, True),
}


def parse_node_args(argv: list[str]) -> dict[str, str | bool | list[str]] | None:
    """Options after ``node`` by NodeArgs field, or None to let typer handle it."""
    values: dict[str, str | bool | list[str]] = {}
    index = 0
    while index < len(argv):
        item = argv[index]
        name, has_inline, inline = item.partition("=")
        spec = NODE_OPTIONS.get(name)
        if spec is None:
            return None
        field, takes_value, repeatable = spec
        if not takes_value:
            if has_inline:
                return None
            values[field] = True
            index += 1
            continue
        if has_inline:
            value = inline
            index += 1
        elif index + 1 < len(argv):
            value = argv[index + 1]
            index += 2
        else:
            return None
        if repeatable:
            existing = values.get(field, [])
            values[field] = [*existing, value] if isinstance(existing, list) else [value]
        elif field in values:
            return None
        else:
            values[field] = value
    return values


def _fast_node(argv: list[str]) -> int | None:
    parsed = parse_node_args(argv)
    if parsed is None:
        return None
    from preflight.commands import NodeArgs, run_node, split_tokens

    def text(field: str) -> str | None:
        value = parsed.get(field)
        return value if isinstance(value, str) else None

    def texts(field: str) -> list[str]:
        value = parsed.get(field)
        return value if isinstance(value, list) else []

    timeout: float | None = None
    if "timeout" in parsed:
        try:
            timeout = float(text("timeout") or "")
        except ValueError:
            return None  # typer reports the bad number properly
    args = NodeArgs(
        root=text("root") or "/",
        config=text("config"),
        select=split_tokens(texts("select")),
        ignore=split_tokens(texts("ignore")),
        profile=text("profile"),
        output_format=text("output_format") or "table",
        timeout=timeout,
        show_all=parsed.get("show_all") is True,
        checks_dirs=tuple(texts("checks_dirs")),
    )
    return run_node(args)


def main(argv: list[str] | None = None) -> None:
    """Run ``preflight``; exits the process."""
    arguments = list(sys.argv[1:] if argv is None else argv)
    if arguments[:1] == ["node"]:
        code = _fast_node(arguments[1:])
        if code is not None:
            from preflight.commands import finish

            finish(code)
    _typer_main(arguments)


def _typer_main(arguments: list[str]) -> None:
    from preflight.cli import app
    from preflight.exitcodes import ExitCode

    try:
        result = app(args=arguments, prog_name="preflight", standalone_mode=False)
    except Exception as error:
        # The CLI framework's usage errors carry show() and exit_code (click's exit code 2
        # would collide with "errors present"); everything else is a real bug and propagates.
        show = getattr(error, "show", None)
        if callable(show) and hasattr(error, "exit_code"):
            show()
            sys.exit(ExitCode.NO_VERDICT)
        if type(error).__name__ == "Abort":
            sys.exit(ExitCode.NO_VERDICT)
        raise
    sys.exit(result if isinstance(result, int) else 0)
