"""GPU BAR1: the window through which RDMA NICs (GPUDirect RDMA) and GDRCopy reach GPU memory
(reference GDR003).

Every buffer a NIC reads from or writes to GPU memory is mapped through BAR1. When BAR1 is small
(a data-centre GPU whose large BAR is off) or already mostly mapped before the job starts
(mappings leaked by an earlier job), peer-memory registration fails and NCCL's RDMA setup dies.

Sources:

* NVML ``nvmlDeviceGetBAR1MemoryInfo``: ``bar1Total``, ``bar1Used``, ``bar1Free`` in bytes.
  Unified-memory parts (Grace Hopper, GB10) answer ``NVML_ERROR_NOT_SUPPORTED``: there, the
  NIC reaches memory without BAR1 and the reference does not apply.
* NVML ``nvmlDeviceGetComputeRunningProcesses``: the processes with a CUDA context on the GPU,
  asked only when most of its BAR1 is mapped; where it lists none,
  ``nvmlDeviceGetMPSComputeRunningProcesses``, the clients of a CUDA MPS server (Slurm's
  gres/mps). A GPU that runs work has its buffers mapped, so BAR1 use says something about
  leaked mappings only on an idle GPU (a health check runs beside jobs; a prolog may find a stray
  process).
* ``/sys/bus/pci/devices/<bdf>/resource``: one ``start end flags`` line per region. The BAR1
  aperture is the largest 64-bit prefetchable memory region; it is region 1 on some GPUs and
  region 2 on HGX H100 (region 0 is 64-bit there and takes two registers), so never index 1.
"""

from __future__ import annotations

from msgspec import Struct

from preflight.probes.gpus import normalise_bus_id
from preflight.probing import FactReader
from preflight.registry import probe
from preflight.sources import NodeFS
from preflight.sources.nvml import Nvml, NvmlError

_MEM, _PREFETCH, _MEM_64 = 0x200, 0x2000, 0x100000  # IORESOURCE_* (include/linux/ioport.h)
MOSTLY_MAPPED = 0.5  # share of BAR1 mapped on an idle GPU that means leaked mappings (GDR003)


class Bar1(Struct, frozen=True):
    index: int
    name: str | None
    bus_id: str | None
    total: int | None  # bytes, from NVML
    used: int | None
    error: str  # NVML error code of the BAR1 query, "" when it answered
    aperture: int | None  # bytes, largest 64-bit prefetchable region in sysfs
    processes: int | None = None  # compute processes on the GPU; None when unread or not asked
    processes_error: str = ""  # the process query and its NVML error code, "" when it answered


class Bar1Facts(Struct, frozen=True):
    gpus: tuple[Bar1, ...]
    nvml_error: str
    problems: tuple[str, ...]


def largest_prefetchable(resource: str) -> int | None:
    """Size of the largest 64-bit prefetchable memory region in a sysfs ``resource`` file."""
    best = None
    for line in resource.splitlines():
        fields = line.split()
        if len(fields) != 3:
            continue
        try:
            start, end, flags = (int(field, 16) for field in fields)
        except ValueError:
            continue
        wanted = _MEM | _PREFETCH | _MEM_64
        if flags & wanted == wanted and end > start:
            size = end - start + 1
            best = size if best is None else max(best, size)
    return best


@probe("bar1")
def probe_bar1(fs: NodeFS, nvml: Nvml) -> Bar1Facts:
    """BAR1 size and use of every GPU NVML knows, with the aperture sysfs shows for it."""
    reader = FactReader(fs)
    try:
        count = nvml.call("nvmlDeviceGetCount")
    except NvmlError as error:
        return Bar1Facts((), error.code, tuple(reader.problems))
    gpus = []
    for index in range(count if isinstance(count, int) else 0):
        name = _answer(nvml, "nvmlDeviceGetName", index)
        pci = _answer(nvml, "nvmlDeviceGetPciInfo", index)
        bus_id = normalise_bus_id(pci["busId"]) if isinstance(pci, dict) and isinstance(pci.get("busId"), str) else None
        try:
            info = nvml.call("nvmlDeviceGetBAR1MemoryInfo", index)
            total, used, code = _bytes(info, "bar1Total"), _bytes(info, "bar1Used"), ""
        except NvmlError as failure:
            total = used = None
            code = failure.code
        resource = reader.text(f"/sys/bus/pci/devices/{bus_id}/resource") if bus_id else None
        aperture = largest_prefetchable(resource) if resource else None
        # Whether the GPU runs work matters only when most of its BAR1 is mapped: asked then only.
        mostly_mapped = total is not None and used is not None and used > total * MOSTLY_MAPPED
        processes, processes_error = _compute_processes(nvml, index) if mostly_mapped else (None, "")
        gpus.append(Bar1(index, name if isinstance(name, str) else None, bus_id, total, used, code, aperture, processes, processes_error))
    return Bar1Facts(tuple(gpus), "", tuple(reader.problems))


def _answer(nvml: Nvml, function: str, index: int) -> object:
    try:
        return nvml.call(function, index)
    except NvmlError:
        return None


def _bytes(info: object, key: str) -> int | None:
    value = info.get(key) if isinstance(info, dict) else None
    return value if isinstance(value, int) and value >= 0 else None


#: What a driver without MPS process accounting answers: no MPS clients to count.
_NO_MPS_LIST = ("NVML_ERROR_NOT_SUPPORTED", "NVML_ERROR_FUNCTION_NOT_FOUND")


def _compute_processes(nvml: Nvml, index: int) -> tuple[int | None, str]:
    """How many processes have a compute context on GPU ``index``, or None and why not. Under
    CUDA MPS the jobs' processes are MPS clients, which NVML lists apart
    (nvmlDeviceGetMPSComputeRunningProcesses): asked where the plain list is empty."""
    counts: list[int] = []
    for function in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetMPSComputeRunningProcesses"):
        try:
            listed = nvml.call(function, index)
        except NvmlError as failure:
            if counts and failure.code in _NO_MPS_LIST:
                break
            return None, f"{function}: {failure.code}"
        if not isinstance(listed, list):
            return None, f"{function}: not a list of processes: {type(listed).__name__}"
        counts.append(len(listed))
        if listed:
            break
    return sum(counts), ""
