"""Interface selection and routing for NCCL's sockets (NET references)."""

from __future__ import annotations

import ipaddress
import re
from itertools import chain
from typing import TYPE_CHECKING

from msgspec import Struct

from preflight.model import (
    NOT_GIVEN,
    Evidence,
    NotApplicable,
    Observation,
    Severity,
    Unread,
    merge_by_subject,
    present,
    undecided,
)
from preflight.nccl.releases import version_tuple
from preflight.probes.nccl_socket import (
    DEFAULT_ORDER,
    FAMILIES,
    RUNNING_FILTER_SINCE,
    IfAddr,
    NcclSocketFacts,
    SocketChoice,
    comm_id_host,
    match_subnet,
    parse_ifname_list,
    shown,
)
from preflight.probes.nccl_libs import NcclCopy, NcclLibFacts
from preflight.probes.hostname import job_nodes
from preflight.probes.routing import CONF, RoutingFacts
from preflight.registry import check

if TYPE_CHECKING:
    from collections.abc import Iterator

    from preflight.probes.job import JobFacts
    from preflight.probes.rdma import RdmaFacts

ARP_FIX = (
    "Set net.ipv4.conf.all.arp_ignore=1 and net.ipv4.conf.all.arp_announce=2 so each interface answers ARP "
    "only for its own address (ARP flux), and give each interface a source-routing table (ip rule from <addr> table N)."
)


# -- NET004 -----------------------------------------------------------------------------------
@check("NET004")
def nccl_socket_network_unreachable(routing: RoutingFacts) -> Iterator[Observation]:
    """A peer none of whose addresses has a route from this node."""
    for setting, reason in routing.peer_problems:
        yield undecided(setting, f"cannot list the peers it names: {reason}")
    if not routing.peers and not routing.peer_problems:
        raise NotApplicable("no peers to reach: no SLURM_JOB_NODELIST, MASTER_ADDR or NCCL_COMM_ID, no [expect] peers")
    for peer in routing.peers:
        origin = Evidence(" / ".join(peer.origins), peer.name)
        if not peer.addresses:
            yield undecided(peer.name, f"{peer.name} does not resolve here ({peer.resolve_error})", origin)
            continue
        if any(route.reachable for route in peer.routes):
            continue
        if peer.route_errors:
            yield undecided(peer.name, f"route lookup failed: {'; '.join(peer.route_errors)}", origin)
            continue
        yield present(
            peer.name,
            origin,
            *(Evidence(route.where, route.describe(), "a route") for route in peer.routes),
        )


# -- NET005 -----------------------------------------------------------------------------------
def _entry_state(entry: str, exact: bool, facts: NcclSocketFacts) -> str:
    """Why one NCCL_SOCKET_IFNAME entry selects nothing usable."""
    links = [link for link in facts.links if (link.name == entry if exact else link.name.startswith(entry))]
    if not links:
        return f"{entry}: no such interface"
    parts = []
    for link in links:
        addresses = [item for item in facts.candidates if item.ifname == link.name]
        if link.operstate not in ("up", "unknown"):
            parts.append(f"{link.name} is {link.operstate}")
        elif not addresses:
            parts.append(f"{link.name} has no IP address")
        else:
            parts.append(f"{link.name}: {', '.join(shown(item) for item in addresses)}")
    return f"{entry}: {'; '.join(parts)}"


def _selection_problems(facts: NcclSocketFacts, routing: RoutingFacts) -> Iterator[Observation]:
    setting = facts.socket_ifname
    if setting is not None and len(setting.value) <= 1:
        yield present(
            "NCCL_SOCKET_IFNAME",
            Evidence(f"{setting.origin} NCCL_SOCKET_IFNAME", repr(setting.value), "longer than one character (NCCL ignores it otherwise)"),
            severity=Severity.WARNING,
        )
    family = f" with NCCL_SOCKET_FAMILY={facts.socket_family.value}" if facts.socket_family is not None else ""
    if not facts.devices.interfaces:
        # NCCL: "Bootstrap : no socket interface found" / "NET/Socket : no interface found".
        evidence = [
            Evidence(facts.devices.source, facts.devices.rule),
            Evidence("getifaddrs", f"no running interface with an address matches{family}", "one interface"),
        ]
        spec = parse_ifname_list(facts.devices.rule)
        if facts.devices.source != DEFAULT_ORDER and not spec.exclude:
            evidence += [Evidence("network interfaces", _entry_state(entry, spec.exact, facts)) for entry in spec.entries]
        yield present("NCCL_SOCKET_IFNAME" if facts.devices.source != DEFAULT_ORDER else "node", *evidence)
    elif not facts.bootstrap.interfaces:
        yield from _comm_id_subnet(facts, routing)


def _comm_id_subnet(facts: NcclSocketFacts, routing: RoutingFacts) -> Iterator[Observation]:
    """NCCL_COMM_ID's host resolved, and no local address in its subnet: NCCL's "NET/Socket : No
    usable listening interface found". NCCL resolves the host with getaddrinfo (files, then DNS:
    socket.cc ncclSocketGetAddrFromString); the socket probe reads /etc/hosts only, so a host it
    could not resolve takes the address the routing probe's resolver found, and stays unknown
    where nothing resolves it."""
    evidence = [Evidence(facts.bootstrap.source, facts.bootstrap.rule)]
    if facts.comm_id is not None and not facts.comm_id_address:
        host = comm_id_host(facts.comm_id.value)
        peer = next((peer for peer in routing.peers if "NCCL_COMM_ID" in peer.origins and peer.addresses), None)
        if peer is None:
            yield undecided("NCCL_COMM_ID", f"its host {host!r} does not resolve here (neither /etc/hosts nor DNS), so its subnet is unknown")
            return
        if any(match_subnet(facts.candidates, address) for address in peer.addresses):
            return
        evidence.append(Evidence(peer.resolved_by or "resolver", f"{host}: {', '.join(peer.addresses[:4])}"))
    evidence.append(Evidence("getifaddrs", "no local address in that subnet", "an interface in the subnet of NCCL_COMM_ID's address"))
    yield present("NCCL_COMM_ID", *evidence)


def _route_mismatch(facts: NcclSocketFacts, routing: RoutingFacts) -> Iterator[Observation]:
    if not facts.bootstrap.interfaces:
        return
    picked = facts.bootstrap.interfaces[0]
    elsewhere = [
        (peer, route) for peer in routing.peers for route in peer.routes[:1]
        if route.reachable and route.route_type != "local" and route.ifname != picked.ifname
    ]
    unresolved = [peer.name for peer in routing.peers if not peer.addresses]
    if not elsewhere and unresolved and routing.problems:
        # A peer may be unresolved only because /etc/hosts could not be read.
        yield undecided(picked.ifname, f"peers {', '.join(unresolved[:4])} unresolved; {routing.problems[0]}")
    if elsewhere:
        chosen = facts.socket_ifname is not None and len(facts.socket_ifname.value) > 1
        # NCCL's default pick of an IPoIB port (ib* first): its peers pick theirs too and dial the
        # address each one publishes on it, never the one their names resolve to; clusters keep
        # IPoIB in one subnet (Azure's ND series, DGX systems under Base Command Manager, GB200
        # trays), so the other route is worth knowing, not a fault.
        ipoib = picked.link_type == "infiniband" and picked.scope == "global"  # a link-local pick is NET003's
        # A rail that shares its subnet with the node's other rails is alike: every node's first
        # rail sits in that subnet, reached on-link; a rail on its own /31 to a leaf stays a warning.
        shared_rail = any(picked.ifname in {member.ifname for member in group} for group in routing.same_subnet)
        yield present(
            picked.ifname,
            Evidence(facts.bootstrap.source, facts.bootstrap.rule),
            Evidence("getifaddrs", f"bootstrap: {shown(picked)}"),
            *(Evidence(route.where, f"{peer.name}: {route.describe()}", f"dev {picked.ifname}") for peer, route in elsewhere[:8]),
            # A deliberate NCCL_SOCKET_IFNAME on a separate data network is common; say so quietly.
            severity=Severity.INFO if chosen or ipoib or shared_rail else Severity.WARNING,
        )


def _roce_netdevs(rdma: RdmaFacts | Unread) -> set[str] | None:
    """The netdevs of RDMA ports with an Ethernet (RoCE) link layer; None where that is not known
    (RDMA unread, a port's link layer unread, or a RoCE port whose netdev is not found)."""
    if isinstance(rdma, Unread) or rdma.class_unread:
        return None
    names: set[str] = set()
    for device in rdma.devices:
        for port in device.ports:
            if port.link_layer is None:
                return None
            if port.link_layer == "Ethernet":
                found = {*port.netdevs, *device.netdevs}
                if not found:
                    return None
                names |= found
    return names


def _multi_rail(routing: RoutingFacts, used: set[str], roce: set[str] | None) -> Iterator[Observation]:
    """Interfaces sharing a subnet whose replies the kernel drops (strict rp_filter) or answers for
    each other (ARP). On an interface NCCL's sockets do not use and that carries no RoCE port,
    that costs NCCL nothing: its InfiniBand transport over IPoIB ports addresses peers by LID and
    GID (net_ib.cc), and a plugin's fabric (HPE Slingshot's cxi through libfabric, with all hsn
    interfaces in one subnet by design) by its own NIC addresses, with neither IP nor ARP; so it
    is a warning for the other IP users there. A RoCE port is NCCL's own: the kernel resolves
    the peer's MAC for a RoCE v2 address handle through IP routing and ARP. ARP answers only
    for the interface's own addresses with arp_ignore >= 1; arp_announce >= 2 keeps another
    interface's address out of its requests, and so does 1 where requests leave by the interface
    itself: under per-interface source routing, and always for a RoCE port's own resolution, which
    the kernel looks up bound to the GID's netdev with the GID's address as source
    (rdma_resolve_ip: bound_dev_if, flowi4_oif in drivers/infiniband/core/addr.c). OCI's RDMA
    hosts put 16 rails in one /16 with arp_ignore=2, arp_announce=1 and loose rp_filter so.
    Where every neighbour entry on the interface is PERMANENT (HPE Slingshot's static ARP on each
    hsn interface) no ARP is asked or answered, so these settings do not matter."""
    for group in routing.same_subnet:
        names = ", ".join(f"{m.ifname}:{m.address}/{m.prefixlen}" for m in group)
        shared = Evidence("ip -4 address", f"same subnet: {names}", "one subnet per interface, or per-interface source routing")
        for member in group:
            knob = f"{CONF}/{{all,{member.ifname}}}"
            unknown: list[str] = []
            rp_evidence: list[Evidence] = []
            strict, route = member.rp_filter.effective, member.return_route
            own_way_out = route is not None and route.ifname == member.ifname
            # A RoCE port no NCCL socket uses resolves peers bound to itself, whatever the table says.
            bound = roce is not None and member.ifname in roce and member.ifname not in used
            if strict is None:
                unknown.append("rp_filter unreadable")
            elif strict == 1 and route is None:
                unknown.append(f"rp_filter is strict and the reply route is unknown: {member.return_route_error or 'no address to look up'}")
            elif strict == 1 and route is not None and not own_way_out:
                rp_evidence = [
                    Evidence(f"{knob}/rp_filter", f"{member.rp_filter.all}, {member.rp_filter.interface} (effective 1: strict)", "0 or 2, or replies routed back out of this interface"),
                    Evidence(route.where, route.describe(), f"dev {member.ifname}"),
                ]
            ignore, announce = member.arp_ignore.effective, member.arp_announce.effective
            # arp_filter answers only where the reply to the asker leaves, which per-interface
            # source routing makes the address's own interface: no flux, whatever arp_ignore says
            # (WEKA's clients: arp_filter=1 with a routing table per NIC).
            filtered = own_way_out and bool(member.arp_filter.effective)
            arp_evidence: list[Evidence] = []
            if member.static_arp:
                pass  # every peer's address is resolved by a PERMANENT entry: no ARP to flux
            elif ignore is None or announce is None:
                unknown.append("arp_ignore/arp_announce unreadable")
            elif (ignore < 1 and not filtered) or announce < (1 if own_way_out or bound else 2):
                wanted = ">= 1 (replies leave by this interface)" if own_way_out else ">= 1 (RoCE resolves bound to this interface)" if bound else ">= 2"
                arp_evidence = [
                    Evidence(f"{knob}/arp_ignore", f"{member.arp_ignore.all}, {member.arp_ignore.interface} (effective {ignore})", ">= 1"),
                    Evidence(f"{knob}/arp_announce", f"{member.arp_announce.all}, {member.arp_announce.interface} (effective {announce})", wanted),
                ]
            not_nccls = member.ifname not in used and (member.link_type == "infiniband" or (roce is not None and member.ifname not in roce))
            if rp_evidence and not_nccls:
                yield present(member.ifname, shared, *rp_evidence, *arp_evidence, severity=Severity.WARNING)
            elif rp_evidence:
                yield present(member.ifname, shared, *rp_evidence, *arp_evidence)
            elif arp_evidence:
                yield present(member.ifname, shared, *arp_evidence, severity=Severity.WARNING, fix=ARP_FIX)
            elif unknown:
                yield undecided(member.ifname, "; ".join(unknown), shared)


@check("NET005", optional=("nccl_libs", "rdma"))
def nccl_wrong_socket_interface(
    nccl_socket: NcclSocketFacts, routing: RoutingFacts, nccl_libs: NcclLibFacts | Unread, rdma: RdmaFacts | Unread = NOT_GIVEN
) -> Iterator[Observation]:
    """NCCL selects nothing usable, or an interface the peers are not reached through, or (before
    2.28) one that is not running; or several interfaces share a subnet with strict reverse-path
    filtering or ARP flux."""
    used = {use.interface.ifname for use in uses(nccl_socket)}
    yield from merge_by_subject(chain(
        _selection_problems(nccl_socket, routing), _route_mismatch(nccl_socket, routing), _multi_rail(routing, used, _roce_netdevs(rdma)),
        _down_pick_before_2_28(nccl_socket, nccl_libs),
    ))


def _before_2_28(nccl_libs: NcclLibFacts) -> tuple[list[NcclCopy], list[NcclCopy]]:
    """The NCCL copies a loader reaches, and those among them older than 2.28, which take
    interfaces that are not running."""
    loaded = [copy for copy in nccl_libs.copies if not copy.unreached]
    return loaded, [copy for copy in loaded if (version := version_tuple(copy.version or "")) is not None and version[:2] < RUNNING_FILTER_SINCE]


def _down_pick_before_2_28(facts: NcclSocketFacts, nccl_libs: NcclLibFacts | Unread) -> Iterator[Observation]:
    """NCCL before 2.28 takes interfaces that are not running (socket.cc at v2.27.7-1 has no
    IFF_RUNNING test): an IPoIB port that is down but keeps its address is then its bootstrap
    interface, and the job hangs there. An error where every NCCL the node holds is that old, a
    warning where a newer one may be the job's."""
    older = facts.bootstrap_before_2_28
    if older is None or not older.interfaces or older.interfaces[0].running:
        return
    picked = older.interfaces[0]
    setting = Evidence(older.source, older.rule)
    seen = Evidence("getifaddrs", f"bootstrap before NCCL 2.28: {shown(picked)}, which is not running", "a running interface")
    if isinstance(nccl_libs, Unread):
        yield undecided(picked.ifname, f"NCCL before 2.28 would bind to it, and which NCCL the node holds is unknown ({nccl_libs})", setting, seen)
        return
    loaded, old = _before_2_28(nccl_libs)
    if not old:
        if any(not copy.version or version_tuple(copy.version) is None for copy in loaded) or (not loaded and nccl_libs.problems):
            yield undecided(picked.ifname, "NCCL before 2.28 would bind to it, and the node's NCCL release is not known")
        return
    rest = len(loaded) - len(old)
    yield present(
        picked.ifname, setting, seen,
        *(Evidence(copy.path, f"NCCL {copy.version}", f"NCCL {RUNNING_FILTER_SINCE[0]}.{RUNNING_FILTER_SINCE[1]} or newer") for copy in old[:4]),
        severity=Severity.WARNING if rest else None,
    )


# Interfaces that never carry traffic between nodes: name prefixes (Docker, libvirt, CNI plugins,
# overlays, VPNs) and link kinds (the container side of a Docker bridge network is a veth named eth0).
VIRTUAL_PREFIXES = {
    "docker": "Docker bridge", "veth": "veth pair", "virbr": "libvirt bridge",
    "cni": "CNI bridge", "cbr": "kubenet bridge", "flannel": "flannel overlay", "cali": "Calico veth",
    "vxlan": "VXLAN overlay", "tunl": "IP-in-IP tunnel", "cilium": "Cilium device", "lxc": "container veth",
    "lxcbr": "LXC bridge", "podman": "Podman bridge", "weave": "Weave overlay", "kube-ipvs": "kube-proxy IPVS dummy",
    "nodelocaldns": "node-local DNS dummy", "tailscale": "Tailscale VPN", "genev": "Geneve tunnel",
}


#: Docker names a user-defined network's bridge br-<first 12 hex digits of the network ID>
#: (libnetwork's bridge driver); other br-* names are bridges an administrator made, such as
#: OVN-Kubernetes' br-ex, which holds an OpenShift node's routable address.
DOCKER_NETWORK_BRIDGE = re.compile(r"br-[0-9a-f]{12}")


def virtual_name(ifname: str) -> str:
    """What ``ifname``'s name alone marks it as (a container bridge, an overlay), "" when nothing."""
    if DOCKER_NETWORK_BRIDGE.fullmatch(ifname):
        return "Docker user-defined bridge"
    return next((what for prefix, what in VIRTUAL_PREFIXES.items() if ifname.startswith(prefix)), "")


VIRTUAL_KINDS = {
    "veth": "veth pair", "vxlan": "VXLAN overlay", "geneve": "Geneve tunnel", "ipip": "IP-in-IP tunnel",
    "dummy": "dummy device", "tun": "tun device", "wireguard": "WireGuard tunnel",
}


# -- helpers shared by the checks -------------------------------------------------------------
class Use(Struct, frozen=True):
    """One interface NCCL would use, and for what."""

    purpose: str
    primary: bool  # bootstrap or the first device, which every NCCL job uses
    choice: SocketChoice
    interface: IfAddr

    def setting(self) -> Evidence:
        return Evidence(self.choice.source, self.choice.rule)


def uses(facts: NcclSocketFacts) -> list[Use]:
    """Bootstrap, the first device (IB out-of-band, or socket transport) and, when the socket
    transport carries data, its other devices; one entry per interface, first purpose wins."""
    found = [Use("bootstrap", True, facts.bootstrap, item) for item in facts.bootstrap.interfaces]
    first = "first socket transport device" if facts.socket_transport else "IB out-of-band socket"
    found += [Use(first, True, facts.devices, item) for item in facts.devices.interfaces[:1]]
    if facts.socket_transport:
        found += [Use(f"socket transport device {n}", False, facts.devices, item) for n, item in enumerate(facts.devices.interfaces[1:], 1)]
    unique: dict[str, Use] = {}
    for use in found:
        unique.setdefault(use.interface.ifname, use)
    return list(unique.values())


LINK_LOCAL_V4 = "IPv4 link-local address"


def virtual_reason(item: IfAddr) -> str:
    """Why ``item`` cannot carry traffic between nodes, "" when it may."""
    address = ipaddress.ip_address(item.address)
    if item.link_type == "loopback" or item.ifname == "lo" or address.is_loopback:
        return "loopback"
    if address.version == 4 and address.is_link_local:
        # 169.254.0.0/16 is never forwarded by routers (RFC 3927), and agents that make such
        # links give every node the same address; NCCL does not filter address ranges.
        return LINK_LOCAL_V4
    return virtual_name(item.ifname) or VIRTUAL_KINDS.get(item.kind, "")


def _is_link_local(item: IfAddr) -> bool:
    return item.family == 6 and item.scope == "link"


# -- NET001 -----------------------------------------------------------------------------------
#: Why a socket-transport device after the first is a warning: NCCL's topology search prefers
#: the fastest network devices, and one without a link speed in sysfs (bridges, overlays) counts
#: as 10 Gb/s (ncclNetSocketGetSpeed, src/transport/net_socket.cc), below a physical NIC's.
SECONDARY_DEVICE = "a secondary socket device, used where no faster interface is left"
#: Why the container end of a veth pair is a warning: a Kubernetes CNI routes pod addresses
#: between nodes (the pod's eth0 is such a veth), Docker's default bridge does not (NAT).
POD_VETH = "a container's veth: routable between nodes where the CNI routes pod addresses, not behind Docker's NAT"
#: Why a dummy, tun, WireGuard or tunnel device NCCL picks is a warning: routing-on-the-host
#: fabrics put the node's one routable address on a dummy device, and VPN meshes join nodes
#: through tun and WireGuard devices; elsewhere such a device reaches no other node.
ROUTED_KIND = "routable only where the host routes its address (a BGP-announced /32, a VPN mesh)"
#: Why an IPv4 link-local address on a physical NIC NCCL picks by itself is a warning: it reaches
#: the nodes on the same link, which is all of them where nodes are cabled back to back or share
#: one L2 segment, and none across a router. Named in NCCL_SOCKET_IFNAME it is the site's choice
#: (NVIDIA's DGX Spark playbooks address the direct QSFP link so), and not judged.
LINK_LOCAL_NIC = "reaches only nodes on the same link: enough where nodes are cabled back to back or share one L2 segment"
ROUTABLE_KINDS = frozenset({"dummy", "tun", "wireguard", "vxlan", "geneve", "ipip"})


#: Why an interface that reaches no other node is a warning in a job of one node.
ONE_NODE_FIX = (
    "This job runs on one node, where its ranks meet over this interface, so it is not hurt; a job "
    "of several nodes would be. Set NCCL_SOCKET_IFNAME to an interface routable between nodes (or run "
    "the container with --network=host) before such a job."
)


def _devices_before_2_28(nccl_socket: NcclSocketFacts, nccl_libs: NcclLibFacts | Unread) -> list[Use]:
    """The socket transport's devices that only an NCCL before 2.28 takes (one that is not
    running: an idle Docker network's bridge keeps its gateway address), where such an NCCL is on
    the node and the socket transport carries the data."""
    older = nccl_socket.devices_before_2_28
    if older is None or not nccl_socket.socket_transport or isinstance(nccl_libs, Unread):
        return []
    if not _before_2_28(nccl_libs)[1]:
        return []
    taken = {use.interface.ifname for use in uses(nccl_socket)}
    purpose = "socket transport device of NCCL before 2.28 (it takes interfaces that are not running)"
    return [Use(purpose, False, older, item) for item in older.interfaces if item.ifname not in taken]


@check("NET001", optional=("job", "nccl_libs"))
def nccl_virtual_interface_selected(
    nccl_socket: NcclSocketFacts, job: JobFacts | Unread = NOT_GIVEN, nccl_libs: NcclLibFacts | Unread = NOT_GIVEN
) -> Iterator[Observation]:
    """NCCL would bind to a loopback, container, bridge, overlay or VPN interface; a warning for
    a secondary socket device or a container's own veth, which may well be routable, and nothing
    for a Kubernetes pod's eth0 (kubelet's /etc/hosts): the Kubernetes network model has every
    pod reach every other pod, on any node, without NAT (kubernetes.io, Cluster Networking). In a
    job known to run on one node (Slurm's node count, torchrun's) every pick is a warning."""
    one_node = not isinstance(job, Unread) and job_nodes(job.environ)[1] == 1
    for use in uses(nccl_socket) + _devices_before_2_28(nccl_socket, nccl_libs):
        reason = virtual_reason(use.interface)
        if not reason or _is_link_local(use.interface):
            continue  # an IPv6 link-local pick is NET003's case
        pod_veth = _container_veth(use.interface)
        if pod_veth and nccl_socket.kubernetes_pod and use.interface.ifname == "eth0":
            continue  # a pod's own eth0: Kubernetes routes pod addresses between nodes without NAT
        named = use.choice.source.endswith("NCCL_SOCKET_IFNAME") and not use.choice.rule.lstrip().startswith("^")
        if reason == LINK_LOCAL_V4 and _physical(use.interface) and named:
            # Named on purpose: NVIDIA's DGX Spark playbooks address the QSFP link between two
            # Sparks link-local and name it; whether the peers share the link is NET004's question.
            continue
        doubt = (
            SECONDARY_DEVICE if not use.primary
            else POD_VETH if pod_veth
            else ROUTED_KIND if _routable_kind(use.interface)
            else LINK_LOCAL_NIC if _physical(use.interface)
            else ""
        )
        yield present(
            use.interface.ifname,
            use.setting(),
            Evidence("getifaddrs", f"{use.purpose}: {shown(use.interface)} ({reason}{'; ' + doubt if doubt else ''})",
                     "an interface routable between nodes"),
            severity=Severity.WARNING if doubt or one_node else None,
            fix=ONE_NODE_FIX if one_node and not doubt else "",
        )


def _physical(item: IfAddr) -> bool:
    """A NIC of the node's own, neither virtual by its name nor by its kind (the only reason
    left for it is an IPv4 link-local address)."""
    virtual = item.kind in VIRTUAL_KINDS or virtual_name(item.ifname)  # ROUTABLE_KINDS among them
    return not virtual and item.link_type != "loopback" and item.ifname != "lo"


def _routable_kind(item: IfAddr) -> bool:
    """A dummy, tun, WireGuard or tunnel device known by its kind alone (no name marks it as a
    container bridge or overlay agent): such a device carries a host's routed address by design
    where the host itself routes (a /32 on a dummy announced by BGP) or a VPN mesh joins the nodes."""
    if item.kind not in ROUTABLE_KINDS or virtual_name(item.ifname):
        return False
    return not ipaddress.ip_address(item.address).is_link_local


def _container_veth(item: IfAddr) -> bool:
    """A veth that no name marks as a host-side bridge port or overlay: the container's end of
    the pair, whose address the pod network may route. Docker's default bridge (172.17.0.0/16)
    is not routed between hosts."""
    if item.kind != "veth" or virtual_name(item.ifname):
        return False
    return ipaddress.ip_address(item.address) not in DOCKER_DEFAULT_BRIDGE


DOCKER_DEFAULT_BRIDGE = ipaddress.ip_network("172.17.0.0/16")  # docker0's default subnet


# -- NET002 -----------------------------------------------------------------------------------
def _is_ipv6_literal(text: str) -> bool:
    try:
        return ipaddress.ip_address(text.strip("[]").split("%", 1)[0]).version == 6
    except ValueError:
        return False


@check("NET002")
def ipv6_address_family_mismatch(nccl_socket: NcclSocketFacts) -> Iterator[Observation]:
    """IPv6 asked for where the kernel has none, an ignored family setting, or an IPv6 pick
    nobody asked for on a node that also has a routable IPv4 address (on an IPv6-only node every
    peer publishes IPv6 too)."""
    family = nccl_socket.socket_family
    if family is not None and family.value not in FAMILIES:
        yield present(
            "NCCL_SOCKET_FAMILY",
            Evidence(f"{family.origin} NCCL_SOCKET_FAMILY", family.value, "AF_INET or AF_INET6 (anything else is ignored)"),
            severity=Severity.WARNING,
        )
    if nccl_socket.ipv6 in ("disabled", "off at boot"):
        ipv6_source = Evidence(
            "/proc/sys/net/ipv6" if nccl_socket.ipv6 == "off at boot" else "/proc/sys/net/ipv6/conf/all/disable_ipv6",
            "absent (ipv6.disable=1 at boot)" if nccl_socket.ipv6 == "off at boot" else "1",
            "IPv6 available, or IPv4-only settings",
        )
        if family is not None and family.value == "AF_INET6":
            yield present("NCCL_SOCKET_FAMILY", Evidence(f"{family.origin} NCCL_SOCKET_FAMILY", family.value), ipv6_source)
        if nccl_socket.comm_id is not None and _is_ipv6_literal(comm_id_host(nccl_socket.comm_id.value)):
            yield present("NCCL_COMM_ID", Evidence(f"{nccl_socket.comm_id.origin} NCCL_COMM_ID", nccl_socket.comm_id.value), ipv6_source)
        if _is_ipv6_literal(nccl_socket.master_addr):
            yield present("MASTER_ADDR", Evidence("environment MASTER_ADDR", nccl_socket.master_addr), ipv6_source)
    if family is not None and family.value == "AF_INET6":
        return  # IPv6 was asked for
    if not any(_routable_ipv4(item) for item in nccl_socket.candidates):
        return  # an IPv6-only node: its peers are alike and publish IPv6 addresses too
    for use in uses(nccl_socket):
        item = use.interface
        if use.primary and item.family == 6 and not _is_link_local(item):
            yield present(
                item.ifname,
                use.setting(),
                Evidence("getifaddrs", f"{use.purpose}: {shown(item)} (the interface has no IPv4 address)", "an IPv4 address, or NCCL_SOCKET_FAMILY=AF_INET6 on every node"),
                severity=Severity.WARNING,
            )


def _routable_ipv4(item: IfAddr) -> bool:
    """An IPv4 address another node could reach: not loopback, not link-local (169.254/16)."""
    if item.family != 4:
        return False
    address = ipaddress.ip_address(item.address)
    return not (address.is_loopback or address.is_link_local or item.link_type == "loopback")


# -- NET003 -----------------------------------------------------------------------------------
@check("NET003")
def nccl_proxy_connect_ipv6_link_local(nccl_socket: NcclSocketFacts) -> Iterator[Observation]:
    """NCCL would publish an IPv6 link-local address, reachable only on its own link."""
    for use in uses(nccl_socket):
        if _is_link_local(use.interface):
            doubt = "" if use.primary else f"; {SECONDARY_DEVICE}"
            yield present(
                use.interface.ifname,
                use.setting(),
                Evidence(
                    "getifaddrs",
                    f"{use.purpose}: {shown(use.interface)} (IPv6 link-local; no IPv4 or global IPv6 address{doubt})",
                    "an IPv4 or global IPv6 address",
                ),
                severity=Severity.WARNING if doubt else None,
            )
