"""Probes run apart: in a child process that the run can abandon at its deadline.

A read stuck in the kernel (a wedged driver's sysfs file, NVML waiting on a GPU that fell off the
bus, a FUSE or NFS mount that never answers) puts its thread in uninterruptible sleep: no signal
ends it, and a process with such a thread cannot exit. Run in a probe thread of the reporting
process, it would let the report out on time and then keep the process alive forever, and a
Slurm prolog that never exits stalls the node's job launches until slurmd's PrologEpilogTimeout.

So the probes run in a forked child (fork is cheap: the child shares the parent's loaded modules
and sources), which sends each probe's outcome over a pipe as soon as it is known. The parent
reads outcomes until it has all of them or the run's deadline passes, marks the missing ones
``timeout``, and goes on to judge, report and exit. The child is its own session, with stdin,
stdout and stderr on /dev/null, so that nothing it holds (a process group, a pipe to slurmd)
keeps anyone waiting for it; the parent kills it on the way out, which takes effect when its
stuck read returns, if ever.
"""

from __future__ import annotations

import os
import pickle
import select
import signal
import struct
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from preflight.model import ProbeOutcome

if TYPE_CHECKING:
    from preflight.config import HostConfig
    from preflight.engine import RunOptions
    from preflight.registry import ProbeSpec
    from preflight.sources import Sources

_LENGTH = struct.Struct("!I")  # each outcome travels as a 4-byte length, then its pickle


#: preflight.engine.run_probes' signature (passed in: this module does not import the engine)
ProbeRunner = Callable[..., "dict[str, ProbeOutcome]"]


class Apart:
    """Probes running in a child process; :meth:`collect` gathers their outcomes."""

    def __init__(self, child: int, read_end: int, specs: list[ProbeSpec], started: float) -> None:
        self.child = child
        self.read_end = read_end
        self.names = frozenset(spec.name for spec in specs)
        self.started = started

    def collect(self, wanted: set[str], deadline: float, monotonic: Callable[[], float]) -> dict[str, ProbeOutcome]:
        """The outcomes of the probes ``wanted`` (a subset of those started) that arrived by the
        deadline, ``timeout`` for the rest; the child is reaped or abandoned. Never waits past
        ``deadline``."""
        try:
            outcomes = _collect(self.read_end, wanted, deadline, monotonic)
        finally:
            os.close(self.read_end)
            self.read_end = -1
        complete = wanted <= outcomes.keys() and all(outcomes[name].status != "timeout" for name in wanted)
        if complete and wanted != self.names:
            # Still running probes nobody waits for (started early for checks a config disabled,
            # or gathered only in other profiles): not waited for, not killed either. It ends by
            # itself within the deadline, or at its next send on the pipe closed above.
            _reap_later(self.child)
        else:
            _abandon(self.child, complete)
        waited = monotonic() - self.started
        for name in wanted - outcomes.keys():
            outcomes[name] = ProbeOutcome(name, "timeout", waited, error=f"timed out after {waited:.1f} s")
        return {name: outcomes[name] for name in wanted}


    def abandon(self) -> None:
        """Give up on the child unless :meth:`collect` already did (a run that ends early)."""
        if self.read_end >= 0:
            os.close(self.read_end)
            self.read_end = -1
            _abandon(self.child, False)


def start_apart(
    run_probes: ProbeRunner, specs: list[ProbeSpec], sources: Sources, config: HostConfig, options: RunOptions, deadline: float
) -> Apart | None:
    """``run_probes`` (:func:`preflight.engine.run_probes`) started in a child process; None when
    no child can be made (out of descriptors, processes or memory): the caller runs the probes
    itself, in threads, as before."""
    started = sources.clock.monotonic()
    _reap_finished()
    try:
        read_end, write_end = os.pipe()
    except OSError:
        return None
    try:
        child = os.fork()
    except OSError:  # EAGAIN, ENOMEM
        os.close(read_end)
        os.close(write_end)
        return None
    if child == 0:  # pragma: no cover - runs in the child, which never returns
        _child(run_probes, read_end, write_end, specs, sources, config, options, deadline)
    os.close(write_end)
    return Apart(child, read_end, specs, started)


def run_probes_apart(
    run_probes: ProbeRunner, specs: list[ProbeSpec], sources: Sources, config: HostConfig, options: RunOptions, deadline: float
) -> dict[str, ProbeOutcome]:
    """``run_probes`` in a child process; the outcomes that arrived by the deadline, ``timeout``
    for the rest. Never waits past ``deadline``."""
    apart = start_apart(run_probes, specs, sources, config, options, deadline)
    if apart is None:
        return run_probes(specs, sources, config, options, deadline)
    return apart.collect({spec.name for spec in specs}, deadline, sources.clock.monotonic)


def _child(
    run_probes: ProbeRunner,
    read_end: int, write_end: int, specs: list[ProbeSpec], sources: Sources, config: HostConfig, options: RunOptions, deadline: float
) -> None:
    """Run the probes, send each outcome as it is known, and exit (never returns)."""
    try:
        os.close(read_end)
        os.setsid()  # out of the caller's process group: a group kill or wait does not reach it
        null = os.open(os.devnull, os.O_RDWR)
        for descriptor in (0, 1, 2):  # no pipe of the caller's (slurmd's) stays open in here
            os.dup2(null, descriptor)
        sent: set[str] = set()
        lock = threading.Lock()

        def send(outcome: ProbeOutcome) -> None:
            try:
                data = pickle.dumps(outcome, protocol=pickle.HIGHEST_PROTOCOL)
            except Exception as error:  # facts that do not pickle are a probe bug, not a crash
                data = pickle.dumps(ProbeOutcome(outcome.name, "error", outcome.duration_s, error=f"facts cannot be sent: {error}"))
            with lock:
                if outcome.name in sent:
                    return
                sent.add(outcome.name)
                _write_all(write_end, _LENGTH.pack(len(data)) + data)

        outcomes = run_probes(specs, sources, config, options, deadline, on_outcome=send)
        for outcome in outcomes.values():  # the timeouts the child's own wait decided
            send(outcome)
    except BaseException:
        pass
    finally:
        os._exit(0)


def _write_all(descriptor: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(descriptor, view):]


def _collect(read_end: int, wanted: set[str], deadline: float, monotonic: Callable[[], float]) -> dict[str, ProbeOutcome]:
    outcomes: dict[str, ProbeOutcome] = {}
    buffer = b""
    while not wanted <= outcomes.keys():
        remaining = deadline - monotonic()
        if remaining <= 0:
            break
        ready, _, _ = select.select([read_end], [], [], remaining)
        if not ready:
            break
        chunk = os.read(read_end, 1 << 16)
        if not chunk:
            break  # the child is gone: what did not arrive is missing
        buffer += chunk
        while len(buffer) >= _LENGTH.size:
            (length,) = _LENGTH.unpack_from(buffer)
            if len(buffer) < _LENGTH.size + length:
                break
            outcome = pickle.loads(buffer[_LENGTH.size:_LENGTH.size + length])  # noqa: S301 - our own child's bytes
            buffer = buffer[_LENGTH.size + length:]
            if isinstance(outcome, ProbeOutcome) and outcome.name in wanted:
                outcomes[outcome.name] = outcome
    return outcomes


#: Children that were left to finish by themselves; reaped when the next one starts, so that a
#: long-lived caller (a daemon, the test suite) does not collect zombies.
_UNREAPED: list[int] = []


def _reap_later(child: int) -> None:
    _UNREAPED.append(child)


def _reap_finished() -> None:
    for child in list(_UNREAPED):
        try:
            if not os.waitpid(child, os.WNOHANG)[0]:
                continue
        except ChildProcessError:
            pass
        _UNREAPED.remove(child)


def _abandon(child: int, complete: bool) -> None:
    """Reap the child. When every probe answered it is exiting: wait for it a moment (so that its
    CPU time is accounted and no zombie is left). Otherwise kill it (effective once a stuck read
    returns) and let init reap it: waiting here is what this module exists to avoid."""
    try:
        if complete:
            for _ in range(50):  # 50 ms at most
                if os.waitpid(child, os.WNOHANG)[0]:
                    return
                time.sleep(0.001)
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, os.WNOHANG)
    except (ChildProcessError, ProcessLookupError):
        pass
