"""Routes to the job's peers and multi-rail reverse-path/ARP settings (references NET004, NET005).

Peers: the job's nodes (``SLURM_JOB_NODELIST``, else ``SLURM_NODELIST``, expanded without
``scontrol`` by :mod:`preflight.hostlist`), ``MASTER_ADDR``, the host of ``NCCL_COMM_ID``, and the
site's ``[expect] peers``; this host itself is skipped and at most :data:`MAX_PEERS` are looked at.
Each is resolved as libc would under ``hosts: files dns``: an address literal, ``/etc/hosts``,
else DNS ``A``/``AAAA`` through the dns source, all lookups together bounded by
:data:`DNS_BUDGET_S` (a dead nameserver must not cost one lifetime per peer). Each address gets
a route lookup through the netlink source (``RTM_GETROUTE``; see ``preflight.sources.routes``).

Multi-rail: running interfaces whose IPv4 subnets overlap. For each, ``/proc/sys/net/ipv4/conf/
{all,<if>}/{rp_filter,arp_ignore,arp_announce}`` (``Documentation/networking/ip-sysctl.rst``:
the kernel applies the larger of ``all`` and the interface's value for all three) and a route
lookup *from* the interface's address into its subnet: without per-source policy rules the reply
path of a second NIC is the first NIC, and strict reverse-path filtering (1) drops what arrives
on the second one.
"""

from __future__ import annotations

import ipaddress
import threading
import time

from msgspec import Struct

from preflight.config import HostConfig
from preflight.hostlist import HostlistError, expand
from preflight.probes.hostname import parse_hosts
from preflight.probes.job import JobFacts, rendezvous_host
from preflight.probes.nccl_socket import comm_id_host
from preflight.probing import FactReader
from preflight.registry import probe
from preflight.sources import NodeFS, SourceError
from preflight.sources.dns import Dns
from preflight.sources.netlink import Address, Link, Netlink
from preflight.sources.routes import Route

MAX_PEERS = 32  # a 2,000-node job needs no 2,000 lookups to show that one subnet is unroutable


DNS_BUDGET_S = 2.5


CONF = "/proc/sys/net/ipv4/conf"


class Peer(Struct, frozen=True):
    """One peer, its addresses and the routes to them."""

    name: str  # as the job or the config names it
    origins: tuple[str, ...]  # "SLURM_JOB_NODELIST", "MASTER_ADDR" (or PET_RDZV_ENDPOINT...), "NCCL_COMM_ID", "expect.peers"
    resolved_by: str  # "address literal", "/etc/hosts:3", "DNS"; "" when unresolved
    addresses: tuple[str, ...]
    resolve_error: str  # why there is no address
    routes: tuple[Route, ...]
    route_errors: tuple[str, ...]  # lookups that could not be made


class Sysctl(Struct, frozen=True):
    """One ``net.ipv4.conf`` knob for an interface: its own value and ``all``'s."""

    interface: int | None
    all: int | None

    @property
    def effective(self) -> int | None:
        """The larger of the two, as the kernel applies rp_filter, arp_ignore and arp_announce."""
        return None if self.interface is None or self.all is None else max(self.interface, self.all)


class RailMember(Struct, frozen=True):
    """An interface that shares its IPv4 subnet with another running interface."""

    ifname: str
    address: str
    prefixlen: int
    rp_filter: Sysctl
    arp_ignore: Sysctl
    arp_announce: Sysctl
    return_route: Route | None  # route get <address in the subnet> from <address>
    return_route_error: str
    link_type: str = ""  # the link's ARPHRD type: "ether", "infiniband" (IPoIB)...
    # arp_filter (on where all's or the interface's is): ARP is answered only on the interface
    # the reply to the asker would leave by (arp_filter() in net/ipv4/arp.c)
    arp_filter: Sysctl = Sysctl(None, None)
    # Every neighbour entry /proc/net/arp lists on this interface is PERMANENT (static ARP, as HPE
    # Slingshot's reference configuration sets on each hsn interface): no ARP is asked or
    # answered for those peers. False with a dynamic entry or none; None where the table is unread.
    static_arp: bool | None = None


class RoutingFacts(Struct, frozen=True):
    hostname: str  # /proc/sys/kernel/hostname
    peers: tuple[Peer, ...]
    peers_total: int  # distinct peers before the MAX_PEERS cap
    peer_problems: tuple[tuple[str, str], ...]  # (setting, why its peers are unknown): a bad hostlist
    same_subnet: tuple[tuple[RailMember, ...], ...]  # groups of interfaces with overlapping subnets
    problems: tuple[str, ...]


# -- peers ------------------------------------------------------------------------------------
def collect_peers(
    environ: dict[str, str], comm_id: str, configured: tuple[str, ...], hostname: str
) -> tuple[dict[str, list[str]], list[tuple[str, str]]]:
    """Peer name -> origins, in order (the rendezvous host: MASTER_ADDR, or Kubeflow's
    PET_RDZV_ENDPOINT or PET_MASTER_ADDR; NCCL_COMM_ID, config, nodelist); and the
    settings whose peers could not be listed, with the reason."""
    problems: list[tuple[str, str]] = []
    found: dict[str, list[str]] = {}
    sources: list[tuple[str, list[str]]] = []
    host, named_by = rendezvous_host(environ)
    if host:
        sources.append((named_by, [host]))
    if comm_id:
        sources.append(("NCCL_COMM_ID", [comm_id_host(comm_id)]))
    for item in configured:
        sources.append(("expect.peers", expand(item)))  # validated when the config was read
    nodelist_name = "SLURM_JOB_NODELIST" if "SLURM_JOB_NODELIST" in environ else "SLURM_NODELIST"
    if environ.get(nodelist_name):
        try:
            sources.append((nodelist_name, expand(environ[nodelist_name])))
        except HostlistError as error:
            problems.append((nodelist_name, str(error)))
    own = {hostname, hostname.split(".", 1)[0]} if hostname else set()
    for origin, names in sources:
        for name in names:
            name = name.strip().strip("[]")
            if name and name not in own and name.split(".", 1)[0] not in own:
                found.setdefault(name, []).append(origin)
    return found, problems


def _literal(name: str) -> str:
    try:
        return str(ipaddress.ip_address(name.split("%", 1)[0]))
    except ValueError:
        return ""


def resolve_in_dns(dns: Dns, names: list[str], budget_s: float) -> dict[str, tuple[tuple[str, ...], str]]:
    """A and AAAA answers for each name, in parallel; names without an answer within
    ``budget_s`` get an error. Lookups run in daemon threads so a hung resolver is left behind."""
    results: dict[str, tuple[tuple[str, ...], str]] = {}

    def lookup(name: str) -> None:
        try:
            answers = [dns.resolve(name, rdtype) for rdtype in ("A", "AAAA")]
        except SourceError as error:
            results[name] = ((), error.reason)
            return
        addresses = tuple(address for answer in answers for address in answer.addresses)
        errors = ", ".join(f"{answer.rdtype} {answer.error}" for answer in answers if answer.error)
        results[name] = (addresses, "" if addresses else f"DNS: {errors}")

    threads = [threading.Thread(target=lookup, args=(name,), name=f"dns-{name}", daemon=True) for name in names]
    deadline = time.monotonic() + budget_s
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    return {name: results.get(name, ((), f"DNS: no answer within {budget_s:g} s")) for name in names}


def _routes(netlink: Netlink, addresses: tuple[str, ...]) -> tuple[tuple[Route, ...], tuple[str, ...]]:
    routes, errors = [], []
    for address in addresses:
        try:
            routes.append(netlink.route_get(address))
        except SourceError as error:
            errors.append(f"{address}: {error.reason}")
    return tuple(routes), tuple(errors)


def _peers(fs: NodeFS, netlink: Netlink, dns: Dns, settings: HostConfig, job: JobFacts, hostname: str) -> tuple[list[Peer], int, list[tuple[str, str]], list[str]]:
    comm_id = job.nccl("NCCL_COMM_ID")
    wanted, peer_problems = collect_peers(job.environ, comm_id.value if comm_id else "", settings.expect.peers, hostname)
    total = len(wanted)
    chosen = list(wanted.items())[:MAX_PEERS]
    reader = FactReader(fs)
    hosts = parse_hosts(reader.text("/etc/hosts") or "")
    resolved: dict[str, tuple[str, tuple[str, ...], str]] = {}
    for name, _ in chosen:
        literal = _literal(name)
        lines = [entry for entry in hosts if name.lower() in (n.lower() for n in entry.names)]
        if literal:
            resolved[name] = ("address literal", (literal,), "")
        elif lines:
            resolved[name] = (lines[0].source, tuple(dict.fromkeys(entry.address for entry in lines)), "")
    pending = [name for name, _ in chosen if name not in resolved]
    for name, (addresses, error) in resolve_in_dns(dns, pending, DNS_BUDGET_S).items():
        resolved[name] = ("DNS" if addresses else "", addresses, error)
    peers = []
    for name, origins in chosen:
        how, addresses, error = resolved[name]
        routes, route_errors = _routes(netlink, addresses)
        peers.append(Peer(name, tuple(origins), how, addresses, error, routes, route_errors))
    return peers, total, peer_problems, reader.problems


# -- multi-rail -------------------------------------------------------------------------------
def same_subnet_groups(links: list[Link], addresses: list[Address]) -> list[list[Address]]:
    """Running interfaces' global IPv4 addresses, grouped where subnets overlap (two or more
    interfaces per group)."""
    running = {link.name for link in links if link.operstate in ("up", "unknown") and link.link_type != "loopback"}
    v4 = [a for a in addresses if a.family == 4 and a.ifname in running and a.scope == "global" and a.prefixlen < 31]
    groups: list[list[Address]] = []
    for address in v4:
        network = ipaddress.ip_network(f"{address.address}/{address.prefixlen}", strict=False)
        for group in groups:
            if any(network.overlaps(ipaddress.ip_network(f"{m.address}/{m.prefixlen}", strict=False)) for m in group):
                group.append(address)
                break
        else:
            groups.append([address])
    return [group for group in groups if len({m.ifname for m in group}) > 1]


def _sysctl(reader: FactReader, ifname: str, knob: str) -> Sysctl:
    def value(name: str) -> int | None:
        text = reader.text(f"{CONF}/{name}/{knob}")
        if text is None:
            return None
        try:
            return int(text.strip())
        except ValueError:
            reader.problems.append(f"{CONF}/{name}/{knob}: not a number: {text.strip()[:40]!r}")
            return None

    return Sysctl(value(ifname), value("all"))


def _probe_target(member: Address, locals_: set[str], peers: list[Peer]) -> str:
    """An address in the member's subnet to look a route up for: a peer's if there is one."""
    network = ipaddress.ip_network(f"{member.address}/{member.prefixlen}", strict=False)
    for peer in peers:
        for address in peer.addresses:
            if ipaddress.ip_address(address) in network and address not in locals_:
                return address
    for host in network.hosts():
        if str(host) not in locals_:
            return str(host)
    return ""


def _rail_member(
    reader: FactReader, netlink: Netlink, member: Address, locals_: set[str], peers: list[Peer], link_types: dict[str, str],
    neighbours: dict[str, bool] | None,
) -> RailMember:
    target = _probe_target(member, locals_, peers)
    route: Route | None = None
    error = ""
    try:
        route = netlink.route_get(target, member.address) if target else None
    except SourceError as failure:
        error = failure.reason
    return RailMember(
        member.ifname, member.address, member.prefixlen,
        _sysctl(reader, member.ifname, "rp_filter"), _sysctl(reader, member.ifname, "arp_ignore"),
        _sysctl(reader, member.ifname, "arp_announce"), route, error, link_types.get(member.ifname, ""),
        _sysctl(reader, member.ifname, "arp_filter"),
        None if neighbours is None else neighbours.get(member.ifname, False),
    )


#: ATF_PERM in a /proc/net/arp entry's flags (include/uapi/linux/if_arp.h): a static entry
ARP_PERMANENT = 0x04
#: /proc/net/arp read at most: a large fabric's static tables list every peer on every rail
ARP_TABLE_BYTES = 8 << 20


def _neighbours(fs: NodeFS) -> dict[str, bool] | None:
    """:func:`parse_arp_table` of /proc/net/arp; None where it is missing or unreadable (the ARP
    settings then decide, as before any table was read)."""
    try:
        text = fs.read("/proc/net/arp", max_bytes=ARP_TABLE_BYTES)
    except SourceError:
        return None
    return parse_arp_table(text) if text is not None else None


def parse_arp_table(text: str) -> dict[str, bool]:
    """Device -> whether every entry /proc/net/arp lists on it is PERMANENT (columns: IP address,
    HW type, Flags, HW address, Mask, Device)."""
    static: dict[str, bool] = {}
    for line in text.splitlines()[1:]:
        fields = line.split()
        if len(fields) < 6:
            continue
        try:
            flags = int(fields[2], 16)
        except ValueError:
            continue
        static[fields[5]] = static.get(fields[5], True) and bool(flags & ARP_PERMANENT)
    return static


@probe("routing", timeout_s=DNS_BUDGET_S + 1.5)
def probe_routing(fs: NodeFS, netlink: Netlink, dns: Dns, settings: HostConfig, job: JobFacts) -> RoutingFacts:
    """Resolve and route the job's peers; read multi-rail reverse-path and ARP settings."""
    reader = FactReader(fs)
    hostname = (reader.text("/proc/sys/kernel/hostname") or "").strip()
    peers, total, peer_problems, problems = _peers(fs, netlink, dns, settings, job, hostname)
    addresses = netlink.addresses()
    links = netlink.links()
    link_types = {link.name: link.link_type for link in links}
    locals_ = {a.address for a in addresses}
    shared = same_subnet_groups(links, addresses)
    neighbours = _neighbours(fs) if shared else None
    groups = tuple(
        tuple(_rail_member(reader, netlink, member, locals_, peers, link_types, neighbours) for member in group)
        for group in shared
    )
    return RoutingFacts(hostname, tuple(peers), total, tuple(peer_problems), groups, tuple(problems + reader.problems))
