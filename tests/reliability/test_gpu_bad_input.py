"""Bad input for every NVML probe (bar1, fabric, gpus, gpu_health) and the GPU-side files on the
example node: NVML missing, calls answering NOT_SUPPORTED / NO_PERMISSION / GPU_IS_LOST, a call
that never returns, truncated config space and an unreadable kernel log. Each gives ``unknown``
with a reason (or ``not_applicable``/``absent`` where that is the honest answer), never a crash."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from conftest import Runner, example_copy_for_nobody, site_config
from preflight.config import HostConfig
from preflight.discovery import build_registry
from preflight.engine import RunOptions, run
from preflight.sources import Sources

NVML_REFERENCES = ("GPU001", "GPU002", "GDR003", "NVL006")
REGISTRY = build_registry()


def edit_nvml(root: Path, change: Any) -> None:
    path = root / ".preflight/nvml.json"
    document = json.loads(path.read_text())
    change(document)
    path.write_text(json.dumps(document))


def judged(root: Path, *select: str) -> set[tuple[str, str, str, str]]:
    """(reference, subject, status, reason) of every finding that is not absent."""
    report = run(REGISTRY, Sources.for_node(str(root)), HostConfig(), RunOptions(select=select or NVML_REFERENCES), "gpu017")
    assert {probe.status for probe in report.probes} == {"ok"}, report.probes
    return {(f.reference_id, f.subject, f.status.value, f.reason) for f in report.findings if f.status.value != "absent"}


def test_nvml_library_missing_makes_every_nvml_reference_unknown(node_copy: Path) -> None:
    detail = "libnvidia-ml.so.1: cannot open shared object file: No such file or directory"
    edit_nvml(node_copy, lambda document: document.update(init={"error": "NVML_ERROR_LIBRARY_NOT_FOUND", "detail": detail}))
    found = judged(node_copy)
    assert {(ref, status) for ref, _, status, _ in found} == {(ref, "unknown") for ref in NVML_REFERENCES}
    assert all("NVML_ERROR_LIBRARY_NOT_FOUND" in reason for *_, reason in found), found


def test_live_nvml_without_a_driver_is_library_not_found_not_a_crash() -> None:
    """This machine (and any CPU-only one) has pynvml but no libnvidia-ml.so.1."""
    from preflight.probes.gpu_health import probe_gpu_health
    from preflight.sources.nvml import LiveNvml, NvmlError

    nvml = LiveNvml()
    try:
        count = nvml.call("nvmlDeviceGetCount")
    except NvmlError as error:
        assert error.code in ("NVML_ERROR_LIBRARY_NOT_FOUND", "NVML_ERROR_DRIVER_NOT_LOADED", "NVML_ERROR_NO_PERMISSION")
        assert probe_gpu_health(nvml).nvml_error == error.code
    else:
        assert isinstance(count, int)  # a real driver: the probe must read it
        assert len(probe_gpu_health(nvml).gpus) == count


# (function, replay key of GPU 2) per probe: gpus, bar1, fabric, gpu_health.
CALLS = [
    ("nvmlDeviceGetName", "2"), ("nvmlDeviceGetPciInfo", "2"), ("nvmlDeviceGetUUID", "2"),
    ("nvmlDeviceGetBAR1MemoryInfo", "2"), ("nvmlDeviceGetGpuFabricInfo", "2"),
    ("nvmlDeviceGetRemappedRows", "2"), ("nvmlDeviceGetPersistenceMode", "2"), ("nvmlDeviceGetEccMode", "2"),
    ("nvmlDeviceGetTotalEccErrors", "2/1/0"),
]
IDENTITY = ("nvmlDeviceGetName", "nvmlDeviceGetPciInfo", "nvmlDeviceGetUUID")
HEALTH = ("nvmlDeviceGetRemappedRows", "nvmlDeviceGetPersistenceMode", "nvmlDeviceGetEccMode", "nvmlDeviceGetTotalEccErrors")
OWN_REFERENCE = {"nvmlDeviceGetBAR1MemoryInfo": "GDR003", "nvmlDeviceGetGpuFabricInfo": "NVL006", "nvmlDeviceGetRemappedRows": "GPU002",
                 "nvmlDeviceGetPersistenceMode": "GPU001", "nvmlDeviceGetTotalEccErrors": "GPU002",
                 **{function: "GPU001" for function in IDENTITY}}


def expected(function: str, error: str) -> set[tuple[str, str]]:
    """(reference, status) for GPU2 after ``function`` answers ``error`` for it."""
    if error == "NVML_ERROR_NOT_SUPPORTED":
        # BAR1 and the fabric state exist on an H100: not answering is unknown. Elsewhere the
        # feature is simply absent (and GPU2's ECC count still decides GPU002).
        return {(OWN_REFERENCE[function], "unknown")} if function in ("nvmlDeviceGetBAR1MemoryInfo", "nvmlDeviceGetGpuFabricInfo") else set()
    if error == "NVML_ERROR_NO_PERMISSION":
        return set() if function == "nvmlDeviceGetEccMode" else {(OWN_REFERENCE[function], "unknown")}
    if function in IDENTITY:
        return {("GPU001", "present")}
    if function in HEALTH:
        return {("GPU001", "present"), ("GPU002", "unknown")}  # GPU002 defers the lost GPU to GPU001
    return {(OWN_REFERENCE[function], "unknown")}


@pytest.mark.parametrize("error", ["NVML_ERROR_NOT_SUPPORTED", "NVML_ERROR_NO_PERMISSION", "NVML_ERROR_GPU_IS_LOST"])
@pytest.mark.parametrize(("function", "key"), CALLS)
def test_failing_call_for_one_gpu(node_copy: Path, function: str, key: str, error: str) -> None:
    edit_nvml(node_copy, lambda document: document["calls"][function].update({key: {"error": error}}))
    found = judged(node_copy)
    assert {(ref, status) for ref, subject, status, _ in found if subject == "GPU2"} == expected(function, error), found
    assert {subject for _, subject, _, _ in found} <= {"GPU2"}, found  # the other GPUs are still judged
    assert all(error in reason or "GPU001" in reason for _, _, status, reason in found if status == "unknown"), found


@pytest.mark.parametrize(("function", "probe", "references"), [
    # NVLink, P2P and clock checks name GPUs from its facts; GDR002 reads the CUDA version the driver supports
    ("nvmlDeviceGetUUID", "gpus", {"GPU001", "GPU002", "GDR002", "GDR003", "NVL003", "PCI004", "PCI005", "NCCL011"}),
    ("nvmlDeviceGetBAR1MemoryInfo", "bar1", {"GDR003"}),
    ("nvmlDeviceGetGpuFabricInfo", "fabric", {"NVL006", "NVL004", "NVL002", "NVL001"}),  # NVL004, NVL002 and NVL001 read the fabric facts too
    ("nvmlDeviceGetTotalEccErrors", "gpu_health", {"GPU001", "GPU002", "NCCL011"}),
])
def test_hanging_call_times_out_and_the_run_finishes(run_cli: Runner, node_copy: Path, function: str, probe: str, references: set[str]) -> None:
    key = "2/1/0" if function == "nvmlDeviceGetTotalEccErrors" else "2"
    edit_nvml(node_copy, lambda document: document["calls"][function].update({key: {"hang": True}}))
    config = site_config(node_copy, "[run]\nprobe_timeout = 1.0\n")
    # The replayed call never returns: a report at all means the run stopped waiting for it
    # (run_cli's subprocess timeout is only a hang guard; bench/deadlines.py times these runs).
    result = run_cli("node", "--root", str(node_copy), "--config", config, "--format", "json", "--timeout", "3")
    report = json.loads(result.stdout)
    assert next(p for p in report["probes"] if p["name"] == probe)["status"] == "timeout"
    stuck = {f["id"] for f in report["findings"] if f["status"] == "unknown" and f["reason"].startswith(f"probe {probe}: timed out after")}
    assert stuck == references
    others = {f["status"] for f in report["findings"] if f["id"] not in NVML_REFERENCES and f["id"] not in stuck}
    assert others <= {"present", "absent", "not_applicable"}, report["findings"]


@pytest.mark.parametrize("size", [0, 64, 200, 256])
def test_truncated_bridge_config_is_unknown_never_off(node_copy: Path, size: int) -> None:
    config = node_copy / "sys/devices/pci0000:5a/0000:5a:01.0/0000:5c:00.0/config"
    config.write_bytes(config.read_bytes()[:size])
    found = judged(node_copy, "PCI001")
    assert {(ref, subject, status) for ref, subject, status, _ in found} == {("PCI001", "bridge 0000:5c:00.0", "unknown")}
    (reason,) = [reason for *_, reason in found]
    assert f"only {size} bytes" in reason and "needs CAP_SYS_ADMIN" in reason


def test_garbage_answers_for_every_health_query(node_copy: Path) -> None:
    def garbage(document: dict[str, Any]) -> None:
        calls = document["calls"]
        calls["nvmlDeviceGetPersistenceMode"]["1"] = {"result": "yes"}
        calls["nvmlDeviceGetEccMode"]["1"] = {"result": [1]}
        calls["nvmlDeviceGetTotalEccErrors"]["1/1/0"] = {"result": None}
        calls["nvmlDeviceGetRemappedRows"]["1"] = {"result": {"pending": 1}}
        calls["nvmlDeviceGetBAR1MemoryInfo"]["1"] = {"result": [1, 2, 3]}
        calls["nvmlDeviceGetCount"] = {"result": "eight"}

    edit_nvml(node_copy, garbage)
    found = judged(node_copy)
    # NVL006 too: a GB200-style tray is recognised through NVML, so a damaged count hides it.
    assert {(ref, status) for ref, _, status, _ in found} == {(ref, "unknown") for ref in ("GPU001", "GPU002", "GDR003", "NVL006")}
    assert all("'eight'" in reason or "NVML lists no GPUs" in reason or "NVML_UNEXPECTED_ANSWER" in reason for *_, reason in found), found
    edit_nvml(node_copy, lambda document: document["calls"].update(nvmlDeviceGetCount={"result": 8}))
    found = judged(node_copy)
    by_reference = {(ref, subject): (status, reason) for ref, subject, status, reason in found}
    assert by_reference[("GPU001", "GPU1")][0] == "unknown" and "unexpected answer 'yes'" in by_reference[("GPU001", "GPU1")][1]
    assert by_reference[("GPU002", "GPU1")][0] == "unknown" and by_reference[("GDR003", "GPU1")][0] == "unknown"


# Imports happen as root; the node is then read as ``nobody``, for whom the recorded kernel log
# is as closed as /dev/kmsg is under kernel.dmesg_restrict.
UNPRIVILEGED_RUN = """
import json, os, sys
from preflight.config import HostConfig
from preflight.discovery import build_registry
from preflight.engine import RunOptions, run
from preflight.sources import Sources
registry = build_registry()
os.setgroups([])
os.setgid(65534)
os.setuid(65534)
report = run(registry, Sources.for_node(sys.argv[1]), HostConfig(), RunOptions(profile="prolog", select=("GPU002",)), "gpu017")
print(json.dumps([f.to_json() for f in report.findings]))
"""


def test_unreadable_kernel_log_is_unknown_with_the_reason() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to switch to an unprivileged user")
    with example_copy_for_nobody("preflight-kmsg-") as (base, root):
        (root / ".preflight/kmsg").chmod(0o000)
        result = subprocess.run([sys.executable, "-c", UNPRIVILEGED_RUN, str(root)], capture_output=True, text=True, timeout=60, cwd=str(base))
        assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
        (finding,) = json.loads(result.stdout)
        assert (finding["subject"], finding["status"]) == ("kernel log", "unknown")
        assert "Xid history since boot unread" in finding["reason"] and "permission denied" in finding["reason"]
