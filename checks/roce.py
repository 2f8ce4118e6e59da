"""RoCE: GID index, MTU, PFC and ECN (ROCE references)."""

from __future__ import annotations

import re
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
from preflight.nccl.gdr import DEFAULT_GDR_LEVEL, PATH_RANK, PXN_PEER_LIMIT, gdr_level, within
from preflight.nccl.gid import nccl_int
from preflight.nccl.ib import data_direct_gpus, ib_hca_selects, nccl_selection, require_ib_transport_on, selection_unseen
from preflight.nccl.releases import require_nccl, version_tuple
from preflight.probes.job import named_net_plugin, setting_evidence
from preflight.probes.kernel_log import NOT_READ, KernelLogFacts
from preflight.probes.nccl_nets import NcclNetsFacts, skipped_devices
from preflight.probes.pcie import unclassified_reason
from preflight.probes.rdma import MELLANOX_VENDOR, RdmaPort, require_rdma
from preflight.probes.roce import (
    IB_SYSFS,
    ROCE_HEADER_BYTES,
    DcbReading,
    GidEntry,
    NcclGid,
    RoceDcbFacts,
    RoceFacts,
    RocePort,
)
from preflight.registry import check

if TYPE_CHECKING:
    from collections.abc import Iterator

    from preflight.config import Expectations
    from preflight.nccl.ib import Selection
    from preflight.probes.job import JobFacts
    from preflight.probes.nccl_libs import NcclCopy, NcclLibFacts
    from preflight.probes.nvlink import NvlinkFacts
    from collections.abc import Mapping

    from preflight.probes.pcie import PcieFacts
    from preflight.probes.rdma import RdmaFacts
    from preflight.sources.netlink import DcbConfig

_OS_ERROR = re.compile(r"\(E[A-Z0-9]+\)")


# -- checks ---------------------------------------------------------------------------------------
def _ports_nccl_uses(
    roce: RoceFacts, job: JobFacts, site_hcas: tuple[str, ...] | None = None, passed: Mapping[str, str] | None = None
) -> Iterator[RocePort | Observation]:
    """The RoCE ports NCCL would open (ACTIVE, selected by NCCL_IB_HCA; where that is not set,
    the site's data HCAs, expect.hcas, when given, else every port but those NCCL's topology
    search passes over, ``passed``), and an undecided observation for every port whose link layer
    could not be read. NotApplicable when the job turns NCCL's IB transport off."""
    require_ib_transport_on(job)
    hca = job.nccl("NCCL_IB_HCA")
    everything = hca is None and site_hcas is None
    skipped = passed or {}
    selected = [
        port for port in roce.ports
        if (port.state is None or port.state.endswith("ACTIVE")) and ib_hca_selects(hca.value if hca else None, port.device, port.port)
        and (hca is not None or site_hcas is None or port.device in site_hcas)
        and not (everything and port.device in skipped)
    ]
    if not roce.unreadable_ports:
        if not roce.ports:
            raise NotApplicable("no RDMA port with link_layer Ethernet in /sys/class/infiniband")
        if not selected:
            unused = sorted({port.device for port in roce.ports if everything and port.device in skipped})
            raise NotApplicable(skipped[unused[0]] if unused else "no ACTIVE RoCE port is selected by NCCL_IB_HCA")
    for subject, reason in roce.unreadable_ports:
        yield undecided(subject, reason)
    yield from selected


#: Said where ports that disagree are compared as rails while the job's choice of ports is unseen.
RAILS_UNSEEN_FIX = (
    "If one of these ports is not a rail (a front-end or storage NIC that jobs leave out), name the rails in "
    "NCCL_IB_HCA in /etc/nccl.conf (or in expect.hcas) so that only they are compared; a job that sets no "
    "NCCL_IB_HCA uses every active port, and then the rails must agree."
)


def _port_unseen_fix(repair: str) -> str:
    """Said where one port's finding is a warning because the jobs' choice of ports is unseen."""
    return (
        f"If this port is a rail, {repair}. If it is not (a spare, front-end or storage NIC that jobs leave out), "
        "name the rails in NCCL_IB_HCA in /etc/nccl.conf (or in expect.hcas) so that only they are judged; a job "
        "that sets no NCCL_IB_HCA uses every active port, this one included."
    )


def _rails_severity(job: JobFacts, expect: Expectations) -> Severity | None:
    """A warning when the rails compared may include ports the jobs leave out; else the
    reference's own."""
    return Severity.WARNING if selection_unseen(job, expect.hcas) else None


#: Said where every RoCE port NCCL uses is addressed in IPv6 only and this run cannot see the
#: jobs' GID settings: NCCL takes IPv4 GIDs unless NCCL_IB_ADDR_FAMILY says AF_INET6
#: (envIbAddrFamily, src/transport/net_ib), which such a site's jobs set themselves.
IPV6_FABRIC_FIX = (
    "Every RoCE port NCCL uses here has a routable RoCE v2 GID in IPv6 only. NCCL looks for IPv4 GIDs unless "
    "NCCL_IB_ADDR_FAMILY=AF_INET6 is set, which this run cannot see in the jobs' environment: set it for every job "
    "in /etc/nccl.conf (then this check sees it), or make sure each job sets it."
)


def _ipv6_fabric(items: list[Observation | tuple[RocePort, NcclGid]]) -> bool:
    """Every port NCCL uses has a routable IPv6 RoCE v2 GID and none an IPv4 one: a fabric
    addressed in IPv6 only, not a rail that lost its IPv4 address beside others that kept theirs."""
    ports = [item[0] for item in items if isinstance(item, tuple)]
    return bool(ports) and all(
        any(_usable(e) and not e.ipv4 for e in port.gids) and not any(_usable(e) and e.ipv4 for e in port.gids)
        for port in ports
    )


def _variable_evidence(roce: RoceFacts) -> list[Evidence]:
    return [Evidence(f"{origin} {name}", value) for name, value, origin in roce.gid_variables]


def _usable(entry: GidEntry | None) -> bool:
    return entry is not None and entry.version == 2 and not entry.link_local


def _ports_with_choice(
    roce: RoceFacts, job: JobFacts, site_hcas: tuple[str, ...] | None, passed: Mapping[str, str]
) -> Iterator[Observation | tuple[RocePort, NcclGid]]:
    """The ports NCCL uses (chosen as for ROCE006) with the GID choice for the job's settings; a
    port whose table could not be read comes out as an undecided observation instead."""
    for item in _ports_nccl_uses(roce, job, site_hcas, passed):
        if isinstance(item, Observation):
            yield item
        elif item.nccl_job is None:
            yield undecided(item.subject, "; ".join(item.unreadable_gids))
        else:
            yield item, item.nccl_job


# RDMA libraries that run beside NCCL in the same job and read a fixed GID index of their own
# from the environment: the variable, its library, and the highest index it accepts (Mooncake
# ignores larger values and chooses by itself). Negative values mean "choose" for all of them.
OTHER_GID_INDEX_VARIABLES: dict[str, tuple[str, int | None]] = {
    "NVSHMEM_IB_GID_INDEX": ("NVSHMEM", None),
    "MC_GID_INDEX": ("Mooncake Transfer Engine", 255),
    "MSCCLPP_IB_GID_INDEX": ("MSCCL++", None),
    "UCCL_IB_GID_INDEX": ("UCCL EP", None),
    "UCCL_P2P_RDMA_GID_INDEX": ("UCCL P2P engine", None),
}


def _missing_slot(port: RocePort, index: int) -> str:
    return "empty slot" if index < port.table_size else f"beyond the table ({port.table_size} slots)"


def _other_library_gid_indices(job: JobFacts) -> list[tuple[str, str, str, int]]:
    """(variable, library, value, index) for every other library's fixed GID index the job sets
    and the library would use."""
    found = []
    for name, (library, highest) in OTHER_GID_INDEX_VARIABLES.items():
        value = job.environ.get(name)
        if value is None or not re.fullmatch(r"\s*\d{1,6}\s*", value):
            continue  # unset, negative (automatic), or a value whose parsing we do not model
        index = int(value)
        if highest is not None and index > highest:
            continue  # the library ignores it and chooses by itself
        found.append((name, library, value, index))
    return found


def _state_unread(port: RocePort, subject: str = "") -> Observation:
    """For a port whose state could not be read and whose GID would be wrong: the port may be
    down, which NCCL and the other libraries skip, so the GID is no verdict."""
    return undecided(subject or port.subject, port.state_error or f"{port.path}/state: not read")


def _may_be_active(port: RocePort) -> bool:
    """ACTIVE, or a state that could not be read (judged like NCCL's own part does)."""
    return port.state is None or port.state.endswith("ACTIVE")


def _other_libraries_fixed_gid(roce: RoceFacts, fixed: list[tuple[str, str, str, int]]) -> Iterator[Observation]:
    """A GID index that another library is told to use and that points at an empty, RoCE v1 or
    link-local slot of an active RoCE port. A warning: these libraries pick their HCAs with their
    own variables, so the port may not be one they use."""
    for name, library, value, index in fixed:
        for port in roce.ports:
            if not _may_be_active(port):
                continue
            subject = f"{name} on {port.subject}"
            if port.unreadable_gids:
                yield undecided(subject, "; ".join(port.unreadable_gids))
                continue
            entry = port.entry(index)
            if entry is not None and entry.roce_type is None:
                yield undecided(subject, f"{port.path}/gid_attrs/types/{index}: {entry.type_error}")
                continue
            if _usable(entry):
                continue
            if port.state is None:
                yield _state_unread(port, subject)
                continue
            observed = f"{library} uses " + (entry.describe() if entry else f"index {index}: {_missing_slot(port, index)}")
            yield present(
                subject,
                Evidence(f"environment {name}", value),
                Evidence(f"{port.path}/gids/{index}", observed, "a routable RoCE v2 GID"),
                severity=Severity.WARNING,
            )


@check("ROCE005", profiles=("prolog",), optional=("nccl_nets",))
def roce_gid_index_mismatch(
    roce: RoceFacts, job: JobFacts, expect: Expectations, nccl_nets: NcclNetsFacts | Unread = NOT_GIVEN
) -> Iterator[Observation]:
    """The GID NCCL would use on a RoCE port is empty, RoCE v1 or link-local, or a fixed
    NCCL_IB_GID_INDEX means different things on different ports; a fixed GID index the job gives
    NVSHMEM, Mooncake, MSCCL++ or UCCL that names an unusable slot is a warning. Where the jobs'
    NCCL_IB_HCA is unseen and the site names no rails, a port's finding is a warning: a spare or
    storage port without an IPv4 address counts only for jobs that set no NCCL_IB_HCA."""
    fixed = _other_library_gid_indices(job)
    try:
        nccl = list(_nccl_gid_choice_findings(roce, job, expect, skipped_devices(nccl_nets)))
    except NotApplicable:
        # NCCL_IB_HCA may leave NCCL no RoCE port while NVSHMEM or Mooncake, which pick their
        # HCAs themselves, still use one: their fixed index is judged all the same.
        if not fixed or not any(_may_be_active(port) for port in roce.ports):
            raise
        nccl = []
    yield from nccl
    yield from _other_libraries_fixed_gid(roce, fixed)


def _nccl_gid_choice_findings(roce: RoceFacts, job: JobFacts, expect: Expectations, passed: Mapping[str, str]) -> Iterator[Observation]:
    """ROCE005's NCCL part: the GID NCCL would use on each RoCE port it opens."""
    forced_families: dict[int, list[str]] = {}  # address family of a fixed index's usable GID -> ports
    severity = _rails_severity(job, expect)
    fix = _port_unseen_fix("give its netdev a routable IPv4 address, or fix the NCCL_IB_* GID settings, as the evidence shows") if severity else ""
    items = list(_ports_with_choice(roce, job, expect.hcas, passed))
    if severity is not None:
        # The jobs' ports unseen: an SR-IOV function without an address is a VF waiting for the
        # pod that gets it (its address comes with it) or the PF its VFs hang from, not a rail.
        items = [item for item in items if isinstance(item, Observation) or not item[0].sriov]
    if _ipv6_fabric(items) and not roce.gid_variables and not job.in_job_process:
        severity, fix = Severity.WARNING, IPV6_FABRIC_FIX
    for item in items:
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
        if port.state is None:
            yield _state_unread(port)
            continue
        how = "NCCL_IB_GID_INDEX fixes" if choice.forced else "NCCL 2.21+ would choose"
        if entry is None:
            observed = f"{how} index {choice.index}: {_missing_slot(port, choice.index)}"
        else:
            observed = f"{how} {entry.describe()}"
        routable = [e for e in port.gids if _usable(e) and e.ipv4]
        global6 = [e for e in port.gids if _usable(e) and not e.ipv4]
        expected = (
            f"a routable RoCE v2 GID, e.g. index {routable[0].index} ({routable[0].ipv4})" if routable else
            f"a routable RoCE v2 GID, e.g. index {global6[0].index} ({global6[0].gid}, taken with NCCL_IB_ADDR_FAMILY=AF_INET6)"
            if global6 else "a routable RoCE v2 GID (this port has no IPv4 RoCE v2 GID: no IPv4 address on its netdev?)"
        )
        yield present(port.subject, *_variable_evidence(roce), Evidence(where, observed, expected), severity=severity, fix=fix)
    if len(forced_families) > 1:
        described = "; ".join(f"RoCE v2 IPv{family} on {', '.join(ports)}" for family, ports in sorted(forced_families.items()))
        yield present(
            "NCCL_IB_GID_INDEX",
            *_variable_evidence(roce),
            Evidence(f"{IB_SYSFS}/*/ports/*/gids", described, "the same address family and RoCE version on every port"),
            severity=severity,
            fix=RAILS_UNSEEN_FIX if severity else "",
        )


#: NCCL's automatic GID scan (ncclIbRoceGetVersionNum) and where it fails on a slot whose
#: gid_attrs/types read answers EINVAL: 2.20 has no scan (src/transport/net_ib.cc@v2.20.5-1 uses
#: NCCL_IB_GID_INDEX, default 0); 2.21 to 2.25 return ncclSystemError on any failed read
#: (net_ib.cc@v2.21.5-1:248, net_ib.cc@v2.25.1-1:329); 2.26 returns success on EINVAL and moves on
#: to the next slot (net_ib.cc@v2.26.2-1:338).
GID_SCAN_SINCE = (2, 21)
EINVAL_SKIPPED_SINCE = (2, 26)


def _einval_fatal(nccl_libs: NcclLibFacts) -> tuple[list[NcclCopy], str, str]:
    """(copies, unread, none): the NCCL copies whose GID scan aborts on an EINVAL read (2.21-2.25,
    or a release the node does not name), why the releases cannot be told, and why no copy here
    aborts (no NCCL, or every copy outside 2.21-2.25)."""
    try:
        require_nccl(nccl_libs)
    except Unknown as error:
        return [], str(error), ""
    except NotApplicable as error:
        return [], "", str(error)
    fatal = []
    for copy in nccl_libs.copies:
        release = version_tuple(copy.version) if copy.version is not None else None
        if release is None or GID_SCAN_SINCE <= release < EINVAL_SKIPPED_SINCE:
            fatal.append(copy)
    none = "" if fatal else "every NCCL installed here is 2.26 or newer, which skips GID slots that read EINVAL, or older than 2.21, which does not scan the GID table"
    return fatal, "", none


def _fatal_evidence(fatal: list[NcclCopy]) -> Evidence:
    shown = ", ".join(f"{copy.version or 'release not named'} ({copy.path})" for copy in fatal)
    return Evidence("NCCL installed", shown, "NCCL 2.26 or newer, which skips such slots")


@check("ROCE004", profiles=("prolog",), optional=("nccl_nets",))
def roce_gid_type_read_einval(
    roce: RoceFacts, job: JobFacts, nccl_libs: NcclLibFacts, expect: Expectations, nccl_nets: NcclNetsFacts | Unread = NOT_GIVEN
) -> Iterator[Observation]:
    """NCCL's automatic GID scan reads a gid_attrs/types file that fails, or reads EINVAL or the
    GID table looks like a container's (hidden leading slots) while an NCCL that aborts on EINVAL
    (2.21-2.25, or a release not named) is installed. Ports are chosen, and softened where the
    jobs' choice is unseen, as for ROCE005."""
    severity = _rails_severity(job, expect)
    fix = _port_unseen_fix("upgrade NCCL to 2.26 or later, or pin NCCL_IB_GID_INDEX to its routable RoCE v2 index") if severity else ""
    fatal, unread, none = _einval_fatal(nccl_libs)
    versions = (_fatal_evidence(fatal),) if fatal else ()
    findings: list[Observation] = []
    skipped = False  # a port whose table only an NCCL that is not installed here would choke on
    for item in _ports_with_choice(roce, job, expect.hcas, skipped_devices(nccl_nets)):
        if isinstance(item, Observation):
            findings.append(item)
            continue
        port, choice = item
        if choice.forced:
            continue  # a fixed NCCL_IB_GID_INDEX skips the scan
        if choice.failed_read is not None:
            findings.append(_state_unread(port) if port.state is None else _failed_read(roce, port, choice, severity, fix))
            continue
        einval = _einval_or_holes(roce, port, choice, versions, severity, fix)
        if einval is None:
            continue
        if unread:
            findings.append(undecided(port.subject, f"whether an NCCL that aborts on EINVAL (2.21-2.25) is installed: {unread}"))
        elif fatal:
            findings.append(_state_unread(port) if port.state is None else einval)
        else:
            skipped = True
    if skipped and not findings:
        raise NotApplicable(none)
    yield from findings


def _failed_read(roce: RoceFacts, port: RocePort, choice: NcclGid, severity: Severity | None, fix: str) -> Observation:
    """A types read that fails otherwise than with EINVAL fails every NCCL's scan (2.21 and later)."""
    path = f"{port.path}/gid_attrs/types/{choice.failed_read}"
    if not _OS_ERROR.search(choice.error):
        return undecided(port.subject, f"{path}: {choice.error}")
    return present(port.subject, *_variable_evidence(roce), Evidence(path, choice.error, "readable for every configured GID"), severity=severity, fix=fix)


def _einval_or_holes(
    roce: RoceFacts, port: RocePort, choice: NcclGid, versions: tuple[Evidence, ...], severity: Severity | None, fix: str
) -> Observation | None:
    """The scan reading EINVAL (NCCL 2.21-2.25 abort), else a table whose leading slots are empty
    (a pod's view, where such reads are likely) as a warning; None for a table NCCL reads whole."""
    pin = f"NCCL >= 2.26, or NCCL_IB_GID_INDEX={choice.index} for this node"
    if choice.einval_reads:
        files = ", ".join(f"types/{index}" for index in choice.einval_reads)
        return present(
            port.subject,
            *_variable_evidence(roce),
            Evidence(f"{port.path}/gid_attrs", f"NCCL's scan reads {files}: invalid argument (EINVAL); NCCL 2.21-2.25 abort", pin),
            *versions,
            severity=severity,
            fix=fix,
        )
    first = min((entry.index for entry in port.gids), default=None)
    if first is None or first == 0:
        return None
    return present(
        port.subject,
        Evidence(f"{port.path}/gids", f"slots 0-{first - 1} empty, GIDs start at index {first} (a container's or pod's view of the table)", pin),
        *versions,
        severity=Severity.WARNING,
    )


@check("ROCE006", profiles=("prolog",), optional=("nccl_nets",))
def roce_path_mtu_mismatch(
    roce: RoceFacts, job: JobFacts, expect: Expectations, nccl_nets: NcclNetsFacts | Unread = NOT_GIVEN
) -> Iterator[Observation]:
    """A RoCE netdev MTU differs from the site's, yields a RoCE MTU below what its size suggests
    (4096 -> 2048), or the node's RoCE rails disagree."""
    rails: dict[int, list[RocePort]] = {}
    for item in _ports_nccl_uses(roce, job, expect.hcas, skipped_devices(nccl_nets)):
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
        severity = _rails_severity(job, expect)
        yield present("RoCE rails", *evidence, severity=severity, fix=RAILS_UNSEEN_FIX if severity else "")


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


@check("ROCE001", optional=("nccl_nets",))
def roce_pfc_pause_storm(
    roce: RoceFacts, roce_dcb: RoceDcbFacts, job: JobFacts, expect: Expectations, kernel_log: KernelLogFacts = NOT_READ,
    nccl_nets: NcclNetsFacts | Unread = NOT_GIVEN,
) -> Iterator[Observation]:
    """The NIC recorded pause storms since the driver loaded, or the lossless setup a RoCE port
    needs against them is off or inconsistent: stall watchdog off, PFC not on the site's lossless
    priority (or on others too), ECN off there, NCCL_IB_TC mapped to a lossy priority, PFC
    priorities that differ between rails, or the driver failing to size a lossless buffer."""
    used = []
    for item in _ports_nccl_uses(roce, job, expect.hcas, skipped_devices(nccl_nets)):
        if isinstance(item, Observation):
            yield item
        else:
            used.append(item)
    if used:
        yield from kernel_log.unread("lossless-buffer errors", subject="port buffers")
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
        if config is None and reading.host_owned:
            continue  # no DCB here to misconfigure: the host that owns the port sets its PFC
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
        if tc_setting is not None and 0 <= tc <= 255 and lossless and trust == "dscp" and not config.dscp_to_priority:
            # qos/trust says dscp, but DCB netlink gave no map (an older kernel or MLNX_OFED):
            # where NCCL_IB_TC's DSCP lands is the firmware's, not priority 0.
            yield undecided(subject, f"trust dscp, but {source} reports no DSCP-to-priority map: the priority of NCCL_IB_TC={tc_setting.value} is not known")
        elif tc_setting is not None and 0 <= tc <= 255 and lossless and trust == "dscp":
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
        severity = _rails_severity(job, expect)
        yield present(
            "RoCE rails",
            Evidence("RTM_GETDCB (mlnx_qos -i <netdev>)", f"PFC priorities differ: {described}", "the same PFC priorities on every rail"),
            severity=severity,
            fix=RAILS_UNSEEN_FIX if severity else "",
        )


# -- ROCE002: GPUDirect RDMA over RoCE ------------------------------------------------------------
def _ib_ports(rdma: RdmaFacts, job: JobFacts, passed: Mapping[str, str] | None = None) -> Selection:
    """The RDMA ports NCCL's IB transport would use (without NCCL_IB_HCA, not those its topology
    search passes over, ``passed``); NotApplicable when the job turns that transport off, Unknown
    when the ports or NCCL_IB_HCA's choice cannot be told."""
    require_ib_transport_on(job)
    require_rdma(rdma)
    selection = nccl_selection(rdma, job, passed)
    if selection.unlisted:
        raise Unknown(selection.unlisted[0])
    return selection


def _no_roce(rdma: RdmaFacts, selection: Selection) -> str:
    if not any(port.link_layer == "Ethernet" for port in rdma.data_ports):
        return "no RDMA port with link_layer Ethernet (RoCE) on this node"
    if selection.setting is not None:
        return "no ACTIVE RoCE port is selected by NCCL_IB_HCA"
    # The reason of a RoCE device: an InfiniBand one passed over beside them (an HGX baseboard's
    # NVSwitch management function) says nothing of the RoCE ports.
    roce = {port.device for port in rdma.data_ports if port.link_layer == "Ethernet"}
    reasons = [why for why in selection.passed_over if why.split(" ", 1)[0] in roce]
    if reasons:
        return f"no ACTIVE RoCE port NCCL would use: {reasons[0]}"
    return "no RoCE port is ACTIVE"


def _nvlink_everywhere(pcie: PcieFacts, nvlink: NvlinkFacts) -> bool | None:
    """Whether a GPU may reach a peer GPU over NVLink (what PXN needs): True on NVSwitch
    systems (every GPU pair), False when NVML says no GPU has an active link, None otherwise
    (NVML unanswered, or bridged pairs whose partners this check does not map)."""
    if pcie.nvswitches:
        return True
    if nvlink.nvml_error or not nvlink.gpus or any(gpu.active_count is None for gpu in nvlink.gpus):
        return None
    return False if all(gpu.active_count == 0 for gpu in nvlink.gpus) else None


def _usable_nics(pcie: PcieFacts, selection: Selection) -> dict[str, tuple[str, bool]]:
    """PCI address -> (RDMA device names, whether one is a RoCE port) of the NICs NCCL keeps."""
    layers: dict[str, set[str]] = {}
    for port in selection.ports:
        layers.setdefault(port.device, set()).add(port.link_layer or "")
    usable = {}
    for nic in pcie.nics:
        names = [name for name in nic.rdma_devices if name in layers]
        if names:
            usable[nic.bdf] = (",".join(names), any("Ethernet" in layers[name] for name in names))
    return usable


@check("ROCE002", profiles=("prolog",), optional=("nccl_nets",))
def roce_gpudirect_rdma_not_used(
    pcie: PcieFacts, rdma: RdmaFacts, nvlink: NvlinkFacts, job: JobFacts, nccl_nets: NcclNetsFacts | Unread = NOT_GIVEN
) -> Iterator[Observation]:
    """A GPU whose nearest RoCE NIC NCCL may use is farther than NCCL_NET_GDR_LEVEL allows, with
    no NVLink peer to relay through (PXN), or GPUDirect RDMA reads switched off by the job."""
    unclassified = unclassified_reason(pcie)
    if not pcie.gpus or not pcie.nics:
        if unclassified:
            raise Unknown(unclassified)
        raise NotApplicable("needs NVIDIA GPUs and RDMA NICs on this node")
    selection = _ib_ports(rdma, job, skipped_devices(nccl_nets))
    usable = _usable_nics(pcie, selection)
    if not any(roce for _, roce in usable.values()):
        if selection.undecided:
            port = selection.undecided[0]
            raise Unknown(port.why("state" if port.state is None else "link_layer"))
        raise NotApplicable(_no_roce(rdma, selection))
    if job.environ_error:
        raise Unknown(f"/proc/self/environ unreadable ({job.environ_error}): NCCL_NET_GDR_LEVEL and NCCL_IB_HCA unknown")
    for port in selection.undecided:
        yield undecided(port.subject, port.why("state" if port.state is None else "link_layer"))
    if unclassified:
        yield undecided("PCI devices", unclassified)
    yield from _gdr_read_off(job)
    setting = job.nccl("NCCL_NET_GDR_LEVEL")
    level = gdr_level(setting.value if setting else None) or DEFAULT_GDR_LEVEL
    level_evidence = setting_evidence(job, "NCCL_NET_GDR_LEVEL", "" if setting else f"NCCL's default {DEFAULT_GDR_LEVEL}")
    pxn_off = (pxn := job.nccl("NCCL_PXN_DISABLE")) is not None and nccl_int(pxn.value, 0) == 1
    nvlinked = _nvlink_everywhere(pcie, nvlink)
    overall = {gpu: kind for gpu, _, kind in pcie.nearest_nic}
    data_direct = data_direct_gpus(pcie, job)
    for gpu in pcie.gpus:
        if overall.get(gpu.bdf) == "SYS":
            continue  # the nearest RDMA NIC is on the other socket: TOPO005 reports it
        if gpu.bdf in data_direct:
            continue  # NCCL places the NIC at its Data Direct function, in this GPU's own switch
        classed = {nic: pcie.path(gpu.bdf, nic) or "UNKNOWN" for nic in usable}
        paths = {nic: kind for nic, kind in classed.items() if kind in PATH_RANK}
        if any(within(kind, level) for kind in paths.values()):
            continue
        if len(paths) < len(usable):  # a NIC this GPU may be close to sits on an unplaced path
            yield undecided(f"GPU {gpu.bdf}", "numa_node of the GPU or of a NIC is not reported on this multi-socket node")
            continue
        best = min(paths.values(), key=PATH_RANK.__getitem__)
        nearest = [nic for nic, kind in paths.items() if kind == best]
        if not any(usable[nic][1] for nic in nearest):
            continue  # its nearest NICs are InfiniBand: not a RoCE question
        if pcie.arm_cpu and best == "PHB":
            yield undecided(f"GPU {gpu.bdf}", "an Arm host: a Grace GPU reaches the CPU over NVLink-C2C, which NCCL may class P2C and allow")
            continue
        relay = [
            (other.bdf, nic) for other in pcie.gpus if other.bdf != gpu.bdf for nic in usable
            if (kind := pcie.path(other.bdf, nic)) in PATH_RANK and within(kind, PXN_PEER_LIMIT) and within(kind, level)
        ]
        if relay and not pxn_off and nvlinked is not False:
            if nvlinked is None:
                yield undecided(f"GPU {gpu.bdf}", f"GPU {relay[0][0]} sits close to NIC {usable[relay[0][1]][0]}; whether PXN can relay over NVLink is not known")
            continue  # PXN sends through the NVLink peer, which uses GDR
        shown = ", ".join(f"{usable[nic][0]} ({nic})" for nic in nearest)
        evidence = [
            Evidence(f"/sys/bus/pci/devices/{gpu.bdf}", f"nearest NIC NCCL may use: {shown}, path {best}", f"a RoCE NIC within {level} (PIX/PXB: under the GPU's own PCIe switch)"),
            level_evidence,
        ]
        if selection.setting is not None:
            evidence.append(setting_evidence(job, "NCCL_IB_HCA"))
        if relay and pxn_off:
            evidence.append(setting_evidence(job, "NCCL_PXN_DISABLE", "unset or 0 (PXN relays through an NVLink peer near a NIC)"))
        yield present(f"GPU {gpu.bdf}", *evidence)


def _gdr_read_off(job: JobFacts) -> Iterator[Observation]:
    """NCCL_NET_GDR_READ=0 stages every send through host memory (ncclTopoCheckGdr, read=1)."""
    setting = job.nccl("NCCL_NET_GDR_READ")
    if setting is not None and nccl_int(setting.value, -2) == 0:
        yield present("NCCL_NET_GDR_READ", setting_evidence(job, "NCCL_NET_GDR_READ", "unset (NCCL reads GPU memory directly on Ampere and newer GPUs)"))


# -- ROCE003: packet reordering and NCCL's out-of-order receive queue -----------------------------
#: NCCL_IB_OOO_RQ first appears in 2.30.3 (src/transport/net_ib/init.cc); older releases ignore it.
OOO_RQ_SINCE = (2, 30, 3)


def _mlx5(rdma: RdmaFacts, device: str) -> bool | None:
    """Whether NCCL drives ``device`` through its mlx5 provider (``mlx5dv_is_supported``), the
    only one that reads NCCL_IB_OOO_RQ: a Mellanox/NVIDIA function that is not an mlx4, or an
    ``mlx5_*`` name; None when neither the vendor nor the name tells."""
    found = rdma.device(device)
    vendor = found.pci_vendor if found is not None else None
    if device.startswith("mlx5"):
        return True
    if vendor is None:
        return None
    return vendor == MELLANOX_VENDOR and not device.startswith("mlx4")


def _counters(port: RdmaPort) -> Evidence:
    shown = ", ".join(
        f"{name} {value if value is not None else 'not reported'}"
        for name, value in (("out_of_sequence", port.out_of_sequence), ("packet_seq_err", port.packet_seq_err))
    )
    return Evidence(f"{port.path}/hw_counters", f"{shown} (since the driver loaded; plain loss counts too)")


@check("ROCE003", profiles=("prolog",))
def roce_packet_reordering(rdma: RdmaFacts, job: JobFacts, nccl_libs: NcclLibFacts) -> Iterator[Observation]:
    """NCCL_IB_OOO_RQ forced on mlx5 RoCE ports that NCCL 2.30.3 or newer would use while its
    adaptive routing stays off there, which makes NCCL fail every connection.

    The node cannot show a fabric that sprays packets: the out_of_sequence and packet_seq_err
    counters add up since the driver loaded and climb after plain loss too, so a nonzero count
    would drain healthy nodes. They are shown beside a finding, never one by themselves. Nor is
    NCCL_IB_ADAPTIVE_ROUTING=1 on RoCE a finding: it is how NCCL is run on fabrics whose switches
    and NICs do adaptive routing with out-of-order placement, which sysfs does not show."""
    selection = _ib_ports(rdma, job)
    roce = [port for port in selection.ports if port.link_layer == "Ethernet"]
    if not roce and not selection.undecided:
        raise NotApplicable(_no_roce(rdma, selection))
    if job.environ_error:
        raise Unknown(f"/proc/self/environ unreadable ({job.environ_error}): NCCL_IB_OOO_RQ unknown")
    setting = job.nccl("NCCL_IB_OOO_RQ")
    if setting is None or nccl_int(setting.value, 0) == 0:
        return  # NCCL keeps its in-order receive queue: the settings demand nothing of the fabric
    require_nccl(nccl_libs)
    reading = [copy for copy in nccl_libs.copies if copy.version is None or (version_tuple(copy.version) or ()) >= OOO_RQ_SINCE]
    if not reading:
        raise NotApplicable("every NCCL installed here is older than 2.30.3, which ignores NCCL_IB_OOO_RQ")
    for port in selection.undecided:
        yield undecided(port.subject, port.why("state" if port.state is None else "link_layer"))
    ar = job.nccl("NCCL_IB_ADAPTIVE_ROUTING")
    # ar is 0 on RoCE unless NCCL_IB_ADAPTIVE_ROUTING is set to something other than -2 (auto)
    ar_on = ar is not None and nccl_int(ar.value, -2) not in (-2, 0)
    named = [copy for copy in reading if copy.version is not None]
    plugin = named_net_plugin(job)  # e.g. NVIDIA's Spectrum-X plugin, whose rules are not public
    versions = Evidence("NCCL installed", ", ".join(f"{copy.version} ({copy.path})" for copy in named), "2.30.3 or newer reads NCCL_IB_OOO_RQ")
    for port in roce:
        mlx5 = _mlx5(rdma, port.device)
        if mlx5 is False:
            continue  # NCCL reads NCCL_IB_OOO_RQ only through the mlx5 provider
        if mlx5 is None:
            yield undecided(port.subject, f"neither the name nor the PCI vendor of {port.device} tells whether NCCL drives it through mlx5")
        elif ar_on:
            yield undecided(port.subject, "NCCL_IB_OOO_RQ and adaptive routing are on: whether both sides' NICs support out-of-order receive is known only to mlx5dv, not sysfs")
        elif plugin is not None:
            yield undecided(port.subject, f"{plugin.origin} NCCL_NET_PLUGIN={plugin.value}: where that plugin loads, its own transport, "
                                          "not NCCL's, decides what NCCL_IB_OOO_RQ asks of the fabric")
        elif not named:
            yield undecided(port.subject, f"the NCCL release of {reading[0].path} is not named by its file or wheel")
        else:
            yield present(
                port.subject,
                setting_evidence(job, "NCCL_IB_OOO_RQ", "unset or 0, unless adaptive routing is on end to end"),
                setting_evidence(job, "NCCL_IB_ADAPTIVE_ROUTING", "1 (NCCL's default on RoCE is off, and OOO RQ requires it)"),
                Evidence(f"{port.path}/link_layer", "Ethernet (RoCE)"),
                versions,
                _counters(port),
            )
