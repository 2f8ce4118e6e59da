"""Text from other machines made safe to show: host names, environment values, log lines and
report fields may carry terminal escape sequences (clear the screen, hide a line, set a window
title or a hyperlink), bidirectional overrides that reorder what a reader sees, or characters
XML cannot hold (every one of those is unprintable, so escaping the unprintable keeps JUnit
valid too). Everything preflight prints for people passes through here."""

from __future__ import annotations


def printable(value: str, limit: int | None = None) -> str:
    """Control, format and other unprintable characters as visible escapes (``\\x1b``,
    ``\\u202e``); text longer than ``limit`` shortened with ``...``."""
    shown = value if value.isprintable() else "".join(char if char.isprintable() else ascii(char)[1:-1] for char in value)
    return shown if limit is None or len(shown) <= limit else shown[: limit - 3] + "..."


def printable_lines(text: str) -> str:
    """:func:`printable` for each line of ``text``; the line breaks themselves are kept."""
    return "\n".join(printable(line) for line in text.split("\n"))
