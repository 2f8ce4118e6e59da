"""The PCIe paths between GPUs and RDMA NICs: ACS redirect on them (PCI001), and GPUs whose
nearest NIC is across the CPU or on another socket (TOPO005).

GPUDirect RDMA needs the NIC's reads and writes of GPU memory to turn around inside the PCIe
switch the two share. ACS "P2P Request Redirect" (RR) or "Completion Redirect" (CR) on a bridge
of that path sends them up to the root complex instead, where the IOMMU rejects them: the NIC
reports a local protection error (vendor err 81) or the job crawls.

Sources:

* ``/sys/bus/pci/devices/<bdf>`` links give each function's place in the tree
  (``../../../devices/pci0000:15/0000:15:01.0/0000:17:00.0/0000:18:00.0``), with ``vendor`` and
  ``class``; an ``infiniband/`` directory marks an RDMA NIC.
* ``/sys/bus/pci/devices/<bdf>/config``: extended capabilities from offset 0x100 (header: ID in
  bits 0-15, next offset in bits 20-31); the ACS capability (ID 0x000D) holds the capability
  register at +4 and the control register at +6 (bits in ``include/uapi/linux/pci_regs.h``).
  Without CAP_SYS_ADMIN the kernel returns only the first 64 bytes: that is "needs root", never
  "ACS off".
* IOMMU: ``/sys/class/iommu`` (one entry per active IOMMU unit), ``/proc/cmdline``. The kernel
  enables ACS on every capable bridge when an IOMMU is active, and ``iommu=pt`` keeps the IOMMU
  active, so it does not turn ACS off.
* ``/sys/bus/pci/devices/<bdf>/numa_node``: the socket a device hangs off (-1: not reported).
* Virtual machines: the ``hypervisor`` CPU flag in ``/proc/cpuinfo``. In a guest the emulated
  bridges' ACS bits do not decide where P2P traffic goes; the host's do.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

from preflight.checks.job import JobFacts
from preflight.model import Evidence, NotApplicable, Observation, Unknown, present, undecided
from preflight.probing import FactReader
from preflight.registry import check, probe
from preflight.sources import NodeFS, SourceError

_BDF = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
_NVIDIA = "0x10de"
_DISPLAY_CLASSES = ("0x0300", "0x0302")  # VGA and 3D controllers
EXTENDED_CONFIG_START = 0x100
_ACS_ID = 0x000D
_MAX_CAPABILITIES = 64  # a garbage chain must not loop forever

# ACS control bits (include/uapi/linux/pci_regs.h)
ACS_BITS = (
    (0x0001, "SrcValid"),
    (0x0002, "TransBlk"),
    (0x0004, "ReqRedir"),
    (0x0008, "CmpltRedir"),
    (0x0010, "UpstreamFwd"),
    (0x0020, "EgressCtrl"),
    (0x0040, "DirectTrans"),
)
REDIRECT_BITS = 0x0004 | 0x0008


@dataclass(frozen=True)
class AcsRegisters:
    capability: int
    control: int

    def describe(self) -> str:
        return " ".join(f"{name}{'+' if self.control & bit else '-'}" for bit, name in ACS_BITS)


@dataclass(frozen=True)
class Bridge:
    """A bridge on some GPU-to-NIC path and what its config space says about ACS."""

    bdf: str
    acs: AcsRegisters | None  # None: no ACS capability (nothing to redirect)
    unreadable: str  # why the ACS state is not known; "" when it is


@dataclass(frozen=True)
class PciEndpoint:
    bdf: str
    chain: tuple[str, ...]  # bridges from the root port down to the parent of this function
    numa_node: int | None  # None: not reported (-1) or unreadable


@dataclass(frozen=True)
class PcieFacts:
    gpus: tuple[PciEndpoint, ...]
    nics: tuple[PciEndpoint, ...]
    bridges: tuple[Bridge, ...]  # every bridge on a GPU-to-nearest-NIC path inside a switch
    pairs: tuple[tuple[str, str, tuple[str, ...]], ...]  # (gpu, nic, bridges between them)
    nearest_nic: tuple[tuple[str, str, str], ...]  # (gpu, its nearest NIC, NCCL path class)
    hypervisor: bool
    iommu_units: tuple[str, ...]
    cmdline: str
    problems: tuple[str, ...]


def parse_acs(config: bytes) -> AcsRegisters | None:
    """The ACS registers from a config-space dump; None when there is no ACS capability.

    Raises ValueError when the dump stops before the extended capabilities."""
    if len(config) <= EXTENDED_CONFIG_START:
        raise ValueError(f"only {len(config)} bytes of config space are readable (the rest needs root)")
    offset = EXTENDED_CONFIG_START
    for _ in range(_MAX_CAPABILITIES):
        if offset < EXTENDED_CONFIG_START or offset + 8 > len(config):
            return None
        header = int.from_bytes(config[offset : offset + 4], "little")
        if header in (0, 0xFFFFFFFF):
            return None
        if header & 0xFFFF == _ACS_ID:
            capability = int.from_bytes(config[offset + 4 : offset + 6], "little")
            control = int.from_bytes(config[offset + 6 : offset + 8], "little")
            return AcsRegisters(capability, control)
        offset = (header >> 20) & 0xFFC
        if offset == 0:
            return None
    return None


def device_chain(link_target: str) -> tuple[str, ...]:
    """BDFs in a ``/sys/bus/pci/devices/<bdf>`` link target, root port first, the device last."""
    return tuple(part for part in link_target.split("/") if _BDF.match(part))


def bridges_between(first: tuple[str, ...], second: tuple[str, ...]) -> tuple[str, ...] | None:
    """Bridges a peer-to-peer transfer crosses between two devices (chains include the devices).

    None when the two sit under different root ports: their traffic crosses the root complex
    anyway, and ACS inside a switch is not what decides it."""
    common = 0
    while common < min(len(first), len(second)) and first[common] == second[common]:
        common += 1
    if common == 0:
        return None
    turnaround = first[common - 1]
    return (turnaround, *first[common:-1], *second[common:-1])


def _distance(first: tuple[str, ...], second: tuple[str, ...]) -> int:
    common = 0
    while common < min(len(first), len(second)) and first[common] == second[common]:
        common += 1
    return (len(first) - common) + (len(second) - common) if common else 1_000


def _setting(job: JobFacts, name: str) -> str:
    setting = job.nccl(name)
    return setting.value.strip() if setting else ""


def _numa(text: str | None) -> int | None:
    try:
        node = int((text or "").strip())
    except ValueError:
        return None
    return node if node >= 0 else None


# NCCL's path classes (src/graph/paths.cc), nearest first. NCCL has no NODE: two root ports of
# one socket are PHB to it; only a path across sockets is SYS.
PATH_CLASSES = ("PIX", "PXB", "PHB", "SYS")
_RANK = {name: rank for rank, name in enumerate(PATH_CLASSES)}
_RANK["UNKNOWN"] = _RANK["SYS"]  # rank an unknown path as far, but report it as unknown
# NCCL_NET_GDR_LEVEL also accepts the old numbers: 0 LOC, 1 PIX, 2 PXB, 3 PHB, 4 or 5 SYS.
_LEVEL_NUMBERS = {"1": "PIX", "2": "PXB", "3": "PHB", "4": "SYS", "5": "SYS"}
DEFAULT_GDR_LEVEL = "PXB"


def path_class(gpu: PciEndpoint, nic: PciEndpoint, sockets: int) -> str:
    """PIX: one bridge between them; PXB: several, below the CPU; PHB: through the CPU's host
    bridge on one socket; SYS: across sockets; UNKNOWN: different root ports on a multi-socket
    node that does not say which socket a device hangs off."""
    first, second = (*gpu.chain, gpu.bdf), (*nic.chain, nic.bdf)
    between = bridges_between(first, second)
    if between is not None:
        return "PIX" if len(between) == 1 else "PXB"
    if gpu.numa_node is not None and nic.numa_node is not None:
        return "PHB" if gpu.numa_node == nic.numa_node else "SYS"
    return "PHB" if sockets <= 1 else "UNKNOWN"


@probe("pcie")
def probe_pcie(fs: NodeFS) -> PcieFacts:
    """GPUs, RDMA NICs, the bridges between each GPU and its nearest NIC, and their ACS state."""
    reader = FactReader(fs)
    gpus: list[PciEndpoint] = []
    nics: list[PciEndpoint] = []
    chains: dict[str, tuple[str, ...]] = {}
    for bdf in reader.listing("/sys/bus/pci/devices"):
        base = f"/sys/bus/pci/devices/{bdf}"
        target = fs.readlink(base)
        if target is None:
            continue
        chain = device_chain(target)
        if not chain or chain[-1] != bdf:
            continue
        chains[bdf] = chain
        vendor = (reader.text(f"{base}/vendor") or "").strip()
        klass = (reader.text(f"{base}/class") or "").strip()
        if vendor == _NVIDIA and klass.startswith(_DISPLAY_CLASSES):
            gpus.append(PciEndpoint(bdf, chain[:-1], _numa(reader.text(f"{base}/numa_node"))))
        elif "infiniband" in reader.listing(base):
            nics.append(PciEndpoint(bdf, chain[:-1], _numa(reader.text(f"{base}/numa_node"))))
    sockets = sum(1 for name in reader.listing("/sys/devices/system/node") if re.fullmatch(r"node\d+", name))
    pairs = []
    nearest_nic = []
    wanted: set[str] = set()
    for gpu in gpus:
        if not nics:
            break
        ranked = sorted(nics, key=lambda nic: (_RANK[path_class(gpu, nic, sockets)], _distance(chains[gpu.bdf], chains[nic.bdf])))
        best = ranked[0]
        nearest_nic.append((gpu.bdf, best.bdf, path_class(gpu, best, sockets)))
        for nic in ranked:
            if _distance(chains[gpu.bdf], chains[nic.bdf]) != _distance(chains[gpu.bdf], chains[best.bdf]):
                continue
            between = bridges_between(chains[gpu.bdf], chains[nic.bdf])
            if between is not None:
                pairs.append((gpu.bdf, nic.bdf, between))
                wanted.update(between)
    bridges = tuple(_bridge(fs, bdf) for bdf in sorted(wanted))
    cpuinfo = reader.text("/proc/cpuinfo") or ""
    flags = next((line for line in cpuinfo.splitlines() if line.startswith("flags")), "")
    return PcieFacts(
        gpus=tuple(gpus),
        nics=tuple(nics),
        bridges=bridges,
        pairs=tuple(pairs),
        nearest_nic=tuple(nearest_nic),
        hypervisor=" hypervisor" in f" {flags.partition(':')[2]} ",
        iommu_units=tuple(reader.listing("/sys/class/iommu")),
        cmdline=(reader.text("/proc/cmdline") or "").strip(),
        problems=tuple(reader.problems),
    )


def _bridge(fs: NodeFS, bdf: str) -> Bridge:
    path = f"/sys/bus/pci/devices/{bdf}/config"
    try:
        config = fs.read_bytes(path)
    except SourceError as error:
        return Bridge(bdf, None, f"{path}: {error.reason}")
    if config is None:
        return Bridge(bdf, None, f"{path} does not exist")
    try:
        return Bridge(bdf, parse_acs(config), "")
    except ValueError as error:
        return Bridge(bdf, None, f"{path}: {error}")


@check("PCI001", profiles=("prolog",))
def acs_redirect_breaks_gpudirect_rdma(pcie: PcieFacts) -> Iterator[Observation]:
    """ACS P2P redirect on a bridge between a GPU and its nearest RDMA NIC, on bare metal."""
    # A device whose vendor, class or entries could not be read may be a GPU or NIC not seen.
    unclassified = [p for p in pcie.problems if p.startswith("/sys/bus/pci/devices") and not p.split(": ", 1)[0].endswith("/numa_node")]
    if unclassified and not (pcie.gpus and pcie.nics and pcie.pairs):
        raise Unknown(f"cannot tell which PCI devices are GPUs and RDMA NICs: {unclassified[0]}")
    if unclassified:
        yield undecided("PCI devices", f"cannot tell which PCI devices are GPUs and RDMA NICs: {unclassified[0]}")
    if not pcie.gpus or not pcie.nics:
        raise NotApplicable("needs NVIDIA GPUs and RDMA NICs on this node")
    if pcie.hypervisor:
        raise NotApplicable(
            "inside a virtual machine: the guest's emulated bridges do not route P2P traffic; "
            "check ACS and the IOMMU on the host"
        )
    if not pcie.pairs:
        raise NotApplicable("no GPU shares a PCIe switch with an RDMA NIC; their traffic crosses the CPU anyway")
    partners: dict[str, list[str]] = {}
    for gpu, nic, between in pcie.pairs:
        for bdf in between:
            partners.setdefault(bdf, []).append(f"GPU {gpu} <-> NIC {nic}")
    iommu = _iommu_note(pcie)
    for bridge in pcie.bridges:
        if bridge.unreadable:
            yield undecided(f"bridge {bridge.bdf}", bridge.unreadable)
        elif bridge.acs is not None and bridge.acs.control & REDIRECT_BITS:
            evidence = [
                Evidence(
                    f"/sys/bus/pci/devices/{bridge.bdf}/config",
                    f"ACSCtl 0x{bridge.acs.control:04x}: {bridge.acs.describe()}",
                    "ReqRedir- CmpltRedir- on GPU-to-NIC paths",
                ),
                Evidence("path", "; ".join(sorted(set(partners.get(bridge.bdf, []))))),
            ]
            if iommu:
                evidence.append(Evidence("IOMMU", iommu))
            yield present(f"bridge {bridge.bdf}", *evidence)


def _iommu_note(pcie: PcieFacts) -> str:
    if not pcie.iommu_units:
        return ""
    note = f"active ({', '.join(pcie.iommu_units)}); the kernel enables ACS on every bridge when an IOMMU is active"
    if "iommu=pt" in pcie.cmdline.split():
        note += ", and iommu=pt does not change that"
    return note


@check("TOPO005", profiles=("prolog",))
def gpu_hca_cross_numa_gdr(pcie: PcieFacts, job: JobFacts) -> Iterator[Observation]:
    """A GPU whose nearest RDMA NIC is on another socket, or GPUDirect RDMA forced across the CPU."""
    if not pcie.gpus or not pcie.nics:
        raise NotApplicable("needs NVIDIA GPUs and RDMA NICs on this node")
    gdr_level = _setting(job, "NCCL_NET_GDR_LEVEL")
    forced = _LEVEL_NUMBERS.get(gdr_level, gdr_level.upper())
    for gpu, nic, distance in pcie.nearest_nic:
        if distance == "UNKNOWN":
            yield undecided(f"GPU {gpu}", f"numa_node of GPU {gpu} or NIC {nic} is not reported on this multi-socket node")
        elif distance == "SYS":
            yield present(
                f"GPU {gpu}",
                Evidence(f"/sys/bus/pci/devices/{gpu}/numa_node", f"nearest RDMA NIC {nic} is {distance} (another socket)",
                         "a NIC under the GPU's own PCIe switch or root complex"),
            )
        elif forced in _RANK and _RANK[forced] >= _RANK["PHB"] and _RANK[distance] > _RANK[DEFAULT_GDR_LEVEL]:
            yield present(
                f"GPU {gpu}",
                Evidence("NCCL_NET_GDR_LEVEL", f"{gdr_level}: GPUDirect RDMA forced over a {distance} path to NIC {nic}",
                         f"unset (NCCL's default {DEFAULT_GDR_LEVEL} stages such transfers through host memory)"),
            )
