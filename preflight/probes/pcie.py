"""The PCIe paths between GPUs and RDMA NICs and between GPUs: ACS redirect on GPU-to-NIC paths
(PCI001), links trained narrower than they can run (PCI002), ACS redirect on GPU-to-GPU paths and
an IOMMU that translates the GPUs' DMA (PCI003), and GPUs whose nearest NIC is across the CPU or
on another socket (TOPO005).

GPUDirect RDMA needs the NIC's reads and writes of GPU memory to turn around inside the PCIe
switch the two share. ACS "P2P Request Redirect" (RR) or "Completion Redirect" (CR) on a bridge
of that path sends them up to the root complex instead, where the IOMMU rejects them: the NIC
reports a local protection error (vendor err 81) or the job crawls. The same bits between two
GPUs under one switch, or an IOMMU in a translating (``DMA``/``DMA-FQ``) domain for the GPUs,
make CUDA peer-to-peer hang or fault while ``cudaDeviceCanAccessPeer`` still says yes; on
NVSwitch systems GPU peer traffic runs over NVLink and neither applies.

Sources:

* ``/sys/bus/pci/devices/<bdf>`` links give each function's place in the tree
  (``../../../devices/pci0000:15/0000:15:01.0/0000:17:00.0/0000:18:00.0``), with ``vendor`` and
  ``class``; an ``infiniband/`` directory marks an RDMA NIC. An entry that is not such a link
  ending in its own name is a problem (the device is unclassified), not a device to skip.
* ``/sys/bus/pci/devices/<bdf>/config``: extended capabilities from offset 0x100 (header: ID in
  bits 0-15, next offset in bits 20-31); the ACS capability (ID 0x000D) holds the capability
  register at +4 and the control register at +6 (bits in ``include/uapi/linux/pci_regs.h``).
  Without CAP_SYS_ADMIN the kernel returns only the first 64 bytes: that is "needs root", never
  "ACS off". Where a NIC's port into its GPU's switch has Direct Translated P2P set (ACSCtl bit 6),
  the NIC's own config is read too: its ATS capability (ID 0x000F) has the control register at +6,
  bit 15 Enable. A NIC that translates through ATS sends peer requests with translated addresses,
  which that bit lets past the port's redirect (rdma-core's ``rdma_topo --virt`` layout).
* IOMMU: ``/sys/class/iommu`` (one entry per active IOMMU unit), ``/proc/cmdline``. The kernel
  enables ACS on every capable bridge when an IOMMU is active, and ``iommu=pt`` keeps the IOMMU
  active, so it does not turn ACS off.
* ``/sys/bus/pci/devices/<bdf>/numa_node``: the socket a device hangs off (-1: not reported).
* ``/sys/bus/pci/devices/<bdf>/{current,max}_link_{width,speed}`` (``drivers/pci/pci-sysfs.c``:
  the negotiated width and speed from Link Status, the maximum from Link Capabilities; speed as
  ``16.0 GT/s PCIe``, older kernels ``8 GT/s``). A width below the maximum is a link that trained
  narrow (seating, riser, slot wiring, BIOS). GPUs lower their link *speed* when idle to save
  power, so speed is recorded, never judged, in a prolog.
* ``/sys/bus/pci/devices/<bdf>/iommu_group`` (a link to ``/sys/kernel/iommu_groups/<n>``, absent
  without an IOMMU) and ``/sys/kernel/iommu_groups/<n>/type`` (Linux 5.11+: ``identity`` for
  passthrough, ``DMA``/``DMA-FQ`` when the IOMMU translates the group's DMA).
* NVSwitches: NVIDIA (0x10de) bridges of class 0x0680.
* Virtual machines (:mod:`preflight.virtualisation`): the ``hypervisor`` CPU flag, a
  device-tree hypervisor node, DMI names, the SMBIOS virtual-machine bit. In a guest the emulated
  bridges' ACS bits do not decide where P2P traffic goes; the host's do.
"""

from __future__ import annotations

import re

from msgspec import Struct
from msgspec.structs import replace

from preflight.probing import FactReader
from preflight.registry import probe
from preflight.sources import NodeFS, SourceError
from preflight.virtualisation import detect as detect_virtualisation

# The kernel prints the domain with %04x: more digits above 0xffff, as Intel VMD's domains
# (10000 and up) have.
_BDF = re.compile(r"^[0-9a-f]{4,8}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")


_NVIDIA = "0x10de"


_DISPLAY_CLASSES = ("0x0300", "0x0302")  # VGA and 3D controllers


_NVSWITCH_CLASS = "0x0680"


_MELLANOX = "0x15b3"


# A ConnectX-8's Data Direct function: a DMA controller (class 0x0801) of its own that the
# NIC's DMA to and from GPU memory goes through, placed in the GPU's PCIe tree while the NIC's
# own function hangs off the CPU (Grace Blackwell trays). NCCL's topology classes it as the NIC's
# PCI place (src/graph/topo.cc, "CX8 data direct"); rdma-core's rdma_topo pairs it by device ID 2100.
_DATA_DIRECT_CLASS = "0x080100"


EXTENDED_CONFIG_START = 0x100


_ACS_ID = 0x000D


_ATS_ID = 0x000F


#: ATS Control register (capability + 6): bit 15 Enable (``PCI_ATS_CTRL_ENABLE``)
ATS_ENABLE = 0x8000


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


class AcsRegisters(Struct, frozen=True):
    capability: int
    control: int

    def describe(self) -> str:
        return " ".join(f"{name}{'+' if self.control & bit else '-'}" for bit, name in ACS_BITS)


#: /sys/kernel/iommu_groups/<n>/type values whose domain translates the device's DMA.
TRANSLATED_DOMAINS = ("DMA", "DMA-FQ")
#: ACSCtl bits that send peer requests and completions up to the root complex (P2P Request and
#: Completion Redirect, PCIe base specification 7.7.8.3).
REDIRECT_BITS = 0x0004 | 0x0008
#: ACSCtl Direct Translated P2P: peer requests that carry an address the device translated
#: through ATS go straight to their target despite Request Redirect (PCIe base specification
#: 7.7.8.3). rdma-core's ``rdma_topo --virt`` sets it on a ConnectX NIC's switch port so that
#: GPUDirect RDMA turns around in the switch while the ports stay isolated for virtual machines.
DIRECT_TRANSLATED = 0x0040


class Bridge(Struct, frozen=True):
    """A bridge on some GPU-to-NIC path and what its config space says about ACS."""

    bdf: str
    acs: AcsRegisters | None  # None: no ACS capability (nothing to redirect)
    unreadable: str  # why the ACS state is not known; "" when it is


class AtsReading(Struct, frozen=True):
    """Whether a NIC translates its DMA addresses through ATS (Address Translation Services). Read
    only for a NIC whose port into its GPU's switch has Direct Translated P2P set: there, and only
    there, it decides whether the NIC's peer requests bypass the port's redirect."""

    nic: str
    enabled: bool | None  # None: not known (``detail`` says why)
    detail: str  # what was read ("ATS Control 0x8000: Enable+"), or why it is not known


class PcieLink(Struct, frozen=True):
    """A function's PCIe link as the kernel reports it (Link Status and Link Capabilities)."""

    current_width: int | None  # current_link_width: lanes negotiated; 0 when the link is down
    max_width: int | None  # max_link_width
    current_speed: str  # current_link_speed, e.g. "16.0 GT/s PCIe"; "" when not read
    max_speed: str  # max_link_speed
    problem: str  # why the widths are not known, "" when both were read
    # The port above the function (its parent bridge) and that port's max_link_width: a GPU that
    # can run x16 trains x8 in a slot wired x8, and that is the slot, not a fault. "" / None: no
    # bridge above it (a virtual machine's root bus), or its width unread.
    port: str = ""
    port_max_width: int | None = None
    # Whose link this is where it is not the function's own: an SR-IOV virtual function's Link
    # Status is reserved (it reads x0), and its link is its physical function's (device/physfn)
    function: str = ""


class PciEndpoint(Struct, frozen=True):
    bdf: str
    chain: tuple[str, ...]  # bridges from the root port down to the parent of this function
    numa_node: int | None  # None: not reported (-1) or unreadable
    link: PcieLink
    iommu_group: str | None  # the number of the group iommu_group links to; None: no IOMMU for it (or unreadable)
    iommu_domain: str  # /sys/kernel/iommu_groups/<n>/type; "" when absent (kernels before 5.11)
    iommu_problem: str  # why the group link or its domain type could not be read, "" otherwise
    rdma_devices: tuple[str, ...] = ()  # infiniband/<name> of a NIC, e.g. ("mlx5_0",)


class PcieFacts(Struct, frozen=True):
    gpus: tuple[PciEndpoint, ...]
    nics: tuple[PciEndpoint, ...]
    bridges: tuple[Bridge, ...]  # every bridge on a GPU-to-nearest-NIC or GPU-to-GPU path inside a switch
    pairs: tuple[tuple[str, str, tuple[str, ...]], ...]  # (gpu, nic, bridges between them)
    gpu_pairs: tuple[tuple[str, str, tuple[str, ...]], ...]  # (gpu, gpu, bridges between them), same root port
    nvswitches: tuple[str, ...]  # NVIDIA bridges of class 0x0680
    nearest_nic: tuple[tuple[str, str, str], ...]  # (gpu, its nearest NIC, NCCL path class)
    # True in a virtual machine, None where that is unknown (``virtualisation`` says why)
    hypervisor: bool | None
    iommu_units: tuple[str, ...] | None  # entries of /sys/class/iommu; None: not known (reason in problems)
    cmdline: str
    problems: tuple[str, ...]
    # NUMA nodes listed in /sys/devices/system/node (2 when unlisted: an unplaced path is then
    # UNKNOWN, not PHB); with the endpoints it gives every GPU-NIC path class (path())
    sockets: int = 2
    # NUMA nodes without CPUs (/sys/devices/system/node/has_cpu); None: not known. On an Arm host
    # they are the GPUs' memory of a coherent NVLink-C2C platform (Grace Hopper, Grace Blackwell).
    memory_only_nodes: int | None = None
    # /proc/cpuinfo names an Arm CPU ("CPU implementer"): Grace hosts attach their GPUs over
    # NVLink-C2C, a path sysfs does not show and NCCL treats apart (C2C, P2C)
    arm_cpu: bool = False
    # /proc/cpuinfo's vendor_id ("AuthenticAMD", "GenuineIntel"; "" on CPUs without one, Arm);
    # None: /proc/cpuinfo unread. NCCL lets GPUs use P2P across an AMD x86 CPU (PCI003).
    cpu_vendor: str | None = None
    virtualisation: str = ""  # what said guest or bare metal, or why it is unknown
    # ATS of each NIC whose port into its GPU's switch has Direct Translated P2P set (none else)
    nic_ats: tuple[AtsReading, ...] = ()
    # ConnectX Data Direct DMA functions, and each GPU's nearest one in its own switch with the
    # ACS ports between them: where the NIC's DMA with that GPU turns around
    data_direct: tuple[PciEndpoint, ...] = ()
    data_direct_pairs: tuple[tuple[str, str, tuple[str, ...]], ...] = ()

    def path(self, gpu: str, nic: str) -> str | None:
        """NCCL's path class between two of the node's devices, as nearest_nic classes them."""
        first = next((device for device in self.gpus if device.bdf == gpu), None)
        second = next((device for device in self.nics if device.bdf == nic), None)
        return path_class(first, second, self.sockets) if first is not None and second is not None else None


def extended_capability(config: bytes, capability_id: int) -> int | None:
    """The offset of an extended capability in a config-space dump, with its two 16-bit registers
    at +4 and +6 inside the dump; None when the chain does not hold it.

    Raises ValueError when the dump stops before the extended capabilities."""
    if len(config) <= EXTENDED_CONFIG_START:
        raise ValueError(f"only {len(config)} bytes of config space are readable (the rest needs CAP_SYS_ADMIN: run as root, outside a container or in a privileged one)")
    offset = EXTENDED_CONFIG_START
    for _ in range(_MAX_CAPABILITIES):
        if offset < EXTENDED_CONFIG_START or offset + 8 > len(config):
            return None
        header = int.from_bytes(config[offset : offset + 4], "little")
        if header in (0, 0xFFFFFFFF):
            return None
        if header & 0xFFFF == capability_id:
            return offset
        offset = (header >> 20) & 0xFFC
        if offset == 0:
            return None
    return None


def _register(config: bytes, offset: int) -> int:
    return int.from_bytes(config[offset : offset + 2], "little")


def parse_acs(config: bytes) -> AcsRegisters | None:
    """The ACS registers from a config-space dump; None when there is no ACS capability.

    Raises ValueError when the dump stops before the extended capabilities."""
    offset = extended_capability(config, _ACS_ID)
    return None if offset is None else AcsRegisters(_register(config, offset + 4), _register(config, offset + 6))


def parse_ats(config: bytes) -> tuple[bool, str]:
    """Whether a function's ATS is enabled, and what says so, from its config-space dump.

    Raises ValueError as :func:`extended_capability`."""
    offset = extended_capability(config, _ATS_ID)
    if offset is None:
        return False, "no ATS capability"
    control = _register(config, offset + 6)
    return bool(control & ATS_ENABLE), f"ATS Control 0x{control:04x}: Enable{'+' if control & ATS_ENABLE else '-'}"


def device_chain(link_target: str) -> tuple[str, ...]:
    """BDFs in a ``/sys/bus/pci/devices/<bdf>`` link target, root port first, the device last."""
    return tuple(part for part in link_target.split("/") if _BDF.match(part))


def _shared(first: tuple[str, ...], second: tuple[str, ...]) -> int:
    """How many bridges two device chains share from the root port down."""
    common = 0
    while common < min(len(first), len(second)) and first[common] == second[common]:
        common += 1
    return common


def bridges_between(first: tuple[str, ...], second: tuple[str, ...]) -> tuple[str, ...] | None:
    """Bridges a peer-to-peer transfer crosses between two devices (chains include the devices).

    None when the two sit under different root ports: their traffic crosses the root complex
    anyway, and ACS inside a switch is not what decides it."""
    common = _shared(first, second)
    if common == 0:
        return None
    return (first[common - 1], *first[common:-1], *second[common:-1])


def acs_ports_between(first: tuple[str, ...], second: tuple[str, ...]) -> tuple[str, ...] | None:
    """The bridges whose ACS redirect decides a peer-to-peer transfer between two devices: the two
    downstream ports through which each side enters the switch where it turns around. ACS P2P
    Request and Completion Redirect act on what a downstream port receives for another port of its
    own switch (PCIe base specification, 6.12.1.1). The switch's upstream port, the bridge the two
    share, is not on that path, and its ACS applies only to the functions of a multi-function
    device (6.12.1.2; Linux's pci_acs_enabled() so reads it): rdma_topo leaves a ConnectX switch's
    at the kernel's default. A port deeper down (a switch nested inside a BlueField or a
    ConnectX-8) only passes the transfer up or down. None as for :func:`bridges_between`."""
    common = _shared(first, second)
    if common == 0:
        return None
    entries = (*first[common:-1][:1], *second[common:-1][:1])
    return entries or (first[common - 1],)  # no downstream port between them: the shared bridge


def entry_port(device: tuple[str, ...], peer: tuple[str, ...]) -> str | None:
    """The downstream port through which ``device`` enters the switch where its transfers with
    ``peer`` turn around: the port whose ACS control acts on the requests ``device`` sends to
    ``peer``. None where the two share no bridge, or ``device`` hangs right off the turnaround."""
    common = _shared(device, peer)
    return device[common] if common and common < len(device) - 1 else None


def _distance(first: tuple[str, ...], second: tuple[str, ...]) -> int:
    common = _shared(first, second)
    return (len(first) - common) + (len(second) - common) if common else 1_000


def _numa(text: str | None) -> int | None:
    try:
        node = int((text or "").strip())
    except ValueError:
        return None
    return node if node >= 0 else None


def count_node_list(text: str) -> int | None:
    """How many nodes a kernel node list names ("0-3,8" is 5: the format of
    /sys/devices/system/node/has_cpu); None when the text is not such a list."""
    count = 0
    for part in text.strip().split(","):
        first, _, last = part.partition("-")
        if not first.isascii() or not first.isdigit() or (last and (not last.isascii() or not last.isdigit())):
            return None
        low, high = int(first), int(last or first)
        if high < low:
            return None
        count += high - low + 1
    return count


# NCCL's path classes (src/graph/paths.cc), nearest first. NCCL has no NODE: two root ports of
# one socket are PHB to it; only a path across sockets is SYS.
PATH_CLASSES = ("PIX", "PXB", "PHB", "SYS")


LINK_RANK = {name: rank for rank, name in enumerate(PATH_CLASSES)}


LINK_RANK["UNKNOWN"] = LINK_RANK["SYS"]  # rank an unknown path as far, but report it as unknown


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
    nvswitches: list[str] = []
    data_direct: list[PciEndpoint] = []
    chains: dict[str, tuple[str, ...]] = {}
    # An unlisted bus or device directory stays in ``problems``: unclassified_reason() makes the
    # verdicts unknown instead of "no GPUs here".
    for bdf in reader.listing("/sys/bus/pci/devices") or []:
        base = f"/sys/bus/pci/devices/{bdf}"
        chain = _place(fs, reader, bdf)
        if chain is None:
            continue
        chains[bdf] = chain
        vendor = (reader.text(f"{base}/vendor") or "").strip()
        klass = (reader.text(f"{base}/class") or "").strip()
        if vendor == _NVIDIA and klass.startswith(_DISPLAY_CLASSES):
            gpus.append(_endpoint(fs, reader, bdf, chain))
        elif vendor == _NVIDIA and klass.startswith(_NVSWITCH_CLASS):
            nvswitches.append(bdf)
        elif "infiniband" in (reader.listing(base) or []):
            nics.append(_endpoint(fs, reader, bdf, chain, tuple(sorted(reader.listing(f"{base}/infiniband") or []))))
        elif vendor == _MELLANOX and klass == _DATA_DIRECT_CLASS:
            data_direct.append(_endpoint(fs, reader, bdf, chain))
    nodes = reader.listing("/sys/devices/system/node")
    listed = None if nodes is None else sum(1 for name in nodes if re.fullmatch(r"node\d+", name))
    with_cpus = count_node_list(reader.text("/sys/devices/system/node/has_cpu") or "") if nodes is not None else None
    # NUMA nodes with CPUs: a Grace Hopper's GPU memory is NUMA nodes too, none of them a socket.
    # Unlisted NUMA nodes: as if several sockets, so an unplaced path is UNKNOWN, not PHB.
    sockets = with_cpus if with_cpus else listed if listed is not None else 2
    pairs = []
    nearest_nic = []
    wanted: set[str] = set()
    for gpu in gpus:
        if not nics:
            break
        ranked = sorted(nics, key=lambda nic: (LINK_RANK[path_class(gpu, nic, sockets)], _distance(chains[gpu.bdf], chains[nic.bdf])))
        best = ranked[0]
        nearest_nic.append((gpu.bdf, best.bdf, path_class(gpu, best, sockets)))
        for nic in ranked:
            if _distance(chains[gpu.bdf], chains[nic.bdf]) != _distance(chains[gpu.bdf], chains[best.bdf]):
                continue
            between = acs_ports_between(chains[gpu.bdf], chains[nic.bdf])
            if between is not None:
                pairs.append((gpu.bdf, nic.bdf, between))
                wanted.update(between)
    data_direct_pairs = _data_direct_pairs(gpus, data_direct, chains)
    for _, _, between in data_direct_pairs:
        wanted.update(between)
    gpu_pairs = []
    for number, first in enumerate(gpus):
        for second in gpus[number + 1 :]:
            between = acs_ports_between(chains[first.bdf], chains[second.bdf])
            if between is not None:
                gpu_pairs.append((first.bdf, second.bdf, between))
                wanted.update(between)
    bridges = tuple(_bridge(fs, bdf) for bdf in sorted(wanted))
    direct = {bridge.bdf for bridge in bridges if bridge.acs is not None and bridge.acs.control & DIRECT_TRANSLATED}
    # A NIC's ATS matters only behind a port with Direct Translated P2P: a prolog reads no more.
    behind_direct = sorted({nic for gpu, nic, _ in (*pairs, *data_direct_pairs) if entry_port(chains[nic], chains[gpu]) in direct})
    known_cpuinfo = reader.text("/proc/cpuinfo")
    cpuinfo = known_cpuinfo or ""
    virtual = detect_virtualisation(fs, known_cpuinfo)
    units = _iommu_units(reader)
    if units and not fs.is_live:
        gpus = [_without_group_link(gpu) for gpu in gpus]
    return PcieFacts(
        gpus=tuple(gpus),
        nics=tuple(nics),
        bridges=bridges,
        pairs=tuple(pairs),
        gpu_pairs=tuple(gpu_pairs),
        nvswitches=tuple(nvswitches),
        nearest_nic=tuple(nearest_nic),
        hypervisor=virtual.guest,
        iommu_units=units,
        cmdline=(reader.text("/proc/cmdline") or "").strip(),
        problems=tuple(reader.problems),
        sockets=sockets,
        memory_only_nodes=None if listed is None or not with_cpus else max(listed - with_cpus, 0),
        arm_cpu=any(line.startswith("CPU implementer") for line in cpuinfo.splitlines()),
        cpu_vendor=None if known_cpuinfo is None else cpu_vendor(known_cpuinfo),
        virtualisation=virtual.evidence,
        nic_ats=tuple(_ats(fs, nic) for nic in behind_direct),
        data_direct=tuple(data_direct),
        data_direct_pairs=data_direct_pairs,
    )


def _data_direct_pairs(gpus: list[PciEndpoint], functions: list[PciEndpoint],
                       chains: dict[str, tuple[str, ...]]) -> tuple[tuple[str, str, tuple[str, ...]], ...]:
    """Each GPU with the Data Direct functions nearest to it among those in its own switch (a
    function across the CPU is no GPU's), and the ACS ports between them."""
    pairs = []
    for gpu in gpus:
        near = [(function, acs_ports_between(chains[gpu.bdf], chains[function.bdf])) for function in functions]
        shared = [(function, between) for function, between in near if between is not None]
        if not shared:
            continue
        closest = min(_distance(chains[gpu.bdf], chains[function.bdf]) for function, _ in shared)
        pairs += [(gpu.bdf, function.bdf, between) for function, between in shared
                  if between is not None and _distance(chains[gpu.bdf], chains[function.bdf]) == closest]
    return tuple(pairs)


def _place(fs: NodeFS, reader: FactReader, bdf: str) -> tuple[str, ...] | None:
    """The device's chain from its ``/sys/bus/pci/devices`` link. An entry that is no link (a
    capture taken with ``cp -L``/``tar -h`` turns them into directories) or whose target does not
    end in its own name has no place in the tree: it becomes a problem, so the checks say unknown
    rather than "no GPUs here" for a device they could not classify."""
    base = f"/sys/bus/pci/devices/{bdf}"
    try:
        target = fs.readlink(base)
    except SourceError as error:
        reader.problems.append(f"{base}: {error.reason}")
        return None
    if target is None:
        reader.problems.append(f"{base}: not a link into /sys/devices, so its place in the PCI tree is unknown")
        return None
    chain = device_chain(target)
    if not chain or chain[-1] != bdf:
        reader.problems.append(f"{base}: link target {target[:120]!r} does not end in {bdf}")
        return None
    return chain


def cpu_vendor(cpuinfo: str) -> str:
    """The first ``vendor_id`` of ``/proc/cpuinfo`` (x86 only: the CPUID vendor string NCCL
    reads too), "" when there is none."""
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == "vendor_id":
            return value.strip()
    return ""


def _iommu_units(reader: FactReader) -> tuple[str, ...] | None:
    """The active IOMMU units. ``/sys/class/iommu`` exists, empty, on every kernel built with
    IOMMU support even when no IOMMU is enabled; it is a capture unit, so a copied root that
    lacks it tells nothing (None) rather than "no IOMMU"."""
    units = reader.listing("/sys/class/iommu")
    return None if units is None else tuple(units)


def _without_group_link(gpu: PciEndpoint) -> PciEndpoint:
    """On a live node an active IOMMU groups every device in its scope, and a GPU without the
    link is outside it; in a recorded root the link may just not have been copied."""
    if gpu.iommu_group is not None or gpu.iommu_problem:
        return gpu
    return replace(gpu, iommu_problem="an IOMMU is active but this root has no iommu_group link for the GPU (not copied, or outside the IOMMU's scope)")


def _endpoint(fs: NodeFS, reader: FactReader, bdf: str, chain: tuple[str, ...], rdma: tuple[str, ...] = ()) -> PciEndpoint:
    base = f"/sys/bus/pci/devices/{bdf}"
    group, domain, problem = None, "", ""
    try:
        target = fs.readlink(f"{base}/iommu_group")
        if target:
            group = target.rstrip("/").rsplit("/", 1)[-1]
            domain = (fs.read(f"/sys/kernel/iommu_groups/{group}/type") or "").strip()
    except SourceError as error:
        problem = str(error)
    link = _link(reader, base)
    if link.current_width == 0:
        physical = _physical_function(fs, base)
        if physical:
            link = replace(_link(reader, f"/sys/bus/pci/devices/{physical}"), function=physical)
    narrow = link.current_width is not None and link.max_width is not None and 0 < link.current_width < link.max_width
    if narrow and len(chain) > 1:
        # Only a narrow link asks its port: every prolog reads this for each GPU and NIC.
        port = chain[-2]
        link = replace(link, port=port, port_max_width=parse_width(reader.text(f"/sys/bus/pci/devices/{port}/max_link_width")))
    return PciEndpoint(bdf, chain[:-1], _numa(reader.text(f"{base}/numa_node")), link, group, domain, problem, rdma)


def _physical_function(fs: NodeFS, base: str) -> str:
    """The PCI address ``<bdf>/physfn`` links to: the device is an SR-IOV virtual function; "" when
    it is none (or the link cannot be read, and then its own x0 stands)."""
    try:
        target = fs.readlink(f"{base}/physfn")
    except SourceError:
        return ""
    return target.rstrip("/").rsplit("/", 1)[-1] if target else ""


def parse_width(text: str | None) -> int | None:
    """``current_link_width``/``max_link_width``: a decimal lane count ("16")."""
    try:
        width = int((text or "").strip())
    except ValueError:
        return None
    return width if 0 <= width <= 32 else None


def _link(reader: FactReader, base: str) -> PcieLink:
    texts = {name: reader.text(f"{base}/{name}") for name in ("current_link_width", "max_link_width", "current_link_speed", "max_link_speed")}
    current, maximum = parse_width(texts["current_link_width"]), parse_width(texts["max_link_width"])
    problem = ""
    if texts["current_link_width"] is None and texts["max_link_width"] is None:
        problem = f"{base}/current_link_width and max_link_width are missing or unreadable"
    elif current is None or maximum is None:
        shown = ", ".join(f"{name} {str(texts[name])[:20]!r}" for name in ("current_link_width", "max_link_width"))
        problem = f"{base}: link width not a lane count ({shown})"
    return PcieLink(current, maximum, (texts["current_link_speed"] or "").strip(), (texts["max_link_speed"] or "").strip(), problem)


def _config_space(fs: NodeFS, bdf: str) -> bytes | str:
    """A function's config space, or why it could not be read."""
    path = f"/sys/bus/pci/devices/{bdf}/config"
    try:
        config = fs.read_bytes(path)
    except SourceError as error:
        return f"{path}: {error.reason}"
    return f"{path} does not exist" if config is None else config


def _bridge(fs: NodeFS, bdf: str) -> Bridge:
    config = _config_space(fs, bdf)
    if isinstance(config, str):
        return Bridge(bdf, None, config)
    try:
        return Bridge(bdf, parse_acs(config), "")
    except ValueError as error:
        return Bridge(bdf, None, f"/sys/bus/pci/devices/{bdf}/config: {error}")


def _ats(fs: NodeFS, bdf: str) -> AtsReading:
    config = _config_space(fs, bdf)
    if isinstance(config, str):
        return AtsReading(bdf, None, config)
    try:
        enabled, detail = parse_ats(config)
    except ValueError as error:
        return AtsReading(bdf, None, f"/sys/bus/pci/devices/{bdf}/config: {error}")
    return AtsReading(bdf, enabled, detail)


def unclassified_reason(pcie: PcieFacts) -> str:
    """Why some PCI device may be a GPU or RDMA NIC not seen (its vendor, class or entries could
    not be read); "" when every device was classified."""
    for problem in pcie.problems:
        path = problem.split(": ", 1)[0]
        device_file = path.startswith("/sys/bus/pci/devices/") and (path.endswith(("/vendor", "/class")) or path.count("/") == 5)
        if path == "/sys/bus/pci/devices" or device_file:
            return f"cannot tell which PCI devices are GPUs and RDMA NICs: {problem}"
    return ""
