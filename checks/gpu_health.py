"""GPU health that turns into CUDA failures inside NCCL (reference GPU002).

A GPU whose HBM row remapping is pending has retired a bad row but needs a reset before the
replacement takes effect; until then, kernels touching that memory can fault, and every CUDA
call in the context - NCCL's included - returns the sticky error. A failed remapping means the
GPU has run out of spare rows and needs service. Hardware Xid events since boot (the driver's
``NVRM: Xid (PCI:<bus>): <code>, ...`` kernel messages) say the same from the driver's side.

Sources:

* NVML ``nvmlDeviceGetRemappedRows`` per GPU, ``(correctable, uncorrectable, pending, failure)``
  (Ampere and later; earlier GPUs answer ``NVML_ERROR_NOT_SUPPORTED`` and use page retirement
  instead, which this check leaves alone);
* the kernel log since boot (``/dev/kmsg``, root; ``.preflight/kmsg`` in a recorded root). Only
  Xids NVIDIA's Xid catalogue attributes to hardware or the driver count; application faults
  (13, 31, 43: an illegal address in someone's kernel) say nothing about the node. An
  unreadable log leaves the NVML part of the verdict standing and is recorded in the facts.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from preflight.model import Evidence, NotApplicable, Observation, Unknown, present, undecided
from preflight.registry import check, probe
from preflight.checks.kernel_log import HARDWARE_XIDS, KernelLogFacts, XidEvent
from preflight.sources.nvml import UNANSWERED, Nvml, NvmlError

@dataclass(frozen=True)
class RemappedRows:
    index: int
    correctable: int | None
    uncorrectable: int | None
    pending: bool | None
    failed: bool | None
    error: str  # NVML error code, "" when NVML answered


@dataclass(frozen=True)
class GpuHealthFacts:
    gpus: tuple[RemappedRows, ...]
    nvml_error: str


@probe("gpu_health")
def probe_gpu_health(nvml: Nvml) -> GpuHealthFacts:
    """Row-remapping state of every GPU NVML knows."""
    try:
        count = nvml.call("nvmlDeviceGetCount")
    except NvmlError as error:
        return GpuHealthFacts((), error.code)
    gpus = []
    for index in range(count if isinstance(count, int) else 0):
        try:
            answer = nvml.call("nvmlDeviceGetRemappedRows", index)
        except NvmlError as failure:
            gpus.append(RemappedRows(index, None, None, None, None, failure.code))
            continue
        values = list(answer) if isinstance(answer, (list, tuple)) and len(answer) == 4 else None
        if values is None or not all(isinstance(value, int) for value in values):
            gpus.append(RemappedRows(index, None, None, None, None, f"unexpected answer {answer!r}"))
            continue
        correctable, uncorrectable, pending, failed = values
        gpus.append(RemappedRows(index, correctable, uncorrectable, bool(pending), bool(failed), ""))
    return GpuHealthFacts(tuple(gpus), "")


@check("GPU002", profiles=("prolog",))
def nccl_cuda_call_failed(gpu_health: GpuHealthFacts, kernel_log: KernelLogFacts) -> Iterator[Observation]:
    """A GPU waiting for a reset to apply a row remap, out of spare rows, or with hardware Xids
    since boot."""
    xids = list(_hardware_xids(kernel_log))
    yield from xids
    if gpu_health.nvml_error in UNANSWERED:
        if not xids:
            raise Unknown(f"no NVML answers recorded for this root ({gpu_health.nvml_error})")
        return
    unsupported = all(gpu.error == "NVML_ERROR_NOT_SUPPORTED" for gpu in gpu_health.gpus)
    if gpu_health.nvml_error or not gpu_health.gpus or unsupported:
        if xids:
            return
        if gpu_health.nvml_error:
            raise NotApplicable(f"no GPUs visible to NVML ({gpu_health.nvml_error})")
        raise NotApplicable("no NVIDIA GPUs" if not gpu_health.gpus else "the GPUs do not remap rows (before Ampere)")
    for gpu in gpu_health.gpus:
        subject = f"GPU{gpu.index}"
        if gpu.error == "NVML_ERROR_NOT_SUPPORTED":
            continue
        if gpu.error:
            yield undecided(subject, f"nvmlDeviceGetRemappedRows: {gpu.error}")
            continue
        counts = f"{gpu.uncorrectable} rows remapped for uncorrectable errors, {gpu.correctable} for correctable"
        if gpu.failed:
            yield present(subject, Evidence("nvmlDeviceGetRemappedRows", f"remapping failed; {counts}", "no failure (spare rows left)"))
        elif gpu.pending:
            yield present(subject, Evidence("nvmlDeviceGetRemappedRows", f"remap pending; {counts}", "no remap pending (reset the GPU to apply it)"))


def _hardware_xids(kernel_log: KernelLogFacts) -> Iterator[Observation]:
    by_bus: dict[str, list[XidEvent]] = {}
    for event in kernel_log.xids:
        if event.code in HARDWARE_XIDS:
            by_bus.setdefault(event.bus, []).append(event)
    for bus, events in sorted(by_bus.items()):
        codes = sorted({event.code for event in events})
        described = ", ".join(f"{code} ({HARDWARE_XIDS[code]})" for code in codes)
        yield present(
            f"GPU {bus}",
            Evidence("kernel log since boot", f"Xid {described}; {len(events)} event(s), last: {events[-1].text}", "no hardware Xid since boot"),
        )
