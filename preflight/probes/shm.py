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

    @property
    def unlimited(self) -> bool:
        """No blocks at all: a tmpfs mounted with size=0, which has no limit ("the limit is
        removed if the size is 0", tmpfs(5); mm/shmem.c's shmem_statfs fills the block counts
        only under a limit). A file system that really holds nothing still has blocks."""
        return self.usage is not None and self.usage.size == 0


@probe("shm")
def probe_shm(fs: NodeFS) -> ShmFacts:
    """Size and free space of /dev/shm."""
    try:
        return ShmFacts(SHM_PATH, fs.statvfs(SHM_PATH), "")
    except SourceError as error:
        return ShmFacts(SHM_PATH, None, error.reason)
