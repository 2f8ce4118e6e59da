"""GPU memory health that turns into CUDA failures inside NCCL (reference GPU002).

A GPU whose HBM row remapping is pending has retired a bad row but needs a reset before the
replacement takes effect; until then, kernels touching that memory can fault, and every CUDA
call in the context - NCCL's included - returns the sticky error. A failed remapping means the
GPU has run out of spare rows and needs service.

Source: NVML ``nvmlDeviceGetRemappedRows`` per GPU, ``(correctable, uncorrectable, pending,
failure)`` (Ampere and later; earlier GPUs answer ``NVML_ERROR_NOT_SUPPORTED`` and use page
retirement instead, which this check leaves alone).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from preflight.model import Evidence, NotApplicable, Observation, Unknown, present, undecided
from preflight.registry import check, probe
from preflight.sources.nvml import Nvml, NvmlError


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
def nccl_cuda_call_failed(gpu_health: GpuHealthFacts) -> Iterator[Observation]:
    """A GPU waiting for a reset to apply a row remap, or out of spare rows."""
    if gpu_health.nvml_error == "NVML_NOT_RECORDED":
        raise Unknown("no NVML answers recorded for this root")
    if gpu_health.nvml_error:
        raise NotApplicable(f"no GPUs visible to NVML ({gpu_health.nvml_error})")
    if not gpu_health.gpus:
        raise NotApplicable("no NVIDIA GPUs")
    if all(gpu.error == "NVML_ERROR_NOT_SUPPORTED" for gpu in gpu_health.gpus):
        raise NotApplicable("the GPUs do not remap rows (before Ampere)")
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
