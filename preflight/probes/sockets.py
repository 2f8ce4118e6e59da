"""TCP ports on this node: the rendezvous port and the ephemeral range (SOCK001, SOCK005).

Sources (kernel ``Documentation/networking/proc_net_tcp.rst`` and ``ip-sysctl.rst``):

* ``/proc/net/tcp`` and ``/proc/net/tcp6``: one socket per line after the ``sl local_address
  rem_address st ...`` header; addresses are ``HEXIP:HEXPORT``, the IP as 32-bit words in the
  host's byte order (little-endian on x86-64 and arm64: ``0100007F`` is 127.0.0.1), the port
  big-endian hex; ``st`` is the TCP state in hex (``0A`` LISTEN, ``01`` ESTABLISHED, ``06``
  TIME_WAIT). TIME_WAIT sockets are listed too. ``tcp6`` is absent when IPv6 is disabled.
* ``/proc/sys/net/ipv4/ip_local_port_range`` (two numbers, tab-separated) and
  ``ip_local_reserved_ports`` (comma-separated ports and ranges, excluded from ephemeral use).
* ``MASTER_PORT`` from the job environment (``preflight.probes.job``); torchrun's default is 29500.
* ``/proc/sys/kernel/hostname``, and this node's addresses from ``/proc/net/fib_trie`` (its ``/32
  host LOCAL`` leaves) and ``/proc/net/if_inet6``: whether ``MASTER_ADDR`` names this node, i.e.
  whether this node binds the rendezvous port at all; read only where something listens on it.

All of it is per network namespace: a prolog on the host sees the host's sockets, a job in its
own namespace may see others.
"""

from __future__ import annotations

import ipaddress
from collections import Counter
from collections.abc import Callable
from typing import TypeVar

from msgspec import Struct

from preflight.probes.gpudirect import parse_status_ids
from preflight.probes.job import JobFacts, rendezvous_endpoint
from preflight.registry import probe
from preflight.sources import NodeFS, SourceError
from preflight.units import is_number

TCP_TABLES = ("/proc/net/tcp", "/proc/net/tcp6")


PORT_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"


RESERVED_PORTS = "/proc/sys/net/ipv4/ip_local_reserved_ports"


#: include/net/tcp_states.h
TCP_STATES = {
    1: "ESTABLISHED", 2: "SYN_SENT", 3: "SYN_RECV", 4: "FIN_WAIT1", 5: "FIN_WAIT2", 6: "TIME_WAIT",
    7: "CLOSE", 8: "CLOSE_WAIT", 9: "LAST_ACK", 10: "LISTEN", 11: "CLOSING", 12: "NEW_SYN_RECV",
}


LISTEN = 10


#: States of sockets their application has already closed: the kernel frees their ports on its own,
#: TIME_WAIT after TCP_TIMEWAIT_LEN (60 s, fixed in include/net/tcp.h), an orphaned FIN_WAIT2 after
#: net.ipv4.tcp_fin_timeout, the rest once the peer answers or the retransmissions give up. A job
#: that just ended leaves thousands of them, so they can fill the range for a minute but never
#: for good.
CLOSING_STATES = frozenset({4, 5, 6, 9, 11})  # FIN_WAIT1, FIN_WAIT2, TIME_WAIT, LAST_ACK, CLOSING


#: A node with thousands of sockets writes tens of MB here; read it whole, but not without bound.
MAX_TABLE_BYTES = 64 * 1024 * 1024


#: Bad lines kept as evidence; the rest are only counted.
MAX_BAD_LINES = 5


#: Busiest destinations kept in the facts.
MAX_DESTINATIONS = 3


class ListeningSocket(Struct, frozen=True):
    address: str  # local address as text ("0.0.0.0", "::", "127.0.0.1")
    port: int
    uid: int
    inode: int
    source: str  # "/proc/net/tcp:4" (line number)


class Destination(Struct, frozen=True):
    address: str
    port: int
    sockets: int  # sockets from ephemeral local ports to this endpoint


class TcpTable(Struct, frozen=True):
    """What one table holds, reduced to what the checks need."""

    listening: tuple[ListeningSocket, ...]
    states: dict[str, int]  # sockets per state name
    local_ports: frozenset[int]  # local ports of every socket
    open_local_ports: frozenset[int]  # local ports of sockets not in a CLOSING_STATES state
    destinations: dict[tuple[str, int], int]  # (remote address, port) -> sockets from ephemeral ports
    open_destinations: dict[tuple[str, int], int]  # the same, counting only sockets not closing
    bad_lines: tuple[str, ...]
    bad_count: int


class SocketFacts(Struct, frozen=True):
    port_range: tuple[int, int] | None  # ip_local_port_range; None when unread
    reserved: tuple[tuple[int, int], ...] | None  # ip_local_reserved_ports as inclusive ranges; None when unread
    listening: tuple[ListeningSocket, ...]  # LISTEN sockets of tcp and tcp6
    states: dict[str, int]  # sockets per TCP state, both tables
    ephemeral_ports_in_use: int | None  # distinct usable ephemeral ports held by any socket
    ephemeral_ports_open: int | None  # the same, held by a socket not in a CLOSING_STATES state
    busiest: tuple[Destination, ...]  # remote endpoints with the most sockets from ephemeral ports
    busiest_open: int  # most sockets not closing from ephemeral ports to any one endpoint
    tables: tuple[str, ...]  # the tables that were read
    bad_lines: tuple[str, ...]  # "path:line: text" of lines that did not parse (first few)
    bad_line_count: int
    problems: tuple[str, ...]  # files that could not be read
    # Read only where something listens on the job's port (SOCK001's question); None otherwise or unread.
    hostname: str | None = None  # /proc/sys/kernel/hostname
    addresses: tuple[str, ...] | None = None  # this node's IPv4 and IPv6 addresses
    own_uid: int | None = None  # this process's real uid (/proc/self/status Uid:)


class TableError(ValueError):
    """The text is not a /proc/net/tcp table at all."""


def _address(hex_ip: str) -> str:
    """``0100007F`` -> 127.0.0.1; 32 hex digits -> an IPv6 address (four host-order words)."""
    if len(hex_ip) == 8:
        return str(ipaddress.IPv4Address(bytes.fromhex(hex_ip)[::-1]))
    if len(hex_ip) == 32:
        raw = b"".join(bytes.fromhex(hex_ip[i:i + 8])[::-1] for i in range(0, 32, 8))
        address = ipaddress.IPv6Address(raw)
        # Dual-stack listeners show IPv4 peers as ::ffff:a.b.c.d; Python < 3.13 prints them in hex.
        return f"::ffff:{address.ipv4_mapped}" if address.ipv4_mapped else str(address)
    raise ValueError(f"address {hex_ip!r} is neither 8 nor 32 hex digits")


def _endpoint(text: str) -> tuple[str, int]:
    hex_ip, colon, hex_port = text.partition(":")
    if not colon or len(hex_port) != 4:
        raise ValueError(f"endpoint {text!r} is not HEXIP:HEXPORT")
    return _address(hex_ip), int(hex_port, 16)


def parse_tcp_table(text: str, path: str, ephemeral: tuple[int, int] | None = None) -> TcpTable:
    """Parse one ``/proc/net/tcp{,6}`` table; lines that do not parse are kept aside, not fatal.
    Destinations count only sockets whose local port lies in ``ephemeral``."""
    lines = text.splitlines()
    header = lines[0].split()[:3] if lines else []
    if header[:2] != ["sl", "local_address"] or header[2:] not in (["rem_address"], ["remote_address"]):
        raise TableError("no 'sl local_address rem_address' header: not a /proc/net/tcp table")
    listening: list[ListeningSocket] = []
    states: Counter[str] = Counter()
    local_ports: set[int] = set()
    open_local_ports: set[int] = set()
    destinations: Counter[tuple[str, int]] = Counter()
    open_destinations: Counter[tuple[str, int]] = Counter()
    bad: list[str] = []
    bad_count = 0
    for number, line in enumerate(lines[1:], 2):
        fields = line.split()
        try:
            if len(fields) < 10 or not fields[0].endswith(":"):
                raise ValueError("fewer than 10 fields")
            local, local_port = _endpoint(fields[1])
            remote, remote_port = _endpoint(fields[2])
            state = int(fields[3], 16)
            if state not in TCP_STATES:
                raise ValueError(f"unknown state {fields[3]}")
            uid, inode = int(fields[7]), int(fields[9])
        except ValueError as error:
            bad_count += 1
            if len(bad) < MAX_BAD_LINES:
                bad.append(f"{path}:{number}: {error}: {line.strip()[:120]}")
            continue
        states[TCP_STATES[state]] += 1
        local_ports.add(local_port)
        closing = state in CLOSING_STATES
        if not closing:
            open_local_ports.add(local_port)
        if state == LISTEN:
            listening.append(ListeningSocket(local, local_port, uid, inode, f"{path}:{number}"))
        elif ephemeral is not None and ephemeral[0] <= local_port <= ephemeral[1]:
            destinations[(remote, remote_port)] += 1
            if not closing:
                open_destinations[(remote, remote_port)] += 1
    return TcpTable(
        tuple(listening), dict(states), frozenset(local_ports), frozenset(open_local_ports),
        dict(destinations), dict(open_destinations), tuple(bad), bad_count,
    )


def parse_port_range(text: str) -> tuple[int, int]:
    """``32768\\t60999`` -> (32768, 60999)."""
    fields = text.split()
    if len(fields) != 2 or not all(is_number(field) for field in fields):
        raise ValueError(f"expected two port numbers, got {text.strip()[:60]!r}")
    low, high = int(fields[0]), int(fields[1])
    if not 0 < low <= high <= 65535:
        raise ValueError(f"{low} {high} is not a port range")
    return low, high


def parse_reserved_ports(text: str) -> tuple[tuple[int, int], ...]:
    """``29400,29500-29510`` -> ((29400, 29400), (29500, 29510)); empty text -> ()."""
    ranges = []
    for item in text.strip().split(","):
        if not item:
            continue
        low, dash, high = item.strip().partition("-")
        if not is_number(low) or (dash and not is_number(high)):
            raise ValueError(f"{item!r} is not a port or a port range")
        ranges.append((int(low), int(high) if dash else int(low)))
    return tuple(ranges)


def reserved_ports(port: int, reserved: tuple[tuple[int, int], ...]) -> bool:
    return any(low <= port <= high for low, high in reserved)


def _read_setting(fs: NodeFS, path: str, problems: list[str]) -> str | None:
    try:
        text = fs.read(path)
    except SourceError as error:
        problems.append(str(error))
        return None
    if text is None:
        problems.append(f"{path}: missing")
    return text


T = TypeVar("T")


def _parsed_setting(fs: NodeFS, path: str, parse: Callable[[str], T], problems: list[str]) -> T | None:
    """A sysctl parsed with ``parse``; None (and the reason in ``problems``) when it cannot be."""
    text = _read_setting(fs, path, problems)
    if text is None:
        return None
    try:
        return parse(text)
    except ValueError as error:
        problems.append(f"{path}: {error}")
        return None


def _ephemeral_count(ports: set[int], port_range: tuple[int, int], reserved: tuple[tuple[int, int], ...]) -> int:
    """How many of ``ports`` the kernel would otherwise hand out as ephemeral ports."""
    return sum(1 for port in ports if port_range[0] <= port <= port_range[1] and not reserved_ports(port, reserved))


#: torchrun / init_process_group(env://) listen here when MASTER_PORT is not set.
TORCH_DEFAULT_PORT = 29500
#: torchrun's c10d rendezvous store listens here when its endpoint names no port
#: (torch/distributed/elastic/rendezvous/c10d_rendezvous_backend.py, DEFAULT_PORT).
C10D_RENDEZVOUS_DEFAULT_PORT = 29400


class StorePort(Struct, frozen=True):
    """The port the job's rendezvous store binds, where that came from, and whether the job named
    it (False: a default the job may not use); port None where it is not known (``origin`` says why)."""

    port: int | None
    origin: str
    named: bool = True


def _port_number(name: str, value: str) -> StorePort:
    text = value.strip()
    if not is_number(text) or not 0 < int(text) <= 65535:
        return StorePort(None, f"{name}={value!r} is not a port number")
    return StorePort(int(text), f"{name}={int(text)} (job environment)")


def job_master_port(job: JobFacts) -> StorePort:
    """The port the job's rendezvous store will bind. torch.distributed's env:// takes MASTER_PORT;
    without it, torchrun's arguments as Kubeflow's training operator passes them: an elastic
    job's ``PET_RDZV_ENDPOINT`` port (its c10d backend's default 29400 without one), a static
    job's endpoint port or ``PET_MASTER_PORT``; else torchrun's default 29500."""
    if job.environ_error:
        return StorePort(None, f"/proc/self/environ: {job.environ_error}")
    environ = job.environ
    if "MASTER_PORT" in environ:
        return _port_number("MASTER_PORT", environ["MASTER_PORT"])
    backend = environ.get("PET_RDZV_BACKEND", "").strip() or "static"
    _, endpoint_port = rendezvous_endpoint(environ)
    if endpoint_port and backend in ("c10d", "static"):
        return _port_number("PET_RDZV_ENDPOINT's port", endpoint_port)
    if backend == "c10d" and environ.get("PET_RDZV_ENDPOINT", "").strip():
        return StorePort(C10D_RENDEZVOUS_DEFAULT_PORT, f"PET_RDZV_ENDPOINT names no port: torchrun's c10d default {C10D_RENDEZVOUS_DEFAULT_PORT}")
    if backend == "static" and "PET_MASTER_PORT" in environ:
        return _port_number("PET_MASTER_PORT", environ["PET_MASTER_PORT"])
    if backend != "static":
        return StorePort(None, f"PET_RDZV_BACKEND={backend[:40]!r}: the port of its store is not in the job's environment")
    return StorePort(TORCH_DEFAULT_PORT, f"MASTER_PORT unset: torchrun's default {TORCH_DEFAULT_PORT}", named=False)


@probe("sockets")
def probe_sockets(fs: NodeFS, job: JobFacts) -> SocketFacts:
    """Read the ephemeral port settings and the TCP tables of this network namespace."""
    problems: list[str] = []
    port_range = _parsed_setting(fs, PORT_RANGE, parse_port_range, problems)
    reserved = _parsed_setting(fs, RESERVED_PORTS, parse_reserved_ports, problems)
    tables: list[str] = []
    parsed: list[TcpTable] = []
    for path in TCP_TABLES:
        try:
            content = fs.read(path, max_bytes=MAX_TABLE_BYTES)
        except SourceError as error:
            problems.append(str(error))
            continue
        if content is None:
            if path == "/proc/net/tcp":  # tcp6 is absent when IPv6 is disabled; tcp never is
                problems.append(f"{path}: missing")
            continue
        try:
            parsed.append(parse_tcp_table(content, path, port_range))
        except TableError as error:
            problems.append(f"{path}: {error}")
            continue
        tables.append(path)
    states: Counter[str] = Counter()
    destinations: Counter[tuple[str, int]] = Counter()
    open_destinations: Counter[tuple[str, int]] = Counter()
    local_ports: set[int] = set()
    open_local_ports: set[int] = set()
    for table in parsed:
        states.update(table.states)
        local_ports |= table.local_ports
        open_local_ports |= table.open_local_ports
        destinations.update(table.destinations)
        open_destinations.update(table.open_destinations)
    listening = tuple(s for table in parsed for s in table.listening)
    in_use = in_use_open = None
    if port_range is not None and reserved is not None and tables:
        in_use = _ephemeral_count(local_ports, port_range, reserved)
        in_use_open = _ephemeral_count(open_local_ports, port_range, reserved)
    return SocketFacts(
        port_range,
        reserved,
        listening,
        dict(states),
        in_use,
        in_use_open,
        tuple(Destination(a, p, n) for (a, p), n in destinations.most_common(MAX_DESTINATIONS)),
        max(open_destinations.values(), default=0),
        tuple(tables),
        tuple(line for table in parsed for line in table.bad_lines),
        sum(table.bad_count for table in parsed),
        tuple(problems),
        *_store_host_facts(fs, job, listening),
    )


def _store_host_facts(fs: NodeFS, job: JobFacts, listening: tuple[ListeningSocket, ...]) -> tuple[str | None, tuple[str, ...] | None, int | None]:
    """This node's host name and addresses, and this process's uid, read only where something
    listens on the job's port: SOCK001 asks them only then (is this the node that will bind it,
    is the listener this user's own?), and the routing table can be large on hosts with many
    routes, so the prolog does not read it for nothing."""
    port = job_master_port(job).port
    if port is None or not any(socket.port == port for socket in listening):
        return None, None, None
    return _hostname(fs), _own_addresses(fs), _own_uid(fs)


def _own_uid(fs: NodeFS) -> int | None:
    try:
        ids = parse_status_ids(fs.read("/proc/self/status") or "")
    except SourceError:
        return None
    return ids[0] if ids is not None else None


def _hostname(fs: NodeFS) -> str | None:
    """This node's host name; None when it cannot be read (SOCK001 then cannot tell whether
    MASTER_ADDR names this node, and does not call the node the store's host)."""
    try:
        text = fs.read("/proc/sys/kernel/hostname")
    except SourceError:
        return None
    name = (text or "").strip()
    return name or None


def _own_addresses(fs: NodeFS) -> tuple[str, ...] | None:
    """The addresses this network namespace holds, from procfs (the prolog reads no netlink);
    None when either table cannot be read. A missing if_inet6 is IPv6 switched off."""
    from preflight.sources.netlink import parse_fib_trie_locals, parse_if_inet6

    try:
        trie, inet6 = fs.read("/proc/net/fib_trie"), fs.read("/proc/net/if_inet6")
    except SourceError:
        return None
    if trie is None:
        return None
    return tuple(parse_fib_trie_locals(trie)) + tuple(entry.address for entry in parse_if_inet6(inet6 or ""))
