"""PCI001: ACS redirect between a GPU and its nearest RDMA NIC, on recorded PCI trees built with
real config-space layouts (extended capability chains from offset 0x100); TOPO005; PCI002 and
PCI003 on hand-built facts (the recorded A100 root has the rest: tests/nodes/test_a100_node.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from msgspec.structs import replace

from preflight.probes.job import JobFacts, NcclConfFile, probe_job
from preflight.probes.pcie import AcsRegisters, Bridge, PcieFacts, PciEndpoint, PcieLink, acs_ports_between, bridges_between, device_chain, entry_port, parse_acs, parse_ats, parse_width, probe_pcie
from preflight.checks.pci import acs_redirect_breaks_gpudirect_rdma, p2p_bandwidth_degraded, p2p_transfers_hang_or_fault
from preflight.checks.topo import gpu_hca_cross_numa_gdr
from preflight.model import NotApplicable, Status, Unknown, Unread
from preflight.probes.gpus import probe_gpus
from preflight.probes.pcie_p2p import P2pStatus, PcieP2pFacts, probe_pcie_p2p
from preflight.sources import NodeFS, Sources

from conftest import bare_node, write

AER, ACS = 0x0001, 0x000D


def config_space(acs_control: int | None, size: int = 4096, acs_capability: int = 0x005F) -> bytes:
    """A bridge's config space: a type-1 header, then AER at 0x100 and ACS at 0x148."""
    data = bytearray(size)
    data[0:4] = (0x10B5 | 0xC030 << 16).to_bytes(4, "little")
    if size > 0x150:
        next_offset = 0x148 if acs_control is not None else 0
        data[0x100:0x104] = (AER | 1 << 16 | next_offset << 20).to_bytes(4, "little")
        if acs_control is not None:
            data[0x148:0x14C] = (ACS | 1 << 16).to_bytes(4, "little")
            data[0x14C:0x14E] = acs_capability.to_bytes(2, "little")
            data[0x14E:0x150] = acs_control.to_bytes(2, "little")
    return bytes(data)


def pci(root: Path, chain: list[str], vendor: str, klass: str, config: bytes | None = None, rdma: bool = False) -> None:
    """A function at the end of ``chain`` (root port first) with its /sys/bus/pci/devices link."""
    device = f"/sys/devices/pci{chain[0][:7]}/" + "/".join(chain)
    write(root, f"{device}/vendor", vendor + "\n")
    write(root, f"{device}/class", klass + "\n")
    if config is not None:
        write(root, f"{device}/config", config)
    if rdma:
        (root / device.lstrip("/") / "infiniband" / "mlx5_0").mkdir(parents=True)
    link = root / "sys/bus/pci/devices" / chain[-1]
    link.parent.mkdir(parents=True, exist_ok=True)
    if not link.is_symlink():
        os.symlink("../../.." + device[len("/sys") :], link)


def hgx_tree(root: Path, switch_acs: int | None = 0, config_size: int = 4096, hypervisor: bool = False) -> Path:
    """Root port 15:01.0 -> switch upstream 16:00.0 -> downstream ports 17:00.0 / 17:01.0 ->
    GPU 18:00.0 and NIC 1a:00.0; a second GPU under another root port with no NIC."""
    bare_node(root)
    bridge = config_space(0x001D, config_size)  # root ports keep ACS on, as with an IOMMU
    pci(root, ["0000:15:01.0"], "0x8086", "0x060400", bridge)
    pci(root, ["0000:15:01.0", "0000:16:00.0"], "0x10b5", "0x060400", config_space(switch_acs, config_size))
    pci(root, ["0000:15:01.0", "0000:16:00.0", "0000:17:00.0"], "0x10b5", "0x060400", config_space(switch_acs, config_size))
    pci(root, ["0000:15:01.0", "0000:16:00.0", "0000:17:01.0"], "0x10b5", "0x060400", config_space(0, config_size))
    pci(root, ["0000:15:01.0", "0000:16:00.0", "0000:17:00.0", "0000:18:00.0"], "0x10de", "0x030200")
    pci(root, ["0000:15:01.0", "0000:16:00.0", "0000:17:01.0", "0000:1a:00.0"], "0x15b3", "0x020700", rdma=True)
    pci(root, ["0000:97:01.0"], "0x8086", "0x060400", bridge)
    pci(root, ["0000:97:01.0", "0000:9a:00.0"], "0x10de", "0x030200")
    flags = "fpu vme de pse" + (" hypervisor" if hypervisor else "") + " lahf_lm"
    write(root, "/proc/cpuinfo", f"processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t\t: {flags}\n\n")
    write(root, "/proc/cmdline", "BOOT_IMAGE=/vmlinuz root=/dev/sda1 intel_iommu=on iommu=pt\n")
    (root / "sys/class/iommu/dmar0").mkdir(parents=True)
    return root


def verdicts(root: Path) -> list[tuple[str, Status, str]]:
    facts = probe_pcie(NodeFS(str(root)))
    return [(o.subject, o.status, " ".join(e.observed for e in o.evidence) + o.reason) for o in acs_redirect_breaks_gpudirect_rdma(facts)]


def test_parse_acs_walks_the_capability_chain() -> None:
    assert parse_acs(config_space(0x001D)) == AcsRegisters(0x005F, 0x001D)
    assert parse_acs(config_space(None)) is None
    with pytest.raises(ValueError, match="needs CAP_SYS_ADMIN"):
        parse_acs(config_space(0x001D, size=64))
    looping = bytearray(config_space(None))
    looping[0x100:0x104] = (AER | 0x100 << 20).to_bytes(4, "little")  # points at itself
    assert parse_acs(bytes(looping)) is None
    assert parse_acs(b"\xff" * 4096) is None


def test_parse_ats_reads_the_enable_bit() -> None:
    assert parse_ats(nic_config(0x8000)) == (True, "ATS Control 0x8000: Enable+")
    assert parse_ats(nic_config(0x0005)) == (False, "ATS Control 0x0005: Enable-")
    assert parse_ats(nic_config(None)) == (False, "no ATS capability")
    with pytest.raises(ValueError, match="needs CAP_SYS_ADMIN"):
        parse_ats(nic_config(0x8000, size=64))


def test_path_between_devices_turns_around_at_the_common_bridge() -> None:
    chain = device_chain("../../../devices/pci0000:15/0000:15:01.0/0000:16:00.0/0000:17:00.0/0000:18:00.0")
    assert chain == ("0000:15:01.0", "0000:16:00.0", "0000:17:00.0", "0000:18:00.0")
    nic = ("0000:15:01.0", "0000:16:00.0", "0000:17:01.0", "0000:1a:00.0")
    assert bridges_between(chain, nic) == ("0000:16:00.0", "0000:17:00.0", "0000:17:01.0")
    assert bridges_between(chain, ("0000:97:01.0", "0000:9a:00.0")) is None
    assert entry_port(nic, chain) == "0000:17:01.0" and entry_port(chain, nic) == "0000:17:00.0"
    assert entry_port(chain, ("0000:97:01.0", "0000:9a:00.0")) is None
    assert entry_port(("0000:15:01.0", "0000:16:00.0"), nic) is None  # right under the turnaround
    # Domains above 0xffff print with more digits (Intel VMD's 10000 and up; a capture's trailing
    # slash, as hwloc's test roots have): still a device, not a target "without its own name".
    assert device_chain("../../../devices/pci10000:00/10000:00:02.0/10000:01:00.0/") == ("10000:00:02.0", "10000:01:00.0")


def test_clean_switch_is_absent_even_with_acs_on_root_ports(tmp_path: Path) -> None:
    assert verdicts(hgx_tree(tmp_path)) == []


def test_redirect_on_the_switch_is_present_with_evidence(tmp_path: Path) -> None:
    found = verdicts(hgx_tree(tmp_path, switch_acs=0x001D))
    # The switch's upstream port 16:00.0 carries the same bits, but the transfer turns around
    # between its downstream ports: ACS there acts only on a multi-function device's functions.
    assert [subject for subject, _, _ in found] == ["bridge 0000:17:00.0"]
    subject, status, text = found[0]
    assert status is Status.PRESENT
    assert "ReqRedir+ CmpltRedir+" in text and "GPU 0000:18:00.0 <-> NIC 0000:1a:00.0" in text
    assert "iommu=pt does not change that" in text


def test_only_the_ports_where_the_transfer_turns_around_decide(tmp_path: Path) -> None:
    """A NIC behind its card's own switch (a BlueField-3's, a ConnectX-8's): the card's ports pass
    the transfer up or down, and their ACS redirect bits act on requests for another port of that
    inner switch only; the outer switch's downstream ports, where GPU and NIC traffic meet, decide."""
    root = hgx_tree(tmp_path)
    nic_path = ["0000:15:01.0", "0000:16:00.0", "0000:17:01.0"]
    (root / "sys/bus/pci/devices/0000:1a:00.0").unlink()
    pci(root, [*nic_path, "0000:1a:00.0"], "0x15b3", "0x060400", config_space(0, 4096))  # the card's upstream port
    pci(root, [*nic_path, "0000:1a:00.0", "0000:1b:00.0"], "0x15b3", "0x060400", config_space(0x001D, 4096))
    pci(root, [*nic_path, "0000:1a:00.0", "0000:1b:00.0", "0000:1c:00.0"], "0x15b3", "0x020700", rdma=True)
    assert verdicts(root) == []
    gpu = ("0000:15:01.0", "0000:16:00.0", "0000:17:00.0", "0000:18:00.0")
    nic = (*nic_path, "0000:1a:00.0", "0000:1b:00.0", "0000:1c:00.0")
    assert acs_ports_between(gpu, nic) == ("0000:17:00.0", "0000:17:01.0")
    assert bridges_between(gpu, nic) == ("0000:16:00.0", "0000:17:00.0", "0000:17:01.0", "0000:1a:00.0", "0000:1b:00.0")
    # Redirect where they meet is still found.
    write(root, "/sys/devices/pci0000:15/0000:15:01.0/0000:16:00.0/0000:17:01.0/config", config_space(0x001D, 4096))
    assert [subject for subject, _, _ in verdicts(root)] == ["bridge 0000:17:01.0"]


def nic_config(ats_control: int | None, size: int = 4096) -> bytes:
    """A ConnectX function's config space: a type-0 header, then AER at 0x100 and (when given) ATS
    at 0x1c0 with its control register at +6."""
    data = bytearray(size)
    data[0:4] = (0x15B3 | 0x1023 << 16).to_bytes(4, "little")
    if size > 0x1C8:
        data[0x100:0x104] = (AER | 1 << 16 | (0x1C0 if ats_control is not None else 0) << 20).to_bytes(4, "little")
        if ats_control is not None:
            data[0x1C0:0x1C4] = (0x000F | 1 << 16).to_bytes(4, "little")
            data[0x1C4:0x1C6] = (0x0020).to_bytes(2, "little")
            data[0x1C6:0x1C8] = ats_control.to_bytes(2, "little")
    return bytes(data)


def virt_host_tree(root: Path, nic_port_acs: int, nic: bytes | None) -> Path:
    """rdma-core's ``rdma_topo --virt`` layout on the tree of :func:`hgx_tree`: the NIC's switch port
    keeps the kernel's isolation and adds Direct Translated P2P (0x5d, "1x111x1"), the GPU's port
    keeps the kernel's 0x1d."""
    root = hgx_tree(root)
    switch = "/sys/devices/pci0000:15/0000:15:01.0/0000:16:00.0"
    write(root, f"{switch}/0000:17:00.0/config", config_space(0x001D))
    write(root, f"{switch}/0000:17:01.0/config", config_space(nic_port_acs))
    if nic is not None:
        write(root, f"{switch}/0000:17:01.0/0000:1a:00.0/config", nic)
    return root


def test_direct_translated_p2p_with_the_nics_ats_on_lets_gpudirect_rdma_turn_around(tmp_path: Path) -> None:
    """The NIC's GPUDirect RDMA requests carry ATS-translated addresses, which Direct Translated
    P2P on its port lets past the redirect: NVIDIA's layout for virtualisation hosts is healthy."""
    assert verdicts(virt_host_tree(tmp_path / "virt", 0x005D, nic_config(0x8000))) == []
    facts = probe_pcie(NodeFS(str(tmp_path / "virt")))
    assert [(reading.nic, reading.enabled, reading.detail) for reading in facts.nic_ats] == [("0000:1a:00.0", True, "ATS Control 0x8000: Enable+")]


@pytest.mark.parametrize(
    ("nic_port_acs", "nic", "why"),
    [
        (0x005D, nic_config(0x0000), "ATS Control 0x0000: Enable-: the DirectTrans+ of its port does not apply"),
        (0x005D, nic_config(None), "no ATS capability: the DirectTrans+ of its port does not apply"),
        (0x001D, nic_config(0x8000), "GPU 0000:18:00.0 <-> NIC 0000:1a:00.0"),  # no DirectTrans: the NIC's ATS is not read
    ],
)
def test_redirect_stands_where_the_nic_sends_untranslated_requests(tmp_path: Path, nic_port_acs: int, nic: bytes, why: str) -> None:
    found = verdicts(virt_host_tree(tmp_path, nic_port_acs, nic))
    assert [(subject, status) for subject, status, _ in found] == [("bridge 0000:17:00.0", Status.PRESENT), ("bridge 0000:17:01.0", Status.PRESENT)]
    assert all(why in text for _, _, text in found)
    read = [(reading.nic, reading.enabled) for reading in probe_pcie(NodeFS(str(tmp_path))).nic_ats]
    assert read == ([] if nic_port_acs == 0x001D else [("0000:1a:00.0", False)])


@pytest.mark.parametrize(("nic", "reason"), [(None, "not captured"), (nic_config(0x8000, size=64), "needs CAP_SYS_ADMIN")])
def test_a_nic_whose_ats_is_unread_behind_direct_translated_p2p_is_unknown(tmp_path: Path, nic: bytes | None, reason: str) -> None:
    found = verdicts(virt_host_tree(tmp_path, 0x005D, nic))
    assert [(subject, status) for subject, status, _ in found] == [("bridge 0000:17:00.0", Status.UNKNOWN), ("bridge 0000:17:01.0", Status.UNKNOWN)]
    assert all("DirectTrans+" in text and reason in text for _, _, text in found)


def grace_data_direct_tree(root: Path, gpu_port_acs: int, dma_port_acs: int) -> Path:
    """A Grace Blackwell tray's GPU segment as rdma-core's rdma_topo knows it (NVCX_DMA_Complex):
    root port 0009:00:00.0 -> the ConnectX-8's switch 01:00.0 -> port 02:00.0 -> its Data Direct
    function 03:00.0 (15b3:2100, class 0x080100), and port 02:01.0 -> a nested switch 04:00.0 ->
    05:00.0 -> GPU 06:00.0. The NIC's own function 0000:03:00.0 hangs off another root port."""
    bare_node(root)
    grace = "0009:00:00.0"
    pci(root, [grace], "0x10de", "0x060400", config_space(0x001C))
    pci(root, [grace, "0009:01:00.0"], "0x15b3", "0x060400", config_space(None))
    pci(root, [grace, "0009:01:00.0", "0009:02:00.0"], "0x15b3", "0x060400", config_space(dma_port_acs))
    pci(root, [grace, "0009:01:00.0", "0009:02:01.0"], "0x15b3", "0x060400", config_space(gpu_port_acs))
    pci(root, [grace, "0009:01:00.0", "0009:02:00.0", "0009:03:00.0"], "0x15b3", "0x080100")
    nested = [grace, "0009:01:00.0", "0009:02:01.0", "0009:04:00.0"]
    pci(root, nested, "0x15b3", "0x060400", config_space(None))
    pci(root, [*nested, "0009:05:00.0"], "0x15b3", "0x060400", config_space(0x001D))
    pci(root, [*nested, "0009:05:00.0", "0009:06:00.0"], "0x10de", "0x030200")
    pci(root, ["0000:00:00.0"], "0x10de", "0x060400", config_space(0x001D))
    pci(root, ["0000:00:00.0", "0000:01:00.0"], "0x15b3", "0x060400", config_space(None))
    pci(root, ["0000:00:00.0", "0000:01:00.0", "0000:02:00.0"], "0x15b3", "0x060400", config_space(0x001D))
    pci(root, ["0000:00:00.0", "0000:01:00.0", "0000:02:00.0", "0000:03:00.0"], "0x15b3", "0x020700", rdma=True)
    write(root, "/proc/cpuinfo", GRACE_CPUINFO)
    write(root, "/proc/cmdline", "BOOT_IMAGE=/vmlinuz iommu.passthrough=1\n")
    write(root, "/sys/class/dmi/id/sys_vendor", "NVIDIA\n")
    (root / "sys/class/iommu/smmu3.0x0000000016000000").mkdir(parents=True)
    return root


def test_a_grace_trays_data_direct_function_is_the_gpus_nic_with_rdma_topos_masks(tmp_path: Path) -> None:
    """GPUDirect RDMA on a Grace Blackwell tray with a ConnectX-8 turns around between the GPU and
    the NIC's Data Direct function. rdma_topo sets Request Redirect on the GPU's port and Completion
    Redirect on the DMA function's, which act only on what the GPU starts: healthy."""
    root = grace_data_direct_tree(tmp_path / "rdma_topo", gpu_port_acs=0x0015, dma_port_acs=0x0019)
    facts = probe_pcie(NodeFS(str(root)))
    assert facts.pairs == () and [function.bdf for function in facts.data_direct] == ["0009:03:00.0"]
    assert facts.data_direct_pairs == (("0009:06:00.0", "0009:03:00.0", ("0009:02:01.0", "0009:02:00.0")),)
    assert verdicts(root) == []
    # The kernel's default on both ports: the DMA function's requests are redirected to the CPU.
    found = verdicts(grace_data_direct_tree(tmp_path / "default", gpu_port_acs=0x001D, dma_port_acs=0x001D))
    assert [(subject, status) for subject, status, _ in found] == [("bridge 0009:02:00.0", Status.PRESENT), ("bridge 0009:02:01.0", Status.PRESENT)]
    assert "GPU 0009:06:00.0 <-> NIC Data Direct function 0009:03:00.0" in found[0][2]
    # Request Redirect on the DMA function's port alone is enough to send its DMA to the CPU.
    found = verdicts(grace_data_direct_tree(tmp_path / "dma-rr", gpu_port_acs=0x0015, dma_port_acs=0x0015))
    assert [(subject, status) for subject, status, _ in found] == [("bridge 0009:02:00.0", Status.PRESENT)]


def test_topo005_takes_the_data_direct_function_as_the_gpus_nic(tmp_path: Path) -> None:
    """The NIC's own function on another NUMA node is not where NCCL puts the NIC of a GPU with a
    Data Direct function in its switch: that function is, unless NCCL_IB_DATA_DIRECT=0."""
    root = grace_data_direct_tree(tmp_path, gpu_port_acs=0x0015, dma_port_acs=0x0019)
    numa(root, "pci0009:00/0009:00:00.0/0009:01:00.0/0009:02:01.0/0009:04:00.0/0009:05:00.0/0009:06:00.0", 0)
    numa(root, "pci0000:00/0000:00:00.0/0000:01:00.0/0000:02:00.0/0000:03:00.0", 1)
    write(root, "/sys/devices/system/node/has_cpu", "0-1\n")
    for node in ("node0", "node1"):
        (root / "sys/devices/system/node" / node).mkdir(parents=True, exist_ok=True)
    assert topo_verdicts(root) == []
    assert [subject for subject, _ in topo_verdicts(root, {"NCCL_IB_DATA_DIRECT": "0"})] == ["GPU 0009:06:00.0"]


def test_unprivileged_config_reads_are_unknown_never_off(tmp_path: Path) -> None:
    found = verdicts(hgx_tree(tmp_path, switch_acs=0x001D, config_size=64))
    assert found and all(status is Status.UNKNOWN and "needs CAP_SYS_ADMIN" in text for _, status, text in found)


def test_not_applicable_in_a_vm_or_without_gpus_and_nics(tmp_path: Path) -> None:
    with pytest.raises(NotApplicable, match="virtual machine"):
        verdicts(hgx_tree(tmp_path / "vm", switch_acs=0x001D, hypervisor=True))
    with pytest.raises(NotApplicable, match="GPUs and RDMA NICs"):
        verdicts(bare_node(tmp_path / "empty"))


GRACE_CPUINFO = "processor\t: 0\nBogoMIPS\t: 2000.00\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics\nCPU implementer\t: 0x41\n\n"


def _smbios_type0(vm_bit: bool) -> bytes:
    """SMBIOS structure type 0 (BIOS information), 0x18 bytes long: extension byte 2 at 0x13."""
    data = bytearray(0x18)
    data[0], data[1] = 0, 0x18
    data[0x13] = 0x10 if vm_bit else 0x0C
    return bytes(data) + b"\0\0"


@pytest.mark.parametrize(
    ("cpuinfo", "planted", "guest", "said"),
    [
        ("x86", {}, False, "no 'hypervisor' flag"),
        ("x86-guest", {}, True, "'hypervisor' CPU flag"),
        # A passthrough guest whose hypervisor hides the CPU flag still names itself in DMI.
        ("x86", {"/sys/class/dmi/id/sys_vendor": "QEMU\n", "/sys/class/dmi/id/product_name": "Standard PC (Q35 + ICH9, 2009)\n"}, True, "QEMU"),
        ("x86", {"/sys/class/dmi/id/sys_vendor": "Microsoft Corporation\n", "/sys/class/dmi/id/product_name": "Virtual Machine\n"}, True, "Hyper-V"),
        ("x86", {"/sys/firmware/dmi/entries/0-0/raw": _smbios_type0(vm_bit=True)}, True, "SMBIOS virtual-machine bit"),
        ("x86", {"/sys/firmware/dmi/entries/0-0/raw": _smbios_type0(vm_bit=False)}, False, "no 'hypervisor' flag"),
        # Arm lists no x86 flags: without DMI or a device-tree hypervisor node nothing is known.
        ("arm", {}, None, "lists no CPU flags"),
        ("arm", {"/sys/class/dmi/id/sys_vendor": "Supermicro\n", "/sys/class/dmi/id/product_name": "ARS-121GL-NHIR\n"}, False, "DMI names no hypervisor"),
        ("arm", {"/sys/class/dmi/id/sys_vendor": "Amazon EC2\n", "/sys/class/dmi/id/product_name": "g5g.2xlarge\n"}, True, "Amazon EC2"),
        ("arm", {"/sys/class/dmi/id/sys_vendor": "Amazon EC2\n", "/sys/class/dmi/id/product_name": "c6g.metal\n"}, False, "DMI names no hypervisor"),
        ("arm", {"/sys/firmware/devicetree/base/hypervisor/compatible": b"linux,kvm\0"}, True, "linux,kvm"),
        # An Azure Arm guest (ND GB200 v6) with no DMI strings: its VMBus devices tell.
        ("arm", {"/sys/bus/vmbus/devices/9dc5b5cd-3c41-4b2f-9a53-36c6f7b5a3d2/class_id": "{44c4f61d-4444-4400-9d52-802e27ede19f}\n"}, True, "VMBus"),
        (None, {}, None, "/proc/cpuinfo unread"),
    ],
)
def test_a_virtual_machine_is_told_by_cpu_flag_device_tree_dmi_or_smbios(
    tmp_path: Path, cpuinfo: str | None, planted: dict[str, str | bytes], guest: bool | None, said: str
) -> None:
    root = hgx_tree(tmp_path, hypervisor=cpuinfo == "x86-guest")
    if cpuinfo == "arm":
        write(root, "/proc/cpuinfo", GRACE_CPUINFO)
    elif cpuinfo is None:
        (root / "proc/cpuinfo").unlink()
    for path, content in planted.items():
        write(root, path, content)
    facts = probe_pcie(NodeFS(str(root)))
    assert (facts.hypervisor, said in facts.virtualisation) == (guest, True), facts.virtualisation


def test_findings_on_a_node_not_known_to_be_bare_metal_are_undecided(tmp_path: Path) -> None:
    """An ACS redirect read on an Arm node without DMI (or a capture without /proc/cpuinfo) may be
    a guest's emulated bridge: unknown with both facts, never an error that drains the node."""
    root = hgx_tree(tmp_path, switch_acs=0x001D)
    write(root, "/proc/cpuinfo", GRACE_CPUINFO)
    found = verdicts(root)
    assert found and all(status is Status.UNKNOWN for _, status, _ in found), found
    assert "ReqRedir+" in found[0][2] and "whether this node is a virtual machine is not known" in found[0][2]
    write(root, "/sys/class/dmi/id/sys_vendor", "Supermicro\n")  # DMI read, no hypervisor named: bare metal
    assert {status for _, status, _ in verdicts(root)} == {Status.PRESENT}


@pytest.mark.parametrize("damage", ["missing", "empty", "garbage"])
def test_damaged_config_space_is_unknown_with_the_reason(tmp_path: Path, damage: str) -> None:
    root = hgx_tree(tmp_path)
    config = root / "sys/devices/pci0000:15/0000:15:01.0/0000:16:00.0/0000:17:00.0/config"
    if damage == "missing":
        config.unlink()
    else:
        config.write_bytes(b"" if damage == "empty" else os.urandom(4096))
    found = dict((subject, (status, text)) for subject, status, text in verdicts(root))
    if damage == "garbage":
        assert all(status in (Status.PRESENT, Status.UNKNOWN) for status, _ in found.values())
    else:
        status, text = found["bridge 0000:17:00.0"]
        assert status is Status.UNKNOWN and "config" in text


@pytest.mark.parametrize("damage", ["dereferenced", "wrong-target"])
def test_a_device_entry_that_is_not_its_link_is_unknown_not_absent(tmp_path: Path, damage: str) -> None:
    """A capture taken with cp -L or tar -h turns /sys/bus/pci/devices/* into directories, and a
    link may name another function: those devices have no place in the tree, and the checks
    must say unknown, never "no GPUs here" (which hid a real ACS redirect on such a copy)."""
    import shutil

    root = hgx_tree(tmp_path, switch_acs=0x001D)
    devices = root / "sys/bus/pci/devices"
    for entry in sorted(devices.iterdir()):
        target = entry.resolve()
        entry.unlink()
        if damage == "dereferenced":
            shutil.copytree(target, entry)
        else:
            os.symlink(f"../../../devices/pci0000:15/0000:15:01.0/{entry.name[:-1]}7", entry)
    facts_ = probe_pcie(NodeFS(str(root)))
    assert facts_.gpus == () and facts_.problems[0].startswith("/sys/bus/pci/devices/0000:15:01.0: ")
    for check in (acs_redirect_breaks_gpudirect_rdma, p2p_bandwidth_degraded, p2p_transfers_hang_or_fault):
        with pytest.raises(Unknown, match="cannot tell which PCI devices"):
            list(check(facts_, offered(facts_), NO_JOB) if check is p2p_transfers_hang_or_fault else check(facts_))
    with pytest.raises(Unknown, match="cannot tell which PCI devices"):
        topo_verdicts(root)


def numa(root: Path, bdf_path: str, node: int) -> None:
    write(root, f"/sys/devices/{bdf_path}/numa_node", f"{node}\n")


def topo_verdicts(root: Path, environ: dict[str, str] | None = None) -> list[tuple[str, str]]:
    if environ:
        write(root, "/proc/self/environ", b"".join(f"{k}={v}".encode() + b"\0" for k, v in environ.items()))
    fs = NodeFS(str(root))
    found = gpu_hca_cross_numa_gdr(probe_pcie(fs), probe_job(fs))
    return [(o.subject, " ".join(e.observed for e in o.evidence)) for o in found]


def test_topo005_does_not_apply_where_nccls_sockets_carry_the_data(tmp_path: Path) -> None:
    """NCCL_NET=Socket: no GPUDirect RDMA whatever the GPU's distance to the NIC."""
    from preflight.model import NotApplicable

    root = hgx_tree(tmp_path)
    write(root, "/proc/self/environ", b"NCCL_NET=Socket\0")
    fs = NodeFS(str(root))
    with pytest.raises(NotApplicable, match="NCCL_NET=Socket"):
        list(gpu_hca_cross_numa_gdr(probe_pcie(fs), probe_job(fs)))


def test_a_gpu_without_a_nic_on_its_socket_is_present(tmp_path: Path) -> None:
    root = hgx_tree(tmp_path)
    for node in ("node0", "node1"):
        (root / "sys/devices/system/node" / node).mkdir(parents=True)
    assert topo_verdicts(root) == [("GPU 0000:9a:00.0", "")]  # numa_node unreported on two sockets: unknown
    numa(root, "pci0000:15/0000:15:01.0/0000:16:00.0/0000:17:01.0/0000:1a:00.0", 0)
    numa(root, "pci0000:97/0000:97:01.0/0000:9a:00.0", 1)
    found = topo_verdicts(root)
    assert [s for s, _ in found] == ["GPU 0000:9a:00.0"] and "SYS (on another NUMA node: another socket, or another sub-NUMA cluster" in found[0][1]


def test_nic_on_the_same_socket_is_phb_and_only_flagged_when_gdr_is_forced(tmp_path: Path) -> None:
    root = hgx_tree(tmp_path)
    for bdf_path in ("pci0000:15/0000:15:01.0/0000:16:00.0/0000:17:01.0/0000:1a:00.0",
                     "pci0000:97/0000:97:01.0/0000:9a:00.0"):
        numa(root, bdf_path, 1)
    assert topo_verdicts(root) == []
    forced = topo_verdicts(root, {"NCCL_NET_GDR_LEVEL": "SYS"})
    assert [s for s, _ in forced] == ["GPU 0000:9a:00.0"] and "forced over a PHB path" in forced[0][1]
    assert topo_verdicts(root, {"NCCL_NET_GDR_LEVEL": "2"}) == []
    assert [s for s, _ in topo_verdicts(root, {"NCCL_NET_GDR_LEVEL": "3"})] == ["GPU 0000:9a:00.0"]  # old number for PHB


@pytest.mark.parametrize("value", ["phb", "Sys", " SYS", "PXN"])
def test_gdr_level_names_are_matched_as_ncclgetlevel_does(tmp_path: Path, value: str) -> None:
    """ncclGetLevel compares NCCL_NET_GDR_LEVEL with strcmp (paths.cc, v2.7.8-1 to v2.30.7-1): a
    name in another case or with a blank is ignored and the default PXB stays; PXN stops short of
    PHB. None forces GPUDirect RDMA over the PHB path."""
    root = hgx_tree(tmp_path)
    for bdf_path in ("pci0000:15/0000:15:01.0/0000:16:00.0/0000:17:01.0/0000:1a:00.0",
                     "pci0000:97/0000:97:01.0/0000:9a:00.0"):
        numa(root, bdf_path, 1)
    assert topo_verdicts(root, {"NCCL_NET_GDR_LEVEL": value}) == []


def test_gdr_forced_in_a_vm_that_hides_the_switches(tmp_path: Path) -> None:
    """Hyper-V (Azure's ND series) gives each GPU and NIC a root bus of its own: every pair looks
    PHB although GPU k and NIC k share a switch on the host. Forced GDR there is undecided; with
    NCCL_TOPO_FILE NCCL takes its paths from the file (Azure's ndv5-topo.xml puts them under one
    bridge), so there is nothing to say from sysfs."""
    root = bare_node(tmp_path)
    pci(root, ["0001:00:00.0"], "0x10de", "0x030200")
    pci(root, ["0101:00:00.0"], "0x15b3", "0x020700", rdma=True)
    for bdf_path in ("pci0001:00/0001:00:00.0", "pci0101:00/0101:00:00.0"):
        numa(root, bdf_path, 0)
    write(root, "/proc/cpuinfo", "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu hypervisor\n\n")
    fs = NodeFS(str(root))
    write(root, "/proc/self/environ", b"NCCL_NET_GDR_LEVEL=5\0")
    found = list(gpu_hca_cross_numa_gdr(probe_pcie(fs), probe_job(fs)))
    assert [(o.subject, o.status) for o in found] == [("GPU 0001:00:00.0", Status.UNKNOWN)] and "root bus of a virtual machine" in found[0].reason
    assert topo_verdicts(root, {"NCCL_NET_GDR_LEVEL": "5", "NCCL_TOPO_FILE": "/opt/microsoft/ndv5-topo.xml"}) == []
    write(root, "/proc/cpuinfo", "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu\n\n")  # bare metal: PHB is PHB
    assert [s for s, _ in topo_verdicts(root, {"NCCL_NET_GDR_LEVEL": "5"})] == ["GPU 0001:00:00.0"]


def test_grace_gpu_forced_gdr_over_its_c2c_path_is_not_flagged(tmp_path: Path) -> None:
    """A GH200's GPU and NIC hang off one Grace socket's root ports (PHB in sysfs), but the GPU
    reaches the socket over NVLink-C2C, a path NCCL classes P2C and uses for GPUDirect RDMA (by
    default from 2.27); CSCS tells GH200 users to set NCCL_NET_GDR_LEVEL=PHB for older NCCL.
    Its HBM shows as CPU-less NUMA nodes; an Arm host without them (PCIe GPUs, or memory the driver
    manages) and one whose has_cpu is unreadable are undecided. A one-socket GH200 whose NIC reports no
    NUMA node is PHB, not unknown: the GPU memory nodes are not sockets."""
    root = bare_node(tmp_path)
    pci(root, ["0009:01:00.0"], "0x10de", "0x030200")
    pci(root, ["0000:01:00.0"], "0x15b3", "0x020700", rdma=True)
    write(root, "/proc/cpuinfo", "processor\t: 0\nCPU implementer\t: 0x41\nCPU part\t: 0xd4f\n\n")
    for node in range(9):  # one Grace socket, eight CPU-less nodes of GPU memory
        (root / f"sys/devices/system/node/node{node}").mkdir(parents=True)
    write(root, "/sys/devices/system/node/has_cpu", "0\n")
    gdr = {"NCCL_NET_GDR_LEVEL": "PHB"}
    assert probe_pcie(NodeFS(str(root))).nearest_nic == (("0009:01:00.0", "0000:01:00.0", "PHB"),)
    assert topo_verdicts(root, gdr) == []
    # No CPU-less node: Arm with PCIe GPUs, or a Grace GPU whose memory the driver manages
    # (NVreg_CoherentGPUMemoryMode=driver, Azure's GB200 image): which, is not known.
    write(root, "/sys/devices/system/node/has_cpu", "0-8\n")
    for bdf_path in ("pci0009:01/0009:01:00.0", "pci0000:01/0000:01:00.0"):
        numa(root, bdf_path, 0)  # both on one socket: PHB
    [found] = gpu_hca_cross_numa_gdr(probe_pcie(NodeFS(str(root))), probe_job(NodeFS(str(root))))
    assert found.subject == "GPU 0009:01:00.0" and found.status is Status.UNKNOWN and "the driver manages" in found.reason
    write(root, "/sys/devices/system/node/has_cpu", "garbage\n")
    for bdf_path in ("pci0009:01/0009:01:00.0", "pci0000:01/0000:01:00.0"):
        numa(root, bdf_path, 0)  # placed, so the path is PHB whatever the socket count
    fs = NodeFS(str(root))
    found = list(gpu_hca_cross_numa_gdr(probe_pcie(fs), probe_job(fs)))
    assert [o.status for o in found] == [Status.UNKNOWN] and "NVLink-C2C" in found[0].reason


# PCI002 / PCI003 on hand-built facts -------------------------------------------------------------
FULL = PcieLink(16, 16, "2.5 GT/s PCIe", "16.0 GT/s PCIe", "")


def endpoint(bdf: str, chain: tuple[str, ...], link: PcieLink = FULL, domain: str = "identity", rdma: tuple[str, ...] = ()) -> PciEndpoint:
    return PciEndpoint(bdf, chain, 0, link, bdf[5:7], domain, "", rdma)


def facts(gpus: tuple[PciEndpoint, ...], nics: tuple[PciEndpoint, ...] = (), bridges: tuple[Bridge, ...] = (),
          gpu_pairs: tuple[tuple[str, str, tuple[str, ...]], ...] = (), pairs: tuple[tuple[str, str, tuple[str, ...]], ...] = (),
          iommu: tuple[str, ...] = ("dmar0",), cmdline: str = "intel_iommu=on iommu=pt") -> PcieFacts:
    return PcieFacts(gpus, nics, bridges, pairs, gpu_pairs, (), (), False, iommu, cmdline, (), cpu_vendor="GenuineIntel")


NO_JOB = JobFacts({}, "", ())  # a job that sets no NCCL variable


SWITCH = ("0000:15:01.0", "0000:16:00.0")
TWO_GPUS = (endpoint("0000:18:00.0", (*SWITCH, "0000:17:00.0")), endpoint("0000:19:00.0", (*SWITCH, "0000:17:01.0")))
GPU_PATH = ("0000:16:00.0", "0000:17:00.0", "0000:17:01.0")


def test_parse_width_takes_lane_counts_only() -> None:
    assert [parse_width(text) for text in ("16\n", "8", " 4 ", "0")] == [16, 8, 4, 0]
    assert [parse_width(text) for text in ("x16", "", None, "64", "-1")] == [None] * 5


def test_pci002_width_below_max_is_present_and_speed_never() -> None:
    narrow = PcieLink(8, 16, "16.0 GT/s PCIe", "16.0 GT/s PCIe", "", "0000:17:02.0", 16)
    slow = PcieLink(16, 16, "2.5 GT/s PCIe", "32.0 GT/s PCIe", "")
    nic = endpoint("0000:1a:00.0", (*SWITCH, "0000:17:02.0"), narrow, rdma=("mlx5_0",))
    found = list(p2p_bandwidth_degraded(facts((endpoint("0000:18:00.0", SWITCH, slow), TWO_GPUS[1]), (nic,))))
    assert [(o.subject, o.status) for o in found] == [("NIC 0000:1a:00.0 (mlx5_0)", Status.PRESENT)]
    assert found[0].evidence[0].observed.startswith("x8;")
    assert found[0].evidence[0].expected == "x16 (max_link_width of the device and of port 0000:17:02.0 above it)"
    with pytest.raises(NotApplicable):
        list(p2p_bandwidth_degraded(facts(())))


def test_pci002_a_virtual_function_has_its_physical_functions_link(tmp_path: Path) -> None:
    """An SR-IOV VF's Link Status is reserved and reads x0, which is no link down: its link is its
    PF's (device/physfn), as a pod given VFs by the SR-IOV device plugin sees them."""
    root = hgx_tree(tmp_path)
    device = "sys/devices/pci0000:15/0000:15:01.0/0000:16:00.0/0000:17:01.0"
    pci(root, ["0000:15:01.0", "0000:16:00.0", "0000:17:01.0", "0000:1a:00.2"], "0x15b3", "0x020000", rdma=True)
    for function, width in (("0000:1a:00.0", "8"), ("0000:1a:00.2", "0")):
        write(root, f"/{device}/{function}/current_link_width", width + "\n")
        write(root, f"/{device}/{function}/max_link_width", "16\n")
    write(root, f"/{device}/max_link_width", "16\n")  # the port above both
    os.symlink("../0000:1a:00.0", root / device / "0000:1a:00.2" / "physfn")
    vf = next(nic for nic in probe_pcie(NodeFS(str(root))).nics if nic.bdf == "0000:1a:00.2")
    assert (vf.link.current_width, vf.link.function) == (8, "0000:1a:00.0")
    found = {o.subject: o for o in p2p_bandwidth_degraded(probe_pcie(NodeFS(str(root))))}
    narrow = found["NIC 0000:1a:00.2 (mlx5_0)"]
    assert narrow.status is Status.PRESENT and narrow.evidence[0].source == "/sys/bus/pci/devices/0000:1a:00.0/current_link_width"


def test_pci002_a_slot_narrower_than_the_device_is_the_slot_not_a_fault() -> None:
    """An x16 GPU in a slot wired x8 trains x8 (real dumps in tests/data/real-nvml show x8 of x16
    on a T4 and an A10G on a guest's root bus, a Quadro P2000, a laptop RTX 3060): only a port
    that could run it wider makes the link degraded, and where the port cannot be read the check
    cannot tell."""
    def gpu(link: PcieLink, chain: tuple[str, ...] = SWITCH) -> PciEndpoint:
        return endpoint("0000:18:00.0", chain, link)

    slot_x8 = PcieLink(8, 16, "8.0 GT/s PCIe", "8.0 GT/s PCIe", "", "0000:16:00.0", 8)
    assert list(p2p_bandwidth_degraded(facts((gpu(slot_x8),)))) == []
    slot_x16 = PcieLink(4, 16, "8.0 GT/s PCIe", "8.0 GT/s PCIe", "", "0000:16:00.0", 8)  # x4 in an x8 slot
    (degraded,) = p2p_bandwidth_degraded(facts((gpu(slot_x16),)))
    assert degraded.status is Status.PRESENT and degraded.evidence[0].expected.startswith("x8 ")
    root_bus = PcieLink(8, 16, "8.0 GT/s PCIe", "8.0 GT/s PCIe", "")  # no bridge above: a guest's root bus
    (unknown,) = p2p_bandwidth_degraded(facts((gpu(root_bus, ()),)))
    assert unknown.status is Status.UNKNOWN and "no bridge above it" in unknown.reason
    unread = PcieLink(8, 16, "8.0 GT/s PCIe", "8.0 GT/s PCIe", "", "0000:16:00.0", None)
    (unknown,) = p2p_bandwidth_degraded(facts((gpu(unread),)))
    assert unknown.status is Status.UNKNOWN and "0000:16:00.0/max_link_width" in unknown.reason
    guest = replace(facts((gpu(PcieLink(8, 16, "8.0 GT/s PCIe", "8.0 GT/s PCIe", "", "0000:16:00.0", 16)),)), hypervisor=True)
    (unknown,) = p2p_bandwidth_degraded(guest)
    assert unknown.status is Status.UNKNOWN and "virtual machine" in unknown.reason
    # x0: on bare metal a link that is down; in a guest (VMware's vGPU) registers that read 0
    zero = PcieLink(0, 16, "", "16.0 GT/s PCIe", "", "0000:16:00.0", 16)
    (down,) = p2p_bandwidth_degraded(facts((gpu(zero),)))
    assert "the link is down" in down.reason
    (emulated,) = p2p_bandwidth_degraded(replace(facts((gpu(zero),)), hypervisor=True))
    assert emulated.status is Status.UNKNOWN and "emulated link registers" in emulated.reason


def offered(facts: PcieFacts, status: int = 0) -> PcieP2pFacts:
    """NVML answering P2P read and write ``status`` (0: OK) between every two GPUs, none over NVLink."""
    bdfs = [gpu.bdf for gpu in facts.gpus]
    statuses = tuple(P2pStatus(s, t, status, status, 5, "") for s in range(len(bdfs)) for t in range(len(bdfs)) if s != t)
    return PcieP2pFacts(True, tuple((bdf, index) for index, bdf in enumerate(bdfs)), statuses, "")


def test_pci003_acs_on_a_gpu_only_path_is_not_pci001() -> None:
    redirect = tuple(Bridge(bdf, AcsRegisters(0x5F, 0x001D if bdf == "0000:17:01.0" else 0), "") for bdf in GPU_PATH)
    nic = endpoint("0000:1a:00.0", (*SWITCH, "0000:17:00.0"), rdma=("mlx5_0",))
    both = facts(TWO_GPUS, (nic,), redirect, ((TWO_GPUS[0].bdf, TWO_GPUS[1].bdf, GPU_PATH),),
                 ((TWO_GPUS[0].bdf, nic.bdf, ("0000:17:00.0",)),))
    assert list(acs_redirect_breaks_gpudirect_rdma(both)) == []  # 17:01.0 is not between GPU 18 and its NIC
    (found,) = p2p_transfers_hang_or_fault(both, offered(both), NO_JOB)
    assert found.subject == "bridge 0000:17:01.0" and "GPU 0000:18:00.0 <-> GPU 0000:19:00.0" in found.evidence[1].observed
    # The redirect hurts only P2P: with none on offer (GNS) there is no finding, unanswered is unknown.
    assert list(p2p_transfers_hang_or_fault(both, offered(both, status=2), NO_JOB)) == []
    (unanswered,) = p2p_transfers_hang_or_fault(both, PcieP2pFacts(True, (), (), "NVML_ERROR_DRIVER_NOT_LOADED"), NO_JOB)
    assert unanswered.status is Status.UNKNOWN and "DRIVER_NOT_LOADED" in unanswered.reason
    (unread,) = p2p_transfers_hang_or_fault(both, Unread("pcie_p2p", "needs probe gpus, which did not finish"), NO_JOB)
    assert unread.status is Status.UNKNOWN and "probe pcie_p2p: needs probe gpus" in unread.reason
    unreadable = facts(TWO_GPUS, bridges=(Bridge("0000:16:00.0", None, "config: permission denied"),), gpu_pairs=both.gpu_pairs)
    (unknown,) = p2p_transfers_hang_or_fault(unreadable, offered(unreadable), NO_JOB)
    assert unknown.status is Status.UNKNOWN and "permission denied" in unknown.reason


def test_pci003_leaves_out_gpus_in_mig_mode() -> None:
    """MIG's user guide: peer-to-peer only between instances of one GPU, so a GPU in MIG mode sends
    nothing over PCIe, and the redirect between two such GPUs hurts no traffic."""
    from preflight.probes.gpus import GpuFacts, NvmlDevice

    redirect = tuple(Bridge(bdf, AcsRegisters(0x5F, 0x001D), "") for bdf in GPU_PATH)
    both = facts(TWO_GPUS, (), redirect, ((TWO_GPUS[0].bdf, TWO_GPUS[1].bdf, GPU_PATH),))

    def gpus(*mig: bool) -> GpuFacts:
        devices = tuple(NvmlDevice(i, "NVIDIA A100-SXM4-80GB", gpu.bdf, f"GPU-{i}", "", mig[i]) for i, gpu in enumerate(TWO_GPUS))
        return GpuFacts(tuple(gpu.bdf for gpu in TWO_GPUS), "", "", "535.183.01", devices, ())

    assert [o.subject for o in p2p_transfers_hang_or_fault(both, offered(both), NO_JOB, gpus(False, False))] != []
    with pytest.raises(NotApplicable, match="1 GPU\\(s\\) in MIG mode"):
        list(p2p_transfers_hang_or_fault(both, offered(both), NO_JOB, gpus(True, False)))
    with pytest.raises(NotApplicable, match="2 GPU\\(s\\) in MIG mode"):
        list(p2p_transfers_hang_or_fault(both, offered(both), NO_JOB, gpus(True, True)))


def test_pci003_iommu_domain_types() -> None:
    """A translating IOMMU meets GPU traffic only where NCCL uses P2P (ncclTopoCheckP2p,
    paths.cc@v2.30.7-1): by default up to PXB, two GPUs under one PCIe switch. GPUs on separate
    root ports of an Intel host are PHB apart, NCCL copies through host memory, and nothing
    faults, unless the job raises NCCL_P2P_LEVEL or the CPU is AMD (level SYS)."""
    same_switch = (endpoint("0000:18:00.0", (*SWITCH, "0000:17:00.0"), domain="DMA"),
                   endpoint("0000:19:00.0", (*SWITCH, "0000:17:01.0"), domain="DMA-FQ"))
    node = facts(same_switch, cmdline="intel_iommu=on")
    (found,) = p2p_transfers_hang_or_fault(node, offered(node), NO_JOB)
    assert (found.subject, found.status) == ("IOMMU", Status.PRESENT)
    assert "DMA: GPU 0000:18:00.0 (group 18); DMA-FQ: GPU 0000:19:00.0" in found.evidence[0].observed
    assert "GPU 0000:18:00.0 <-> GPU 0000:19:00.0" in found.evidence[2].observed and "PXB" in found.evidence[3].observed
    assert list(p2p_transfers_hang_or_fault(node, offered(node, status=2), NO_JOB)) == []  # no P2P on offer: nothing meets the IOMMU
    assert list(p2p_transfers_hang_or_fault(facts(same_switch, iommu=()), offered(node), NO_JOB)) == []  # no IOMMU unit is active
    assert list(p2p_transfers_hang_or_fault(node, offered(node), JobFacts({"NCCL_P2P_DISABLE": "1"}, "", ()))) == []

    apart = (endpoint("0000:18:00.0", SWITCH, domain="DMA"), endpoint("0000:9a:00.0", ("0000:97:01.0",), domain="DMA-FQ"))
    intel = facts(apart, cmdline="intel_iommu=on")
    assert list(p2p_transfers_hang_or_fault(intel, offered(intel), NO_JOB)) == []  # separate root ports: PHB, beyond PXB
    for raised in ("PHB", "SYS", "3", "4"):
        (found,) = p2p_transfers_hang_or_fault(intel, offered(intel), JobFacts({"NCCL_P2P_LEVEL": raised}, "", ()))
        assert found.status is Status.PRESENT and found.evidence[3].source == "NCCL_P2P_LEVEL (environment)"
    assert list(p2p_transfers_hang_or_fault(intel, offered(intel), JobFacts({"NCCL_P2P_LEVEL": "phb"}, "", ()))) == []  # strcmp
    amd = replace(intel, cpu_vendor="AuthenticAMD")
    (found,) = p2p_transfers_hang_or_fault(amd, offered(amd), NO_JOB)
    assert found.status is Status.PRESENT and "AuthenticAMD" in found.evidence[3].observed
    assert list(p2p_transfers_hang_or_fault(amd, offered(amd), JobFacts({"NCCL_P2P_LEVEL": "PXB"}, "", ()))) == []
    (unknown,) = p2p_transfers_hang_or_fault(replace(intel, cpu_vendor=None), offered(intel), NO_JOB)
    assert unknown.status is Status.UNKNOWN and "/proc/cpuinfo unread" in unknown.reason
    unreadable_conf = JobFacts({}, "", (NcclConfFile("/home/alice/.nccl.conf", (), "permission denied"),))
    (unknown,) = p2p_transfers_hang_or_fault(node, offered(node), unreadable_conf)
    assert unknown.status is Status.UNKNOWN and "NCCL_P2P_LEVEL not known" in unknown.reason and "permission denied" in unknown.reason

    unread = facts(tuple(PciEndpoint(gpu.bdf, gpu.chain, 0, FULL, "7", "", "/sys/kernel/iommu_groups/7/type: permission denied", ()) for gpu in TWO_GPUS))
    assert {o.status for o in p2p_transfers_hang_or_fault(unread, offered(unread), NO_JOB)} == {Status.UNKNOWN}
    outside = facts(tuple(PciEndpoint(gpu.bdf, gpu.chain, 0, FULL, None, "", "", ()) for gpu in TWO_GPUS), cmdline="intel_iommu=on")
    assert list(p2p_transfers_hang_or_fault(outside, offered(outside), NO_JOB)) == []  # not behind the IOMMU


def test_pcie_probe_records_links_and_gpu_pairs(tmp_path: Path) -> None:
    root = hgx_tree(tmp_path)
    facts_ = probe_pcie(NodeFS(str(root)))
    assert facts_.gpu_pairs == () and facts_.nvswitches == ()  # the two GPUs sit under different root ports
    assert facts_.gpus[0].link.problem.endswith("current_link_width and max_link_width are missing or unreadable")
    with pytest.raises(Unknown, match="no link width readable"):
        list(p2p_bandwidth_degraded(facts_))
    # widths written: the probe also reads the width of the port above each function
    device = "/sys/devices/pci0000:15/0000:15:01.0/0000:16:00.0/0000:17:00.0"
    for path, width in ((f"{device}/0000:18:00.0/current_link_width", "8"), (f"{device}/0000:18:00.0/max_link_width", "16"),
                        (f"{device}/max_link_width", "8")):
        write(root, path, width + "\n")
    link = probe_pcie(NodeFS(str(root))).gpus[0].link
    assert (link.current_width, link.max_width, link.port, link.port_max_width) == (8, 16, "0000:17:00.0", 8)
    # the second GPU's link is narrow too, and its root port's width was not written
    second_gpu = "/sys/devices/pci0000:97/0000:97:01.0/0000:9a:00.0"
    write(root, f"{second_gpu}/current_link_width", "8\n")
    write(root, f"{second_gpu}/max_link_width", "16\n")
    second = probe_pcie(NodeFS(str(root))).gpus[1].link
    assert second.port == "0000:97:01.0" and second.port_max_width is None
    # a link at its full width asks nothing of its port: the prolog reads it for every GPU and NIC
    write(root, f"{device}/0000:18:00.0/current_link_width", "16\n")
    full = probe_pcie(NodeFS(str(root))).gpus[0].link
    assert (full.current_width, full.port, full.port_max_width) == (16, "", None)


def test_the_p2p_answers_are_asked_only_where_pci003_can_use_them(tmp_path: Path) -> None:
    """The prolog asks NVML for every GPU pair's P2P status only on nodes where PCI003 needs it:
    an IOMMU translating the GPUs, on bare metal without NVSwitches. In a guest PCI003 does not
    apply whatever the driver answers, so nothing is asked there."""
    import shutil

    tests = Path(__file__).resolve().parents[1]
    root = tmp_path / "amd"
    shutil.copytree(tests / "fixtures" / "nodes" / "rtx5090-workstation", root, symlinks=True)
    (root / "sys/class/iommu/ivhd0").mkdir(parents=True)

    def asked() -> bool:
        sources = Sources.for_node(str(root))
        pcie = probe_pcie(sources.fs)
        return probe_pcie_p2p(sources.nvml, pcie, probe_gpus(sources.fs, sources.nvml)).asked

    assert asked()  # DMA-FQ domains on bare metal
    cpuinfo = root / "proc/cpuinfo"
    cpuinfo.write_text(cpuinfo.read_text().replace("flags\t\t: fpu", "flags\t\t: fpu hypervisor"))
    assert not asked()


def test_pci003_iommu_sources_missing_from_a_recorded_root_are_unknown(tmp_path: Path) -> None:
    """Missing is not empty: a copied root without /sys/class/iommu says nothing about the IOMMU,
    and under an active IOMMU a GPU whose iommu_group link was not copied is undecided. The
    complete root (identity domains, iommu=pt) is absent."""
    import shutil

    tests = Path(__file__).resolve().parents[1]
    source = tmp_path / "source"  # the PCI003 absent case: the fixture and its overlay
    shutil.copytree(tests / "fixtures" / "nodes" / "rtx5090-workstation", source, symlinks=True)
    shutil.copytree(tests / "cases" / "PCI003" / "absent" / "root", source, symlinks=True, dirs_exist_ok=True)

    def pci003(root: Path) -> set[Status]:
        sources = Sources.for_node(str(root))
        pcie = probe_pcie(sources.fs)
        answers = probe_pcie_p2p(sources.nvml, pcie, probe_gpus(sources.fs, sources.nvml))
        return {observation.status for observation in p2p_transfers_hang_or_fault(pcie, answers, probe_job(sources.fs))}

    whole = tmp_path / "whole"
    shutil.copytree(source, whole, symlinks=True)
    assert pci003(whole) == set()  # nothing translates, nothing redirects: absent
    no_units = tmp_path / "no-units"
    shutil.copytree(source, no_units, symlinks=True)
    shutil.rmtree(no_units / "sys" / "class" / "iommu")
    assert pci003(no_units) == {Status.UNKNOWN}
    no_link = tmp_path / "no-link"
    shutil.copytree(source, no_link, symlinks=True)
    (no_link / "sys/devices/pci0000:01/0000:01:01.1/0000:01:00.0/iommu_group").unlink()
    assert pci003(no_link) == {Status.UNKNOWN}
    # The fixture itself, an AMD workstation whose GPUs sit in the kernel's default translated
    # (DMA-FQ) domains, with its IOMMU unit recorded: the driver offers no P2P between the two
    # RTX 5090s (GNS), so nothing meets the translation and the node is healthy.
    amd = tmp_path / "amd"
    shutil.copytree(tests / "fixtures" / "nodes" / "rtx5090-workstation", amd, symlinks=True)
    (amd / "sys/class/iommu/ivhd0").mkdir(parents=True)
    assert pci003(amd) == set()


def test_pci003_without_the_job_environment_still_decides_what_needs_no_job(node_copy: Path) -> None:
    """The job's NCCL_P2P_LEVEL matters only for GPU pairs under a translating IOMMU: a capture
    without /proc/self/environ is still an NVSwitch system (not applicable), not unknown because
    the job probe could not read it."""
    from preflight.run import inspect_node, open_node

    (node_copy / "proc/self/environ").unlink()
    report = inspect_node(open_node(str(node_copy), None), select=("PCI003",))
    [finding] = [f for f in report.findings if f.reference_id == "PCI003"]
    assert finding.status is Status.NOT_APPLICABLE and "NVSwitch" in finding.reason
