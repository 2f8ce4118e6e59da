#!/usr/bin/env python3
"""Extract the log-message format strings that NCCL prints, from every release tag in a range.

Usage::

    python3 references/coverage/extract_nccl.py /work/.mirror/NVIDIA+nccl/repo

The argument is a git directory (bare or not) of NVIDIA/nccl with its release tags. For every tag
from ``--first`` to ``--last`` (ordered by version) the script reads the C/C++/CUDA sources under
``src/`` straight from git (nothing is checked out), plus the C code that build-time generator
scripts there hold in their string literals, and collects the format string of

* every ``WARN(...)`` call;
* every ``INFO(...)``, ``INFO_LOC(...)`` and ``INFO_LOC_FN(...)`` call that sits inside a
  ``#define`` body (the failure-reporting macros of ``checks.h`` and their kind: back traces such
  as ``%s:%d -> %d``, "Call to ... returned %s, retrying"), except in the definitions of the
  logging macros themselves;
* every other INFO-family call whose format contains one of the words of :data:`INFO_KEYWORDS`
  ("failed", "error", "HINT", ...) or of :data:`CONDITION_WORDS` ("could not", "disabled",
  "not found", ...), ignoring case, or, in the InfiniBand verbs, ``net_ib`` and socket code,
  names an ``NCCL_`` setting (the hints NCCL prints next to a failure).

Adjacent string literals are joined, continued lines spliced and C escapes decoded. Conversions
are kept as written; ``PRIu64``-style macros become what they expand to on Linux x86-64 (``lu``),
and a macro that names a string literal (``#define SYMBOL "text"``) becomes that text. When a
checking macro pastes one of its parameters into the format (``"Call to " name " failed: %s"``
in ``SYSCHECK``, ``#name "() failed: %s"`` in the NVML wrapper) the macro's own format is
recorded with ``%s`` in that place, and so is every call site's format with the argument it
passes (``Call to bind failed: %s``), following macros that hand the parameter on to another
macro. Any other identifier pasted into a literal becomes ``%s``. A call whose format is not
made of literals (``WARN(msg)``) has no format to record and is skipped.

Released tags stop where the mirror's tags stop; ``--pre-release`` adds one untagged commit after
them (by default the newest commit of the ``dev`` branch the mirror holds), named by the version
its ``makefiles/version.mk`` gives (``v2.31.0a7-1``), so that messages of a release still in
development are decided before logs carry them.

Formats are deduplicated by their text; each record gives the macro (``WARN`` when any
occurrence is a WARN, else ``INFO``), the file of the newest tag that has it (the first in sort
order when several do), and the first and last tag that contain it. The result is written,
sorted by text, to ``nccl-formats.json`` beside this script (or ``--output``).

Only message formats, paths and tag names are recorded; no NCCL code is copied.
"""

from __future__ import annotations

import argparse
import bisect
import json
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Union

FIRST_TAG = "v2.4.2-1"
LAST_TAG = "v2.30.7-1"
#: The dev branch of NVIDIA/nccl on 2026-06-13 (version.mk: 2.31.0a7), newer than every tag read.
PRE_RELEASE = "86fa684d3bd5b6ac3414d6d024fdc6f65441cb81"
SOURCE_DIR = "src"
SOURCE_SUFFIXES = (".h", ".hpp", ".hh", ".c", ".cc", ".cpp", ".cxx", ".cu", ".cuh", ".inl")
HEADER_SUFFIXES = (".h", ".hpp", ".hh", ".cuh", ".inl")
#: Build-time generators whose string literals hold C code that ends up in the library.
GENERATOR_SUFFIXES = (".py",)

#: Index of the format argument of each logging macro.
FORMAT_ARG = {"WARN": 0, "INFO": 1, "INFO_LOC": 1, "INFO_LOC_FN": 4}
LOGGING_MACROS = frozenset(FORMAT_ARG) | {"TRACE", "TRACE_CALL", "TRACE_LOC", "TRACE_LOC_FN", "VERSION"}
#: Words (matched ignoring case) that make an INFO format a failure report or a hint next to one.
INFO_KEYWORDS = re.compile(r"hint|failed|error|timeout|retrying|abort", re.IGNORECASE)
#: Words (ignoring case) of INFO formats that report a degraded condition NCCL works around: a
#: library or device it cannot open, a feature it disables, a value it cannot read or rejects.
CONDITION_WORDS = re.compile(r"could not|count not|cannot|can't|unable|disabled|not available|no device"
                             r"|not found|not supported|unsafe|mismatch|invalid|falling back|fall back",
                             re.IGNORECASE)
#: Path fragments of the code whose ``NCCL_`` hints are kept even without a keyword.
HINT_PATHS = ("ibvwrap", "net_ib", "socket")
#: What the ``<inttypes.h>`` format macros expand to on Linux x86-64 (glibc, LP64).
INTTYPES = {
    f"PRI{conv}{width}": ("l" if width == "64" else "") + conv
    for conv in "diouxX"
    for width in ("8", "16", "32", "64")
}
INTTYPES.update({f"PRI{conv}PTR": "l" + conv for conv in "diouxX"})
#: Rounds of following a parameter from one checking macro into another that calls it.
MAX_MACRO_NESTING = 5

VERSION_TAG = re.compile(r"^v(\d+)\.(\d+)\.(\d+)-(\d+)$")
#: A pre-release's name: its version.mk's version with the alpha suffix ("v2.31.0a7-1").
PRE_RELEASE_NAME = re.compile(r"^v(\d+)\.(\d+)\.(\d+)a(\d+)-(\d+)$")
ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "a": "\a", "b": "\b", "f": "\f", "v": "\v",
           "\\": "\\", "'": "'", '"': '"', "?": "?",
           "\n": ""}  # a backslash-newline inside a literal splices the two lines

# One token of C source after optional blanks.
TOKEN = re.compile(
    r"""
    [ \t\r\f\v]*
    (?:
      (?P<string>(?:u8|[uUL])?"(?:[^"\\\n]|\\.)*")
    | (?P<char>(?:u8|[uUL])?'(?:[^'\\\n]|\\.)*')
    | (?P<ident>[A-Za-z_]\w*)
    | (?P<number>\.?\d(?:[\w.]|[eEpP][+-])*)
    | (?P<continuation>\\\n)
    | (?P<newline>\n)
    | (?P<punct>\.\.\.|.)
    )
    """,
    re.VERBOSE | re.DOTALL,
)
#: String and character literals (kept) and comments (blanked out before anything else is read).
LITERAL_OR_COMMENT = re.compile(r"""(?P<literal>"(?:[^"\\\n]|\\.)*"|'(?:[^'\\\n]|\\.)*')|//[^\n]*|/\*.*?\*/""",
                                re.DOTALL)
#: A #define directive with its continuation lines.
DEFINE = re.compile(r"^[ \t]*#[ \t]*define[ \t]+(?P<name>\w+)(?P<params>\([^)\n]*\))?(?P<body>(?:[^\n]*\\\n)*[^\n]*)",
                    re.MULTILINE)
DEFINE_HEAD = re.compile(r"[ \t]*#[ \t]*define[ \t]+")
STRING_BODY = re.compile(r"""\s*("(?:[^"\\\n]|\\.)*")\s*""")
#: A single- or double-quoted Python string literal (generators quote C code with the other quote).
PYTHON_STRING = re.compile(r"""(?P<quote>['"])(?P<body>(?:(?!(?P=quote))[^\\\n]|\\.)*)(?P=quote)""")
#: A use of a logging macro.
LOGGING_USE = re.compile(r"\b(?:WARN|INFO|INFO_LOC|INFO_LOC_FN)\s*\(")
#: A use of an upper-case (macro) name.
MACRO_USE = re.compile(r"\b[A-Z][A-Z0-9_]*\s*\(")
#: Longest macro use read, in tokens (a guard against unbalanced parentheses).
MAX_USE_TOKENS = 4000


@dataclass(frozen=True)
class Token:
    kind: str
    text: str


@dataclass(frozen=True)
class Define:
    """A #define directive: the macro's name, its parameters and where its body lies."""

    name: str
    params: tuple[str, ...]
    function_like: bool
    body_start: int
    end: int


@dataclass(frozen=True)
class Pasted:
    """An identifier pasted between the literals of a format: a macro parameter or constant."""

    name: str
    stringized: bool  # written as #name: the spelling of the argument, not its value


Part = Union[str, Pasted]
Args = tuple[tuple[Token, ...], ...]


@dataclass(frozen=True)
class Call:
    """One logging call whose format argument is made of string literals (and pasted names)."""

    macro: str
    parts: tuple[Part, ...]
    define: str = ""
    params: tuple[str, ...] = ()
    via: str = ""  # the checking macro whose body holds the logging call, for a macro use

    @property
    def is_template(self) -> bool:
        """Whether the format pastes in a parameter of the macro whose body holds the call."""
        return any(isinstance(part, Pasted) and part.name in self.params for part in self.parts)


@dataclass(frozen=True)
class Invocation:
    """A use of a macro: its name, its arguments and the #define body it sits in, if any."""

    name: str
    args: Args
    define: str = ""
    params: tuple[str, ...] = ()


@dataclass
class BlobInfo:
    calls: list[Call] = field(default_factory=list)
    strings: dict[str, str] = field(default_factory=dict)  # #define NAME "literal"
    nested: list[Invocation] = field(default_factory=list)  # macro uses inside #define bodies


@dataclass
class Record:
    macros: set[str] = field(default_factory=set)
    tags: set[str] = field(default_factory=set)
    files: dict[str, set[str]] = field(default_factory=dict)  # tag -> paths


def version_key(tag: str) -> tuple[int, ...]:
    """Release order: an alpha of x.y.z sorts after every x.y'.z' before it and before x.y.z."""
    match = VERSION_TAG.match(tag)
    if match is not None:
        major, minor, patch, package = (int(part) for part in match.groups())
        return (major, minor, patch, 1, 0, package)
    alpha = PRE_RELEASE_NAME.match(tag)
    if alpha is None:
        raise ValueError(f"not a release tag: {tag}")
    major, minor, patch, number, package = (int(part) for part in alpha.groups())
    return (major, minor, patch, 0, number, package)


def pre_release_name(repo: Path, revision: str) -> str:
    """``v<major>.<minor>.<patch><suffix>-<package>`` from the commit's makefiles/version.mk."""
    text = git(repo, "show", f"{revision}:makefiles/version.mk").decode()
    fields = dict(re.findall(r"(?m)^(NCCL_MAJOR|NCCL_MINOR|NCCL_PATCH|NCCL_SUFFIX|PKG_REVISION)\s*:=\s*(\S*)", text))
    name = f"v{fields['NCCL_MAJOR']}.{fields['NCCL_MINOR']}.{fields['NCCL_PATCH']}{fields.get('NCCL_SUFFIX', '')}-{fields.get('PKG_REVISION', '1')}"
    version_key(name)  # a version this script can order, or ValueError
    return name


def git(repo: Path, *args: str, data: bytes | None = None) -> bytes:
    result = subprocess.run(["git", "-C", str(repo), *args], input=data, capture_output=True, check=True)
    return result.stdout


def release_tags(repo: Path, first: str, last: str) -> list[str]:
    """Every ``vX.Y.Z-N`` tag from ``first`` to ``last`` inclusive, oldest first."""
    low, high = version_key(first), version_key(last)
    names = git(repo, "tag", "--list").decode().split()
    tags = [name for name in names if VERSION_TAG.match(name) and low <= version_key(name) <= high]
    return sorted(tags, key=version_key)


def source_blobs(repo: Path, tag: str) -> dict[str, str]:
    """Path -> blob id of every C/C++/CUDA source (and generator script) under ``src/`` in ``tag``."""
    listing = git(repo, "ls-tree", "-r", "-z", tag, "--", SOURCE_DIR).decode()
    blobs: dict[str, str] = {}
    for entry in filter(None, listing.split("\0")):
        meta, path = entry.split("\t", 1)
        _mode, kind, blob = meta.split()
        if kind == "blob" and path.endswith(SOURCE_SUFFIXES + GENERATOR_SUFFIXES):
            blobs[path] = blob
    return blobs


def read_blobs(repo: Path, blobs: Iterable[str]) -> dict[str, str]:
    """Contents of the given blobs, read in one ``git cat-file --batch`` run."""
    wanted_blobs = sorted(set(blobs))
    output = git(repo, "cat-file", "--batch", data="".join(f"{blob}\n" for blob in wanted_blobs).encode())
    contents: dict[str, str] = {}
    position = 0
    for blob in wanted_blobs:
        header_end = output.index(b"\n", position)
        name, kind, size = output[position:header_end].decode().split()
        if name != blob or kind != "blob":
            raise RuntimeError(f"unexpected cat-file header for {blob}: {name} {kind}")
        start = header_end + 1
        contents[blob] = output[start:start + int(size)].decode("utf-8", errors="replace")
        position = start + int(size) + 1
    return contents


def c_sources(text: str, generator: bool) -> list[str]:
    """The C code in a file: the file itself, or the string literals of a generator script."""
    if not generator:
        return [text]
    bodies = (match.group("body") for match in PYTHON_STRING.finditer(text))
    return [body.replace("\\\\", "\\") for body in bodies if "(" in body]


class Source:
    """One C source with its comments blanked out and its literals and #define directives located."""

    def __init__(self, text: str) -> None:
        pieces: list[str] = []
        self.literals: list[tuple[int, int]] = []
        position = 0
        for match in LITERAL_OR_COMMENT.finditer(text):
            pieces.append(text[position:match.start()])
            if match.group("literal") is not None:
                self.literals.append(match.span())
                pieces.append(match.group())
            else:  # same length, line breaks kept, so positions and line structure stay valid
                pieces.append(re.sub(r"[^\n]", " ", match.group()))
            position = match.end()
        pieces.append(text[position:])
        self.text = "".join(pieces)
        self.literal_starts = [start for start, _ in self.literals]
        self.defines: list[Define] = []
        for match in DEFINE.finditer(self.text):
            raw = match.group("params")
            params = tuple("__VA_ARGS__" if name.strip() == "..." else name.strip()
                           for name in (raw[1:-1].split(",") if raw else []) if name.strip())
            self.defines.append(Define(match.group("name"), params, raw is not None,
                                       match.start("body"), match.end()))
        self.define_starts = [define.body_start for define in self.defines]

    def in_literal(self, position: int) -> bool:
        index = bisect.bisect_right(self.literal_starts, position) - 1
        return index >= 0 and position < self.literals[index][1]

    def is_define_head(self, position: int) -> bool:
        """Whether ``position`` is the name of the macro a #define directive defines."""
        line_start = self.text.rfind("\n", 0, position) + 1
        return DEFINE_HEAD.fullmatch(self.text, line_start, position) is not None

    def define_at(self, position: int) -> Define | None:
        index = bisect.bisect_right(self.define_starts, position) - 1
        if index >= 0 and position < self.defines[index].end:
            return self.defines[index]
        return None

    def uses(self, pattern: re.Pattern[str], start: int = 0, end: int | None = None) -> Iterable[Invocation]:
        """Macro uses whose name and '(' the pattern finds, outside string literals."""
        for match in pattern.finditer(self.text, start, len(self.text) if end is None else end):
            if self.in_literal(match.start()) or self.is_define_head(match.start()):
                continue
            name = match.group().rstrip("( \t\r\n")
            arguments = self.arguments(match.end() - 1)
            if arguments is None:
                continue
            define = self.define_at(match.start())
            if define is None:
                yield Invocation(name, arguments)
            elif define.name != name:
                yield Invocation(name, arguments, define.name, define.params)

    def arguments(self, open_paren: int) -> Args | None:
        """The comma-separated arguments of the parenthesis opened at ``open_paren``."""
        depth = 0
        arguments: list[list[Token]] = [[]]
        for count, match in enumerate(TOKEN.finditer(self.text, open_paren)):
            kind = match.lastgroup or "punct"
            if count > MAX_USE_TOKENS:
                return None
            if kind in ("newline", "continuation"):
                continue
            text = match.group(kind)
            if kind == "punct" and text in "([{":
                depth += 1
                if depth == 1:
                    continue
            elif kind == "punct" and text in ")]}":
                depth -= 1
                if depth == 0:
                    return tuple(tuple(argument) for argument in arguments)
            elif kind == "punct" and text == "," and depth == 1:
                arguments.append([])
                continue
            arguments[-1].append(Token(kind, text))
        return None


def decode_literal(literal: str) -> str:
    """The characters a C string literal stands for."""
    body = literal[literal.index('"') + 1:-1]
    out: list[str] = []
    index = 0
    while index < len(body):
        char = body[index]
        if char != "\\":
            out.append(char)
            index += 1
            continue
        escape = body[index + 1]
        if escape in ESCAPES:
            out.append(ESCAPES[escape])
            index += 2
        elif escape == "x":
            digits = re.match(r"[0-9A-Fa-f]+", body[index + 2:])
            assert digits is not None, literal
            out.append(chr(int(digits.group(), 16)))
            index += 2 + len(digits.group())
        else:
            digits = re.match(r"[0-7]{1,3}", body[index + 1:])
            assert digits is not None, literal
            out.append(chr(int(digits.group(), 8)))
            index += 1 + len(digits.group())
    return "".join(out)


def format_parts(argument: tuple[Token, ...]) -> tuple[Part, ...] | None:
    """The pieces of a format argument made of adjacent literals, or None when it is not one."""
    if not argument or not any(token.kind == "string" for token in argument):
        return None
    parts: list[Part] = []
    for index, token in enumerate(argument):
        if token.kind == "string":
            parts.append(decode_literal(token.text))
        elif token.kind == "ident" and token.text in INTTYPES:
            parts.append(INTTYPES[token.text])
        elif token.kind == "ident":
            parts.append(Pasted(token.text, index > 0 and argument[index - 1].text == "#"))
        elif token.text == "#" and index + 1 < len(argument) and argument[index + 1].kind == "ident":
            continue  # the stringizing operator: #name prints the macro argument's spelling
        else:
            return None
    return tuple(parts)


def analyse(text: str) -> BlobInfo:
    """Logging calls, string constants and macro uses inside macro bodies of one C source."""
    info = BlobInfo()
    if "WARN" not in text and "INFO" not in text and "#define" not in text:
        return info
    source = Source(text)
    for use in source.uses(LOGGING_USE):
        position = FORMAT_ARG[use.name]
        parts = format_parts(use.args[position]) if len(use.args) > position else None
        if parts is not None:
            info.calls.append(Call(use.name, parts, use.define, use.params))
    for define in source.defines:
        body = source.text[define.body_start:define.end]
        literal = STRING_BODY.fullmatch(body.replace("\\\n", " "))
        if not define.function_like and literal is not None:
            info.strings[define.name] = decode_literal(literal.group(1))
        for use in source.uses(MACRO_USE, define.body_start, define.end):
            if use.name not in FORMAT_ARG:
                info.nested.append(use)
    return info


def argument_part(argument: tuple[Token, ...], stringized: bool, use: Invocation,
                  strings: dict[str, str]) -> Part:
    """What a macro argument puts into a format where the macro pastes the parameter."""
    if len(argument) == 1 and argument[0].kind == "ident" and argument[0].text in use.params:
        return Pasted(argument[0].text, stringized)  # handed on from the enclosing macro
    if stringized:
        return " ".join(token.text for token in argument)
    if argument and all(token.kind == "string" for token in argument):
        return "".join(decode_literal(token.text) for token in argument)
    if len(argument) == 1 and argument[0].text in strings:
        return strings[argument[0].text]
    return "%s"


def substitute(template: Call, use: Invocation, strings: dict[str, str]) -> Call:
    """The call a checking macro makes when it is used with the arguments of ``use``."""
    parts: list[Part] = []
    for part in template.parts:
        if isinstance(part, Pasted) and part.name in template.params:
            position = template.params.index(part.name)
            if part.name == "__VA_ARGS__" or position >= len(use.args):
                parts.append("%s")
            else:
                parts.append(argument_part(use.args[position], part.stringized, use, strings))
        else:
            parts.append(part)
    return Call(template.macro, tuple(parts), use.define, use.params, template.via or template.define)


def render(call: Call, strings: dict[str, str]) -> str:
    """The format text of a call: pasted constants resolved, anything else as ``%s``."""
    out: list[str] = []
    for part in call.parts:
        if isinstance(part, str):
            out.append(part)
        elif not part.stringized and part.name not in call.params and part.name in strings:
            out.append(strings[part.name])
        else:
            out.append("%s")
    return "".join(out)


def wanted(call: Call, path: str, text: str) -> bool:
    """Whether a call prints a failure (or a hint next to one) and belongs in the table."""
    if call.define in LOGGING_MACROS:
        return False  # the logging macros' own definitions (INFO_LOC_FN's location prefix)
    if call.macro == "WARN" or call.define or call.via:
        return True
    if INFO_KEYWORDS.search(text) or CONDITION_WORDS.search(text):
        return True
    return "NCCL_" in text and any(part in path for part in HINT_PATHS)


class Extractor:
    """Reads the tags of one repository, caching what each distinct file version holds."""

    def __init__(self, repo: Path, tags: list[str], revisions: dict[str, str] | None = None) -> None:
        self.repo = repo
        self.tags = tags
        revisions = revisions or {}  # name -> commit, for names that are no tag (a pre-release)
        self.per_tag = {tag: source_blobs(repo, revisions.get(tag, tag)) for tag in tags}
        everything = (blob for blobs in self.per_tag.values() for blob in blobs.values())
        self.contents = read_blobs(repo, everything)
        self.infos: dict[tuple[str, bool], BlobInfo] = {}
        self.uses: dict[tuple[str, bool, frozenset[str]], list[Invocation]] = {}

    def sources(self, blob: str, path: str) -> tuple[tuple[str, bool], list[str]]:
        generator = path.endswith(GENERATOR_SUFFIXES)
        return (blob, generator), c_sources(self.contents[blob], generator)

    def info(self, blob: str, path: str) -> BlobInfo:
        key, sources = self.sources(blob, path)
        if key not in self.infos:
            merged = BlobInfo()
            for source in sources:
                part = analyse(source)
                merged.calls.extend(part.calls)
                merged.strings.update(part.strings)
                merged.nested.extend(part.nested)
            self.infos[key] = merged
        return self.infos[key]

    def macro_uses(self, blob: str, path: str, names: frozenset[str]) -> list[Invocation]:
        """Uses of the checking macros ``names`` in one file (cached per file version)."""
        (blob_key, generator), sources = self.sources(blob, path)
        key = (blob_key, generator, names)
        if key not in self.uses:
            found: list[Invocation] = []
            pattern = re.compile(r"\b(?:" + "|".join(sorted(names)) + r")\s*\(")
            for source in sources:
                if pattern.search(source):
                    found.extend(Source(source).uses(pattern))
            self.uses[key] = found
        return self.uses[key]

    def templates(self, tag: str, strings: dict[str, str]) -> dict[str, list[tuple[str, Call]]]:
        """Checking macros of a tag that paste a parameter into a format, with where they are defined."""
        found: dict[str, list[tuple[str, Call]]] = {}
        blobs = self.per_tag[tag]
        for path, blob in sorted(blobs.items()):
            for call in self.info(blob, path).calls:
                if call.is_template and call.define not in LOGGING_MACROS:
                    found.setdefault(call.define, []).append((path, call))
        for _ in range(MAX_MACRO_NESTING):
            added = False
            for path, blob in sorted(blobs.items()):
                for use in self.info(blob, path).nested:
                    for _, template in definitions(found, use.name, path):
                        call = substitute(template, use, strings)
                        entry = (path, call)
                        if call.is_template and entry not in found.get(use.define, []):
                            found.setdefault(use.define, []).append(entry)
                            added = True
            if not added:
                break
        return found

    def calls(self, tag: str) -> Iterable[tuple[str, Call, str]]:
        """(path, call, format text) of every logging call a tag makes, macro uses expanded."""
        blobs = self.per_tag[tag]
        strings: dict[str, str] = {}
        for path, blob in sorted(blobs.items(), reverse=True):
            strings.update(self.info(blob, path).strings)
        templates = self.templates(tag, strings)
        names = frozenset(templates)
        for path, blob in sorted(blobs.items()):
            for call in self.info(blob, path).calls:
                yield path, call, render(call, strings)
            if not names:
                continue
            for use in self.macro_uses(blob, path, names):
                for _, template in definitions(templates, use.name, path):
                    call = substitute(template, use, strings)
                    if not call.is_template:
                        yield path, call, render(call, strings)


def definitions(templates: dict[str, list[tuple[str, Call]]], name: str, path: str) -> list[tuple[str, Call]]:
    """The definitions of macro ``name`` that a use in ``path`` sees: its own file's, else the headers'."""
    entries = templates.get(name, [])
    local = [entry for entry in entries if entry[0] == path]
    if local:
        return local
    return [entry for entry in entries if entry[0].endswith(HEADER_SUFFIXES)]


def collect(repo: Path, tags: list[str], revisions: dict[str, str] | None = None) -> dict[str, Record]:
    extractor = Extractor(repo, tags, revisions)
    records: dict[str, Record] = {}
    for tag in tags:
        for path, call, text in extractor.calls(tag):
            if not wanted(call, path, text):
                continue
            record = records.setdefault(text, Record())
            record.macros.add("WARN" if call.macro == "WARN" else "INFO")
            record.tags.add(tag)
            record.files.setdefault(tag, set()).add(path)
    return records


def table(records: dict[str, Record]) -> list[dict[str, str]]:
    rows: list[dict[str, str]] = []
    for text, record in records.items():
        ordered = sorted(record.tags, key=version_key)
        rows.append({
            "text": text,
            "macro": "WARN" if "WARN" in record.macros else "INFO",
            "file": min(record.files[ordered[-1]]),
            "first": ordered[0],
            "last": ordered[-1],
        })
    return sorted(rows, key=lambda row: (row["text"], row["macro"]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("repo", type=Path, help="git directory of NVIDIA/nccl with its release tags")
    parser.add_argument("--first", default=FIRST_TAG, help=f"oldest tag to read (default {FIRST_TAG})")
    parser.add_argument("--last", default=LAST_TAG, help=f"newest tag to read (default {LAST_TAG})")
    parser.add_argument("--pre-release", default=PRE_RELEASE, metavar="COMMIT",
                        help=f"untagged commit read after the tags, '' for none (default {PRE_RELEASE[:12]}, dev)")
    parser.add_argument("--output", type=Path, default=Path(__file__).with_name("nccl-formats.json"))
    args = parser.parse_args(argv)

    tags = release_tags(args.repo, args.first, args.last)
    if not tags:
        parser.error(f"no release tags between {args.first} and {args.last} in {args.repo}")
    revisions: dict[str, str] = {}
    if args.pre_release:
        name = pre_release_name(args.repo, args.pre_release)
        if version_key(name) <= version_key(tags[-1]):
            parser.error(f"{args.pre_release} is {name}, not newer than {tags[-1]}")
        revisions[name] = args.pre_release
        tags.append(name)
    rows = table(collect(args.repo, tags, revisions))
    document = {
        "source": "https://github.com/NVIDIA/nccl",
        "generator": "references/coverage/extract_nccl.py",
        "tags": tags,
        "pre_releases": dict(revisions),
        "formats": rows,
    }
    args.output.write_text(json.dumps(document, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    counts: dict[str, int] = {}
    for row in rows:
        counts[row["macro"]] = counts.get(row["macro"], 0) + 1
    summary = ", ".join(f"{macro} {count}" for macro, count in sorted(counts.items()))
    print(f"{len(rows)} formats from {len(tags)} tags ({tags[0]} .. {tags[-1]}): {summary}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
