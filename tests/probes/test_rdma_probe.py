"""The rdma and efa probes: sysfs parsers on short strings, whole facts on recorded roots, the
RDMA device -> netdev mapping, NVSwitch management functions, and device-node replay."""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

import pytest

from preflight.probes.efa import probe_efa
from preflight.probes.gpudirect import DeviceNode, JobIdentity
from preflight.probes.rdma import PortRate, Problem, RdmaDevice, RdmaFacts, RdmaPort, natural_key, parse_hex, parse_link_layer, parse_numbered, parse_pci_link, parse_rate, probe_rdma
from preflight.sources import NodeFS, SourceError

from conftest import EXAMPLE_ROOT, bare_node

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "nodes"
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "nodes" / "hgx-h100"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("400 Gb/sec (4X NDR)\n", PortRate(400.0, 4, "NDR")),
        ("200 Gb/sec (2X NDR)", PortRate(200.0, 2, "NDR")),
        ("56 Gb/sec (4X FDR)", PortRate(56.0, 4, "FDR")),
        ("2.5 Gb/sec (1X)", PortRate(2.5, 1, "SDR")),  # SDR has no speed name
        ("10 Gb/sec (4X)", PortRate(10.0, 4, "SDR")),
        ("800 Gb/sec (4X XDR)", PortRate(800.0, 4, "XDR")),
        ("fast", None),
        ("400 Gb/sec", None),
    ],
)
def test_parse_rate(text: str, expected: PortRate | None) -> None:
    assert parse_rate(text) == expected


def test_small_parsers() -> None:
    assert parse_numbered("4: ACTIVE\n") == (4, "ACTIVE") and parse_numbered("7: unspecified") == (7, "unspecified")
    assert parse_numbered("ACTIVE") is None and parse_numbered("x: ACTIVE") is None
    assert parse_hex("0x1a\n") == 26 and parse_hex("0x0") == 0 and parse_hex("26") is None and parse_hex("0xzz") is None
    assert parse_link_layer("Ethernet\n") == "Ethernet" and parse_link_layer("IB") is None
    assert parse_pci_link("../../../0000:1a:00.0") == "0000:1a:00.0" and parse_pci_link("../../../eth0") is None
    assert sorted(["mlx5_10", "mlx5_2", "mlx5_bond_0", "mlx5_1"], key=natural_key) == ["mlx5_1", "mlx5_2", "mlx5_10", "mlx5_bond_0"]


def test_whole_facts_of_the_container_root() -> None:
    facts = probe_rdma(NodeFS(str(FIXTURES / "container-roce")))

    def device(index: int, bus: str) -> RdmaDevice:
        path = f"/sys/class/infiniband/mlx5_{index}"
        port = RdmaPort(
            f"mlx5_{index}", 1, f"{path}/ports/1", 4, "ACTIVE", 5, "LinkUp", PortRate(200.0, 4, "HDR"), "Ethernet",
            0, 0, (f"net{index + 1}",), "gid_attrs/ndevs", (),
        )
        return RdmaDevice(f"mlx5_{index}", path, "CA", "20.39.1002", "MT4123", f"0000:{bus}:00.0", "0x15b3", False,
                          False, (), f"uverbs{index}", (port,), ())

    assert facts == RdmaFacts(
        devices=(device(0, "1a"), device(1, "3c"), device(2, "9c")),
        verbs_class_present=True,
        dev_infiniband=None,
        device_nodes=(),
        job_identity=JobIdentity(1001, (1001,), "/proc/self/status"),
        problems=(),
    )


def test_netdevs_from_gid_table_first_then_pci_function() -> None:
    facts = probe_rdma(NodeFS(str(FIXTURES / "degraded-b200")))
    bond = facts.device("mlx5_10")
    assert bond is not None and bond.netdevs == ("ens10f0np0",)
    assert (bond.ports[0].netdevs, bond.ports[0].netdev_source) == (("bond0",), "gid_attrs/ndevs")
    ib = facts.device("mlx5_0")
    assert ib is not None and (ib.ports[0].netdevs, ib.ports[0].netdev_source) == (("ibp26s0",), "device/net")


def test_multi_port_device_maps_netdevs_by_dev_port(tmp_path: Path) -> None:
    device = tmp_path / "sys/devices/pci0000:00/0000:00:01.0/0000:03:00.0"
    for number in (1, 2):
        (device / f"infiniband/mlx4_0/ports/{number}").mkdir(parents=True)
        for name, value in (("state", "4: ACTIVE"), ("phys_state", "5: LinkUp"), ("rate", "56 Gb/sec (4X FDR)"),
                            ("link_layer", "InfiniBand"), ("lid", "0x3"), ("sm_lid", "0x1")):
            (device / f"infiniband/mlx4_0/ports/{number}/{name}").write_text(value + "\n")
        (device / f"net/ib{number - 1}").mkdir(parents=True)
        (device / f"net/ib{number - 1}/dev_port").write_text(f"{number - 1}\n")
    for name, value in (("node_type", "1: CA"), ("fw_ver", "2.42.5000")):
        (device / f"infiniband/mlx4_0/{name}").write_text(value + "\n")
    (device / "vendor").write_text("0x15b3\n")
    os.symlink("../../../0000:03:00.0", device / "infiniband/mlx4_0/device")
    (tmp_path / "sys/class/infiniband").mkdir(parents=True)
    os.symlink("../../devices/pci0000:00/0000:00:01.0/0000:03:00.0/infiniband/mlx4_0", tmp_path / "sys/class/infiniband/mlx4_0")
    facts = probe_rdma(NodeFS(str(tmp_path)))
    assert [port.netdevs for port in facts.devices[0].ports] == [("ib0",), ("ib1",)]
    assert facts.devices[0].nvswitch_management is False  # no vpd: not a management function
    assert facts.devices[0].problems == ()


def test_odd_entries_under_ports_and_in_names_do_not_sink_the_probe(tmp_path: Path) -> None:
    """'³' passes str.isdigit() but not int(): one such entry must not turn every device unknown."""
    root = tmp_path / "node"
    shutil.copytree(FIXTURES / "degraded-b200", root, symlinks=True)
    ports = (root / "sys/class/infiniband/mlx5_0").resolve() / "ports"
    (ports / "³").mkdir()
    (ports / "1/gid_attrs/ndevs").mkdir(parents=True)
    (ports / "1/gid_attrs/ndevs/²").write_text("ibp26s0\n")
    facts = probe_rdma(NodeFS(str(root)))
    mlx5_0 = facts.device("mlx5_0")
    assert mlx5_0 is not None and [port.number for port in mlx5_0.ports] == [1] and len(facts.devices) == 12
    assert natural_key("mlx5_²") == ((-1, "mlx"), (5, ""), (-1, "_²"))  # '²' is no number to sort by


def test_nvswitch_management_functions_are_recognised_by_vpd() -> None:
    facts = probe_rdma(NodeFS(str(FIXTURES / "degraded-b200")))
    management = {device.name for device in facts.devices if device.nvswitch_management}
    assert management == {"mlx5_4", "mlx5_5"}
    assert [device.name for device in facts.data_devices][:5] == ["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3", "mlx5_6"]


def test_efa_devices_and_their_libraries() -> None:
    fs = NodeFS(str(FIXTURES / "efa-p4d"))
    facts = probe_rdma(fs)
    assert [d.name for d in facts.devices] == ["rdmap16s27", "rdmap32s27", "rdmap144s27", "rdmap160s27"]
    assert all(d.efa and d.node_type == "unspecified" and d.ports[0].link_layer == "Unknown" for d in facts.devices)
    efa = probe_efa(fs)
    assert efa is not None and efa.libraries == ("/opt/amazon/efa/lib/libfabric.so.1",)
    assert efa.library_dirs[:2] == ("/usr/local/cuda/lib64", "/opt/amazon/efa/lib")  # LD_LIBRARY_PATH, then ld.so.conf.d
    assert probe_efa(NodeFS(str(EXAMPLE))) is None


def test_efa_gpu_memory_provider_from_device_p2p_or_gdr(tmp_path: Path) -> None:
    """Amazon's efa.ko says which GPU-memory provider it can use in device/p2p (empty: none);
    older releases say device/gdr 1; the kernel's own driver has neither. ConnectX: never read."""
    root = tmp_path / "node"
    shutil.copytree(FIXTURES / "efa-p4d", root, symlinks=True)
    devices = root / "sys/class/infiniband"
    (devices / "rdmap16s27/device/p2p").write_text("NVIDIA\n")
    (devices / "rdmap32s27/device/p2p").write_text("\n")
    (devices / "rdmap144s27/device/gdr").write_text("1\n")
    facts = probe_rdma(NodeFS(str(root)))
    assert [d.efa_gpu_memory for d in facts.devices] == ["NVIDIA", "", "NVIDIA", None]
    assert all(d.efa_gpu_memory is None for d in probe_rdma(NodeFS(str(EXAMPLE))).devices)


def test_device_nodes_and_job_identity_of_the_example() -> None:
    facts = probe_rdma(NodeFS(str(EXAMPLE)))
    assert facts.dev_infiniband == ("rdma_cm", *(f"uverbs{i}" for i in range(8)))
    assert facts.node("/dev/infiniband/uverbs3") == DeviceNode("/dev/infiniband/uverbs3", stat.S_IFCHR | 0o666, 0, 0)
    assert [d.uverbs for d in facts.devices] == [f"uverbs{i}" for i in range(8)]
    assert [d.pci_address for d in facts.devices][:2] == ["0000:1a:00.0", "0000:2c:00.0"]
    assert facts.job_identity == JobIdentity(1001, (1001, 996), "SLURM_JOB_UID, SLURM_JOB_GID, /etc/group")


def test_device_recording_answers_stat_for_dev_paths_only(tmp_path: Path) -> None:
    (tmp_path / ".preflight").mkdir()
    (tmp_path / "dev").mkdir()
    (tmp_path / "dev/gdrdrv").write_text("")
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc/hosts").write_text("")
    recording = {"format": "preflight-devices/1", "nodes": {"/dev/gdrdrv": {"type": "char", "mode": "0660", "uid": 0, "gid": 44}}}
    (tmp_path / ".preflight/devices.json").write_text(json.dumps(recording))
    fs = NodeFS(str(tmp_path))
    node = fs.stat("/dev/gdrdrv")
    assert node is not None and stat.S_ISCHR(node.mode) and stat.S_IMODE(node.mode) == 0o660 and node.gid == 44
    assert fs.stat("/dev/null") is None
    (tmp_path / ".preflight/devices.json").write_text("{not json")
    broken = NodeFS(str(tmp_path))
    with pytest.raises(SourceError, match="devices.json: malformed recording"):
        broken.stat("/dev/gdrdrv")
    hosts = broken.stat("/etc/hosts")
    assert hosts is not None and stat.S_ISREG(hosts.mode)  # a broken recording only concerns /dev


def test_unreadable_class_directory_is_a_problem_not_an_empty_node(tmp_path: Path) -> None:
    (tmp_path / "sys/class").mkdir(parents=True)
    os.symlink("infiniband", tmp_path / "sys/class/infiniband")
    facts = probe_rdma(NodeFS(str(tmp_path)))
    assert facts.devices == () and facts.problems[0].path == "/sys/class/infiniband"
    assert "ELOOP" in facts.problems[0].reason or "symbolic links" in facts.problems[0].reason
    assert Problem("/x", "empty").__str__() == "/x: empty"


def test_ipoib_mode_is_recorded_for_infiniband_ports(tmp_path: Path) -> None:

    from preflight.probes.rdma import probe_rdma
    from preflight.sources import NodeFS

    example = Path(__file__).resolve().parents[2] / "examples" / "nodes" / "hgx-h100"
    root = tmp_path / "node"
    shutil.copytree(example, root, symlinks=True)
    facts = probe_rdma(NodeFS(str(root)))
    assert {port.ipoib_mode for device in facts.devices for port in device.ports} == {"datagram"}
    (root / "sys/class/net/ibp26s0/mode").write_text("connected\n")
    facts = probe_rdma(NodeFS(str(root)))
    modes = {port.subject: port.ipoib_mode for device in facts.devices for port in device.ports}
    assert modes["mlx5_0/1"] == "connected" and modes["mlx5_1/1"] == "datagram"


def test_mlx5_driver_version_tells_ofed_from_inbox(tmp_path: Path) -> None:
    """MLNX_OFED/DOCA build mlx5_core with a version; the in-tree driver has none. Not loaded is
    None, and so is an unreadable file, which is also a problem (never taken for inbox)."""
    bare_node(tmp_path)
    assert probe_rdma(NodeFS(str(tmp_path))).mlx5_driver_version is None  # not loaded
    module = tmp_path / "sys/module/mlx5_core"
    module.mkdir(parents=True)
    (module / "refcnt").write_text("1\n")
    assert probe_rdma(NodeFS(str(tmp_path))).mlx5_driver_version == ""  # inbox
    (module / "version").write_text("24.10-1.1.4\n")
    assert probe_rdma(NodeFS(str(tmp_path))).mlx5_driver_version == "24.10-1.1.4"
    (module / "version").unlink()
    (module / "version").mkdir()  # EISDIR: unreadable
    facts = probe_rdma(NodeFS(str(tmp_path)))
    assert facts.mlx5_driver_version is None
    assert [problem.path for problem in facts.problems] == ["/sys/module/mlx5_core/version"]


def test_ib_uverbs_not_loaded_only_from_a_captured_sys_module(tmp_path: Path) -> None:
    """Missing is not empty: without /sys/class/infiniband_verbs, ib_uverbs is "not loaded" only
    when /sys/module was captured without it; otherwise unknown, and the devices' own
    infiniband_verbs/ directories answer for a capture that skipped the class directory."""
    root = bare_node(tmp_path / "node")
    device = root / "sys/devices/pci0000:00/0000:00:02.0/infiniband/mlx5_0"
    (device / "ports/1").mkdir(parents=True)
    (root / "sys/class/infiniband").mkdir()
    os.symlink("../../devices/pci0000:00/0000:00:02.0/infiniband/mlx5_0", root / "sys/class/infiniband/mlx5_0")
    assert probe_rdma(NodeFS(str(root))).verbs_class_present is False  # /sys/module has no ib_uverbs
    (root / "sys/module/ib_uverbs").mkdir()
    facts = probe_rdma(NodeFS(str(root)))
    assert facts.verbs_class_present is None and any(p.path == "/sys/class/infiniband_verbs" for p in facts.problems)
    shutil.rmtree(root / "sys/module")
    assert probe_rdma(NodeFS(str(root))).verbs_class_present is None
    verbs = root / "sys/devices/pci0000:00/0000:00:02.0/infiniband_verbs/uverbs0"
    verbs.mkdir(parents=True)
    (verbs / "ibdev").write_text("mlx5_0\n")
    os.symlink("../../../0000:00:02.0", device / "device")
    facts = probe_rdma(NodeFS(str(root)))
    assert facts.verbs_class_present is True and facts.devices[0].uverbs == "uverbs0"


def test_functions_of_one_adapter_are_counted() -> None:
    """A dual-port card is two PCI functions of one bus:device: each of its RDMA devices knows the
    adapter has two, so IB009 compares it with like cards only."""
    dual = probe_rdma(NodeFS(str(FIXTURES / "h800-dual-port")))
    assert [(d.pci_address, d.adapter_functions) for d in dual.devices] == [
        ("0000:1a:00.0", 2), ("0000:1a:00.1", 2), ("0000:9c:00.0", 2), ("0000:9c:00.1", 2)]
    assert {d.adapter_functions for d in probe_rdma(NodeFS(str(EXAMPLE_ROOT))).devices} == {1}
