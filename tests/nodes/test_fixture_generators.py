"""Every recorded root is made by a generator script beside it, and the rule is "change the
generator, not the files" (docs/contributors/testing.md). These tests hold the rule: each
generator runs into a temporary directory and what it makes today must equal what is committed,
path for path, byte for byte, symlink target for symlink target. A hand edit of a root, a
generator changed without regenerating, or a generator whose output depends on the run (hash
seed, time zone, umask, working directory) fails here, instead of the other tests quietly judging
a tree that nobody can rebuild.

Generators are found by file name (``build_*.py`` under ``tests/fixtures/`` and ``examples/``), so
a new one is covered without editing this file. Each is run as its documented command line,
``python build_x.py [DIRECTORY]``, with DIRECTORY receiving its roots; a root's committed
counterpart is the directory of the same name beside the generator."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

REPO = Path(__file__).resolve().parents[2]
GENERATOR_PATTERNS = ("tests/fixtures/**/build_*.py", "examples/**/build_*.py")
GENERATORS = sorted({path for pattern in GENERATOR_PATTERNS for path in REPO.glob(pattern)})
# A generator that cannot be regenerated here, by repository-relative path, with the reason. Every
# generator is covered today; an entry here must say why, and one naming no generator fails.
NOT_COVERED: dict[str, str] = {}
SHOWN = 12  # differences listed in one failure; the rest are counted
# A generator is a few hundred lines writing a few MB; this only keeps a hung one from hanging the suite.
GENERATOR_TIMEOUT_S = 300


def relative(path: Path) -> str:
    return path.relative_to(REPO).as_posix() if path.is_relative_to(REPO) else str(path)


@dataclass(frozen=True)
class Conditions:
    """What may differ between the run that made the committed roots and a run of the test."""

    name: str
    hash_seed: str
    time_zone: str
    umask: int


# Two unlike runs: a generator that iterates a set of strings, stamps local time or reads the
# umask into what it writes gives different trees under them (the committed tree was made at
# another time, so a wall-clock stamp differs from it under either). POSIX TZ strings need no
# tzdata.
RUNS = (
    Conditions("seed0", hash_seed="0", time_zone="UTC0", umask=0o022),
    Conditions("seed1-utc+13:45-umask077", hash_seed="1", time_zone="XST-13:45", umask=0o077),
)


# -- Running a generator -------------------------------------------------------------------------


def regenerate(generator: Path, into: Path, run: Conditions = RUNS[0]) -> list[Path]:
    """Run ``generator`` as its command line into the fresh directory ``into``; return the roots it made."""
    into.mkdir()
    environment = {**os.environ, "PYTHONHASHSEED": run.hash_seed, "TZ": run.time_zone}
    # -B: a __pycache__ of _roots.py would land among the committed roots.
    result = subprocess.run(
        [sys.executable, "-B", str(generator), str(into)], cwd=into, env=environment, umask=run.umask,
        capture_output=True, text=True, timeout=GENERATOR_TIMEOUT_S, check=False,
    )
    command = f"python {relative(generator)} {into}"
    assert result.returncode == 0, f"`{command}` exited {result.returncode}:\n{result.stderr[-3000:]}"
    roots = sorted(into.iterdir())
    assert roots, f"`{command}` wrote nothing into {into}"
    return roots


# -- Comparing trees ------------------------------------------------------------------------------

# What git records of an entry, so what a fresh clone gives: its kind, a symlink's target, a
# file's executable bit (git keeps no other mode bit, nor owners, nor empty directories).
Entry = tuple[str, str]


def entries(top: Path) -> dict[str, Entry]:
    """Every path below ``top`` (relative, '/'-separated), without following symlinks: the
    generators write sysfs-like trees whose links form cycles when followed."""
    found: dict[str, Entry] = {}
    pending = [top]
    while pending:
        directory = pending.pop()
        with os.scandir(directory) as listing:
            for item in listing:
                name = Path(item.path).relative_to(top).as_posix()
                if item.is_symlink():
                    found[name] = ("symlink", os.readlink(item.path))
                elif item.is_dir(follow_symlinks=False):
                    found[name] = ("directory", "")
                    pending.append(Path(item.path))
                elif item.is_file(follow_symlinks=False):
                    executable = item.stat(follow_symlinks=False).st_mode & stat.S_IXUSR
                    found[name] = ("file", "executable" if executable else "")
                else:
                    found[name] = (stat.filemode(item.stat(follow_symlinks=False).st_mode)[0] + " special file", "")
    return found


def byte_difference(made: Path, committed: Path) -> str | None:
    """Where two files' bytes first differ, in words; None when they are equal."""
    left, right = made.read_bytes(), committed.read_bytes()
    if left == right:
        return None
    offset = next((i for i, (a, b) in enumerate(zip(left, right)) if a != b), min(len(left), len(right)))
    return (f"bytes differ from offset {offset} (regenerated {len(left)} bytes {left[offset:offset + 24]!r}, "
            f"committed {len(right)} bytes {right[offset:offset + 24]!r})")


def differences(made: Path, committed: Path) -> list[str]:
    """How the regenerated root ``made`` differs from the committed root ``committed``, one line
    per path, named by the committed path; a directory only on one side is one line, not one per
    file in it."""
    label = relative(committed)
    if not committed.is_dir():
        return [f"{label}: regenerated, but no such root is committed"]
    ours, theirs = entries(made), entries(committed)
    found: list[str] = []
    for name in sorted(ours.keys() | theirs.keys()):
        parent = name.rpartition("/")[0]
        if parent and (parent not in ours or parent not in theirs):
            continue  # reported with its directory
        where = f"{label}/{name}"
        if name not in theirs:
            found.append(f"{where}: only in the regenerated tree ({ours[name][0]})")
        elif name not in ours:
            found.append(f"{where}: only in the committed tree ({theirs[name][0]})")
        else:
            found += entry_differences(where, ours[name], theirs[name], made / name, committed / name)
    return found


def entry_differences(where: str, mine: Entry, theirs: Entry, made: Path, committed: Path) -> list[str]:
    """How one path present in both trees differs."""
    if mine[0] != theirs[0]:
        return [f"{where}: a {mine[0]} regenerated, a {theirs[0]} committed"]
    if mine[0] == "symlink" and mine[1] != theirs[1]:
        return [f"{where}: symlink to {mine[1]!r} regenerated, to {theirs[1]!r} committed"]
    if mine[0] != "file":
        return []
    found = []
    if mine[1] != theirs[1]:
        found.append(f"{where}: {mine[1] or 'not executable'} regenerated, {theirs[1] or 'not executable'} committed")
    content = byte_difference(made, committed)
    if content is not None:
        found.append(f"{where}: {content}")
    return found


def report(generator: Path, found: list[str], run: Conditions) -> str:
    shown = "\n".join(found[:SHOWN]) + (f"\n... and {len(found) - SHOWN} more" if len(found) > SHOWN else "")
    return (f"{relative(generator)} (run {run.name}) no longer makes what is committed, {len(found)} difference(s):\n{shown}\n"
            f"If the generator is right and the commit stale, rerun `python {relative(generator)}` and commit; "
            "otherwise fix the generator (a difference under one run only means its output depends on the hash seed, time zone or umask).")


# -- The tests ------------------------------------------------------------------------------------


def test_generators_are_found() -> None:
    # Guards the discovery itself: a glob that silently matched nothing would pass every test below.
    names = {path.name for path in GENERATORS}
    assert {"build_hgx_h100.py", "build_net_fixtures.py"} <= names, names


def test_uncovered_generators_are_real_and_give_a_reason() -> None:
    listed = {relative(path) for path in GENERATORS}
    assert {name: reason for name, reason in NOT_COVERED.items() if name not in listed or not reason.strip()} == {}


@pytest.mark.parametrize("run", RUNS, ids=[run.name for run in RUNS])
@pytest.mark.parametrize("generator", GENERATORS, ids=[relative(path) for path in GENERATORS])
def test_generator_remakes_the_committed_roots(tmp_path: Path, generator: Path, run: Conditions) -> None:
    if relative(generator) in NOT_COVERED:
        pytest.skip(NOT_COVERED[relative(generator)])
    found = [line for root in regenerate(generator, tmp_path / "made", run) for line in differences(root, generator.parent / root.name)]
    assert found == [], report(generator, found, run)


def test_every_committed_root_is_made_by_exactly_one_generator(tmp_path: Path) -> None:
    """A root nobody can rebuild (a generator renamed, a root added by hand) or one that two
    generators overwrite in turn fails here; directories holding an uncovered generator are left out."""
    makers: dict[Path, list[str]] = {}
    for number, generator in enumerate(GENERATORS):
        if relative(generator) not in NOT_COVERED:
            for root in regenerate(generator, tmp_path / str(number)):
                makers.setdefault(generator.parent / root.name, []).append(relative(generator))
    uncovered = {(REPO / name).parent for name in NOT_COVERED}
    homes = {generator.parent for generator in GENERATORS} - uncovered
    committed = {path for home in homes for path in home.iterdir() if path.is_dir() and path.name != "__pycache__"}
    assert sorted(relative(path) for path in committed - makers.keys()) == [], "committed roots that no generator makes"
    assert {relative(path): names for path, names in makers.items() if len(names) > 1} == {}, "roots made by several generators"


# The comparison must be able to fail: each mutation of a freshly regenerated tree is named, by
# path and kind, in the message. build_gpu_nodes.py is small and writes files and symlinks.
SMALL = REPO / "tests" / "fixtures" / "nodes" / "build_gpu_nodes.py"
NVML = "gb200-tray/.preflight/nvml.json"
GROUP_LINK = "gb200-tray/sys/bus/pci/devices/0008:01:00.0"


def flip_one_byte(made: Path) -> str:
    path = made / NVML
    data = bytearray(path.read_bytes())
    data[100] ^= 0x01
    path.write_bytes(bytes(data))
    return "bytes differ from offset 100"


def retarget_link(made: Path) -> str:
    path = made / GROUP_LINK
    target = os.readlink(path)
    path.unlink()
    path.symlink_to(target + "-elsewhere")
    return "-elsewhere' regenerated"


def make_executable(made: Path) -> str:
    path = made / NVML
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return "executable regenerated, not executable committed"


def add_empty_directory(made: Path) -> str:
    (made / NVML).with_name("stray").mkdir()
    return "only in the regenerated tree (directory)"


def remove_file(made: Path) -> str:
    (made / NVML).unlink()
    return "only in the committed tree (file)"


def replace_link_with_file(made: Path) -> str:
    path = made / GROUP_LINK
    path.unlink()
    path.write_text("")
    return "a file regenerated, a symlink committed"


MUTATIONS: dict[str, tuple[str, Callable[[Path], str]]] = {
    "flip-one-byte": (NVML, flip_one_byte),
    "retarget-symlink": (GROUP_LINK, retarget_link),
    "set-executable-bit": (NVML, make_executable),
    "add-empty-directory": ("gb200-tray/.preflight/stray", add_empty_directory),
    "remove-file": (NVML, remove_file),
    "symlink-becomes-file": (GROUP_LINK, replace_link_with_file),
}


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_comparison_names_a_changed_path(tmp_path: Path, mutation: str) -> None:
    made = tmp_path / "made"
    regenerate(SMALL, made)
    assert [line for root in sorted(made.iterdir()) for line in differences(root, SMALL.parent / root.name)] == []
    path, mutate = MUTATIONS[mutation]
    kind = mutate(made)
    found = [line for root in sorted(made.iterdir()) for line in differences(root, SMALL.parent / root.name)]
    assert len(found) == 1 and found[0].startswith(f"tests/fixtures/nodes/{path}: ") and kind in found[0], found
    assert found[0] in report(SMALL, found, RUNS[0])


def test_a_regenerated_root_missing_from_the_commit_is_named(tmp_path: Path) -> None:
    made = tmp_path / "made"
    regenerate(SMALL, made)
    shutil.copytree(made / "gb200-tray", made / "gb300-tray", symlinks=True)
    assert differences(made / "gb300-tray", SMALL.parent / "gb300-tray") == ["tests/fixtures/nodes/gb300-tray: regenerated, but no such root is committed"]


def test_a_generator_that_follows_set_order_fails_under_the_other_run(tmp_path: Path) -> None:
    """The second run is not decorative: a generator writing a set of names in iteration order
    matches a tree committed from one hash seed and not the tree of the other."""
    home = tmp_path / "home"
    home.mkdir()
    generator = home / "build_set_order.py"
    generator.write_text(
        "import os, sys\n"
        "root = os.path.join(sys.argv[1], 'set-order')\n"
        "os.makedirs(root)\n"
        "names = {f'mlx5_{n}' for n in range(16)}\n"
        "with open(os.path.join(root, 'order'), 'w') as handle:\n"
        "    handle.write(' '.join(names))\n"
    )
    regenerate(generator, home / "made", RUNS[0])
    (home / "made" / "set-order").rename(home / "set-order")  # the "committed" root, beside its generator
    assert differences(regenerate(generator, tmp_path / "same", RUNS[0])[0], home / "set-order") == []
    found = differences(regenerate(generator, tmp_path / "other", RUNS[1])[0], home / "set-order")
    assert [line.partition(": ")[0] for line in found] == [f"{home}/set-order/order"], found
