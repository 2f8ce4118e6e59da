"""RoCE ports: GID tables and NCCL's GID choice, MTU, PFC/ECN/trust (ROCE001, ROCE004-ROCE006).

Sources (kernel ``drivers/infiniband/core/sysfs.c``, ABI ``sysfs-class-infiniband``; all
world-readable):

* ``/sys/class/infiniband/<dev>/ports/<n>/link_layer`` (``Ethernet`` marks a RoCE port) and
  ``state``;
* ``.../gids/<i>`` (``%pI6``, one file per table slot, empty slots read as zeros) with
  ``.../gid_attrs/types/<i>`` (``IB/RoCE v1`` / ``RoCE v2``) and ``.../gid_attrs/ndevs/<i>``;
  both attribute reads fail with ``EINVAL`` for empty slots, which is normal, so only configured
  slots are asked;
* ``/sys/class/infiniband/<dev>/device/net/`` when no GID names a netdev;
* ``/sys/class/net/<if>/mtu``; the RoCE MTU follows from it (``iboe_get_mtu()`` in
  ``include/rdma/ib_addr.h``). The port's ``active_mtu`` itself is not in sysfs (only
  ``ibv_query_port`` has it), so the derived value stands in for it;
* MLNX_OFED only: ``/sys/class/net/<if>/qos/trust`` and ``/sys/class/net/<if>/ecn/roce_np|roce_rp/
  enable/<prio>`` (``en_sysfs.c`` of MLNX_OFED; upstream kernels have neither);
* DCB netlink (``RTM_GETDCB``, full profile): PFC priorities and the DSCP-to-priority map, asked of
  the RoCE netdev, or of the members of a bond and the parent of a VLAN;
* the ethtool ioctl on the same interfaces (``preflight.sources.ethtool``): mlx5's pause-storm
  counters ``tx_pause_storm_warning_events`` / ``tx_pause_storm_error_events`` since the driver
  loaded, and the ``pfc-prevention-tout`` stall watchdog (0 turns it off);
* the job's NCCL variables (``preflight.probes.job``): ``NCCL_IB_GID_INDEX``,
  ``NCCL_IB_ROCE_VERSION_NUM``, ``NCCL_IB_ADDR_FAMILY``, ``NCCL_IB_ADDR_RANGE``, ``NCCL_IB_HCA``,
  ``NCCL_IB_TC``.

NCCL's GID choice is emulated in ``preflight.nccl.gid`` and recorded per port, for the
job's settings and for NCCL's defaults, so fleet reports can compare nodes.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TypeVar

from msgspec import Struct

from preflight.nccl.gid import (
    GidChoice,
    GidSettings,
    Slot,
    ipv4_of,
    link_local_gid,
    nccl_int,
    nccl_would_pick_gid,
    parse_gid,
    parse_gid_settings,
    roce_version,
)
from preflight.probes.job import JobFacts
from preflight.probing import FactReader
from preflight.registry import probe
from preflight.sources import NodeFS, SourceError
from preflight.sources.ethtool import PauseState
from preflight.sources.netlink import DcbConfig, Netlink
from preflight.virtualisation import detect as detect_virtualisation

IB_SYSFS = "/sys/class/infiniband"


GID_VARIABLES = ("NCCL_IB_GID_INDEX", "NCCL_IB_ROCE_VERSION_NUM", "NCCL_IB_ADDR_FAMILY", "NCCL_IB_ADDR_RANGE")


#: GRH 40 + UDP 8 + BTH 12 + XRC ext 4 + AtomicETH 28 + ICRC 4 (include/rdma/ib_pack.h).
ROCE_HEADER_BYTES = 96


T = TypeVar("T")


IB_MTUS = (4096, 2048, 1024, 512, 256)


_LINK_LAYERS = ("InfiniBand", "Ethernet", "Unknown")


_PORT_STATE = re.compile(r"^\d: [A-Z_]+$")  # "4: ACTIVE"


#: The kernel's GID table of a port is gid_tbl_len slots long (256 on an mlx5 RoCE port, fewer on
#: most others); a slot number above this bound comes from a garbled or crafted copy, never a
#: kernel, and must not make the probe build a table that size.
GID_INDEX_LIMIT = 4096


def roce_mtu(netdev_mtu: int) -> int | None:
    """``iboe_get_mtu()``: the largest IB MTU that fits the netdev MTU less the RoCE headers."""
    return next((mtu for mtu in IB_MTUS if netdev_mtu - ROCE_HEADER_BYTES >= mtu), None)


class GidEntry(Struct, frozen=True):
    """One configured GID table slot."""

    index: int
    gid: str  # gids/<i>, as the kernel prints it
    roce_type: str | None  # gid_attrs/types/<i>; None when it could not be read
    type_error: str  # why gid_attrs/types/<i> could not be read, "" when it was
    netdev: str | None  # gid_attrs/ndevs/<i>
    ipv4: str | None  # the address of an IPv4-mapped GID

    @property
    def version(self) -> int | None:
        return roce_version(self.roce_type) if self.roce_type is not None else None

    @property
    def link_local(self) -> bool:
        raw = parse_gid(self.gid)
        return raw is not None and link_local_gid(raw)

    def describe(self) -> str:
        kind = self.roce_type or f"type unreadable: {self.type_error}"
        where = f" on {self.netdev}" if self.netdev else ""
        address = self.ipv4 or ("link-local" if self.link_local else "IPv6")
        return f"index {self.index}: {self.gid} ({address}, {kind}{where})"


class NcclGid(Struct, frozen=True):
    """NCCL's GID choice on one port under one set of variables."""

    settings: GidSettings
    index: int | None  # the index NCCL >= 2.26 uses; None when every NCCL version fails
    forced: bool  # NCCL_IB_GID_INDEX fixed it
    einval_reads: tuple[int, ...]  # slots whose gid_attrs/types read fails with EINVAL: fatal in NCCL 2.21-2.25
    failed_read: int | None  # the slot whose gid_attrs/types read fails for every NCCL version
    error: str  # how that read fails, "" when none does


class EcnState(Struct, frozen=True):
    """MLNX_OFED's per-priority DCQCN switches (``/sys/class/net/<if>/ecn``)."""

    notification_point: tuple[int, ...] | None  # priorities with ecn/roce_np/enable/<p> = 1; None: no ecn sysfs
    reaction_point: tuple[int, ...] | None  # the same for ecn/roce_rp
    error: str  # why the ecn files could not be read, "" when they were (or do not exist)


class RocePort(Struct, frozen=True):
    """One RDMA port whose link layer is Ethernet."""

    device: str
    port: int
    state: str | None  # ports/<n>/state, e.g. "4: ACTIVE"; None when unreadable or garbled
    table_size: int  # slots in ports/<n>/gids
    gids: tuple[GidEntry, ...]  # configured slots only
    unreadable_gids: tuple[str, ...]  # "path: reason" for slots that could not be read
    nccl_job: NcclGid | None  # NCCL's choice with the job's variables; None when the table is unreadable
    nccl_default: NcclGid | None  # NCCL's choice with none of them set
    netdev: str | None  # the netdev NCCL's GID (else the table, else device/net) names
    netdev_source: str  # where netdev came from
    mtu: int | None  # /sys/class/net/<netdev>/mtu
    mtu_error: str  # why the MTU is unknown, "" when it is known
    roce_mtu: int | None  # derived from mtu (iboe_get_mtu)
    trust: str | None  # /sys/class/net/<netdev>/qos/trust ("pcp"/"dscp"), MLNX_OFED only
    ecn: EcnState
    state_error: str = ""  # "path: reason" when state is None, "" when it was read
    # The interfaces that carry the port's DCB, QoS trust and DCQCN: a bond's members (RoCE LAG),
    # a VLAN's parent, else the netdev itself; () without a netdev
    dcb_interfaces: tuple[str, ...] = ()
    # An SR-IOV function without a routable RoCE v2 GID: "pf" (device/sriov_numvfs above 0: the
    # parent of virtual functions), "vf" (device/physfn: a virtual function, whose address a pod
    # gets when it is handed out), "" otherwise or where the port has such a GID (not read then)
    sriov: str = ""

    @property
    def subject(self) -> str:
        return f"{self.device}/{self.port}"

    @property
    def path(self) -> str:
        return f"{IB_SYSFS}/{self.device}/ports/{self.port}"

    def entry(self, index: int) -> GidEntry | None:
        return next((entry for entry in self.gids if entry.index == index), None)


class RoceFacts(Struct, frozen=True):
    ports: tuple[RocePort, ...]
    unreadable_ports: tuple[tuple[str, str], ...]  # (subject, reason): link layer not readable
    gid_variables: tuple[tuple[str, str, str], ...]  # (name, value, origin) of the job's GID variables


class DcbReading(Struct, frozen=True):
    """The DCB state of one interface under a RoCE port."""

    netdev: str  # the interface asked: the RoCE netdev, a bond member or a VLAN's parent
    ports: tuple[str, ...]  # RoCE ports ("mlx5_0/1") carried by it
    config: DcbConfig | None
    error: str  # why it could not be read, "" when it was
    pause: PauseState | None = None  # pause-storm counters and stall watchdog (ethtool ioctl)
    pause_error: str = ""  # why those could not be read
    # Why the interface's driver offering no DCB (EOPNOTSUPP) leaves PFC to another host: a
    # virtual function (mlx5 registers DCB netlink only on a vport group manager, the PF) or a
    # virtual machine's NIC; "" otherwise
    host_owned: str = ""


class RoceDcbFacts(Struct, frozen=True):
    readings: tuple[DcbReading, ...]


# -- probes ---------------------------------------------------------------------------------------
def _read_attr(fs: NodeFS, path: str) -> tuple[str | None, str]:
    """(stripped text, "") or (None, reason); a missing file is reported as ENOENT."""
    try:
        text = fs.read(path)
    except SourceError as error:
        return None, error.reason
    if text is None:
        return None, "no such file or directory (ENOENT)"
    return text.strip(), ""


def _gid_indices(names: list[str], base: str) -> tuple[list[int], list[str]]:
    """The slot numbers a ``gids/`` listing holds, and the problems that make the table garbled:
    an index past any kernel's table, or slots missing below the last one (the kernel lists all
    ``gid_tbl_len`` of them; a gap is a damaged or partial copy), reported as a count."""
    # str.isdigit() also takes '²', which int() refuses: only ASCII digits name slots.
    numbered = [name for name in names if name.isascii() and name.isdigit()]
    beyond = [name for name in numbered if len(name) > 5 or int(name) > GID_INDEX_LIMIT]
    if beyond:
        return [], [f"{base}/gids/{beyond[0][:24]}: index above {GID_INDEX_LIMIT}, past any kernel's GID table (garbled copy)"]
    indices = sorted({int(name) for name in numbered})
    table_size = indices[-1] + 1 if indices else 0
    gaps = table_size - len(indices)
    if gaps:
        first = next(index for index, slot in enumerate(indices) if index != slot)
        return indices, [f"{base}/gids: {gaps} of {table_size} slots missing, the first {first}"]
    return indices, []


def _scan_gids(fs: NodeFS, reader: FactReader, base: str) -> tuple[int, list[GidEntry], list[str]]:
    names = reader.listing(f"{base}/gids")
    if names is None:
        return 0, [], [reader.problems.pop()]  # the table is unknown, not empty
    indices, unreadable = _gid_indices(names, base)
    entries: list[GidEntry] = []
    table_size = indices[-1] + 1 if indices else 0
    for index in indices:
        text, reason = _read_attr(fs, f"{base}/gids/{index}")
        raw = parse_gid(text) if text is not None else None
        if raw is None:
            unreadable.append(f"{base}/gids/{index}: {reason or 'not a GID: ' + repr((text or '')[:48])}")
            continue
        if raw == bytes(16) or (raw[:4] == b"\xfe\x80\x00\x00" and raw[4:] == bytes(12)):
            continue  # an empty slot; its gid_attrs reads would fail with EINVAL by design
        roce_type, type_error = _read_attr(fs, f"{base}/gid_attrs/types/{index}")
        if type_error.startswith("not captured") or "(ENOENT)" in type_error:
            # A read that fails on the node decides NCCL's choice; one never made (the kernel
            # has a types file for every slot) decides nothing.
            unreadable.append(f"{base}/gid_attrs/types/{index}: {type_error}")
            continue
        if roce_type is not None and roce_version(roce_type) is None:
            type_error = f"unexpected value {roce_type[:32]!r}"
            roce_type = None
        netdev, _ = _read_attr(fs, f"{base}/gid_attrs/ndevs/{index}")
        entries.append(GidEntry(index, text or "", roce_type, type_error, netdev or None, ipv4_of(raw)))
    return table_size, entries, unreadable


def _nccl_choice(entries: list[GidEntry], table_size: int, settings: GidSettings) -> NcclGid:
    slots = {}
    for entry in entries:
        raw = parse_gid(entry.gid)
        if raw is not None:
            slots[entry.index] = Slot(raw, entry.roce_type, entry.type_error)
    choice: GidChoice = nccl_would_pick_gid(slots, table_size, settings)
    return NcclGid(settings, choice.index, choice.forced, choice.einval_reads, choice.failed_read, choice.error)


def _netdev(fs: NodeFS, reader: FactReader, device: str, port: int, entries: list[GidEntry], chosen: int | None) -> tuple[str | None, str]:
    base = f"{IB_SYSFS}/{device}/ports/{port}"
    by_index = {entry.index: entry for entry in entries}
    if chosen is not None and by_index.get(chosen) is not None and by_index[chosen].netdev:
        return by_index[chosen].netdev, f"{base}/gid_attrs/ndevs/{chosen}"
    for entry in entries:
        if entry.netdev:
            return entry.netdev, f"{base}/gid_attrs/ndevs/{entry.index}"
    names = reader.listing(f"{IB_SYSFS}/{device}/device/net") or []  # unlisted: no netdev, MTU unknown
    if len(names) > 1:
        # Several netdevs on one PCI function (mlx4 dual port): dev_port counts from 0.
        names = [name for name in names if (_read_attr(fs, f"/sys/class/net/{name}/dev_port")[0] or "") == str(port - 1)]
    if len(names) == 1:
        return names[0], f"{IB_SYSFS}/{device}/device/net"
    return None, ""


def _ecn(fs: NodeFS, reader: FactReader, netdev: str) -> EcnState:
    entries = reader.listing(f"/sys/class/net/{netdev}/ecn")
    if entries is None:
        return EcnState(None, None, reader.problems.pop())
    if not entries:
        return EcnState(None, None, "")
    found: list[tuple[int, ...] | None] = []
    for point in ("roce_np", "roce_rp"):
        enabled = []
        for priority in range(8):
            path = f"/sys/class/net/{netdev}/ecn/{point}/enable/{priority}"
            text, reason = _read_attr(fs, path)
            if text not in ("0", "1"):
                return EcnState(None, None, f"{path}: {reason or f'unexpected value {text!r}'}")
            if text == "1":
                enabled.append(priority)
        found.append(tuple(enabled))
    return EcnState(found[0], found[1], "")


def _merged_ecn(states: list[EcnState]) -> EcnState:
    """One port's DCQCN over the interfaces that carry it: a priority counts as enabled only where
    every member enables it (a bond hashes flows onto any member); the first error stands."""
    for state in states:
        if state.error:
            return state
    known = [state for state in states if state.notification_point is not None]  # _ecn reads both or neither
    if not known:
        return EcnState(None, None, "")
    np = set.intersection(*(set(state.notification_point or ()) for state in known))
    rp = set.intersection(*(set(state.reaction_point or ()) for state in known))
    return EcnState(tuple(sorted(np)), tuple(sorted(rp)), "")


def _read_port(fs: NodeFS, reader: FactReader, device: str, port: int, job_settings: GidSettings) -> RocePort:
    base = f"{IB_SYSFS}/{device}/ports/{port}"
    state, state_reason = _read_attr(fs, f"{base}/state")
    if state is not None and not _PORT_STATE.match(state):
        state_reason = f"unexpected value {state[:32]!r}"
        state = None
    table_size, entries, unreadable = _scan_gids(fs, reader, base)
    nccl_job = nccl_default = None
    if not unreadable:
        nccl_job = _nccl_choice(entries, table_size, job_settings)
        nccl_default = _nccl_choice(entries, table_size, GidSettings())
    netdev, netdev_source = _netdev(fs, reader, device, port, entries, nccl_job.index if nccl_job else None)
    mtu = derived = trust = None
    mtu_error = "no netdev found for this port (no gid_attrs/ndevs entry, no device/net)"
    ecn = EcnState(None, None, "")
    members: list[str] = []
    if netdev is not None:
        text, reason = _read_attr(fs, f"/sys/class/net/{netdev}/mtu")
        mtu = nccl_int(text, -1) if text is not None and text.isascii() and text.isdigit() else None
        problem = reason or "not a number: " + repr((text or "")[:32])
        mtu_error = "" if mtu is not None else f"/sys/class/net/{netdev}/mtu: {problem}"
        derived = roce_mtu(mtu) if mtu is not None else None
        # QoS trust and DCQCN live where DCB does: on a bond's members (RoCE LAG), a VLAN's parent.
        members = _dcb_interfaces(fs, netdev)
        trusts = {_read_attr(fs, f"/sys/class/net/{member}/qos/trust")[0] for member in members}
        trust = trusts.pop() if len(trusts) == 1 else None  # members that disagree: mlnx_qos's rule decides
        ecn = _merged_ecn([_ecn(fs, reader, member) for member in members])
    routable = any(entry.version == 2 and not entry.link_local for entry in entries)
    return RocePort(
        device, port, state, table_size, tuple(entries), tuple(unreadable), nccl_job, nccl_default,
        netdev, netdev_source, mtu, mtu_error, derived, trust, ecn, f"{base}/state: {state_reason}" if state is None else "",
        tuple(members), "" if routable else _sriov_role(fs, device),
    )


def _sriov_role(fs: NodeFS, device: str) -> str:
    """"vf" for a virtual function, "pf" for a function with virtual functions, else "" (also
    where the files cannot be read: the port is then judged as any other)."""
    path = f"{IB_SYSFS}/{device}/device"
    try:
        if fs.readlink(f"{path}/physfn") is not None:
            return "vf"
        count = (fs.read(f"{path}/sriov_numvfs") or "").strip()
    except SourceError:
        return ""
    return "pf" if count.isascii() and count.isdigit() and int(count) > 0 else ""


@probe("roce", timeout_s=5.0, gather_in=("prolog", "full"))
def probe_roce(fs: NodeFS, job: JobFacts) -> RoceFacts:
    """Scan the GID table, netdev MTU and MLNX QoS files of every Ethernet RDMA port."""
    reader = FactReader(fs)
    variables = [(name, setting.value, setting.origin) for name in GID_VARIABLES if (setting := job.nccl(name)) is not None]
    job_settings = parse_gid_settings({name: value for name, value, _ in variables})
    ports: list[RocePort] = []
    unreadable: list[tuple[str, str]] = []
    # Unlisted directories stay in reader.problems and become unreadable_ports below.
    for device in reader.listing(IB_SYSFS) or []:
        for name in reader.listing(f"{IB_SYSFS}/{device}/ports") or []:
            if not (name.isascii() and name.isdigit()):
                continue  # ports are numbered in ASCII digits; int() refuses '³', which isdigit() takes
            layer, reason = _read_attr(fs, f"{IB_SYSFS}/{device}/ports/{name}/link_layer")
            if layer == "Ethernet":
                ports.append(_read_port(fs, reader, device, int(name), job_settings))
            elif layer not in _LINK_LAYERS:
                path = f"{IB_SYSFS}/{device}/ports/{name}/link_layer"
                unreadable.append((f"{device}/{name}", f"{path}: {reason or f'unexpected value {layer!r}'}"))
    unreadable += [(IB_SYSFS, problem) for problem in reader.problems]
    return RoceFacts(tuple(ports), tuple(unreadable), tuple(variables))


def _dcb_interfaces(fs: NodeFS, netdev: str) -> list[str]:
    """DCB lives on physical functions: a bond's members, a VLAN's parent, else the netdev."""
    slaves, _ = _read_attr(fs, f"/sys/class/net/{netdev}/bonding/slaves")
    if slaves:
        return slaves.split()
    try:
        lower = [name[len("lower_"):] for name in fs.listdir(f"/sys/class/net/{netdev}") or [] if name.startswith("lower_")]
    except SourceError:
        lower = []
    return lower or [netdev]


@probe("roce_dcb", timeout_s=5.0, gather_in=("full",))
def probe_roce_dcb(fs: NodeFS, netlink: Netlink, roce: RoceFacts) -> RoceDcbFacts:
    """Ask DCB netlink for PFC and the DSCP map of every interface under a RoCE port."""
    carried: dict[str, list[str]] = {}
    for port in roce.ports:
        for ifname in port.dcb_interfaces:
            carried.setdefault(ifname, []).append(port.subject)
    readings = []
    for ifname, subjects in carried.items():
        config, error = _ask(netlink.dcb, ifname)
        pause, pause_error = _ask(netlink.pause, ifname)
        owner = _pfc_owner(fs, ifname) if "EOPNOTSUPP" in error else ""
        readings.append(DcbReading(ifname, tuple(subjects), config, error, pause, pause_error, owner))
    return RoceDcbFacts(tuple(readings))


def _pfc_owner(fs: NodeFS, ifname: str) -> str:
    """Who sets PFC for an interface without DCB netlink: its physical function's host ("" when
    this node is that host, or when that is not known)."""
    reader = FactReader(fs)
    if reader.presence(f"/sys/class/net/{ifname}/device/physfn"):
        return f"{ifname} is a virtual function (device/physfn): PFC is its physical function's"
    guest = detect_virtualisation(fs, reader.text("/proc/cpuinfo"))
    return f"{ifname} is a virtual machine's NIC ({guest.evidence}): PFC is the host's" if guest.guest else ""


def _ask(query: Callable[[str], T], ifname: str) -> tuple[T | None, str]:
    """``query(ifname)``, or None and the reason it could not be answered."""
    try:
        return query(ifname), ""
    except SourceError as error:
        return None, f"{error.source}: {error.reason}"
