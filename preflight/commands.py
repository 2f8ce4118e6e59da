"""What the commands do, independent of how their arguments were parsed.

Both the typer CLI (``preflight.cli``) and the launcher's fast path for ``preflight node``
(``preflight.launcher``) call :func:`run_node`, so the two cannot drift apart in behaviour.
"""

from __future__ import annotations

import math
import os
import sys
import threading
import time
from dataclasses import replace

from preflight.catalogue import CatalogueError, load_all, load_reference
from preflight.config import DEFAULT_CONFIG_PATH, ConfigError, HostConfig, parse_config
from preflight.engine import Report, RunOptions, run, select_checks, selects
from preflight.exitcodes import ExitCode, exit_code
from preflight.launcher import split_tokens
from preflight.records import frozen
from preflight.registry import PROFILES, RegistrationError, Registry
from preflight.sources import NodeFS, RootError, SourceError, Sources, open_root
from preflight.sources.archive import ArchiveError, is_archive, opened_root

OUTPUT_FORMATS = ("table", "json", "prometheus", "junit")


@frozen
class NodeArgs:
    """Arguments of ``preflight node``; ``None`` means "take the config's value"."""

    root: str = "/"
    config: str | None = None
    select: tuple[str, ...] = ()
    ignore: tuple[str, ...] = ()
    profile: str | None = None
    output_format: str = "table"
    timeout: float | None = None
    show_all: bool = False
    checks_dirs: tuple[str, ...] = ()


class UsageProblem(Exception):
    """The command cannot run as asked; the message is shown to the user as is."""


def _hostname(fs: NodeFS) -> str:
    try:
        text = fs.read("/proc/sys/kernel/hostname")
    except SourceError:
        text = None
    return (text or "").strip() or "unknown"


def load_host_config(path: str | None, hostname: str) -> HostConfig:
    """``--config FILE``, else ``/etc/preflight/preflight.toml`` of the machine preflight runs on.

    Never a config inside ``--root``: a recorded root or snapshot is evidence from someone else's
    node, and its config would choose check directories to import and servers to query."""
    target = os.path.abspath(path) if path is not None else DEFAULT_CONFIG_PATH
    try:
        text = NodeFS("/").read(target, max_bytes=1024 * 1024)
    except SourceError as error:
        raise ConfigError(f"{path or DEFAULT_CONFIG_PATH}: {error.reason}") from None
    if text is None:
        if path is not None:
            raise ConfigError(f"--config {path}: no such file")
        return HostConfig()
    return parse_config(text, path or DEFAULT_CONFIG_PATH, hostname)


def _check_tokens(select: tuple[str, ...], ignore: tuple[str, ...]) -> None:
    if not (select or ignore):
        return
    references = load_all()
    for token in (*select, *ignore):
        if not any(selects(token, reference) for reference in references):
            raise UsageProblem(f"--select/--ignore {token!r} matches no reference ID prefix or symbol")


def run_node(args: NodeArgs) -> int:
    """``preflight node``: print the report, return the exit code. Never raises. ``--root`` may
    name a snapshot archive, replayed from a private temporary copy removed afterwards."""
    from preflight.reporters import render

    try:
        if args.output_format not in OUTPUT_FORMATS:
            raise UsageProblem(f"--format {args.output_format!r}: choose one of {', '.join(OUTPUT_FORMATS)}")
        if args.profile is not None and args.profile not in PROFILES:
            raise UsageProblem(f"--profile {args.profile!r}: choose one of {', '.join(PROFILES)}")
        if args.timeout is not None and not 0 < args.timeout < math.inf:
            raise UsageProblem("--timeout must be a positive number of seconds")
        begin = time.monotonic()
        with opened_root(args.root, begin + unpack_budget(args.root, args.timeout, args.config)) as (directory, label):
            report, unknown_policy = _judge(args, directory, time.monotonic() - begin)
            if label != directory:
                report = replace(report, root=label)  # the archive, not its temporary copy
            output = render(report, args.output_format, args.show_all)
    except (UsageProblem, RootError, ConfigError, RegistrationError, CatalogueError, ArchiveError) as error:
        print(f"preflight: error: {error}", file=sys.stderr)
        return ExitCode.NO_VERDICT
    sys.stdout.write(output)
    return exit_code(report.findings, unknown_policy)


def unpack_budget(root: str, timeout: float | None, config_path: str | None) -> float:
    """Seconds a snapshot archive may take to unpack: the run's whole ``--timeout`` (or the
    config's), of which the run gets what is left. Nothing is read for a directory root."""
    if timeout is not None:
        return timeout
    if not is_archive(root):
        return math.inf
    return load_host_config(config_path, "").timeout_s


def _judge(args: NodeArgs, root: str, spent: float = 0.0) -> tuple[Report, str]:
    """One engine run on the directory ``root``; the report and the site's unknown policy.
    ``spent``: seconds of the run's timeout already used (unpacking a snapshot)."""
    from preflight.discovery import build_registry

    fs = open_root(root)
    hostname = _hostname(fs)
    config = load_host_config(args.config, hostname)
    sources = Sources.for_fs(fs, config.dns)
    profile = args.profile or config.profile
    registry = build_registry((*config.checks_dirs, *args.checks_dirs), profile=profile)
    _check_tokens(args.select, args.ignore)
    timeout = (args.timeout if args.timeout is not None else config.timeout_s) - spent
    if timeout <= 0:
        raise UsageProblem("unpacking the snapshot used the whole --timeout")
    options = RunOptions(
        profile=profile,
        select=args.select,
        ignore=args.ignore,
        timeout_s=timeout,
        probe_timeout_s=min(config.probe_timeout_s, timeout),
    )
    checks = select_checks(registry, config, options)
    if not checks:
        # Every check, so that the reason can name the profile a skipped check runs in.
        everything = registry if profile == "full" else build_registry((*config.checks_dirs, *args.checks_dirs))
        raise UsageProblem(nothing_to_run(everything, config, options))
    return run(registry, sources, config, options, hostname, checks), config.unknown_policy


def nothing_to_run(registry: Registry, config: HostConfig, options: RunOptions) -> str:
    """Why a run would decide no reference, for each one ``--select`` names (every check without
    it): a report of zero checks would read as a healthy node."""
    if options.select:
        named = [r for r in load_all() if any(selects(token, r) for token in options.select)]
    else:
        named = [load_reference(ref_id) for ref_id in sorted(registry.checks)]
    reasons: dict[str, list[str]] = {}
    for reference in named:
        spec = registry.checks.get(reference.id)
        if spec is None:
            why = "no node check" + (" (preflight explain finds it in logs)" if reference.signatures else "")
        elif options.profile not in spec.profiles:
            why = f"not in the {options.profile} profile (runs in: {', '.join(spec.profiles)})"
        elif reference.id in config.disabled:
            why = f"disabled by {config.origin}"
        else:
            why = "removed by --ignore " + ",".join(token for token in options.ignore if selects(token, reference))
        reasons.setdefault(why, []).append(reference.id)
    shown = [", ".join(ids[:6]) + (f" and {len(ids) - 6} more" if len(ids) > 6 else "") + f": {why}" for why, ids in reasons.items()]
    return "no check left to run: " + "; ".join(shown)


def finish(code: int) -> None:
    """Exit, without waiting for probe threads stuck in the kernel (they are daemon threads,
    but interpreter shutdown can still block on a thread holding a C-level lock)."""
    stuck = [thread for thread in threading.enumerate() if thread.name.startswith("probe-") and thread.is_alive()]
    if stuck:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
