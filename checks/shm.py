"""Shared memory for the job: the size and free space of ``/dev/shm`` (reference VLLM001).

vLLM's multiprocessing executor passes every scheduler step to its workers through shared-memory
ring buffers (``MessageQueue`` in ``vllm/distributed/device_communicators/shm_broadcast.py``:
by default 10 chunks of 10 MiB, one ring for the broadcast and one more per worker's replies),
and NCCL's SHM transport and its NVLS/cuMem bookkeeping create segments there too. Containers get
a private ``/dev/shm`` of 64 MiB unless started with ``--ipc=host`` or ``--shm-size``; a process
that touches a page of a segment the tmpfs cannot back dies with SIGBUS. NCCL's troubleshooting
guide asks for ``--shm-size=1g`` in containers.

Sources:

* ``statvfs("/dev/shm")`` through the filesystem source (a recorded root replays
  ``.preflight/statvfs.json``, see ``preflight.sources.fs``);
* vLLM's presence from ``preflight.checks.frameworks``.
"""

from __future__ import annotations

from collections.abc import Iterator

from preflight.checks.frameworks import FrameworkFacts
from preflight.model import Evidence, NotApplicable, Observation, Severity, Unknown, present
from preflight.records import frozen
from preflight.registry import check, probe
from preflight.sources import NodeFS, SourceError
from preflight.sources.fs import FsUsage
from preflight.units import format_size

SHM_PATH = "/dev/shm"
#: NCCL's container guidance (troubleshooting, "Docker"): --shm-size=1g.
SHM_MIN_SIZE = 1 << 30
#: One vLLM ring at its defaults (10 chunks x 10 MiB) plus its per-chunk metadata; with less free
#: than this not even the broadcast ring fits.
VLLM_RING_BYTES = 10 * 10 * (1 << 20) + (1 << 20)


@frozen
class ShmFacts:
    path: str
    usage: FsUsage | None  # statvfs(/dev/shm); None when absent or unreadable
    error: str  # why statvfs failed, "" when it answered or the path is absent


@probe("shm")
def probe_shm(fs: NodeFS) -> ShmFacts:
    """Size and free space of /dev/shm."""
    try:
        return ShmFacts(SHM_PATH, fs.statvfs(SHM_PATH), "")
    except SourceError as error:
        return ShmFacts(SHM_PATH, None, error.reason)


@check("VLLM001", profiles=("prolog",))
def vllm_shm_broadcast_stall(shm: ShmFacts, frameworks: FrameworkFacts) -> Iterator[Observation]:
    """vLLM is installed and /dev/shm is smaller than NCCL's guidance or cannot hold one of
    vLLM's shared-memory rings."""
    vllm = frameworks.versions("vllm")
    if not vllm:
        raise NotApplicable("vLLM is not installed in this node's Python environments")
    if shm.error:
        raise Unknown(f"statvfs {shm.path}: {shm.error}")
    installed = Evidence(vllm[0].metadata, f"vLLM {vllm[0].version}")
    if shm.usage is None:
        yield present(shm.path, installed, Evidence(shm.path, "missing", f"a tmpfs of at least {format_size(SHM_MIN_SIZE)}"))
        return
    usage = shm.usage
    if usage.available < VLLM_RING_BYTES:
        severity = None  # the next ring vLLM creates will not fit
    elif usage.size < SHM_MIN_SIZE:
        severity = Severity.WARNING  # fits a ring now; more workers or NCCL segments will not
    else:
        return
    yield present(
        shm.path,
        installed,
        Evidence(
            f"statvfs {shm.path}",
            f"size {format_size(usage.size)}, {format_size(usage.available)} available",
            f"size >= {format_size(SHM_MIN_SIZE)} and >= {format_size(VLLM_RING_BYTES)} available (one vLLM ring)",
        ),
        severity=severity,
    )
