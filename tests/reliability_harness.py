"""The machinery of the reliability tests (``tests/reliability/test_reliability_*.py``), shared with
``bench/reliability.py``, which runs the same checks at larger scale: mutated recorded roots,
sources that hang (:class:`HungSources`), and measured commands for untrusted inputs
(:func:`measure`).

A *mutation* breaks one file the probes read in a writable copy of a recorded root: deletes it,
truncates it, garbles it, plants non-UTF-8 bytes, records a read error for it in
``.preflight/read-errors.json`` (``chmod 000`` does not bite as root, a recorded errno does),
replaces it with a symlink loop, a huge sparse file, a directory or a FIFO, or writes broken JSON
into a ``.preflight/*.json`` recording. :class:`MutationBench` applies mutations, runs every full
profile check in-process through the engine, restores the files, and judges the report against
the unmutated baseline with :func:`violations`.

The oracle. Kinds are split by what they do to the evidence:

* *unreadable* kinds (read errors, symlink loops, huge files, directories, FIFOs, non-UTF-8 bytes
  in a file read as text, broken recordings) leave the fact unknowable. A reference whose verdict
  they change must not become healthier: a ``present`` (reference, subject) may only disappear if
  the reference now says ``unknown`` for something, and a reference that was ``present`` or
  ``unknown`` (or ``absent``, i.e. checked) must not turn into nothing but ``absent`` /
  ``not_applicable``. Only references whose verdict changed matter: a file that no check needed
  can break freely.
* *content* kinds (delete, truncate, garble, non-UTF-8 bytes in a binary file) give the probes a
  different but readable node, on which a different verdict can be right; for them the oracle is
  the rest: no exception, no probe or check bug caught by the engine's safety net, every
  ``unknown`` with a reason, and the run inside its deadline.
"""

from __future__ import annotations

import errno as errno_codes
import json
import os
import random
import re
import shutil
import socket
import stat
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from preflight.config import HostConfig
from preflight.discovery import build_registry
from preflight.engine import Report, RunOptions, run
from preflight.model import Status
from preflight.registry import Registry
from preflight.sources import NodeFS, SourceError, Sources

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "nodes" / "hgx-h100"
FIXTURE_NODES = REPO / "tests" / "fixtures" / "nodes"
RUN_TIMEOUT_S = 10.0
#: Bigger than every read cap (NodeFS's 4 MiB, the 64 MiB TCP tables, 32 MiB recordings);
#: sparse, so it costs no disk.
HUGE_BYTES = 96 * 1024 * 1024
READ_ERRNOS = ("EACCES", "EIO", "EINVAL", "EPERM", "ENODEV", "ENXIO")

CONTENT_KINDS = ("delete", "truncate", "garble")
UNREADABLE_KINDS = ("read_error", "symlink_loop", "huge", "directory", "fifo")
# ``non_utf8`` is unreadable for a file read as text and content for one read as bytes.
FILE_KINDS = (*CONTENT_KINDS, "non_utf8", *UNREADABLE_KINDS)
RECORDING_KINDS = ("delete", "truncate", "garble", "non_utf8", "huge", "directory", "symlink_loop", "bad_json")

# Broken recordings: not JSON at all, and JSON of the wrong shape at each level.
BAD_JSON = (
    b"{not json",
    b"",
    b"null",
    b"[]",
    b'"a string"',
    b"1e999999",
    b'{"format": 7, "calls": [], "links": {}, "addresses": "x", "errors": [], "nodes": null}',
    b'{"calls": {"nvmlDeviceGetCount": {"result": "eight"}}, "links": [{"name": 5}], "errors": {"/x": "ENOSUCH"}}',
    b"[" * 100_000,
)
# A safety-net message: the engine's ``f"{type(error).__name__}: {error}"`` for a probe that raised
# something other than SourceError, or ``check failed: ...`` for a check that did.
_ENGINE_CAUGHT = re.compile(r"^(?:check failed: )?[A-Za-z_][A-Za-z0-9_]*(?:Error|Exception|Exit|Interrupt): ")
_HEALTHY = frozenset({Status.ABSENT.value, Status.NOT_APPLICABLE.value})
# Known gaps, left to the modules' owners: these references decide "no GPU / no NVSwitch here"
# from PCI vendor and class files without noticing when one could not be read, so breaking such
# a file can turn them not_applicable. Violations that need such a mutation are counted apart
# (``Outcome.known_gaps``, the bench's table), every other violation fails.
KNOWN_GAP_REFERENCES: frozenset[str] = frozenset()
_PCI_CLASSIFICATION = re.compile(r"^sys/devices/.+/(?:vendor|class)$")


def recorded_roots() -> list[Path]:
    """The README's example node and every fixture root."""
    fixtures = sorted(path for path in FIXTURE_NODES.iterdir() if path.is_dir())
    return [EXAMPLE, *fixtures]


class RecordingFS(NodeFS):
    """A NodeFS that notes which real files its reads reached (and which it read as text)."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.host_paths: dict[str, set[str]] = {}  # real path relative to root -> host paths
        self.text: set[str] = set()

    def _note(self, path: str) -> str | None:
        try:
            real = self._resolve(path)
        except Exception:
            return None
        relative = os.path.relpath(real, self.root)
        if relative.startswith("..") or not os.path.isfile(real) or os.path.islink(real):
            return None
        self.host_paths.setdefault(relative, set()).add(self._host_path(path))
        return relative

    def read_bytes(self, path: str, max_bytes: int | None = None) -> bytes | None:
        data = super().read_bytes(path, max_bytes)
        self._note(path)
        return data

    def read(self, path: str, max_bytes: int | None = None) -> str | None:
        try:
            return super().read(path, max_bytes)
        finally:
            relative = self._note(path)
            if relative is not None:
                self.text.add(relative)


@dataclass(frozen=True)
class Target:
    """One file of a recorded root that a full run reads."""

    relative: str  # path inside the root's directory
    host_paths: tuple[str, ...]  # the node paths probes named it by ("" for .preflight files)
    read_as_text: bool
    recording: bool  # a .preflight/ answer file


@dataclass(frozen=True)
class Mutation:
    kind: str
    target: Target
    seed: int

    def unreadable(self) -> bool:
        if self.kind in UNREADABLE_KINDS or self.kind == "bad_json":
            return True
        if self.target.recording:
            # A recording that is gone, cut or garbled is a broken recording, not a different node.
            return self.kind in ("truncate", "garble", "non_utf8", "huge", "directory", "symlink_loop") and self.target.relative != ".preflight/kmsg"
        return self.kind == "non_utf8" and self.target.read_as_text

    def describe(self) -> str:
        return f"{self.kind} {self.target.relative} (seed {self.seed})"


def kinds_for(target: Target) -> tuple[str, ...]:
    if target.recording:
        if target.relative.endswith(".json"):
            return RECORDING_KINDS
        return tuple(kind for kind in RECORDING_KINDS if kind != "bad_json")
    return FILE_KINDS


def targets_of(registry: Registry, root: Path) -> list[Target]:
    """Every regular file a full run of ``root`` reads, plus its ``.preflight`` recordings."""
    fs = RecordingFS(str(root))
    run(registry, Sources.for_fs(fs), HostConfig(), RunOptions(profile="full", timeout_s=RUN_TIMEOUT_S), "baseline")
    found = [
        Target(relative, tuple(sorted(hosts)), relative in fs.text, False)
        for relative, hosts in sorted(fs.host_paths.items())
        if not relative.startswith(".preflight/")
    ]
    recordings = root / ".preflight"
    if recordings.is_dir():
        found += [
            Target(f".preflight/{name}", (), False, True)
            for name in sorted(os.listdir(recordings))
            if (recordings / name).is_file() and name != "read-errors.json"
        ]
        if (recordings / "read-errors.json").is_file():
            # Broken read-error records would turn recorded EINVALs into absent files.
            found.append(Target(".preflight/read-errors.json", (), False, True))
    return found


# -- applying and undoing ---------------------------------------------------------------------
@dataclass
class _Saved:
    path: Path
    link: str | None = None
    data: bytes | None = None
    mode: int = 0o644
    existed: bool = True


def _save(path: Path) -> _Saved:
    if path.is_symlink():
        return _Saved(path, link=os.readlink(path))
    if not path.exists():
        return _Saved(path, existed=False)
    return _Saved(path, data=path.read_bytes(), mode=stat.S_IMODE(path.stat().st_mode))


def _remove(path: Path) -> None:
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)


def _restore(saved: _Saved) -> None:
    _remove(saved.path)
    if saved.link is not None:
        os.symlink(saved.link, saved.path)
    elif saved.existed and saved.data is not None:
        saved.path.write_bytes(saved.data)
        saved.path.chmod(saved.mode)


def _apply(root: Path, mutation: Mutation) -> None:
    rng = random.Random(mutation.seed)
    path = root / mutation.target.relative
    kind = mutation.kind
    data = path.read_bytes() if path.is_file() and not path.is_symlink() else b""
    if kind == "read_error":
        record = root / ".preflight" / "read-errors.json"
        try:
            document = json.loads(record.read_text())
            errors = document["errors"] if isinstance(document.get("errors"), dict) else {}
        except (OSError, ValueError, AttributeError):
            errors = {}
        for host in mutation.target.host_paths:
            errors[host] = rng.choice(READ_ERRNOS)
        record.parent.mkdir(parents=True, exist_ok=True)
        record.write_text(json.dumps({"format": "preflight-read-errors/1", "errors": errors}))
        return
    _remove(path)
    if kind == "delete":
        return
    if kind == "truncate":
        path.write_bytes(data[: rng.randrange(len(data))] if data else b"")
    elif kind == "garble":
        garbled = bytearray(data or b"\0")
        for _ in range(rng.randint(1, 8)):
            garbled[rng.randrange(len(garbled))] = rng.randrange(256)
        path.write_bytes(bytes(garbled))
    elif kind == "non_utf8":
        cut = rng.randrange(len(data) + 1)
        path.write_bytes(data[:cut] + rng.choice((b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\x80\x80")) + data[cut:])
    elif kind == "symlink_loop":
        os.symlink(path.name, path)
    elif kind == "huge":
        with open(path, "wb") as handle:
            handle.write(data[:4096])
            handle.truncate(HUGE_BYTES)
    elif kind == "directory":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "bad_json":
        path.write_bytes(rng.choice(BAD_JSON))
    else:
        raise ValueError(f"unknown mutation kind {kind!r}")


@contextmanager
def mutated(root: Path, mutations: list[Mutation]) -> Iterator[None]:
    """Apply ``mutations`` to the writable root, undo them afterwards."""
    paths = {root / m.target.relative for m in mutations} | {root / ".preflight" / "read-errors.json"}
    saved = [_save(path) for path in sorted(paths)]
    try:
        for mutation in mutations:
            _apply(root, mutation)
        yield
    finally:
        for item in reversed(saved):
            _restore(item)


# -- running and judging ----------------------------------------------------------------------
Verdicts = dict[str, frozenset[tuple[str, str]]]  # reference ID -> {(status, subject)}


def verdicts(report: Report) -> Verdicts:
    found: dict[str, set[tuple[str, str]]] = {}
    for finding in report.findings:
        found.setdefault(finding.reference_id, set()).add((finding.status.value, finding.subject))
    return {ref: frozenset(items) for ref, items in found.items()}


@dataclass
class Outcome:
    """One mutated run and what the oracle made of it."""

    mutations: list[Mutation]
    seconds: float
    report: Report | None
    crash: str = ""
    problems: list[str] = field(default_factory=list)
    changed: frozenset[str] = frozenset()  # references whose verdict differs from the baseline
    known_gaps: list[str] = field(default_factory=list)  # see KNOWN_GAP_REFERENCES


def run_root(registry: Registry, root: Path) -> Report:
    config = HostConfig()
    options = RunOptions(profile="full", timeout_s=RUN_TIMEOUT_S)
    return run(registry, Sources.for_fs(NodeFS(str(root))), config, options, "mutated")


def safety_net_catches(report: Report) -> list[str]:
    """Probe or check exceptions the engine had to catch: bugs, even though the run survived."""
    caught = [f"probe {p.name}: {p.error}" for p in report.probes if p.status == "error" and _ENGINE_CAUGHT.match(p.error)]
    caught += [f"{f.reference_id} {f.subject}: {f.reason}" for f in report.findings if f.reason.startswith("check failed: ")]
    return caught


def unclean_run(report: Report) -> list[str]:
    """What no run may leave: exceptions the engine had to catch, and ``unknown`` findings that
    do not say why."""
    return safety_net_catches(report) + [
        f"{f.reference_id} {f.subject}: unknown without a reason" for f in report.findings
        if f.status is Status.UNKNOWN and not f.reason.strip()
    ]


def violations(baseline: Verdicts, report: Report, unreadable: bool) -> tuple[list[str], frozenset[str]]:
    """What the oracle objects to in ``report`` (see the module docstring) and the references
    whose verdict changed."""
    problems = unclean_run(report)
    after = verdicts(report)
    changed = frozenset(ref for ref in baseline.keys() | after.keys() if baseline.get(ref) != after.get(ref))
    if unreadable:
        for ref in sorted(changed):
            before, now = baseline.get(ref, frozenset()), after.get(ref, frozenset())
            now_statuses = {status for status, _ in now}
            if "unknown" in now_statuses:
                continue
            lost = sorted(subject for status, subject in before - now if status == "present")
            if lost:
                problems.append(f"{ref}: present for {', '.join(lost)} vanished without an unknown ({sorted(now)})")
            elif now_statuses <= _HEALTHY and {status for status, _ in before} - {"not_applicable"}:
                problems.append(f"{ref}: {sorted(before)} became {sorted(now)} when its input became unreadable")
    return problems, changed


class MutationBench:
    """A writable copy of each recorded root, its baseline verdicts and its mutation targets."""

    def __init__(self, workdir: Path, roots: list[Path] | None = None) -> None:
        self.registry = build_registry(plugins=False)
        self.roots: dict[str, Path] = {}
        self.baselines: dict[str, Verdicts] = {}
        self.targets: dict[str, list[Target]] = {}
        for source in roots or recorded_roots():
            copy = workdir / source.name
            shutil.copytree(source, copy, symlinks=True)
            self.roots[source.name] = copy
            self.targets[source.name] = targets_of(self.registry, copy)
            self.baselines[source.name] = verdicts(run_root(self.registry, copy))

    def try_mutations(self, name: str, mutations: list[Mutation]) -> Outcome:
        root = self.roots[name]
        with mutated(root, mutations):
            begin = time.monotonic()
            try:
                report = run_root(self.registry, root)
            except Exception as error:  # the very thing the harness looks for
                return Outcome(mutations, time.monotonic() - begin, None, crash=f"{type(error).__name__}: {error}")
            seconds = time.monotonic() - begin
        unreadable = all(m.unreadable() for m in mutations)
        problems, changed = violations(self.baselines[name], report, unreadable)
        known_gaps: list[str] = []
        if any(_PCI_CLASSIFICATION.match(m.target.relative) for m in mutations):
            # Oracle messages start with "<reference>:"; crashes ("probe x: ...") are never excused.
            known_gaps = [p for p in problems if p.split(":", 1)[0] in KNOWN_GAP_REFERENCES]
            problems = [p for p in problems if p not in known_gaps]
        # The time against RUN_TIMEOUT_S is bench/reliability.py's to report, not a problem here:
        # another process on the machine would move it.
        return Outcome(mutations, seconds, report, problems=problems, changed=changed, known_gaps=known_gaps)


def random_mutations(rng: random.Random, bench: MutationBench, name: str, most: int = 3) -> list[Mutation]:
    """One to ``most`` mutations of distinct files of root ``name``."""
    targets = bench.targets[name]
    chosen = rng.sample(targets, k=min(len(targets), rng.randint(1, most)))
    return [Mutation(rng.choice(kinds_for(target)), target, rng.randrange(2**32)) for target in chosen]


def errno_name(code: int) -> str:
    return errno_codes.errorcode.get(code, str(code))


# -- hung sources -----------------------------------------------------------------------------
# Stubs injected through ``Sources`` for what a recorded root cannot make hang by itself. Each
# blocks until ``release()`` so that a test can end its stuck threads when it is done; the
# NVML replay's ``{"hang": true}`` blocks for good, as a wedged driver does.


class HangingNetlink:
    """A netlink source whose every dump never returns (a kernel that never answers)."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.calls = 0

    def _hang(self) -> Any:
        self.calls += 1
        self.gate.wait()
        raise SourceError("netlink", "released after hanging")

    def links(self) -> list[Any]:
        return cast("list[Any]", self._hang())

    def addresses(self) -> list[Any]:
        return cast("list[Any]", self._hang())

    def route_get(self, destination: str, source: str = "") -> Any:
        return self._hang()

    def dcb(self, ifname: str) -> Any:
        return self._hang()

    def pause(self, ifname: str) -> Any:
        return self._hang()

    def firewall(self) -> Any:
        return self._hang()

    def release(self) -> None:
        self.gate.set()


class BlockingFS(NodeFS):
    """A recorded root whose reads under ``blocked`` never return (a sysfs read in D state)."""

    def __init__(self, root: str, blocked: tuple[str, ...], gate: threading.Event) -> None:
        super().__init__(root)
        self.blocked = blocked
        self.gate = gate

    def read_bytes(self, path: str, max_bytes: int | None = None) -> bytes | None:
        if path.startswith(self.blocked):
            self.gate.wait()
            raise SourceError(path, "released after blocking")
        return super().read_bytes(path, max_bytes)


class SilentDnsServer:
    """A UDP socket on loopback that reads queries and never answers."""

    def __init__(self, address: str = "127.0.0.79") -> None:
        self.socket = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.socket.bind((address, 0))
        self.socket.settimeout(0.2)
        self.address, self.port = self.socket.getsockname()
        self.stop = threading.Event()
        self.queries = 0
        self.thread = threading.Thread(target=self._swallow, name="silent-dns", daemon=True)
        self.thread.start()

    def _swallow(self) -> None:
        while not self.stop.is_set():
            try:
                self.socket.recvfrom(4096)
                self.queries += 1
            except OSError:
                continue

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.socket.close()


def hang_nvml(root: Path) -> None:
    """Make the root's NVML recording block forever on the first calls every NVML probe makes."""
    path = root / ".preflight" / "nvml.json"
    document = json.loads(path.read_text())
    for function in ("nvmlSystemGetDriverVersion", "nvmlDeviceGetCount"):
        document["calls"][function] = {"hang": True}
    path.write_text(json.dumps(document))


@dataclass
class HungSources:
    """Every source of one recorded root hung at once: NVML (replay hang), netlink (stub), DNS
    (a live resolver asking a server that never answers), and the reads of ``BLOCKED_PATHS``."""

    root: Path
    dns_server: SilentDnsServer
    netlink: HangingNetlink = field(default_factory=HangingNetlink)
    fs_gate: threading.Event = field(default_factory=threading.Event)

    BLOCKED_PATHS = ("/proc/net/tcp",)

    def sources(self) -> Sources:
        from preflight.sources.dns import LiveDns, ResolvConf
        from preflight.sources.nvml import ReplayNvml

        fs = BlockingFS(str(self.root), self.BLOCKED_PATHS, self.fs_gate)
        nvml = ReplayNvml.from_file(str(self.root / ".preflight" / "nvml.json"))
        dns = LiveDns(ResolvConf((self.dns_server.address,), ("cluster",)), self.dns_server.port, lifetime=30.0)
        return Sources(fs, nvml, self.netlink, dns)

    def release(self) -> None:
        self.netlink.release()
        self.fs_gate.set()


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


# -- untrusted inputs -------------------------------------------------------------------------
@dataclass(frozen=True)
class Measured:
    """One command's exit status, output, wall time and peak resident memory."""

    returncode: int
    stdout: str
    stderr: str
    seconds: float
    max_rss_mb: float


# Runs the command as its only child and reports RUSAGE_CHILDREN's peak RSS, which in the test
# process would be the largest of every child it ever waited for.
_MEASURE = """
import json, resource, subprocess, sys, time
begin = time.monotonic()
result = subprocess.run(sys.argv[2:], stdin=subprocess.DEVNULL, timeout=float(sys.argv[1]))
peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
sys.stderr.write("\\n@@measure " + json.dumps([result.returncode, time.monotonic() - begin, peak]) + "\\n")
"""


def measure(command: list[str], timeout: float = 600) -> Measured:
    import subprocess
    import sys

    wrapped = subprocess.run(
        [sys.executable, "-c", _MEASURE, str(timeout), *command],
        capture_output=True, text=True, errors="replace", timeout=timeout + 30, cwd="/",
    )
    stderr, _, tail = wrapped.stderr.rpartition("\n@@measure ")
    returncode, seconds, peak = json.loads(tail)
    return Measured(returncode, wrapped.stdout, stderr, seconds, peak)


def repetitive_log(path: Path, size: int) -> None:
    """NCCL setup chatter with the catalogue's own example lines spread through it."""
    from preflight.catalogue import load_all

    examples = [e for r in load_all() for item in r.signatures for e in item.get("examples", [])]
    chatter = "gpu017:2187:2301 [3] NCCL INFO Channel 05/0 : 3[3] -> 4[4] via P2P/CUMEM/read\n" * 20
    block = "".join(chatter + example + "\n" for example in examples).encode()
    with open(path, "wb") as handle:
        written = 0
        while written < size:
            handle.write(block[: size - written])
            written += min(len(block), size - written)


def sparse_file(path: Path, size: int) -> None:
    with open(path, "wb") as handle:
        handle.truncate(size)


# -- capture units ----------------------------------------------------------------------------
# The property of issue "missing is not empty": deleting a whole capture unit (a source a partial
# capture, a container or an old kernel may lack) never creates a problem and never turns
# "could not tell" into "fine". Units come from preflight.sources.capture.CAPTURE_UNITS, plus
# each .preflight recording.


@dataclass(frozen=True)
class UnitInstance:
    """One capture unit found in a root: the node path and the real path to delete."""

    node_path: str
    relative: str  # inside the root's directory


def capture_unit_instances(root: Path, per_pattern: int | None = None) -> list[UnitInstance]:
    """Every capture unit present in ``root`` (patterns expanded through the root's links, as
    the probes see it), and each ``.preflight`` recording. ``per_pattern`` keeps the first and
    last instances of each pattern only (each interface's ``mtu`` is the same kind of unit)."""
    from preflight.sources.capture import CAPTURE_UNITS

    fs = NodeFS(str(root))
    found: dict[str, UnitInstance] = {}
    for pattern, _ in CAPTURE_UNITS:
        if "**" in pattern:
            continue  # per-device config files are covered by the mutation tests
        expanded = _expand(fs, pattern.split("/")[1:], "")
        if per_pattern is not None and len(expanded) > per_pattern:
            expanded = expanded[: per_pattern - 1] + expanded[-1:]
        for node_path in expanded:
            real = Path(fs._resolve(node_path))
            if not (real.exists() or real.is_symlink()):
                continue
            relative = os.path.relpath(real, root)
            if relative.startswith(".."):
                continue
            found.setdefault(relative, UnitInstance(node_path, relative))
    recordings = root / ".preflight"
    if recordings.is_dir():
        for name in sorted(os.listdir(recordings)):
            found.setdefault(f".preflight/{name}", UnitInstance(f".preflight/{name}", f".preflight/{name}"))
    return sorted(found.values(), key=lambda unit: unit.relative)


def _expand(fs: NodeFS, parts: list[str], prefix: str) -> list[str]:
    if not parts:
        return [prefix]
    head, rest = parts[0], parts[1:]
    if head in ("*", "<pid>"):
        try:
            entries = fs.listdir(prefix or "/") or []
        except SourceError:
            return []
        names = [e for e in entries if head == "*" or e.isdigit()]
    else:
        names = [head]
    paths: list[str] = []
    for name in names:
        paths += _expand(fs, rest, f"{prefix}/{name}")
    return paths


@contextmanager
def deleted(root: Path, unit: UnitInstance) -> Iterator[None]:
    """``unit`` moved out of ``root`` for the duration (a rename: cheap and exact to undo)."""
    path = root / unit.relative
    aside = root.parent / f".aside-{root.name}"
    os.rename(path, aside)
    try:
        yield
    finally:
        os.rename(aside, path)


_PROCESS_ENTRY = re.compile(r"^/proc/[0-9]+$")


def capture_violations(baseline: Report, report: Report, unit: UnitInstance | None = None) -> list[str]:
    """What deleting a capture unit must never do: make a finding ``present`` that was not,
    turn an ``unknown`` into ``absent`` or ``not_applicable``, or let a reference that had a
    present or unknown finding end with only healthy ones. A deleted ``/proc/<pid>`` only has to
    keep the first rule: a process without its entry is, to every observer, not running."""
    before = {(f.reference_id, f.subject): f.status.value for f in baseline.findings}
    after = {(f.reference_id, f.subject): f.status.value for f in report.findings}
    problems = safety_net_catches(report)
    process_gone = unit is not None and _PROCESS_ENTRY.match(unit.node_path) is not None
    for key, status in sorted(after.items()):
        was = before.get(key)
        if status == "present" and was != "present":
            problems.append(f"{key[0]} {key[1]}: {was or 'no finding'} -> present")
        elif process_gone:
            continue
        elif was == "unknown" and status in _HEALTHY:
            problems.append(f"{key[0]} {key[1]}: unknown -> {status}")
    for reference in sorted({ref for ref, _ in before}) if not process_gone else ():
        old = {s for (ref, _), s in before.items() if ref == reference}
        new = {s for (ref, _), s in after.items() if ref == reference}
        if old & {"present", "unknown"} and new and new <= _HEALTHY:
            problems.append(f"{reference}: {sorted(old)} -> {sorted(new)}")
    return problems


REAL_ROOTS = REPO / "tests" / "data" / "real-roots"


def real_root_archives() -> list[Path]:
    """The real captures of ``tests/data/real-roots`` (see its README and PROVENANCE.toml)."""
    return sorted(REAL_ROOTS.glob("*.tar.gz"))


def extracted_real_roots(workdir: Path) -> list[Path]:
    """Every real capture extracted under ``workdir`` (with preflight's own safe extractor)."""
    from preflight.sources.archive import extract_archive

    roots = []
    for archive in real_root_archives():
        target = workdir / archive.name[: -len(".tar.gz")]
        target.mkdir()
        extract_archive(str(archive), str(target))
        roots.append(target)
    return roots
