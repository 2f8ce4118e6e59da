"""Launch settings (TORCH004, TORCH010, NCCL015): checks on hand-built job facts for each rule,
and the engine on the recorded ``srun-torchrun-per-gpu`` task and the example node's prolog."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from preflight.probes.job import JobFacts, NcclConfFile
from preflight.checks.nccl import allreduce_algorithms, tree_algorithm_hang
from preflight.checks.torch import ddp_process_group_setup_invalid, rank_to_gpu_mapping_wrong
from preflight.config import HostConfig
from preflight.discovery import build_registry
from preflight.engine import RunOptions, run
from preflight.model import NotApplicable, Observation, Severity, Unknown
from preflight.sources import NodeFS, Sources

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "nodes"
REGISTRY = build_registry(plugins=False)
# srun --ntasks-per-node=8 python train.py on two nodes, task 9 (node 2, local 1), done right.
SRUN_TASK = {
    "SLURM_JOB_ID": "9001", "SLURM_STEP_ID": "0", "SLURM_JOB_NODELIST": "gpu[001-002]", "SLURM_JOB_NUM_NODES": "2",
    "SLURM_NTASKS": "16", "SLURM_STEP_NUM_TASKS": "16", "SLURM_STEP_NUM_NODES": "2", "SLURM_PROCID": "9", "SLURM_LOCALID": "1",
    "RANK": "9", "LOCAL_RANK": "1", "WORLD_SIZE": "16", "MASTER_ADDR": "gpu001", "MASTER_PORT": "29500",
}


def job(environ: dict[str, str], conf: str = "") -> JobFacts:
    files = (NcclConfFile("/etc/nccl.conf", tuple(tuple(line.split("=", 1)) for line in conf.splitlines())),) if conf else ()  # type: ignore[misc]
    return JobFacts(environ, "", files)


def subjects(observations: list[Observation]) -> list[str]:
    return [observation.subject for observation in observations]


# -- TORCH004 -----------------------------------------------------------------------------------
def test_consistent_srun_task_is_absent() -> None:
    facts = job(SRUN_TASK)
    assert list(ddp_process_group_setup_invalid(facts)) == []
    assert list(rank_to_gpu_mapping_wrong(facts)) == []


def test_a_lone_world_size_for_a_later_torchrun_is_only_a_warning() -> None:
    """sbatch scripts export WORLD_SIZE for the torchrun of a later step and run a one-task-per-node
    step (preflight itself) first: that process carries no RANK or LOCAL_RANK, so it is no rank,
    and the mismatch with its own step's task count is a warning, not an error."""
    environ = {key: value for key, value in SRUN_TASK.items() if key not in ("RANK", "LOCAL_RANK")}
    environ.update(WORLD_SIZE="24", SLURM_STEP_NUM_TASKS="3", SLURM_NTASKS="3", SLURM_PROCID="1", SLURM_LOCALID="0")
    found = list(rank_to_gpu_mapping_wrong(job(environ)))
    assert [(o.subject, o.severity) for o in found] == [("WORLD_SIZE", Severity.WARNING)], found
    with_rank = list(rank_to_gpu_mapping_wrong(job({**environ, "RANK": "1"})))
    assert [(o.subject, o.severity) for o in with_rank] == [("WORLD_SIZE", None)]  # a rank's own setting: an error


@pytest.mark.parametrize(
    "changes, subject",
    [
        ({"MASTER_PORT": "29500x"}, "MASTER_PORT"),
        ({"MASTER_PORT": "70000"}, "MASTER_PORT"),
        ({"WORLD_SIZE": "sixteen"}, "WORLD_SIZE"),
        ({"WORLD_SIZE": "0"}, "WORLD_SIZE"),
        ({"RANK": "-1"}, "RANK"),
        ({"RANK": "\u00b2"}, "RANK"),  # str.isdigit() accepts a superscript two; int() does not
        ({"MASTER_ADDR": ""}, "MASTER_ADDR"),
        ({"MASTER_ADDR": "gpu001 "}, "MASTER_ADDR"),
        ({"MASTER_ADDR": "127.0.0.1"}, "MASTER_ADDR"),
        ({"MASTER_ADDR": "localhost"}, "MASTER_ADDR"),
    ],
)
def test_rendezvous_values_init_process_group_rejects(changes: dict[str, str], subject: str) -> None:
    found = list(ddp_process_group_setup_invalid(job({**SRUN_TASK, **changes})))
    assert subjects(found) == [subject]
    assert found[0].evidence[0].observed == repr(changes[subject])


def test_rendezvous_values_python_parses_are_accepted() -> None:
    """torch.distributed's env:// handler parses RANK and WORLD_SIZE with int(), which takes a
    sign and surrounding blanks: such values are no setup error."""
    facts = job({**SRUN_TASK, "RANK": "+9", "WORLD_SIZE": " 16 ", "LOCAL_RANK": "1\n"})
    assert list(ddp_process_group_setup_invalid(facts)) == []


def test_loopback_master_is_fine_on_one_node() -> None:
    single = {**SRUN_TASK, "SLURM_JOB_NODELIST": "gpu001", "SLURM_JOB_NUM_NODES": "1", "SLURM_STEP_NUM_NODES": "1", "MASTER_ADDR": "localhost"}
    assert list(ddp_process_group_setup_invalid(job(single))) == []
    nodelist_only = {"SLURM_JOB_NODELIST": "gpu[001-004]", "MASTER_ADDR": "::1"}  # node count from the hostlist
    assert subjects(list(ddp_process_group_setup_invalid(job(nodelist_only)))) == ["MASTER_ADDR"]


def test_no_launch_variables_is_not_applicable_and_an_unreadable_environment_unknown() -> None:
    with pytest.raises(NotApplicable, match="sets none of"):
        list(ddp_process_group_setup_invalid(job({"SLURM_JOB_ID": "1", "SLURM_SCRIPT_CONTEXT": "prolog_slurmd"})))
    with pytest.raises(Unknown, match="unreadable"):  # missing is not empty: the variables may be set
        list(rank_to_gpu_mapping_wrong(JobFacts({}, "permission denied (EACCES); needs root", ())))


# -- TORCH010 -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "changes, expected",
    [
        ({"RANK": "16"}, ["RANK", "RANK"]),  # past WORLD_SIZE, and not SLURM_PROCID
        ({"RANK": "0"}, ["RANK"]),  # every task exported RANK=0
        ({"WORLD_SIZE": "8"}, ["RANK", "WORLD_SIZE"]),  # hand-exported world size
        ({"LOCAL_RANK": "9"}, ["LOCAL_RANK", "LOCAL_RANK"]),  # global rank used as local rank
        ({"LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "2"}, ["LOCAL_RANK", "LOCAL_RANK"]),
    ],
)
def test_ranks_that_contradict_each_other_or_slurm(changes: dict[str, str], expected: list[str]) -> None:
    assert sorted(subjects(list(rank_to_gpu_mapping_wrong(job({**SRUN_TASK, **changes}))))) == sorted(expected)


def test_outside_a_step_slurm_numbers_are_not_compared() -> None:
    batch = {key: value for key, value in SRUN_TASK.items() if key != "SLURM_STEP_ID"}
    assert list(rank_to_gpu_mapping_wrong(job({**batch, "RANK": "0", "SLURM_PROCID": "0"}))) == []
    # The batch script (SLURM_STEP_ID=-5 since Slurm 20.11) and an salloc shell (-6) export the
    # world size of a torchrun they start later, which no task count of theirs describes.
    for step in ("-5", "-6", "4294967291"):
        exported = {**batch, "SLURM_STEP_ID": step, "SLURM_NTASKS": "2", "WORLD_SIZE": "16", "RANK": "0", "SLURM_PROCID": "0"}
        assert list(rank_to_gpu_mapping_wrong(job(exported))) == [], step


def test_torchrun_once_per_node_is_absent_and_once_per_gpu_is_present() -> None:
    per_node = {**SRUN_TASK, "SLURM_NTASKS": "2", "SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "1", "SLURM_LOCALID": "0",
                "TORCHELASTIC_RUN_ID": "none", "GROUP_RANK": "1", "LOCAL_WORLD_SIZE": "8"}
    assert list(rank_to_gpu_mapping_wrong(job(per_node))) == []
    per_gpu = {**per_node, "SLURM_NTASKS": "16", "SLURM_STEP_NUM_TASKS": "16"}
    [finding] = rank_to_gpu_mapping_wrong(job(per_gpu))
    assert finding.subject == "launcher" and "16 tasks on 2 nodes" in finding.evidence[1].observed


# -- NCCL015 ------------------------------------------------------------------------------------
def test_nccl_algo_grammar() -> None:
    assert allreduce_algorithms("Tree") == {"tree"}
    assert allreduce_algorithms("ring,tree") == {"ring", "tree"}
    assert allreduce_algorithms("^ring") == {"tree", "collnetdirect", "collnetchain", "nvls", "nvlstree", "pat"}
    assert allreduce_algorithms("ring;allreduce:tree") == {"tree"}
    assert allreduce_algorithms("tree;broadcast:ring") == {"tree"}
    assert allreduce_algorithms("allreduce:^tree") == {"ring", "collnetdirect", "collnetchain", "nvls", "nvlstree", "pat"}
    assert allreduce_algorithms("ring;tree") is None  # a second entry without a prefix: NCCL refuses
    assert allreduce_algorithms("Tree,Bogus") is None


def test_forced_tree_is_a_warning_at_any_size() -> None:
    """No NCCL release note ties Tree to a hang at counts that are not a power of two (trees.cc
    builds its trees for any count), and forcing Tree is a tuning choice made for every node of a
    job or site alike: a 3-node job is warned, never drained."""
    three_nodes = {**SRUN_TASK, "SLURM_JOB_NUM_NODES": "3", "SLURM_STEP_NUM_NODES": "3", "WORLD_SIZE": "24"}
    [finding] = tree_algorithm_hang(job(three_nodes, conf="NCCL_ALGO=Tree"))
    assert finding.severity is Severity.WARNING and finding.evidence[0].source == "/etc/nccl.conf NCCL_ALGO"
    assert [e.observed for e in finding.evidence[1:]] == ["3 nodes", "24 ranks"]
    [finding] = tree_algorithm_hang(job({**SRUN_TASK, "NCCL_ALGO": "allreduce:tree"}))
    assert finding.severity is Severity.WARNING  # 2 nodes, 16 ranks


def test_tree_left_to_nccl_or_one_node_is_absent() -> None:
    with pytest.raises(NotApplicable, match="NCCL_ALGO not set"):
        list(tree_algorithm_hang(job(SRUN_TASK)))
    assert list(tree_algorithm_hang(job({**SRUN_TASK, "NCCL_ALGO": "Ring,Tree"}))) == []
    assert list(tree_algorithm_hang(job({**SRUN_TASK, "NCCL_ALGO": "tree;allreduce:ring"}))) == []
    assert list(tree_algorithm_hang(job({**SRUN_TASK, "NCCL_ALGO": "Tree;bogus"}))) == []  # NCCL rejects it at init
    one_node = {**SRUN_TASK, "SLURM_JOB_NUM_NODES": "1", "SLURM_STEP_NUM_NODES": "1", "NCCL_ALGO": "Tree"}
    assert list(tree_algorithm_hang(job(one_node))) == []


# -- the engine on recorded roots ---------------------------------------------------------------
def test_recorded_task_of_torchrun_per_gpu(tmp_path: Path, example_root: Path) -> None:
    root = tmp_path / "task"
    shutil.copytree(FIXTURES / "srun-torchrun-per-gpu", root, symlinks=True)
    ids = ("TORCH004", "TORCH010", "NCCL015")
    report = run(REGISTRY, Sources.for_fs(NodeFS(str(root))), HostConfig(), RunOptions(profile="prolog", select=ids), "test")
    assert {(f.reference_id, f.status.value, f.subject) for f in report.findings} == {
        ("TORCH004", "present", "MASTER_ADDR"), ("TORCH010", "present", "launcher"), ("NCCL015", "present", "NCCL_ALGO"),
    }
    nccl015 = next(f for f in report.findings if f.reference_id == "NCCL015")
    assert nccl015.evidence[0].source == "/home/alice/.nccl.conf NCCL_ALGO"
    prolog = run(REGISTRY, Sources.for_fs(NodeFS(str(example_root))), HostConfig(), RunOptions(profile="prolog", select=ids), "test")
    assert {(f.reference_id, f.status.value) for f in prolog.findings} == {
        ("TORCH004", "not_applicable"), ("TORCH010", "not_applicable"), ("NCCL015", "not_applicable"),
    }
