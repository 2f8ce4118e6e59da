"""Snapshot archives: a recorded root packed as a ``.tar.gz``, and opened again for replay.

Writing goes to a temporary file beside the destination that replaces it only when complete, so
a full disk or a killed run never leaves a truncated snapshot under the requested name.

Opening extracts into a private temporary directory (mode 0700) that is removed afterwards, and
trusts nothing in the archive: member names must be relative without ``..``; only regular files,
directories and symbolic links are accepted (no hard links, devices or FIFOs); a relative link
target must stay inside the archive (an absolute one means a path *inside* the recorded root, as
in any recorded root, and preflight's filesystem view never follows it out); nothing is written
through a link extracted earlier; duplicates are refused; member count and total size are capped.
"""

from __future__ import annotations

import os
import stat as stat_codes
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import IO, Any

from preflight.records import frozen
from preflight.sources.fs import describe_os_error

ARCHIVE_SUFFIXES = (".tar.gz", ".tgz")
#: A snapshot of an 8-GPU node is well under 1 MB; these caps stop archive bombs, not snapshots.
MAX_MEMBERS = 200_000
MAX_TOTAL_BYTES = 512 << 20
_COPY_CHUNK = 1 << 16
_GZIP_MAGIC = b"\x1f\x8b"


class ArchiveError(Exception):
    """The archive cannot be written or opened; the message is shown to the user as is."""


@frozen
class Member:
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
def opened_root(root: str) -> Iterator[tuple[str, str]]:
    """``(directory, label)`` for ``--root``: a directory as it is, or an archive extracted into
    a private temporary directory that is removed on exit. ArchiveError when it cannot be used."""
    if not is_archive(root):
        yield root, root
        return
    import shutil
    import tempfile

    workspace = tempfile.mkdtemp(prefix="preflight-replay-")
    try:
        # Named after the archive, so that evidence naming a recorded file says where it came from.
        base = os.path.basename(root)
        for suffix in (*ARCHIVE_SUFFIXES, ".tar"):
            if base.endswith(suffix):
                base = base[: -len(suffix)]
                break
        target = os.path.join(workspace, "".join(c if c.isalnum() or c in "-_." else "_" for c in base).strip(".") or "snapshot")
        os.mkdir(target, 0o700)
        extract_archive(root, target)
        yield target, os.path.abspath(root)
    finally:
        shutil.rmtree(workspace, ignore_errors=True)


def extract_archive(archive: str, destination: str) -> None:
    """Extract ``archive`` into the empty directory ``destination`` under the rules of the module
    docstring; ArchiveError naming the archive (and member) otherwise."""
    import tarfile
    import zlib

    def fail(reason: str) -> ArchiveError:
        return ArchiveError(f"--root {archive}: {reason}")

    try:
        with open(archive, "rb") as handle:
            magic = handle.read(2)
    except OSError as error:
        raise fail(f"cannot read it ({describe_os_error(error)})") from None
    if magic != _GZIP_MAGIC:
        raise fail("neither a directory nor a snapshot archive (a gzip-compressed tar, as `preflight snapshot` writes)")
    try:
        tar = tarfile.open(archive, mode="r:gz")
    except (tarfile.TarError, EOFError, zlib.error) as error:
        raise fail(f"not a readable snapshot archive ({error or type(error).__name__})") from None
    except OSError as error:
        raise fail(f"not a readable snapshot archive ({describe_os_error(error) if error.errno else error})") from None
    members = 0
    total = 0
    try:
        with tar:
            for info in tar:
                members += 1
                if members > MAX_MEMBERS:
                    raise fail(f"more than {MAX_MEMBERS} members; refusing to extract it")
                name = _safe_name(info.name)
                if name is None:
                    continue  # the archive's own "." entry
                where = f"member {info.name!r}"
                if info.isdir():
                    _make_directories(destination, name, where)
                elif info.isreg():
                    total += info.size
                    if total > MAX_TOTAL_BYTES:
                        raise fail(f"more than {MAX_TOTAL_BYTES >> 20} MiB uncompressed; refusing to extract it")
                    parent = _make_directories(destination, os.path.dirname(name), where)
                    source = tar.extractfile(info)
                    if source is None:
                        raise fail(f"{where}: unreadable file entry")
                    _copy(source, os.path.join(parent, os.path.basename(name)), info.size, where)
                elif info.issym():
                    _check_link(name, info.linkname, where)
                    parent = _make_directories(destination, os.path.dirname(name), where)
                    try:
                        os.symlink(info.linkname, os.path.join(parent, os.path.basename(name)))
                    except FileExistsError:
                        raise ArchiveError(f"{where}: duplicate entry") from None
                else:
                    raise ArchiveError(f"{where}: {_kind(info)} entries are not allowed (only files, directories and symbolic links)")
    except ArchiveError as error:
        if str(error).startswith("--root"):
            raise
        raise fail(str(error)) from None
    except (tarfile.TarError, EOFError, zlib.error) as error:
        raise fail(f"corrupt or truncated archive ({error or type(error).__name__})") from None
    except OSError as error:
        raise fail(f"cannot extract it ({describe_os_error(error)})") from None


def _kind(info: Any) -> str:
    if info.islnk():
        return "hard link"
    if info.ischr() or info.isblk():
        return "device"
    if info.isfifo():
        return "FIFO"
    return f"type {info.type!r}"


def _safe_name(name: str) -> str | None:
    """A member name as a clean relative path; None for the root itself; ArchiveError if unsafe."""
    if "\0" in name or not name:
        raise ArchiveError(f"member {name!r}: empty name or NUL byte")
    if name.startswith("/"):
        raise ArchiveError(f"member {name!r}: absolute path")
    parts = [part for part in name.split("/") if part not in ("", ".")]
    if ".." in parts:
        raise ArchiveError(f"member {name!r}: '..' in its path")
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


def _copy(source: IO[bytes], path: str, size: int, where: str) -> None:
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        handle = os.open(path, flags, 0o644)
    except FileExistsError:
        raise ArchiveError(f"{where}: duplicate entry") from None
    with os.fdopen(handle, "wb") as out:
        remaining = size
        while remaining > 0:
            chunk = source.read(min(_COPY_CHUNK, remaining))
            if not chunk:
                raise ArchiveError(f"{where}: truncated data")
            out.write(chunk)
            remaining -= len(chunk)
