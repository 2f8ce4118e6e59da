"""Slurm hostlist expressions (``gpu[001-064,100],login1``) without calling ``scontrol``.

Grammar as documented for ``scontrol show hostnames``: comma-separated items; each item may hold
several bracket groups of comma-separated numbers and ``lo-hi`` ranges; a range keeps the
zero-padding of its lower bound (``[001-010]``). Expansion is capped so that a hostile or mistyped
expression (``n[0-99999999]``) is an error, not a memory blow-up.
"""

from __future__ import annotations

import fnmatch
import itertools
import re

MAX_HOSTS = 100_000
_GROUP = re.compile(r"\[([^\[\]]*)\]")


class HostlistError(ValueError):
    """The expression is malformed or too large."""


def split_top_level(expression: str) -> list[str]:
    """Split on commas that are not inside brackets."""
    items: list[str] = []
    current: list[str] = []
    depth = 0
    for char in expression:
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise HostlistError(f"unbalanced ']' in {expression!r}")
        if char == "," and depth == 0:
            items.append("".join(current))
            current = []
        else:
            current.append(char)
    if depth != 0:
        raise HostlistError(f"unbalanced '[' in {expression!r}")
    items.append("".join(current))
    return [item.strip() for item in items if item.strip()]


def _expand_group(body: str, expression: str) -> list[str]:
    values: list[str] = []
    for part in body.split(","):
        part = part.strip()
        if re.fullmatch(r"\d+", part):
            values.append(part)
            continue
        bounds = re.fullmatch(r"(\d+)-(\d+)", part)
        if not bounds:
            raise HostlistError(f"bad range {part!r} in {expression!r}")
        low, high = bounds.groups()
        if int(high) < int(low):
            raise HostlistError(f"range {part!r} runs backwards in {expression!r}")
        if int(high) - int(low) >= MAX_HOSTS:
            raise HostlistError(f"range {part!r} in {expression!r} has more than {MAX_HOSTS} hosts")
        width = len(low)
        values.extend(str(number).zfill(width) for number in range(int(low), int(high) + 1))
    return values


def expand(expression: str) -> list[str]:
    """``"gpu[01-03],cpu1"`` -> ``["gpu01", "gpu02", "gpu03", "cpu1"]``."""
    hosts: list[str] = []
    for item in split_top_level(expression):
        pieces = _GROUP.split(item)  # literal, group, literal, group, ..., literal
        if "[" in "".join(pieces[::2]) or "]" in "".join(pieces[::2]):
            raise HostlistError(f"nested or stray brackets in {item!r}")
        choices = [[piece] if index % 2 == 0 else _expand_group(piece, item) for index, piece in enumerate(pieces)]
        count = 1
        for choice in choices:
            count *= len(choice)
        if len(hosts) + count > MAX_HOSTS:
            raise HostlistError(f"{expression!r} expands to more than {MAX_HOSTS} hosts")
        hosts.extend("".join(combination) for combination in itertools.product(*choices))
    return hosts


def matches(pattern: str, hostname: str) -> bool:
    """True when ``hostname`` (or its short name) is in a hostlist/glob pattern list."""
    names = {hostname, hostname.split(".", 1)[0]}
    for item in split_top_level(pattern):
        if "[" in item and not any(char in item for char in "*?"):
            if names & set(expand(item)):
                return True
        elif any(fnmatch.fnmatchcase(name, item) for name in names):
            return True
    return False


def number_runs(numbers: list[int]) -> list[tuple[int, int]]:
    """Sorted, distinct numbers as runs of consecutive ones: ``[1, 2, 3, 7]`` -> ``[(1, 3), (7, 7)]``
    (the ``lo-hi`` ranges of a hostlist, or of a list of ranks)."""
    runs: list[tuple[int, int]] = []
    for number in numbers:
        if runs and number == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], number)
        else:
            runs.append((number, number))
    return runs
