"""GPUs as the PCI bus and the driver see them (reference GPU001).

Sources:

* ``/sys/bus/pci/devices/<bdf>/{vendor,class}``: NVIDIA (0x10de) display/3D controllers
  (class 0x03xxxx; NVSwitches are bridges, class 0x0680, and are not counted);
* NVML: ``nvmlSystemGetDriverVersion``, ``nvmlSystemGetCudaDriverVersion_v2`` (the CUDA version
  the driver supports, ``1000 * major + 10 * minor``: 13030 is CUDA 13.3), ``nvmlDeviceGetCount``,
  and per device ``nvmlDeviceGetName``, ``nvmlDeviceGetPciInfo`` (``busId``), ``nvmlDeviceGetUUID``,
  ``nvmlDeviceGetMigMode`` (current, pending; 1 is enabled; NOT_SUPPORTED on GPUs without MIG).
  A GPU in MIG mode does no peer-to-peer over PCIe or NVLink (NVIDIA's MIG user guide), so the
  NVLink and P2P checks leave it out.

A GPU that is on the bus but missing from NVML, NVML refusing to start because the kernel module
and the user-space library differ, or ``NVML_ERROR_GPU_IS_LOST`` (from any NVML call, including
the health queries of ``gpu_health``) are the node states behind CUDA's catch-all error 999 in
NCCL jobs. Persistence mode off (``nvmlDeviceGetPersistenceMode``, read by ``gpu_health``) is a
warning: the driver then tears each GPU down after its last client and initialises it again
inside the next job, 1-3 s per GPU, and that start-up is where a failing GPU or driver shows
(https://docs.nvidia.com/deploy/driver-persistence/overview.html).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from msgspec import Struct

from preflight.probing import FactReader, container_marker
from preflight.registry import probe
from preflight.sources.fs import SourceError
from preflight.sources.nvml import Nvml, NvmlError

if TYPE_CHECKING:  # gpu_health imports this module at run time
    from preflight.sources import NodeFS
    pass


NVIDIA_VENDOR = 0x10DE


UNEXPECTED_ANSWER = "NVML_UNEXPECTED_ANSWER"  # an answer pynvml never gives: a damaged recording


class NvmlDevice(Struct, frozen=True):
    index: int
    name: str | None  # nvmlDeviceGetName
    bus_id: str | None  # nvmlDeviceGetPciInfo().busId, normalised to sysfs form 0000:18:00.0
    uuid: str | None  # nvmlDeviceGetUUID
    error: str  # NVML error code of the first failing call, "" when all succeeded
    mig: bool | None = None  # MIG mode on now (nvmlDeviceGetMigMode); False also without MIG; None: unanswered


class GpuFacts(Struct, frozen=True):
    pci_gpus: tuple[str, ...]  # /sys/bus/pci/devices with vendor 0x10de and class 0x03xxxx
    nvml_error: str  # NVML_ERROR_* of nvmlInit / nvmlDeviceGetCount, "" when NVML answered
    nvml_detail: str
    driver_version: str | None  # nvmlSystemGetDriverVersion
    devices: tuple[NvmlDevice, ...]
    problems: tuple[str, ...]
    cuda_driver_version: int | None = None  # nvmlSystemGetCudaDriverVersion_v2; None: see cuda_driver_error
    cuda_driver_error: str = ""  # NVML_* code of that call when it failed, was not recorded or made no sense
    # Asked only when NVML lists fewer GPUs than the PCI bus: the GPUs a container runtime left
    # this process (libnvidia-container mounts its own /proc/driver/nvidia and binds only the
    # container's GPUs under gpus/; CDI creates only their /dev/nvidia<minor> nodes), None when the
    # driver's view is the host's or was not asked;
    # view_error says why it could not be told.
    container_gpus: tuple[str, ...] | None = None
    view_error: str = ""

    @property
    def mig_indices(self) -> frozenset[int]:
        """NVML indices of the GPUs in MIG mode (no peer-to-peer traffic over PCIe or NVLink)."""
        return frozenset(device.index for device in self.devices if device.mig)


def pci_device_key(address: str) -> tuple[int, int, int] | None:
    """(domain, bus, device) of a PCI address as the kernel log ("0000:5d:00"), sysfs
    ("0000:5d:00.0") or NVML ("00000000:5D:00.0") writes it; None when it is none of those. The
    function number is dropped: an Xid line names the device, not the function."""
    parts = address.strip().split(".", 1)[0].split(":")
    if len(parts) == 2:
        parts.insert(0, "0")
    if len(parts) != 3 or not all(parts) or any(len(part) > 8 for part in parts):
        return None
    try:
        domain, bus, device = (int(part, 16) for part in parts)
    except ValueError:
        return None
    return (domain, bus, device) if bus <= 0xFF and device <= 0x1F else None  # PCI: 8-bit bus, 5-bit device


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
        mig=_mig_mode(nvml, index),
    )


MIG_ENABLED = 1  # NVML_DEVICE_MIG_ENABLE


def _mig_mode(nvml: Nvml, index: int) -> bool | None:
    """Whether MIG mode is on now; a GPU without MIG answers NOT_SUPPORTED (off). Its own error,
    apart from the device's: an older recording without the call keeps the GPU as it was."""
    try:
        modes = nvml.call("nvmlDeviceGetMigMode", index)
    except NvmlError as failure:
        return False if failure.code == "NVML_ERROR_NOT_SUPPORTED" else None
    if isinstance(modes, (list, tuple)) and modes and type(modes[0]) is int:
        return modes[0] == MIG_ENABLED
    return None


@probe("gpus")
def probe_gpus(fs: NodeFS, nvml: Nvml) -> GpuFacts:
    """List GPUs on the PCI bus and ask NVML about each device it knows."""
    reader = FactReader(fs)
    pci = _pci_gpus(reader)
    try:
        driver = nvml.call("nvmlSystemGetDriverVersion")
        count = nvml.call("nvmlDeviceGetCount")
    except NvmlError as error:
        return GpuFacts(pci, error.code, str(error), None, (), tuple(reader.problems), None, error.code)
    cuda, cuda_error = _cuda_driver_version(nvml)
    if not isinstance(count, int) or count < 0:
        return GpuFacts(pci, UNEXPECTED_ANSWER, f"device count {repr(count)[:40]}", str(driver), (), tuple(reader.problems), cuda, cuda_error)
    devices = tuple(_device(nvml, index) for index in range(count))
    container_gpus, view_error = _container_view(reader) if len(devices) < len(pci) else (None, "")
    # Only inside a container: on a host a GPU the driver failed to set up has no procfs entry
    # either, and must stay a missing GPU, not a view that cannot be told.
    if container_gpus is None and len(devices) < len(pci) and container_marker(reader) != "":
        narrowed, why = _device_node_view(reader, pci)
        if narrowed is not None:
            container_gpus, view_error = narrowed, ""
        elif not view_error:
            view_error = why
    return GpuFacts(pci, "", "", str(driver), devices, tuple(reader.problems), cuda, cuda_error, container_gpus, view_error)


MOUNTINFO = "/proc/self/mountinfo"
DRIVER_PROCFS = "/proc/driver/nvidia"
GPU_LISTING = f"{DRIVER_PROCFS}/gpus"


def _container_view(reader: FactReader) -> tuple[tuple[str, ...] | None, str]:
    """(the GPUs under a container's own /proc/driver/nvidia/gpus, "") when a mount there shows
    that a runtime narrowed this process's view; (None, "") for the host's view; (None, why)
    when it cannot be told."""
    try:
        text = reader.fs.read(MOUNTINFO, max_bytes=4 * 1024 * 1024)
    except SourceError as error:
        return None, str(error)
    if text is None:
        return None, f"{MOUNTINFO}: not in this root"
    # Field 5 is the mount point, octal-escaped (proc(5)); nothing here contains a space.
    points = {line.split(" ", 5)[4] for line in text.splitlines() if line.count(" ") >= 5}
    under = {point for point in points if point.startswith(f"{DRIVER_PROCFS}/")}
    if DRIVER_PROCFS not in points and not any(point == GPU_LISTING or point.startswith(f"{GPU_LISTING}/") for point in under):
        if under:
            # A runtime mounted something else there (the CDI hook mounts only params,
            # nvidia-container-toolkit's disable-device-node-modification): it narrowed this view
            # through /dev alone, and the gpus/ listing is the host's.
            return None, f"a container runtime mounted {sorted(under)[0]} but left the host's {GPU_LISTING}: which GPUs it gave is not listed"
        return None, ""
    listed = reader.listing(GPU_LISTING)
    if listed is None:
        return None, reader.problems[-1]
    return tuple(sorted(entry.lower() for entry in listed)), ""


_DEVICE_NODE = re.compile(r"nvidia(\d{1,4})")
_DEVICE_MINOR = re.compile(r"^Device Minor:\s*(\d{1,4})\s*$", re.MULTILINE)


def _device_node_view(reader: FactReader, pci: tuple[str, ...]) -> tuple[tuple[str, ...] | None, str]:
    """(the GPUs whose /dev/nvidia<minor> node this process has, "") where it lacks some: a runtime
    that narrows the view through /dev alone (CDI devices before nvidia-container-toolkit 1.18 mount
    nothing over /proc/driver/nvidia, and podman --device nvidia.com/gpu=0 creates only nvidia0),
    each GPU's minor read from the host's /proc/driver/nvidia/gpus/<bus>/information. (None, "")
    where every GPU's node is there: the host's view, or a Slurm device cgroup, which denies
    access without removing nodes; (None, why) when that cannot be read."""
    names = reader.listing("/dev")
    if names is None:
        return None, f"whether a container runtime left out /dev/nvidia* nodes cannot be told: {reader.problems[-1]}"
    minors = {int(match.group(1)) for match in map(_DEVICE_NODE.fullmatch, names) if match}
    given = []
    for bus in pci:
        path = f"{GPU_LISTING}/{bus.lower()}/information"
        known, text = reader.known_text(path)
        match = _DEVICE_MINOR.search(text or "")
        if match is None:
            why = reader.problems[-1] if not known else f"{path}: {'no Device Minor line' if text is not None else 'missing'}"
            return None, f"which /dev/nvidia* node is GPU {bus}'s cannot be told: {why}"
        if int(match.group(1)) in minors:
            given.append(bus)
    return (None, "") if len(given) == len(pci) else (tuple(given), "")


def _cuda_driver_version(nvml: Nvml) -> tuple[int | None, str]:
    """The CUDA version the driver supports, as NVML encodes it, or None and why not."""
    try:
        version = nvml.call("nvmlSystemGetCudaDriverVersion_v2")
    except NvmlError as error:
        return None, error.code
    if isinstance(version, bool) or not isinstance(version, int) or not 1000 <= version < 100_000:
        return None, UNEXPECTED_ANSWER  # CUDA 1.0 is 1000; a recording cannot invent CUDA 100
    return version, ""
