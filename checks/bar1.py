"""GPU BAR1: the window through which RDMA NICs (GPUDirect RDMA) and GDRCopy reach GPU memory
(reference GDR003).

Every buffer a NIC reads from or writes to GPU memory is mapped through BAR1. When BAR1 is small
(a data-centre GPU whose large BAR is off) or already mostly mapped before the job starts
(mappings leaked by an earlier job), peer-memory registration fails and NCCL's RDMA setup dies.

Sources:

* NVML ``nvmlDeviceGetBAR1MemoryInfo``: ``bar1Total``, ``bar1Used``, ``bar1Free`` in bytes.
  Unified-memory parts (Grace Hopper, GB10) answer ``NVML_ERROR_NOT_SUPPORTED``: there, the
  NIC reaches memory without BAR1 and the reference does not apply.
* ``/sys/bus/pci/devices/<bdf>/resource``: one ``start end flags`` line per region. The BAR1
  aperture is the largest 64-bit prefetchable memory region; it is region 1 on some GPUs and
  region 2 on HGX H100 (region 0 is 64-bit there and takes two registers), so never index 1.
"""

from __future__ import annotations

from collections.abc import Iterator

from preflight.checks.gpus import GpuFacts, normalise_bus_id
from preflight.model import Evidence, NotApplicable, Observation, Unknown, present, undecided
from preflight.probing import FactReader
from preflight.records import frozen
from preflight.registry import check, probe
from preflight.sources import NodeFS
from preflight.sources.nvml import UNANSWERED, Nvml, NvmlError
from preflight.units import format_size

_MEM, _PREFETCH, _MEM_64 = 0x200, 0x2000, 0x100000  # IORESOURCE_* (include/linux/ioport.h)
SMALL_BAR1 = 256 << 20  # the legacy window consumer boards keep with Resizable BAR off
MOSTLY_MAPPED = 0.5  # share of BAR1 mapped on an idle GPU that means leaked mappings
_UNIFIED_MEMORY = ("GH200", "GB10", "GB200")


@frozen
class Bar1:
    index: int
    name: str | None
    bus_id: str | None
    total: int | None  # bytes, from NVML
    used: int | None
    error: str  # NVML error code of the BAR1 query, "" when it answered
    aperture: int | None  # bytes, largest 64-bit prefetchable region in sysfs


@frozen
class Bar1Facts:
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
        gpus.append(Bar1(index, name if isinstance(name, str) else None, bus_id, total, used, code, aperture))
    return Bar1Facts(tuple(gpus), "", tuple(reader.problems))


def _answer(nvml: Nvml, function: str, index: int) -> object:
    try:
        return nvml.call(function, index)
    except NvmlError:
        return None


def _bytes(info: object, key: str) -> int | None:
    value = info.get(key) if isinstance(info, dict) else None
    return value if isinstance(value, int) and value >= 0 else None


@check("GDR003", profiles=("prolog",))
def peermem_gpu_mapping_rejected(bar1: Bar1Facts, gpus: GpuFacts) -> Iterator[Observation]:
    """BAR1 too small for GPUDirect RDMA, or mostly mapped before the job starts."""
    if bar1.nvml_error in UNANSWERED:  # no recording, or a broken one
        raise Unknown(f"no NVML answers recorded for this root ({bar1.nvml_error})")
    on_bus = len(gpus.pci_gpus)
    if bar1.nvml_error:
        if on_bus:
            raise Unknown(f"NVML unavailable ({bar1.nvml_error}): BAR1 of the {on_bus} GPUs on the PCI bus cannot be read")
        raise NotApplicable(f"no NVIDIA GPUs (NVML: {bar1.nvml_error})")
    if not bar1.gpus:
        if on_bus:
            raise Unknown(f"NVML lists no GPUs, but {on_bus} are on the PCI bus (GPU001)")
        raise NotApplicable("no NVIDIA GPUs")
    if all(gpu.error == "NVML_ERROR_NOT_SUPPORTED" and _unified(gpu) for gpu in bar1.gpus):
        raise NotApplicable("unified-memory GPUs: NICs reach their memory without BAR1")
    for gpu in bar1.gpus:
        subject = f"GPU{gpu.index}"
        source = "nvmlDeviceGetBAR1MemoryInfo"
        if gpu.error == "NVML_ERROR_NOT_SUPPORTED" and _unified(gpu):
            continue
        if gpu.error or gpu.total is None:
            if gpu.aperture is not None and gpu.aperture <= SMALL_BAR1:
                yield present(subject, Evidence(f"/sys/bus/pci/devices/{gpu.bus_id}/resource", f"BAR1 aperture {format_size(gpu.aperture)}", "more than 256 MiB"))
            else:
                yield undecided(subject, f"NVML does not report BAR1 for a GPU that has one ({gpu.error or 'no size'})")
            continue
        if gpu.total <= SMALL_BAR1:
            evidence = [Evidence(source, f"bar1Total {format_size(gpu.total)} ({gpu.name or 'GPU'})", "more than 256 MiB: large BAR enabled")]
            if gpu.aperture is not None:
                evidence.append(Evidence(f"/sys/bus/pci/devices/{gpu.bus_id}/resource", f"aperture {format_size(gpu.aperture)}"))
            yield present(subject, *evidence)
        elif gpu.used is not None and gpu.used > gpu.total * MOSTLY_MAPPED:
            yield present(
                subject,
                Evidence(source, f"bar1Used {format_size(gpu.used)} of {format_size(gpu.total)} before the job",
                         f"at most {int(MOSTLY_MAPPED * 100)}% mapped on an idle GPU"),
            )


def _unified(gpu: Bar1) -> bool:
    return any(model in (gpu.name or "") for model in _UNIFIED_MEMORY)
