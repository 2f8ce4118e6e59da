"""Peer-to-peer between the GPUs of a node: switched off (PCI004), and the RTX 5090 / RTX PRO
Blackwell (sm_120) multi-GPU failures (PCI005).

Sources:

* NVML, per device: ``nvmlDeviceGetName``, ``nvmlDeviceGetCudaComputeCapability`` (major,
  minor), ``nvmlDeviceGetPciInfo`` (``busId``); per ordered pair of devices
  ``nvmlDeviceGetP2PStatus(h1, h2, caps)`` for ``NVML_P2P_CAPS_INDEX_READ`` (0), ``_WRITE`` (1)
  and ``_NVLINK`` (2), answering ``NVML_P2P_STATUS_OK`` (0), ``CHIPSET_NOT_SUPPORTED`` (1),
  ``GPU_NOT_SUPPORTED`` (2), ``IOH_TOPOLOGY_NOT_SUPPORTED`` (3), ``DISABLED_BY_REGKEY`` (4),
  ``NOT_SUPPORTED`` (5) or ``UNKNOWN`` (6) - the matrix ``nvidia-smi topo -p2p r|w|n`` prints as
  OK/CNS/GNS/TNS/DR/NS/U. (nvidia-ml-py defines ``NVML_P2P_CAPS_INDEX_READ = 0,`` - a tuple -
  so the numbers are spelled out here.)
* ``/sys/bus/pci/devices/<bdf>/iommu_group/type``: the IOMMU domain of a GPU (``identity`` for
  pass-through, ``DMA``/``DMA-FQ`` for translated; no ``iommu_group`` when there is no IOMMU).
* The job's ``NCCL_P2P_DISABLE``, ``NCCL_P2P_LEVEL`` and ``NCCL_IGNORE_DISABLED_P2P``, read as
  NCCL's ``ncclGetLevel`` (src/graph/paths.cc) does: P2P_DISABLE counts only when ``strtol`` gives
  exactly 1; P2P_LEVEL is a path name compared exactly (``LOC``, ``NVL``...) or an old-style number
  (0 is LOC).
* The NCCL libraries on the node (the ``nccl_libs`` probe).

NCCL uses P2P between two GPUs only when NVML reports read and write status OK for the pair; if
they are NVLink-connected and it does not, NCCL stops ("P2P is disabled between NVLINK connected
GPUs"), because that means a broken link or driver, not a platform limit.
"""

from __future__ import annotations

from msgspec import Struct

from preflight.probes.gpus import normalise_bus_id
from preflight.probes.pcie_p2p import P2pStatus, read_p2p_status
from preflight.probing import FactReader
from preflight.registry import probe
from preflight.sources import NodeFS
from preflight.sources.nvml import Nvml, NvmlError


class P2pGpu(Struct, frozen=True):
    index: int
    name: str | None  # nvmlDeviceGetName
    compute_capability: tuple[int, int] | None  # nvmlDeviceGetCudaComputeCapability
    bus_id: str | None  # nvmlDeviceGetPciInfo().busId in sysfs form
    iommu_domain: str | None  # /sys/bus/pci/devices/<bdf>/iommu_group/type; None: no IOMMU group


class P2pFacts(Struct, frozen=True):
    gpus: tuple[P2pGpu, ...]
    statuses: tuple[P2pStatus, ...]  # every ordered pair of different GPUs
    nvml_error: str
    nvml_detail: str
    problems: tuple[str, ...]


def _answer(nvml: Nvml, function: str, index: int) -> object:
    try:
        return nvml.call(function, index)
    except NvmlError:
        return None


def _capability(value: object) -> tuple[int, int] | None:
    if isinstance(value, (list, tuple)) and len(value) == 2 and all(type(part) is int for part in value):
        return (value[0], value[1])
    return None


def _iommu_domain(reader: FactReader, bus_id: str | None) -> str | None:
    if bus_id is None:
        return None
    text = reader.text(f"/sys/bus/pci/devices/{bus_id}/iommu_group/type")
    return text.strip() if text is not None else None


@probe("p2p")
def probe_p2p(fs: NodeFS, nvml: Nvml) -> P2pFacts:
    """The driver's P2P status for every ordered pair of GPUs, and what each GPU is."""
    reader = FactReader(fs)
    try:
        count = nvml.call("nvmlDeviceGetCount")
    except NvmlError as error:
        return P2pFacts((), (), error.code, str(error), ())
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        return P2pFacts((), (), "NVML_ERROR_UNKNOWN", f"device count {count!r}", ())
    gpus = []
    for index in range(count):
        name = _answer(nvml, "nvmlDeviceGetName", index)
        pci = _answer(nvml, "nvmlDeviceGetPciInfo", index)
        bus = pci.get("busId") if isinstance(pci, dict) else None
        bus_id = normalise_bus_id(bus) if isinstance(bus, str) else None
        gpus.append(P2pGpu(
            index,
            name if isinstance(name, str) else None,
            _capability(_answer(nvml, "nvmlDeviceGetCudaComputeCapability", index)),
            bus_id,
            _iommu_domain(reader, bus_id),
        ))
    statuses = tuple(read_p2p_status(nvml, source, target) for source in range(count) for target in range(count) if source != target)
    return P2pFacts(tuple(gpus), statuses, "", "", tuple(reader.problems))
