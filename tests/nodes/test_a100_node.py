"""The recorded A100 SXM4 node (``tests/fixtures/nodes/a100-pcie4``) and planted variants of it:
a GPU trained at x8, uncorrectable volatile ECC errors, persistence mode off, ACS redirect
between two GPUs, an IOMMU translating the GPUs' DMA (PCI002, GPU002, GPU001, PCI003, PCI001)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from conftest import REPO, Runner
from preflight.checks.gpu import nccl_cuda_call_failed
from preflight.probes.gpu_health import probe_gpu_health
from preflight.checks.gpu import gpu_unusable_by_driver
from preflight.probes.job import probe_job
from preflight.probes.pcie_p2p import probe_pcie_p2p
from preflight.probes.nvlink import probe_nvlink
from preflight.probes.gpus import probe_gpus
from preflight.probes.kernel_log import probe_kernel_log
from preflight.checks.pci import acs_redirect_breaks_gpudirect_rdma, p2p_bandwidth_degraded, p2p_transfers_hang_or_fault
from preflight.probes.pcie import probe_pcie
from preflight.config import Expectations
from preflight.model import NotApplicable, Severity, Status, Unknown
from preflight.sources import Sources

A100 = REPO / "tests" / "fixtures" / "nodes" / "a100-pcie4"
GPU0 = "sys/devices/pci0000:00/0000:00:01.1/0000:01:00.0/0000:02:00.0/0000:03:00.0"
GPU0_PORT = "sys/devices/pci0000:00/0000:00:01.1/0000:01:00.0/0000:02:00.0"
LNKSTA, ACSCTL = 0x60 + 0x12, 0x148 + 6


@pytest.fixture
def a100(tmp_path: Path) -> Path:
    target = tmp_path / "a100"
    shutil.copytree(A100, target, symlinks=True)
    return target


def observed(found: Any) -> list[tuple[str, Status, str]]:
    return [(o.subject, o.status, " ".join(e.observed for e in o.evidence) + o.reason) for o in found]


def pcie_verdicts(root: Path, check: Any) -> list[tuple[str, Status, str]]:
    sources = Sources.for_node(str(root))
    pcie = probe_pcie(sources.fs)
    if check is p2p_transfers_hang_or_fault:  # it also weighs the driver's P2P answers
        return observed(check(pcie, probe_pcie_p2p(sources.nvml, pcie, probe_gpus(sources.fs, sources.nvml)), probe_job(sources.fs)))
    return observed(check(pcie))


def offer_pcie_p2p(root: Path, status: int | None = 0) -> None:
    """NVML's P2P answers of eight A100 PCIe cards: read and write ``status`` (0: OK), no NVLink."""
    answer = {"result": status} if status is not None else {"error": "NVML_ERROR_UNKNOWN"}
    answers = {f"{a}/gpu{b}/{caps}": answer if caps < 2 else {"result": 5} for a in range(8) for b in range(8) if a != b for caps in range(3)}
    path = root / ".preflight/nvml.json"
    document = json.loads(path.read_text())
    document["calls"]["nvmlDeviceGetP2PStatus"] = answers
    path.write_text(json.dumps(document))


def edit_nvml(root: Path, function: str, answers: dict[str, Any]) -> None:
    path = root / ".preflight/nvml.json"
    document = json.loads(path.read_text())
    document["calls"][function].update(answers)
    path.write_text(json.dumps(document))


def patch_config(root: Path, device: str, offset: int, value: int) -> None:
    config = bytearray((root / device / "config").read_bytes())
    config[offset : offset + 2] = value.to_bytes(2, "little")
    (root / device / "config").write_bytes(bytes(config))


def without_nvswitches(root: Path) -> Path:
    """The same board with the GPUs on PCIe only (as 8 A100 PCIe cards would be)."""
    for device in (root / "sys/bus/pci/devices").iterdir():
        if (device / "class").read_text().startswith("0x0680"):
            device.unlink()
    return root


def test_recorded_a100_is_clean_for_every_gpu_and_pcie_check() -> None:
    sources = Sources.for_node(str(A100))
    pcie = probe_pcie(sources.fs)
    assert len(pcie.gpus) == 8 and len(pcie.nics) == 8 and len(pcie.nvswitches) == 6
    assert pcie.gpus[0].link.current_width == 16 and pcie.gpus[0].link.current_speed == "2.5 GT/s PCIe"  # idle, not judged
    assert ("0000:03:00.0", "0000:04:00.0", ("0000:02:00.0", "0000:02:01.0")) in pcie.gpu_pairs  # the two downstream ports
    assert {gpu.iommu_domain for gpu in pcie.gpus} == {"identity"} and not pcie.problems
    for check in (acs_redirect_breaks_gpudirect_rdma, p2p_bandwidth_degraded):
        assert observed(check(pcie)) == []
    gpus, health, log = probe_gpus(sources.fs, sources.nvml), probe_gpu_health(sources.nvml), probe_kernel_log(sources.fs)
    answers = probe_pcie_p2p(sources.nvml, pcie, gpus)
    assert not answers.asked  # identity domains, no redirect: NVML is asked nothing more
    with pytest.raises(NotApplicable, match="NVLink through 6 NVSwitches"):
        list(p2p_transfers_hang_or_fault(pcie, answers, probe_job(sources.fs)))
    assert observed(gpu_unusable_by_driver(gpus, health, probe_job(sources.fs), Expectations(gpu_count=8))) == []
    assert [event.code for event in log.xids] == [31]  # an earlier job's MMU fault: GPU003's context, not a node fault
    assert observed(nccl_cuda_call_failed(health, log, gpus, probe_nvlink(sources.nvml))) == []


def test_gpu_trained_at_x8_is_present_and_idle_speed_is_not(a100: Path) -> None:
    (a100 / GPU0 / "current_link_width").write_text("8\n")
    patch_config(a100, GPU0, LNKSTA, 1 | 8 << 4)  # LnkSta as the kernel read it: 2.5 GT/s, x8
    found = pcie_verdicts(a100, p2p_bandwidth_degraded)
    assert [(s, st) for s, st, _ in found] == [("GPU 0000:03:00.0", Status.PRESENT)]
    assert "x8; speed 2.5 GT/s PCIe of 16.0 GT/s PCIe" in found[0][2]


def test_nic_trained_narrow_and_unreadable_widths(a100: Path) -> None:
    nic = a100 / "sys/bus/pci/devices/0000:45:00.0"
    (nic / "current_link_width").write_text("8\n")
    (a100 / GPU0 / "max_link_width").write_text("x16\n")
    (a100 / "sys/bus/pci/devices/0000:c4:00.0/current_link_width").write_text("0\n")
    found = {subject: (status, text) for subject, status, text in pcie_verdicts(a100, p2p_bandwidth_degraded)}
    assert found["NIC 0000:45:00.0 (mlx5_2)"][0] is Status.PRESENT
    assert found["GPU 0000:03:00.0"][0] is Status.UNKNOWN and "not a lane count" in found["GPU 0000:03:00.0"][1]
    assert found["GPU 0000:c4:00.0"][0] is Status.UNKNOWN and "link is down" in found["GPU 0000:c4:00.0"][1]
    for device in (a100 / "sys/bus/pci/devices").iterdir():
        for name in ("current_link_width", "max_link_width"):
            (device / name).unlink()
    with pytest.raises(Unknown, match="no link width readable for any of the 16 GPUs and NICs"):
        pcie_verdicts(a100, p2p_bandwidth_degraded)


def test_uncorrectable_ecc_and_persistence_off(a100: Path) -> None:
    edit_nvml(a100, "nvmlDeviceGetTotalEccErrors", {"5/1/0": {"result": 2}})
    edit_nvml(a100, "nvmlDeviceGetPersistenceMode", {str(i): {"result": 0} for i in range(8)})
    sources = Sources.for_node(str(a100))
    gpus, health = probe_gpus(sources.fs, sources.nvml), probe_gpu_health(sources.nvml)
    ecc = observed(nccl_cuda_call_failed(health, probe_kernel_log(sources.fs), gpus, probe_nvlink(sources.nvml)))
    assert [(s, st) for s, st, _ in ecc] == [("GPU5", Status.PRESENT)] and "2 uncorrectable ECC errors" in ecc[0][2]
    (warning,) = gpu_unusable_by_driver(gpus, health, probe_job(sources.fs), Expectations())
    assert warning.subject == "nvidia-persistenced" and warning.severity is Severity.WARNING
    assert "(8 of 8)" in warning.evidence[0].observed


def test_acs_redirect_between_two_gpus(a100: Path) -> None:
    patch_config(a100, GPU0_PORT, ACSCTL, 0x001D)  # the downstream port above GPU 0
    found = pcie_verdicts(a100, acs_redirect_breaks_gpudirect_rdma)  # it is on GPU 0's NIC paths too
    assert [s for s, _, _ in found] == ["bridge 0000:02:00.0"]
    with pytest.raises(NotApplicable, match="NVLink"):
        pcie_verdicts(a100, p2p_transfers_hang_or_fault)
    without_nvswitches(a100)
    offer_pcie_p2p(a100)
    found = pcie_verdicts(a100, p2p_transfers_hang_or_fault)
    assert [(s, st) for s, st, _ in found] == [("bridge 0000:02:00.0", Status.PRESENT)]
    assert "ReqRedir+ CmpltRedir+" in found[0][2] and "GPU 0000:03:00.0 <-> GPU 0000:04:00.0" in found[0][2]


def test_truncated_bridge_config_is_unknown_never_off(a100: Path) -> None:
    without_nvswitches(a100)
    offer_pcie_p2p(a100)
    truncated = a100 / GPU0_PORT / "config"
    truncated.write_bytes(truncated.read_bytes()[:64])  # what a reader without CAP_SYS_ADMIN gets
    for check in (p2p_transfers_hang_or_fault, acs_redirect_breaks_gpudirect_rdma):
        found = {s: (st, text) for s, st, text in pcie_verdicts(a100, check)}
        assert set(found) == {"bridge 0000:02:00.0"}
        assert found["bridge 0000:02:00.0"][0] is Status.UNKNOWN and "only 64 bytes" in found["bridge 0000:02:00.0"][1]
        assert "needs CAP_SYS_ADMIN" in found["bridge 0000:02:00.0"][1]


def test_translating_iommu_for_the_gpus(a100: Path) -> None:
    without_nvswitches(a100)
    offer_pcie_p2p(a100)
    assert pcie_verdicts(a100, p2p_transfers_hang_or_fault) == []
    for group in (a100 / "sys/kernel/iommu_groups").iterdir():
        (group / "type").write_text("DMA-FQ\n")
    (a100 / "proc/cmdline").write_text("BOOT_IMAGE=/boot/vmlinuz-5.15.0-1042-nvidia root=/dev/md0 ro amd_iommu=on\n")
    (found,) = pcie_verdicts(a100, p2p_transfers_hang_or_fault)
    assert found[0] == "IOMMU" and found[1] is Status.PRESENT and "DMA-FQ: GPU 0000:03:00.0 (group" in found[2]
    # Only GPU-to-GPU traffic over PCIe meets the translation: with no P2P on offer (GNS, as the
    # driver answers for GeForce boards) NCCL copies through host memory; unanswered is unknown.
    offer_pcie_p2p(a100, status=2)
    assert pcie_verdicts(a100, p2p_transfers_hang_or_fault) == []
    offer_pcie_p2p(a100, status=None)
    (unanswered,) = pcie_verdicts(a100, p2p_transfers_hang_or_fault)
    assert unanswered[:2] == ("IOMMU", Status.UNKNOWN) and "nvmlDeviceGetP2PStatus did not answer" in unanswered[2]
    offer_pcie_p2p(a100)
    for group in (a100 / "sys/kernel/iommu_groups").iterdir():
        (group / "type").unlink()  # a kernel before 5.11
    found_old = pcie_verdicts(a100, p2p_transfers_hang_or_fault)
    assert len(found_old) == 8 and all(st is Status.UNKNOWN and "Linux before 5.11" in text for _, st, text in found_old)
    (a100 / "proc/cmdline").write_text("BOOT_IMAGE=/boot/vmlinuz root=/dev/md0 ro iommu=pt\n")
    assert pcie_verdicts(a100, p2p_transfers_hang_or_fault) == []
    shutil.rmtree(a100 / "sys/class/iommu")
    (a100 / "sys/class/iommu").mkdir()
    assert pcie_verdicts(a100, p2p_transfers_hang_or_fault) == []  # no IOMMU: nothing translates


def test_pci003_not_applicable_in_a_vm_or_with_one_gpu(a100: Path) -> None:
    without_nvswitches(a100)
    cpuinfo = a100 / "proc/cpuinfo"
    cpuinfo.write_text(cpuinfo.read_text().replace("flags\t\t: fpu", "flags\t\t: fpu hypervisor"))
    with pytest.raises(NotApplicable, match="virtual machine"):
        pcie_verdicts(a100, p2p_transfers_hang_or_fault)
    for device in (a100 / "sys/bus/pci/devices").iterdir():
        if device.name != "0000:03:00.0" and (device / "vendor").read_text().strip() == "0x10de":
            device.unlink()
    with pytest.raises(NotApplicable, match="fewer than two"):
        pcie_verdicts(a100, p2p_transfers_hang_or_fault)


def test_cli_on_planted_a100(run_cli: Runner, a100: Path) -> None:
    (a100 / GPU0 / "current_link_width").write_text("8\n")
    edit_nvml(a100, "nvmlDeviceGetTotalEccErrors", {"2/1/0": {"result": 1}})
    edit_nvml(a100, "nvmlDeviceGetPersistenceMode", {"7": {"result": 0}})
    without_nvswitches(a100)
    offer_pcie_p2p(a100)
    patch_config(a100, "sys/devices/pci0000:80/0000:80:01.1/0000:81:00.0/0000:82:01.0", ACSCTL, 0x000C)
    result = run_cli("node", "--root", str(a100), "--format", "json", "--select", "GPU,PCI,GDR003,TOPO005", "--profile", "prolog")
    report = json.loads(result.stdout)
    present = {(f["id"], f["subject"], f["severity"]) for f in report["findings"] if f["status"] == "present"}
    assert present == {
        ("PCI002", "GPU 0000:03:00.0", "warning"), ("GPU002", "GPU2", "error"), ("GPU001", "nvidia-persistenced", "warning"),
        ("PCI003", "bridge 0000:82:01.0", "error"), ("PCI001", "bridge 0000:82:01.0", "error"),
    }
    assert result.returncode == 2 and {f["status"] for f in report["findings"]} <= {"present", "absent"}
