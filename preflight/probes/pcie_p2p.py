"""Whether GPUs send each other traffic over PCIe at all, for PCI003: an IOMMU translating the
GPUs' DMA or an ACS redirect between two GPUs hurts only that traffic, and a driver that offers no
P2P between two GPUs (GeForce and many workstation boards) sends none: NCCL copies through host
memory instead. Asked only on nodes where the answer can change PCI003's verdict, so a prolog on
a node with neither asks NVML nothing more.

Source: ``nvmlDeviceGetP2PStatus(h1, h2, caps)`` per ordered pair, for ``NVML_P2P_CAPS_INDEX_READ``
(0), ``_WRITE`` (1) and ``_NVLINK`` (2), answering ``NVML_P2P_STATUS_OK`` (0) or a reason it is not
(1-6: chipset, GPU or topology not supported, disabled by regkey, not supported, unknown), the
matrix ``nvidia-smi topo -p2p r|w|n`` prints. The ``p2p`` probe (PCI004, PCI005) asks the same.
"""

from __future__ import annotations

from msgspec import Struct

from preflight.probes.gpus import GpuFacts
from preflight.probes.pcie import REDIRECT_BITS, TRANSLATED_DOMAINS, PcieFacts
from preflight.registry import probe
from preflight.sources.nvml import Gpu, Nvml, NvmlError

CAPS_READ, CAPS_WRITE, CAPS_NVLINK = 0, 1, 2  # NVML_P2P_CAPS_INDEX_*


class P2pStatus(Struct, frozen=True):
    """nvmlDeviceGetP2PStatus from ``source`` to ``target``; None where the query failed."""

    source: int
    target: int
    read: int | None
    write: int | None
    nvlink: int | None
    error: str  # NVML error code of the first failed query, "" when all three answered


def read_p2p_status(nvml: Nvml, source: int, target: int) -> P2pStatus:
    answers: list[int | None] = []
    error = ""
    for caps in (CAPS_READ, CAPS_WRITE, CAPS_NVLINK):
        try:
            value = nvml.call("nvmlDeviceGetP2PStatus", source, Gpu(target), caps)
        except NvmlError as failure:
            answers.append(None)
            error = error or failure.code
            continue
        if type(value) is int:
            answers.append(value)
        else:
            answers.append(None)
            error = error or f"unexpected answer {value!r}"
    return P2pStatus(source, target, answers[0], answers[1], answers[2], error)


class PcieP2pFacts(Struct, frozen=True):
    """The driver's P2P answers PCI003 needs (see the module docstring)."""

    asked: bool  # False: neither is on this node, so nothing was asked
    by_bus: tuple[tuple[str, int], ...]  # GPU PCI address (sysfs form) -> NVML index
    statuses: tuple[P2pStatus, ...]  # every ordered pair of the GPUs NVML lists
    nvml_error: str  # why NVML could not be asked, "" when it was (or nothing was asked)


def p2p_answers_matter(pcie: PcieFacts) -> bool:
    """Whether PCI003 needs the driver's P2P answers on this node (see PcieP2pFacts). Not in a
    virtual machine nor beside NVSwitches: PCI003 does not apply there whatever the answers."""
    if pcie.hypervisor is True or pcie.nvswitches:
        return False
    maybe_translated = bool(pcie.iommu_units) and any(
        gpu.iommu_domain in TRANSLATED_DOMAINS or (gpu.iommu_group is not None and not gpu.iommu_domain) or gpu.iommu_problem
        for gpu in pcie.gpus
    )
    between = {bdf for _, _, bridges in pcie.gpu_pairs for bdf in bridges}
    redirected = any(bridge.bdf in between and bridge.acs is not None and bridge.acs.control & REDIRECT_BITS for bridge in pcie.bridges)
    return maybe_translated or redirected


@probe("pcie_p2p")
def probe_pcie_p2p(nvml: Nvml, pcie: PcieFacts, gpus: GpuFacts) -> PcieP2pFacts:
    """nvmlDeviceGetP2PStatus for every ordered pair of GPUs, where PCI003 needs it (a prolog on a
    node with neither an IOMMU translating GPUs nor an ACS redirect between them asks nothing)."""
    if not p2p_answers_matter(pcie):
        return PcieP2pFacts(False, (), (), "")
    if gpus.nvml_error:
        return PcieP2pFacts(True, (), (), gpus.nvml_detail or gpus.nvml_error)
    count = len(gpus.devices)
    statuses = tuple(read_p2p_status(nvml, source, target) for source in range(count) for target in range(count) if source != target)
    return PcieP2pFacts(True, tuple((device.bus_id, device.index) for device in gpus.devices if device.bus_id), statuses, "")
