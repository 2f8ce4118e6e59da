"""The node's filesystem as probes see it: the live ``/`` or a recorded root treated as ``/``.

Probes name host-style paths (``/sys/class/infiniband``); this module maps them under the root,
follows symlinks *inside* the root (an absolute link in a copied sysfs tree must not escape to the
live machine), bounds every read, and turns OS errors into :class:`SourceError` with the errno's
name, so that probes can tell "absent" (``None``) from "unreadable" (an exception they record).

One view serves one run and remembers what it read: several probes need the same files
(``/proc/self/environ``, ``/sys/class/infiniband``), and a run must judge one consistent picture
of the node rather than read it again mid-run.

Device nodes (``/dev/infiniband/uverbs0``, ``/dev/gdrdrv``) cannot live in a recorded root: git
and most archives keep neither character devices nor owners. A recorded root therefore holds a
plain placeholder file at the node's path (so directory listings match the node) and its
``stat`` in ``.preflight/devices.json``::

    {"format": "preflight-devices/1",
     "nodes": {"/dev/infiniband/uverbs0": {"type": "char", "mode": "0666", "uid": 0, "gid": 0}}}

``stat`` of a path listed there answers from that file (``type`` is ``char``, ``block``,
``file``, ``dir``, ``fifo`` or ``socket``; ``mode`` the permission bits in octal; an optional
``size`` in bytes, 0 when missing); paths it does not list are stat'ed in the tree. ``preflight
snapshot`` lists every path the probes stat'ed, since an extracted archive keeps neither owners
nor the sizes sysfs reports.

Some kernel files exist but fail to read by design (``gid_attrs/types/<i>`` of an empty GID slot
answers ``EINVAL``), which a copied tree cannot hold. A recorded root lists them in
``<root>/.preflight/read-errors.json``::

    {"format": "preflight-read-errors/1",
     "errors": {"/sys/class/infiniband/*/ports/*/gid_attrs/*/*": "EINVAL"}}

Keys are node paths or ``fnmatch`` patterns of them, values errno names. A plain path fails
whenever it is read (its file may stay in the tree so that directory listings show it, as sysfs
does); a pattern applies only to paths *absent* from the tree, since files that were readable
were recorded as files. Optional sections ``listdir``, ``stat`` and ``readlink`` map node paths
(exact, no patterns) to the errno that listing, stat'ing or reading the link of that path failed
with; ``"/dev/kmsg"`` under ``errors`` fails the kernel log. Live nodes never consult it.

File-system usage (``statvfs(2)``, e.g. of ``/dev/shm``) is no file either. A recorded root keeps
it in ``<root>/.preflight/statvfs.json``, keyed by mount point, with ``statvfs``'s own fields::

    {"format": "preflight-statvfs/1",
     "mounts": {"/dev/shm": {"f_frsize": 4096, "f_blocks": 16384, "f_bfree": 16000, "f_bavail": 16000}}}

A path the recording does not list is absent (``None``) when the tree has no such directory, and
"not recorded" otherwise; an entry may be ``{"error": "EACCES"}`` to replay a failing call. A root
without the recording answers nothing (``NotCaptured``): it was taken by something that did not
record sizes, which says nothing about the node's mounts.
"""

from __future__ import annotations

import errno as errno_codes
import fnmatch
import itertools
import json
import os
import stat as stat_codes
import struct
import threading
from collections import deque
from collections.abc import Callable
from typing import Any, TypeVar, cast

from msgspec import Struct

from preflight.sources.capture import PROCESS_ENTRY, unit_of

#: Reads stop here: sysfs attributes are one page, and a 10 GB "file" must not fill memory.
KERNEL_LOG_MAX_BYTES = 8 << 20  # a full default kernel ring buffer is 1-4 MiB
KERNEL_LOG_READ_LIMIT = 64 << 20  # twice the largest ring buffer CONFIG_LOG_BUF_SHIFT allows
DEFAULT_MAX_BYTES = 4 * 1024 * 1024
#: Listings stop here: /proc on a busy node holds tens of thousands of entries and a library
#: directory a few thousand; a root whose directory holds millions must not fill memory.
MAX_DIR_ENTRIES = 200_000
_MAX_SYMLINK_HOPS = 40
_ABSENT_ERRNOS = frozenset({errno_codes.ENOENT, errno_codes.ENOTDIR})
DEVICE_RECORDING = "devices.json"
STATVFS_RECORDING = "statvfs.json"
_STATVFS_FIELDS = ("f_frsize", "f_blocks", "f_bfree", "f_bavail")
_DEVICE_TYPES = {
    "char": stat_codes.S_IFCHR, "block": stat_codes.S_IFBLK, "file": stat_codes.S_IFREG,
    "dir": stat_codes.S_IFDIR, "fifo": stat_codes.S_IFIFO, "socket": stat_codes.S_IFSOCK,
}
#: Operations besides reads whose recorded errors ``read-errors.json`` may carry.
RECORDED_ERROR_OPERATIONS = ("listdir", "stat", "readlink")
_T = TypeVar("_T")


class SourceError(Exception):
    """A node fact exists but could not be read; ``reason`` is short and printable."""

    def __init__(self, source: str, reason: str) -> None:
        super().__init__(f"{source}: {reason}")
        self.source = source
        self.reason = reason


class NotCaptured(SourceError):
    """A path is not there, and neither is a source it belongs to (a capture unit of
    :mod:`preflight.sources.capture`, or the target of a dangling link): nothing is known about
    it, which is not the same as knowing it is absent."""


def describe_os_error(error: OSError) -> str:
    """``EACCES`` -> "permission denied (EACCES)", the form shown in findings."""
    code = error.errno
    if code is None:
        return str(error)
    name = errno_codes.errorcode.get(code, str(code))
    if code in (errno_codes.EACCES, errno_codes.EPERM):
        return f"permission denied ({name}); needs root"
    # preflight's own refusals carry their reason in strerror ("a symbolic link; ...")
    said = error.strerror if error.strerror and error.strerror != os.strerror(code) else os.strerror(code).lower()
    return f"{said} ({name})"


class FileStat(Struct, frozen=True):
    """The parts of ``stat(2)`` the checks use."""

    mode: int
    uid: int
    gid: int
    size: int


class FsUsage(Struct, frozen=True):
    """The parts of ``statvfs(2)`` the checks use, in bytes."""

    size: int  # f_blocks * f_frsize
    free: int  # f_bfree * f_frsize (root may use it all)
    available: int  # f_bavail * f_frsize (what an unprivileged process may still allocate)


class NodeFS:
    """Read-only view of a node's files; ``root`` of ``/`` is the live node."""

    def __init__(self, root: str = "/", max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.root = os.path.abspath(root)
        self.is_live = self.root == "/"
        self.max_bytes = max_bytes
        # (operation, path, limit) -> result or SourceError; dict operations are atomic under
        # the GIL, and two probe threads racing on one path only read it twice.
        self._memo: dict[tuple[str, str, int], object] = {}
        self._read_errors: list[tuple[str, int]] | None = None  # loaded on first use
        self._operation_errors: dict[str, dict[str, int]] | None = None  # likewise
        self._dirs: dict[str, tuple[str, ...]] = {}  # resolved directories, see _resolve
        self._replay_files: dict[str, str | None] = {}  # stat stays cheap with a recorded devices.json
        self._root_fd: int | None = None  # O_PATH descriptor of a recorded root, opened on first read

    def _remembered(self, operation: str, path: str, limit: int, compute: Callable[[], _T]) -> _T:
        key = (operation, path, limit)
        if key not in self._memo:
            try:
                self._memo[key] = compute()
            except SourceError as error:
                # Kept without its traceback and context: their frames hold this view, and the
                # cycle would keep the view (and its root's descriptor) alive until a GC pass.
                self._memo[key] = error.with_traceback(None)
                error.__context__ = error.__cause__ = None
        value = self._memo[key]
        if isinstance(value, SourceError):
            # A fresh error each time: raising the remembered one would attach this frame (and
            # so this view) to it, a cycle that keeps the root's descriptor open until a GC pass.
            raise type(value)(value.source, value.reason)
        return cast(_T, value)

    # -- path mapping -------------------------------------------------------------------------
    def _host_path(self, path: str) -> str:
        if not path.startswith("/"):
            raise ValueError(f"node paths are absolute, got {path!r}")
        if "\0" in path:
            # Paths built from what a node's files say (a netdev name in gid_attrs/ndevs): the
            # kernel has no such path, and os refuses it with a ValueError.
            raise SourceError(path.replace("\0", "\\0")[:300], "not a path: it holds a NUL byte")
        return os.path.normpath(path)

    def _resolve(self, path: str, follow_last: bool = True) -> str:
        """Map a host path to a real path, following symlinks as if ``root`` were ``/``.

        Directories are resolved once per view and remembered: a probe reads many files under
        the same deep sysfs directories, and walking every component with ``lstat`` for every
        read was most of what a recorded root cost."""
        host = self._host_path(path)
        if self.is_live:
            return host
        parent, name = os.path.split(host)
        if not name:
            return self.root
        return os.path.join(self.root, *self._walk(list(self._resolve_dir(parent)), [name], follow_last, path))

    def _resolve_dir(self, directory: str) -> tuple[str, ...]:
        """A normalised directory's real components: its parent's (remembered), then its own
        name, so that each directory costs one lstat however deep it is."""
        known = self._dirs.get(directory)
        if known is None:
            parent, name = os.path.split(directory)
            known = tuple(self._walk(list(self._resolve_dir(parent)), [name], True, directory)) if name else ()
            self._dirs[directory] = known
        return known

    def _walk(self, resolved: list[str], parts: list[str], follow_last: bool, path: str) -> list[str]:
        hops = 0
        while parts:
            part = parts.pop(0)
            if part == "..":
                if resolved:
                    resolved.pop()
                continue
            if part == ".":
                continue
            candidate = os.path.join(self.root, *resolved, part)
            if (parts or follow_last) and os.path.islink(candidate):
                hops += 1
                if hops > _MAX_SYMLINK_HOPS:
                    raise SourceError(path, "too many levels of symbolic links (ELOOP)")
                target = os.readlink(candidate)
                if target.startswith("/"):
                    resolved = []
                parts = [p for p in target.split("/") if p] + parts
                continue
            resolved.append(part)
        return resolved

    # -- reads --------------------------------------------------------------------------------
    def read_bytes(self, path: str, max_bytes: int | None = None) -> bytes | None:
        """Whole-file read, bounded; ``None`` when the file does not exist."""
        limit = self.max_bytes if max_bytes is None else max_bytes
        return self._remembered("read", path, limit, lambda: self._read_bytes(path, limit))

    def _read_bytes(self, path: str, limit: int) -> bytes | None:
        self._raise_recorded_error(path, exact_only=True)
        try:
            real = self._resolve(path)
            # Only regular files are read (sysfs and procfs attributes are): a FIFO planted in a
            # recorded root would read as empty or block, and opening a device node can have
            # side effects (opening /dev/watchdog arms it), so neither is even opened.
            _refuse_special(path, os.stat(real).st_mode)
            # O_NONBLOCK keeps a FIFO swapped in after the stat from blocking the open.
            flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
            fd = os.open(real, flags) if self.is_live else self._open_in_root(real, flags)
        except OSError as error:
            if error.errno in _ABSENT_ERRNOS:
                self._absent(path)  # a source not captured says nothing, not even a recorded errno
                self._raise_recorded_error(path)
                return None
            raise SourceError(path, describe_os_error(error)) from None
        return _read_descriptor(fd, path, limit)

    def read_for(self, path: str, user: FileUser | None, max_bytes: int | None = None) -> str | None:
        """:meth:`read` of a file that a job's environment names (``NCCL_CONF_FILE``,
        ``$HOME/.nccl.conf``, ``NCCL_TOPO_FILE``, ``SLURM_CONF``). On a live node where preflight
        runs as root for another user's job, the file is opened only as that user could open it,
        and only if it belongs to that user or root: a job must not make root read someone
        else's 0600 file into a report through a link. Elsewhere (a recorded root, an
        unprivileged run, a job of root's) this is :meth:`read`."""
        if user is None or user.uid == 0 or not self.is_live or os.geteuid() != 0:
            return self.read(path, max_bytes)
        limit = self.max_bytes if max_bytes is None else max_bytes
        fd = _open_as_user(self._host_path(path), user)
        if fd is None:
            return None
        data = _read_descriptor(fd, path, limit)
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            raise SourceError(path, "not UTF-8 text (binary or garbled content)") from None

    def _open_in_root(self, real: str, flags: int) -> int:
        """Open ``real`` (a path :meth:`_resolve` made, with no link left in it) so that no link
        can be swapped in on the way: ``openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)`` from the
        root where the kernel has it (5.6 and later), else with ``O_NOFOLLOW`` on the file."""
        if self._root_fd is None:
            with _ROOT_FD_LOCK:  # probe threads read at once: open it once, or the rest would leak
                if self._root_fd is None:
                    self._root_fd = os.open(self.root, os.O_PATH | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
        relative = real[len(self.root) + 1 :] if real.startswith(self.root + "/") else os.path.relpath(real, self.root)
        fd = _openat2_beneath(self._root_fd, relative, flags)
        return fd if fd is not None else os.open(real, flags | getattr(os, "O_NOFOLLOW", 0))

    def close(self) -> None:
        """Release the root's descriptor; dropping the view does too."""
        if self._root_fd is not None:
            os.close(self._root_fd)
            self._root_fd = None

    def __del__(self) -> None:
        try:
            self.close()
        except (OSError, AttributeError):  # half-built, or at interpreter exit
            pass

    def read(self, path: str, max_bytes: int | None = None) -> str | None:
        """Whole-file text read; ``None`` when absent. Text must be UTF-8 without NUL bytes
        except where the format uses NUL separators (use :meth:`read_bytes` for those)."""
        data = self.read_bytes(path, max_bytes)
        if data is None:
            return None
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            raise SourceError(path, "not UTF-8 text (binary or garbled content)") from None

    def listdir(self, path: str) -> list[str] | None:
        """Sorted directory entries; ``None`` when the directory does not exist."""
        entries = self._remembered("list", path, 0, lambda: self._listdir(path))
        return None if entries is None else list(entries)

    def _listdir(self, path: str) -> list[str] | None:
        self._raise_operation_error("listdir", path)
        try:
            with os.scandir(self._resolve(path)) as listing:
                names = [entry.name for entry in itertools.islice(listing, MAX_DIR_ENTRIES + 1)]
        except OSError as error:
            if error.errno in _ABSENT_ERRNOS:
                self._absent(path)
                return None
            raise SourceError(path, describe_os_error(error)) from None
        if len(names) > MAX_DIR_ENTRIES:
            # A partial listing would read as "not there" for whatever was left out.
            raise SourceError(path, f"more than {MAX_DIR_ENTRIES} entries; not listed")
        return sorted(names)

    def readlink(self, path: str) -> str | None:
        """The raw target of a symlink; ``None`` if ``path`` is absent or not a link."""
        self._raise_operation_error("readlink", path)
        try:
            return os.readlink(self._resolve(path, follow_last=False))
        except OSError as error:
            if error.errno == errno_codes.EINVAL:
                return None  # there, but not a link
            if error.errno in _ABSENT_ERRNOS:
                self._absent(path, follow_last=False)
                return None
            raise SourceError(path, describe_os_error(error)) from None

    def stat(self, path: str) -> FileStat | None:
        """``stat`` following links inside the root; ``None`` when absent. In a recorded root,
        device nodes (and every path a snapshot stat'ed) answer from ``.preflight/devices.json``
        (see the module docstring)."""
        host = self._host_path(path)
        if not self.is_live:
            self._raise_operation_error("stat", path)
            try:
                recorded = self._recorded_devices()
            except SourceError:
                if host.startswith("/dev/"):
                    raise
                recorded = {}  # a broken recording concerns device nodes; the tree answers the rest
            if host in recorded:
                return recorded[host]
        try:
            result = os.stat(self._resolve(path))
        except OSError as error:
            if error.errno in _ABSENT_ERRNOS:
                self._absent(path)
                return None
            raise SourceError(path, describe_os_error(error)) from None
        if not self.is_live and host.startswith("/dev/") and not stat_codes.S_ISDIR(result.st_mode):
            # Trees and archives keep no device nodes, owners or modes: what stands at a /dev
            # path of a recorded root is a placeholder, and only devices.json knows the node.
            raise NotCaptured(path, f"its type, mode and owner are not recorded (.preflight/{DEVICE_RECORDING})")
        return FileStat(result.st_mode, result.st_uid, result.st_gid, result.st_size)

    def statvfs(self, path: str) -> FsUsage | None:
        """Size and free space of the file system holding ``path``; ``None`` when the path does
        not exist. A recorded root answers from ``.preflight/statvfs.json`` (module docstring)."""
        host = self._host_path(path)
        if not self.is_live:
            recording = self.replay_file(STATVFS_RECORDING)
            if recording is None:  # missing is not empty: no recording says nothing of the mount
                raise NotCaptured(path, f"not captured: this root records no file system sizes (.preflight/{STATVFS_RECORDING})")
            mounts = self._remembered("statvfs", recording, 0, lambda: _load_statvfs_recording(recording))
            if host in mounts:
                answer = mounts[host]
                if isinstance(answer, SourceError):
                    raise SourceError(path, answer.reason)
                return answer
            if self._exists_in_tree(path) is False:
                self._absent(path)
                return None
            raise SourceError(path, f"no statvfs answer recorded in .preflight/{STATVFS_RECORDING}")
        try:
            result = os.statvfs(host)
        except OSError as error:
            if error.errno in _ABSENT_ERRNOS:
                self._absent(path)
                return None
            raise SourceError(path, describe_os_error(error)) from None
        return FsUsage(result.f_blocks * result.f_frsize, result.f_bfree * result.f_frsize, result.f_bavail * result.f_frsize)

    def _recorded_devices(self) -> dict[str, FileStat]:
        recording = self.replay_file(DEVICE_RECORDING)
        if recording is None:
            return {}
        return self._remembered("devices", recording, 0, lambda: _load_device_recording(recording))

    def exists(self, path: str) -> bool:
        """True when ``path`` exists; an unreadable parent counts as an error, not absence, and
        so does a path whose source was not captured (:class:`NotCaptured`)."""
        return self.stat(path) is not None

    # -- absence ------------------------------------------------------------------------------
    def _absent(self, path: str, follow_last: bool = True) -> None:
        """Return for a path the node does not have; raise :class:`NotCaptured` for one whose source
        is not there: the first component missing along the path is a capture unit
        (:mod:`preflight.sources.capture`) or a link whose target was not copied."""
        host = self._host_path(path)
        if not self.is_live and host.startswith("/dev/") and self.replay_file(DEVICE_RECORDING) is None:
            # A tree keeps no device nodes: only a recording of them says what /dev lacked.
            raise NotCaptured(path, f"not captured: this root records no device nodes (.preflight/{DEVICE_RECORDING})")
        parts = host.split("/")
        # Most absent paths sit in a directory that is there: then only the last component can
        # be the missing one, and the walk from / (a few lstat calls a prefix) is not needed.
        first = len(parts) if self._directory_there(os.path.dirname(host)) else 2
        for end in range(first, len(parts) + 1):
            prefix = "/".join(parts[:end])
            last = end == len(parts)
            state = self._prefix_state(prefix, follow_last or not last)
            if state == "there":
                continue
            where = "this node" if self.is_live else "this root"
            if state == "dangling":
                raise NotCaptured(path, f"not captured: {prefix} links to a path {where} does not have")
            what = unit_of(prefix)
            if what == PROCESS_ENTRY and self.is_live and prefix.count("/") == 2:
                # A pid another file named (slurmd's pid file) whose entry is not there: the
                # process ended, or /proc hides other users' processes (hidepid), as hardened
                # nodes mount it.
                raise NotCaptured(path, f"{prefix} is not visible: the process ended, or /proc is mounted with hidepid (run as root)")
            if what is not None:
                raise NotCaptured(path, f"not captured: {where} has no {prefix} ({what})")
            return
        # Every component is there after all (it appeared while we looked): absent when read.

    def _directory_there(self, directory: str) -> bool:
        """Whether ``directory`` (links followed inside the root) is a directory; remembered."""
        key = ("dir", directory, 1)
        known = self._memo.get(key)
        if isinstance(known, bool):
            return known
        try:
            there = os.path.isdir(self._resolve(directory))
        except SourceError:
            there = False
        self._memo[key] = there
        return there

    def _prefix_state(self, prefix: str, follow: bool) -> str:
        """"there", "missing" or "dangling" (a link whose target is missing) for a node path."""
        key = ("prefix", prefix, int(follow))
        known = self._memo.get(key)
        if isinstance(known, str):
            return known
        try:
            real = self._resolve(prefix, follow_last=False)
        except SourceError:
            return "there"  # a link loop is an error its own read reports, not an absence
        if not os.path.lexists(real):
            state = "missing"
        elif follow and os.path.islink(real) and not self._exists_in_tree(prefix):
            state = "dangling"
        else:
            state = "there"
        self._memo[key] = state
        return state

    def _exists_in_tree(self, path: str) -> bool | None:
        """Whether ``path`` resolves to something, links followed inside the root; None when
        the answer is an error (a loop, no permission)."""
        try:
            return os.path.exists(self._resolve(path))
        except (SourceError, OSError):
            return None

    def _raise_recorded_error(self, path: str, exact_only: bool = False) -> None:
        """Raise the error ``read-errors.json`` records for ``path``: a plain-path entry for any
        read (``exact_only``), a pattern only once the file turned out to be absent."""
        if self.is_live:
            return
        if self._read_errors is None:
            self._read_errors = _load_read_errors(self.replay_file("read-errors.json"))
        host = self._host_path(path)
        for pattern, code in self._read_errors:
            is_pattern = any(char in pattern for char in "*?[")
            if (pattern == host) if (exact_only or not is_pattern) else fnmatch.fnmatchcase(host, pattern):
                raise SourceError(path, describe_os_error(OSError(code, os.strerror(code))))

    def _raise_operation_error(self, operation: str, path: str) -> None:
        """Raise the error ``read-errors.json`` records for listing/stat'ing/readlink of ``path``."""
        if self.is_live:
            return
        if self._operation_errors is None:
            self._operation_errors = _load_operation_errors(self.replay_file("read-errors.json"))
        code = self._operation_errors.get(operation, {}).get(self._host_path(path))
        if code is not None:
            raise SourceError(path, describe_os_error(OSError(code, os.strerror(code))))

    def read_kernel_log(self, max_bytes: int = KERNEL_LOG_MAX_BYTES, keep: tuple[str, ...] = ()) -> list[str] | None:
        """The kernel's log records since boot, one ``pri,seq,usec,flags;message`` line each.

        Live: ``/dev/kmsg``, opened non-blocking (each read returns one record; EAGAIN ends the
        buffer, EPIPE means a record was overwritten while reading and is skipped). Reading it
        needs root where ``kernel.dmesg_restrict`` is 1. A recorded root replays
        ``.preflight/kmsg`` (the same lines; a line starting with a space continues the record
        before it, as the ``KEY=value`` dictionary lines of a ``/dev/kmsg`` record do). ``None``
        when there is no log to read. ``keep``: only records containing one of these texts count
        (and are returned), so that ``max_bytes`` holds what the caller reads, not routine noise.
        Beyond ``max_bytes`` the oldest records are dropped: the newest (the last job's) matter most."""
        if not self.is_live:
            self._raise_recorded_error("/dev/kmsg", exact_only=True)
            replay = self.replay_file("kmsg")
            if replay is None:
                return None
            try:
                data = read_recording(replay, max_bytes, cut=True, tail=True)  # the newest records matter
            except OSError as error:
                raise SourceError(".preflight/kmsg", describe_os_error(error)) from None
            lines = join_kmsg_continuations(data.decode("utf-8", "replace").splitlines())
            return [line for line in lines if any(text in line for text in keep)] if keep else lines
        try:
            descriptor = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
        except FileNotFoundError:
            return None
        except OSError as error:
            raise SourceError("/dev/kmsg", describe_os_error(error)) from None
        # A log beyond KERNEL_LOG_READ_LIMIT (log_buf_len= can ask for more than
        # CONFIG_LOG_BUF_SHIFT's 32 MiB) is not read to its end, and says so.
        wanted = tuple(text.encode() for text in keep)
        records: deque[bytes] = deque()
        kept = read = 0
        try:
            while True:
                try:
                    record = os.read(descriptor, 8192)
                except BlockingIOError:
                    break
                except OSError as error:
                    if error.errno == errno_codes.EPIPE:
                        continue
                    raise SourceError("/dev/kmsg", describe_os_error(error)) from None
                if not record:
                    break
                read += len(record)
                if read > KERNEL_LOG_READ_LIMIT:
                    raise SourceError("/dev/kmsg", f"more than {KERNEL_LOG_READ_LIMIT >> 20} MiB of records: the newest were not read")
                if wanted and not any(text in record for text in wanted):
                    continue
                records.append(record)
                kept += len(record)
                while kept > max_bytes:
                    kept -= len(records.popleft())
        finally:
            os.close(descriptor)
        return [record.decode("utf-8", "replace").rstrip("\n") for record in records]

    def replay_file(self, name: str) -> str | None:
        """Path of a recorded answer file (``<root>/.preflight/<name>``) in root mode, if any."""
        if self.is_live:
            return None
        if name not in self._replay_files:
            candidate = os.path.join(self.root, ".preflight", name)
            # Anything at the name counts: a recording that is a directory, a FIFO or a symlink
            # loop is a broken recording (its reader says so), not a missing one with a fallback.
            self._replay_files[name] = candidate if os.path.lexists(candidate) else None
        return self._replay_files[name]


#: Recordings of whole NVML, netlink and DNS answers stay far below this (a snapshot of an
#: 8-GPU node is under 1 MB); anything larger is not read into memory.
RECORDING_MAX_BYTES = 32 * 1024 * 1024


def read_recording(path: str, max_bytes: int = RECORDING_MAX_BYTES, cut: bool = False, tail: bool = False) -> bytes:
    """A ``.preflight`` recording's bytes: regular files only (never blocks on a FIFO), at most
    ``max_bytes`` (``cut``: the first ``max_bytes``, or with ``tail`` the whole lines of the last
    ``max_bytes``; otherwise a larger file fails). Raises
    OSError, with a readable ``strerror`` for the refusals. Neither the file nor its directory
    (``.preflight``) may be a symbolic link: a recording is part of the root, and a link would
    read a file of this machine into the report (or into a new snapshot)."""
    if os.path.islink(os.path.dirname(path)):
        raise OSError(errno_codes.ELOOP, "a symbolic link; recordings are never followed out of the root")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0))
    except OSError as error:
        if error.errno == errno_codes.ELOOP:
            raise OSError(errno_codes.ELOOP, "a symbolic link; recordings are never followed out of the root") from None
        raise
    try:
        status = os.fstat(fd)
        if not stat_codes.S_ISREG(status.st_mode):
            raise OSError(errno_codes.EINVAL, "not a regular file")
        if status.st_size > max_bytes and not cut:
            raise OSError(errno_codes.EFBIG, f"larger than {max_bytes} bytes")
        skip_partial = tail and status.st_size > max_bytes
        if skip_partial:
            os.lseek(fd, status.st_size - max_bytes, os.SEEK_SET)
        chunks: list[bytes] = []
        remaining = max_bytes + 1
        while remaining > 0:
            chunk = os.read(fd, min(remaining, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            remaining -= len(chunk)
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > max_bytes:
        if not cut:
            raise OSError(errno_codes.EFBIG, f"larger than {max_bytes} bytes")
        data = data[-max_bytes:] if tail else data[:max_bytes]
    if skip_partial:
        data = data[data.find(b"\n") + 1 :]  # the first line began before the window
    return data


def load_recording(path: str) -> Any:
    """A JSON recording, parsed; ValueError (with the file and the reason) for anything that is
    not a readable, bounded, UTF-8 JSON document, including nesting deep enough to exhaust
    Python's recursion limit."""
    try:
        return json.loads(read_recording(path).decode("utf-8"))
    except OSError as error:
        raise ValueError(f"{path}: {error.strerror or error}") from None
    except RecursionError:
        raise ValueError(f"{path}: JSON nested too deeply") from None
    except ValueError as error:  # JSONDecodeError and UnicodeDecodeError
        raise ValueError(f"{path}: {error}") from None


_Recorded = TypeVar("_Recorded", bound="RecordedDocument")


class RecordedDocument:
    """The recorded JSON object behind a replay source (``<root>/.preflight/<FILE>``). A broken
    recording fails the probes that use it (they say unknown), not the whole run."""

    KIND = "recorded"  # names the recording in errors ("unreadable DNS recording: ...")
    FILE = "recording.json"

    def __init__(self, document: dict[str, Any], origin: str = "", error: str = "") -> None:
        self._document = document
        self._origin = origin or self.FILE
        self._error = error

    def _checked(self) -> dict[str, Any]:
        if self._error:
            raise SourceError(self._origin, self._error)
        return self._document

    @classmethod
    def from_file(cls: type[_Recorded], path: str) -> _Recorded:
        try:
            document = load_recording(path)
        except ValueError as error:
            return cls({}, path, f"unreadable {cls.KIND} recording: {error}")
        if not isinstance(document, dict):
            return cls({}, path, f"{cls.KIND} recording is not a JSON object")
        return cls(document, origin=path)


_ROOT_FD_LOCK = threading.Lock()
_OPENAT2 = 437  # the same on every architecture: added after the syscall tables were unified
_RESOLVE_NO_SYMLINKS, _RESOLVE_BENEATH = 0x04, 0x08
# ctypes' syscall() and the open_how structs by flags, set up on the first read of a recorded
# root (ctypes costs 3 ms to import, which live runs never pay); False where openat2 is absent.
_openat2: Any = None
_open_how: dict[int, Any] = {}


def _openat2_beneath(directory_fd: int, relative: str, flags: int) -> int | None:
    """``openat2(directory_fd, relative, {flags, 0, RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS})``;
    None where the kernel or libc has no openat2 (the caller falls back); OSError otherwise."""
    global _openat2
    if _openat2 is None:
        try:
            import ctypes

            syscall = ctypes.CDLL(None, use_errno=True).syscall
            syscall.restype = ctypes.c_long
            syscall.argtypes = [ctypes.c_long, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p, ctypes.c_size_t]
            _openat2 = syscall, ctypes
        except (ImportError, OSError, AttributeError):  # no ctypes (or none reachable after a setuid)
            _openat2 = False
    if _openat2 is False:
        return None
    syscall, ctypes = _openat2
    how = _open_how.get(flags)
    if how is None:
        how = _open_how[flags] = ctypes.create_string_buffer(struct.pack("QQQ", flags, 0, _RESOLVE_BENEATH | _RESOLVE_NO_SYMLINKS), 24)
    fd = syscall(_OPENAT2, directory_fd, relative.encode(), how, 24)
    if fd >= 0:
        return int(fd)
    code = ctypes.get_errno()
    if code == errno_codes.ENOSYS:  # an old kernel, or a seccomp filter that does not know it
        _openat2 = False
        return None
    raise OSError(code, os.strerror(code))


def _read_descriptor(fd: int, path: str, limit: int) -> bytes:
    """The whole content of an open regular file, at most ``limit`` bytes; closes ``fd``."""
    try:
        _refuse_special(path, os.fstat(fd).st_mode)
        chunks: list[bytes] = []
        remaining = limit + 1
        while remaining > 0:
            chunk = os.read(fd, min(remaining, 65536))
            if not chunk:
                break
            chunks.append(chunk)
            remaining -= len(chunk)
    except OSError as error:
        raise SourceError(path, describe_os_error(error)) from None
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > limit:
        raise SourceError(path, f"larger than {limit} bytes; refusing to read it whole")
    return data


class FileUser(Struct, frozen=True):
    """Whose rights a read of a job-named file is checked against (:meth:`NodeFS.read_for`)."""

    uid: int
    gids: tuple[int, ...]  # primary first, then supplementary


def _may(status: os.stat_result, user: FileUser, bits: int) -> bool:
    """Unix permission bits for ``user`` (owner, else group, else others), as the kernel checks."""
    if status.st_uid == user.uid:
        granted = status.st_mode >> 6
    elif status.st_gid in user.gids:
        granted = status.st_mode >> 3
    else:
        granted = status.st_mode
    return granted & bits == bits


def _open_as_user(path: str, user: FileUser) -> int | None:
    """Open ``path`` read-only as ``user`` would, walking it component by component: links only
    when root or the user owns them, directories only when the user may enter them, and the file
    only when it is regular, root's or the user's, and readable by the user. ``None`` when it is
    absent; SourceError for every refusal. The open itself follows no link, and the file opened
    must be the one checked."""
    pending = [part for part in path.split("/") if part]
    current = "/"
    hops = 0
    while pending:
        name = pending.pop(0)
        if name in ("", "."):
            continue
        if name == "..":
            current = os.path.dirname(current)
            continue
        candidate = os.path.join(current, name)
        try:
            status = os.lstat(candidate)
        except OSError as error:
            if error.errno in _ABSENT_ERRNOS:
                return None
            raise SourceError(path, describe_os_error(error)) from None
        if stat_codes.S_ISLNK(status.st_mode):
            if status.st_uid not in (0, user.uid):
                raise SourceError(path, f"{candidate} is a link owned by uid {status.st_uid}: not followed for the job's user (uid {user.uid})")
            hops += 1
            if hops > _MAX_SYMLINK_HOPS:
                raise SourceError(path, "too many levels of symbolic links (ELOOP)")
            target = os.readlink(candidate)
            current = "/" if target.startswith("/") else current
            pending = [part for part in target.split("/") if part] + pending
            continue
        if pending:
            if not stat_codes.S_ISDIR(status.st_mode):
                return None
            if not _may(status, user, 0o1):
                raise SourceError(path, f"{candidate}: the job's user (uid {user.uid}) may not enter it; not read")
            current = candidate
            continue
        if not stat_codes.S_ISREG(status.st_mode):
            _refuse_special(path, status.st_mode)
        if status.st_uid not in (0, user.uid):
            raise SourceError(path, f"owned by uid {status.st_uid}, neither root nor the job's user (uid {user.uid}); not read")
        if not _may(status, user, 0o4):
            raise SourceError(path, f"the job's user (uid {user.uid}) may not read it (mode {status.st_mode & 0o7777:04o}); not read")
        try:
            fd = os.open(candidate, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
        except OSError as error:
            raise SourceError(path, describe_os_error(error)) from None
        opened = os.fstat(fd)
        if (opened.st_dev, opened.st_ino) != (status.st_dev, status.st_ino):
            os.close(fd)
            raise SourceError(path, "replaced while it was being opened; not read")
        return fd
    return None  # the path names a directory ("/")


def _refuse_special(path: str, mode: int) -> None:
    if stat_codes.S_ISDIR(mode):
        raise SourceError(path, "is a directory (EISDIR)")
    if not stat_codes.S_ISREG(mode):
        kind = "a FIFO" if stat_codes.S_ISFIFO(mode) else "a device node" if stat_codes.S_ISCHR(mode) or stat_codes.S_ISBLK(mode) else "a socket"
        raise SourceError(path, f"not a regular file ({kind}); not opened")


def join_kmsg_continuations(lines: list[str]) -> list[str]:
    """Lines of a kmsg file as ``/dev/kmsg`` records: continuation lines (leading space) are
    appended to the record before them with a newline, as one read of ``/dev/kmsg`` returns them."""
    records: list[str] = []
    for line in lines:
        if line.startswith(" ") and records:
            records[-1] += "\n" + line
        else:
            records.append(line)
    return records


def _load_device_recording(recording: str) -> dict[str, FileStat]:
    """Parse ``.preflight/devices.json``; a broken recording fails every ``/dev`` stat."""
    where = f".preflight/{DEVICE_RECORDING}"
    try:
        nodes = json.loads(read_recording(recording, DEFAULT_MAX_BYTES))["nodes"]
        return {
            os.path.normpath(node_path): FileStat(
                _DEVICE_TYPES[entry["type"]] | (int(entry["mode"], 8) & 0o7777),
                int(entry["uid"]),
                int(entry["gid"]),
                int(entry.get("size", 0)),
            )
            for node_path, entry in nodes.items()
        }
    except OSError as error:
        raise SourceError(where, describe_os_error(error)) from None
    except RecursionError:
        raise SourceError(where, "malformed recording (JSON nested too deeply)") from None
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise SourceError(where, f"malformed recording ({type(error).__name__}: {error})") from None


def _load_statvfs_recording(recording: str) -> dict[str, FsUsage | SourceError]:
    """Parse ``.preflight/statvfs.json``; a broken recording fails every replayed ``statvfs``."""
    where = f".preflight/{STATVFS_RECORDING}"
    try:
        mounts: dict[str, FsUsage | SourceError] = {}
        for mount, entry in json.loads(read_recording(recording, DEFAULT_MAX_BYTES))["mounts"].items():
            host = os.path.normpath(mount)
            if "error" in entry:
                code = getattr(errno_codes, str(entry["error"]))
                mounts[host] = SourceError(host, describe_os_error(OSError(code, os.strerror(code))))
                continue
            frsize, blocks, bfree, bavail = (int(entry[name]) for name in _STATVFS_FIELDS)
            if min(frsize, blocks, bfree, bavail) < 0:
                raise ValueError(f"{mount}: negative field")
            mounts[host] = FsUsage(blocks * frsize, bfree * frsize, bavail * frsize)
        return mounts
    except OSError as error:
        raise SourceError(where, describe_os_error(error)) from None
    except RecursionError:
        raise SourceError(where, "malformed recording (JSON nested too deeply)") from None
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise SourceError(where, f"malformed recording ({type(error).__name__}: {error})") from None


def _load_read_errors(path: str | None) -> list[tuple[str, int]]:
    """``(pattern, errno)`` pairs of a ``read-errors.json``; a broken file records nothing."""
    if path is None:
        return []
    try:
        errors = load_recording(path)["errors"]
        return [(str(pattern), getattr(errno_codes, str(name))) for pattern, name in errors.items()]
    except (ValueError, KeyError, TypeError, AttributeError):
        return []


def _load_operation_errors(path: str | None) -> dict[str, dict[str, int]]:
    """``operation -> {path: errno}`` from the optional sections of a ``read-errors.json``."""
    if path is None:
        return {}
    try:
        document = load_recording(path)
        return {
            operation: {os.path.normpath(str(node_path)): getattr(errno_codes, str(name)) for node_path, name in document[operation].items()}
            for operation in RECORDED_ERROR_OPERATIONS
            if isinstance(document.get(operation), dict)
        }
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}
