"""RoCE: GID index, MTU, PFC and ECN (ROCE references)."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from preflight.model import (
    Evidence,
    NotApplicable,
    Observation,
    Severity,
    present,
    undecided,
)
from preflight.nccl.gid import ib_hca_selects, nccl_int
from preflight.probes.kernel_log import NOT_READ, KernelLogFacts
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
    from preflight.probes.job import JobFacts
    from preflight.sources.netlink import DcbConfig

_OS_ERROR = re.compile(r"\(E[A-Z0-9]+\)")


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
