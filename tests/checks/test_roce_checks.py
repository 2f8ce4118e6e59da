"""The RoCE checks (ROCE001, ROCE004, ROCE005, ROCE006) on hand-built facts, and end to end on
the recorded roots in tests/fixtures/nodes."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest
from msgspec.structs import replace

from conftest import EXAMPLE_ROOT, Runner
from preflight.nccl.gid import GidSettings, Slot, nccl_would_pick_gid, parse_gid, parse_gid_settings
from preflight.probes.job import JobFacts, NcclConfFile, parse_environ
from preflight.probes.nccl_libs import NcclCopy, NcclLibFacts
from preflight.probes.roce import DcbReading, EcnState, GidEntry, NcclGid, RoceDcbFacts, RoceFacts, RocePort, roce_mtu
from preflight.checks.roce import roce_gid_index_mismatch, roce_gid_type_read_einval, roce_path_mtu_mismatch, roce_pfc_pause_storm
from preflight.config import ConfigError, Expectations, parse_config
from preflight.model import NotApplicable, Observation, Severity, Status
from preflight.sources.ethtool import PauseState
from preflight.sources.netlink import DcbConfig

NODES = Path(__file__).resolve().parents[1] / "fixtures" / "nodes"
V1, V2 = "IB/RoCE v1", "RoCE v2"
LINK_LOCAL = "fe80:0000:0000:0000:ba59:9fff:fe3c:10a2"
DSCP_MAP = tuple((dscp, dscp >> 3) for dscp in range(64))


def ipv4(last: int) -> str:
    return f"0000:0000:0000:0000:0000:ffff:0a0a:{last:04x}"


def host_gids(ndev: str = "ens1f0np0", last: int = 0x11) -> list[GidEntry]:
    address = f"10.10.0.{last}"
    return [
        GidEntry(0, LINK_LOCAL, V1, "", ndev, None), GidEntry(1, LINK_LOCAL, V2, "", ndev, None),
        GidEntry(2, ipv4(last), V1, "", ndev, address), GidEntry(3, ipv4(last), V2, "", ndev, address),
    ]


def choice(entries: Iterable[GidEntry], settings: GidSettings, size: int = 16) -> NcclGid:
    slots = {}
    for entry in entries:
        raw = parse_gid(entry.gid)
        assert raw is not None
        slots[entry.index] = Slot(raw, entry.roce_type, entry.type_error)
    picked = nccl_would_pick_gid(slots, size, settings)
    return NcclGid(settings, picked.index, picked.forced, picked.einval_reads, picked.failed_read, picked.error)


def port(
    device: str = "mlx5_0",
    entries: list[GidEntry] | None = None,
    variables: dict[str, str] | None = None,
    mtu: int | None = 9000,
    state: str | None = "4: ACTIVE",
    netdev: str | None = "ens1f0np0",
    ecn: EcnState = EcnState((3,), (3,), ""),
    unreadable: tuple[str, ...] = (),
) -> RocePort:
    gids = host_gids(netdev or "ens1f0np0") if entries is None else entries
    settings = parse_gid_settings(variables or {})
    return RocePort(
        device=device, port=1, state=state, table_size=16, gids=tuple(gids), unreadable_gids=unreadable,
        nccl_job=None if unreadable else choice(gids, settings), nccl_default=None if unreadable else choice(gids, GidSettings()),
        netdev=netdev, netdev_source="", mtu=mtu, mtu_error="" if mtu else "/sys/class/net/ens1f0np0/mtu: invalid argument (EINVAL)",
        roce_mtu=roce_mtu(mtu) if mtu else None, trust=None, ecn=ecn,
    )


def facts(*ports: RocePort, variables: dict[str, str] | None = None, unreadable: tuple[tuple[str, str], ...] = ()) -> RoceFacts:
    return RoceFacts(tuple(ports), unreadable, tuple((name, value, "environment") for name, value in (variables or {}).items()))


def job(**environ: str) -> JobFacts:
    return JobFacts(dict(environ), "", ())


def roce005(roce: RoceFacts, where: JobFacts, expect: Expectations | None = None) -> Iterator[Observation]:
    """ROCE005 with the site's expectations (none unless given)."""
    return roce_gid_index_mismatch(roce, where, expect or Expectations())


def installed(*versions: str | None, problems: tuple[str, ...] = ()) -> NcclLibFacts:
    """NCCL copies of these releases (None: a file whose release is not named)."""
    return NcclLibFacts(tuple(NcclCopy(f"/usr/lib/x86_64-linux-gnu/libnccl.so.{i}", v, "system") for i, v in enumerate(versions)), problems)


NCCL_2_23 = installed("2.23.4")  # aborts on a GID type read that answers EINVAL


def roce004(roce: RoceFacts, where: JobFacts, expect: Expectations | None = None, libs: NcclLibFacts = NCCL_2_23) -> Iterator[Observation]:
    """ROCE004 with the site's expectations (none unless given) and NCCL 2.23 unless told."""
    return roce_gid_type_read_einval(roce, where, libs, expect or Expectations())


def observe(observations: Iterator[Observation]) -> list[tuple[str, Status, Severity | None]]:
    return [(o.subject, o.status, o.severity) for o in observations]


# -- ROCE005 ------------------------------------------------------------------------------------
def test_gid_index_absent_on_a_healthy_port() -> None:
    assert observe(roce005(facts(port()), job())) == []
    gid_index = {"NCCL_IB_GID_INDEX": "3"}
    assert observe(roce005(facts(port(variables=gid_index), variables=gid_index), job(**gid_index))) == []


@pytest.mark.parametrize(("value", "observed"), [("1", "link-local"), ("2", V1), ("9", "empty slot"), ("300", "beyond the table")])
def test_fixed_gid_index_that_is_wrong(value: str, observed: str) -> None:
    variables = {"NCCL_IB_GID_INDEX": value}
    (finding,) = list(roce005(facts(port(variables=variables), variables=variables), job(**variables)))
    assert finding.subject == "mlx5_0/1" and finding.status is Status.PRESENT
    assert finding.evidence[0].source == "environment NCCL_IB_GID_INDEX" and observed in finding.evidence[1].observed
    assert "index 3 (10.10.0.17)" in finding.evidence[1].expected


def test_port_without_an_ipv4_address_falls_back_to_link_local() -> None:
    only_link_local = host_gids()[:2]
    (finding,) = list(roce005(facts(port(entries=only_link_local)), job()))
    assert "index 0" in finding.evidence[0].observed and "no IPv4 RoCE v2 GID" in finding.evidence[0].expected


@pytest.mark.parametrize("variables", [{"NCCL_IB_ROCE_VERSION_NUM": "1"}, {"NCCL_IB_ADDR_RANGE": "192.168.0.0/16"}])
def test_selection_variables_that_lead_away_from_roce_v2(variables: dict[str, str]) -> None:
    (finding,) = list(roce005(facts(port(variables=variables), variables=variables), job(**variables)))
    assert finding.evidence[0].source.endswith(next(iter(variables)))


def test_fixed_index_that_means_different_things_on_different_ports() -> None:
    variables = {"NCCL_IB_GID_INDEX": "3"}
    ipv6 = [*host_gids("ens2f0np0")[:3], GidEntry(3, "fd00:0000:0000:0004:e4ea:71ff:feb9:4970", V2, "", "ens2f0np0", None)]
    roce = facts(port(variables=variables), port("mlx5_1", ipv6, variables, netdev="ens2f0np0"), variables=variables)
    findings = list(roce005(roce, job(**variables)))
    assert [f.subject for f in findings] == ["NCCL_IB_GID_INDEX"]
    assert "IPv4 on mlx5_0/1" in findings[0].evidence[-1].observed and "IPv6 on mlx5_1/1" in findings[0].evidence[-1].observed


IN_JOB = job(SLURM_JOB_ID="42")  # a job's own process: no NCCL_IB_HCA means every active port
PROLOG = job(SLURM_JOB_ID="42", SLURM_SCRIPT_CONTEXT="prolog_slurmd")  # the jobs' NCCL_IB_HCA unseen
RAILS = Expectations(hcas=("mlx5_0", "mlx5_1"))


def spare(entries: list[GidEntry]) -> RoceFacts:
    """Two healthy rails beside a cabled spare or storage port mlx5_2 (MTU 1500, no PFC)."""
    return facts(port(), port("mlx5_1", netdev="ens2f0np0"), port("mlx5_2", entries, mtu=1500, netdev="eno1np0"))


@pytest.mark.parametrize(
    ("where", "expect", "severity"),
    [(PROLOG, Expectations(), Severity.WARNING), (PROLOG, RAILS, "absent"), (IN_JOB, Expectations(), None), (IN_JOB, RAILS, "absent"),
     (job(NCCL_IB_HCA="mlx5"), RAILS, None)],  # NCCL_IB_HCA, where set, is what NCCL opens whatever the site lists
)
def test_a_spare_port_counts_only_where_jobs_may_use_it(where: JobFacts, expect: Expectations, severity: Severity | str | None) -> None:
    """A port without an IPv4 address (link-local GIDs only) beside the rails is NCCL's only for jobs
    that set no NCCL_IB_HCA: not judged where the site names its rails, a warning where a prolog
    cannot see the job's choice, an error in the job's own process."""
    no_address = host_gids("eno1np0")[:2]
    einval = [*host_gids("eno1np0")[:3], GidEntry(3, ipv4(0x12), None, "invalid argument (EINVAL)", "eno1np0", "10.10.2.18")]
    for check, entries in ((roce005, no_address), (roce004, einval)):
        found = observe(check(spare(entries), where, expect))
        assert found == ([] if severity == "absent" else [("mlx5_2/1", Status.PRESENT, severity)]), check.__name__
    if severity is Severity.WARNING:
        fix = next(roce005(spare(no_address), where, expect)).fix
        assert fix.startswith("If this port is a rail, give its netdev a routable IPv4 address") and "name the rails in NCCL_IB_HCA" in fix


def ipv6_gids(ndev: str, host: int) -> list[GidEntry]:
    """A port addressed in IPv6 only: link-local GIDs, then the global address's v1 and v2 GIDs."""
    address = f"2001:0db8:0000:0010:0000:0000:0000:{host:04x}"
    return [*host_gids(ndev)[:2], GidEntry(2, address, V1, "", ndev, None), GidEntry(3, address, V2, "", ndev, None)]


RAILS_LISTED = JobFacts({"SLURM_SCRIPT_CONTEXT": "prolog_slurmd"}, "", (NcclConfFile("/etc/nccl.conf", (("NCCL_IB_HCA", "=mlx5_0,mlx5_1"),)),))


def test_an_ipv6_only_fabric_seen_from_a_prolog_is_a_warning() -> None:
    """NCCL takes IPv4 GIDs unless NCCL_IB_ADDR_FAMILY=AF_INET6: on a fabric addressed in IPv6
    only, the jobs set it themselves, which a prolog cannot see; in the job's own process it is
    seen, and a rail without IPv4 beside rails with it has lost its address."""
    v6 = facts(port(entries=ipv6_gids("ens1f0np0", 0x17)), port("mlx5_1", ipv6_gids("ens2f0np0", 0x18), netdev="ens2f0np0"))
    found = list(roce005(v6, RAILS_LISTED))
    assert [(o.subject, o.severity) for o in found] == [("mlx5_0/1", Severity.WARNING), ("mlx5_1/1", Severity.WARNING)]
    assert "NCCL_IB_ADDR_FAMILY=AF_INET6" in found[0].fix and "/etc/nccl.conf" in found[0].fix
    assert "index 3 (2001:0db8:0000:0010:0000:0000:0000:0017, taken with NCCL_IB_ADDR_FAMILY=AF_INET6)" in found[0].evidence[-1].expected
    assert [o.severity for o in roce005(v6, IN_JOB)] == [None, None]
    lost = facts(port(), port("mlx5_1", ipv6_gids("ens2f0np0", 0x18), netdev="ens2f0np0"))
    assert observe(roce005(lost, RAILS_LISTED)) == [("mlx5_1/1", Status.PRESENT, None)]
    family = {"NCCL_IB_ADDR_FAMILY": "AF_INET6"}
    v6_set = facts(*(replace(p, nccl_job=choice(p.gids, parse_gid_settings(family))) for p in v6.ports), variables=family)
    assert observe(roce005(v6_set, RAILS_LISTED)) == []


@pytest.mark.parametrize("role", ["vf", "pf"])
def test_sriov_functions_without_an_address_are_not_rails_where_the_jobs_ports_are_unseen(role: str) -> None:
    """On a Kubernetes host with the SR-IOV network operator, a free VF gets its address in the pod
    it is handed to and a PF with VFs is their parent: without a routable GID neither is a rail.
    Named by a job's NCCL_IB_HCA, or in the job's own process, the port is judged as any other."""
    sriov = replace(port("mlx5_2", host_gids("enp26s0f0v2")[:2], netdev="enp26s0f0v2"), sriov=role)
    roce = facts(port(), port("mlx5_1", netdev="ens2f0np0"), sriov)
    assert observe(roce005(roce, PROLOG)) == []
    assert observe(roce005(roce, IN_JOB)) == [("mlx5_2/1", Status.PRESENT, None)]
    assert observe(roce005(roce, job(NCCL_IB_HCA="=mlx5_2"))) == [("mlx5_2/1", Status.PRESENT, None)]


def test_the_probe_tells_sriov_functions_apart(tmp_path: Path) -> None:
    from preflight.probes.roce import _sriov_role
    from preflight.sources import NodeFS

    devices = tmp_path / "sys/class/infiniband"
    for name, files in {"mlx5_0": {"sriov_numvfs": "8\n"}, "mlx5_9": {}, "mlx5_1": {"sriov_numvfs": "0\n"}}.items():
        (devices / name / "device").mkdir(parents=True)
        for file, text in files.items():
            (devices / name / "device" / file).write_text(text)
    (devices / "mlx5_9/device/physfn").symlink_to("../0000:1a:00.0")
    fs = NodeFS(str(tmp_path))
    assert [_sriov_role(fs, name) for name in ("mlx5_0", "mlx5_9", "mlx5_1", "mlx5_7")] == ["pf", "vf", "", ""]


IB_OFF = [job(NCCL_IB_DISABLE="1"), JobFacts({}, "", (NcclConfFile("/etc/nccl.conf", (("NCCL_NET", "Socket"),)),))]


@pytest.mark.parametrize("where", IB_OFF)
def test_nothing_to_judge_where_nccls_ib_transport_is_off(where: JobFacts) -> None:
    """NCCL_IB_DISABLE=1 or NCCL_NET naming another network: NCCL opens no RDMA port, so a port
    without an IPv4 address or MTU 1500 beside the rails (storage, say) is not NCCL's business."""
    roce = spare(host_gids("eno1np0")[:2])
    readings = dcb(("ens1f0np0", (3,), DSCP_MAP), ("ens2f0np0", (3,), DSCP_MAP), ("eno1np0", (), ()))
    for verdict in (
        lambda: roce005(roce, where), lambda: roce004(roce, where), lambda: roce_path_mtu_mismatch(roce, where, Expectations()),
        lambda: roce_pfc_pause_storm(roce, readings, where, Expectations()),
    ):
        with pytest.raises(NotApplicable, match="NCCL_IB_DISABLE=1|NCCL_NET=Socket"):
            list(verdict())
    # NVSHMEM picks its HCAs and GID itself: its fixed index is still judged.
    nvshmem = observe(roce005(roce, JobFacts({**where.environ, "NVSHMEM_IB_GID_INDEX": "0"}, "", where.nccl_conf_files)))
    assert nvshmem == [(f"NVSHMEM_IB_GID_INDEX on mlx5_{i}/1", Status.PRESENT, Severity.WARNING) for i in range(3)]


@pytest.mark.parametrize("name", ["NVSHMEM_IB_GID_INDEX", "MC_GID_INDEX", "MSCCLPP_IB_GID_INDEX", "UCCL_IB_GID_INDEX", "UCCL_P2P_RDMA_GID_INDEX"])
def test_another_librarys_fixed_gid_index_on_a_link_local_slot_is_a_warning(name: str) -> None:
    # NCCL picks index 3 by itself; the other library is told to use 0, the link-local RoCE v1 slot.
    findings = list(roce005(facts(port(), port("mlx5_1", state="1: DOWN")), job(**{name: "0"})))
    assert observe(iter(findings)) == [(f"{name} on mlx5_0/1", Status.PRESENT, Severity.WARNING)]
    assert findings[0].evidence[0].source == f"environment {name}" and "link-local" in findings[0].evidence[1].observed
    assert "index 9: empty slot" in next(roce005(facts(port()), job(**{name: "9"}))).evidence[1].observed
    for healthy in ("3", "-1", "auto", ""):
        assert observe(roce005(facts(port()), job(**{name: healthy}))) == []
    # A slot whose type file could not be read is not a wrong GID: undecided, never present.
    unread = [*host_gids()[:3], GidEntry(3, ipv4(0x11), None, "permission denied (EACCES)", "ens1f0np0", "10.10.0.17")]
    roce = facts(port(entries=unread, variables={"NCCL_IB_GID_INDEX": "2"}), variables={"NCCL_IB_GID_INDEX": "2"})
    statuses = observe(roce005(roce, job(NCCL_IB_GID_INDEX="2", **{name: "3"})))
    assert (f"{name} on mlx5_0/1", Status.UNKNOWN, None) in statuses


def test_mooncake_ignores_a_gid_index_above_255() -> None:
    assert observe(roce005(facts(port()), job(MC_GID_INDEX="300"))) == []
    (finding,) = list(roce005(facts(port()), job(NVSHMEM_IB_GID_INDEX="300")))
    assert "beyond the table (16 slots)" in finding.evidence[1].observed


def test_another_librarys_gid_index_is_judged_when_nccl_ib_hca_leaves_nccl_no_roce_port() -> None:
    # NCCL is steered to an InfiniBand HCA; NVSHMEM still opens the RoCE port with its own index.
    (finding,) = list(roce005(facts(port()), job(NCCL_IB_HCA="=mlx5_4", NVSHMEM_IB_GID_INDEX="0")))
    assert (finding.subject, finding.status, finding.severity) == ("NVSHMEM_IB_GID_INDEX on mlx5_0/1", Status.PRESENT, Severity.WARNING)
    # A usable index there is a checked answer (absent), not "not applicable".
    assert observe(roce005(facts(port()), job(NCCL_IB_HCA="=mlx5_4", NVSHMEM_IB_GID_INDEX="3"))) == []
    # A table that could not be read, or a port state that could not be read, is never "absent".
    unreadable = port(unreadable=("/sys/class/infiniband/mlx5_0/ports/1/gids/0: permission denied (EACCES)",))
    assert observe(roce005(facts(unreadable), job(NCCL_IB_HCA="=mlx5_4", NVSHMEM_IB_GID_INDEX="0"))) == [
        ("NVSHMEM_IB_GID_INDEX on mlx5_0/1", Status.UNKNOWN, None)
    ]
    (unread_state,) = list(roce005(facts(UNREAD_STATE), job(NCCL_IB_HCA="=mlx5_4", NVSHMEM_IB_GID_INDEX="0")))
    assert (unread_state.subject, unread_state.status, unread_state.reason) == ("NVSHMEM_IB_GID_INDEX on mlx5_0/1", Status.UNKNOWN, STATE_ERROR)
    # No active RoCE port at all: nothing for any library to use.
    with pytest.raises(NotApplicable, match="NCCL_IB_HCA"):
        list(roce005(facts(port(state="1: DOWN")), job(NVSHMEM_IB_GID_INDEX="0")))


STATE_ERROR = "/sys/class/infiniband/mlx5_0/ports/1/state: not UTF-8 text (binary or garbled content)"
UNREAD_STATE = replace(port(state=None), state_error=STATE_ERROR)


def test_a_port_whose_state_is_unread_is_undecided_unless_its_gid_is_usable() -> None:
    """A port without an IPv4 address is most likely the down one NCCL skips: with its state
    unread, its link-local GID is no verdict; a usable GID is a checked answer all the same."""
    no_address = replace(UNREAD_STATE, gids=tuple(host_gids()[:2]), nccl_job=choice(host_gids()[:2], GidSettings()))
    for check in (roce005, roce004):
        assert observe(check(facts(UNREAD_STATE), IN_JOB)) == []
    assert [(o.subject, o.status, o.reason) for o in roce005(facts(no_address), IN_JOB)] == [("mlx5_0/1", Status.UNKNOWN, STATE_ERROR)]
    hidden = replace(UNREAD_STATE, gids=tuple(HIDDEN_TYPE), nccl_job=choice(HIDDEN_TYPE, GidSettings()))
    assert [(o.subject, o.status, o.reason) for o in roce004(facts(hidden), IN_JOB)] == [("mlx5_0/1", Status.UNKNOWN, STATE_ERROR)]


def test_the_job_environment_keeps_other_libraries_gid_variables() -> None:
    environ = parse_environ(
        b"MC_GID_INDEX=0\0MSCCLPP_IB_GID_INDEX=1\0NVSHMEM_IB_GID_INDEX=2\0UCCL_IB_GID_INDEX=3\0UCCL_P2P_RDMA_GID_INDEX=4\0HOSTNAME=n1\0"
    )
    assert environ == {
        "MC_GID_INDEX": "0", "MSCCLPP_IB_GID_INDEX": "1", "NVSHMEM_IB_GID_INDEX": "2", "UCCL_IB_GID_INDEX": "3", "UCCL_P2P_RDMA_GID_INDEX": "4",
    }


def test_gid_index_unknown_and_not_applicable() -> None:
    broken = port(unreadable=("/sys/class/infiniband/mlx5_0/ports/1/gids/3: not UTF-8 text",))
    assert observe(roce005(facts(broken), job())) == [("mlx5_0/1", Status.UNKNOWN, None)]
    unreadable = facts(unreadable=(("mlx5_0/1", "link_layer: invalid argument (EINVAL)"),))
    assert observe(roce005(unreadable, job())) == [("mlx5_0/1", Status.UNKNOWN, None)]
    with pytest.raises(NotApplicable, match="link_layer Ethernet"):
        list(roce005(facts(), job()))
    with pytest.raises(NotApplicable, match="NCCL_IB_HCA"):
        list(roce005(facts(port(state="1: DOWN")), job()))
    bad = {"NCCL_IB_GID_INDEX": "9"}
    with pytest.raises(NotApplicable):  # the job only uses mlx5_1, so mlx5_0's table does not matter
        list(roce005(facts(port(variables=bad), variables=bad), job(NCCL_IB_HCA="=mlx5_1", **bad)))


# -- ROCE004 ------------------------------------------------------------------------------------
def pod_gids() -> list[GidEntry]:
    return [
        GidEntry(4, ipv4(0x401), V1, "", "net1", "10.10.4.1"), GidEntry(5, ipv4(0x401), V2, "", "net1", "10.10.4.1"),
        GidEntry(6, LINK_LOCAL, V1, "", "net1", None), GidEntry(7, LINK_LOCAL, V2, "", "net1", None),
    ]


def test_gid_type_read_absent_on_a_host_table_or_a_fixed_index() -> None:
    assert observe(roce004(facts(port()), job())) == []
    fixed = {"NCCL_IB_GID_INDEX": "5"}
    assert observe(roce004(facts(port(entries=pod_gids(), variables=fixed), variables=fixed), job(**fixed))) == []


def test_pod_table_with_leading_holes_is_a_warning() -> None:
    (finding,) = list(roce004(facts(port(entries=pod_gids(), netdev="net1")), job()))
    assert finding.severity is Severity.WARNING
    assert "slots 0-3 empty" in finding.evidence[0].observed and "NCCL_IB_GID_INDEX=5" in finding.evidence[0].expected


def test_scan_that_reads_einval_is_an_error() -> None:
    hidden = [*host_gids()[:3], GidEntry(3, ipv4(0x11), None, "invalid argument (EINVAL)", "ens1f0np0", "10.10.0.17")]
    (finding,) = list(roce004(facts(port(entries=hidden)), IN_JOB))
    assert finding.severity is None and "types/3: invalid argument (EINVAL)" in finding.evidence[0].observed
    # NCCL_IB_ADDR_FAMILY=AF_INET6 in a pod reads the type of empty slot 0.
    variables = {"NCCL_IB_ADDR_FAMILY": "AF_INET6"}
    ipv6 = [*pod_gids(), GidEntry(8, "fd00:0000:0000:0004:e4ea:71ff:feb9:4970", V1, "", "net1", None),
            GidEntry(9, "fd00:0000:0000:0004:e4ea:71ff:feb9:4970", V2, "", "net1", None)]
    (finding,) = list(roce004(facts(port(entries=ipv6, variables=variables), variables=variables), job(**variables)))
    assert "types/0" in finding.evidence[-2].observed and finding.evidence[-1].observed == "2.23.4 (/usr/lib/x86_64-linux-gnu/libnccl.so.0)"


HIDDEN_TYPE = [*host_gids()[:3], GidEntry(3, ipv4(0x11), None, "invalid argument (EINVAL)", "ens1f0np0", "10.10.0.17")]


@pytest.mark.parametrize(
    ("libs", "shown"),
    [(installed("2.27.3", "2.23.4"), "2.23.4 (/usr/lib/x86_64-linux-gnu/libnccl.so.1)"),
     (installed("2.27.3", None), "release not named (/usr/lib/x86_64-linux-gnu/libnccl.so.1)"),
     (installed("2.21.5"), "2.21.5 (/usr/lib/x86_64-linux-gnu/libnccl.so.0)"), (installed("2.25.1"), "2.25.1 (/usr/lib/x86_64-linux-gnu/libnccl.so.0)")],
)
def test_einval_and_pod_tables_are_judged_where_an_nccl_that_aborts_is_installed(libs: NcclLibFacts, shown: str) -> None:
    for table, severity in ((HIDDEN_TYPE, None), (pod_gids(), Severity.WARNING)):
        (finding,) = roce004(facts(port(entries=table, netdev="net1")), IN_JOB, libs=libs)
        assert (finding.status, finding.severity, finding.evidence[-1].observed) == (Status.PRESENT, severity, shown)


@pytest.mark.parametrize(
    ("libs", "reason"),
    [(installed("2.27.3"), "2.26 or newer"), (installed("2.20.5", "2.26.2"), "older than 2.21"), (installed(), "no libnccl")],
)
def test_einval_and_pod_tables_do_not_matter_to_the_nccl_installed_here(libs: NcclLibFacts, reason: str) -> None:
    """NCCL 2.26 skips a slot whose type read answers EINVAL; NCCL 2.20 does not scan at all."""
    for table in (HIDDEN_TYPE, pod_gids()):
        with pytest.raises(NotApplicable, match=reason):
            list(roce004(facts(port(entries=table, netdev="net1")), IN_JOB, libs=libs))
    # A type file that fails otherwise (ENOENT) fails every NCCL that scans, 2.26 included.
    missing = [*host_gids()[:3], GidEntry(3, ipv4(0x11), None, "no such file or directory (ENOENT)", "ens1f0np0", "10.10.0.17")]
    assert observe(roce004(facts(port(entries=missing)), IN_JOB, libs=libs)) == [("mlx5_0/1", Status.PRESENT, None)]
    # Where no library directory could be read, whether an NCCL that aborts is here is unknown.
    unread = installed(problems=("/opt/nccl/lib: permission denied (EACCES)",))
    [unknown] = roce004(facts(port(entries=HIDDEN_TYPE)), IN_JOB, libs=unread)
    assert unknown.status is Status.UNKNOWN and "EACCES" in unknown.reason


def test_missing_type_file_and_unreadable_one() -> None:
    missing = [*host_gids()[:3], GidEntry(3, ipv4(0x11), None, "no such file or directory (ENOENT)", "ens1f0np0", "10.10.0.17")]
    (finding,) = list(roce004(facts(port(entries=missing)), job()))
    assert finding.status is Status.PRESENT and finding.evidence[0].source.endswith("gid_attrs/types/3")
    garbled = [*host_gids()[:3], GidEntry(3, ipv4(0x11), None, "not UTF-8 text (binary or garbled content)", "ens1f0np0", "10.10.0.17")]
    assert observe(roce004(facts(port(entries=garbled)), job())) == [("mlx5_0/1", Status.UNKNOWN, None)]
    assert observe(roce005(facts(port(entries=garbled)), job())) == [("mlx5_0/1", Status.UNKNOWN, None)]


# -- ROCE006 ------------------------------------------------------------------------------------
def test_mtu_absent_when_rails_agree() -> None:
    assert observe(roce_path_mtu_mismatch(facts(port(), port("mlx5_1", netdev="ens2f0np0")), job(), Expectations())) == []
    assert observe(roce_path_mtu_mismatch(facts(port(mtu=4096)), job(), Expectations(mtu=4096))) == []


def test_mtu_against_the_site_and_the_4096_trap() -> None:
    (finding,) = list(roce_path_mtu_mismatch(facts(port()), job(), Expectations(mtu=4200)))
    assert finding.evidence[0].observed == "ens1f0np0 MTU 9000 -> RoCE MTU 4096" and "4200" in finding.evidence[0].expected
    (trap,) = list(roce_path_mtu_mismatch(facts(port(mtu=4096)), job(), Expectations()))
    assert trap.severity is Severity.WARNING and "RoCE MTU 2048" in trap.evidence[0].observed


def test_rails_with_different_roce_mtus() -> None:
    roce = facts(port(mtu=1500), port("mlx5_1", netdev="ens2f0np0"))
    findings = list(roce_path_mtu_mismatch(roce, job(), Expectations()))
    assert [f.subject for f in findings] == ["RoCE rails"]
    assert [e.observed for e in findings[0].evidence] == [
        "mlx5_0/1 on ens1f0np0: MTU 1500 -> RoCE MTU 1024", "mlx5_1/1 on ens2f0np0: MTU 9000 -> RoCE MTU 4096",
    ]


def test_mtu_unknown() -> None:
    assert observe(roce_path_mtu_mismatch(facts(port(mtu=None)), job(), Expectations())) == [("mlx5_0/1", Status.UNKNOWN, None)]


# -- ROCE001 ------------------------------------------------------------------------------------
def mlx5_pause(name: str, warnings: int = 0, errors: int = 0, timeout_ms: int | None = 8000) -> PauseState:
    counters = (("rx_prio3_pause", 1841), ("tx_prio3_pause", 312), ("tx_pause_storm_warning_events", warnings), ("tx_pause_storm_error_events", errors))
    return PauseState(name, counters, timeout_ms)


def dcb(
    *readings: tuple[str, tuple[int, ...] | None, tuple[tuple[int, int], ...]], error: str = "", pause: dict[str, PauseState | str] | None = None
) -> RoceDcbFacts:
    """DCB readings; each interface's pause state is a healthy mlx5 one unless ``pause`` gives a
    state or the reason it could not be read."""
    ports = {"ens1f0np0": ("mlx5_0/1",), "ens2f0np0": ("mlx5_1/1",), "eno1np0": ("mlx5_2/1",)}
    chosen = {name: (pause or {}).get(name, mlx5_pause(name)) for name, _, _ in readings}
    return RoceDcbFacts(tuple(
        DcbReading(
            name, ports[name], DcbConfig(name, 8, pfc, dscp_map, 9) if pfc is not None else None, error,
            *((chosen[name], "") if isinstance(chosen[name], PauseState) else (None, str(chosen[name]))),
        )
        for name, pfc, dscp_map in readings
    ))


TWO_RAILS = facts(port(), port("mlx5_1", netdev="ens2f0np0"))


def test_pfc_absent_on_a_lossless_setup() -> None:
    healthy = dcb(("ens1f0np0", (3,), DSCP_MAP), ("ens2f0np0", (3,), DSCP_MAP))
    assert observe(roce_pfc_pause_storm(TWO_RAILS, healthy, job(NCCL_IB_TC="106"), Expectations(lossless_priority=3))) == []
    lossy = dcb(("ens1f0np0", (), DSCP_MAP), ("ens2f0np0", (), DSCP_MAP))
    assert observe(roce_pfc_pause_storm(TWO_RAILS, lossy, job(NCCL_IB_TC="106"), Expectations())) == []  # lossy RoCE by design


def test_pfc_off_where_the_site_expects_it() -> None:
    readings = dcb(("ens1f0np0", (), DSCP_MAP), ("ens2f0np0", (3, 4), DSCP_MAP))
    findings = observe(roce_pfc_pause_storm(TWO_RAILS, readings, job(SLURM_JOB_ID="42"), Expectations(lossless_priority=3)))
    assert findings == [
        ("ens1f0np0", Status.PRESENT, None), ("ens2f0np0", Status.PRESENT, Severity.WARNING), ("RoCE rails", Status.PRESENT, None),
    ]


FRONT_END = port("mlx5_2", mtu=1500, netdev="eno1np0")


@pytest.mark.parametrize(
    ("where", "expect", "severity"),
    [
        (job(), Expectations(), Severity.WARNING),  # a prolog, health check or shell: the jobs' NCCL_IB_HCA unseen
        (job(SLURM_JOB_ID="42"), Expectations(), None),  # a job's own process: no NCCL_IB_HCA means every port
        (JobFacts({}, "", (NcclConfFile("/etc/nccl.conf", (("NCCL_IB_HCA", "mlx5"),)),)), Expectations(), None),
    ],
)
def test_rails_that_disagree_while_the_jobs_choice_of_ports_is_unseen(where: JobFacts, expect: Expectations, severity: Severity | None) -> None:
    """A front-end NIC beside the rails (MTU 1500, no PFC) is a rail only for jobs that set no
    NCCL_IB_HCA; where that choice cannot be seen, the disagreement is a warning saying how to
    name the rails."""
    roce = facts(port(), port("mlx5_1", netdev="ens2f0np0"), FRONT_END)
    [mtu] = roce_path_mtu_mismatch(roce, where, expect)
    assert (mtu.subject, mtu.severity) == ("RoCE rails", severity) and ("NCCL_IB_HCA in /etc/nccl.conf" in mtu.fix) == (severity is not None)
    readings = dcb(("ens1f0np0", (3,), DSCP_MAP), ("ens2f0np0", (3,), DSCP_MAP), ("eno1np0", (), ()))
    [pfc] = roce_pfc_pause_storm(roce, readings, where, expect)
    assert (pfc.subject, pfc.severity) == ("RoCE rails", severity)


def test_site_data_hcas_name_the_rails_when_nccl_ib_hca_is_unset() -> None:
    roce = facts(port(), port("mlx5_1", netdev="ens2f0np0"), FRONT_END)
    assert observe(roce_path_mtu_mismatch(roce, job(), Expectations(hcas=("mlx5_0", "mlx5_1")))) == []
    # NCCL_IB_HCA, where set, is what NCCL uses, whatever the site lists.
    [mtu] = roce_path_mtu_mismatch(roce, job(NCCL_IB_HCA="mlx5"), Expectations(hcas=("mlx5_0", "mlx5_1")))
    assert (mtu.subject, mtu.severity) == ("RoCE rails", None)


def test_nccl_ib_tc_that_maps_to_a_lossy_priority() -> None:
    readings = dcb(("ens1f0np0", (3,), DSCP_MAP), ("ens2f0np0", (3,), DSCP_MAP))
    (finding, _) = list(roce_pfc_pause_storm(TWO_RAILS, readings, job(NCCL_IB_TC="160"), Expectations()))
    assert finding.evidence[0].observed == "160 (DSCP 40) -> priority 5 (trust dscp)"
    pcp = dcb(("ens1f0np0", (3,), ()), ("ens2f0np0", (3,), ()))  # trust pcp: DSCP does not pick the priority
    assert observe(roce_pfc_pause_storm(TWO_RAILS, pcp, job(NCCL_IB_TC="160"), Expectations())) == []
    # MLNX_OFED's qos/trust says dscp, but DCB netlink gives no map (an old kernel and MLNX_OFED):
    # where the DSCP lands is the firmware's, not priority 0.
    trusting = facts(replace(port(), trust="dscp"), replace(port("mlx5_1", netdev="ens2f0np0"), trust="dscp"))
    found = list(roce_pfc_pause_storm(trusting, pcp, job(NCCL_IB_TC="106"), Expectations()))
    assert [f.status for f in found] == [Status.UNKNOWN, Status.UNKNOWN] and "no DSCP-to-priority map" in found[0].reason


def test_ecn_off_on_the_lossless_priority() -> None:
    roce = facts(port(ecn=EcnState((), (3,), "")))
    (finding,) = list(roce_pfc_pause_storm(roce, dcb(("ens1f0np0", (3,), DSCP_MAP)), job(), Expectations(lossless_priority=3)))
    assert finding.severity is Severity.WARNING and finding.evidence[0].source == "/sys/class/net/ens1f0np0/ecn/{roce_np}/enable/3"


def test_pfc_unknown_where_dcb_is_not_exposed() -> None:
    readings = dcb(("ens1f0np0", None, ()), error="RTM_GETDCB ens1f0np0: operation not supported (EOPNOTSUPP)")
    assert observe(roce_pfc_pause_storm(facts(port()), readings, job(), Expectations())) == [("ens1f0np0", Status.UNKNOWN, None)]
    broken_ecn = facts(port(ecn=EcnState(None, None, "/sys/class/net/ens1f0np0/ecn/roce_np/enable/3: invalid argument (EINVAL)")))
    healthy = dcb(("ens1f0np0", (3,), DSCP_MAP))
    assert observe(roce_pfc_pause_storm(broken_ecn, healthy, job(), Expectations(lossless_priority=3))) == [("ens1f0np0", Status.UNKNOWN, None)]


def test_pfc_of_a_virtual_function_is_its_hosts(tmp_path: Path) -> None:
    """mlx5 offers DCB netlink only on the physical function: a VF (in a pod, device/physfn) or a
    cloud VM's NIC (Azure's accelerated networking, Google's A3 Ultra) answers EOPNOTSUPP, and
    the host that owns the port sets its PFC: nothing for this node to fix. A bare-metal PF that
    answers so stays unknown."""
    from msgspec.structs import replace as replaced

    from preflight.probes.roce import _pfc_owner
    from preflight.sources import NodeFS

    (tmp_path / "sys/class/net/net1/device/physfn").mkdir(parents=True)
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc/cpuinfo").write_text("processor\t: 0\nflags\t\t: fpu sse2\n")
    assert "virtual function" in _pfc_owner(NodeFS(str(tmp_path)), "net1")
    assert _pfc_owner(NodeFS(str(tmp_path)), "ens1f0np0") == ""  # a PF on bare metal
    (tmp_path / "proc/cpuinfo").write_text("processor\t: 0\nflags\t\t: fpu sse2 hypervisor\n")
    assert "virtual machine's NIC" in _pfc_owner(NodeFS(str(tmp_path)), "ens1f0np0")
    readings = dcb(("ens1f0np0", None, ()), error="RTM_GETDCB ens1f0np0: operation not supported (EOPNOTSUPP)")
    guest = RoceDcbFacts(tuple(replaced(reading, host_owned="a VM's NIC") for reading in readings.readings))
    assert observe(roce_pfc_pause_storm(facts(port()), guest, job(), Expectations())) == []


def test_pause_storms_the_nic_recorded_since_the_driver_loaded() -> None:
    stormy = dcb(
        ("ens1f0np0", (3,), DSCP_MAP), ("ens2f0np0", (3,), DSCP_MAP),
        pause={"ens1f0np0": mlx5_pause("ens1f0np0", warnings=17, errors=3), "ens2f0np0": mlx5_pause("ens2f0np0", warnings=2)},
    )
    findings = list(roce_pfc_pause_storm(TWO_RAILS, stormy, job(), Expectations(lossless_priority=3)))
    assert [(f.subject, f.status, f.severity) for f in findings] == [
        ("ens1f0np0", Status.PRESENT, None), ("ens2f0np0", Status.PRESENT, Severity.WARNING),
    ]
    assert findings[0].evidence[0].observed == "tx_pause_storm_error_events 3, tx_pause_storm_warning_events 17"
    assert findings[0].evidence[0].source == "ethtool -S ens1f0np0 (SIOCETHTOOL)"


def test_stall_watchdog_off_matters_only_with_pfc_on() -> None:
    off = {"ens1f0np0": mlx5_pause("ens1f0np0", timeout_ms=0)}
    findings = list(roce_pfc_pause_storm(facts(port()), dcb(("ens1f0np0", (3,), DSCP_MAP), pause=off), job(), Expectations()))
    assert [(f.subject, f.severity, f.evidence[0].observed) for f in findings] == [("ens1f0np0", Severity.WARNING, "0 (stall watchdog off)")]
    assert observe(roce_pfc_pause_storm(facts(port()), dcb(("ens1f0np0", (), DSCP_MAP), pause=off), job(), Expectations())) == []


def test_nics_without_storm_counters_or_watchdog_are_not_judged_on_them() -> None:
    other_driver = {"ens1f0np0": PauseState("ens1f0np0", (("rx_pause_ctrl_phy", 4),), None)}
    assert observe(roce_pfc_pause_storm(facts(port()), dcb(("ens1f0np0", (3,), DSCP_MAP), pause=other_driver), job(), Expectations())) == []


def test_unreadable_pause_counters_are_unknown_not_absent() -> None:
    unreadable = {"ens1f0np0": "SIOCETHTOOL ens1f0np0: Operation not permitted"}
    findings = list(roce_pfc_pause_storm(facts(port()), dcb(("ens1f0np0", (3,), DSCP_MAP), pause=unreadable), job(), Expectations()))
    assert [(f.subject, f.status, f.reason) for f in findings] == [("ens1f0np0", Status.UNKNOWN, "SIOCETHTOOL ens1f0np0: Operation not permitted")]


def test_lossless_priority_in_the_config() -> None:
    assert parse_config("[expect]\nlossless_priority = 3\n", "p.toml", "gpu1").expect.lossless_priority == 3
    with pytest.raises(ConfigError, match="expect.lossless_priority"):
        parse_config("[expect]\nlossless_priority = 8\n", "p.toml", "gpu1")


# -- end to end on the recorded roots -----------------------------------------------------------
def run_roce(run_cli: Runner, root: Path, *extra: str) -> list[tuple[str, str, str, str]]:
    result = run_cli("node", "--root", str(root), "--select", "ROCE", "--format", "json", *extra)
    assert "Traceback" not in result.stderr, result.stderr
    return sorted((f["id"], f["status"], f["severity"], f["subject"]) for f in json.loads(result.stdout)["findings"])


def test_recorded_roots_end_to_end(run_cli: Runner, tmp_path: Path) -> None:
    # ROCE002: these roots record no PCI bus, so which devices are GPUs is not known
    assert run_roce(run_cli, NODES / "roce-v1v2") == [
        ("ROCE001", "absent", "critical", "node"), ("ROCE002", "unknown", "warning", "node"), ("ROCE003", "absent", "error", "node"), ("ROCE004", "absent", "error", "node"),
        ("ROCE005", "absent", "error", "node"), ("ROCE006", "absent", "error", "node"),
    ]
    assert run_roce(run_cli, NODES / "roce-macvlan-pod") == [
        # A pod records no kernel log: whether mlx5 failed to size a lossless buffer stays unknown.
        ("ROCE001", "unknown", "critical", "net1"), ("ROCE001", "unknown", "critical", "port buffers"), ("ROCE002", "unknown", "warning", "node"), ("ROCE003", "absent", "error", "node"), ("ROCE004", "absent", "error", "node"),
        ("ROCE005", "present", "error", "mlx5_0/1"), ("ROCE006", "absent", "error", "node"),
    ]
    mtu = [f for f in run_roce(run_cli, NODES / "roce-mtu4096") if f[0] == "ROCE006"]
    assert mtu == [("ROCE006", "present", "error", "RoCE rails"), ("ROCE006", "present", "warning", "mlx5_0/1")]
    config = tmp_path / "site.toml"
    config.write_text("[expect]\nlossless_priority = 3\n")
    pfc = [f for f in run_roce(run_cli, NODES / "roce-pfc-misconfigured", "--config", str(config)) if f[0] == "ROCE001"]
    assert pfc == [
        ("ROCE001", "present", "critical", "RoCE rails"), ("ROCE001", "present", "critical", "ens1f0np0"),
        ("ROCE001", "present", "critical", "ens2f0np0"), ("ROCE001", "present", "critical", "ens2f0np0"),
        ("ROCE001", "present", "warning", "ens2f0np0"),
    ]


def test_recorded_pause_storm_end_to_end(run_cli: Runner, tmp_path: Path) -> None:
    root = tmp_path / "node"
    shutil.copytree(NODES / "roce-v1v2", root, symlinks=True)
    recording = root / ".preflight/netlink.json"
    document = json.loads(recording.read_text())
    document["pause"]["ens2f0np0"]["counters"]["tx_pause_storm_error_events"] = 5
    recording.write_text(json.dumps(document))
    assert [f for f in run_roce(run_cli, root) if f[0] == "ROCE001"] == [("ROCE001", "present", "critical", "ens2f0np0")]
    del document["pause"]
    recording.write_text(json.dumps(document))
    assert [f for f in run_roce(run_cli, root) if f[0] == "ROCE001"] == [
        ("ROCE001", "unknown", "critical", "ens1f0np0"), ("ROCE001", "unknown", "critical", "ens2f0np0"),
    ]


def test_prolog_profile_leaves_dcb_alone(run_cli: Runner) -> None:
    statuses = run_roce(run_cli, NODES / "roce-v1v2", "--profile", "prolog")
    assert [f[0] for f in statuses] == ["ROCE002", "ROCE003", "ROCE004", "ROCE005", "ROCE006"]


def test_infiniband_example_node_is_not_applicable(run_cli: Runner) -> None:
    assert {status for _, status, _, _ in run_roce(run_cli, EXAMPLE_ROOT)} == {"not_applicable"}



def test_lossless_buffer_errors_in_the_kernel_log_are_present() -> None:
    from preflight.probes.kernel_log import KernelLogFacts

    log = KernelLogFacts((), (), ("buffer_size[3]=0 is not enough for lossless buffer",), "", True)
    readings = dcb(("ens1f0np0", (3,), DSCP_MAP))
    found = [o for o in roce_pfc_pause_storm(facts(port()), readings, job(), Expectations(lossless_priority=3), log) if o.subject == "port buffers"]
    assert len(found) == 1 and "is not enough for lossless buffer" in found[0].evidence[0].observed


def test_an_unread_kernel_log_leaves_the_lossless_buffer_history_undecided() -> None:
    from preflight.probes.kernel_log import KernelLogFacts

    log = KernelLogFacts((), (), (), "/dev/kmsg: permission denied", False)
    readings = dcb(("ens1f0np0", (3,), DSCP_MAP))
    found = [o for o in roce_pfc_pause_storm(facts(port()), readings, job(), Expectations(lossless_priority=3), log) if o.subject == "port buffers"]
    assert [(o.status, o.reason) for o in found] == [(Status.UNKNOWN, "lossless-buffer errors since boot unread: /dev/kmsg: permission denied")]
