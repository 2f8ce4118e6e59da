"""A recorded root or snapshot is data from someone else's node: it never chooses code to import,
servers to query or files of this machine to read. Each case is an attack that used to work."""

from __future__ import annotations

import json
import os
import shutil
import tarfile
from pathlib import Path

import pytest

from preflight.snapshot import SnapshotArgs, take_snapshot

from conftest import Runner, write

MARKER_CODE = 'import pathlib\npathlib.Path({marker!r}).write_text("ran")\n'


def pack(root: Path, archive: Path) -> Path:
    with tarfile.open(archive, "w:gz") as tar:
        for entry in sorted(root.rglob("*")):
            tar.add(entry, arcname=str(entry.relative_to(root)), recursive=False)
    return archive


@pytest.fixture
def evil_snapshot(node_copy: Path, tmp_path: Path) -> tuple[Path, Path]:
    """A snapshot whose recorded config names its own directory as a check directory, which
    holds a module that leaves a marker when imported."""
    marker = tmp_path / "imported"
    drop = tmp_path / "drop"  # what an unprivileged user can leave in /tmp
    drop.mkdir()
    (drop / "evil_check.py").write_text(MARKER_CODE.format(marker=str(marker)))
    config = f'[run]\nchecks_dirs = [".", "{drop}"]\n\n[dns]\nnameservers = ["127.0.0.99"]\n'
    write(node_copy, "/etc/preflight/preflight.toml", config)
    write(node_copy, "/evil_check.py", MARKER_CODE.format(marker=str(marker)))
    return pack(node_copy, tmp_path / "evil.tar.gz"), marker


def test_a_snapshots_config_chooses_no_code(run_cli: Runner, evil_snapshot: tuple[Path, Path], node_copy: Path, tmp_path: Path) -> None:
    archive, marker = evil_snapshot
    directory = run_cli("node", "--root", str(node_copy), "--format", "json")  # the same, unpacked
    assert directory.returncode in (0, 1, 2), directory.stderr
    node = run_cli("node", "--root", str(archive), "--format", "json")
    assert node.returncode in (0, 1, 2), node.stderr
    assert json.loads(node.stdout)["config"] == ""  # the recorded config is not the run's
    explain = run_cli("explain", "--check", "--root", str(archive), input="NCCL WARN Cuda failure 'out of memory'\n")
    assert explain.returncode in (0, 1, 2), explain.stderr
    snapshot = run_cli("snapshot", "--root", str(archive), "--scrub", "all", "--scrub-key", "k", str(tmp_path / "again.tar.gz"))
    assert snapshot.returncode in (0, 1, 2), snapshot.stderr
    assert not marker.exists()


def test_a_snapshots_config_names_no_server(evil_snapshot: tuple[Path, Path], run_cli: Runner) -> None:
    archive, _ = evil_snapshot
    report = json.loads(run_cli("node", "--root", str(archive), "--format", "json", "--select", "DNS001").stdout)
    dns = report["facts"]["hostname"]
    assert "127.0.0.99" not in json.dumps(dns)  # answers come from the recording, not a live query


@pytest.mark.parametrize("recording", ["kmsg", "nvml.json", "dns.json", "devices.json"])
def test_recordings_never_follow_links_out_of_the_root(node_copy: Path, tmp_path: Path, run_cli: Runner, recording: str) -> None:
    secret = tmp_path / "secret.log"
    secret.write_text("6,1,5,-;TOPSECRET-TOKEN-1234 mlx5_core 0000:1a:00.0: Link down\n")
    target = node_copy / ".preflight" / recording
    target.unlink(missing_ok=True)
    os.symlink(secret, target)
    result = run_cli("node", "--root", str(node_copy), "--format", "json")
    assert result.returncode in (0, 1, 2) and "Traceback" not in result.stderr
    assert "TOPSECRET" not in result.stdout
    assert "never followed out of the root" in result.stdout
    again = tmp_path / "again.tar.gz"
    take_snapshot(SnapshotArgs(output=str(again), root=str(node_copy)))
    with tarfile.open(again) as tar:
        assert not any(b"TOPSECRET" in (tar.extractfile(m).read() if m.isfile() else b"") for m in tar.getmembers())  # type: ignore[union-attr]


def test_a_recording_directory_that_is_a_link_is_not_followed(node_copy: Path, tmp_path: Path, run_cli: Runner) -> None:
    elsewhere = tmp_path / "elsewhere"
    (node_copy / ".preflight").rename(elsewhere)
    os.symlink(elsewhere, node_copy / ".preflight")
    report = json.loads(run_cli("node", "--root", str(node_copy), "--format", "json").stdout)
    gpu = [f for f in report["findings"] if f["id"] == "GPU001"]
    assert {f["status"] for f in gpu} == {"unknown"} and "never followed" in gpu[0]["reason"]


def test_a_users_process_named_slurmd_is_not_taken_for_slurmd(node_copy: Path, run_cli: Runner) -> None:
    """Without a pid file, slurmd is looked for by name; any user can name a process "slurmd"
    (prctl, or a copied binary) and set its memlock limit. Only a root process counts."""
    (node_copy / "run/slurmd.pid").unlink()
    shutil.rmtree(node_copy / "proc/2187")
    impostor = node_copy / "proc/4321"
    write(node_copy, "/proc/4321/comm", "slurmd\n")
    write(node_copy, "/proc/4321/status", "Name:\tslurmd\nUid:\t1000\t1000\t1000\t1000\nGid:\t1000\t1000\t1000\t1000\n")
    write(node_copy, "/proc/4321/limits", "Max locked memory         unlimited            unlimited            bytes\n")
    report = json.loads(run_cli("node", "--root", str(node_copy), "--format", "json", "--select", "MEM001").stdout)
    assert "/proc/4321" not in json.dumps(report["findings"]) and report["facts"]["memlock"]["slurmd_pid"] is None
    (impostor / "status").write_text("Name:\tslurmd\nUid:\t0\t0\t0\t0\nGid:\t0\t0\t0\t0\n")
    report = json.loads(run_cli("node", "--root", str(node_copy), "--format", "json", "--select", "MEM001").stdout)
    assert report["facts"]["memlock"]["slurmd_pid"] == 4321
