"""Network interfaces and addresses: live through pyroute2 (rtnetlink), replayed from
``<root>/.preflight/netlink.json``, or read from the files the kernel also exposes.

The file fallback lets a plain copied root work without a recording:

* links from ``/sys/class/net/<if>/{ifindex,mtu,operstate,type,address,uevent}`` and the
  ``master`` symlink (kernel ABI ``Documentation/ABI/testing/sysfs-class-net``);
* IPv6 addresses from ``/proc/net/if_inet6`` (hex address, ifindex, prefix length, scope, flags,
  name per line);
* IPv4 addresses from ``/proc/net/fib_trie`` (``/32 host LOCAL`` leaves are this host's
  addresses), attached to the interface of the most specific gateway-less route in
  ``/proc/net/route`` that contains them.

DCB (Data Center Bridging: PFC, ETS and the APP table that carries the DSCP-to-priority map)
comes from rtnetlink ``RTM_GETDCB`` with ``DCB_CMD_IEEE_GET`` (``include/uapi/linux/dcbnl.h``,
``net/dcb/dcbnl.c``). pyroute2 has no message class for it, so :class:`dcbmsg` defines one on
pyroute2's ``nlmsg`` base and :func:`query_dcb` sends it on a plain netlink socket with a
deadline. The kernel exposes no files for it, so a copied root without a recording cannot answer.

Pause-storm counters and the stall-prevention timeout come from the ethtool ioctl
(:mod:`preflight.sources.ethtool`); like DCB, the kernel exposes no files for them.

Replay format: ``{"format": "preflight-netlink/1", "links": [Link...], "addresses": [Address...],
"dcb": {"<ifname>": DcbConfig | {"error": "<reason>", "source": "<where>"}},
"pause": {"<ifname>": {"counters": {"<name>": <value>...}, "prevention_timeout_ms": <int|null>}
| {"error": "<reason>", "source": "<where>"}}}`` with the field names of the dataclasses below;
``dcb`` and ``pause`` are optional, and so is ``source`` (default ``RTM_GETDCB <ifname>`` /
``SIOCETHTOOL <ifname>``). A dump that failed is recorded as ``"errors": {"links": {"source":
..., "reason": ...}}`` (likewise ``addresses``) and fails the same way on replay.

The nftables ruleset (:meth:`Netlink.firewall`) replays from its own file,
``<root>/.preflight/firewall.json``, beside ``netlink.json`` or without it (links then come from
sysfs): ``{"format": "preflight-firewall/1", "ruleset": Ruleset}`` with the fields of
:class:`preflight.sources.nftables.Ruleset`, or ``{"format": ..., "error": "<reason>", "source":
"<where>"}`` for a dump that failed. A root without the file answers "firewall rules not
recorded": the kernel keeps the rules in memory only.

Route lookups (:meth:`Netlink.route_get`) live in ``preflight.sources.routes``, which documents
their replay entries (``"routes"`` in the same file) and what the file fallback can answer.
"""

from __future__ import annotations

import errno as errno_codes
import ipaddress
import os
import struct
from collections.abc import Iterable
from typing import Any, Protocol

import msgspec
from msgspec import Struct
from msgspec import to_builtins as asdict  # records as plain JSON values, recursively

from preflight.sources.ethtool import PauseState, query_pause
from preflight.sources.fs import NodeFS, RecordedDocument, SourceError, load_recording
from preflight.sources.nftables import SOURCE as FIREWALL_SOURCE
from preflight.sources.nftables import Ruleset, read_ruleset
from preflight.sources.nlmsg import NLMSG_ERROR
from preflight.sources.routes import Route, file_route_get, live_route_get, replay_route

# ARPHRD_* from include/uapi/linux/if_arp.h, as in /sys/class/net/<if>/type and ifi_type.
_ARPHRD_NAMES = {1: "ether", 32: "infiniband", 772: "loopback", 776: "sit", 778: "gre", 65534: "none"}
# rtnetlink scopes (include/uapi/linux/rtnetlink.h) and the if_inet6 scope bits (net/ipv6/addrconf.c).
_RT_SCOPES = {0: "global", 200: "site", 253: "link", 254: "host", 255: "nowhere"}
_INET6_SCOPES = {0x00: "global", 0x10: "host", 0x20: "link", 0x40: "site"}


class Link(Struct, frozen=True):
    """One network interface."""

    name: str  # IFLA_IFNAME / /sys/class/net/<name>
    index: int  # ifi_index / .../ifindex
    mtu: int | None  # IFLA_MTU / .../mtu
    operstate: str  # IFLA_OPERSTATE / .../operstate, lower case ("up", "down", "unknown")
    link_type: str  # ifi_type / .../type as a name ("ether", "infiniband", "loopback")
    kind: str  # IFLA_INFO_KIND / DEVTYPE in .../uevent ("bridge", "vlan", "vxlan", "" if none)
    master: str  # IFLA_MASTER / .../master symlink, "" when the link has no master
    mac: str  # IFLA_ADDRESS / .../address


class Address(Struct, frozen=True):
    """One address assigned to an interface."""

    ifname: str
    family: int  # 4 or 6
    address: str
    prefixlen: int
    scope: str  # "global", "link", "host"


class DcbConfig(Struct, frozen=True):
    """The IEEE 802.1Qaz state of one interface (``DCB_CMD_IEEE_GET``)."""

    ifname: str
    pfc_cap: int  # struct ieee_pfc.pfc_cap: how many priorities may be lossless at once
    pfc_enabled: tuple[int, ...]  # priorities whose bit is set in struct ieee_pfc.pfc_en
    dscp_to_priority: tuple[tuple[int, int], ...]  # APP table entries with selector 5 (DSCP)
    dcbx: int | None  # DCB_ATTR_DCBX flags (0x1 host/OS controlled, 0x8 IEEE); None if not reported


class Netlink(Protocol):
    """What probes may ask about interfaces."""

    def links(self) -> list[Link]: ...

    def addresses(self) -> list[Address]: ...

    def route_get(self, destination: str, source: str = "") -> Route:
        """``ip route get <destination> [from <source>]``; SourceError when it cannot be asked."""

    def dcb(self, ifname: str) -> DcbConfig:
        """DCB state of ``ifname``; SourceError when it cannot be read (no DCB support...)."""
        ...

    def pause(self, ifname: str) -> PauseState:
        """Pause-storm counters of ``ifname``; SourceError when they cannot be read."""
        ...

    def firewall(self) -> Ruleset:
        """The nftables ruleset (``preflight.sources.nftables``); SourceError when it cannot be read."""
        ...


class LiveNetlink:
    """rtnetlink dumps in the caller's network namespace."""

    def links(self) -> list[Link]:
        from pyroute2 import IPRoute

        with IPRoute() as ipr:
            messages = list(ipr.get_links())
        names = {msg["index"]: msg.get_attr("IFLA_IFNAME") for msg in messages}
        links = []
        for msg in messages:
            info = msg.get_attr("IFLA_LINKINFO")
            kind = info.get_attr("IFLA_INFO_KIND") if info is not None else None
            master = msg.get_attr("IFLA_MASTER")
            links.append(
                Link(
                    name=msg.get_attr("IFLA_IFNAME"),
                    index=msg["index"],
                    mtu=msg.get_attr("IFLA_MTU"),
                    operstate=str(msg.get_attr("IFLA_OPERSTATE") or "unknown").lower(),
                    link_type=_ARPHRD_NAMES.get(msg["ifi_type"], str(msg["ifi_type"])),
                    kind=kind or "",
                    master=names.get(master, "") if master else "",
                    mac=msg.get_attr("IFLA_ADDRESS") or "",
                )
            )
        return sorted(links, key=lambda link: link.index)

    def addresses(self) -> list[Address]:
        from pyroute2 import IPRoute

        with IPRoute() as ipr:
            names = {msg["index"]: msg.get_attr("IFLA_IFNAME") for msg in ipr.get_links()}
            messages = list(ipr.get_addr())
        found = []
        for msg in messages:
            family = 4 if msg["family"] == 2 else 6
            address = msg.get_attr("IFA_LOCAL") if family == 4 else None
            found.append(
                Address(
                    ifname=names.get(msg["index"], str(msg["index"])),
                    family=family,
                    address=address or msg.get_attr("IFA_ADDRESS"),
                    prefixlen=msg["prefixlen"],
                    scope=_RT_SCOPES.get(msg["scope"], str(msg["scope"])),
                )
            )
        return found

    def route_get(self, destination: str, source: str = "") -> Route:
        return live_route_get(destination, source)

    def dcb(self, ifname: str) -> DcbConfig:
        return query_dcb(ifname)

    def pause(self, ifname: str) -> PauseState:
        return query_pause(ifname)

    def firewall(self) -> Ruleset:
        return read_ruleset()


#: The kernel keeps the firewall in memory only; a root replays it from this recording.
FIREWALL_FILE = "firewall.json"
FIREWALL_FORMAT = "preflight-firewall/1"
FIREWALL_NOT_RECORDED = "firewall rules not recorded"


def load_firewall(path: str | None) -> Ruleset:
    """The ruleset recorded in ``path`` (a root's ``.preflight/firewall.json``); SourceError when
    there is none, the recorded dump failed, or the file is broken."""
    if path is None:
        raise SourceError(FIREWALL_SOURCE, f"{FIREWALL_NOT_RECORDED} (this root has no .preflight/{FIREWALL_FILE})")
    try:
        document = load_recording(path)
    except ValueError as error:
        raise SourceError(path, f"unreadable firewall recording: {error}") from None
    if not isinstance(document, dict) or document.get("format") != FIREWALL_FORMAT:
        raise SourceError(path, f"not a {FIREWALL_FORMAT} recording")
    if "error" in document:
        raise SourceError(str(document.get("source", FIREWALL_SOURCE)), str(document["error"]))
    try:
        return msgspec.convert(document.get("ruleset"), Ruleset)
    except msgspec.ValidationError as error:
        raise SourceError(path, f"malformed firewall recording: {error}") from None


class ReplayNetlink(RecordedDocument):
    """Links and addresses from a recorded ``netlink.json``."""

    KIND = "netlink"
    FILE = "netlink.json"
    firewall_file: str | None = None  # the root's firewall.json, set by Sources.for_fs

    def _recorded_failure(self, dump_name: str) -> None:
        errors = self._checked().get("errors")
        failure = errors.get(dump_name) if isinstance(errors, dict) else None
        if isinstance(failure, dict):
            raise SourceError(str(failure.get("source", self._origin)), str(failure.get("reason", "failed")))

    def links(self) -> list[Link]:
        self._recorded_failure("links")
        try:  # convert checks each field's type: a Struct built from a dict does not
            return msgspec.convert(self._checked().get("links", []), list[Link])
        except msgspec.ValidationError as error:
            raise SourceError(self._origin, f"malformed link entry: {error}") from None

    def addresses(self) -> list[Address]:
        self._recorded_failure("addresses")
        try:
            entries = msgspec.convert(self._checked().get("addresses", []), list[Address])
        except msgspec.ValidationError as error:
            raise SourceError(self._origin, f"malformed address entry: {error}") from None
        for entry in entries:
            # Types alone let "10.0.0.x" or a v6 text under family 4 through, which the probes
            # parse again (NCCL's interface choice, subnets): refused here, once, as malformed.
            problem = _address_problem(entry)
            if problem:
                raise SourceError(self._origin, f"malformed address entry: {problem}")
        return entries

    def route_get(self, destination: str, source: str = "") -> Route:
        return replay_route(self._checked().get("routes", {}), self._origin, destination, source)

    def dcb(self, ifname: str) -> DcbConfig:
        source = f"{self._origin} dcb {ifname}"
        recorded = self._checked().get("dcb", {})
        item = recorded.get(ifname) if isinstance(recorded, dict) else None
        if not isinstance(item, dict):
            raise SourceError(source, "no DCB state recorded for this interface")
        if "error" in item:
            raise SourceError(str(item.get("source", f"RTM_GETDCB {ifname}")), str(item["error"]))
        try:
            return DcbConfig(
                ifname=str(item["ifname"]),
                pfc_cap=int(item["pfc_cap"]),
                pfc_enabled=tuple(int(p) for p in item["pfc_enabled"]),
                dscp_to_priority=tuple((int(d), int(p)) for d, p in item["dscp_to_priority"]),
                dcbx=None if item.get("dcbx") is None else int(item["dcbx"]),
            )
        except (KeyError, TypeError, ValueError) as error:
            raise SourceError(source, f"malformed DCB entry: {error!r}") from None

    def pause(self, ifname: str) -> PauseState:
        source = f"{self._origin} pause {ifname}"
        recorded = self._checked().get("pause", {})
        item = recorded.get(ifname) if isinstance(recorded, dict) else None
        if not isinstance(item, dict):
            raise SourceError(source, "no pause counters recorded for this interface")
        if "error" in item:
            raise SourceError(str(item.get("source", f"SIOCETHTOOL {ifname}")), str(item["error"]))
        try:
            counters = item["counters"]
            timeout = item.get("prevention_timeout_ms")
            return PauseState(
                ifname,
                tuple((str(name), int(value)) for name, value in counters.items()),
                None if timeout is None else int(timeout),
            )
        except (AttributeError, KeyError, TypeError, ValueError) as error:
            raise SourceError(source, f"malformed pause entry: {error!r}") from None

    def firewall(self) -> Ruleset:
        return load_firewall(self.firewall_file)


def dump(netlink: Netlink, destinations: Iterable[str] = (), dcb_interfaces: Iterable[str] = ()) -> dict[str, Any]:
    """The replay document for what ``netlink`` answers now (used by recordings and tests), with
    route lookups for ``destinations`` (``"<dst>"`` or ``"<dst> from <src>"``) and DCB state for
    ``dcb_interfaces`` (with the reason where it cannot be read)."""
    dcb: dict[str, Any] = {}
    pause: dict[str, Any] = {}
    for ifname in dcb_interfaces:
        try:
            dcb[ifname] = asdict(netlink.dcb(ifname))
        except SourceError as error:
            dcb[ifname] = {"error": error.reason}
        try:
            state = netlink.pause(ifname)
            pause[ifname] = {"counters": dict(state.counters), "prevention_timeout_ms": state.prevention_timeout_ms}
        except SourceError as error:
            pause[ifname] = {"error": error.reason}
    document: dict[str, Any] = {
        "format": "preflight-netlink/1",
        "links": [asdict(link) for link in netlink.links()],
        "addresses": [asdict(address) for address in netlink.addresses()],
    }
    routes = {}
    for key in destinations:
        destination, _, source = key.partition(" from ")
        route = netlink.route_get(destination, source)
        recorded = asdict(route)
        for field in ("destination", "source", "origin"):
            recorded.pop(field)
        routes[key] = {"error": route.error} if route.error else recorded
    if routes:
        document["routes"] = routes
    if dcb:
        document["dcb"] = dcb
        document["pause"] = pause
    return document


class FileNetlink:
    """Links and addresses read from sysfs and procfs under a root."""

    def __init__(self, fs: NodeFS) -> None:
        self._fs = fs

    def _attr(self, name: str, attr: str) -> str | None:
        text = self._fs.read(f"/sys/class/net/{name}/{attr}")
        return None if text is None else text.strip()

    def links(self) -> list[Link]:
        links = []
        for name in self._fs.listdir("/sys/class/net") or []:
            index = _to_int(self._attr(name, "ifindex"))
            if index is None:
                continue  # bonding_masters and other non-interface entries
            arphrd = _to_int(self._attr(name, "type"))
            master_link = self._fs.readlink(f"/sys/class/net/{name}/master")
            links.append(
                Link(
                    name=name,
                    index=index,
                    mtu=_to_int(self._attr(name, "mtu")),
                    operstate=(self._attr(name, "operstate") or "unknown").lower(),
                    link_type=_ARPHRD_NAMES.get(arphrd, str(arphrd)) if arphrd is not None else "",
                    kind=_uevent_devtype(self._attr(name, "uevent")),
                    master=master_link.rsplit("/", 1)[-1] if master_link else "",
                    mac=self._attr(name, "address") or "",
                )
            )
        return sorted(links, key=lambda link: link.index)

    def dcb(self, ifname: str) -> DcbConfig:
        raise SourceError(
            f"RTM_GETDCB {ifname}",
            "DCB state is only exposed through netlink; this root has no recording (.preflight/netlink.json)",
        )

    def pause(self, ifname: str) -> PauseState:
        raise SourceError(
            f"SIOCETHTOOL {ifname}",
            "pause counters are only exposed through the ethtool ioctl; this root has no recording (.preflight/netlink.json)",
        )

    def firewall(self) -> Ruleset:
        return load_firewall(self._fs.replay_file(FIREWALL_FILE))

    def addresses(self) -> list[Address]:
        found = parse_if_inet6(self._fs.read("/proc/net/if_inet6") or "")
        trie = self._fs.read("/proc/net/fib_trie") or ""
        routes = parse_proc_net_route(self._fs.read("/proc/net/route") or "")
        for local in parse_fib_trie_locals(trie):
            found.append(attach_ipv4(local, routes))
        return found

    def route_get(self, destination: str, source: str = "") -> Route:
        locals_ = parse_fib_trie_locals(self._fs.read("/proc/net/fib_trie") or "")
        return file_route_get(self._fs, locals_, destination, source)


def _to_int(text: str | None) -> int | None:
    try:
        return int(text, 0) if text is not None else None
    except ValueError:
        return None


def _uevent_devtype(uevent: str | None) -> str:
    for line in (uevent or "").splitlines():
        if line.startswith("DEVTYPE="):
            return line.split("=", 1)[1].strip()
    return ""


def _address_problem(entry: Address) -> str:
    """Why a recorded address is not one a kernel reports; "" when it is."""
    try:
        parsed = ipaddress.ip_address(entry.address)
    except ValueError:
        return f"{entry.address!r} is not an IP address"
    if parsed.version != entry.family or not 0 <= entry.prefixlen <= parsed.max_prefixlen:
        return f"{entry.address}/{entry.prefixlen} recorded as family {entry.family}"
    return ""


#: rtnetlink's address dump (include/uapi/linux/rtnetlink.h, netlink.h).
_RTM_NEWADDR, _RTM_GETADDR = 20, 22
_NLM_F_REQUEST_DUMP = 0x1 | 0x300
_ADDRESS_DUMP_TIMEOUT_S = 1.0
_ADDRESS_DUMP_MAX_BYTES = 8 << 20  # tens of thousands of addresses (kube-ipvs0 holds one per Service)
ADDRESS_DUMP = "rtnetlink RTM_GETADDR"


def address_owners() -> list[tuple[int, str, str]]:
    """(family 4 or 6, interface name, scope) of every address in the caller's network namespace,
    from one RTM_GETADDR dump on a plain netlink socket: what ``ip -o addr`` lists, a /32 that no
    route places included, without pyroute2's import (over 100 ms), for the prolog's firewall
    probe. SourceError when the dump fails or does not end within a second."""
    import socket
    import time

    from preflight.sources.nlmsg import dump_messages

    deadline = time.monotonic() + _ADDRESS_DUMP_TIMEOUT_S
    request = struct.pack("=IHHII", 16 + 8, _RTM_GETADDR, _NLM_F_REQUEST_DUMP, 1, 0) + struct.pack("=BBBBI", 0, 0, 0, 0, 0)
    found: list[tuple[int, str, str]] = []
    try:
        names = dict(socket.if_nameindex())  # the same namespace as the dump
        with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE) as sock:
            sock.bind((0, 0))
            sock.send(request)
            for kind, payload in dump_messages(sock, 1, deadline, ADDRESS_DUMP, _ADDRESS_DUMP_MAX_BYTES, lambda code: os.strerror(code).lower()):
                if kind == _RTM_NEWADDR and len(payload) >= 8:
                    family, _prefix, _flags, scope, index = struct.unpack_from("=BBBBI", payload, 0)
                    if family in (socket.AF_INET, socket.AF_INET6):
                        found.append((4 if family == socket.AF_INET else 6, names.get(index, ""), _RT_SCOPES.get(scope, str(scope))))
    except OSError as error:
        raise SourceError(ADDRESS_DUMP, os.strerror(error.errno).lower() if error.errno else str(error)) from None
    return found


def parse_if_inet6(text: str) -> list[Address]:
    """``/proc/net/if_inet6`` lines: ``<32 hex> <ifindex> <plen> <scope> <flags> <name>``."""
    found = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) != 6 or len(fields[0]) != 32:
            continue
        try:
            address = ipaddress.IPv6Address(bytes.fromhex(fields[0]))
            prefixlen = int(fields[2], 16)
            scope = _INET6_SCOPES.get(int(fields[3], 16) & 0xF0, fields[3])
        except ValueError:
            continue
        found.append(Address(fields[5], 6, str(address), prefixlen, scope))
    return found


def parse_fib_trie_locals(text: str) -> list[str]:
    """Addresses of ``/32 host LOCAL`` leaves in ``/proc/net/fib_trie``, in order, once each."""
    locals_: list[str] = []
    leaf = ""
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("|-- "):
            leaf = stripped[4:].strip()
        elif stripped.startswith("/32") and stripped.endswith("LOCAL") and " host " in f" {stripped} ":
            if leaf and leaf not in locals_ and _is_ipv4(leaf):
                locals_.append(leaf)
    return locals_


def _is_ipv4(text: str) -> bool:
    """A leaf of a damaged or planted fib_trie that is no IPv4 address is no address of this host."""
    try:
        ipaddress.IPv4Address(text)
    except ValueError:
        return False
    return True


class _Route(Struct, frozen=True):
    ifname: str
    network: ipaddress.IPv4Network


def parse_proc_net_route(text: str) -> list[_Route]:
    """Gateway-less routes of ``/proc/net/route`` (hex, little-endian fields)."""
    routes = []
    for line in text.splitlines()[1:]:
        fields = line.split()
        if len(fields) < 8:
            continue
        try:
            destination = int(fields[1], 16).to_bytes(4, "little")
            gateway = int(fields[2], 16)
            mask = int(fields[7], 16).to_bytes(4, "little")
            network = ipaddress.IPv4Network(
                (ipaddress.IPv4Address(destination), str(ipaddress.IPv4Address(mask))), strict=False
            )
        except (ValueError, OverflowError):
            continue
        if gateway == 0:
            routes.append(_Route(fields[0], network))
    return routes


def attach_ipv4(local: str, routes: list[_Route]) -> Address:
    """``local`` (a /32 LOCAL address of fib_trie) on the interface of the most specific
    gateway-less route containing it. procfs names no interface for an IPv4 address, so where no
    such route holds it (a /32 reached through an on-link gateway, an anycast address on lo) or
    routes of the same length on several interfaces do (rails sharing a subnet), which interface
    holds it cannot be told: SourceError, and the addresses are unknown rather than misplaced."""
    address = ipaddress.IPv4Address(local)  # parse_fib_trie_locals keeps only IPv4 addresses
    if address.is_loopback:
        return Address("lo", 4, local, 8, "host")
    matches = [route for route in routes if address in route.network and route.network.prefixlen > 0]
    if not matches:
        raise SourceError("/proc/net/fib_trie", f"local address {local} is in no interface's subnet in /proc/net/route: which interface holds it is unknown")
    longest = max(route.network.prefixlen for route in matches)
    holders = sorted({route.ifname for route in matches if route.network.prefixlen == longest})
    if len(holders) > 1:
        raise SourceError(
            "/proc/net/fib_trie", f"local address {local} is in the subnet of {', '.join(holders[:4])} alike: which of them holds it is unknown without netlink",
        )
    return Address(holders[0], 4, local, longest, "global")


# -- DCB netlink (include/uapi/linux/dcbnl.h) ------------------------------------------------------
RTM_GETDCB = 78
DCB_CMD_IEEE_GET = 21
IEEE_8021QAZ_APP_SEL_DSCP = 5
_NETLINK_ROUTE = 0
_DCB_TIMEOUT_S = 1.0


def _dcbmsg_class() -> Any:
    """``struct dcbmsg`` and the attributes preflight reads, on pyroute2's message base (imported
    here: pyroute2 costs ~0.2 s to import and only the full profile asks for DCB)."""
    from pyroute2.netlink import nla, nlmsg

    class dcbmsg(nlmsg):  # type: ignore[misc]  # pyroute2 ships no type hints
        fields = (("family", "B"), ("cmd", "B"), ("pad", "H"))
        nla_map = (
            (0, "DCB_ATTR_UNDEFINED", "none"),
            (1, "DCB_ATTR_IFNAME", "asciiz"),
            (13, "DCB_ATTR_IEEE", "ieee"),
            (14, "DCB_ATTR_DCBX", "uint8"),
        )

        class ieee(nla):  # type: ignore[misc]
            nla_map = (
                (0, "DCB_ATTR_IEEE_UNSPEC", "none"),
                (1, "DCB_ATTR_IEEE_ETS", "cdata"),
                (2, "DCB_ATTR_IEEE_PFC", "cdata"),  # struct ieee_pfc
                (3, "DCB_ATTR_IEEE_APP_TABLE", "app_table"),
            )

            class app_table(nla):  # type: ignore[misc]
                nla_map = ((0, "DCB_ATTR_IEEE_APP_UNSPEC", "none"), (1, "DCB_ATTR_IEEE_APP", "cdata"))  # struct dcb_app

    return dcbmsg


def encode_dcb_request(ifname: str, sequence: int = 1) -> bytes:
    """An ``RTM_GETDCB``/``DCB_CMD_IEEE_GET`` request for ``ifname``."""
    from pyroute2.netlink import NLM_F_REQUEST

    msg = _dcbmsg_class()()
    msg["family"] = 0  # AF_UNSPEC
    msg["cmd"] = DCB_CMD_IEEE_GET
    msg["attrs"] = [("DCB_ATTR_IFNAME", ifname)]
    msg["header"]["type"] = RTM_GETDCB
    msg["header"]["flags"] = NLM_F_REQUEST
    msg["header"]["sequence_number"] = sequence
    msg.encode()
    return bytes(msg.data)


def decode_dcb_reply(ifname: str, data: bytes) -> DcbConfig:
    """Parse the kernel's answer to :func:`encode_dcb_request`; SourceError for an error reply."""
    source = f"RTM_GETDCB {ifname}"
    if len(data) < 16:
        raise SourceError(source, f"short netlink reply ({len(data)} bytes)")
    (msg_type,) = struct.unpack_from("=H", data, 4)
    if msg_type == NLMSG_ERROR:
        code = -struct.unpack_from("=i", data, 16)[0] if len(data) >= 20 else errno_codes.EIO
        name = "EOPNOTSUPP" if code == errno_codes.EOPNOTSUPP else errno_codes.errorcode.get(code, str(code))
        reason = f"{os.strerror(code).lower()} ({name})"
        if code == errno_codes.EOPNOTSUPP:
            reason += "; the driver has no DCB support (or the kernel lacks CONFIG_DCB)"
        raise SourceError(source, reason)
    if msg_type != RTM_GETDCB:
        raise SourceError(source, f"unexpected netlink message type {msg_type}")
    msg = _dcbmsg_class()(data)
    try:
        msg.decode()
    except Exception as error:  # pyroute2 raises assorted errors on truncated attributes
        raise SourceError(source, f"undecodable DCB reply: {error}") from None
    ieee = msg.get_attr("DCB_ATTR_IEEE")
    pfc = ieee.get_attr("DCB_ATTR_IEEE_PFC") if ieee is not None else None
    if not pfc or len(pfc) < 2:
        raise SourceError(source, "the reply carries no PFC configuration (DCB_ATTR_IEEE_PFC)")
    mapping = []
    table = ieee.get_attr("DCB_ATTR_IEEE_APP_TABLE")
    for entry in table.get_attrs("DCB_ATTR_IEEE_APP") if table is not None else []:
        if len(entry) >= 4:
            selector, priority, protocol = struct.unpack_from("=BBH", entry)
            if selector == IEEE_8021QAZ_APP_SEL_DSCP:
                mapping.append((protocol, priority))
    return DcbConfig(
        ifname=ifname,
        pfc_cap=pfc[0],
        pfc_enabled=tuple(p for p in range(8) if pfc[1] >> p & 1),
        dscp_to_priority=tuple(sorted(mapping)),
        dcbx=msg.get_attr("DCB_ATTR_DCBX"),
    )


def query_dcb(ifname: str) -> DcbConfig:
    """Ask the kernel for ``ifname``'s DCB state, waiting at most a second."""
    import socket

    source = f"RTM_GETDCB {ifname}"
    try:
        with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, _NETLINK_ROUTE) as sock:
            sock.settimeout(_DCB_TIMEOUT_S)
            sock.bind((0, 0))
            sock.send(encode_dcb_request(ifname))
            data = sock.recv(65536)
    except socket.timeout:
        raise SourceError(source, f"no answer within {_DCB_TIMEOUT_S} s") from None
    except OSError as error:
        raise SourceError(source, str(error)) from None
    return decode_dcb_reply(ifname, data)
