"""IB009's verbs user space: inside a job, libibverbs and the provider of each RDMA device's driver
must be where libibverbs and NCCL look for them (rdma-core's dynamic_driver.c, NCCL's
ibvsymbols.cc), or NCCL lists no IB device and runs over sockets. Run through the engine on copies
of the example node, whose eight ConnectX ports are healthy; the user space is added or removed
file by file."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from preflight.config import HostConfig
from preflight.discovery import build_registry
from preflight.engine import RunOptions, run
from preflight.model import Finding
from preflight.probes.verbs import parse_driver_lines
from preflight.snapshot import SnapshotArgs, take_snapshot
from preflight.sources import NodeFS, Sources
from preflight.sources.archive import opened_root

from conftest import write

REGISTRY = build_registry(plugins=False)
LIB = "/usr/lib/x86_64-linux-gnu"
JOB_STEP = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "HOME": "/root"}


def ib009(root: Path) -> list[Finding]:
    report = run(REGISTRY, Sources.for_fs(NodeFS(str(root))), HostConfig(), RunOptions(select=("IB009",)), "test")
    return [finding for finding in report.findings if finding.reference_id == "IB009"]


def environ(root: Path, values: dict[str, str]) -> None:
    write(root, "/proc/self/environ", b"".join(f"{k}={v}".encode() + b"\0" for k, v in values.items()))


def bind_drivers(root: Path, driver: str = "mlx5_core") -> None:
    """Give every PCI function of the example's RDMA devices the driver link real sysfs has."""
    for device in (root / "sys/class/infiniband").iterdir():
        function = (device / "device").resolve()
        link = function / "driver"
        if not link.is_symlink():
            os.symlink(f"../../bus/pci/drivers/{driver}", link)


def install_user_space(root: Path, providers: tuple[str, ...] = ("mlx5",), libibverbs: bool = True) -> None:
    if libibverbs:
        write(root, f"{LIB}/libibverbs.so.1", b"")
    for name in providers:
        write(root, f"/etc/libibverbs.d/{name}.driver", f"driver {name}\n")
        write(root, f"{LIB}/libibverbs/lib{name}-rdmav34.so", b"")


@pytest.fixture
def job_node(node_copy: Path) -> Path:
    environ(node_copy, JOB_STEP)
    bind_drivers(node_copy)
    return node_copy


def test_a_complete_user_space_is_absent(job_node: Path) -> None:
    install_user_space(job_node)
    assert [(f.status.value, f.subject) for f in ib009(job_node)] == [("absent", "node")]


def test_no_libibverbs_in_the_job_is_present(job_node: Path) -> None:
    [finding] = ib009(job_node)
    assert (finding.status.value, finding.subject, finding.severity.value) == ("present", "libibverbs", "error")
    assert f"no libibverbs.so.1 or libibverbs.so in {LIB}" in finding.evidence[0].observed


def test_a_task_in_a_job_steps_cgroup_is_judged_without_its_environment(node_copy: Path) -> None:
    """An Apptainer container started with --cleanenv (or --containall) empties the environment of
    the step's task, not its cgroup: the image's missing libibverbs is still found missing. The
    extern step (an ssh session pam_slurm_adopt put in the job) is no task of the job."""
    bind_drivers(node_copy)
    environ(node_copy, {"HOME": "/root"})
    write(node_copy, "/proc/self/cgroup", "0::/system.slice/slurmstepd.scope/job_4242/step_0/user/task_0\n")
    [finding] = ib009(node_copy)
    assert (finding.status.value, finding.subject) == ("present", "libibverbs")
    write(node_copy, "/proc/self/cgroup", "0::/system.slice/slurmstepd.scope/job_4242/step_extern/user/task_special\n")
    assert [(f.status.value, f.subject) for f in ib009(node_copy)] == [("absent", "node")]


@pytest.mark.parametrize(
    ("remove", "observed"),
    [
        ("/etc/libibverbs.d", "missing"),
        ("/etc/libibverbs.d/mlx5.driver", "no 'driver mlx5' line"),
        (f"{LIB}/libibverbs/libmlx5-rdmav34.so", "no libmlx5-rdmav*.so in <dir>/libibverbs or on the library path"),
    ],
)
def test_a_provider_the_devices_need_and_libibverbs_cannot_load_is_present(job_node: Path, remove: str, observed: str) -> None:
    install_user_space(job_node, providers=("mlx5", "efa"))
    target = job_node / remove.lstrip("/")
    if target.is_dir():
        for child in target.iterdir():
            child.unlink()
        target.rmdir()
    else:
        target.unlink()
    [finding] = ib009(job_node)
    assert (finding.status.value, finding.subject) == ("present", "mlx5 provider")
    assert finding.evidence[0].observed == observed
    assert finding.evidence[1].observed.startswith("mlx5_0, mlx5_1")


def test_rdmav_drivers_and_the_search_path_count_as_libibverbs_does(job_node: Path) -> None:
    install_user_space(job_node, providers=())
    write(job_node, f"{LIB}/libmlx5-rdmav2.so", b"")  # an old release's provider, on the search path
    environ(job_node, {**JOB_STEP, "RDMAV_DRIVERS": "mlx5"})
    assert [f.status.value for f in ib009(job_node)] == ["absent"]


def test_the_job_library_path_and_nccl_ibverbs_lib_are_looked_in(job_node: Path) -> None:
    write(job_node, "/opt/ofed/lib/libibverbs.so.1", b"")
    write(job_node, "/etc/libibverbs.d/mlx5.driver", "driver mlx5\n")
    write(job_node, "/opt/ofed/lib/libibverbs/libmlx5-rdmav34.so", b"")
    environ(job_node, {**JOB_STEP, "LD_LIBRARY_PATH": "/opt/ofed/lib"})
    assert [f.status.value for f in ib009(job_node)] == ["absent"]
    (job_node / "opt/ofed/lib/libibverbs.so.1").rename(job_node / "opt/ofed/verbs.so")
    environ(job_node, {**JOB_STEP, "LD_LIBRARY_PATH": "/opt/ofed/lib", "NCCL_IBVERBS_LIB": "/opt/ofed/verbs.so"})
    assert [f.status.value for f in ib009(job_node)] == ["absent"]


def test_an_rdma_core_installed_under_a_prefix_reads_its_own_config(job_node: Path) -> None:
    # conda-forge's rdma-core (and Spack's, or a module's) reads <prefix>/etc/libibverbs.d and keeps
    # its providers in <prefix>/lib/libibverbs; NCCL's conda build finds it by its RPATH.
    prefix = "/opt/conda/envs/train"
    write(job_node, f"{prefix}/lib/libibverbs.so.1", b"")
    write(job_node, f"{prefix}/lib/libibverbs/libmlx5-rdmav34.so", b"")
    environ(job_node, {**JOB_STEP, "CONDA_PREFIX": prefix})
    [finding] = ib009(job_node)
    assert (finding.status.value, finding.evidence[0].observed) == ("present", "missing")
    write(job_node, f"{prefix}/etc/libibverbs.d/mlx5.driver", "driver mlx5\n")
    assert [f.status.value for f in ib009(job_node)] == ["absent"]


@pytest.mark.parametrize(
    "rank",
    [{"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "16"}, {"MASTER_ADDR": "trainer-0", "RANK": "0", "WORLD_SIZE": "16"}],
    ids=["mpirun", "pytorchjob"],
)
def test_a_rank_started_without_slurm_is_judged_too(job_node: Path, rank: dict[str, str]) -> None:
    environ(job_node, {"HOME": "/root", **rank})
    [finding] = ib009(job_node)
    assert (finding.status.value, finding.subject) == ("present", "libibverbs")


@pytest.mark.parametrize("context", [{"SLURM_JOB_ID": "4242", "SLURM_SCRIPT_CONTEXT": "prolog_slurmd"}, {}])
def test_outside_the_job_the_host_user_space_is_not_judged(job_node: Path, context: dict[str, str]) -> None:
    # A prolog or an operator's shell reads the host's libraries; a containerised job loads its own.
    environ(job_node, context)
    assert [f.status.value for f in ib009(job_node)] == ["absent"]


def test_library_directories_not_captured_leave_it_unknown(job_node: Path) -> None:
    for path in sorted((job_node / "usr").rglob("*"), reverse=True):
        path.unlink() if not path.is_dir() or path.is_symlink() else path.rmdir()
    (job_node / "usr").rmdir()
    [finding] = ib009(job_node)
    assert (finding.status.value, finding.subject) == ("unknown", "libibverbs")
    assert "not captured" in finding.reason


def test_driver_lines_are_read_as_libibverbs_reads_them() -> None:
    text = "# rdma-core\ndriver mlx5\n\tdriver  efa extra\ndrivers mlx4\n#driver hns\n"
    assert parse_driver_lines(text) == ["mlx5", "efa"]


@pytest.mark.parametrize("complete", [True, False])
def test_a_snapshot_taken_in_the_job_replays_the_verdict(job_node: Path, tmp_path: Path, complete: bool) -> None:
    """What the probe reads (links, listings, presences) is recorded like any other read, so a
    snapshot taken inside the job judges its user space the same way anywhere."""
    install_user_space(job_node, libibverbs=complete)
    archive = tmp_path / "job.tar.gz"
    take_snapshot(SnapshotArgs(output=str(archive), root=str(job_node)))
    with opened_root(str(archive)) as (directory, _label):
        direct, again = ib009(job_node), ib009(Path(directory))
    assert [(f.status, f.subject, f.evidence) for f in again] == [(f.status, f.subject, f.evidence) for f in direct]
    assert [f.status.value for f in direct] == (["absent"] if complete else ["present"])


def test_an_unreadable_environment_leaves_a_missing_library_unknown(job_node: Path) -> None:
    # Without the environment, whether this is the job's process is unknown: nothing missing is
    # reported present, and nothing is cleared either.
    (job_node / "proc/self/environ").unlink()
    (job_node / "proc/self/environ").mkdir()
    statuses = {(f.status.value, f.subject) for f in ib009(job_node)}
    assert ("unknown", "libibverbs") in statuses and not any(status == "present" for status, _ in statuses)


def test_a_huge_library_path_is_read_only_in_part() -> None:
    from preflight.probes.job import MAX_LIBRARY_PATH_DIRS, library_path_dirs

    environ = {"LD_LIBRARY_PATH": ":".join(["relative/lib", *(f"/opt/lib{n}" for n in range(100_000)), "/opt/lib1"])}
    assert library_path_dirs(environ) == [f"/opt/lib{n}" for n in range(MAX_LIBRARY_PATH_DIRS)]


def _libibverbs(abi: int) -> bytes:
    """Bytes laid out as in rdma-core's libibverbs.so.1: an ELF header, then the dynamic string
    table with the private symbol version (Debian 12's libibverbs1 44.0 has IBVERBS_PRIVATE_34 at
    byte 15084 of its 133 KiB)."""
    return b"\x7fELF\x02\x01\x01" + b"\0" * 200 + b"ibv_get_device_list\0IBVERBS_1.1\0" + f"IBVERBS_PRIVATE_{abi}".encode() + b"\0libc.so.6\0"


def test_a_provider_of_another_rdma_core_is_never_loaded(job_node: Path) -> None:
    """libibverbs opens lib<name>-rdmav<its ABI>.so only: a provider left from another rdma-core
    (a MOFED install, a bind mount from the host) is on disk and unused."""
    install_user_space(job_node)  # libmlx5-rdmav34.so
    write(job_node, f"{LIB}/libibverbs.so.1", _libibverbs(57))
    [finding] = ib009(job_node)
    assert (finding.status.value, finding.subject) == ("present", "mlx5 provider")
    assert finding.evidence[0].observed == "loads providers of ABI 57 (IBVERBS_PRIVATE_57); found only libmlx5-rdmav34.so"
    write(job_node, f"{LIB}/libibverbs/libmlx5-rdmav57.so", b"")
    assert [f.status.value for f in ib009(job_node)] == ["absent"]


def test_a_matching_or_unreadable_provider_abi_is_no_finding(job_node: Path) -> None:
    install_user_space(job_node)
    write(job_node, f"{LIB}/libibverbs.so.1", _libibverbs(34))
    assert [f.status.value for f in ib009(job_node)] == ["absent"]
    # a library that names no ABI (a stub, a stripped copy) leaves any provider ABI acceptable
    write(job_node, f"{LIB}/libibverbs.so.1", b"\x7fELF not a real library")
    assert [f.status.value for f in ib009(job_node)] == ["absent"]


def test_a_snapshot_keeps_the_provider_abi_it_read(job_node: Path, tmp_path: Path) -> None:
    """The library bytes the ABI is read from travel in the snapshot like any other read, so a
    mismatched provider is found again on replay, scrubbed or not."""
    install_user_space(job_node)
    write(job_node, f"{LIB}/libibverbs.so.1", _libibverbs(57))
    for scrub in ((), ("hostnames", "addresses")):
        archive = tmp_path / f"job{len(scrub)}.tar.gz"
        take_snapshot(SnapshotArgs(output=str(archive), root=str(job_node), scrub=scrub))
        with opened_root(str(archive)) as (directory, _label):
            [finding] = ib009(Path(directory))
        assert (finding.status.value, finding.subject) == ("present", "mlx5 provider"), scrub
