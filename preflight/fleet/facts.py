"""What a fleet audit compares across nodes, and how each value is read from a report's facts.

Each entry of :data:`FACTS` is one line: a stable key (used in JSON and ``--ignore-fact``), a
label for people, and an extractor from the report's ``facts`` object (``{probe name: facts}``,
as ``preflight node --format json`` writes it) to a canonical string. A new probe's fact is one
more line here, and the keys its extractor reads are declared in :mod:`preflight.fleet.shape`
(the fast decoder reads nothing else; ``tests/test_fleet_shape.py`` fails when one is missing).

Reports are untrusted and may come from older preflight versions or failed probes, so an
extractor only reads through the accessors below (:func:`dig`, :func:`records`, :func:`text`,
:func:`integer`), which answer ``None`` for anything missing or of the wrong type; ``None`` means
"unknown" and the node is left out of that comparison. :func:`extract_all` also turns any
exception an extractor still raises into "unknown": a malformed report must never stop an audit.

The comparison has no expectations of its own: a value is only odd because most nodes of the
same hardware class (:class:`HardwareClass`) hold another one.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from typing import Any

from msgspec import Struct
from preflight.units import UNLIMITED, format_size

Facts = dict[str, Any]  # JSON objects parse to dict: cheaper to test than Mapping
Extractor = Callable[[Facts], "str | None"]

NONE = "none"  # a known, empty value (no RoCE ports, no nccl.conf): it is compared like any other
_MAX_VALUE = 400  # longer values are shortened, with a digest so that different ones stay different
# ACS control bits P2P Request Redirect and Completion Redirect (include/uapi/linux/pci_regs.h),
# as checks/pcie.py reads them.
_ACS_REDIRECT_BITS = 0x0004 | 0x0008


class Fact(Struct, frozen=True):
    key: str
    label: str
    extract: Extractor
    # "class": compare within a hardware class; "family": within nodes of the same GPU and NIC
    # models whatever their GPU count, for the count that the class itself is keyed on.
    scope: str = "class"
    # References whose present findings carry the site's expectation for this fact (their
    # evidence's "expected"), shown beside the comparison.
    references: tuple[str, ...] = ()


# -- accessors that never raise ----------------------------------------------------------------

# Facts come from a JSON parser, so a value's type is exactly dict, list, str, int, float or bool
# (or None): ``type(x) is T`` is the test, cheaper than isinstance at 10,000 reports a run, and it
# keeps bool (a subclass of int) out of integers.

def dig(value: Any, *keys: str) -> Any:
    """``value[k1][k2]...`` through objects only; None when any step is missing or not an object."""
    for key in keys:
        if type(value) is not dict:
            return None
        value = value.get(key)
    return value


def records(value: Any) -> list[dict[str, Any]] | None:
    """The objects of a list (other items dropped); None when ``value`` is not a list."""
    if type(value) is not list:
        return None
    return [item for item in value if type(item) is dict]


def text(value: Any) -> str | None:
    return value if type(value) is str else None


def integer(value: Any) -> int | None:
    return value if type(value) is int else None


def strings(value: Any) -> list[str]:
    """The strings of a list; empty for anything else."""
    return [item for item in value if type(item) is str] if type(value) is list else []


def count(value: Any) -> str | None:
    """How many items a list has; None when it is not a list."""
    return str(len(value)) if isinstance(value, list) else None


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

#: Several facts read the same view (the data HCAs, their ports): the last one computed is kept,
#: with the facts object it came from (held, so that its id cannot be reused meanwhile).
_last_view: dict[str, tuple[Facts, Any]] = {}


def _view(name: str, facts: Facts, compute: Callable[[Facts], Any]) -> Any:
    last = _last_view.get(name)
    if last is not None and last[0] is facts:
        return last[1]
    value = compute(facts)
    _last_view[name] = (facts, value)
    return value


def _data_hcas(facts: Facts) -> list[dict[str, Any]] | None:
    devices = records(dig(facts, "rdma", "devices"))
    if devices is None:
        return None
    return [device for device in devices if device.get("nvswitch_management") is not True]


def data_hcas(facts: Facts) -> list[dict[str, Any]] | None:
    """RDMA devices that carry data: NVSwitch management NICs are left out (checks/rdma.py).
    The list is shared between callers: do not change it."""
    return _view("data_hcas", facts, _data_hcas)  # type: ignore[no-any-return]


def nvml_gpus(facts: Facts) -> list[dict[str, Any]] | None:
    gpus = dig(facts, "gpus")
    if not isinstance(gpus, dict) or text(gpus.get("nvml_error")):
        return None
    return records(gpus.get("devices"))


def _gpu_model(facts: Facts) -> str:
    pci = dig(facts, "gpus", "pci_gpus")
    devices = nvml_gpus(facts)
    names = [name for device in devices or () if (name := text(device.get("name")))]
    if names:
        return joined(names, " + ")
    if isinstance(pci, list) and not pci:
        return "no GPU"
    return "unknown GPU"


def _gpu_count_pci(facts: Facts) -> str | None:
    return count(dig(facts, "gpus", "pci_gpus"))


def _nic_model(facts: Facts) -> str:
    devices = data_hcas(facts)
    if devices is None:
        return "unknown NIC"
    models = [text(device.get("hca_type")) or text(device.get("pci_vendor")) or "?" for device in devices]
    return joined(models, " + ") if models else "no RDMA NIC"


class HardwareClass(Struct, frozen=True):
    """Nodes are only compared with nodes of the same class."""

    gpu_model: str
    gpu_count: str  # GPUs on the PCI bus: a GPU NVML lost keeps its node in its class
    nic_model: str

    @property
    def label(self) -> str:
        gpus = self.gpu_model if self.gpu_model in ("no GPU", "unknown GPU") else f"{self.gpu_count}x {self.gpu_model}"
        return f"{gpus} / {self.nic_model}"

    @property
    def family(self) -> str:
        """The class without the GPU count."""
        return f"{self.gpu_model} / {self.nic_model}"


def hardware_class(facts: Facts) -> HardwareClass:
    try:
        return HardwareClass(
            canonical(_gpu_model(facts)), _gpu_count_pci(facts) or "?", canonical(_nic_model(facts))
        )
    except Exception:  # noqa: BLE001 - untrusted facts: a bug here must not stop the audit
        return HardwareClass("unknown GPU", "?", "unknown NIC")


# -- extractors ------------------------------------------------------------------------------------

def _nccl_libraries(facts: Facts) -> str | None:
    copies = records(dig(facts, "nccl_libs", "copies"))
    if copies is None:
        return None
    return joined(f"{text(copy.get('version')) or 'unversioned'} ({text(copy.get('origin')) or '?'})" for copy in copies)


def _hca_names(facts: Facts) -> str | None:
    devices = data_hcas(facts)
    return joined(text(device.get("name")) or "?" for device in devices) if devices is not None else None


def _hca_firmware(facts: Facts) -> str | None:
    devices = data_hcas(facts)
    return joined(text(device.get("fw_ver")) or "unreadable" for device in devices) if devices is not None else None


def _compute_data_ports(facts: Facts) -> list[dict[str, Any]] | None:
    devices = data_hcas(facts)
    if devices is None:
        return None
    return [port for device in devices for port in records(device.get("ports")) or ()]


def _data_ports(facts: Facts) -> list[dict[str, Any]] | None:
    return _view("data_ports", facts, _compute_data_ports)  # type: ignore[no-any-return]


def _port_rates(facts: Facts) -> str | None:
    ports = _data_ports(facts)
    if ports is None:
        return None
    rates: set[tuple[Any, int, str] | None] = set()  # (gbps, width, speed); None: unreadable
    for port in ports:
        rate = port.get("rate")
        if type(rate) is dict:
            gbps, width, speed = rate.get("gbps"), rate.get("width"), rate.get("speed")
            if type(gbps) in (int, float) and type(width) is int and type(speed) is str and speed:
                rates.add((gbps, width, speed))
                continue
        rates.add(None)
    # formatted once per distinct rate, not once per port
    return joined(f"{rate[0]:g} Gb/s ({rate[1]}X {rate[2]})" if rate else "unreadable" for rate in rates)


def _rdma_stack(facts: Facts) -> str | None:
    """MLNX_OFED/DOCA-OFED's version of mlx5_core, or "inbox" (the in-tree driver has no version
    of its own, or one equal to the kernel release)."""
    rdma = dig(facts, "rdma")
    if type(rdma) is not dict or "mlx5_driver_version" not in rdma:
        return None  # a report from before preflight read it
    version = rdma["mlx5_driver_version"]
    if version is None:
        problems = records(rdma.get("problems")) or []
        if any(str(problem.get("path", "")).startswith("/sys/module/mlx5_core") for problem in problems):
            return None  # unreadable
        return "mlx5_core not loaded"
    if type(version) is not str:
        return None
    return "inbox" if version in ("", text(dig(facts, "gpudirect", "kernel_release"))) else version


def _ipoib_modes(facts: Facts) -> str | None:
    ports = _data_ports(facts)
    if ports is None:
        return None
    return joined(mode for port in ports if (mode := text(port.get("ipoib_mode"))))


def _rdma_mtu(facts: Facts) -> str | None:
    devices = data_hcas(facts)
    links = records(dig(facts, "interfaces", "links"))
    if devices is None or links is None:
        return None
    mtu_of = {name: mtu for link in links if type(name := link.get("name")) is str and type(mtu := link.get("mtu")) is int}
    mtus = {mtu_of.get(name) for device in devices for name in strings(device.get("netdevs"))}
    mtus.discard(None)
    return joined(map(str, mtus))


def _nccl_gid_index(facts: Facts) -> str | None:
    ports = records(dig(facts, "roce", "ports"))
    if ports is None:
        return None
    chosen = []
    for port in ports:
        if not isinstance(port.get("nccl_job"), dict):
            chosen.append("unreadable")
            continue
        index = integer(dig(port, "nccl_job", "index"))
        chosen.append(str(index) if index is not None else "no usable GID")
    return joined(chosen)


def _nccl_conf(facts: Facts) -> str | None:
    files = records(dig(facts, "job", "nccl_conf_files"))
    if files is None:
        return None
    shown = []
    for conf in files:
        path = text(conf.get("path")) or "?"
        if text(conf.get("error")):
            shown.append(f"{path}: unreadable")
            continue
        entries = conf.get("entries")
        pairs = [f"{item[0]}={item[1]}" for item in entries if isinstance(item, list) and len(item) == 2
                 and all(isinstance(part, str) for part in item)] if isinstance(entries, list) else []
        shown.append(f"{path}: {' '.join(pairs) or '(empty)'}")
    return "; ".join(shown) if shown else NONE


def _peer_memory(facts: Facts) -> str | None:
    gpudirect = dig(facts, "gpudirect")
    files = dig(gpudirect, "peer_memory_files")
    legacy = dig(gpudirect, "nv_peer_mem_loaded")
    if not isinstance(files, list) or not isinstance(legacy, bool):
        return None
    # "/sys/module/nvidia_peermem/version" -> "nvidia_peermem": the client, not where it was seen
    names = [path.removesuffix("/version").rsplit("/", 1)[-1] for path in strings(files)]
    if legacy:
        names.append("nv_peer_mem module")
    return joined(names)


def _limit(value: Any) -> str | None:
    soft, hard = integer(dig(value, "soft")), integer(dig(value, "hard"))
    if soft is None or hard is None:
        return None
    def shown(number: int) -> str:
        return "unlimited" if number >= UNLIMITED else format_size(number) if number >= 0 else str(number)
    return f"soft {shown(soft)}, hard {shown(hard)}"


def _memlock_slurmd(facts: Facts) -> str | None:
    memlock = dig(facts, "memlock")
    if not isinstance(memlock, dict):
        return None
    if memlock.get("slurmd") is None:
        return "no slurmd" if memlock.get("slurmd_pid") is None else None
    return _limit(memlock.get("slurmd"))


def _fabric_manager_running(facts: Facts) -> str | None:
    manager = dig(facts, "fabric", "fabric_manager")
    if not isinstance(manager, dict) or not isinstance(manager.get("pids"), list):
        return None
    return flag(bool(manager["pids"]) or text(manager.get("listening")) is not None)


def _active_nvlinks(facts: Facts) -> str | None:
    """``GPU0 18, GPU1 18, ...``: a GPU that lost links stands out against its siblings' nodes."""
    gpus = records(dig(facts, "nvlink", "gpus"))
    if gpus is None:
        return None
    counts = []
    for gpu in gpus:
        index, active = gpu.get("index"), gpu.get("active_count")
        if type(index) is not int or type(active) is not int:
            return None  # a GPU whose links could not be read
        counts.append(f"GPU{index} {active}")
    return ", ".join(counts) if counts else NONE


def _acs_redirect(facts: Facts) -> str | None:
    bridges = records(dig(facts, "pcie", "bridges"))
    if bridges is None:
        return None
    redirecting = []
    for bridge in bridges:
        if text(bridge.get("unreadable")):
            return None  # one unknown bridge could be the redirecting one
        acs = bridge.get("acs")
        control = acs.get("control") if type(acs) is dict else None
        if type(control) is int and control & _ACS_REDIRECT_BITS:
            redirecting.append(text(bridge.get("bdf")) or "?")
    if not bridges:
        return "no bridges on GPU-NIC paths"
    return f"on at {joined(redirecting)}" if redirecting else f"off on all {len(bridges)} bridges"


#: The comparison table: one line per fact.
FACTS: tuple[Fact, ...] = (
    Fact("gpu_count_pci", "GPUs on the PCI bus", _gpu_count_pci, scope="family", references=("GPU001",)),
    Fact("gpu_count_nvml", "GPUs NVML sees", lambda f: count(nvml_gpus(f)), references=("GPU001",)),
    Fact("nvidia_driver", "NVIDIA driver", lambda f: text(dig(f, "gpus", "driver_version")) or text(dig(f, "gpudirect", "nvidia_driver"))),
    Fact("driver_flavour", "NVIDIA kernel module flavour", lambda f: text(dig(f, "gpudirect", "driver_flavour"))),
    Fact("kernel", "Kernel release", lambda f: text(dig(f, "gpudirect", "kernel_release"))),
    Fact("nccl_libraries", "NCCL libraries", _nccl_libraries),
    Fact("hca_count", "RDMA NICs (data)", lambda f: count(data_hcas(f)), references=("IB009",)),
    Fact("hca_names", "RDMA NIC names", _hca_names, references=("IB009",)),
    Fact("hca_firmware", "RDMA NIC firmware", _hca_firmware),
    Fact("rdma_stack", "mlx5 driver (MLNX_OFED/DOCA version, or inbox)", _rdma_stack),
    Fact("port_rates", "RDMA port rates", _port_rates),
    Fact("ipoib_mode", "IPoIB mode", _ipoib_modes),
    Fact("rdma_mtu", "MTU of RDMA netdevs", _rdma_mtu),
    Fact("nccl_gid_index", "GID index NCCL picks (RoCE)", _nccl_gid_index),
    Fact("nccl_conf", "nccl.conf", _nccl_conf),
    Fact("peer_memory", "GPUDirect peer memory", _peer_memory),
    Fact("gdrdrv", "gdrdrv loaded", lambda f: flag(dig(f, "gpudirect", "gdrdrv_loaded"))),
    Fact("memlock_slurmd", "memlock of slurmd (jobs inherit it)", _memlock_slurmd),
    Fact("memlock_propagated", "slurm.conf propagates memlock", lambda f: flag(dig(f, "memlock", "memlock_propagated"))),
    Fact("acs_redirect", "ACS redirect on GPU-NIC paths", _acs_redirect),
    Fact("nvswitches", "NVSwitches", lambda f: count(dig(f, "fabric", "nvswitches"))),
    Fact("fabric_manager", "Fabric manager running", _fabric_manager_running),
    Fact("nvlinks_active", "Active NVLinks per GPU", _active_nvlinks),
)


def extract_all(facts: Facts, table: Iterable[Fact]) -> dict[str, str | None]:
    """Every fact's canonical value; None (unknown) for one that cannot be read."""
    values: dict[str, str | None] = {}
    for fact in table:
        try:
            value = fact.extract(facts)
        except Exception:  # noqa: BLE001 - untrusted facts: unknown, never a crash
            value = None
        values[fact.key] = canonical(value) if isinstance(value, str) else None
    return values
