"""The host firewall: which incoming TCP connections it lets through.

Sources:

* the nftables ruleset through netfilter netlink (``netlink.firewall()``, decoded by
  ``preflight.sources.nftables``; a recorded root replays it from ``.preflight/netlink.json``,
  and a root without that recording is unknown: the kernel keeps the rules in memory only);
* ``/proc/net/ip_tables_names`` and ``/proc/net/ip6_tables_names``: tables of the legacy
  iptables backend (``x_tables``), which netlink does not show; a node that has any is unknown;
* the namespace's interfaces (``if_nameindex(3)``), read with the rules and recorded with them:
  ``/sys/class/net`` shows the namespace sysfs was mounted in, not necessarily the caller's;
* which of them hold an IPv4 address or a global IPv6 one: the kernel's address dump
  (``netlink.addresses()``, live or a snapshot's recording), else, on a copied root,
  ``/proc/net/fib_trie``'s local addresses placed on an interface by ``/proc/net/route`` (a /32
  with no route, which the files cannot place, leaves this unknown) and ``/proc/net/if_inet6``.
  NCCL and Gloo listen only on interfaces with an address (NCCL's interface search skips any
  without one of the family, ``src/os/linux.cc``), so a bond or bridge port, a container's veth or
  an unconfigured port is never where a peer's SYN arrives, whatever zone the firewall gives it.

The evaluator (:func:`evaluate`) answers one question: what happens to a TCP SYN that another
host sends to local port P on interface I. It follows netfilter's order: the netdev and inet
``ingress`` hooks, then ``prerouting``, then ``input``; within a hook the base chains by
priority; within a chain the rules in order. ``accept`` ends one base chain (the next still
runs); ``drop`` and ``reject`` are final; ``jump`` returns, ``goto`` does not; a base chain's
policy applies when its rules run out. The packet is what NCCL's and Gloo's connects send: TCP,
SYN only, conntrack state ``new``, no NAT status bits, no mark known, coming from an address we do
not know and addressed to the interface's own (neither ever loopback). A condition on something
we do not know (the peer's address, a mark, an expression we do not decode) is followed both
ways, and when the ways end differently the answer lists every outcome; checks call that unknown.
"""

from __future__ import annotations

import ipaddress
import re
from typing import TYPE_CHECKING

from msgspec import Struct

from preflight.model import Observation
from preflight.probes.job import JobFacts
from preflight.registry import probe
from preflight.sources import NodeFS, SourceError
from preflight.sources.netlink import Netlink
from preflight.sources.nftables import (
    ADDRTYPE_DEST,
    ADDRTYPE_SOURCE,
    FIB_DADDR_TYPE,
    FIB_SADDR_TYPE,
    IP6_EXTHDR,
    Chain,
    Condition,
    Rule,
    Ruleset,
)
from preflight.units import is_number

if TYPE_CHECKING:
    from collections.abc import Iterator

    from preflight.probes.rdma import RdmaFacts
    from preflight.probes.sockets import SocketFacts

LEGACY_TABLES = ("/proc/net/ip_tables_names", "/proc/net/ip6_tables_names")
#: Hooks a packet for this host passes, in order (netfilter's NF_INET_* path for local delivery).
HOOK_ORDER = ("ingress", "prerouting", "input")
#: Evaluation steps (rules looked at, summed over every branch) before we give up.
MAX_STEPS = 200_000
#: Undecidable conditions on one path before we give up (bounds the recursion too).
MAX_BRANCH_DEPTH = 64
#: Jumps nested deeper than this are a loop or a ruleset we do not follow.
MAX_JUMP_DEPTH = 16

_TCP = 6
_CT_NEW = 1 << 3  # NF_CT_STATE_BIT(IP_CT_NEW)
_FAMILY_CHAINS = {4: ("inet", "ip", "netdev"), 6: ("inet", "ip6", "netdev")}


class Interface(Struct, frozen=True):
    name: str
    index: int
    # IFF_RUNNING as /sys/class/net/<name>/operstate tells it ("up" or "unknown"); None: unread.
    # NCCL lists only running interfaces (ncclOsFindInterfaces), so it never listens on the others.
    running: bool | None = None


class FirewallFacts(Struct, frozen=True):
    ruleset: Ruleset | None  # the chains a packet for this host can pass; None when unread
    error: str  # why the ruleset could not be read, "" when it was
    source: str  # where the ruleset came from
    legacy_tables: tuple[str, ...]  # "ip:filter" per table of the legacy iptables backend
    legacy_error: str  # why the legacy table lists could not be read, "" when they were
    interfaces: tuple[Interface, ...]  # read with the rules, loopback included; () when unread
    # names of the interfaces holding an IPv4 address; None when that could not be told (a file
    # missing or unreadable, or an address no route places), and then no interface is left out
    addressed: tuple[str, ...] | None = None
    # names of the interfaces holding a global IPv6 address (/proc/net/if_inet6); () where IPv6
    # is off, None when unread (then only the IPv4 ones count, as before this was read)
    addressed6: tuple[str, ...] | None = None

    def reachable(self) -> tuple[str, ...] | None:
        return reachable_names(self.addressed, self.addressed6)

    def families(self, name: str, ipv6: bool | None) -> tuple[int, ...]:
        """The address families a listener on ``name`` uses: ``ipv6`` True (NCCL_SOCKET_FAMILY=AF_INET6),
        False (the library takes the interface's first address, IPv4 where it has one: getifaddrs
        lists IPv4 before IPv6) or None (the host name's address decides, unknown here: both on
        an interface that has both)."""
        v4 = self.addressed is None or name in self.addressed
        v6 = self.addressed6 is not None and name in self.addressed6
        if ipv6:
            return (6,)
        if ipv6 is False or not (v4 and v6):
            return (4,) if v4 or not v6 else (6,)
        return (4, 6)


def no_listener_here(facts: FirewallFacts) -> None:
    """Unknown where no interface holds an IPv4 address a library would listen on but whether one
    holds a global IPv6 address was not read (/proc/net/if_inet6): "none" would be a guess."""
    from preflight.model import Unknown

    if facts.addressed is not None and facts.addressed6 is None:
        raise Unknown("no interface holds an IPv4 address to listen on, and /proc/net/if_inet6 (the IPv6 ones) could not be read")


def reachable_names(addressed: tuple[str, ...] | None, addressed6: tuple[str, ...] | None) -> tuple[str, ...] | None:
    """Interfaces another host can reach this node on (an IPv4 or a global IPv6 address); None
    when which hold an IPv4 address is unknown; the IPv4 ones alone when IPv6's are unread."""
    if addressed is None or addressed6 is None:
        return addressed
    return tuple(sorted({*addressed, *addressed6}))


class Outcome(Struct, frozen=True):
    """One way a connection attempt can end."""

    kind: str  # "accepted", "dropped", "rejected", "unknown"
    chain: str = ""  # "inet filter input" where it was decided; "" when every chain accepted
    rule: str = ""  # the rule's text, or "policy drop"
    reject_with: str = ""  # "tcp reset", "admin-prohibited"... for "rejected"
    reason: str = ""  # why "unknown"

    def describe(self) -> str:
        if self.kind == "accepted":
            return "accepted"
        if self.kind == "unknown":
            return f"unknown ({self.reason})"
        where = f"{self.chain}: {self.rule}" if self.chain else self.rule
        return f"{self.kind} by {where}"


class Packet(Struct, frozen=True):
    family: int  # 4 or 6
    dport: int
    iifname: str
    iif: int


class _GiveUp(Exception):
    pass


# -- conditions ---------------------------------------------------------------------------------


#: Route types of addresses (RTN_UNICAST, RTN_LOCAL in include/uapi/linux/rtnetlink.h).
_RTN_UNICAST, _RTN_LOCAL = 1, 2


def _field_value(field: str, packet: Packet) -> int | str | None:
    """What ``field`` holds for the packet, None when we do not know."""
    known: dict[str, int | str] = {
        "meta l4proto": _TCP,
        "meta nfproto": 2 if packet.family == 4 else 10,
        "meta protocol": 0x0800 if packet.family == 4 else 0x86DD,
        "th dport": packet.dport,
        "tcp flags": 0x02,  # SYN
        "ct state": _CT_NEW,
        "ct status": 0,  # a new connection: not yet seen a reply, not confirmed, not NATed
        "meta pkttype": 0,  # PACKET_HOST
        "iifname": packet.iifname,
        "iif": packet.iif,
        # A peer's SYN: from another host's unicast address to this interface's own (local) one
        # (as address-type bits for xt's addrtype, as RTN_* numbers for nft's fib), with no IPv6
        # extension header.
        ADDRTYPE_SOURCE: 1 << _RTN_UNICAST,
        ADDRTYPE_DEST: 1 << _RTN_LOCAL,
        FIB_SADDR_TYPE: _RTN_UNICAST,
        FIB_DADDR_TYPE: _RTN_LOCAL,
    }
    if field.startswith(IP6_EXTHDR):
        return 0
    if packet.family == 4:
        known["ip protocol"] = _TCP
    return known.get(field)


def _one_matches(field: str, value: int | str, text: str) -> bool | None:
    if field == "iifname":
        assert isinstance(value, str)
        return value.startswith(text[:-1]) if text.endswith("*") else value == text
    assert isinstance(value, int)
    low, _, high = text.partition("-")
    try:
        return int(low) <= value <= int(high or low)
    except ValueError:
        return None


def _loopback_only(text: str) -> bool:
    """Whether every address ``text`` covers is loopback (a peer never sends from there)."""
    try:
        if "/" in text:
            network = ipaddress.ip_network(text, strict=False)
            return network.network_address.is_loopback and network.broadcast_address.is_loopback
        low, _, high = text.partition("-")
        return all(ipaddress.ip_address(part).is_loopback for part in (low, high or low))
    except (ValueError, TypeError):
        return False


def condition_holds(condition: Condition, packet: Packet) -> bool | None:
    """True/False for the packet, None when it cannot be decided."""
    if condition.op == "opaque":
        return None
    if condition.field in ("ip saddr", "ip6 saddr", "ip daddr", "ip6 daddr"):
        # A peer's SYN comes from another host and is addressed to the listener's address on the
        # interface it arrives on, never loopback: kubelet's KUBE-FIREWALL drop of "! -s 127.0.0.0/8
        # -d 127.0.0.0/8" never matches it. Any other address depends on the peer or the interface.
        if condition.op in ("==", "in", "!=", "not in") and all(_loopback_only(v) for v in condition.values):
            return condition.op in ("!=", "not in")
        return None
    value = _field_value(condition.field, packet)
    if value is None:
        return None
    if condition.mask:
        if not isinstance(value, int):
            return None
        value &= condition.mask
    if condition.op in ("in", "not in", "==", "!="):
        results = [_one_matches(condition.field, value, text) for text in condition.values]
        if None in results:
            return None
        hit = any(results)
        return hit if condition.op in ("in", "==") else not hit
    if not isinstance(value, int):
        return None
    try:
        operand = int(condition.values[0])
    except (IndexError, ValueError):
        return None
    return {"<": value < operand, "<=": value <= operand, ">": value > operand, ">=": value >= operand}.get(condition.op)


def rule_matches(rule: Rule, packet: Packet) -> bool | None:
    """All conditions hold (True), one fails (False), or it depends on what we do not know."""
    undecided = False
    for condition in rule.conditions:
        holds = condition_holds(condition, packet)
        if holds is False:
            return False
        undecided = undecided or holds is None
    return None if undecided else True


# -- walking the chains -------------------------------------------------------------------------


class _Walk:
    def __init__(self, ruleset: Ruleset, packet: Packet) -> None:
        self.packet = packet
        self.steps = 0
        self.regular = {(c.family, c.table, c.name): c for c in ruleset.chains if not c.hook}
        families = _FAMILY_CHAINS[packet.family]
        hooked = [
            c for c in ruleset.chains
            if c.hook in HOOK_ORDER and c.family in families and (not c.devices or packet.iifname in c.devices)
        ]
        self.base = sorted(hooked, key=lambda c: (HOOK_ORDER.index(c.hook), c.priority or 0))

    def run(self) -> set[Outcome]:
        return self._from_base(0)

    def _from_base(self, position: int) -> set[Outcome]:
        if position == len(self.base):
            return {Outcome("accepted")}
        results: set[Outcome] = set()
        for outcome in self._chain(self.base[position], self.base[position], 0, (), 0):
            results |= self._from_base(position + 1) if outcome.kind == "accepted" else {outcome}
        return results

    def _chain(self, base: Chain, chain: Chain, index: int, stack: tuple[tuple[Chain, int], ...], depth: int) -> set[Outcome]:
        while True:
            self.steps += 1
            if self.steps > MAX_STEPS:
                raise _GiveUp(f"more than {MAX_STEPS} evaluation steps")
            if index >= len(chain.rules):
                if stack:
                    chain, index = stack[-1]
                    stack = stack[:-1]
                    continue
                if base.policy == "drop":
                    return {Outcome("dropped", base.label(), "policy drop")}
                return {Outcome("accepted")}
            rule = chain.rules[index]
            matched = rule_matches(rule, self.packet)
            if matched is False or (matched is True and not rule.verdict):
                index += 1
                continue
            if matched is None:
                if depth >= MAX_BRANCH_DEPTH:
                    raise _GiveUp(f"more than {MAX_BRANCH_DEPTH} undecidable rules on one path")
                return self._chain(base, chain, index + 1, stack, depth + 1) | self._verdict(base, chain, index, stack, depth + 1)
            return self._verdict(base, chain, index, stack, depth)

    def _verdict(self, base: Chain, chain: Chain, index: int, stack: tuple[tuple[Chain, int], ...], depth: int) -> set[Outcome]:
        rule = chain.rules[index]
        verdict = rule.verdict
        if verdict == "accept":
            return {Outcome("accepted")}
        if verdict == "drop":
            return {Outcome("dropped", chain.label(), rule.text())}
        if verdict == "reject":
            return {Outcome("rejected", chain.label(), rule.text(), rule.reject_with)}
        if verdict in ("jump", "goto"):
            target = self.regular.get((chain.family, chain.table, rule.target))
            if target is None:
                return {Outcome("unknown", chain.label(), rule.text(), reason=f"{verdict} to a chain not in the ruleset: {rule.target}")}
            if len(stack) >= MAX_JUMP_DEPTH:
                raise _GiveUp(f"jumps nested deeper than {MAX_JUMP_DEPTH}")
            pushed = stack + ((chain, index + 1),) if verdict == "jump" else stack
            return self._chain(base, target, 0, pushed, depth)
        if verdict == "return":
            return self._chain(base, chain, len(chain.rules), stack, depth)
        if verdict in ("", "continue", "break"):
            return self._chain(base, chain, index + 1, stack, depth)
        return {Outcome("unknown", chain.label(), rule.text(), reason=f"a statement we do not decode decides the packet ({rule.target or verdict})")}


def evaluate(ruleset: Ruleset, packet: Packet) -> set[Outcome]:
    """Every way a SYN like ``packet`` can end in ``ruleset`` (one element when it is decided)."""
    try:
        return _Walk(ruleset, packet).run()
    except _GiveUp as error:
        return {Outcome("unknown", reason=str(error))}
    except RecursionError:
        return {Outcome("unknown", reason="the ruleset nests too deeply to follow")}


def port_boundaries(ruleset: Ruleset) -> set[int]:
    """Every port where a destination-port condition can change its answer: testing one port
    per stretch between them decides the whole stretch."""
    points: set[int] = set()
    for chain in ruleset.chains:
        for rule in chain.rules:
            for condition in rule.conditions:
                if condition.field != "th dport" or condition.mask:
                    continue
                for text in condition.values:
                    low, _, high = text.partition("-")
                    if not (is_number(low) and is_number(high or low)):
                        continue
                    points.update((int(low), int(high or low) + 1))
                    if condition.op in ("<", "<=", ">", ">="):
                        points.update((int(low) - 1, int(low), int(low) + 1))
    return points


# -- the probe ----------------------------------------------------------------------------------


def _listening(interfaces: tuple[Interface, ...], addressed: tuple[str, ...] | None) -> tuple[Interface, ...]:
    """``interfaces`` but loopback, those known not to be running and, when known, those without
    an address another host can reach (``FirewallFacts.reachable``)."""
    return tuple(
        i for i in interfaces if i.name != "lo" and i.running is not False and (addressed is None or i.name in addressed)
    )


def selected_interfaces(interfaces: tuple[Interface, ...], setting: str | None, addressed: tuple[str, ...] | None = None) -> tuple[Interface, ...]:
    """The interfaces a socket library listening per its ``*_SOCKET_IFNAME`` can be reached on:
    the list's choice, or NCCL's default (``ib*`` first, else anything but ``docker``, ``lo`` and
    ``virbr``: ``src/misc/socket.cc``), among those with an address."""
    candidates = _listening(interfaces, addressed)
    if setting:
        # NCCL's list grammar; imported here because its module is otherwise full-profile only
        from preflight.probes.nccl_socket import list_selects, parse_ifname_list

        spec = parse_ifname_list(setting)
        return tuple(i for i in candidates if list_selects(spec, i.name))
    others = tuple(i for i in candidates if not i.name.startswith(_VIRTUAL_BRIDGES))
    if addressed is None:
        return others  # whether an ib* interface has an address, and so comes first, is unknown
    infiniband = tuple(i for i in candidates if i.name.startswith("ib"))
    return infiniband or others


#: Bridges NCCL passes over unless nothing else is left (docker's and libvirt's); a firewall
#: commonly rejects on them (firewalld's libvirt zone does) without touching the cluster's traffic.
_VIRTUAL_BRIDGES = ("docker", "virbr")


def gloo_interfaces(interfaces: tuple[Interface, ...], setting: str | None, addressed: tuple[str, ...] | None = None) -> tuple[Interface, ...]:
    """The interfaces Gloo can be reached on: ``GLOO_SOCKET_IFNAME``'s exact names (comma
    separated, as PyTorch splits them); unset, Gloo uses the host name's address, on any
    addressed interface but loopback and docker or libvirt bridges."""
    candidates = _listening(interfaces, addressed)
    if setting:
        names = {name.strip() for name in setting.split(",")}
        return tuple(i for i in candidates if i.name in names)
    return tuple(i for i in candidates if not i.name.startswith(_VIRTUAL_BRIDGES))


def _legacy_tables(fs: NodeFS) -> tuple[tuple[str, ...], str]:
    names: list[str] = []
    for path in LEGACY_TABLES:
        try:
            text = fs.read(path)
        except SourceError as error:
            return (), f"{path}: {error.reason}"
        family = "ip6" if "ip6" in path else "ip"
        names.extend(f"{family}:{line.strip()}" for line in (text or "").splitlines() if line.strip())
    return tuple(names), ""


def _relevant(ruleset: Ruleset) -> Ruleset:
    """The chains a packet for this host can pass: base chains of the local delivery path and
    the regular chains of their tables (jump targets); output and forward chains are left out."""
    families = {"inet", "ip", "ip6", "netdev"}
    tables = {(c.family, c.table) for c in ruleset.chains if c.hook in HOOK_ORDER and c.family in families}
    chains = tuple(
        c for c in ruleset.chains
        if (c.family, c.table) in tables and (c.hook in HOOK_ORDER or not c.hook)
    )
    return Ruleset(chains, sum(len(c.rules) for c in chains), ruleset.interfaces)


@probe("firewall")
def probe_firewall(fs: NodeFS, netlink: Netlink) -> FirewallFacts:
    """Read the nftables ruleset (with the interfaces) and the legacy iptables tables."""
    legacy, legacy_error = _legacy_tables(fs)
    try:
        ruleset: Ruleset | None = _relevant(netlink.firewall())
        error, source = "", "nf_tables netlink"
    except SourceError as failure:
        ruleset, error, source = None, failure.reason, failure.source
    addressed, addressed6 = _addressed(fs, netlink)
    reachable = reachable_names(addressed, addressed6)
    interfaces = tuple(
        Interface(name, index, interface_running(fs, name) if reachable is None or name in reachable else None)
        for index, name in (ruleset.interfaces if ruleset else ())
    )
    return FirewallFacts(ruleset, error, source, legacy, legacy_error, interfaces, addressed, addressed6)


#: An interface name the kernel accepts (dev_valid_name(): at most 15 bytes, no '/', not '.' or '..').
_IFNAME = re.compile(r"(?!\.{1,2}$)[^/\s]{1,15}")
#: operstate values with IFF_RUNNING set (RFC 2863 up, and "unknown" for drivers that report no state)
_RUNNING_STATES = ("up", "unknown")


def interface_running(fs: NodeFS, name: str) -> bool | None:
    """Whether the interface is running, from sysfs; None when that is not read. The name comes
    from a recording, so only a name the kernel could have given is looked up."""
    if not _IFNAME.fullmatch(name):
        return None
    try:
        state = fs.read(f"/sys/class/net/{name}/operstate")
    except SourceError:
        return None
    return None if state is None else state.strip() in _RUNNING_STATES


def _addressed(fs: NodeFS, netlink: Netlink) -> tuple[tuple[str, ...] | None, tuple[str, ...] | None]:
    """The interfaces holding an IPv4 address and those holding a global IPv6 one: from the
    kernel's address dump (live, or a snapshot's recording), which places every address, a /32
    without a main-table route too (NodeLocal DNSCache's 169.254.20.10, the ClusterIPs on
    kube-ipvs0, tailscale0's address); else from the files a copied root holds."""
    from preflight.sources.netlink import LiveNetlink, ReplayNetlink, address_owners

    try:
        if isinstance(netlink, LiveNetlink):
            owners = address_owners()
        elif isinstance(netlink, ReplayNetlink):
            owners = [(address.family, address.ifname, address.scope) for address in netlink.addresses()]
        else:
            owners = None
    except (SourceError, OSError):
        owners = None
    if owners is None:
        return _ipv4_interfaces(fs), _ipv6_interfaces(fs)
    named = [(family, name, scope) for family, name, scope in owners if _IFNAME.fullmatch(name)]
    return (
        tuple(sorted({name for family, name, _ in named if family == 4})),
        tuple(sorted({name for family, name, scope in named if family == 6 and scope == "global"})),
    )


def _ipv4_interfaces(fs: NodeFS) -> tuple[str, ...] | None:
    """Names of the interfaces holding an IPv4 address, or None when that cannot be told."""
    from preflight.sources.netlink import attach_ipv4, parse_fib_trie_locals, parse_proc_net_route

    try:
        trie, route_table = fs.read("/proc/net/fib_trie"), fs.read("/proc/net/route")
    except SourceError:
        return None
    if trie is None or route_table is None:
        return None  # not captured: every interface stays a candidate
    routes = parse_proc_net_route(route_table)
    names = set()
    try:
        for local in parse_fib_trie_locals(trie):
            names.add(attach_ipv4(local, routes).ifname)
    except SourceError:
        return None  # an address we cannot place might be on any interface
    return tuple(sorted(names))


def _ipv6_interfaces(fs: NodeFS) -> tuple[str, ...] | None:
    """Names of the interfaces holding a global IPv6 address (``/proc/net/if_inet6``: address,
    ifindex, prefix length, scope, flags, name; scope 00 is global); () where the file is not
    there (IPv6 off at boot), None when it could not be read."""
    from preflight.sources.netlink import parse_if_inet6

    try:
        text = fs.read("/proc/net/if_inet6")
    except SourceError:
        return None
    return tuple(sorted({a.ifname for a in parse_if_inet6(text or "") if a.scope == "global" and _IFNAME.fullmatch(a.ifname)}))


# -- what the checks ask ------------------------------------------------------------------------

#: Port stretches tested per interface; a ruleset that cuts the range finer is left unknown.
MAX_STRETCHES = 128


class PortFate(Struct, frozen=True):
    """How the firewall treats a SYN to ports ``low``-``high`` arriving on ``interface``."""

    interface: str
    low: int
    high: int
    outcomes: tuple[Outcome, ...]

    def ports(self) -> str:
        return str(self.low) if self.low == self.high else f"{self.low}-{self.high}"


def readable_ruleset(facts: FirewallFacts) -> Ruleset:
    """The ruleset, or Unknown with the reason it cannot be judged."""
    from preflight.model import Unknown

    if facts.ruleset is None:
        raise Unknown(f"{facts.source}: {facts.error}")
    if facts.legacy_error:
        raise Unknown(f"cannot tell whether legacy iptables tables exist: {facts.legacy_error}")
    if facts.legacy_tables:
        raise Unknown(
            f"legacy iptables tables are loaded ({', '.join(facts.legacy_tables)}): their rules are not "
            "visible through nf_tables netlink"
        )
    if not facts.interfaces:
        raise Unknown("the recording holds no interfaces, so rules on the incoming interface cannot be judged")
    return facts.ruleset


def port_fates(
    facts: FirewallFacts, ruleset: Ruleset, interfaces: tuple[Interface, ...], ranges: tuple[tuple[int, int], ...], ipv6: bool | None = False
) -> list[PortFate]:
    """The outcome for every stretch of ``ranges`` on every interface in ``interfaces``, for a
    SYN of each family a listener there may use (``FirewallFacts.families``; both families'
    outcomes where either may be, so a block of one alone is undecided), neighbouring stretches
    with the same outcome merged; Unknown when the rules cut the ranges into too many stretches."""
    from preflight.model import Unknown

    points = port_boundaries(ruleset)
    fates: list[PortFate] = []
    for interface in interfaces:
        for low, high in ranges:
            starts = sorted({low} | {p for p in points if low < p <= high})
            if len(starts) > MAX_STRETCHES:
                raise Unknown(f"the rules cut ports {low}-{high} into {len(starts)} stretches, more than the {MAX_STRETCHES} tested")
            merged: list[PortFate] = []
            for position, start in enumerate(starts):
                end = starts[position + 1] - 1 if position + 1 < len(starts) else high
                ways = {o for family in facts.families(interface.name, ipv6) for o in evaluate(ruleset, Packet(family, start, interface.name, interface.index))}
                outcomes = tuple(sorted(ways, key=lambda o: (o.kind, o.chain, o.rule)))
                if merged and merged[-1].outcomes == outcomes:
                    merged[-1] = PortFate(interface.name, merged[-1].low, end, outcomes)
                else:
                    merged.append(PortFate(interface.name, start, end, outcomes))
            fates.extend(merged)
    return fates


#: What connect() reports to the peer for each way of rejecting (ICMP codes as Linux's
#: icmp_err_convert maps them; a TCP reset is a refusal).
PEER_ERROR = {
    "tcp reset": "Connection refused",
    "port-unreachable": "Connection refused",
    "host-unreachable": "No route to host",
    "host-prohibited": "No route to host",
    "admin-prohibited": "No route to host",
    "addr-unreachable": "No route to host",
    "no-route": "No route to host",
    "net-unreachable": "Network is unreachable",
    "net-prohibited": "Network is unreachable",
    "prot-unreachable": "Protocol not available",
}


def outcome_text(outcome: Outcome) -> str:
    text = outcome.describe()
    if outcome.kind == "rejected":
        error = PEER_ERROR.get(outcome.reject_with, "")
        text += f" (the peer's connect fails with '{error}')" if error else ""
    elif outcome.kind == "dropped":
        text += " (silently: the peer's connect times out)"
    return text


def blocked_findings(fates: list[PortFate], kinds: frozenset[str], purpose: str, expected: str) -> list[Observation]:
    """One finding per interface: present when some ports end in one of ``kinds`` on every way
    through the rules, unknown when they might, nothing when none can."""
    from preflight.model import Evidence, present, undecided

    by_interface: dict[str, list[PortFate]] = {}
    for fate in fates:
        by_interface.setdefault(fate.interface, []).append(fate)
    found: list[Observation] = []
    for interface, items in by_interface.items():
        evidence = [
            Evidence(SOURCE_LABEL, f"TCP SYN from another host to {purpose} {fate.ports()} on {interface}: {' or '.join(outcome_text(o) for o in fate.outcomes)}", expected)
            for fate in items
            if all(o.kind in kinds for o in fate.outcomes)
        ]
        if evidence:
            found.append(present(interface, *evidence))
            continue
        doubtful = [fate for fate in items if any(o.kind in kinds or o.kind == "unknown" for o in fate.outcomes)]
        if doubtful:
            fate = doubtful[0]
            ways = "; ".join(outcome_text(o) for o in fate.outcomes)
            found.append(undecided(interface, f"{purpose} {fate.ports()} on {interface}: the outcome depends on what the node cannot tell (the peer's address or address family, a mark, an expression not decoded): {ways}"))
    return found


SOURCE_LABEL = "nftables ruleset (nf_tables netlink)"


def nccl_port_findings(
    firewall: FirewallFacts, sockets: SocketFacts, job: JobFacts, rdma: RdmaFacts, kinds: frozenset[str]
) -> list[Observation]:
    """SOCK004 (rejected) and NCCL004 (dropped): what the firewall does to connections to
    NCCL's listeners, which bind port 0 so the kernel picks from ip_local_port_range. Where NCCL's
    IB transport carries the data, its only listeners are the bootstrap ones, on the one interface
    it picks first: a block on some of the candidates and not others is then undecided."""
    from preflight.model import NotApplicable, Unknown
    from preflight.nccl.ib import ib_carries_data
    from preflight.probes.sockets import PORT_RANGE

    ruleset = readable_ruleset(firewall)
    if sockets.port_range is None:
        raise Unknown(f"{PORT_RANGE} unread: the ports NCCL listens on are not known")
    setting = job.nccl("NCCL_SOCKET_IFNAME")
    interfaces = selected_interfaces(firewall.interfaces, setting.value if setting else None, firewall.reachable())
    if not interfaces:
        no_listener_here(firewall)
        raise NotApplicable("no interface NCCL would listen on (only loopback, or NCCL_SOCKET_IFNAME selects none)")
    family = job.nccl("NCCL_SOCKET_FAMILY")
    fates = port_fates(firewall, ruleset, interfaces, (sockets.port_range,), ipv6=family is not None and family.value == "AF_INET6")
    found = blocked_findings(fates, kinds, "ephemeral port", "accepted: NCCL listens on ports the kernel picks from ip_local_port_range")
    if firewall.addressed is None:
        found = list(only_if_every_interface(found, interfaces, ADDRESSES_UNKNOWN))
    if ib_carries_data(rdma, job) is not False:  # IB carries the data, or whether it does is unknown
        found = list(only_if_every_interface(found, interfaces, BOOTSTRAP_ONLY))
    return on_one_node(job, found)


#: Why a block does not touch a job known to run on one node.
ONE_NODE = (
    "the job runs on this one node: its ranks connect to this host's own addresses, which Linux delivers through lo, "
    "so rules for other hosts' packets do not reach them; jobs that span nodes are still blocked"
)


def on_one_node(job: JobFacts, found: list[Observation]) -> list[Observation]:
    """``found``, with its blocks as warnings where the job is known to run on one node (Slurm's
    node count, torchrun --standalone, mpirun on one host: :func:`preflight.probes.hostname.job_nodes`):
    the node still blocks the multi-node jobs after it, as DNS001 says of a loopback host name."""
    from msgspec.structs import replace

    from preflight.model import Evidence, Severity, Status
    from preflight.probes.hostname import job_nodes

    if job_nodes(job.environ)[1] != 1:
        return found
    return [
        replace(item, severity=Severity.WARNING, evidence=(*item.evidence, Evidence("job", ONE_NODE))) if item.status is Status.PRESENT else item
        for item in found
    ]


#: Why a block on one candidate interface may not matter where NCCL's IB transport carries the data.
BOOTSTRAP_ONLY = (
    "NCCL's IB transport carries the data here, so NCCL listens only on the bootstrap interface it picks first "
    "(getifaddrs order, ib* first), which is not read here"
)


#: Why a block on one interface may not matter when the interfaces' addresses were not read.
ADDRESSES_UNKNOWN = "which interfaces hold an IPv4 address is unknown (/proc/net/fib_trie or /proc/net/route unread, or an address no route places)"


def only_if_every_interface(found: list[Observation], interfaces: tuple[Interface, ...], doubt: str) -> Iterator[Observation]:
    """``found`` when a block on some interfaces and not others cannot be told to matter
    (``doubt`` says why: the library listens on one address only, or which interfaces carry an
    address is unknown): a block on every interface is certain, since the listener is on one of
    them; a block on some is undecided, naming both sides."""
    from preflight.model import Status, undecided

    blocked = {item.subject for item in found if item.status is Status.PRESENT}
    open_ = [i.name for i in interfaces if i.name not in blocked]
    if not blocked or not open_:
        yield from found
        return
    for item in found:
        if item.status is Status.PRESENT:
            yield undecided(
                item.subject,
                f"{doubt}; blocked on {item.subject} ({item.evidence[0].observed[:200]}) but not on {', '.join(open_[:12])}",
            )
        else:
            yield item
