"""The one place a node run is assembled: open the root, load the site config, build the registry
for the profile, choose the checks, run the engine.

``preflight node``, the Slurm prolog/epilog/health check, ``preflight snapshot`` and
``preflight explain --check`` all call :func:`open_node` and :func:`inspect_node`, so a new
option or rule of the run reaches every command at once.
"""

from __future__ import annotations

import math
import os

from msgspec import Struct

from preflight.config import DEFAULT_CONFIG_PATH, ConfigError, HostConfig, parse_config, seconds_problem
from preflight.engine import EarlyProbes, Report, RunOptions, run, select_checks, start_early
from preflight.model import selects
from preflight.registry import PROFILES, Registry
from preflight.sources import NodeFS, SourceError, Sources, open_root
from preflight.sources.archive import is_archive


class UsageProblem(Exception):
    """The command cannot run as asked; the message is shown to the user as is."""


class NothingToRun(UsageProblem):
    """The selection leaves no check to run; the message says why for each reference named."""


class OpenedNode(Struct, frozen=True):
    """A node root ready to be inspected: its files, its host name and the site config for it."""

    fs: NodeFS
    hostname: str
    config: HostConfig


def node_hostname(fs: NodeFS) -> str:
    """The node's host name as its kernel reports it; "unknown" when unreadable."""
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


def open_node(directory: str, config_path: str | None, fs: NodeFS | None = None) -> OpenedNode:
    """Open the root ``directory`` (or use ``fs``, e.g. a recording one, over it) and load the
    site config for its host name. Raises RootError or ConfigError."""
    opened = open_root(directory)
    fs = fs or opened
    hostname = node_hostname(fs)
    return OpenedNode(fs, hostname, load_host_config(config_path, hostname))


def unpack_budget(root: str, timeout: float | None, config_path: str | None) -> float:
    """Seconds a snapshot archive may take to unpack: the run's whole ``--timeout`` (or the
    config's), of which the run gets what is left. Nothing is read for a directory root."""
    if timeout is not None:
        return timeout
    if not is_archive(root):
        return math.inf
    return load_host_config(config_path, "").timeout_s


def check_profile(profile: str | None) -> None:
    if profile is not None and profile not in PROFILES:
        raise UsageProblem(f"--profile {profile!r}: choose one of {', '.join(PROFILES)}")


def check_timeout(timeout: float | None) -> None:
    if timeout is not None and seconds_problem(timeout):
        raise UsageProblem(f"--timeout {seconds_problem(timeout)}")


def inspect_node(
    node: OpenedNode,
    *,
    profile: str | None = None,
    timeout_s: float | None = None,
    select: tuple[str, ...] = (),
    ignore: tuple[str, ...] = (),
    checks_dirs: tuple[str, ...] = (),
    sources: Sources | None = None,
    apart: bool = False,
) -> Report:
    """One engine run on ``node``. ``profile`` and ``timeout_s`` default to the config's;
    ``checks_dirs`` add to the config's; ``apart``: probes in a child process the run can abandon
    (:mod:`preflight.apart`; the commands that must exit on time use it). Raises NothingToRun when the selection leaves no check,
    RegistrationError for a broken check module, CatalogueError for a broken catalogue."""

    config = node.config
    chosen_profile = profile or config.profile
    directories = (*config.checks_dirs, *checks_dirs)
    early = _start_early(node, config, chosen_profile, timeout_s, apart, sources) if not (select or ignore or directories) else None
    if early is None:
        return _inspect(node, chosen_profile, timeout_s, select, ignore, directories, sources, apart, None)
    try:
        return _inspect(node, chosen_profile, timeout_s, select, ignore, directories, early[1], apart, early[0])
    finally:
        early[0].apart.abandon()  # a run that stopped before its checks (a usage or catalogue error)


def _inspect(
    node: OpenedNode, chosen_profile: str, timeout_s: float | None, select: tuple[str, ...], ignore: tuple[str, ...],
    directories: tuple[str, ...], sources: Sources | None, apart: bool, early: EarlyProbes | None,
) -> Report:
    from preflight.discovery import build_registry

    config = node.config
    registry = build_registry(directories, profile=chosen_profile, select=select)
    if select or ignore:
        references = registry.references.all()
        for token in (*select, *ignore):
            if not any(selects(token, reference) for reference in references):
                raise UsageProblem(f"--select/--ignore {token!r} matches no reference ID prefix or symbol")
    timeout = timeout_s if timeout_s is not None else config.timeout_s
    if timeout <= 0:
        raise UsageProblem("the whole --timeout was spent before the checks started (opening the root, its config or snapshot)")
    options = RunOptions(
        profile=chosen_profile,
        select=select,
        ignore=ignore,
        timeout_s=timeout,
        probe_timeout_s=min(config.probe_timeout_s, timeout),
        apart=apart,
    )
    checks = select_checks(registry, config, options)
    if not checks:
        # Every check, so that the reason can name the profile a skipped check runs in.
        everything = registry if chosen_profile == "full" else build_registry(directories)
        raise NothingToRun(nothing_to_run(everything, config, options))
    sources = sources or Sources.for_fs(node.fs, config.dns)
    return run(registry, sources, config, options, node.hostname, checks, early)


def _start_early(
    node: OpenedNode, config: HostConfig, profile: str, timeout_s: float | None, apart: bool, sources: Sources | None
) -> tuple[EarlyProbes, Sources] | None:
    """The probes of ``profile`` started apart before the check modules are imported
    (:func:`preflight.engine.start_early`), for a run of the built-in checks alone: a
    ``--select``, a site directory or an installed plugin decides which probes are needed only
    once its modules are loaded, and such a run starts them afterwards as before."""
    from preflight.discovery import builtin_probe_registry, entry_point_specs

    timeout = timeout_s if timeout_s is not None else config.timeout_s
    if not apart or timeout <= 0 or entry_point_specs():
        return None
    options = RunOptions(profile=profile, timeout_s=timeout, probe_timeout_s=min(config.probe_timeout_s, timeout), apart=True)
    sources = sources or Sources.for_fs(node.fs, config.dns)
    started = start_early(builtin_probe_registry(profile), sources, config, options)
    return None if started is None else (started, sources)


def nothing_to_run(registry: Registry, config: HostConfig, options: RunOptions) -> str:
    """Why a run would decide no reference, for each one ``--select`` names (every check without
    it): a report of zero checks would read as a healthy node."""
    references = registry.references
    if options.select:
        named = [r for r in references.all() if any(selects(token, r) for token in options.select)]
    else:
        named = [references.get(ref_id) for ref_id in sorted(registry.checks)]
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
