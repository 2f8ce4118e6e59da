"""The NVLink fabric on NVSwitch systems: NVLS (NVLink SHARP) multicast needs it (NVL006).

On HGX systems with NVSwitches the GPUs join the NVLink fabric only after the fabric manager
(``nv-fabricmanager``) has programmed the switches; until then, or when it fails, peer-to-peer
and NVLS multicast setup fail and NCCL either falls back or, from 2.29, aborts.

Sources:

* ``/sys/bus/pci/devices/*``: NVSwitches are NVIDIA (0x10de) bridges of class 0x0680.
* NVML ``nvmlDeviceGetGpuFabricInfo`` per GPU: ``state`` (0 not supported, 1 not started,
  2 in progress, 3 completed) and ``status`` (an NVML return code; 0 is success). Drivers before
  the fabric-info API answer ``NVML_ERROR_FUNCTION_NOT_FOUND`` or ``NOT_SUPPORTED``.
* ``/proc/<pid>/comm``: a running fabric manager (``nv-fabricmanager``, cut to 15 characters
  by the kernel), for drivers without the fabric-info API.
* The job's ``NCCL_NVLS_ENABLE``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from preflight.checks.job import JobFacts
from preflight.model import Evidence, NotApplicable, Observation, Unknown, present, undecided
from preflight.probing import FactReader
from preflight.registry import check, probe
from preflight.sources import NodeFS
from preflight.sources.nvml import UNANSWERED, Nvml, NvmlError

_NVSWITCH_CLASS = "0x0680"
_FABRIC_MANAGER_COMM = "nv-fabricmanag"
FABRIC_STATES = {0: "not supported", 1: "not started", 2: "in progress", 3: "completed"}
_COMPLETED = 3
_API_MISSING = ("NVML_ERROR_FUNCTION_NOT_FOUND", "NVML_ERROR_NOT_SUPPORTED")


@dataclass(frozen=True)
class GpuFabric:
    index: int
    state: int | None
    status: int | None
    error: str  # NVML error code of the fabric query, "" when it answered


@dataclass(frozen=True)
class FabricFacts:
    nvswitches: tuple[str, ...]
    gpus: tuple[GpuFabric, ...]
    nvml_error: str
    fabric_manager_running: bool | None  # None: /proc could not be scanned
    problems: tuple[str, ...]


@probe("fabric", gather_in=("full",))
def probe_fabric(fs: NodeFS, nvml: Nvml) -> FabricFacts:
    """NVSwitches on the bus, each GPU's fabric state, and whether a fabric manager runs."""
    reader = FactReader(fs)
    nvswitches = tuple(
        bdf
        for bdf in reader.listing("/sys/bus/pci/devices")
        if (reader.text(f"/sys/bus/pci/devices/{bdf}/vendor") or "").strip() == "0x10de"
        and (reader.text(f"/sys/bus/pci/devices/{bdf}/class") or "").strip().startswith(_NVSWITCH_CLASS)
    )
    running = _fabric_manager_running(fs, reader)
    try:
        count = nvml.call("nvmlDeviceGetCount")
    except NvmlError as error:
        return FabricFacts(nvswitches, (), error.code, running, tuple(reader.problems))
    gpus = []
    for index in range(count if isinstance(count, int) else 0):
        try:
            info = nvml.call("nvmlDeviceGetGpuFabricInfo", index)
        except NvmlError as failure:
            gpus.append(GpuFabric(index, None, None, failure.code))
            continue
        state = info.get("state") if isinstance(info, dict) else None
        status = info.get("status") if isinstance(info, dict) else None
        gpus.append(GpuFabric(index, state if isinstance(state, int) else None, status if isinstance(status, int) else None, ""))
    return FabricFacts(nvswitches, tuple(gpus), "", running, tuple(reader.problems))


def _fabric_manager_running(fs: NodeFS, reader: FactReader) -> bool | None:
    pids = [name for name in reader.listing("/proc") if name.isdigit()]
    if not pids:
        return None
    for pid in pids:
        comm = fs.read(f"/proc/{pid}/comm") if fs.exists(f"/proc/{pid}/comm") else None
        if comm is not None and comm.strip().startswith(_FABRIC_MANAGER_COMM):
            return True
    return False


@check("NVL006", profiles=("full",))
def nvls_multicast_init_failure(fabric: FabricFacts, job: JobFacts) -> Iterator[Observation]:
    """GPUs outside a completed NVLink fabric on an NVSwitch system, where NVLS cannot start."""
    if not fabric.nvswitches:
        raise NotApplicable("no NVSwitch on this node")
    if fabric.nvml_error in UNANSWERED:
        raise Unknown(f"no NVML answers recorded for this root ({fabric.nvml_error})")
    if fabric.nvml_error:
        raise Unknown(f"NVML unavailable ({fabric.nvml_error}); the fabric state cannot be read")
    nvls = job.nccl("NCCL_NVLS_ENABLE")
    forced = [Evidence(f"NCCL_NVLS_ENABLE ({nvls.origin})", nvls.value, "unset, or 0 until the fabric is fixed")] if nvls and nvls.value.strip() == "1" else []
    if fabric.gpus and all(gpu.error in _API_MISSING for gpu in fabric.gpus):
        if fabric.fabric_manager_running is None:
            yield undecided("fabric manager", "the driver has no fabric-info API and /proc could not be scanned")
        elif not fabric.fabric_manager_running:
            yield present(
                "fabric manager",
                Evidence("/proc/*/comm", "no nv-fabricmanager process", "nvidia-fabricmanager running on NVSwitch systems"),
                Evidence("/sys/bus/pci/devices", f"{len(fabric.nvswitches)} NVSwitches"),
                *forced,
            )
        return
    for gpu in fabric.gpus:
        if gpu.error:
            yield undecided(f"GPU{gpu.index}", f"nvmlDeviceGetGpuFabricInfo: {gpu.error}")
        elif gpu.state != _COMPLETED or gpu.status != 0:
            state = FABRIC_STATES.get(gpu.state or 0, f"state {gpu.state}")
            evidence = [Evidence("nvmlDeviceGetGpuFabricInfo", f"fabric {state}, status {gpu.status}", "completed, status 0 (success)")]
            if fabric.fabric_manager_running is False:
                evidence.append(Evidence("/proc/*/comm", "no nv-fabricmanager process", "nvidia-fabricmanager running"))
            yield present(f"GPU{gpu.index}", *evidence, *forced)
