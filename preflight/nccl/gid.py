"""How NCCL picks the RoCE GID of a port, emulated on a GID table read from sysfs.

Pure functions (no I/O), shared by the RoCE probe that reports the choice and the checks that
judge it. The algorithm is NCCL's ``ncclIbGetGidIndex`` / ``ncclUpdateGidIndex``
(``src/transport/net_ib.cc`` in 2.21-2.22, ``src/transport/net_ib/connect.cc`` since 2.23,
unchanged through 2.30 except for the handling of ``EINVAL``):

* ``NCCL_IB_GID_INDEX`` >= 0 is used verbatim, with no look at the table (before 2.21 its
  default was 0; since 2.21 it is -1, "choose").
* Otherwise NCCL starts at index 0 and walks every later slot. A candidate of the wanted address
  family (``NCCL_IB_ADDR_FAMILY``, ``AF_INET`` unless exactly ``AF_INET6``) inside
  ``NCCL_IB_ADDR_RANGE`` replaces a current GID of the other family outright; one of the same
  family replaces it only if it is valid (configured and not link-local) and its RoCE version,
  read from ``gid_attrs/types/<i>`` of both slots, is ``NCCL_IB_ROCE_VERSION_NUM`` (default 2)
  where the current one's is not (or the current GID is not valid).
* ``ncclIbRoceGetVersionNum`` fails the connection when a ``types`` file cannot be opened, and
  when it cannot be read; since 2.26 a read failing with ``EINVAL`` is skipped instead
  (NVIDIA/nccl#1573), which is what the kernel answers for a slot without a valid GID.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping

from msgspec import Struct

from preflight.units import MAX_DIGITS

AF_INET, AF_INET6 = 4, 6


_ZERO = bytes(16)


_LINK_LOCAL_PREFIX = bytes.fromhex("fe800000")


_GID_TEXT = re.compile(r"^[0-9a-fA-F]{4}(?::[0-9a-fA-F]{4}){7}$")


_EINVAL = "(EINVAL)"


def parse_gid(text: str) -> bytes | None:
    """``gids/<i>`` text (eight groups of four hex digits, ``%pI6``) -> 16 bytes; None if not a GID."""
    stripped = text.strip()
    return bytes.fromhex(stripped.replace(":", "")) if _GID_TEXT.match(stripped) else None


def gid_family(gid: bytes) -> int:
    """NCCL's ``getGidAddrFamily``: IPv4-mapped (also the ``ff0e::ffff:`` multicast form) is AF_INET."""
    mapped = gid[:10] == bytes(10) and gid[10:12] == b"\xff\xff"
    mapped_multicast = gid[:4] == b"\xff\x0e\x00\x00" and gid[4:10] == bytes(6) and gid[10:12] == b"\xff\xff"
    return AF_INET if mapped or mapped_multicast else AF_INET6


def configured_gid(gid: bytes) -> bool:
    """NCCL's ``configuredGid``: neither all zero nor the bare ``fe80::`` prefix."""
    trailer = gid[4:] != bytes(12)
    return not (gid == _ZERO or (gid[:4] == _LINK_LOCAL_PREFIX and not trailer))


def link_local_gid(gid: bytes) -> bool:
    """NCCL's ``linkLocalGid``: ``fe80:0000:0000:0000:...``."""
    return gid[:4] == _LINK_LOCAL_PREFIX and gid[4:8] == bytes(4)


def valid_gid(gid: bytes) -> bool:
    return configured_gid(gid) and not link_local_gid(gid)


def ipv4_of(gid: bytes) -> str | None:
    """The IPv4 address of an IPv4-mapped GID (``::ffff:a.b.c.d``)."""
    if gid[:10] == bytes(10) and gid[10:12] == b"\xff\xff":
        return str(ipaddress.IPv4Address(gid[12:]))
    return None


def roce_version(type_text: str) -> int | None:
    """``gid_attrs/types/<i>`` -> 1 or 2, matched on the prefix as NCCL does."""
    if type_text.startswith(("IB/RoCE v1", "RoCE v1")):
        return 1
    if type_text.startswith("RoCE v2"):
        return 2
    return None


def nccl_int(value: str | None, default: int) -> int:
    """An integer NCCL parameter as ``ncclLoadParam`` reads it: ``strtoll(value, NULL, 0)``,
    which takes the longest numeric prefix (``"3x"`` is 3, ``"abc"`` is 0); unset, empty or
    out-of-range values give the default."""
    if value is None or value == "":
        return default
    match = re.match(r"\s*([+-]?)(0[xX][0-9a-fA-F]+|0[0-7]*|[1-9][0-9]*)?", value)
    digits = match.group(2) if match else None
    if not digits:
        return 0
    if len(digits) > MAX_DIGITS:
        return default  # beyond long long: strtoll says ERANGE, and int() would refuse the string
    number = int(digits, 16) if digits[:2].lower() == "0x" else int(digits, 8) if digits.startswith("0") else int(digits)
    number = -number if match is not None and match.group(1) == "-" else number
    return number if -(2**63) <= number < 2**63 else default


class GidSettings(Struct, frozen=True):
    """The job's GID-selection variables as NCCL parses them."""

    gid_index: int = -1  # NCCL_IB_GID_INDEX; -1 chooses automatically (NCCL >= 2.21)
    roce_version: int = 2  # NCCL_IB_ROCE_VERSION_NUM
    family: int = AF_INET  # NCCL_IB_ADDR_FAMILY
    addr_range: str = ""  # NCCL_IB_ADDR_RANGE as given


def parse_gid_settings(values: Mapping[str, str]) -> GidSettings:
    """``{"NCCL_IB_GID_INDEX": "3", ...}`` (the variables that are set) -> :class:`GidSettings`."""
    return GidSettings(
        gid_index=nccl_int(values.get("NCCL_IB_GID_INDEX"), -1),
        roce_version=nccl_int(values.get("NCCL_IB_ROCE_VERSION_NUM"), 2),
        family=AF_INET6 if values.get("NCCL_IB_ADDR_FAMILY") == "AF_INET6" else AF_INET,
        addr_range=values.get("NCCL_IB_ADDR_RANGE", ""),
    )


def parse_addr_range(text: str, family: int) -> tuple[bytes, int] | None:
    """NCCL's ``envIbAddrRange``: ``"10.1.0.0/16"`` -> (address bytes, prefix length); None when
    NCCL ignores the value (no ``/``, an address of the other family, a prefix too long).
    The prefix is ``strtol(..., 10)``, so ``"/abc"`` is 0 and ``"/-1"`` is -1 (matches nothing)."""
    if "/" not in text:
        return None
    address_text, _, mask_text = text[:127].partition("/")
    try:
        address = (ipaddress.IPv4Address if family == AF_INET else ipaddress.IPv6Address)(address_text)
    except ValueError:
        return None
    match = re.match(r"\s*([+-]?\d+)", mask_text)
    mask = int(match.group(1)) if match else 0
    if mask > (32 if family == AF_INET else 128):
        return None
    return address.packed, mask


def in_addr_range(family: int, prefix: tuple[bytes, int] | None, gid: bytes) -> bool:
    """NCCL's ``matchGidAddrPrefix``: an IPv4 range is compared with the GID's last 32 bits."""
    if prefix is None:
        return True
    base, length = prefix
    if length < 0:
        return False  # the loop never runs and the remaining length is not 0
    if length == 0:
        return True
    value = gid[12:] if family == AF_INET else gid
    bits = len(base) * 8
    mask = ((1 << length) - 1) << (bits - length)
    return int.from_bytes(base, "big") & mask == int.from_bytes(value, "big") & mask


class Slot(Struct, frozen=True):
    """One GID table slot as the emulation needs it."""

    gid: bytes  # zeros for an empty slot
    type_text: str | None  # gid_attrs/types/<i>; None when it could not be read
    type_error: str = ""  # why not, e.g. "invalid argument (EINVAL)"


class GidChoice(Struct, frozen=True):
    """What NCCL would do on one port."""

    index: int | None  # the GID index used (NCCL >= 2.26 semantics); None when NCCL fails
    forced: bool  # fixed by NCCL_IB_GID_INDEX
    einval_reads: tuple[int, ...]  # slots whose type NCCL reads and gets EINVAL: fatal in 2.21-2.25
    failed_read: int | None = None  # the slot whose gid_attrs/types fails for every NCCL version
    error: str = ""  # how that read fails


def nccl_would_pick_gid(slots: Mapping[int, Slot], table_size: int, settings: GidSettings) -> GidChoice:
    """Emulate ``ncclIbGetGidIndex`` for a RoCE port; ``slots`` holds the non-empty ones."""
    if settings.gid_index >= 0:
        return GidChoice(settings.gid_index, True, ())
    empty = Slot(_ZERO, None, f"invalid argument {_EINVAL}")  # what the kernel answers for an empty slot
    prefix = parse_addr_range(settings.addr_range, settings.family) if settings.addr_range else None
    einval: list[int] = []

    def version(index: int) -> tuple[int | None, str]:
        slot = slots.get(index, empty)
        if slot.type_text is not None:
            return roce_version(slot.type_text), ""
        if slot.type_error.endswith(_EINVAL):
            if index not in einval:
                einval.append(index)
            return None, ""
        return None, slot.type_error

    current = 0
    for candidate in range(1, table_size):
        gid = slots.get(current, empty).gid
        other = slots.get(candidate, empty).gid
        other_family = gid_family(other)
        inside = in_addr_range(settings.family, prefix, other)
        if other_family != gid_family(gid) and other_family == settings.family and inside:
            current = candidate
            continue
        if other_family != settings.family or not valid_gid(other) or not inside:
            continue
        current_version, error = version(current)
        if error:
            return GidChoice(None, False, tuple(einval), current, error)
        candidate_version, error = version(candidate)
        if error:
            return GidChoice(None, False, tuple(einval), candidate, error)
        if (current_version != candidate_version or not valid_gid(gid)) and candidate_version == settings.roce_version:
            current = candidate
    return GidChoice(current, False, tuple(einval))


