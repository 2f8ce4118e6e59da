"""``preflight snapshot --scrub``: replace identifiers in a recorded root with placeholders that
keep every relation the checks rely on.

Categories (``--scrub all`` is every one):

* ``addresses``: IPv4 and IPv6 addresses, as text, in RoCE GIDs (an IPv4-mapped GID carries the
  interface's IPv4 address) and in the hex forms of ``/proc/net/{route,tcp,tcp6,udp,udp6,raw,
  raw6,if_inet6,ipv6_route}``. The mapping is *prefix-preserving* (Crypto-PAn: bit ``i`` of the
  output is bit ``i`` of the input flipped by a keyed function of the bits before it), so two
  addresses that share ``n`` leading bits still share exactly ``n``: subnets, same-subnet rails and
  route lookups keep their meaning. Special blocks keep their prefix so that their class survives
  (``10/8``, ``172.16/12``, ``192.168/16``, ``100.64/10``, ``169.254/16``, ``fe80::/64``,
  ``fc00::/7``...); loopback, unspecified, multicast and ``240/4`` (netmasks) are kept as they are.
  Public IPv4 addresses keep their first octet. A network address (``10.1.0.0/16``) stays one.
* ``guids``: node and system-image GUIDs (``0c42:a103:0014:e35a``) and GIDs; the interface-ID half
  of an IPv6 address/GID and a GUID use one function (IB GIDs embed the port GUID). The first 24
  bits (the vendor's OUI) are kept.
* ``macs``: Ethernet MACs (OUI kept, multicast/broadcast kept) and 20-byte IPoIB hardware
  addresses (QPN kept, the GID part mapped as above).
* ``serials``: UUIDs (GPU UUIDs, boot and product UUIDs), serial-number files (``serial``,
  ``*_serial``, ``/etc/machine-id``), NVML ``*Serial*`` answers, ``Serial Number:`` lines, the
  ``SN`` field of PCI VPD (checksum fixed) and the PCIe Device Serial Number capability in config
  space. Replacements keep length and character classes.
* ``hostnames``: names collected from the hostname, ``/etc/hosts``, ``resolv.conf``, the job
  environment (``SLURM_*NODELIST``, ``MASTER_ADDR``...), Slurm's config, the site config and DNS
  answers are replaced label by label, in ``/etc``, the hostname files, the job environment,
  ``dns.json`` and the manifest (not in sysfs, where ``node0`` is a NUMA node). A trailing number
  is kept (``gpu017`` -> ``hqxmvzra017``), so hostlists such as ``gpu[001-064]`` in the node list,
  Slurm's config and ``[[hosts]] match`` keep matching the same nodes.

* ``users``: account names, learned from the recorded job environments (``USER``, ``LOGNAME``,
  ``SLURM_JOB_USER``, ``SUDO_USER``, and the directory after ``/home/`` in ``HOME``,
  ``VIRTUAL_ENV``, ``CONDA_PREFIX`` and recorded paths), are replaced as whole words in ``/etc``,
  the job environments and preflight's recordings, and as path components everywhere (so a
  virtualenv recorded under ``/home/alice/`` is still found at its new place). Service accounts
  (``root``, ``slurm``, ``nobody``...) are kept: they name no person.

Placeholders come from HMAC-SHA256 under a key: the same key gives the same placeholder for the
same value on every node, so snapshots of several nodes stay comparable (the key stays with the
operator; without it a placeholder cannot be reversed by guessing names or addresses, which an
unkeyed hash would allow). Without ``--scrub-key`` a random key is used: consistent within one
snapshot only. A counter ("host-1, host-2" in order of appearance) was rejected because the order
differs from node to node. The manifest records the categories and a key fingerprint, never the key.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import re
import secrets
import struct
from collections.abc import Callable, Iterable
from typing import Any

from msgspec.structs import replace

from preflight.hostlist import split_top_level
from preflight.sources.archive import Member
from preflight.sources.netlink import FIREWALL_FILE

CATEGORIES = ("hostnames", "addresses", "guids", "macs", "serials", "users")

_HEX = "[0-9A-Fa-f]"
_TOKENS = re.compile(
    rf"(?P<ipoib>(?<![0-9A-Fa-f:]){_HEX}{{2}}(?::{_HEX}{{2}}){{19}}(?![0-9A-Fa-f:]))"
    rf"|(?P<gid>(?<![0-9A-Fa-f:]){_HEX}{{4}}(?::{_HEX}{{4}}){{7}}(?![0-9A-Fa-f:]))"
    rf"|(?P<uuid>(?<![0-9A-Fa-f]){_HEX}{{8}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{12}}(?![0-9A-Fa-f]))"
    rf"|(?P<mac>(?<![0-9A-Fa-f:]){_HEX}{{2}}(?::{_HEX}{{2}}){{5}}(?![0-9A-Fa-f:]))"
    rf"|(?P<guid>(?<![0-9A-Fa-f:]){_HEX}{{4}}(?::{_HEX}{{4}}){{3}}(?![0-9A-Fa-f:]))"
    # an address may end a sentence ("... from 10.10.1.17."): a full stop counts as part of the
    # token only when a digit follows it (an OID, a longer version number)
    rf"|(?P<ipv6>(?<![0-9A-Za-z:.])(?:{_HEX}{{0,4}}:){{2,7}}(?:{_HEX}{{1,4}}|(?:\d{{1,3}}\.){{3}}\d{{1,3}})?(?![0-9A-Za-z:]|\.\w)(?:/(?P<plen6>\d{{1,3}})(?!\d))?)"
    rf"|(?P<ipv4>(?<![\w.-])(?:\d{{1,3}}\.){{3}}\d{{1,3}}(?!\w|\.\d|-\d)(?:/(?P<plen4>\d{{1,2}})(?!\d))?)"
)
# An IPv4 range as nftables rules write it ("10.10.1.17-10.10.1.30"): _TOKENS leaves an address
# next to a hyphen alone (package versions such as "MLNX_OFED_LINUX-5.8-1.1.2.1"), so a range's
# two ends are found here.
_IPV4_RANGE = re.compile(r"(?<![\w.-])((?:\d{1,3}\.){3}\d{1,3})-((?:\d{1,3}\.){3}\d{1,3})(?![\w.-])")
#: CIDR blocks one range of a firewall recording may become (any IPv4 range needs at most 62).
MAX_RANGE_BLOCKS = 256
_LABEL = re.compile(r"(?<![\w-])[A-Za-z0-9_][A-Za-z0-9_-]*")
_SERIAL_LINE = re.compile(
    r"(?im)^(?P<key>[ \t]*(?:[a-z]+[ \t_-])*serial(?:[ \t_-]?(?:number|num|no))?[ \t]*[:=][ \t]*)(?P<value>\S.*?)[ \t]*$"
)
_PROC_NET = re.compile(r"^proc/(?:[^/]+/)?net/(?P<name>route|tcp6?|udp6?|raw6?|if_inet6|ipv6_route)$")
_SERIAL_FILE = re.compile(r"(?:^|/)(?:[\w-]*_serial|serial|serial_number)$|^etc/machine-id$")
_HOSTNAME_SCOPE = re.compile(
    r"^(?:etc/|proc/sys/kernel/(?:hostname|domainname)$|proc/[^/]+/(?:environ|cmdline)$|proc/cmdline$"
    r"|\.preflight/(?:(?:dns|snapshot|nvml|netlink|firewall)\.json|kmsg)$|(?:home/[^/]+|root)/\.nccl\.conf$)"
)
_SLURM_HOSTS = re.compile(r"(?i)\b(?:NodeName|NodeHostname|NodeAddr|Nodes|SlurmctldHost|ControlMachine|BackupController)=(\S+)")
_HOST_VARIABLES = (
    "MASTER_ADDR", "SLURMD_NODENAME", "SLURM_SUBMIT_HOST", "SLURM_CLUSTER_NAME", "HOSTNAME", "NCCL_COMM_ID", "SLURM_SRUN_COMM_HOST",
)
_USER_VARIABLES = ("USER", "LOGNAME", "USERNAME", "SLURM_JOB_USER", "SUDO_USER")
_HOME_VARIABLES = ("HOME", "VIRTUAL_ENV", "CONDA_PREFIX", "PWD", "SLURM_SUBMIT_DIR")
_HOME_DIR = re.compile(r"(?:^|/)home/(?P<name>[^/\0\s:]+)")
_ACCOUNT = re.compile(r"[a-z_][a-z0-9_.-]{0,31}", re.IGNORECASE)
# Where account names are replaced inside files: configuration, job environments, recordings.
_USER_SCOPE = re.compile(r"^(?:etc/|proc/[^/]+/environ$|\.preflight/|(?:home/[^/]+|root)/\.nccl\.conf$)")
# Accounts that name a service, not a person: kept so that the snapshot still reads naturally.
_SERVICE_ACCOUNTS = frozenset({
    "root", "nobody", "daemon", "bin", "sys", "sync", "adm", "admin", "slurm", "munge", "nvidia",
    "nvidia-persistenced", "systemd-network", "systemd-resolve", "messagebus", "sshd", "www-data",
    "ubuntu", "debian", "ec2-user", "centos", "rocky", "cloud-user", "user", "shared", "local", "opt",
})
# Labels that name no site: kept so that localhost entries and public suffixes read the same.
_KEPT_LABELS = frozenset({
    "localhost", "localdomain", "local", "lan", "home", "internal", "arpa", "in-addr", "ip6", "com", "net", "org",
    "edu", "gov", "io", "ip6-localhost", "ip6-loopback", "ip6-localnet", "ip6-allnodes", "ip6-allrouters",
    "ip6-mcastprefix", "ip6-allhosts", "broadcasthost",
})
# (network, prefix length, bits kept): the first block containing an address decides. 32 keeps it whole.
_V4_BLOCKS = tuple(
    (int(ipaddress.IPv4Address(net)), plen, keep)
    for net, plen, keep in (
        ("0.0.0.0", 8, 32), ("127.0.0.0", 8, 32), ("224.0.0.0", 4, 32), ("240.0.0.0", 4, 32),
        ("169.254.0.0", 16, 16), ("10.0.0.0", 8, 8), ("172.16.0.0", 12, 12), ("192.168.0.0", 16, 16),
        ("100.64.0.0", 10, 10), ("198.18.0.0", 15, 15), ("192.0.2.0", 24, 24), ("198.51.100.0", 24, 24),
        ("203.0.113.0", 24, 24),
    )
)
_OUI_BITS = 24


class ScrubError(Exception):
    """Bad ``--scrub`` options; the message is shown to the user as is."""


def parse_categories(tokens: Iterable[str]) -> frozenset[str]:
    """``("hostnames", "macs")`` or ``("all",)`` -> the categories; ScrubError for unknown ones."""
    chosen: set[str] = set()
    for token in tokens:
        name = token.strip().lower()
        if name == "all":
            chosen.update(CATEGORIES)
        elif name in CATEGORIES:
            chosen.add(name)
        elif name:
            raise ScrubError(f"--scrub {token!r}: choose from {', '.join(CATEGORIES)} or all")
    return frozenset(chosen)


class Scrubber:
    """One consistent mapping for one snapshot (see the module docstring)."""

    def __init__(self, categories: frozenset[str], key: str | None = None) -> None:
        if key is not None and not key:
            raise ScrubError("--scrub-key must not be empty")
        self.categories = categories
        self.key_given = key is not None
        self._key = key.encode("utf-8") if key is not None else secrets.token_bytes(32)
        self._bits: dict[tuple[bytes, int, int], int] = {}
        self._memo: dict[tuple[str, str], str] = {}
        self.host_labels: set[str] = set()  # whole labels known to name hosts or domains
        self.host_prefixes: set[str] = set()  # alphabetic stems of numbered host names ("gpu")
        self.user_names: set[str] = set()  # account names to replace (see learn_users)
        self._user_pattern: re.Pattern[str] | None = None

    # -- keyed functions --------------------------------------------------------------------------
    def _digest(self, *parts: bytes) -> bytes:
        return hmac.new(self._key, b"\0".join(parts), hashlib.sha256).digest()

    def key_id(self) -> str:
        """A fingerprint that tells whether two snapshots used the same key, revealing nothing."""
        return self._digest(b"preflight-scrub-key-id").hex()[:12]

    def _preserving(self, family: bytes, value: int, bits: int, keep: int) -> int:
        """Crypto-PAn style prefix-preserving permutation of ``bits``-bit ``value``, first
        ``keep`` bits unchanged."""
        out = value
        for position in range(keep, bits):
            prefix = value >> (bits - position)
            memo_key = (family, position, prefix)
            flip = self._bits.get(memo_key)
            if flip is None:
                flip = self._digest(family, str(position).encode(), str(prefix).encode())[0] & 1
                self._bits[memo_key] = flip
            if flip:
                out ^= 1 << (bits - 1 - position)
        return out

    def _stream(self, kind: str, value: str, length: int) -> bytes:
        data = b""
        counter = 0
        while len(data) < length:
            data += self._digest(kind.encode(), value.encode("utf-8", "surrogateescape"), str(counter).encode())
            counter += 1
        return data[:length]

    # -- addresses ---------------------------------------------------------------------------------
    def map_ipv4(self, value: int) -> int:
        keep = 8
        for network, plen, kept in _V4_BLOCKS:
            if value >> (32 - plen) == network >> (32 - plen):
                keep = kept
                break
        return value if keep >= 32 else self._preserving(b"v4", value, 32, keep)

    def map_interface_id(self, value: int) -> int:
        """The low 64 bits of an IPv6 address or GID, and a GUID."""
        return self._preserving(b"iid", value, 64, _OUI_BITS)

    def map_ipv6(self, value: int) -> int:
        high, low = value >> 64, value & (2**64 - 1)
        if value in (0, 1) or high >> 56 == 0xFF:  # unspecified, loopback, multicast
            return value
        if value >> 32 == 0xFFFF or value >> 32 == 0x0064FF9B << 64:  # IPv4-mapped, NAT64
            return (value >> 32 << 32) | self.map_ipv4(value & 0xFFFFFFFF)
        if high >> 54 == 0x3FA:  # fe80::/10 link-local: the prefix half is not site-specific
            return (high << 64) | self.map_interface_id(low)
        if high >> 57 == 0x7E:  # fc00::/7 unique local
            keep = 8
        elif high >> 32 == 0x20010DB8:  # documentation
            keep = 32
        else:
            keep = 16
        return (self._preserving(b"v6", high, 64, keep) << 64) | self.map_interface_id(low)

    def _addresses(self) -> bool:
        return "addresses" in self.categories

    # -- text ----------------------------------------------------------------------------------------
    def scrub_text(self, text: str, hostnames: bool = False) -> str:
        """Every identifier of the chosen categories in ``text`` replaced."""
        if self._addresses():
            text = _IPV4_RANGE.sub(self._ipv4_range, text)
        text = _TOKENS.sub(self._token, text)
        if hostnames and "hostnames" in self.categories and (self.host_labels or self.host_prefixes):
            text = _LABEL.sub(self._label_match, text)
        if "serials" in self.categories:
            text = _SERIAL_LINE.sub(lambda m: m.group("key") + self.map_serial(m.group("value")), text)
        return text

    def _token(self, match: re.Match[str]) -> str:
        kind = match.lastgroup
        token = match.group(0)
        if kind == "ipoib" and "macs" in self.categories:
            octets = token.split(":")
            gid = self.map_ipv6(int("".join(octets[4:]), 16))
            tail = f"{gid:032x}"
            return ":".join([*octets[:4], *(tail[i:i + 2] for i in range(0, 32, 2))])
        if kind == "gid" and self.categories & {"addresses", "guids"}:
            mapped = f"{self.map_ipv6(int(token.replace(':', ''), 16)):032x}"
            return ":".join(mapped[i:i + 4] for i in range(0, 32, 4))
        if kind == "uuid" and "serials" in self.categories:
            return self._uuid(token)
        if kind == "mac" and "macs" in self.categories:
            return self._mac(token)
        if kind == "guid" and "guids" in self.categories:
            mapped = f"{self.map_interface_id(int(token.replace(':', ''), 16)):016x}"
            return ":".join(mapped[i:i + 4] for i in range(0, 16, 4))
        if kind == "ipv6" and self._addresses():
            return self._ipv6_text(match)
        if kind == "ipv4" and self._addresses():
            return self._ipv4_text(match)
        return token

    def _ipv4_range(self, match: re.Match[str]) -> str:
        """Both ends of a range, each mapped alone: in free text the order of the ends may turn
        (a prefix-preserving map keeps blocks, not order). A firewall recording's ranges become
        blocks instead (:func:`_ranges_as_blocks`), which keeps which addresses they hold."""
        try:
            first, last = (int(ipaddress.IPv4Address(end)) for end in match.groups())
        except ValueError:
            return match.group(0)
        return f"{ipaddress.IPv4Address(self.map_ipv4(first))}-{ipaddress.IPv4Address(self.map_ipv4(last))}"

    def _ipv4_text(self, match: re.Match[str]) -> str:
        address = match.group(0).split("/", 1)[0]
        try:
            value = int(ipaddress.IPv4Address(address))
        except ValueError:
            return match.group(0)
        length = match.group("plen4")
        return str(ipaddress.IPv4Address(self._network_aware(self.map_ipv4(value), value, 32, length))) + (f"/{length}" if length else "")

    def _ipv6_text(self, match: re.Match[str]) -> str:
        token = match.group(0)
        address, _, _length = token.partition("/")
        if "::" not in address and not any(len(group) >= 3 for group in address.split(":")):
            return token  # "0c:42:a1:03:00:14:e3:5a" or a time of day, not an address
        try:
            value = int(ipaddress.IPv6Address(address))
        except ValueError:
            return token
        length = match.group("plen6")
        mapped = ipaddress.IPv6Address(self._network_aware(self.map_ipv6(value), value, 128, length))
        text = f"::ffff:{mapped.ipv4_mapped}" if "." in address and mapped.ipv4_mapped else str(mapped)
        return text + (f"/{length}" if length else "")

    @staticmethod
    def _network_aware(mapped: int, original: int, bits: int, length: str | None) -> int:
        """A network address (host bits zero) stays one, and so does a broadcast address."""
        if not length or not 0 <= int(length) <= bits:
            return mapped
        host = (1 << (bits - int(length))) - 1
        if original & host == 0:
            return mapped & ~host
        if original & host == host:
            return mapped | host
        return mapped

    def _mac(self, token: str) -> str:
        value = int(token.replace(":", ""), 16)
        if value in (0, 2**48 - 1) or (value >> 40) & 1:  # zero, broadcast, multicast
            return token
        mapped = f"{self._preserving(b'mac', value, 48, _OUI_BITS):012x}"
        out = ":".join(mapped[i:i + 2] for i in range(0, 12, 2))
        return out.upper() if token.isupper() else out

    def _uuid(self, token: str) -> str:
        digits = self._stream("uuid", token.lower(), 16).hex()
        digits = digits[:12] + token[14] + digits[13:]  # keep the version nibble
        out = f"{digits[:8]}-{digits[8:12]}-{digits[12:16]}-{digits[16:20]}-{digits[20:32]}"
        return out.upper() if token.isupper() else out

    def map_serial(self, value: str) -> str:
        """Same length and character classes (hex stays hex), keyed by the value."""
        memo_key = ("serial", value)
        if memo_key in self._memo:
            return self._memo[memo_key]
        stream = self._stream("serial", value, len(value))
        is_hex = len(value) >= 8 and re.fullmatch(r"[0-9a-f]+|[0-9A-F]+", value) is not None
        out = []
        for char, byte in zip(value, stream):
            if is_hex:
                digit = "0123456789abcdef"[byte % 16]
                out.append(digit.upper() if char.isupper() else digit)
            elif char.isdigit():
                out.append(str(byte % 10))
            elif "a" <= char <= "z":
                out.append(chr(ord("a") + byte % 26))
            elif "A" <= char <= "Z":
                out.append(chr(ord("A") + byte % 26))
            else:
                out.append(char)
        self._memo[memo_key] = "".join(out)
        return self._memo[memo_key]

    # -- host names ------------------------------------------------------------------------------------
    def learn_names(self, names: Iterable[str]) -> None:
        """Remember host/domain names and hostlist expressions to replace."""
        for expression in names:
            expression = expression.strip().rstrip(".").lower()
            if not expression or _is_ip(expression):
                continue
            try:
                pieces = split_top_level(expression)
            except ValueError:
                pieces = [expression]
            for piece in pieces:
                if "[" in piece:
                    stem = piece.split("[", 1)[0].split(".")[-1]
                    if re.fullmatch(r"[a-z0-9_-]*[a-z_-]", stem):
                        self.host_prefixes.add(stem)
                    piece = piece.split("]", 1)[-1]
                for label in piece.split("."):
                    if not re.fullmatch(r"[a-z0-9_][a-z0-9_-]*", label) or label in _KEPT_LABELS or label.isdigit():
                        continue
                    self.host_labels.add(label)
                    stem = label.rstrip("0123456789")
                    if stem and stem != label:
                        self.host_prefixes.add(stem)

    def _label_match(self, match: re.Match[str]) -> str:
        label = match.group(0)
        lower = label.lower()
        stem = lower.rstrip("0123456789")
        numbered = stem != lower and stem in self.host_prefixes
        before_range = match.end() < len(match.string) and match.string[match.end()] == "[" and lower in self.host_prefixes
        if lower in self.host_labels or numbered or before_range:
            return self._placeholder(stem) + lower[len(stem):] if stem else label
        return label

    def _placeholder(self, stem: str) -> str:
        memo_key = ("host", stem)
        if memo_key not in self._memo:
            letters = "".join(chr(ord("a") + byte % 26) for byte in self._stream("host", stem, 7))
            self._memo[memo_key] = f"h{letters}"
        return self._memo[memo_key]

    # -- account names -----------------------------------------------------------------------------------
    def learn_users(self, names: Iterable[str]) -> None:
        """Remember account names to replace; service accounts and non-names are ignored."""
        for name in names:
            if _ACCOUNT.fullmatch(name) and name.lower() not in _SERVICE_ACCOUNTS:
                self.user_names.add(name)
        # Longest first, so that "alice" never shadows "alice2" in the alternation.
        alternatives = "|".join(re.escape(name) for name in sorted(self.user_names, key=lambda n: (-len(n), n)))
        # Whole words: not inside "alice2", "malice" or "alice.smith" (a dot before a word char).
        self._user_pattern = re.compile(rf"(?<![\w.-])(?:{alternatives})(?![\w-]|\.\w)") if alternatives else None

    def user_placeholder(self, name: str) -> str:
        memo_key = ("user", name)
        if memo_key not in self._memo:
            self._memo[memo_key] = "u" + "".join(chr(ord("a") + byte % 26) for byte in self._stream("user", name, 7))
        return self._memo[memo_key]

    def scrub_users(self, text: str) -> str:
        if self._user_pattern is None:
            return text
        return self._user_pattern.sub(lambda match: self.user_placeholder(match.group(0)), text)

    # -- whole snapshots ---------------------------------------------------------------------------------
    def scrub_members(self, members: dict[str, Member]) -> dict[str, Member]:
        """A scrubbed copy of a recorded root (paths, link targets, contents)."""
        if "hostnames" in self.categories:
            self.learn_names(_names_in(members))
        if "users" in self.categories:
            self.learn_users(_users_in(members))
        scrubbed: dict[str, Member] = {}
        for path, member in members.items():
            new_path = self.scrub_path(path)
            if member.kind == "link":
                scrubbed[new_path] = replace(member, path=new_path, target=self.scrub_path(member.target))
            elif member.kind == "file":
                scrubbed[new_path] = replace(member, path=new_path, data=self.scrub_file(path, member.data))
            else:
                scrubbed[new_path] = replace(member, path=new_path)
        return scrubbed

    def scrub_path(self, path: str) -> str:
        # sysfs, procfs and /dev name kernel objects, never accounts: a user called "net" must not
        # rename /sys/class/net.
        accounts = self.user_names if not path.lstrip("/").startswith(("sys/", "proc/", "dev/")) else ()
        return "/".join(
            self.user_placeholder(part) if part in accounts else _TOKENS.sub(self._token, part)
            for part in path.split("/")
        )

    def scrub_file(self, path: str, data: bytes) -> bytes:
        if path.startswith(".preflight/") and path.endswith(".json"):
            return self._scrub_json_file(path, data)
        if "serials" in self.categories:
            base = path.rsplit("/", 1)[-1]
            if base == "config" and path.startswith("sys/"):
                return self._scrub_dsn(data)
            if base == "vpd":
                return self._scrub_vpd(data)
            if _SERIAL_FILE.search(path) and data.strip():
                text = data.decode("utf-8", "surrogateescape")
                core = text.strip()
                return text.replace(core, self.map_serial(core)).encode("utf-8", "surrogateescape")
        hostnames = _HOSTNAME_SCOPE.match(path) is not None
        users = _USER_SCOPE.match(path) is not None
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            if not (hostnames or users):
                return data  # binary: only the formats handled above carry identifiers
            # a configuration file or an environment with one Latin-1 byte is still text, whose
            # names and addresses must go; its other bytes come back as they were
            text = data.decode("utf-8", "surrogateescape")
        proc_net = _PROC_NET.match(path)
        if proc_net and self._addresses():
            text = self._scrub_proc_net(proc_net.group("name"), text)
        if users:
            text = self.scrub_users(text)
        return "\0".join(self.scrub_text(part, hostnames) for part in text.split("\0")).encode("utf-8", "surrogateescape")

    def _scrub_json_file(self, path: str, data: bytes) -> bytes:
        try:
            document = json.loads(data)
        except ValueError:
            return data
        name = path.rsplit("/", 1)[-1]
        hostnames = _HOSTNAME_SCOPE.match(path) is not None
        if name == "nvml.json":
            document = self._scrub_nvml(document)
        else:
            if name == FIREWALL_FILE and self._addresses():
                document = _ranges_as_blocks(document)
            keys = self.scrub_path if name in ("devices.json", "read-errors.json", "statvfs.json") else (lambda key: self.scrub_text(self.scrub_users(key), hostnames))
            document = _map_json(document, lambda text: self.scrub_text(self.scrub_users(text), hostnames), keys)
        return (json.dumps(document) + "\n").encode("utf-8")

    def _scrub_nvml(self, document: Any) -> Any:
        calls = document.get("calls") if isinstance(document, dict) else None
        if not isinstance(calls, dict):
            return document
        for function, entry in calls.items():
            def text(value: str, serial: bool = "Serial" in function) -> str:
                if serial and "serials" in self.categories:
                    return self.map_serial(value)
                # messages name the recorded root's path and host ("no NVML recording in /home/alice/...")
                return self.scrub_text(self.scrub_users(value), hostnames=True)

            # Keys of per-device answers are indices and arguments ("0/gpu1/0"), never identifiers.
            calls[function] = self._cluster_uuids(_map_json(entry, text, lambda key: key))
        return document

    def _cluster_uuids(self, value: Any) -> Any:
        """NVLink fabric answers carry the cluster's UUID as 16 byte values (``clusterUuid``),
        which no text pattern sees: mapped as the UUID they spell."""
        if isinstance(value, list):
            return [self._cluster_uuids(item) for item in value]
        if not isinstance(value, dict):
            return value
        mapped = {}
        for name, item in value.items():
            # all zero: no fabric cluster at all, which the NVLink checks read as such
            if name == "clusterUuid" and "serials" in self.categories and _uuid_bytes(item) and any(item):
                spelled = bytes(item).hex()
                uuid = self._uuid(f"{spelled[:8]}-{spelled[8:12]}-{spelled[12:16]}-{spelled[16:20]}-{spelled[20:]}")
                mapped[name] = list(bytes.fromhex(uuid.replace("-", "")))
            else:
                mapped[name] = self._cluster_uuids(item)
        return mapped

    def scrub_manifest(self, manifest: dict[str, Any]) -> dict[str, Any]:
        scrubbed: dict[str, Any] = _map_json(manifest, lambda text: self.scrub_text(self.scrub_users(text), hostnames=True), lambda key: key)
        scrubbed["scrub"] = {"categories": sorted(self.categories), "key": "given" if self.key_given else "random (consistent within this snapshot only)"}
        if self.key_given:
            scrubbed["scrub"]["key_id"] = self.key_id()
        return scrubbed

    # -- formats with addresses in hex -------------------------------------------------------------------
    def _scrub_proc_net(self, name: str, text: str) -> str:
        lines = text.split("\n")
        for number, line in enumerate(lines):
            fields = line.split()
            if not fields:
                continue
            if name == "route" and number > 0 and len(fields) >= 8:
                mask = _le32(fields[7])
                if mask is None:
                    continue
                length = str(bin(mask).count("1"))
                fields[1] = self._hex_v4(fields[1], length)
                fields[2] = self._hex_v4(fields[2], None)
                lines[number] = "\t".join(fields)
            elif name in ("tcp", "udp", "raw", "tcp6", "udp6", "raw6") and number > 0 and len(fields) >= 3:
                for index in (1, 2):
                    address, colon, port = fields[index].partition(":")
                    fields[index] = (self._hex_v4(address, None) if len(address) == 8 else self._hex_v6_words(address)) + colon + port
                lines[number] = " ".join(fields)
            elif name == "if_inet6" and len(fields) == 6 and len(fields[0]) == 32:
                fields[0] = self._hex_v6(fields[0])
                lines[number] = " ".join(fields)
            elif name == "ipv6_route" and len(fields) >= 5:
                for index in (0, 2, 4):
                    if len(fields[index]) == 32:
                        fields[index] = self._hex_v6(fields[index])
                lines[number] = " ".join(fields)
        return "\n".join(lines)

    def _hex_v4(self, field: str, length: str | None) -> str:
        value = _le32(field)
        if value is None:
            return field
        mapped = self._network_aware(self.map_ipv4(value), value, 32, length if length and length != "0" else None)
        return f"{struct.unpack('<I', struct.pack('>I', mapped))[0]:08X}"

    def _hex_v6(self, field: str) -> str:
        try:
            value = int(field, 16)
        except ValueError:
            return field
        return f"{self.map_ipv6(value):032x}"

    def _hex_v6_words(self, field: str) -> str:
        """``/proc/net/tcp6``: four 32-bit words, each in host (little-endian) order."""
        if len(field) != 32:
            return field
        try:
            raw = b"".join(struct.pack(">I", struct.unpack("<I", bytes.fromhex(field[i:i + 8]))[0]) for i in range(0, 32, 8))
        except ValueError:
            return field
        mapped = self.map_ipv6(int.from_bytes(raw, "big")).to_bytes(16, "big")
        return "".join(f"{struct.unpack('<I', mapped[i:i + 4])[0]:08X}" for i in range(0, 16, 4))

    # -- binary formats ------------------------------------------------------------------------------
    def _scrub_dsn(self, data: bytes) -> bytes:
        """PCIe extended capability 0x0003 (Device Serial Number) in a sysfs ``config`` file."""
        buffer = bytearray(data)
        offset, seen = 0x100, 0
        while 0x100 <= offset <= len(buffer) - 12 and seen < 64:
            header = struct.unpack_from("<I", buffer, offset)[0]
            if header in (0, 0xFFFFFFFF):
                break
            if header & 0xFFFF == 0x0003:
                original = bytes(buffer[offset + 4:offset + 12])
                buffer[offset + 4:offset + 12] = self._stream("dsn", original.hex(), 8)
            offset, seen = header >> 20, seen + 1
        return bytes(buffer)

    def _scrub_vpd(self, data: bytes) -> bytes:
        """The ``SN`` keyword of the read-only VPD resource, with its ``RV`` checksum fixed."""
        buffer = bytearray(data)
        position = 0
        while position < len(buffer):
            tag = buffer[position]
            if not tag & 0x80:  # small resource; 0x78 is the end tag
                if tag & 0x78 == 0x78:
                    break
                position += 1 + (tag & 0x07)
                continue
            if position + 3 > len(buffer):
                break
            length = struct.unpack_from("<H", buffer, position + 1)[0]
            start, end = position + 3, min(position + 3 + length, len(buffer))
            if tag == 0x90:  # VPD-R
                cursor = start
                while cursor + 3 <= end:
                    keyword, size = bytes(buffer[cursor:cursor + 2]), buffer[cursor + 2]
                    value_at = cursor + 3
                    if keyword == b"SN":
                        value = bytes(buffer[value_at:value_at + size]).decode("latin-1")
                        buffer[value_at:value_at + size] = self.map_serial(value).encode("latin-1")
                    elif keyword == b"RV" and size >= 1:
                        buffer[value_at] = (-sum(buffer[:value_at])) & 0xFF
                    cursor = value_at + size
            position = end
        return bytes(buffer)


def _ranges_as_blocks(value: Any, in_values: bool = False) -> Any:
    """A firewall recording with each address range of a rule's ``values`` ("10.10.1.17-10.10.1.30")
    replaced by the CIDR blocks that make it up: a prefix-preserving map takes a block onto a
    block, so the scrubbed rule matches exactly the images of the addresses it matched."""
    if isinstance(value, dict):
        return {name: _ranges_as_blocks(item, name == "values") for name, item in value.items()}
    if not isinstance(value, list):
        return value
    if not in_values:
        return [_ranges_as_blocks(item) for item in value]
    expanded: list[Any] = []
    for item in value:
        first, _, last = item.partition("-") if isinstance(item, str) else ("", "", "")
        try:
            blocks = list(ipaddress.summarize_address_range(ipaddress.ip_address(first), ipaddress.ip_address(last)))
        except (ValueError, TypeError):
            blocks = []
        if 0 < len(blocks) <= MAX_RANGE_BLOCKS:
            expanded.extend(str(block) for block in blocks)
        else:
            expanded.append(item)
    return expanded


def _uuid_bytes(value: Any) -> bool:
    return isinstance(value, list) and len(value) == 16 and all(isinstance(b, int) and not isinstance(b, bool) and 0 <= b <= 255 for b in value)


def _le32(field: str) -> int | None:
    if len(field) != 8:
        return None
    try:
        return int.from_bytes(bytes.fromhex(field), "little")
    except ValueError:
        return None


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text.split("%", 1)[0])
    except ValueError:
        return False
    return True


def _map_json(value: Any, text: Callable[[str], str], key: Callable[[str], str]) -> Any:
    if isinstance(value, str):
        return text(value)
    if isinstance(value, list):
        return [_map_json(item, text, key) for item in value]
    if isinstance(value, dict):
        return {key(str(name)): _map_json(item, text, key) for name, item in value.items()}
    return value


def _names_in(members: dict[str, Member]) -> list[str]:
    """Host and domain names (and hostlist expressions) the recorded root mentions."""
    from preflight.tomlcompat import parse_toml

    def text(path: str) -> str:
        member = members.get(path)
        return member.data.decode("utf-8", "replace") if member is not None and member.kind == "file" else ""

    names = [text("proc/sys/kernel/hostname"), text("etc/hostname"), text("proc/sys/kernel/domainname")]
    for line in text("etc/hosts").splitlines():
        fields = line.split("#", 1)[0].split()
        names += fields[1:]
    for line in text("etc/resolv.conf").splitlines():
        fields = line.split("#", 1)[0].split()
        if fields and fields[0] in ("search", "domain"):
            names += fields[1:]
    for path, member in members.items():
        if member.kind != "file":
            continue
        if re.fullmatch(r"proc/[^/]+/environ", path):
            for item in member.data.split(b"\0"):
                name, _, value = item.decode("utf-8", "replace").partition("=")
                if name in _HOST_VARIABLES or name.endswith("NODELIST"):
                    names.append(value.rsplit(":", 1)[0] if name == "NCCL_COMM_ID" else value)
        elif path.startswith("etc/slurm/") and path.endswith(".conf"):
            names += [match.group(1) for match in _SLURM_HOSTS.finditer(text(path))]
    try:
        config = parse_toml(text("etc/preflight/preflight.toml"))
        names += [str(peer) for peer in config.get("expect", {}).get("peers", [])]
        names += [str(section.get("match", "")) for section in config.get("hosts", [])]
    except (ValueError, AttributeError, TypeError):
        pass
    try:
        dns = json.loads(text(".preflight/dns.json") or "{}")
        for question, answer in dns.get("answers", {}).items():
            names.append(question.rsplit(" ", 1)[0])
            names += [str(name) for name in answer.get("names", [])]
    except (ValueError, AttributeError, TypeError):
        pass
    return [name for name in names if name and name.lower() not in ("none", "localhost")]


def _users_in(members: dict[str, Member]) -> list[str]:
    """Account names the recorded root mentions: in job environments, and as home directories."""
    names = [match.group("name") for path in members for match in _HOME_DIR.finditer(path)]
    for path, member in members.items():
        if member.kind == "link":
            names += [match.group("name") for match in _HOME_DIR.finditer(member.target)]
        if member.kind != "file" or not re.fullmatch(r"proc/[^/]+/environ", path):
            continue
        for item in member.data.split(b"\0"):
            name, _, value = item.decode("utf-8", "replace").partition("=")
            if name in _USER_VARIABLES:
                names.append(value)
            elif name in _HOME_VARIABLES:
                names += [match.group("name") for match in _HOME_DIR.finditer(value)]
    return names
