"""Undo what posting a log does to it, before a line is matched or its prefixes are read.

Logs reach ``explain`` copied out of terminals, CI pages and issue threads, and each of those
leaves marks on the text that no signature should have to know about:

* Markdown quoting: ``> `` (or ``>>``) in front of every line of a quoted reply;
* Markdown autolinks: GitHub turns ``net_ib.cc:101`` and ``10.1.3.201`` into
  ``[net_ib.cc:101](http://net_ib.cc:101/)``, so a copied line carries both;
* code fences (```` ``` ````), which are whole lines of their own and match nothing, and a
  single line quoted as inline code (`` `RuntimeError: ...` ``);
* terminal colours (handled by :func:`preflight.explain.prefixes.strip_ansi`);
* carriage returns: a progress bar redraws itself with ``\\r`` and the error that follows is
  written onto the same line of the file, so a line is really several, and the last one is the
  message;
* hard wraps: a terminal, a mailer or a viewer that breaks every line at a fixed width cuts a
  message, and often a word of it, over several lines (:func:`unwrap_hard_wraps`);
* typography: a log copied out of a rendered page, a chat or a mail can carry no-break and other
  Unicode spaces where the program wrote a space, curly quotes where it wrote straight ones, an
  ellipsis character for "...", zero-width characters, and HTML entities (``&lt;`` for ``<``)
  where a page's source was copied rather than its text.

Autolinks and typography are undone on the raw bytes of a chunk (:func:`undo_posting`), before
the scanner looks for literals: a link can split one ("peer [10.1.3.201](http://...)<41937>")
and a no-break space hides one. A hard wrap is undone there too, for a post small enough to be
one (:func:`unwrap_hard_wraps`). The rest is undone on each candidate line (:func:`normalise`),
where quoting only adds a prefix and every literal survives.
"""

from __future__ import annotations

import re

from preflight.explain.prefixes import strip_ansi

_QUOTE = re.compile(r"[ \t]{0,3}>(?:[ \t]{0,3}>)*[ \t]?")
# "[text](http://text/)": only links whose text is a single token (a host, an address, a
# file:line), which is how GitHub autolinks look; a prose link keeps its words either way.
_AUTOLINK = re.compile(rb"\[([^\[\]\s]{1,200})\]\((?:https?|ftp|mailto):[^()\s]{0,400}\)")
_FENCE = re.compile(r"[ \t]{0,3}(?:```|~~~)")
_INLINE_CODE = re.compile(r"[ \t]{0,3}`([^`]+)`?[ \t]*$")


# What a renderer, chat client or mailer writes in place of what the program printed. Programs
# that write these characters themselves (a progress bar's block glyphs, a CJK path) keep them:
# only spaces, quotes, the ellipsis and invisible characters are replaced.
_TYPOGRAPHY = {
    "\u00a0": " ", **{chr(code): " " for code in range(0x2000, 0x200B)}, "\u202f": " ", "\u205f": " ", "\u3000": " ",
    "\u200b": "", "\u200c": "", "\u200d": "", "\u2060": "", "\ufeff": "",
    "\u2018": "'", "\u2019": "'", "\u201a": "'", "\u201b": "'", "\u2032": "'",
    "\u201c": '"', "\u201d": '"', "\u201e": '"', "\u2033": '"',
    "\u2026": "...",
}  # fmt: skip
_TYPOGRAPHY_TABLE = str.maketrans(_TYPOGRAPHY)
_TYPOGRAPHY_BYTES = tuple((char.encode(), plain.encode()) for char, plain in _TYPOGRAPHY.items())
# The entities a page's source has for characters that log lines use; numeric ones for quotes.
# "&amp;" comes last, so "&amp;lt;" (an escaped entity) stays "&lt;", as a browser shows it.
_ENTITIES = (("&lt;", "<"), ("&gt;", ">"), ("&quot;", '"'), ("&#39;", "'"), ("&#x27;", "'"), ("&apos;", "'"), ("&nbsp;", " "), ("&amp;", "&"))
_ENTITY_BYTES = tuple((entity.encode(), plain.encode()) for entity, plain in _ENTITIES)


def undo_posting(data: bytes) -> bytes:
    """What the program printed, as far as a chunk's raw bytes show it: autolinks, typography
    and HTML entities undone. No newline is touched, so line numbers stay those of the input."""
    if b"](" in data:
        data = _AUTOLINK.sub(rb"\1", data)
    # bytes.replace, one character at a time: each is a C-level pass that only ever shrinks the
    # data (or keeps its size), and a line of nothing but such characters costs no Python loop.
    if not data.isascii():
        for char, plain in _TYPOGRAPHY_BYTES:
            if char in data:
                data = data.replace(char, plain)
    if b"&" in data:
        for entity, plain in _ENTITY_BYTES:
            if entity in data:
                data = data.replace(entity, plain)
    return data


def undo_typography(line: str) -> str:
    """A line's Unicode spaces, curly quotes and HTML entities as the program wrote them (for
    text that did not come through :func:`undo_posting`)."""
    if not line.isascii():
        line = line.translate(_TYPOGRAPHY_TABLE)
    if "&" in line:
        for entity, plain in _ENTITIES:
            line = line.replace(entity, plain)
    return line


def normalise(line: str) -> str:
    """The message a posted line carries: no quote markers, colours, redraws or typography
    (autolinks are gone already, see :func:`undo_posting`)."""
    line = undo_typography(line)
    if "\r" in line:
        line = _last_segment(line)
    line = strip_ansi(line)
    if line[:4].lstrip(" \t")[:1] == ">":
        line = _QUOTE.sub("", line, count=1)
    if "`" in line[:8]:
        if _FENCE.match(line):
            line = line.lstrip(" \t").lstrip("`~")
            if " " not in line.strip():
                return ""  # an opening fence with its language tag ("```text") carries nothing
        elif _INLINE_CODE.match(line):
            # A one-line post quotes its log line as inline code: `RuntimeError: ...`
            line = _INLINE_CODE.sub(r"\1", line, count=1)
    return line


def _last_segment(line: str) -> str:
    """The text a terminal would show: what follows the last carriage return that has text
    after it (a trailing ``\\r`` of a CRLF line ends the line, it does not redraw it)."""
    segments = [segment for segment in line.split("\r") if segment.strip()]
    return segments[-1] if segments else ""


def segments(line: str) -> list[str]:
    """Every redraw of a line, each normalised; the line itself when it has no redraws.

    A signature may sit in a segment before the last (an error printed, then a progress bar
    drawn over it), so the matcher tries each."""
    if "\r" not in line.rstrip("\r"):
        return [normalise(line.rstrip("\r"))]
    return [normalise(part) for part in line.split("\r") if part.strip()]


# How a new record starts: a timestamp, a bracketed tag, a Ray/pod prefix, an NCCL
# "host:pid:tid [dev]" header, an srun label, a "host: " pdsh prefix or a syslog date.
_HOST_PREFIX = r"[\w.-]+: "
_RECORD_STARTS = (
    r"\d{4}-\d\d-\d\d", r"[\[(]", r"[\w.-]+:\d+:\d+ \[", r" *\d{1,6}: ", _HOST_PREFIX, r"[A-Z][a-z]{2} +\d{1,2} \d\d:", r"[IWEF]\d{4} "
)  # fmt: skip
RECORD_START = re.compile("|".join(_RECORD_STARTS))
# The same, less the "host: " prefix: a word and a colon also begin a wrapped line's rest
# ("ailed: No data available"), so after a cut inside a word only these mark a new record.
_STRONG_RECORD_START = re.compile("|".join(start for start in _RECORD_STARTS if start != _HOST_PREFIX))


def is_continuation(line: str) -> bool:
    """No prefix a launcher, shipper or NCCL would put at the start of a new record."""
    if not line or line[0] in " \t":
        return False  # indented lines are tracebacks and tables, not cut messages
    return RECORD_START.match(line) is None


UNWRAP_MAX_BYTES = 256 << 10  # a post; a bigger input is a file a program wrote, never re-wrapped
_MIN_WRAP_WIDTH = 60


def unwrap_hard_wraps(data: bytes) -> tuple[bytes, list[int]] | None:
    """A post hard-wrapped at a fixed width, each cut line joined to its rest, and for every line
    of the result the (0-based) input line it starts on; None when the text shows no such wrap.

    Wrapped at width W, the text has lines of exactly W characters, its longest, each followed
    by a line that starts no new record. That alone also describes a log whose longest message
    is printed twice, each time followed by an unprefixed line (an assertion, say), so more is
    asked: at least two such lines, not all the same, and at least one cut inside a word (a
    letter or digit on both sides), which is what a fixed width does and a program never does.
    A table's rows (``|`` or ``+`` at the edges) are never joined."""
    lines = data.split(b"\n")
    texts = [line.rstrip(b"\r").decode("utf-8", "replace") for line in lines]
    width = max(len(text) for text in texts)
    if width < _MIN_WRAP_WIDTH:
        return None
    rests = [normalise(text) for text in texts]

    def inside_word(index: int) -> bool:
        return texts[index][-1:].isalnum() and rests[index + 1][:1].isalnum()

    def is_cut(index: int) -> bool:
        if len(texts[index]) != width or index + 1 >= len(texts):
            return False
        rest = rests[index + 1]
        if texts[index].rstrip()[-1:] in ("|", "+") or rest[:1] in ("|", "+", "-", "="):
            return False
        if inside_word(index):
            return _STRONG_RECORD_START.match(rest) is None
        return is_continuation(rest)

    cuts = [index for index in range(len(texts)) if is_cut(index)]
    if len(cuts) < 2 or len({texts[index] for index in cuts}) < 2 or not any(inside_word(index) for index in cuts):
        return None
    cut = set(cuts)
    joined: list[bytes] = []
    starts: list[int] = []
    index = 0
    while index < len(lines):
        starts.append(index)
        line = lines[index]
        quoted = _QUOTE.match(texts[index]) is not None and texts[index].lstrip(" \t")[:1] == ">"
        while index in cut:
            index += 1
            rest = lines[index]
            marker = _QUOTE.match(texts[index]) if quoted else None
            line = line.rstrip(b"\r") + (rest[len(marker.group().encode()) :] if marker else rest)
        joined.append(line)
        index += 1
    return b"\n".join(joined), starts
