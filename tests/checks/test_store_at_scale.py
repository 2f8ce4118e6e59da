"""TORCH012 on hand-built facts: the store host's backlog and descriptor limit against the job's
size, and the legacy TCPStore server beyond a thousand ranks."""

from __future__ import annotations

from pathlib import Path

import pytest

from preflight.checks.torch import elastic_rendezvous_timeout_at_scale
from preflight.model import NotApplicable, Observation, Severity, Status, Unknown
from preflight.probes.frameworks import FrameworkFacts, PythonPackage
from preflight.probes.job import JobFacts
from preflight.probes.memlock import Limit
from preflight.probes.store_limits import StoreLimitsFacts, probe_store_limits
from preflight.sources import NodeFS

STEP = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_NODES": "1024", "SLURM_STEP_NUM_TASKS": "8192", "WORLD_SIZE": "8192", "MASTER_ADDR": "gpu0001"}
ROOMY = StoreLimitsFacts(65535, "", Limit(131072, 131072, "/proc/self/limits"), "")


def torch(version: str = "2.6.0+cu124") -> FrameworkFacts:
    package = PythonPackage("torch", version, f"/usr/lib/python3/dist-packages/torch-{version}.dist-info/METADATA")
    return FrameworkFacts(("/usr/lib/python3/dist-packages",), (package,), ())


def judge(environ: dict[str, str], limits: StoreLimitsFacts = ROOMY, frameworks: FrameworkFacts | None = None) -> list[Observation]:
    job = JobFacts(environ, "", ())
    return list(elastic_rendezvous_timeout_at_scale(job, limits, frameworks or torch()))


def verdicts(observations: list[Observation]) -> dict[str, Severity | Status | None]:
    return {o.subject: (o.status if o.status is Status.UNKNOWN else o.severity) for o in observations}


def test_a_large_job_within_the_limits_is_absent() -> None:
    assert judge(STEP) == []


def test_backlog_below_the_ranks_is_a_warning() -> None:
    found = judge(STEP, StoreLimitsFacts(4096, "", ROOMY.open_files, ""))
    assert verdicts(found) == {"net.core.somaxconn": Severity.WARNING}
    assert found[0].evidence[0].observed == "4096"


def test_an_mpi_launchers_world_size_counts_too() -> None:
    """mpirun (Open MPI) and Hydra name the job's ranks in their own variables, with no WORLD_SIZE
    or Slurm count beside them (a job started over ssh, where the script sets MASTER_ADDR)."""
    for name in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE"):
        found = judge({name: "8192", "MASTER_ADDR": "gpu0001", "MASTER_PORT": "29500"}, StoreLimitsFacts(4096, "", ROOMY.open_files, ""))
        assert verdicts(found) == {"net.core.somaxconn": Severity.WARNING}, name


def test_a_pytorchjobs_size_is_its_nodes_times_its_ranks_per_node() -> None:
    """Kubeflow's training operator passes torchrun's --nnodes and --nproc-per-node as PET_NNODES
    (N or MIN:MAX, the most counted) and PET_NPROC_PER_NODE; WORLD_SIZE there counts pods."""
    elastic = {"PET_NNODES": "256:1024", "PET_NPROC_PER_NODE": "8", "WORLD_SIZE": "256", "MASTER_ADDR": "job-master-0"}
    found = judge(elastic, StoreLimitsFacts(4096, "", ROOMY.open_files, ""))
    assert verdicts(found) == {"net.core.somaxconn": Severity.WARNING}
    assert "PET_NNODES=256:1024, PET_NPROC_PER_NODE=8" in found[0].evidence[1].observed
    assert judge(dict(elastic, PET_NPROC_PER_NODE="gpu"), StoreLimitsFacts(4096, "", ROOMY.open_files, "")) == []


def test_the_same_backlog_is_fine_for_a_job_it_holds() -> None:
    small = dict(STEP, SLURM_STEP_NUM_TASKS="64", WORLD_SIZE="64", SLURM_STEP_NUM_NODES="8")
    assert judge(small, StoreLimitsFacts(128, "", Limit(1024, 1024, "/proc/self/limits"), "")) == []


@pytest.mark.parametrize(
    ("soft", "hard", "severity"),
    [(1024, 524288, Severity.WARNING), (1024, 4096, None), (8192, 8192, "absent")],
)
def test_open_files_against_the_ranks(soft: int, hard: int, severity: Severity | None | str) -> None:
    found = verdicts(judge(STEP, StoreLimitsFacts(65535, "", Limit(soft, hard, "/proc/self/limits"), "")))
    if severity == "absent":
        assert found == {}
    else:
        assert found == {"open files": severity}  # None: the reference's own severity, error


def test_hard_limit_without_torch_launch_variables_is_only_a_warning() -> None:
    # An srun step of 8192 tasks that names no MASTER_ADDR/WORLD_SIZE may be an MPI or Horovod
    # job that starts no TCPStore at all.
    mpi_step = {name: value for name, value in STEP.items() if name not in ("WORLD_SIZE", "MASTER_ADDR")}
    found = verdicts(judge(mpi_step, StoreLimitsFacts(65535, "", Limit(1024, 4096, "/proc/self/limits"), "")))
    assert found == {"open files": Severity.WARNING}


def test_limits_of_a_slurmd_script_are_not_the_jobs() -> None:
    prolog = dict(STEP, SLURM_SCRIPT_CONTEXT="prolog_slurmd")
    assert judge(prolog, StoreLimitsFacts(65535, "", Limit(1024, 1024, "/proc/self/limits"), "")) == []


def test_missing_evidence_is_unknown_not_absent() -> None:
    found = verdicts(judge(STEP, StoreLimitsFacts(None, "/proc/sys/net/core/somaxconn: missing", None, "/proc/self/limits: missing")))
    assert found == {"net.core.somaxconn": Status.UNKNOWN, "open files": Status.UNKNOWN}


def test_legacy_store_server_beyond_a_thousand_ranks_is_info() -> None:
    assert verdicts(judge(dict(STEP, USE_LIBUV="0"))) == {"USE_LIBUV": Severity.INFO}
    assert verdicts(judge(STEP, frameworks=torch("2.3.1"))) == {"PyTorch": Severity.INFO}
    # Under torchrun's agent store the workers start no server, so USE_LIBUV chooses nothing.
    assert judge(dict(STEP, USE_LIBUV="0", TORCHELASTIC_USE_AGENT_STORE="True")) == []
    assert judge(dict(STEP, WORLD_SIZE="512", SLURM_STEP_NUM_TASKS="512"), frameworks=torch("2.3.1")) == []


def test_unknown_size_or_no_pytorch_is_not_applicable() -> None:
    with pytest.raises(NotApplicable):
        judge({"HOME": "/root"})
    with pytest.raises(NotApplicable):
        judge({"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "4096"}, frameworks=FrameworkFacts((), (), ()))
    with pytest.raises(Unknown):
        list(elastic_rendezvous_timeout_at_scale(JobFacts({}, "EACCES", ()), ROOMY, torch()))


def test_probe_reads_somaxconn_and_the_open_files_row(tmp_path: Path) -> None:
    (tmp_path / "proc/sys/net/core").mkdir(parents=True)
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/sys/net/core/somaxconn").write_text("4096\n")
    (tmp_path / "proc/self/limits").write_text(
        "Limit                     Soft Limit           Hard Limit           Units     \n"
        "Max open files            1024                 524288               files     \n"
        "Max locked memory         unlimited            unlimited            bytes     \n"
    )
    facts = probe_store_limits(NodeFS(str(tmp_path)))
    assert facts == StoreLimitsFacts(4096, "", Limit(1024, 524288, "/proc/self/limits"), "")


def test_probe_tells_missing_and_garbled_apart(tmp_path: Path) -> None:
    (tmp_path / "proc/sys/net/core").mkdir(parents=True)
    (tmp_path / "proc/sys/net/core/somaxconn").write_text("lots\n")
    facts = probe_store_limits(NodeFS(str(tmp_path)))
    assert facts.somaxconn is None and "not a non-negative integer" in facts.somaxconn_problem
    assert facts.open_files is None and "not captured" in facts.open_files_problem  # no /proc/self at all
    (tmp_path / "proc/self").mkdir()
    (tmp_path / "proc/self/limits").write_text("Limit  Soft Limit  Hard Limit  Units\nMax open files  many  1024  files\n")
    facts = probe_store_limits(NodeFS(str(tmp_path)))
    assert facts.open_files is None and "no readable 'Max open files' row" in facts.open_files_problem
