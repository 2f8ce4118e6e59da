"""Hung sources: NVML blocking forever (the replay's ``{"hang": true}``), a DNS server that never
answers, a netlink dump that never returns and a sysfs read that blocks, all at once. The run
returns with ``unknown`` ("timed out ...") for what was stuck; repeated runs in one process do
not pile up threads or file descriptors; a loop of CLI processes leaves nothing behind. A FIFO
planted in a recorded root is refused, not read.

None of the stuck calls ever returns by itself, so a run that returns at all stopped waiting for
them; how long it took against its deadline is a figure of ``bench/reliability.py`` (hung
sources, process loop), not an assertion here, where another process on the machine would move
it."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import EXAMPLE_ROOT, Runner
from reliability_harness import HungSources, SilentDnsServer, hang_nvml, open_fds
from preflight.config import HostConfig
from preflight.discovery import build_registry
from preflight.engine import Report, RunOptions, run
from preflight.sources import NodeFS, Sources

REGISTRY = build_registry(plugins=False)
DEADLINE_S = 1.0
# Which probes each hung source holds up in the example node (the gpus probe asks NVML first).
STUCK_PROBES = {
    "nvml": {"gpus", "bar1", "gpu_health", "fabric"},
    "netlink": {"interfaces", "routing"},
    "dns": {"hostname"},
    "fs": {"sockets"},
}


@pytest.fixture
def hung(tmp_path: Path) -> Iterator[HungSources]:
    root = tmp_path / "node"
    shutil.copytree(EXAMPLE_ROOT, root, symlinks=True)
    hang_nvml(root)
    (root / ".preflight" / "dns.json").unlink()
    # A name only DNS can answer, so the hostname probe must ask the silent server.
    hosts = (root / "etc/hosts").read_text().replace("gpu017", "elsewhere")
    (root / "etc/hosts").write_text(hosts)
    server = SilentDnsServer()
    sources = HungSources(root, server)
    yield sources
    sources.release()
    server.close()


def run_hung(hung: HungSources) -> Report:
    """One run against the hung sources. It runs in a thread only so that a run that waits for
    them fails the test instead of hanging the suite: the 60 s join is a hang guard."""
    options = RunOptions(profile="full", timeout_s=DEADLINE_S, probe_timeout_s=DEADLINE_S)
    reports: list[Report] = []
    worker = threading.Thread(target=lambda: reports.append(run(REGISTRY, hung.sources(), HostConfig(), options, "gpu017")), daemon=True)
    worker.start()
    worker.join(60)
    assert reports, "the run waited for a hung source"
    return reports[0]


def wait_until_gone(names: set[str]) -> list[str]:
    """Names of the threads among ``names`` still alive after they have had a minute to end."""
    deadline = time.monotonic() + 60  # a hang guard: released threads end at once
    while time.monotonic() < deadline and any(t.name in names for t in threading.enumerate()):
        time.sleep(0.05)
    return [t.name for t in threading.enumerate() if t.name in names]


def test_every_source_hung_at_once_returns_with_unknowns(hung: HungSources) -> None:
    report = run_hung(hung)
    timed_out = {probe.name for probe in report.probes if probe.status == "timeout"}
    stuck = set().union(*STUCK_PROBES.values())
    assert stuck <= timed_out, stuck - timed_out
    assert hung.dns_server.queries > 0 and hung.netlink.calls > 0
    # A probe a check declares optional leaves it deciding what it can without (an Unread).
    by_probe = {spec.reference_id: set(spec.probes) - set(spec.optional) for spec in REGISTRY.checks.values()}
    for finding in report.findings:
        needs = by_probe[finding.reference_id]
        if needs & timed_out:
            assert finding.status.value == "unknown" and "timed out" in finding.reason, finding
    decided = [f for f in report.findings if f.status.value != "unknown"]
    assert decided, "references that need no stuck source are still decided"


def test_runs_in_one_process_do_not_pile_up_threads_or_descriptors(hung: HungSources) -> None:
    """The first run abandons one thread per stuck probe; later runs see the probe still stuck
    and do not start it again, so threads stay bounded (they used to grow by one per stuck probe
    per run). Released sources let their threads finish."""
    threads_before, fds_before = threading.active_count(), open_fds()
    report = run_hung(hung)
    threads_after_first, fds_after_first = threading.active_count(), open_fds()
    assert threads_after_first - threads_before <= len(report.probes)
    for _ in range(99):
        report = run_hung(hung)
        stuck = [p for p in report.probes if p.status == "timeout"]
        assert stuck and all("timed out" in p.error for p in stuck)
    assert threading.active_count() <= threads_after_first + 2  # + DNS helper threads still in flight
    assert open_fds() <= fds_after_first + 2
    # a stuck probe may hold the socket it waits on, and its view of the root that root's descriptor
    assert fds_after_first <= fds_before + 5
    hung.release()
    assert wait_until_gone({"probe-interfaces", "probe-sockets"}) == []


def test_a_released_source_is_asked_again(hung: HungSources) -> None:
    """Skipping a stuck probe lasts only while its thread is stuck."""
    run_hung(hung)
    hung.release()
    assert wait_until_gone({"probe-sockets"}) == []
    report = run_hung(hung)
    sockets = next(p for p in report.probes if p.name == "sockets")
    assert sockets.status == "ok" and "released after blocking" in json.dumps(report.facts["sockets"])


def test_another_root_is_not_held_back_by_a_stuck_probe(hung: HungSources) -> None:
    run_hung(hung)
    report = run(REGISTRY, Sources.for_node(str(EXAMPLE_ROOT)), HostConfig(), RunOptions(), "gpu017")
    assert all(p.status == "ok" for p in report.probes), [p for p in report.probes if p.status != "ok"]


@pytest.mark.parametrize("writer", [False, True])
def test_fifo_in_a_recorded_root_is_refused(tmp_path: Path, writer: bool) -> None:
    """A FIFO where sysfs has a file: with no writer a read would see end-of-file (a silent
    empty value), with a writer that never writes it would block. Either way it is not read."""
    root = tmp_path / "node"
    shutil.copytree(EXAMPLE_ROOT, root, symlinks=True)
    state = Path(os.path.realpath(root / "sys/class/infiniband/mlx5_0")) / "ports/1/state"
    state.unlink()
    os.mkfifo(state)
    holder = os.open(state, os.O_RDWR) if writer else None  # O_RDWR: a writer without blocking
    try:
        report = run(REGISTRY, Sources.for_node(str(root)), HostConfig(), RunOptions(select=("IB009",)), "gpu017")
        # Refused before any read: a read would have blocked into the probe's timeout, and the
        # probes below would not all be "ok".
        (finding,) = [f for f in report.findings if f.subject == "mlx5_0/1"]
        assert finding.status.value == "unknown" and "not a regular file (a FIFO)" in finding.reason
        assert all(p.status == "ok" for p in report.probes)
    finally:
        if holder is not None:
            os.close(holder)


def test_device_nodes_are_not_opened() -> None:
    """Opening some devices has side effects (``/dev/watchdog`` arms the watchdog): NodeFS
    refuses anything that is not a regular file before opening it."""
    from preflight.sources import SourceError

    with pytest.raises(SourceError, match="a device node"):
        NodeFS("/").read_bytes("/dev/null")


def test_loop_of_cli_processes_with_hung_nvml(run_cli: Runner, tmp_path: Path) -> None:
    """Each process gives up on the stuck NVML call at the deadline, exits without waiting for
    it (os._exit), and leaves no process behind."""
    root = tmp_path / "node"
    shutil.copytree(EXAMPLE_ROOT, root, symlinks=True)
    hang_nvml(root)
    for _ in range(8):
        # The NVML call never returns: the process must exit without it (30 s: a hang guard).
        result = run_cli("node", "--root", str(root), "--format", "json", "--timeout", "0.5", "--profile", "prolog", timeout=30)
        assert result.returncode in (0, 1, 2) and "Traceback" not in result.stderr, result.stderr
        report = json.loads(result.stdout)
        gpus = next(p for p in report["probes"] if p["name"] == "gpus")
        assert gpus["status"] == "timeout" and "timed out" in gpus["error"]
    assert not leftover_processes(str(root))


def leftover_processes(marker: str) -> list[int]:
    """Processes whose command line mentions ``marker`` (the run's unique root)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as handle:
                if marker.encode() in handle.read():
                    found.append(int(entry))
        except OSError:
            continue
    return found
