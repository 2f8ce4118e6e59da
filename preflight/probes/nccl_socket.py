"""Which IP interface and address NCCL would use on this node (references NET001, NET002, NET003).

NCCL picks its socket interfaces once per process (``ncclFindInterfaces()`` in
``src/misc/socket.cc``, ``ncclOsFindInterfaces()`` in ``src/os/linux.cc``, the list grammar in
``parseStringList()``/``matchIfList()`` of ``src/misc/utils.cc``):

* ``NCCL_SOCKET_IFNAME`` counts only when it is longer than one character. A leading ``^``
  excludes, then a leading ``=`` asks for exact names; otherwise each comma-separated entry is a
  name *prefix* (``eth1`` also matches ``eth10``); ``:<port>`` suffixes are ignored here.
* Unset, NCCL tries in turn: names starting with ``ib``; (with ``NCCL_COMM_ID``) the first address
  in the same subnet as the ID's address; everything except ``^docker,lo,virbr``; then ``docker``,
  ``lo`` and ``virbr`` themselves.
* It walks ``getifaddrs()``: only ``IFF_RUNNING`` interfaces (the kernel sets it when the
  operstate is ``up`` or ``unknown``; releases before 2.28 take any interface, and search
  without the ``virbr`` steps: ``bootstrap_before_2_28``), AF_INET/AF_INET6 only, never ``::1``, the first address per
  interface, in the order glibc's netlink dump gives: every IPv4 address (by ifindex) before every
  IPv6 one, and on one interface global IPv6 before link-local. ``NCCL_SOCKET_FAMILY`` =
  ``AF_INET``/``AF_INET6`` keeps one family; any other value is ignored.
* Bootstrap takes one interface, or with ``NCCL_COMM_ID`` the first address (running or not) in the
  ID's subnet. The IB transport's out-of-band socket takes the first interface; the socket transport
  takes up to 16, one device each.

Sources: links and addresses from the netlink source; the job's settings from the ``job`` probe's
reader (environment, then ``$NCCL_CONF_FILE``/``~/.nccl.conf``, then ``/etc/nccl.conf``);
``/sys/class/infiniband`` (RDMA devices make the IB transport, not sockets, carry data);
``/proc/sys/net/ipv6/conf/all/disable_ipv6`` and the presence of ``/proc/sys/net/ipv6``
(absent when the kernel booted with ``ipv6.disable=1``); ``/etc/hosts`` for an ``NCCL_COMM_ID``
host name.
"""

from __future__ import annotations

import ipaddress

from msgspec import Struct

from preflight.nccl.gid import nccl_int
from preflight.probes.hostname import parse_hosts
from preflight.probes.efa import loader_dirs
from preflight.probes.job import JobFacts, Setting, named_net_plugin
from preflight.probing import KUBELET_HOSTS_HEADER, FactReader
from preflight.registry import probe
from preflight.sources import NodeFS, SourceError
from preflight.sources.netlink import Address, Link, Netlink

MAX_IFS = 16  # MAX_IFS in NCCL's src/include/socket.h: list entries and socket devices


_PREFIX_MAX = 63  # struct netIf.prefix is char[64]


DEFAULT_SEARCH = ("ib", "", "^docker,lo,virbr", "docker", "lo", "virbr")  # "" marks the NCCL_COMM_ID step
# NCCL before 2.28 searched without the virbr steps and took interfaces that are not running
# (IFF_RUNNING is first tested in socket.cc at v2.28.3-1; v2.27.7-1 findInterfaces has no test).
SEARCH_BEFORE_2_28 = ("ib", "", "^docker,lo", "docker", "lo")
RUNNING_FILTER_SINCE = (2, 28)


DEFAULT_ORDER = "NCCL default interface order"


FAMILIES = {"AF_INET": 4, "AF_INET6": 6}


class IfnameList(Struct, frozen=True):
    """An interface list as ``ncclOsFindInterfaces()`` reads it."""

    exclude: bool  # leading '^'
    exact: bool  # '=' after the optional '^'
    entries: tuple[str, ...]  # name prefixes (or exact names), at most MAX_IFS


class IfAddr(Struct, frozen=True):
    """One AF_INET/AF_INET6 entry of ``getifaddrs()``."""

    ifname: str
    index: int  # ifindex
    family: int  # 4 or 6
    address: str
    prefixlen: int
    scope: str  # "global", "link", "host"
    running: bool  # IFF_RUNNING: operstate "up" or "unknown"
    kind: str  # IFLA_INFO_KIND ("veth", "bridge", "" for a physical NIC)
    link_type: str  # "ether", "infiniband", "loopback"


class SocketChoice(Struct, frozen=True):
    """Interfaces NCCL would use for one purpose and the rule that chose them."""

    source: str  # "/etc/nccl.conf NCCL_SOCKET_IFNAME", "environment NCCL_COMM_ID" or DEFAULT_ORDER
    rule: str  # the setting's value, or the default step that matched ("'ib' prefix")
    interfaces: tuple[IfAddr, ...]


class NcclSocketFacts(Struct, frozen=True):
    """NCCL's socket settings on this node and what they select."""

    socket_ifname: Setting | None  # NCCL_SOCKET_IFNAME
    socket_family: Setting | None  # NCCL_SOCKET_FAMILY
    comm_id: Setting | None  # NCCL_COMM_ID
    comm_id_address: str  # its address (literal or /etc/hosts), "" when unset or unresolved here
    master_addr: str  # MASTER_ADDR of the job environment, "" when unset
    socket_transport: str  # why NET/Socket carries data ("no RDMA devices", ...), "" when IB does
    ipv6: str  # "enabled", "disabled" (conf/all/disable_ipv6 = 1), "off at boot" (no /proc/sys/net/ipv6), "unknown"
    links: tuple[Link, ...]
    candidates: tuple[IfAddr, ...]  # getifaddrs() order
    bootstrap: SocketChoice  # bootstrap's one interface
    devices: SocketChoice  # socket transport devices; the first is also the IB out-of-band interface
    problems: tuple[str, ...]  # facts that could not be read
    # What NCCL before 2.28 binds bootstrap to, where that differs from the choice above (it also
    # takes interfaces that are not running); None where both releases choose alike.
    bootstrap_before_2_28: SocketChoice | None = None
    # The socket transport's devices before NCCL 2.28, where they differ from ``devices``
    devices_before_2_28: SocketChoice | None = None
    # /etc/hosts carries kubelet's header: this is a Kubernetes pod, whose network model routes
    # pod addresses between nodes without NAT. None: /etc/hosts unread.
    kubernetes_pod: bool | None = None


# -- NCCL's grammar and search --------------------------------------------------------------------
def parse_ifname_list(text: str) -> IfnameList:
    """``^=eth0,eth1:5`` -> exclude, exact, ("eth0", "eth1")."""
    exclude = text.startswith("^")
    rest = text[1:] if exclude else text
    exact = rest.startswith("=")
    rest = rest[1:] if exact else rest
    entries = [item.split(":", 1)[0][:_PREFIX_MAX] for item in rest.split(",")]
    return IfnameList(exclude, exact, tuple(entry for entry in entries if entry)[:MAX_IFS])


def entry_matches(entry: str, name: str, exact: bool) -> bool:
    return name == entry if exact else name.startswith(entry)


def list_selects(spec: IfnameList, name: str) -> bool:
    """``matchIfList() ^ searchNot``; an empty list matches everything."""
    listed = not spec.entries or any(entry_matches(entry, name, spec.exact) for entry in spec.entries)
    return listed != spec.exclude


def getifaddrs_order(links: tuple[Link, ...], addresses: tuple[Address, ...]) -> tuple[IfAddr, ...]:
    """The addresses as ``getifaddrs()`` lists them; addresses of unknown links are dropped."""
    by_name = {link.name: link for link in links}
    entries = []
    for address in addresses:
        link = by_name.get(address.ifname)
        if link is None:
            continue
        entries.append(
            IfAddr(
                link.name, link.index, address.family, address.address.split("%", 1)[0], address.prefixlen,
                address.scope, link.operstate in ("up", "unknown"), link.kind, link.link_type,
            )
        )
    scope_rank = {"global": 0, "site": 0, "link": 1}
    return tuple(sorted(entries, key=lambda e: (e.family, e.index, scope_rank.get(e.scope, 2) if e.family == 6 else 0)))


def find_interfaces(
    candidates: tuple[IfAddr, ...], spec: IfnameList, family: int | None, limit: int, running_only: bool = True
) -> tuple[IfAddr, ...]:
    """``ncclOsFindInterfaces()``: the first address of each matching running interface (any
    matching interface before NCCL 2.28: ``running_only`` False)."""
    found: list[IfAddr] = []
    for entry in candidates:
        if len(found) >= limit:
            break
        if (running_only and not entry.running) or (family is not None and entry.family != family):
            continue
        if entry.family == 6 and ipaddress.ip_address(entry.address).is_loopback:
            continue
        if list_selects(spec, entry.ifname) and all(item.ifname != entry.ifname for item in found):
            found.append(entry)
    return tuple(found)


def match_subnet(candidates: tuple[IfAddr, ...], remote: str) -> IfAddr | None:
    """``ncclFindInterfaceMatchSubnet()``: the first address whose subnet holds ``remote``, running
    or not. A link-local local address never matches: its scope id differs from the remote's 0."""
    try:
        target = ipaddress.ip_address(remote)
    except ValueError:
        return None
    for entry in candidates:
        if entry.family != target.version or (entry.family == 6 and entry.scope == "link"):
            continue
        if target in ipaddress.ip_network(f"{entry.address}/{entry.prefixlen}", strict=False):
            return entry
    return None


def nccl_choice(
    candidates: tuple[IfAddr, ...], ifname: Setting | None, family: int | None, comm_id_address: str, limit: int,
    before_2_28: bool = False,
) -> SocketChoice:
    """``ncclFindInterfaces()`` for ``limit`` interfaces, as NCCL 2.28 and later search, or as
    earlier releases did (``before_2_28``)."""
    running_only = not before_2_28
    if ifname is not None and len(ifname.value) > 1:
        found = find_interfaces(candidates, parse_ifname_list(ifname.value), family, limit, running_only)
        return SocketChoice(f"{ifname.origin} NCCL_SOCKET_IFNAME", ifname.value, found)
    for step in SEARCH_BEFORE_2_28 if before_2_28 else DEFAULT_SEARCH:
        if step == "":
            picked = match_subnet(candidates, comm_id_address) if comm_id_address else None
            if picked is not None:
                return SocketChoice(DEFAULT_ORDER, f"same subnet as NCCL_COMM_ID {comm_id_address}", (picked,))
            continue
        found = find_interfaces(candidates, parse_ifname_list(step), family, limit, running_only)
        if found:
            rule = f"names except {step[1:]}" if step.startswith("^") else f"'{step}' prefix"
            return SocketChoice(DEFAULT_ORDER, rule, found)
    return SocketChoice(DEFAULT_ORDER, "nothing matched", ())


def bootstrap_choice(candidates: tuple[IfAddr, ...], devices: SocketChoice, comm_id: Setting | None, comm_id_address: str) -> SocketChoice:
    """``bootstrapNetInit()``: NCCL_COMM_ID's subnet when it is set, else the first device."""
    if comm_id is None:
        return SocketChoice(devices.source, devices.rule, devices.interfaces[:1])
    source = f"{comm_id.origin} NCCL_COMM_ID"
    if not comm_id_address:
        return SocketChoice(source, f"{comm_id.value} (its host does not resolve from /etc/hosts)", ())
    picked = match_subnet(candidates, comm_id_address)
    return SocketChoice(source, f"{comm_id.value}: same subnet as {comm_id_address}", (picked,) if picked else ())


def comm_id_host(value: str) -> str:
    """The host part of ``<ipv4|host>:<port>`` or ``[<ipv6>[%if]]:<port>``."""
    if value.startswith("["):
        return value[1:].split("]", 1)[0].split("%", 1)[0]
    return value.split(":", 1)[0]


def family_setting(setting: Setting | None) -> int | None:
    return FAMILIES.get(setting.value) if setting is not None else None


# -- the probe --------------------------------------------------------------------------------
def _resolve_from_hosts(reader: FactReader, host: str) -> str:
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    for entry in parse_hosts(reader.text("/etc/hosts") or ""):
        if host.lower() in (name.lower() for name in entry.names):
            return entry.address
    return ""


#: What NCCL dlopens for its network plugin when NCCL_NET_PLUGIN is unset (src/plugin/net.cc).
DEFAULT_NET_PLUGIN = "libnccl-net.so"


def _socket_transport(job: JobFacts, reader: FactReader) -> str:
    """Why NCCL would carry data over its socket transport here, "" where it would not or that
    is not known. NCCL tries a network plugin first (NCCL_NET_PLUGIN's names, else
    libnccl-net.so wherever the loader finds it; "none" for none), then IB, then sockets: a
    plugin (aws-ofi-nccl for EFA or Slingshot's cxi, Google's TCPX, FasTrak and gIB) carries the
    data on nodes without verbs devices."""
    net = job.nccl("NCCL_NET")
    if net is not None:
        # "Socket" chooses it; IB or a plugin's name ("AWS Libfabric", "gIB") does not.
        return f"{net.origin} NCCL_NET={net.value}" if net.value.lower() == "socket" else ""
    disable = job.nccl("NCCL_IB_DISABLE")
    try:
        rdma = reader.fs.listdir("/sys/class/infiniband")
    except SourceError as error:
        reader.problems.append(str(error))
        return ""  # unknown: claim nothing about the socket transport's extra devices
    if not rdma or (disable is not None and nccl_int(disable.value, 0) != 0):  # any non-zero value, as NCCL's strtoll reads it
        if _net_plugin(job, reader) is not False:
            return ""  # a plugin may carry the data (or whether one loads is not known)
        if rdma:
            return f"{disable.origin} NCCL_IB_DISABLE={disable.value}" if disable is not None else ""
        return "no RDMA devices in /sys/class/infiniband and no NCCL network plugin"
    return ""


def _net_plugin(job: JobFacts, reader: FactReader) -> bool | None:
    """Whether NCCL would find a network plugin to load: NCCL_NET_PLUGIN names one (or "none"),
    else libnccl-net.so where the loader looks for it; None when a directory or ld.so.conf
    could not be read."""
    if job.nccl("NCCL_NET_PLUGIN") is not None:
        return named_net_plugin(job) is not None
    scan = FactReader(reader.fs)  # its own problems: an unread file leaves only this unknown
    for directory in loader_dirs(scan, job.environ):
        if DEFAULT_NET_PLUGIN in (scan.listing(directory.rstrip("/")) or []):
            return True
    return None if scan.problems else False


def _ipv6_state(reader: FactReader, candidates: tuple[IfAddr, ...]) -> str:
    disabled = reader.text("/proc/sys/net/ipv6/conf/all/disable_ipv6")
    if disabled is not None:
        # Writing "all" copies the value to every interface once; a later per-interface write turns
        # IPv6 back on there while "all" still reads 1 (net/ipv6/addrconf.c, addrconf_disable_ipv6).
        # An interface disabled this way holds no IPv6 address at all, so one that holds any has it on.
        if disabled.strip() == "1" and not any(entry.family == 6 and entry.scope != "host" for entry in candidates):
            return "disabled"
        return "enabled"
    if reader.presence("/proc/sys/net/ipv4") and reader.presence("/proc/sys/net/ipv6") is False:
        # ipv6.disable=1 stops inet6_init before any of the stack registers (net/ipv6/af_inet6.c):
        # no sysctls, no /proc/net/if_inet6, no IPv6 address. A copy that lacks only the sysctls
        # while the node lists IPv6 addresses is a partial capture, not a node without IPv6.
        if reader.presence("/proc/net/if_inet6") is False and not any(entry.family == 6 for entry in candidates):
            return "off at boot"
    return "unknown"


@probe("nccl_socket", gather_in=("full",))
def probe_nccl_socket(fs: NodeFS, netlink: Netlink, job: JobFacts) -> NcclSocketFacts:
    """Emulate NCCL's interface choice on this node's interfaces and the job's settings."""
    reader = FactReader(fs)
    links = tuple(netlink.links())
    candidates = getifaddrs_order(links, tuple(netlink.addresses()))
    ifname, family, comm_id = job.nccl("NCCL_SOCKET_IFNAME"), job.nccl("NCCL_SOCKET_FAMILY"), job.nccl("NCCL_COMM_ID")
    comm_id_address = _resolve_from_hosts(reader, comm_id_host(comm_id.value)) if comm_id is not None else ""
    devices = nccl_choice(candidates, ifname, family_setting(family), comm_id_address, MAX_IFS)
    bootstrap = bootstrap_choice(candidates, devices, comm_id, comm_id_address)
    older = nccl_choice(candidates, ifname, family_setting(family), comm_id_address, MAX_IFS, before_2_28=True)
    bootstrap_older = bootstrap_choice(candidates, older, comm_id, comm_id_address)
    differs = [item.ifname for item in bootstrap_older.interfaces] != [item.ifname for item in bootstrap.interfaces]
    problems = [job.environ_error] if job.environ_error else []
    return NcclSocketFacts(
        socket_ifname=ifname,
        socket_family=family,
        comm_id=comm_id,
        comm_id_address=comm_id_address,
        master_addr=job.environ.get("MASTER_ADDR", ""),
        socket_transport=_socket_transport(job, reader),
        ipv6=_ipv6_state(reader, candidates),
        links=links,
        candidates=candidates,
        bootstrap=bootstrap,
        devices=devices,
        problems=tuple(problems + reader.problems),
        bootstrap_before_2_28=bootstrap_older if differs else None,
        devices_before_2_28=older if [i.ifname for i in older.interfaces] != [i.ifname for i in devices.interfaces] else None,
        kubernetes_pod=_kubernetes_pod(reader),
    )




def _kubernetes_pod(reader: FactReader) -> bool | None:
    hosts = FactReader(reader.fs).text("/etc/hosts")  # its own problems: this is a detail of NET001
    return None if hosts is None else hosts.startswith(KUBELET_HOSTS_HEADER)


def shown(item: IfAddr) -> str:
    """``eth0:10.0.0.1`` or ``veth1:fe80::1%veth1``, as NCCL logs it."""
    scope = f"%{item.ifname}" if item.family == 6 and item.scope == "link" else ""
    return f"{item.ifname}:{item.address}{scope}"
