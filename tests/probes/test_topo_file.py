"""TOPO004: the job's NCCL_TOPO_FILE against this node, on copies of the example node with
topology files in the format NCCL_TOPO_DUMP_FILE writes."""

from __future__ import annotations

from pathlib import Path

import pytest

from preflight.checks.topo import nccl_topo_xml_nic_without_busid
from preflight.probes.job import probe_job
from preflight.nccl import topo_xml
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


#: Crusoe's VM topology files name GPUs and NICs by bare <pci> elements under made-up ffff:ff
#: switches (crusoecloud/solutions-library, b300-288gb-sxm-ib-cloud-hypervisor.xml); NCCL adds the
#: <gpu> and <nic> when it finds the bus ID.
LEAVES = """<system version="1">
  <cpu numaid="0" affinity="ffffffff" arch="x86_64" vendor="GenuineIntel" familyid="6" modelid="143">
    <pci busid="ffff:ff:01.0" class="0x060400" vendor="0xffff" device="0xffff" link_speed="32.0 GT/s PCIe" link_width="16">
      <pci busid="0000:18:00.0" class="0x030200" vendor="0x10de" device="0x2330" link_speed="32.0 GT/s PCIe" link_width="16"/>
      <pci busid="0000:1a:00.0" class="0x020700" vendor="0x15b3" device="0x101e" link_speed="32.0 GT/s PCIe" link_width="16"/>
    </pci>
  </cpu>
</system>
"""


def test_bare_pci_elements_of_gpus_and_nics_are_devices(node_copy: Path) -> None:
    """A hypervisor update moves a VM's devices and leaves the provider's file behind: the file's
    devices are its bare <pci> elements of GPU and NIC class, not the made-up switches."""
    assert parse_topology(LEAVES).device_busids == ("0000:18:00.0", "0000:1a:00.0")
    assert verdicts(node_copy, LEAVES) == []
    found = verdicts(node_copy, LEAVES.replace("0000:18:00.0", "0000:c1:00.0"))
    assert [s for s, _, _ in found] == ["NCCL_TOPO_FILE"] and "not on this node: 0000:c1:00.0" in found[0][2]


def test_missing_relative_and_broken_files(node_copy: Path) -> None:
    assert "does not exist" in verdicts(node_copy, None, "/etc/nccl/none.xml")[0][2]
    assert severities(node_copy) == [Severity.WARNING]  # NCCL ignores a file it cannot open and reads sysfs
    assert "relative path" in verdicts(node_copy, GOOD, "topo.xml")[0][2]
    assert "reader refuses it" in verdicts(node_copy, "<system><cpu></system>")[0][2]
    bomb = '<?xml version="1.0"?><!DOCTYPE l [<!ENTITY a "aaaaaaaaaa"><!ENTITY b "&a;&a;&a;&a;&a;&a;&a;&a;&a;&a;">]><system>&b;</system>'
    assert [st for _, st, _ in verdicts(node_copy, bomb)] in ([], [Status.PRESENT])  # small entity use parses or is refused, never hangs


def test_not_applicable_without_the_variable(example_root: Path) -> None:
    with pytest.raises(NotApplicable):
        list(nccl_topo_xml_nic_without_busid(probe_topo_file(NodeFS(str(example_root)), probe_job(NodeFS(str(example_root))))))


def test_parse_keeps_the_enclosing_bus_id() -> None:
    parsed = parse_topology(GOOD)
    assert parsed.nics[0].names == ("mlx5_0",) and parsed.nics[0].busid == "0000:1a:00.0"
    assert parsed.device_busids == ("0000:18:00.0", "0000:1a:00.0") and (parsed.refused, parsed.unsure) == ("", "")


def _kept(count: int) -> str:
    """<system>, <cpu> and count - 2 <pci> elements: count elements NCCL keeps."""
    return '<system version="1">\n <cpu numaid="0">\n' + "".join(f'  <pci busid="0000:{i:02x}:00.0"/>\n' for i in range(count - 2)) + " </cpu>\n</system>\n"


FIRST_PCI = '<pci busid="0000:17:00.0" class="0x060400" vendor="0x1000" device="0xc030" link_speed="32.0 GT/s PCIe" link_width="16">'

# What NCCL's own reader makes of each file: v2.30.7-1 (RELEASES[-1]) and v2.18.3-1 (RELEASES[1],
# the rules of 2.8.3 to 2.19.0). Each row was checked against xml.cc of those tags compiled
# unchanged (xmlLoadSub with the topology handlers, 256 and 1024 nodes): "read" is ncclSuccess.
NCCL_OUTCOMES: list[tuple[str, bytes, str, str]] = [
    ("an NCCL_TOPO_DUMP_FILE dump", GOOD.encode(), "read", "read"),
    ("<?xml ...?> first line", b'<?xml version="1.0"?>\n' + GOOD.encode(), "refused", "refused"),
    ("tab indentation", GOOD.replace("  ", "\t").encode(), "refused", "refused"),
    ("a tag broken over lines", GOOD.replace(' class="0x030200"', '\n        class="0x030200"').encode(), "refused", "refused"),
    ("a UTF-8 byte order mark", b"\xef\xbb\xbf" + GOOD.encode(), "refused", "refused"),
    ("CRLF line ends", GOOD.replace("\n", "\r\n").encode(), "read", "read"),
    ("an element after </system>", GOOD.encode() + b'<extra a="1"><b/></extra>\n', "read", "read"),
    ("a stray closing tag after </system> (opens a skipped element)", GOOD.encode() + b"</extra>\n", "refused", "refused"),
    ("raw & and < in a value", GOOD.replace('vendor="GenuineIntel"', 'vendor="AT&T <x>"').encode(), "read", "read"),
    ("a duplicated attribute", GOOD.replace('gdr="1"/>', 'gdr="1" gdr="0"/>', 1).encode(), "read", "read"),
    ("a comment first", b"<!-- node type A -->\n" + GOOD.encode(), "read", "read"),
    ("a comment starting with '='", b"<!--=== A ===-->\n" + GOOD.encode(), "refused", "refused"),
    ("a tag name followed by '='", b'<system version="1"><cpu=1/></system>\n', "refused", "refused"),
    ("single-quoted values", GOOD.replace('busid="0000:18:00.0"', "busid='0000:18:00.0'").encode(), "read", "refused"),
    ("a 254-byte value", _kept(3).replace('busid="0000:00:00.0"', f'busid="{"a" * 254}"').encode(), "refused", "read"),
    ("<system> without version", b"<system>\n</system>\n", "refused", "refused"),
    ("version 2", b'<system version="2">\n</system>\n', "refused", "refused"),
    ("version 0x1 (strtol)", b'<system version="0x1">\n</system>\n', "read", "read"),
    ("version as the 17th attribute", ("<system " + " ".join(f'a{i}="{i}"' for i in range(16)) + ' version="1">\n</system>\n').encode(), "refused", "refused"),
    ("a mismatched closing tag inside a skipped element", b'<system version="1"><foo><bar></baz></foo></system>\n', "read", "read"),
    ("a mismatched closing tag of a kept element", b'<system version="1"><cpu numaid="0"></pci></system>\n', "refused", "refused"),
    ("a closing tag with a blank", b'<system version="1"><cpu numaid="0"></cpu ></system>\n', "refused", "refused"),
    ("two blanks between attributes, a name without value", b'<system version="1"><cpu  numaid="0" flag/></system>\n', "read", "read"),
    ("text between elements", b'<system version="1">\n hello\n</system>\n', "refused", "refused"),
    ("an unterminated <cpu>", b'<system version="1">\n <cpu numaid="0">\n', "refused", "refused"),
    ("an empty file", b"", "read", "read"),
    ("255 kept elements", _kept(255).encode(), "read", "undefined"),  # 2.18.3: a 33rd child overflows subs[32]
    ("256 kept elements", _kept(256).encode(), "refused", "undefined"),
]


@pytest.mark.parametrize(("what", "data", "newest", "older"), NCCL_OUTCOMES, ids=[row[0] for row in NCCL_OUTCOMES])
def test_the_reader_accepts_and_refuses_what_nccl_does(what: str, data: bytes, newest: str, older: str) -> None:
    def outcome(rules: topo_xml.XmlRules) -> str:
        try:
            topo_xml.read_xml(data, rules)
        except topo_xml.Refused:
            return "refused"
        except topo_xml.Undefined:
            return "undefined"
        return "read"

    assert (outcome(topo_xml.RELEASES[-1]), outcome(topo_xml.RELEASES[1])) == (newest, older)


@pytest.mark.parametrize(
    ("topology", "status", "said"),
    [
        ('<?xml version="1.0"?>\n' + GOOD, Status.PRESENT, "expected '>' or a space in <?xml>, got '?'"),
        (GOOD.replace("  ", "\t"), Status.PRESENT, "expected '<', got '\\t' (line 2)"),
        ("\ufeff" + GOOD, Status.PRESENT, "expected '<', got '\\xef'"),
        (GOOD + '<extra a="1"/>\n', None, ""),
        (GOOD.replace('vendor="GenuineIntel"', 'vendor="AT&T <x>"'), None, ""),
        (GOOD.replace('gdr="1"/>', 'gdr="1" gdr="0"/>', 1), None, ""),
        (GOOD.replace('busid="0000:18:00.0"', "busid='0000:18:00.0'"), Status.UNKNOWN, "2.27.3 and later: read"),
    ],
)
def test_topo004_judges_the_file_as_nccl_reads_it(node_copy: Path, topology: str, status: Status | None, said: str) -> None:
    """Files an XML parser takes but NCCL refuses fail every rank's init (error); files NCCL reads
    though an XML parser would not are fine; where releases differ the verdict is unknown."""
    found = verdicts(node_copy, topology)
    if status is None:
        assert found == []
    else:
        assert [(s, st) for s, st, _ in found] == [("NCCL_TOPO_FILE", status)] and said in found[0][2], found


def test_bus_ids_are_taken_from_the_elements_nccl_keeps(node_copy: Path) -> None:
    """NCCL skips an element it does not know with everything inside it: a <pci> there is not
    read, so its bus ID is not this node's concern."""
    skipped = GOOD.replace("  </cpu>", '    <spare><pci busid="0000:c1:00.0" class="0x030200"><gpu dev="9"/></pci></spare>\n  </cpu>')
    assert verdicts(node_copy, skipped) == []
    assert parse_topology(skipped).device_busids == ("0000:18:00.0", "0000:1a:00.0")


@pytest.mark.parametrize("shape", ["deep", "wide"])
def test_hostile_files_are_bounded_and_unknown(node_copy: Path, shape: str) -> None:
    """100 000 nested elements (which made the old recursive walk raise RecursionError) or
    200 000 tags: read without recursion, stopped at the reader's bounds, and unknown."""
    body = "<a>" * 100_000 + "</a>" * 100_000 if shape == "deep" else "<a/>" * 200_000
    found = verdicts(node_copy, '<system version="1">' + body + "</system>\n")
    assert [(s, st) for s, st, _ in found] == [("NCCL_TOPO_FILE", Status.UNKNOWN)] and "not judged" in found[0][2]
