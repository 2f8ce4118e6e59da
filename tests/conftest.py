"""Shared fixtures: the recorded example node, writable copies of it, and CLI runners.

Tests import the *installed* package (``pip install '.[test]'``), so they exercise the same
layout users get, with ``checks/`` and ``references/`` mapped inside ``preflight``.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

import pytest

AUDIT = Path(__file__).resolve().parent / "audit"
sys.path.insert(0, str(AUDIT))
import io_audit  # noqa: E402


def pytest_configure(config: pytest.Config) -> None:
    """The no-direct-I/O hook, for the whole session, before any test module imports preflight
    (tests/audit/io_audit.py says what it sees, where, and what it cannot). Here rather than at
    import: bench scripts import helpers from this module and must stay unaudited."""
    io_audit.install()

REPO = Path(__file__).resolve().parent.parent
EXAMPLE_ROOT = REPO / "examples" / "nodes" / "hgx-h100"
BIN = Path(sys.executable).parent


def load_script(path: Path) -> ModuleType:
    """A repository script that is not part of the package (a generator, an importer), as a module."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def preflight_command() -> list[str]:
    script = BIN / "preflight"
    return [str(script)] if script.exists() else [sys.executable, "-m", "preflight"]


#: The log the suite's Python child processes append their violations to, once the session started.
_children_log: list[Path] = []
#: How far earlier reports went: an index into io_audit.violations, an offset in the children's log.
_reported = {"in_process": 0, "children": 0}


@pytest.fixture(scope="session", autouse=True)
def audited_children(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Audit the Python processes the tests start: they load tests/audit/sitecustomize.py
    through PYTHONPATH and append their violations to a log in the session's temporary
    directory."""
    log = tmp_path_factory.mktemp("io-audit") / "violations.tsv"
    saved = {name: os.environ.get(name) for name in ("PYTHONPATH", io_audit.LOG_VARIABLE)}
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, (str(AUDIT), saved["PYTHONPATH"])))
    os.environ[io_audit.LOG_VARIABLE] = str(log)
    _children_log.append(log)
    yield log
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def _new_violations() -> list[io_audit.Violation]:
    found = io_audit.violations[_reported["in_process"]:]
    _reported["in_process"] = len(io_audit.violations)
    if _children_log:
        children, _reported["children"] = io_audit.read_log(str(_children_log[0]), _reported["children"])
        found += children
    return found


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """Fail the test (or its setup or teardown) during which a module outside
    ``preflight.sources`` touched the node, in this process or in a child. A setup's report
    also carries what happened before it outside any test (collection, a wider fixture)."""
    report: pytest.TestReport = yield
    found = _new_violations()
    if found:
        message = "direct node I/O outside preflight.sources:\n" + "\n".join(map(str, found))
        if report.passed:
            report.outcome = "failed"
            report.longrepr = message
        else:
            report.sections.append(("direct node I/O", message))
    return report


@pytest.fixture
def example_root() -> Path:
    return EXAMPLE_ROOT


@pytest.fixture
def node_copy(tmp_path: Path) -> Path:
    """A writable copy of the example node (symlinks kept)."""
    target = tmp_path / "node"
    shutil.copytree(EXAMPLE_ROOT, target, symlinks=True)
    return target


def write(root: Path, path: str, text: str | bytes) -> None:
    full = root / path.lstrip("/")
    full.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(text, bytes):
        full.write_bytes(text)
    else:
        full.write_text(text)


def bare_node(root: Path) -> Path:
    """``root`` made a node with nothing on it: the sources are captured (so their absence is
    evidence, see preflight.sources.capture) but hold no RDMA device, GPU, NCCL or setting."""
    for directory in ("dev", "usr/lib", "sys/class", "sys/module", "sys/bus/pci/devices", "sys/devices/system/node"):
        (root / directory).mkdir(parents=True, exist_ok=True)
    write(root, "/etc/hostname", "bare\n")
    write(root, "/proc/self/environ", b"")
    write(root, "/.preflight/devices.json", '{"format": "preflight-devices/1", "nodes": {}}')  # /dev looked at: no devices
    return root


def site_config(root: Path, text: str) -> str:
    """A site config for a run on ``root``, written beside it (a config inside a root is never
    read) and passed with ``--config``."""
    path = root.parent / f"{root.name}.site.toml"
    path.write_text(text)
    return str(path)


CLEAN_NCCL = "2.28.9"


@contextmanager
def example_copy_for_nobody(prefix: str) -> Iterator[tuple[Path, Path]]:
    """(working directory, root): a copy of the example node that ``nobody`` can walk into
    (pytest's tmp_path is not), removed afterwards."""
    base = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        base.chmod(0o755)
        root = base / "node"
        shutil.copytree(EXAMPLE_ROOT, root, symlinks=True)
        yield base, root
    finally:
        shutil.rmtree(base)


def drain_datagrams(sock: socket.socket) -> list[str]:
    """Every datagram waiting on a non-blocking socket (a test's stand-in for /dev/log)."""
    lines = []
    while True:
        try:
            lines.append(sock.recv(4096).decode())
        except BlockingIOError:
            return lines


def upgrade_nccl(root: Path, old: str, new: str) -> None:
    """Replace the example's NCCL release, system package and wheel alike."""
    system = root / "usr/lib/x86_64-linux-gnu"
    (system / f"libnccl.so.{old}").rename(system / f"libnccl.so.{new}")
    (system / "libnccl.so.2").unlink()
    (system / "libnccl.so.2").symlink_to(f"libnccl.so.{new}")
    site = root / "usr/local/lib/python3.10/dist-packages"
    (site / f"nvidia_nccl_cu12-{old}.dist-info").rename(site / f"nvidia_nccl_cu12-{new}.dist-info")
    write(root, f"/usr/local/lib/python3.10/dist-packages/nvidia_nccl_cu12-{new}.dist-info/METADATA", f"Name: nvidia-nccl-cu12\nVersion: {new}\n")


def make_clean(root: Path) -> Path:
    """Repair every planted misconfiguration of the example node."""
    for path in ("proc/self/limits", "proc/2187/limits"):
        full = root / path
        text = re.sub(r"^(Max locked memory\s+)8388608(\s+)8388608", r"\1unlimited\2unlimited", full.read_text(), flags=re.M)
        full.write_text(text)
    write(root, "/etc/slurm/slurm.conf", (root / "etc/slurm/slurm.conf").read_text() + "PropagateResourceLimitsExcept=MEMLOCK\n")
    write(root, "/etc/nccl.conf", "NCCL_IB_HCA=mlx5\n")
    write(root, "/sys/module/nvidia_peermem/version", "550.54.15\n")
    # With MLNX_OFED, nvidia_peermem registers as the "nv_mem" peer-memory client.
    write(root, "/sys/kernel/mm/memory_peers/nv_mem/version", "1.3\n")
    upgrade_nccl(root, "2.21.5", CLEAN_NCCL)  # 2.21.5 carries known bugs (SOCK002)
    hosts = (root / "etc/hosts").read_text().replace("127.0.1.1\tgpu017.cluster\tgpu017\n", "")
    write(root, "/etc/hosts", hosts)
    switch_config = root / "sys/devices/pci0000:5a/0000:5a:01.0/0000:5c:00.0/config"
    config = bytearray(switch_config.read_bytes())
    config[0x14E:0x150] = b"\0\0"  # ACS redirect off on the switch between GPU 3 and mlx5_3
    switch_config.write_bytes(bytes(config))
    return root


@pytest.fixture
def clean_root(node_copy: Path) -> Path:
    return make_clean(node_copy)


Runner = Callable[..., subprocess.CompletedProcess[str]]


@pytest.fixture
def run_cli(tmp_path_factory: pytest.TempPathFactory) -> Runner:
    # The test's own working directory for the command: never the source tree (it would shadow
    # the installed package), never a directory other tests share.
    cwd = tmp_path_factory.mktemp("cwd")

    def run(*args: str, timeout: float = 60, env: dict[str, str] | None = None, input: str | None = None) -> subprocess.CompletedProcess[str]:
        merged = {**os.environ, **(env or {})}
        return subprocess.run(
            [*preflight_command(), *args], capture_output=True, text=True, timeout=timeout, env=merged, input=input, cwd=cwd,
        )

    return run


#: Libraries the prolog and fleet paths must not import (tests/cli/test_import_cost.py, tests/slurm/test_slurm.py).
HEAVY = {"typer", "pydantic", "rich", "click", "pyroute2", "dns", "pynvml", "pyudev", "tabulate"}
