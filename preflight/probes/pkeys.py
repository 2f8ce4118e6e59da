"""The partition keys NCCL's InfiniBand transport will use on each RDMA port (IB009).

NCCL puts every queue pair it creates in the partition at P_Key table index ``NCCL_IB_PKEY``
(0 when unset; an *index*, parsed like every NCCL integer with ``strtoll(value, NULL, 0)``:
``qpAttr.pkey_index = ncclParamIbPkey()`` in src/transport/net_ib). The table is the port's, as
the subnet manager programmed it; the kernel shows each entry as ``0x%04x`` in
``/sys/class/infiniband/<dev>/ports/<n>/pkeys/<index>`` (what libibverbs' ibv_query_pkey reads).
A RoCE port has one entry, 0xffff at index 0.

Read only where the job sets NCCL_IB_PKEY: the entry it names, with the directory listing for the
table's size (an InfiniBand port lists 128 or more); RoCE ports only for an index other than 0.
Unset, NCCL takes index 0, where the subnet manager puts the port's default partition, which the
node shares with nodes set up alike; nothing is read and nothing judged.
"""

from __future__ import annotations

import re

from msgspec import Struct

from preflight.model import Unknown
from preflight.nccl.gid import nccl_int
from preflight.probes.job import JobFacts
from preflight.probes.rdma import RdmaFacts
from preflight.probing import FactReader
from preflight.registry import probe
from preflight.sources import NodeFS

PKEY_VARIABLE = "NCCL_IB_PKEY"
FULL_MEMBER = 0x8000  # the P_Key's top bit: full member; clear, a limited member
PKEY_BASE = 0x7FFF  # the partition number; 0 is no partition (an empty table slot)
_HEX16 = re.compile(r"(?:0[xX])?[0-9a-fA-F]{1,4}")  # the kernel writes 0x%04x


class PortPkeys(Struct, frozen=True):
    subject: str  # "<dev>/<port>", as the rdma probe names ports
    path: str  # /sys/class/infiniband/<dev>/ports/<n>/pkeys
    link_layer: str | None
    table_size: int | None  # numbered entries listed; None when the directory could not be listed
    key: int | None  # the entry at the index NCCL uses; None when beyond the table or unread
    problems: tuple[str, ...]  # why an entry (or the listing) could not be read


class PkeyFacts(Struct, frozen=True):
    index: int  # the table index NCCL passes: NCCL_IB_PKEY, or 0
    setting: str | None  # NCCL_IB_PKEY as set, None when unset
    origin: str  # "environment" or the nccl.conf that sets it; "" when unset
    setting_unread: str  # an nccl.conf that could not be read and may set it; "" when none
    ports: tuple[PortPkeys, ...]

    def port(self, subject: str) -> PortPkeys | None:
        return next((port for port in self.ports if port.subject == subject), None)


def _read_port(fs: NodeFS, base: str, subject: str, layer: str | None, index: int) -> PortPkeys:
    """The table's size and its entry at ``index``; a table that is not there (a capture without
    it) or not readable leaves both unknown, never an empty table."""
    path = f"{base}/pkeys"
    reader = FactReader(fs)
    names = reader.listing(path)
    if names == [] and reader.presence(path) is False:
        reader.problems.append(f"{path}: missing")
        names = None
    size = None if names is None else sum(1 for name in names if name.isascii() and name.isdigit())
    key = None
    if size is not None and index < size:
        known, text = reader.known_text(f"{path}/{index}")
        stripped = (text or "").strip()
        if _HEX16.fullmatch(stripped):
            key = int(stripped, 16)
        elif known:
            reader.problems.append(f"{path}/{index}: not a P_Key ({stripped[:20] or 'missing'!r})")
    return PortPkeys(subject, path, layer, size, key, tuple(reader.problems))


def _setting(job: JobFacts) -> tuple[int, str | None, str, str]:
    """NCCL_IB_PKEY as NCCL reads it: the index (``ibv_qp_attr.pkey_index`` is 16 bits wide),
    the value as set and where; or why an nccl.conf that may set it could not be read."""
    try:
        setting = job.nccl(PKEY_VARIABLE)
    except Unknown as error:
        return 0, None, "", str(error)
    if setting is None:
        return 0, None, "", ""
    return nccl_int(setting.value, 0) & 0xFFFF, setting.value, setting.origin, ""


@probe("pkeys")
def probe_pkeys(fs: NodeFS, rdma: RdmaFacts, job: JobFacts) -> PkeyFacts:
    """The P_Key table entries NCCL would use on every InfiniBand and RoCE port."""
    index, value, origin, unread = _setting(job)
    ports = []
    for port in rdma.data_ports if value is not None else ():
        # A RoCE port's only entry is 0xffff at index 0 (UCX chooses it for RoCE for that reason);
        # EFA and other layers NCCL's IB transport never opens.
        if port.link_layer == "InfiniBand" or (port.link_layer == "Ethernet" and index != 0):
            ports.append(_read_port(fs, port.path, port.subject, port.link_layer, index))
    return PkeyFacts(index, value, origin, unread, tuple(ports))
