"""TOPO004: the job's NCCL_TOPO_FILE against this node, on copies of the example node with
topology files in the format NCCL_TOPO_DUMP_FILE writes."""

from __future__ import annotations

from pathlib import Path

import pytest

from preflight.checks.topo import nccl_topo_xml_nic_without_busid
from preflight.probes.job import probe_job
from preflight.probes.topo_file import parse_topology, probe_topo_file
from preflight.model import NotApplicable, Severity, Status
from preflight.sources import NodeFS

from conftest import write

GOOD = """<system version="1">
  <cpu numaid="0" affinity="ffffffff" arch="x86_64" vendor="GenuineIntel" familyid="6" modelid="143">
    <pci busid="0000:17:00.0" class="0x060400" vendor="0x1000" device="0xc030" link_speed="32.0 GT/s PCIe" link_width="16">
      <pci busid="0000:18:00.0" class="0x030200" vendor="0x10de" device="0x2330" link_speed="32.0 GT/s PCIe" link_width="16">
        <gpu dev="0" sm="90" rank="0" gdr="1"/>
      </pci>
      <pci busid="0000:1a:00.0" class="0x020700" vendor="0x15b3" device="0x1021" link_speed="32.0 GT/s PCIe" link_width="16">
        <nic>
          <net name="mlx5_0" dev="0" speed="400000" port="1" latency="0.000000" guid="0x2cc2a00003a088a0" maxconn="131072" gdr="1"/>
        </nic>
      </pci>
    </pci>
  </cpu>
</system>
"""


def verdicts(root: Path, topology: str | None, variable: str = "/etc/nccl/topo.xml") -> list[tuple[str, Status, str]]:
    if topology is not None:
        write(root, "/etc/nccl/topo.xml", topology)
    write(root, "/proc/self/environ", f"NCCL_TOPO_FILE={variable}\0".encode())
    found = nccl_topo_xml_nic_without_busid(probe_topo_file(NodeFS(str(root)), probe_job(NodeFS(str(root)))))
    return [(o.subject, o.status, " ".join(e.observed for e in o.evidence) + o.reason) for o in found]


def severities(root: Path) -> list[Severity | None]:
    """The severities TOPO004 gives the files verdicts() last wrote."""
    fs = NodeFS(str(root))
    return [o.severity for o in nccl_topo_xml_nic_without_busid(probe_topo_file(fs, probe_job(fs)))]


def test_a_file_matching_this_node_is_absent(node_copy: Path) -> None:
    assert verdicts(node_copy, GOOD) == []


def test_a_nic_outside_any_pci_node_is_a_warning(node_copy: Path) -> None:
    """NCCL hangs such a NIC off its CPU and runs (ncclTopoAddCpu): GPUDirect RDMA to it is lost,
    no job fails, so the node is warned about, never drained."""
    stray = GOOD.replace("  </cpu>", '    <nic><net name="mlx5_7" dev="7" speed="400000" port="1"/></nic>\n  </cpu>')
    found = verdicts(node_copy, stray)
    assert [(s, st) for s, st, _ in found] == [("nic mlx5_7", Status.PRESENT)] and "outside any <pci" in found[0][2]
    fs = NodeFS(str(node_copy))  # the files verdicts() wrote
    assert [o.severity for o in nccl_topo_xml_nic_without_busid(probe_topo_file(fs, probe_job(fs)))] == [Severity.WARNING]


def test_bus_ids_from_another_machine_are_a_warning(node_copy: Path) -> None:
    """NCCL (2.8.3+) trims file branches that no local GPU or NIC claimed (ncclTopoTrimXml) and
    reads this node's GPUs from sysfs: a stale bus ID misplaces devices, it fails no job."""
    found = verdicts(node_copy, GOOD.replace("0000:18:00.0", "0000:c1:00.0"))
    assert [s for s, _, _ in found] == ["NCCL_TOPO_FILE"] and "not on this node: 0000:c1:00.0" in found[0][2]
    assert severities(node_copy) == [Severity.WARNING]


def test_missing_relative_and_broken_files(node_copy: Path) -> None:
    assert "does not exist" in verdicts(node_copy, None, "/etc/nccl/none.xml")[0][2]
    assert severities(node_copy) == [Severity.WARNING]  # NCCL ignores a file it cannot open and reads sysfs
    assert "relative path" in verdicts(node_copy, GOOD, "topo.xml")[0][2]
    assert "not valid XML" in verdicts(node_copy, "<system><cpu></system>")[0][2]
    bomb = '<?xml version="1.0"?><!DOCTYPE l [<!ENTITY a "aaaaaaaaaa"><!ENTITY b "&a;&a;&a;&a;&a;&a;&a;&a;&a;&a;">]><system>&b;</system>'
    assert [st for _, st, _ in verdicts(node_copy, bomb)] in ([], [Status.PRESENT])  # small entity use parses or is refused, never hangs


def test_not_applicable_without_the_variable(example_root: Path) -> None:
    with pytest.raises(NotApplicable):
        list(nccl_topo_xml_nic_without_busid(probe_topo_file(NodeFS(str(example_root)), probe_job(NodeFS(str(example_root))))))


def test_parse_keeps_the_enclosing_bus_id() -> None:
    nics, devices = parse_topology(GOOD)
    assert nics[0].names == ("mlx5_0",) and nics[0].busid == "0000:1a:00.0"
    assert devices == ("0000:18:00.0", "0000:1a:00.0")
