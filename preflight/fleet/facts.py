"""What a fleet audit compares across nodes, and how each value is read from a report's facts.

Each entry of :data:`FACTS` is one line: a stable key (used in JSON and ``--ignore-fact``), a
label for people, the probe fields it reads (``rdma.devices.fw_ver``), and an extractor from
those fields to a canonical string. The fields are read through :data:`FactsView`, a view made
from the probes' own fact types (:func:`preflight.facts.facts_view`): the audit decodes reports
into the same types the probes write, keeping only what some entry reads, and a field name the
probes do not have fails at import. A new probe's fact is one more line here.

Reports are untrusted and may come from older preflight versions or failed probes: a probe whose
facts do not decode into the view is unknown as a whole; a field an older report lacks is UNSET;
either makes an extractor answer ``None``, which means "unknown" and leaves the node out of that
comparison. :func:`extract_all` also turns any exception an extractor still raises into
"unknown": a malformed report must never stop an audit.

The comparison has no expectations of its own: a value is only odd because most nodes of the
same hardware class (:class:`HardwareClass`) hold another one.
"""

from __future__ import annotations

import hashlib
import typing
from collections.abc import Callable, Iterable
from typing import Any

import msgspec
from msgspec import Struct

from preflight.facts import facts_view
from preflight.probes.rdma import PORT_ACTIVE
from preflight.units import UNLIMITED, format_size

Extractor = Callable[[Any], "str | None"]

NONE = "none"  # a known, empty value (no RoCE ports, no nccl.conf): it is compared like any other
_MAX_VALUE = 400  # longer values are shortened, with a digest so that different ones stay different
# ACS control bits P2P Request Redirect and Completion Redirect (include/uapi/linux/pci_regs.h),
# as checks/pci.py reads them.
_ACS_REDIRECT_BITS = 0x0004 | 0x0008


class Fact(Struct, frozen=True):
    key: str
    label: str
    reads: tuple[str, ...]  # probe fields, "probe.field.sub": what FactsView decodes for it
    extract: Extractor  # FactsView -> canonical value, None when unknown
    # "class": compare within a hardware class; "family": within nodes of the same GPU and NIC
    # models whatever their GPU count, for the count that the class itself is keyed on.
    scope: str = "class"
    # References whose present findings carry the site's expectation for this fact (their
    # evidence's "expected"), shown beside the comparison.
    references: tuple[str, ...] = ()
    # The reference that nodes disagreeing on this fact *is* (its [detect] fleet lists this key):
    # the audit then reports a fleet finding with that reference's ID and severity. Only where
    # the reference's own text names the difference between nodes as the misconfiguration.
    decides: str = ""


# -- reading views -----------------------------------------------------------------------------


def at(value: Any, *names: str) -> Any:
    """``value.n1.n2...``; None when a step is missing (None, or UNSET in an older report)."""
    for name in names:
        if value is None or value is msgspec.UNSET:
            return None
        value = getattr(value, name)
    return None if value is msgspec.UNSET else value


def count(value: Any) -> str | None:
    """How many items a list has; None when unknown."""
    return str(len(value)) if isinstance(value, tuple) else None


def flag(value: Any) -> str | None:
    return ("yes" if value else "no") if isinstance(value, bool) else None


def joined(values: Iterable[str], separator: str = ", ") -> str:
    """Sorted, de-duplicated, ``NONE`` when empty: the order facts list things in is not a
    difference between nodes."""
    unique = sorted(set(values))
    return separator.join(unique) if unique else NONE


def canonical(value: str) -> str:
    """Shorten a very long value, keeping a digest of the whole so that two long values that
    differ only past the cut still compare different."""
    if len(value) <= _MAX_VALUE:
        return value
    digest = hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()[:12]
    return f"{value[:_MAX_VALUE - 30]}... (sha256 {digest})"


# -- shared views of the facts --------------------------------------------------------------------


def data_hcas(facts: Any) -> list[Any] | None:
    """RDMA devices that carry data: NVSwitch management NICs are left out (checks/ib.py)."""
    devices = at(facts, "rdma", "devices")
    if devices is None:
        return None
    return [device for device in devices if at(device, "nvswitch_management") is not True]


def data_ports(facts: Any) -> list[Any] | None:
    devices = data_hcas(facts)
    if devices is None:
        return None
    return [port for device in devices for port in at(device, "ports") or ()]


def nvml_gpus(facts: Any) -> Any:
    gpus = at(facts, "gpus")
    if gpus is None or at(gpus, "nvml_error"):
        return None
    return at(gpus, "devices")


#: The GPU model of a node whose NVML named none (failed, or not recorded).
UNKNOWN_GPU = "unknown GPU"


def _gpu_model(facts: Any) -> str:
    names = [name for device in nvml_gpus(facts) or () if (name := at(device, "name"))]
    if names:
        return joined(names, " + ")
    if at(facts, "gpus", "pci_gpus") == ():
        return "no GPU"
    return UNKNOWN_GPU


def _gpu_count_pci(facts: Any) -> str | None:
    return count(at(facts, "gpus", "pci_gpus"))


def _nic_model(facts: Any) -> str:
    devices = data_hcas(facts)
    if devices is None:
        return "unknown NIC"
    models = [at(device, "hca_type") or at(device, "pci_vendor") or "?" for device in devices]
    return joined(models, " + ") if models else "no RDMA NIC"


class HardwareClass(Struct, frozen=True):
    """Nodes are only compared with nodes of the same class."""

    gpu_model: str
    gpu_count: str  # GPUs on the PCI bus: a GPU NVML lost keeps its node in its class
    nic_model: str

    @property
    def label(self) -> str:
        gpus = self.gpu_model if self.gpu_model in ("no GPU", UNKNOWN_GPU) else f"{self.gpu_count}x {self.gpu_model}"
        return f"{gpus} / {self.nic_model}"

    @property
    def family(self) -> str:
        """The class without the GPU count."""
        return f"{self.gpu_model} / {self.nic_model}"


#: The probe fields the hardware class reads.
CLASS_READS = (
    "gpus.pci_gpus", "gpus.nvml_error", "gpus.devices.name",
    "rdma.devices.nvswitch_management", "rdma.devices.hca_type", "rdma.devices.pci_vendor",
)


def hardware_class(facts: Any) -> HardwareClass:
    try:
        return HardwareClass(canonical(_gpu_model(facts)), _gpu_count_pci(facts) or "?", canonical(_nic_model(facts)))
    except Exception:  # noqa: BLE001 - untrusted facts: a bug here must not stop the audit
        return HardwareClass(UNKNOWN_GPU, "?", "unknown NIC")


# -- extractors ------------------------------------------------------------------------------------


def _nccl_libraries(facts: Any) -> str | None:
    copies = at(facts, "nccl_libs", "copies")
    if copies is None:
        return None
    return joined(f"{at(copy, 'version') or 'unversioned'} ({at(copy, 'origin') or '?'})" for copy in copies)


def _nccl_versions(facts: Any) -> str | None:
    """The NCCL releases installed (NCCL017): where each copy lies is not a difference between
    ranks, its version is. A copy whose version could not be read makes the node unknown: it
    could be the one that differs."""
    copies = at(facts, "nccl_libs", "copies")
    if copies is None:
        return None
    # A versioned file that no loader reaches (its directory's libnccl.so.2 links to another
    # release, as a package upgrade leaves it) is no release a job runs.
    versions = [at(copy, "version") for copy in copies if not at(copy, "unreached")]
    if not all(isinstance(version, str) and version for version in versions):
        return None
    return joined(versions)


def _hca_names(facts: Any) -> str | None:
    devices = data_hcas(facts)
    return joined(at(device, "name") or "?" for device in devices) if devices is not None else None


def _hca_firmware(facts: Any) -> str | None:
    devices = data_hcas(facts)
    if devices is None:
        return None
    versions = [at(device, "fw_ver") for device in devices]
    return joined(versions) if all(versions) else None  # one unreadable: the node's firmware is unknown


def _port_rates(facts: Any) -> str | None:
    ports = data_ports(facts)
    if ports is None:
        return None
    rates: set[tuple[float, int, str]] = set()  # (gbps, width, speed)
    down = 0
    for port in ports:
        rate, state = at(port, "rate"), at(port, "state")
        if (rate is None or not rate.speed) and isinstance(state, int) and state != PORT_ACTIVE:
            down += 1  # a pulled cable: no rate to read, and that is the difference
            continue
        if rate is None or not rate.speed:
            return None  # one port's rate unreadable: the node's rates are unknown
        rates.add((rate.gbps, rate.width, rate.speed))
    # formatted once per distinct rate, not once per port
    shown = [f"{rate[0]:g} Gb/s ({rate[1]}X {rate[2]})" for rate in rates]
    return joined([*shown, *([f"{down} port(s) not ACTIVE"] if down else [])])


def _rdma_stack(facts: Any) -> str | None:
    """MLNX_OFED/DOCA-OFED's version of mlx5_core, or "inbox" (the in-tree driver has no version
    of its own, or one equal to the kernel release)."""
    rdma = at(facts, "rdma")
    if rdma is None or rdma.mlx5_driver_version is msgspec.UNSET:
        return None  # a report from before preflight read it
    version = rdma.mlx5_driver_version
    if version is None:
        if any(problem.path.startswith("/sys/module/mlx5_core") for problem in at(rdma, "problems") or ()):
            return None  # unreadable
        return "mlx5_core not loaded"
    return "inbox" if version in ("", at(facts, "gpudirect", "kernel_release")) else version


def _ipoib_modes(facts: Any) -> str | None:
    ports = data_ports(facts)
    if ports is None:
        return None
    return joined(mode for port in ports if (mode := at(port, "ipoib_mode")))


def _rdma_mtu(facts: Any) -> str | None:
    devices = data_hcas(facts)
    links = at(facts, "interfaces", "links")
    if devices is None or links is None:
        return None
    mtu_of = {link.name: mtu for link in links if isinstance(link.name, str) and isinstance(mtu := at(link, "mtu"), int)}
    mtus = {mtu_of.get(name) for device in devices for name in at(device, "netdevs") or ()}
    mtus.discard(None)
    return joined(map(str, mtus))


def _roce_mtu(facts: Any) -> str | None:
    """The MTUs of the netdevs under RoCE (Ethernet link layer) data ports (ROCE006): an
    InfiniBand port's netdev is IPoIB, whose MTU says nothing about the RDMA path MTU, so it is
    left out (``rdma_mtu`` shows it). An unreadable link layer or MTU makes the node unknown."""
    devices = data_hcas(facts)
    if devices is None:
        return None
    netdevs: set[str] = set()
    for device in devices:
        for port in at(device, "ports") or ():
            layer = at(port, "link_layer")
            if layer is None:
                return None
            if layer == "Ethernet":
                netdevs.update(at(port, "netdevs") or at(device, "netdevs") or ())
    if not netdevs:
        return NONE  # no RoCE port: the interfaces need not be read
    links = at(facts, "interfaces", "links")
    if links is None:
        return None
    mtu_of = {link.name: at(link, "mtu") for link in links if isinstance(link.name, str)}
    mtus = [mtu_of.get(name) for name in netdevs]
    if not all(isinstance(mtu, int) for mtu in mtus):
        return None  # a RoCE netdev the interfaces probe did not see, or whose MTU it could not read
    return joined(map(str, mtus))


def _nccl_gid_index(facts: Any) -> str | None:
    ports = at(facts, "roce", "ports")
    if ports is None:
        return None
    chosen = []
    for port in ports:
        job = at(port, "nccl_job")
        if job is None:
            return None  # one port's choice unreadable: the node's is unknown
        index = at(job, "index")
        chosen.append(str(index) if index is not None else "no usable GID")
    return joined(chosen)


def _nccl_conf(facts: Any) -> str | None:
    files = at(facts, "job", "nccl_conf_files")
    if files is None:
        return None
    shown = []
    for conf in files:
        if conf.error:
            return None  # a file NCCL reads that preflight could not: the node's settings are unknown
        # NCCL sets each line's variable unless it is already set (setEnvFile in src/misc/param.cc,
        # setenv without overwrite): the first line of a key decides, and the order of distinct
        # keys means nothing.
        first: dict[str, str] = {}
        for name, value in conf.entries:
            first.setdefault(name, value)
        pairs = [f"{name}={value}" for name, value in sorted(first.items())]
        shown.append(f"{conf.path or '?'}: {' '.join(pairs) or '(empty)'}")
    return "; ".join(shown) if shown else NONE


def _peer_memory(facts: Any) -> str | None:
    files = at(facts, "gpudirect", "peer_memory_files")
    legacy = at(facts, "gpudirect", "nv_peer_mem_loaded")
    if files is None or not isinstance(legacy, bool) or at(facts, "gpudirect", "peer_memory_unknown"):
        return None  # a peer-memory file that could not be looked up may be the one loaded
    # "/sys/module/nvidia_peermem/version" -> "nvidia_peermem": the client, not where it was seen
    names = [path.removesuffix("/version").rsplit("/", 1)[-1] for path in files]
    if legacy:
        names.append("nv_peer_mem module")
    return joined(names)


def _limit(limit: Any) -> str:
    def shown(number: int) -> str:
        return "unlimited" if number >= UNLIMITED else format_size(number) if number >= 0 else str(number)

    return f"soft {shown(limit.soft)}, hard {shown(limit.hard)}"


def _memlock_slurmd(facts: Any) -> str | None:
    memlock = at(facts, "memlock")
    if memlock is None or memlock.slurmd is msgspec.UNSET:
        return None
    if memlock.slurmd is None:
        # "no slurmd" only where /proc was listed: an unlisted /proc hides a running one
        listed = not any(problem.startswith("/proc:") for problem in at(memlock, "problems") or ())
        return "no slurmd" if at(memlock, "slurmd_pid") is None and listed else None
    return _limit(memlock.slurmd)


def _fabric_manager_running(facts: Any) -> str | None:
    manager = at(facts, "fabric", "fabric_manager")
    if manager is None:
        return None
    if at(manager, "not_looked_for"):
        return "not looked for"  # no NVSwitch fabric on this node: none runs here
    return flag(bool(manager.pids) or manager.listening is not None)


def _per_gpu(facts: Any, probe: str, shown: Callable[[Any], str | None]) -> list[tuple[Any, str]] | None:
    """(index, what ``shown`` says of it) for each GPU of ``probe``'s facts; None where the probe's
    GPUs, a GPU's index or what ``shown`` reads of one is unknown."""
    gpus = at(facts, probe, "gpus")
    if gpus is None:
        return None
    values = []
    for gpu in gpus:
        index, value = at(gpu, "index"), shown(gpu)
        if index is None or value is None:
            return None
        values.append((index, value))
    return values


def _active_nvlinks(facts: Any) -> str | None:
    """``GPU0 18, GPU1 18, ...``: a GPU that lost links stands out against its siblings' nodes."""
    counts = _per_gpu(facts, "nvlink", lambda gpu: None if (active := at(gpu, "active_count")) is None else str(active))
    if counts is None:
        return None
    return ", ".join(f"GPU{index} {active}" for index, active in counts) if counts else NONE


def _ecc_mode(gpu: Any) -> str | None:
    error, current, pending = at(gpu, "ecc_mode_error"), at(gpu, "ecc_current"), at(gpu, "ecc_pending")
    if error == "NVML_ERROR_NOT_SUPPORTED":
        return "n/a"
    if error or current is None:
        return None
    mode = "on" if current else "off"
    return mode if pending is None or pending == current else f"{mode} (pending {'on' if pending else 'off'})"


def _ecc_modes(facts: Any) -> str | None:
    """``on`` (every GPU's ECC enabled, nothing pending), else each GPU's: a GPU switched off with
    ``nvidia-smi -e 0``, or one whose change waits for a reset, stands out against its class.
    GPUs without ECC (NVML's NOT_SUPPORTED) read ``n/a``; another NVML error leaves it unknown."""
    modes = _per_gpu(facts, "gpu_health", _ecc_mode)
    if modes is None:
        return None
    if not modes:
        return NONE
    shown = {mode for _, mode in modes}
    return shown.pop() if len(shown) == 1 else ", ".join(f"GPU{index} {mode}" for index, mode in modes)


def _acs_redirect(facts: Any) -> str | None:
    bridges = at(facts, "pcie", "bridges")
    if bridges is None:
        return None
    redirecting = []
    for bridge in bridges:
        if at(bridge, "unreadable"):
            return None  # one unknown bridge could be the redirecting one
        acs = at(bridge, "acs")
        if acs is not None and acs.control & _ACS_REDIRECT_BITS:
            redirecting.append(at(bridge, "bdf") or "?")
    if not bridges:
        return "no bridges on GPU-NIC paths"
    return f"on at {joined(redirecting)}" if redirecting else f"off on all {len(bridges)} bridges"


_HCAS = ("rdma.devices.nvswitch_management",)
_PORTS = (*_HCAS, "rdma.devices.ports.rate", "rdma.devices.ports.ipoib_mode")

#: The comparison table: one line per fact.
FACTS: tuple[Fact, ...] = (
    Fact("gpu_count_pci", "GPUs on the PCI bus", ("gpus.pci_gpus",), _gpu_count_pci, scope="family", references=("GPU001",)),
    Fact("gpu_count_nvml", "GPUs NVML sees", ("gpus.nvml_error", "gpus.devices.name"), lambda f: count(nvml_gpus(f)), references=("GPU001",)),
    Fact("nvidia_driver", "NVIDIA driver", ("gpus.driver_version", "gpudirect.nvidia_driver"),
         lambda f: at(f, "gpus", "driver_version") or at(f, "gpudirect", "nvidia_driver")),
    Fact("driver_flavour", "NVIDIA kernel module flavour", ("gpudirect.driver_flavour",), lambda f: at(f, "gpudirect", "driver_flavour")),
    Fact("kernel", "Kernel release", ("gpudirect.kernel_release",), lambda f: at(f, "gpudirect", "kernel_release")),
    Fact("nccl_libraries", "NCCL libraries", ("nccl_libs.copies",), _nccl_libraries),
    Fact("nccl_versions", "NCCL versions installed", ("nccl_libs.copies",), _nccl_versions, decides="NCCL017"),
    Fact("hca_count", "RDMA NICs (data)", _HCAS, lambda f: count(tuple(d) if (d := data_hcas(f)) is not None else None), references=("IB009",)),
    Fact("hca_names", "RDMA NIC names", (*_HCAS, "rdma.devices.name"), _hca_names, references=("IB009",)),
    Fact("hca_firmware", "RDMA NIC firmware", (*_HCAS, "rdma.devices.fw_ver"), _hca_firmware),
    Fact("rdma_stack", "mlx5 driver (MLNX_OFED/DOCA version, or inbox)",
         ("rdma.mlx5_driver_version", "rdma.problems", "gpudirect.kernel_release"), _rdma_stack),
    Fact("port_rates", "RDMA port rates", (*_PORTS, "rdma.devices.ports.state"), _port_rates),
    Fact("ipoib_mode", "IPoIB mode", _PORTS, _ipoib_modes),
    Fact("rdma_mtu", "MTU of RDMA netdevs", (*_HCAS, "rdma.devices.netdevs", "interfaces.links.name", "interfaces.links.mtu"), _rdma_mtu),
    Fact("roce_mtu", "MTU of RoCE netdevs", (*_HCAS, "rdma.devices.netdevs", "rdma.devices.ports.link_layer", "rdma.devices.ports.netdevs",
                                              "interfaces.links.name", "interfaces.links.mtu"), _roce_mtu, decides="ROCE006"),
    Fact("nccl_gid_index", "GID index NCCL picks (RoCE)", ("roce.ports.nccl_job.index",), _nccl_gid_index),
    Fact("nccl_conf", "nccl.conf", ("job.nccl_conf_files",), _nccl_conf),
    Fact(
        "peer_memory", "GPUDirect peer memory",
        ("gpudirect.peer_memory_files", "gpudirect.peer_memory_unknown", "gpudirect.nv_peer_mem_loaded"), _peer_memory,
    ),
    Fact("gdrdrv", "gdrdrv loaded", ("gpudirect.gdrdrv_loaded",), lambda f: flag(at(f, "gpudirect", "gdrdrv_loaded"))),
    Fact("memlock_slurmd", "memlock of slurmd (jobs inherit it)", ("memlock.slurmd", "memlock.slurmd_pid", "memlock.problems"), _memlock_slurmd),
    Fact("memlock_propagated", "slurm.conf propagates memlock", ("memlock.memlock_propagated",), lambda f: flag(at(f, "memlock", "memlock_propagated"))),
    Fact("acs_redirect", "ACS redirect on GPU-NIC paths", ("pcie.bridges.bdf", "pcie.bridges.unreadable", "pcie.bridges.acs"), _acs_redirect),
    Fact("nvswitches", "NVSwitches", ("fabric.nvswitches",), lambda f: count(at(f, "fabric", "nvswitches"))),
    Fact("fabric_manager", "Fabric manager running", ("fabric.fabric_manager",), _fabric_manager_running),
    Fact("nvlinks_active", "Active NVLinks per GPU", ("nvlink.gpus.index", "nvlink.gpus.active_count"), _active_nvlinks),
    Fact("ecc_mode", "GPU ECC mode", ("gpu_health.gpus.index", "gpu_health.gpus.ecc_current", "gpu_health.gpus.ecc_pending",
                                      "gpu_health.gpus.ecc_mode_error"), _ecc_modes),
)

#: The part of a report's ``facts`` the audit decodes: what the hardware class and FACTS read.
FactsView: type = facts_view([*CLASS_READS, *(path for fact in FACTS for path in fact.reads)])


def facts_of(document_facts: dict[str, Any]) -> Any:
    """A report's ``facts`` object (a dict, from the careful path) as a :data:`FactsView`, each
    field of each probe converted on its own: a malformed field is unknown (UNSET), a probe
    whose facts are not an object is unknown (None), the rest is read as usual."""
    probes: dict[str, Any] = {}
    for name, (view, fields) in _PROBE_VIEWS.items():
        if name not in document_facts:
            continue
        raw = document_facts[name]
        if type(raw) is not dict:
            probes[name] = None
            continue
        kept = {}
        for field, kind in fields.items():
            if field in raw:
                try:
                    kept[field] = msgspec.convert(raw[field], kind)
                except (msgspec.ValidationError, RecursionError):
                    pass  # left UNSET: unknown
        probes[name] = view(**kept)
    return FactsView(**probes)


def _probe_views() -> dict[str, tuple[type, dict[str, Any]]]:
    """Probe name -> (its view type, that view's field types)."""
    views = {}
    for name, kind in typing.get_type_hints(FactsView).items():
        view = next(arg for arg in typing.get_args(kind) if isinstance(arg, type) and issubclass(arg, msgspec.Struct))
        views[name] = (view, typing.get_type_hints(view))
    return views


_PROBE_VIEWS = _probe_views()


def extract_all(facts: Any, table: Iterable[Fact]) -> dict[str, str | None]:
    """Every fact's canonical value; None (unknown) for one that cannot be read."""
    values: dict[str, str | None] = {}
    for fact in table:
        try:
            value = fact.extract(facts)
        except Exception:  # noqa: BLE001 - untrusted facts: unknown, never a crash
            value = None
        values[fact.key] = canonical(value) if isinstance(value, str) else None
    return values
