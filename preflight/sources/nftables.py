"""The host firewall (nftables) through netfilter netlink, decoded into a small typed model.

On Debian 11+, RHEL 8+ and Ubuntu 20.10+ the ``iptables`` command is ``iptables-nft`` and
firewalld's default backend is nftables, so one netlink dump of nf_tables sees what all three
configured. The dump is ours (``socket`` and ``struct``): pyroute2's nftables module decodes the
same attributes, but importing pyroute2 costs about 0.2 s against a few milliseconds for the
dump, and the checks built on it run in every prolog. Turning attributes into tests on packet
fields (which register holds which field, byte orders, set intervals) is ours either way.

What is asked (``include/uapi/linux/netfilter/nf_tables.h``, ``nfnetlink.h``): ``NFT_MSG_GETCHAIN``,
``NFT_MSG_GETRULE`` and ``NFT_MSG_GETSET`` dumps of every family, and ``NFT_MSG_GETSETELEM`` for
each set a rule looks up. Every nfnetlink request needs CAP_NET_ADMIN in the namespace
(``nfnetlink_rcv_msg``); without it the kernel answers EPERM.

A rule is reduced to :class:`Rule`: its conditions in order (:class:`Condition`, each naming the
packet field it tests, e.g. ``th dport``, ``iifname``, ``ct state``) and its verdict. The kernel
evaluates a rule's expressions in order and stops at the first one that does not match, so an
expression we do not decode is kept in place as an ``opaque`` condition: the evaluator
(``preflight.probes.firewall``) then knows the rule *may* stop there. Statements that never stop a
rule and never decide a verdict (``counter``, ``log``, iptables' ``comment`` match) are skipped.

Bounds: at most :data:`MAX_RULES` rules, :data:`MAX_SET_ELEMENTS` elements per set and
:data:`MAX_DUMP_BYTES` bytes per dump; past them the dump fails (``SourceError``) rather than
judging a partial ruleset.
"""

from __future__ import annotations

import errno as errno_codes
import ipaddress
import os
import struct
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from msgspec import Struct
from msgspec.structs import replace

from preflight.sources.fs import SourceError

if TYPE_CHECKING:
    # imported where the live dump runs: a recorded root never opens a socket, and importing
    # the module costs a replayed prolog ~4 ms
    import socket

MAX_RULES = 10_000
MAX_SET_ELEMENTS = 4_096
MAX_DUMP_BYTES = 32 * 1024 * 1024
DUMP_TIMEOUT_S = 2.0
SOURCE = "nf_tables netlink"

# nfnetlink / nf_tables message types and flags
_NETLINK_NETFILTER = 12
_NFNL_SUBSYS_NFTABLES = 10
_NFT_MSG_GETCHAIN = 4
_NFT_MSG_GETRULE = 7
_NFT_MSG_GETSET = 10
_NFT_MSG_GETSETELEM = 13
_NLM_F_REQUEST = 0x1
_NLM_F_DUMP = 0x300
_NLA_TYPE_MASK = 0x3FFF

FAMILIES = {1: "inet", 2: "ip", 3: "arp", 5: "netdev", 7: "bridge", 10: "ip6"}
# NF_INET_* hook numbers (include/uapi/linux/netfilter.h); netdev's ingress is 0 there.
INET_HOOKS = {0: "prerouting", 1: "input", 2: "forward", 3: "output", 4: "postrouting", 5: "ingress"}

# nft_verdicts and the netfilter verdicts NF_DROP/NF_ACCEPT
_VERDICTS = {0: "drop", 1: "accept", -1: "continue", -2: "break", -3: "jump", -4: "goto", -5: "return"}
_CMP_OPS = {0: "==", 1: "!=", 2: "<", 3: "<=", 4: ">", 5: ">="}
_META_KEYS = {1: "meta protocol", 4: "iif", 6: "iifname", 15: "meta nfproto", 16: "meta l4proto", 3: "meta mark", 19: "meta pkttype"}
_CT_KEYS = {0: "ct state", 2: "ct status", 3: "ct mark"}
# NFT_REJECT_ICMPX_* codes, and the ICMP codes of the IPv4/IPv6 reject types
_ICMPX = {0: "no-route", 1: "port-unreachable", 2: "host-unreachable", 3: "admin-prohibited"}
_ICMP4 = {0: "net-unreachable", 1: "host-unreachable", 2: "prot-unreachable", 3: "port-unreachable", 9: "net-prohibited", 10: "host-prohibited", 13: "admin-prohibited"}
_ICMP6 = {0: "no-route", 1: "admin-prohibited", 3: "addr-unreachable", 4: "port-unreachable"}
# iptables' REJECT target info (ipt_REJECT.h / ip6t_REJECT.h)
_IPT_REJECT = {0: "net-unreachable", 1: "host-unreachable", 2: "prot-unreachable", 3: "port-unreachable", 5: "net-prohibited", 6: "host-prohibited", 7: "tcp reset", 8: "admin-prohibited"}
_IP6T_REJECT = {0: "no-route", 1: "admin-prohibited", 3: "addr-unreachable", 4: "port-unreachable", 6: "tcp reset"}
# Expressions that neither stop a rule nor decide its verdict.
_NEUTRAL = frozenset({"counter", "log"})
_NEUTRAL_MATCHES = frozenset({"comment"})
# Statements that end the packet's walk with a verdict we do not model (NAT, queueing to user
# space, transparent proxying): a rule that reaches one makes the outcome unknown.
_TERMINAL = frozenset({"nat", "masq", "redir", "queue", "tproxy", "fwd", "synproxy"})
# iptables targets that only annotate the packet and let the next rule run.
_PASSING_TARGETS = frozenset({"LOG", "NFLOG", "MARK", "CONNMARK", "CT", "NOTRACK", "TRACE", "CLASSIFY", "TCPMSS", "DSCP", "TOS", "AUDIT"})


class Condition(Struct, frozen=True):
    """One test of a rule, on one field of the packet.

    ``op`` is ``==``/``!=``/``<``/``<=``/``>``/``>=`` against ``values[0]``, ``in``/``not in``
    (any of ``values``), or ``opaque`` (an expression we do not decode; ``values[0]`` names it).
    Values are text: numbers in decimal, ranges ``"lo-hi"``, interface names (``"eth*"`` a
    prefix), addresses ``"a.b.c.d/len"`` or ``"a-b"``. ``mask`` (decimal, 0 when none) is ANDed
    with the field first: ``ct state established,related`` is ``ct state & 6 != 0``.
    """

    field: str
    op: str
    values: tuple[str, ...]
    mask: int = 0

    def text(self) -> str:
        if self.op == "opaque":
            return f"<{self.values[0] if self.values else 'expression'}>"
        field = f"{self.field} & {self.mask:#x}" if self.mask else self.field
        shown = ", ".join(self.values)
        if self.op in ("in", "not in"):
            return f"{field} {'!= ' if self.op == 'not in' else ''}{{ {shown} }}"
        return f"{field} {self.op} {shown}"


class Rule(Struct, frozen=True):
    handle: int
    conditions: tuple[Condition, ...]
    verdict: str  # accept drop reject jump goto return continue, or "" (no verdict: next rule)
    target: str = ""  # the chain of a jump/goto
    reject_with: str = ""  # "tcp reset", "port-unreachable", "admin-prohibited"...

    def text(self) -> str:
        parts = [c.text() for c in self.conditions]
        if self.verdict:
            parts.append(self.verdict + (f" {self.target}" if self.target else "") + (f" with {self.reject_with}" if self.reject_with else ""))
        return " ".join(parts) or "(no expressions)"


class Chain(Struct, frozen=True):
    family: str  # inet ip ip6 netdev bridge arp
    table: str
    name: str
    hook: str  # "" for a regular chain; else input, prerouting, ingress...
    priority: int | None
    policy: str  # "accept" or "drop" for a base chain, "" otherwise
    chain_type: str  # filter, nat, route; "" for a regular chain
    rules: tuple[Rule, ...]
    devices: tuple[str, ...] = ()  # an ingress chain's devices (NFTA_HOOK_DEV/DEVS); it sees only their packets

    def label(self) -> str:
        return f"{self.family} {self.table} {self.name}"


class Ruleset(Struct, frozen=True):
    chains: tuple[Chain, ...]
    rule_count: int
    # (ifindex, name) of the namespace's interfaces when the rules were read (if_nameindex(3)):
    # the names iifname rules test, from the same namespace as the rules themselves.
    interfaces: tuple[tuple[int, str], ...] = ()


# -- attribute parsing -------------------------------------------------------------------------


def _attrs(data: bytes) -> Iterator[tuple[int, bytes]]:
    """(type, payload) of each netlink attribute in ``data``, flags masked off."""
    offset = 0
    while offset + 4 <= len(data):
        length, kind = struct.unpack_from("=HH", data, offset)
        if length < 4 or offset + length > len(data):
            raise ValueError(f"attribute of length {length} at offset {offset} overruns {len(data)} bytes")
        yield kind & _NLA_TYPE_MASK, data[offset + 4 : offset + length]
        offset += (length + 3) & ~3


def _table(data: bytes) -> dict[int, bytes]:
    return dict(_attrs(data))


def _u32(value: bytes | None) -> int | None:
    return None if value is None or len(value) < 4 else int(struct.unpack(">I", value[:4])[0])


def _s32(value: bytes | None) -> int | None:
    return None if value is None or len(value) < 4 else int(struct.unpack(">i", value[:4])[0])


def _str(value: bytes | None) -> str:
    return (value or b"").split(b"\0", 1)[0].decode("utf-8", "replace")


def _data_value(nested: bytes | None) -> bytes | None:
    """NFTA_DATA_VALUE inside a nested nft_data."""
    return None if nested is None else _table(nested).get(1)


# -- reading rules -----------------------------------------------------------------------------


class _Load(Struct, frozen=True):
    """What a register holds while a rule is decoded: a packet field, perhaps masked."""

    field: str
    length: int
    mask: int = 0


def _payload_field(base: int, offset: int, length: int, family: str) -> str | None:
    if base == 2 and (offset, length) == (2, 2):
        return "th dport"
    if base == 2 and (offset, length) == (0, 2):
        return "th sport"
    if base == 2 and (offset, length) == (13, 1):
        return "tcp flags"
    if base == 1 and family != "ip6" and (offset, length) == (9, 1):
        return "ip protocol"
    # nft loads only the bytes a prefix needs: "ip saddr 10.0.0.0/8" reads one byte at 12.
    if base == 1 and family != "ip6" and 1 <= length <= 4 and offset in (12, 16):
        return "ip saddr" if offset == 12 else "ip daddr"
    if base == 1 and family != "ip" and 1 <= length <= 16 and offset in (8, 24):
        return "ip6 saddr" if offset == 8 else "ip6 daddr"
    return None


_ADDRESS_FIELDS = {"ip saddr": 4, "ip daddr": 4, "ip6 saddr": 16, "ip6 daddr": 16}
# Fields the kernel keeps in host byte order in its registers (iif, ct state/status, marks).
#: ``fib saddr type`` and ``fib daddr type`` (nft_fib's NFT_FIB_RESULT_ADDRTYPE): the address's
#: RTN_* route type, stored as a host-order u32 (iptables-nft writes ``-m addrtype`` so).
FIB_SADDR_TYPE, FIB_DADDR_TYPE = "fib saddr type", "fib daddr type"
_HOST_ORDER = frozenset({"iif", "ct state", "ct status", "meta mark", "ct mark", FIB_SADDR_TYPE, FIB_DADDR_TYPE})


def _value_text(field: str, data: bytes, load_length: int) -> str:
    """One comparison operand as text (see :class:`Condition`)."""
    if field == "iifname":
        name, nul, _ = data.partition(b"\0")
        return name.decode("utf-8", "replace") + ("" if nul or len(data) >= 16 else "*")
    if field in _ADDRESS_FIELDS:
        return str(ipaddress.ip_address(data[: _ADDRESS_FIELDS[field]].ljust(_ADDRESS_FIELDS[field], b"\0")))
    if field in _HOST_ORDER:
        return str(int.from_bytes(data[:4].ljust(4, b"\0"), "little" if _host_little() else "big"))
    return str(int.from_bytes(data, "big"))


def _host_little() -> bool:
    import sys

    return sys.byteorder == "little"


def _whole(load: _Load) -> bool:
    """Whether the register holds the whole field (no mask, an address not cut to a prefix)."""
    return load.mask == 0 or (load.field in _ADDRESS_FIELDS and -load.mask == 8 * _ADDRESS_FIELDS[load.field])


def _prefix_len(mask: bytes) -> int | None:
    bits = bin(int.from_bytes(mask, "big"))[2:].zfill(len(mask) * 8)
    return None if "01" in bits else bits.count("1")


class _RuleDecoder:
    """Reduces one rule's expression list to conditions and a verdict."""

    def __init__(self, family: str, sets: dict[tuple[str, str, str], SetElements | str]) -> None:
        self.family = family
        self.sets = sets
        self.registers: dict[int, _Load] = {}
        self.conditions: list[Condition] = []
        self.verdict = ""
        self.target = ""
        self.reject_with = ""

    def opaque(self, what: str) -> None:
        self.conditions.append(Condition("", "opaque", (what,)))

    def expression(self, table_name: str, name: str, data: dict[int, bytes]) -> None:
        handler = getattr(self, f"_{name}", None)
        if name in _NEUTRAL:
            return
        if name in _TERMINAL:
            self.verdict, self.target = "opaque", name
            return
        if handler is None:
            self.opaque(name)
            return
        handler(table_name, data)

    def _load(self, register: int | None, load: _Load | None) -> None:
        if register is None:
            return
        if load is None:
            self.registers.pop(register, None)
        else:
            self.registers[register] = load

    def _meta(self, _table_name: str, data: dict[int, bytes]) -> None:
        key, dreg = _u32(data.get(2)), _u32(data.get(1))
        if dreg is None:  # a statement ("meta set mark ..."): marks may change later tests
            self.opaque("meta set")
            return
        field = _META_KEYS.get(key if key is not None else -1)
        self._load(dreg, _Load(field, 16 if field == "iifname" else 4) if field else None)

    def _ct(self, _table_name: str, data: dict[int, bytes]) -> None:
        key, dreg = _u32(data.get(2)), _u32(data.get(1))
        if dreg is None:
            self.opaque("ct set")
            return
        field = _CT_KEYS.get(key if key is not None else -1) if data.get(3) is None else None  # no direction-specific keys
        self._load(dreg, _Load(field, 4) if field else None)

    def _payload(self, _table_name: str, data: dict[int, bytes]) -> None:
        dreg = _u32(data.get(1))
        if dreg is None:
            self.opaque("payload set")
            return
        base, offset, length = (_u32(data.get(k)) for k in (2, 3, 4))
        field = _payload_field(base or 0, offset or 0, length or 0, self.family) if None not in (base, offset, length) else None
        # an address load carries its prefix length as a negative mask (see _compare)
        prefix = -(8 * (length or 0)) if field in _ADDRESS_FIELDS else 0
        self._load(dreg, _Load(field, length or 0, prefix) if field else None)

    def _fib(self, _table_name: str, data: dict[int, bytes]) -> None:
        """``fib saddr|daddr [. iif] type``: the address type (NFTA_FIB_RESULT 3); other results
        (the output interface) depend on routes, left undecoded. Flags: NFTA_FIB_F_SADDR 1,
        NFTA_FIB_F_DADDR 2, NFTA_FIB_F_MARK 4, NFTA_FIB_F_IIF 8 (nf_tables.h)."""
        dreg, result, flags = _u32(data.get(1)), _u32(data.get(2)), _u32(data.get(3)) or 0
        field = None
        if result == 3 and not flags & 0x4:
            field = FIB_SADDR_TYPE if flags & 0x1 else FIB_DADDR_TYPE if flags & 0x2 else None
        self._load(dreg, _Load(field, 4) if field else None)

    def _exthdr(self, _table_name: str, data: dict[int, bytes]) -> None:
        """An IPv6 extension header (NFT_EXTHDR_OP_IPV6, the default): loading a field of one the
        packet lacks ends the rule (NFT_BREAK), and with NFT_EXTHDR_F_PRESENT it loads whether the
        header is there. TCP options and the rest are left undecoded."""
        dreg, kind, flags, op = _u32(data.get(1)), data.get(2, b"\xff")[:1], _u32(data.get(5)) or 0, _u32(data.get(6)) or 0
        if dreg is None or op != 0 or self.family not in ("ip6", "inet"):
            self.opaque("exthdr")
            return
        field = f"{IP6_EXTHDR} {kind[0]}"
        if flags & 0x1:
            self._load(dreg, _Load(field, 1))
        else:
            self.conditions.append(Condition(field, "!=", ("0",)))  # the header must be there to load from it
            self._load(dreg, None)

    def _bitwise(self, _table_name: str, data: dict[int, bytes]) -> None:
        sreg, dreg, op = _u32(data.get(1)), _u32(data.get(2)), _u32(data.get(6)) or 0
        mask, xor = _data_value(data.get(4)), _data_value(data.get(5))
        source = self.registers.get(sreg) if sreg is not None else None
        if source is None or op != 0 or mask is None or xor is None or any(xor):
            self._load(dreg, None)
            return
        if source.field in _ADDRESS_FIELDS:
            prefix = _prefix_len(mask)
            self._load(dreg, _Load(source.field, source.length, -prefix) if prefix is not None and prefix <= -source.mask else None)
            return
        if source.mask:
            self._load(dreg, None)
            return
        if source.field in _HOST_ORDER:
            bits = int.from_bytes(mask[:4].ljust(4, b"\0"), "little" if _host_little() else "big")
        else:
            bits = int.from_bytes(mask, "big")
        self._load(dreg, _Load(source.field, source.length, bits))

    def _compare(self, register: int | None, op: str, operands: tuple[bytes, ...]) -> None:
        load = self.registers.get(register) if register is not None else None
        if load is None:
            self.opaque("cmp on an undecoded field")
            return
        if load.mask < 0:  # an address prefix: cmp eq 10.0.0.0 after a /8 mask, or on 1 byte
            prefix, size = -load.mask, _ADDRESS_FIELDS[load.field]
            values = tuple(f"{ipaddress.ip_address(v[:size].ljust(size, bytes(1)))}/{prefix}" for v in operands)
            self.conditions.append(Condition(load.field, op, values))
            return
        values = tuple(_value_text(load.field, v, load.length) for v in operands)
        self.conditions.append(Condition(load.field, op, values, load.mask))

    def _cmp(self, _table_name: str, data: dict[int, bytes]) -> None:
        op = _CMP_OPS.get(_u32(data.get(2)) or 0, "==")
        value = _data_value(data.get(3))
        if value is None:
            self.opaque("cmp")
            return
        self._compare(_u32(data.get(1)), op, (value,))

    def _range(self, _table_name: str, data: dict[int, bytes]) -> None:
        low, high = _data_value(data.get(3)), _data_value(data.get(4))
        load = self.registers.get(_u32(data.get(1)) or -1)
        if low is None or high is None or load is None or not _whole(load) or load.field in ("iifname",):
            self.opaque("range")
            return
        op = "not in" if _u32(data.get(2)) == 1 else "in"
        self.conditions.append(Condition(load.field, op, (f"{_value_text(load.field, low, load.length)}-{_value_text(load.field, high, load.length)}",)))

    def _lookup(self, table_name: str, data: dict[int, bytes]) -> None:
        set_name = _str(data.get(1))
        load = self.registers.get(_u32(data.get(2)) or -1)
        if data.get(3) is not None:  # a map (vmap / dreg): the verdict comes from the elements
            self.opaque(f"map @{set_name}")
            return
        elements = self.sets.get((self.family, table_name, set_name))
        if load is None or not _whole(load) or elements is None or isinstance(elements, str):
            self.opaque(f"lookup @{set_name}" + (f" ({elements})" if isinstance(elements, str) else ""))
            return
        inverted = bool((_u32(data.get(5)) or 0) & 1)
        if load.field in _HOST_ORDER and any(first != last for first, last in elements):
            self.opaque(f"lookup @{set_name} (ranges of a host-order field)")
            return
        values = []
        for first, last in elements:
            low, high = _value_text(load.field, first, load.length), _value_text(load.field, last, load.length)
            values.append(low if low == high else f"{low}-{high}")
        self.conditions.append(Condition(load.field, "not in" if inverted else "in", tuple(values)))

    def _immediate(self, _table_name: str, data: dict[int, bytes]) -> None:
        if _u32(data.get(1)) != 0:  # loads a value into a data register: used by later statements
            self._load(_u32(data.get(1)), None)
            return
        verdict_attrs = _table(_table(data.get(2, b"")).get(2, b""))
        code = _s32(verdict_attrs.get(1))
        verdict = _VERDICTS.get(code if code is not None else 99)
        if verdict is None:
            self.opaque(f"verdict {code}")
            return
        self.verdict = "" if verdict == "continue" else verdict
        self.target = _str(verdict_attrs.get(2))

    def _reject(self, _table_name: str, data: dict[int, bytes]) -> None:
        kind = _u32(data.get(1))
        code = data.get(2, b"\0")[0] if data.get(2) else 0
        if kind == 1:
            self.reject_with = "tcp reset"
        elif kind == 2:
            self.reject_with = _ICMPX.get(code, f"icmpx code {code}")
        else:
            table = _ICMP6 if self.family == "ip6" else _ICMP4
            self.reject_with = table.get(code, f"icmp code {code}")
        self.verdict = "reject"

    def _match(self, _table_name: str, data: dict[int, bytes]) -> None:
        """An iptables match that iptables-nft could not express in nf_tables expressions; the
        common ones (connection state, port lists) are read from their xt info structs."""
        name, revision, info = _str(data.get(1)), _u32(data.get(2)) or 0, data.get(3, b"")
        if name in _NEUTRAL_MATCHES:
            return
        condition = None
        if name == "conntrack":
            condition = xt_conntrack_condition(revision, info)
        elif name == "state":
            condition = xt_state_condition(info)
        elif name == "multiport":
            condition = xt_multiport_condition(revision, info)
        elif name == "addrtype":
            tests = xt_addrtype_conditions(revision, info)
            if tests is not None:
                self.conditions.extend(tests)
                return
        elif name == "rt":
            # ip6t_rt matches only a packet with a routing header (ipv6_find_hdr), whatever the
            # rule inverts; a SYN to a listener carries none (ufw6's before-input rules use it).
            condition = Condition(RT_HEADER, "!=", ("0",))
        if condition is None:
            self.opaque(f"xt match {name}")
        else:
            self.conditions.append(condition)

    def _target(self, _table_name: str, data: dict[int, bytes]) -> None:
        name, info = _str(data.get(1)), data.get(3, b"")
        if name == "REJECT" and len(info) >= 4:
            (with_,) = struct.unpack("=I", info[:4])
            table = _IP6T_REJECT if self.family == "ip6" else _IPT_REJECT
            self.reject_with = table.get(with_, f"REJECT {with_}")
            self.verdict = "reject"
        elif name not in _PASSING_TARGETS:
            self.verdict, self.target = "opaque", f"xt target {name}"


# xt_conntrack_mtinfo{1,2,3} (include/uapi/linux/netfilter/xt_conntrack.h): eight 16-byte
# addresses, two u32, five u16, then match_flags and invert_flags (u16) at 146 and 148 and the
# state mask at 150 (u8 in revision 1, u16 from revision 2). Host byte order.
_XT_CONNTRACK_STATE = 1 << 0
_XT_CONNTRACK_STATE_ALIAS = 1 << 13


def xt_conntrack_condition(revision: int, info: bytes) -> Condition | None:
    """``-m conntrack --ctstate ...`` alone as a ct state test; None for anything else."""
    if revision not in (1, 2, 3) or len(info) < 152:
        return None
    flags, invert = struct.unpack_from("=HH", info, 146)
    if flags & ~(_XT_CONNTRACK_STATE | _XT_CONNTRACK_STATE_ALIAS) or not flags & _XT_CONNTRACK_STATE:
        return None  # other conntrack criteria (addresses, ports, status, expiry) are not decoded
    mask = info[150] if revision == 1 else struct.unpack_from("=H", info, 150)[0]
    return Condition("ct state", "==" if invert & _XT_CONNTRACK_STATE else "!=", ("0",), mask)


#: Fields the xt matches below test: the route type of the packet's source and destination address
#: as a bit (1 << RTN_* of include/uapi/linux/rtnetlink.h, as xt_addrtype.h's masks), and whether
#: it carries an IPv6 routing header (1) or not (0).
ADDRTYPE_SOURCE, ADDRTYPE_DEST = "addrtype src", "addrtype dst"
IP6_EXTHDR = "ip6 exthdr"  # followed by the header's next-header number: "ip6 exthdr 43", the routing header
RT_HEADER = f"{IP6_EXTHDR} 43"
_XT_ADDRTYPE_INVERT_SOURCE, _XT_ADDRTYPE_INVERT_DEST = 0x1, 0x2  # --limit-iface-in/out (0x4, 0x8) change nothing for a SYN to a local address


def xt_addrtype_conditions(revision: int, info: bytes) -> list[Condition] | None:
    """``-m addrtype --src-type/--dst-type`` as bit tests of the address types: struct
    xt_addrtype_info (revision 0: u16 source and dest masks, u32 invert flags for each) or
    xt_addrtype_info_v1 (u16 masks, u32 flags with the inversions and --limit-iface-in/out);
    a zero mask tests nothing (xt_addrtype.c). None for a layout not known."""
    if revision == 0 and len(info) >= 12:
        source, dest, invert_source, invert_dest = struct.unpack_from("=HHII", info)
    elif revision == 1 and len(info) >= 8:
        source, dest, flags = struct.unpack_from("=HHI", info)
        invert_source, invert_dest = flags & _XT_ADDRTYPE_INVERT_SOURCE, flags & _XT_ADDRTYPE_INVERT_DEST
    else:
        return None
    tests = []
    for field, mask, inverted in ((ADDRTYPE_SOURCE, source, invert_source), (ADDRTYPE_DEST, dest, invert_dest)):
        if mask:
            tests.append(Condition(field, "==" if inverted else "!=", ("0",), mask))
    return tests


def xt_state_condition(info: bytes) -> Condition | None:
    """``-m state --state ...``: struct xt_state_info { unsigned int statemask; }."""
    if len(info) < 4:
        return None
    (mask,) = struct.unpack_from("=I", info)
    return Condition("ct state", "!=", ("0",), mask)


def xt_multiport_condition(revision: int, info: bytes) -> Condition | None:
    """``-m multiport --dports ...`` (struct xt_multiport / xt_multiport_v1: flags, count, 15
    host-order ports, then in revision 1 a range flag per port and an invert byte)."""
    if revision not in (0, 1) or len(info) < (48 if revision else 32):
        return None
    flags, count = info[0], info[1]
    if flags != 1 or count > 15:  # source or either-direction ports depend on the peer
        return None
    ports = struct.unpack_from("=15H", info, 2)
    ranges = info[32:47] if revision else bytes(15)
    values, index = [], 0
    while index < count:
        if ranges[index] and index + 1 < count:
            values.append(f"{ports[index]}-{ports[index + 1]}")
            index += 2
        else:
            values.append(str(ports[index]))
            index += 1
    inverted = bool(revision and info[47])
    return Condition("th dport", "not in" if inverted else "in", tuple(values))


def decode_rule(family: str, attrs: dict[int, bytes], sets: dict[tuple[str, str, str], SetElements | str]) -> Rule:
    """One ``NFT_MSG_NEWRULE`` message's attributes as a :class:`Rule`."""
    table_name = _str(attrs.get(1))
    decoder = _RuleDecoder(family, sets)
    for kind, element in _attrs(attrs.get(4, b"")):
        if kind != 1:  # NFTA_LIST_ELEM
            continue
        expr = _table(element)
        decoder.expression(table_name, _str(expr.get(1)), _table(expr.get(2, b"")))
    handle = attrs.get(3)
    return Rule(
        handle=int.from_bytes(handle, "big") if handle else 0,
        conditions=tuple(decoder.conditions),
        verdict=decoder.verdict,
        target=decoder.target,
        reject_with=decoder.reject_with,
    )


# -- sets ---------------------------------------------------------------------------------------


class SetInfo(Struct, frozen=True):
    family: str
    table: str
    name: str
    flags: int
    key_len: int


#: A set's keys as inclusive (first, last) pairs of raw key bytes, as the kernel sent them.
SetElements = tuple[tuple[bytes, bytes], ...]


def set_intervals(elements: list[tuple[bytes, int]], flags: int, key_len: int) -> SetElements | str:
    """Element keys as inclusive (first, last) key pairs; a reason (str) when we cannot use them.
    Interval sets come as start elements and end markers (``NFT_SET_ELEM_INTERVAL_END``), the end
    exclusive, in any order."""
    if flags & 0x80 or flags & 0x08:  # concatenations and maps
        return "concatenated or map set"
    if key_len not in (1, 2, 4, 16):
        return f"key of {key_len} bytes"
    if not flags & 0x04:  # plain set: each key one value
        return tuple((key, key) for key, _ in elements)
    pairs = []
    ordered = sorted(elements, key=lambda item: (int.from_bytes(item[0], "big"), item[1] & 1))
    start: int | None = None
    for key, elem_flags in ordered:
        number = int.from_bytes(key, "big")
        if elem_flags & 1:
            if start is not None and number > start:
                pairs.append((start, number - 1))
            start = None
        else:
            if start is not None:
                return "interval set without end markers"
            start = number
    if start is not None:
        pairs.append((start, (1 << (8 * key_len)) - 1))
    return tuple((a.to_bytes(key_len, "big"), b.to_bytes(key_len, "big")) for a, b in pairs)


# -- the live dump ------------------------------------------------------------------------------


def _request(message_type: int, sequence: int, family: int = 0, attrs: bytes = b"", dump: bool = True) -> bytes:
    body = struct.pack("=BBH", family, 0, 0) + attrs
    flags = _NLM_F_REQUEST | (_NLM_F_DUMP if dump else 0)
    return struct.pack("=IHHII", 16 + len(body), (_NFNL_SUBSYS_NFTABLES << 8) | message_type, flags, sequence, 0) + body


def _attr(kind: int, payload: bytes) -> bytes:
    raw = struct.pack("=HH", 4 + len(payload), kind) + payload
    return raw + b"\0" * ((4 - len(raw) % 4) % 4)


def _describe_errno(code: int) -> str:
    name = errno_codes.errorcode.get(code, str(code))
    reason = f"{os.strerror(code).lower()} ({name})"
    if code == errno_codes.EPERM:
        reason += "; reading nftables rules needs CAP_NET_ADMIN (run as root)"
    elif code in (errno_codes.EOPNOTSUPP, errno_codes.EPROTONOSUPPORT, errno_codes.ENOENT):
        reason += "; the kernel has no nf_tables (module not available)"
    return reason


def _dump(sock: socket.socket, message_type: int, sequence: int, deadline: float, family: int = 0, attrs: bytes = b"") -> list[tuple[int, dict[int, bytes]]]:
    """Every message of one dump as (nfgen family, attributes)."""
    from preflight.sources.nlmsg import dump_messages

    sock.send(_request(message_type, sequence, family, attrs))
    found: list[tuple[int, dict[int, bytes]]] = []
    for _kind, payload in dump_messages(sock, sequence, deadline, SOURCE, MAX_DUMP_BYTES, _describe_errno):
        if len(payload) < 4:
            continue
        try:
            found.append((payload[0], _table(payload[4:])))
        except ValueError as error:
            raise SourceError(SOURCE, f"undecodable message: {error}") from None
    return found


def read_ruleset() -> Ruleset:
    """The nftables ruleset of the caller's network namespace; SourceError when it cannot be read."""
    import socket

    deadline = time.monotonic() + DUMP_TIMEOUT_S
    try:
        sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, _NETLINK_NETFILTER)
    except OSError as error:
        raise SourceError(SOURCE, _describe_errno(error.errno or errno_codes.EIO)) from None
    with sock:
        try:
            sock.bind((0, 0))
            chains = _dump(sock, _NFT_MSG_GETCHAIN, 1, deadline)
            rules = _dump(sock, _NFT_MSG_GETRULE, 2, deadline)
            if len(rules) > MAX_RULES:
                raise SourceError(SOURCE, f"{len(rules)} rules, more than the {MAX_RULES} read")
            sets = _read_sets(sock, rules, deadline)
            interfaces = tuple(sorted(socket.if_nameindex()))
        except OSError as error:
            raise SourceError(SOURCE, _describe_errno(error.errno or errno_codes.EIO)) from None
    return replace(assemble(chains, rules, sets), interfaces=interfaces)


def _looked_up(rules: list[tuple[int, dict[int, bytes]]]) -> set[tuple[int, str, str]]:
    """(family, table, set) of every set a rule looks up."""
    wanted = set()
    for family, attrs in rules:
        for kind, element in _attrs(attrs.get(4, b"")):
            expr = _table(element) if kind == 1 else {}
            if _str(expr.get(1)) == "lookup":
                wanted.add((family, _str(attrs.get(1)), _str(_table(expr.get(2, b"")).get(1))))
    return wanted


def _read_sets(sock: socket.socket, rules: list[tuple[int, dict[int, bytes]]], deadline: float) -> dict[tuple[str, str, str], SetElements | str]:
    wanted = _looked_up(rules)
    if not wanted:
        return {}
    infos = {}
    for family, attrs in _dump(sock, _NFT_MSG_GETSET, 3, deadline):
        key = (family, _str(attrs.get(1)), _str(attrs.get(2)))
        if key in wanted:
            infos[key] = (_u32(attrs.get(3)) or 0, _u32(attrs.get(5)) or 0)
    found: dict[tuple[str, str, str], SetElements | str] = {}
    for sequence, ((family, table_name, set_name), (flags, key_len)) in enumerate(sorted(infos.items()), start=10):
        request = _attr(1, table_name.encode() + b"\0") + _attr(2, set_name.encode() + b"\0")
        elements: list[tuple[bytes, int]] = []
        for _family, attrs in _dump(sock, _NFT_MSG_GETSETELEM, sequence, deadline, family, request):
            for kind, element in _attrs(attrs.get(3, b"")):
                item = _table(element) if kind == 1 else {}
                element_key = _data_value(item.get(1))
                if element_key is not None:
                    elements.append((element_key, _u32(item.get(3)) or 0))
        label = (FAMILIES.get(family, str(family)), table_name, set_name)
        found[label] = f"more than {MAX_SET_ELEMENTS} elements" if len(elements) > MAX_SET_ELEMENTS else set_intervals(elements, flags, key_len)
    return found


def _hook_devices(hook_attrs: dict[int, bytes]) -> tuple[str, ...]:
    """NFTA_HOOK_DEV (one name) or NFTA_HOOK_DEVS (a list of NFTA_DEVICE_NAME)."""
    if 3 in hook_attrs:
        return (_str(hook_attrs[3]),)
    return tuple(_str(value) for _kind, value in _attrs(hook_attrs.get(4, b"")))


def assemble(chains: list[tuple[int, dict[int, bytes]]], rules: list[tuple[int, dict[int, bytes]]], sets: dict[tuple[str, str, str], SetElements | str]) -> Ruleset:
    """Chains with their rules, in the kernel's order (rules come in chain order already)."""
    by_chain: dict[tuple[str, str, str], list[Rule]] = {}
    for family_number, attrs in rules:
        family = FAMILIES.get(family_number, str(family_number))
        key = (family, _str(attrs.get(1)), _str(attrs.get(2)))
        by_chain.setdefault(key, []).append(decode_rule(family, attrs, sets))
    result = []
    for family_number, attrs in chains:
        family = FAMILIES.get(family_number, str(family_number))
        table_name, name = _str(attrs.get(1)), _str(attrs.get(3))
        hook_attrs = _table(attrs[4]) if 4 in attrs else {}
        hook_number = _u32(hook_attrs.get(1))
        hook = "" if hook_number is None else (
            ("ingress" if hook_number == 0 else "egress") if family == "netdev" else INET_HOOKS.get(hook_number, str(hook_number))
        )
        policy = _u32(attrs.get(5))
        result.append(Chain(
            family=family,
            table=table_name,
            name=name,
            hook=hook,
            priority=_s32(hook_attrs.get(2)),
            policy=("" if not hook else "drop" if policy == 0 else "accept"),
            chain_type=_str(attrs.get(7)),
            rules=tuple(by_chain.get((family, table_name, name), ())),
            devices=_hook_devices(hook_attrs),
        ))
    return Ruleset(tuple(result), sum(len(r) for r in by_chain.values()))
