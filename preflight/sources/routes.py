"""Route lookups (``ip route get <destination> [from <source>]``): live over rtnetlink, replayed
from ``<root>/.preflight/netlink.json``, or computed from ``/proc/net/route`` on a copied root.

Live lookups send ``RTM_GETROUTE`` for one destination, so the answer is the kernel's own: policy
rules, every table, ``unreachable``/``prohibit``/``blackhole`` routes and the preferred source.
The kernel refuses a lookup with the errno a ``connect()`` to that address would get:
``ENETUNREACH`` (no route at all), ``EHOSTUNREACH`` (an ``unreachable`` route), ``EACCES``
(``prohibit``) and ``EINVAL`` (``blackhole``); these are answers, recorded in
:attr:`Route.error`, not read failures.

The file fallback knows the main IPv4 table only: ``/proc/net/route`` (``fib_route_seq_show()`` in
``net/ipv4/fib_trie.c``: hex little-endian destination, gateway and mask, ``RTF_*`` flags, metric;
``unreachable`` and ``prohibit`` routes carry ``RTF_REJECT`` and device ``*``, a ``blackhole``
route device ``*`` alone) plus this host's addresses from ``/proc/net/fib_trie``. Policy rules
are not exposed as files, so source-specific and IPv6 lookups need netlink or a recording.

Replay entries live under ``"routes"`` in ``netlink.json``, keyed ``"<destination>"`` or
``"<destination> from <source>"``::

    "routes": {"10.10.1.18": {"route_type": "unicast", "ifname": "eno1", "prefsrc": "10.10.1.17",
                              "gateway": "", "table": 254},
               "10.99.0.1": {"error": "ENETUNREACH"}}

An entry may name the ``origin`` its answer came from (``"netlink"`` for a snapshot of a live
node; the default is the recording's path), and ``{"source_error": {"source": ..., "reason": ...}}``
records a lookup that could not be asked at all (it raises SourceError on replay).
"""

from __future__ import annotations

import errno as errno_codes
import ipaddress
import os
from typing import Any

from msgspec import Struct

from preflight.sources.fs import NodeFS, SourceError

# rtm_type (include/uapi/linux/rtnetlink.h)
RTN_TYPES = {
    0: "unspec", 1: "unicast", 2: "local", 3: "broadcast", 4: "anycast", 5: "multicast",
    6: "blackhole", 7: "unreachable", 8: "prohibit", 9: "throw", 10: "nat",
}
#: errnos with which the kernel answers a lookup that has no usable route (fib_lookup()/ip_route_output_key()).
ROUTE_ERRORS = ("ENETUNREACH", "EHOSTUNREACH", "EACCES", "EINVAL")
_RTF_GATEWAY = 0x0002
_RTF_REJECT = 0x0200
FILE_ORIGIN = "/proc/net/route"
FIB_TRIE = "/proc/net/fib_trie"  # every routing table, by name or "Id <n>:"


class Route(Struct, frozen=True):
    """The kernel's answer for one destination."""

    destination: str
    source: str  # the source address the lookup asked for, "" for none
    route_type: str  # RTN_* name ("unicast", "local"); "" when the kernel refused the lookup
    ifname: str  # RTA_OIF as a name, "" when refused
    prefsrc: str  # RTA_PREFSRC, "" when not reported
    gateway: str  # RTA_GATEWAY, "" for a directly connected destination
    table: int | None  # RTA_TABLE / rtm_table
    error: str = ""  # one of ROUTE_ERRORS when the kernel refused the lookup
    origin: str = "netlink"  # "netlink", the recording's path, or FILE_ORIGIN (main table only)

    @property
    def reachable(self) -> bool:
        return not self.error and self.route_type in ("unicast", "local")

    @property
    def where(self) -> str:
        """The evidence source: the lookup as ``ip route`` spells it, or the file it came from."""
        lookup = f"{self.destination} from {self.source}" if self.source else self.destination
        return f"{FILE_ORIGIN} (main table) {lookup}" if self.origin == FILE_ORIGIN else f"ip route get {lookup}"

    def describe(self) -> str:
        """``via eno1 src 10.0.0.1`` / ``Network is unreachable (ENETUNREACH)``, for evidence."""
        if self.error:
            code = getattr(errno_codes, self.error, None)
            text = os.strerror(code) if isinstance(code, int) else self.error
            return f"{text} ({self.error})"
        parts = [] if self.route_type == "unicast" else [self.route_type]
        if self.gateway:
            parts.append(f"via {self.gateway}")
        parts.append(f"dev {self.ifname or '?'}")
        if self.prefsrc:
            parts.append(f"src {self.prefsrc}")
        return " ".join(parts)


def route_key(destination: str, source: str = "") -> str:
    return f"{destination} from {source}" if source else destination


def parse_ip(text: str, what: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """An address argument, or SourceError naming it."""
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        raise SourceError(what, f"{text!r} is not an IP address") from None


# -- live ---------------------------------------------------------------------------------------
def live_route_get(destination: str, source: str = "") -> Route:
    """``RTM_GETROUTE`` in the caller's network namespace."""
    from pyroute2 import IPRoute
    from pyroute2.netlink.exceptions import NetlinkError

    parse_ip(destination, "route get")
    request: dict[str, Any] = {"dst": destination}
    if source:
        request["src"] = str(parse_ip(source, "route get from"))
    where = f"route get {route_key(destination, source)}"
    try:
        with IPRoute() as ipr:
            answer = ipr.route("get", **request)[0]
            oif = answer.get_attr("RTA_OIF")
            names = {msg["index"]: msg.get_attr("IFLA_IFNAME") for msg in ipr.get_links(oif)} if oif else {}
    except NetlinkError as error:
        name = errno_codes.errorcode.get(error.code, "")
        if name in ROUTE_ERRORS:
            return Route(destination, source, "", "", "", "", None, error=name)
        raise SourceError(where, f"{os.strerror(error.code).lower()} ({name or error.code})") from None
    except OSError as error:
        raise SourceError(where, str(error)) from None
    table = answer.get_attr("RTA_TABLE")
    return Route(
        destination,
        source,
        RTN_TYPES.get(answer["type"], str(answer["type"])),
        names.get(oif, str(oif or "")),
        answer.get_attr("RTA_PREFSRC") or "",
        answer.get_attr("RTA_GATEWAY") or "",
        table if table is not None else answer["table"],
    )


# -- replay -------------------------------------------------------------------------------------
def replay_route(routes: object, origin: str, destination: str, source: str = "") -> Route:
    """The recorded answer for (destination, source); SourceError when none was recorded."""
    key = route_key(destination, source)
    entry = routes.get(key) if isinstance(routes, dict) else None
    if not isinstance(entry, dict):
        raise SourceError(origin, f"no recorded route for {key}")
    failure = entry.get("source_error")
    if isinstance(failure, dict):
        raise SourceError(str(failure.get("source", origin)), str(failure.get("reason", "failed")))
    error = str(entry.get("error", ""))
    if error and error not in ROUTE_ERRORS:
        raise SourceError(origin, f"unknown route error {error!r} for {key}")
    table = entry.get("table")
    return Route(
        destination,
        source,
        "" if error else str(entry.get("route_type", "unicast")),
        str(entry.get("ifname", "")),
        str(entry.get("prefsrc", "")),
        str(entry.get("gateway", "")),
        table if isinstance(table, int) else None,
        error=error,
        origin=str(entry.get("origin", origin)),
    )


# -- files --------------------------------------------------------------------------------------
class RouteEntry(Struct, frozen=True):
    """One line of ``/proc/net/route``."""

    ifname: str  # "*" for reject and blackhole routes
    network: ipaddress.IPv4Network
    gateway: str  # "" when RTF_GATEWAY is not set
    flags: int
    metric: int


def parse_route_table(text: str) -> list[RouteEntry]:
    """Every route of ``/proc/net/route`` (hex fields in host byte order, little-endian here);
    ValueError naming the first line that is not a route, so garbage never reads as "no route"."""
    lines = text.splitlines()
    if not lines or not lines[0].startswith("Iface"):
        raise ValueError("no 'Iface' header line")
    entries = []
    for number, line in enumerate(lines[1:], 2):
        fields = line.split()
        if not fields:
            continue
        try:
            destination = ipaddress.IPv4Address(int(fields[1], 16).to_bytes(4, "little"))
            gateway = ipaddress.IPv4Address(int(fields[2], 16).to_bytes(4, "little"))
            flags = int(fields[3], 16)
            metric = int(fields[6])
            mask = ipaddress.IPv4Address(int(fields[7], 16).to_bytes(4, "little"))
            network = ipaddress.IPv4Network(f"{destination}/{mask}", strict=False)
        except (ValueError, OverflowError, IndexError):
            raise ValueError(f"line {number} is not a route: {line.strip()[:60]!r}") from None
        entries.append(RouteEntry(fields[0], network, str(gateway) if flags & _RTF_GATEWAY else "", flags, metric))
    return entries


def _only_main_and_local(fs: NodeFS) -> None:
    """Raise SourceError unless ``/proc/net/fib_trie`` lists no routing table but Main and Local.
    The kernel prints every table there, others as ``Id <n>:`` (``fib_table_print()``); where one
    exists, policy rules (which no file shows) may send a destination the main table lacks to it,
    so "no route" would be a guess."""
    trie = fs.read(FIB_TRIE)
    if trie is None:
        raise SourceError(FIB_TRIE, "absent; whether other routing tables hold a route is not known")
    other = next((line.strip() for line in trie.splitlines() if line.startswith("Id ")), None)
    if other is not None:
        raise SourceError(FILE_ORIGIN, f"no route in the main table, and {FIB_TRIE} lists table {other.rstrip(':')[3:]}, "
                                       "which policy rules (not exposed as files) may use")


def file_route_get(fs: NodeFS, locals_: list[str], destination: str, source: str = "") -> Route:
    """The main-table answer for an IPv4 destination, as the kernel's FIB would give it without
    policy rules: longest prefix first, then the lowest metric."""
    address = parse_ip(destination, "route get")
    if address.version == 6:
        raise SourceError("/proc/net/ipv6_route", "IPv6 route lookups need netlink or a recording (.preflight/netlink.json)")
    if source:
        raise SourceError(FILE_ORIGIN, "source-specific lookups depend on policy rules, which only netlink exposes")
    if address.is_loopback or destination in locals_:
        return Route(destination, source, "local", "lo", destination, "", 255, origin=FILE_ORIGIN)
    text = fs.read(FILE_ORIGIN)
    if text is None:
        raise SourceError(FILE_ORIGIN, "absent; no routing table to look up")
    try:
        table = parse_route_table(text)
    except ValueError as error:
        raise SourceError(FILE_ORIGIN, str(error)) from None
    matches = [entry for entry in table if address in entry.network]
    if not matches:
        _only_main_and_local(fs)
        return Route(destination, source, "", "", "", "", None, error="ENETUNREACH", origin=FILE_ORIGIN)
    best = min(matches, key=lambda entry: (-entry.network.prefixlen, entry.metric))
    if best.flags & _RTF_REJECT:
        # unreachable and prohibit look alike here; both refuse the connect at once.
        return Route(destination, source, "", "", "", "", 254, error="EHOSTUNREACH", origin=FILE_ORIGIN)
    if best.ifname == "*":
        return Route(destination, source, "", "", "", "", 254, error="EINVAL", origin=FILE_ORIGIN)
    return Route(destination, source, "unicast", best.ifname, "", best.gateway, 254, origin=FILE_ORIGIN)
