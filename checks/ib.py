"""InfiniBand ports, the HCAs NCCL selects and the subnet's state (IB references)."""

from __future__ import annotations

import re
import stat as stat_codes
from collections import Counter
from typing import TYPE_CHECKING

from preflight.model import (
    NOT_GIVEN,
    Evidence,
    NotApplicable,
    Observation,
    Severity,
    Unknown,
    Unread,
    present,
    undecided,
)
from preflight.nccl.ib import (
    NCCL_LINK_LAYERS,
    HcaEntry,
    HcaList,
    Selection,
    nccl_selection,
    parse_nccl_ib_hca,
    plugin_transport,
    require_ib_transport_on,
)
from preflight.nccl.releases import version_tuple
from preflight.probes.gpudirect import DeviceNode, JobIdentity, access_decided, membership_unknown
from preflight.probes.kernel_log import NOT_READ, JoinFailure, KernelLogFacts
from preflight.probes.link_history import IB_SYSFS, LinkHistoryFacts
from preflight.probes.nccl_nets import NcclNetsFacts, skipped_devices
from preflight.probes.pkeys import FULL_MEMBER, PKEY_BASE, PkeyFacts, PortPkeys
from preflight.probes.rdma import (
    DEV_INFINIBAND,
    IB_CLASS,
    PORT_ACTIVE,
    RDMA_CM,
    VERBS_CLASS,
    Problem,
    RdmaDevice,
    RdmaFacts,
    RdmaPort,
    management_unknown,
    natural_key,
    port_evidence,
    ports_unlisted,
    require_rdma,
)
from preflight.probes.verbs import CONFIG_DIR, LIBRARY_NAMES, PROVIDER_OF_DRIVER, VERBS_NOT_READ, VerbsFacts
from preflight.registry import check

if TYPE_CHECKING:
    from collections.abc import Iterator

    from preflight.config import Expectations
    from preflight.probes.job import JobFacts, Setting
    from preflight.probes.nccl_libs import NcclLibFacts

# NCCL_IB_TIMEOUT is an exponent: 4.096 us * 2**value per try. NCCL's default is 20 (about 4 s);
# below 14 (about 67 ms) a link retraining outlasts every retry.
MIN_IB_TIMEOUT = 14


MIN_RETRY_COUNT = 7  # NCCL's default and the verbs maximum (a 3-bit field)


@check("IB006", profiles=("prolog",))
def ib_transport_retry_exceeded(link_history: LinkHistoryFacts, kernel_log: KernelLogFacts, job: JobFacts) -> Iterator[Observation]:
    """RDMA ports that went down since boot, and retry settings that cannot ride out a retrain."""
    if link_history.unlisted:
        raise Unknown(link_history.unlisted)
    if not link_history.ports:
        raise NotApplicable("no RDMA ports on this node")
    ports = [port for port in link_history.ports if port.link_layer in (None, "InfiniBand", "Ethernet")]
    if not ports:
        other = link_history.ports[0]
        raise NotApplicable(
            f"no InfiniBand or RoCE port ({other.device}/{other.port}: link layer {other.link_layer}): NCCL's IB transport "
            "opens no other, and EFA's are aws-ofi-nccl's"
        )
    # The counters below may have been cleared since; the kernel log is the other witness.
    yield from kernel_log.unread("link-down history")
    for port in ports:
        subject = f"{port.device}/{port.port}"
        if port.problem:
            yield undecided(subject, port.problem)
        elif port.link_downed:
            evidence = [Evidence(f"{IB_SYSFS}/{subject.replace('/', '/ports/')}/counters/link_downed", str(port.link_downed), "0 since the counters were cleared")]
            if port.link_error_recovery:
                evidence.append(Evidence("link_error_recovery", str(port.link_error_recovery)))
            yield present(subject, *evidence, severity=Severity.WARNING)
    by_bus = {port.bus: port.device for port in ports if port.bus}
    downs: dict[str, list[str]] = {}
    for event in kernel_log.link_downs:
        if event.bus in by_bus:
            downs.setdefault(f"{by_bus[event.bus]} ({event.netdev})", []).append(event.text)
    for subject, texts in sorted(downs.items()):
        yield present(subject, Evidence("kernel log since boot", f"{len(texts)} link-down(s), last: {texts[-1]}", "no link-down since boot"), severity=Severity.WARNING)
    for name, minimum, bits in (("NCCL_IB_TIMEOUT", MIN_IB_TIMEOUT, 5), ("NCCL_IB_RETRY_CNT", MIN_RETRY_COUNT, 3)):
        setting = job.nccl(name)
        if setting is None:
            continue
        try:
            value = int(setting.value.strip())
        except ValueError:
            yield undecided(name, f"{setting.origin}: {setting.value!r} is not a number")
            continue
        # NCCL passes the value unchecked into ibv_modify_qp; the QP context holds a 5-bit ack
        # timeout and a 3-bit retry count (IBTA; mlx5 writes them with MLX5_SET, which keeps the
        # low bits): NCCL_IB_RETRY_CNT=50 is 2 retries, NCCL_IB_TIMEOUT=32 is 0, no timeout at all.
        effective = value & ((1 << bits) - 1)  # a negative value too: ibv_qp_attr's fields are unsigned
        shown = str(value) if effective == value else f"{value}, of which the QP's {bits}-bit field keeps {effective}"
        if effective < minimum:
            hang = " (0: the QP never times out, so a lost peer hangs the job instead of failing it)" if name == "NCCL_IB_TIMEOUT" and effective == 0 else ""
            yield present(name, Evidence(f"{name} ({setting.origin})", shown + hang,
                                         f"unset (NCCL's default) or {minimum} to {(1 << bits) - 1}"))


RAIL_NIC_COUNTS = "2, 4 or 8 NICs, identical on every node"


def _selected_devices(rdma: RdmaFacts, selection: Selection) -> list[RdmaDevice]:
    names = set(selection.devices)
    return [device for device in rdma.devices if device.name in names]


def require_ib_transport(rdma: RdmaFacts) -> None:
    """NotApplicable when no port could ever be NCCL's (EFA-only or soft devices)."""
    require_rdma(rdma)
    ports = [port for device in rdma.devices for port in device.ports]
    unlisted = [problem for device in rdma.devices if (problem := ports_unlisted(device)) is not None]
    if unlisted and not ports:
        raise Unknown(str(unlisted[0]))
    if not any(port.link_layer in NCCL_LINK_LAYERS or port.link_layer is None for port in ports):
        raise NotApplicable("no InfiniBand or RoCE ports; NCCL's IB transport does not use them")


def _decided(selection: Selection) -> None:
    if selection.unlisted:
        raise Unknown(selection.unlisted[0])
    if selection.undecided:
        port = selection.undecided[0]
        raise Unknown(port.why("state" if port.state is None else "link_layer"))


def _setting_evidence(setting: Setting | None, expected: str = "") -> Evidence:
    if setting is None:
        return Evidence("NCCL_IB_HCA", "unset (every device)", expected)
    where = "/proc/self/environ" if setting.origin == "environment" else setting.origin
    return Evidence(f"{where} NCCL_IB_HCA", repr(setting.value), expected)


# -- IB004 ------------------------------------------------------------------------------------
def accidental_prefix(entry: HcaEntry, device: str) -> bool:
    """``mlx5_1`` matching ``mlx5_10``: the prefix ends inside a number. ``mlx5`` matching
    ``mlx5_0`` is a deliberate family prefix."""
    return (
        len(device) > len(entry.name)
        and device.startswith(entry.name)
        and entry.name[-1:].isdigit()
        and device[len(entry.name)].isdigit()
    )


def _added_by_accident(hca: HcaList, entry: HcaEntry, device: RdmaDevice) -> bool:
    """Whether ``entry`` reaches a port of ``device`` only through an accidental prefix that no
    other entry names on purpose: NCCL's set is the union of every entry's matches (matchIfList,
    src/misc/utils.cc@v2.30.7-1), so ``mlx5_1`` in a list that also names ``mlx5_10`` adds nothing."""
    if not accidental_prefix(entry, device.name):
        return False
    others = [other for other in hca.entries if other is not entry and not accidental_prefix(other, device.name)]
    return any(
        hca.entry_matches(entry, device.name, port.number) and not any(hca.entry_matches(other, device.name, port.number) for other in others)
        for port in device.ports
    )


def _unmatched_note(entry: HcaEntry) -> str:
    if entry.name != entry.name.strip():
        return "; NCCL does not trim spaces"
    if entry.name[:1] in ("^", "="):
        return "; '^' must come first ('^=name'), anything later is part of the name"
    return ""


def _entry_findings(rdma: RdmaFacts, selection: Selection) -> Iterator[Observation]:
    hca = selection.hca
    for entry in hca.entries:
        matched = [
            device
            for device in rdma.devices
            if any(hca.entry_matches(entry, device.name, port.number) for port in device.ports)
        ]
        subject = f"NCCL_IB_HCA {entry.text!r}"
        if not matched and selection.unlisted:
            yield undecided(subject, f"no device with listed ports matches, and {selection.unlisted[0]}")
            continue
        if not matched:
            names = ", ".join(device.name for device in rdma.devices)
            yield present(
                subject,
                _setting_evidence(selection.setting),
                Evidence(IB_CLASS, f"no device{' port' if entry.port is not None else ''} matches {entry.text!r}{_unmatched_note(entry)} (devices: {names})"),
                severity=Severity.WARNING,
            )
            continue
        extra = [device.name for device in matched if not hca.exact and _added_by_accident(hca, entry, device)]
        if extra:
            verb = "also excludes" if hca.exclude else "also selects"
            yield present(
                subject,
                _setting_evidence(selection.setting, f"exact names: {'^' if hca.exclude else ''}={','.join(e.text.strip() for e in hca.entries)}"),
                Evidence(IB_CLASS, f"prefix {entry.name!r} {verb} {', '.join(extra)}"),
            )
        if not hca.exclude:
            yield from _listed_but_down(hca, entry, matched, selection)


#: The fix for an InfiniBand port whose link is up but that the subnet manager has not configured
#: (INIT or ARMED with LinkUp): IB008 reports the cause; what names or counts the port is right.
AWAITING_SUBNET_MANAGER_FIX = (
    "The link is up but the subnet manager has not configured the port (IB008): check the SM (sminfo; on its host "
    "systemctl status opensm) and force a sweep; the port turns ACTIVE with a LID once it has. Nothing in this "
    "node's settings needs to change."
)


def awaiting_subnet_manager(port: RdmaPort) -> bool:
    """An InfiniBand port the subnet manager has yet to configure: its link trained (LinkUp) but
    its logical state stays INIT or ARMED until the SM sweeps it (IB008's finding)."""
    return port.link_layer == "InfiniBand" and port.state in (PORT_INIT, PORT_ARMED) and port.phys_state == PHYS_LINK_UP


def _listed_but_down(hca: HcaList, entry: HcaEntry, matched: list[RdmaDevice], selection: Selection) -> Iterator[Observation]:
    """Ports an entry names outright (``mlx5_3:1``, or ``mlx5_3`` when no port of it is ACTIVE)
    that NCCL will skip; a family prefix such as ``mlx5`` names no port in particular, and a
    device named without a port is served by its active port (NCCL skips the spare one)."""
    for device in matched:
        if device.name != entry.name:
            continue
        if entry.port is None and any(port.state is None or port.state == PORT_ACTIVE for port in device.ports):
            continue  # a port that is, or may be, ACTIVE carries the device; the others are spares
        for port in device.ports:
            if hca.entry_matches(entry, device.name, port.number) and port.state is not None and port.state != PORT_ACTIVE:
                yield present(
                    port.subject,
                    _setting_evidence(selection.setting),
                    port_evidence(port, "state", "phys_state", expected="4: ACTIVE (NCCL skips other ports)"),
                    fix=AWAITING_SUBNET_MANAGER_FIX if awaiting_subnet_manager(port) else "",
                )


def _mixed_and_management(rdma: RdmaFacts, selection: Selection, severity: Severity | None) -> Iterator[Observation]:
    layers = sorted({port.link_layer or "?" for port in selection.ports})
    if len(layers) > 1:
        yield present(
            "NCCL IB selection",
            _setting_evidence(selection.setting, "one link layer (NCCL 2.26 and later refuse a connection that mixes IB and RoCE)"),
            Evidence(IB_CLASS, selection.describe()),
            severity=severity,
        )
    management = [device.name for device in _selected_devices(rdma, selection) if device.nvswitch_management]
    if management:
        yield present(
            "NCCL IB selection",
            _setting_evidence(selection.setting, "data NICs only"),
            Evidence(f"{IB_CLASS}/*/device/vpd", f"{', '.join(management)}: NVSwitch management function (SMDL=SW_MNG)"),
            severity=Severity.WARNING,
        )


@check("IB004", profiles=("prolog",), optional=("nccl_nets",))
def ib_hca_selection_mismatch(rdma: RdmaFacts, job: JobFacts, nccl_nets: NcclNetsFacts | Unread = NOT_GIVEN) -> Iterator[Observation]:
    """NCCL_IB_HCA entries that match nothing or too much, an empty or mixed selection. Unset, it
    leaves NCCL every port but those its topology search passes over (an IB/RoCE mix of ports it
    does use is refused per connection)."""
    require_ib_transport(rdma)
    require_ib_transport_on(job, ucx_counts=True)
    selection = nccl_selection(rdma, job, skipped_devices(nccl_nets))
    for port in selection.undecided:
        yield undecided(port.subject, port.why("state" if port.state is None else "link_layer"))
    for problem in selection.unlisted:
        yield undecided(problem.split(": ", 1)[0], problem)
    if selection.setting is None:
        yield from _mixed_and_management(rdma, selection, Severity.WARNING)
        return
    yield from _entry_findings(rdma, selection)
    if not selection.ports and not selection.undecided and not selection.unlisted:
        yield present(
            "NCCL_IB_HCA",
            _setting_evidence(selection.setting, "at least one ACTIVE InfiniBand or RoCE port"),
            Evidence(IB_CLASS, "selects nothing: NCCL logs 'NET/IB : No device found.' and falls back to sockets"),
        )
    yield from _mixed_and_management(rdma, selection, None)


# -- IB003 ------------------------------------------------------------------------------------
@check("IB003", profiles=("prolog",))
def ib_odd_nic_count_rail_hang(rdma: RdmaFacts, job: JobFacts) -> Iterator[Observation]:
    """NCCL would use exactly three IB/RoCE ports on this node."""
    require_ib_transport(rdma)
    require_ib_transport_on(job, ucx_counts=True)
    selection = nccl_selection(rdma, job)
    _decided(selection)
    if len(selection.ports) == 3:
        yield present(
            "node",
            _setting_evidence(selection.setting),
            Evidence(f"{IB_CLASS}/*/ports/*/{{state,link_layer}}", f"NCCL would use 3: {selection.describe()}", RAIL_NIC_COUNTS),
            severity=Severity.WARNING,
        )


# -- IB005 ------------------------------------------------------------------------------------
def pci_key(address: str) -> tuple[int, ...]:
    """``0000:1a:00.0`` -> ``(0, 26, 0, 0)``."""
    return tuple(int(part, 16) for part in re.split(r"[:.]", address))


def _pci_order_setting(job: JobFacts) -> tuple[Setting | None, bool]:
    """NCCL_IB_DEVICE_PCI_ORDER and whether it asks for PCI order (NCCL_PARAM: integer, default 1)."""
    setting = job.nccl("NCCL_IB_DEVICE_PCI_ORDER")
    if setting is None:
        return None, True
    try:
        return setting, int(setting.value.strip(), 0) != 0
    except ValueError:
        return setting, True  # NCCL warns and keeps the default


#: NCCL_PARAM(IbDevicePciOrder, "IB_DEVICE_PCI_ORDER", 1) first appears in v2.29.7 (src/transport/net_ib):
#: from then on NCCL sorts its IB devices by PCI address unless told not to.
PCI_ORDER_DEFAULT_SINCE = (2, 29, 7)


#: rdma-core's persistent RDMA device names (udev's rdma_rename NAME_PCI; "ibp26s0", "rocep1s0f1",
#: "roceP2p1s0f1" with the PCI domain): the name is the PCI address, so alike nodes list alike.
PCI_DERIVED_NAME = re.compile(r"^(?:ib|roce|iw)(?:P\d+)?p\d+s\d+(?:f\d+)?$")


@check("IB005", profiles=("prolog",), optional=("nccl_nets",))
def ib_device_order_differs_across_nodes(
    rdma: RdmaFacts, job: JobFacts, nccl_libs: NcclLibFacts, nccl_nets: NcclNetsFacts | Unread = NOT_GIVEN
) -> Iterator[Observation]:
    """The RDMA devices NCCL uses are not numbered in PCI address order, and an NCCL that does not
    sort them (before 2.29.7, or told not to) or a network plugin that does not (HPC-X's) may run here. A device NCCL's topology search passes
    over (a slow front-end port) carries no rail: its place in the order moves no rail."""
    require_ib_transport(rdma)
    require_ib_transport_on(job, ucx_counts=True)
    selection = nccl_selection(rdma, job, skipped_devices(nccl_nets))
    _decided(selection)
    # nccl-rdma-sharp-plugins (HPC-X) takes the devices in ibv_get_device_list's order and reads
    # no NCCL_IB_DEVICE_PCI_ORDER: where it carries the traffic, NCCL's release does not sort them.
    plugin = plugin_transport(job, nccl_libs)
    setting, pci_order = _pci_order_setting(job) if not plugin else (None, False)
    if setting is not None and pci_order:
        return  # the job asks NCCL (2.29.7 and later) to sort by PCI address
    devices = _selected_devices(rdma, selection)
    unreadable = [p for device in devices for p in device.problems if p.path == f"{device.path}/device"]
    if unreadable:
        raise Unknown(str(unreadable[0]))
    located = [device for device in devices if device.pci_address is not None]
    if located and all(PCI_DERIVED_NAME.match(device.name) for device in located):
        return  # rdma-core's persistent names come from the PCI address: alike on alike nodes
    by_name = sorted(located, key=lambda device: natural_key(device.name))
    by_pci = sorted(located, key=lambda device: pci_key(device.pci_address or ""))
    if [d.name for d in by_name] == [d.name for d in by_pci]:
        return
    releases: list[Evidence] = []
    if plugin:
        order = Evidence(plugin, "NCCL's network plugin, which keeps the verbs library's device order (no PCI sort)")
    elif setting is None:
        unsorted = [
            copy for copy in nccl_libs.copies
            if copy.version is None or (version_tuple(copy.version) or ()) < PCI_ORDER_DEFAULT_SINCE
        ]
        # Every NCCL here sorts its devices by PCI address by default; a directory that could not
        # be read may hide an older copy, and then the names still decide.
        if nccl_libs.copies and not unsorted and not nccl_libs.problems:
            return
        order = Evidence("NCCL_IB_DEVICE_PCI_ORDER", "unset: NCCL 2.29.7 and later sort by PCI address, earlier releases do not")
        releases = [Evidence(copy.path, f"NCCL {copy.version or 'of an unnamed release'}", "2.29.7 or later") for copy in unsorted[:3]]
    else:
        where = "/proc/self/environ" if setting.origin == "environment" else setting.origin
        order = Evidence(f"{where} NCCL_IB_DEVICE_PCI_ORDER", repr(setting.value), "1 (sort devices by PCI address)")
    yield present(
        "node",
        Evidence(
            f"{IB_CLASS}/*/device",
            "; ".join(f"{d.name} {d.pci_address}" for d in by_name),
            "names numbered in PCI address order: " + ", ".join(d.name for d in by_pci),
        ),
        order,
        *releases,
        severity=Severity.WARNING if setting is None else None,
    )


PORT_INIT, PORT_ARMED = 2, 3


PHYS_DISABLED, PHYS_LINK_UP = 3, 5


def unlisted_ports(rdma: RdmaFacts) -> Iterator[Observation]:
    """An undecided observation for each data device whose ports directory could not be listed:
    its ports are unknown, not absent."""
    for device in rdma.data_devices:
        unlisted = ports_unlisted(device)
        if unlisted is not None:
            yield undecided(device.name, str(unlisted))


# -- IB009 ------------------------------------------------------------------------------------
def _kind(port: RdmaPort, rdma: RdmaFacts) -> tuple[str, str, int]:
    """Ports compared with one another: one link layer, one HCA model, adapters of as many
    functions (a 2x200G BlueField-3 DPU beside 1x400G BlueField-3 SuperNICs is another card)."""
    device = rdma.device(port.device)
    return (port.link_layer or "?", (device.hca_type if device else None) or "?", device.adapter_functions if device else 1)


def _kind_name(kind: tuple[str, str, int]) -> str:
    link_layer, hca_type, functions = kind
    return f"{link_layer} {hca_type} ports" + (f" of {functions}-port adapters" if functions > 1 else "")


def _kind_unreadable(port: RdmaPort, rdma: RdmaFacts) -> str:
    """The read problem that hides a port's kind (its link layer or its HCA's type), if any."""
    device = rdma.device(port.device)
    wanted = {f"{port.path}/link_layer"} | ({f"{device.path}/hca_type"} if device else set())
    problems = [*port.problems, *(device.problems if device else ())]
    return next((str(problem) for problem in problems if problem.path in wanted), "")


def judged_ports(rdma: RdmaFacts, expect: Expectations) -> list[RdmaPort]:
    """The data ports whose health matters (see the module docstring)."""
    if expect.hcas is not None:
        return [port for device in rdma.data_devices if device.name in expect.hcas for port in device.ports]
    ports = list(rdma.data_ports)
    if not any(port.state == PORT_ACTIVE for port in ports):
        return ports
    groups: dict[tuple[str, str, int], list[RdmaPort]] = {}
    for port in ports:
        groups.setdefault(_kind(port, rdma), []).append(port)
    return [
        port
        for group in groups.values()
        for port in group
        # A port of unreadable kind stays: the check says unknown rather than drop it unseen.
        if 2 * sum(1 for p in group if p.state == PORT_ACTIVE) > len(group) or _kind_unreadable(port, rdma)
    ]


def _reference_rate(port: RdmaPort, active: list[RdmaPort], rdma: RdmaFacts) -> tuple[float, int, int] | None:
    """The bandwidth (Gb/s) most active ports of this port's kind run at: (Gb/s, holders, peers)."""
    peers = [p.rate.gbps for p in active if p.rate is not None and _kind(p, rdma) == _kind(port, rdma)]
    if not peers:
        return None
    gbps, holders = Counter(peers).most_common(1)[0]
    return (gbps, holders, len(peers)) if 2 * holders > len(peers) else None


def _unnamed_fix(port: RdmaPort, repair: str) -> str:
    """The fix of a finding softened because nothing names the port as a rail."""
    return (
        f"If {port.subject} is a rail, {repair}. If it is a storage, in-band or spare port (it may be the rails' own "
        "HCA model), list the rails in expect.hcas or NCCL_IB_HCA (/etc/nccl.conf): then only they are judged, and a "
        "rail that is down or slow is an error."
    )


def _degraded(port: RdmaPort, active: list[RdmaPort], rdma: RdmaFacts, expect: Expectations, named: bool) -> Observation | None:
    assert port.rate is not None
    if expect.rate_gbps is not None:
        if port.rate.gbps < expect.rate_gbps:
            return present(
                port.subject,
                port_evidence(port, "rate", expected=f"{expect.rate_gbps:g} Gb/sec (expect.rate_gbps)"),
            )
        return None
    # Bandwidth decides, not lanes: one speed comes as several width x lane-speed pairs (100 Gb/s
    # as 4X EDR or 2X HDR, 400 Gb/s as 4X NDR or 2X XDR, by cable and optic; RoCE drivers map the
    # netdev's speed onto them), and a link that lost lanes at one lane speed loses Gb/s too.
    unreadable = _kind_unreadable(port, rdma)
    if unreadable:
        rates = [p.rate for p in active if p.rate is not None]
        if all(port.rate.gbps >= rate.gbps for rate in rates):
            return None  # as fast as every active port: not degraded, whatever its kind
        return undecided(port.subject, f"{unreadable}; cannot tell which ports its rate should match")
    reference = _reference_rate(port, active, rdma)
    if reference is None:
        return None
    gbps, holders, peers = reference
    if port.rate.gbps < gbps:
        return present(
            port.subject,
            port_evidence(port, "rate", expected=f"{gbps:g} Gb/sec like {holders} of {peers} active {_kind_name(_kind(port, rdma))}"),
            severity=None if named else Severity.WARNING,
            fix="" if named else _unnamed_fix(port, "reseat or replace its cable or optic, or set the switch port's speed"),
        )
    return None


def _pkey_setting(pkeys: PkeyFacts) -> str:
    return f"NCCL_IB_PKEY={pkeys.setting} ({pkeys.origin})" if pkeys.setting is not None else "NCCL_IB_PKEY unset"


def _pkey_fix(port: PortPkeys) -> str:
    return (
        f"NCCL_IB_PKEY is an index into the port's P_Key table, not a P_Key: list the table with "
        f"grep -H . {port.path}/* and set NCCL_IB_PKEY to the index that holds the job's partition with the full-member "
        "bit (0x8000) set; the subnet manager's partitions.conf decides what the table holds."
    )


def _partition(port: RdmaPort, pkeys: PkeyFacts | Unread) -> Observation | None:
    """The P_Key NCCL puts the port's queue pairs in (IB009): an index beyond the table or an
    empty slot fails every connection; a limited membership reaches full members only."""
    if isinstance(pkeys, Unread):
        return undecided(port.subject, f"partition keys: {pkeys}") if pkeys is not NOT_GIVEN and port.link_layer == "InfiniBand" else None
    if pkeys.setting_unread and port.link_layer == "InfiniBand":
        return undecided(port.subject, f"partition key index: {pkeys.setting_unread}")
    table = pkeys.port(port.subject)
    if table is None:
        return None  # not read: NCCL_IB_PKEY unset, or index 0 of a RoCE port (its only entry, 0xffff)
    if table.table_size is None or (table.key is None and pkeys.index < table.table_size):
        return undecided(port.subject, "; ".join(table.problems) or f"{table.path}/{pkeys.index}: not read")
    where = _pkey_setting(pkeys)
    if table.key is None:
        return present(
            port.subject,
            Evidence(table.path, f"{table.table_size} entries; NCCL uses index {pkeys.index} ({where})",
                     f"an index below {table.table_size}"),
            fix=_pkey_fix(table) if port.link_layer == "InfiniBand" else
            "Unset NCCL_IB_PKEY (or set it to 0): a RoCE port's P_Key table has one entry, 0xffff at index 0.",
        )
    shown = f"0x{table.key:04x} at index {pkeys.index} ({where})"
    if table.key & PKEY_BASE == 0:
        return present(port.subject, Evidence(f"{table.path}/{pkeys.index}", f"{shown}: an empty slot, no partition",
                                              "a P_Key of the job's partition"), fix=_pkey_fix(table))
    if table.key & FULL_MEMBER == 0:
        return present(
            port.subject,
            Evidence(f"{table.path}/{pkeys.index}", f"{shown}: a limited member", "a full-member P_Key (0x8000 set)"),
            severity=Severity.WARNING,
            fix="Two limited members of a partition cannot talk to each other, so nodes set up alike cannot connect on it. "
            + _pkey_fix(table),
        )
    return None


def _left_out_by_nccl_ib_hca(job: JobFacts | Unread) -> HcaList | None:
    """NCCL_IB_HCA as the job (its environment) or NCCL's configuration files set it, when it
    narrows the selection; None when it is unset, empty or cannot be read (then every port is
    judged, as IB009 did before it read the setting: a port's state is evidence either way)."""
    if isinstance(job, Unread):
        return None
    try:
        setting = job.nccl("NCCL_IB_HCA")
    except Unknown:
        return None
    if setting is None or not setting.value.strip():
        return None
    return parse_nccl_ib_hca(setting.value)


#: IB009's fix where the HCAs are on the bus but no RDMA device is registered.
HCA_WITHOUT_DEVICE_FIX = (
    "The HCAs' RDMA driver is not loaded or was refused: look in the kernel log (dmesg | grep -E 'mlx5_ib|ib_core|"
    "disagrees about version|Unknown symbol') and at lsmod | grep -E 'mlx5_ib|ib_core|ib_uverbs'. After an MLNX_OFED or "
    "DOCA-OFED upgrade, load the new stack with '/etc/init.d/openibd restart' (or reboot); with the kernel's own "
    "drivers, 'modprobe mlx5_ib'. NCCL finds no device until then ('NET/IB : No device found') and runs on sockets."
)


@check("IB009", profiles=("prolog",), optional=("job", "pkeys"))
def rdma_stack_or_ports_misconfigured(
    rdma: RdmaFacts,
    expect: Expectations,
    job: JobFacts | Unread,
    verbs: VerbsFacts = VERBS_NOT_READ,
    pkeys: PkeyFacts | Unread = NOT_GIVEN,
) -> Iterator[Observation]:
    """Expected HCAs missing, data ports down, or links trained below the bandwidth of their peers;
    inside a job, a verbs user space (libibverbs, a device's provider) NCCL cannot load. Ports that
    a visible NCCL_IB_HCA leaves out are not judged (NCCL never opens them); an InfiniBand port an
    administrator disabled is a warning, and so is a port down or slower than its kind while
    neither expect.hcas nor a visible NCCL_IB_HCA names the rails. Where the job sets
    NCCL_IB_PKEY, an index beyond a port's P_Key table or at an empty slot is an error, one where
    the port is a limited member a warning. InfiniBand controllers on the PCI bus with no RDMA
    device at all are an error: the RDMA driver is not loaded or was refused."""
    if rdma.hcas_without_device is None and not rdma.devices and not rdma.class_unread:
        raise Unknown("mlx5_core is loaded and mlx5_ib is not, and the PCI bus (or a function's class or driver) could "
                      "not be read to see which InfiniBand controllers lack their RDMA device")
    if rdma.hcas_without_device and not rdma.devices:
        yield present(
            "node",
            Evidence("/sys/bus/pci/devices", f"InfiniBand controllers (class 0x0207) driven by mlx5_core: {', '.join(rdma.hcas_without_device[:8])}",
                     "an RDMA device in /sys/class/infiniband for each"),
            Evidence("/sys/module/mlx5_ib", "not loaded (mlx5_core is)", "loaded: it registers each HCA's RDMA device"),
            fix=HCA_WITHOUT_DEVICE_FIX,
        )
        return
    require_rdma(rdma)
    yield from _verbs_user_space(verbs)
    yield from unlisted_ports(rdma)
    for name in expect.hcas or ():
        if rdma.device(name) is None:
            yield present(
                name,
                Evidence(IB_CLASS, f"no {name} (devices: {', '.join(d.name for d in rdma.devices)})", f"{name} (expect.hcas)"),
            )
    active = []
    # The site's expect.hcas names what must work; without it, NCCL's own selection does.
    selection = _left_out_by_nccl_ib_hca(job) if expect.hcas is None else None
    some_active = any(port.state == PORT_ACTIVE for port in rdma.data_ports)
    # Without either, a port of the rails' own HCA model may be a storage or in-band port (DGX
    # H100 storage cards are ConnectX-7 like the rails): one down or slower than most of its kind
    # is only a warning. With no port up at all, the rails are down whichever they are.
    named = expect.hcas is not None or selection is not None or not some_active
    for port in judged_ports(rdma, expect):
        if selection is not None and not selection.selects(port.device, port.number):
            continue
        unreadable = _kind_unreadable(port, rdma) if expect.hcas is None else ""
        if unreadable and port.state != PORT_ACTIVE:
            yield undecided(port.subject, f"{unreadable}; cannot tell whether ports of its kind are in use")
        elif port.state is not None and (unsure := management_unknown(rdma.device(port.device), port)):
            yield undecided(port.subject, unsure)
        elif (port.state is not None and port.state != PORT_ACTIVE and port.phys_state == PHYS_DISABLED
              and port.link_layer == "InfiniBand" and expect.hcas is None and some_active):
            # On InfiniBand, Disabled is set on purpose (ibportstate, the switch side, a spare port
            # of a dual-port card); NCCL skips the port. A rail turned off by mistake still shows.
            # Ethernet (RoCE) drivers report Disabled for any netdev without carrier (irdma, mana,
            # ocrdma query_port): there it may be a pulled cable, and stays an error.
            yield present(
                port.subject,
                port_evidence(port, "state", "phys_state", expected="4: ACTIVE, 5: LinkUp, or left out by NCCL_IB_HCA"),
                severity=Severity.WARNING,
                fix=f"If {port.subject} is a rail, enable it (ibportstate, or the switch port); if it is a spare, "
                "list the rails in expect.hcas or NCCL_IB_HCA (/etc/nccl.conf) so that it is not judged.",
            )
        elif port.state is not None and port.state != PORT_ACTIVE:
            yield present(
                port.subject,
                port_evidence(port, "state", "phys_state", expected="4: ACTIVE, 5: LinkUp"),
                severity=None if named else Severity.WARNING,
                fix=AWAITING_SUBNET_MANAGER_FIX if awaiting_subnet_manager(port)
                else "" if named else _unnamed_fix(port, "bring its link up (cable, optic, switch port)"),
            )
        elif port.state is None or port.phys_state is None:
            yield undecided(port.subject, port.why("state" if port.state is None else "phys_state"))
        elif port.phys_state != PHYS_LINK_UP:
            yield present(port.subject, port_evidence(port, "state", "phys_state", expected="5: LinkUp"))
        else:
            active.append(port)
    for port in active:
        if (partition := _partition(port, pkeys)) is not None:
            yield partition
        if port.rate is None:
            yield undecided(port.subject, port.why("rate"))
            continue
        observation = _degraded(port, active, rdma, expect, named)
        if observation is not None:
            yield observation


def _verbs_user_space(verbs: VerbsFacts) -> Iterator[Observation]:
    """What NCCL would load in the job's own processes (a job step, or a snapshot taken in one):
    there the user space read here is the job's, a container's included. A prolog, a health check
    or an operator's shell reads the host's, which a containerised job never loads: not judged."""
    if verbs.job_view is False or not verbs.devices:
        return
    # Anything unread (a library directory not captured, /etc/libibverbs.d unreadable) may hold
    # what is missing: then the finding is unknown, never present.
    unread = verbs.problems[0] if verbs.problems else ""
    if not verbs.libraries:
        looked = f"no {' or '.join(LIBRARY_NAMES)} in {', '.join(verbs.directories[:6])}" + (" ..." if len(verbs.directories) > 6 else "")
        if unread:
            yield undecided("libibverbs", f"{looked}, and {unread}")
        else:
            yield present("libibverbs", Evidence("library directories and LD_LIBRARY_PATH", looked, "libibverbs.so.1 (rdma-core), which NCCL opens for its IB transport"))
        return
    needed: dict[str, list[str]] = {}
    for device in verbs.devices:
        if device.driver in PROVIDER_OF_DRIVER:
            needed.setdefault(PROVIDER_OF_DRIVER[device.driver], []).append(device.name)
    named = set(verbs.configured or ()) | set(verbs.rdmav_drivers)
    for provider, devices in sorted(needed.items()):
        if provider not in named:
            observed = "missing" if verbs.configured is None else f"no 'driver {provider}' line"
            gap = Evidence(CONFIG_DIR, observed, f"{provider}.driver saying 'driver {provider}' (rdma-core's ibverbs-providers)")
        elif not (abis := sorted(abi for name, abi in verbs.providers if name == provider)):
            gap = Evidence("library directories", f"no lib{provider}-rdmav*.so in <dir>/libibverbs or on the library path", f"the {provider} provider library (rdma-core)")
        elif verbs.provider_abi is not None and verbs.provider_abi not in abis:
            # libibverbs opens lib<name>-rdmav<its ABI>.so only: another rdma-core's provider stays on disk unused.
            found = ", ".join(f"lib{provider}-rdmav{abi}.so" for abi in abis)
            gap = Evidence(
                verbs.libraries[0],
                f"loads providers of ABI {verbs.provider_abi} (IBVERBS_PRIVATE_{verbs.provider_abi}); found only {found}",
                f"lib{provider}-rdmav{verbs.provider_abi}.so from the same rdma-core as libibverbs",
            )
        else:
            continue
        shown = ", ".join(devices[:8]) + (f" and {len(devices) - 8} more" if len(devices) > 8 else "")
        if unread:
            yield undecided(f"{provider} provider", f"{gap.source}: {gap.observed}, and {unread}")
        else:
            yield present(f"{provider} provider", gap, Evidence(f"{IB_CLASS}/*/device/driver", f"{shown}: libibverbs lists none of them without it"))


# -- IB008 ------------------------------------------------------------------------------------
@check("IB008", profiles=("prolog",))
def ib_subnet_manager_sweep_failure(rdma: RdmaFacts, kernel_log: KernelLogFacts = NOT_READ) -> Iterator[Observation]:
    """InfiniBand ports the subnet manager has not brought up (INIT/ARMED, or ACTIVE without LIDs),
    and IPoIB multicast joins the subnet administrator refused or never answered since boot."""
    require_rdma(rdma)
    ports = [port for port in rdma.data_ports if port.link_layer in ("InfiniBand", None)]
    unlisted = list(unlisted_ports(rdma))
    if not any(port.link_layer == "InfiniBand" for port in ports):
        unreadable = [port for port in ports if port.link_layer is None]
        if unreadable:
            raise Unknown(unreadable[0].why("link_layer"))
        if unlisted:
            raise Unknown(unlisted[0].reason)
        raise NotApplicable("no InfiniBand link-layer ports (RoCE and EFA have no subnet manager)")
    yield from unlisted
    yield from _refused_joins(kernel_log)
    for port in ports:
        if port.link_layer is None:
            yield undecided(port.subject, port.why("link_layer"))
        elif port.state is None:
            yield undecided(port.subject, port.why("state"))
        elif port.state in (PORT_INIT, PORT_ARMED) and (unsure := management_unknown(rdma.device(port.device), port)):
            yield undecided(port.subject, unsure)
        elif port.state in (PORT_INIT, PORT_ARMED):
            yield present(
                port.subject,
                port_evidence(port, "state", "phys_state", "lid", "sm_lid", expected="4: ACTIVE with non-zero lid and sm_lid"),
            )
        elif port.state == PORT_ACTIVE:
            if port.lid is None or port.sm_lid is None:
                yield undecided(port.subject, port.why("lid" if port.lid is None else "sm_lid"))
            elif port.lid == 0 or port.sm_lid == 0:
                yield present(port.subject, port_evidence(port, "state", "lid", "sm_lid", expected="non-zero lid and sm_lid"))


def _broadcast_group(gid: str) -> bool:
    """The IPv4 broadcast group of an IPoIB partition, ff1<scope>:401b:<P_Key>::ffff:ffff (RFC 4391
    section 4), as the kernel prints it (%pI6: eight groups of four hex digits)."""
    parts = gid.lower().split(":")
    return len(parts) == 8 and parts[0].startswith("ff1") and parts[1] == "401b" and parts[6:] == ["ffff", "ffff"]


def _refused_joins(kernel_log: KernelLogFacts) -> Iterator[Observation]:
    """One warning per IPoIB interface whose broadcast-group joins failed and that is not up now:
    without that group the interface has no carrier (ipoib_mcast_join_complete turns it on only
    for the broadcast group), and bootstrap traffic over it goes nowhere. One that is up now was
    granted a later retry. A refused IPv6 or application group leaves the interface up."""
    yield from kernel_log.unread("IPoIB multicast join history")
    by_netdev: dict[str, list[JoinFailure]] = {}
    for failure in kernel_log.join_failures:
        if _broadcast_group(failure.group):
            by_netdev.setdefault(failure.netdev, []).append(failure)
    for netdev, failures in sorted(by_netdev.items()):
        if netdev in kernel_log.joined_since:
            continue  # up now: a later join was granted (after an SM restart or failover)
        statuses = ", ".join(sorted({str(f.status) for f in failures}))
        yield present(
            netdev,
            Evidence("kernel log since boot", f"{len(failures)} multicast join failure(s) (status {statuses}); last: {failures[-1].text}",
                     "joins granted by the subnet administrator"),
            severity=Severity.WARNING,
        )


# -- IB007 ------------------------------------------------------------------------------------
def _access(node: DeviceNode, identity: JobIdentity) -> Evidence:
    return Evidence(
        node.path,
        f"mode {stat_codes.filemode(node.mode)} owner {node.uid}:{node.gid}",
        f"read-write for uid {identity.uid} (groups {','.join(map(str, identity.gids)) or 'none'}; {identity.source})",
    )


def _node_problem(rdma: RdmaFacts, path: str) -> Problem | None:
    return next((p for p in rdma.problems if p.path in (path, DEV_INFINIBAND, ".preflight/devices.json")), None)


def _devices_named(rdma: RdmaFacts, job: JobFacts | Unread) -> set[str] | None:
    """The data devices a visible NCCL_IB_HCA selects (what NCCL opens); None when it is not seen."""
    hca = _left_out_by_nccl_ib_hca(job)
    if hca is None:
        return None
    return {device.name for device in rdma.data_devices if any(hca.selects(device.name, port.number) for port in device.ports)}


@check("IB007", profiles=("prolog",), optional=("job",))
def rdma_device_nodes_missing(rdma: RdmaFacts, job: JobFacts | Unread, expect: Expectations) -> Iterator[Observation]:
    """RDMA devices the job can see in sysfs but cannot open through /dev/infiniband. A device
    that a visible NCCL_IB_HCA leaves out is not judged, and one that only expect.hcas leaves out
    (the job's choice unseen) is at most a warning: a pod's device plugin mounts only the devices
    it hands out while sysfs shows them all (every PF and VF of the host in RDMA shared mode), and
    NCCL skips a device it cannot open (init.cc@v2.30.7-1, 'Unable to open device'). In a container
    given the nodes of some devices, a device without its node was not given to it and is not
    judged: libibverbs does not list it. A job that turns NCCL's
    IB transport off (a pod of a multi-node NVLink ComputeDomain given GPUs and an IMEX channel
    only, with NCCL_IB_DISABLE=1) opens none."""
    require_rdma(rdma)
    if not isinstance(job, Unread):
        require_ib_transport_on(job, ucx_counts=True)
    devices = rdma.data_devices
    if not devices:
        raise NotApplicable("only NVSwitch management functions, no data RDMA devices")
    if rdma.dev_infiniband is None:
        problem = _node_problem(rdma, DEV_INFINIBAND)
        if problem is not None:
            raise Unknown(str(problem))
        yield present(
            DEV_INFINIBAND,
            Evidence(IB_CLASS, ", ".join(d.name for d in devices)),
            Evidence(DEV_INFINIBAND, "missing", "uverbs device nodes for every RDMA device, and rdma_cm"),
        )
        return
    if rdma.verbs_class_present is None:
        problem = next((p for p in rdma.problems if p.path.startswith((VERBS_CLASS, "/sys/module/ib_uverbs"))), None)
        raise Unknown(f"whether ib_uverbs is loaded: {problem or 'not read'}")
    if not rdma.verbs_class_present:
        yield present(
            "ib_uverbs",
            Evidence(VERBS_CLASS, "missing, and /sys/module has no ib_uverbs: the module is not loaded", "one uverbsN per RDMA device"),
        )
        return
    identity = rdma.job_identity
    opened = _devices_named(rdma, job)
    given = [device.name for device in devices if device.uverbs and device.uverbs in rdma.dev_infiniband]
    for device in devices:
        if opened is not None and device.name not in opened:
            continue  # NCCL never opens it
        if rdma.container and given and device.uverbs and device.uverbs not in rdma.dev_infiniband:
            # A pod's device plugin mounts the nodes of the devices it hands out, sysfs shows the
            # host's all; libibverbs lists no device without its node (try_access_device in
            # rdma-core's libibverbs/init.c), so NCCL never sees this one: not given, not broken.
            continue
        severity = Severity.ERROR if opened is not None or expect.hcas is None or device.name in expect.hcas else Severity.WARNING
        if device.uverbs is None:
            problem = next((p for p in rdma.problems if p.path.startswith(VERBS_CLASS)), None)
            if problem is not None:
                yield undecided(device.name, str(problem))
            else:
                yield present(device.name, Evidence(VERBS_CLASS, f"no uverbsN whose ibdev is {device.name}", "one"), severity=severity)
            continue
        path = f"{DEV_INFINIBAND}/{device.uverbs}"
        yield from _judge_node(rdma, device.name, path, identity, severity)
    if any(port.link_layer in ("InfiniBand", "Ethernet") for device in devices for port in device.ports):
        yield from _judge_node(rdma, "rdma_cm", RDMA_CM, identity, Severity.WARNING)


#: IB007's fix for a missing /dev/infiniband/rdma_cm: on a host its module is not loaded (or was
#: refused after an RDMA stack upgrade), in a container the runtime did not pass it in.
RDMA_CM_MISSING_FIX = (
    "On the host, rdma_ucm is not loaded: 'modprobe rdma_ucm' (after an MLNX_OFED or DOCA-OFED upgrade, restart openibd "
    "or reboot so the new modules load, and look for 'disagrees about version of symbol' in dmesg). In a container, pass "
    "the node in: docker run --device=/dev/infiniband/rdma_cm (or the whole /dev/infiniband)."
)


def _judge_node(
    rdma: RdmaFacts, subject: str, path: str, identity: JobIdentity | None, severity: Severity
) -> Iterator[Observation]:
    """rdma_cm is a warning, and only for IB and RoCE ports: NCCL exchanges QP details over its
    own sockets, but UCX, MPI and libfabric's verbs provider connect through rdma_cm (EFA does not)."""
    node = rdma.node(path)
    if node is None:
        problem = _node_problem(rdma, path)
        if problem is not None:
            yield undecided(subject, str(problem))
        else:
            fix = RDMA_CM_MISSING_FIX if path == RDMA_CM else ""
            yield present(subject, Evidence(path, "missing", "a character device the job can open"), severity=severity, fix=fix)
    elif not stat_codes.S_ISCHR(node.mode):
        yield present(subject, Evidence(path, f"not a character device ({stat_codes.filemode(node.mode)})", "character device"), severity=severity)
    elif identity is None:
        yield undecided(subject, f"{path} exists, but the job's identity could not be read (/proc/self/status)")
    elif (access := access_decided(node, identity)) is None:
        yield undecided(subject, membership_unknown(node, identity))
    elif not access:
        yield present(subject, _access(node, identity), severity=severity)
