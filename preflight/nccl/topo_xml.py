"""NCCL's topology XML reader, re-written from its behaviour (``src/graph/xml.cc``, read at every
tag from v2.7.8-1 to v2.30.7-1), so that TOPO004 accepts and refuses the files NCCL does.

NCCL reads ``NCCL_TOPO_FILE`` byte by byte with a small reader of its own, not an XML parser:

* between elements only ``' '``, ``'\\n'`` and ``'\\r'`` may appear (a tab, a UTF-8 byte order mark
  or ``<?xml ...?>`` stops it), and nothing but elements and ``<!-- -->`` comments;
* a name runs up to ``' '``, ``'>'``, ``'/'``, ``'\\n'`` or ``'\\r'``; inside a tag attributes are
  separated by single spaces, so a tag broken over lines is refused, while a name without
  ``=value`` or two spaces in a row are taken;
* a value is quoted and taken verbatim up to the closing quote: ``&`` and ``<`` are plain
  characters, entities are not expanded, a duplicated attribute is kept (the first one counts),
  only the first 16 attributes of an element count;
* only the elements of its format are kept (``system`` > ``cpu`` > ``pci``/``nic`` > ...);
  anything else is skipped with its content, and inside skipped content any closing tag ends the
  skipped element; after ``</system>`` it goes on reading, so a second ``<system>`` or another
  element is read too, and a stray closing tag there opens a skipped element;
* ``<system>`` needs ``version`` equal to 1 (``strtol``);
* a name holds at most 253 bytes (254 in 2.7), a value 253 (from 2.27.3); the kept elements are
  counted and reading stops at the limit (1024 up to 2.20, ``NCCL_TOPO_XML_MAX_NODES`` 256 from
  2.21.5, ``src/graph/topo.h``), as it does for an element with too many kept children.

Releases differ, so the file is read under each release's rules (:data:`RELEASES`): up to 2.26 a
value opened with ``'`` runs to the next ``"``, and a value longer than the buffer, or a 33rd
kept child before 2.21.5, overflows a buffer (undefined: not judged). Where releases disagree the
verdict says which accept the file.

Bounded for untrusted files: no recursion (an explicit stack, at most :data:`MAX_DEPTH` open
elements), at most :data:`MAX_TAGS` tags per reading, the node limits above, and every scan is a
bounded regular expression or ``bytes.find``.
"""

from __future__ import annotations

import re
from msgspec import Struct, field  # not dataclasses: its import (inspect, ast) costs the prolog

MAX_DEPTH = 1024  # open elements; NCCL recurses without limit into skipped elements, this does not
MAX_TAGS = 10_000  # tags and comments per reading; a dump of an 8-GPU node has a few hundred
TOPO_XML_VERSION = 1  # NCCL_TOPO_XML_VERSION, 1 in every release


class XmlRules(Struct, frozen=True):
    """What one range of NCCL releases accepts (from ``since`` to the next row)."""

    since: str
    max_str_len: int  # MAX_STR_LEN: names hold max_str_len - 2 bytes, values max_str_len - 2
    max_nodes: int  # kept elements NCCL reads before it stops
    max_subs: int  # kept children of one element
    subs_checked: bool  # False: one more overflows a buffer (undefined)
    same_quote: bool  # a value ends at its opening quote (else only at '"'), and is bounded
    children: dict[bytes, frozenset[bytes]]  # kept element -> the children it keeps


def _children(gpu: tuple[bytes, ...], pci: tuple[bytes, ...]) -> dict[bytes, frozenset[bytes]]:
    return {
        b"system": frozenset({b"cpu"}), b"cpu": frozenset({b"pci", b"nic"}), b"pci": frozenset(pci),
        b"gpu": frozenset(gpu), b"nic": frozenset({b"net"}),
        b"net": frozenset(), b"nvlink": frozenset(), b"c2c": frozenset(), b"pcilink": frozenset(),
    }


_OLD_TREE = _children((b"nvlink",), (b"pci", b"gpu", b"nic"))
_C2C_TREE = _children((b"nvlink", b"c2c"), (b"pci", b"gpu", b"nic"))
_PCILINK_TREE = _children((b"nvlink", b"c2c"), (b"pci", b"gpu", b"nic", b"pcilink"))

#: Each row holds from its release to the next row's (xml.cc, xml.h and topo.h at each tag).
RELEASES: tuple[XmlRules, ...] = (
    XmlRules("2.7.8", 256, 1024, 32, False, False, _OLD_TREE),
    XmlRules("2.8.3", 255, 1024, 32, False, False, _OLD_TREE),
    XmlRules("2.19.1", 255, 1024, 32, False, False, _C2C_TREE),
    XmlRules("2.21.5", 255, 256, 128, True, False, _C2C_TREE),
    XmlRules("2.22.3", 255, 256, 128, True, False, _PCILINK_TREE),
    XmlRules("2.27.3", 255, 256, 128, True, True, _PCILINK_TREE),
    XmlRules("2.29.7", 255, 256, 640, True, True, _PCILINK_TREE),
)


class Refused(Exception):
    """NCCL stops reading the file (ncclInternalError or ncclInvalidUsage): init fails."""


class Undefined(Exception):
    """The release overflows a buffer on this file: what it does is not known."""


class TooBig(Exception):
    """Beyond this reader's own bounds: not judged."""


class XmlNode(Struct):
    """A kept element: its name, attributes in file order and kept children."""

    name: bytes
    attrs: list[tuple[bytes, bytes]]
    subs: list[XmlNode] = field(default_factory=list)

    def get(self, key: bytes) -> bytes | None:
        """The attribute as NCCL looks it up: the first of that name."""
        return next((value for name, value in self.attrs if name == key), None)


_NONE, _OPEN, _CLOSE, _SINGLE = range(4)
_MAX_ATTRS = 16  # MAX_ATTR_COUNT
_BLANKS = re.compile(rb"[ \n\r]*")
_STRTOL = re.compile(rb"[ \t\n\v\f\r]*([+-]?)(0[xX][0-9a-fA-F]+|0[0-7]*|[1-9][0-9]*)?")


def _c_string(raw: bytes) -> bytes:
    """What C string functions see of a buffer: up to its first NUL."""
    return raw.split(b"\0", 1)[0]


def c_int(value: bytes) -> int:
    """``(int)strtol(value, NULL, 0)`` on Linux: a long, clamped on overflow, cut to 32 bits."""
    match = _STRTOL.match(value)
    digits = match.group(2) if match is not None else None
    if match is None or not digits:
        return 0
    number = int(digits, 16) if digits[:2].lower() == b"0x" else int(digits, 8) if digits.startswith(b"0") else int(digits)
    number = -number if match.group(1) == b"-" else number
    number = max(-(2**63), min(2**63 - 1, number))
    number &= 0xFFFFFFFF
    return number - 2**32 if number >= 2**31 else number


class _Reader:
    """One reading of the bytes under one release's rules."""

    def __init__(self, data: bytes, rules: XmlRules) -> None:
        self.data = data
        self.pos = 0
        self.rules = rules
        self.tags = 0
        self.token_re = re.compile(rb"[^ >/\n\r=]{0,%d}" % rules.max_str_len)

    def where(self) -> str:
        line = self.data.count(b"\n", 0, self.pos) + 1
        return f"line {line}"

    def next_char(self) -> int:
        if self.pos >= len(self.data):
            raise Refused(f"unexpected end of file ({self.where()})")
        char = self.data[self.pos]
        self.pos += 1
        return char

    def token(self, with_value: bool) -> tuple[bytes, bytes | None, int]:
        """A name up to a delimiter (returned as the last byte read), or ``name=value``."""
        limit = self.rules.max_str_len
        name = self.token_re.match(self.data, self.pos).group()  # type: ignore[union-attr]
        if len(name) >= limit:
            raise Refused(f"name longer than {limit - 2} bytes ({self.where()})")
        self.pos += len(name)
        last = self.next_char()
        if last == ord("="):
            if not with_value:
                raise Refused(f"unexpected '=' after the tag name '{_show(name)}' ({self.where()})")
            value, last = self.value()
            return _c_string(name), value, last
        if len(name) >= limit - 1:
            raise Refused(f"name longer than {limit - 2} bytes ({self.where()})")
        return _c_string(name), None, last

    def value(self) -> tuple[bytes, int]:
        quote = self.next_char()
        if quote not in (ord('"'), ord("'")):
            raise Refused(f"attribute value without quotes ({self.where()})")
        closing = quote if self.rules.same_quote else ord('"')
        end = self.data.find(bytes([closing]), self.pos)
        length = (len(self.data) if end < 0 else end) - self.pos  # bytes before the closing quote (or EOF)
        stored = length + (0 if end < 0 else 1)  # the closing quote is stored too
        if self.rules.same_quote and stored >= self.rules.max_str_len:
            raise Refused(f"attribute value longer than {self.rules.max_str_len - 2} bytes ({self.where()})")
        if not self.rules.same_quote and stored > self.rules.max_str_len + 1:
            raise Undefined(f"an attribute value of {length} bytes overflows this release's buffer ({self.where()})")
        if end < 0:
            self.pos = len(self.data)
            raise Refused(f"unexpected end of file in an attribute value ({self.where()})")
        value = self.data[self.pos : end]
        self.pos = end + 1
        return _c_string(value), self.next_char()

    def node(self) -> tuple[int, bytes, list[tuple[bytes, bytes]]]:
        """The next element tag (comments skipped): its kind, name and first 16 attributes."""
        while True:
            self.tags += 1
            if self.tags > MAX_TAGS:
                raise TooBig(f"more than {MAX_TAGS} tags")
            self.pos = _BLANKS.match(self.data, self.pos).end()  # type: ignore[union-attr]
            if self.pos >= len(self.data):
                return _NONE, b"", []
            first = self.next_char()
            if first != ord("<"):
                raise Refused(f"expected '<', got {_char(first)} ({self.where()})")
            name, _, last = self.token(with_value=False)
            if not name.startswith(b"!--"):
                break
            self.skip_comment(name[3:] + bytes([last]))
        if not name and last == ord("/"):
            name, _, last = self.token(with_value=False)
            if last != ord(">"):
                raise Refused(f"{_char(last)} after the name in </{_show(name)}> ({self.where()})")
            return _CLOSE, name, []
        attrs: list[tuple[bytes, bytes]] = []
        while last == ord(" "):
            key, value, last = self.token(with_value=True)
            if len(attrs) < _MAX_ATTRS:
                attrs.append((key, value or b""))
        kind = _OPEN
        if last == ord("/"):
            kind = _SINGLE
            _, _, last = self.token(with_value=False)
        if last != ord(">"):
            raise Refused(f"expected '>' or a space in <{_show(name)}>, got {_char(last)} ({self.where()})")
        return kind, name, attrs

    def skip_comment(self, seen: bytes) -> None:
        """Past the ``-->`` that ends a comment; ``seen``: what followed ``<!--`` in its name."""
        if seen.endswith(b"-->"):
            return
        end = self.data.find(b"-->", self.pos)
        if end < 0:
            raise Refused("unterminated comment")
        self.pos = end + 3


def _show(raw: bytes) -> str:
    """Bytes for a reason: at most 40, non-ASCII escaped (``\\xef``)."""
    return raw[:40].decode("ascii", "backslashreplace").replace("\n", "\\n").replace("\r", "\\r").replace("\t", "\\t")


def _char(byte: int) -> str:
    return f"'{_show(bytes([byte]))}'"


class _Frame(Struct):
    node: XmlNode | None  # a kept element, None for the top level and skipped elements
    keeps: frozenset[bytes]  # the children it keeps
    skipped: bool  # skipped content: any closing tag ends it


def read_xml(data: bytes, rules: XmlRules) -> list[XmlNode]:
    """The kept top-level elements of ``data`` read under ``rules``; Refused, Undefined or TooBig."""
    reader = _Reader(data, rules)
    roots: list[XmlNode] = []
    stack = [_Frame(None, frozenset({b"system"}), False)]
    count = 0
    while True:
        frame = stack[-1]
        if count == rules.max_nodes:  # checked before every tag, so the last one read is one too many
            raise Refused(f"NCCL's reader is limited to {rules.max_nodes} elements, and this file reaches it")
        kind, name, attrs = reader.node()
        if kind == _NONE:
            if len(stack) > 1:
                raise Refused(f"end of file inside <{_show(frame.node.name) if frame.node else 'an element NCCL skips'}>")
            return roots
        if kind == _CLOSE and len(stack) > 1:
            if not frame.skipped and frame.node is not None and name != frame.node.name:
                raise Refused(f"</{_show(name)}> closes <{_show(frame.node.name)}> ({reader.where()})")
            stack.pop()
            continue
        if name not in frame.keeps or frame.skipped:
            if kind != _SINGLE:
                _push(stack, _Frame(None, frozenset(), True))
            continue
        node = XmlNode(name, attrs)
        if frame.node is not None:
            if len(frame.node.subs) == rules.max_subs:
                if rules.subs_checked:
                    raise Refused(f"more than {rules.max_subs} children in <{_show(frame.node.name)}> ({reader.where()})")
                raise Undefined(f"a child beyond {rules.max_subs} overflows this release's buffer ({reader.where()})")
            frame.node.subs.append(node)
        else:
            roots.append(node)
        count += 1
        if name == b"system":
            _check_version(node, reader)
        if kind != _SINGLE:
            _push(stack, _Frame(node, rules.children[name], False))


def _push(stack: list[_Frame], frame: _Frame) -> None:
    if len(stack) > MAX_DEPTH:
        raise TooBig(f"elements nested more than {MAX_DEPTH} deep")
    stack.append(frame)


def _check_version(system: XmlNode, reader: _Reader) -> None:
    version = system.get(b"version")
    if version is None:
        raise Refused(f"<system> without a version attribute ({reader.where()})")
    if c_int(version) != TOPO_XML_VERSION:
        raise Refused(f"<system version=\"{_show(version)}\">: NCCL reads version {TOPO_XML_VERSION} only")


class TopologyRead(Struct, frozen=True):
    """What the releases make of a file: the newest release's kept elements when every release
    reads it, why every release refuses it, or why the verdict depends on the release."""

    roots: list[XmlNode]
    refused: str = ""
    unsure: str = ""


def read_topology(data: bytes) -> TopologyRead:
    """``data`` read under every release's rules (see the module docstring)."""
    outcomes: list[tuple[str, list[XmlNode] | None, str]] = []  # (since, roots or None, why not)
    for rules in RELEASES:
        try:
            outcomes.append((rules.since, read_xml(data, rules), ""))
        except TooBig as error:
            return TopologyRead([], unsure=f"not judged: {error}")
        except Refused as error:
            outcomes.append((rules.since, None, str(error)))
        except Undefined as error:
            outcomes.append((rules.since, None, f"undefined: {error}"))
    newest = outcomes[-1][1]
    if all(roots is not None for _, roots, _ in outcomes) and newest is not None:
        return TopologyRead(newest)
    if all(roots is None and not why.startswith("undefined") for _, roots, why in outcomes):
        return TopologyRead([], refused=outcomes[-1][2])
    return TopologyRead([], unsure="NCCL releases differ on this file: " + "; ".join(_ranges(outcomes)))


def _ranges(outcomes: list[tuple[str, list[XmlNode] | None, str]]) -> list[str]:
    """'2.7.8 to before 2.27.3: refused (...)' for each run of releases with one outcome."""
    runs: list[tuple[str, str, str]] = []  # (first release, next row's release, outcome)
    for index, (since, roots, why) in enumerate(outcomes):
        until = outcomes[index + 1][0] if index + 1 < len(outcomes) else ""
        said = "read" if roots is not None else why if why.startswith("undefined") else f"refused ({why})"
        if runs and runs[-1][2] == said:
            runs[-1] = (runs[-1][0], until, said)
        else:
            runs.append((since, until, said))
    return [f"{first} {'to before ' + until if until else 'and later'}: {said}" for first, until, said in runs]
