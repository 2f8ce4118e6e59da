"""GPU health that turns into CUDA failures inside NCCL (reference GPU002), and the per-GPU NVML
state GPU001 reads as well (persistence mode, GPUs the driver reports lost).

A GPU whose HBM row remapping is pending has retired a bad row but needs a reset before the
replacement takes effect; until then, kernels touching that memory can fault, and every CUDA
call in the context - NCCL's included - returns the sticky error. A failed remapping means the
GPU has run out of spare rows and needs service. Uncorrectable ECC errors counted since the GPU
was last initialised, and hardware Xid events since boot (the driver's
``NVRM: Xid (PCI:<bus>): <code>, ...`` kernel messages) say the same from other sides.

Sources:

* NVML ``nvmlDeviceGetRemappedRows`` per GPU, ``(correctable, uncorrectable, pending, failure)``
  (Ampere and later; earlier GPUs answer ``NVML_ERROR_NOT_SUPPORTED`` and use page retirement
  instead);
* NVML ``nvmlDeviceGetRetiredPagesPendingStatus`` (1: a page is marked for retirement that takes
  effect only at the next driver load, GPU reset or reboot): the page-retirement side of the same
  question on GPUs before Ampere (https://docs.nvidia.com/deploy/dynamic-page-retirement/);
* NVML ``nvmlDeviceGetEccMode`` (``[current, pending]``, 1 enabled) and
  ``nvmlDeviceGetTotalEccErrors(handle, NVML_MEMORY_ERROR_TYPE_UNCORRECTED (1),
  NVML_VOLATILE_ECC (0))``. Volatile counts restart whenever the driver initialises the GPU:
  once per boot with persistence mode on, once per job with it off (NVML's ``nvmlEccCounterType_t``
  note; https://docs.nvidia.com/deploy/driver-persistence/data-persistence.html). The count
  needs ECC enabled; GPUs without ECC answer ``NOT_SUPPORTED``;
* NVML ``nvmlDeviceGetPersistenceMode`` (1 enabled), read here for GPU001;
* NVML ``nvmlDeviceGetCurrentClocksThrottleReasons`` (a bit mask, ``nvmlClocksThrottleReason*`` in
  nvml.h; renamed ``ClocksEventReasons`` in recent headers, same values): why the GPU runs below
  its maximum clocks right now, read for NCCL011 (a GPU slowed by its hardware makes its rank the
  job's straggler);
* the kernel log since boot (``/dev/kmsg``, root; ``.preflight/kmsg`` in a recorded root). Only
  Xids NVIDIA's Xid catalogue attributes to hardware or the driver count; application faults
  (13, 31, 43: an illegal address in someone's kernel, reference GPU003) say nothing about the
  node and stay in the kernel-log facts as context. An unreadable log makes the Xid half of the
  verdict ``unknown`` ("needs root") while the NVML half still decides.

Any call answering ``NVML_ERROR_GPU_IS_LOST`` marks the GPU lost; GPU001 reports it.
"""

from __future__ import annotations

from typing import Any

from msgspec import Struct

from preflight.model import NotApplicable, Unknown
from preflight.probes.gpus import UNEXPECTED_ANSWER, GpuFacts
from preflight.sources.nvml import UNANSWERED
from preflight.registry import probe
from preflight.sources.nvml import Nvml, NvmlError

# nvmlMemoryErrorType_t and nvmlEccCounterType_t (nvml.h; pynvml NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
# NVML_VOLATILE_ECC).
MEMORY_ERROR_TYPE_UNCORRECTED = 1


VOLATILE_ECC = 0


GPU_IS_LOST = "NVML_ERROR_GPU_IS_LOST"


NOT_RECORDED = "NVML_NOT_RECORDED"


class GpuHealth(Struct, frozen=True):
    index: int
    # nvmlDeviceGetRemappedRows
    rows_correctable: int | None
    rows_uncorrectable: int | None
    remap_pending: bool | None
    remap_failed: bool | None
    rows_error: str  # NVML error code, "" when NVML answered
    # nvmlDeviceGetPersistenceMode
    persistence: bool | None
    persistence_error: str
    # nvmlDeviceGetEccMode
    ecc_current: bool | None
    ecc_pending: bool | None
    ecc_mode_error: str
    # nvmlDeviceGetTotalEccErrors(UNCORRECTED, VOLATILE)
    volatile_uncorrected: int | None
    volatile_error: str
    # nvmlDeviceGetCurrentClocksThrottleReasons
    clock_reasons: int | None = None
    clock_reasons_error: str = NOT_RECORDED
    # nvmlDeviceGetRetiredPagesPendingStatus (recordings made before it was read have none)
    pages_pending: bool | None = None
    pages_error: str = NOT_RECORDED

    @property
    def lost_in(self) -> str:
        """The first NVML call that answered GPU_IS_LOST, "" when none did."""
        for call, error in (
            ("nvmlDeviceGetRemappedRows", self.rows_error),
            ("nvmlDeviceGetPersistenceMode", self.persistence_error),
            ("nvmlDeviceGetEccMode", self.ecc_mode_error),
            ("nvmlDeviceGetTotalEccErrors", self.volatile_error),
            ("nvmlDeviceGetCurrentClocksThrottleReasons", self.clock_reasons_error),
            ("nvmlDeviceGetRetiredPagesPendingStatus", self.pages_error),
        ):
            if error == GPU_IS_LOST:
                return call
        return ""


class GpuHealthFacts(Struct, frozen=True):
    gpus: tuple[GpuHealth, ...]
    nvml_error: str


def _ask(nvml: Nvml, function: str, index: int, *args: int) -> tuple[Any, str]:
    try:
        return nvml.call(function, index, *args), ""
    except NvmlError as failure:
        return None, failure.code


def _flag(value: Any) -> bool | None:
    return bool(value) if isinstance(value, int) and not isinstance(value, bool) and value in (0, 1) else None


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _unexpected(answer: Any) -> str:
    return f"unexpected answer {repr(answer)[:60]}"


def _gpu_health(nvml: Nvml, index: int) -> GpuHealth:
    rows, rows_error = _ask(nvml, "nvmlDeviceGetRemappedRows", index)
    values = list(rows) if isinstance(rows, (list, tuple)) and len(rows) == 4 else None
    if not rows_error and (values is None or any(_count(value) is None for value in values)):
        rows_error, values = _unexpected(rows), None
    correctable, uncorrectable, pending, failed = values if values is not None else (None, None, None, None)

    mode, persistence_error = _ask(nvml, "nvmlDeviceGetPersistenceMode", index)
    persistence = _flag(mode)
    if not persistence_error and persistence is None:
        persistence_error = _unexpected(mode)

    ecc, ecc_mode_error = _ask(nvml, "nvmlDeviceGetEccMode", index)
    ecc_modes = [_flag(value) for value in ecc] if isinstance(ecc, (list, tuple)) and len(ecc) == 2 else [None, None]
    if not ecc_mode_error and None in ecc_modes:
        ecc_mode_error = _unexpected(ecc)

    volatile, volatile_error = _ask(nvml, "nvmlDeviceGetTotalEccErrors", index, MEMORY_ERROR_TYPE_UNCORRECTED, VOLATILE_ECC)
    if not volatile_error and _count(volatile) is None:
        volatile_error = _unexpected(volatile)

    pages, pages_error = _ask(nvml, "nvmlDeviceGetRetiredPagesPendingStatus", index)
    if not pages_error and _flag(pages) is None:
        pages_error = _unexpected(pages)

    reasons, clock_reasons_error = _ask(nvml, "nvmlDeviceGetCurrentClocksThrottleReasons", index)
    if not clock_reasons_error and _count(reasons) is None:
        clock_reasons_error = _unexpected(reasons)

    return GpuHealth(
        index=index,
        rows_correctable=correctable,
        rows_uncorrectable=uncorrectable,
        remap_pending=bool(pending) if pending is not None else None,
        remap_failed=bool(failed) if failed is not None else None,
        rows_error=rows_error,
        persistence=persistence,
        persistence_error=persistence_error,
        ecc_current=ecc_modes[0],
        ecc_pending=ecc_modes[1],
        ecc_mode_error=ecc_mode_error,
        volatile_uncorrected=_count(volatile),
        volatile_error=volatile_error,
        clock_reasons=None if clock_reasons_error else _count(reasons),
        clock_reasons_error=clock_reasons_error,
        pages_pending=None if pages_error else _flag(pages),
        pages_error=pages_error,
    )


@probe("gpu_health")
def probe_gpu_health(nvml: Nvml) -> GpuHealthFacts:
    """Row remapping, ECC mode and volatile uncorrectable ECC count, and persistence mode of every
    GPU NVML knows."""
    try:
        count = nvml.call("nvmlDeviceGetCount")
    except NvmlError as error:
        return GpuHealthFacts((), error.code)
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        return GpuHealthFacts((), f"{UNEXPECTED_ANSWER} (device count {repr(count)[:40]})")
    return GpuHealthFacts(tuple(_gpu_health(nvml, index) for index in range(count)), "")


def nvml_unusable(gpu_health: GpuHealthFacts, gpus: GpuFacts) -> NotApplicable | Unknown | None:
    """Why NVML cannot judge any GPU, as the exception the check raises; None when it can."""
    if gpu_health.nvml_error in UNANSWERED:  # no recording, or a broken one
        return Unknown(f"no NVML answers recorded for this root ({gpu_health.nvml_error})")
    if gpu_health.nvml_error:
        if gpus.pci_gpus:
            return Unknown(f"NVML unavailable ({gpu_health.nvml_error}): the health of the {len(gpus.pci_gpus)} GPUs on the PCI bus cannot be read")
        return NotApplicable(f"no NVIDIA GPUs (NVML: {gpu_health.nvml_error})")
    if not gpu_health.gpus:
        if gpus.pci_gpus:
            return Unknown(f"NVML lists no GPUs, but {len(gpus.pci_gpus)} are on the PCI bus (GPU001)")
        return NotApplicable("no NVIDIA GPUs")
    return None
