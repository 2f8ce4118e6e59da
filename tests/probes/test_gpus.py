"""The gpus probe's system-wide NVML answers: the driver version and the CUDA version it supports."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from preflight.probes.gpus import UNEXPECTED_ANSWER, probe_gpus
from preflight.sources import Sources


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


@pytest.mark.parametrize(
    ("mounts", "container_gpus", "view_error"),
    [
        (CONTAINER_MOUNTS, ("0000:18:00.0", "0000:2a:00.0"), ""),
        (HOST_MOUNTS, None, ""),
        (None, None, "/proc/self/mountinfo: not in this root"),
        # The CDI hook binds only params over the host's file: the gpus/ listing is the host's.
        (CDI_MOUNTS, None, "a container runtime mounted /proc/driver/nvidia/params but left the host's /proc/driver/nvidia/gpus: which GPUs it gave is not listed"),
    ],
)
def test_whether_a_container_runtime_narrowed_the_view_is_asked_when_nvml_lists_fewer(
    node_copy: Path, mounts: str | None, container_gpus: tuple[str, ...] | None, view_error: str
) -> None:
    path = node_copy / ".preflight/nvml.json"
    document = json.loads(path.read_text())
    document["calls"]["nvmlDeviceGetCount"] = {"result": 2}
    path.write_text(json.dumps(document))
    if mounts is not None:
        (node_copy / "proc/self/mountinfo").write_text(mounts)
    shutil.rmtree(node_copy / "proc/driver/nvidia/gpus", ignore_errors=True)
    for address in ("0000:18:00.0", "0000:2a:00.0"):
        (node_copy / "proc/driver/nvidia/gpus" / address).mkdir(parents=True)
    sources = Sources.for_node(str(node_copy))
    facts = probe_gpus(sources.fs, sources.nvml)
    assert len(facts.devices) == 2 and len(facts.pci_gpus) == 8
    assert (facts.container_gpus, facts.view_error) == (container_gpus, view_error)


def test_the_view_is_not_asked_when_nvml_lists_every_gpu(node_copy: Path) -> None:
    sources = Sources.for_node(str(node_copy))
    facts = probe_gpus(sources.fs, sources.nvml)
    assert (facts.container_gpus, facts.view_error) == (None, "")
