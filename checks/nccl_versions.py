"""Installed NCCL releases with known bugs, flagged where this node and job can trigger them
(references NVL005, SOCK002, NCCL018, NCCL013, NVL002, TOPO003).

The releases come from ``preflight.checks.nccl_libs`` (every copy a job could load) and the table
in ``checks/_nccl_releases.py``. A release in a buggy range is only a finding when the node's facts
make the bug reachable: dual-port NICs under NVLS for NVL005, a multi-node NVLink clique and an
unsafe stack limit for NVL002, a non-blocking or split-sharing job for NCCL018, RAS left on for
NCCL013 (as NCCL012 does). Copies whose release the node does not name are ``unknown`` where the
rest of the conditions hold.

The multi-node NVLink fabric comes from the ``fabric`` probe (NVML ``nvmlDeviceGetGpuFabricInfo``:
NCCL enables MNNVL when every rank's fabric state is completed and the cluster UUIDs are non-zero
and equal, ``src/mnnvl.cc``). Sources beyond the other probes (``nccl_platform``):
* ``/proc/self/limits`` ``Max stack size``: glibc sizes new threads' stacks from RLIMIT_STACK, but
  uses 2 MiB when it is unlimited. A Slurm prolog inherits slurmd's limits (Slurm's unit file sets
  ``LimitSTACK=infinity``); the job gets the submitting shell's stack limit unless ``slurm.conf``
  excludes STACK from ``PropagateResourceLimits`` (slurm.conf(5)), in which case it gets slurmd's.
* ``/sys/bus/pci/devices/*/{vendor,class}``: NVSwitches (NVIDIA, class 0x0680, as
  ``preflight.checks.fabric`` finds them, but without waiting on NVML) and GPUs;
  ``/sys/bus/pci/devices/<gpu>/max_link_speed`` and the parent bridge's: NCCL's topology
  detection reads both and logs "could not read ..., ignoring" without them (VMs, passthrough).
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Iterator

from preflight.checks._nccl_releases import (
    CONNECT_RETRY,
    MNNVL_STACK,
    NVLS_DUAL_PORT,
    NVLS_SEARCH,
    PCI_SPEED_DETECTION,
    RAS_INIT_RACE,
    SPLIT_NONBLOCKING,
    KnownBug,
    affected,
    release_evidence,
    require_nccl,
)
from preflight.checks.frameworks import FrameworkFacts, parse_version
from preflight.checks.fabric import FabricFacts
from preflight.checks.job import JobFacts, Setting, parse_environ
from preflight.checks.nccl_ib import nccl_selection
from preflight.checks.nccl_libs import NcclLibFacts
from preflight.checks.rdma import IB_CLASS, RdmaFacts, require_rdma
from preflight.model import Evidence, NotApplicable, Observation, Severity, Unknown, present, undecided
from preflight.probing import FactReader
from preflight.records import frozen
from preflight.registry import check, probe
from preflight.sources import NodeFS, SourceError
from preflight.units import UNLIMITED, format_size

FABRIC_COMPLETED = 3
SAFE_STACK = 8192 * 1024  # NCCL's SAFE_STACK_SIZE: the Linux default limit, known to be enough
PCI_DEVICES = "/sys/bus/pci/devices"
_NVIDIA, _GPU_CLASSES, _NVSWITCH_CLASS = "0x10de", ("0x0300", "0x0302"), "0x0680"
_SLURM_CONF_PATHS = ("/etc/slurm/slurm.conf", "/etc/slurm-llnl/slurm.conf")
# Scripts slurmd runs itself carry slurmd's limits, not the job's (Slurm's prolog/epilog guide).
_SLURMD_SCRIPT_CONTEXTS = frozenset({"prolog_slurmd", "epilog_slurmd"})


@frozen
class NcclPlatformFacts:
    """What makes known NCCL bugs reachable on this node, from its files."""

    stack_soft: int | None  # /proc/self/limits "Max stack size" soft, bytes (UNLIMITED)
    slurm_conf: str | None  # the slurm.conf read
    stack_propagated: bool | None  # whether slurm.conf lets the submitting shell's STACK through
    propagation_setting: str  # the deciding slurm.conf line
    nvswitches: tuple[str, ...]  # NVIDIA bridges of class 0x0680 in /sys/bus/pci/devices (NVLS-capable)
    pci_gpus: tuple[str, ...]  # NVIDIA display/3D functions in /sys/bus/pci/devices
    gpus_without_link_speed: tuple[str, ...]  # those with no max_link_speed (own or parent's)
    problems: tuple[str, ...]
    # PCI functions whose vendor or class could not be read: any of them may be a GPU or NVSwitch.
    unclassified: tuple[str, ...] = ()

    def require_classified(self, missing: str) -> None:
        """Unknown rather than "no such device" when ``missing`` may hide among unreadable functions."""
        if self.unclassified:
            raise Unknown(f"{missing} among the classified PCI functions, but {len(self.unclassified)} could not be "
                          f"classified (vendor or class unreadable), e.g. {self.unclassified[0]}")


def parse_stack_limit(text: str) -> int | None:
    """Soft ``Max stack size`` of ``/proc/<pid>/limits`` in bytes (``UNLIMITED`` for unlimited)."""
    for line in text.splitlines():
        if line.startswith("Max stack size"):
            fields = line[len("Max stack size"):].split()
            if fields and (fields[0] == "unlimited" or fields[0].isdigit()):
                return UNLIMITED if fields[0] == "unlimited" else int(fields[0])
    return None


def parse_stack_propagation(text: str) -> tuple[bool, str]:
    """Whether slurm.conf propagates STACK from the submitting shell, and the deciding line."""
    decided: dict[str, tuple[str, str]] = {}
    for line in text.splitlines():
        stripped = line.split("#", 1)[0].strip()
        match = re.match(r"(?i)^(PropagateResourceLimits(?:Except)?)\s*=\s*(\S*)", stripped)
        if match:
            decided["except" if match.group(1).lower().endswith("except") else "only"] = (stripped, match.group(2))
    if "except" in decided:
        line, value = decided["except"]
        names = {item.strip().upper() for item in value.split(",")}
        return not names & {"STACK", "ALL"}, line
    if "only" in decided:
        line, value = decided["only"]
        names = {item.strip().upper() for item in value.split(",")}
        return bool(names & {"STACK", "ALL"}), line
    return True, "(neither PropagateResourceLimits nor PropagateResourceLimitsExcept set: ALL)"


def _nvidia_functions(fs: NodeFS, reader: FactReader) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """NVSwitches and GPUs on the PCI bus, the GPUs whose own or parent's ``max_link_speed`` is
    missing (NCCL reads both), and the functions that could not be classified. Read from sysfs,
    not NVML, so a wedged driver holds none of it."""
    switches, gpus, missing, unclassified = [], [], [], []
    listed = reader.listing(PCI_DEVICES)
    if listed is None:
        unclassified.append(PCI_DEVICES)  # the whole bus: nothing is known to be absent
    for bdf in listed or []:
        base = f"{PCI_DEVICES}/{bdf}"
        known_problems = len(reader.problems)
        vendor = (reader.text(f"{base}/vendor") or "").strip()
        klass = (reader.text(f"{base}/class") or "").strip() if vendor in (_NVIDIA, "") else ""
        if len(reader.problems) > known_problems:
            unclassified.append(bdf)
            continue
        if vendor != _NVIDIA:
            continue
        if klass.startswith(_NVSWITCH_CLASS):
            switches.append(bdf)
        if not klass.startswith(_GPU_CLASSES):
            continue
        gpus.append(bdf)
        try:
            target = fs.readlink(base)
        except SourceError as error:
            reader.problems.append(str(error))
            continue
        # The parent is the bridge above the function in /sys/devices; paths are normalised
        # lexically, so ".." must be taken off the resolved link, not off the bus directory.
        real = posixpath.normpath(posixpath.join(PCI_DEVICES, target)) if target else base
        speeds = {reader.presence(f"{real}/max_link_speed"), reader.presence(f"{posixpath.dirname(real)}/max_link_speed")}
        if None in speeds:
            unclassified.append(bdf)  # not captured or unreadable: not known to be missing
        elif False in speeds:
            missing.append(bdf)
    return tuple(switches), tuple(gpus), tuple(missing), tuple(unclassified)


@probe("nccl_platform", gather_in=("full",))
def probe_nccl_platform(fs: NodeFS) -> NcclPlatformFacts:
    """The stack limit NCCL's threads will get, and GPUs without PCI link speeds."""
    reader = FactReader(fs)
    limits = reader.text("/proc/self/limits")
    try:
        conf_override = parse_environ(fs.read_bytes("/proc/self/environ") or b"").get("SLURM_CONF", "")
    except SourceError:
        conf_override = ""  # the job probe reports an unreadable environment
    nvswitches, pci_gpus, without_link_speed, unclassified = _nvidia_functions(fs, reader)
    slurm_conf, propagated, setting = None, None, ""
    for path in ((conf_override,) if conf_override.startswith("/") else ()) + _SLURM_CONF_PATHS:
        text = reader.text(path)
        if text is not None:
            slurm_conf = path
            propagated, setting = parse_stack_propagation(text)
            break
    return NcclPlatformFacts(
        stack_soft=parse_stack_limit(limits) if limits else None,
        slurm_conf=slurm_conf,
        stack_propagated=propagated,
        propagation_setting=setting,
        nvswitches=nvswitches,
        pci_gpus=pci_gpus,
        unclassified=unclassified,
        gpus_without_link_speed=without_link_speed,
        problems=tuple(reader.problems),
    )


# -- helpers ------------------------------------------------------------------------------------
def _switched_off(job: JobFacts, name: str) -> Setting | None:
    """The setting when it is 0 (NCCL reads these as integers: "0" switches the feature off)."""
    setting = job.nccl(name)
    return setting if setting is not None and setting.value.strip() == "0" else None


def _env(job: JobFacts, name: str, expected: str = "") -> Evidence:
    setting = job.nccl(name)
    if setting is None:
        return Evidence(name, "unset", expected)
    where = "/proc/self/environ" if setting.origin == "environment" else setting.origin
    return Evidence(f"{where} {name}", repr(setting.value), expected)


def _releases(libs: NcclLibFacts, bug: KnownBug, *context: Evidence, severity: Severity | None = None) -> Iterator[Observation]:
    """A finding per copy carrying ``bug``; ``unknown`` per copy whose release is not named."""
    carrying, unnamed = affected(libs, bug)
    for copy in carrying:
        yield present(copy.path, release_evidence(copy, bug), *context, severity=severity)
    for copy in unnamed:
        yield undecided(copy.path, f"the NCCL release of {copy.path} is not named by its file or wheel", *context)


# -- checks -------------------------------------------------------------------------------------
@check("NVL005", profiles=("full",))
def nvls_dual_port_nic_corruption(nccl_libs: NcclLibFacts, nccl_platform: NcclPlatformFacts, rdma: RdmaFacts, job: JobFacts) -> Iterator[Observation]:
    """NCCL 2.18-2.20.2 with NVLS on an NVSwitch node whose NCCL selection uses both ports of a
    dual-port NIC."""
    require_nccl(nccl_libs)
    if not nccl_platform.nvswitches:
        nccl_platform.require_classified("no NVSwitch")
        raise NotApplicable("no NVSwitch on this node: NVLS cannot run")
    require_rdma(rdma)  # unknown when the RDMA devices could not be listed
    if _switched_off(job, "NCCL_NVLS_ENABLE"):
        return
    selection = nccl_selection(rdma, job)
    if selection.unlisted:
        raise Unknown(selection.unlisted[0])
    if selection.undecided:
        port = selection.undecided[0]
        raise Unknown(port.why("state" if port.state is None else "link_layer"))
    adapters: dict[str, list[str]] = {}
    for port in selection.ports:
        device = rdma.device(port.device)
        address = device.pci_address if device is not None else None
        if address is not None:
            adapters.setdefault(address.rsplit(".", 1)[0], []).append(port.subject)
    dual = {adapter: ports for adapter, ports in adapters.items() if len(ports) > 1}
    if not dual:
        return
    yield from _releases(
        nccl_libs, NVLS_DUAL_PORT,
        Evidence("/sys/bus/pci/devices", f"{len(nccl_platform.nvswitches)} NVSwitches (NVLS)"),
        Evidence("/sys/class/infiniband", "; ".join(f"adapter {adapter}: {', '.join(ports)}" for adapter, ports in sorted(dual.items())), "one port per adapter in NCCL's selection, or NVLS off"),
        _env(job, "NCCL_NVLS_ENABLE", "0 until NCCL is upgraded"),
    )


@check("SOCK002", profiles=("full",))
def nccl_connect_retry_econnaborted(nccl_libs: NcclLibFacts) -> Iterator[Observation]:
    """An NCCL release whose connect retry fails on the socket it retries; every multi-process
    job bootstraps over sockets, so a late peer turns into 'Software caused connection abort'."""
    require_nccl(nccl_libs)
    yield from _releases(nccl_libs, CONNECT_RETRY, severity=Severity.WARNING)


def _nonblocking_triggers(job: JobFacts, frameworks: FrameworkFacts) -> tuple[list[Evidence], bool]:
    """Evidence that the job splits or creates non-blocking communicators, and whether it is only
    a risk (a PyTorch release that turns non-blocking on when init_process_group gets device_id)."""
    found: list[Evidence] = []
    torch_env = job.environ.get("TORCH_NCCL_USE_COMM_NONBLOCKING", "").strip().lower()
    if torch_env in ("1", "true", "yes", "y", "on"):
        found.append(Evidence("/proc/self/environ TORCH_NCCL_USE_COMM_NONBLOCKING", torch_env, "0 or unset"))
    share = job.nccl("NCCL_COMM_SPLIT_SHARE_RESOURCES")
    if share is not None and share.value.strip() == "1":
        found.append(_env(job, "NCCL_COMM_SPLIT_SHARE_RESOURCES", "0 or unset"))
    if found:
        return found, False
    if torch_env in ("0", "false", "no", "n", "off"):
        return [], False
    for torch in frameworks.versions("torch"):
        version = parse_version(torch.version)
        # PyTorch 2.6 and 2.7.0 make eagerly initialised groups non-blocking (pytorch#138527);
        # 2.7.1 turned that off again (pytorch#154055).
        if version is not None and (2, 6) <= version[:2] and version[:3] < (2, 7, 1):
            found.append(Evidence(torch.metadata, f"PyTorch {torch.version}: non-blocking communicators when init_process_group gets device_id", "PyTorch 2.7.1 or newer, or TORCH_NCCL_USE_COMM_NONBLOCKING=0"))
    return found, True


@check("NCCL018", profiles=("full",))
def nccl_commsplit_nonblocking_segfault(nccl_libs: NcclLibFacts, job: JobFacts, frameworks: FrameworkFacts) -> Iterator[Observation]:
    """An NCCL release before 2.27.3 with a job that creates non-blocking or resource-sharing
    split communicators."""
    require_nccl(nccl_libs)
    triggers, only_risk = _nonblocking_triggers(job, frameworks)
    if triggers:
        yield from _releases(nccl_libs, SPLIT_NONBLOCKING, *triggers, severity=Severity.WARNING if only_risk else None)


@check("NCCL013", profiles=("full",))
def nccl_ras_init_race(nccl_libs: NcclLibFacts, job: JobFacts) -> Iterator[Observation]:
    """An NCCL release from 2.24 to 2.26 with RAS on (its default); as for NCCL012, a status query
    is what crashes it, and nothing on the node says nobody will query."""
    require_nccl(nccl_libs)
    if _switched_off(job, "NCCL_RAS_ENABLE"):
        return
    yield from _releases(nccl_libs, RAS_INIT_RACE, _env(job, "NCCL_RAS_ENABLE", "0 until NCCL is upgraded (unset: RAS on)"))


def _job_stack(platform: NcclPlatformFacts, job: JobFacts) -> tuple[int | None, str, str]:
    """The stack limit the job's processes get, where it was read, and why it is unknown."""
    if platform.stack_soft is None:
        return None, "", "/proc/self/limits has no readable 'Max stack size' row"
    in_slurmd_script = job.environ.get("SLURM_SCRIPT_CONTEXT", "") in _SLURMD_SCRIPT_CONTEXTS
    if in_slurmd_script and platform.stack_propagated:
        return None, "", f"the job gets the submitting shell's stack limit ({platform.slurm_conf}: {platform.propagation_setting})"
    source = "/proc/self/limits (slurmd's, which the job inherits: STACK not propagated)" if in_slurmd_script else "/proc/self/limits"
    return platform.stack_soft, source, ""


@check("NVL002", profiles=("full",))
def mnnvl_init_stack_overrun(
    nccl_libs: NcclLibFacts, fabric: FabricFacts, nccl_platform: NcclPlatformFacts, job: JobFacts
) -> Iterator[Observation]:
    """NCCL before 2.28.3 on a multi-node NVLink GPU with a stack limit that is unlimited (glibc
    then gives threads 2 MiB) or below 8 MiB."""
    require_nccl(nccl_libs)
    if not nccl_platform.pci_gpus:
        nccl_platform.require_classified("no NVIDIA GPU")
        raise NotApplicable("no NVIDIA GPU in /sys/bus/pci/devices")
    carrying, unnamed = affected(nccl_libs, MNNVL_STACK)
    if not carrying and not unnamed:
        return  # every copy is 2.28.3 or newer (or older than MNNVL), whatever the fabric
    if fabric.nvml_error:
        raise Unknown(f"NVML unavailable ({fabric.nvml_error}); the NVLink fabric cannot be read")
    unanswered = [gpu for gpu in fabric.gpus if gpu.error]
    cliques = [gpu for gpu in fabric.gpus if gpu.state == FABRIC_COMPLETED and gpu.cluster_uuid is not None]
    if not cliques:
        if unanswered and len(unanswered) == len(fabric.gpus) and unanswered[0].error not in ("NVML_ERROR_NOT_SUPPORTED", "NVML_ERROR_FUNCTION_NOT_FOUND"):
            raise Unknown(f"nvmlDeviceGetGpuFabricInfo: {unanswered[0].error}")
        raise NotApplicable("no GPU in a multi-node NVLink fabric (fabric state completed with a cluster UUID)")
    if _switched_off(job, "NCCL_MNNVL_ENABLE"):
        return
    stack, source, unknown = _job_stack(nccl_platform, job)
    clique = Evidence("nvmlDeviceGetGpuFabricInfo", f"{len(cliques)} GPUs in clique {cliques[0].clique_id} of a multi-node NVLink fabric")
    if stack is None:
        for copy in carrying + unnamed:
            yield undecided(copy.path, unknown, clique)
        return
    if SAFE_STACK <= stack < UNLIMITED:
        return
    yield from _releases(
        nccl_libs, MNNVL_STACK, clique,
        Evidence(source, f"stack soft limit {format_size(stack)}", f"{format_size(SAFE_STACK)} or more, not unlimited (ulimit -s 8192)"),
    )


@check("TOPO003", profiles=("full",))
def nccl_topology_search_regression(
    nccl_libs: NcclLibFacts, nccl_platform: NcclPlatformFacts, rdma: RdmaFacts, job: JobFacts
) -> Iterator[Observation]:
    """NCCL 2.18.3-2.19.3 where its known topology regressions apply: the NVLS search crash on
    NVSwitch nodes with network devices (before 2.18.5), and run-to-run differences where sysfs
    has no PCI link speed for a GPU (before 2.19.4)."""
    require_nccl(nccl_libs)
    rdma_unread = next((str(p) for p in rdma.problems if p.path == IB_CLASS), "")
    if nccl_platform.nvswitches and rdma_unread and any(affected(nccl_libs, NVLS_SEARCH)):
        yield undecided("node", f"NVSwitches present, but whether RDMA devices are: {rdma_unread}")
    if nccl_platform.nvswitches and rdma.devices and not _switched_off(job, "NCCL_NVLS_ENABLE"):
        yield from _releases(
            nccl_libs, NVLS_SEARCH,
            Evidence("/sys/bus/pci/devices", f"{len(nccl_platform.nvswitches)} NVSwitches (NVLS) and {len(rdma.devices)} RDMA devices"),
        )
    at_risk = any(part for bug in (NVLS_SEARCH, PCI_SPEED_DETECTION) for part in affected(nccl_libs, bug))
    if at_risk and nccl_platform.unclassified and not (nccl_platform.nvswitches and nccl_platform.pci_gpus):
        # an unreadable function may be the NVSwitch or the GPU without a link speed
        yield undecided("node", f"{len(nccl_platform.unclassified)} PCI function(s) could not be classified "
                                f"(vendor or class unreadable), e.g. {nccl_platform.unclassified[0]}")
    missing = nccl_platform.gpus_without_link_speed
    speed_risk = any(affected(nccl_libs, PCI_SPEED_DETECTION))
    # A topology file replaces sysfs detection; asked only where some copy could carry the bug.
    if missing and speed_risk and job.nccl("NCCL_TOPO_FILE") is None:
        yield from _releases(
            nccl_libs, PCI_SPEED_DETECTION,
            Evidence("/sys/bus/pci/devices/*/max_link_speed", f"missing for GPU {', '.join(missing)} or its parent bridge", "readable (or an NCCL_TOPO_FILE)"),
        )
