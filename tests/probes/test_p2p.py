"""PCI004 (P2P switched off or not OK) and PCI005 (sm_120 multi-GPU failures) from replayed NVML
P2P answers, the job's NCCL settings, sysfs IOMMU groups and the NCCL libraries, on the example
HGX H100, the GB200 tray and the RTX 5090 workstation."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from preflight.probes.gpus import probe_gpus
from preflight.probes.job import probe_job
from preflight.probes.nccl_libs import probe_nccl_libs
from preflight.probes.p2p import P2pGpu, P2pStatus, probe_p2p
from preflight.checks.pci import blackwell_sm120_multi_gpu_failure, p2p_transport_disabled
from preflight.config import Expectations
from preflight.model import NotApplicable, Observation, Severity, Status, Unknown
from preflight.probes.pcie import probe_pcie
from preflight.sources import Sources

from conftest import write

NODES = Path(__file__).resolve().parents[1] / "fixtures" / "nodes"
RTX = "rtx5090-workstation"
WHEEL = "usr/local/lib/python3.12/dist-packages"


def pci004(root: Path, expect: Expectations = Expectations()) -> list[Observation]:
    sources = Sources.for_node(str(root), None)
    return list(p2p_transport_disabled(probe_p2p(sources.fs, sources.nvml), probe_job(sources.fs),
                                       probe_gpus(sources.fs, sources.nvml), expect))


def pci005(root: Path) -> list[Observation]:
    sources = Sources.for_node(str(root), None)
    return list(blackwell_sm120_multi_gpu_failure(probe_p2p(sources.fs, sources.nvml), probe_nccl_libs(sources.fs),
                                                  probe_job(sources.fs), probe_gpus(sources.fs, sources.nvml), probe_pcie(sources.fs)))


def text(observation: Observation) -> str:
    return " | ".join(f"{e.source}: {e.observed} / {e.expected}" for e in observation.evidence) + observation.reason


def edit_nvml(root: Path, function: str, answers: dict[str, Any]) -> None:
    path = root / ".preflight/nvml.json"
    document = json.loads(path.read_text())
    document["calls"].setdefault(function, {}).update(answers)
    path.write_text(json.dumps(document))


def p2p_answers(pairs: list[tuple[int, int]], read: int, write_: int, nvlink: int) -> dict[str, Any]:
    answers = {}
    for first, second in pairs:
        for source, target in ((first, second), (second, first)):
            for caps, status in enumerate((read, write_, nvlink)):
                answers[f"{source}/gpu{target}/{caps}"] = {"result": status}
    return answers


def environ(root: Path, **variables: str) -> None:
    write(root, "/proc/self/environ", b"".join(f"{k}={v}".encode() + b"\0" for k, v in {"HOME": "/root", **variables}.items()))


@pytest.fixture
def rtx(tmp_path: Path) -> Path:
    target = tmp_path / RTX
    shutil.copytree(NODES / RTX, target, symlinks=True)
    return target


# -- probe on recorded roots --------------------------------------------------------------------
def test_example_probe_records_every_ordered_pair(example_root: Path) -> None:
    sources = Sources.for_node(str(example_root), None)
    facts = probe_p2p(sources.fs, sources.nvml)
    assert len(facts.statuses) == 56 and set(facts.statuses) == {
        P2pStatus(s, t, 0, 0, 0, "") for s in range(8) for t in range(8) if s != t
    }
    assert facts.gpus[0] == P2pGpu(0, "NVIDIA H100 80GB HBM3", (9, 0), "0000:18:00.0", None)


def test_rtx5090_probe_reads_compute_capability_and_iommu_domain() -> None:
    sources = Sources.for_node(str(NODES / RTX), None)
    facts = probe_p2p(sources.fs, sources.nvml)
    assert facts.gpus == (
        P2pGpu(0, "NVIDIA GeForce RTX 5090", (12, 0), "0000:01:00.0", "DMA-FQ"),
        P2pGpu(1, "NVIDIA GeForce RTX 5090", (12, 0), "0000:41:00.0", "DMA-FQ"),
    )
    assert set(facts.statuses) == {P2pStatus(0, 1, 2, 2, 5, ""), P2pStatus(1, 0, 2, 2, 5, "")}


# -- PCI004 -------------------------------------------------------------------------------------
def test_healthy_nodes_are_absent(example_root: Path) -> None:
    assert pci004(example_root) == []
    assert pci004(NODES / "gb200-tray") == []
    assert pci004(NODES / RTX) == []  # no P2P on GeForce cards: NCCL uses SHM, nothing is switched off


@pytest.mark.parametrize("value, off", [("1", True), (" 1", True), ("0x1", True), ("1abc", True),
                                        ("2", False), ("0", False), ("yes", False), ("", False)])
def test_p2p_disable_counts_only_when_strtol_gives_one(node_copy: Path, value: str, off: bool) -> None:
    environ(node_copy, NCCL_P2P_DISABLE=value)
    found = pci004(node_copy)
    assert [o.subject for o in found] == (["job environment"] if off else [])
    if off:
        assert "NCCL_P2P_DISABLE (environment): " in text(found[0]) and "read/write OK for 28 of 28 GPU pairs" in text(found[0])


@pytest.mark.parametrize("value, off", [("LOC", True), ("0", True), ("LOC ", False), ("loc", False), ("NVL", False),
                                        ("PIX", False), ("SYS", False)])
def test_p2p_level_in_nccl_conf(node_copy: Path, value: str, off: bool) -> None:
    write(node_copy, "/etc/nccl.conf", f"NCCL_P2P_LEVEL={value}\n")
    assert [o.subject for o in pci004(node_copy)] == (["/etc/nccl.conf"] if off else [])


def test_p2p_level_nvl_without_nvlink_switches_p2p_off(rtx: Path) -> None:
    edit_nvml(rtx, "nvmlDeviceGetP2PStatus", p2p_answers([(0, 1)], 0, 0, 5))  # the driver offers PCIe P2P
    assert pci004(rtx) == []
    environ(rtx, NCCL_P2P_LEVEL="NVL")
    (found,) = pci004(rtx)
    assert found.subject == "job environment" and "only over NVLink" in text(found)


def test_setting_on_hardware_without_p2p_takes_nothing_away(rtx: Path) -> None:
    environ(rtx, NCCL_P2P_DISABLE="1")
    assert pci004(rtx) == []


def test_nvlink_connected_pair_without_p2p_is_critical(node_copy: Path) -> None:
    edit_nvml(node_copy, "nvmlDeviceGetP2PStatus", {"2/gpu5/0": {"result": 6}, "5/gpu2/1": {"result": 6}})
    environ(node_copy, NCCL_IGNORE_DISABLED_P2P="1")
    (found,) = pci004(node_copy)
    assert (found.subject, found.severity) == ("GPU2-GPU5", Severity.CRITICAL)
    assert "GPU2->GPU5: read U (unknown), write OK, NVLink OK" in text(found)
    assert "NCCL_IGNORE_DISABLED_P2P (environment): 1" in text(found) and "nvlink --status" in found.fix


def test_a_gpu_in_mig_mode_does_no_p2p(node_copy: Path) -> None:
    """NVIDIA's MIG user guide: GPU-to-GPU P2P (PCIe or NVLink) is not supported in MIG mode, so
    a MIG GPU's pairs answering 'not supported' beside NVLink OK are no fault; a GPU without MIG
    answers nvmlDeviceGetMigMode NOT_SUPPORTED and is judged as before."""
    edit_nvml(node_copy, "nvmlDeviceGetP2PStatus", {"2/gpu5/0": {"result": 6}, "5/gpu2/1": {"result": 6}})
    edit_nvml(node_copy, "nvmlDeviceGetMigMode", {"5": {"result": [1, 1]}, "2": {"error": "NVML_ERROR_NOT_SUPPORTED"}})
    assert pci004(node_copy) == []
    edit_nvml(node_copy, "nvmlDeviceGetMigMode", {"5": {"result": [0, 1]}})  # enabled at the next reset: not yet
    assert [o.subject for o in pci004(node_copy)] == ["GPU2-GPU5"]


def test_p2p_disabled_by_regkey_is_present(rtx: Path) -> None:
    edit_nvml(rtx, "nvmlDeviceGetP2PStatus", p2p_answers([(0, 1)], 4, 4, 5))
    (found,) = pci004(rtx)
    assert (found.subject, found.severity) == ("GPU0-GPU1", None) and "DR (disabled by regkey)" in text(found)


def test_no_p2p_where_the_site_expects_nvlink_is_an_error(rtx: Path) -> None:
    (found,) = pci004(rtx, Expectations(nvlinks_per_gpu=4))
    assert (found.subject, found.severity) == ("GPU0-GPU1", Severity.ERROR) and "GNS (GPU not supported)" in text(found)


def test_single_gpu_is_not_applicable(rtx: Path) -> None:
    path = rtx / ".preflight/nvml.json"
    document = json.loads(path.read_text())
    document["calls"]["nvmlDeviceGetCount"] = {"result": 1}
    path.write_text(json.dumps(document))
    # The bus holds two: a job's device cgroup (or a container) shows NVML one, and the node is not
    # called a one-GPU node.
    with pytest.raises(NotApplicable, match=r"1 GPU\(s\) visible to NVML here: no peer-to-peer traffic between them"):
        pci004(rtx)


# -- PCI004: bad NVML answers -------------------------------------------------------------------
def test_failing_p2p_queries_are_unknown_for_those_pairs(node_copy: Path) -> None:
    edit_nvml(node_copy, "nvmlDeviceGetP2PStatus", {"1/gpu4/2": {"error": "NVML_ERROR_UNKNOWN"}, "3/gpu0/0": {"result": None}})
    found = pci004(node_copy)
    assert [(o.subject, o.status) for o in found] == [("GPU pairs", Status.UNKNOWN), ("GPU pairs", Status.UNKNOWN)]
    assert "NVML_ERROR_UNKNOWN for GPU1->GPU4" in found[0].reason and "unexpected answer None for GPU3->GPU0" in found[1].reason


def test_nvml_down_with_p2p_switched_off_still_reports_the_setting(node_copy: Path) -> None:
    path = node_copy / ".preflight/nvml.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "init": {"error": "NVML_ERROR_DRIVER_NOT_LOADED"}}))
    with pytest.raises(Unknown, match="NVML_ERROR_DRIVER_NOT_LOADED"):
        pci004(node_copy)
    environ(node_copy, NCCL_P2P_DISABLE="1")
    assert [(o.subject, o.status) for o in pci004(node_copy)] == [("job environment", Status.PRESENT), ("GPU pairs", Status.UNKNOWN)]


# -- PCI005 -------------------------------------------------------------------------------------
def test_sm120_healthy_workstation_and_other_gpus(example_root: Path) -> None:
    assert pci005(NODES / RTX) == []
    with pytest.raises(NotApplicable, match="compute capability 12"):
        pci005(example_root)
    with pytest.raises(NotApplicable, match="compute capability 12"):
        pci005(NODES / "gb200-tray")


def test_nccl_older_than_2_26_2_on_sm120_is_present(rtx: Path) -> None:
    shutil.move(rtx / WHEEL / "nvidia_nccl_cu12-2.26.2.dist-info", rtx / WHEEL / "nvidia_nccl_cu12-2.25.1.dist-info")
    (found,) = pci005(rtx)
    assert found.subject == f"/{WHEEL}/nvidia/nccl/lib/libnccl.so.2"
    assert "NCCL 2.25.1 / NCCL 2.26.2 or newer" in text(found) and "GPU1 NVIDIA GeForce RTX 5090 sm_120" in text(found)


def test_nccl_of_unknown_version_is_unknown(rtx: Path) -> None:
    shutil.rmtree(rtx / WHEEL / "nvidia_nccl_cu12-2.26.2.dist-info")
    (found,) = pci005(rtx)
    assert found.status is Status.UNKNOWN and "version" in found.reason


def test_p2p_offered_under_a_translating_iommu_is_present(rtx: Path) -> None:
    edit_nvml(rtx, "nvmlDeviceGetP2PStatus", p2p_answers([(0, 1)], 0, 0, 5))
    (found,) = pci005(rtx)
    assert (found.subject, found.severity) == ("GPU0-GPU1", Severity.WARNING)
    assert "GPU0 DMA-FQ, GPU1 DMA-FQ" in text(found)
    environ(rtx, NCCL_P2P_DISABLE="1")
    assert pci005(rtx) == []  # P2P is off: nothing crosses the IOMMU


def test_translating_iommu_counts_only_where_nccl_uses_p2p(rtx: Path) -> None:
    """The two cards hang off separate root ports: NCCL's default P2P level PXB does not reach
    them on an Intel host (ncclTopoCheckP2p, paths.cc@v2.30.7-1), so NCCL copies through host
    memory and nothing meets the IOMMU; raised by the job, or on the AMD CPU the fixture has
    (level SYS), it does."""
    edit_nvml(rtx, "nvmlDeviceGetP2PStatus", p2p_answers([(0, 1)], 0, 0, 5))
    cpuinfo = rtx / "proc/cpuinfo"
    cpuinfo.write_text(cpuinfo.read_text().replace("AuthenticAMD", "GenuineIntel"))
    assert pci005(rtx) == []
    environ(rtx, NCCL_P2P_LEVEL="SYS")
    (found,) = pci005(rtx)
    assert (found.subject, found.severity) == ("GPU0-GPU1", Severity.WARNING) and "NCCL_P2P_LEVEL (environment): SYS" in text(found)
    environ(rtx)
    cpuinfo.unlink()
    (unknown,) = pci005(rtx)
    assert unknown.status is Status.UNKNOWN and "/proc/cpuinfo" in unknown.reason


def test_p2p_offered_with_iommu_passthrough_is_absent(rtx: Path) -> None:
    edit_nvml(rtx, "nvmlDeviceGetP2PStatus", p2p_answers([(0, 1)], 0, 0, 5))
    for group in ("21", "23"):
        (rtx / f"sys/kernel/iommu_groups/{group}/type").write_text("identity\n")
    assert pci005(rtx) == []


def test_unreadable_compute_capability_is_unknown(rtx: Path) -> None:
    edit_nvml(rtx, "nvmlDeviceGetCudaComputeCapability", {"1": {"error": "NVML_ERROR_GPU_IS_LOST"}})
    (found,) = pci005(rtx)
    assert found.status is Status.UNKNOWN and "GPU1" in found.reason
