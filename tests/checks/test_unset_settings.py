"""Checks whose misconfiguration is a setting the job makes (GDR002, MEM002, NCCL002, NCCL006,
NCCL015, NCCL018, TORCH006): when the setting is not made there is nothing to judge, and the
verdict is not_applicable with where it was looked for, never an absent that reads as "checked".
A prolog's environment is slurmd's, so the reason says what a prolog cannot see."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from preflight.config import HostConfig
from preflight.discovery import build_registry
from preflight.engine import RunOptions, run
from preflight.model import Finding
from preflight.sources import NodeFS, Sources

from conftest import write

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "nodes"
REGISTRY = build_registry(plugins=False)
UNSEEN = "a script slurmd runs (prolog, epilog) does not see the variables a job exports"
#: reference -> the setting its reason names; a100-pcie4 has the NVIDIA driver, RDMA devices and
#: no nccl.conf, so only the job's settings are missing.
SETTING_ONLY = {
    "GDR002": "NCCL_GDRCOPY_ENABLE not set in the environment or NCCL's configuration files",
    "MEM002": "NCCL_BUFFSIZE not set in the environment or NCCL's configuration files",
    "NCCL002": "NCCL_BUFFSIZE, NCCL_LL_BUFFSIZE, NCCL_LL128_BUFFSIZE not set",
    "NCCL006": "TORCH_NCCL_ENABLE_MONITORING not set in the environment (",
    "NCCL015": "NCCL_ALGO not set in the environment or NCCL's configuration files",
    "TORCH006": "TORCH_NCCL_ASYNC_ERROR_HANDLING and TORCH_NCCL_BLOCKING_WAIT (nor their older NCCL_ names) not set in the environment (",
}


def findings(root: Path, ref_id: str) -> list[Finding]:
    report = run(REGISTRY, Sources.for_fs(NodeFS(str(root))), HostConfig(), RunOptions(select=(ref_id,)), "test")
    return [finding for finding in report.findings if finding.reference_id == ref_id]


def with_environ(tmp_path: Path, **values: str) -> Path:
    root = tmp_path / "root"
    shutil.copytree(FIXTURES / "a100-pcie4", root, symlinks=True)
    write(root, "/proc/self/environ", b"".join(f"{k}={v}".encode() + b"\0" for k, v in values.items()))
    return root


@pytest.mark.parametrize("ref_id", sorted(SETTING_ONLY))
def test_unset_setting_is_not_applicable_not_absent(ref_id: str, tmp_path: Path) -> None:
    [finding] = findings(with_environ(tmp_path, HOME="/root"), ref_id)
    assert finding.status.value == "not_applicable"
    assert SETTING_ONLY[ref_id] in finding.reason and UNSEEN not in finding.reason


@pytest.mark.parametrize("ref_id", sorted(SETTING_ONLY))
def test_a_prolog_says_it_cannot_see_the_job_environment(ref_id: str, tmp_path: Path) -> None:
    root = with_environ(tmp_path, HOME="/root", SLURM_JOB_ID="7", SLURM_SCRIPT_CONTEXT="prolog_slurmd")
    [finding] = findings(root, ref_id)
    assert finding.status.value == "not_applicable" and finding.reason.endswith(UNSEEN)


def test_a_setting_in_nccl_conf_is_judged_in_a_prolog(tmp_path: Path) -> None:
    # nccl.conf is the node's: a prolog reads it as the job will.
    root = with_environ(tmp_path, HOME="/root", SLURM_JOB_ID="7", SLURM_SCRIPT_CONTEXT="prolog_slurmd")
    write(root, "/etc/nccl.conf", b"NCCL_ALGO=Ring\n")
    assert [f.status.value for f in findings(root, "NCCL015")] == ["absent"]
