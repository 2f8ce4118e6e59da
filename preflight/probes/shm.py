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
* vLLM's presence from ``preflight.probes.frameworks``.
"""

from __future__ import annotations

from msgspec import Struct

from preflight.registry import probe
from preflight.sources import NodeFS, SourceError
from preflight.sources.fs import FsUsage

SHM_PATH = "/dev/shm"


class ShmFacts(Struct, frozen=True):
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
