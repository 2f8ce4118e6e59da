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
* the job's NCCL variables (``preflight.checks.job``): ``NCCL_IB_GID_INDEX``,
  ``NCCL_IB_ROCE_VERSION_NUM``, ``NCCL_IB_ADDR_FAMILY``, ``NCCL_IB_ADDR_RANGE``, ``NCCL_IB_HCA``,
  ``NCCL_IB_TC``.

NCCL's GID choice is emulated in ``preflight.checks._nccl_gid`` and recorded per port, for the
job's settings and for NCCL's defaults, so fleet reports can compare nodes.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import TypeVar

from preflight.checks._nccl_gid import (
    AF_INET,
    GidChoice,
    GidSettings,
    Slot,
    ib_hca_selects,
    ipv4_of,
    link_local_gid,
    nccl_int,
    nccl_would_pick_gid,
    parse_gid,
    parse_gid_settings,
    roce_version,
)
from preflight.checks.kernel_log import NOT_READ, KernelLogFacts
from preflight.checks.job import JobFacts, probe_job
from preflight.config import Expectations
from preflight.model import Evidence, NotApplicable, Observation, Severity, present, undecided
from preflight.probing import FactReader
from preflight.records import frozen
from preflight.registry import check, probe
from preflight.sources import NodeFS, SourceError
from preflight.sources.ethtool import PauseState
from preflight.sources.netlink import DcbConfig, Netlink

IB_SYSFS = "/sys/class/infiniband"
GID_VARIABLES = ("NCCL_IB_GID_INDEX", "NCCL_IB_ROCE_VERSION_NUM", "NCCL_IB_ADDR_FAMILY", "NCCL_IB_ADDR_RANGE")
#: GRH 40 + UDP 8 + BTH 12 + XRC ext 4 + AtomicETH 28 + ICRC 4 (include/rdma/ib_pack.h).
ROCE_HEADER_BYTES = 96
T = TypeVar("T")
IB_MTUS = (4096, 2048, 1024, 512, 256)
_LINK_LAYERS = ("InfiniBand", "Ethernet", "Unknown")
_OS_ERROR = re.compile(r"\(E[A-Z0-9]+\)")
_PORT_STATE = re.compile(r"^\d: [A-Z_]+$")  # "4: ACTIVE"


def roce_mtu(netdev_mtu: int) -> int | None:
    """``iboe_get_mtu()``: the largest IB MTU that fits the netdev MTU less the RoCE headers."""
    return next((mtu for mtu in IB_MTUS if netdev_mtu - ROCE_HEADER_BYTES >= mtu), None)


@frozen
class GidEntry:
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


@frozen
class NcclGid:
    """NCCL's GID choice on one port under one set of variables."""

    settings: GidSettings
    index: int | None  # the index NCCL >= 2.26 uses; None when every NCCL version fails
    forced: bool  # NCCL_IB_GID_INDEX fixed it
    einval_reads: tuple[int, ...]  # slots whose gid_attrs/types read fails with EINVAL: fatal in NCCL 2.21-2.25
    failed_read: int | None  # the slot whose gid_attrs/types read fails for every NCCL version
    error: str  # how that read fails, "" when none does


@frozen
class EcnState:
    """MLNX_OFED's per-priority DCQCN switches (``/sys/class/net/<if>/ecn``)."""

    notification_point: tuple[int, ...] | None  # priorities with ecn/roce_np/enable/<p> = 1; None: no ecn sysfs
    reaction_point: tuple[int, ...] | None  # the same for ecn/roce_rp
    error: str  # why the ecn files could not be read, "" when they were (or do not exist)


@frozen
class RocePort:
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

    @property
    def subject(self) -> str:
        return f"{self.device}/{self.port}"

    @property
    def path(self) -> str:
        return f"{IB_SYSFS}/{self.device}/ports/{self.port}"

    def entry(self, index: int) -> GidEntry | None:
        return next((entry for entry in self.gids if entry.index == index), None)


@frozen
class RoceFacts:
    ports: tuple[RocePort, ...]
    unreadable_ports: tuple[tuple[str, str], ...]  # (subject, reason): link layer not readable
    gid_variables: tuple[tuple[str, str, str], ...]  # (name, value, origin) of the job's GID variables


@frozen
class DcbReading:
    """The DCB state of one interface under a RoCE port."""

    netdev: str  # the interface asked: the RoCE netdev, a bond member or a VLAN's parent
    ports: tuple[str, ...]  # RoCE ports ("mlx5_0/1") carried by it
    config: DcbConfig | None
    error: str  # why it could not be read, "" when it was
    pause: PauseState | None = None  # pause-storm counters and stall watchdog (ethtool ioctl)
    pause_error: str = ""  # why those could not be read


@frozen
class RoceDcbFacts:
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


def _scan_gids(fs: NodeFS, reader: FactReader, base: str) -> tuple[int, list[GidEntry], list[str]]:
    names = reader.listing(f"{base}/gids")
    if names is None:
        return 0, [], [reader.problems.pop()]  # the table is unknown, not empty
    indices = sorted(int(name) for name in names if name.isdigit())
    entries: list[GidEntry] = []
    unreadable: list[str] = []
    table_size = indices[-1] + 1 if indices else 0
    # The kernel lists every slot up to the table length; a gap is a damaged or partial copy.
    unreadable += [f"{base}/gids/{index}: missing" for index in sorted(set(range(table_size)) - set(indices))]
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


def _read_port(fs: NodeFS, reader: FactReader, device: str, port: int, job_settings: GidSettings) -> RocePort:
    base = f"{IB_SYSFS}/{device}/ports/{port}"
    state, _ = _read_attr(fs, f"{base}/state")
    state = state if state is not None and _PORT_STATE.match(state) else None
    table_size, entries, unreadable = _scan_gids(fs, reader, base)
    nccl_job = nccl_default = None
    if not unreadable:
        nccl_job = _nccl_choice(entries, table_size, job_settings)
        nccl_default = _nccl_choice(entries, table_size, GidSettings())
    netdev, netdev_source = _netdev(fs, reader, device, port, entries, nccl_job.index if nccl_job else None)
    mtu = derived = trust = None
    mtu_error = "no netdev found for this port (no gid_attrs/ndevs entry, no device/net)"
    ecn = EcnState(None, None, "")
    if netdev is not None:
        text, reason = _read_attr(fs, f"/sys/class/net/{netdev}/mtu")
        mtu = nccl_int(text, -1) if text is not None and text.isdigit() else None
        problem = reason or "not a number: " + repr((text or "")[:32])
        mtu_error = "" if mtu is not None else f"/sys/class/net/{netdev}/mtu: {problem}"
        derived = roce_mtu(mtu) if mtu is not None else None
        trust, _ = _read_attr(fs, f"/sys/class/net/{netdev}/qos/trust")
        ecn = _ecn(fs, reader, netdev)
    return RocePort(
        device, port, state, table_size, tuple(entries), tuple(unreadable), nccl_job, nccl_default,
        netdev, netdev_source, mtu, mtu_error, derived, trust, ecn,
    )


@probe("roce", timeout_s=5.0, gather_in=("prolog", "full"))
def probe_roce(fs: NodeFS) -> RoceFacts:
    """Scan the GID table, netdev MTU and MLNX QoS files of every Ethernet RDMA port."""
    reader = FactReader(fs)
    job = probe_job(fs)  # the same memoized reads as the job probe: one picture of the job
    variables = [(name, setting.value, setting.origin) for name in GID_VARIABLES if (setting := job.nccl(name)) is not None]
    job_settings = parse_gid_settings({name: value for name, value, _ in variables})
    ports: list[RocePort] = []
    unreadable: list[tuple[str, str]] = []
    # Unlisted directories stay in reader.problems and become unreadable_ports below.
    for device in reader.listing(IB_SYSFS) or []:
        for name in reader.listing(f"{IB_SYSFS}/{device}/ports") or []:
            if not name.isdigit():
                continue
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
def probe_roce_dcb(fs: NodeFS, netlink: Netlink) -> RoceDcbFacts:
    """Ask DCB netlink for PFC and the DSCP map of every interface under a RoCE port."""
    carried: dict[str, list[str]] = {}
    for port in probe_roce(fs).ports:
        for ifname in _dcb_interfaces(fs, port.netdev) if port.netdev else []:
            carried.setdefault(ifname, []).append(port.subject)
    readings = []
    for ifname, subjects in carried.items():
        config, error = _ask(netlink.dcb, ifname)
        pause, pause_error = _ask(netlink.pause, ifname)
        readings.append(DcbReading(ifname, tuple(subjects), config, error, pause, pause_error))
    return RoceDcbFacts(tuple(readings))


def _ask(query: Callable[[str], T], ifname: str) -> tuple[T | None, str]:
    """``query(ifname)``, or None and the reason it could not be answered."""
    try:
        return query(ifname), ""
    except SourceError as error:
        return None, f"{error.source}: {error.reason}"


# -- checks ---------------------------------------------------------------------------------------
def _ports_nccl_uses(roce: RoceFacts, job: JobFacts) -> Iterator[RocePort | Observation]:
    """The RoCE ports NCCL would open (ACTIVE, selected by NCCL_IB_HCA), and an undecided
    observation for every port whose link layer could not be read."""
    hca = job.nccl("NCCL_IB_HCA")
    selected = [
        port for port in roce.ports
        if (port.state is None or port.state.endswith("ACTIVE")) and ib_hca_selects(hca.value if hca else None, port.device, port.port)
    ]
    if not roce.unreadable_ports:
        if not roce.ports:
            raise NotApplicable("no RDMA port with link_layer Ethernet in /sys/class/infiniband")
        if not selected:
            raise NotApplicable("no ACTIVE RoCE port is selected by NCCL_IB_HCA")
    for subject, reason in roce.unreadable_ports:
        yield undecided(subject, reason)
    yield from selected


def _variable_evidence(roce: RoceFacts) -> list[Evidence]:
    return [Evidence(f"{origin} {name}", value) for name, value, origin in roce.gid_variables]


def _usable(entry: GidEntry | None) -> bool:
    return entry is not None and entry.version == 2 and not entry.link_local


def _ports_with_choice(roce: RoceFacts, job: JobFacts) -> Iterator[Observation | tuple[RocePort, NcclGid]]:
    """The ports NCCL uses with the GID choice for the job's settings; a port whose table could
    not be read comes out as an undecided observation instead."""
    for item in _ports_nccl_uses(roce, job):
        if isinstance(item, Observation):
            yield item
        elif item.nccl_job is None:
            yield undecided(item.subject, "; ".join(item.unreadable_gids))
        else:
            yield item, item.nccl_job


@check("ROCE005", profiles=("prolog",))
def roce_gid_index_mismatch(roce: RoceFacts, job: JobFacts) -> Iterator[Observation]:
    """The GID NCCL would use on a RoCE port is empty, RoCE v1 or link-local, or a fixed
    NCCL_IB_GID_INDEX means different things on different ports."""
    forced_families: dict[int, list[str]] = {}  # address family of a fixed index's usable GID -> ports
    for item in _ports_with_choice(roce, job):
        if isinstance(item, Observation):
            yield item
            continue
        port, choice = item
        if choice.index is None:
            if not _OS_ERROR.search(choice.error):
                yield undecided(port.subject, f"{port.path}/gid_attrs/types/{choice.failed_read}: {choice.error}")
            continue  # otherwise NCCL cannot pick at all: ROCE004
        entry = port.entry(choice.index)
        where = f"{port.path}/gids/{choice.index}"
        if entry is not None and entry.roce_type is None and choice.forced:
            yield undecided(port.subject, f"{port.path}/gid_attrs/types/{choice.index}: {entry.type_error}")
            continue
        if _usable(entry):
            if choice.forced and entry is not None:
                forced_families.setdefault(4 if entry.ipv4 else 6, []).append(port.subject)
            continue
        how = "NCCL_IB_GID_INDEX fixes" if choice.forced else "NCCL 2.21+ would choose"
        if entry is None:
            observed = f"{how} index {choice.index}: " + ("empty slot" if choice.index < port.table_size else f"beyond the table ({port.table_size} slots)")
        else:
            observed = f"{how} {entry.describe()}"
        routable = [e for e in port.gids if _usable(e) and e.ipv4]
        expected = (
            f"a routable RoCE v2 GID, e.g. index {routable[0].index} ({routable[0].ipv4})"
            if routable else "a routable RoCE v2 GID (this port has no IPv4 RoCE v2 GID: no IPv4 address on its netdev?)"
        )
        yield present(port.subject, *_variable_evidence(roce), Evidence(where, observed, expected))
    if len(forced_families) > 1:
        described = "; ".join(f"RoCE v2 IPv{family} on {', '.join(ports)}" for family, ports in sorted(forced_families.items()))
        yield present(
            "NCCL_IB_GID_INDEX",
            *_variable_evidence(roce),
            Evidence(f"{IB_SYSFS}/*/ports/*/gids", described, "the same address family and RoCE version on every port"),
        )


@check("ROCE004", profiles=("prolog",))
def roce_gid_type_read_einval(roce: RoceFacts, job: JobFacts) -> Iterator[Observation]:
    """NCCL's automatic GID scan reads a gid_attrs/types file that fails, or the GID table looks
    like a container's, whose hidden leading slots make NCCL 2.21-2.25 abort."""
    for item in _ports_with_choice(roce, job):
        if isinstance(item, Observation):
            yield item
            continue
        port, choice = item
        if choice.forced:
            continue  # a fixed NCCL_IB_GID_INDEX skips the scan
        if choice.failed_read is not None:
            path = f"{port.path}/gid_attrs/types/{choice.failed_read}"
            if not _OS_ERROR.search(choice.error):
                yield undecided(port.subject, f"{path}: {choice.error}")
            else:
                yield present(port.subject, *_variable_evidence(roce), Evidence(path, choice.error, "readable for every configured GID"))
            continue
        pin = f"NCCL >= 2.26, or NCCL_IB_GID_INDEX={choice.index} for this node"
        if choice.einval_reads:
            files = ", ".join(f"types/{index}" for index in choice.einval_reads)
            yield present(
                port.subject,
                *_variable_evidence(roce),
                Evidence(f"{port.path}/gid_attrs", f"NCCL's scan reads {files}: invalid argument (EINVAL); NCCL 2.21-2.25 abort", pin),
            )
            continue
        first = min((entry.index for entry in port.gids), default=None)
        if first is not None and first > 0:
            yield present(
                port.subject,
                Evidence(
                    f"{port.path}/gids",
                    f"slots 0-{first - 1} empty, GIDs start at index {first} (a container's or pod's view of the table)",
                    pin,
                ),
                severity=Severity.WARNING,
            )


@check("ROCE006", profiles=("prolog",))
def roce_path_mtu_mismatch(roce: RoceFacts, job: JobFacts, expect: Expectations) -> Iterator[Observation]:
    """A RoCE netdev MTU differs from the site's, yields a RoCE MTU below what its size suggests
    (4096 -> 2048), or the node's RoCE rails disagree."""
    rails: dict[int, list[RocePort]] = {}
    for item in _ports_nccl_uses(roce, job):
        if isinstance(item, Observation):
            yield item
            continue
        port = item
        if port.mtu is None or port.roce_mtu is None:
            yield undecided(port.subject, port.mtu_error or f"netdev MTU {port.mtu} is too small for RoCE")
            continue
        rails.setdefault(port.roce_mtu, []).append(port)
        source = f"/sys/class/net/{port.netdev}/mtu"
        observed = f"{port.netdev} MTU {port.mtu} -> RoCE MTU {port.roce_mtu}"
        if expect.mtu is not None and port.mtu != expect.mtu:
            yield present(port.subject, Evidence(source, observed, f"MTU {expect.mtu} (site expectation)"))
        elif expect.mtu is None and 4096 <= port.mtu < 4096 + ROCE_HEADER_BYTES:
            yield present(
                port.subject,
                Evidence(source, observed, f"MTU >= {4096 + ROCE_HEADER_BYTES} (e.g. 4200 or 9000) for RoCE MTU 4096"),
                severity=Severity.WARNING,
            )
    if len(rails) > 1:
        evidence = [
            Evidence(f"/sys/class/net/{port.netdev}/mtu", f"{port.subject} on {port.netdev}: MTU {port.mtu} -> RoCE MTU {mtu}", "one RoCE MTU on every rail")
            for mtu, ports in sorted(rails.items()) for port in ports
        ]
        yield present("RoCE rails", *evidence)


def _pause_storms(reading: DcbReading, pfc_on: bool) -> Iterator[Observation]:
    """The NIC's own record of pause storms since the driver loaded, and a stall watchdog that
    was switched off while PFC is on."""
    subject = reading.netdev
    pause = reading.pause
    if pause is None:
        yield undecided(subject, reading.pause_error)
        return
    source = f"ethtool -S {subject} (SIOCETHTOOL)"
    errors = pause.counter("tx_pause_storm_error_events")
    warnings = pause.counter("tx_pause_storm_warning_events")
    if errors:
        yield present(
            subject,
            Evidence(source, f"tx_pause_storm_error_events {errors}, tx_pause_storm_warning_events {warnings or 0}", "0 since the driver loaded"),
        )
    elif warnings:
        yield present(
            subject, Evidence(source, f"tx_pause_storm_warning_events {warnings}", "0 since the driver loaded"), severity=Severity.WARNING
        )
    if pfc_on and pause.prevention_timeout_ms == 0:
        yield present(
            subject,
            Evidence(f"ethtool --get-tunable {subject} pfc-prevention-tout", "0 (stall watchdog off)", "a timeout (the driver default, or the site's value)"),
            severity=Severity.WARNING,
        )


def _trust(port_trust: str | None, config: DcbConfig) -> str:
    """mlnx_qos's rule: qos/trust where MLNX_OFED has it, else dscp iff the APP table maps DSCP."""
    return port_trust or ("dscp" if config.dscp_to_priority else "pcp")


@check("ROCE001")
def roce_pfc_pause_storm(
    roce: RoceFacts, roce_dcb: RoceDcbFacts, job: JobFacts, expect: Expectations, kernel_log: KernelLogFacts = NOT_READ
) -> Iterator[Observation]:
    """The NIC recorded pause storms since the driver loaded, or the lossless setup a RoCE port
    needs against them is off or inconsistent: stall watchdog off, PFC not on the site's lossless
    priority (or on others too), ECN off there, NCCL_IB_TC mapped to a lossy priority, PFC
    priorities that differ between rails, or the driver failing to size a lossless buffer."""
    used = []
    for item in _ports_nccl_uses(roce, job):
        if isinstance(item, Observation):
            yield item
        else:
            used.append(item)
    if used and kernel_log.lossless_buffer_errors:
        yield present(
            "port buffers",
            Evidence("kernel log since boot", kernel_log.lossless_buffer_errors[-1], "no lossless-buffer errors (mlx5 port_buffer.c)"),
            Evidence("kernel log since boot", f"{len(kernel_log.lossless_buffer_errors)} such error(s)"),
        )
    used_subjects = {port.subject for port in used}
    trust_of = {port.subject: port.trust for port in used}
    wanted = expect.lossless_priority
    tc_setting = job.nccl("NCCL_IB_TC")
    tc = nccl_int(tc_setting.value, -1) if tc_setting is not None else -1
    pfc_sets: dict[tuple[int, ...], list[str]] = {}
    for reading in roce_dcb.readings:
        if not used_subjects.intersection(reading.ports):
            continue
        subject = reading.netdev
        config = reading.config
        if config is None:
            yield undecided(subject, reading.error)
            continue
        yield from _pause_storms(reading, bool(config.pfc_enabled))
        source = f"RTM_GETDCB {reading.netdev} (mlnx_qos -i {reading.netdev})"
        pfc = ", ".join(map(str, config.pfc_enabled)) or "none"
        pfc_sets.setdefault(config.pfc_enabled, []).append(subject)
        if wanted is not None and wanted not in config.pfc_enabled:
            yield present(subject, Evidence(source, f"PFC enabled on priorities: {pfc}", f"PFC on priority {wanted} (site's lossless priority)"))
        elif wanted is not None and len(config.pfc_enabled) > 1:
            yield present(
                subject, Evidence(source, f"PFC enabled on priorities: {pfc}", f"PFC on priority {wanted} only"), severity=Severity.WARNING
            )
        lossless = (wanted,) if wanted is not None else config.pfc_enabled
        trust = _trust(next((trust_of[s] for s in reading.ports if trust_of.get(s)), None), config)
        if tc_setting is not None and 0 <= tc <= 255 and lossless and trust == "dscp":
            dscp = tc >> 2
            priority = dict(config.dscp_to_priority).get(dscp, 0)
            if priority not in lossless:
                yield present(
                    subject,
                    Evidence(f"{tc_setting.origin} NCCL_IB_TC", f"{tc_setting.value} (DSCP {dscp}) -> priority {priority} (trust dscp)"),
                    Evidence(source, f"PFC enabled on priorities: {pfc}", f"NCCL_IB_TC whose DSCP maps to priority {', '.join(map(str, lossless))}"),
                )
    for port in used:
        if port.netdev is None:
            yield undecided(port.subject, port.mtu_error)
            continue
        if wanted is None or port.ecn.notification_point is None and not port.ecn.error:
            continue
        if port.ecn.error:
            yield undecided(f"{port.netdev}", port.ecn.error)
            continue
        off = [name for name, enabled in (("roce_np", port.ecn.notification_point), ("roce_rp", port.ecn.reaction_point)) if enabled is not None and wanted not in enabled]
        if off:
            yield present(
                f"{port.netdev}",
                Evidence(f"/sys/class/net/{port.netdev}/ecn/{{{','.join(off)}}}/enable/{wanted}", "0", "1 (DCQCN on the lossless priority)"),
                severity=Severity.WARNING,
            )
    if len(pfc_sets) > 1:
        described = "; ".join(f"{', '.join(map(str, pfc)) or 'none'} on {', '.join(names)}" for pfc, names in pfc_sets.items())
        yield present("RoCE rails", Evidence("RTM_GETDCB (mlnx_qos -i <netdev>)", f"PFC priorities differ: {described}", "the same PFC priorities on every rail"))
