"""The gpus probe's system-wide NVML answers: the driver version and the CUDA version it supports."""

from __future__ import annotations

import json
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
