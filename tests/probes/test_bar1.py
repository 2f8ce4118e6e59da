"""GDR003: BAR1 too small or mostly mapped before the job, from replayed NVML answers and the
GPU's sysfs resource file (the aperture is the largest 64-bit prefetchable region)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from preflight.probes.bar1 import largest_prefetchable, probe_bar1
from preflight.checks.gdr import peermem_gpu_mapping_rejected
from preflight.probes.gpus import probe_gpus
from preflight.probes.rdma import probe_rdma
from preflight.model import NotApplicable, Severity, Status, Unknown
from preflight.sources import Sources

GIB, MIB = 1 << 30, 1 << 20


def verdicts(root: Path) -> list[tuple[str, Status, str]]:
    sources = Sources.for_node(str(root), None)
    facts = probe_bar1(sources.fs, sources.nvml)
    found = peermem_gpu_mapping_rejected(facts, probe_gpus(sources.fs, sources.nvml), probe_rdma(sources.fs))
    return [(o.subject, o.status, " ".join(e.observed for e in o.evidence) + o.reason) for o in found]


def edit_nvml(root: Path, change: Any) -> None:
    path = root / ".preflight/nvml.json"
    document = json.loads(path.read_text())
    change(document["calls"])
    path.write_text(json.dumps(document))


def test_resource_parsing_picks_the_largest_64bit_prefetchable_region() -> None:
    resource = (
        "0x00000000e0000000 0x00000000e0ffffff 0x0000000000140204\n"  # region 0: 16 MiB, 64-bit, not prefetchable
        "0x0000000000000000 0x0000000000000000 0x0000000000000000\n"
        "0x0000200000000000 0x0000201fffffffff 0x000000000014220c\n"  # region 2: 128 GiB, 64-bit prefetchable
        "garbage line\n"
    )
    assert largest_prefetchable(resource) == 128 * GIB
    assert largest_prefetchable("0x0 0x0 0x0\n") is None


def test_example_node_has_full_size_bar1(example_root: Path) -> None:
    assert verdicts(example_root) == []


def test_small_bar1_is_present(node_copy: Path) -> None:
    def small(calls: dict[str, Any]) -> None:
        calls["nvmlDeviceGetBAR1MemoryInfo"]["2"] = {"result": {"bar1Total": 256 * MIB, "bar1Free": 250 * MIB, "bar1Used": 6 * MIB}}

    edit_nvml(node_copy, small)
    found = verdicts(node_copy)
    assert [(s, st) for s, st, _ in found] == [("GPU2", Status.PRESENT)] and "bar1Total 256 MiB" in found[0][2]
    # A warning: whether a job's registrations outgrow 256 MiB depends on its scale, and some
    # boards (T4) have no larger BAR1 to enable, so a drain would be for good.
    sources = Sources.for_node(str(node_copy), None)
    [observation] = peermem_gpu_mapping_rejected(probe_bar1(sources.fs, sources.nvml), probe_gpus(sources.fs, sources.nvml), probe_rdma(sources.fs))
    assert observation.severity is Severity.WARNING and "NCCL_NET_GDR_LEVEL=LOC" in observation.fix



def test_small_aperture_read_from_sysfs_is_the_same_warning_and_a_missing_answer_is_unknown(node_copy: Path) -> None:
    """Where NVML does not answer, the PCI resource file shows the same 256 MiB window: the same
    warning as NVML's figure gives (a T4 has no larger one to enable). A recording that lacks the
    call says nothing, so the window is not judged from sysfs then."""
    sources = Sources.for_node(str(node_copy), None)
    bus_id = probe_bar1(sources.fs, sources.nvml).gpus[2].bus_id
    (node_copy / f"sys/bus/pci/devices/{bus_id}/resource").write_text(
        "0x00000000e0000000 0x00000000e0ffffff 0x0000000000040200\n"  # region 0: 16 MiB registers
        "0x0000380000000000 0x000038000fffffff 0x000000000014220c\n"  # region 1: 256 MiB, 64-bit prefetchable
        "0x0000000000000000 0x0000000000000000 0x0000000000000000\n"
        "0x0000380010000000 0x0000380011ffffff 0x000000000014220c\n"  # region 3: 32 MiB
    )

    def unanswered(calls: dict[str, Any]) -> None:
        calls["nvmlDeviceGetBAR1MemoryInfo"]["2"] = {"error": "NVML_ERROR_UNKNOWN"}

    edit_nvml(node_copy, unanswered)
    sources = Sources.for_node(str(node_copy), None)
    [observation] = peermem_gpu_mapping_rejected(probe_bar1(sources.fs, sources.nvml), probe_gpus(sources.fs, sources.nvml), probe_rdma(sources.fs))
    assert (observation.subject, observation.status, observation.severity) == ("GPU2", Status.PRESENT, Severity.WARNING)
    assert "BAR1 aperture 256 MiB" in observation.evidence[0].observed

    def not_recorded(calls: dict[str, Any]) -> None:
        del calls["nvmlDeviceGetBAR1MemoryInfo"]["2"]

    edit_nvml(node_copy, not_recorded)
    assert [(s, st) for s, st, _ in verdicts(node_copy)] == [("GPU2", Status.UNKNOWN)]

def test_small_bar1_matters_only_where_an_rdma_nic_maps_gpu_memory(node_copy: Path) -> None:
    """A 256 MiB BAR1 (T4, Quadro, GeForce without Resizable BAR: real nvidia-smi dumps in
    tests/data/real-nvml) is no fault on a node without RDMA NICs, and undecided while
    /sys/class/infiniband is unread."""
    def small(calls: dict[str, Any]) -> None:
        calls["nvmlDeviceGetBAR1MemoryInfo"]["2"] = {"result": {"bar1Total": 256 * MIB, "bar1Free": 250 * MIB, "bar1Used": 6 * MIB}}

    edit_nvml(node_copy, small)
    classes = node_copy / "sys/class"
    classes.rename(node_copy / "class-elsewhere")
    found = verdicts(node_copy)  # a root without /sys/class: whether it has RDMA NICs is unread
    assert [(s, st) for s, st, _ in found] == [("GPU2", Status.UNKNOWN)]
    assert "bar1Total 256 MiB" in found[0][2] and "not captured" in found[0][2] and "/sys/class" in found[0][2]
    classes.mkdir()  # /sys/class read, and no infiniband class in it: no RDMA device on this node
    with pytest.raises(NotApplicable, match="no RDMA devices"):
        verdicts(node_copy)


def test_bar1_mostly_mapped_before_the_job_is_present(node_copy: Path) -> None:
    def leaked(calls: dict[str, Any]) -> None:
        calls["nvmlDeviceGetBAR1MemoryInfo"]["5"] = {"result": {"bar1Total": 128 * GIB, "bar1Free": 20 * GIB, "bar1Used": 108 * GIB}}
        calls.setdefault("nvmlDeviceGetComputeRunningProcesses", {})["5"] = {"result": []}
        calls.setdefault("nvmlDeviceGetMPSComputeRunningProcesses", {})["5"] = {"result": []}

    edit_nvml(node_copy, leaked)
    found = verdicts(node_copy)
    assert [(s, st) for s, st, _ in found] == [("GPU5", Status.PRESENT)] and "bar1Used 108 GiB of 128 GiB" in found[0][2]
    assert "no compute process on the GPU" in found[0][2]
    # A driver that keeps no MPS list says nothing more: still idle.
    edit_nvml(node_copy, lambda calls: calls.update({"nvmlDeviceGetMPSComputeRunningProcesses": {"5": {"error": "NVML_ERROR_NOT_SUPPORTED"}}}))
    assert [(s, st) for s, st, _ in verdicts(node_copy)] == [("GPU5", Status.PRESENT)]


def test_bar1_mapped_by_mps_clients_is_no_leak(node_copy: Path) -> None:
    """Under CUDA MPS (Slurm's gres/mps) the jobs' processes are MPS clients, which NVML lists
    apart from the plain compute processes: their mappings are not a leak."""
    def mps(calls: dict[str, Any]) -> None:
        calls["nvmlDeviceGetBAR1MemoryInfo"]["5"] = {"result": {"bar1Total": 128 * GIB, "bar1Free": 20 * GIB, "bar1Used": 108 * GIB}}
        calls.setdefault("nvmlDeviceGetComputeRunningProcesses", {})["5"] = {"result": []}
        calls.setdefault("nvmlDeviceGetMPSComputeRunningProcesses", {})["5"] = {"result": [{"pid": 5151, "usedGpuMemory": 30 * GIB}]}

    edit_nvml(node_copy, mps)
    found = verdicts(node_copy)
    assert [(s, st) for s, st, _ in found] == [("GPU5", Status.UNKNOWN)] and "1 compute process(es) run on the GPU" in found[0][2]
    edit_nvml(node_copy, lambda calls: calls.update({"nvmlDeviceGetMPSComputeRunningProcesses": {"5": {"error": "NVML_ERROR_NO_PERMISSION"}}}))
    found = verdicts(node_copy)
    assert [(s, st) for s, st, _ in found] == [("GPU5", Status.UNKNOWN)]
    assert "nvmlDeviceGetMPSComputeRunningProcesses: NVML_ERROR_NO_PERMISSION" in found[0][2]


def test_bar1_mapped_by_running_work_is_no_leak(node_copy: Path) -> None:
    """A health check runs beside jobs, whose buffers are mapped: the share is judged on an idle
    GPU only, and otherwise a warning-level unknown (which never drains) says what runs."""
    def busy(calls: dict[str, Any]) -> None:
        calls["nvmlDeviceGetBAR1MemoryInfo"]["5"] = {"result": {"bar1Total": 128 * GIB, "bar1Free": 20 * GIB, "bar1Used": 108 * GIB}}
        calls.setdefault("nvmlDeviceGetComputeRunningProcesses", {})["5"] = {"result": [{"pid": 4242, "usedGpuMemory": 70 * GIB}]}

    edit_nvml(node_copy, busy)
    sources = Sources.for_node(str(node_copy), None)
    found = list(peermem_gpu_mapping_rejected(probe_bar1(sources.fs, sources.nvml), probe_gpus(sources.fs, sources.nvml), probe_rdma(sources.fs)))
    assert [(o.subject, o.status, o.severity) for o in found] == [("GPU5", Status.UNKNOWN, Severity.WARNING)]
    assert found[0].reason == "bar1Used 108 GiB of 128 GiB, but 1 compute process(es) run on the GPU, whose buffers are mapped through BAR1"

    def unread(calls: dict[str, Any]) -> None:
        del calls["nvmlDeviceGetComputeRunningProcesses"]

    edit_nvml(node_copy, unread)
    found = verdicts(node_copy)
    assert [(s, st) for s, st, _ in found] == [("GPU5", Status.UNKNOWN)]
    assert "whether the GPU is idle is unread (nvmlDeviceGetComputeRunningProcesses: NVML_NOT_RECORDED)" in found[0][2]
    for answer in ({"error": "NVML_ERROR_NO_PERMISSION"}, {"result": "garbage"}):
        edit_nvml(node_copy, lambda calls: calls.update({"nvmlDeviceGetComputeRunningProcesses": {"5": answer}}))
        assert [(s, st) for s, st, _ in verdicts(node_copy)] == [("GPU5", Status.UNKNOWN)], answer


def test_processes_are_asked_only_where_most_of_bar1_is_mapped(example_root: Path) -> None:
    """The prolog asks NVML once per GPU for BAR1, and for processes only where they decide."""
    sources = Sources.for_node(str(example_root), None)
    facts = probe_bar1(sources.fs, sources.nvml)
    assert [(gpu.processes, gpu.processes_error) for gpu in facts.gpus] == [(None, "")] * 8


def test_not_supported_is_not_applicable_on_unified_memory_and_unknown_elsewhere(node_copy: Path) -> None:
    def unified(calls: dict[str, Any]) -> None:
        calls["nvmlDeviceGetBAR1MemoryInfo"] = {str(i): {"error": "NVML_ERROR_NOT_SUPPORTED"} for i in range(8)}
        calls["nvmlDeviceGetName"] = {str(i): {"result": "NVIDIA GH200 480GB"} for i in range(8)}

    edit_nvml(node_copy, unified)
    with pytest.raises(NotApplicable, match="unified-memory"):
        verdicts(node_copy)

    def gb300(calls: dict[str, Any]) -> None:
        calls["nvmlDeviceGetName"] = {str(i): {"result": "NVIDIA GB300"} for i in range(8)}

    edit_nvml(node_copy, gb300)  # Grace with Blackwell Ultra over NVLink-C2C, as GB200
    with pytest.raises(NotApplicable, match="unified-memory"):
        verdicts(node_copy)

    def h100_not_supported(calls: dict[str, Any]) -> None:
        calls["nvmlDeviceGetName"] = {str(i): {"result": "NVIDIA H100 80GB HBM3"} for i in range(8)}

    edit_nvml(node_copy, h100_not_supported)
    found = verdicts(node_copy)
    assert len(found) == 8 and all(status is Status.UNKNOWN and "NVML does not report BAR1" in text for _, status, text in found)


def test_without_nvml_answers(node_copy: Path) -> None:
    (node_copy / ".preflight/nvml.json").unlink()
    with pytest.raises(Unknown):
        verdicts(node_copy)
    (node_copy / ".preflight/nvml.json").write_text(json.dumps({"format": "preflight-nvml/1", "init": {"error": "NVML_ERROR_DRIVER_NOT_LOADED"}}))
    with pytest.raises(Unknown, match="DRIVER_NOT_LOADED.*8 GPUs on the PCI bus"):
        verdicts(node_copy)  # the GPUs are there; only NVML cannot be asked
    for bdf in [link.name for link in (node_copy / "sys/bus/pci/devices").iterdir()]:
        if (node_copy / "sys/bus/pci/devices" / bdf / "vendor").read_text().strip() == "0x10de":
            (node_copy / "sys/bus/pci/devices" / bdf).unlink()
    with pytest.raises(NotApplicable, match="no NVIDIA GPUs.*DRIVER_NOT_LOADED"):
        verdicts(node_copy)


def test_a_mig_parent_whose_aggregate_bar1_needs_privilege_says_so(node_copy: Path) -> None:
    """nvml.h: in MIG mode the parent's handle reports the aggregate BAR1 only to a privileged
    caller; a job step's NO_PERMISSION there is MIG's rule, not a GPU without BAR1."""
    def mig_step(calls: dict[str, Any]) -> None:
        calls["nvmlDeviceGetBAR1MemoryInfo"] = {str(i): {"error": "NVML_ERROR_NO_PERMISSION"} for i in range(8)}
        calls["nvmlDeviceGetMigMode"] = {str(i): {"result": [1, 1] if i == 0 else [0, 0]} for i in range(8)}

    edit_nvml(node_copy, mig_step)
    found = dict((subject, (status, text)) for subject, status, text in verdicts(node_copy))
    assert found["GPU0"][0] is Status.UNKNOWN and "in MIG mode" in found["GPU0"][1] and "privileged caller" in found["GPU0"][1]
    assert "NVML does not report BAR1" in found["GPU1"][1]  # a whole GPU that refuses is another matter
