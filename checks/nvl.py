"""NVLink, NVSwitch fabric and NVLS (NVL references)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from preflight.model import (
    NOT_GIVEN,
    Evidence,
    NotApplicable,
    Observation,
    Severity,
    Unknown,
    Unread,
    present,
    undecided,
)
from preflight.nccl.ib import nccl_selection, selection_unseen
from preflight.nccl.nvls import nvls_ruled_out
from preflight.nccl.releases import MNNVL_ALLTOALL, MNNVL_STACK, NVLS_DUAL_PORT, affected, release_findings, require_nccl
from preflight.probes.job import job_ranks, setting_evidence, switched_off
from preflight.probes.nccl_platform import NcclPlatformFacts
from preflight.probes.nvlink import GpuNvlinks, NvlinkFacts, require_nvml
from preflight.probes.rdma import RdmaFacts, require_rdma
from preflight.registry import check
from preflight.units import UNLIMITED, format_size

if TYPE_CHECKING:
    from collections.abc import Iterator

    from preflight.config import Expectations
    from preflight.probes.fabric import FabricFacts, FabricManager
    from preflight.probes.gpus import GpuFacts
    from preflight.probes.job import JobFacts
    from preflight.nccl.releases import KnownBug
    from preflight.probes.nccl_libs import NcclCopy, NcclLibFacts
    from preflight.probes.p2p import P2pFacts

# A fabric manager that first started this long after boot was restarted (or started by hand);
# at boot it starts with the driver, within a minute or two. Generous, so that a driver
# container installing the driver after boot does not count.
LATE_START_S = 30 * 60


FABRIC_STATES = {0: "not supported", 1: "not started", 2: "in progress", 3: "completed"}


_COMPLETED = 3


_API_MISSING = ("NVML_ERROR_FUNCTION_NOT_FOUND", "NVML_ERROR_NOT_SUPPORTED")


def _manager_missing(manager: FabricManager) -> Evidence:
    return Evidence("/proc/*/comm, /proc/net/tcp", "no nv-fabricmanager process and nothing listening on its command port",
                    "nvidia-fabricmanager running on NVSwitch systems")


def _fabric_completed(fabric: FabricFacts) -> bool:
    """Every GPU reports its NVLink fabric completed with success: the fabric manager did its
    work, whatever this view of the node shows of it."""
    return bool(fabric.gpus) and all(not gpu.error and gpu.state == _COMPLETED and gpu.status == 0 for gpu in fabric.gpus)


def _switch_evidence(nvswitches: tuple[str, ...], rdma: RdmaFacts | Unread) -> Evidence | None:
    """What shows that this node's GPUs sit on NVSwitches: NVSwitch PCI functions (HGX A100 and
    H100 boards), or the baseboard's NVSwitch management functions (HGX/DGX B200 and later, whose
    switches Fabric Manager and NVLSM reach through those ConnectX functions, not over PCIe, so no
    NVSwitch is on the host's PCI bus); None when neither is seen."""
    if nvswitches:
        return Evidence("/sys/bus/pci/devices", f"{len(nvswitches)} NVSwitches")
    management = [] if isinstance(rdma, Unread) else [device.name for device in rdma.devices if device.nvswitch_management]
    if management:
        return Evidence("/sys/class/infiniband/*/device/vpd", f"{', '.join(management)}: NVSwitch management functions (SMDL=SW_MNG)")
    return None


def _manager_not_seen(fabric: FabricFacts, switches: Evidence, manager: FabricManager, forced: list[Evidence]) -> Observation:
    """No fabric manager process or command socket seen: present only in the host's own process
    table (positive evidence, see the fabric probe) and while some GPU's fabric is not completed."""
    if manager.not_looked_for:
        return undecided("fabric manager", f"not looked for: {manager.not_looked_for}")
    # Beside a completed fabric the manager did its work; whether it still serves NVLS is what
    # a view that is not the host's cannot tell (a Kubernetes pod, Slurm on Kubernetes).
    done = "; every GPU reports its NVLink fabric completed with success, which a fabric manager did" if _fabric_completed(fabric) else ""
    if manager.host_view is None:
        return undecided("fabric manager", f"no nv-fabricmanager process seen, but {manager.not_host}: "
                                           f"whether this is the host's process table is not known{done}")
    if not manager.host_view:
        return undecided("fabric manager", f"no nv-fabricmanager process seen, but {manager.not_host}: this is not the host's process table{done}")
    if _fabric_completed(fabric):
        return undecided("fabric manager", "no nv-fabricmanager process or command socket seen, but every GPU reports its NVLink "
                                           "fabric completed with success (nvmlDeviceGetGpuFabricInfo), which a fabric manager did")
    return present("fabric manager", _manager_missing(manager), switches, *forced)


@check("NVL006", profiles=("prolog",), optional=("rdma",))
def nvls_multicast_init_failure(fabric: FabricFacts, job: JobFacts, rdma: RdmaFacts | Unread = NOT_GIVEN) -> Iterator[Observation]:
    """GPUs outside a completed NVLink fabric, or an NVSwitch system without its fabric manager."""
    switches = _switch_evidence(fabric.nvswitches, rdma)
    if not switches and fabric.nvswitch_problem:
        raise Unknown(f"cannot tell whether this node has NVSwitches: {fabric.nvswitch_problem}")
    if not fabric.nvidia_functions and not fabric.gpus:
        raise NotApplicable("no NVIDIA GPU or NVSwitch on this node's PCI bus")
    if not switches and fabric.nvml_error in ("NVML_REPLAY_UNREADABLE", "NVML_UNEXPECTED_ANSWER", "NVML_NOT_RECORDED"):
        raise Unknown(f"NVML answers are not available ({fabric.nvml_error}): a multi-node fabric cannot be looked for")
    if not switches and fabric.nvml_error:
        # GPU001 reports a broken NVML; here it only means a GB200-style tray cannot be recognised.
        raise NotApplicable(f"no NVSwitch on this node (NVML unavailable, {fabric.nvml_error}, to look for a multi-node fabric)")
    if not switches and not fabric.multi_node_tray:
        raise NotApplicable("no NVSwitch on this node and no GPU in a multi-node NVLink fabric")
    if fabric.nvml_error == "NVML_NOT_RECORDED":
        raise Unknown("no NVML answers recorded for this root")
    if fabric.nvml_error:
        raise Unknown(f"NVML unavailable ({fabric.nvml_error}); the fabric state cannot be read")
    nvls = job.nccl("NCCL_NVLS_ENABLE")
    forced = [Evidence(f"NCCL_NVLS_ENABLE ({nvls.origin})", nvls.value, "unset, or 0 until the fabric is fixed")] if nvls and nvls.value.strip() == "1" else []
    manager = fabric.fabric_manager
    if switches:
        # The fabric manager serves NVLS multicast setup while jobs run, so one that is gone
        # matters; but one not seen in a view that may not be the host's, or beside GPUs whose
        # fabric it completed, may simply run where this view cannot see it.
        if not manager.running:
            yield _manager_not_seen(fabric, switches, manager, forced)
    if fabric.gpus and all(gpu.error in _API_MISSING for gpu in fabric.gpus):
        return  # a driver without the fabric-info API: the fabric manager is all there is to check
    for gpu in fabric.gpus:
        if gpu.error:
            yield undecided(f"GPU{gpu.index}", f"nvmlDeviceGetGpuFabricInfo: {gpu.error}")
        elif gpu.state != _COMPLETED or gpu.status != 0:
            state = FABRIC_STATES.get(gpu.state or 0, f"state {gpu.state}")
            evidence = [Evidence("nvmlDeviceGetGpuFabricInfo", f"fabric {state}, status {gpu.status}", "completed, status 0 (success)")]
            if fabric.multi_node_tray:
                evidence.append(Evidence("nvmlDeviceGetGpuFabricInfo", f"cluster {gpu.cluster_uuid}, clique {gpu.clique_id}",
                                         "registered with the NVLink switch trays' fabric manager"))
            yield present(f"GPU{gpu.index}", *evidence, *forced)


def _duration(seconds: float) -> str:
    minutes = int(seconds // 60)
    return f"{minutes // 60} h {minutes % 60} min" if minutes >= 60 else f"{minutes} min"


@check("NVL004", profiles=("full",), optional=("rdma",))
def nvls_cuda_invalid_argument(fabric: FabricFacts, rdma: RdmaFacts | Unread = NOT_GIVEN) -> Iterator[Observation]:
    """A fabric manager on an NVSwitch system that started long after boot: restarted, so NVLS
    multicast state may be invalid until the node reboots."""
    switches = _switch_evidence(fabric.nvswitches, rdma)
    if not switches and fabric.nvswitch_problem:
        raise Unknown(f"cannot tell whether this node has NVSwitches: {fabric.nvswitch_problem}")
    if not switches:
        raise NotApplicable("no NVSwitch on this node: no fabric manager runs here")
    manager = fabric.fabric_manager
    if manager.not_looked_for:
        yield undecided("fabric manager", f"not looked for: {manager.not_looked_for}")
        return
    if not manager.pids:
        if manager.running:
            yield undecided("fabric manager", f"its command socket listens ({manager.listening}) but no process is visible to date its start")
            return
        unread = [p for p in manager.problems if p.split(": ", 1)[0].endswith("/comm") or p.split(": ", 1)[0] == "/proc"]
        if unread:  # the process may be the one whose name could not be read
            yield undecided("fabric manager", f"cannot tell whether nv-fabricmanager runs: {unread[0]}")
            return
        if manager.host_view is not True:  # a container's process table: the host's manager is out of sight
            yield undecided("fabric manager", f"no nv-fabricmanager process seen, but {manager.not_host or 'whether this is the host process table is not known'}")
            return
        raise NotApplicable("no fabric manager process running (NVL006 reports that)")
    pid = manager.pids[0]
    if manager.started_after_boot_s is None:
        yield undecided("fabric manager", f"/proc/{pid}/stat could not be read to tell when nv-fabricmanager started")
    elif manager.started_after_boot_s > LATE_START_S:
        yield present(
            "fabric manager",
            Evidence(f"/proc/{pid}/stat", f"nv-fabricmanager (pid {pid}) started {_duration(manager.started_after_boot_s)} after boot",
                     f"started at boot (within {LATE_START_S // 60} min), not restarted since"),
            severity=Severity.WARNING,
        )


FABRIC_COMPLETED = 3


SAFE_STACK = 8192 * 1024  # NCCL's SAFE_STACK_SIZE: the Linux default limit, known to be enough


# -- checks -------------------------------------------------------------------------------------
#: NVL005 where the jobs' NCCL_IB_HCA is unseen (preflight.nccl.ib.selection_unseen).
DUAL_PORT_UNSEEN_FIX = (
    "NCCL's default selection would use both ports of this adapter, but jobs that name their rails in "
    "NCCL_IB_HCA (a storage or front-end dual-port NIC left out) are safe. Name the rails in NCCL_IB_HCA "
    "in /etc/nccl.conf (or in expect.hcas) so that only they are judged, set NCCL_NVLS_ENABLE=0, or "
    "upgrade NCCL past 2.20.2."
)


@check("NVL005", profiles=("full",), optional=("p2p",))
def nvls_dual_port_nic_corruption(
    nccl_libs: NcclLibFacts, nccl_platform: NcclPlatformFacts, rdma: RdmaFacts, job: JobFacts, expect: Expectations,
    p2p: P2pFacts | Unread = NOT_GIVEN,
) -> Iterator[Observation]:
    """NCCL 2.18-2.20.2 with NVLS on an NVSwitch node of Hopper or later GPUs whose NCCL selection
    uses both ports of a dual-port NIC (where NCCL_IB_HCA is unset, the site's expect.hcas stand
    for it; where the jobs' choice is unseen, a warning)."""
    require_nccl(nccl_libs)
    switches = _switch_evidence(nccl_platform.nvswitches, rdma)
    if not switches:
        nccl_platform.require_classified("no NVSwitch")
        raise NotApplicable("no NVSwitch on this node: NVLS cannot run")
    if ruled_out := nvls_ruled_out(p2p):
        raise NotApplicable(ruled_out)
    require_rdma(rdma)  # unknown when the RDMA devices could not be listed
    if switched_off(job, "NCCL_NVLS_ENABLE"):
        return
    selection = nccl_selection(rdma, job)
    if selection.unlisted:
        raise Unknown(selection.unlisted[0])
    if selection.undecided:
        port = selection.undecided[0]
        raise Unknown(port.why("state" if port.state is None else "link_layer"))
    site = expect.hcas if selection.setting is None else None
    adapters: dict[str, list[str]] = {}
    for port in selection.ports:
        if site is not None and port.device not in site:
            continue
        device = rdma.device(port.device)
        address = device.pci_address if device is not None else None
        if address is not None:
            adapters.setdefault(address.rsplit(".", 1)[0], []).append(port.subject)
    dual = {adapter: ports for adapter, ports in adapters.items() if len(ports) > 1}
    if not dual:
        return
    unseen = selection_unseen(job, expect.hcas)
    yield from release_findings(
        nccl_libs, NVLS_DUAL_PORT,
        switches,
        Evidence("/sys/class/infiniband", "; ".join(f"adapter {adapter}: {', '.join(ports)}" for adapter, ports in sorted(dual.items())), "one port per adapter in NCCL's selection, or NVLS off"),
        setting_evidence(job, "NCCL_NVLS_ENABLE", "0 until NCCL is upgraded"),
        severity=Severity.WARNING if unseen else None,
        fix=DUAL_PORT_UNSEEN_FIX if unseen else "",
    )


def _job_stack(platform: NcclPlatformFacts, job: JobFacts) -> tuple[int | None, str, str]:
    """The stack limit the job's processes get, where it was read, and why it is unknown."""
    if platform.stack_soft is None:
        return None, "", "/proc/self/limits has no readable 'Max stack size' row"
    if not job.in_slurmd_script and not job.in_job_process and platform.slurm_conf is not None:
        # A health check has slurmd's limit and an operator's shell its own; a Slurm job gets the
        # submitting shell's (STACK propagated, Slurm's default) or slurmd's, neither read here.
        return None, "", ("outside a job on a Slurm node this process's stack limit is not a job's (a health check has "
                          "slurmd's, a shell its own): run it inside a job (srun preflight node) to judge the job's")
    if job.in_slurmd_script and platform.slurm_conf is not None and platform.stack_propagated is None:
        return None, "", f"{platform.slurm_conf}: {platform.propagation_setting}"  # an Include unread
    if job.in_slurmd_script and platform.stack_propagated:
        return None, "", f"the job gets the submitting shell's stack limit ({platform.slurm_conf}: {platform.propagation_setting})"
    source = "/proc/self/limits (slurmd's, which the job inherits: STACK not propagated)" if job.in_slurmd_script else "/proc/self/limits"
    return platform.stack_soft, source, ""


def _mnnvl_copies(nccl_libs: NcclLibFacts, nccl_platform: NcclPlatformFacts, bug: KnownBug) -> tuple[list[NcclCopy], list[NcclCopy]]:
    """The NCCL copies that carry an MNNVL ``bug`` and those whose version is unknown, on a node
    with NVIDIA GPUs (NotApplicable or Unknown otherwise)."""
    require_nccl(nccl_libs)
    if not nccl_platform.pci_gpus:
        nccl_platform.require_classified("no NVIDIA GPU")
        raise NotApplicable("no NVIDIA GPU in /sys/bus/pci/devices")
    return affected(nccl_libs, bug)


def _mnnvl_clique(fabric: FabricFacts) -> Evidence:
    """Evidence that this node's GPUs are in a multi-node NVLink clique; Unknown when NVML cannot
    say, NotApplicable when they are not."""
    if fabric.nvml_error:
        raise Unknown(f"NVML unavailable ({fabric.nvml_error}); the NVLink fabric cannot be read")
    unanswered = [gpu for gpu in fabric.gpus if gpu.error]
    cliques = [gpu for gpu in fabric.gpus if gpu.state == FABRIC_COMPLETED and gpu.cluster_uuid is not None]
    if not cliques:
        if unanswered and len(unanswered) == len(fabric.gpus) and unanswered[0].error not in ("NVML_ERROR_NOT_SUPPORTED", "NVML_ERROR_FUNCTION_NOT_FOUND"):
            raise Unknown(f"nvmlDeviceGetGpuFabricInfo: {unanswered[0].error}")
        raise NotApplicable("no GPU in a multi-node NVLink fabric (fabric state completed with a cluster UUID)")
    return Evidence("nvmlDeviceGetGpuFabricInfo", f"{len(cliques)} GPUs in clique {cliques[0].clique_id} of a multi-node NVLink fabric")


@check("NVL002", profiles=("full",))
def mnnvl_init_stack_overrun(
    nccl_libs: NcclLibFacts, fabric: FabricFacts, nccl_platform: NcclPlatformFacts, job: JobFacts
) -> Iterator[Observation]:
    """NCCL before 2.28.3 on a multi-node NVLink GPU with a stack limit that is unlimited (glibc
    then gives threads 2 MiB) or below 8 MiB."""
    carrying, unnamed = _mnnvl_copies(nccl_libs, nccl_platform, MNNVL_STACK)
    if not carrying and not unnamed:
        return  # every copy is 2.28.3 or newer (or older than MNNVL), whatever the fabric
    clique = _mnnvl_clique(fabric)
    if switched_off(job, "NCCL_MNNVL_ENABLE"):
        return
    stack, source, unknown = _job_stack(nccl_platform, job)
    if stack is None:
        for copy in carrying + unnamed:
            yield undecided(copy.path, unknown, clique)
        return
    if SAFE_STACK <= stack < UNLIMITED:
        return
    yield from release_findings(
        nccl_libs, MNNVL_STACK, clique,
        Evidence(source, f"stack soft limit {format_size(stack)}", f"{format_size(SAFE_STACK)} or more, not unlimited (ulimit -s 8192)"),
    )


def _inactive(gpu: GpuNvlinks) -> str:
    down = [str(link) for link in gpu.links if link not in gpu.active]
    return f"; inactive: link {', '.join(down)}" if down else ""


def _observed(gpu: GpuNvlinks) -> str:
    return f"{gpu.active_count} of {len(gpu.links)} NVLinks active{_inactive(gpu)}"


NO_ACTIVE_LINK_FIX = (
    "No NVLink of this GPU is up while its siblings have theirs: on PCIe boards, fit the NVLink bridge "
    "if one belongs there (NCCL otherwise sends this GPU's traffic over PCIe); on SXM boards, check the "
    "fabric (nvidia-smi nvlink --status, the fabric manager's log) and reset or service the GPU."
)


@check("NVL003", profiles=("prolog",))
def nvlink_ring_search_fallback(nvlink: NvlinkFacts, gpus: GpuFacts, expect: Expectations) -> Iterator[Observation]:
    """GPUs with fewer active NVLinks than the site expects or than their siblings have."""
    require_nvml(nvlink.nvml_error, nvlink.nvml_detail, gpus, "the NVLink state")
    if not nvlink.gpus:
        raise NotApplicable("NVML reports no GPU")
    # A GPU in MIG mode does no peer-to-peer over NVLink: its links are no part of NCCL's graph.
    mig = gpus.mig_indices
    whole = [gpu for gpu in nvlink.gpus if gpu.index not in mig]
    if not whole:
        raise NotApplicable("every GPU is in MIG mode (nvmlDeviceGetMigMode): none does peer-to-peer over NVLink")
    expected = expect.nvlinks_per_gpu
    if expected is None and not any(gpu.links or gpu.error for gpu in whole):
        raise NotApplicable("no GPU on this node has NVLinks")
    known = [gpu for gpu in whole if gpu.active_count is not None]
    for gpu in whole:
        if gpu.error:
            yield undecided(f"GPU{gpu.index}", f"nvmlDeviceGetNvLinkState: {gpu.error}")
    if expected is not None:
        for gpu in known:
            if (gpu.active_count or 0) < expected:
                yield present(
                    f"GPU{gpu.index}",
                    Evidence("nvmlDeviceGetNvLinkState", _observed(gpu), f"{expected} active (expect.nvlinks_per_gpu)"),
                )
        return
    # No site expectation: GPUs of one model on one node should have as many active links as
    # each other (an HGX board's GPUs all have the same NVLink wiring).
    models: dict[str, list[GpuNvlinks]] = {}
    for gpu in known:
        if gpu.name is not None:
            models.setdefault(gpu.name, []).append(gpu)
    for name, siblings in sorted(models.items()):
        best = max(siblings, key=lambda gpu: gpu.active_count or 0)
        for gpu in siblings:
            if (gpu.active_count or 0) >= (best.active_count or 0):
                continue
            like = f"{best.active_count} active, as on GPU{best.index} ({name})"
            if not gpu.links:
                # Every link number answered NOT_SUPPORTED or INVALID_ARGUMENT: the GPU reports no
                # NVLink at all (a mode or board that hides them), which says nothing about links down.
                yield undecided(f"GPU{gpu.index}", f"nvmlDeviceGetNvLinkState reports no NVLink on this GPU, while {like}")
            elif not gpu.active_count:
                # No active link at all: a PCIe card without its bridge sits outside the NVLink
                # graph (NCCL uses PCIe for it), as does an SXM GPU whose fabric failed, which
                # NVL006 judges from the fabric state; a lopsided graph needs some links up.
                yield present(f"GPU{gpu.index}", Evidence("nvmlDeviceGetNvLinkState", _observed(gpu), like),
                              severity=Severity.WARNING, fix=NO_ACTIVE_LINK_FIX)
            else:
                yield present(f"GPU{gpu.index}", Evidence("nvmlDeviceGetNvLinkState", _observed(gpu), like))


ALLTOALL_HANG_RANKS = 80  # "at a scale of over 80 ranks" (v2.26.5-1 and v2.27.3-1 release notes)


@check("NVL001", profiles=("full",))
def moe_dispatch_combine_timeout_nvl_domain(
    nccl_libs: NcclLibFacts, fabric: FabricFacts, nccl_platform: NcclPlatformFacts, job: JobFacts
) -> Iterator[Observation]:
    """NCCL before 2.26.5 on a multi-node NVLink GPU, for a job of more than 80 ranks (or of a size
    the environment does not give), where alltoall-like traffic such as MoE dispatch and combine
    can hang. The reference's other causes (EP kernel modes, a stalled peer) live in the program."""
    carrying, unnamed = _mnnvl_copies(nccl_libs, nccl_platform, MNNVL_ALLTOALL)
    if not carrying and not unnamed:
        return  # every copy has the work-around (or predates MNNVL), whatever the fabric
    clique = _mnnvl_clique(fabric)
    if switched_off(job, "NCCL_MNNVL_ENABLE"):
        return
    # WORLD_SIZE, an MPI launcher's world size (an MPIJob's OMPI_COMM_WORLD_SIZE), Slurm's tasks,
    # Kubeflow's PET_NNODES x PET_NPROC_PER_NODE: the largest the environment gives
    known = job_ranks(job)
    if known is not None and known[0] <= ALLTOALL_HANG_RANKS:
        return
    limit = f"at most {ALLTOALL_HANG_RANKS} ranks on these releases"
    size = (
        Evidence(known[1].source, f"{known[1].observed}: {known[0]} ranks", limit)
        if known is not None
        else Evidence("/proc/self/environ", "no world size (WORLD_SIZE, an MPI launcher's, SLURM_NTASKS): the job's size is not known here", limit)
    )
    yield from release_findings(nccl_libs, MNNVL_ALLTOALL, clique, size, severity=Severity.WARNING)
