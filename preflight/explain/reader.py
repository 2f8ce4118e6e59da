"""Stream log inputs as chunks of whole lines, in bounded memory.

Inputs are files (plain or gzip, recognised by their magic bytes, not their name), ``-`` for
stdin, or directories of per-rank logs (walked in name order). Whatever a user points
``explain`` at, the reader either streams it or names the problem: a missing file, a directory
it cannot list, a binary file, a corrupt gzip stream. A line longer than ``MAX_LINE`` is cut
into pieces of that size so a 50 MB single-line file cannot exhaust memory.
"""

from __future__ import annotations

import errno
import gzip
import os
import stat
import sys
import zlib
from dataclasses import dataclass, field
from typing import BinaryIO, Generator, Iterator, cast

CHUNK = 1 << 20
MAX_LINE = 64 * 1024
#: A gzip input stops after this many times its compressed size (real logs compress 5-30x; a
#: gzip bomb 1000x), and never below MIN_DECOMPRESSED (stdin's size is unknown).
MAX_RATIO = 100
MIN_DECOMPRESSED = 256 << 20
_GZIP_MAGIC = b"\x1f\x8b"
_BINARY_SAMPLE = 8192
#: Problems named one by one; a directory of checkpoints and core files would otherwise print a
#: line for each file it skipped and bury the explanation.
MAX_PROBLEMS = 20
#: A directory walk stops here: one log per rank of a 100,000-GPU job, in per-host folders.
MAX_WALK_FILES = 100_000
MAX_WALK_DEPTH = 16


@dataclass
class Chunk:
    """Whole lines from one input; ``first_line`` is the 1-based number of the first."""

    source: str
    data: bytes
    first_line: int


@dataclass
class ReadStats:
    files: int = 0
    lines: int = 0
    bytes: int = 0
    split_lines: int = 0
    problems: list[str] = field(default_factory=list)
    problems_left_out: int = 0

    def problem(self, text: str) -> None:
        """Record an input that could not be read in full; past ``MAX_PROBLEMS`` only count it."""
        if len(self.problems) < MAX_PROBLEMS:
            self.problems.append(text)
        else:
            self.problems_left_out += 1

    def problem_lines(self) -> list[str]:
        """The problems to show, the count of those not named last."""
        if not self.problems_left_out:
            return list(self.problems)
        return [*self.problems, f"{self.problems_left_out} more input problem(s) not listed"]


def iter_inputs(paths: list[str], stats: ReadStats, stdin: BinaryIO | None = None) -> Iterator[Chunk]:
    """Chunks of every input in order; problems go to ``stats.problems`` instead of raising."""
    for path in paths or ["-"]:
        if path == "-":
            yield from _stream("<stdin>", stdin or sys.stdin.buffer, stats)
        elif os.path.isdir(path):
            yield from _walk(path, stats)
        else:
            yield from _open_and_stream(path, stats)


def _walk(directory: str, stats: ReadStats) -> Iterator[Chunk]:
    def on_error(error: OSError) -> None:
        stats.problem(f"{error.filename}: cannot list ({_reason(error)})")

    base_depth = directory.rstrip(os.sep).count(os.sep)
    seen = 0
    problems_before = len(stats.problems) + stats.problems_left_out
    for folder, subfolders, files in os.walk(directory, onerror=on_error):
        if folder.count(os.sep) - base_depth >= MAX_WALK_DEPTH and subfolders:
            stats.problem(f"{folder}: more than {MAX_WALK_DEPTH} folders deep; its subfolders were not read")
            subfolders.clear()
        subfolders.sort()
        for name in sorted(files):
            path = os.path.join(folder, name)
            if not os.path.isfile(path):
                continue
            if seen == MAX_WALK_FILES:
                stats.problem(f"{directory}: more than {MAX_WALK_FILES} files; read the first {MAX_WALK_FILES} in name order")
                return
            seen += 1
            yield from _open_and_stream(path, stats)
    if not seen and len(stats.problems) + stats.problems_left_out == problems_before:
        stats.problem(f"{directory}: no files in it")


def _open_and_stream(path: str, stats: ReadStats) -> Iterator[Chunk]:
    try:
        # Non-blocking, then checked: opening a FIFO for reading would wait for a writer forever,
        # and a device node can be endless or act when opened. Only regular files are read
        # (``-`` reads stdin, which may be a pipe on purpose).
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as error:
        stats.problem(f"{path}: cannot read ({_reason(error)})")
        return
    mode = os.fstat(descriptor).st_mode
    if not stat.S_ISREG(mode):
        os.close(descriptor)
        kind = "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "a device node"
        stats.problem(f"{path}: not a regular file ({kind}); not read (use - for a pipe)")
        return
    with os.fdopen(descriptor, "rb") as handle:
        yield from _stream(path, handle, stats, os.fstat(descriptor).st_size)


def _stream(name: str, handle: BinaryIO, stats: ReadStats, compressed_size: int = 0) -> Iterator[Chunk]:
    try:
        head = handle.read(_BINARY_SAMPLE)
    except OSError as error:
        stats.problem(f"{name}: cannot read ({_reason(error)})")
        return
    source: BinaryIO = handle
    if head.startswith(_GZIP_MAGIC):
        unpacked = cast(BinaryIO, gzip.GzipFile(fileobj=cast(BinaryIO, _Prepend(head, handle)), mode="rb"))
        source = cast(BinaryIO, _Capped(unpacked, name, max(MIN_DECOMPRESSED, MAX_RATIO * compressed_size), stats))
        try:
            head = source.read(_BINARY_SAMPLE)
        except (OSError, EOFError, zlib.error) as error:
            stats.problem(f"{name}: not a readable gzip stream ({error})")
            return
    if _is_binary(head):
        stats.problem(f"{name}: binary data, not a text log (skipped)")
        return
    stats.files += 1
    yield from _lines_in_chunks(name, head, source, stats)


def _lines_in_chunks(name: str, head: bytes, source: BinaryIO, stats: ReadStats) -> Iterator[Chunk]:
    pending = head
    line_number = 1
    while True:
        try:
            block = source.read(CHUNK)
        except (OSError, EOFError, zlib.error) as error:
            stats.problem(f"{name}: read failed after {stats.bytes} bytes ({error}); scanned what came before")
            block = b""
        data = pending + block
        if not block:
            if data:
                yield from _emit(name, data if data.endswith(b"\n") else data + b"\n", line_number, stats)
            return
        cut = data.rfind(b"\n") + 1
        if cut == 0:
            # An endless line: scan it in MAX_LINE pieces so memory stays bounded.
            whole = len(data) - len(data) % MAX_LINE
            for offset in range(0, whole, MAX_LINE):
                stats.split_lines += 1
                yield from _emit(name, data[offset : offset + MAX_LINE] + b"\n", line_number, stats, counts_lines=False)
            pending = data[whole:]
            continue
        complete, pending = data[:cut], data[cut:]
        line_number += yield from _emit(name, complete, line_number, stats)


def _emit(name: str, data: bytes, first_line: int, stats: ReadStats, counts_lines: bool = True) -> Generator[Chunk, None, int]:
    """Yield one chunk; returns how many lines it advanced the count by."""
    lines = data.count(b"\n") if counts_lines else 0
    stats.lines += lines
    stats.bytes += len(data)
    yield Chunk(name, data, first_line)
    return lines


def _is_binary(head: bytes) -> bool:
    """NUL bytes or mostly control bytes: an executable, a core file, a tarball."""
    if b"\x00" in head:
        return True
    if not head:
        return False
    control = sum(1 for byte in head if byte < 9 or 13 < byte < 27 or 27 < byte < 32)
    return control > len(head) // 10


def _reason(error: OSError) -> str:
    if error.errno is not None and error.errno in errno.errorcode:
        return f"{error.strerror or os.strerror(error.errno)} ({errno.errorcode[error.errno]})"
    return str(error)


class _Capped:
    """A decompressed stream that ends, with a note in the stats, after ``limit`` bytes."""

    def __init__(self, source: BinaryIO, name: str, limit: int, stats: ReadStats) -> None:
        self._source, self._name, self._left, self._stats = source, name, limit, stats
        self._limit = limit

    def read(self, size: int = -1) -> bytes:
        if self._left <= 0:
            return b""
        data = self._source.read(min(size if size >= 0 else CHUNK, self._left))
        self._left -= len(data)
        if self._left <= 0:
            self._stats.problem(
                f"{self._name}: decompresses to more than {self._limit >> 20} MiB ({MAX_RATIO} times its size, a gzip "
                "bomb or an unusual log); scanned the first part only"
            )
        return data

    def readable(self) -> bool:
        return True


class _Prepend:
    """A file-like object that first returns ``head``, then the rest of ``handle``."""

    def __init__(self, head: bytes, handle: BinaryIO) -> None:
        self._head = head
        self._handle = handle

    def read(self, size: int = -1) -> bytes:
        if self._head:
            if size < 0:
                data, self._head = self._head + self._handle.read(), b""
                return data
            data, self._head = self._head[:size], self._head[size:]
            return data
        return self._handle.read(size)

    def readable(self) -> bool:
        return True
