"""vLLM's shared-memory needs (VLLM references)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from preflight.model import (
    Evidence,
    NotApplicable,
    Observation,
    Severity,
    Unknown,
    Unread,
    present,
)
from preflight.registry import check
from preflight.units import format_size

if TYPE_CHECKING:
    from collections.abc import Iterator

    from preflight.probes.frameworks import FrameworkFacts
    from preflight.probes.gpudirect import GpuDirectFacts
    from preflight.probes.shm import ShmFacts

#: NCCL's container guidance (troubleshooting, "Docker"): --shm-size=1g.
SHM_MIN_SIZE = 1 << 30


#: One vLLM ring at its defaults (10 chunks x 10 MiB) plus its per-chunk metadata; with less free
#: than this not even the broadcast ring fits.
VLLM_RING_BYTES = 10 * 10 * (1 << 20) + (1 << 20)


@check("VLLM001", profiles=("prolog",), optional=("gpudirect",))
def vllm_shm_broadcast_stall(shm: ShmFacts, frameworks: FrameworkFacts, gpudirect: GpuDirectFacts | Unread) -> Iterator[Observation]:
    """vLLM is installed on a node of several GPUs and /dev/shm is smaller than NCCL's guidance or
    cannot hold one of vLLM's shared-memory rings."""
    vllm = frameworks.versions("vllm")
    if not vllm:
        raise NotApplicable("vLLM is not installed in this node's Python environments")
    if not isinstance(gpudirect, Unread) and gpudirect.nvidia_gpus == 1:
        # vLLM makes its shared-memory MessageQueue only for the multiprocessing executor, which
        # it picks for a world size above 1; one GPU runs world size 1 on the uniprocess one.
        raise NotApplicable("one GPU on this node: vLLM runs it in one process, without shared-memory rings")
    if shm.error:
        raise Unknown(f"statvfs {shm.path}: {shm.error}")
    installed = Evidence(vllm[0].metadata, f"vLLM {vllm[0].version}")
    if shm.usage is None:
        yield present(shm.path, installed, Evidence(shm.path, "missing", f"a tmpfs of at least {format_size(SHM_MIN_SIZE)}"))
        return
    usage = shm.usage
    if shm.unlimited:
        return
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
