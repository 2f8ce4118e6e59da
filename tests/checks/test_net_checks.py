"""Layer 3 for NET001-NET005: each check on facts built by its probe from small hand-made roots
(a job environment, ``/etc/nccl.conf`` and a netlink recording), varied with ``replace``."""

from __future__ import annotations

import os

import json
from msgspec.structs import replace
from pathlib import Path
from typing import Any

import pytest

from preflight.probes.job import probe_job
from preflight.probes.job import Setting
from preflight.probes.routing import Peer, RailMember, RoutingFacts, Sysctl, probe_routing
from preflight.checks.net import nccl_socket_network_unreachable, nccl_wrong_socket_interface
from preflight.probes.nccl_libs import NcclCopy, NcclLibFacts
from preflight.probes.nccl_socket import NcclSocketFacts, probe_nccl_socket
from preflight.checks.net import ipv6_address_family_mismatch, nccl_proxy_connect_ipv6_link_local, nccl_virtual_interface_selected
from preflight.config import Expectations, HostConfig
from preflight.model import NOT_GIVEN, Evidence, NotApplicable, Observation, Severity, Status, Unread, merge_by_subject, present, undecided
from preflight.sources import NodeFS
from preflight.sources.dns import ReplayDns
from preflight.sources.netlink import ReplayNetlink
from preflight.sources.routes import Route

NO_NCCL = NcclLibFacts((), ())  # no NCCL on the node: nothing to judge of older releases
LO = {"name": "lo", "index": 1, "mtu": 65536, "operstate": "unknown", "link_type": "loopback", "kind": "", "master": "", "mac": ""}


def nic(name: str, index: int, kind: str = "", state: str = "up") -> dict[str, Any]:
    return {"name": name, "index": index, "mtu": 1500, "operstate": state, "link_type": "ether", "kind": kind, "master": "", "mac": ""}


def ip(ifname: str, text: str, scope: str = "global") -> dict[str, Any]:
    host, _, length = text.partition("/")
    return {"ifname": ifname, "family": 6 if ":" in host else 4, "address": host, "prefixlen": int(length), "scope": scope}


class Node:
    """A tiny recorded root: environment, nccl.conf, files, and a netlink recording."""

    def __init__(self, tmp_path: Path) -> None:
        self.root = tmp_path / "root"
        self.root.mkdir(parents=True)
        self.links: list[dict[str, Any]] = [LO]
        self.addresses: list[dict[str, Any]] = [ip("lo", "127.0.0.1/8", "host"), ip("lo", "::1/128", "host")]
        self.routes: dict[str, Any] = {}
        self.file("/proc/sys/kernel/hostname", "node1\n")
        # What every node has: an /etc (here without nccl.conf) and a job environment (empty)
        self.file("/etc/hostname", "node1\n")
        self.env()
        (self.root / "sys" / "class").mkdir(parents=True)  # no RDMA class: no RDMA devices
        (self.root / "usr" / "lib").mkdir(parents=True)  # libraries recorded: no NCCL network plugin

    def file(self, path: str, text: str | bytes) -> None:
        full = self.root / path.lstrip("/")
        full.parent.mkdir(parents=True, exist_ok=True)
        full.write_bytes(text if isinstance(text, bytes) else text.encode())

    def env(self, **values: str) -> None:
        self.file("/proc/self/environ", b"".join(f"{k}={v}\0".encode() for k, v in values.items()))

    def add(self, name: str, index: int, *addresses: str, kind: str = "", state: str = "up") -> None:
        self.links.append(nic(name, index, kind, state))
        for text in addresses:
            self.addresses.append(ip(name, text, "link" if text.startswith("fe80") else "global"))

    def rdma(self) -> None:
        self.file("/sys/class/infiniband/mlx5_0/ports/1/state", "4: ACTIVE\n")

    def netlink(self) -> ReplayNetlink:
        return ReplayNetlink({"links": self.links, "addresses": self.addresses, "routes": self.routes})

    def socket(self) -> NcclSocketFacts:
        fs = NodeFS(str(self.root))
        return probe_nccl_socket(fs, self.netlink(), probe_job(fs))

    def routing(self, peers: tuple[str, ...] = (), dns: dict[str, Any] | None = None) -> RoutingFacts:
        config = HostConfig(expect=Expectations(peers=peers))
        fs = NodeFS(str(self.root))
        return probe_routing(fs, self.netlink(), ReplayDns({"answers": dns or {}}), config, probe_job(fs))


@pytest.fixture
def node(tmp_path: Path) -> Node:
    return Node(tmp_path)


def subjects(observations: Any) -> dict[str, Observation]:
    found = {item.subject: item for item in observations}
    return found


def text(observation: Observation) -> str:
    return " | ".join(f"{e.source}: {e.observed}" for e in observation.evidence)


def unicast(ifname: str, gateway: str = "") -> dict[str, Any]:
    return {"route_type": "unicast", "ifname": ifname, "prefsrc": "", "gateway": gateway, "table": 254}


# -- NET001 -------------------------------------------------------------------------------------
def test_net001_docker_bridge_picked_and_absent_with_a_real_nic(node: Node) -> None:
    node.add("docker0", 3, "172.17.0.1/16", kind="bridge")
    found = subjects(nccl_virtual_interface_selected(node.socket()))
    assert set(found) == {"docker0"} and "Docker bridge" in text(found["docker0"])
    node.add("eno1", 4, "10.0.0.2/24")
    assert list(nccl_virtual_interface_selected(node.socket())) == []


def test_net001_an_idle_docker_network_bridge_taken_by_nccl_before_2_28(node: Node) -> None:
    """A Docker network with no container keeps its bridge (br-<id>, down, with its gateway
    address). NCCL before 2.28 does not test IFF_RUNNING, so its socket transport takes the bridge
    as a second device; 2.28 and later pass it over."""
    node.add("eno1", 2, "10.0.0.2/24")
    node.add("br-5a1b2c3d4e5f", 3, "172.18.0.1/16", kind="bridge", state="down")
    old = NcclLibFacts((NcclCopy("/usr/lib/x86_64-linux-gnu/libnccl.so.2.21.5", "2.21.5", "system"),), ())
    [found] = nccl_virtual_interface_selected(node.socket(), NOT_GIVEN, old)
    assert found.subject == "br-5a1b2c3d4e5f" and found.severity is Severity.WARNING and "before 2.28" in text(found)
    new = NcclLibFacts((NcclCopy("/usr/lib/x86_64-linux-gnu/libnccl.so.2.28.9", "2.28.9", "system"),), ())
    assert list(nccl_virtual_interface_selected(node.socket(), NOT_GIVEN, new)) == []
    assert list(nccl_virtual_interface_selected(node.socket())) == []  # which NCCL runs is not known: the current rules


def test_a_network_plugin_carries_the_data_where_there_are_no_verbs_devices(node: Node) -> None:
    """NCCL loads a network plugin before its own IB and socket transports: libnccl-net.so where
    the loader finds it (aws-ofi-nccl on EFA and Slingshot, Google's TCPX), or the names in
    NCCL_NET_PLUGIN. Then its socket transport carries nothing, and its extra devices are no
    finding; NCCL_NET_PLUGIN=none or NCCL_NET=Socket brings the socket transport back."""
    node.add("eno1", 2, "10.0.0.2/24")
    node.add("cali12ab", 3, "10.244.3.1/32", kind="veth")
    node.file("/opt/amazon/ofi-nccl/lib/libnccl-net.so", b"")
    node.env(NCCL_SOCKET_IFNAME="^docker,lo", LD_LIBRARY_PATH="/opt/amazon/ofi-nccl/lib")
    assert node.socket().socket_transport == "" and list(nccl_virtual_interface_selected(node.socket())) == []
    node.env(NCCL_SOCKET_IFNAME="^docker,lo", LD_LIBRARY_PATH="/opt/amazon/ofi-nccl/lib", NCCL_NET_PLUGIN="none")
    assert "no NCCL network plugin" in node.socket().socket_transport
    assert set(subjects(nccl_virtual_interface_selected(node.socket()))) == {"cali12ab"}
    node.env(NCCL_SOCKET_IFNAME="^docker,lo", NCCL_NET_PLUGIN="ofi")
    assert node.socket().socket_transport == ""
    node.env(NCCL_SOCKET_IFNAME="^docker,lo", NCCL_NET="AWS Libfabric")
    assert node.socket().socket_transport == ""
    node.env(NCCL_SOCKET_IFNAME="^docker,lo", NCCL_NET="Socket", LD_LIBRARY_PATH="/opt/amazon/ofi-nccl/lib")
    assert node.socket().socket_transport.endswith("NCCL_NET=Socket")


def test_net001_prefix_setting_that_catches_a_bridge_and_virtual_secondary_devices(node: Node) -> None:
    node.add("br-3f2a9c81d04e", 2, "172.18.0.1/16", kind="bridge")
    node.add("eno1", 3, "10.0.0.2/24")
    node.add("cali12ab", 4, "10.244.3.1/32", kind="veth")
    node.env(NCCL_SOCKET_IFNAME="^docker,lo")
    found = subjects(nccl_virtual_interface_selected(node.socket()))
    assert set(found) == {"br-3f2a9c81d04e", "cali12ab"}  # bootstrap, and a socket transport device (no RDMA here)
    # NCCL prefers its fastest devices and takes a bridge's or overlay's speed as 10 Gb/s: the
    # secondary device is a warning, the bootstrap pick every job makes an error.
    assert (found["br-3f2a9c81d04e"].severity, found["cali12ab"].severity) == (None, Severity.WARNING)
    assert text(found["br-3f2a9c81d04e"]).startswith("environment NCCL_SOCKET_IFNAME: ^docker,lo")
    node.rdma()  # with an IB transport only bootstrap and the out-of-band socket matter
    assert set(subjects(nccl_virtual_interface_selected(node.socket()))) == {"br-3f2a9c81d04e"}


def test_net001_only_dockers_bridge_names_are_container_bridges(node: Node) -> None:
    """Docker names a user-defined network's bridge br-<12 hex digits of its ID>; OVN-Kubernetes
    moves an OpenShift node's routable address onto the OVS bridge br-ex, which NCCL rightly picks."""
    node.add("br-ex", 2, "10.0.40.17/24", kind="openvswitch")
    node.add("br-0123456789ab", 3, "172.18.0.1/16", kind="bridge")
    node.env(NCCL_SOCKET_IFNAME="br-ex")
    assert list(nccl_virtual_interface_selected(node.socket())) == []
    node.env(NCCL_SOCKET_IFNAME="br-0")
    assert set(subjects(nccl_virtual_interface_selected(node.socket()))) == {"br-0123456789ab"}


@pytest.mark.parametrize(("address", "severity"), [("10.128.2.132/23", Severity.WARNING), ("172.17.0.2/16", None)])
def test_net001_a_containers_own_veth_is_a_warning_unless_docker_nats_it(node: Node, address: str, severity: Severity | None) -> None:
    """A Kubernetes pod's eth0 is the container end of a veth whose address the CNI routes between
    nodes; behind Docker's default bridge (172.17.0.0/16) it is NATed and unreachable."""
    node.add("eth0", 2, address, kind="veth")
    found = subjects(nccl_virtual_interface_selected(node.socket()))
    assert set(found) == {"eth0"} and found["eth0"].severity == severity, found


def test_net001_a_one_node_job_is_not_hurt_by_a_bridge(node: Node) -> None:
    """docker run --gpus all on the default bridge: NCCL's ranks in the container meet over the
    NATed eth0, which only a job of several nodes cannot cross (torchrun --standalone, or Slurm
    saying one node, make every pick a warning)."""
    from preflight.probes.job import probe_job

    node.add("eth0", 2, "172.17.0.2/16", kind="veth")
    assert [o.severity for o in nccl_virtual_interface_selected(node.socket())] == [None]
    node.env(WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
    (found,) = nccl_virtual_interface_selected(node.socket(), probe_job(NodeFS(str(node.root))))
    assert found.severity is Severity.WARNING and "runs on one node" in found.fix
    node.env(WORLD_SIZE="16", LOCAL_WORLD_SIZE="8")
    assert [o.severity for o in nccl_virtual_interface_selected(node.socket(), probe_job(NodeFS(str(node.root))))] == [None]


def test_net001_a_kubernetes_pods_eth0_is_routable(node: Node) -> None:
    """kubelet heads every pod's /etc/hosts with its own line; in a pod the Kubernetes network
    model routes the eth0 veth's address to every node without NAT (EKS's VPC CNI gives it a VPC
    /32 behind 169.254.1.1). A veth under another name is still a warning."""
    node.add("eth0", 2, "10.1.77.201/32", kind="veth")
    node.file("/etc/hosts", "# Kubernetes-managed hosts file.\n127.0.0.1\tlocalhost\n10.1.77.201\tnccl-worker-0\n")
    assert node.socket().kubernetes_pod is True and list(nccl_virtual_interface_selected(node.socket())) == []
    node.env(NCCL_SOCKET_IFNAME="=eth1")
    node.add("eth1", 3, "10.1.9.2/24", kind="veth")
    assert subjects(nccl_virtual_interface_selected(node.socket()))["eth1"].severity is Severity.WARNING
    node.file("/etc/hosts", "127.0.0.1\tlocalhost\n")  # Docker's /etc/hosts: no header
    node.env()
    assert node.socket().kubernetes_pod is False
    assert subjects(nccl_virtual_interface_selected(node.socket()))["eth0"].severity is Severity.WARNING


@pytest.mark.parametrize(("name", "kind", "severity"), [
    ("dummy0", "dummy", Severity.WARNING), ("wg0", "wireguard", Severity.WARNING), ("kube-ipvs0", "dummy", None),
])
def test_net001_a_dummy_or_vpn_device_by_kind_alone_is_a_warning(node: Node, name: str, kind: str, severity: Severity | None) -> None:
    """Routing on the host puts the node's one routable /32 on a dummy device (the NICs carry only
    link-local addresses), and VPN meshes join nodes through WireGuard: a device known by its kind
    alone may be routed, so it is a warning; kube-proxy's IPVS dummy, named as such, never is."""
    node.add("eno1", 2, "fe80::21/64")
    node.add(name, 3, "10.40.0.21/32", kind=kind)
    node.env(NCCL_SOCKET_IFNAME=f"={name}")
    found = subjects(nccl_virtual_interface_selected(node.socket()))
    assert set(found) == {name} and found[name].severity == severity, found


def test_net001_ipv4_link_local_interface_picked_before_the_real_nic(node: Node) -> None:
    node.add("pod-id-link0", 2, "169.254.170.23/32", kind="dummy")  # EKS Pod Identity's agent link
    node.add("eno1", 3, "10.0.0.2/24")
    node.env(NCCL_SOCKET_IFNAME="^docker,lo")
    found = subjects(nccl_virtual_interface_selected(node.socket()))
    assert set(found) == {"pod-id-link0"} and "IPv4 link-local address" in text(found["pod-id-link0"])
    assert found["pod-id-link0"].severity is None
    node.env(NCCL_SOCKET_IFNAME="eno1")
    assert list(nccl_virtual_interface_selected(node.socket())) == []


def test_net001_ipv4_link_local_on_a_nic_of_the_node_is_a_warning_unless_named(node: Node) -> None:
    """An IPv4 link-local address reaches the nodes on the same link, which is every node where
    they are cabled back to back, and none across a router: NCCL's own pick of it is a warning.
    NVIDIA's DGX Spark playbooks address the QSFP link between two Sparks so and name it in
    NCCL_SOCKET_IFNAME: the site's choice, whose peers NET004 checks."""
    node.add("enP2p1s0f1np1", 2, "169.254.53.21/16")
    node.env(NCCL_SOCKET_IFNAME="enP2p1s0f1np1")
    assert list(nccl_virtual_interface_selected(node.socket())) == []
    node.env(NCCL_SOCKET_IFNAME="^docker,lo")  # NCCL picks it itself
    found = subjects(nccl_virtual_interface_selected(node.socket()))
    assert found["enP2p1s0f1np1"].severity is Severity.WARNING and "cabled back to back" in text(found["enP2p1s0f1np1"])


def test_net001_loopback_fallback(node: Node) -> None:
    found = subjects(nccl_virtual_interface_selected(node.socket()))
    assert "loopback" in text(found["lo"]) and "'lo' prefix" in text(found["lo"])


# -- NET002 -------------------------------------------------------------------------------------
def test_net002_unrecognised_family_and_ipv6_asked_where_disabled(node: Node) -> None:
    node.add("eno1", 2, "10.0.0.2/24")
    node.env(NCCL_SOCKET_FAMILY="inet6")
    found = subjects(ipv6_address_family_mismatch(node.socket()))
    assert found["NCCL_SOCKET_FAMILY"].severity is Severity.WARNING
    node.file("/proc/sys/net/ipv6/conf/all/disable_ipv6", "1\n")
    node.env(NCCL_SOCKET_FAMILY="AF_INET6", NCCL_COMM_ID="[2001:db8::1]:5000", MASTER_ADDR="2001:db8::1")
    found = subjects(ipv6_address_family_mismatch(node.socket()))
    assert set(found) == {"NCCL_SOCKET_FAMILY", "NCCL_COMM_ID", "MASTER_ADDR"}
    assert all(item.severity is None for item in found.values())  # the reference's error


def test_net002_ipv6_turned_back_on_for_one_interface_is_not_disabled(node: Node) -> None:
    """"all/disable_ipv6 = 1" then eno1's own 0: the kernel copies "all" to every interface once
    and keeps reading 1 there, while eno1 holds IPv6 addresses again and NCCL uses them."""
    node.file("/proc/sys/net/ipv6/conf/all/disable_ipv6", "1\n")
    node.file("/proc/sys/net/ipv6/conf/eno1/disable_ipv6", "0\n")
    node.add("eno1", 2, "2001:db8:40::21/64", "fe80::21/64")
    node.env(NCCL_SOCKET_FAMILY="AF_INET6", NCCL_SOCKET_IFNAME="=eno1")
    facts = node.socket()
    assert facts.ipv6 == "enabled" and list(ipv6_address_family_mismatch(facts)) == []


@pytest.mark.parametrize("partial_copy", [False, True])
def test_net002_ipv6_off_at_boot_needs_the_whole_stack_gone(node: Node, partial_copy: bool) -> None:
    """ipv6.disable=1 removes the IPv6 sysctls, /proc/net/if_inet6 and every IPv6 address (not
    even ::1 on lo). A root that lacks only the sysctls while listing IPv6 addresses is a partial
    capture, never a node without IPv6."""
    if partial_copy:
        node.file("/proc/net/if_inet6", "00000000000000000000000000000001 01 80 10 80       lo\n")
    else:
        node.addresses = [address for address in node.addresses if address["family"] == 4]
        node.file("/proc/net/dev", "Inter-|   Receive\n")
    node.add("eno1", 2, "10.0.0.2/24")
    node.file("/proc/sys/net/ipv4/conf/all/rp_filter", "0\n")
    node.env(NCCL_SOCKET_FAMILY="AF_INET6")
    facts = node.socket()
    found = subjects(ipv6_address_family_mismatch(facts))
    if partial_copy:
        assert (facts.ipv6, found) == ("unknown", {})
    else:
        assert facts.ipv6 == "off at boot" and "ipv6.disable=1" in text(found["NCCL_SOCKET_FAMILY"])


def test_net002_global_ipv6_pick_nobody_asked_for(node: Node) -> None:
    """An IPv6 pick on a node that also has a routable IPv4 address: nodes set up alike may pick
    either family. On a node addressed in IPv6 only, every peer publishes IPv6 as well."""
    node.add("eno1", 2, "2001:db8::2/64", "fe80::2/64")
    node.add("eno2", 3, "10.0.0.2/24")
    node.env(NCCL_SOCKET_IFNAME="=eno1")
    found = subjects(ipv6_address_family_mismatch(node.socket()))
    assert found["eno1"].severity is Severity.WARNING and "eno1:2001:db8::2" in text(found["eno1"])
    node.env(NCCL_SOCKET_IFNAME="=eno1", NCCL_SOCKET_FAMILY="AF_INET6")
    assert list(ipv6_address_family_mismatch(node.socket())) == []
    node.env()  # any IPv4 address comes first
    assert list(ipv6_address_family_mismatch(node.socket())) == []


def test_net002_an_ipv6_only_node_needs_no_family_setting(node: Node) -> None:
    node.add("eno1", 2, "2001:db8::2/64", "fe80::2/64")
    assert list(ipv6_address_family_mismatch(node.socket())) == []


# -- NET003 -------------------------------------------------------------------------------------
def test_net003_link_local_socket_device_only_when_sockets_carry_data(node: Node) -> None:
    node.add("eno1", 2, "10.0.0.2/24")
    node.add("veth25f2e72", 3, "fe80::380d:bfff:fe5b:54d2/64", kind="veth")
    found = subjects(nccl_proxy_connect_ipv6_link_local(node.socket()))
    assert "socket transport device 1: veth25f2e72:fe80::380d:bfff:fe5b:54d2%veth25f2e72" in text(found["veth25f2e72"])
    assert found["veth25f2e72"].severity is Severity.WARNING  # a secondary device, below eno1's speed
    assert list(nccl_virtual_interface_selected(node.socket())) == []  # link-local is NET003's, not NET001's
    node.rdma()
    assert list(nccl_proxy_connect_ipv6_link_local(node.socket())) == []
    for value in ("1", "2", "0x1"):  # any non-zero value NCCL's strtoll reads turns IB off
        node.env(NCCL_IB_DISABLE=value)
        assert set(subjects(nccl_proxy_connect_ipv6_link_local(node.socket()))) == {"veth25f2e72"}
    node.env(NCCL_IB_DISABLE="0")
    assert list(nccl_proxy_connect_ipv6_link_local(node.socket())) == []


def test_net003_ipoib_with_only_link_local_is_the_bootstrap_pick(node: Node) -> None:
    node.rdma()
    node.add("eno1", 2, "10.0.0.2/24")
    node.add("ib0", 3, "fe80::ba3f:d203:21:77a0/64")
    found = subjects(nccl_proxy_connect_ipv6_link_local(node.socket()))
    assert "bootstrap: ib0:fe80::" in text(found["ib0"]) and "'ib' prefix" in text(found["ib0"])
    node.file("/etc/nccl.conf", "NCCL_SOCKET_FAMILY=AF_INET\n")  # from nccl.conf, NCCL's precedence
    assert list(nccl_proxy_connect_ipv6_link_local(node.socket())) == []


# -- NET004 -------------------------------------------------------------------------------------
def test_net004_not_applicable_without_peers(node: Node) -> None:
    with pytest.raises(NotApplicable):
        list(nccl_socket_network_unreachable(node.routing()))


def test_net004_unreachable_reachable_unresolved_and_unlookupable_peers(node: Node) -> None:
    node.add("eno1", 2, "10.0.0.2/24")
    node.env(SLURM_JOB_NODELIST="node[1-4]", MASTER_ADDR="10.9.0.1")
    node.file("/etc/hosts", "10.0.0.3 node2\n10.7.0.3 node3\n2001:db8::4 node4\n10.0.0.4 node4\n")
    node.routes = {"10.9.0.1": {"error": "ENETUNREACH"}, "10.0.0.3": unicast("eno1"), "10.7.0.3": {"error": "EHOSTUNREACH"},
                   "10.0.0.4": {"error": "ENETUNREACH"}}
    found = subjects(nccl_socket_network_unreachable(node.routing(dns={})))
    assert found["10.9.0.1"].status is Status.PRESENT and "Network is unreachable" in text(found["10.9.0.1"])
    assert found["node3"].status is Status.PRESENT and "SLURM_JOB_NODELIST" in text(found["node3"])
    assert found["node4"].status is Status.UNKNOWN and "no recorded route for 2001:db8::4" in found["node4"].reason
    assert "node2" not in found and "node1" not in found  # reachable; this host
    node.routes["2001:db8::4"] = unicast("eno1")
    assert "node4" not in subjects(nccl_socket_network_unreachable(node.routing()))  # libc tries the next address


def test_net004_unresolvable_peer_is_undecided(node: Node) -> None:
    node.env(MASTER_ADDR="head")
    found = subjects(nccl_socket_network_unreachable(node.routing(dns={"head A": {"error": "NXDOMAIN"}, "head AAAA": {"error": "NXDOMAIN"}})))
    assert found["head"].status is Status.UNKNOWN and "NXDOMAIN" in found["head"].reason


def test_net004_unparsable_nodelist_is_undecided(node: Node) -> None:
    node.env(SLURM_JOB_NODELIST="gpu[01-")
    found = subjects(nccl_socket_network_unreachable(node.routing()))
    assert found["SLURM_JOB_NODELIST"].status is Status.UNKNOWN and "unbalanced" in found["SLURM_JOB_NODELIST"].reason


def test_routing_probe_caps_the_number_of_peers(node: Node) -> None:
    node.env(SLURM_JOB_NODELIST="n[0001-2000]")
    node.routes = {}
    facts = node.routing(dns={})
    assert facts.peers_total == 2000 and len(facts.peers) == 32


# -- NET005 -------------------------------------------------------------------------------------
def test_net005_socket_ifname_matching_nothing_usable(node: Node) -> None:
    node.add("eno1", 2, "10.0.0.2/24")
    node.add("ens9f0", 3, "10.1.0.2/24", state="down")
    node.add("ens10f0", 4)
    node.file("/etc/nccl.conf", "NCCL_SOCKET_IFNAME==eth0,ens9f0,ens10f0\n")
    found = subjects(nccl_wrong_socket_interface(node.socket(), node.routing(), NO_NCCL))
    evidence = text(found["NCCL_SOCKET_IFNAME"])
    assert evidence.startswith("/etc/nccl.conf NCCL_SOCKET_IFNAME: =eth0,ens9f0,ens10f0")
    assert "eth0: no such interface" in evidence and "ens9f0 is down" in evidence and "ens10f0 has no IP address" in evidence
    node.file("/etc/nccl.conf", "NCCL_SOCKET_IFNAME=^e\n")  # leaves lo: NET001's case, not this one
    assert list(nccl_wrong_socket_interface(node.socket(), node.routing(), NO_NCCL)) == []
    node.file("/etc/nccl.conf", "NCCL_SOCKET_IFNAME=^e,lo\n")
    found = subjects(nccl_wrong_socket_interface(node.socket(), node.routing(), NO_NCCL))
    assert set(found) == {"NCCL_SOCKET_IFNAME"} and "no running interface with an address matches" in text(found["NCCL_SOCKET_IFNAME"])


def test_net005_one_character_value_and_comm_id_without_a_local_subnet(node: Node) -> None:
    node.add("eno1", 2, "10.0.0.2/24")
    node.env(NCCL_SOCKET_IFNAME="e", NCCL_COMM_ID="10.5.0.1:6000")
    node.routes = {"10.5.0.1": unicast("eno1", "10.0.0.1")}
    found = subjects(nccl_wrong_socket_interface(node.socket(), node.routing(), NO_NCCL))
    assert found["NCCL_SOCKET_IFNAME"].severity is Severity.WARNING
    assert "no local address in that subnet" in text(found["NCCL_COMM_ID"])


def test_net005_comm_id_host_resolved_by_dns_as_nccl_resolves_it(node: Node) -> None:
    """NCCL resolves NCCL_COMM_ID's host with getaddrinfo (files, then DNS): a host only DNS knows
    is judged by its DNS address, and one nothing resolves leaves the subnet unknown, never a
    "no local address in that subnet" error."""
    node.add("eno1", 2, "10.10.1.17/16")
    node.env(NCCL_COMM_ID="gpu018:29600")
    node.routes = {"10.10.1.18": unicast("eno1")}
    answered = {"gpu018 A": {"addresses": ["10.10.1.18"]}, "gpu018 AAAA": {"error": "NOANSWER"}}
    assert list(nccl_wrong_socket_interface(node.socket(), node.routing(dns=answered), NO_NCCL)) == []
    elsewhere = {"gpu018 A": {"addresses": ["10.99.0.18"]}, "gpu018 AAAA": {"error": "NOANSWER"}}
    node.routes = {"10.99.0.18": unicast("eno1", "10.10.0.1")}
    found = subjects(nccl_wrong_socket_interface(node.socket(), node.routing(dns=elsewhere), NO_NCCL))
    assert found["NCCL_COMM_ID"].status is Status.PRESENT and "gpu018: 10.99.0.18" in text(found["NCCL_COMM_ID"])
    nowhere = {"gpu018 A": {"error": "NXDOMAIN"}, "gpu018 AAAA": {"error": "NXDOMAIN"}}
    found = subjects(nccl_wrong_socket_interface(node.socket(), node.routing(dns=nowhere), NO_NCCL))
    assert found["NCCL_COMM_ID"].status is Status.UNKNOWN and "does not resolve here" in found["NCCL_COMM_ID"].reason


def test_net005_a_down_interface_nccl_before_2_28_would_bind_to(node: Node) -> None:
    """NCCL before 2.28 takes interfaces that are not running: an IPoIB port that is down but keeps
    its address is its bootstrap interface ("ib" comes first in its default order)."""
    node.add("eno1", 2, "10.40.0.21/16")
    node.add("ib0", 3, "10.50.0.21/16", state="down")
    old = NcclCopy("/usr/lib/x86_64-linux-gnu/libnccl.so.2.21.5", "2.21.5", "system")
    new = NcclCopy("/opt/venv/lib/python3.12/site-packages/nvidia/nccl/lib/libnccl.so.2", "2.28.9", "python")
    facts, routing = node.socket(), node.routing()
    assert facts.bootstrap.interfaces[0].ifname == "eno1" and facts.bootstrap_before_2_28 is not None
    found = subjects(nccl_wrong_socket_interface(facts, routing, NcclLibFacts((old,), ())))
    assert found["ib0"].severity is None and "not running" in text(found["ib0"]) and "NCCL 2.21.5" in text(found["ib0"])
    found = subjects(nccl_wrong_socket_interface(facts, routing, NcclLibFacts((old, new), ())))
    assert found["ib0"].severity is Severity.WARNING  # the job may load the newer one
    assert list(nccl_wrong_socket_interface(facts, routing, NcclLibFacts((new,), ()))) == []
    unread = subjects(nccl_wrong_socket_interface(facts, routing, Unread("nccl_libs", "timed out")))
    assert unread["ib0"].status is Status.UNKNOWN
    node.links[-1]["operstate"] = "up"
    assert node.socket().bootstrap_before_2_28 is None  # both releases pick the running ib0


def test_net005_peers_routed_elsewhere_warning_when_automatic_info_when_chosen(node: Node) -> None:
    node.add("eno1", 2, "10.0.0.2/24")
    node.add("ib0", 3, "192.168.50.2/24")
    node.env(MASTER_ADDR="10.0.0.9")
    node.routes = {"10.0.0.9": unicast("eno1")}
    found = subjects(nccl_wrong_socket_interface(node.socket(), node.routing(), NO_NCCL))
    assert found["ib0"].severity is Severity.WARNING and "10.0.0.9: dev eno1" in text(found["ib0"])
    node.env(MASTER_ADDR="10.0.0.9", NCCL_SOCKET_IFNAME="=ib0")
    assert subjects(nccl_wrong_socket_interface(node.socket(), node.routing(), NO_NCCL))["ib0"].severity is Severity.INFO
    node.env(MASTER_ADDR="10.0.0.9", NCCL_SOCKET_IFNAME="=eno1")
    assert list(nccl_wrong_socket_interface(node.socket(), node.routing(), NO_NCCL)) == []


def test_net005_nccls_default_ipoib_pick_with_peers_named_on_ethernet_is_information(node: Node) -> None:
    """A real IPoIB port first in NCCL's default order: every peer picks its own and NCCL dials the
    address each publishes there, not the Ethernet address a peer's name resolves to (Azure ND,
    DGX under Base Command Manager, GB200 trays)."""
    node.add("eno1", 2, "10.0.0.2/24")
    node.add("ib0", 3, "192.168.50.2/24")
    node.links[-1]["link_type"] = "infiniband"
    node.env(MASTER_ADDR="10.0.0.9")
    node.routes = {"10.0.0.9": unicast("eno1")}
    found = subjects(nccl_wrong_socket_interface(node.socket(), node.routing(), NO_NCCL))
    assert found["ib0"].severity is Severity.INFO and "10.0.0.9: dev eno1" in text(found["ib0"])


def test_net005_a_default_pick_of_a_rail_sharing_its_subnet_is_information(node: Node) -> None:
    """RoCE rails in one subnet with the management port numbered after them: NCCL's default order
    bootstraps on the first rail, which every node has in that subnet (reached on-link), while
    host names route by the management port. A rail alone on its /31 keeps the warning."""
    def first_rail(where: Node, r1: str, r2: str) -> Observation:
        where.add("r1", 2, r1)
        where.add("r2", 3, r2)
        where.add("eno1", 4, "10.0.0.2/24")
        where.env(MASTER_ADDR="10.0.0.9")
        where.routes = {"10.0.0.9": unicast("eno1")}
        return subjects(nccl_wrong_socket_interface(where.socket(), where.routing(), NO_NCCL))["r1"]

    assert first_rail(node, "10.50.0.2/24", "10.50.0.3/24").severity is Severity.INFO
    assert first_rail(Node(node.root.parent / "alone"), "10.50.0.0/31", "10.50.0.2/31").severity is Severity.WARNING


def _rails(node: Node, rp_filter: int, arp: tuple[int, int], own_tables: bool) -> None:
    node.add("eno1", 2, "10.0.0.2/24")
    node.add("r1", 3, "10.50.0.2/24")
    node.add("r2", 4, "10.50.0.3/24")
    node.env(NCCL_SOCKET_IFNAME="=eno1")
    for name in ("all", "eno1", "r1", "r2"):
        node.file(f"/proc/sys/net/ipv4/conf/{name}/rp_filter", f"{rp_filter if name == 'all' else 0}\n")
        node.file(f"/proc/sys/net/ipv4/conf/{name}/arp_ignore", f"{arp[0]}\n")
        node.file(f"/proc/sys/net/ipv4/conf/{name}/arp_announce", f"{arp[1]}\n")
    node.routes = {"10.50.0.1 from 10.50.0.2": unicast("r1"), "10.50.0.1 from 10.50.0.3": unicast("r2" if own_tables else "r1")}


def test_net005_strict_rp_filter_without_source_routing(node: Node) -> None:
    _rails(node, 1, (1, 2), own_tables=False)
    found = subjects(nccl_wrong_socket_interface(node.socket(), node.routing(), NO_NCCL))
    assert set(found) == {"r2"} and found["r2"].severity is None
    assert "(effective 1: strict)" in text(found["r2"]) and "ip route get 10.50.0.1 from 10.50.0.3: dev r1" in text(found["r2"])


def test_net005_strict_rp_filter_on_ipoib_rails_nccl_does_not_use_is_a_warning(node: Node) -> None:
    """IPoIB interfaces in one subnet under strict rp_filter: NCCL's InfiniBand transport reaches
    peers by LID and GID without IP, and its sockets use eno1, so only the other IP users there
    suffer. Where NCCL's own socket is one of them, it is the error it was."""
    _rails(node, 1, (1, 2), own_tables=False)
    for link in node.links:
        if link["name"] in ("r1", "r2"):
            link["link_type"] = "infiniband"
    found = subjects(nccl_wrong_socket_interface(node.socket(), node.routing(), NO_NCCL))
    assert set(found) == {"r2"} and found["r2"].severity is Severity.WARNING
    node.env(NCCL_SOCKET_IFNAME="=r2")
    found = subjects(nccl_wrong_socket_interface(node.socket(), node.routing(), NO_NCCL))
    assert found["r2"].severity is None


def test_net005_arp_flux_warning_and_clean_multi_rail(node: Node) -> None:
    _rails(node, 2, (0, 0), own_tables=False)
    found = subjects(nccl_wrong_socket_interface(node.socket(), node.routing(), NO_NCCL))
    assert set(found) == {"r1", "r2"} and {item.severity for item in found.values()} == {Severity.WARNING}
    assert "arp_ignore=1" in found["r1"].fix
    clean = Node(node.root.parent / "clean")
    _rails(clean, 1, (1, 2), own_tables=True)
    assert list(nccl_wrong_socket_interface(clean.socket(), clean.routing(), NO_NCCL)) == []


def test_net005_rails_that_carry_no_roce_and_no_nccl_socket_are_a_warning(node: Node) -> None:
    """HPE Slingshot puts every hsn interface in one subnet; NCCL's data goes over the cxi NIC
    through libfabric, which addresses peers without IP, and its socket uses eno1. With RDMA read
    and no RoCE port on r1/r2, strict rp_filter there is a warning for other IP users; a RoCE
    port on r2 (the kernel resolves its peers' MACs through IP) keeps the error, and so does an
    RDMA class that was not read."""
    from preflight.probes.rdma import probe_rdma

    _rails(node, 1, (1, 2), own_tables=False)
    fs = NodeFS(str(node.root))
    found = subjects(nccl_wrong_socket_interface(node.socket(), node.routing(), NO_NCCL, probe_rdma(fs)))
    assert set(found) == {"r2"} and found["r2"].severity is Severity.WARNING
    assert subjects(nccl_wrong_socket_interface(node.socket(), node.routing(), NO_NCCL))["r2"].severity is None  # RDMA unread
    node.file("/sys/class/infiniband/mlx5_1/ports/1/link_layer", "Ethernet\n")
    node.file("/sys/class/infiniband/mlx5_1/ports/1/state", "4: ACTIVE\n")
    os.makedirs(node.root / "sys/class/infiniband/mlx5_1/device/net/r2")
    found = subjects(nccl_wrong_socket_interface(node.socket(), node.routing(), NO_NCCL, probe_rdma(NodeFS(str(node.root)))))
    assert found["r2"].severity is None


def test_net005_static_arp_leaves_nothing_to_flux(node: Node) -> None:
    """HPE Slingshot's reference configuration gives every peer a PERMANENT neighbour entry on
    every hsn interface (shs-docs: check_arp_information_on_compute_and_gateway.md): no ARP is
    asked or answered for them, so arp_ignore/arp_announce at 0 do not matter. One dynamic entry
    (or none) on a rail leaves ARP in use there."""
    from preflight.probes.routing import parse_arp_table

    _rails(node, 2, (0, 0), own_tables=False)
    header = "IP address       HW type     Flags       HW address            Mask     Device\n"
    static = "".join(f"10.50.0.{peer}     0x1         0x6         02:00:00:00:07:{peer:02x}     *        {rail}\n"
                     for peer in (7, 8) for rail in ("r1", "r2"))
    node.file("/proc/net/arp", header + static)
    assert list(nccl_wrong_socket_interface(node.socket(), node.routing(), NO_NCCL)) == []
    node.file("/proc/net/arp", header + static + "10.50.0.9     0x1         0x2         02:00:00:00:07:09     *        r2\n")
    assert set(subjects(nccl_wrong_socket_interface(node.socket(), node.routing(), NO_NCCL))) == {"r2"}
    assert parse_arp_table(header + "garbage line\n10.0.0.1 0x1 zz 00:00 * r9\n") == {}


def test_net005_arp_announce_1_is_enough_where_replies_leave_by_their_own_interface(node: Node) -> None:
    """OCI's RDMA hosts: all ports in one subnet, arp_ignore=2, arp_announce=1 and a source-routing
    table per port. A packet then leaves by the port that owns its source address, so no ARP
    request carries another port's address."""
    _rails(node, 0, (2, 1), own_tables=True)
    assert list(nccl_wrong_socket_interface(node.socket(), node.routing(), NO_NCCL)) == []
    shared = Node(node.root.parent / "shared")
    _rails(shared, 0, (2, 1), own_tables=False)
    found = subjects(nccl_wrong_socket_interface(shared.socket(), shared.routing(), NO_NCCL))
    assert set(found) == {"r2"} and found["r2"].evidence[-1].expected == ">= 2" and "(effective 1)" in text(found["r2"])


def test_net005_arp_filter_with_source_routing_answers_only_on_the_own_interface(node: Node) -> None:
    """WEKA's clients: arp_filter=1, arp_announce=2 and a routing table per NIC, arp_ignore left at
    0. arp_filter answers a request only where the reply to the asker would leave, which source
    routing makes the address's own interface (arp_filter() in net/ipv4/arp.c): no flux. Without
    per-interface tables it proves nothing."""
    _rails(node, 0, (0, 2), own_tables=True)
    for name in ("all", "eno1", "r1", "r2"):
        node.file(f"/proc/sys/net/ipv4/conf/{name}/arp_filter", "1\n" if name == "all" else "0\n")
    assert list(nccl_wrong_socket_interface(node.socket(), node.routing(), NO_NCCL)) == []
    node.routes = {"10.50.0.1 from 10.50.0.2": unicast("r1"), "10.50.0.1 from 10.50.0.3": unicast("r1")}
    assert set(subjects(nccl_wrong_socket_interface(node.socket(), node.routing(), NO_NCCL))) == {"r2"}


def test_net005_arp_announce_1_is_enough_on_roce_rails_without_source_routing(node: Node) -> None:
    """OCI's stack as published (oci-hpc's rdma-interface role): 16 RoCE rails in one /16, loose
    rp_filter, arp_ignore=2, arp_announce=1, no per-rail tables. The kernel resolves a RoCE peer
    bound to the GID's netdev, with its address as source, so the unbound lookup's rdma0 is not the
    way out; an interface NCCL's sockets use is still held to arp_announce >= 2."""
    from preflight.probes.rdma import probe_rdma

    _rails(node, 2, (2, 1), own_tables=False)
    for index, netdev in enumerate(("r1", "r2")):
        node.file(f"/sys/class/infiniband/mlx5_{index}/ports/1/link_layer", "Ethernet\n")
        node.file(f"/sys/class/infiniband/mlx5_{index}/ports/1/state", "4: ACTIVE\n")
        os.makedirs(node.root / f"sys/class/infiniband/mlx5_{index}/device/net/{netdev}")
    rdma = probe_rdma(NodeFS(str(node.root)))
    assert list(nccl_wrong_socket_interface(node.socket(), node.routing(), NO_NCCL, rdma)) == []
    assert set(subjects(nccl_wrong_socket_interface(node.socket(), node.routing(), NO_NCCL))) == {"r2"}  # RDMA unread
    node.env(NCCL_SOCKET_IFNAME="=r2")
    found = subjects(nccl_wrong_socket_interface(node.socket(), node.routing(), NO_NCCL, rdma))
    assert found["r2"].evidence[-1].expected == ">= 2"


def test_net005_unreadable_or_garbage_sysctls_are_undecided(node: Node) -> None:
    _rails(node, 1, (1, 2), own_tables=False)
    node.file("/proc/sys/net/ipv4/conf/r2/rp_filter", "strict\n")
    facts = node.routing()
    assert any("not a number" in problem for problem in facts.problems)
    found = subjects(nccl_wrong_socket_interface(node.socket(), facts, NO_NCCL))
    assert found["r2"].status is Status.UNKNOWN and "rp_filter unreadable" in found["r2"].reason


def test_net005_strict_rp_filter_with_unknown_reply_route_on_a_copied_root(node: Node) -> None:
    _rails(node, 1, (1, 2), own_tables=False)
    member = RailMember("r2", "10.50.0.3", 24, Sysctl(0, 1), Sysctl(1, 1), Sysctl(2, 2), None, "source-specific lookups depend on policy rules")
    facts = replace(node.routing(), same_subnet=((member,),))
    found = subjects(nccl_wrong_socket_interface(node.socket(), facts, NO_NCCL))
    assert found["r2"].status is Status.UNKNOWN and "policy rules" in found["r2"].reason


def test_merge_by_subject_keeps_one_row_per_subject() -> None:
    merged = merge_by_subject([
        present("eth1", Evidence("a", "1"), severity=Severity.WARNING, fix="x"),
        undecided("eth1", "why"),
        present("eth1", Evidence("b", "2")),
        undecided("eth2", "why"),
    ])
    assert [(o.subject, o.status, o.severity, len(o.evidence), o.fix) for o in merged] == [
        ("eth1", Status.PRESENT, None, 2, ""), ("eth2", Status.UNKNOWN, None, 0, ""),
    ]


def test_probe_facts_are_json_and_name_the_choice(node: Node) -> None:
    node.add("eno1", 2, "10.0.0.2/24")
    node.env(NCCL_SOCKET_IFNAME="eno", MASTER_ADDR="10.0.0.9")
    node.routes = {"10.0.0.9": unicast("eno1")}
    from preflight.engine import facts_to_json

    socket = facts_to_json(node.socket())
    assert socket["bootstrap"]["interfaces"][0]["address"] == "10.0.0.2"
    assert socket["socket_ifname"] == {"value": "eno", "origin": "environment"}
    routing = facts_to_json(node.routing())
    assert routing["peers"][0]["routes"][0]["ifname"] == "eno1"
    json.dumps([socket, routing])
    assert isinstance(node.socket().socket_ifname, Setting)
    assert Peer("x", (), "", (), "", (Route("1.1.1.1", "", "unicast", "eno1", "", "", 254),), ()).routes[0].reachable
