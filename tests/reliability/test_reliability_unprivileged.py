"""The CLI run as an unprivileged user (``runuser -u nobody``), on a root-owned recorded root with
parts made unreadable and on the live node: what needs root becomes ``unknown`` with a reason
saying so, nothing crashes (exit code 0/1/2, no traceback), and the run writes no file.

How "writes no file" is checked: ``nobody`` can only create files where it may write, and on
this kind of machine that is the world-writable directories (``/tmp``, ``/var/tmp``,
``/dev/shm``); the test lists every file ``nobody`` owns there before and after each run (files
of other users' concurrent work do not count), and compares the recorded root's listing,
contents and modification times. The report goes to stdout, the only report path there is.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import stat
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest

from conftest import EXAMPLE_ROOT, REPO
from reliability_harness import violations
from preflight.engine import Report
from preflight.model import Finding, Severity, Status

NOBODY = 65534
WORLD_WRITABLE = ("/tmp", "/var/tmp", "/dev/shm")
SCHEMA = json.loads((REPO / "preflight" / "schemas" / "report-v1.schema.json").read_text())
# NVML_REPLAY_UNREADABLE: the NVML recording could not be read (GPU001 carries the errno).
PERMISSION_WORDS = ("permission denied", "needs root", "eacces", "eperm", "nvml_replay_unreadable")
RUNUSER = shutil.which("runuser") or shutil.which("runuser", path="/usr/sbin:/sbin") or "runuser"


def _nobody_cannot_run(bin_dir: Path) -> str:
    """Why ``nobody`` cannot import preflight with ``bin_dir``'s interpreter ("" when it can)."""
    probe = subprocess.run(
        [RUNUSER, "-u", "nobody", "--", str(bin_dir / "python"), "-c", "import preflight"],
        capture_output=True, text=True, timeout=60, cwd="/",
    )
    if probe.returncode == 0:
        return ""
    return probe.stderr.strip()[-200:] or f"exit code {probe.returncode}"


# Not needed by the CLI, and most of the copy's size.
_NOT_COPIED = ("__pycache__", "mypy", "mypyc", "*__mypyc*", "ansible", "ansible_*", "pip", "setuptools", "hypothesis", "_pytest", "cryptography")


def _system_python_venv() -> tuple[Path | None, str]:
    """A venv ``nobody`` can run when this one cannot (CI's interpreter lives under /root): made
    from the system's interpreter of the same minor version, so compiled extensions still load,
    reading a world-readable copy of this venv's packages through a .pth file."""
    minor = f"python{sys.version_info.major}.{sys.version_info.minor}"
    system = shutil.which(minor, path="/usr/bin:/bin")
    if system is None:
        return None, f"there is no /usr/bin/{minor} to make a venv nobody can run"
    base = Path(tempfile.mkdtemp(prefix="preflight-nobody-"))
    atexit.register(shutil.rmtree, base, True)
    base.chmod(0o755)
    shutil.copytree(sysconfig.get_paths()["purelib"], base / "site", symlinks=True, ignore=shutil.ignore_patterns(*_NOT_COPIED))
    made = subprocess.run([system, "-m", "venv", "--without-pip", str(base / "venv")], capture_output=True, text=True, timeout=120)
    if made.returncode:
        return None, f"{system} -m venv failed: {made.stderr.strip()[-200:]}"
    bin_dir = base / "venv" / "bin"
    purelib = subprocess.run(
        [str(bin_dir / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout.strip()
    Path(purelib, "preflight-tests.pth").write_text(f"{base / 'site'}\n")
    script = bin_dir / "preflight"
    script.write_text(f"#!{bin_dir / 'python'}\nimport sys\nfrom preflight.cli.start import main\nsys.exit(main())\n")
    script.chmod(0o755)
    return bin_dir, ""


def _nobody_bin() -> tuple[Path | None, str]:
    """The bin directory whose ``python`` and ``preflight`` nobody can run, or None and why not."""
    if os.geteuid() != 0:
        return None, "needs root to switch to the unprivileged user nobody"
    if not os.path.isabs(RUNUSER):
        return None, "runuser (util-linux) is not installed"
    own = Path(sys.executable).parent
    problem = _nobody_cannot_run(own)
    if not problem:
        return own, ""
    made, why = _system_python_venv()
    if made is None:
        return None, f"nobody cannot run this virtualenv's interpreter ({own / 'python'}: {problem}), and {why}"
    problem = _nobody_cannot_run(made)
    return (made, "") if not problem else (None, f"nobody cannot run {made / 'python'} either: {problem}")


BIN, _WHY_NOT = _nobody_bin()
pytestmark = pytest.mark.skipif(BIN is None, reason=_WHY_NOT or "ready")


def nobody_files() -> set[str]:
    """Every file or directory owned by nobody in the world-writable directories."""
    found = set()
    for top in WORLD_WRITABLE:
        for folder, subfolders, files in os.walk(top, onerror=lambda error: None):
            for name in subfolders + files:
                path = os.path.join(folder, name)
                try:
                    if os.lstat(path).st_uid == NOBODY:
                        found.add(path)
                except OSError:
                    continue
            # Directories nobody cannot enter hold nothing it wrote.
            subfolders[:] = [d for d in subfolders if _enterable(os.path.join(folder, d))]
    return found


def _enterable(path: str) -> bool:
    try:
        status = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(status.st_mode) and (status.st_uid == NOBODY or bool(status.st_mode & stat.S_IXOTH))


def tree_state(root: Path) -> list[tuple[str, int, int]]:
    """(path, mode, mtime) of everything under ``root``, links not followed."""
    state = []
    for folder, subfolders, files in os.walk(root):
        for name in subfolders + files:
            path = os.path.join(folder, name)
            status = os.lstat(path)
            state.append((path, status.st_mode, status.st_mtime_ns))
    return sorted(state)


def run_as_nobody(*args: str) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.run(
        [RUNUSER, "-u", "nobody", "--", str(BIN / "preflight"), *args],
        capture_output=True, text=True, timeout=120, cwd="/", env=env,
    )


def run_as_root(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BIN / "preflight"), *args], capture_output=True, text=True, timeout=120, cwd="/")


def as_report(document: dict) -> Report:
    """Enough of a Report for the mutation oracle: findings and probes."""
    from preflight.model import ProbeOutcome

    findings = tuple(
        Finding(f["id"], f["symbol"], f["title"], Status(f["status"]), Severity(f["severity"]), f["subject"], reason=f.get("reason", ""))
        for f in document["findings"]
    )
    probes = tuple(ProbeOutcome(p["name"], p["status"], 0.0, error=p.get("error", "")) for p in document["probes"])
    return Report("", "", "", 0.0, 0.0, findings, probes, {})


def verdicts_of(document: dict) -> dict[str, frozenset[tuple[str, str]]]:
    found: dict[str, set[tuple[str, str]]] = {}
    for finding in document["findings"]:
        found.setdefault(finding["id"], set()).add((finding["status"], finding["subject"]))
    return {ref: frozenset(items) for ref, items in found.items()}


def check_clean_run(result: subprocess.CompletedProcess[str]) -> dict:
    assert result.returncode in (0, 1, 2), (result.returncode, result.stderr[-2000:])
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    document = json.loads(result.stdout)
    jsonschema.validate(document, SCHEMA)
    return document


@pytest.fixture
def guarded_root() -> Iterator[Path]:
    """A root-owned copy of the example node, readable by others except the parts only root
    may read on a real node: slurmd's /proc entry, slurm.conf, nccl.conf, one HCA's sysfs
    directory and the NVML recording."""
    base = Path(tempfile.mkdtemp(prefix="preflight-unprivileged-"))
    try:
        base.chmod(0o755)
        root = base / "node"
        shutil.copytree(EXAMPLE_ROOT, root, symlinks=True)
        for private in ("proc/2187", "etc/slurm/slurm.conf", "etc/nccl.conf", ".preflight/nvml.json"):
            (root / private).chmod(0o700 if (root / private).is_dir() else 0o600)
        Path(os.path.realpath(root / "sys/class/infiniband/mlx5_0")).chmod(0o700)
        yield root
    finally:
        shutil.rmtree(base)


def test_recorded_root_as_nobody(guarded_root: Path) -> None:
    files_before, tree_before = nobody_files(), tree_state(guarded_root)
    unprivileged = check_clean_run(run_as_nobody("node", "--root", str(guarded_root), "--format", "json"))
    assert nobody_files() == files_before
    assert tree_state(guarded_root) == tree_before
    privileged = check_clean_run(run_as_root("node", "--root", str(guarded_root), "--format", "json"))

    # Every reference the missing privileges changed is unknown, for a reason that says so.
    problems, changed = violations(verdicts_of(privileged), as_report(unprivileged), unreadable=True)
    assert not problems, problems
    assert changed >= {"MEM001", "GPU001", "IB008", "IB009"}, changed
    for finding in unprivileged["findings"]:
        if finding["id"] in changed and finding["status"] == "unknown":
            assert any(word in finding["reason"].lower() for word in PERMISSION_WORDS), finding
    reasons = " ".join(f["reason"] for f in unprivileged["findings"] if f["status"] == "unknown").lower()
    # (slurmd's unreadable /proc/2187 decides nothing here: the prolog's own limit is slurmd's.)
    for private in ("nvml.json", "/sys/class/infiniband/mlx5_0", "nccl.conf"):
        assert private in reasons, private


def test_live_node_as_nobody() -> None:
    """On the machine running the tests: the same references decided as root, or unknown."""
    files_before = nobody_files()
    unprivileged = check_clean_run(run_as_nobody("node", "--format", "json"))
    assert nobody_files() == files_before
    privileged = check_clean_run(run_as_root("node", "--format", "json"))
    root_verdicts, nobody_verdicts = verdicts_of(privileged), verdicts_of(unprivileged)
    assert set(root_verdicts) == set(nobody_verdicts)
    for ref, found in nobody_verdicts.items():
        if found != root_verdicts[ref]:
            assert any(status == "unknown" for status, _ in found), (ref, found, root_verdicts[ref])
    for finding in unprivileged["findings"]:
        assert finding["status"] != "unknown" or finding["reason"], finding


def test_explain_and_references_as_nobody() -> None:
    """The other commands an operator runs unprivileged: no traceback, no file written."""
    log = Path(tempfile.mkdtemp(prefix="preflight-unprivileged-log-")) / "rank0.log"
    try:
        log.parent.chmod(0o755)
        from preflight.catalogue import load_all

        examples = [example for r in load_all() for item in r.signatures for example in item.get("examples", [])]
        log.write_text("\n".join(examples[:20]) + "\n")
        files_before = nobody_files()
        explained = run_as_nobody("explain", "--format", "json", str(log))
        assert explained.returncode in (0, 1) and "Traceback" not in explained.stderr, explained.stderr
        assert json.loads(explained.stdout)["candidates"]
        listed = run_as_nobody("references", "list")
        assert listed.returncode == 0 and "MEM001" in listed.stdout
        assert nobody_files() == files_before
    finally:
        shutil.rmtree(log.parent)
