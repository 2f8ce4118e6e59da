"""GPUs as the PCI bus and the driver see them (reference GPU001).

Sources:

* ``/sys/bus/pci/devices/<bdf>/{vendor,class}``: NVIDIA (0x10de) display/3D controllers
  (class 0x03xxxx; NVSwitches are bridges, class 0x0680, and are not counted);
* NVML: ``nvmlSystemGetDriverVersion``, ``nvmlDeviceGetCount``, and per device
  ``nvmlDeviceGetName``, ``nvmlDeviceGetPciInfo`` (``busId``), ``nvmlDeviceGetUUID``.

A GPU that is on the bus but missing from NVML, NVML refusing to start because the kernel module
and the user-space library differ, or ``NVML_ERROR_GPU_IS_LOST`` (from any NVML call, including
the health queries of ``gpu_health``) are the node states behind CUDA's catch-all error 999 in
NCCL jobs. Persistence mode off (``nvmlDeviceGetPersistenceMode``, read by ``gpu_health``) is a
warning: the driver then tears each GPU down after its last client and initialises it again
inside the next job, 1-3 s per GPU, and that start-up is where a failing GPU or driver shows
(https://docs.nvidia.com/deploy/driver-persistence/overview.html).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from preflight.config import Expectations
from preflight.model import Evidence, NotApplicable, Observation, Severity, Unknown, present, undecided
from preflight.probing import FactReader
from preflight.records import frozen
from preflight.registry import check, probe
from preflight.sources import NodeFS
from preflight.sources.nvml import UNANSWERED, Nvml, NvmlError

if TYPE_CHECKING:  # gpu_health imports this module at run time
    from preflight.checks.gpu_health import GpuHealthFacts

NVIDIA_VENDOR = 0x10DE
UNEXPECTED_ANSWER = "NVML_UNEXPECTED_ANSWER"  # an answer pynvml never gives: a damaged recording
# NVML start-up errors that say nothing about the driver: preflight could not ask it (the library
# is not installed where preflight runs, /dev/nvidiactl is not open to this user, a recording is
# unreadable). Every other start-up error with GPUs on the bus (LIB_RM_VERSION_MISMATCH,
# DRIVER_NOT_LOADED, GPU_IS_LOST, UNKNOWN...) means the driver stack is broken.
CANNOT_ASK_ERRORS = frozenset(
    {"NVML_ERROR_LIBRARY_NOT_FOUND", "NVML_ERROR_NO_PERMISSION", "NVML_ERROR_FUNCTION_NOT_FOUND", "NVML_REPLAY_UNREADABLE", UNEXPECTED_ANSWER}
)
PERSISTENCE_FIX = (
    "Keep the GPUs initialised between jobs: enable and start nvidia-persistenced "
    "(systemctl enable --now nvidia-persistenced), or set persistence mode with 'nvidia-smi -pm 1' at every boot."
)


@frozen
class NvmlDevice:
    index: int
    name: str | None  # nvmlDeviceGetName
    bus_id: str | None  # nvmlDeviceGetPciInfo().busId, normalised to sysfs form 0000:18:00.0
    uuid: str | None  # nvmlDeviceGetUUID
    error: str  # NVML error code of the first failing call, "" when all succeeded


@frozen
class GpuFacts:
    pci_gpus: tuple[str, ...]  # /sys/bus/pci/devices with vendor 0x10de and class 0x03xxxx
    nvml_error: str  # NVML_ERROR_* of nvmlInit / nvmlDeviceGetCount, "" when NVML answered
    nvml_detail: str
    driver_version: str | None  # nvmlSystemGetDriverVersion
    devices: tuple[NvmlDevice, ...]
    problems: tuple[str, ...]


def normalise_bus_id(bus_id: str) -> str:
    """NVML's ``00000000:18:00.0`` (8-hex domain) -> sysfs ``0000:18:00.0``, lower case."""
    text = bus_id.strip().lower()
    domain, _, rest = text.partition(":")
    if not rest:
        return text
    try:
        return f"{int(domain, 16):04x}:{rest}"
    except ValueError:
        return text


def _hex(text: str | None) -> int | None:
    try:
        return int(text.strip(), 16) if text else None
    except ValueError:
        return None


def _pci_gpus(reader: FactReader) -> tuple[str, ...]:
    found = []
    for bdf in reader.listing("/sys/bus/pci/devices") or []:  # unlisted: in problems, checks say unknown
        base = f"/sys/bus/pci/devices/{bdf}"
        if _hex(reader.text(f"{base}/vendor")) != NVIDIA_VENDOR:
            continue
        device_class = _hex(reader.text(f"{base}/class"))
        if device_class is not None and device_class >> 16 == 0x03:
            found.append(bdf.lower())
    return tuple(found)


def _device(nvml: Nvml, index: int) -> NvmlDevice:
    values: dict[str, Any] = {}
    error = ""
    for key, function in (("name", "nvmlDeviceGetName"), ("pci", "nvmlDeviceGetPciInfo"), ("uuid", "nvmlDeviceGetUUID")):
        try:
            values[key] = nvml.call(function, index)
        except NvmlError as failure:
            error = error or failure.code
    pci = values.get("pci")
    bus_id = pci.get("busId") if isinstance(pci, dict) else None
    return NvmlDevice(
        index=index,
        name=values.get("name"),
        bus_id=normalise_bus_id(bus_id) if isinstance(bus_id, str) else None,
        uuid=values.get("uuid"),
        error=error,
    )


@probe("gpus")
def probe_gpus(fs: NodeFS, nvml: Nvml) -> GpuFacts:
    """List GPUs on the PCI bus and ask NVML about each device it knows."""
    reader = FactReader(fs)
    pci = _pci_gpus(reader)
    try:
        driver = nvml.call("nvmlSystemGetDriverVersion")
        count = nvml.call("nvmlDeviceGetCount")
    except NvmlError as error:
        return GpuFacts(pci, error.code, str(error), None, (), tuple(reader.problems))
    if not isinstance(count, int) or count < 0:
        return GpuFacts(pci, UNEXPECTED_ANSWER, f"device count {repr(count)[:40]}", str(driver), (), tuple(reader.problems))
    devices = tuple(_device(nvml, index) for index in range(count))
    return GpuFacts(pci, "", "", str(driver), devices, tuple(reader.problems))


@check("GPU001", profiles=("prolog",))
def gpu_unusable_by_driver(gpus: GpuFacts, gpu_health: GpuHealthFacts, expect: Expectations) -> Iterator[Observation]:
    """A GPU is on the bus but unusable: lost, invisible to NVML, or the driver stack is broken;
    a warning when persistence mode is off."""
    if gpus.nvml_error in UNANSWERED:  # no recording, or a broken one
        raise Unknown(gpus.nvml_detail or gpus.nvml_error)
    if not gpus.pci_gpus and gpus.nvml_error:
        raise NotApplicable(f"no NVIDIA GPU on the PCI bus and NVML unavailable ({gpus.nvml_error})")
    if gpus.nvml_error in CANNOT_ASK_ERRORS:
        raise Unknown(
            f"NVML unavailable ({gpus.nvml_detail or gpus.nvml_error}): cannot ask the driver about the "
            f"{len(gpus.pci_gpus)} NVIDIA GPUs on the PCI bus"
        )
    if gpus.nvml_error:
        yield present(
            "node",
            Evidence("nvmlInit", gpus.nvml_detail or gpus.nvml_error, "NVML_SUCCESS"),
            Evidence("/sys/bus/pci/devices", f"{len(gpus.pci_gpus)} NVIDIA GPUs on the bus"),
        )
        return
    lost = set()
    for device in gpus.devices:
        if device.error == "NVML_ERROR_GPU_IS_LOST":
            lost.add(device.index)
            yield present(f"GPU{device.index}", Evidence("nvmlDeviceGetName", device.error, "NVML_SUCCESS"))
        elif device.error and device.error != "NVML_ERROR_NOT_SUPPORTED":
            yield undecided(f"GPU{device.index}", f"NVML: {device.error}")
    for health in gpu_health.gpus if not gpu_health.nvml_error else ():
        if health.lost_in and health.index not in lost:
            lost.add(health.index)
            yield present(f"GPU{health.index}", Evidence(health.lost_in, "NVML_ERROR_GPU_IS_LOST", "NVML_SUCCESS"))
    seen = {device.bus_id for device in gpus.devices if device.bus_id}
    missing = [bdf for bdf in gpus.pci_gpus if bdf not in seen]
    # A device whose PCI info NVML would not give may be any of the unmatched GPUs on the bus.
    unidentified = sum(1 for device in gpus.devices if not device.bus_id)
    if len(missing) > unidentified and (seen or not gpus.devices):
        yield present(
            "node",
            Evidence("nvmlDeviceGetCount", f"{len(gpus.devices)} GPUs", f"{len(gpus.pci_gpus)} (as on the PCI bus)"),
            Evidence("/sys/bus/pci/devices", "not visible to NVML: " + ", ".join(missing)),
        )
    if expect.gpu_count is not None and len(gpus.devices) < expect.gpu_count:
        yield present(
            "node",
            Evidence("nvmlDeviceGetCount", f"{len(gpus.devices)} GPUs", f"{expect.gpu_count} (expect.gpu_count)"),
        )
    yield from _persistence(gpu_health, lost)


def _persistence(gpu_health: GpuHealthFacts, lost: set[int]) -> Iterator[Observation]:
    if gpu_health.nvml_error:
        return
    off = []
    for health in gpu_health.gpus:
        if health.index in lost or health.persistence_error in ("NVML_ERROR_NOT_SUPPORTED", "NVML_ERROR_FUNCTION_NOT_FOUND"):
            continue
        if health.persistence_error:
            yield undecided(f"GPU{health.index}", f"nvmlDeviceGetPersistenceMode: {health.persistence_error}")
        elif health.persistence is False:
            off.append(f"GPU{health.index}")
    if off:
        yield present(
            "nvidia-persistenced",
            Evidence("nvmlDeviceGetPersistenceMode", f"disabled on {', '.join(off)} ({len(off)} of {len(gpu_health.gpus)})", "enabled"),
            Evidence("effect", "the driver deinitialises an idle GPU and initialises it again (1-3 s per GPU) at the next "
                     "job's first CUDA call; volatile ECC counts restart with it"),
            severity=Severity.WARNING,
            fix=PERSISTENCE_FIX,
        )
