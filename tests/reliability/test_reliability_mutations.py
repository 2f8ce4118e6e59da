"""Mutated recorded roots (property-based): every recorded root, random files the probes read
deleted, truncated, garbled, given non-UTF-8 bytes, made to fail with a recorded errno, replaced
by a symlink loop, a huge sparse file, a directory or a FIFO, and ``.preflight`` recordings
broken. Every run finishes within its deadline, raises nothing, trips no safety net, and no
reference turns healthier because its evidence became unreadable (the oracle is described in
``tests/reliability_harness.py``). ``bench/reliability.py`` runs thousands more."""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reliability_harness import (
    EXAMPLE, Mutation, MutationBench, Target, kinds_for, mutated, random_mutations, recorded_roots, run_root,
    verdicts, violations,
)

# Bounded for CI: about 10-20 s on two slow cores; the bench runs 2,000+.
MAX_EXAMPLES = 300


@pytest.fixture(scope="module")
def bench(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MutationBench]:
    yield MutationBench(tmp_path_factory.mktemp("mutated-roots"))


@st.composite
def mutation_sets(draw: st.DrawFn, bench: MutationBench) -> tuple[str, list[Mutation]]:
    name = draw(st.sampled_from(sorted(bench.roots)))
    targets = bench.targets[name]
    chosen = draw(st.lists(st.sampled_from(targets), min_size=1, max_size=3, unique_by=lambda t: t.relative))
    return name, [
        Mutation(draw(st.sampled_from(kinds_for(target))), target, draw(st.integers(0, 2**32 - 1))) for target in chosen
    ]


def test_every_recorded_root_has_mutation_targets(bench: MutationBench) -> None:
    assert set(bench.roots) == {root.name for root in recorded_roots()}
    for name, targets in bench.targets.items():
        assert targets, name
        assert any(t.recording for t in targets) or not (bench.roots[name] / ".preflight").is_dir(), name
    example = {t.relative for t in bench.targets[EXAMPLE.name]}
    assert {"proc/self/limits", "proc/self/environ", ".preflight/nvml.json"} <= example


def test_baselines_are_stable(bench: MutationBench) -> None:
    """The oracle compares against the unmutated run: it must not vary by itself."""
    for name, root in bench.roots.items():
        assert verdicts(run_root(bench.registry, root)) == bench.baselines[name], name


@settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_mutated_roots_never_crash_and_never_turn_unreadable_into_healthy(bench: MutationBench, data: st.DataObject) -> None:
    name, mutations = data.draw(mutation_sets(bench))
    outcome = bench.try_mutations(name, mutations)
    described = f"{name}: {[m.describe() for m in mutations]}"
    assert not outcome.crash, f"{described}: {outcome.crash}"
    assert not outcome.problems, f"{described}: {outcome.problems}"


def _single(bench: MutationBench, name: str, relative: str, kind: str, seed: int = 1) -> Mutation:
    target = next(t for t in bench.targets[name] if t.relative == relative)
    return Mutation(kind, target, seed)


@pytest.mark.parametrize("kind", ["read_error", "symlink_loop", "huge", "directory", "fifo", "non_utf8"])
def test_unreadable_job_environment_is_unknown_not_unset(bench: MutationBench, kind: str) -> None:
    """Regression: an unreadable /proc/self/environ once read as "no job settings", which made
    NET004 not applicable and dropped EFA001's FI_PROVIDER finding."""
    for name in ("efa-p4d", "no-route-to-master", "dns-peers"):
        mutation = _single(bench, name, "proc/self/environ", kind)
        if kind == "non_utf8" and not mutation.unreadable():
            continue  # environ is read as bytes: a stray byte is just a different environment
        outcome = bench.try_mutations(name, [mutation])
        assert outcome.report is not None and not outcome.problems, (name, outcome.problems)
        job = next(p for p in outcome.report.probes if p.name == "job")
        assert job.status == "error" and "/proc/self/environ" in job.error, job


@pytest.mark.parametrize("kind", ["truncate", "garble", "huge", "directory", "symlink_loop", "bad_json"])
def test_broken_recordings_are_unknown_not_absent(bench: MutationBench, kind: str) -> None:
    """Regression: a broken dns.json dropped DNS001's nameserver finding; a netlink.json that was
    a directory silently fell back to sysfs files; a truncated nvml.json made GPU002 and GDR003
    not applicable."""
    for name, recording in (("dns-stub-container", "dns.json"), ("container-bridge", "netlink.json"), ("hgx-h100", "nvml.json")):
        outcome = bench.try_mutations(name, [_single(bench, name, f".preflight/{recording}", kind, seed=7)])
        assert outcome.report is not None and not outcome.problems, (name, outcome.problems)
        assert outcome.changed, f"{name}: a broken {recording} changed nothing"


def test_deeply_nested_recording_is_an_error_not_a_recursion_crash(bench: MutationBench) -> None:
    """Regression: ``[[[[...`` 200,000 deep escaped json's ValueError as RecursionError and
    crashed ``Sources.for_fs`` (and the probes reading devices.json)."""
    root = bench.roots["dns-stub-container"]
    for recording in ("dns.json", "read-errors.json", "devices.json", "nvml.json", "netlink.json"):
        path = root / ".preflight" / recording
        saved = path.read_bytes() if path.exists() else None
        try:
            path.write_bytes(b"[" * 200_000)
            report = run_root(bench.registry, root)
            assert report.findings
            problems, _ = violations(bench.baselines["dns-stub-container"], report, unreadable=True)
            assert not problems, (recording, problems)
        finally:
            path.unlink()
            if saved is not None:
                path.write_bytes(saved)


def test_a_fifo_is_refused_not_read_as_empty(bench: MutationBench) -> None:
    """A FIFO with no writer reads as end-of-file: before NodeFS refused non-regular files, a
    FIFO at /proc/self/environ read as an empty environment."""
    from preflight.sources import NodeFS, SourceError

    root = bench.roots["dns-peers"]
    mutation = _single(bench, "dns-peers", "proc/self/environ", "fifo")
    with mutated(root, [mutation]):
        with pytest.raises(SourceError, match="not a regular file"):
            NodeFS(str(root)).read_bytes("/proc/self/environ")


def test_random_mutations_are_reproducible(bench: MutationBench) -> None:
    """The bench's counts must be the same on every run: mutations depend only on the seed."""
    first = [m.describe() for m in random_mutations(random.Random(5), bench, EXAMPLE.name)]
    again = [m.describe() for m in random_mutations(random.Random(5), bench, EXAMPLE.name)]
    assert first == again


def test_targets_carry_the_paths_probes_use(bench: MutationBench) -> None:
    """read_error mutations name the node path the probe asked for, not the resolved file."""
    targets: dict[str, Target] = {t.relative: t for t in bench.targets[EXAMPLE.name]}
    assert targets["proc/self/environ"].host_paths == ("/proc/self/environ",)
    sysfs = [t for t in targets.values() if t.relative.startswith("sys/devices/") and t.host_paths]
    assert sysfs and all(path.startswith("/sys/") for t in sysfs for path in t.host_paths)


def _listing(root: Path) -> list[tuple[str, str]]:
    """Every path under ``root`` with its type and content or link target (links not followed)."""
    found = []
    for folder, subfolders, files in os.walk(root):
        for entry in sorted(subfolders + files):
            path = Path(folder) / entry
            kind = f"link {os.readlink(path)}" if path.is_symlink() else "dir" if path.is_dir() else path.read_bytes().hex()
            found.append((str(path.relative_to(root)), kind))
    return sorted(found)


def test_harness_restores_the_root(bench: MutationBench) -> None:
    name = EXAMPLE.name
    root = bench.roots[name]
    before = _listing(root)
    rng = random.Random(3)
    for kind in ("delete", "directory", "symlink_loop", "fifo", "huge", "read_error"):
        target = rng.choice([t for t in bench.targets[name] if not t.recording])
        bench.try_mutations(name, [Mutation(kind, target, 1)])
    assert _listing(root) == before
    assert verdicts(run_root(bench.registry, root)) == bench.baselines[name]
