"""Snapshot archives: a recorded root packed as a ``.tar.gz``, and opened again for replay.

Writing goes to a temporary file beside the destination that replaces it only when complete, so
a full disk or a killed run never leaves a truncated snapshot under the requested name.

Opening extracts into a private temporary directory (mode 0700) that is removed afterwards, and
trusts nothing in the archive: member names must be relative without ``..``; only regular files,
directories and symbolic links are accepted (no hard links, devices or FIFOs); a relative link
target must stay inside the archive (an absolute one means a path *inside* the recorded root, as
in any recorded root, and preflight's filesystem view never follows it out); nothing is written
through a link extracted earlier; duplicates are refused; member count, total size, path depth, the size of
every header record (GNU long names, pax headers) and the time taken are capped, all checked
while the stream is read, before anything is kept in memory or on disk. Clean-up never recurses
and also runs when SIGTERM ends the run.
"""

from __future__ import annotations

import os
import stat as stat_codes
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import IO

from msgspec import Struct

from preflight.sources.fs import describe_os_error

ARCHIVE_SUFFIXES = (".tar.gz", ".tgz")
#: Recorded roots are shallow (the deepest sysfs path of a real node has about 20 components);
#: deeper members are refused, so that nothing deep is ever created or has to be cleaned up.
MAX_DEPTH = 64
MAX_NAME_CHARACTERS = 4096
#: A snapshot of an 8-GPU node is well under 1 MB; these caps stop archive bombs, not snapshots.
MAX_MEMBERS = 200_000
MAX_TOTAL_BYTES = 512 << 20
_COPY_CHUNK = 1 << 16
_GZIP_MAGIC = b"\x1f\x8b"


class ArchiveError(Exception):
    """The archive cannot be written or opened; the message is shown to the user as is."""


class Member(Struct, frozen=True):
    """One entry of a recorded root: ``path`` relative to the root (``sys/class/net``)."""

    path: str
    kind: str  # "file" | "dir" | "link"
    data: bytes = b""
    target: str = ""  # of a link


def write_archive(destination: str, members: Iterable[Member], mtime: float) -> int:
    """Write ``members`` as a gzip-compressed tar at ``destination``; its size in bytes."""
    import gzip
    import io
    import tarfile
    import tempfile

    directory = os.path.dirname(os.path.abspath(destination))
    try:
        if os.path.isdir(destination):
            raise IsADirectoryError(21, "Is a directory")
        handle, temporary = tempfile.mkstemp(prefix=".preflight-snapshot-", suffix=".part", dir=directory)
    except OSError as error:
        raise ArchiveError(f"cannot write {destination}: {describe_os_error(error)}") from None
    try:
        with os.fdopen(handle, "wb") as raw:
            with gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=int(mtime), compresslevel=6) as packed:
                with tarfile.open(fileobj=packed, mode="w", format=tarfile.GNU_FORMAT) as tar:
                    for member in sorted(members, key=lambda item: item.path):
                        info = tarfile.TarInfo(member.path)
                        info.mtime = int(mtime)
                        if member.kind == "dir":
                            info.type, info.mode = tarfile.DIRTYPE, 0o755
                            tar.addfile(info)
                        elif member.kind == "link":
                            info.type, info.mode, info.linkname = tarfile.SYMTYPE, 0o777, member.target
                            tar.addfile(info)
                        else:
                            info.size, info.mode = len(member.data), 0o644
                            tar.addfile(info, io.BytesIO(member.data))
        size = os.path.getsize(temporary)
        os.replace(temporary, destination)
    except OSError as error:
        _remove_quietly(temporary)
        raise ArchiveError(f"cannot write {destination}: {describe_os_error(error)}") from None
    except BaseException:
        _remove_quietly(temporary)
        raise
    return size


def _remove_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def is_archive(root: str) -> bool:
    """True when ``--root`` names a file (an archive to extract) rather than a directory."""
    return os.path.isfile(root)


@contextmanager
def opened_root(root: str, deadline: float | None = None) -> Iterator[tuple[str, str]]:
    """``(directory, label)`` for ``--root``: a directory as it is, or an archive extracted into
    a private temporary directory that is removed on exit, also when SIGTERM or SIGINT ends the
    run. ArchiveError when it cannot be used, or when unpacking passes ``deadline``."""
    if not is_archive(root):
        yield root, root
        return
    import tempfile

    workspace = tempfile.mkdtemp(prefix="preflight-replay-")
    try:
        with _signals_end_the_run():
            # Named after the archive, so that evidence naming a recorded file says where it came from.
            base = os.path.basename(root)
            for suffix in (*ARCHIVE_SUFFIXES, ".tar"):
                if base.endswith(suffix):
                    base = base[: -len(suffix)]
                    break
            target = os.path.join(workspace, "".join(c if c.isalnum() or c in "-_." else "_" for c in base).strip(".") or "snapshot")
            os.mkdir(target, 0o700)
            extract_archive(root, target, deadline)
            yield target, os.path.abspath(root)
    finally:
        remove_tree(workspace)


@contextmanager
def _signals_end_the_run() -> Iterator[None]:
    """SIGTERM (Slurm's kill, systemd's stop) raises SystemExit in the main thread for the
    duration, so that the clean-up around it runs; SIGINT already raises KeyboardInterrupt."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def end(number: int, _frame: object) -> None:
        raise SystemExit(128 + number)

    previous = signal.signal(signal.SIGTERM, end)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def extract_archive(archive: str, destination: str, deadline: float | None = None) -> None:
    """Extract ``archive`` into the empty directory ``destination`` under the rules of the module
    docstring; ArchiveError naming the archive (and member) otherwise. ``deadline`` (a
    ``time.monotonic()`` value) bounds the time it may take."""

    def fail(reason: str) -> ArchiveError:
        return ArchiveError(f"--root {archive}: {reason}")

    try:
        handle = open(archive, "rb")  # noqa: SIM115 (closed below; the stream borrows it)
    except OSError as error:
        raise fail(f"cannot read it ({describe_os_error(error)})") from None
    with handle:
        if handle.read(2) != _GZIP_MAGIC:
            raise fail("neither a directory nor a snapshot archive (a gzip-compressed tar, as `preflight snapshot` writes)")
        handle.seek(0)
        members = 0
        total = 0
        try:
            for entry in _tar_entries(_GzipStream(handle, deadline)):
                members += 1
                if members > MAX_MEMBERS:
                    raise fail(f"more than {MAX_MEMBERS} members; refusing to extract it")
                name = _safe_name(entry.name)
                if name is None:
                    entry.skip()
                    continue  # the archive's own "." entry
                where = f"member {entry.name!r}"
                if entry.kind == "dir":
                    _make_directories(destination, name, where)
                elif entry.kind == "file":
                    total += entry.size
                    if total > MAX_TOTAL_BYTES:
                        raise fail(f"more than {MAX_TOTAL_BYTES >> 20} MiB uncompressed; refusing to extract it")
                    parent = _make_directories(destination, os.path.dirname(name), where)
                    _copy(entry, os.path.join(parent, os.path.basename(name)), where)
                elif entry.kind == "link":
                    _check_link(name, entry.linkname, where)
                    parent = _make_directories(destination, os.path.dirname(name), where)
                    try:
                        os.symlink(entry.linkname, os.path.join(parent, os.path.basename(name)))
                    except FileExistsError:
                        raise ArchiveError(f"{where}: duplicate entry") from None
                else:
                    raise ArchiveError(f"{where}: {entry.kind} entries are not allowed (only files, directories and symbolic links)")
        except ArchiveError as error:
            if str(error).startswith("--root"):
                raise
            raise fail(str(error)) from None
        except OSError as error:
            raise fail(f"cannot extract it ({describe_os_error(error)})") from None


# -- reading: a tar stream parsed here, so that every cap applies before anything is kept --------
# tarfile reads a GNU long name or a pax header whole into memory before any caller can look at
# it (a 1 MB archive can carry a 1 GiB name), so the archive is parsed by these few lines instead:
# the ustar/GNU/pax subset that archivers write for files, directories and symbolic links.
_BLOCK = 512
_TYPES = {b"0": "file", b"\0": "file", b"7": "file", b"5": "dir", b"2": "symlink-entry", b"1": "hard link",
          b"3": "device", b"4": "device", b"6": "FIFO"}
_KIND_NAMES = {"symlink-entry": "link"}
#: A GNU long name or link, or a pax extended header, is at most this long: PATH_MAX-sized names
#: and a few attributes. Larger ones are refused before they are read.
MAX_HEADER_RECORD_BYTES = 64 << 10


class _GzipStream:
    """The decompressed bytes of a gzip file (several members allowed), read in bounded steps
    with the deadline checked as it goes."""

    def __init__(self, handle: IO[bytes], deadline: float | None) -> None:
        import zlib

        self._zlib = zlib
        self._handle = handle
        self._deadline = deadline
        self._inflate = zlib.decompressobj(16 + zlib.MAX_WBITS)
        self._buffer = b""
        self._pending = b""  # compressed input not yet given to the decompressor
        self._eof = False

    def _fill(self, wanted: int) -> None:
        import time

        while len(self._buffer) < wanted and not self._eof:
            if self._deadline is not None and time.monotonic() > self._deadline:
                raise ArchiveError("unpacking did not finish within the --timeout")
            if not self._pending:
                self._pending = self._handle.read(_COPY_CHUNK)
                if not self._pending:
                    if not self._inflate.eof:
                        raise ArchiveError("corrupt or truncated archive (compressed data ends early)")
                    self._eof = True
                    break
            try:
                produced = self._inflate.decompress(self._pending, max(wanted - len(self._buffer), _COPY_CHUNK))
            except self._zlib.error as error:
                raise ArchiveError(f"corrupt or truncated archive ({error})") from None
            self._pending = self._inflate.unconsumed_tail
            self._buffer += produced
            if self._inflate.eof:
                rest = self._inflate.unused_data + self._pending
                self._pending = b""
                if rest.strip(b"\0"):  # another gzip member follows
                    self._inflate = self._zlib.decompressobj(16 + self._zlib.MAX_WBITS)
                    self._pending = rest
                else:
                    self._eof = True

    def read(self, size: int) -> bytes:
        """Exactly ``size`` bytes; ArchiveError when the stream ends first."""
        self._fill(size)
        if len(self._buffer) < size:
            raise ArchiveError("corrupt or truncated archive (tar data ends early)")
        data, self._buffer = self._buffer[:size], self._buffer[size:]
        return data

    def at_end(self) -> bool:
        self._fill(1)
        return not self._buffer


class _Entry(Struct):
    """One tar member as the extractor sees it; ``read``/``skip`` consume its data."""

    name: str
    kind: str  # "file", "dir", "link" or a refused kind ("hard link", "device", "FIFO", "type 'S'")
    size: int
    linkname: str
    stream: _GzipStream
    left: int = 0

    def read(self, size: int) -> bytes:
        size = min(size, self.left)
        self.left -= size
        return self.stream.read(size)

    def skip(self) -> None:
        while self.left:
            self.read(_COPY_CHUNK)


def _tar_entries(stream: _GzipStream) -> Iterator[_Entry]:
    overrides: dict[str, str] = {}  # from a pax header or GNU long name/link, for the next member
    while True:
        if stream.at_end():
            raise ArchiveError("corrupt or truncated archive (no end-of-archive marker)")
        header = stream.read(_BLOCK)
        if header == bytes(_BLOCK):
            return  # end of archive; what follows (padding, a second zero block) is not read
        _check_checksum(header)
        size = _number(header[124:136])
        kind_byte = header[156:157]
        padded = -(-size // _BLOCK) * _BLOCK
        if kind_byte in (b"L", b"K", b"x", b"g"):
            if size > MAX_HEADER_RECORD_BYTES:
                raise ArchiveError(f"a {_RECORD_NAMES[kind_byte]} of {size} bytes (more than {MAX_HEADER_RECORD_BYTES}); refusing it")
            record = stream.read(padded)[:size]
            if kind_byte == b"L":
                overrides["path"] = _text(record.split(b"\0", 1)[0])
            elif kind_byte == b"K":
                overrides["linkpath"] = _text(record.split(b"\0", 1)[0])
            elif kind_byte == b"x":
                overrides.update(_pax_records(record))
            continue  # a global pax header ("g") changes nothing preflight reads
        name = _text(header[0:100].split(b"\0", 1)[0])
        if header[257:262] == b"ustar":
            prefix = _text(header[345:500].split(b"\0", 1)[0])
            name = f"{prefix}/{name}" if prefix else name
        name = overrides.pop("path", name)
        linkname = overrides.pop("linkpath", _text(header[157:257].split(b"\0", 1)[0]))
        if "size" in overrides:
            text = overrides.pop("size")
            # ASCII digits only: int() would take "-1000000000000", and a negative size would
            # lower the extraction total and the cap with it
            if not (text.isascii() and text.isdigit() and len(text) <= 20):
                raise ArchiveError("a pax header with a size that is not a number")
            size = int(text)
            padded = -(-size // _BLOCK) * _BLOCK
        overrides.clear()
        kind = _KIND_NAMES.get(_TYPES.get(kind_byte, ""), _TYPES.get(kind_byte, f"type {kind_byte!r}"))
        if kind != "file" and size and kind in ("dir", "link"):
            raise ArchiveError(f"member {name!r}: a {kind} with {size} bytes of data")
        entry = _Entry(name, kind, size, linkname, stream, left=size)
        yield entry
        entry.skip()
        stream.read(padded - size)


_RECORD_NAMES = {b"L": "GNU long name", b"K": "GNU long link name", b"x": "pax header", b"g": "global pax header"}


def _check_checksum(header: bytes) -> None:
    try:
        recorded = int(header[148:156].split(b"\0", 1)[0].strip() or b"-1", 8)
    except ValueError:
        raise ArchiveError("corrupt or truncated archive (a tar header's checksum is not a number)") from None
    unsigned = sum(header[:148]) + 8 * 32 + sum(header[156:])
    signed = unsigned - sum(b for b in header[:148] + header[156:] if b > 127) * 2  # old tars summed signed bytes
    if recorded not in (unsigned, signed):
        raise ArchiveError("corrupt or truncated archive (a tar header's checksum does not match)")


def _number(field: bytes) -> int:
    """A tar numeric field: octal text, or GNU base-256 (high bit set) for large values."""
    if field[:1] and field[0] & 0x80:
        if field[0] != 0x80:
            raise ArchiveError("a tar header with a negative size")
        return int.from_bytes(field[1:], "big")
    text = field.split(b"\0", 1)[0].strip()
    if text and not all(48 <= byte <= 55 for byte in text):  # octal digits only: no sign, no "0x"
        raise ArchiveError("corrupt or truncated archive (a tar header's size is not a number)")
    return int(text, 8) if text else 0


def _text(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ArchiveError(f"a member name that is not UTF-8 ({raw[:60]!r})") from None


def _pax_records(record: bytes) -> dict[str, str]:
    """``"%d %s=%s\\n"`` records of a pax extended header (POSIX.1-2001); the ones preflight uses."""
    found: dict[str, str] = {}
    offset = 0
    while offset < len(record) and record[offset:offset + 1] not in (b"", b"\0"):
        space = record.find(b" ", offset, offset + 20)
        try:
            length = int(record[offset:space])
        except ValueError:
            raise ArchiveError("a pax header record without its length") from None
        if space < 0 or length <= space - offset or offset + length > len(record):
            raise ArchiveError("a pax header record longer than its header")
        key, _, value = record[space + 1 : offset + length - 1].partition(b"=")
        if key in (b"path", b"linkpath", b"size"):
            found[key.decode("ascii")] = _text(value)
        offset += length
    return found


def _safe_name(name: str) -> str | None:
    """A member name as a clean relative path; None for the root itself; ArchiveError if unsafe."""
    if "\0" in name or not name:
        raise ArchiveError(f"member {name!r}: empty name or NUL byte")
    if name.startswith("/"):
        raise ArchiveError(f"member {name!r}: absolute path")
    parts = [part for part in name.split("/") if part not in ("", ".")]
    if ".." in parts:
        raise ArchiveError(f"member {name!r}: '..' in its path")
    if len(parts) > MAX_DEPTH or len(name) > MAX_NAME_CHARACTERS:
        raise ArchiveError(f"member {name[:80]!r}...: deeper than {MAX_DEPTH} directories or longer than {MAX_NAME_CHARACTERS} characters")
    return "/".join(parts) or None


def _check_link(name: str, target: str, where: str) -> None:
    if not target or "\0" in target:
        raise ArchiveError(f"{where}: empty link target or NUL byte")
    if target.startswith("/"):
        return  # inside the recorded root, as NodeFS resolves it
    depth = len(name.split("/")) - 1
    for part in target.split("/"):
        if part == "..":
            depth -= 1
            if depth < 0:
                raise ArchiveError(f"{where}: link to {target!r} points outside the snapshot")
        elif part not in ("", "."):
            depth += 1


def _make_directories(destination: str, relative: str, where: str) -> str:
    """Create ``relative`` under ``destination`` one component at a time, refusing to pass
    through anything but a real directory (a link extracted earlier must not redirect writes)."""
    current = destination
    for part in [p for p in relative.split("/") if p]:
        current = os.path.join(current, part)
        try:
            os.mkdir(current, 0o755)
        except FileExistsError:
            if not stat_codes.S_ISDIR(os.lstat(current).st_mode):
                raise ArchiveError(f"{where}: {relative} passes through a non-directory entry of the archive") from None
    return current


def _copy(source: _Entry, path: str, where: str) -> None:
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        handle = os.open(path, flags, 0o644)
    except FileExistsError:
        raise ArchiveError(f"{where}: duplicate entry") from None
    with os.fdopen(handle, "wb") as out:
        while source.left:
            out.write(source.read(_COPY_CHUNK))


#: remove_tree keeps at most this many directories open; a deeper subtree is moved up first.
_MAX_OPEN_LEVELS = 32


def remove_tree(path: str) -> None:
    """Remove ``path`` and everything below it, best effort: without recursion, without
    following links, at any depth (past PATH_MAX and the descriptor limit: a subtree deeper than
    ``_MAX_OPEN_LEVELS`` is moved up into ``path`` and taken apart from there). What cannot be
    removed stays, silently."""
    flags = os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        top = os.open(path, flags)
    except OSError:
        try:
            os.unlink(path)  # a file or a link in its place
        except OSError:
            pass
        return
    stack: list[tuple[int, str]] = [(top, "")]  # open directories, each with its name in the one above
    given_up: set[tuple[int, int]] = set()  # (device, inode) of directories that would not go
    moved = 0
    try:
        while stack:
            fd = stack[-1][0]
            child = _clear_files(fd, given_up)
            if child is None:  # nothing but what would not go is left in it
                identity = _identity(fd)
                _, name = stack.pop()
                os.close(fd)
                if stack:
                    try:
                        os.rmdir(name, dir_fd=stack[-1][0])
                    except OSError:
                        given_up.add(identity)
                continue
            try:
                if len(stack) < _MAX_OPEN_LEVELS:
                    stack.append((os.open(child, flags, dir_fd=fd), child))
                else:
                    moved += 1
                    os.rename(child, f".deep-{moved}", src_dir_fd=fd, dst_dir_fd=top)
            except OSError:
                given_up.add(_identity(fd, child))
    finally:
        for fd, _ in stack:
            os.close(fd)
    try:
        os.rmdir(path)
    except OSError:
        pass


def _clear_files(fd: int, given_up: set[tuple[int, int]]) -> str | None:
    """Unlink every non-directory in the directory ``fd``; the name of a subdirectory still to
    take apart, or None."""
    for entry in os.scandir(fd):
        try:
            if not entry.is_dir(follow_symlinks=False):
                os.unlink(entry.name, dir_fd=fd)
            elif _identity(fd, entry.name) not in given_up:
                return entry.name
        except OSError:
            continue
    return None


def _identity(fd: int, name: str | None = None) -> tuple[int, int]:
    try:
        status = os.fstat(fd) if name is None else os.stat(name, dir_fd=fd, follow_symlinks=False)
    except OSError:
        return (-1, -1)
    return status.st_dev, status.st_ino
