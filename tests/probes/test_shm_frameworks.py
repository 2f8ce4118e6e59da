"""/dev/shm (VLLM001), the statvfs source behind it (live and replayed) and framework versions
read from package metadata."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from preflight.probes.frameworks import normalise, parse_metadata, parse_version, probe_frameworks
from preflight.config import HostConfig
from preflight.discovery import build_registry
from preflight.engine import RunOptions, run
from preflight.sources import NodeFS, SourceError, Sources

from conftest import write

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "nodes"
REGISTRY = build_registry(plugins=False)
CONTAINER_SITE = "/usr/local/lib/python3.12/dist-packages"


def vllm001(root: Path, profile: str = "prolog") -> list[dict[str, object]]:
    report = run(REGISTRY, Sources.for_fs(NodeFS(str(root))), HostConfig(), RunOptions(profile=profile, select=("VLLM001",)), "test")
    return [finding.to_json() for finding in report.findings]


def container(tmp_path: Path) -> Path:
    target = tmp_path / "container"
    shutil.copytree(FIXTURES / "vllm-container", target, symlinks=True)
    return target


def record_shm(root: Path, entry: dict[str, object]) -> None:
    write(root, "/.preflight/statvfs.json", json.dumps({"format": "preflight-statvfs/1", "mounts": {"/dev/shm": entry}}))


def blocks(mib: int) -> int:
    return mib * 256  # 4 KiB blocks


# -- statvfs source -----------------------------------------------------------------------------
def test_live_statvfs_matches_the_kernel(tmp_path: Path) -> None:
    usage = NodeFS("/").statvfs(str(tmp_path))
    expected = os.statvfs(tmp_path)
    assert usage is not None and usage.size == expected.f_blocks * expected.f_frsize
    assert 0 <= usage.available <= usage.free <= usage.size
    assert NodeFS("/").statvfs(str(tmp_path / "absent")) is None


def test_replayed_statvfs(tmp_path: Path) -> None:
    root = container(tmp_path)
    usage = NodeFS(str(root)).statvfs("/dev/shm")
    assert usage is not None and (usage.size, usage.free, usage.available) == (64 << 20, 64 << 20, 64 << 20)
    assert NodeFS(str(root)).statvfs("/mnt/scratch") is None  # neither recorded nor in the tree
    (root / "mnt/scratch").mkdir(parents=True)
    with pytest.raises(SourceError, match="no statvfs answer recorded"):
        NodeFS(str(root)).statvfs("/mnt/scratch")
    record_shm(root, {"error": "EACCES"})
    with pytest.raises(SourceError, match="EACCES"):
        NodeFS(str(root)).statvfs("/dev/shm")


@pytest.mark.parametrize("document", ['{"format": "preflight-statvfs/1"}', "not json", '{"mounts": {"/dev/shm": {"f_frsize": 4096}}}',
                                      '{"mounts": {"/dev/shm": {"f_frsize": 4096, "f_blocks": -1, "f_bfree": 0, "f_bavail": 0}}}'])
def test_malformed_statvfs_recording(tmp_path: Path, document: str) -> None:
    root = container(tmp_path)
    write(root, "/.preflight/statvfs.json", document)
    with pytest.raises(SourceError, match="malformed recording"):
        NodeFS(str(root)).statvfs("/dev/shm")


# -- frameworks ---------------------------------------------------------------------------------
def test_metadata_and_version_parsers() -> None:
    assert parse_metadata("Metadata-Version: 2.1\nName: Megatron_Core\nVersion: 0.12.1\n\nName: not a header\n") == ("Megatron_Core", "0.12.1", False)
    # PyPI's CUDA torch names the NCCL wheel it loads; a build from source (NGC, conda-forge) does not
    pypi = "Name: torch\nVersion: 2.8.0+cu128\nRequires-Dist: filelock\nRequires-Dist: nvidia-nccl-cu12==2.27.3; platform_system == \"Linux\"\n\n"
    assert parse_metadata(pypi) == ("torch", "2.8.0+cu128", True)
    assert parse_metadata("Name: torch\nVersion: 2.6.0a0+ecf3bae\nRequires-Dist: filelock\n\nRequires-Dist: nvidia-nccl-cu12\n") == ("torch", "2.6.0a0+ecf3bae", False)
    assert parse_metadata("Name: torch\n\nVersion: 2.6.0\n") is None  # the body is not headers
    assert parse_metadata("garbage") is None
    assert normalise("Megatron_Core") == "megatron-core" and normalise("vLLM") == "vllm"
    assert parse_version("2.7.0+cu126") == (2, 7, 0) and parse_version("2.6.0a0+git1234") == (2, 6, 0) and parse_version("dev") is None


def test_frameworks_from_system_site_and_the_jobs_venv(tmp_path: Path) -> None:
    root = tmp_path / "node"
    write(root, "/usr/lib/python3/dist-packages/.keep", "")  # Debian's python3 directory is no python3.X
    write(root, "/usr/local/lib/python3.10/dist-packages/deepspeed-0.16.4.dist-info/METADATA", "Name: deepspeed\nVersion: 0.16.4\n")
    write(root, "/usr/local/lib/python3.10/dist-packages/numpy-2.2.0.dist-info/METADATA", "Name: numpy\nVersion: 2.2.0\n")
    write(root, "/home/alice/venv/lib/python3.11/site-packages/torch-2.7.0.dist-info/METADATA", "Name: torch\nVersion: 2.7.0\n")
    write(root, "/home/alice/venv/lib/python3.11/site-packages/megatron_core-0.12.1.egg-info/PKG-INFO", "Name: megatron-core\nVersion: 0.12.1\n")
    write(root, "/proc/self/environ", b"VIRTUAL_ENV=/home/alice/venv\0PATH=/usr/bin\0")
    facts = probe_frameworks(NodeFS(str(root)))
    assert {(p.name, p.version) for p in facts.packages} == {("deepspeed", "0.16.4"), ("torch", "2.7.0"), ("megatron-core", "0.12.1")}
    assert "/home/alice/venv/lib/python3.11/site-packages" in facts.site_dirs and facts.problems == ()


def test_frameworks_a_module_puts_on_pythonpath(tmp_path: Path) -> None:
    """EasyBuild's and Spack's PyTorch modules add their site-packages to PYTHONPATH (no venv, no
    conda): Python searches it first, and so does the probe. Relative entries are not followed."""
    root = tmp_path / "node"
    site = "/apps/software/PyTorch/2.1.2-foss-2023a-CUDA-12.1.1/lib/python3.11/site-packages"
    write(root, f"{site}/torch-2.1.2.dist-info/METADATA", "Name: torch\nVersion: 2.1.2\n")
    write(root, "/proc/self/environ", f"PYTHONPATH={site}:relative/dir::/apps/missing\0".encode())
    facts = probe_frameworks(NodeFS(str(root)))
    assert [(p.name, p.version) for p in facts.packages] == [("torch", "2.1.2")] and facts.site_dirs[0] == site


def test_unreadable_or_garbled_metadata_is_a_problem_not_a_version(tmp_path: Path) -> None:
    root = tmp_path / "node"
    site = "/usr/local/lib/python3.10/dist-packages"
    write(root, f"{site}/vllm-0.8.5.dist-info/METADATA", b"\xff\xfe binary")
    write(root, f"{site}/torch-2.6.0.dist-info/RECORD", "")  # METADATA missing
    facts = probe_frameworks(NodeFS(str(root)))
    assert facts.packages == ()
    assert any("vllm-0.8.5.dist-info/METADATA: not UTF-8" in problem for problem in facts.problems)
    assert any("torch-2.6.0.dist-info/METADATA: missing" in problem for problem in facts.problems)


# -- VLLM001 ------------------------------------------------------------------------------------
def test_docker_default_shm_with_vllm_is_present(tmp_path: Path) -> None:
    [finding] = vllm001(container(tmp_path))
    assert (finding["status"], finding["subject"], finding["severity"]) == ("present", "/dev/shm", "error")
    assert "size 64 MiB, 64 MiB available" in json.dumps(finding["evidence"])


def test_small_but_roomy_shm_is_a_warning_and_a_large_one_absent(tmp_path: Path) -> None:
    root = container(tmp_path)
    record_shm(root, {"f_frsize": 4096, "f_blocks": blocks(512), "f_bfree": blocks(400), "f_bavail": blocks(400)})
    [finding] = vllm001(root)
    assert (finding["status"], finding["severity"]) == ("present", "warning")
    record_shm(root, {"f_frsize": 4096, "f_blocks": blocks(16384), "f_bfree": blocks(16000), "f_bavail": blocks(16000)})
    assert [(f["status"], f["subject"]) for f in vllm001(root)] == [("absent", "node")]
    record_shm(root, {"f_frsize": 4096, "f_blocks": blocks(16384), "f_bfree": blocks(50), "f_bavail": blocks(50)})
    [finding] = vllm001(root)
    assert (finding["status"], finding["severity"]) == ("present", "error")  # large but full


def test_a_tmpfs_without_a_size_limit_is_absent(tmp_path: Path) -> None:
    """tmpfs mounted with size=0 has no limit (Documentation/filesystems/tmpfs.rst) and reports
    zero blocks, zero free: not a full /dev/shm."""
    root = container(tmp_path)
    record_shm(root, {"f_frsize": 4096, "f_blocks": 0, "f_bfree": 0, "f_bavail": 0})
    assert [(f["status"], f["subject"]) for f in vllm001(root)] == [("absent", "node")]


def test_a_node_with_one_gpu_is_not_applicable(tmp_path: Path) -> None:
    """One GPU runs vLLM with world size 1, whose uniprocess executor creates no shared-memory
    ring; NCCL007 leaves such a node out for the same reason."""
    root = container(tmp_path)  # Docker's 64 MiB /dev/shm
    write(root, "/proc/driver/nvidia/gpus/0000:18:00.0/information", "Model: NVIDIA H100\n")
    [finding] = vllm001(root)
    assert finding["status"] == "not_applicable" and "one GPU" in str(finding["reason"])
    write(root, "/proc/driver/nvidia/gpus/0000:2a:00.0/information", "Model: NVIDIA H100\n")
    [finding] = vllm001(root)
    assert (finding["status"], finding["severity"]) == ("present", "error")


def test_missing_unreadable_and_not_applicable(tmp_path: Path, example_root: Path) -> None:
    root = container(tmp_path)
    shutil.rmtree(root / "dev/shm")
    (root / ".preflight/statvfs.json").write_text('{"format": "preflight-statvfs/1", "mounts": {}}')
    [finding] = vllm001(root)  # sizes recorded, and no /dev/shm among them or in the tree
    assert finding["status"] == "present" and "missing" in json.dumps(finding["evidence"])
    (root / "dev/shm").mkdir()
    [finding] = vllm001(root)
    assert finding["status"] == "unknown" and "no statvfs answer recorded" in str(finding["reason"])
    os.remove(root / ".preflight/statvfs.json")
    shutil.rmtree(root / "dev/shm")
    [finding] = vllm001(root)  # nothing recorded of the sizes: missing is not empty
    assert finding["status"] == "unknown" and "records no file system sizes" in str(finding["reason"])
    record_shm(root, {"error": "EIO"})
    [finding] = vllm001(root)
    assert finding["status"] == "unknown" and "EIO" in str(finding["reason"])
    assert [(f["status"], f["reason"]) for f in vllm001(example_root)] == [("not_applicable", "vLLM is not installed in this node's Python environments")]
