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

import re
from collections.abc import Iterator
from dataclasses import dataclass

from preflight.model import Evidence, NotApplicable, Observation, Unknown, present, undecided
from preflight.registry import check, probe
from preflight.sources import NodeFS, SourceError
from preflight.sources.nvml import Nvml, NvmlError

_XID = re.compile(r"NVRM: Xid \(PCI:(?P<bus>[0-9A-Fa-f:.]{7,16})\): (?P<code>\d{1,3}),(?P<rest>.{0,200})")
# Hardware and driver Xids (NVIDIA's Xid catalogue, docs.nvidia.com/deploy/xid-errors):
# ECC and row remapping, fallen off the bus, NVLink, GSP and other firmware faults.
HARDWARE_XIDS = {
    48: "double-bit ECC error", 63: "row remapping event", 64: "row remapping failure", 74: "NVLink error",
    79: "GPU has fallen off the bus", 92: "high single-bit ECC error rate", 94: "contained ECC error",
    95: "uncontained ECC error", 119: "GSP RPC timeout", 120: "GSP error",
}


@dataclass(frozen=True)
class XidEvent:
    bus: str  # as the driver prints it, e.g. 0000:5d:00
    code: int
    text: str


@dataclass(frozen=True)
class KernelLogFacts:
    xids: tuple[XidEvent, ...]
    error: str  # why the kernel log could not be read, "" when it was (or is not recorded)
    read: bool  # whether any log was read at all


def parse_xids(records: list[str]) -> tuple[XidEvent, ...]:
    """Xid events in kernel log records (``pri,seq,usec,flags;message`` or plain lines)."""
    found = []
    for record in records:
        if "Xid" not in record:
            continue
        match = _XID.search(record)
        if match:
            found.append(XidEvent(match.group("bus").lower(), int(match.group("code")), record.split(";", 1)[-1][:300]))
    return tuple(found)


@probe("kernel_log")
def probe_kernel_log(fs: NodeFS) -> KernelLogFacts:
    """Hardware Xid events since boot."""
    try:
        records = fs.read_kernel_log()
    except SourceError as error:
        return KernelLogFacts((), str(error), False)
    if records is None:
        return KernelLogFacts((), "", False)
    return KernelLogFacts(parse_xids(records), "", True)


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
    if gpu_health.nvml_error == "NVML_NOT_RECORDED":
        if not xids:
            raise Unknown("no NVML answers recorded for this root")
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
