"""Files a job's environment names (NCCL_CONF_FILE, $HOME/.nccl.conf, NCCL_TOPO_FILE,
$SLURM_CONF) are read, on a live node where preflight runs as root for another user's job, only
as that user could read them: root never follows the user's links into files the user may not
read, and never reads a file of a third user. These ran as root and put a 0600 file's content
into the report before."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from preflight.sources import NodeFS, SourceError
from preflight.sources.fs import FileUser

from conftest import Runner

NOBODY = FileUser(65534, (65534,))
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="reading as another user's job needs root")


@pytest.fixture
def place() -> Iterator[Path]:
    """A directory every user may enter (pytest's own tmp_path is root's alone)."""
    directory = Path(tempfile.mkdtemp(prefix="preflight-jobfiles-"))
    directory.chmod(0o755)
    try:
        yield directory
    finally:
        shutil.rmtree(directory)


def owned(path: Path, text: str, uid: int, mode: int) -> Path:
    path.write_text(text)
    os.chown(path, uid, uid)
    path.chmod(mode)
    return path


def test_the_users_own_file_is_read(place: Path) -> None:
    conf = owned(place / "nccl.conf", "NCCL_DEBUG=INFO\n", 65534, 0o600)
    assert NodeFS("/").read_for(str(conf), NOBODY) == "NCCL_DEBUG=INFO\n"
    shared = owned(place / "site.conf", "NCCL_IB_HCA=mlx5\n", 0, 0o644)  # root's, readable by all
    assert NodeFS("/").read_for(str(shared), NOBODY) == "NCCL_IB_HCA=mlx5\n"
    assert NodeFS("/").read_for(str(place / "absent.conf"), NOBODY) is None


def test_a_link_of_the_user_to_a_file_only_root_may_read_is_refused(place: Path) -> None:
    secret = owned(place / "shadow", "TOPSECRET\n", 0, 0o600)
    link = place / "nccl.conf"
    os.symlink(secret, link)
    os.lchown(link, 65534, 65534)
    with pytest.raises(SourceError, match="may not read it"):
        NodeFS("/").read_for(str(link), NOBODY)
    assert NodeFS("/").read(str(link)) == "TOPSECRET\n"  # what root alone would have read


def test_links_and_files_of_a_third_user_are_refused(place: Path) -> None:
    other = owned(place / "other.conf", "NCCL_X=1\n", 12345, 0o644)
    with pytest.raises(SourceError, match="owned by uid 12345"):
        NodeFS("/").read_for(str(other), NOBODY)
    theirs = place / "their-link"
    os.symlink(place / "site.conf", theirs)
    os.lchown(theirs, 12345, 12345)
    with pytest.raises(SourceError, match="link owned by uid 12345"):
        NodeFS("/").read_for(str(theirs), NOBODY)


def test_a_directory_the_user_may_not_enter_is_refused(place: Path) -> None:
    closed = place / "closed"
    closed.mkdir(mode=0o700)
    owned(closed / "nccl.conf", "NCCL_X=1\n", 65534, 0o644)
    with pytest.raises(SourceError, match="may not enter it"):
        NodeFS("/").read_for(str(closed / "nccl.conf"), NOBODY)


def test_root_reads_as_itself_outside_another_users_job(place: Path) -> None:
    secret = owned(place / "shadow", "TOPSECRET\n", 0, 0o600)
    assert NodeFS("/").read_for(str(secret), None) == "TOPSECRET\n"  # preflight's own environment
    assert NodeFS("/").read_for(str(secret), FileUser(0, (0,))) == "TOPSECRET\n"  # a job of root's


def test_a_prolog_for_another_users_job_keeps_a_0600_file_out_of_the_report(place: Path, run_cli: Runner) -> None:
    secret = owned(place / "shadow", "NCCL_SOCKET_IFNAME=TOPSECRET\n", 0, 0o600)
    link = place / "nccl.conf"
    os.symlink(secret, link)
    os.lchown(link, 65534, 65534)
    env = {"SLURM_JOB_UID": "65534", "SLURM_JOB_GID": "65534", "SLURM_JOB_ID": "7", "NCCL_CONF_FILE": str(link)}
    result = run_cli("node", "--format", "json", "--select", "GDR002", env=env)
    assert "TOPSECRET" not in result.stdout
    files = json.loads(result.stdout)["facts"]["job"]["nccl_conf_files"]
    assert any(entry["path"] == str(link) and "may not read it" in entry["error"] for entry in files)


def test_a_job_named_slurm_conf_is_read_with_the_jobs_rights(place: Path, run_cli: Runner) -> None:
    """Both readers of slurm.conf take $SLURM_CONF (and the files it includes) from the job, so
    both read it as the job's user: a link to root's 0600 file stays out of the report."""
    secret = owned(place / "shadow", "PropagateResourceLimitsExcept=TOPSECRET\n", 0, 0o600)
    link = place / "slurm.conf"
    os.symlink(secret, link)
    os.lchown(link, 65534, 65534)
    env = {"SLURM_JOB_UID": "65534", "SLURM_JOB_GID": "65534", "SLURM_JOB_ID": "7", "SLURM_CONF": str(link)}
    result = run_cli("node", "--format", "json", "--select", "MEM001,NVL005", env=env)  # the memlock and nccl_platform probes
    assert result.returncode in (0, 1, 2, 3) and "Traceback" not in result.stderr
    assert "TOPSECRET" not in result.stdout and str(link) in result.stdout
