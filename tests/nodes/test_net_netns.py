"""Integration: the network checks inside real network namespaces with real topologies.

Each test creates its own namespace with pyroute2, builds links, addresses, routes, policy rules
and sysctls in it, runs the installed ``preflight node --select NET`` inside it (a small wrapper
``setns()``-es into the namespace, then execs the CLI) and asserts the verdicts. Only the test's
own namespaces are touched; finalizers remove them. Needs root (CAP_SYS_ADMIN); skipped otherwise.

Inside a namespace every link is virtual, so the "real NICs" here are macvlan devices on top of
a veth whose peer stays in the namespace: macvlan is not a kind NET001 treats as virtual (SR-IOV
and Multus pods use it for their data network).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from netns_lab import RECORD, Namespace, evidence_text, finding, namespace, present, two_rails_in_one_subnet, verdicts

pytestmark = pytest.mark.integration

# setns() into the named namespace (never create one), then become the command.
# What a recording of a namespace needs: links, addresses and every route lookup the probes make.


@pytest.fixture
def ns(tmp_path: Path) -> Iterator[Namespace]:
    with namespace("net", tmp_path) as made:
        yield made


# -- NET001 -------------------------------------------------------------------------------------
def test_docker_bridge_is_picked_when_it_is_the_only_running_interface(ns: Namespace) -> None:
    ns.ipr.link("add", ifname="docker0", kind="bridge")
    ns.ipr.link("add", ifname="vethd0", kind="veth", peer="vethd1")
    ns.ipr.link("set", index=ns.index("vethd0"), master=ns.index("docker0"))
    ns.up("docker0", "vethd0", "vethd1")  # a port with carrier makes the bridge RUNNING
    ns.addr("docker0", "172.17.0.1/16")
    ns.nic("eno1", "10.0.0.2/24", up=False)  # the real NIC is down
    report = ns.preflight()
    assert ("NET001", "docker0") in present(report)
    assert "'docker' prefix" in evidence_text(finding(report, "NET001", "docker0"))
    assert report["facts"]["nccl_socket"]["bootstrap"]["interfaces"][0]["address"] == "172.17.0.1"

    ns.up("eno1")
    report = ns.preflight()
    assert verdicts(report)[("NET001", "node")] == "absent"
    assert report["facts"]["nccl_socket"]["bootstrap"]["interfaces"][0]["ifname"] == "eno1"


def test_flannel_vxlan_wins_when_no_ib_and_is_listed_first(ns: Namespace) -> None:
    ns.ipr.link("add", ifname="flannel.1", kind="vxlan", vxlan_id=1, vxlan_port=8472)
    ns.up("flannel.1")
    ns.addr("flannel.1", "10.244.0.0/32")
    ns.nic("eth0", "10.0.0.2/24")  # created later: higher ifindex, so flannel.1 comes first
    report = ns.preflight()
    assert ("NET001", "flannel.1") in present(report)
    # An exact NCCL_SOCKET_IFNAME repairs it.
    report = ns.preflight({"NCCL_SOCKET_IFNAME": "=eth0"})
    assert verdicts(report)[("NET001", "node")] == "absent"


def test_container_side_veth_and_prefix_that_matches_a_veth(ns: Namespace) -> None:
    ns.ipr.link("add", ifname="eth0", kind="veth", peer="veth9f3a")
    ns.up("eth0", "veth9f3a")
    ns.addr("eth0", "172.17.0.2/16")  # the container end of Docker's default bridge network
    report = ns.preflight()
    assert "veth pair" in evidence_text(finding(report, "NET001", "eth0"))
    ns.addr("veth9f3a", "10.1.0.1/24")
    report = ns.preflight({"NCCL_SOCKET_IFNAME": "^eth"})  # excluding eth leaves the veth
    assert ("NET001", "veth9f3a") in present(report)


def test_loopback_is_the_last_resort(ns: Namespace) -> None:
    report = ns.preflight()
    item = finding(report, "NET001", "lo")
    assert item["status"] == "present" and "loopback" in evidence_text(item) and "'lo' prefix" in evidence_text(item)


def test_ipv4_link_local_interface_listed_before_the_data_nic(ns: Namespace) -> None:
    ns.nic("pod-id-link0", "169.254.170.23/32")  # created first: NCCL meets it before eno1
    ns.nic("eno1", "10.0.0.2/24")
    report = ns.preflight({"NCCL_IB_DISABLE": "1"})
    item = finding(report, "NET001", "pod-id-link0")
    assert item["status"] == "present" and "IPv4 link-local address" in evidence_text(item)
    report = ns.preflight({"NCCL_IB_DISABLE": "1", "NCCL_SOCKET_IFNAME": "=eno1"})
    assert verdicts(report)[("NET001", "node")] == "absent"


# -- NET002 / NET003 ----------------------------------------------------------------------------
def test_link_local_only_interface_in_the_socket_transport(ns: Namespace) -> None:
    ns.nic("eno1", "10.0.0.2/24")
    ns.nic("ens2")
    ns.sysctl(ipv6__conf__ens2__disable_ipv6="0")  # the kernel gives it a fe80:: address, nothing else
    env = {"NCCL_IB_DISABLE": "1"}
    report = ns.preflight(env)
    item = finding(report, "NET003", "ens2")
    assert item["status"] == "present" and "socket transport device 1" in evidence_text(item) and "fe80::" in evidence_text(item)
    assert verdicts(report)[("NET001", "node")] == "absent"
    # Bootstrap on it explicitly: the same finding names bootstrap.
    report = ns.preflight({**env, "NCCL_SOCKET_IFNAME": "=ens2"})
    assert "bootstrap: ens2:fe80::" in evidence_text(finding(report, "NET003", "ens2"))
    # Forcing IPv4 takes it out of the list.
    report = ns.preflight({**env, "NCCL_SOCKET_FAMILY": "AF_INET"})
    assert verdicts(report)[("NET003", "node")] == "absent"


def test_global_ipv6_only_pick_and_ipv6_forced_where_it_is_disabled(ns: Namespace) -> None:
    ns.nic("eno1")
    ns.sysctl(ipv6__conf__eno1__disable_ipv6="0")
    ns.addr("eno1", "2001:db8:10::2/64")
    report = ns.preflight()
    assert verdicts(report)[("NET002", "node")] == "absent"  # addressed in IPv6 only: its peers are too
    assert verdicts(report)[("NET003", "node")] == "absent"  # global first: no link-local pick
    ns.nic("eno2", "10.0.0.2/24")
    report = ns.preflight({"NCCL_SOCKET_IFNAME": "=eno1"})
    item = finding(report, "NET002", "eno1")
    assert item["status"] == "present" and item["severity"] == "warning" and "2001:db8:10::2" in evidence_text(item)
    assert verdicts(ns.preflight({"NCCL_SOCKET_IFNAME": "=eno1", "NCCL_SOCKET_FAMILY": "AF_INET6"}))[("NET002", "node")] == "absent"

    ns.sysctl(ipv6__conf__all__disable_ipv6="1")
    report = ns.preflight({"NCCL_SOCKET_FAMILY": "AF_INET6", "MASTER_ADDR": "2001:db8:10::1"})
    assert {("NET002", "NCCL_SOCKET_FAMILY"), ("NET002", "MASTER_ADDR")} <= present(report)
    assert finding(report, "NET002", "NCCL_SOCKET_FAMILY")["severity"] == "error"
    # With IPv6 off and AF_INET6 forced nothing is selectable: NET005 says so too.
    assert ("NET005", "NCCL_SOCKET_IFNAME") not in present(report) and ("NET005", "node") in present(report)


# -- NET005 -------------------------------------------------------------------------------------
def test_socket_ifname_that_matches_nothing_or_a_down_interface(ns: Namespace) -> None:
    ns.nic("eno1", "10.0.0.2/24")
    ns.nic("ens9f0", "10.1.0.2/24", up=False)
    report = ns.preflight({"NCCL_SOCKET_IFNAME": "=eth9,ens9f0"})
    item = finding(report, "NET005", "NCCL_SOCKET_IFNAME")
    assert item["status"] == "present"
    text = evidence_text(item)
    assert "eth9: no such interface" in text and "ens9f0 is down" in text
    assert verdicts(ns.preflight({"NCCL_SOCKET_IFNAME": "eno"}))[("NET005", "node")] == "absent"
    # One character is ignored by NCCL: a warning, and the default choice applies.
    item = finding(ns.preflight({"NCCL_SOCKET_IFNAME": "e"}), "NET005", "NCCL_SOCKET_IFNAME")
    assert item["severity"] == "warning"


def test_peer_routed_through_another_interface_than_nccls_pick(ns: Namespace) -> None:
    ns.nic("ib0", "192.168.50.2/24")  # an IPoIB-style name NCCL prefers
    ns.nic("eno1", "10.0.0.2/24")
    report = ns.preflight({"MASTER_ADDR": "10.0.0.9"})
    item = finding(report, "NET005", "ib0")
    assert item["severity"] == "warning" and "10.0.0.9: dev eno1" in evidence_text(item)
    assert verdicts(report)[("NET004", "node")] == "absent"
    # Chosen on purpose: reported quietly.
    report = ns.preflight({"MASTER_ADDR": "10.0.0.9", "NCCL_SOCKET_IFNAME": "=ib0"})
    assert finding(report, "NET005", "ib0")["severity"] == "info"


# -- NET004 -------------------------------------------------------------------------------------
def test_unreachable_peers_no_route_unreachable_route_and_policy_route(ns: Namespace) -> None:
    ns.nic("eno1", "10.0.0.2/24")
    ns.nic("ens2", "10.2.0.2/24")
    ns.ipr.route("add", dst="10.98.0.0/16", type="unreachable")
    config = '[expect]\npeers = ["10.98.1.1", "10.0.0.7", "10.77.0.1"]\n'
    report = ns.preflight({"MASTER_ADDR": "10.99.0.1"}, config)
    assert {("NET004", "10.99.0.1"), ("NET004", "10.98.1.1"), ("NET004", "10.77.0.1")} == {
        key for key in present(report) if key[0] == "NET004"
    }
    assert "ENETUNREACH" in evidence_text(finding(report, "NET004", "10.99.0.1"))
    assert "EHOSTUNREACH" in evidence_text(finding(report, "NET004", "10.98.1.1"))
    # A policy rule sends 10.77.0.0/16 through its own table: reachable now.
    ns.ipr.route("add", dst="10.77.0.0/16", gateway="10.2.0.1", table=200)
    ns.ipr.rule("add", table=200, priority=1000, dst="10.77.0.0", dst_len=16)
    report = ns.preflight({"MASTER_ADDR": "10.99.0.1"}, config)
    assert ("NET004", "10.77.0.1") not in present(report) and ("NET004", "10.99.0.1") in present(report)


def test_hostlist_peers_resolve_from_etc_hosts_of_the_live_node(ns: Namespace) -> None:
    ns.nic("eno1", "10.0.0.2/24")
    report = ns.preflight({"SLURM_JOB_NODELIST": "localhost"})
    assert verdicts(report)[("NET004", "node")] == "absent"
    peer = report["facts"]["routing"]["peers"][0]
    assert peer["name"] == "localhost" and peer["resolved_by"].startswith("/etc/hosts:")


# -- multi-rail ---------------------------------------------------------------------------------


def test_strict_rp_filter_on_same_subnet_rails_without_source_routing(ns: Namespace) -> None:
    two_rails_in_one_subnet(ns)
    report = ns.preflight()
    item = finding(report, "NET005", "ens2f0")
    assert item["severity"] == "error"
    assert "effective 1: strict" in evidence_text(item) and "from 10.50.0.3: dev ens1f0" in evidence_text(item)
    arp = finding(report, "NET005", "ens1f0")  # its replies go out of itself, but ARP still floats
    assert arp["severity"] == "warning" and "arp_ignore" in evidence_text(arp)


def test_source_routing_and_arp_settings_repair_same_subnet_rails(ns: Namespace) -> None:
    two_rails_in_one_subnet(ns)
    for table, (ifname, address) in enumerate((("ens1f0", "10.50.0.2"), ("ens2f0", "10.50.0.3")), 101):
        ns.ipr.route("add", dst="10.50.0.0/24", oif=ns.index(ifname), prefsrc=address, table=table)
        ns.ipr.rule("add", table=table, priority=table, src=address, src_len=32)
    ns.sysctl(ipv4__conf__all__arp_ignore="1", ipv4__conf__all__arp_announce="2")
    report = ns.preflight()
    assert verdicts(report)[("NET005", "node")] == "absent", report["findings"]


def test_loose_rp_filter_is_fine_but_the_interface_value_counts_when_larger(ns: Namespace) -> None:
    two_rails_in_one_subnet(ns)
    ns.sysctl(ipv4__conf__all__rp_filter="0", ipv4__conf__all__arp_ignore="1", ipv4__conf__all__arp_announce="2")
    assert verdicts(ns.preflight())[("NET005", "node")] == "absent"
    ns.sysctl(ipv4__conf__ens2f0__rp_filter="1")  # max(all, interface) = 1
    assert ("NET005", "ens2f0") in present(ns.preflight())


# -- a recording of the namespace replays to the same verdicts ------------------------------------
def test_recorded_namespace_replays_to_the_same_findings(ns: Namespace, tmp_path: Path) -> None:
    two_rails_in_one_subnet(ns)
    ns.nic("docker0", "172.17.0.1/16")
    ns.ipr.route("add", dst="10.98.0.0/16", type="unreachable")
    env = {"MASTER_ADDR": "10.98.0.5", "NCCL_SOCKET_IFNAME": "^ens"}
    config = '[expect]\npeers = ["10.50.0.9", "10.60.0.1"]\n'
    live = ns.preflight(env, config)

    root = tmp_path / "root"
    recording = ns.python(RECORD, "10.50.0.9", "10.60.0.1", env=env)
    (root / ".preflight").mkdir(parents=True)
    (root / ".preflight" / "netlink.json").write_text(recording)
    (root / "proc" / "self").mkdir(parents=True)
    for unit in ("etc", "sys/class", "usr/lib"):  # captured, without nccl.conf, RDMA devices or NCCL plugin
        (root / unit).mkdir(parents=True)
    (root / "proc" / "self" / "environ").write_bytes(b"".join(f"{k}={v}\0".encode() for k, v in env.items()))
    for knob in ("rp_filter", "arp_ignore", "arp_announce"):
        for ifname in ("all", "ens1f0", "ens2f0"):
            value = ns.python(f"print(open('/proc/sys/net/ipv4/conf/{ifname}/{knob}').read().strip())")
            path = root / "proc" / "sys" / "net" / "ipv4" / "conf" / ifname / knob
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(value)
    replayed = ns.preflight(config=config, root=str(root))

    assert {("NET001", "docker0"), ("NET004", "10.98.0.5"), ("NET004", "10.60.0.1"), ("NET005", "ens2f0")} <= present(live)
    assert verdicts(replayed) == verdicts(live)
    assert [f["evidence"] for f in replayed["findings"]] == [f["evidence"] for f in live["findings"]]


def test_ethtool_ioctl_reads_real_driver_statistics(ns: Namespace) -> None:
    """The pause-storm source asks the kernel as ethtool -S does: veth's statistics name the peer's
    ifindex; veth and loopback have no pause counters and no stall watchdog; a missing device is
    a clear error."""
    ns.ipr.link("add", ifname="st-a", kind="veth", peer="st-b")
    peer = ns.index("st-b")
    code = (
        "import json\n"
        "from preflight.sources.ethtool import driver_statistics, query_pause\n"
        "from preflight.sources import SourceError\n"
        "stats = dict(driver_statistics('st-a'))\n"
        "states = [query_pause(name) for name in ('st-a', 'lo')]\n"
        "try:\n    query_pause('st-none')\n    missing = ''\nexcept SourceError as error:\n    missing = str(error)\n"
        "print(json.dumps({'peer': stats.get('peer_ifindex'), 'states': [[s.counters, s.prevention_timeout_ms] for s in states], 'missing': missing}))\n"
    )
    answer = json.loads(ns.python(code))
    assert answer["peer"] == peer
    assert answer["states"] == [[[], None], [[], None]]
    assert "st-none" in answer["missing"] and "No such device" in answer["missing"]
