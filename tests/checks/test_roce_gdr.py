"""ROCE002 (GPUDirect RDMA not used over RoCE) on copies of the recorded HGX H800 root
(tests/fixtures/nodes/h800-dual-port: two GPUs, each under a PCIe switch with a dual-port RoCE
NIC, NVSwitches on the bus), and NCCL's NCCL_NET_GDR_LEVEL parsing (preflight.nccl.gdr)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from msgspec.structs import replace

from preflight.checks.roce import roce_gpudirect_rdma_not_used
from preflight.model import NotApplicable, Status, Unknown
from preflight.nccl.gdr import gdr_level, within
from preflight.probes.job import probe_job
from preflight.probes.nvlink import GpuNvlinks, NvlinkFacts
from preflight.probes.pcie import probe_pcie
from preflight.probes.rdma import probe_rdma
from preflight.sources import NodeFS

H800 = Path(__file__).resolve().parents[1] / "fixtures" / "nodes" / "h800-dual-port"
NO_NVLINK = NvlinkFacts((GpuNvlinks(0, "H800", (), (), 0, ""), GpuNvlinks(1, "H800", (), (), 0, "")), "", "")
NVML_DOWN = NvlinkFacts((), "NVML_ERROR_DRIVER_NOT_LOADED", "")


def h800(tmp_path: Path, environ: dict[str, str], nvswitches: bool = True, arm: bool = False) -> Path:
    root = tmp_path / "root"
    shutil.copytree(H800, root, symlinks=True)
    (root / "proc/self/environ").write_bytes(b"".join(f"{k}={v}".encode() + b"\0" for k, v in {"SLURM_JOB_ID": "1", **environ}.items()))
    if not nvswitches:  # a PCIe host: no NVSwitch bridges on the bus
        for bdf in ("0000:05:00.0", "0000:06:00.0"):
            (root / "sys/bus/pci/devices" / bdf).unlink()
    if arm:
        (root / "proc/cpuinfo").write_text("processor\t: 0\nBogoMIPS\t: 2000.00\nCPU implementer\t: 0x41\nCPU part\t: 0xd4f\n\n")
    return root


def verdicts(root: Path, nvlink: NvlinkFacts = NO_NVLINK) -> list[tuple[str, Status, str]]:
    fs = NodeFS(str(root))
    found = roce_gpudirect_rdma_not_used(probe_pcie(fs), probe_rdma(fs), nvlink, probe_job(fs))
    return [(o.subject, o.status, " | ".join(f"{e.source}: {e.observed}" for e in o.evidence) + o.reason) for o in found]


@pytest.mark.parametrize(
    ("value", "level"),
    [(None, None), ("PHB", "PHB"), ("SYS", "SYS"), ("LOC", "LOC"), ("phb", None), ("NODE", None), ("", None),
     ("0", "LOC"), ("1", "PIX"), ("2", "PXB"), ("3", "PHB"), ("4", "SYS"), ("9", "SYS"), ("08", "LOC"), ("3abc", "PHB")],
)
def test_gdr_level_reads_names_exactly_and_old_numbers(value: str | None, level: str | None) -> None:
    """ncclGetLevel: strcmp against the path names (upper case only), else a leading digit is
    an old level (strtol, base 0; above 5 clamps to SYS); anything else leaves the default."""
    assert gdr_level(value) == level


def test_within_compares_in_nccls_path_order() -> None:
    assert within("PIX", "PXB") and within("PXB", "PXB") and not within("PHB", "PXB")
    assert within("PHB", "P2C") is False and within("PXB", "P2C")  # NCCL 2.29+ default on PCIe hosts
    assert not within("PIX", "LOC")


def test_each_gpu_beside_its_nic_is_absent(tmp_path: Path) -> None:
    assert verdicts(h800(tmp_path, {})) == []


def test_hca_filter_leaves_a_gpu_behind_the_cpu_without_nvlink(tmp_path: Path) -> None:
    found = verdicts(h800(tmp_path, {"NCCL_IB_HCA": "mlx5_0,mlx5_1"}, nvswitches=False))
    assert [(subject, status) for subject, status, _ in found] == [("GPU 0000:9a:00.0", Status.PRESENT)]
    assert "mlx5_0 (0000:1a:00.0), mlx5_1 (0000:1a:00.1), path PHB" in found[0][2]
    assert "NCCL_NET_GDR_LEVEL: unset" in found[0][2] and "NCCL_IB_HCA: 'mlx5_0,mlx5_1'" in found[0][2]


def test_pxn_over_nvswitch_keeps_gdr_unless_pxn_is_disabled(tmp_path: Path) -> None:
    """A GPU without a near NIC sends through its NVLink peer beside one (PXN), which uses GDR."""
    assert verdicts(h800(tmp_path / "a", {"NCCL_IB_HCA": "mlx5_0,mlx5_1"})) == []
    found = verdicts(h800(tmp_path / "b", {"NCCL_IB_HCA": "mlx5_0,mlx5_1", "NCCL_PXN_DISABLE": "1"}))
    assert [(s, st) for s, st, _ in found] == [("GPU 0000:9a:00.0", Status.PRESENT)]
    assert "NCCL_PXN_DISABLE: '1'" in found[0][2]


def test_unknown_nvlink_makes_the_relay_case_unknown(tmp_path: Path) -> None:
    found = verdicts(h800(tmp_path, {"NCCL_IB_HCA": "mlx5_0,mlx5_1"}, nvswitches=False), NVML_DOWN)
    assert [(s, st) for s, st, _ in found] == [("GPU 0000:9a:00.0", Status.UNKNOWN)]


@pytest.mark.parametrize(("level", "flagged"), [("LOC", 2), ("0", 2), ("PIX", 0), ("PHB", 0), ("phb", 0)])
def test_a_gdr_level_below_the_path_disables_it_for_every_gpu(tmp_path: Path, level: str, flagged: int) -> None:
    found = verdicts(h800(tmp_path, {"NCCL_NET_GDR_LEVEL": level}))
    assert [st for _, st, _ in found] == [Status.PRESENT] * flagged


def test_a_forced_phb_level_accepts_the_cpu_path(tmp_path: Path) -> None:
    assert verdicts(h800(tmp_path, {"NCCL_IB_HCA": "mlx5_0,mlx5_1", "NCCL_NET_GDR_LEVEL": "PHB"}, nvswitches=False)) == []


def test_gdr_read_switched_off(tmp_path: Path) -> None:
    assert [(s, st) for s, st, _ in verdicts(h800(tmp_path, {"NCCL_NET_GDR_READ": "0"}))] == [("NCCL_NET_GDR_READ", Status.PRESENT)]


def test_arm_host_phb_is_unknown_not_present(tmp_path: Path) -> None:
    found = verdicts(h800(tmp_path, {"NCCL_IB_HCA": "mlx5_0,mlx5_1"}, nvswitches=False, arm=True))
    assert [(s, st) for s, st, _ in found] == [("GPU 0000:9a:00.0", Status.UNKNOWN)]
    assert "NVLink-C2C" in found[0][2]


def test_a_gpu_with_a_data_direct_function_in_its_switch_has_its_nic_there(tmp_path: Path) -> None:
    """A Grace tray's ConnectX-8 Data Direct function (class 0x080100) under the GPU's own switch:
    NCCL places the NIC there (PXB) unless NCCL_IB_DATA_DIRECT=0 keeps the NIC's own function."""
    for name, environ in (("on", {}), ("off", {"NCCL_IB_DATA_DIRECT": "0"})):
        root = h800(tmp_path / name, {"NCCL_IB_HCA": "mlx5_0,mlx5_1", **environ}, nvswitches=False, arm=True)
        function = root / "sys/devices/pci0000:97/0000:97:01.0/0000:99:00.0/0000:9d:00.0"
        function.mkdir(parents=True)
        (function / "vendor").write_text("0x15b3\n")
        (function / "class").write_text("0x080100\n")
        (root / "sys/bus/pci/devices/0000:9d:00.0").symlink_to("../../../devices/pci0000:97/0000:97:01.0/0000:99:00.0/0000:9d:00.0")
        found = verdicts(root)
        assert [(s, st) for s, st, _ in found] == ([] if name == "on" else [("GPU 0000:9a:00.0", Status.UNKNOWN)])


def test_not_applicable_without_roce_or_with_the_ib_transport_off(tmp_path: Path) -> None:
    with pytest.raises(NotApplicable, match="NCCL_IB_DISABLE"):
        verdicts(h800(tmp_path / "a", {"NCCL_IB_DISABLE": "1"}))
    with pytest.raises(NotApplicable, match="NCCL_NET=Socket"):
        verdicts(h800(tmp_path / "b", {"NCCL_NET": "Socket"}))
    with pytest.raises(NotApplicable, match="no ACTIVE RoCE port"):
        verdicts(h800(tmp_path / "c", {"NCCL_IB_HCA": "mlx5_9"}))


def test_unreadable_job_environment_is_unknown(tmp_path: Path) -> None:
    fs = NodeFS(str(h800(tmp_path, {})))
    job = replace(probe_job(fs), environ={}, environ_error="permission denied (EACCES)")
    with pytest.raises(Unknown, match="EACCES"):
        list(roce_gpudirect_rdma_not_used(probe_pcie(fs), probe_rdma(fs), NO_NVLINK, job))


def two_sockets(root: Path) -> None:
    for node in ("node0", "node1"):
        (root / "sys/devices/system/node" / node).mkdir(parents=True)


def test_an_unplaced_far_nic_does_not_hide_a_near_one(tmp_path: Path) -> None:
    """Without numa_node on a two-socket node the cross-root paths are unknown; a GPU with a NIC
    under its own switch is still decided, one without is unknown."""
    root = h800(tmp_path, {"NCCL_PXN_DISABLE": "1"}, nvswitches=False)
    two_sockets(root)
    for bdf in ("0000:18:00.0", "0000:1a:00.0", "0000:1a:00.1", "0000:9a:00.0", "0000:9c:00.0", "0000:9c:00.1"):
        (root / "sys/bus/pci/devices" / bdf / "numa_node").write_text("-1\n")
    assert verdicts(root) == []
    hca_root = h800(tmp_path / "hca", {"NCCL_PXN_DISABLE": "1", "NCCL_IB_HCA": "mlx5_0,mlx5_1"}, nvswitches=False)
    two_sockets(hca_root)
    for bdf in ("0000:18:00.0", "0000:1a:00.0", "0000:1a:00.1", "0000:9a:00.0"):
        (hca_root / "sys/bus/pci/devices" / bdf / "numa_node").write_text("-1\n")
    assert [(s, st) for s, st, _ in verdicts(hca_root)] == [("GPU 0000:9a:00.0", Status.UNKNOWN)]
