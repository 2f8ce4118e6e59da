"""The gpus probe's system-wide NVML answers: the driver version and the CUDA version it supports."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from preflight.probes.gpus import UNEXPECTED_ANSWER, probe_gpus
from preflight.sources import Sources

from conftest import write


def with_cuda_answer(root: Path, answer: dict[str, object] | None) -> Path:
    path = root / ".preflight/nvml.json"
    document = json.loads(path.read_text())
    if answer is None:
        document["calls"].pop("nvmlSystemGetCudaDriverVersion_v2", None)
    else:
        document["calls"]["nvmlSystemGetCudaDriverVersion_v2"] = answer
    path.write_text(json.dumps(document))
    return root


@pytest.mark.parametrize(
    ("answer", "version", "error"),
    [
        ({"result": 12040}, 12040, ""),  # driver 550: CUDA 12.4
        ({"error": "NVML_ERROR_FUNCTION_NOT_FOUND"}, None, "NVML_ERROR_FUNCTION_NOT_FOUND"),  # a driver older than the call
        (None, None, "NVML_NOT_RECORDED"),  # a recording made before the probe asked
        ({"result": "12.4"}, None, UNEXPECTED_ANSWER),
        ({"result": 10**9}, None, UNEXPECTED_ANSWER),
        ({"result": True}, None, UNEXPECTED_ANSWER),
    ],
)
def test_the_cuda_version_the_driver_supports(node_copy: Path, answer: dict[str, object] | None, version: int | None, error: str) -> None:
    """Read beside the driver version; an unanswered or senseless reply is None with the reason,
    and never costs the GPU list (the other answers stay)."""
    sources = Sources.for_node(str(with_cuda_answer(node_copy, answer)))
    facts = probe_gpus(sources.fs, sources.nvml)
    assert (facts.cuda_driver_version, facts.cuda_driver_error) == (version, error)
    assert facts.nvml_error == "" and len(facts.devices) == 8 and facts.driver_version == "550.54.15"


def test_nvml_that_does_not_start_names_its_error_for_the_cuda_version_too(node_copy: Path) -> None:
    path = node_copy / ".preflight/nvml.json"
    document = json.loads(path.read_text())
    document["init"] = {"error": "NVML_ERROR_DRIVER_NOT_LOADED"}
    path.write_text(json.dumps(document))
    sources = Sources.for_node(str(node_copy))
    facts = probe_gpus(sources.fs, sources.nvml)
    assert facts.cuda_driver_version is None and facts.cuda_driver_error == "NVML_ERROR_DRIVER_NOT_LOADED"


HOST_MOUNTS = "22 1 259:2 / / rw,relatime shared:1 - ext4 /dev/nvme0n1p2 rw\n25 22 0:5 / /proc rw,nosuid shared:12 - proc proc rw\n"
# libnvidia-container mounts a tmpfs at /proc/driver/nvidia and binds the container's GPUs under gpus/.
CONTAINER_MOUNTS = HOST_MOUNTS + (
    "700 25 0:88 / /proc/driver/nvidia rw,nosuid,nodev,noexec - tmpfs tmpfs ro,mode=555\n"
    "701 700 0:5 /driver/nvidia/gpus/0000:18:00.0 /proc/driver/nvidia/gpus/0000:18:00.0 rw - proc proc rw\n"
)

# nvidia-container-toolkit's CDI hook (disable-device-node-modification) bind-mounts a copy of params.
CDI_MOUNTS = HOST_MOUNTS + "702 25 0:89 /nvct-params /proc/driver/nvidia/params ro,nosuid - tmpfs tmpfs ro\n"


PARAMS_LEFT = "a container runtime mounted /proc/driver/nvidia/params but left the host's /proc/driver/nvidia/gpus: which GPUs it gave is not listed"


@pytest.mark.parametrize(
    ("mounts", "nodes", "container_gpus", "view_error"),
    [
        (CONTAINER_MOUNTS, 8, ("0000:18:00.0", "0000:2a:00.0"), ""),
        (HOST_MOUNTS, 8, None, ""),  # every GPU's node there: the host's view (or Slurm's cgroup)
        (None, 8, None, "/proc/self/mountinfo: not in this root"),
        # The CDI hook binds only params over the host's file: the gpus/ listing is the host's,
        # and with every node in /dev which GPUs it gave is not known.
        (CDI_MOUNTS, 8, None, PARAMS_LEFT),
        # CDI (toolkit before 1.18 mounts nothing there) or podman --device nvidia.com/gpu=0,1
        # in a container (Podman's /run/.containerenv): only the given GPUs' /dev/nvidia<minor>
        # nodes are created. On a host, a GPU without its node is a missing GPU.
        (HOST_MOUNTS + "container", 2, ("0000:18:00.0", "0000:2a:00.0"), ""),
        (CDI_MOUNTS + "container", 2, ("0000:18:00.0", "0000:2a:00.0"), ""),
        # a containerd pod (a DRA claim of 2 GPUs) has no marker file, but kubelet writes its /etc/hosts
        (HOST_MOUNTS + "pod", 2, ("0000:18:00.0", "0000:2a:00.0"), ""),
        (HOST_MOUNTS, 2, None, ""),
    ],
)
def test_whether_a_container_runtime_narrowed_the_view_is_asked_when_nvml_lists_fewer(
    node_copy: Path, mounts: str | None, nodes: int, container_gpus: tuple[str, ...] | None, view_error: str
) -> None:
    sources = Sources.for_node(str(node_copy))
    pci = probe_gpus(sources.fs, sources.nvml).pci_gpus
    path = node_copy / ".preflight/nvml.json"
    document = json.loads(path.read_text())
    document["calls"]["nvmlDeviceGetCount"] = {"result": 2}
    path.write_text(json.dumps(document))
    if mounts is not None and mounts.endswith("container"):
        mounts = mounts.removesuffix("container")
        write(node_copy, "/run/.containerenv", "engine=\"podman-5.2.2\"\n")
    if mounts is not None and mounts.endswith("pod"):
        mounts = mounts.removesuffix("pod")
        write(node_copy, "/etc/hosts", "# Kubernetes-managed hosts file.\n127.0.0.1\tlocalhost\n10.244.3.7\tworker-0\n")
    if mounts is not None:
        (node_copy / "proc/self/mountinfo").write_text(mounts)
    shutil.rmtree(node_copy / "proc/driver/nvidia/gpus", ignore_errors=True)
    for minor, address in enumerate(pci):  # the host's listing, as the real information files say it
        folder = node_copy / "proc/driver/nvidia/gpus" / address
        folder.mkdir(parents=True)
        (folder / "information").write_text(f"Model: \t\t NVIDIA H100 80GB HBM3\nBus Location: \t {address}\nDevice Minor: \t {minor}\n")
    if mounts is CONTAINER_MOUNTS:  # the container's own listing holds its two GPUs only
        for address in pci[2:]:
            shutil.rmtree(node_copy / "proc/driver/nvidia/gpus" / address)
    for minor in range(nodes):
        (node_copy / f"dev/nvidia{minor}").write_text("")
    (node_copy / "dev/nvidiactl").write_text("")
    sources = Sources.for_node(str(node_copy))
    facts = probe_gpus(sources.fs, sources.nvml)
    assert len(facts.devices) == 2 and len(facts.pci_gpus) == 8 and pci[:2] == ("0000:18:00.0", "0000:2a:00.0")
    assert (facts.container_gpus, facts.view_error) == (container_gpus, view_error)


def test_a_gpu_whose_device_node_cannot_be_told_leaves_the_view_unknown(node_copy: Path) -> None:
    """In a container with the host's mounts and listing, but information files without Device
    Minor lines (as the example's abbreviated ones): whether /dev was narrowed cannot be told."""
    path = node_copy / ".preflight/nvml.json"
    document = json.loads(path.read_text())
    document["calls"]["nvmlDeviceGetCount"] = {"result": 7}
    path.write_text(json.dumps(document))
    (node_copy / "proc/self/mountinfo").write_text(HOST_MOUNTS)
    write(node_copy, "/.dockerenv", "")
    sources = Sources.for_node(str(node_copy))
    facts = probe_gpus(sources.fs, sources.nvml)
    assert facts.container_gpus is None and facts.view_error.startswith("which /dev/nvidia* node is GPU 0000:18:00.0's cannot be told")


def test_the_view_is_not_asked_when_nvml_lists_every_gpu(node_copy: Path) -> None:
    sources = Sources.for_node(str(node_copy))
    facts = probe_gpus(sources.fs, sources.nvml)
    assert (facts.container_gpus, facts.view_error) == (None, "")


@pytest.mark.parametrize(
    ("error", "says"),
    [
        ("NVML_ERROR_DRIVER_NOT_LOADED", "dkms status"),  # a kernel upgraded without the module built for it
        ("NVML_ERROR_LIB_RM_VERSION_MISMATCH", "/proc/driver/nvidia/version"),  # a driver upgraded without a reboot
        ("NVML_ERROR_UNKNOWN", ""),  # no known cause: the reference's own fix
    ],
)
def test_gpu001_names_the_repair_for_the_start_up_error(node_copy: Path, error: str, says: str) -> None:
    from preflight.checks.gpu import gpu_unusable_by_driver
    from preflight.config import Expectations
    from preflight.probes.gpu_health import probe_gpu_health
    from preflight.probes.job import JobFacts

    path = node_copy / ".preflight/nvml.json"
    document = json.loads(path.read_text())
    document["init"] = {"error": error}
    path.write_text(json.dumps(document))
    sources = Sources.for_node(str(node_copy))
    [found] = gpu_unusable_by_driver(probe_gpus(sources.fs, sources.nvml), probe_gpu_health(sources.nvml), JobFacts({}, "", ()), Expectations())
    assert found.evidence[0].observed.startswith(error) or error in found.evidence[0].observed
    assert (says in found.fix) if says else found.fix == ""
