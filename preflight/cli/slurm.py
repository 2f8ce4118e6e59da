"""``preflight slurm prolog|epilog|healthcheck|config``: run under Slurm."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from preflight.cli.node import CHECKS_DIR, CONFIG, ROOT
from preflight.cli.spec import Command, Option, Values, error

if TYPE_CHECKING:
    from preflight.slurm_conf import SlurmConf

GROUP_HELP = "Run under Slurm: prolog, epilog, health check; print slurm.conf lines."

_PROLOG_EXIT_CODES = (
    "Exit codes: 0 the job may run (also when preflight itself could not decide: the reason goes to stderr, "
    "syslog and the last-result file); 2 findings at or above the configured drain_severity are present: the "
    "node is drained (reason printed, sent to syslog, set with one bounded scontrol call), Slurm requeues a "
    "batch job held and cancels an srun job."
)
_EPILOG_EXIT_CODES = (
    "Exit codes: 0 nothing drains the node (also when preflight itself could not decide); 2 findings at or "
    "above the configured drain_severity are present: the node is drained with a preflight reason, unless it "
    "is already drained or down with a reason (the failed prolog's, an operator's), which is kept."
)
_TIMEOUT = Option(
    "--timeout", "timeout",
    "Budget for the whole run, scontrol included (default: the config's slurm.timeout, 8 s); cut to end 2 s before "
    "slurmd's kill (slurm.conf PrologTimeout, EpilogTimeout or PrologEpilogTimeout).",
    kind="number",
)
_HEALTHCHECK_TIMEOUT = Option(
    "--timeout", "timeout",
    "Budget for the whole run, scontrol included (default: the config's slurm.healthcheck_timeout, 50 s); cut to end "
    "2 s before slurmd's kill (slurm.conf HealthCheckTimeout, else 60 s).",
    kind="number",
)


def _job_mode(mode: str, help: str, timeout: Option) -> Command:
    """``preflight slurm MODE``: a run scoped to the job Slurm starts or ends (fast to start)."""

    def run(values: Values) -> int:
        from preflight.slurm import SlurmArgs, run_slurm

        return run_slurm(SlurmArgs(mode=mode, **values))

    run.__name__ = f"run_{mode}"
    return Command(("slurm", mode), help, run, options=(ROOT, CONFIG, timeout, CHECKS_DIR), fast=True, probe_threads=True)


def _interval_problem(interval_s: int, healthcheck_timeout_s: float, printed_timeout_s: int | None) -> str:
    """Why HealthCheckInterval cannot hold a health check ("" when it can): slurmd would start the
    next one before the last may finish; Slurm 26.05 also logs an error when the HealthCheckTimeout
    printed beside it is not below it."""
    if printed_timeout_s is not None and interval_s <= printed_timeout_s:
        return f"--interval {interval_s} must be longer than the HealthCheckTimeout={printed_timeout_s} printed for [slurm] healthcheck_timeout"
    if interval_s > healthcheck_timeout_s:
        return ""
    return f"--interval {interval_s} must be longer than [slurm] healthcheck_timeout ({healthcheck_timeout_s:g} s), the time one health check may take"


def _node_slurm_conf() -> SlurmConf | None:
    """This node's slurm.conf as Slurm reads it ($SLURM_CONF, else slurmd's own, else the default
    paths); None where none is found or read."""
    from preflight.slurm_conf import find_named_slurm_conf
    from preflight.sources import NodeFS

    return find_named_slurm_conf(NodeFS("/"), os.environ)[0]


def run_config(values: Values) -> int:
    """Print the slurm.conf lines and write or show the wrapper scripts."""
    import sys

    from preflight.config import ConfigError
    from preflight.run import load_host_config
    from preflight.slurm import (
        commented_wrappers,
        printed_healthcheck_timeout,
        preflight_program,
        prolog_timeout_problem,
        slurm_conf_lines,
        wrapper_dir_problem,
        wrapper_scripts,
        write_wrappers,
    )

    config, wrapper_dir, message_timeout = values["config"], values["wrapper_dir"], values["message_timeout"]
    try:
        settings = load_host_config(config, "").slurm
    except ConfigError as broken:
        return error(str(broken))
    problem = (
        prolog_timeout_problem(settings, message_timeout)
        or _interval_problem(values["interval"], settings.healthcheck_timeout_s, printed_healthcheck_timeout(settings))
        or (wrapper_dir_problem(wrapper_dir) if wrapper_dir is not None else "")
    )
    if problem:
        return error(problem)
    directory = (wrapper_dir or "/etc/slurm").rstrip("/") or "/"
    wrappers = wrapper_scripts(preflight_program(), directory, os.path.abspath(config) if config else None)
    lines = slurm_conf_lines(settings, directory, values["interval"], message_timeout, _node_slurm_conf())
    if wrapper_dir is None:
        sys.stdout.write(lines + commented_wrappers(wrappers))
        return 0
    problem = write_wrappers(wrappers)
    if problem:
        return error(problem)
    sys.stdout.write(lines)
    print(f"preflight: wrote {', '.join(wrappers)} (mode 0755)", file=sys.stderr)
    return 0


COMMANDS = (
    _job_mode("prolog", f"Slurm Prolog: the prolog profile, scoped to the job (SLURM_JOB_GPUS).\n\n{_PROLOG_EXIT_CODES}", _TIMEOUT),
    _job_mode(
        "epilog",
        "Slurm Epilog: after each job (also one whose prolog failed), the configured epilog_profile (default "
        f"prolog) scoped to the job's GPUs, so a node the job left broken takes no further job.\n\n{_EPILOG_EXIT_CODES}",
        _TIMEOUT,
    ),
    _job_mode(
        "healthcheck",
        """HealthCheckProgram or cron: the full profile; drains the node with a "preflight:" reason, resumes a node it drained once clean, never touches a reason someone else set.

    Exit codes: 0 nothing drains the node, 2 it has findings that drain it, 3 no verdict.
    """,
        _HEALTHCHECK_TIMEOUT,
    ),
    Command(
        ("slurm", "config"),
        """Print the slurm.conf lines (Prolog, Epilog, PrologFlags, PrologEpilogTimeout, HealthCheckProgram, HealthCheckInterval, HealthCheckNodeState, and HealthCheckTimeout where the budget needs it), ready to include, and write or show the wrapper scripts they name.

    Exit codes: 0 done, 3 refused (a broken config, a [slurm] timeout that PrologEpilogTimeout cannot cover, an unusable --wrapper-dir).
    """,
        run_config,
        options=(
            Option("--config", "config", "Site config whose [slurm] timeouts to use (default: /etc/preflight/preflight.toml if present); passed on to the wrappers."),
            Option("--wrapper-dir", "wrapper_dir", "Write the three wrapper scripts into this existing directory (mode 0755) and name them there; without it they are printed as comments, named in /etc/slurm."),
            Option("--interval", "interval", "HealthCheckInterval, seconds.", kind="integer", default=300, minimum=1),
            Option("--message-timeout", "message_timeout", "The cluster's MessageTimeout (Slurm's default: 10); PrologEpilogTimeout stays within it.", kind="integer", default=10, minimum=1),
        ),
    ),
)
