"""How the job is launched: torch.distributed's variables against Slurm's view of the tasks
(references TORCH004, TORCH010) and a forced NCCL algorithm at the job's size (NCCL015).

Sources: the job environment (``preflight.checks.job``; ``/proc/self/environ``, so these checks
see the job's variables when preflight runs inside a job step, e.g. ``srun preflight node``;
a Slurm prolog sees none of them and the checks are not applicable there) and NCCL's
configuration files for ``NCCL_ALGO``.

* torch.distributed's ``env://`` rendezvous reads ``MASTER_ADDR``, ``MASTER_PORT`` (an integer
  port), ``WORLD_SIZE`` and ``RANK`` (``torch/distributed/rendezvous.py``); torchrun sets them per
  worker with ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK`` and ``TORCHELASTIC_RUN_ID``.
* Slurm describes the step's tasks (srun(1), "OUTPUT ENVIRONMENT VARIABLES"): ``SLURM_PROCID``
  (global task rank), ``SLURM_LOCALID`` (rank on the node), ``SLURM_STEP_NUM_TASKS`` /
  ``SLURM_NTASKS``, ``SLURM_STEP_NUM_NODES`` / ``SLURM_JOB_NUM_NODES``, ``SLURM_NTASKS_PER_NODE``;
  ``SLURM_STEP_ID`` is set only inside a step, where those numbers describe tasks actually started.
* ``NCCL_ALGO`` (``src/graph/tuning.cc`` ``parseList``): ``;``-separated entries, only the first
  without a ``function:`` prefix; each a ``,``-separated list of algorithms, ``^`` negating it.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterator

from preflight.checks.job import JobFacts
from preflight.hostlist import expand
from preflight.model import Evidence, NotApplicable, Observation, Severity, present
from preflight.records import frozen
from preflight.registry import check

LAUNCH_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK")
NCCL_ALGORITHMS = ("tree", "ring", "collnetdirect", "collnetchain", "nvls", "nvlstree", "pat")


@frozen
class SlurmView:
    """What Slurm says about this task and its step; None where a variable is unset or garbled."""

    in_step: bool  # SLURM_STEP_ID set: the task numbers describe started tasks
    procid: int | None
    localid: int | None
    ntasks: int | None  # the step's tasks (SLURM_STEP_NUM_TASKS), else the job's (SLURM_NTASKS)
    nnodes: int | None  # the step's nodes, else the job's
    nodelist: tuple[str, ...]  # SLURM_JOB_NODELIST expanded


def _integer(environ: dict[str, str], *names: str) -> int | None:
    for name in names:
        value = environ.get(name, "").strip()
        if value.isdigit():
            return int(value)
    return None


def slurm_view(job: JobFacts) -> SlurmView:
    environ = job.environ
    try:
        nodes = tuple(expand(environ["SLURM_JOB_NODELIST"])) if environ.get("SLURM_JOB_NODELIST") else ()
    except ValueError:
        nodes = ()
    return SlurmView(
        in_step="SLURM_STEP_ID" in environ,
        procid=_integer(environ, "SLURM_PROCID"),
        localid=_integer(environ, "SLURM_LOCALID"),
        ntasks=_integer(environ, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"),
        nnodes=_integer(environ, "SLURM_STEP_NUM_NODES", "SLURM_JOB_NUM_NODES", "SLURM_NNODES") or (len(nodes) or None),
        nodelist=nodes,
    )


def _require_launch(job: JobFacts) -> dict[str, str]:
    if job.environ_error:
        raise NotApplicable(f"/proc/self/environ unreadable ({job.environ_error}); no launch settings to judge")
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


def _env(name: str, value: str, expected: str = "") -> Evidence:
    return Evidence(f"/proc/self/environ {name}", repr(value), expected)


@check("TORCH004", profiles=("prolog",))
def ddp_process_group_setup_invalid(job: JobFacts) -> Iterator[Observation]:
    """env:// rendezvous values that init_process_group rejects, or a loopback MASTER_ADDR in a
    multi-node job."""
    found = _require_launch(job)
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        if name in found and not found[name].strip().isdigit():
            yield present(name, _env(name, found[name], "a non-negative integer"))
    if "WORLD_SIZE" in found and found["WORLD_SIZE"].strip() == "0":
        yield present("WORLD_SIZE", _env("WORLD_SIZE", found["WORLD_SIZE"], "at least 1"))
    if "MASTER_PORT" in found:
        port = found["MASTER_PORT"].strip()
        if not port.isdigit() or not 1 <= int(port) <= 65535:
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
    rank, world = _integer(found, "RANK"), _integer(found, "WORLD_SIZE")
    local_rank, local_world = _integer(found, "LOCAL_RANK"), _integer(environ, "LOCAL_WORLD_SIZE")
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
    for name, value, slurm, slurm_name in expectations:
        if value is not None and slurm is not None and value != slurm:
            yield present(name, _env(name, found[name], f"{slurm} as {slurm_name} says"), Evidence(f"/proc/self/environ {slurm_name}", str(slurm)))
    if local_rank is not None and per_node is not None and local_rank >= per_node:
        yield present("LOCAL_RANK", _env("LOCAL_RANK", found["LOCAL_RANK"], f"0-{per_node - 1} ({per_node} tasks per node)"))


def allreduce_algorithms(value: str) -> set[str] | None:
    """The algorithms NCCL_ALGO leaves enabled for all-reduce; None when NCCL would reject it."""
    enabled = set(NCCL_ALGORITHMS)
    for position, entry in enumerate(value.split(";")):
        prefix, colon, items = entry.rpartition(":")
        if not colon:
            if position:
                return None  # only the first entry may lack a prefix
            prefix, items = "", entry
        if prefix and prefix.lower() != "allreduce":
            continue
        negate = items.startswith("^")
        names = {item.lower() for item in (items[1:] if negate else items).split(",") if item}
        if not names <= set(NCCL_ALGORITHMS):
            return None
        enabled = set(NCCL_ALGORITHMS) - names if negate else names
    return enabled


def _is_power_of_two(count: int) -> bool:
    return count > 0 and count & (count - 1) == 0


@check("NCCL015", profiles=("prolog",))
def tree_algorithm_hang(job: JobFacts) -> Iterator[Observation]:
    """NCCL_ALGO leaves all-reduce only Tree (no Ring to fall back on), worst at rank or node
    counts that are not a power of two."""
    setting = job.nccl("NCCL_ALGO")
    if setting is None:
        return
    enabled = allreduce_algorithms(setting.value)
    if enabled is None or "tree" not in enabled or "ring" in enabled:
        return
    view = slurm_view(job)
    if view.nnodes == 1:
        return  # Tree runs between nodes; a one-node job does not use it for all-reduce
    world = _integer(job.environ, "WORLD_SIZE") or view.ntasks
    where = "/proc/self/environ" if setting.origin == "environment" else setting.origin
    evidence = [Evidence(f"{where} NCCL_ALGO", repr(setting.value), "unset, or a list that keeps Ring for all-reduce")]
    odd = [(name, count) for name, count in (("nodes", view.nnodes), ("ranks", world)) if count is not None and not _is_power_of_two(count)]
    evidence += [Evidence("/proc/self/environ", f"{count} {name}", "a power of two while Tree is forced") for name, count in odd]
    yield present("NCCL_ALGO", *evidence, severity=None if odd else Severity.WARNING)
