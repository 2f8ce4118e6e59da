"""Recording sources for ``preflight snapshot``: each wraps a source, answers exactly as it does,
and remembers every answer (and every error) so that the answers can be written out as a
recorded root that replays them.

They sit at the source boundary, not in the probes, so a new probe is recorded without changes:
whatever it asks of ``fs``, ``nvml``, ``netlink`` or ``dns`` is captured here.

* :class:`RecordingFS` is a :class:`NodeFS` (the same view of the live ``/`` or of a recorded
  root) that also records the *shape* of the tree behind each answer: the symlinks a path went
  through (``/sys/class/infiniband/mlx5_0 -> ../../devices/...``), file contents at their
  resolved paths, directory listings (each entry as a directory, link or placeholder file), the
  ``stat`` answers, and errors by errno name.
* :class:`RecordingNvml`, :class:`RecordingNetlink` and :class:`RecordingDns` record calls and
  answers in the replay formats of ``nvml.json``, ``netlink.json`` and ``dns.json``. A call still
  running when the snapshot is written (a wedged driver, a server that never answers) is recorded
  as ``{"hang": true}``, which the replay sources honour.

:class:`FileNetlink`, whose replay *is* the tree (it reads sysfs through the recorded view), is
left unwrapped: see :func:`record`.
"""

from __future__ import annotations

import os
import re
import stat as stat_codes
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

from msgspec import to_builtins as asdict  # records as plain JSON values, recursively

from preflight.sources.dns import Dns, DnsAnswer, NameserverCheck
from preflight.sources.ethtool import PauseState
from preflight.sources.fs import DEVICE_RECORDING, KERNEL_LOG_MAX_BYTES, FileStat, FileUser, FsUsage, NodeFS, NotCaptured, SourceError, describe_os_error
from preflight.sources.netlink import FIREWALL_FORMAT, FIREWALL_NOT_RECORDED, Address, DcbConfig, FileNetlink, Link, Netlink
from preflight.sources.nftables import Ruleset
from preflight.sources.nvml import Argument, Nvml, NvmlError, replay_key
from preflight.sources.routes import Route, route_key

_T = TypeVar("_T")
_MAX_SYMLINK_HOPS = 40
_ERRNO_IN_REASON = re.compile(r"\(([A-Z][A-Z0-9]+)\)(?:;.*)?$")
_TOO_LARGE = re.compile(r"^larger than (\d+) bytes")
# NodeFS methods that answer from other recorded methods (read -> read_bytes, exists -> stat) or
# only locate the replay files the sources open themselves.
DERIVED_METHODS = frozenset({"read", "exists", "replay_file", "close"})
RECORDED_METHODS = frozenset({"read_bytes", "read_for", "listdir", "readlink", "stat", "statvfs", "read_kernel_log"})


def errno_name(reason: str) -> str | None:
    """``"permission denied (EACCES); needs root"`` -> ``"EACCES"``; None without an errno."""
    import errno as errno_codes

    match = _ERRNO_IN_REASON.search(reason)
    if match and isinstance(getattr(errno_codes, match.group(1), None), int):
        return match.group(1)
    return None


def _replays_exactly(name: str, reason: str) -> bool:
    import errno as errno_codes

    code = getattr(errno_codes, name)
    return describe_os_error(OSError(code, os.strerror(code))) == reason


@dataclass
class TreeRecording:
    """What a :class:`RecordingFS` saw, as a tree of host paths (``/sys/...``)."""

    files: dict[str, bytes] = field(default_factory=dict)  # resolved path -> content
    links: dict[str, str] = field(default_factory=dict)  # path of the link -> raw target
    dirs: set[str] = field(default_factory=set)
    placeholders: set[str] = field(default_factory=set)  # exist (listed, stat'ed) but never read
    stats: dict[str, FileStat] = field(default_factory=dict)  # requested path -> stat answer
    statvfs: dict[str, dict[str, Any]] = field(default_factory=dict)  # path -> statvfs.json entry
    errors: dict[str, dict[str, str]] = field(default_factory=dict)  # operation -> path -> errno name
    kernel_log: list[str] | None = None  # None: no log (or not asked); written as .preflight/kmsg
    inexact: list[str] = field(default_factory=list)  # answers a recorded root cannot reproduce
    unrecorded: set[str] = field(default_factory=set)  # NodeFS methods called that nothing records
    # Whether the recorded node could answer for device nodes: a live node, or a root that has a
    # devices.json; otherwise the replay must not claim that /dev lacked anything.
    device_nodes_known: bool = True


class RecordingFS(NodeFS):
    """A :class:`NodeFS` that records what it answers (see the module docstring)."""

    def __init__(self, root: str = "/", max_bytes: int | None = None) -> None:
        if max_bytes is None:
            super().__init__(root)
        else:
            super().__init__(root, max_bytes)
        self.recording = TreeRecording(device_nodes_known=self.is_live or self.replay_file(DEVICE_RECORDING) is not None)
        self._lock = threading.Lock()
        self._traced_dirs: dict[str, str | None] = {"/": "/"}

    def __getattribute__(self, name: str) -> Any:
        # A method added to NodeFS after this recorder (a new kind of question) is noted, so the
        # snapshot says what it could not record instead of silently replaying it wrong.
        if not name.startswith("_") and name not in RECORDED_METHODS and name not in DERIVED_METHODS:
            value = object.__getattribute__(self, name)
            if callable(value) and hasattr(NodeFS, name):
                object.__getattribute__(self, "recording").unrecorded.add(name)
            return value
        return object.__getattribute__(self, name)

    # -- the shape of the tree ------------------------------------------------------------------
    def _real(self, host: str) -> str:
        return host if self.is_live else os.path.join(self.root, host.lstrip("/"))

    def _trace(self, path: str, follow_last: bool = True) -> str | None:
        """The link-free host path ``path`` resolves to (as NodeFS resolves it), recording every
        symlink on the way; None when a component cannot be examined (absent, unreadable, loop)."""
        host = os.path.normpath(path)
        parent, name = os.path.split(host)
        if not name:
            return "/"
        directory = self._trace_dir(parent)
        if directory is None:
            return None
        return self._walk_parts(directory, [name], follow_last)

    def _trace_dir(self, directory: str) -> str | None:
        if directory not in self._traced_dirs:
            self._traced_dirs[directory] = self._walk_parts("/", [p for p in directory.split("/") if p], True)
        return self._traced_dirs[directory]

    def _walk_parts(self, start: str, parts: list[str], follow_last: bool) -> str | None:
        resolved = [p for p in start.split("/") if p]
        hops = 0
        while parts:
            part = parts.pop(0)
            if part == "..":
                if resolved:
                    resolved.pop()
                continue
            if part in (".", ""):
                continue
            here = "/" + "/".join([*resolved, part])
            if parts or follow_last:
                try:
                    is_link = stat_codes.S_ISLNK(os.lstat(self._real(here)).st_mode)
                except OSError:
                    return None
                if is_link:
                    hops += 1
                    if hops > _MAX_SYMLINK_HOPS:
                        return None
                    try:
                        target = os.readlink(self._real(here))
                    except OSError:
                        return None
                    with self._lock:
                        self.recording.links[here] = target
                    if target.startswith("/"):
                        resolved = []
                    parts = [p for p in target.split("/") if p] + parts
                    continue
            resolved.append(part)
        return "/" + "/".join(resolved)

    def _note_entry(self, host: str) -> None:
        """Record what ``host`` is (directory, link or something else) without reading it."""
        try:
            mode = os.lstat(self._real(host)).st_mode
        except OSError:
            return
        with self._lock:
            if stat_codes.S_ISLNK(mode):
                try:
                    self.recording.links[host] = os.readlink(self._real(host))
                except OSError:
                    pass
            elif stat_codes.S_ISDIR(mode):
                self.recording.dirs.add(host)
            elif host not in self.recording.files:
                self.recording.placeholders.add(host)

    def _note_absence(self, path: str) -> None:
        """Record the deepest directory above an absent ``path`` (and the links on the way): a
        replay then finds the capture units around it and answers "absent" too, not "not
        captured" (:meth:`NodeFS._absent`)."""
        directory = os.path.dirname(os.path.normpath(path))
        while directory != "/":
            resolved = self._trace(directory)
            if resolved is not None and os.path.isdir(self._real(resolved)):
                with self._lock:
                    self.recording.dirs.add(resolved)
                return
            self._forget_vanished(directory)
            directory = os.path.dirname(directory)

    def _forget_vanished(self, directory: str) -> None:
        """Drop a directory that a listing recorded and that has gone since (a process that
        exited while the snapshot was taken, an interface deleted meanwhile), with all recorded
        below it. Kept, it would replay as a directory whose files were "not captured", an
        unknown the live node never shows; dropped, the snapshot is the node as it was after."""
        with self._lock:
            if directory not in self.recording.dirs:
                return
            below = directory.rstrip("/") + "/"
            self.recording.dirs = {d for d in self.recording.dirs if d != directory and not d.startswith(below)}
            self.recording.placeholders = {p for p in self.recording.placeholders if not p.startswith(below)}
            for table in (self.recording.files, self.recording.links):
                for key in [key for key in table if key == directory or key.startswith(below)]:
                    del table[key]

    def _record_error(self, operation: str, path: str, error: SourceError) -> None:
        if isinstance(error, NotCaptured):
            # Keep the links and directories on the way (a dangling link stays dangling): the
            # recording then lacks the same source and replays the same answer.
            self._trace(path)
            self._note_absence(path)
            return
        name = errno_name(error.reason)
        with self._lock:
            if name is None:
                self.recording.inexact.append(f"{operation} {path}: {error.reason} (recorded as EIO)")
                name = "EIO"
            elif not _replays_exactly(name, error.reason):
                self.recording.inexact.append(f"{operation} {path}: {error.reason} (recorded as {name})")
            self.recording.errors.setdefault(operation, {})[os.path.normpath(path)] = name

    # -- the recorded questions -----------------------------------------------------------------
    def read_bytes(self, path: str, max_bytes: int | None = None) -> bytes | None:
        try:
            data = super().read_bytes(path, max_bytes)
        except SourceError as error:
            too_large = _TOO_LARGE.match(error.reason)
            if too_large:
                self._record_prefix(path, int(too_large.group(1)) + 1)
            else:
                self._record_error("read", path, error)
            raise
        if data is None:
            self._note_absence(path)
        else:
            resolved = self._trace(path)
            if resolved is not None:
                with self._lock:
                    known = self.recording.files.get(resolved)
                    if known is None or len(data) > len(known):
                        self.recording.files[resolved] = data
                    self.recording.placeholders.discard(resolved)
        return data

    def read_for(self, path: str, user: FileUser | None, max_bytes: int | None = None) -> str | None:
        if user is None or user.uid == 0 or not self.is_live or os.geteuid() != 0:
            return self.read(path, max_bytes)  # recorded by read_bytes
        try:
            text = super().read_for(path, user, max_bytes)
        except SourceError as error:
            self._record_error("read", path, error)
            raise
        if text is None:
            self._note_absence(path)
        else:  # what the job's user could read, as a plain file at the path the job named
            with self._lock:
                self.recording.files[os.path.normpath(path)] = text.encode("utf-8")
        return text

    def _record_prefix(self, path: str, size: int) -> None:
        """Keep the first ``size`` bytes of a file too large to read whole, so that the replay
        refuses it with the same words."""
        resolved = self._trace(path)
        if resolved is None:
            return
        try:
            with open(self._real(resolved), "rb") as handle:
                data = handle.read(size)
        except OSError:
            return
        with self._lock:
            known = self.recording.files.get(resolved)
            if known is None or len(data) > len(known):
                self.recording.files[resolved] = data

    def listdir(self, path: str) -> list[str] | None:
        try:
            entries = super().listdir(path)
        except SourceError as error:
            self._record_error("listdir", path, error)
            raise
        if entries is None:
            self._note_absence(path)
        else:
            resolved = self._trace(path)
            if resolved is not None:
                with self._lock:
                    self.recording.dirs.add(resolved)
                for entry in entries:
                    self._note_entry(f"{resolved.rstrip('/')}/{entry}")
        return entries

    def readlink(self, path: str) -> str | None:
        try:
            target = super().readlink(path)
        except SourceError as error:
            self._record_error("readlink", path, error)
            raise
        if target is None:
            self._note_absence(path)
        else:
            location = self._trace(path, follow_last=False)
            if location is not None:
                with self._lock:
                    self.recording.links[location] = target
        return target

    def stat(self, path: str) -> FileStat | None:
        try:
            answer = super().stat(path)
        except SourceError as error:
            self._record_error("stat", path, error)
            raise
        if answer is None:
            self._note_absence(path)
        else:
            resolved = self._trace(path)
            with self._lock:
                self.recording.stats[os.path.normpath(path)] = answer
            if resolved is not None:
                self._note_entry(resolved)
        return answer

    def statvfs(self, path: str) -> FsUsage | None:
        host = os.path.normpath(path)
        try:
            usage = super().statvfs(path)
        except SourceError as error:
            if error.reason.startswith("no statvfs answer recorded") or isinstance(error, NotCaptured):
                # A recorded root without an answer for an existing path: leave it unanswered,
                # so the replay says the same (the stat before recorded the path itself).
                raise
            name = errno_name(error.reason)
            with self._lock:
                if name is None or not _replays_exactly(name, error.reason):
                    self.recording.inexact.append(f"statvfs {path}: {error.reason} (recorded as {name or 'EIO'})")
                self.recording.statvfs[host] = {"error": name or "EIO"}
            raise
        if usage is not None:
            # In bytes: a fragment size of 1 makes the replay's products exact.
            with self._lock:
                self.recording.statvfs[host] = {"f_frsize": 1, "f_blocks": usage.size, "f_bfree": usage.free, "f_bavail": usage.available}
            resolved = self._trace(path)
            if resolved is not None:
                self._note_entry(resolved)
        return usage

    def read_kernel_log(self, max_bytes: int = KERNEL_LOG_MAX_BYTES, keep: tuple[str, ...] = ()) -> list[str] | None:
        try:
            records = super().read_kernel_log(max_bytes, keep)
        except SourceError as error:
            self._record_error("read", "/dev/kmsg", error)
            raise
        with self._lock:
            self.recording.kernel_log = None if records is None else list(records)
        return records


# -- the other sources ------------------------------------------------------------------------------
class _Calls:
    """Answers keyed by question, plus the questions still waiting for an answer."""

    def __init__(self) -> None:
        self.answers: dict[str, Any] = {}
        self.waiting: dict[str, int] = {}
        self._lock = threading.Lock()

    @contextmanager
    def asking(self, *keys: str) -> Iterator[None]:
        with self._lock:
            for key in keys:
                self.waiting[key] = self.waiting.get(key, 0) + 1
        try:
            yield
        finally:
            with self._lock:
                for key in keys:
                    self.waiting[key] -= 1
                    if not self.waiting[key]:
                        del self.waiting[key]

    def answer(self, key: str, value: Any) -> None:
        with self._lock:
            self.answers.setdefault(key, value)

    def hung(self) -> list[str]:
        """Questions asked but never answered: recorded as hanging."""
        with self._lock:
            return [key for key in self.waiting if key not in self.answers]


def _source_error(error: SourceError) -> dict[str, str]:
    return {"source": error.source, "reason": error.reason}


def _failure(error: Exception) -> SourceError:
    """Any other exception of a wrapped source, in the form the replay can raise."""
    return SourceError(type(error).__name__, str(error))


class RecordingNvml:
    """Records ``call(function, index, *args)`` in the ``nvml.json`` format."""

    def __init__(self, inner: Nvml) -> None:
        self.inner = inner
        self._calls = _Calls()

    @staticmethod
    def _key(function: str, index: int | None, args: tuple[Argument, ...]) -> str:
        return function if index is None else f"{function}\0{replay_key(index, args)}"

    def call(self, function: str, index: int | None = None, *args: Argument) -> Any:
        key = self._key(function, index, args)
        with self._calls.asking(key):
            try:
                result = self.inner.call(function, index, *args)
            except NvmlError as error:
                message = str(error)
                detail = message[len(error.code) + 2:] if message.startswith(f"{error.code}: ") else ""
                self._calls.answer(key, {"error": error.code, "detail": detail})
                raise
            self._calls.answer(key, {"result": _json_value(result)})
            return result

    def document(self) -> dict[str, Any]:
        calls: dict[str, Any] = {}
        entries = dict(self._calls.answers)
        entries.update({key: {"hang": True} for key in self._calls.hung()})
        for key in sorted(entries):
            function, _, device = key.partition("\0")
            if device:
                calls.setdefault(function, {})[device] = entries[key]
            else:
                calls[function] = entries[key]
        return {"format": "preflight-nvml/1", "calls": calls}


def _json_value(value: Any) -> Any:
    """Tuples as lists, as the replay's JSON will give them back."""
    if isinstance(value, (list, tuple)):
        return [_json_value(item) for item in value]
    if isinstance(value, dict):
        return {str(key): _json_value(item) for key, item in value.items()}
    return value


class RecordingNetlink:
    """Records dumps, route lookups and DCB answers in the ``netlink.json`` format."""

    def __init__(self, inner: Netlink, links_from_files: bool = False) -> None:
        self.inner = inner
        self.links_from_files = links_from_files  # a FileNetlink: no netlink.json to write
        self._calls = _Calls()

    def _dump(self, name: str, ask: Callable[[], _T]) -> _T:
        with self._calls.asking(name):
            try:
                answer = ask()
            except SourceError as error:
                self._calls.answer(name, error)
                raise
            except Exception as error:
                self._calls.answer(name, _failure(error))
                raise
            self._calls.answer(name, answer)
            return answer

    def links(self) -> list[Link]:
        return self._dump("links", self.inner.links)

    def addresses(self) -> list[Address]:
        return self._dump("addresses", self.inner.addresses)

    def route_get(self, destination: str, source: str = "") -> Route:
        return self._dump(f"route {route_key(destination, source)}", lambda: self.inner.route_get(destination, source))

    def dcb(self, ifname: str) -> DcbConfig:
        return self._dump(f"dcb {ifname}", lambda: self.inner.dcb(ifname))

    def pause(self, ifname: str) -> PauseState:
        return self._dump(f"pause {ifname}", lambda: self.inner.pause(ifname))

    def firewall(self) -> Ruleset:
        return self._dump("firewall", self.inner.firewall)

    def document(self) -> dict[str, Any]:
        answers = dict(self._calls.answers)
        document: dict[str, Any] = {"format": "preflight-netlink/1", "links": [], "addresses": []}
        errors: dict[str, Any] = {}
        for dump_name in ("links", "addresses"):
            answer = answers.get(dump_name)
            if isinstance(answer, SourceError):
                errors[dump_name] = _source_error(answer)
            elif answer is not None:
                document[dump_name] = [asdict(item) for item in answer]
        routes: dict[str, Any] = {}
        dcb: dict[str, Any] = {}
        pause: dict[str, Any] = {}
        for key, answer in sorted(answers.items()):
            kind, _, name = key.partition(" ")
            if kind == "route":
                if isinstance(answer, SourceError):
                    routes[name] = {"source_error": _source_error(answer)}
                elif answer.error:
                    routes[name] = {"error": answer.error, "origin": answer.origin}
                else:
                    recorded = asdict(answer)
                    for dropped in ("destination", "source", "error"):
                        recorded.pop(dropped)
                    routes[name] = recorded
            elif kind == "dcb":
                dcb[name] = {"error": answer.reason, "source": answer.source} if isinstance(answer, SourceError) else asdict(answer)
            elif kind == "pause":
                pause[name] = (
                    {"error": answer.reason, "source": answer.source}
                    if isinstance(answer, SourceError)
                    else {"counters": dict(answer.counters), "prevention_timeout_ms": answer.prevention_timeout_ms}
                )
        if errors:
            document["errors"] = errors
        if routes:
            document["routes"] = routes
        if dcb:
            document["dcb"] = dcb
        if pause:
            document["pause"] = pause
        return document

    def firewall_document(self) -> dict[str, Any] | None:
        """The ``firewall.json`` of what was answered; None when nothing was (or the source had
        no recording either, which the replay says in the same words without a file)."""
        answer = dict(self._calls.answers).get("firewall")
        if answer is None or (isinstance(answer, SourceError) and answer.reason.startswith(FIREWALL_NOT_RECORDED)):
            return None
        if isinstance(answer, SourceError):
            return {"format": FIREWALL_FORMAT, "error": answer.reason, "source": answer.source}
        return {"format": FIREWALL_FORMAT, "ruleset": asdict(answer)}

    def hung(self) -> list[str]:
        return self._calls.hung()


class RecordingDns:
    """Records nameserver health and answers in the ``dns.json`` format."""

    def __init__(self, inner: Dns) -> None:
        self.inner = inner
        self._calls = _Calls()

    def nameservers(self) -> list[str]:
        return self.inner.nameservers()

    def _answered(self, answer: DnsAnswer) -> None:
        entry: dict[str, Any] = {}
        if answer.addresses:
            entry["addresses"] = list(answer.addresses)
        if answer.names:
            entry["names"] = list(answer.names)
        if answer.error:
            entry["error"] = answer.error
        if answer.detail:
            entry["detail"] = answer.detail
        self._calls.answer(f"answer {answer.name} {answer.rdtype}", entry)

    def resolve(self, name: str, rdtype: str, nameservers: Sequence[str] | None = None) -> DnsAnswer:
        key = f"answer {name} {rdtype}"
        with self._calls.asking(key):
            try:
                answer = self.inner.resolve(name, rdtype, nameservers)
            except SourceError as error:
                self._calls.answer(key, {"source_error": _source_error(error)})
                raise
        self._answered(answer)
        return answer

    def resolve_many(
        self, questions: Sequence[tuple[str, str]], nameservers: Sequence[str] | None = None
    ) -> list[DnsAnswer]:
        keys = [f"answer {name} {rdtype}" for name, rdtype in questions]
        with self._calls.asking(*keys):
            try:
                answers = self.inner.resolve_many(questions, nameservers)
            except SourceError as error:
                # A replayed batch stops at its first failing question; the replay of this
                # recording raises the same error at the first question that has no answer.
                for key in keys:
                    self._calls.answer(key, {"source_error": _source_error(error)})
                raise
        for answer in answers:
            self._answered(answer)
        return answers

    def check_nameservers(self, name: str) -> list[NameserverCheck]:
        keys = [f"server {server}" for server in self.inner.nameservers()]
        with self._calls.asking(*keys):
            try:
                checks = self.inner.check_nameservers(name)
            except SourceError as error:
                self._calls.answer("check_nameservers", _source_error(error))
                raise
        for check in checks:
            entry: dict[str, Any] = {}
            for attribute in ("rcode", "elapsed_s", "error", "detail"):
                value = getattr(check, attribute)
                if value not in ("", None):
                    entry[attribute] = value
            self._calls.answer(f"server {check.server}", entry)
        return checks

    def document(self) -> dict[str, Any]:
        entries = dict(self._calls.answers)
        entries.update({key: {"hang": True} for key in self._calls.hung()})
        servers = {key.split(" ", 1)[1]: value for key, value in sorted(entries.items()) if key.startswith("server ")}
        answers = {key.split(" ", 1)[1]: value for key, value in sorted(entries.items()) if key.startswith("answer ")}
        try:
            nameservers = self.inner.nameservers()
        except SourceError:
            nameservers = list(servers)
        document = {"format": "preflight-dns/1", "nameservers": nameservers, "servers": servers, "answers": answers}
        if "check_nameservers" in entries:
            document["errors"] = {"check_nameservers": entries["check_nameservers"]}
        return document


@dataclass
class Recorders:
    """The wrapped sources of one snapshot run; ``None`` where the source was left unwrapped."""

    fs: RecordingFS
    nvml: RecordingNvml | None
    netlink: RecordingNetlink | None
    dns: RecordingDns | None


def record(fs: RecordingFS, nvml: Nvml, netlink: Netlink, dns: Dns) -> Recorders:
    """Wrap the sources whose answers a recorded root must carry in ``.preflight/``. A
    ``FileNetlink``'s links, addresses and routes come from files read through ``fs`` (recorded
    there), so only its firewall answer goes to ``.preflight/``, never a ``netlink.json``. A source
    that had no recording to replay (``NoNvml``, ``NoDns``) is recorded too: its replay then says
    the same "no recording" words, naming the root that was recorded."""
    return Recorders(
        fs,
        RecordingNvml(nvml),
        RecordingNetlink(netlink, links_from_files=isinstance(netlink, FileNetlink)),
        RecordingDns(dns),
    )
