"""Select checks, run the probes they need concurrently under deadlines, judge, and report.

Probes run in daemon threads: a thread stuck in the kernel (a wedged NVML call, a DNS server
that never answers, a sysfs read in D state) cannot be killed, so the engine stops waiting for
it at its deadline, marks what it feeds ``unknown`` and moves on; the CLI exits with
``os._exit`` when such a thread is still alive so that interpreter shutdown cannot wait on it.
In a process that runs many times, a probe whose earlier thread is still stuck on the same
node and kind of source is not started again (it is ``unknown`` at once), so stuck threads stay
bounded by the number of distinct stuck probes instead of growing with every run.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec
from msgspec import Struct

from preflight import __version__
from preflight.config import HostConfig
from preflight.model import (
    Finding,
    NotApplicable,
    Observation,
    ProbeOutcome,
    Reference,
    Status,
    Unknown,
    Unread,
    selects,
)
from preflight.registry import CheckSpec, ProbeSpec, Registry
from preflight.sources import SourceError, Sources

if TYPE_CHECKING:
    from preflight.apart import Apart

REPORT_SCHEMA = "preflight-report/1"


class RunOptions(Struct, frozen=True):
    """What the user asked for on the command line (config supplies the defaults)."""

    profile: str = "full"
    select: tuple[str, ...] = ()
    ignore: tuple[str, ...] = ()
    timeout_s: float = 10.0
    probe_timeout_s: float = 3.0
    # Run the probes in a child process the run can abandon (preflight.apart): a read stuck in
    # the kernel then holds that child, never the process that reports and exits.
    apart: bool = False


class Report(Struct, frozen=True):
    """Everything one run found, ready for the reporters."""

    hostname: str
    root: str
    profile: str
    started_at: float
    duration_s: float
    findings: tuple[Finding, ...]
    probes: tuple[ProbeOutcome, ...]
    facts: dict[str, Any]
    config_origin: str = ""

    def with_root(self, root: str) -> Report:
        """The same report, naming ``root`` (a snapshot archive, not its temporary copy)."""
        return msgspec.structs.replace(self, root=root)

    def to_json(self) -> dict[str, Any]:
        counts = {status.value: 0 for status in Status}
        for finding in self.findings:
            counts[finding.status.value] += 1
        return {
            "schema": REPORT_SCHEMA,
            "tool": {"name": "preflight", "version": __version__},
            "host": self.hostname,
            "root": self.root,
            "profile": self.profile,
            "config": self.config_origin,
            "started_at": round(self.started_at, 3),
            "duration_s": round(self.duration_s, 6),
            "summary": counts,
            "findings": [finding.to_json() for finding in self.findings],
            "probes": [probe.to_json() for probe in self.probes],
            "facts": self.facts,
        }


def select_checks(registry: Registry, config: HostConfig, options: RunOptions) -> list[tuple[CheckSpec, Reference]]:
    """The checks this run decides, in ID order, with their references."""
    chosen = []
    for ref_id in sorted(registry.checks):
        spec = registry.checks[ref_id]
        if options.profile not in spec.profiles or ref_id in config.disabled:
            continue
        reference = registry.references.get(ref_id)
        if options.select and not any(selects(token, reference) for token in options.select):
            continue
        if any(selects(token, reference) for token in options.ignore):
            continue
        chosen.append((spec, reference))
    return chosen


def _probes_to_run(registry: Registry, checks: Iterable[CheckSpec], profile: str) -> list[ProbeSpec]:
    names = {name for spec in checks for name in spec.probes}
    names |= {name for name, spec in registry.probes.items() if profile in spec.gather_in}
    return [registry.probes[name] for name in registry.needed_probes(names)]


def _call_probe(spec: ProbeSpec, sources: Sources, config: HostConfig, needed: dict[str, Any]) -> Any:
    arguments = {name: (config if name == "settings" else sources.by_name(name)) for name in spec.sources}
    return spec.func(**arguments, **needed)


# Probe threads a run stopped waiting for, by what they were asked (see _abandon_key), with
# when they started. A later run in the same process does not start the same probe against
# the same kind of source while its predecessor is still stuck: a wedged driver or a dead
# server would only swallow one more thread per run, and a long-lived process (a daemon, a
# test suite, a fleet replay) would collect them without bound.
_ABANDONED: dict[tuple[str, ...], tuple[threading.Thread, float]] = {}
_ABANDONED_LOCK = threading.Lock()


def _abandon_key(spec: ProbeSpec, sources: Sources) -> tuple[str, ...]:
    """The probe, the node, and the classes of the sources it reads: a run on another root, or
    with another NVML/netlink/DNS implementation, is not held back by this one's stuck call."""
    kinds = tuple(type(sources.by_name(name)).__qualname__ for name in spec.sources if name != "settings")
    return (spec.name, sources.fs.root, *kinds)


def _still_stuck(key: tuple[str, ...]) -> float | None:
    """When the stuck thread for ``key`` started (monotonic), or None if there is none."""
    with _ABANDONED_LOCK:
        for known in [k for k, (thread, _) in _ABANDONED.items() if not thread.is_alive()]:
            del _ABANDONED[known]
        entry = _ABANDONED.get(key)
    return entry[1] if entry else None


_T = TypeVar("_T")
#: How long after a run starts its probe threads take turns (see _Turns).
TURN_TAKING_S = 0.15


class _Turns:
    """Probe threads take turns for the first moments of a run instead of all contending for the
    GIL. Probes are mostly Python reading many small files, and every read releases the GIL: with
    twenty threads runnable, each read became a hand-over between threads, and the example node's
    prolog probes took twice as long together (49 ms) as one after another (24 ms). A thread
    waiting for its turn sleeps on a lock, so the one running keeps the GIL across its reads.

    Turn-taking ends ``TURN_TAKING_S`` after the run starts: a probe still running then (hung in a
    driver, waiting on a dead DNS server, or just slow) holds nobody back any longer, and everyone
    still waiting goes ahead at once. Deadlines are unchanged."""

    def __init__(self, until: float) -> None:
        self._lock = threading.Lock()
        self._until = until  # time.monotonic(): lock timeouts are real time, whatever the clock

    def run(self, func: Callable[[], _T]) -> _T:
        taken = self._lock.acquire(timeout=max(0.0, self._until - time.monotonic()))
        try:
            return func()
        finally:
            if taken:
                self._lock.release()


def run_probes(
    specs: list[ProbeSpec],
    sources: Sources,
    config: HostConfig,
    options: RunOptions,
    deadline: float,
    on_outcome: Callable[[ProbeOutcome], None] | None = None,
) -> dict[str, ProbeOutcome]:
    """Run every probe in its own daemon thread; stop waiting at its deadline or the run's.
    ``on_outcome`` is called (from the probe's thread) with each outcome as soon as it is known."""
    clock = sources.clock
    results: dict[str, ProbeOutcome] = {}
    done = {spec.name: threading.Event() for spec in specs}
    threads: dict[str, threading.Thread] = {}
    outcomes: dict[str, ProbeOutcome] = {}
    started = clock.monotonic()
    now = time.monotonic()
    turns = _Turns(now + TURN_TAKING_S)

    def attempt(spec: ProbeSpec, needed: dict[str, Any]) -> ProbeOutcome:
        begin = clock.monotonic()  # the probe's own time, not its wait for a turn
        try:
            facts = _call_probe(spec, sources, config, needed)
            return ProbeOutcome(spec.name, "ok", clock.monotonic() - begin, facts)
        except (SourceError, Unknown) as error:  # a fact the probe needs could not be had
            return ProbeOutcome(spec.name, "error", clock.monotonic() - begin, error=str(error))
        except Exception as error:  # a probe bug must not crash the run
            return ProbeOutcome(spec.name, "error", clock.monotonic() - begin, error=f"{type(error).__name__}: {error}")

    def needed_facts(spec: ProbeSpec) -> dict[str, Any] | ProbeOutcome:
        """The facts of the probes ``spec`` needs, waited for (never while holding a turn), or
        the outcome that says why ``spec`` cannot run."""
        needed: dict[str, Any] = {}
        for name in spec.needs:
            limit = spec.timeout_s if spec.timeout_s is not None else options.probe_timeout_s
            if name not in done or not done[name].wait(max(0.0, min(started + limit, deadline) - clock.monotonic())):
                return ProbeOutcome(spec.name, "error", 0.0, error=f"needs probe {name}, which did not finish")
            outcome = results[name]
            if outcome.status != "ok":
                return ProbeOutcome(spec.name, "error", 0.0, error=f"needs probe {name}: {outcome.error or outcome.status}")
            needed[name] = outcome.facts
        return needed

    def work(spec: ProbeSpec) -> None:
        needed = needed_facts(spec)
        if isinstance(needed, ProbeOutcome):
            results[spec.name] = needed
        else:
            results[spec.name] = turns.run(lambda: attempt(spec, needed))
        done[spec.name].set()
        if on_outcome is not None:
            on_outcome(results[spec.name])

    for spec in specs:
        stuck_since = _still_stuck(_abandon_key(spec, sources))
        if stuck_since is not None:
            outcomes[spec.name] = ProbeOutcome(
                spec.name, "timeout", 0.0,
                error=f"timed out: the same probe has been stuck for {now - stuck_since:.1f} s in an earlier run; not started again",
            )
            del done[spec.name]  # probes that need it learn at once that it will not finish
    for spec in specs:
        if spec.name in outcomes:
            continue
        thread = threading.Thread(target=work, args=(spec,), name=f"probe-{spec.name}", daemon=True)
        threads[spec.name] = thread
        thread.start()

    for spec in specs:
        if spec.name in outcomes:
            continue
        limit = spec.timeout_s if spec.timeout_s is not None else options.probe_timeout_s
        probe_deadline = min(started + limit, deadline)
        finished = done[spec.name].wait(max(0.0, probe_deadline - clock.monotonic()))
        if finished:
            outcomes[spec.name] = results[spec.name]
        else:
            waited = clock.monotonic() - started
            outcomes[spec.name] = ProbeOutcome(
                spec.name, "timeout", waited, error=f"timed out after {waited:.1f} s"
            )
            with _ABANDONED_LOCK:
                _ABANDONED[_abandon_key(spec, sources)] = (threads[spec.name], now)
    return outcomes


def _finding(reference: Reference, config: HostConfig, observation: Observation) -> Finding:
    severity = config.severity.get(reference.id) or observation.severity or reference.severity
    return Finding(
        reference_id=reference.id,
        symbol=reference.symbol,
        title=reference.title,
        status=observation.status,
        severity=severity,
        subject=observation.subject,
        evidence=observation.evidence,
        fix=observation.fix or reference.fix_text,
        reason=observation.reason,
    )


def _verdict(reference: Reference, config: HostConfig, status: Status, reason: str = "") -> Finding:
    return Finding(
        reference_id=reference.id,
        symbol=reference.symbol,
        title=reference.title,
        status=status,
        severity=config.severity.get(reference.id, reference.severity),
        subject="node",
        fix=reference.fix_text if status is Status.UNKNOWN else "",
        reason=reason,
    )


def judge(
    spec: CheckSpec, reference: Reference, outcomes: dict[str, ProbeOutcome], config: HostConfig
) -> list[Finding]:
    """Run one check on gathered facts; never raises."""
    arguments: dict[str, Any] = {}
    for name in spec.probes:
        outcome = outcomes[name]
        if outcome.status == "ok":
            arguments[name] = outcome.facts
            continue
        detail = outcome.error or outcome.status
        if name not in spec.optional:
            return [_verdict(reference, config, Status.UNKNOWN, f"probe {name}: {detail}")]
        arguments[name] = Unread(name, detail)
    if spec.wants_expect:
        arguments["expect"] = config.expect
    try:
        observations = list(spec.func(**arguments))
    except NotApplicable as error:
        return [_verdict(reference, config, Status.NOT_APPLICABLE, str(error))]
    except Unknown as error:
        return [_verdict(reference, config, Status.UNKNOWN, str(error))]
    except Exception as error:  # a check bug becomes unknown, never a crash
        return [_verdict(reference, config, Status.UNKNOWN, f"check failed: {type(error).__name__}: {error}")]
    if not observations:
        return [_verdict(reference, config, Status.ABSENT)]
    return [_finding(reference, config, observation) for observation in observations]


def facts_to_json(value: Any) -> Any:
    """Facts (records, tuples, enums) as plain JSON values: what a report's reader gets back
    from the JSON (lists, not tuples), so that a report in memory equals its replay."""
    return _as_lists(msgspec.to_builtins(value, str_keys=True))


def _as_lists(value: Any) -> Any:
    if type(value) is tuple or type(value) is list:
        return [_as_lists(item) for item in value]
    if type(value) is dict:
        return {key: _as_lists(item) for key, item in value.items()}
    return value


class EarlyProbes(Struct):
    """Probes started in their child process before the checks were imported (:func:`start_early`)."""

    apart: Apart
    started_at: float
    begin: float  # the clock's monotonic reading when the run began
    deadline: float


def start_early(probes: Registry, sources: Sources, config: HostConfig, options: RunOptions) -> EarlyProbes | None:
    """Start every probe of ``probes`` (a registry of probe modules only) in a child process,
    so that they run while this process imports the check modules and loads their references:
    on a node with a core to spare the two overlap. None when the probes cannot run apart here
    (:func:`run` then starts them itself)."""
    if not options.apart or threading.active_count() != 1:
        return None
    from preflight.apart import start_apart

    clock = sources.clock
    started_at, begin = clock.now(), clock.monotonic()
    deadline = begin + options.timeout_s
    specs = [probes.probes[name] for name in probes.needed_probes(probes.probes)]
    apart = start_apart(run_probes, specs, sources, config, options, deadline)
    return None if apart is None else EarlyProbes(apart, started_at, begin, deadline)


def run(
    registry: Registry,
    sources: Sources,
    config: HostConfig,
    options: RunOptions,
    hostname: str,
    checks: list[tuple[CheckSpec, Reference]] | None = None,
    early: EarlyProbes | None = None,
) -> Report:
    """One complete preflight run: never raises for node problems. ``checks``: the selection,
    when the caller already made it (:func:`select_checks`); ``early``: probes already started
    (:func:`start_early`), whose run began then."""
    clock = sources.clock
    started_at = clock.now() if early is None else early.started_at
    begin = clock.monotonic() if early is None else early.begin
    deadline = begin + options.timeout_s if early is None else early.deadline
    if checks is None:
        checks = select_checks(registry, config, options)
    probe_specs = _probes_to_run(registry, (spec for spec, _ in checks), options.profile)
    wanted = {spec.name for spec in probe_specs}
    if early is not None and wanted <= early.apart.names:
        outcomes = early.apart.collect(wanted, deadline, clock.monotonic)
    elif early is not None:
        # The checks need a probe the early start did not know of (none of the built-in ones):
        # the run starts over in threads rather than join two partial sets of facts.
        early.apart.collect(set(), deadline, clock.monotonic)
        outcomes = run_probes(probe_specs, sources, config, options, deadline)
    # Fork only from a single-threaded process: a child forked while another thread holds a lock
    # (an import, an allocator arena) can wait on it forever. The command line is; a library
    # caller with threads of its own gets the probe threads here instead.
    elif options.apart and threading.active_count() == 1:
        from preflight.apart import run_probes_apart

        outcomes = run_probes_apart(run_probes, probe_specs, sources, config, options, deadline)
    else:
        outcomes = run_probes(probe_specs, sources, config, options, deadline)
    findings: list[Finding] = []
    for spec, reference in checks:
        findings.extend(judge(spec, reference, outcomes, config))
    # By probe name: outcomes arrive in the order probes finish, and a report must read the same
    # on every run (diffs, goldens, the fleet's comparisons).
    facts = {name: facts_to_json(outcomes[name].facts) for name in sorted(outcomes) if outcomes[name].status == "ok"}
    return Report(
        hostname=hostname,
        root=sources.fs.root,
        profile=options.profile,
        started_at=started_at,
        duration_s=clock.monotonic() - begin,
        findings=tuple(findings),
        probes=tuple(outcomes[spec.name] for spec in probe_specs),
        facts=facts,
        config_origin=config.origin,
    )
