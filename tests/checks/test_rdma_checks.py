"""RDMA checks on hand-built facts: present, absent, not_applicable and unknown for IB003, IB004,
IB005, IB007, IB008, IB009 and EFA001, and NCCL's NCCL_IB_HCA grammar on short strings."""

from __future__ import annotations

import stat
from pathlib import Path
from collections.abc import Iterable
from msgspec.structs import replace

import pytest

from preflight.probes.efa import EfaFacts, parse_ld_so_conf
from preflight.checks.efa import efa_provider_unavailable, plugin_names
from preflight.probes.gpudirect import DeviceNode, JobIdentity
from preflight.probes.job import JobFacts, NcclConfFile, Setting
from preflight.nccl.ib import HcaEntry, nccl_selection, parse_nccl_ib_hca
from preflight.checks.ib import accidental_prefix, ib_device_order_differs_across_nodes, ib_hca_selection_mismatch, ib_odd_nic_count_rail_hang
from preflight.probes.kernel_log import KernelLogFacts, parse_join_failures
from preflight.probes.nccl_libs import NcclCopy, NcclLibFacts
from preflight.probes.pkeys import PkeyFacts
from preflight.probes.rdma import PortRate, Problem, RdmaDevice, RdmaFacts, RdmaPort
from preflight.checks.ib import ib_subnet_manager_sweep_failure, rdma_device_nodes_missing, rdma_stack_or_ports_misconfigured
from preflight.config import Expectations
from preflight.model import NotApplicable, Observation, Severity, Status, Unknown, Unread

STATES = {1: "DOWN", 2: "INIT", 3: "ARMED", 4: "ACTIVE"}
PHYS = {2: "Polling", 3: "Disabled", 5: "LinkUp"}
NDR = PortRate(400.0, 4, "NDR")
CHAR = stat.S_IFCHR | 0o666
ALICE = JobIdentity(1001, (1001,), "SLURM_JOB_UID, SLURM_JOB_GID, /etc/group")


def port(device: str = "mlx5_0", state: int | None = 4, phys: int | None = 5, rate: PortRate | None = NDR,
         link_layer: str | None = "InfiniBand", lid: int | None = 0x41, sm_lid: int | None = 0x1,
         problems: tuple[Problem, ...] = ()) -> RdmaPort:
    path = f"/sys/class/infiniband/{device}/ports/1"
    return RdmaPort(device, 1, path, state, STATES.get(state or 0), phys, PHYS.get(phys or 0), rate, link_layer,
                    lid, sm_lid, (), "", problems)


def hca(name: str, *ports: RdmaPort, bus: int | None = None, hca_type: str | None = "MT4129", efa: bool = False,
        management: bool | None = False, uverbs: str | None = "auto", problems: tuple[Problem, ...] = ()) -> RdmaDevice:
    tail = name.rsplit("_", 1)[-1]
    number = int(tail) if tail.isdigit() else 0
    pci = f"0000:{bus if bus is not None else 0x1a + 0x10 * number:02x}:00.0"
    chosen = (replace(p, device=name, path=f"/sys/class/infiniband/{name}/ports/1") for p in (ports or (port(),)))
    return RdmaDevice(name, f"/sys/class/infiniband/{name}", "CA", "28.39.1002", hca_type, pci,
                      "0x1d0f" if efa else "0x15b3", efa, management, (), f"uverbs{number}" if uverbs == "auto" else uverbs,
                      tuple(chosen), problems)


def rdma(*devices: RdmaDevice, dev: tuple[str, ...] | None = None, identity: JobIdentity | None = ALICE,
         nodes: dict[str, int] | None = None, verbs: bool = True, problems: tuple[Problem, ...] = ()) -> RdmaFacts:
    names = [d.uverbs for d in devices if d.uverbs] + ["rdma_cm"]
    listing = tuple(names) if dev is None else dev
    modes = nodes if nodes is not None else {f"/dev/infiniband/{n}": CHAR for n in listing}
    device_nodes = tuple(DeviceNode(path, mode, 0, 0) for path, mode in modes.items())
    return RdmaFacts(tuple(devices), verbs, listing, device_nodes, identity, problems)


def eight(**changes: RdmaPort) -> RdmaFacts:
    """An HGX node: mlx5_0..mlx5_7, NDR InfiniBand, healthy unless a port is given."""
    return rdma(*(hca(f"mlx5_{i}", changes.get(f"mlx5_{i}", port())) for i in range(8)))


def job(environ: dict[str, str] | None = None, conf: dict[str, str] | None = None) -> JobFacts:
    return JobFacts(environ or {}, "", (NcclConfFile("/etc/nccl.conf", tuple((conf or {}).items())),))


def ib007(facts: RdmaFacts, where: JobFacts | None = None, expect: Expectations | None = None) -> Iterable[Observation]:
    """IB007 for a job whose NCCL_IB_HCA and site expectations are none unless given."""
    return rdma_device_nodes_missing(facts, where or job(), expect or Expectations())


def subjects(observations: Iterable[Observation], status: Status = Status.PRESENT) -> set[str]:
    return {o.subject for o in observations if o.status is status}


# -- NCCL_IB_HCA grammar ----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("value", "exclude", "exact", "entries"),
    [
        (None, False, False, ()),
        ("mlx5_0,mlx5_1:1", False, False, (("mlx5_0", None), ("mlx5_1", 1))),
        ("^=mlx5_bond_0", True, True, (("mlx5_bond_0", None),)),
        ("=^mlx5_0", False, True, (("^mlx5_0", None),)),  # '^' only counts first
        ("mlx5_0,,mlx5_1:", False, False, (("mlx5_0", None), ("mlx5_1", None))),  # empty entries and ports dropped
        ("mlx5_0:x", False, False, (("mlx5_0", 0),)),  # atoi("x") == 0: no port matches
        ("mlx5_0:1:2:3", False, False, (("mlx5_0", 1),)),  # rail and plane follow the port
        ("mlx5_0, mlx5_1", False, False, (("mlx5_0", None), (" mlx5_1", None))),  # no trimming
        (":1,mlx5_2", False, False, (("mlx5_2", None),)),  # an entry without a name is dropped
        ("^", True, False, ()),
    ],
)
def test_parse_nccl_ib_hca(value: str | None, exclude: bool, exact: bool, entries: tuple[tuple[str, int | None], ...]) -> None:
    parsed = parse_nccl_ib_hca(value)
    assert (parsed.exclude, parsed.exact) == (exclude, exact)
    assert tuple((e.name, e.port) for e in parsed.entries) == entries


def test_prefix_exact_and_exclusion_matching() -> None:
    assert parse_nccl_ib_hca("mlx5_1").selects("mlx5_10", 1)
    assert not parse_nccl_ib_hca("=mlx5_1").selects("mlx5_10", 1)
    assert parse_nccl_ib_hca("mlx5_1:2").selects("mlx5_1", 2) and not parse_nccl_ib_hca("mlx5_1:2").selects("mlx5_1", 1)
    assert not parse_nccl_ib_hca("^mlx5_1").selects("mlx5_10", 1) and parse_nccl_ib_hca("^mlx5_1").selects("mlx5_2", 1)
    assert not parse_nccl_ib_hca("^").selects("mlx5_0", 1)  # an empty exclusion list excludes everything
    assert parse_nccl_ib_hca("").selects("mlx5_0", 1) and parse_nccl_ib_hca("=").selects("mlx5_0", 1)


def test_accidental_prefix_is_a_prefix_ending_inside_a_number() -> None:
    assert accidental_prefix(HcaEntry("mlx5_1", "mlx5_1", None), "mlx5_10")
    assert not accidental_prefix(HcaEntry("mlx5", "mlx5", None), "mlx5_10")
    assert not accidental_prefix(HcaEntry("mlx5_", "mlx5_", None), "mlx5_10")
    assert not accidental_prefix(HcaEntry("mlx5_1", "mlx5_1", None), "mlx5_1")


def test_selection_keeps_active_ib_and_ethernet_ports_only() -> None:
    facts = rdma(hca("mlx5_0"), hca("mlx5_1", port(state=1, phys=2)), hca("efa_0", port(link_layer="Unknown"), efa=True),
                 hca("mlx5_2", port(link_layer="Ethernet")))
    assert [p.subject for p in nccl_selection(facts, job()).ports] == ["mlx5_0/1", "mlx5_2/1"]


# -- IB009 ------------------------------------------------------------------------------------
def test_ib009_present_for_down_port_and_degraded_rate() -> None:
    facts = eight(mlx5_3=port(state=1, phys=2, rate=None), mlx5_5=port(rate=PortRate(200.0, 2, "NDR")))
    found = list(rdma_stack_or_ports_misconfigured(facts, Expectations(), job()))
    assert subjects(found) == {"mlx5_3/1", "mlx5_5/1"}
    degraded = next(o for o in found if o.subject == "mlx5_5/1")
    assert "200 Gb/sec (2X NDR)" in degraded.evidence[0].observed
    assert "400 Gb/sec like 6 of 7 active InfiniBand MT4129 ports" in degraded.evidence[0].expected


def test_ib009_partition_keys_unread_are_unknown_not_absent() -> None:
    """An nccl.conf that could not be read may set NCCL_IB_PKEY, and a failed pkeys probe says
    nothing: the InfiniBand ports' partition is unknown; RoCE ports use index 0 unless told."""
    facts = rdma(hca("mlx5_0"), hca("mlx5_1", port(link_layer="Ethernet")))
    unread_conf = PkeyFacts(0, None, "", "NCCL_IB_PKEY: /home/alice/.nccl.conf could not be read (EACCES) and may set it", ())
    found = list(rdma_stack_or_ports_misconfigured(facts, Expectations(), job(), pkeys=unread_conf))
    assert [(o.subject, o.status, o.reason) for o in found] == [("mlx5_0/1", Status.UNKNOWN, f"partition key index: {unread_conf.setting_unread}")]
    failed = list(rdma_stack_or_ports_misconfigured(facts, Expectations(), job(), pkeys=Unread("pkeys", "timed out")))
    assert [(o.subject, o.reason) for o in failed] == [("mlx5_0/1", "partition keys: probe pkeys: timed out")]
    unset = PkeyFacts(0, None, "", "", ())
    assert list(rdma_stack_or_ports_misconfigured(facts, Expectations(), job(), pkeys=unset)) == []


def test_ib009_compares_ports_of_like_adapters() -> None:
    """Eight 1x400G BlueField-3 SuperNICs and a 2x200G BlueField-3 DPU all say MT41692: the DPU's
    two functions on one adapter make it another card, whose 200G is not a degraded rail."""
    rails = [hca(f"mlx5_{i}", port(link_layer="Ethernet"), hca_type="MT41692") for i in range(8)]

    def dpus(slow: float = 200.0) -> list[RdmaDevice]:
        return [replace(hca(f"mlx5_{8 + i}", port(link_layer="Ethernet", rate=PortRate(slow if i == 3 else 200.0, 4, "HDR")), hca_type="MT41692"),
                        pci_address=f"0000:c{1 + i // 2}:00.{i % 2}", adapter_functions=2) for i in range(4)]

    assert list(rdma_stack_or_ports_misconfigured(rdma(*rails, *dpus()), Expectations(), job())) == []
    [found] = rdma_stack_or_ports_misconfigured(rdma(*rails, *dpus(slow=100.0)), Expectations(), job())
    assert found.subject == "mlx5_11/1" and "200 Gb/sec like 3 of 4 active Ethernet MT41692 ports of 2-port adapters" in found.evidence[0].expected


def test_ib009_present_for_missing_expected_hca_and_rate_below_expectation() -> None:
    facts = eight()
    expect = Expectations(hcas=("mlx5_0", "mlx5_8"), rate_gbps=800)
    assert subjects(rdma_stack_or_ports_misconfigured(facts, expect, job())) == {"mlx5_8", "mlx5_0/1"}


def test_ib009_judges_bandwidth_not_lanes() -> None:
    """One bandwidth comes as several width x lane-speed pairs (400 Gb/s as 4X NDR or 2X XDR; a
    RoCE driver maps 100 Gb/s Ethernet to 4X EDR or 2X HDR by its lanes): none is degraded."""
    assert list(rdma_stack_or_ports_misconfigured(eight(mlx5_1=port(rate=PortRate(400.0, 2, "XDR"))), Expectations(), job())) == []
    edr, hdr = PortRate(100.0, 4, "EDR"), PortRate(100.0, 2, "HDR")
    mixed = rdma(*(hca(f"mlx5_{i}", port(rate=edr if i % 2 else hdr, link_layer="Ethernet")) for i in range(8)))
    assert list(rdma_stack_or_ports_misconfigured(mixed, Expectations(), job())) == []
    # A link that lost lanes at its lane speed loses bandwidth, and that is judged.
    halved = eight(mlx5_1=port(rate=PortRate(200.0, 2, "NDR")))
    assert subjects(rdma_stack_or_ports_misconfigured(halved, Expectations(), job())) == {"mlx5_1/1"}


def test_ib009_absent_on_healthy_node_and_for_plausibly_unused_ports() -> None:
    assert list(rdma_stack_or_ports_misconfigured(eight(), Expectations(), job())) == []
    # A storage pair with one uncabled port: no majority of its kind is ACTIVE, so it is not judged.
    storage = (hca("mlx5_8", port(link_layer="Ethernet"), hca_type="MT4125"),
               hca("mlx5_9", port(state=1, phys=2, link_layer="Ethernet", rate=None), hca_type="MT4125"))
    facts = replace(eight(), devices=eight().devices + storage)
    assert list(rdma_stack_or_ports_misconfigured(facts, Expectations(), job())) == []
    # ...unless the site says it is a data HCA.
    assert subjects(rdma_stack_or_ports_misconfigured(facts, Expectations(hcas=("mlx5_9",)), job())) == {"mlx5_9/1"}


def test_ib009_skips_ports_nccl_ib_hca_leaves_out() -> None:
    """NCCL never opens a port NCCL_IB_HCA leaves out, so its state cannot hurt a job; the setting
    counts from the job's environment and from NCCL's configuration files alike."""
    facts = rdma(*(hca(f"mlx5_{i}") for i in range(8)), hca("mlx5_8", port(state=1, phys=2, rate=None)))
    assert subjects(rdma_stack_or_ports_misconfigured(facts, Expectations(), job())) == {"mlx5_8/1"}
    rails = "=" + ",".join(f"mlx5_{i}" for i in range(8))
    assert list(rdma_stack_or_ports_misconfigured(facts, Expectations(), job({"NCCL_IB_HCA": rails}))) == []
    assert list(rdma_stack_or_ports_misconfigured(facts, Expectations(), job(conf={"NCCL_IB_HCA": "^mlx5_8"}))) == []
    # A selection that keeps the port, an empty one (NCCL's "every device") and an unreadable
    # nccl.conf still judge it; so does the site's expect.hcas, whatever NCCL_IB_HCA says.
    for kept in (job({"NCCL_IB_HCA": "mlx5"}), job({"NCCL_IB_HCA": ""})):
        assert subjects(rdma_stack_or_ports_misconfigured(facts, Expectations(), kept)) == {"mlx5_8/1"}
    unreadable = JobFacts({}, "", (NcclConfFile("/etc/nccl.conf", (), "permission denied (EACCES)"),))
    assert subjects(rdma_stack_or_ports_misconfigured(facts, Expectations(), unreadable)) == {"mlx5_8/1"}
    # Without the job's facts (its probe failed) every port is judged, as before the setting was read.
    assert subjects(rdma_stack_or_ports_misconfigured(facts, Expectations(), Unread("job", "/proc/self/environ: not captured"))) == {"mlx5_8/1"}
    expected = Expectations(hcas=("mlx5_0", "mlx5_8"))
    assert subjects(rdma_stack_or_ports_misconfigured(facts, expected, job({"NCCL_IB_HCA": rails}))) == {"mlx5_8/1"}


def test_ib009_disabled_port_is_a_warning_unless_expected() -> None:
    """On InfiniBand phys_state 3 (Disabled) is set on purpose, e.g. the spare port of a dual-port
    card of the rails' type; a port that lost its link (2, Polling) stays an error, and so does a
    RoCE port reading Disabled, which Ethernet RDMA drivers report for any netdev without carrier."""
    disabled = rdma(*(hca(f"mlx5_{i}") for i in range(8)), hca("mlx5_8", port(state=1, phys=3, rate=None)))
    [found] = rdma_stack_or_ports_misconfigured(disabled, Expectations(), job())
    assert (found.subject, found.severity) == ("mlx5_8/1", Severity.WARNING)
    assert "3: Disabled" in found.evidence[0].observed and "expect.hcas or NCCL_IB_HCA" in found.fix
    [expected] = rdma_stack_or_ports_misconfigured(disabled, Expectations(hcas=("mlx5_8",)), job())
    assert expected.severity is None  # the reference's own (error)
    rails = job(conf={"NCCL_IB_HCA": "mlx5"})  # a visible selection that keeps every port
    [polling] = rdma_stack_or_ports_misconfigured(eight(mlx5_3=port(state=1, phys=2, rate=None)), Expectations(), rails)
    assert polling.severity is None
    roce = rdma(*(hca(f"mlx5_{i}", port(link_layer="Ethernet")) for i in range(8)),
                hca("mlx5_8", port(state=1, phys=3, rate=None, link_layer="Ethernet")))
    [no_carrier] = rdma_stack_or_ports_misconfigured(roce, Expectations(), rails)
    assert (no_carrier.subject, no_carrier.severity) == ("mlx5_8/1", None)


HALF_NDR = PortRate(200.0, 2, "NDR")


@pytest.mark.parametrize(
    ("facts", "odd", "rails_down"),
    [
        # eight 400G rails and a storage pair of the same ConnectX-7 cabled at NDR200
        (rdma(*(hca(f"mlx5_{i}", port(rate=HALF_NDR if i > 7 else NDR)) for i in range(10))), ("mlx5_8/1", "mlx5_9/1"), ()),
        # twelve ConnectX-7 functions, one port of a storage card uncabled, and a rail (mlx5_2)
        (rdma(*(hca(f"mlx5_{i}", port(state=1, phys=2, rate=None) if i in (2, 8) else port()) for i in range(12))), ("mlx5_2/1", "mlx5_8/1"), ("mlx5_2/1",)),
    ],
)
def test_ib009_ports_nothing_names_as_rails_are_warnings(facts: RdmaFacts, odd: tuple[str, ...], rails_down: tuple[str, ...]) -> None:
    """The HCA model is not the role: a storage port of the rails' own model, slower or down, is
    indistinguishable from a broken rail until expect.hcas or a visible NCCL_IB_HCA names the rails."""
    found = list(rdma_stack_or_ports_misconfigured(facts, Expectations(), job({"SLURM_SCRIPT_CONTEXT": "prolog_slurmd"})))
    assert [(o.subject, o.status, o.severity) for o in found] == [(subject, Status.PRESENT, Severity.WARNING) for subject in odd]
    assert "is a rail, " in found[0].fix and "list the rails in expect.hcas or NCCL_IB_HCA" in found[0].fix
    # Named rails: theirs is an error, the rest is not judged.
    site = Expectations(hcas=tuple(f"mlx5_{i}" for i in (0, 1, 2, 3, 4, 5, 6, 7)))
    assert [(o.subject, o.severity) for o in rdma_stack_or_ports_misconfigured(facts, site, job())] == [(s, None) for s in rails_down]
    listed = job(conf={"NCCL_IB_HCA": "mlx5"})
    assert [(o.subject, o.severity) for o in rdma_stack_or_ports_misconfigured(facts, Expectations(), listed)] == [(s, None) for s in odd]


def test_ib009_ignores_nvswitch_management_functions() -> None:
    lpf = hca("mlx5_8", port(state=2, lid=0, sm_lid=0), management=True)
    facts = replace(eight(), devices=eight().devices + (lpf,))
    assert list(rdma_stack_or_ports_misconfigured(facts, Expectations(), job())) == []


def unread_vpd(name: str, state: int) -> RdmaDevice:
    """A Mellanox InfiniBand function whose device/vpd a non-root run could not read."""
    vpd = Problem(f"/sys/class/infiniband/{name}/device/vpd", "permission denied (EACCES)")
    return hca(name, port(state=state, lid=0 if state != 4 else 0x41, sm_lid=0 if state != 4 else 1), management=None, problems=(vpd,))


def test_ib008_ib009_an_inactive_port_of_an_unread_vpd_is_undecided() -> None:
    """An NVSwitch management function (LPF, ports in INIT) is told from a data NIC by its
    root-only VPD alone: read as non-root, an inactive port of such a function may be either."""
    facts = replace(eight(), devices=(*eight().devices, unread_vpd("mlx5_8", 2), unread_vpd("mlx5_9", 2)))
    reason = "/sys/class/infiniband/mlx5_8/device/vpd: permission denied (EACCES): cannot tell an NVSwitch management function from a data NIC"
    for found in (list(ib_subnet_manager_sweep_failure(facts)), list(rdma_stack_or_ports_misconfigured(facts, Expectations(), job()))):
        assert [(o.subject, o.status) for o in found] == [("mlx5_8/1", Status.UNKNOWN), ("mlx5_9/1", Status.UNKNOWN)]
        assert found[0].reason == reason
    # An ACTIVE port is judged whatever the VPD says: LPFs never come up.
    slow = replace(unread_vpd("mlx5_8", 4), ports=(replace(unread_vpd("mlx5_8", 4).ports[0], rate=PortRate(200.0, 2, "NDR")),))
    found = list(rdma_stack_or_ports_misconfigured(replace(eight(), devices=(*eight().devices, slow)), Expectations(), job()))
    assert [(o.subject, o.status) for o in found] == [("mlx5_8/1", Status.PRESENT)]


def test_ib009_judges_every_port_when_none_is_active() -> None:
    facts = rdma(hca("mlx5_0", port(state=1, phys=3)))
    assert subjects(rdma_stack_or_ports_misconfigured(facts, Expectations(), job())) == {"mlx5_0/1"}
    # With no port up, the rails are down whichever they are: an error without naming them.
    no_sm = rdma(*(hca(f"mlx5_{i}", port(state=2, lid=0, sm_lid=0)) for i in range(4)))
    assert {(o.subject, o.severity) for o in rdma_stack_or_ports_misconfigured(no_sm, Expectations(), job())} == {(f"mlx5_{i}/1", None) for i in range(4)}


def test_ib009_not_applicable_and_unknown() -> None:
    with pytest.raises(NotApplicable):
        list(rdma_stack_or_ports_misconfigured(rdma(), Expectations(), job()))
    with pytest.raises(Unknown, match="EACCES"):
        list(rdma_stack_or_ports_misconfigured(rdma(problems=(Problem("/sys/class/infiniband", "permission denied (EACCES)"),)), Expectations(), job()))
    broken = port(state=None, problems=(Problem("/sys/class/infiniband/mlx5_2/ports/1/state", "invalid argument (EINVAL)"),))
    found = list(rdma_stack_or_ports_misconfigured(eight(mlx5_2=broken), Expectations(), job()))
    assert [(o.subject, o.status) for o in found] == [("mlx5_2/1", Status.UNKNOWN)]
    assert found[0].reason == "/sys/class/infiniband/mlx5_2/ports/1/state: invalid argument (EINVAL)"
    no_rate = port(rate=None, problems=(Problem("/sys/class/infiniband/mlx5_1/ports/1/rate", "empty"),))
    assert subjects(rdma_stack_or_ports_misconfigured(eight(mlx5_1=no_rate), Expectations(), job()), Status.UNKNOWN) == {"mlx5_1/1"}


# -- IB008 ------------------------------------------------------------------------------------
def test_ib008_present_for_init_and_for_active_without_lids() -> None:
    facts = eight(mlx5_0=port(state=2, lid=0, sm_lid=0), mlx5_1=port(state=3), mlx5_2=port(sm_lid=0))
    found = list(ib_subnet_manager_sweep_failure(facts))
    assert subjects(found) == {"mlx5_0/1", "mlx5_1/1", "mlx5_2/1"}
    assert "state 2: INIT" in found[0].evidence[0].observed and "sm_lid 0x0" in found[0].evidence[0].observed


def test_ib008_absent_for_healthy_down_and_management_ports() -> None:
    assert list(ib_subnet_manager_sweep_failure(eight())) == []
    down = eight(mlx5_4=port(state=1, phys=2, lid=0, sm_lid=0))  # no link: IB009's business, not the SM's
    assert list(ib_subnet_manager_sweep_failure(down)) == []
    lpf = hca("mlx5_8", port(state=2, lid=0, sm_lid=0), management=True)
    assert list(ib_subnet_manager_sweep_failure(replace(eight(), devices=eight().devices + (lpf,)))) == []


JOIN_LOG = [
    "6,2210,91022311,-;mlx5_core 0000:1a:00.0: mlx5_core_set_hca_defaults:...",
    "4,2231,95123002,-;ib0: multicast join failed for ff12:401b:ffff:0000:0000:0000:ffff:ffff, status -22",
    "4,2240,99123002,-;ib0: multicast join failed for ff12:401b:ffff:0000:0000:0000:ffff:ffff, status -110, retry in 2000 msecs",
    "4,2241,99123010,-;ib1.8001: multicast join failed for ff12:401b:8001:0000:0000:0000:ffff:ffff, status -22",
    "4,2242,99123011,-;ib2: multicast join failed for the group, status -22",  # not the kernel's format
    # An IPv6 solicited-node group (601b) refused: the interface keeps its carrier.
    "4,2243,99123012,-;ib3: multicast join failed for ff12:601b:ffff:0000:0000:0001:ff00:0001, status -22",
]


def test_ib008_ipoib_joins_the_subnet_administrator_refused() -> None:
    failures = parse_join_failures(JOIN_LOG)
    assert [(f.netdev, f.status) for f in failures] == [("ib0", -22), ("ib0", -110), ("ib1.8001", -22), ("ib3", -22)]
    log = KernelLogFacts((), (), (), "", True, failures)
    found = list(ib_subnet_manager_sweep_failure(eight(), log))
    assert [(o.subject, o.status, o.severity) for o in found] == [("ib0", Status.PRESENT, Severity.WARNING), ("ib1.8001", Status.PRESENT, Severity.WARNING)]
    assert found[0].evidence[0].observed.startswith("2 multicast join failure(s) (status -110, -22); last: ib0: multicast join failed")
    with pytest.raises(NotApplicable):  # RoCE-only node: IPoIB messages cannot be about a subnet manager here
        list(ib_subnet_manager_sweep_failure(rdma(hca("mlx5_0", port(link_layer="Ethernet"))), log))


def test_ib008_an_interface_up_now_was_granted_a_later_join(tmp_path: Path) -> None:
    """After an OpenSM restart the joins fail until the SM is back; IPoIB keeps retrying and turns
    carrier on only once the broadcast group is joined: an interface up now has recovered."""
    from preflight.probes.kernel_log import probe_kernel_log
    from preflight.sources import NodeFS

    (tmp_path / ".preflight").mkdir()
    (tmp_path / ".preflight" / "kmsg").write_text("\n".join(JOIN_LOG) + "\n")
    for netdev, state in (("ib0", "up"), ("ib1.8001", "down")):
        (tmp_path / "sys/class/net" / netdev).mkdir(parents=True)
        (tmp_path / "sys/class/net" / netdev / "operstate").write_text(f"{state}\n")
    log = probe_kernel_log(NodeFS(str(tmp_path)))
    assert log.joined_since == ("ib0",)
    assert [o.subject for o in ib_subnet_manager_sweep_failure(eight(), log)] == ["ib1.8001"]


def test_ib008_a_kernel_log_not_read_leaves_the_join_history_undecided() -> None:
    """The ports' verdict stands beside an unknown for the joins the log would have shown."""
    log = KernelLogFacts((), (), (), "the root records no kernel log (.preflight/kmsg)", False)
    found = list(ib_subnet_manager_sweep_failure(eight(mlx5_0=port(state=2, lid=0, sm_lid=0)), log))
    assert [(o.subject, o.status) for o in found] == [("kernel log", Status.UNKNOWN), ("mlx5_0/1", Status.PRESENT)]
    assert found[0].reason == "IPoIB multicast join history since boot unread: the root records no kernel log (.preflight/kmsg)"


def test_ib008_not_applicable_without_infiniband_ports() -> None:
    with pytest.raises(NotApplicable, match="no InfiniBand"):
        list(ib_subnet_manager_sweep_failure(rdma(hca("mlx5_0", port(link_layer="Ethernet", lid=0, sm_lid=0)))))


def test_ib008_unknown_when_lids_or_link_layer_unreadable() -> None:
    bad = port(sm_lid=None, problems=(Problem("/sys/class/infiniband/mlx5_1/ports/1/sm_lid", "unparseable 'zz'"),))
    found = list(ib_subnet_manager_sweep_failure(eight(mlx5_1=bad)))
    assert [(o.subject, o.status, o.reason) for o in found] == [("mlx5_1/1", Status.UNKNOWN, "/sys/class/infiniband/mlx5_1/ports/1/sm_lid: unparseable 'zz'")]
    only = rdma(hca("mlx5_0", port(link_layer=None, problems=(Problem("/sys/class/infiniband/mlx5_0/ports/1/link_layer", "missing"),))))
    with pytest.raises(Unknown, match="link_layer: missing"):
        list(ib_subnet_manager_sweep_failure(only))


# -- IB007 ------------------------------------------------------------------------------------
def test_ib007_present_when_container_has_no_dev_infiniband() -> None:
    facts = rdma(hca("mlx5_0"), hca("mlx5_1"), dev=None, nodes={})
    found = list(ib007(replace(facts, dev_infiniband=None)))
    assert subjects(found) == {"/dev/infiniband"}
    assert found[0].evidence[0].observed == "mlx5_0, mlx5_1"


def test_ib007_not_applicable_where_the_job_turns_nccls_ib_transport_off() -> None:
    """A Kubernetes pod of a multi-node NVLink ComputeDomain gets GPUs and an IMEX channel, no
    /dev/infiniband, and NCCL_IB_DISABLE=1: NCCL opens no RDMA device."""
    facts = replace(rdma(hca("mlx5_0"), dev=None, nodes={}), dev_infiniband=None)
    with pytest.raises(NotApplicable, match="NCCL_IB_DISABLE=1"):
        list(rdma_device_nodes_missing(facts, job({"NCCL_IB_DISABLE": "1"}), Expectations()))


@pytest.mark.parametrize("net", ["UCX", "ucx-rma", "UCX-UCT-RD", "IBext_v8"])
def test_ib_device_checks_apply_to_the_hpcx_plugins_verbs_networks(net: str) -> None:
    """nccl-rdma-sharp-plugins' IBext and UCX networks open the verbs ports NCCL's IB transport
    would, filtered by NCCL_IB_HCA (nccl_p2p_ib_init): a container without /dev/infiniband fails
    them too, and NCCL_IB_DISABLE, which the plugin does not read, turns nothing off."""
    facts = replace(rdma(hca("mlx5_0"), dev=None, nodes={}), dev_infiniband=None)
    assert subjects(ib007(facts, job({"NCCL_NET": net}))) == {"/dev/infiniband"}
    assert subjects(ib007(facts, job({"NCCL_NET": net, "NCCL_IB_DISABLE": "1"}))) == {"/dev/infiniband"}
    with pytest.raises(NotApplicable, match="NCCL_NET=AWS Libfabric"):
        list(ib007(facts, job({"NCCL_NET": "AWS Libfabric"})))


def test_ib007_present_for_missing_node_permissions_and_rdma_cm() -> None:
    facts = rdma(hca("mlx5_0"), hca("mlx5_1"), hca("mlx5_2"),
                 nodes={"/dev/infiniband/uverbs0": CHAR, "/dev/infiniband/uverbs1": stat.S_IFCHR | 0o600,
                        "/dev/infiniband/uverbs2": stat.S_IFREG | 0o666})
    found = list(ib007(facts))
    assert subjects(found) == {"mlx5_1", "mlx5_2", "rdma_cm"}
    rdma_cm = next(o for o in found if o.subject == "rdma_cm")
    assert rdma_cm.severity is Severity.WARNING and "modprobe rdma_ucm" in rdma_cm.fix and "--device=/dev/infiniband/rdma_cm" in rdma_cm.fix
    assert next(o for o in found if o.subject == "mlx5_2").fix == ""  # the reference's own fix for a uverbs node
    denied = next(o for o in found if o.subject == "mlx5_1").evidence[0]
    assert denied.observed == "mode crw------- owner 0:0" and "uid 1001" in denied.expected


def test_ib007_is_unknown_where_only_a_group_the_directory_may_hold_would_open_the_node() -> None:
    """/dev/infiniband nodes read-write for a group (0660) and a job user /etc/group does not list
    in it, on a node whose group database also asks sss: the membership is unknown, not missing."""
    group_only = {"/dev/infiniband/uverbs0": stat.S_IFCHR | 0o660, "/dev/infiniband/rdma_cm": stat.S_IFCHR | 0o660}
    directory = replace(ALICE, groups_elsewhere=("sss",))
    found = list(ib007(rdma(hca("mlx5_0"), nodes=group_only, identity=directory)))
    assert {(o.subject, o.status) for o in found} == {("mlx5_0", Status.UNKNOWN), ("rdma_cm", Status.UNKNOWN)}
    assert "also asks sss (nsswitch.conf)" in found[0].reason
    assert subjects(ib007(rdma(hca("mlx5_0"), nodes=group_only))) == {"mlx5_0", "rdma_cm"}  # files only: decided


def test_ib007_present_without_ib_uverbs_or_a_uverbs_device() -> None:
    assert subjects(ib007(rdma(hca("mlx5_0"), verbs=False))) == {"ib_uverbs"}
    assert subjects(ib007(rdma(hca("mlx5_0"), hca("mlx5_1", uverbs=None)))) == {"mlx5_1"}


def test_ib007_absent_for_root_prolog_and_world_writable_nodes() -> None:
    assert list(ib007(rdma(hca("mlx5_0"), hca("mlx5_1")))) == []
    root_only = rdma(hca("mlx5_0"), nodes={"/dev/infiniband/uverbs0": stat.S_IFCHR | 0o600, "/dev/infiniband/rdma_cm": CHAR},
                     identity=JobIdentity(0, (0,), "/proc/self/status"))
    assert list(ib007(root_only)) == []
    # EFA needs no rdma_cm.
    efa = rdma(hca("efa_0", port(link_layer="Unknown"), efa=True), nodes={"/dev/infiniband/uverbs0": CHAR})
    assert list(ib007(efa)) == []


def test_ib007_devices_the_job_leaves_out_are_not_judged_or_warnings() -> None:
    """A pod's device plugin mounts the uverbs node of the HCA it hands out while sysfs shows every
    HCA (every PF and VF of the host in RDMA shared mode); NCCL skips a device it cannot open. A
    device a visible NCCL_IB_HCA leaves out is not judged (NCCL never opens it), one only the
    site's expect.hcas leaves out is a warning; the devices the job or the site names stay errors."""
    pod = rdma(*(hca(f"mlx5_{i}", port(link_layer="Ethernet")) for i in range(4)), nodes={"/dev/infiniband/uverbs2": CHAR, "/dev/infiniband/rdma_cm": CHAR})
    assert list(ib007(pod, job({"SLURM_JOB_ID": "42", "NCCL_IB_HCA": "=mlx5_2"}))) == []
    assert [(o.subject, o.severity) for o in ib007(pod, job({"NCCL_IB_HCA": "=mlx5_1,mlx5_2"}))] == [("mlx5_1", Severity.ERROR)]
    site = [(o.subject, o.severity) for o in ib007(pod, job(), Expectations(hcas=("mlx5_0", "mlx5_2")))]
    assert site == [("mlx5_0", Severity.ERROR), ("mlx5_1", Severity.WARNING), ("mlx5_3", Severity.WARNING)]
    # Nothing names the devices (or the job's facts are unread): every device is the job's.
    for where in (job(), Unread("job", "/proc/self/environ: not captured")):
        assert {o.severity for o in rdma_device_nodes_missing(pod, where, Expectations())} == {Severity.ERROR}


def test_ib007_in_a_container_a_device_without_its_node_was_not_given() -> None:
    """A pod's RDMA shared device plugin mounts the nodes of the HCAs it hands out; sysfs shows the
    host's all, and libibverbs lists no device whose node is missing, so NCCL never sees the front
    end's. On the host (no container) a missing node hides a rail from NCCL: still an error."""
    devices = (hca("mlx5_0"), hca("mlx5_1"), hca("mlx5_4", port(link_layer="Ethernet")))
    pod = rdma(*devices, dev=("uverbs0", "uverbs1", "rdma_cm"))
    assert [o.subject for o in ib007(pod)] == ["mlx5_4"]
    assert list(ib007(replace(pod, container="/etc/hosts (kubelet's)"))) == []
    # Given none at all, the container cannot use RDMA: that stays.
    bare = rdma(*devices, dev=("rdma_cm",))
    assert {o.subject for o in ib007(replace(bare, container="/.dockerenv"))} == {"mlx5_0", "mlx5_1", "mlx5_4"}


def test_ib007_not_applicable_and_unknown() -> None:
    with pytest.raises(NotApplicable):
        list(ib007(rdma()))
    with pytest.raises(NotApplicable, match="NVSwitch management"):
        list(ib007(rdma(hca("mlx5_0", management=True))))
    found = list(ib007(rdma(hca("mlx5_0"), identity=None)))
    assert subjects(found, Status.UNKNOWN) == {"mlx5_0", "rdma_cm"} and "identity" in found[0].reason
    broken = rdma(hca("mlx5_0"), nodes={}, problems=(Problem(".preflight/devices.json", "malformed recording"),))
    assert subjects(ib007(broken), Status.UNKNOWN) == {"mlx5_0", "rdma_cm"}
    unlisted = rdma(hca("mlx5_0"), problems=(Problem("/dev/infiniband", "permission denied (EACCES)"),))
    with pytest.raises(Unknown, match="EACCES"):
        list(ib007(replace(unlisted, dev_infiniband=None)))


# -- IB004 ------------------------------------------------------------------------------------
def twelve() -> RdmaFacts:
    return rdma(*(hca(f"mlx5_{i}") for i in range(12)))


def test_ib004_accidental_prefix_unmatched_entries_and_down_ports() -> None:
    facts = replace(twelve(), devices=tuple(
        replace(d, ports=(replace(d.ports[0], state=1, phys_state=2),)) if d.name == "mlx5_3" else d for d in twelve().devices
    ))
    found = list(ib_hca_selection_mismatch(facts, job(conf={"NCCL_IB_HCA": "mlx5_1,mlx5_3,mlx5_12, mlx5_2,mlx5_0:2"})))
    assert subjects(found) == {"NCCL_IB_HCA 'mlx5_1'", "mlx5_3/1", "NCCL_IB_HCA 'mlx5_12'", "NCCL_IB_HCA ' mlx5_2'", "NCCL_IB_HCA 'mlx5_0:2'"}
    prefix = next(o for o in found if o.subject == "NCCL_IB_HCA 'mlx5_1'")
    assert prefix.severity is None and "also selects mlx5_10, mlx5_11" in prefix.evidence[1].observed
    assert prefix.evidence[0].source == "/etc/nccl.conf NCCL_IB_HCA"
    spaced = next(o for o in found if o.subject == "NCCL_IB_HCA ' mlx5_2'")
    assert spaced.severity is Severity.WARNING and "does not trim spaces" in spaced.evidence[1].observed


@pytest.mark.parametrize(
    ("value", "reported"),
    [
        ("mlx5_0,mlx5_1,mlx5_2,mlx5_3,mlx5_6,mlx5_7,mlx5_8,mlx5_9,mlx5_10,mlx5_11", None),  # a DGX's rails, named one by one
        ("mlx5_1,mlx5_10", "also selects mlx5_11"), ("mlx5_1,mlx5_10:2", "also selects mlx5_10, mlx5_11"),  # mlx5_10 has port 1 only
        ("mlx5,mlx5_1", None),  # the family prefix names every mlx5 device on purpose
        ("^mlx5_1,mlx5_10,mlx5_11", None), ("^mlx5_1,mlx5_11", "also excludes mlx5_10"),
    ],
)
def test_ib004_a_prefix_is_accidental_only_for_devices_no_other_entry_names(value: str, reported: str | None) -> None:
    """NCCL selects the union of every entry's matches: 'mlx5_1' reaching mlx5_10 and mlx5_11
    changes nothing where the list names them too."""
    found = [o for o in ib_hca_selection_mismatch(twelve(), job(conf={"NCCL_IB_HCA": value})) if o.subject == "NCCL_IB_HCA 'mlx5_1'"]
    assert [o.evidence[1].observed for o in found] == ([] if reported is None else [f"prefix 'mlx5_1' {reported}"])


def dual_port(name: str, first: int | None, second: int | None) -> RdmaDevice:
    """A two-port HCA (mlx4/ConnectX-3 and other multi-port drivers) with these port states."""
    device = hca(name, port(state=first, phys=5 if first == 4 else 2))
    spare = replace(port(state=second, phys=5 if second == 4 else 2, rate=None), device=name, number=2, path=f"/sys/class/infiniband/{name}/ports/2")
    return replace(device, ports=(device.ports[0], spare))


def test_ib004_a_device_named_without_a_port_is_down_only_when_none_of_its_ports_is_active() -> None:
    """NCCL_IB_HCA=mlx5_0 asks for the device: NCCL uses its active port and skips the uncabled
    one; 'mlx5_0:2' names the port, and a device with no active port at all is a listed rail down."""
    spares = rdma(dual_port("mlx5_0", 4, 1), dual_port("mlx5_1", 4, 1))
    assert list(ib_hca_selection_mismatch(spares, job(conf={"NCCL_IB_HCA": "mlx5_0,mlx5_1"}))) == []
    assert subjects(ib_hca_selection_mismatch(spares, job(conf={"NCCL_IB_HCA": "mlx5_0:2,mlx5_1"}))) == {"mlx5_0/2"}
    dead = rdma(dual_port("mlx5_0", 1, 1), dual_port("mlx5_1", 4, 1))
    assert subjects(ib_hca_selection_mismatch(dead, job(conf={"NCCL_IB_HCA": "mlx5_0,mlx5_1"}))) == {"mlx5_0/1", "mlx5_0/2"}
    # A port whose state is unread may be the active one: it is unknown, and its sibling not judged.
    unread = rdma(dual_port("mlx5_0", None, 1), dual_port("mlx5_1", 4, 1))
    found = list(ib_hca_selection_mismatch(unread, job(conf={"NCCL_IB_HCA": "mlx5_0,mlx5_1"})))
    assert [(o.subject, o.status) for o in found] == [("mlx5_0/1", Status.UNKNOWN)]


def test_ib004_exclusion_prefix_and_empty_selection() -> None:
    excluded = list(ib_hca_selection_mismatch(twelve(), job({"NCCL_IB_HCA": "^mlx5_1"})))
    assert subjects(excluded) == {"NCCL_IB_HCA 'mlx5_1'"} and "also excludes" in excluded[0].evidence[1].observed
    assert excluded[0].evidence[0].source == "/proc/self/environ NCCL_IB_HCA"
    nothing = list(ib_hca_selection_mismatch(twelve(), job({"NCCL_IB_HCA": "=^mlx5_1"})))
    assert subjects(nothing) == {"NCCL_IB_HCA '^mlx5_1'", "NCCL_IB_HCA"}
    assert "'^' must come first" in nothing[0].evidence[1].observed


def test_ib004_mixed_link_layers_and_management_functions() -> None:
    mixed = rdma(hca("mlx5_0"), hca("mlx5_bond_0", port(link_layer="Ethernet")), hca("mlx5_1", management=True))
    explicit = list(ib_hca_selection_mismatch(mixed, job({"NCCL_IB_HCA": "mlx5"})))
    assert [(o.subject, o.severity) for o in explicit] == [("NCCL IB selection", None), ("NCCL IB selection", Severity.WARNING)]
    default = list(ib_hca_selection_mismatch(mixed, job()))
    assert [o.severity for o in default] == [Severity.WARNING, Severity.WARNING]


def test_ib004_absent_for_exact_lists_family_prefixes_and_unset() -> None:
    assert list(ib_hca_selection_mismatch(twelve(), job({"NCCL_IB_HCA": "=mlx5_0,mlx5_1"}))) == []
    assert list(ib_hca_selection_mismatch(twelve(), job({"NCCL_IB_HCA": "mlx5"}))) == []
    assert list(ib_hca_selection_mismatch(twelve(), job())) == []


def test_ib004_not_applicable_on_efa_and_unknown_for_unreadable_ports() -> None:
    efa = rdma(hca("efa_0", port(link_layer="Unknown"), efa=True))
    with pytest.raises(NotApplicable):
        list(ib_hca_selection_mismatch(efa, job({"NCCL_IB_HCA": "mlx5_0"})))
    unreadable = port(state=None, problems=(Problem("/sys/class/infiniband/mlx5_0/ports/1/state", "empty"),))
    found = list(ib_hca_selection_mismatch(eight(mlx5_0=unreadable), job({"NCCL_IB_HCA": "=mlx5_0"})))
    assert [(o.subject, o.status) for o in found] == [("mlx5_0/1", Status.UNKNOWN)]


# -- IB003 ------------------------------------------------------------------------------------
def test_ib003_present_for_exactly_three_selected_ports() -> None:
    found = list(ib_odd_nic_count_rail_hang(eight(), job({"NCCL_IB_HCA": "=mlx5_0,mlx5_1,mlx5_4"})))
    assert [(o.subject, o.severity) for o in found] == [("node", Severity.WARNING)]
    assert "NCCL would use 3: mlx5_0/1 InfiniBand, mlx5_1/1 InfiniBand, mlx5_4/1 InfiniBand" == found[0].evidence[1].observed
    down = rdma(hca("mlx5_0"), hca("mlx5_1"), hca("mlx5_2"), hca("mlx5_3", port(state=1, phys=2)))
    assert subjects(ib_odd_nic_count_rail_hang(down, job())) == {"node"}


def test_ib003_absent_not_applicable_and_unknown() -> None:
    assert list(ib_odd_nic_count_rail_hang(eight(), job())) == []
    assert list(ib_odd_nic_count_rail_hang(eight(), job({"NCCL_IB_HCA": "=mlx5_0,mlx5_1"}))) == []
    with pytest.raises(NotApplicable):
        list(ib_odd_nic_count_rail_hang(rdma(hca("efa_0", port(link_layer="Unknown"), efa=True)), job()))
    unreadable = port(link_layer=None, problems=(Problem("/sys/class/infiniband/mlx5_5/ports/1/link_layer", "unparseable 'IB'"),))
    with pytest.raises(Unknown, match="unparseable 'IB'"):
        list(ib_odd_nic_count_rail_hang(eight(mlx5_5=unreadable), job()))


@pytest.mark.parametrize("where", [job({"NCCL_IB_DISABLE": "1"}), job(conf={"NCCL_NET": "Socket"})])
def test_ib003_ib004_ib005_not_applicable_where_nccls_ib_transport_is_off(where: JobFacts) -> None:
    """NCCL never opens an RDMA device then (ncclIbInit returns first): three ports, a prefix that
    selects too much or names out of PCI order are not NCCL's business."""
    three = rdma(hca("mlx5_0"), hca("mlx5_1"), hca("mlx5_2", bus=0x9c), hca("mlx5_3", port(state=1, phys=2), bus=0x5f))
    conf = JobFacts(where.environ, "", (NcclConfFile("/etc/nccl.conf", (*where.nccl_conf_files[0].entries, ("NCCL_IB_HCA", "mlx5_1,mlx5_3"))),))
    for verdict in (lambda: ib_odd_nic_count_rail_hang(three, where), lambda: ib_hca_selection_mismatch(twelve(), conf),
                    lambda: ib_device_order_differs_across_nodes(shuffled(), where, OLD_NCCL)):
        with pytest.raises(NotApplicable, match="NCCL_IB_DISABLE=1|NCCL_NET=Socket"):
            list(verdict())


# -- IB005 ------------------------------------------------------------------------------------
def shuffled() -> RdmaFacts:
    """mlx5_2 sits on a later bus than mlx5_3."""
    return rdma(hca("mlx5_0"), hca("mlx5_1"), hca("mlx5_2", bus=0x9c), hca("mlx5_3", bus=0x5f))


def nccl(*versions: str | None) -> NcclLibFacts:
    return NcclLibFacts(tuple(NcclCopy(f"/usr/lib/x86_64-linux-gnu/libnccl.so.{i}", v, "system") for i, v in enumerate(versions)), ())


OLD_NCCL = nccl("2.21.5")


def test_ib005_present_with_severity_by_setting() -> None:
    unset = list(ib_device_order_differs_across_nodes(shuffled(), job(), OLD_NCCL))
    assert [(o.subject, o.severity) for o in unset] == [("node", Severity.WARNING)]
    assert unset[0].evidence[0].expected == "names numbered in PCI address order: mlx5_0, mlx5_1, mlx5_3, mlx5_2"
    assert unset[0].evidence[2].observed == "NCCL 2.21.5" and unset[0].evidence[2].expected == "2.29.7 or later"
    forced = list(ib_device_order_differs_across_nodes(shuffled(), job({"NCCL_IB_DEVICE_PCI_ORDER": "0"}), nccl("2.30.7")))
    assert [(o.subject, o.severity) for o in forced] == [("node", None)]


def test_ib005_names_made_from_pci_addresses_list_alike_on_alike_nodes() -> None:
    """rdma-core's persistent names (NAME_PCI: "rocep1s0f1", "roceP2p1s0f1" with a PCI domain, as
    on a DGX Spark) are the PCI address: however they sort, alike nodes sort them alike. GUID-based
    names are not, and kernel names are judged as before."""
    def named(first: str, second: str) -> RdmaFacts:
        return rdma(replace(hca("mlx5_0", bus=0x01), name=first), replace(hca("mlx5_1", bus=0x01), name=second, pci_address="0002:01:00.1"))
    assert list(ib_device_order_differs_across_nodes(named("rocep1s0f1", "roceP2p1s0f1"), job(), OLD_NCCL)) == []
    assert [o.severity for o in ib_device_order_differs_across_nodes(named("mlx5_1", "mlx5_0"), job(), OLD_NCCL)] == [Severity.WARNING]


def test_ib005_unset_order_is_fine_where_every_nccl_sorts_by_pci_address() -> None:
    """NCCL 2.29.7 made NCCL_IB_DEVICE_PCI_ORDER=1 the default: a node whose NCCL copies are all that
    recent numbers its devices the same way as its siblings whatever the kernel named them."""
    assert list(ib_device_order_differs_across_nodes(shuffled(), job(), nccl("2.29.7", "2.30.7"))) == []
    # One older copy, one whose release is not named, or none found (NCCL may come with the job's
    # container): the names still decide.
    unreadable = NcclLibFacts(nccl("2.30.7").copies, ("/opt/nccl/lib: permission denied",))
    for libs in (nccl("2.30.7", "2.27.3"), nccl("2.30.7", None), nccl(), unreadable):
        assert [o.severity for o in ib_device_order_differs_across_nodes(shuffled(), job(), libs)] == [Severity.WARNING]


def test_ib005_a_network_plugin_keeps_the_verbs_librarys_order() -> None:
    """HPC-X's nccl-rdma-sharp plugin does not sort devices by PCI address, nor read
    NCCL_IB_DEVICE_PCI_ORDER: where it loads, a recent NCCL's sort does not help."""
    plugin = replace(nccl("2.29.7"), net_plugins=("/opt/hpcx/nccl_rdma_sharp_plugin/lib/libnccl-net.so",))
    for environ in ({}, {"NCCL_IB_DEVICE_PCI_ORDER": "1"}):
        [found] = ib_device_order_differs_across_nodes(shuffled(), job(environ), plugin)
        assert found.severity is Severity.WARNING and found.evidence[1].source.endswith("libnccl-net.so")
    assert list(ib_device_order_differs_across_nodes(shuffled(), job({"NCCL_NET": "IB"}), plugin)) == []


def test_ib005_absent_in_order_when_sorted_or_when_the_odd_device_is_not_selected() -> None:
    assert list(ib_device_order_differs_across_nodes(eight(), job(), OLD_NCCL)) == []
    assert list(ib_device_order_differs_across_nodes(shuffled(), job({"NCCL_IB_DEVICE_PCI_ORDER": "1"}), OLD_NCCL)) == []
    assert list(ib_device_order_differs_across_nodes(shuffled(), job({"NCCL_IB_HCA": "^=mlx5_2"}), OLD_NCCL)) == []


def test_ib005_not_applicable_and_unknown() -> None:
    with pytest.raises(NotApplicable):
        list(ib_device_order_differs_across_nodes(rdma(), job(), OLD_NCCL))
    link = Problem("/sys/class/infiniband/mlx5_3/device", "not a PCI function: 'garbage'")
    broken = replace(shuffled(), devices=shuffled().devices[:3] + (replace(shuffled().devices[3], pci_address=None, problems=(link,)),))
    with pytest.raises(Unknown, match="not a PCI function"):
        list(ib_device_order_differs_across_nodes(broken, job(), OLD_NCCL))


# -- EFA001 -----------------------------------------------------------------------------------
EFA_NODE = rdma(*(hca(f"rdmap{16 * (i + 1)}s27", port(link_layer="Unknown", lid=0, sm_lid=0), efa=True, hca_type=None) for i in range(4)))
LIBS = EfaFacts(("/opt/amazon/efa/lib", "/opt/amazon/ofi-nccl/lib"),
                ("/opt/amazon/efa/lib/libfabric.so.1", "/opt/amazon/ofi-nccl/lib/libnccl-net.so", "/opt/amazon/ofi-nccl/lib/libnccl-net-ofi.so"), ())


def test_efa001_present_for_provider_net_and_plugin_settings() -> None:
    bad = job({"FI_PROVIDER": "tcp", "NCCL_NET": "Socket"}, conf={"NCCL_NET_PLUGIN": "none"})
    found = list(efa_provider_unavailable(EFA_NODE, LIBS, bad))
    assert subjects(found) == {"FI_PROVIDER", "NCCL_NET", "NCCL_NET_PLUGIN"}
    assert next(o for o in found if o.subject == "NCCL_NET_PLUGIN").evidence[1].source == "/etc/nccl.conf NCCL_NET_PLUGIN"


def test_efa001_an_empty_plugin_setting_depends_on_the_nccl_release() -> None:
    """NCCL_NET_PLUGIN set but empty: up to 2.26 NCCL loads libnccl-net.so, from 2.27 no plugin at all."""
    (found,) = efa_provider_unavailable(EFA_NODE, LIBS, job({"NCCL_NET_PLUGIN": ""}))
    assert (found.subject, found.status) == ("NCCL_NET_PLUGIN", Status.UNKNOWN) and "2.27 and later load no plugin" in found.reason


def test_efa001_present_warning_for_missing_libraries() -> None:
    found = list(efa_provider_unavailable(EFA_NODE, replace(LIBS, libraries=()), job()))
    assert [(o.subject, o.severity) for o in found] == [("aws-ofi-nccl", Severity.WARNING), ("libfabric", Severity.WARNING)]
    named = list(efa_provider_unavailable(EFA_NODE, LIBS, job({"NCCL_NET_PLUGIN": "aws-ofi"})))
    assert subjects(named) == {"aws-ofi-nccl"} and "libnccl-net-aws-ofi.so" in named[0].evidence[1].observed


def test_efa001_absent_with_plugin_and_efa_provider() -> None:
    assert list(efa_provider_unavailable(EFA_NODE, LIBS, job({"FI_PROVIDER": "efa"}))) == []
    # libfabric's '^' lists the providers not to use: efa stays allowed unless it is listed.
    assert list(efa_provider_unavailable(EFA_NODE, LIBS, job({"FI_PROVIDER": "^tcp,sockets"}))) == []
    assert subjects(efa_provider_unavailable(EFA_NODE, LIBS, job({"FI_PROVIDER": "^efa"}))) == {"FI_PROVIDER"}
    assert list(efa_provider_unavailable(EFA_NODE, LIBS, job({"NCCL_NET_PLUGIN": "ofi"}))) == []
    assert list(efa_provider_unavailable(EFA_NODE, LIBS, job({"NCCL_NET_PLUGIN": "/opt/amazon/ofi-nccl/lib/libnccl-net.so"}))) == []


def test_efa001_a_plugin_the_loader_does_not_search_for_is_missing() -> None:
    """NCCL dlopens libnccl-net.so by bare name: aws-ofi-nccl left in /opt/amazon/ofi-nccl/lib
    without its ld.so.conf.d entry or the job's LD_LIBRARY_PATH is not found (NCCL falls back to
    sockets); named by its path, it is. libfabric is found through the plugin's RPATH."""
    unsearched = replace(LIBS, loader_dirs=("/usr/lib/x86_64-linux-gnu", "/usr/lib"))
    found = list(efa_provider_unavailable(EFA_NODE, unsearched, job({"FI_PROVIDER": "efa"})))
    assert [(o.subject, o.severity) for o in found] == [("aws-ofi-nccl", Severity.WARNING)]
    path = job({"FI_PROVIDER": "efa", "NCCL_NET_PLUGIN": "/opt/amazon/ofi-nccl/lib/libnccl-net.so"})
    assert list(efa_provider_unavailable(EFA_NODE, unsearched, path)) == []
    searched = replace(LIBS, loader_dirs=("/opt/amazon/ofi-nccl/lib/", "/usr/lib"))
    assert list(efa_provider_unavailable(EFA_NODE, searched, job({"FI_PROVIDER": "efa"}))) == []


def test_efa001_not_applicable_and_unknown() -> None:
    with pytest.raises(NotApplicable):
        list(efa_provider_unavailable(eight(), None, job()))
    unreadable = EfaFacts(LIBS.library_dirs, (), ("/opt/amazon/ofi-nccl/lib: too many levels of symbolic links (ELOOP)",))
    found = list(efa_provider_unavailable(EFA_NODE, unreadable, job()))
    assert subjects(found, Status.UNKNOWN) == {"aws-ofi-nccl", "libfabric"} and "ELOOP" in found[0].reason


def test_plugin_names_and_ld_so_conf() -> None:
    assert plugin_names(None) == ["libnccl-net.so"]
    assert plugin_names(Setting("ofi,libfoo.so", "environment")) == ["ofi", "libnccl-net-ofi.so", "libfoo.so"]
    assert plugin_names(Setting("NONE", "environment")) is None
    assert parse_ld_so_conf("# comment\ninclude /etc/ld.so.conf.d/*.conf\n/opt/lib\n") == (["/opt/lib"], ["/etc/ld.so.conf.d/*.conf"])


def test_roce002_names_a_passed_over_roce_device_not_an_infiniband_one() -> None:
    """An HGX B300's baseboard NVSwitch management functions are InfiniBand devices that NCCL's
    topology search also passes over: the reason why no RoCE port is used names a RoCE device."""
    from preflight.checks.roce import _no_roce

    facts = rdma(hca("mlx5_0"), hca("mlx5_12", port(link_layer="Ethernet")))
    passed = {"mlx5_0": "mlx5_0 is passed over by NCCL's topology search", "mlx5_12": "mlx5_12 is passed over by NCCL's topology search"}
    reason = _no_roce(facts, nccl_selection(facts, job(), passed))
    assert reason == "no ACTIVE RoCE port NCCL would use: mlx5_12 is passed over by NCCL's topology search"


def test_ib009_hcas_on_the_bus_with_no_rdma_device(node_copy: Path) -> None:
    """After an MLNX_OFED upgrade whose mlx5_ib the loaded ib_core refuses, the ConnectX-7 HCAs
    (class 0x0207) stay on the bus but /sys/class/infiniband is empty: NCCL finds no device and
    runs on sockets. A function given to vfio-pci (a VM's) or a virtual function is no such HCA."""
    import os
    import shutil

    from preflight.checks.ib import rdma_stack_or_ports_misconfigured
    from preflight.config import Expectations
    from preflight.probes.rdma import probe_rdma
    from preflight.sources import NodeFS

    for entry in (node_copy / "sys/class/infiniband").iterdir():
        entry.unlink()
    for function in (node_copy / "sys/devices").rglob("infiniband"):
        shutil.rmtree(function)
    hcas = sorted(path.parent for path in (node_copy / "sys/devices").rglob("class") if path.read_text().startswith("0x0207"))
    assert hcas
    for hca in hcas:
        os.symlink("../../../../bus/pci/drivers/mlx5_core", hca / "driver")
    facts = probe_rdma(NodeFS(str(node_copy)))  # mlx5_core loaded, mlx5_ib not (the example has none)
    assert facts.devices == () and len(facts.hcas_without_device) == len(hcas)
    [found] = rdma_stack_or_ports_misconfigured(facts, Expectations(), JobFacts({}, "", ()))
    assert found.status is Status.PRESENT and found.severity is None and "openibd restart" in found.fix
    assert found.evidence[1].source == "/sys/module/mlx5_ib" and "not loaded" in found.evidence[1].observed
    (node_copy / "sys/module/mlx5_ib").mkdir()  # loaded: the devices' absence is another matter
    assert probe_rdma(NodeFS(str(node_copy))).hcas_without_device == ()
    (node_copy / "sys/module/mlx5_ib").rmdir()
    for hca in hcas:  # every HCA handed to a virtual machine
        (hca / "driver").unlink()
        os.symlink("../../../../bus/pci/drivers/vfio-pci", hca / "driver")
    facts = probe_rdma(NodeFS(str(node_copy)))
    assert facts.hcas_without_device == ()
    with pytest.raises(NotApplicable, match="no RDMA devices"):
        list(rdma_stack_or_ports_misconfigured(facts, Expectations(), JobFacts({}, "", ())))
    # Missing is not empty: a function whose class cannot be read may be such an HCA.
    gpu_class = next(path for path in (node_copy / "sys/devices").rglob("class") if path.read_text().startswith("0x0302"))
    gpu_class.unlink()
    gpu_class.mkdir()  # not a file: its read fails
    assert probe_rdma(NodeFS(str(node_copy))).hcas_without_device is None
    gpu_class.rmdir()
    gpu_class.write_text("0x030200\n")
    # And without the PCI bus the HCAs mlx5_core drives are not known at all.
    shutil.rmtree(node_copy / "sys/bus/pci/devices")
    facts = probe_rdma(NodeFS(str(node_copy)))
    assert facts.hcas_without_device is None
    with pytest.raises(Unknown, match="PCI bus .or a function's class or driver. could not be read"):
        list(rdma_stack_or_ports_misconfigured(facts, Expectations(), JobFacts({}, "", ())))


def test_a_port_awaiting_the_subnet_manager_gets_the_subnet_managers_fix(node_copy: Path) -> None:
    """mlx5_3's link trained (LinkUp) but the SM has not swept it (INIT): IB008 names the cause;
    IB004 (NCCL_IB_HCA names the port) and IB009 (a data port not ACTIVE) report it too, and their
    fix must point at the SM, not at the node's verbs user space or its NCCL_IB_HCA."""
    from preflight.config import Expectations
    from preflight.probes.rdma import probe_rdma
    from preflight.sources import NodeFS

    port = node_copy / "sys/devices/pci0000:5a/0000:5a:01.0/0000:5c:00.0/0000:5f:00.0/infiniband/mlx5_3/ports/1"
    (port / "state").write_text("2: INIT\n")
    facts = probe_rdma(NodeFS(str(node_copy)))
    hcas = {"NCCL_IB_HCA": "=mlx5_0:1,mlx5_1:1,mlx5_2:1,mlx5_3:1"}
    ib004 = [o for o in ib_hca_selection_mismatch(facts, job(conf=hcas)) if o.subject == "mlx5_3/1"]
    ib009 = [o for o in rdma_stack_or_ports_misconfigured(facts, Expectations(), job(conf=hcas)) if o.subject == "mlx5_3/1"]
    assert ib004 and ib009
    assert all(o.status is Status.PRESENT and o.fix.startswith("The link is up but the subnet manager") for o in ib004 + ib009)
    (port / "phys_state").write_text("2: Polling\n")  # no link: a cable or switch port, not the SM
    facts = probe_rdma(NodeFS(str(node_copy)))
    ib009 = [o for o in rdma_stack_or_ports_misconfigured(facts, Expectations(), job(conf=hcas)) if o.subject == "mlx5_3/1"]
    assert ib009 and not ib009[0].fix.startswith("The link is up")


def test_rdma_probe_looks_for_a_container_only_where_a_node_is_missing(node_copy: Path) -> None:
    from preflight.probes.rdma import probe_rdma
    from preflight.sources import NodeFS

    assert probe_rdma(NodeFS(str(node_copy))).container == ""  # every node there: not asked
    (node_copy / "etc/hosts").write_text("# Kubernetes-managed hosts file.\n127.0.0.1\tlocalhost\n")
    assert probe_rdma(NodeFS(str(node_copy))).container == ""
    (node_copy / "dev/infiniband/uverbs3").unlink()
    assert probe_rdma(NodeFS(str(node_copy))).container == "/etc/hosts (kubelet's)"
