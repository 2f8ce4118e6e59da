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

The file is read through the node's filesystem (bounded) and parsed with the standard library's
expat-based parser, which refuses entity expansion bombs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from msgspec import Struct

from preflight.probing import FactReader
from preflight.registry import probe
from preflight.sources import NodeFS, SourceError

if TYPE_CHECKING:  # imported where a topology file is parsed: most nodes have none
    from xml.etree import ElementTree

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


def parse_topology(text: str) -> tuple[tuple[TopoNic, ...], tuple[str, ...]]:
    """NICs with their enclosing bus ID, and the bus IDs of GPU/NIC PCI nodes; ValueError on XML errors."""
    from xml.etree import ElementTree

    try:
        root = ElementTree.fromstring(text)
    except ElementTree.ParseError as error:
        raise ValueError(str(error)) from None
    nics: list[TopoNic] = []
    devices: list[str] = []

    def walk(node: ElementTree.Element, busid: str | None) -> None:
        if node.tag == "pci" and node.get("busid"):
            busid = node.get("busid", "").lower()
            if any(child.tag in ("gpu", "nic") for child in node):
                devices.append(busid)
        if node.tag == "nic":
            nics.append(TopoNic(tuple(net.get("name", "?") for net in node if net.tag == "net"), busid))
        for child in node:
            walk(child, busid)

    walk(root, None)
    return tuple(nics), tuple(devices)


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
    try:
        nics, devices = parse_topology(text)
    except ValueError as error:
        return TopoFileFacts(setting, True, str(error), "", (), (), node_busids)
    return TopoFileFacts(setting, True, "", "", nics, devices, node_busids)
