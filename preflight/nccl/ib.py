"""Which RDMA ports NCCL's IB transport would use on this node (references IB003, IB004, IB005).

NCCL's rules (``src/transport/net_ib/init.cc`` ``ncclIbInitDevices``, ``src/misc/utils.cc``
``parseStringList``/``matchIfList``, NCCL 2.30):

* ``NCCL_IB_HCA`` (environment, then the NCCL configuration files; see ``preflight.probes.job``):
  a leading ``^`` excludes the listed devices; after it, a leading ``=`` makes names exact;
  otherwise every name is a *prefix* (``strncmp`` over the entry's length), so ``mlx5_1`` also
  selects ``mlx5_10``. Entries are split at commas (empty ones dropped) and read as
  ``name[:port[:rail[:plane]]]`` with ``atoi`` for the port (``mlx5_0:x`` asks for port 0, which
  no device has). Nothing is trimmed: ``mlx5_0, mlx5_1`` names ``" mlx5_1"``. An empty list
  selects everything, so ``^`` alone excludes everything.
* Only ports whose state is ACTIVE and whose link layer is InfiniBand or Ethernet are kept (EFA's
  ``Unknown`` link layer is the aws-ofi-nccl plugin's business).
* Device order: since 2.29.7 NCCL sorts its devices by PCI address unless
  ``NCCL_IB_DEVICE_PCI_ORDER=0``; earlier releases number them as libibverbs lists them, which
  follows the kernel's registration order, the order that ``mlx5_<N>`` names are handed out in.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from msgspec import Struct

from preflight.model import NotApplicable, Unread
from preflight.nccl.gid import nccl_int
from preflight.probes.job import JobFacts, Setting
from preflight.probes.nccl_libs import NcclLibFacts
from preflight.probes.pcie import PcieFacts
from preflight.probes.rdma import PORT_ACTIVE, RdmaFacts, RdmaPort, ports_unlisted

NCCL_LINK_LAYERS = ("InfiniBand", "Ethernet")


_ATOI = re.compile(r"^\s*([+-]?\d+)")


class HcaEntry(Struct, frozen=True):
    """One ``NCCL_IB_HCA`` entry."""

    text: str  # as written: "mlx5_1:1"
    name: str  # "mlx5_1"
    port: int | None  # None: any port


class HcaList(Struct, frozen=True):
    """``NCCL_IB_HCA`` as NCCL parses it."""

    exclude: bool  # leading "^"
    exact: bool  # leading "=" (after any "^")
    entries: tuple[HcaEntry, ...]

    def entry_matches(self, entry: HcaEntry, device: str, port: int) -> bool:
        name_ok = device == entry.name if self.exact else device.startswith(entry.name)
        return name_ok and (entry.port is None or entry.port == port)

    def selects(self, device: str, port: int) -> bool:
        listed = not self.entries or any(self.entry_matches(entry, device, port) for entry in self.entries)
        return listed != self.exclude


def _atoi(text: str) -> int:
    match = _ATOI.match(text)
    return int(match.group(1)) if match else 0


def parse_nccl_ib_hca(value: str | None) -> HcaList:
    """Parse ``NCCL_IB_HCA`` the way NCCL does; ``None`` (unset) selects everything."""
    text = value or ""
    exclude = text.startswith("^")
    text = text[1:] if exclude else text
    exact = text.startswith("=")
    text = text[1:] if exact else text
    entries = []
    for item in text.split(","):
        name, _, rest = item.partition(":")
        if not name:
            continue
        port_text = rest.split(":", 1)[0]
        entries.append(HcaEntry(item, name, _atoi(port_text) if port_text else None))
    return HcaList(exclude, exact, tuple(entries))


def ib_hca_selects(setting: str | None, device: str, port: int) -> bool:
    """Whether ``NCCL_IB_HCA`` lets NCCL use ``device`` port ``port`` (NCCL's grammar, parsed by
    :func:`parse_nccl_ib_hca`); unset or empty selects everything."""
    return parse_nccl_ib_hca(setting).selects(device, port)


class Selection(Struct, frozen=True):
    """What NCCL's IB transport would open on this node."""

    setting: Setting | None  # NCCL_IB_HCA and where it came from
    hca: HcaList
    ports: tuple[RdmaPort, ...]  # kept ports, in device order
    undecided: tuple[RdmaPort, ...]  # listed ports whose state or link layer is unknown
    unlisted: tuple[str, ...] = ()  # "path: reason" of selected devices whose ports are unknown
    # Why devices NCCL_IB_HCA leaves in are not kept: its topology search passes them over
    # (preflight.nccl.net_choice), given only where the caller asked for that model
    passed_over: tuple[str, ...] = ()

    @property
    def devices(self) -> list[str]:
        return list(dict.fromkeys(port.device for port in self.ports))

    def describe(self) -> str:
        return ", ".join(f"{port.subject} {port.link_layer}" for port in self.ports) or "nothing"


def nccl_selection(rdma: RdmaFacts, job: JobFacts, passed: Mapping[str, str] | None = None) -> Selection:
    """The ports NCCL_IB_HCA leaves NCCL; where it is unset, without the devices ``passed``
    names (those NCCL's topology search never makes a GPU's network device)."""
    setting = job.nccl("NCCL_IB_HCA")
    hca = parse_nccl_ib_hca(setting.value if setting else None)
    kept, unknown, unlisted = [], [], []
    skipped = (passed or {}) if setting is None else {}
    for device in rdma.devices:
        if device.name in skipped:
            continue
        problem = ports_unlisted(device)
        if problem is not None and (hca.exclude or not hca.entries or any(device.name.startswith(e.name.strip()) for e in hca.entries)):
            unlisted.append(str(problem))
        for port in device.ports:
            if not hca.selects(device.name, port.number):
                continue
            if port.state is None or port.link_layer is None:
                unknown.append(port)
            elif port.state == PORT_ACTIVE and port.link_layer in NCCL_LINK_LAYERS:
                kept.append(port)
    return Selection(setting, hca, tuple(kept), tuple(unknown), tuple(unlisted), tuple(skipped[name] for name in sorted(skipped)))


#: Devices one fused NIC may hold (NCCL_NET_MAX_DEVS_PER_NIC, net API v9 and v10); NCCL's list
#: parser stops after this many names, so further names of a group are ignored.
MAX_DEVS_PER_NIC = 4
#: The first release with NIC fusion and NCCL_NET_FORCE_MERGE (absent from src/ at v2.23.4-1).
FUSION_SINCE = (2, 24)


#: NCCL_NET names of the networks of nccl-rdma-sharp-plugins (HPC-X's libnccl-net.so) that open
#: the verbs ports NCCL's own IB transport would, with the same NCCL_IB_HCA filter
#: (nccl_p2p_ib_init in src/p2p_plugin.c): its copy of that transport, "IBext_v6" to "IBext_v11",
#: which also picks GIDs as NCCL does (ib_plugin.c), and its UCX transports, which leave the GID
#: to UCX.
PLUGIN_IB_NET = "ibext"
PLUGIN_UCX_NETS = ("ucx", "ucx-rma", "ucx-uct", "ucx-uct-rd")


def ib_transport_off(job: JobFacts, ucx_counts: bool = False) -> str:
    """Why NCCL will not use its IB transport (NCCL_NET naming another network, NCCL_IB_DISABLE),
    or "" when nothing turns it off. The plugin's IBext networks are that transport; its UCX ones
    count where only which ports are opened matters (``ucx_counts``)."""
    net = job.nccl("NCCL_NET")
    name = net.value.strip().lower() if net is not None else "ib"
    if net is not None and name != "ib" and not name.startswith(PLUGIN_IB_NET) and not (ucx_counts and name in PLUGIN_UCX_NETS):
        return f"NCCL_NET={net.value}: NCCL uses another network than its IB/RoCE transport"
    if name != "ib":
        return ""  # the plugin's: it does not read NCCL_IB_DISABLE (NCCL_IBEXT_DISABLE, NCCL_UCX_DISABLE instead)
    disabled = job.nccl("NCCL_IB_DISABLE")
    if disabled is not None and nccl_int(disabled.value, 0) != 0:
        return f"NCCL_IB_DISABLE={disabled.value}: NCCL's IB/RoCE transport is off"
    return ""


def plugin_transport(job: JobFacts | Unread, nccl_libs: NcclLibFacts | Unread) -> str:
    """The network plugin whose transport, not NCCL's own, carries a job's RDMA traffic: the one
    NCCL_NET_PLUGIN names (libnccl-net-<name>.so, or the name itself), else libnccl-net.so where
    the loader finds it (src/plugin/net.cc); "" where none loads or NCCL_NET picks NCCL's own
    "IB" or "Socket" transport, or the libraries are unread. With the job's settings unread, only
    a plugin the loader finds by default counts."""
    if isinstance(nccl_libs, Unread):
        return ""
    net = job.nccl("NCCL_NET") if not isinstance(job, Unread) else None
    if net is not None and net.value.strip().lower() in ("ib", "socket"):
        return ""
    named = job.nccl("NCCL_NET_PLUGIN") if not isinstance(job, Unread) else None
    if named is None:
        wanted = {"libnccl-net.so"}
    elif named.value.strip().lower() in ("", "none"):
        return ""
    else:
        wanted = {named.value.strip(), f"libnccl-net-{named.value.strip()}.so"}
    return next((path for path in nccl_libs.net_plugins if path.rsplit("/", 1)[-1] in wanted or path in wanted), "")


def sockets_only(job: JobFacts | Unread, nccl_libs: NcclLibFacts | Unread) -> str:
    """Why NCCL moves the job's data over its socket transport alone (so it registers no memory
    with a NIC and uses no GPUDirect RDMA): NCCL_NET=Socket, or its IB transport turned off with
    no network plugin for the loader to find; "" otherwise, or where that is not known."""
    if isinstance(job, Unread):
        return ""
    net = job.nccl("NCCL_NET")
    if net is not None:
        return f"NCCL_NET={net.value}: NCCL's socket transport carries the data" if net.value.strip().lower() == "socket" else ""
    off = ib_transport_off(job)
    if not off or isinstance(nccl_libs, Unread) or plugin_transport(job, nccl_libs) or nccl_libs.problems:
        return ""
    return f"{off}, and no network plugin for NCCL to load: its socket transport carries the data"


def require_ib_transport_on(job: JobFacts, ucx_counts: bool = False) -> None:
    """NotApplicable, with the reason, when the job turns NCCL's IB transport off: ncclIbInit then
    returns before it opens any device (init.cc@v2.30.7-1), so no port's state, GID or MTU matters
    to NCCL. ``ucx_counts``: the check is about which devices are opened, which the plugin's UCX
    networks choose as NCCL does."""
    off = ib_transport_off(job, ucx_counts)
    if off:
        raise NotApplicable(off)


def ib_carries_data(rdma: RdmaFacts, job: JobFacts) -> bool | None:
    """Whether NCCL's IB transport carries a job's data between nodes here (an ACTIVE port
    NCCL_IB_HCA keeps, the transport not turned off); then NCCL's own sockets are its bootstrap
    ones, on the one interface it picks first. None when the ports cannot be told."""
    if ib_transport_off(job):
        return False
    selection = nccl_selection(rdma, job)
    if selection.ports:
        return True
    unknown = selection.undecided or selection.unlisted or rdma.class_unread or rdma.verbs_class_present is None
    return None if unknown else False


def selection_unseen(job: JobFacts, site_hcas: tuple[str, ...] | None) -> bool:
    """Whether the ports a job's NCCL opens are unseen here: NCCL_IB_HCA is set nowhere this run
    can read (a prolog, a health check or a shell sees neither the job's environment nor its
    choice; /etc/nccl.conf it does see), the run is not one of the job's processes, and the site
    named no data HCAs (expect.hcas). A front-end or storage NIC beside the rails then counts only
    for jobs that set no NCCL_IB_HCA. Raises Unknown where a configuration file is unreadable."""
    return not job.in_job_process and site_hcas is None and job.nccl("NCCL_IB_HCA") is None


def parse_force_merge(value: str) -> list[tuple[str, tuple[HcaEntry, ...]]]:
    """``NCCL_NET_FORCE_MERGE`` as ``ncclTopoForceMerge`` reads it (``src/graph/topo.cc``): groups
    split at ``;`` (empty ones skipped by strtok_r), each parsed by ``parseStringList``
    (``src/misc/utils.cc``) into at most four ``name[:port]`` entries; an entry needs a name, a
    port is read with ``atoi``, and ``^`` or ``=`` mean nothing here. A group with no entry at all
    comes back empty."""
    groups = []
    for group in (part for part in value.split(";") if part):
        entries = []
        for item in group.split(","):
            name, colon, rest = item.partition(":")
            if name:
                entries.append(HcaEntry(item, name, _atoi(rest) if colon else None))
            if len(entries) == MAX_DEVS_PER_NIC:
                break
        groups.append((group, tuple(entries)))
    return groups


def data_direct_gpus(pcie: PcieFacts, job: JobFacts) -> set[str]:
    """GPUs that share their PCIe switch with a ConnectX-8 Data Direct function, where NCCL's IB
    transport places the NIC (path PXB) unless NCCL_IB_DATA_DIRECT=0 turns that off
    (src/transport/net_ib/init.cc: on by default, the Data Direct device alone exposed)."""
    setting = job.nccl("NCCL_IB_DATA_DIRECT")
    if setting is not None and nccl_int(setting.value, 1) == 0:
        return set()
    return {gpu for gpu, _, _ in pcie.data_direct_pairs}
