"""RDMA devices, their ports and the job's access to them (references IB007, IB008, IB009).

Sources (kernel ``drivers/infiniband/core/sysfs.c``; all world-readable except ``vpd``):

* ``/sys/class/infiniband/<dev>/{node_type,fw_ver,hca_type}``; ``<dev>/device`` links to the PCI
  function (``../../../0000:1a:00.0``), whose ``vendor`` tells EFA (Amazon, 0x1d0f) apart.
* ``<dev>/ports/<n>/{state,phys_state,rate,link_layer,lid,sm_lid}``: ``"4: ACTIVE"``,
  ``"5: LinkUp"``, ``"400 Gb/sec (4X NDR)"`` (SDR has no speed suffix: ``"10 Gb/sec (4X)"``),
  ``InfiniBand``/``Ethernet``/``Unknown``, ``"0x1a"``. ``rate`` fails with EINVAL while a port
  has no active width (a down port).
* RDMA device -> netdev, as ``ibdev2netdev`` did: ``ports/<n>/gid_attrs/ndevs/<i>`` first (right
  for bonds, VLANs and macvlan; EINVAL for empty slots and on InfiniBand ports, which is normal),
  then the PCI function's ``device/net/*`` (IPoIB, and RoCE without GIDs), narrowed by
  ``dev_port`` on multi-port devices.
* RoCE ports only: ``ports/<n>/hw_counters/out_of_sequence`` and ``packet_seq_err`` (mlx5's
  ``drivers/infiniband/hw/mlx5/counters.c``), decimal counts since the driver loaded, shown as
  evidence by ROCE003; a driver without them has no file, which is "not reported", never 0.
* ``/sys/class/infiniband_verbs/uverbs<N>/ibdev``: which verbs device node belongs to which RDMA
  device; ``/dev/infiniband/uverbs<N>`` and ``/dev/infiniband/rdma_cm`` (mode, owner) against the
  job's identity (``preflight.probes.gpudirect.read_job_identity``).
* ``/sys/module/mlx5_core/version``: the mlx5 driver's own version. MLNX_OFED and DOCA-OFED
  build their modules with one (``24.10-1.1.4``); the kernel's in-tree mlx5 has none (the
  kernel dropped per-driver versions), which is how NVIDIA's nic-feature-discovery tells an
  inbox driver apart. A fleet compares it as the node's RDMA stack.
* NVSwitch management functions: on HGX/DGX B200 the baseboard's ConnectX bridge exposes
  "limited physical functions" (LPFs) as extra ``mlx5_*`` devices that Fabric Manager and NVLSM
  use to manage the NVSwitches; they are not data NICs. NVIDIA's Fabric Manager guide says their
  PCI VPD carries the vendor field ``SMDL=SW_MNG``, which is what ``nvidia-fabricmanager-start.sh``
  tests; we read ``<dev>/device/vpd`` of InfiniBand-link Mellanox functions for it. The file is
  root-only (mode 0600): run as non-root, LPFs cannot be told apart and count as data NICs, except
that IB008 and IB009 call an inactive port of such a function unknown (see ``management_unknown``).

Which ports a missing link condemns: without ``expect.hcas`` a port is only judged when most ports
of its kind (same link layer and HCA model, on adapters of as many functions) are ACTIVE, or when
no port on the node is; an uncabled second port or an unused storage port of another model is
then not mistaken for a broken data link. A storage port of the rails' own model (DGX H100) still counts with its kind, so while
neither ``expect.hcas`` nor a visible ``NCCL_IB_HCA`` names the rails IB009 reports such ports as
warnings. Sites that list their data HCAs in ``expect.hcas`` get every port of those HCAs judged.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Iterable
from typing import TypeVar

from msgspec import Struct
from msgspec.structs import replace

from preflight.model import (
    Evidence,
    NotApplicable,
    Unknown,
)
from preflight.probes.gpudirect import DeviceNode, JobIdentity, read_job_identity
from preflight.probes.job import parse_environ
from preflight.probing import FactReader, container_marker
from preflight.registry import probe
from preflight.sources import NodeFS, SourceError
from preflight.units import is_number

IB_CLASS = "/sys/class/infiniband"


VERBS_CLASS = "/sys/class/infiniband_verbs"


DEV_INFINIBAND = "/dev/infiniband"


RDMA_CM = f"{DEV_INFINIBAND}/rdma_cm"


MLX5_MODULE = "/sys/module/mlx5_core"


PORT_ACTIVE = 4


PHYS_DISABLED = 3


MELLANOX_VENDOR = "0x15b3"


AMAZON_VENDOR = "0x1d0f"


NVSWITCH_MANAGEMENT_VPD = b"SMDL=SW_MNG"


_SYSFS_ATTRIBUTE_BYTES = 4096


_VPD_BYTES = 64 * 1024  # PCI VPD is at most 32 KiB


_PCI_ADDRESS = re.compile(r"^[0-9a-f]{4,8}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")


_NUMBERED = re.compile(r"^(\d+): (\S.*)$")


_RATE = re.compile(r"^(\d+)(\.5)? Gb/sec \((\d+)X(?: (\w+))?\)$")


_T = TypeVar("_T")


class Problem(Struct, frozen=True):
    """A node file that exists (or should) but gave no usable value."""

    path: str
    reason: str  # "missing", "empty", "unparseable 'x'", "invalid argument (EINVAL)", ...

    def __str__(self) -> str:
        return f"{self.path}: {self.reason}"


class PortRate(Struct, frozen=True):
    """``ports/<n>/rate``: ``400 Gb/sec (4X NDR)``."""

    gbps: float
    width: int  # lanes: 1, 2, 4, 8, 12
    speed: str  # per-lane generation: SDR, DDR, QDR, FDR10, FDR, EDR, HDR, NDR, XDR

    def __str__(self) -> str:
        return f"{self.gbps:g} Gb/sec ({self.width}X {self.speed})"


class RdmaPort(Struct, frozen=True):
    device: str
    number: int
    path: str  # /sys/class/infiniband/<dev>/ports/<n>
    state: int | None  # ports/<n>/state: 1 DOWN, 2 INIT, 3 ARMED, 4 ACTIVE
    state_name: str | None
    phys_state: int | None  # ports/<n>/phys_state: 2 Polling, 3 Disabled, 5 LinkUp
    phys_state_name: str | None
    rate: PortRate | None  # ports/<n>/rate
    link_layer: str | None  # ports/<n>/link_layer: InfiniBand, Ethernet, Unknown (EFA)
    lid: int | None  # ports/<n>/lid
    sm_lid: int | None  # ports/<n>/sm_lid
    netdevs: tuple[str, ...]  # gid_attrs/ndevs/* in slot order, else device/net/*
    netdev_source: str  # "gid_attrs/ndevs", "device/net" or "" when none
    problems: tuple[Problem, ...]
    # IPoIB netdevs only: /sys/class/net/<if>/mode, "datagram" (MTU up to 4092) or "connected"
    # (up to 65520); recorded so a fleet comparison shows nodes that differ.
    ipoib_mode: str | None = None
    # ports/<n>/hw_counters/{out_of_sequence,packet_seq_err}: packets the responder received
    # out of PSN order and sequence-error NAKs the requester got, since the driver loaded (mlx5
    # and others; a driver without them has no file). None: not reported or unreadable.
    out_of_sequence: int | None = None
    packet_seq_err: int | None = None

    @property
    def subject(self) -> str:
        return f"{self.device}/{self.number}"

    def why(self, attribute: str) -> str:
        """Why ``attribute`` has no value: the recorded read problem."""
        wanted = f"{self.path}/{attribute}"
        return next((str(p) for p in self.problems if p.path == wanted), f"{wanted}: not read")

    def shown(self, attribute: str) -> str:
        """``"4: ACTIVE"`` style text of a state attribute, or why it is unknown."""
        number, name = (self.state, self.state_name) if attribute == "state" else (self.phys_state, self.phys_state_name)
        return f"{number}: {name}" if number is not None else "unknown"


class RdmaDevice(Struct, frozen=True):
    name: str
    path: str  # /sys/class/infiniband/<dev>
    node_type: str | None  # node_type "1: CA" -> "CA"; "7: unspecified" on EFA
    fw_ver: str | None  # fw_ver
    hca_type: str | None  # hca_type ("MT4129"); None where the driver has none
    pci_address: str | None  # basename of the device link; None for virtual devices (rxe, siw)
    pci_vendor: str | None  # device/vendor
    efa: bool  # an AWS Elastic Fabric Adapter (Amazon PCI vendor, or efa_* name)
    nvswitch_management: bool | None  # device/vpd has SMDL=SW_MNG; None when vpd is unreadable
    netdevs: tuple[str, ...]  # device/net/*: the PCI function's netdevs
    uverbs: str | None  # "uverbs3" from /sys/class/infiniband_verbs/*/ibdev
    ports: tuple[RdmaPort, ...]
    problems: tuple[Problem, ...]
    # EFA only: the GPU-memory provider Amazon's efa.ko names in device/p2p ("NVIDIA", "NVIDIA
    # peermem", "NEURON"; "" when none is available now), "NVIDIA" where an older efa.ko says
    # device/gdr 1; None when neither file is there (the kernel's own efa driver) or readable.
    efa_gpu_memory: str | None = None
    # RDMA devices on this device's adapter (PCI functions of one bus:device): a dual-port card
    # shows two. A 1x400G BlueField-3 SuperNIC and a 2x200G BlueField-3 DPU share hca_type MT41692.
    adapter_functions: int = 1

    @property
    def is_data_nic(self) -> bool:
        return self.nvswitch_management is not True


class RdmaFacts(Struct, frozen=True):
    devices: tuple[RdmaDevice, ...]  # /sys/class/infiniband, in name order
    verbs_class_present: bool | None  # ib_uverbs loaded: /sys/class/infiniband_verbs, else /sys/module/ib_uverbs; None: unknown
    dev_infiniband: tuple[str, ...] | None  # entries of /dev/infiniband; None when absent
    device_nodes: tuple[DeviceNode, ...]  # stat of the uverbs nodes of our devices and rdma_cm
    job_identity: JobIdentity | None
    problems: tuple[Problem, ...]  # node-level: unreadable class or /dev directories
    # /sys/module/mlx5_core/version: MLNX_OFED/DOCA-OFED's version, "" for a loaded in-tree
    # (inbox) mlx5 without one, None when mlx5_core is not loaded or the file is unreadable
    mlx5_driver_version: str | None = None
    # Where no RDMA device is registered: ConnectX InfiniBand controllers (PCI class 0x0207) that
    # mlx5_core drives while mlx5_ib is not loaded, so none has its RDMA device; None where
    # mlx5_core runs without mlx5_ib and the PCI bus, or a function on it, could not be read
    hcas_without_device: tuple[str, ...] | None = ()
    # Where some device's uverbs node is missing from /dev/infiniband: what shows this process runs
    # in a container (probing.container_marker), "" nothing, None not known; "" when not asked
    container: str | None = ""

    @property
    def class_unread(self) -> str:
        """Why /sys/class/infiniband could not be read (which devices exist is then unknown), "" when it was."""
        return next((str(problem) for problem in self.problems if problem.path == IB_CLASS), "")

    @property
    def data_devices(self) -> tuple[RdmaDevice, ...]:
        return tuple(device for device in self.devices if device.is_data_nic)

    @property
    def data_ports(self) -> tuple[RdmaPort, ...]:
        return tuple(port for device in self.data_devices for port in device.ports)

    def device(self, name: str) -> RdmaDevice | None:
        return next((device for device in self.devices if device.name == name), None)

    def node(self, path: str) -> DeviceNode | None:
        return next((node for node in self.device_nodes if node.path == path), None)


# -- parsers ----------------------------------------------------------------------------------
def parse_numbered(text: str) -> tuple[int, str] | None:
    """``"4: ACTIVE"`` -> ``(4, "ACTIVE")``: the ``"%d: %s"`` form of state, phys_state, node_type."""
    match = _NUMBERED.match(text.strip())
    return (int(match.group(1)), match.group(2).strip()) if match else None


def parse_rate(text: str) -> PortRate | None:
    """``"400 Gb/sec (4X NDR)"``, ``"2.5 Gb/sec (1X)"`` (SDR prints no speed name)."""
    match = _RATE.match(text.strip())
    if not match:
        return None
    gbps = int(match.group(1)) + (0.5 if match.group(2) else 0.0)
    return PortRate(gbps, int(match.group(3)), match.group(4) or "SDR")


def parse_hex(text: str) -> int | None:
    """``"0x1a"`` (lid, sm_lid)."""
    try:
        return int(text.strip(), 16) if text.strip().lower().startswith("0x") else None
    except ValueError:
        return None


def parse_link_layer(text: str) -> str | None:
    value = text.strip()
    return value if value in ("InfiniBand", "Ethernet", "Unknown") else None


def parse_pci_link(target: str) -> str | None:
    """``../../../0000:1a:00.0`` -> ``0000:1a:00.0``."""
    name = target.rstrip("/").rsplit("/", 1)[-1].lower()
    return name if _PCI_ADDRESS.match(name) else None


def natural_key(name: str) -> tuple[tuple[int, str], ...]:
    """Sort ``mlx5_2`` before ``mlx5_10``, as device numbering means them."""
    # re's \d and str.isdigit() also take non-ASCII digits ('²'), which int() may refuse.
    return tuple((int(part), "") if part.isascii() and part.isdigit() else (-1, part) for part in re.split(r"(\d+)", name) if part)


def looks_like_efa(name: str, vendor: str | None) -> bool:
    """An EFA device: Amazon's PCI vendor, or the driver's ``efa_<N>`` name when the vendor is unknown."""
    if vendor is not None and vendor.strip():
        return vendor.strip().lower() == AMAZON_VENDOR
    return name.startswith("efa")


# -- probe ------------------------------------------------------------------------------------
class _Attributes:
    """Reads sysfs attributes into values or :class:`Problem` entries, never raising."""

    def __init__(self, fs: NodeFS) -> None:
        self.fs = fs
        self.problems: list[Problem] = []

    def value(self, path: str, parse: Callable[[str], _T | None], required: bool = True) -> _T | None:
        try:
            text = self.fs.read(path, max_bytes=_SYSFS_ATTRIBUTE_BYTES)
        except SourceError as error:
            self.problems.append(Problem(path, error.reason))
            return None
        if text is None:
            if required:
                self.problems.append(Problem(path, "missing"))
            return None
        if not text.strip():
            self.problems.append(Problem(path, "empty"))
            return None
        parsed = parse(text)
        if parsed is None:
            self.problems.append(Problem(path, f"unparseable {text.strip()[:60]!r}"))
        return parsed

    def listing(self, path: str) -> list[str] | None:
        try:
            return self.fs.listdir(path)
        except SourceError as error:
            self.problems.append(Problem(path, error.reason))
            return None

    def link(self, path: str) -> str | None:
        """A symlink's target; ``None`` when absent (a virtual device has no ``device`` link)."""
        try:
            target = self.fs.readlink(path)
            if target is None and self.fs.exists(path):
                self.problems.append(Problem(path, "not a symbolic link"))
            return target
        except SourceError as error:
            self.problems.append(Problem(path, error.reason))
            return None

    def take(self) -> tuple[Problem, ...]:
        taken, self.problems = tuple(self.problems), []
        return taken


def _text(value: str) -> str | None:
    return value.strip() or None


def _gid_netdevs(fs: NodeFS, port_path: str, reader: _Attributes) -> tuple[str, ...]:
    """Distinct netdevs of a port's GID table in slot order; empty slots answer EINVAL."""
    names: list[str] = []
    for slot in sorted((reader.listing(f"{port_path}/gid_attrs/ndevs") or []), key=natural_key):
        path = f"{port_path}/gid_attrs/ndevs/{slot}"
        try:
            text = fs.read(path, max_bytes=_SYSFS_ATTRIBUTE_BYTES)
        except SourceError as error:
            if "EINVAL" not in error.reason:
                reader.problems.append(Problem(path, error.reason))
            continue
        name = (text or "").strip()
        if name and name not in names:
            names.append(name)
    return tuple(names)


def _pci_netdevs(fs: NodeFS, device_path: str, port: int, ports: int, reader: _Attributes) -> tuple[str, ...]:
    """The PCI function's netdevs; on multi-port devices those whose dev_port is ``port - 1``."""
    names = reader.listing(f"{device_path}/device/net") or []
    if ports <= 1:
        return tuple(names)
    chosen = []
    for name in names:
        dev_port = reader.value(f"{device_path}/device/net/{name}/dev_port", lambda t: int(t) if is_number(t.strip()) else None, required=False)
        if dev_port is None or dev_port == port - 1:
            chosen.append(name)
    return tuple(chosen)


def _read_port(fs: NodeFS, device: str, device_path: str, number: int, port_count: int) -> RdmaPort:
    reader = _Attributes(fs)
    path = f"{device_path}/ports/{number}"
    state = reader.value(f"{path}/state", parse_numbered)
    phys = reader.value(f"{path}/phys_state", parse_numbered)
    link_layer = reader.value(f"{path}/link_layer", parse_link_layer)
    netdevs: tuple[str, ...] = ()
    source = ""
    if link_layer != "InfiniBand":  # IB ports have GIDs but no netdev in gid_attrs
        netdevs, source = _gid_netdevs(fs, path, reader), "gid_attrs/ndevs"
    if not netdevs:
        netdevs, source = _pci_netdevs(fs, device_path, number, port_count, reader), "device/net"
    return RdmaPort(
        device=device,
        number=number,
        path=path,
        state=state[0] if state else None,
        state_name=state[1] if state else None,
        phys_state=phys[0] if phys else None,
        phys_state_name=phys[1] if phys else None,
        rate=reader.value(f"{path}/rate", parse_rate),
        link_layer=link_layer,
        lid=reader.value(f"{path}/lid", parse_hex),
        sm_lid=reader.value(f"{path}/sm_lid", parse_hex),
        netdevs=netdevs,
        netdev_source=source if netdevs else "",
        problems=reader.take(),
        ipoib_mode=_ipoib_mode(fs, netdevs) if link_layer == "InfiniBand" else None,
        out_of_sequence=_counter(fs, f"{path}/hw_counters/out_of_sequence") if link_layer == "Ethernet" else None,
        packet_seq_err=_counter(fs, f"{path}/hw_counters/packet_seq_err") if link_layer == "Ethernet" else None,
    )


def parse_counter(text: str) -> int | None:
    """A ``hw_counters`` file: a decimal count (``"4819337"``)."""
    value = text.strip()
    return int(value) if is_number(value) else None


def _counter(fs: NodeFS, path: str) -> int | None:
    """A hardware counter, or None when the driver has none or it cannot be read: counters are
    shown as evidence, and a missing one must never read as 0."""
    try:
        text = fs.read(path, max_bytes=_SYSFS_ATTRIBUTE_BYTES)
    except SourceError:
        return None
    return parse_counter(text) if text is not None else None


def _ipoib_mode(fs: NodeFS, netdevs: tuple[str, ...]) -> str | None:
    for netdev in netdevs:
        try:
            mode = fs.read(f"/sys/class/net/{netdev}/mode")
        except SourceError:
            return None
        if mode is not None and mode.strip() in ("datagram", "connected"):
            return mode.strip()
    return None


def _management_function(fs: NodeFS, path: str, reader: _Attributes) -> bool | None:
    try:
        vpd = fs.read_bytes(f"{path}/device/vpd", max_bytes=_VPD_BYTES)
    except SourceError as error:
        reader.problems.append(Problem(f"{path}/device/vpd", error.reason))
        return None
    return vpd is not None and NVSWITCH_MANAGEMENT_VPD in vpd


def _read_device(fs: NodeFS, name: str, uverbs: dict[str, str]) -> RdmaDevice:
    reader = _Attributes(fs)
    path = f"{IB_CLASS}/{name}"
    node_type = reader.value(f"{path}/node_type", parse_numbered)
    link = reader.link(f"{path}/device")
    pci_address = parse_pci_link(link) if link else None
    if link and pci_address is None:
        reader.problems.append(Problem(f"{path}/device", f"not a PCI function: {link!r}"))
    vendor = reader.value(f"{path}/device/vendor", _text, required=False) if link else None
    # Ports are numbered in ASCII digits; one odd entry ('³', which isdigit() takes and int() refuses) must not sink the probe.
    numbers = sorted(int(entry) for entry in (reader.listing(f"{path}/ports") or []) if entry.isascii() and entry.isdigit())
    if not numbers:
        reader.problems.append(Problem(f"{path}/ports", "no ports"))
    ports = tuple(_read_port(fs, name, path, number, len(numbers)) for number in numbers)
    efa = looks_like_efa(name, vendor)
    management: bool | None = False
    if vendor == MELLANOX_VENDOR and any(port.link_layer == "InfiniBand" for port in ports):
        management = _management_function(fs, path, reader)
    return RdmaDevice(
        name=name,
        path=path,
        node_type=node_type[1] if node_type else None,
        fw_ver=reader.value(f"{path}/fw_ver", _text),
        hca_type=reader.value(f"{path}/hca_type", _text, required=False),
        pci_address=pci_address,
        pci_vendor=vendor.lower() if vendor else None,
        efa=efa,
        nvswitch_management=management,
        netdevs=tuple(reader.listing(f"{path}/device/net") or []) if link else (),
        uverbs=uverbs.get(name) or (_device_verbs(fs, path, name) if link else None),
        ports=ports,
        efa_gpu_memory=_efa_gpu_memory(fs, path, reader) if link and efa else None,
        problems=reader.take(),
    )


def _efa_gpu_memory(fs: NodeFS, path: str, reader: _Attributes) -> str | None:
    """Amazon's efa.ko maps GPU memory itself (efa_p2p.c, amzn-drivers): device/p2p names the
    first provider it can use now, empty when none; older releases built with GPUDirect
    support have device/gdr reading 1 instead."""
    for attribute in ("p2p", "gdr"):
        try:
            text = fs.read(f"{path}/device/{attribute}", max_bytes=_SYSFS_ATTRIBUTE_BYTES)
        except SourceError as error:
            reader.problems.append(Problem(f"{path}/device/{attribute}", error.reason))
            return None
        if text is not None:
            value = text.strip()
            return value if attribute == "p2p" else ("NVIDIA" if value == "1" else "")
    return None


def _verbs_devices(reader: _Attributes, entries: Iterable[str]) -> dict[str, str]:
    """RDMA device name -> ``uverbsN`` from ``/sys/class/infiniband_verbs/uverbsN/ibdev``."""
    mapping = {}
    for entry in entries:
        if entry.startswith("uverbs"):
            ibdev = reader.value(f"{VERBS_CLASS}/{entry}/ibdev", _text)
            if ibdev:
                mapping[ibdev] = entry
    return mapping


def _device_verbs(fs: NodeFS, path: str, name: str) -> str | None:
    """``uverbsN`` from the PCI function's own ``infiniband_verbs/`` directory: the class
    directory's links point there, and a capture may hold one without the other."""
    try:
        for entry in fs.listdir(f"{path}/device/infiniband_verbs") or []:
            if entry.startswith("uverbs") and (fs.read(f"{path}/device/infiniband_verbs/{entry}/ibdev") or "").strip() == name:
                return entry
    except SourceError:
        return None  # the class directory decides, or the check says unknown
    return None


def _uverbs_loaded(reader: _Attributes) -> bool | None:
    """Whether ib_uverbs is loaded when its class directory is not there: a capture may lack the
    class directory, so only ``/sys/module`` (captured, without ``ib_uverbs``) says "not loaded"."""
    # The class directory's problem: explained by the module's absence, or kept.
    unlisted = [reader.problems.pop()] if reader.problems and reader.problems[-1].path == VERBS_CLASS else []
    try:
        module = reader.fs.exists("/sys/module/ib_uverbs")
    except SourceError as error:
        reader.problems += [*unlisted, Problem("/sys/module/ib_uverbs", error.reason)]
        return None
    if module:
        reader.problems += unlisted or [Problem(VERBS_CLASS, "missing although ib_uverbs is loaded")]
        return None
    return False


def _stat_node(fs: NodeFS, path: str, reader: _Attributes) -> DeviceNode | None:
    try:
        stat = fs.stat(path)
    except SourceError as error:
        reader.problems.append(Problem(path, error.reason))
        return None
    return DeviceNode(path, stat.mode, stat.uid, stat.gid) if stat else None


def _mlx5_driver_version(reader: _Attributes) -> str | None:
    """See :attr:`RdmaFacts.mlx5_driver_version`; an unreadable file is a problem, not inbox."""
    try:
        if reader.fs.listdir(MLX5_MODULE) is None:
            return None  # mlx5_core not loaded
        text = reader.fs.read(f"{MLX5_MODULE}/version", max_bytes=_SYSFS_ATTRIBUTE_BYTES)
    except SourceError as error:
        reader.problems.append(Problem(error.source, error.reason))
        return None
    return "" if text is None else text.strip()[:100]


def _adapter(device: RdmaDevice) -> str | None:
    return device.pci_address.rsplit(".", 1)[0] if device.pci_address else None


def _with_adapter_functions(devices: tuple[RdmaDevice, ...]) -> tuple[RdmaDevice, ...]:
    counts = Counter(adapter for adapter in map(_adapter, devices) if adapter is not None)
    return tuple(
        replace(device, adapter_functions=counts[adapter]) if (adapter := _adapter(device)) is not None and counts[adapter] > 1 else device
        for device in devices
    )


@probe("rdma", gather_in=("full",))
def probe_rdma(fs: NodeFS) -> RdmaFacts:
    """Read every RDMA device, its ports and netdevs, and the job's device nodes."""
    reader = _Attributes(fs)
    names = reader.listing(IB_CLASS) or []
    verbs_entries = reader.listing(VERBS_CLASS)
    verbs_loaded = _uverbs_loaded(reader) if verbs_entries is None else True
    uverbs = _verbs_devices(reader, verbs_entries or [])
    devices = _with_adapter_functions(tuple(_read_device(fs, name, uverbs) for name in sorted(names, key=natural_key)))
    if verbs_loaded is not True and any(device.uverbs for device in devices):
        verbs_loaded = True  # found under the devices themselves
        reader.problems = [p for p in reader.problems if not p.path.startswith((VERBS_CLASS, "/sys/module/ib_uverbs"))]
    listing = reader.listing(DEV_INFINIBAND)
    wanted = [f"{DEV_INFINIBAND}/{device.uverbs}" for device in devices if device.uverbs] + [RDMA_CM]
    nodes = tuple(node for node in (_stat_node(fs, path, reader) for path in wanted) if node is not None)
    identity_reader = FactReader(fs)
    try:
        environ = parse_environ(fs.read_bytes("/proc/self/environ") or b"")
    except SourceError:
        environ = {}  # the job probe reports an unreadable environment
    identity = read_job_identity(identity_reader, environ) if devices else None
    for problem in identity_reader.problems:
        path, _, reason = problem.partition(": ")
        reader.problems.append(Problem(path, reason))
    mlx5_version = _mlx5_driver_version(reader)
    class_read = not any(problem.path == IB_CLASS for problem in reader.problems)
    return RdmaFacts(
        devices=devices,
        verbs_class_present=verbs_loaded,
        dev_infiniband=tuple(listing) if listing is not None else None,
        device_nodes=nodes,
        job_identity=identity,
        problems=reader.take(),
        mlx5_driver_version=mlx5_version,
        hcas_without_device=_hcas_without_device(fs) if class_read and not names else (),
        container=container_marker(FactReader(fs)) if listing is not None and any(
            device.uverbs and device.uverbs not in listing for device in devices) else "",
    )


#: PCI class of an InfiniBand controller (pci_ids.h PCI_CLASS_NETWORK_INFINIBAND, 0x0207)
INFINIBAND_CLASS = "0x0207"


def _hcas_without_device(fs: NodeFS) -> tuple[str, ...] | None:
    """ConnectX InfiniBand controllers (PCI class 0x0207, bound to mlx5_core) on the bus while
    mlx5_core is loaded and mlx5_ib is not, so that no RDMA device is registered: as after an
    MLNX_OFED upgrade whose mlx5_ib the loaded ib_core refuses. Read only where no RDMA device
    exists, and only from positive evidence: a capture without /sys/module (hwloc's) tells
    nothing. An Ethernet ConnectX (class 0x0200) without RDMA is a site's choice and not listed;
    neither are SR-IOV virtual functions nor functions given to another driver (vfio-pci)."""
    reader = FactReader(fs)
    if not reader.presence("/sys/module/mlx5_core") or reader.presence("/sys/module/mlx5_ib") is not False:
        return ()
    functions = reader.listing("/sys/bus/pci/devices")
    if functions is None:
        return None  # mlx5_core without mlx5_ib, and which functions it drives is not known
    found, unread = [], False
    for bdf in functions:
        base = f"/sys/bus/pci/devices/{bdf}"
        known, klass = reader.known_text(f"{base}/class")
        if not known:
            unread = True
        if not (klass or "").strip().startswith(INFINIBAND_CLASS):
            continue
        try:
            if fs.readlink(f"{base}/physfn") is not None:
                continue
            driver = fs.readlink(f"{base}/driver")
        except SourceError:
            unread = True
            continue
        if driver and driver.rstrip("/").rsplit("/", 1)[-1] == "mlx5_core":
            found.append(bdf)
    # One function whose class or driver could not be read may be such an HCA: not known, not none.
    return tuple(found) if found or not unread else None


# -- helpers shared by the checks -------------------------------------------------------------
def require_rdma(rdma: RdmaFacts) -> None:
    """NotApplicable without RDMA devices; Unknown when the class directory could not be read."""
    if rdma.class_unread:
        raise Unknown(rdma.class_unread)
    if not rdma.devices:
        raise NotApplicable(f"no RDMA devices in {IB_CLASS}")


def ports_unlisted(device: RdmaDevice) -> Problem | None:
    """Why ``device``'s ports directory could not be listed (its ports are unknown, not absent)."""
    if device.ports:
        return None
    return next((p for p in device.problems if p.path == f"{device.path}/ports" and p.reason != "no ports"), None)


def management_unknown(device: RdmaDevice | None, port: RdmaPort) -> str:
    """Why a port that is not ACTIVE may belong to an NVSwitch management function rather than a
    data NIC: its device's ``vpd``, the only file that tells them apart, was not read (root-only;
    those functions' ports sit in INIT). "" when the device is known to be one or the other, or
    the port is ACTIVE."""
    if device is None or device.nvswitch_management is not None or port.state == PORT_ACTIVE:
        return ""
    vpd = f"{device.path}/device/vpd"
    problem = next((str(p) for p in device.problems if p.path == vpd), f"{vpd}: not read")
    return f"{problem}: cannot tell an NVSwitch management function from a data NIC"


def port_evidence(port: RdmaPort, *attributes: str, expected: str = "") -> Evidence:
    """One evidence line with several port attributes, read from ``ports/<n>/``."""
    shown = []
    for attribute in attributes:
        if attribute in ("state", "phys_state"):
            shown.append(f"{attribute} {port.shown(attribute)}")
        elif attribute == "rate":
            shown.append(f"rate {port.rate}" if port.rate else "rate unknown")
        elif attribute in ("lid", "sm_lid"):
            value = port.lid if attribute == "lid" else port.sm_lid
            shown.append(f"{attribute} {hex(value) if value is not None else 'unknown'}")
        else:
            shown.append(f"{attribute} {getattr(port, attribute)}")
    files = attributes[0] if len(attributes) == 1 else f"{{{','.join(attributes)}}}"
    return Evidence(f"{port.path}/{files}", ", ".join(shown), expected)
