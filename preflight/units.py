"""Byte sizes as people and config files write them, and back."""

from __future__ import annotations

import re
from typing import Any

#: RLIM_INFINITY on Linux (``~0UL``). Kept as an int so limits compare and serialise naturally.
UNLIMITED = 2**64 - 1

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGTPE]?)(i?)B?\s*$", re.IGNORECASE)
_POWERS = {"": 0, "K": 1, "M": 2, "G": 3, "T": 4, "P": 5, "E": 6}


#: More digits than any count, size or id a node holds: int() refuses strings of over 4300 digits
#: (Python's conversion limit), and untrusted files and environments can carry them.
MAX_DIGITS = 40


def is_number(text: str) -> bool:
    """ASCII digits, at most MAX_DIGITS of them: what int() reads at once. ``str.isdigit()`` alone
    also takes a superscript two, which int() refuses, and any length."""
    return text.isascii() and text.isdigit() and len(text) <= MAX_DIGITS


def parse_size(value: Any) -> int:
    """``"64GiB"``, ``"8M"``, ``4096``, ``"unlimited"``/``"infinity"`` -> bytes.

    Suffixes are binary (``M`` = MiB) as in systemd's and ulimit's usage; ``"64GB"`` is read the
    same way because every tool that takes memlock sizes treats it so.
    """
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise ValueError("must not be negative")
        return value
    if not isinstance(value, str):
        raise ValueError("must be bytes, a size like \"64GiB\", or \"unlimited\"")
    if value.strip().lower() in ("unlimited", "infinity"):
        return UNLIMITED
    match = _SIZE.match(value)
    if not match:
        raise ValueError("must be bytes, a size like \"64GiB\", or \"unlimited\"")
    number, unit, _ = match.groups()
    try:
        return int(float(number) * 1024 ** _POWERS[unit.upper()])
    except OverflowError:  # more digits than a float holds: inf
        raise ValueError("is too large") from None


def format_size(value: int | None) -> str:
    """Bytes as a short human string: ``8388608`` -> ``"8 MiB"``; ``UNLIMITED`` -> ``"unlimited"``."""
    if value is None:
        return "unknown"
    if value >= UNLIMITED:
        return "unlimited"
    for unit, power in (("EiB", 6), ("PiB", 5), ("TiB", 4), ("GiB", 3), ("MiB", 2), ("KiB", 1)):
        scale = 1024**power
        if value >= scale:
            amount = value / scale
            return f"{amount:g} {unit}" if amount == int(amount) else f"{amount:.1f} {unit}"
    return f"{value} bytes"
