"""GPUs the driver can use and their health (GPU references)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from preflight.model import (
    Evidence,
    NotApplicable,
    Observation,
    Severity,
    Unknown,
    Unread,
    present,
    undecided,
)
from preflight.registry import check
from preflight.sources.nvml import UNANSWERED

if TYPE_CHECKING:  # gpu_health imports this module at run time
    from collections.abc import Iterator

    from preflight.config import Expectations
    from preflight.probes.gpu_health import GpuHealthFacts
    from preflight.probes.job import JobFacts
    from preflight.probes.nvlink import NvlinkFacts
from preflight.probes.gpu_health import GPU_IS_LOST, GpuHealth, GpuHealthFacts, nvml_unusable
from preflight.probes.gpus import UNEXPECTED_ANSWER, GpuFacts, pci_device_key
from preflight.probes.job import parse_gpu_indices
from preflight.probes.kernel_log import HARDWARE_XIDS, KernelLogFacts, XidEvent

# The GPU or this driver lacks the feature: nothing to judge, not a failure to read.
FEATURE_ABSENT = frozenset({"NVML_ERROR_NOT_SUPPORTED", "NVML_ERROR_FUNCTION_NOT_FOUND"})


@check("GPU002", profiles=("prolog",), optional=("nvlink",))
def nccl_cuda_call_failed(
    gpu_health: GpuHealthFacts, kernel_log: KernelLogFacts, gpus: GpuFacts, nvlink: NvlinkFacts | Unread
) -> Iterator[Observation]:
    """A GPU waiting for a reset to apply a row remap (a page retirement before Ampere), out of
    spare rows, with uncorrectable ECC errors since it was initialised, or with hardware Xids
    since boot."""
    unusable = nvml_unusable(gpu_health, gpus)
    # Each GPU's NVML verdicts, judged once: they decide too whether an old Xid still matters.
    verdicts = {} if unusable is not None else {gpu.index: list(_gpu_verdicts(gpu)) for gpu in gpu_health.gpus}
    found = list(_hardware_xids(kernel_log, _clean_now(gpu_health, gpus, verdicts, nvlink)))
    found.extend(kernel_log.unread("Xid history"))
    if unusable is not None:
        if isinstance(unusable, NotApplicable) and not found:
            raise unusable
        if isinstance(unusable, Unknown):
            if not found:
                raise unusable
            found.append(undecided("NVML", str(unusable)))
        yield from found
        return
    for gpu in gpu_health.gpus:
        found.extend(verdicts[gpu.index])
    if not found and all(gpu.rows_error in FEATURE_ABSENT and gpu.volatile_error in FEATURE_ABSENT for gpu in gpu_health.gpus):
        raise NotApplicable("NVML reports neither row remapping nor ECC error counts for these GPUs (GPUs before Ampere, "
                            "GPUs without ECC, vGPUs and GPUs whose driver does not expose them)")
    yield from found


def _gpu_verdicts(gpu: GpuHealth) -> Iterator[Observation]:
    subject = f"GPU{gpu.index}"
    if gpu.lost_in:
        yield undecided(subject, f"{gpu.lost_in}: {GPU_IS_LOST} (GPU001 reports the lost GPU)")
        return
    if gpu.rows_error and gpu.rows_error not in FEATURE_ABSENT:
        yield undecided(subject, f"nvmlDeviceGetRemappedRows: {gpu.rows_error}")
    elif not gpu.rows_error:
        counts = f"{gpu.rows_uncorrectable} rows remapped for uncorrectable errors, {gpu.rows_correctable} for correctable"
        if gpu.remap_failed:
            yield present(subject, Evidence("nvmlDeviceGetRemappedRows", f"remapping failed; {counts}", "no failure (spare rows left)"))
        elif gpu.remap_pending:
            yield present(subject, Evidence("nvmlDeviceGetRemappedRows", f"remap pending; {counts}", "no remap pending (reset the GPU to apply it)"))
    # Before Ampere a bad page is retired instead of a row remapped, at the next driver load,
    # reset or reboot; a GPU that remaps rows answers NOT_SUPPORTED here.
    if gpu.pages_pending:
        yield present(subject, Evidence("nvmlDeviceGetRetiredPagesPendingStatus", "page retirement pending", "none pending (reset the GPU or reboot to retire the page)"))
    elif gpu.rows_error in FEATURE_ABSENT and gpu.pages_error and gpu.pages_error not in FEATURE_ABSENT:
        yield undecided(subject, f"nvmlDeviceGetRetiredPagesPendingStatus: {gpu.pages_error}")
    if gpu.ecc_current is False or gpu.volatile_error in FEATURE_ABSENT:
        return  # ECC off or absent: there is nothing to count
    if gpu.volatile_error:
        yield undecided(subject, f"nvmlDeviceGetTotalEccErrors (uncorrected, volatile): {gpu.volatile_error}")
    elif gpu.volatile_uncorrected:
        since = {
            True: "since the driver initialised the GPU (persistence mode on: since boot or the last reset)",
            False: "since the GPU was initialised for the current or last client (persistence mode off)",
            None: "since the driver initialised the GPU",
        }[gpu.persistence]
        yield present(
            subject,
            Evidence("nvmlDeviceGetTotalEccErrors(UNCORRECTED, VOLATILE)", f"{gpu.volatile_uncorrected} uncorrectable ECC errors {since}", "0"),
        )


#: Hardware Xids whose aftermath NVML's queries show while it lasts, and the reading that shows
#: it: uncorrectable ECC errors since the GPU was initialised (48, 94, 95; 92 is a rate of
#: corrected ones), a row remap pending or failed (63, 64), a lost GPU (79), an NVLink that went
#: down (74: the link stays down until the GPU is reset). For these a GPU whose reading is clean
#: now has been reset or recovered. A GSP fault (119, 120) leaves nothing these queries read, so
#: it stays an error until the reboot clears the log; so does an Xid whose reading was not had
#: (MIG mode and older boards answer NOT_SUPPORTED for remapped rows). Before Ampere, 63 is a page
#: retired at the next driver load, which NVML shows pending until then; a failed retirement (64)
#: shows nowhere in NVML there.
XID_SHOWN_BY = {48: "ecc", 92: "ecc", 94: "ecc", 95: "ecc", 63: "remap", 64: "remap_failure", 79: "alive", 74: "nvlink"}


RECOVERED_FIX = (
    "NVML reads this GPU clean now: it has been reset or recovered since the Xid, which the kernel "
    "log keeps until the next reboot. Watch for the Xid to come back (dmesg -T | grep Xid); if it "
    "does, drain the node and have the GPU serviced."
)


def _clean_now(
    gpu_health: GpuHealthFacts, gpus: GpuFacts, verdicts: dict[int, list[Observation]], nvlink: NvlinkFacts | Unread
) -> dict[tuple[int, int, int], dict[str, str]]:
    """What NVML reads clean now of each GPU, by bus: for each reading of XID_SHOWN_BY, what was
    read. The kernel log keeps an Xid until the next reboot, but resetting the GPU (what NVIDIA's
    Xid catalogue asks for after most hardware Xids) clears what the Xid left behind, and an old
    Xid of a recovered GPU must not drain the node at every job. ``verdicts``: each GPU's NVML
    findings, empty where NVML cannot judge (then no GPU reads clean)."""
    buses = {device.index: device.bus_id for device in gpus.devices if device.bus_id}
    links = {} if isinstance(nvlink, Unread) or nvlink.nvml_error else {gpu.index: gpu for gpu in nvlink.gpus}
    clean: dict[tuple[int, int, int], dict[str, str]] = {}
    for gpu in gpu_health.gpus:
        key = pci_device_key(buses.get(gpu.index, ""))
        if key is None or gpu.index not in verdicts or verdicts[gpu.index]:  # a lost GPU has its verdict
            continue
        read = {"alive": f"GPU{gpu.index} answers NVML (not lost)"}
        if not gpu.rows_error:
            read["remap"] = read["remap_failure"] = (
                f"GPU{gpu.index}: no row remap pending or failed ({gpu.rows_uncorrectable} rows remapped for uncorrectable errors)"
            )
        elif gpu.rows_error in FEATURE_ABSENT and not gpu.pages_error:
            read["remap"] = f"GPU{gpu.index}: no page retirement pending"
        if gpu.ecc_current and not gpu.volatile_error:
            read["ecc"] = f"GPU{gpu.index}: 0 uncorrectable ECC errors since the GPU was initialised"
        own = links.get(gpu.index)
        if own is not None and own.links and not own.error and len(own.active) == len(own.links):
            read["nvlink"] = f"GPU{gpu.index}: all {len(own.links)} NVLinks active"
        clean[key] = read
    return clean


def _hardware_xids(kernel_log: KernelLogFacts, clean_now: dict[tuple[int, int, int], dict[str, str]]) -> Iterator[Observation]:
    by_bus: dict[str, list[XidEvent]] = {}
    for event in kernel_log.xids:
        if event.code in HARDWARE_XIDS:
            by_bus.setdefault(event.bus, []).append(event)
    for bus, events in sorted(by_bus.items()):
        codes = sorted({event.code for event in events})
        described = ", ".join(f"{code} ({HARDWARE_XIDS[code]})" for code in codes)
        history = Evidence(
            "kernel log since boot", f"Xid {described}; {len(events)} event(s), last: {events[-1].text}", "no hardware Xid since boot"
        )
        read = clean_now.get(pci_device_key(bus) or (-1, -1, -1), {})
        needed = {XID_SHOWN_BY.get(code, "") for code in codes}
        if not needed <= read.keys():  # an Xid no reading shows, or whose reading was not had
            yield present(f"GPU {bus}", history)
        else:
            shown = "; ".join(read[reading] for reading in sorted(needed))
            yield present(f"GPU {bus}", history, Evidence("NVML now", shown), severity=Severity.WARNING, fix=RECOVERED_FIX)


# NVML start-up errors that say nothing about the driver: preflight could not ask it (the library
# is not installed where preflight runs, /dev/nvidiactl is not open to this user, a recording is
# unreadable). Every other start-up error with GPUs on the bus (LIB_RM_VERSION_MISMATCH,
# DRIVER_NOT_LOADED, GPU_IS_LOST, UNKNOWN...) means the driver stack is broken.
CANNOT_ASK_ERRORS = frozenset(
    {"NVML_ERROR_LIBRARY_NOT_FOUND", "NVML_ERROR_NO_PERMISSION", "NVML_ERROR_FUNCTION_NOT_FOUND", "NVML_REPLAY_UNREADABLE", UNEXPECTED_ANSWER}
)


#: What to do for the NVML start-up errors whose cause is known, where the reference's general fix
#: would send an operator the wrong way (a reboot into a kernel that has no module does not help).
STARTUP_FIXES = {
    "NVML_ERROR_DRIVER_NOT_LOADED": (
        "No NVIDIA kernel module is loaded. After a kernel upgrade the driver's module may not be built for the "
        "running kernel: compare 'uname -r' with 'dkms status' (or the installed linux-modules-nvidia-<branch>-<kernel> "
        "package), build or install it for this kernel, then 'modprobe nvidia' or reboot; 'dmesg | grep -i nvrm' "
        "shows a module that refused to load."
    ),
    "NVML_ERROR_LIB_RM_VERSION_MISMATCH": (
        "The NVIDIA user-space library and the loaded kernel module are different versions, as after a driver upgrade "
        "without a reboot: compare 'cat /proc/driver/nvidia/version' with 'ls -l /usr/lib/*/libnvidia-ml.so.1'. Reboot, "
        "or stop every GPU process (nvidia-persistenced, DCGM, the fabric manager) and reload the nvidia modules, so "
        "that the new module loads."
    ),
}


PERSISTENCE_FIX = (
    "Keep the GPUs initialised between jobs: enable and start nvidia-persistenced "
    "(systemctl enable --now nvidia-persistenced), or set persistence mode with 'nvidia-smi -pm 1' at every boot. "
    "Debian's and Ubuntu's packages start the daemon with --no-persistence-mode, which keeps it off while the "
    "service runs: replace it with --persistence-mode in the unit's ExecStart (systemctl edit nvidia-persistenced)."
)


def _in_slurm_view(job: JobFacts | Unread) -> bool:
    """Whether this process sees the GPUs Slurm's device cgroup gives a job: one of the job's own
    processes by its environment, or any process in the job's cgroup, which its device
    constraint covers whatever the environment says: a prolog or epilog run there
    (PrologFlags=RunInJob puts it in the extern step, slurm.conf(5)), a step in an Apptainer
    container started with --cleanenv or --containall (no SLURM_* variables left), an ssh
    session pam_slurm_adopt put in the job."""
    return not isinstance(job, Unread) and (job.in_job_process or bool(job.cgroup_job))


def _slurm_gpu_counts(job: JobFacts) -> set[int] | None:
    """How many GPUs Slurm may have given this process on this node: SLURM_STEP_GPUS's count,
    else SLURM_JOB_GPUS's; None when neither names any. An srun step without SLURM_STEP_GPUS may
    also have none: Slurm unsets it for a step given none (srun --gres=none) and leaves the job's
    (gres_common_gpu_set_env)."""
    step = parse_gpu_indices(job.environ["SLURM_STEP_GPUS"]) if "SLURM_STEP_GPUS" in job.environ else None
    if step is not None:
        return {len(step)}
    given = parse_gpu_indices(job.environ["SLURM_JOB_GPUS"]) if "SLURM_JOB_GPUS" in job.environ else None
    if given is None:
        return None
    return {len(given), 0} if "SLURM_STEP_ID" in job.environ else {len(given)}


def _slurm_gave(gpus: GpuFacts, counts: set[int] | None) -> bool:
    """Whether NVML's count is what Slurm's device cgroup leaves for a job given ``counts`` GPUs.
    Slurm makes each MIG instance one GPU GRES (gpu_nvml.c), and the cgroup opens the parent
    GPU of each: two instances of one GPU leave NVML one GPU. So where a listed GPU is in MIG
    mode, any count from one to the GRES count is the job's view."""
    if not counts:
        return False
    listed = len(gpus.devices)
    if gpus.mig_indices:
        return 0 < listed <= max(counts)
    return listed in counts


def _not_visible(gpus: GpuFacts, job: JobFacts | Unread, missing: list[str], unidentified: int) -> Iterator[Observation]:
    """GPUs on the PCI bus that NVML does not list, unless the view of this process was narrowed
    on purpose: a container runtime's own /proc/driver/nvidia, or Slurm's device cgroup (with
    ConstrainDevices NVML lists only the job's GPUs) in a job given as many GPUs as NVML lists,
    which holds a prolog or epilog too where it runs in the job's cgroup (PrologFlags=RunInJob)."""
    expected = f"{len(gpus.pci_gpus)} (as on the PCI bus)"
    hidden = ""
    if gpus.container_gpus is not None:
        given = {pci_device_key(address) for address in gpus.container_gpus}
        hidden = f"; {sum(1 for bdf in missing if pci_device_key(bdf) not in given)} not given to this container"
        missing = [bdf for bdf in missing if pci_device_key(bdf) in given]
        if len(missing) <= unidentified:
            return
        expected = f"{len(gpus.container_gpus)} (the container's: its /proc/driver/nvidia/gpus, or the GPUs of its /dev/nvidia* nodes)"
    elif not isinstance(job, Unread) and _in_slurm_view(job) and _slurm_gave(gpus, _slurm_gpu_counts(job)):
        return  # as many GPUs as Slurm gave this job step: its view, whatever a container runtime did
    elif gpus.view_error:
        yield undecided(
            "node",
            f"NVML lists {len(gpus.devices)} of the {len(gpus.pci_gpus)} GPUs on the PCI bus, and whether a container "
            f"runtime hid the others cannot be told: {gpus.view_error}",
        )
        return
    elif isinstance(job, Unread):
        yield undecided(
            "node",
            f"NVML lists {len(gpus.devices)} of the {len(gpus.pci_gpus)} GPUs on the PCI bus, and whether this is a Slurm "
            f"job step that was given only those cannot be told: {job}",
        )
        return
    elif job.in_slurmd_script and job.cgroup_job is None:
        yield undecided(
            "node",
            f"NVML lists {len(gpus.devices)} of the {len(gpus.pci_gpus)} GPUs on the PCI bus, and whether this prolog or epilog "
            "runs in the job's cgroup (PrologFlags=RunInJob), which hides the others, cannot be told: /proc/self/cgroup not read",
        )
        return
    elif _in_slurm_view(job) and _slurm_gpu_counts(job) is None:
        # A CPU-only step, a gres/shard job or a launcher outside Slurm: with ConstrainDevices
        # (or a pod's device list) NVML lists only what the job was given, and no variable says
        # what. (A count that matches returned above.)
        where = "a job process that names" if job.in_job_process else f"a process in the cgroup of Slurm's {job.cgroup_job} whose environment names"
        yield undecided(
            "node",
            f"NVML lists {len(gpus.devices)} of the {len(gpus.pci_gpus)} GPUs on the PCI bus in {where} "
            "no GPUs given to it (SLURM_STEP_GPUS, SLURM_JOB_GPUS): its device cgroup may hide the others",
        )
        return
    yield present(
        "node",
        Evidence("nvmlDeviceGetCount", f"{len(gpus.devices)} GPUs", expected),
        Evidence("/sys/bus/pci/devices", "not visible to NVML: " + ", ".join(missing) + hidden),
    )


@check("GPU001", profiles=("prolog",), optional=("job",))
def gpu_unusable_by_driver(gpus: GpuFacts, gpu_health: GpuHealthFacts, job: JobFacts | Unread, expect: Expectations) -> Iterator[Observation]:
    """A GPU is on the bus but unusable: lost, invisible to NVML, or the driver stack is broken;
    a warning when persistence mode is off."""
    if gpus.nvml_error in UNANSWERED:  # no recording, or a broken one
        raise Unknown(gpus.nvml_detail or gpus.nvml_error)
    if not gpus.pci_gpus and gpus.nvml_error:
        raise NotApplicable(f"no NVIDIA GPU on the PCI bus and NVML unavailable ({gpus.nvml_error})")
    if gpus.nvml_error in CANNOT_ASK_ERRORS:
        raise Unknown(
            f"NVML unavailable ({gpus.nvml_detail or gpus.nvml_error}): cannot ask the driver about the "
            f"{len(gpus.pci_gpus)} NVIDIA GPUs on the PCI bus"
        )
    if gpus.nvml_error:
        yield present(
            "node",
            Evidence("nvmlInit", gpus.nvml_detail or gpus.nvml_error, "NVML_SUCCESS"),
            Evidence("/sys/bus/pci/devices", f"{len(gpus.pci_gpus)} NVIDIA GPUs on the bus"),
            fix=STARTUP_FIXES.get(gpus.nvml_error, ""),
        )
        return
    lost = set()
    for device in gpus.devices:
        if device.error == "NVML_ERROR_GPU_IS_LOST":
            lost.add(device.index)
            yield present(f"GPU{device.index}", Evidence("nvmlDeviceGetName", device.error, "NVML_SUCCESS"))
        elif device.error and device.error != "NVML_ERROR_NOT_SUPPORTED":
            yield undecided(f"GPU{device.index}", f"NVML: {device.error}")
    for health in gpu_health.gpus if not gpu_health.nvml_error else ():
        if health.lost_in and health.index not in lost:
            lost.add(health.index)
            yield present(f"GPU{health.index}", Evidence(health.lost_in, "NVML_ERROR_GPU_IS_LOST", "NVML_SUCCESS"))
    seen = {device.bus_id for device in gpus.devices if device.bus_id}
    missing = [bdf for bdf in gpus.pci_gpus if bdf not in seen]
    # A device whose PCI info NVML would not give may be any of the unmatched GPUs on the bus.
    unidentified = sum(1 for device in gpus.devices if not device.bus_id)
    if len(missing) > unidentified and (seen or not gpus.devices):
        yield from _not_visible(gpus, job, missing, unidentified)
    if expect.gpu_count is not None:
        # In a view narrowed on purpose (see _not_visible) NVML counts the job's GPUs, not the node's.
        allotted = _slurm_gpu_counts(job) if not isinstance(job, Unread) else None
        step_view = _in_slurm_view(job) and (allotted is None or _slurm_gave(gpus, allotted))
        narrowed = gpus.container_gpus is not None or step_view
        count, source = (len(gpus.pci_gpus), "/sys/bus/pci/devices") if narrowed else (len(gpus.devices), "nvmlDeviceGetCount")
        if count < expect.gpu_count:
            yield present("node", Evidence(source, f"{count} GPUs", f"{expect.gpu_count} (expect.gpu_count)"))
    yield from _persistence(gpu_health, lost)


def _persistence(gpu_health: GpuHealthFacts, lost: set[int]) -> Iterator[Observation]:
    if gpu_health.nvml_error:
        return
    off = []
    for health in gpu_health.gpus:
        if health.index in lost or health.persistence_error in ("NVML_ERROR_NOT_SUPPORTED", "NVML_ERROR_FUNCTION_NOT_FOUND"):
            continue
        if health.persistence_error:
            yield undecided(f"GPU{health.index}", f"nvmlDeviceGetPersistenceMode: {health.persistence_error}")
        elif health.persistence is False:
            off.append(f"GPU{health.index}")
    if off:
        yield present(
            "nvidia-persistenced",
            Evidence("nvmlDeviceGetPersistenceMode", f"disabled on {', '.join(off)} ({len(off)} of {len(gpu_health.gpus)})", "enabled"),
            Evidence("effect", "the driver deinitialises an idle GPU and initialises it again (1-3 s per GPU) at the next "
                     "job's first CUDA call; volatile ECC counts restart with it"),
            severity=Severity.WARNING,
            fix=PERSISTENCE_FIX,
        )
