"""GPU002: row remapping pending or failed, from replayed NVML answers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from preflight.checks.gpu_health import nccl_cuda_call_failed, probe_gpu_health
from preflight.model import NotApplicable, Status
from preflight.sources import Sources


def verdicts(root: Path) -> list[tuple[str, Status, str]]:
    sources = Sources.for_node(str(root), None)
    found = nccl_cuda_call_failed(probe_gpu_health(sources.nvml))
    return [(o.subject, o.status, " ".join(e.observed for e in o.evidence) + o.reason) for o in found]


def set_rows(root: Path, answers: dict[str, object]) -> None:
    path = root / ".preflight/nvml.json"
    document = json.loads(path.read_text())
    document["calls"]["nvmlDeviceGetRemappedRows"].update(answers)
    path.write_text(json.dumps(document))


def test_healthy_gpus_are_absent(example_root: Path) -> None:
    assert verdicts(example_root) == []


def test_pending_and_failed_remaps_are_present(node_copy: Path) -> None:
    set_rows(node_copy, {"1": {"result": [0, 2, 1, 0]}, "4": {"result": [1, 9, 0, 1]}, "6": {"error": "NVML_ERROR_UNKNOWN"}, "7": {"result": "garbage"}})
    found = {subject: (status, text) for subject, status, text in verdicts(node_copy)}
    assert found["GPU1"][0] is Status.PRESENT and "remap pending; 2 rows" in found["GPU1"][1]
    assert found["GPU4"][0] is Status.PRESENT and "remapping failed" in found["GPU4"][1]
    assert found["GPU6"][0] is Status.UNKNOWN and found["GPU7"][0] is Status.UNKNOWN
    assert set(found) == {"GPU1", "GPU4", "GPU6", "GPU7"}


def test_gpus_without_row_remapping_are_not_applicable(node_copy: Path) -> None:
    set_rows(node_copy, {str(i): {"error": "NVML_ERROR_NOT_SUPPORTED"} for i in range(8)})
    with pytest.raises(NotApplicable, match="before Ampere"):
        verdicts(node_copy)
