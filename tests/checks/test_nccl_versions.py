"""Known-buggy NCCL releases (NVL005, SOCK002, NCCL018, NCCL013, NVL002, TOPO003, and GDR001's
release rule), run through the engine on the recorded roots of build_nccl_env_nodes.py and on
copies of the example node: each present where the node makes the bug reachable, absent where the
release is fixed or the trigger is missing, unknown where a fact could not be read."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from preflight.nccl.releases import KNOWN_BUGS, carries, version_tuple
from preflight.probes.nccl_libs import probe_nccl_libs
from preflight.probes.nccl_platform import parse_stack_limit
from preflight.slurm_conf import propagated, read_slurm_conf
from preflight.config import Expectations, HostConfig
from preflight.model import Severity
from preflight.discovery import build_registry
from preflight.engine import RunOptions, run
from preflight.sources import NodeFS, Sources
from preflight.units import UNLIMITED

from conftest import bare_node, upgrade_nccl, write

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "nodes"
REGISTRY = build_registry(plugins=False)
SITE = "/usr/local/lib/python3.10/dist-packages"
SYSTEM_COPY = "/usr/lib/x86_64-linux-gnu/libnccl.so.2.21.5"
WHEEL_COPY = f"{SITE}/nvidia/nccl/lib/libnccl.so.2"


def judge(root: Path, *ids: str, profile: str = "full") -> dict[str, set[tuple[str, str]]]:
    """ID -> {(status, subject)} from a real engine run on ``root``."""
    report = run(REGISTRY, Sources.for_fs(NodeFS(str(root))), HostConfig(), RunOptions(profile=profile, select=ids), "test")
    found: dict[str, set[tuple[str, str]]] = {ref_id: set() for ref_id in ids}
    for finding in report.findings:
        found[finding.reference_id].add((finding.status.value, finding.subject))
    return found


def findings(root: Path, ref_id: str) -> list[dict[str, object]]:
    report = run(REGISTRY, Sources.for_fs(NodeFS(str(root))), HostConfig(), RunOptions(select=(ref_id,)), "test")
    return [finding.to_json() for finding in report.findings]


def fixture(name: str, tmp_path: Path) -> Path:
    target = tmp_path / name
    shutil.copytree(FIXTURES / name, target, symlinks=True)
    return target


def environ(root: Path, **values: str) -> None:
    write(root, "/proc/self/environ", b"".join(f"{k}={v}".encode() + b"\0" for k, v in values.items()))


def set_stack(root: Path, soft: str) -> None:
    limits = root / "proc/self/limits"
    lines = [f"{'Max stack size':<25} {soft:<20} {'unlimited':<20} {'bytes':<10} " if line.startswith("Max stack size") else line
             for line in limits.read_text().splitlines()]
    limits.write_text("\n".join(lines) + "\n")


# -- the table ----------------------------------------------------------------------------------
def test_release_ranges_are_half_open_and_ordered() -> None:
    for bug in KNOWN_BUGS:
        first, fixed = version_tuple(bug.first), version_tuple(bug.fixed)
        assert first is not None and fixed is not None and first < fixed, bug
        assert not carries(bug, bug.fixed) and (bug.first == "0" or carries(bug, bug.first)), bug
    socket = next(bug for bug in KNOWN_BUGS if bug.reference_id == "SOCK002")
    assert carries(socket, "2.23.4") and not carries(socket, "2.24.3") and not carries(socket, "2.16.1")
    assert not carries(socket, "2.21.5+cuda12.4") and version_tuple("2.x") is None


def test_parsers_on_kernel_and_nvml_formats() -> None:
    limits = "Limit                     Soft Limit           Hard Limit           Units     \nMax stack size            8388608              unlimited            bytes     \n"
    assert parse_stack_limit(limits) == 8388608
    assert parse_stack_limit(limits.replace("8388608   ", "unlimited ")) == UNLIMITED
    assert parse_stack_limit("Max stack size            lots                 unlimited            bytes\n") is None
    def stack(text: str) -> tuple[bool | None, str]:
        conf = read_slurm_conf({"/etc/slurm/slurm.conf": text}.get, "/etc/slurm/slurm.conf")
        assert conf is not None
        return propagated(conf, "STACK")

    assert stack("ClusterName=x\n")[0] is True
    assert stack("PropagateResourceLimitsExcept=MEMLOCK,STACK\n") == (False, "PropagateResourceLimitsExcept=MEMLOCK,STACK")
    assert stack("PropagateResourceLimits=NONE # site\n")[0] is False
    assert stack("PropagateResourceLimits=CORE,STACK\n")[0] is True


# -- SOCK002 ------------------------------------------------------------------------------------
def test_connect_retry_release_on_the_example_and_fixed_after_upgrade(example_root: Path, node_copy: Path) -> None:
    assert judge(example_root, "SOCK002")["SOCK002"] == {("present", SYSTEM_COPY), ("present", WHEEL_COPY)}
    upgrade_nccl(node_copy, "2.21.5", "2.24.3")
    assert judge(node_copy, "SOCK002")["SOCK002"] == {("absent", "node")}


def test_unnamed_release_is_unknown_and_no_nccl_is_not_applicable(node_copy: Path, tmp_path: Path) -> None:
    shutil.rmtree(node_copy / SITE.lstrip("/") / "nvidia_nccl_cu12-2.21.5.dist-info")  # the wheel's version is gone
    assert judge(node_copy, "SOCK002")["SOCK002"] == {("present", SYSTEM_COPY), ("unknown", WHEEL_COPY)}
    assert judge(bare_node(tmp_path / "bare"), "SOCK002")["SOCK002"] == {("not_applicable", "node")}


def test_unreadable_library_directory_without_any_copy_is_unknown(tmp_path: Path) -> None:
    root = bare_node(tmp_path / "node")
    write(root, "/usr/lib64/libc.so.6", b"")
    (root / "usr/lib").mkdir(parents=True, exist_ok=True)
    os.symlink("x86_64-linux-gnu", root / "usr/lib/x86_64-linux-gnu")  # present, but a link loop: ELOOP
    found = findings(root, "SOCK002")
    assert [(f["status"], f["subject"]) for f in found] == [("unknown", "node")]
    assert "no libnccl found" in str(found[0]["reason"]) and "ELOOP" in str(found[0]["reason"])


# -- files no loader picks ------------------------------------------------------------------------
def test_a_versioned_file_no_link_reaches_is_not_judged(node_copy: Path) -> None:
    """Old versioned files left beside the libnccl.so.2 link, which points to a fixed release: a
    program asks ld.so for libnccl.so.2, so none of them loads and no release bug of theirs bites."""
    upgrade_nccl(node_copy, "2.21.5", "2.28.3")
    system = node_copy / "usr/lib/x86_64-linux-gnu"
    for stale in ("2.18.3", "2.21.5", "2.26.2", "2.27.3"):  # TOPO003, SOCK002 and NCCL018, NCCL013, NCCL012
        write(system, f"/libnccl.so.{stale}", b"")
    environ(node_copy, TORCH_NCCL_USE_COMM_NONBLOCKING="1")
    ids = ("TOPO003", "SOCK002", "NCCL018", "NCCL013", "NCCL012")
    assert judge(node_copy, *ids) == {ref_id: {("absent", "node")} for ref_id in ids}
    facts = probe_nccl_libs(NodeFS(str(node_copy)))
    unreached = {c.path.rsplit("/", 1)[-1]: c.unreached for c in facts.copies if c.origin == "system"}
    assert unreached["libnccl.so.2.21.5"] == "libnccl.so.2 links to libnccl.so.2.28.3" and unreached["libnccl.so.2.28.3"] == ""
    # Without a link that reaches one of them, nothing says which file loads: all are judged.
    (system / "libnccl.so.2").unlink()
    assert ("present", "/usr/lib/x86_64-linux-gnu/libnccl.so.2.21.5") in judge(node_copy, "SOCK002")["SOCK002"]


# -- NVL005 -------------------------------------------------------------------------------------
def test_nvls_with_both_ports_of_dual_port_nics(tmp_path: Path) -> None:
    root = fixture("h800-dual-port", tmp_path)
    [finding] = findings(root, "NVL005")
    assert finding["status"] == "present" and finding["subject"] == "/usr/lib/x86_64-linux-gnu/libnccl.so.2.19.3"
    assert "adapter 0000:1a:00: mlx5_0/1, mlx5_1/1" in json.dumps(finding["evidence"])
    environ(root, NCCL_IB_HCA="=mlx5_0,mlx5_2")  # one port per adapter
    assert judge(root, "NVL005")["NVL005"] == {("absent", "node")}
    environ(root, NCCL_NVLS_ENABLE="0")
    assert judge(root, "NVL005")["NVL005"] == {("absent", "node")}


def test_nvls_dual_port_where_the_jobs_choice_of_ports_is_unseen(tmp_path: Path) -> None:
    """A health check sees neither the job's NCCL_IB_HCA nor whether the dual-port adapter is a
    storage NIC the jobs leave out: a warning saying how to name the rails, never a drain.
    /etc/nccl.conf, which it does see, or the site's expect.hcas decide again."""
    root = fixture("h800-dual-port", tmp_path)
    environ(root, HOME="/root")
    [finding] = findings(root, "NVL005")
    assert (finding["status"], finding["severity"]) == ("present", "warning") and "NCCL_IB_HCA in /etc/nccl.conf" in str(finding["fix"])
    write(root, "/etc/nccl.conf", "NCCL_IB_HCA=mlx5\n")  # every port: both of the adapter's
    [finding] = findings(root, "NVL005")
    assert (finding["status"], finding["severity"]) == ("present", "critical")
    write(root, "/etc/nccl.conf", "# no NCCL_IB_HCA\n")
    sources = Sources.for_fs(NodeFS(str(root)))
    config = HostConfig(expect=Expectations(hcas=("mlx5_0", "mlx5_2")))  # one port per adapter
    report = run(REGISTRY, sources, config, RunOptions(select=("NVL005",)), "test")
    assert [(f.status.value, f.subject) for f in report.findings] == [("absent", "node")]


def test_nvls_dual_port_fixed_release_single_port_nics_and_no_nvswitch(tmp_path: Path, node_copy: Path) -> None:
    root = fixture("h800-dual-port", tmp_path)
    os.rename(root / "usr/lib/x86_64-linux-gnu/libnccl.so.2.19.3", root / "usr/lib/x86_64-linux-gnu/libnccl.so.2.20.3")
    assert judge(root, "NVL005")["NVL005"] == {("absent", "node")}
    upgrade_nccl(node_copy, "2.21.5", "2.19.3")  # NVSwitches, but one single-port HCA per GPU
    assert judge(node_copy, "NVL005")["NVL005"] == {("absent", "node")}
    assert judge(fixture("vm-no-link-speed", tmp_path), "NVL005")["NVL005"] == {("not_applicable", "node")}


def set_capability(root: Path, capability: list[int] | None) -> None:
    """Record every GPU's nvmlDeviceGetCudaComputeCapability answer (None: the call failed)."""
    nvml = json.loads((root / ".preflight/nvml.json").read_text())
    count = nvml["calls"]["nvmlDeviceGetCount"]["result"]
    answer = {"result": capability} if capability is not None else {"error": "NVML_ERROR_UNKNOWN"}
    nvml["calls"]["nvmlDeviceGetCudaComputeCapability"] = {str(index): answer for index in range(count)}
    write(root, "/.preflight/nvml.json", json.dumps(nvml))


def test_nvls_bugs_need_hopper_gpus(tmp_path: Path, node_copy: Path) -> None:
    """A100 boards have NVSwitches (gen 2, PCI functions like Hopper's), but NCCL never builds
    NVLS below compute capability 9.0: neither NVLS bug can bite there. A capability that could
    not be read rules nothing out."""
    root = fixture("h800-dual-port", tmp_path)
    set_capability(root, [8, 0])
    [finding] = findings(root, "NVL005")
    assert finding["status"] == "not_applicable" and "compute capability is 8.0" in str(finding["reason"])
    set_capability(root, None)
    assert {status for status, _ in judge(root, "NVL005")["NVL005"]} == {"present"}
    set_capability(root, [9, 0])
    assert {status for status, _ in judge(root, "NVL005")["NVL005"]} == {"present"}
    upgrade_nccl(node_copy, "2.21.5", "2.18.3")  # NVSwitches and eight HCAs: the NVLS search crash
    set_capability(node_copy, [8, 0])
    assert judge(node_copy, "TOPO003")["TOPO003"] == {("absent", "node")}
    set_capability(node_copy, [9, 0])
    assert {status for status, _ in judge(node_copy, "TOPO003")["TOPO003"]} == {"present"}


def test_nvls_dual_port_unknown_port_state(tmp_path: Path) -> None:
    root = fixture("h800-dual-port", tmp_path)
    state = next(root.glob("sys/devices/**/infiniband/mlx5_1/ports/1/state"))
    state.write_text("garbage\n")
    [finding] = findings(root, "NVL005")
    assert finding["status"] == "unknown" and "mlx5_1/ports/1/state" in str(finding["reason"])


# -- NCCL013 ------------------------------------------------------------------------------------
def test_ras_init_race_releases_unless_ras_is_off(node_copy: Path) -> None:
    assert judge(node_copy, "NCCL013")["NCCL013"] == {("absent", "node")}  # 2.21.5 has no RAS
    upgrade_nccl(node_copy, "2.21.5", "2.26.2")
    assert judge(node_copy, "NCCL013")["NCCL013"] == {("present", "/usr/lib/x86_64-linux-gnu/libnccl.so.2.26.2"), ("present", WHEEL_COPY)}
    # Only a RAS status query crashes it, and nothing here says whether anything queries: a
    # warning, never a drain of every node whose image ships the release; a site that polls RAS
    # raises the severity.
    found = findings(node_copy, "NCCL013")
    assert {f["severity"] for f in found} == {"warning"} and all("NCCL_RAS_ENABLE=0" in str(f["fix"]) for f in found)
    polled = run(REGISTRY, Sources.for_fs(NodeFS(str(node_copy))), HostConfig(severity={"NCCL013": Severity.ERROR}), RunOptions(select=("NCCL013",)), "test")
    assert {f.severity for f in polled.findings} == {Severity.ERROR}
    write(node_copy, "/etc/nccl.conf", "NCCL_RAS_ENABLE=0\n")
    assert judge(node_copy, "NCCL013")["NCCL013"] == {("absent", "node")}
    write(node_copy, "/etc/nccl.conf", "NCCL_RAS_ENABLE =0\n")  # NCCL does not trim: this is another variable
    assert ("present", WHEEL_COPY) in judge(node_copy, "NCCL013")["NCCL013"]


def test_ras_init_race_fixed_in_2_27_3(node_copy: Path) -> None:
    upgrade_nccl(node_copy, "2.21.5", "2.27.3")
    assert judge(node_copy, "NCCL013")["NCCL013"] == {("absent", "node")}


# -- NCCL018 ------------------------------------------------------------------------------------
def test_nonblocking_split_with_pytorch_2_6_is_a_risk(tmp_path: Path) -> None:
    root = fixture("vllm-container", tmp_path)
    [finding] = findings(root, "NCCL018")
    assert (finding["status"], finding["severity"]) == ("present", "warning")
    assert "PyTorch 2.6.0+cu124" in json.dumps(finding["evidence"])
    environ(root, TORCH_NCCL_USE_COMM_NONBLOCKING="0")
    assert judge(root, "NCCL018")["NCCL018"] == {("absent", "node")}
    metadata = root / "usr/local/lib/python3.12/dist-packages/torch-2.6.0+cu124.dist-info/METADATA"
    metadata.write_text(metadata.read_text().replace("2.6.0+cu124", "2.7.1"))
    environ(root)
    assert judge(root, "NCCL018")["NCCL018"] == {("absent", "node")}


def test_nonblocking_requested_by_the_job_is_an_error_until_2_27_3(node_copy: Path) -> None:
    environ(node_copy, TORCH_NCCL_USE_COMM_NONBLOCKING="1")
    [system, wheel] = sorted(findings(node_copy, "NCCL018"), key=lambda f: str(f["subject"]))
    assert system["status"] == "present" and system["severity"] == "critical"
    environ(node_copy, NCCL_COMM_SPLIT_SHARE_RESOURCES="1")
    assert ("present", WHEEL_COPY) in judge(node_copy, "NCCL018")["NCCL018"]
    upgrade_nccl(node_copy, "2.21.5", "2.27.3")
    assert judge(node_copy, "NCCL018")["NCCL018"] == {("absent", "node")}
    environ(node_copy)
    upgrade_nccl(node_copy, "2.27.3", "2.21.5")
    assert judge(node_copy, "NCCL018")["NCCL018"] == {("not_applicable", "node")}  # nothing non-blocking, no PyTorch



PYPI_TORCH = "Metadata-Version: 2.1\nName: torch\nVersion: 2.7.1\nRequires-Dist: nvidia-nccl-cu12==2.26.2; platform_system == \"Linux\"\n"


def test_a_pytorch_setting_judges_the_nccl_pytorch_loads(node_copy: Path) -> None:
    """TORCH_NCCL_USE_COMM_NONBLOCKING is PyTorch's: a PyPI CUDA build of PyTorch names its
    nvidia-nccl wheel and finds that wheel's NCCL first (DT_RPATH), so an old system libnccl is no
    job's. A build from source (NGC: no such requirement) links the system's, wheel or no wheel.
    An NCCL setting (NCCL_COMM_SPLIT_SHARE_RESOURCES) reaches every program, so every copy counts."""
    write(node_copy, f"{SITE}/torch-2.7.1.dist-info/METADATA", PYPI_TORCH)
    environ(node_copy, TORCH_NCCL_USE_COMM_NONBLOCKING="1")
    assert judge(node_copy, "NCCL018")["NCCL018"] == {("present", WHEEL_COPY)}
    environ(node_copy, NCCL_COMM_SPLIT_SHARE_RESOURCES="1")
    assert judge(node_copy, "NCCL018")["NCCL018"] == {("present", WHEEL_COPY), ("present", SYSTEM_COPY)}
    write(node_copy, f"{SITE}/torch-2.7.1.dist-info/METADATA", "Metadata-Version: 2.1\nName: torch\nVersion: 2.7.0a0+79aa17489c\n")
    environ(node_copy, TORCH_NCCL_USE_COMM_NONBLOCKING="1")
    assert judge(node_copy, "NCCL018")["NCCL018"] == {("present", WHEEL_COPY), ("present", SYSTEM_COPY)}


def test_a_release_bug_in_a_copy_pytorch_does_not_load_is_information(node_copy: Path) -> None:
    """The system libnccl of a CUDA base image beside a PyPI PyTorch and its wheel: PyTorch never
    loads the system copy, a program linked to libnccl.so.2 without an RPATH would (information).
    With another framework that brings its own NCCL, or PyTorch built from source, it counts."""
    write(node_copy, f"{SITE}/torch-2.7.1.dist-info/METADATA", PYPI_TORCH)
    severities = {f["subject"]: f["severity"] for f in findings(node_copy, "SOCK002") if f["status"] == "present"}
    assert severities[SYSTEM_COPY] == "info"
    fix = next(f["fix"] for f in findings(node_copy, "SOCK002") if f["subject"] == SYSTEM_COPY)
    assert fix.startswith(f"Not what PyTorch loads here: PyTorch here ({SITE}) loads its own nvidia-nccl wheel")
    write(node_copy, f"{SITE}/tensorflow-2.18.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: tensorflow\nVersion: 2.18.0\n")
    severities = {f["subject"]: f["severity"] for f in findings(node_copy, "SOCK002") if f["status"] == "present"}
    assert severities[SYSTEM_COPY] == "warning"


# -- NVL002 -------------------------------------------------------------------------------------
def test_mnnvl_with_unlimited_stack(tmp_path: Path) -> None:
    root = fixture("gb200-mnnvl", tmp_path)
    [finding] = findings(root, "NVL002")
    assert (finding["status"], finding["subject"]) == ("present", "/usr/lib/aarch64-linux-gnu/libnccl.so.2.27.5")
    assert "stack soft limit unlimited" in json.dumps(finding["evidence"]) and "clique 32766" in json.dumps(finding["evidence"])
    set_stack(root, "8388608")
    assert judge(root, "NVL002")["NVL002"] == {("absent", "node")}
    set_stack(root, "2097152")  # below NCCL's safe 8192 KB as well
    assert judge(root, "NVL002")["NVL002"] == {("present", "/usr/lib/aarch64-linux-gnu/libnccl.so.2.27.5")}


def test_mnnvl_fixed_release_mnnvl_off_and_no_clique(tmp_path: Path, example_root: Path) -> None:
    root = fixture("gb200-mnnvl", tmp_path)
    environ(root, NCCL_MNNVL_ENABLE="0", SLURM_STEP_ID="0")
    assert judge(root, "NVL002")["NVL002"] == {("absent", "node")}
    environ(root, SLURM_STEP_ID="0")
    os.remove(root / "usr/lib/aarch64-linux-gnu/libnccl.so.2")
    os.rename(root / "usr/lib/aarch64-linux-gnu/libnccl.so.2.27.5", root / "usr/lib/aarch64-linux-gnu/libnccl.so.2.28.3")
    assert judge(root, "NVL002")["NVL002"] == {("absent", "node")}
    assert judge(example_root, "NVL002")["NVL002"] == {("not_applicable", "node")}  # HGX: NVLink inside the node only


def test_mnnvl_stack_from_a_prolog(tmp_path: Path) -> None:
    """A prolog carries slurmd's limits: they are the job's only when slurm.conf keeps STACK."""
    root = fixture("gb200-mnnvl", tmp_path)
    environ(root, SLURM_JOB_ID="9001", SLURM_SCRIPT_CONTEXT="prolog_slurmd")
    [finding] = findings(root, "NVL002")
    assert finding["status"] == "unknown" and "submitting shell" in str(finding["reason"])
    write(root, "/etc/slurm/slurm.conf", "ClusterName=nvl72\nPropagateResourceLimitsExcept=MEMLOCK,STACK\n")
    [finding] = findings(root, "NVL002")
    assert finding["status"] == "present" and "slurmd's, which the job inherits" in json.dumps(finding["evidence"])


def test_mnnvl_stack_outside_a_job(tmp_path: Path) -> None:
    """A health check (slurmd's unlimited stack, as Slurm's slurmd.service sets it) or an operator's
    shell on a Slurm node reads a limit no job gets: unknown, never a drain. Without Slurm, the
    shell's limit is what ranks started from it get."""
    root = fixture("gb200-mnnvl", tmp_path)
    environ(root, HOME="/root")
    [finding] = findings(root, "NVL002")
    assert finding["status"] == "unknown" and "outside a job on a Slurm node" in str(finding["reason"])
    shutil.rmtree(root / "etc/slurm")
    [finding] = findings(root, "NVL002")
    assert finding["status"] == "present"


def test_mnnvl_bad_nvml_and_limits(tmp_path: Path) -> None:
    root = fixture("gb200-mnnvl", tmp_path)
    nvml = json.loads((root / ".preflight/nvml.json").read_text())
    nvml["calls"]["nvmlDeviceGetGpuFabricInfo"] = {str(i): {"error": "NVML_ERROR_UNKNOWN"} for i in range(4)}
    write(root, "/.preflight/nvml.json", json.dumps(nvml))
    [finding] = findings(root, "NVL002")
    assert finding["status"] == "unknown" and "NVML_ERROR_UNKNOWN" in str(finding["reason"])
    os.remove(root / ".preflight/nvml.json")
    [finding] = findings(root, "NVL002")
    assert finding["status"] == "unknown" and "NVML unavailable" in str(finding["reason"])
    root = fixture("gb200-mnnvl", tmp_path / "again")
    write(root, "/proc/self/limits", "garbage\n")
    [finding] = findings(root, "NVL002")
    assert finding["status"] == "unknown" and "Max stack size" in str(finding["reason"])


# -- TOPO003 ------------------------------------------------------------------------------------
def test_topology_regression_without_pci_speeds(tmp_path: Path) -> None:
    root = fixture("vm-no-link-speed", tmp_path)
    [finding] = findings(root, "TOPO003")
    assert finding["status"] == "present" and "0000:00:05.0, 0000:00:06.0" in json.dumps(finding["evidence"])
    environ(root, NCCL_TOPO_FILE="/opt/cloud/topo.xml")  # the provider's topology replaces detection
    assert judge(root, "TOPO003")["TOPO003"] == {("absent", "node")}
    environ(root)
    shutil.rmtree(root / "usr/local/lib/python3.10/dist-packages/nvidia_nccl_cu12-2.18.3.dist-info")
    write(root, "/usr/local/lib/python3.10/dist-packages/nvidia_nccl_cu12-2.19.4.dist-info/METADATA", "Name: nvidia-nccl-cu12\nVersion: 2.19.4\n")
    assert judge(root, "TOPO003")["TOPO003"] == {("absent", "node")}


def test_topology_nvls_search_crash_on_2_18_3(node_copy: Path) -> None:
    upgrade_nccl(node_copy, "2.21.5", "2.18.3")  # NVSwitches and eight HCAs, link speeds readable
    found = findings(node_copy, "TOPO003")
    assert {(f["status"], f["subject"]) for f in found} == {("present", "/usr/lib/x86_64-linux-gnu/libnccl.so.2.18.3"), ("present", WHEEL_COPY)}
    assert "NVLS graph search" in json.dumps(found[0]["evidence"])
    upgrade_nccl(node_copy, "2.18.3", "2.18.5")
    assert judge(node_copy, "TOPO003")["TOPO003"] == {("absent", "node")}


# -- GDR001's release rule ---------------------------------------------------------------------
def test_nvidia_peermem_alone_is_invisible_to_nccl_before_2_23_4(clean_root: Path) -> None:
    assert judge(clean_root, "GDR001", profile="prolog")["GDR001"] == {("absent", "node")}
    shutil.rmtree(clean_root / "sys/kernel/mm/memory_peers")  # a kernel without MLNX_OFED's peer-memory API
    assert judge(clean_root, "GDR001", profile="prolog")["GDR001"] == {("absent", "node")}  # NCCL 2.28.9 reads the module
    upgrade_nccl(clean_root, "2.28.9", "2.23.3")
    found = findings(clean_root, "GDR001")
    assert {(f["status"], f["subject"]) for f in found} == {("present", "/usr/lib/x86_64-linux-gnu/libnccl.so.2.23.3"), ("present", WHEEL_COPY)}
    assert "NCCL 2.23.4 or newer" in json.dumps(found[0]["evidence"])
    upgrade_nccl(clean_root, "2.23.3", "2.23.4")
    assert judge(clean_root, "GDR001", profile="prolog")["GDR001"] == {("absent", "node")}


@pytest.mark.parametrize("ref_id", ["NVL005", "SOCK002", "NCCL018", "NCCL013", "NVL002", "TOPO003"])
def test_full_profile_only(ref_id: str) -> None:
    """The job's settings these depend on are not in a prolog's environment; the periodic full run judges them."""
    assert REGISTRY.checks[ref_id].profiles == ("full",)


def test_unclassifiable_pci_functions_are_unknown_not_no_gpu(tmp_path: Path) -> None:
    """A GPU whose vendor file cannot be read may still be there: NVL002 and NVL005 say unknown
    instead of "no GPU / no NVSwitch here"."""
    root = fixture("gb200-mnnvl", tmp_path)
    errors = root / ".preflight/read-errors.json"
    document = json.loads(errors.read_text()) if errors.exists() else {"format": "preflight-read-errors/1", "errors": {}}
    for function in os.listdir(root / "sys/bus/pci/devices"):  # plain paths: they fail even though the files exist
        document["errors"][f"/sys/bus/pci/devices/{function}/vendor"] = "EACCES"
    errors.write_text(json.dumps(document))
    found = judge(root, "NVL002", "NVL005")
    assert found["NVL002"] == {("unknown", "node")} and found["NVL005"] == {("unknown", "node")}
    [finding] = findings(root, "NVL002")
    assert "could not be classified" in str(finding["reason"])
