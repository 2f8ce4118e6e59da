"""NVL001 on the recorded GB200 tray (``gb200-mnnvl``): the NCCL release, the job's size and
NCCL_MNNVL_ENABLE decide whether alltoall-like traffic can hang across the NVLink domain."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from preflight.config import HostConfig
from preflight.discovery import build_registry
from preflight.engine import RunOptions, run
from preflight.model import Finding, Severity
from preflight.sources import NodeFS, Sources

TRAY = Path(__file__).resolve().parents[1] / "fixtures" / "nodes" / "gb200-mnnvl"
LIBS = "usr/lib/aarch64-linux-gnu"
REGISTRY = build_registry(plugins=False)


def tray(tmp_path: Path, nccl: str, environ: dict[str, str]) -> Path:
    """The tray with one system NCCL of release ``nccl`` and the job environment ``environ``."""
    root = tmp_path / "tray"
    shutil.copytree(TRAY, root, symlinks=True)
    for entry in (root / LIBS).glob("libnccl.so*"):
        entry.unlink()
    (root / LIBS / f"libnccl.so.{nccl}").write_bytes(b"")
    (root / "proc/self/environ").write_bytes(b"".join(f"{k}={v}\0".encode() for k, v in environ.items()))
    return root


def nvl001(root: Path) -> list[Finding]:
    report = run(REGISTRY, Sources.for_fs(NodeFS(str(root))), HostConfig(), RunOptions(profile="full", select=("NVL001",)), "test")
    return [finding for finding in report.findings if finding.reference_id == "NVL001"]


@pytest.mark.parametrize(
    "nccl, environ, observed",
    [
        ("2.25.1", {"WORLD_SIZE": "96"}, "'96': 96 ranks"),
        ("2.26.2", {"SLURM_JOB_ID": "7", "HOME": "/root"}, "no world size (WORLD_SIZE, an MPI launcher's, SLURM_NTASKS): the job's size is not known here"),
    ],
)
def test_release_without_the_work_around_on_a_large_or_unknown_job_is_a_warning(tmp_path: Path, nccl: str, environ: dict[str, str], observed: str) -> None:
    (finding,) = nvl001(tray(tmp_path, nccl, environ))
    assert finding.status.value == "present" and finding.severity is Severity.WARNING
    assert finding.evidence[0].observed.startswith(f"NCCL {nccl}:") and finding.evidence[-1].observed == observed
    assert "multi-node NVLink fabric" in finding.evidence[1].observed


@pytest.mark.parametrize(
    "nccl, environ",
    [
        ("2.26.5", {"WORLD_SIZE": "96"}),  # the work-around
        ("2.26.2", {"WORLD_SIZE": "80"}),  # "over 80 ranks"
        ("2.25.1", {"OMPI_COMM_WORLD_SIZE": "8"}),  # an MPIJob rank: Open MPI's world size counts too
        ("2.26.2", {"WORLD_SIZE": "96", "NCCL_MNNVL_ENABLE": "0"}),  # no multi-node NVLink traffic
    ],
)
def test_fixed_release_small_job_or_mnnvl_off_is_absent(tmp_path: Path, nccl: str, environ: dict[str, str]) -> None:
    assert [f.status.value for f in nvl001(tray(tmp_path, nccl, environ))] == ["absent"]
