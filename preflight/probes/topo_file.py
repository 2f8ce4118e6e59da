"""The topology XML a job hands NCCL with NCCL_TOPO_FILE, checked against this node (TOPO004).

NCCL reads the file instead of probing (VMs whose virtual PCI tree hides the real one use it).
Every NIC should sit under a ``<pci busid="...">`` node so NCCL can place it; NCCL hangs one
directly under ``<cpu>`` off that CPU (``ncclTopoAddCpu``), where GPUDirect RDMA to it is judged
across the CPU and NIC fusion cannot merge it. And a file written for another machine names bus
IDs this node does not have, so NCCL attaches GPUs and NICs to the wrong places.

The format is what ``NCCL_TOPO_DUMP_FILE`` writes (``src/graph/xml.cc``)::

    <system version="1">
      <cpu numaid="0" ...>
        <pci busid="0000:17:00.0" ...>
          <pci busid="0000:18:00.0" class="0x030200" ...><gpu dev="0" .../></pci>
          <pci busid="0000:1a:00.0" class="0x020700" ...><nic><net name="mlx5_0" .../></nic></pci>

The file is read through the node's filesystem (bounded) and read as NCCL reads it
(:mod:`preflight.nccl.topo_xml`, under the rules of every release from 2.7.8): a file NCCL
refuses fails every rank's init, one an XML parser refuses may be fine for NCCL (a raw ``&`` in a
value, an element after ``</system>``) and the reverse (``<?xml ...?>``, tab indentation, a tag
broken over lines, a byte order mark). Bus IDs are taken from the elements NCCL keeps.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from msgspec import Struct

from preflight.nccl.topo_xml import XmlNode, read_topology
from preflight.probing import FactReader
from preflight.registry import probe
from preflight.sources import NodeFS, SourceError

if TYPE_CHECKING:
    from preflight.probes.job import JobFacts, Setting


class TopoNic(Struct, frozen=True):
    names: tuple[str, ...]  # <net name="..."> children
    busid: str | None  # busid of the nearest enclosing <pci>, None when there is none


class TopoFileFacts(Struct, frozen=True):
    setting: Setting | None  # NCCL_TOPO_FILE and where it came from
    exists: bool
    parse_error: str
    read_error: str
    nics: tuple[TopoNic, ...]
    device_busids: tuple[str, ...]  # busids of <pci> nodes holding a <gpu> or <nic>
    node_busids: tuple[str, ...]  # /sys/bus/pci/devices on this node
    parse_unknown: str = ""  # why whether NCCL reads the file is not known (releases differ), "" if known


class ParsedTopology(Struct, frozen=True):
    nics: tuple[TopoNic, ...]
    device_busids: tuple[str, ...]
    refused: str  # why NCCL refuses the file (every release), "" when it reads it
    unsure: str  # why that depends on the release, or was not judged; "" otherwise


def parse_topology(text: str) -> ParsedTopology:
    """The file as NCCL reads it, with the NICs (and their enclosing bus ID) and the bus IDs of
    GPU/NIC PCI elements among the elements NCCL keeps."""
    read = read_topology(text.encode("utf-8"))  # the file's own bytes: read() decoded them as UTF-8
    nics, devices = _devices(read.roots)
    return ParsedTopology(nics, devices, read.refused, read.unsure)


def _devices(roots: list[XmlNode]) -> tuple[tuple[TopoNic, ...], tuple[str, ...]]:
    """Depth first, without recursion (the elements are bounded by NCCL's node limit)."""
    nics: list[TopoNic] = []
    devices: list[str] = []
    pending: list[tuple[XmlNode, str | None]] = [(root, None) for root in reversed(roots)]
    while pending:
        node, busid = pending.pop()
        found = node.get(b"busid") if node.name == b"pci" else None
        if found:
            busid = _text(found).lower()
            if any(child.name in (b"gpu", b"nic") for child in node.subs) or _device_leaf(node):
                devices.append(busid)
        if node.name == b"nic":
            names = tuple(_text(net.get(b"name") or b"?") for net in node.subs if net.name == b"net")
            nics.append(TopoNic(names, busid))
        pending.extend((child, busid) for child in reversed(node.subs))
    return tuple(nics), tuple(devices)


#: PCI classes (the XML's class attribute, 0x<base><sub><prog-if>) of the GPUs and network
#: controllers NCCL attaches to a <pci> element: display (0x0300), 3D (0x0302), Ethernet (0x0200),
#: InfiniBand (0x0207).
DEVICE_CLASSES = (b"0x0300", b"0x0302", b"0x0200", b"0x0207")


def _device_leaf(node: XmlNode) -> bool:
    """A <pci> element with nothing under it whose class is a GPU's or a NIC's: cloud providers'
    files name their devices so (Crusoe's VM topologies), and NCCL adds the <gpu> or <nic> itself
    when it finds the bus ID (ncclTopoFillGpu, ncclTopoFillNet in src/graph/xml.cc)."""
    return not node.subs and (node.get(b"class") or b"").strip().lower().startswith(DEVICE_CLASSES)


def _text(value: bytes) -> str:
    return value.decode("utf-8", "replace")


@probe("topo_file")
def probe_topo_file(fs: NodeFS, job: JobFacts) -> TopoFileFacts:
    """The job's NCCL_TOPO_FILE (environment or nccl.conf, NCCL's precedence), parsed."""
    reader = FactReader(fs)
    setting = job.nccl("NCCL_TOPO_FILE")
    # Unlisted: empty, and TOPO004 then compares nothing (it only reports bus IDs it saw missing).
    node_busids = tuple(name.lower() for name in reader.listing("/sys/bus/pci/devices") or [])
    if setting is None or not setting.value.strip():
        return TopoFileFacts(None, False, "", "", (), (), node_busids)
    path = setting.value.strip()
    if not path.startswith("/"):
        return TopoFileFacts(setting, False, "", "a relative path: NCCL opens it from each rank's working directory", (), (), node_busids)
    try:
        text = fs.read_for(path, job.file_user)  # named by the job: read with the job user's rights
    except SourceError as error:
        return TopoFileFacts(setting, True, "", error.reason, (), (), node_busids)
    if text is None:
        return TopoFileFacts(setting, False, "", "", (), (), node_busids)
    parsed = parse_topology(text)
    return TopoFileFacts(setting, True, parsed.refused, "", parsed.nics, parsed.device_busids, node_busids, parsed.unsure)
