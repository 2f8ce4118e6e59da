"""Bad input never crashes the run: missing, empty, garbage, oversized, looping or unreadable
node files give a report (with unknown where facts could not be read), never a traceback."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

from conftest import EXAMPLE_ROOT, REPO, Runner, example_copy_for_nobody

SCHEMA = json.loads((REPO / "preflight" / "schemas" / "report-v1.schema.json").read_text())
FILES = [
    "proc/self/limits", "proc/2187/limits", "proc/self/environ", "proc/self/status", "proc/meminfo",
    "sys/module/nvidia/version", "proc/driver/nvidia/version", "proc/sys/kernel/hostname",
    "proc/sys/kernel/osrelease", "etc/hosts", "etc/nccl.conf", "etc/slurm/slurm.conf", "run/slurmd.pid",
    ".preflight/nvml.json", ".preflight/dns.json", "sys/bus/pci/devices/0000:18:00.0/vendor",
    "etc/systemd/system.conf", "etc/security/limits.d/90-rdma.conf", "proc/net/fib_trie",
]


def mutate(root: Path, relative: str, how: str) -> None:
    target = root / relative
    if target.is_symlink() or target.exists():
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        else:
            target.unlink()
    if how == "missing":
        return
    if how == "empty":
        target.write_bytes(b"")
    elif how == "garbage":
        target.write_bytes(b"\xff\xfe\x00garbage\x80\n" * 50)
    elif how == "directory":
        target.mkdir()
    elif how == "huge":
        with open(target, "wb") as handle:
            handle.truncate(5 * 1024 * 1024)
    elif how == "loop":
        os.symlink(target.name, target)


@pytest.mark.parametrize("how", ["missing", "empty", "garbage", "directory", "huge", "loop"])
@pytest.mark.parametrize("relative", FILES)
def test_mutated_file_gives_a_report(run_cli: Runner, node_copy: Path, relative: str, how: str) -> None:
    mutate(node_copy, relative, how)
    result = run_cli("node", "--root", str(node_copy), "--format", "json")
    assert "Traceback" not in result.stderr
    assert result.returncode in (0, 1, 2), result.stderr
    jsonschema.validate(json.loads(result.stdout), SCHEMA)


@pytest.mark.parametrize("how", ["garbage", "directory", "huge", "loop"])
def test_unreadable_slurmd_limits_is_unknown_not_absent(run_cli: Runner, node_copy: Path, how: str) -> None:
    mutate(node_copy, "proc/2187/limits", how)
    report = json.loads(run_cli("node", "--root", str(node_copy), "--format", "json", "--select", "MEM001").stdout)
    subjects = {(f["status"], f["subject"]) for f in report["findings"]}
    assert ("unknown", "/proc/2187/limits") in subjects, subjects


def test_garbage_nvml_recording_makes_gpu_check_unknown(run_cli: Runner, node_copy: Path) -> None:
    (node_copy / ".preflight/nvml.json").write_text("{not json")
    report = json.loads(run_cli("node", "--root", str(node_copy), "--format", "json", "--select", "GPU001").stdout)
    assert report["findings"][0]["status"] in ("unknown", "present")
    assert "NVML_REPLAY_UNREADABLE" in json.dumps(report)


def test_root_that_is_a_file_or_unreadable(run_cli: Runner, tmp_path: Path) -> None:
    a_file = tmp_path / "file"
    a_file.write_text("x")
    result = run_cli("node", "--root", str(a_file))
    # a file may be a snapshot archive; this one is not (tests/snapshot/test_snapshot_archive.py has more)
    assert result.returncode == 3 and "neither a directory nor a snapshot archive" in result.stderr
    result = run_cli("node", "--root", str(tmp_path / "missing"))
    assert result.returncode == 3 and "no such directory" in result.stderr


def test_malformed_config_values(run_cli: Runner, tmp_path: Path) -> None:
    cases = {
        "[run]\ntimeout = \"soon\"\n": "run.timeout",
        "[expect]\nmemlock_min = \"lots\"\n": "expect.memlock_min",
        "[severity]\nMEM001 = \"fatal\"\n": "severity.MEM001",
        "[[hosts]]\nmatch = \"gpu[1-\"\n": "hosts[0].match",
        "[policy\n": "not valid TOML",
        "disable = [\"mem001\"]\n": "disable",
    }
    for text, expected in cases.items():
        config = tmp_path / "c.toml"
        config.write_text(text)
        result = run_cli("node", "--root", str(EXAMPLE_ROOT), "--config", str(config))
        assert result.returncode == 3 and expected in result.stderr and "Traceback" not in result.stderr, (text, result.stderr)


# Imports and the catalogue are loaded while still root (the test's virtualenv may live in a
# directory only root can read); the node is then read with the credentials of ``nobody``.
UNPRIVILEGED_RUN = """
import json, os, sys
from preflight.config import HostConfig
from preflight.discovery import build_registry
from preflight.engine import RunOptions, run
from preflight.reporters import json_report
from preflight.sources import Sources
registry = build_registry()
os.setgroups([])
os.setgid(65534)
os.setuid(65534)
report = run(registry, Sources.for_node(sys.argv[1]), HostConfig(), RunOptions(profile="prolog"), "gpu017")
sys.stdout.write(json_report.render(report, True))
"""


def test_permission_denied_as_unprivileged_user() -> None:
    """On a root-owned copy with an unreadable slurmd limits file, running as ``nobody``."""
    if os.geteuid() != 0:
        pytest.skip("needs root to switch to an unprivileged user")
    with example_copy_for_nobody("preflight-unpriv-") as (base, root):
        (root / "proc/2187/limits").chmod(0o000)
        result = subprocess.run(
            [sys.executable, "-c", UNPRIVILEGED_RUN, str(root)],
            capture_output=True, text=True, timeout=60, cwd=str(base),
        )
        assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
        findings = [f for f in json.loads(result.stdout)["findings"] if f["id"] == "MEM001"]
        unknown = [f for f in findings if f["status"] == "unknown"]
        assert [f["subject"] for f in unknown] == ["/proc/2187/limits"]
        assert "permission denied" in unknown[0]["reason"] and "needs root" in unknown[0]["reason"]
