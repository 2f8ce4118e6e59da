"""Console entry point ``preflight``.

The prolog runs ``preflight node`` (or ``preflight slurm prolog``) before every job, and typer
costs ~250 ms to import (it pulls in pydantic and rich), about 15x a bare interpreter. So this
module parses the common, well-formed ``preflight node ...``, ``preflight slurm
prolog|epilog|healthcheck ...`` and ``preflight fleet ...`` command lines itself and calls
:func:`preflight.commands.run_node`, :func:`preflight.slurm.run_slurm` or
:func:`preflight.fleet.run_fleet` directly. Anything it does not fully understand (``--help``,
a typo, a missing value, any other command) goes to the typer application, which prints proper
help and errors. Tests keep the option sets here equal to the typer commands'.
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

# option -> (SlurmArgs field, takes a value, repeatable); the same for prolog, epilog, healthcheck
SLURM_OPTIONS: dict[str, tuple[str, bool, bool]] = {
    "--root": ("root", True, False),
    "--config": ("config", True, False),
    "--timeout": ("timeout", True, False),
    "--checks-dir": ("checks_dirs", True, True),
}
SLURM_FAST_MODES = ("prolog", "epilog", "healthcheck")

# option -> (field, takes a value, repeatable) for ``preflight fleet``; the rest are report paths.
# A fleet audit of 10,000 reports has a 3 s budget, and typer's import would be a tenth of it.
FLEET_OPTIONS: dict[str, tuple[str, bool, bool]] = {
    "--format": ("output_format", True, False),
    "--output": ("output", True, False),
    "--ignore-fact": ("ignore_fact", True, True),
    "--node-names": ("node_names", True, False),
}

Parsed = dict[str, str | bool | list[str]]


def split_tokens(values: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """``--select MEM,GDR001 --select dns`` -> ``("MEM", "GDR001", "dns")``."""
    return tuple(token.strip() for value in values for token in value.split(",") if token.strip())


def parse_node_args(argv: list[str]) -> Parsed | None:
    """Options after ``node`` by NodeArgs field, or None to let typer handle it."""
    return parse_options(argv, NODE_OPTIONS)


def parse_options(
    argv: list[str], options: dict[str, tuple[str, bool, bool]], positional: str | None = None
) -> Parsed | None:
    """Options by field name, or None when anything is not a well-formed known option. With
    ``positional``, other arguments (anywhere, as click allows) are collected under that name;
    one that starts with "-" still counts as an unknown option."""
    values: dict[str, str | bool | list[str]] = {}
    arguments: list[str] = []
    index = 0
    while index < len(argv):
        item = argv[index]
        if positional is not None and not item.startswith("-"):
            arguments.append(item)
            index += 1
            continue
        name, has_inline, inline = item.partition("=")
        spec = options.get(name)
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
    if positional is not None:
        values[positional] = arguments
    return values


def _fast_node(argv: list[str]) -> int | None:
    parsed = parse_node_args(argv)
    if parsed is None:
        return None
    from preflight.commands import NodeArgs, run_node

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


def _fast_slurm(mode: str, argv: list[str]) -> int | None:
    parsed = parse_options(argv, SLURM_OPTIONS)
    if parsed is None:
        return None
    root, config, timeout_text = parsed.get("root", "/"), parsed.get("config"), parsed.get("timeout")
    checks_dirs = parsed.get("checks_dirs", [])
    timeout: float | None = None
    if isinstance(timeout_text, str):
        try:
            timeout = float(timeout_text)
        except ValueError:
            return None  # typer reports the bad number properly
    from preflight.slurm import SlurmArgs, run_slurm

    return run_slurm(
        SlurmArgs(
            mode=mode,
            root=root if isinstance(root, str) else "/",
            config=config if isinstance(config, str) else None,
            timeout=timeout,
            checks_dirs=tuple(checks_dirs) if isinstance(checks_dirs, list) else (),
        )
    )


def _fast_fleet(argv: list[str]) -> int | None:
    parsed = parse_options(argv, FLEET_OPTIONS, positional="inputs")
    if parsed is None or not parsed["inputs"]:
        return None  # typer explains what is missing
    from preflight.fleet import run_fleet

    output_format, output = parsed.get("output_format", "table"), parsed.get("output")
    inputs, ignored = parsed["inputs"], parsed.get("ignore_fact", [])
    node_names = parsed.get("node_names", "host")
    return run_fleet(
        inputs if isinstance(inputs, list) else [],
        output_format if isinstance(output_format, str) else "table",
        output if isinstance(output, str) else None,
        split_tokens(ignored if isinstance(ignored, list) else []),
        node_names=node_names if isinstance(node_names, str) else "host",
    )


def main(argv: list[str] | None = None) -> None:
    """Run ``preflight``; exits the process."""
    arguments = list(sys.argv[1:] if argv is None else argv)
    code: int | None = None
    if arguments[:1] == ["node"]:
        code = _fast_node(arguments[1:])
    elif arguments[:1] == ["slurm"] and len(arguments) > 1 and arguments[1] in SLURM_FAST_MODES:
        code = _fast_slurm(arguments[1], arguments[2:])
    elif arguments[:1] == ["fleet"]:
        code = _fast_fleet(arguments[1:])
        if code is not None:
            sys.exit(code)  # the fleet starts no probe threads: nothing to wait for
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
