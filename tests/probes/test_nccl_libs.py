"""NCCL016 and NCCL012: the NCCL builds a job on this node can load, on copies of the example
node with libraries laid out as Debian packages and the nvidia-nccl-cu12 wheel install them."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from preflight.probes.job import probe_job
from preflight.checks.nccl import nccl_library_conflict, nccl_ras_query_crash
from preflight.probes.nccl_libs import probe_nccl_libs
from preflight.model import NotApplicable, Severity
from preflight.sources import NodeFS

from conftest import bare_node, write

SITE = "/usr/local/lib/python3.10/dist-packages"


def verdicts(root: Path, check: str) -> list[tuple[str, str]]:
    fs = NodeFS(str(root))
    function = {"NCCL016": nccl_library_conflict, "NCCL012": nccl_ras_query_crash}[check]
    return [(o.subject, " ".join(e.observed for e in o.evidence)) for o in function(probe_nccl_libs(fs), probe_job(fs))]


def environ(root: Path, **values: str) -> None:
    write(root, "/proc/self/environ", b"".join(f"{k}={v}".encode() + b"\0" for k, v in values.items()))


def test_one_release_everywhere_is_absent(example_root: Path) -> None:
    assert verdicts(example_root, "NCCL016") == [] and verdicts(example_root, "NCCL012") == []


def test_job_search_path_ahead_of_the_wheel_is_present(node_copy: Path) -> None:
    write(node_copy, "/opt/nccl-2.18.3/lib/libnccl.so.2.18.3", b"")
    write(node_copy, "/etc/ld.so.conf.d/nccl.conf", "# site NCCL build\n/opt/nccl-2.18.3/lib\n")
    environ(node_copy, LD_LIBRARY_PATH="/opt/nccl-2.18.3/lib/:/usr/local/cuda/lib64")
    found = dict(verdicts(node_copy, "NCCL016"))
    assert "/opt/nccl-2.18.3/lib/libnccl.so.2.18.3 (NCCL 2.18.3)" in found["job environment"]
    assert "2 versions: 2.18.3, 2.21.5" in found["library path"]
    # Two releases in the system directories are a hazard, not a conflict in one process; and pip's
    # torch finds its wheel through its RPATH before LD_LIBRARY_PATH (ld.so(8)): a warning too.
    assert severities(node_copy) == {"job environment": Severity.WARNING, "library path": Severity.WARNING}


def severities(root: Path) -> dict[str, Severity | None]:
    fs = NodeFS(str(root))
    return {o.subject: o.severity for o in nccl_library_conflict(probe_nccl_libs(fs), probe_job(fs))}


@pytest.mark.parametrize(("release", "severity"), [("2.18.3", None), ("2.27.3", Severity.WARNING)])
def test_a_preloaded_copy_is_an_error_only_when_older_than_the_wheel(node_copy: Path, release: str, severity: Severity | None) -> None:
    """LD_PRELOAD puts its copy under the framework: an older one lacks symbols the framework's
    NCCL calls (import fails), a newer one keeps the 2.x ABI and is how the reference upgrades."""
    write(node_copy, f"/opt/nccl/lib/libnccl.so.{release}", b"")
    environ(node_copy, LD_PRELOAD=f"/opt/nccl/lib/libnccl.so.{release}")
    found = dict(verdicts(node_copy, "NCCL016"))
    assert found["job environment"] == f"/opt/nccl/lib/libnccl.so.{release} (NCCL {release})"
    assert severities(node_copy)["job environment"] is severity


def test_a_dangling_so2_link_is_no_copy(node_copy: Path) -> None:
    """A libnccl.so.2 link left behind by a removed package loads nothing."""
    system = node_copy / "usr/lib/x86_64-linux-gnu"
    (system / "libnccl.so.2.21.5").unlink()
    write(node_copy, "/opt/nccl/lib/libnccl.so.2.23.4", b"")
    os.symlink("libnccl.so.2.23.4", node_copy / "opt/nccl/lib/libnccl.so.2")
    facts = probe_nccl_libs(NodeFS(str(node_copy)))
    assert not any(c.path.startswith("/usr/lib/x86_64-linux-gnu/") for c in facts.copies), facts.copies
    assert "library path" not in dict(verdicts(node_copy, "NCCL016"))  # one system version, not "2.21.5, 2.23.4"


def test_the_wheel_in_the_jobs_virtualenv_is_the_frameworks(node_copy: Path) -> None:
    """A job whose venv ships NCCL 2.26.2, with the system's 2.21.5 on its LD_LIBRARY_PATH, loads
    two builds: the venv's wheel is found through $VIRTUAL_ENV, and it is the one compared (the
    system Python's 2.21.5 wheel is not the job's)."""
    venv = "/home/alice/venvs/train/lib/python3.11/site-packages"
    write(node_copy, f"{venv}/nvidia/nccl/lib/libnccl.so.2", b"")
    (node_copy / venv.lstrip("/") / "nvidia_nccl_cu12-2.26.2.dist-info").mkdir()
    environ(node_copy, VIRTUAL_ENV="/home/alice/venvs/train", LD_LIBRARY_PATH="/usr/lib/x86_64-linux-gnu")
    facts = probe_nccl_libs(NodeFS(str(node_copy)))
    assert (f"{venv}/nvidia/nccl/lib/libnccl.so.2", "2.26.2", "python") in {(c.path, c.version, c.origin) for c in facts.copies}
    found = dict(verdicts(node_copy, "NCCL016"))
    assert "/usr/lib/x86_64-linux-gnu/libnccl.so.2.21.5 (NCCL 2.21.5)" in found["job environment"]
    environ(node_copy, LD_LIBRARY_PATH="/usr/lib/x86_64-linux-gnu")  # no venv: the system wheel agrees
    assert verdicts(node_copy, "NCCL016") == []


def test_rhel_system_python_keeps_compiled_wheels_in_lib64(tmp_path: Path) -> None:
    """On RHEL and Fedora, pip (as root) puts compiled wheels in /usr/local/lib64/python3.X/
    site-packages (sysconfig's platlib): the wheel's NCCL and torch there are the system Python's."""
    root = bare_node(tmp_path / "node")
    site = "/usr/local/lib64/python3.9/site-packages"
    write(root, f"{site}/nvidia/nccl/lib/libnccl.so.2", b"")
    (root / site.lstrip("/") / "nvidia_nccl_cu12-2.21.5.dist-info").mkdir()
    facts = probe_nccl_libs(NodeFS(str(root)))
    assert (f"{site}/nvidia/nccl/lib/libnccl.so.2", "2.21.5", "python") in {(c.path, c.version, c.origin) for c in facts.copies}


def test_two_nccl_wheels_in_one_environment_are_present(node_copy: Path) -> None:
    """nvidia-nccl-cu11 and -cu12 (or two -cu12 releases' metadata) both own
    nvidia/nccl/lib/libnccl.so.2: whichever was installed last is what the framework loads."""
    (node_copy / SITE.lstrip("/") / "nvidia_nccl_cu11-2.21.5.dist-info").mkdir()
    facts = probe_nccl_libs(NodeFS(str(node_copy)))
    wheel = next(c for c in facts.copies if c.origin == "python")
    assert wheel.wheels == ("nvidia_nccl_cu11-2.21.5", "nvidia_nccl_cu12-2.21.5") and wheel.version == "2.21.5"
    found = dict(verdicts(node_copy, "NCCL016"))
    assert "2 NCCL wheels: nvidia_nccl_cu11-2.21.5, nvidia_nccl_cu12-2.21.5" in found[SITE]
    os.rename(node_copy / SITE.lstrip("/") / "nvidia_nccl_cu11-2.21.5.dist-info", node_copy / SITE.lstrip("/") / "nvidia_nccl_cu12-2.26.2.dist-info")
    wheel = next(c for c in probe_nccl_libs(NodeFS(str(node_copy))).copies if c.origin == "python")
    assert wheel.version is None  # two releases: the file's own is not named
    assert "2 NCCL wheels: nvidia_nccl_cu12-2.21.5, nvidia_nccl_cu12-2.26.2" in dict(verdicts(node_copy, "NCCL016"))[SITE]
    for n in range(20):  # a recorded root with many: the report keeps a few and says so
        (node_copy / SITE.lstrip("/") / f"nvidia_nccl_cu12-2.{n}.1.dist-info").mkdir()
    wheel = next(c for c in probe_nccl_libs(NodeFS(str(node_copy))).copies if c.origin == "python")
    assert len(wheel.wheels) == 8 and "8 or more NCCL wheels" in dict(verdicts(node_copy, "NCCL016"))[SITE]


def test_ras_crash_release_unless_ras_is_off(node_copy: Path) -> None:
    wheel = node_copy / SITE.lstrip("/")
    os.rename(wheel / "nvidia_nccl_cu12-2.21.5.dist-info", wheel / "nvidia_nccl_cu12-2.27.3.dist-info")
    found = verdicts(node_copy, "NCCL012")
    assert [subject for subject, _ in found] == [f"{SITE}/nvidia/nccl/lib/libnccl.so.2"]
    assert "NCCL 2.27.3" in found[0][1] and "unset (RAS on by default)" in found[0][1]
    (observation,) = nccl_ras_query_crash(probe_nccl_libs(NodeFS(str(node_copy))), probe_job(NodeFS(str(node_copy))))
    assert observation.severity is Severity.WARNING and "localhost:28028" in observation.fix  # a query crashes it
    environ(node_copy, NCCL_RAS_ENABLE="0")
    assert verdicts(node_copy, "NCCL012") == []


def test_version_from_the_so2_link_and_unknown_versions(tmp_path: Path) -> None:
    write(tmp_path, "/usr/local/lib/libnccl.so.2.26.2", b"")
    os.symlink("libnccl.so.2.26.2", tmp_path / "usr/local/lib/libnccl.so.2")
    write(tmp_path, "/usr/lib64/libnccl.so.2", b"")  # a plain file: no version in its name
    facts = probe_nccl_libs(NodeFS(str(tmp_path)))
    assert {(c.path, c.version) for c in facts.copies} == {("/usr/local/lib/libnccl.so.2.26.2", "2.26.2"), ("/usr/lib64/libnccl.so.2", None)}


def test_not_applicable_without_nccl(tmp_path: Path) -> None:
    with pytest.raises(NotApplicable):
        verdicts(bare_node(tmp_path), "NCCL016")


def test_left_over_versioned_files_are_no_second_system_version(node_copy: Path) -> None:
    """An old versioned file beside the libnccl.so.2 link of the installed release is loaded by
    nothing (ld.so asks for libnccl.so.2): one version on the library path, not two."""
    write(node_copy, "/usr/lib/x86_64-linux-gnu/libnccl.so.2.18.3", b"")
    assert "library path" not in dict(verdicts(node_copy, "NCCL016"))


def test_a_copy_only_the_jobs_library_path_reaches_is_judged(tmp_path: Path) -> None:
    """Cloud images put NCCL where only the job's LD_LIBRARY_PATH reaches it (Google's A3 puts
    /var/lib/tcpx/lib64 first, AWS's Deep Learning AMI /usr/local/cuda-12.4/lib): its release bugs
    are the job's, not "no libnccl on this node"."""
    root = bare_node(tmp_path)
    write(root, "/var/lib/tcpx/lib64/libnccl.so.2.27.3", b"")
    os.symlink("libnccl.so.2.27.3", root / "var/lib/tcpx/lib64/libnccl.so.2")
    with pytest.raises(NotApplicable):  # without the job's environment nothing points there
        verdicts(root, "NCCL012")
    environ(root, LD_LIBRARY_PATH="/var/lib/tcpx/lib64/:relative/lib:/usr/local/nvidia/lib64")
    facts = probe_nccl_libs(NodeFS(str(root)))
    assert [(c.path, c.version, c.origin) for c in facts.copies] == [("/var/lib/tcpx/lib64/libnccl.so.2.27.3", "2.27.3", "job")]
    assert [subject for subject, _ in verdicts(root, "NCCL012")] == ["/var/lib/tcpx/lib64/libnccl.so.2.27.3"]


def test_a_copy_on_the_jobs_library_path_shadows_the_systems(tmp_path: Path) -> None:
    """Google's A3 Ultra script puts gIB's own libnccl.so.2 first on LD_LIBRARY_PATH inside an NGC
    container whose system NCCL is older: the loader takes the job's copy before the system's
    directories, so the system copy's release bugs are information, the job copy's stay."""
    root = bare_node(tmp_path)
    write(root, "/usr/lib/x86_64-linux-gnu/libnccl.so.2.22.3", b"")
    os.symlink("libnccl.so.2.22.3", root / "usr/lib/x86_64-linux-gnu/libnccl.so.2")
    write(root, "/usr/local/gib/lib64/libnccl.so.2.27.7", b"")
    os.symlink("libnccl.so.2.27.7", root / "usr/local/gib/lib64/libnccl.so.2")
    facts = probe_nccl_libs(NodeFS(str(root)))
    assert [(c.origin, c.bypassed) for c in facts.copies] == [("system", "")]  # no job environment: the system's is loaded
    (root / "usr/local/gib/lib64/libnccl.so.2").unlink()  # a versioned file alone is not what DT_NEEDED finds
    environ(root, LD_LIBRARY_PATH="/usr/local/gib/lib64:/usr/local/nvidia/lib64")
    assert {c.origin: c.bypassed for c in probe_nccl_libs(NodeFS(str(root))).copies}["system"] == ""
    os.symlink("libnccl.so.2.27.7", root / "usr/local/gib/lib64/libnccl.so.2")
    copies = {c.origin: c for c in probe_nccl_libs(NodeFS(str(root))).copies}
    assert "/usr/local/gib/lib64/libnccl.so.2.27.7 first" in copies["system"].bypassed and copies["job"].bypassed == ""
    from preflight.nccl.releases import KnownBug, release_findings
    from preflight.model import Severity

    bug = KnownBug("SOCK002", "2.22.0", "2.23.4", "a bug of 2.22")
    found = {o.subject: o.severity for o in release_findings(probe_nccl_libs(NodeFS(str(root))), bug)}
    assert found == {"/usr/lib/x86_64-linux-gnu/libnccl.so.2.22.3": Severity.INFO}


def test_a_preloaded_copy_outside_the_library_path_is_found(tmp_path: Path) -> None:
    """LD_PRELOAD may name a libnccl anywhere, through a link whose target names the release."""
    root = bare_node(tmp_path)
    write(root, "/scratch/nccl/build/lib/libnccl.so.2.27.3", b"")
    os.symlink("libnccl.so.2.27.3", root / "scratch/nccl/build/lib/libnccl.so.2")
    environ(root, LD_PRELOAD="/scratch/nccl/build/lib/libnccl.so.2 /lib/libfoo.so", LD_LIBRARY_PATH="/../../../etc")
    facts = probe_nccl_libs(NodeFS(str(root)))
    assert [(c.path, c.version, c.origin) for c in facts.copies] == [("/scratch/nccl/build/lib/libnccl.so.2", "2.27.3", "job")]


def test_a_conda_environments_own_nccl_is_found(tmp_path: Path) -> None:
    """conda-forge's nccl installs into <prefix>/lib and its pytorch finds it by RPATH, with no
    LD_LIBRARY_PATH: the copy of the job's environment (and of /opt/conda) is found; a lib/
    directory of something that is no conda environment (no conda-meta) is not searched."""
    env = "/home/alice/miniforge3/envs/train"
    write(tmp_path, f"{env}/conda-meta/nccl-2.23.4-h03a54cd_3.json", "{}")
    write(tmp_path, f"{env}/lib/libnccl.so.2.23.4", b"")
    os.symlink("libnccl.so.2.23.4", tmp_path / env.lstrip("/") / "lib/libnccl.so.2")
    write(tmp_path, "/opt/conda/lib/libnccl.so.2.21.5", b"")  # no conda-meta: not an environment
    environ(tmp_path, CONDA_PREFIX=env)
    copies = probe_nccl_libs(NodeFS(str(tmp_path))).copies
    assert [(copy.path, copy.version, copy.origin) for copy in copies] == [(f"{env}/lib/libnccl.so.2.23.4", "2.23.4", "conda")]


def test_network_plugins_in_the_loaders_order(node_copy: Path) -> None:
    """HPC-X puts the nccl-rdma-sharp plugin on the job's LD_LIBRARY_PATH (hpcx-init.sh); a
    system-wide one is in the loader's own directories: the job's come first, as ld.so finds them."""
    write(node_copy, "/opt/hpcx/nccl_rdma_sharp_plugin/lib/libnccl-net.so.0.0.0", b"")
    write(node_copy, "/opt/hpcx/nccl_rdma_sharp_plugin/lib/libnccl-net.so", b"")
    write(node_copy, "/usr/lib/x86_64-linux-gnu/libnccl-net-ofi.so", b"")
    environ(node_copy, LD_LIBRARY_PATH="/opt/hpcx/nccl_rdma_sharp_plugin/lib")
    plugins = probe_nccl_libs(NodeFS(str(node_copy))).net_plugins
    assert plugins == (
        "/opt/hpcx/nccl_rdma_sharp_plugin/lib/libnccl-net.so",
        "/opt/hpcx/nccl_rdma_sharp_plugin/lib/libnccl-net.so.0.0.0",
        "/usr/lib/x86_64-linux-gnu/libnccl-net-ofi.so",
    )
    assert not any(copy.path.endswith("libnccl-net.so") for copy in probe_nccl_libs(NodeFS(str(node_copy))).copies)


def test_the_python_first_on_path_is_the_jobs_environment(node_copy: Path) -> None:
    """Ray's images run /home/ray/anaconda3's python from PATH without activating it (no
    VIRTUAL_ENV or CONDA_PREFIX): its NCCL wheel and frameworks are found there."""
    from preflight.probes.frameworks import probe_frameworks

    site = "/home/ray/anaconda3/lib/python3.11/site-packages"
    write(node_copy, "/home/ray/anaconda3/bin/python3", b"")
    write(node_copy, f"{site}/nvidia/nccl/lib/libnccl.so.2", b"")
    (node_copy / site.lstrip("/") / "nvidia_nccl_cu12-2.26.2.dist-info").mkdir()
    (node_copy / site.lstrip("/") / "vllm-0.9.1.dist-info").mkdir()
    environ(node_copy, PATH="/home/ray/anaconda3/bin:/usr/local/sbin:/usr/bin")
    fs = NodeFS(str(node_copy))
    assert (f"{site}/nvidia/nccl/lib/libnccl.so.2", "2.26.2") in {(c.path, c.version) for c in probe_nccl_libs(fs).copies}
    assert site in probe_frameworks(fs).site_dirs
    environ(node_copy, PATH="/usr/local/sbin:/usr/bin:/home/ray/anaconda3/bin")  # another python first: not the job's
    write(node_copy, "/usr/bin/python3", b"")
    assert site not in probe_frameworks(NodeFS(str(node_copy))).site_dirs


def test_a_path_entry_that_cannot_be_looked_in_decides_nothing(node_copy: Path) -> None:
    """A PATH directory behind a link the capture did not follow is passed over, as the shell's
    lookup would pass it: it leaves no problem that would make the frameworks unknown."""
    from preflight.probes.frameworks import probe_frameworks

    (node_copy / "cm/shared/apps/slurm").mkdir(parents=True)
    (node_copy / "cm/shared/apps/slurm/current").symlink_to("/cm/shared/apps/slurm/25.05.2")
    environ(node_copy, PATH="/cm/shared/apps/slurm/current/bin:/usr/bin")
    fs = NodeFS(str(node_copy))
    assert probe_frameworks(fs).problems == () and probe_nccl_libs(fs).problems == ()
