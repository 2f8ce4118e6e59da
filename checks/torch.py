"""How PyTorch jobs are launched: process groups and rank-to-GPU mapping (TORCH references)."""

from __future__ import annotations

import ipaddress
from typing import TYPE_CHECKING

from preflight.model import Evidence, NotApplicable, Observation, Severity, Unknown, present, undecided
from preflight.probes.frameworks import FrameworkFacts, parse_version
from preflight.probes.job import JobFacts, integer_setting, job_ranks, slurm_view
from preflight.probes.store_limits import SOMAXCONN, StoreLimitsFacts
from preflight.registry import check
from preflight.torch_settings import as_bool, as_int, read_setting, readers_for
from preflight.units import is_number

if TYPE_CHECKING:
    from collections.abc import Iterator

LAUNCH_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK")


def _require_launch(job: JobFacts) -> dict[str, str]:
    if job.environ_error:
        raise Unknown(f"/proc/self/environ unreadable ({job.environ_error}); the launch settings may be there")
    found = {name: job.environ[name] for name in LAUNCH_VARIABLES if name in job.environ}
    if not found:
        raise NotApplicable("the job environment sets none of " + ", ".join(LAUNCH_VARIABLES))
    return found


def _is_loopback(address: str) -> bool:
    if address.lower() in ("localhost", "localhost.localdomain", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def _python_int(text: str) -> int | None:
    """``int(text)`` as the env:// rendezvous and training scripts parse these variables (blanks
    and a sign allowed, "2" superscript refused), or None where it raises."""
    try:
        return int(text)
    except ValueError:
        return None


def _env(name: str, value: str, expected: str = "") -> Evidence:
    return Evidence(f"/proc/self/environ {name}", repr(value), expected)


@check("TORCH004", profiles=("prolog",))
def ddp_process_group_setup_invalid(job: JobFacts) -> Iterator[Observation]:
    """env:// rendezvous values that init_process_group rejects, or a loopback MASTER_ADDR in a
    multi-node job."""
    found = _require_launch(job)
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        value = _python_int(found[name]) if name in found else 0
        if value is None or value < 0:
            yield present(name, _env(name, found[name], "a non-negative integer"))
    if "WORLD_SIZE" in found and found["WORLD_SIZE"].strip() == "0":
        yield present("WORLD_SIZE", _env("WORLD_SIZE", found["WORLD_SIZE"], "at least 1"))
    if "MASTER_PORT" in found:
        port = found["MASTER_PORT"].strip()
        if not is_number(port) or not 1 <= int(port) <= 65535:
            yield present("MASTER_PORT", _env("MASTER_PORT", found["MASTER_PORT"], "a TCP port, 1-65535"))
    if "MASTER_ADDR" in found:
        address = found["MASTER_ADDR"]
        view = slurm_view(job)
        nodes = view.nnodes or 0
        if not address.strip() or address != address.strip() or " " in address:
            yield present("MASTER_ADDR", _env("MASTER_ADDR", address, "one host name or address"))
        elif _is_loopback(address) and nodes > 1:
            yield present(
                "MASTER_ADDR",
                _env("MASTER_ADDR", address, "the first node of the job (a loopback rendezvous splits the job per node)"),
                Evidence("/proc/self/environ SLURM_JOB_NUM_NODES", str(nodes)),
            )


@check("TORCH010", profiles=("prolog",))
def rank_to_gpu_mapping_wrong(job: JobFacts) -> Iterator[Observation]:
    """RANK, WORLD_SIZE and LOCAL_RANK that contradict each other or the tasks Slurm started."""
    found = _require_launch(job)
    environ = job.environ
    rank, world = integer_setting(found, "RANK"), integer_setting(found, "WORLD_SIZE")
    local_rank, local_world = integer_setting(found, "LOCAL_RANK"), integer_setting(environ, "LOCAL_WORLD_SIZE")
    if rank is not None and world is not None and rank >= world:
        yield present("RANK", _env("RANK", found["RANK"], f"0-{world - 1}"), _env("WORLD_SIZE", found["WORLD_SIZE"]))
    if local_rank is not None and local_world is not None and local_rank >= local_world:
        yield present("LOCAL_RANK", _env("LOCAL_RANK", found["LOCAL_RANK"], f"0-{local_world - 1}"), _env("LOCAL_WORLD_SIZE", environ["LOCAL_WORLD_SIZE"]))
    view = slurm_view(job)
    if not view.in_step:
        return  # outside a step Slurm's task numbers describe the allocation, not started tasks
    under_torchrun = "TORCHELASTIC_RUN_ID" in environ or "GROUP_RANK" in environ
    per_node = view.ntasks // view.nnodes if view.ntasks and view.nnodes and view.ntasks % view.nnodes == 0 else None
    if under_torchrun:
        if view.ntasks is not None and view.nnodes is not None and view.ntasks > view.nnodes:
            yield present(
                "launcher",
                Evidence("/proc/self/environ TORCHELASTIC_RUN_ID", environ.get("TORCHELASTIC_RUN_ID", "set (torchrun worker)")),
                Evidence("/proc/self/environ SLURM_STEP_NUM_TASKS", f"{view.ntasks} tasks on {view.nnodes} nodes", "one torchrun task per node (srun --ntasks-per-node=1)"),
            )
        return
    # Started by srun without torchrun: each task must carry Slurm's numbers.
    expectations = (
        ("RANK", rank, view.procid, "SLURM_PROCID"),
        ("WORLD_SIZE", world, view.ntasks, "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in environ else "SLURM_NTASKS"),
        ("LOCAL_RANK", local_rank, view.localid, "SLURM_LOCALID"),
    )
    # A WORLD_SIZE with neither RANK nor LOCAL_RANK beside it is no rank's setting: batch scripts
    # export it for a torchrun started in a later step, which gives its workers their own.
    lone_world = rank is None and local_rank is None
    for name, value, slurm, slurm_name in expectations:
        if value is not None and slurm is not None and value != slurm:
            yield present(
                name, _env(name, found[name], f"{slurm} as {slurm_name} says"), Evidence(f"/proc/self/environ {slurm_name}", str(slurm)),
                severity=Severity.WARNING if lone_world else None,
                fix=LONE_WORLD_SIZE_FIX if lone_world else "",
            )
    if local_rank is not None and per_node is not None and local_rank >= per_node:
        yield present("LOCAL_RANK", _env("LOCAL_RANK", found["LOCAL_RANK"], f"0-{per_node - 1} ({per_node} tasks per node)"))


LONE_WORLD_SIZE_FIX = (
    "WORLD_SIZE is set, but no RANK or LOCAL_RANK: this process is no rank, and a launcher such as "
    "torchrun sets WORLD_SIZE for its own workers. If the job's ranks read this WORLD_SIZE themselves "
    "(with SLURM_PROCID as their rank), make it SLURM_NTASKS; otherwise nothing needs changing."
)


# ProcessGroupNCCL's names for each setting, newest first (preflight/torch_settings.py).
ASYNC_ERROR_HANDLING = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING")
BLOCKING_WAIT = ("TORCH_NCCL_BLOCKING_WAIT", "NCCL_BLOCKING_WAIT")
NO_HANDLING = 0  # ErrorHandlingMode NoHandling: the watchdog logs the failure and the job hangs


def _disabling(value: str, names: tuple[str, ...]) -> bool:
    if names is ASYNC_ERROR_HANDLING:
        return as_int(value) == NO_HANDLING
    return as_bool(value) is True  # blocking wait: no watchdog thread, async handling switched off


@check("TORCH006", profiles=("prolog",))
def nccl_async_error_handling_mode(job: JobFacts, frameworks: FrameworkFacts) -> Iterator[Observation]:
    """The job switches off what ProcessGroupNCCL does when a collective fails or times out:
    async error handling 0 (log, then hang) or blocking wait (no watchdog), under the names the
    installed PyTorch reads."""
    if job.environ_error:
        raise Unknown(f"/proc/self/environ unreadable ({job.environ_error})")
    expected = {
        ASYNC_ERROR_HANDLING: "unset (3: tear the process down) or 1",
        BLOCKING_WAIT: "unset or 0 (the watchdog then watches every collective)",
    }
    if not any(name in job.environ for name in ASYNC_ERROR_HANDLING + BLOCKING_WAIT):
        raise job.nothing_to_judge(
            "TORCH_NCCL_ASYNC_ERROR_HANDLING and TORCH_NCCL_BLOCKING_WAIT (nor their older NCCL_ names)",
            "ProcessGroupNCCL's defaults: the watchdog tears a failed job down",
            conf_files=False,
        )
    for names, wanted in expected.items():
        for prefixed, release in readers_for(job.environ, names, frameworks).variants():
            setting = read_setting(job.environ, names, prefixed)
            if setting is not None and _disabling(setting.value, names):
                evidence = [_env(setting.name, setting.value, wanted)]
                if release is not None:
                    evidence.append(release)
                yield present(names[0], *evidence)
                break


# TORCH012: what a job's TCPStore server needs at the job's size.
#: PyTorch 2.4 made the libuv TCPStore server the default (the "Introduction to Libuv TCPStore
#: Backend" tutorial); earlier releases run the legacy server unless the program asks otherwise.
LIBUV_DEFAULT_SINCE = (2, 4)
#: The tutorial's threshold for "large-scale" jobs the legacy server copes badly with: its
#: benchmark starts at 1024 ranks and the legacy server timed out at 96K.
LEGACY_STORE_RANKS = 1024
_TORCH_LAUNCH = ("MASTER_ADDR", "WORLD_SIZE", "TORCHELASTIC_RUN_ID", "USE_LIBUV")


def _store_limit_findings(ranks: int, size: Evidence, limit_facts: StoreLimitsFacts, job: JobFacts) -> Iterator[Observation]:
    if limit_facts.somaxconn is None:
        yield undecided("net.core.somaxconn", limit_facts.somaxconn_problem)
    elif limit_facts.somaxconn < ranks:
        # Both TCPStore servers listen with the kernel's maximum backlog, somaxconn. A client
        # whose connection the full queue drops or resets retries until its timeout
        # (socket.cpp), so a small backlog slows the start of a large job rather than failing
        # it outright: a warning, as PyTorch's own message is.
        yield present(
            "net.core.somaxconn",
            Evidence(SOMAXCONN, str(limit_facts.somaxconn), f">= {ranks}, the job's ranks (PyTorch warns below the store's worker count)"),
            size,
            severity=Severity.WARNING,
        )
    if not job.in_job_process:
        return  # this process's limits are slurmd's or an operator's, not those the ranks get
    limit = limit_facts.open_files
    if limit is None:
        yield undecided("open files", limit_facts.open_files_problem)
        return
    observed = f"open files soft {limit.soft}, hard {limit.hard}"
    launched = any(name in job.environ for name in ("MASTER_ADDR", "WORLD_SIZE", "TORCHELASTIC_RUN_ID"))
    if limit.hard < ranks:
        # The store host keeps one socket per client for the life of the store, and nothing
        # unprivileged can go above the hard limit: connections beyond it cannot be accepted.
        # Only a job that shows torch.distributed's launch variables is known to start a
        # TCPStore at all (a Horovod or MPI job does not): otherwise a warning.
        yield present(
            "open files",
            Evidence(limit.source, observed, f"hard limit >= {ranks}, one descriptor per rank on the store host"),
            size,
            severity=None if launched else Severity.WARNING,
        )
    elif limit.soft < ranks:
        # A program may raise its soft limit up to the hard one itself; most do not.
        yield present(
            "open files",
            Evidence(limit.source, observed, f"soft limit >= {ranks}, one descriptor per rank on the store host"),
            size,
            severity=Severity.WARNING,
        )


def _legacy_store_findings(ranks: int, size: Evidence, job: JobFacts, installs: tuple[Evidence, ...], older: bool) -> Iterator[Observation]:
    if ranks <= LEGACY_STORE_RANKS:
        return
    expected = f"the libuv TCPStore server for more than {LEGACY_STORE_RANKS} ranks"
    agent_store = job.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    # USE_LIBUV is read where init_process_group's env:// and tcp:// handlers start a server; under
    # torchrun's agent store the workers only connect to the agent's, which that does not choose.
    if job.environ.get("USE_LIBUV", "").strip() == "0" and not agent_store:
        yield present("USE_LIBUV", _env("USE_LIBUV", job.environ["USE_LIBUV"], expected), size, severity=Severity.INFO)
    elif older:
        yield present("PyTorch", *installs, Evidence("TCPStore server", "legacy (the default before PyTorch 2.4)", expected), size, severity=Severity.INFO)


@check("TORCH012", profiles=("prolog",))
def elastic_rendezvous_timeout_at_scale(job: JobFacts, store_limits: StoreLimitsFacts, frameworks: FrameworkFacts) -> Iterator[Observation]:
    """At the job's size, a listen backlog or descriptor limit below the number of ranks on a node
    that may host the TCPStore, or the legacy store server for a job beyond a thousand ranks."""
    if job.environ_error:
        raise Unknown(f"/proc/self/environ unreadable ({job.environ_error})")
    bound = job_ranks(job)
    if bound is None:
        raise NotApplicable("the job environment gives no job size (WORLD_SIZE, SLURM_NTASKS, SLURM node count)")
    torch = frameworks.versions("torch")
    if not torch and not any(name in job.environ for name in _TORCH_LAUNCH):
        raise NotApplicable("no PyTorch in this node's Python environments and no torch.distributed variables in the job")
    ranks, size = bound
    yield from _store_limit_findings(ranks, size, store_limits, job)
    versions = [parse_version(package.version) for package in torch]
    # Only when every install the node shows predates 2.4: with a newer one beside it the job may use that.
    older = bool(versions) and all(v is not None and v[:2] < LIBUV_DEFAULT_SINCE for v in versions)
    installs = tuple(Evidence(package.metadata, f"PyTorch {package.version}") for package in torch)
    yield from _legacy_store_findings(ranks, size, job, installs, older)
