"""Missing is not empty: deleting a capture unit never creates a problem or hides one.

For every recorded root (the example node, every fixture root and every real capture under
``tests/data/real-roots``), each capture unit that the root has (``preflight.sources.capture``:
``dev/``, ``etc/``, ``proc/net/``, ``proc/self/``, ``proc/<pid>/``, ``sys/module/``,
``sys/class/net/``, ``sys/class/infiniband_verbs/``, each port's ``gids/`` and ``gid_attrs/``,
... and each ``.preflight`` recording) is moved out of the root in turn, and a full run must:

* make no finding ``present`` that was not present before;
* turn no ``unknown`` into ``absent`` or ``not_applicable``, and leave no reference that had a
  ``present`` or ``unknown`` finding with only healthy ones;
* trip no safety net (no probe or check exception).

Deleting ``/proc/<pid>`` is the one exception to the second rule: a process whose entry is not
there is, to every observer, a process that does not run.

Here each unit pattern is tried on its first and last instances in a root (every interface's
``mtu`` is one kind of unit); ``bench/reliability.py`` tries every instance.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from reliability_harness import (
    capture_unit_instances, capture_violations, deleted, extracted_real_roots, recorded_roots, run_root,
)
from preflight.discovery import build_registry
from preflight.registry import Registry


@pytest.fixture(scope="module")
def registry() -> Registry:
    return build_registry(plugins=False)


def _roots() -> list[Path]:
    return recorded_roots()


@pytest.fixture(scope="module")
def real_roots(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Path]]:
    yield extracted_real_roots(tmp_path_factory.mktemp("real-roots"))


def _check_root(registry: Registry, root: Path) -> tuple[int, list[str]]:
    baseline = run_root(registry, root)
    tried, failures = 0, []
    for unit in capture_unit_instances(root, per_pattern=2):
        with deleted(root, unit):
            report = run_root(registry, root)
        tried += 1
        problems = capture_violations(baseline, report, unit)
        failures += [f"{root.name} without {unit.node_path}: {problem}" for problem in problems]
    return tried, failures


@pytest.mark.parametrize("source", _roots(), ids=lambda path: path.name)
def test_deleting_a_capture_unit_never_creates_or_hides_a_problem(registry: Registry, source: Path, tmp_path: Path) -> None:
    import shutil

    root = tmp_path / source.name
    shutil.copytree(source, root, symlinks=True)
    tried, failures = _check_root(registry, root)
    assert tried >= 5, f"{source.name}: only {tried} capture units found"
    assert not failures, "\n".join(failures)


def test_deleting_capture_units_of_real_captures(registry: Registry, real_roots: list[Path]) -> None:
    assert len(real_roots) >= 30
    tried, failures = 0, []
    for root in real_roots:
        count, found = _check_root(registry, root)
        tried += count
        failures += found
    assert tried >= 100
    assert not failures, "\n".join(failures[:40])


@pytest.mark.parametrize(
    ("path", "unit"),
    [
        ("/proc/4242/limits", True),
        ("/proc/self/limits", True),
        ("/proc/４２/limits", False),  # full-width digits are not a process ID
        ("/sys/class/net/eth0/mtu", True),
        ("/sys/class/net/eth0/statistics/mtu", False),
        ("/sys/devices/pci0000:00/0000:00:01.0/config", True),
        ("/sys/devices/config", False),  # ** is one component or more
        ("/sys/bus", True),  # above a literal unit
        ("/sys/class/infiniband", False),  # above a wildcard unit: a node without RDMA lacks it
    ],
)
def test_unit_patterns(path: str, unit: bool) -> None:
    from preflight.sources.capture import unit_of

    assert (unit_of(path) is not None) == unit
