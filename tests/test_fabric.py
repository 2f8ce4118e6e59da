"""NVL006: GPUs outside a completed NVLink fabric on an NVSwitch system, from replayed NVML
fabric answers, the PCI bus and /proc."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from preflight.checks.fabric import nvls_multicast_init_failure, probe_fabric
from preflight.checks.job import probe_job
from preflight.model import NotApplicable, Status
from preflight.sources import Sources

from conftest import write


def verdicts(root: Path) -> list[tuple[str, Status, str]]:
    sources = Sources.for_node(str(root), None)
    found = nvls_multicast_init_failure(probe_fabric(sources.fs, sources.nvml), probe_job(sources.fs))
    return [(o.subject, o.status, " ".join(e.observed for e in o.evidence) + o.reason) for o in found]


def edit_fabric(root: Path, answers: dict[str, Any]) -> None:
    path = root / ".preflight/nvml.json"
    document = json.loads(path.read_text())
    document["calls"]["nvmlDeviceGetGpuFabricInfo"] = answers
    path.write_text(json.dumps(document))


def test_completed_fabric_is_absent(example_root: Path) -> None:
    assert verdicts(example_root) == []


def test_gpu_whose_fabric_is_not_started_is_present(node_copy: Path) -> None:
    answers = {str(i): {"result": {"clusterUuid": [0] * 16, "status": 0, "cliqueId": 0, "state": 3}} for i in range(8)}
    answers["6"] = {"result": {"clusterUuid": [0] * 16, "status": 0, "cliqueId": 0, "state": 1}}
    edit_fabric(node_copy, answers)
    (node_copy / "proc/1843/comm").unlink()
    write(node_copy, "/proc/self/environ", b"NCCL_NVLS_ENABLE=1\0")
    found = verdicts(node_copy)
    assert [(s, st) for s, st, _ in found] == [("GPU6", Status.PRESENT)]
    assert "fabric not started" in found[0][2] and "no nv-fabricmanager process" in found[0][2] and "1" in found[0][2]


def test_old_driver_falls_back_on_the_fabric_manager_process(node_copy: Path) -> None:
    edit_fabric(node_copy, {str(i): {"error": "NVML_ERROR_FUNCTION_NOT_FOUND"} for i in range(8)})
    assert verdicts(node_copy) == []
    (node_copy / "proc/1843/comm").unlink()
    assert [s for s, _, _ in verdicts(node_copy)] == ["fabric manager"]


def test_not_applicable_without_nvswitches(node_copy: Path) -> None:
    for bdf in ("0000:05:00.0", "0000:06:00.0", "0000:07:00.0", "0000:08:00.0"):
        (node_copy / "sys/bus/pci/devices" / bdf).unlink()
    with pytest.raises(NotApplicable, match="no NVSwitch"):
        verdicts(node_copy)


def test_fabric_query_errors_are_unknown_per_gpu(node_copy: Path) -> None:
    answers = {str(i): {"result": {"clusterUuid": [0] * 16, "status": 0, "cliqueId": 0, "state": 3}} for i in range(8)}
    answers["2"] = {"error": "NVML_ERROR_UNKNOWN"}
    edit_fabric(node_copy, answers)
    assert [(s, st) for s, st, _ in verdicts(node_copy)] == [("GPU2", Status.UNKNOWN)]
