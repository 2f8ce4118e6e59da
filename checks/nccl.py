"""NCCL libraries, versions and settings of the job (NCCL references)."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from msgspec.structs import replace

from preflight.model import (
    Evidence,
    NotApplicable,
    Observation,
    Severity,
    Unknown,
    present,
    undecided,
)
from preflight.nccl.gid import nccl_int
from preflight.nccl.releases import NO_NCCL, RAS_INIT_RACE, SPLIT_NONBLOCKING, bypassed_fix, loaded_copies, release_findings, require_nccl, version_tuple
from preflight.probes.firewall import FirewallFacts, nccl_port_findings
from preflight.probes.frameworks import FrameworkFacts, parse_version
from preflight.probes.gpu_health import GpuHealthFacts, nvml_unusable
from preflight.probes.gpus import GpuFacts
from preflight.probes.job import JobFacts, integer_setting, setting_evidence, slurm_view, switched_off
from preflight.probes.nccl_libs import WHEEL_LIBRARY, WHEELS_KEPT, NcclCopy, NcclLibFacts, python_prefixes
from preflight.probes.rdma import IB_CLASS, RdmaFacts
from preflight.probes.sockets import SocketFacts
from preflight.registry import check
from preflight.torch_settings import as_bool, read_setting, readers_for
from preflight.units import format_size

if TYPE_CHECKING:
    from collections.abc import Iterator

    from preflight.probes.gpudirect import GpuDirectFacts
    from preflight.probes.shm import ShmFacts

NCCL_ALGORITHMS = ("tree", "ring", "collnetdirect", "collnetchain", "nvls", "nvlstree", "pat")


def allreduce_algorithms(value: str) -> set[str] | None:
    """The algorithms NCCL_ALGO leaves enabled for all-reduce; None when NCCL would reject it."""
    enabled = set(NCCL_ALGORITHMS)
    for position, entry in enumerate(value.split(";")):
        prefix, colon, items = entry.rpartition(":")
        if not colon:
            if position:
                return None  # only the first entry may lack a prefix
            prefix, items = "", entry
        if prefix and prefix.lower() != "allreduce":
            continue
        negate = items.startswith("^")
        names = {item.lower() for item in (items[1:] if negate else items).split(",") if item}
        if not names <= set(NCCL_ALGORITHMS):
            return None
        enabled = set(NCCL_ALGORITHMS) - names if negate else names
    return enabled


def _is_power_of_two(count: int) -> bool:
    return count > 0 and count & (count - 1) == 0


@check("NCCL015", profiles=("prolog",))
def tree_algorithm_hang(job: JobFacts) -> Iterator[Observation]:
    """NCCL_ALGO leaves all-reduce only Tree (no Ring to fall back on). A warning at any count:
    forcing Tree is a job's or a site's tuning choice, the node is healthy, and no NCCL release
    note ties a hang to counts that are not a power of two (``ncclGetBtree`` and ``ncclGetDtree``
    in src/graph/trees.cc@v2.30.7-1 build the double binary tree for any rank count, shifting the
    second tree when the count is odd); such counts are named in the evidence only."""
    setting = job.nccl("NCCL_ALGO")
    if setting is None:
        raise job.nothing_to_judge("NCCL_ALGO", "NCCL chooses among all its algorithms, Ring included")
    enabled = allreduce_algorithms(setting.value)
    if enabled is None or "tree" not in enabled or "ring" in enabled:
        return
    view = slurm_view(job)
    if view.nnodes == 1:
        return  # Tree runs between nodes; a one-node job does not use it for all-reduce
    world = integer_setting(job.environ, "WORLD_SIZE") or view.ntasks
    where = "/proc/self/environ" if setting.origin == "environment" else setting.origin
    evidence = [Evidence(f"{where} NCCL_ALGO", repr(setting.value), "unset, or a list that keeps Ring for all-reduce")]
    odd = [(name, count) for name, count in (("nodes", view.nnodes), ("ranks", world)) if count is not None and not _is_power_of_two(count)]
    evidence += [Evidence("/proc/self/environ", f"{count} {name}", "a power of two while Tree is forced") for name, count in odd]
    yield present("NCCL_ALGO", *evidence, severity=Severity.WARNING)


# Releases with a crash NCCL's own tracker ties to them (references/NCCL012.toml).
RAS_CRASH_VERSIONS = frozenset({"2.27.3"})


# NCCL012's and NCCL013's crashes need a RAS status query (the ncclras client, or an agent that
# writes STATUS to localhost:28028). Nothing on a node says whether anything will query, and jobs
# on a node nobody queries run as well as anywhere: a warning, never a drain of every node whose
# image ships the release. A site that polls RAS raises the severity in its config.
RAS_QUERY_FIX = (
    "Upgrade NCCL (2.27.3 fixed the init race; the 2.27.3 query crash is fixed after it), or set "
    "NCCL_RAS_ENABLE=0 in /etc/nccl.conf. Only a RAS status query (ncclras, or a monitoring agent "
    "polling localhost:28028) triggers the crash; where the site polls RAS, drain such nodes with "
    "[severity] NCCL012 = \"error\" and NCCL013 = \"error\" in the preflight config."
)


def job_copies(libs: NcclLibFacts, job: JobFacts) -> list[tuple[NcclCopy, str]]:
    """Copies the job's LD_PRELOAD or LD_LIBRARY_PATH puts first, with the variable that does. A
    directory of LD_LIBRARY_PATH gives the file its libnccl.so.2 reaches, not one left beside it."""
    preload = [entry for entry in re.split(r"[\s:]+", job.environ.get("LD_PRELOAD", "")) if "libnccl" in entry]
    search = [entry.rstrip("/") for entry in job.environ.get("LD_LIBRARY_PATH", "").split(":") if entry]
    chosen = []
    for copy in libs.copies:
        folder = copy.path.rsplit("/", 1)[0]
        if copy.path in preload:
            chosen.append((NcclCopy(copy.path, copy.version, "job"), "LD_PRELOAD"))
        elif folder in search and not copy.unreached:
            chosen.append((NcclCopy(copy.path, copy.version, "job"), "LD_LIBRARY_PATH"))
    return chosen


def framework_copies(libs: NcclLibFacts, job: JobFacts) -> list[NcclCopy]:
    """The NCCL the job's frameworks load (nvidia-nccl wheels, a conda environment's own): those in the environment the job names
    (``$VIRTUAL_ENV``, ``$CONDA_PREFIX``) when it has one, else every Python environment's."""
    wheels = [copy for copy in libs.copies if copy.origin in ("python", "conda")]
    prefixes = tuple(f"{prefix}/" for prefix in python_prefixes(job.environ))
    own = [copy for copy in wheels if copy.path.startswith(prefixes)] if prefixes else []
    return own or wheels


def _override_evidence(copy: NcclCopy, how: str, wheel: set[str]) -> tuple[Evidence, bool]:
    """Evidence for a job copy that differs from the framework's wheel, and whether it breaks the
    framework. Only an LD_PRELOAD copy older than every wheel does: the framework then calls
    symbols that copy lacks (undefined symbol at import). A newer preloaded copy keeps NCCL's 2.x
    ABI, which is how the reference itself says to upgrade. A copy only in LD_LIBRARY_PATH loses
    to the wheel for pip's torch: its libraries carry DT_RPATH $ORIGIN/../../nvidia/nccl/lib
    (pytorch .ci/manywheel/build_cuda.sh, patchelf --force-rpath), which ld.so searches before
    LD_LIBRARY_PATH (ld.so(8)); other programs of the job may still load it."""
    shipped = ", ".join(sorted(wheel, key=lambda v: version_tuple(v) or ()))
    release = version_tuple(copy.version or "")
    older = how == "LD_PRELOAD" and release is not None and all(release < (version_tuple(v) or ()) for v in wheel)
    if how == "LD_PRELOAD":
        expected = f"NCCL {shipped} as the framework's wheel ships, or newer (an older one lacks symbols the framework calls)"
    else:
        expected = f"NCCL {shipped} as the framework's wheel ships (pip's torch finds its wheel first through its RPATH; other programs take this one)"
    return Evidence(how, f"{copy.path} (NCCL {copy.version})", expected), older


@check("NCCL016", profiles=("full",))
def nccl_library_conflict(nccl_libs: NcclLibFacts, job: JobFacts) -> Iterator[Observation]:
    """A job here can load two different NCCL builds: its LD_PRELOAD puts an older copy under the
    framework (an error), a newer one or one in its LD_LIBRARY_PATH differs from the framework's
    wheel (a warning), a Python environment holds two nvidia-nccl wheels, or the system library
    path itself holds different versions."""
    if not nccl_libs.copies:
        raise NotApplicable(NO_NCCL)
    wheel = {c.version for c in framework_copies(nccl_libs, job) if c.version}
    judged = [_override_evidence(c, how, wheel) for c, how in job_copies(nccl_libs, job) if c.version and wheel and c.version not in wheel]
    if judged:
        yield present(
            "job environment",
            *(evidence for evidence, _ in judged),
            severity=None if any(older for _, older in judged) else Severity.WARNING,
        )
    for copy in nccl_libs.copies:
        if len(copy.wheels) > 1:
            folder = copy.path.removesuffix(f"/{WHEEL_LIBRARY}")
            count = f"{len(copy.wheels)}{' or more' if len(copy.wheels) == WHEELS_KEPT else ''}"
            yield present(
                folder,
                Evidence(folder, f"{count} NCCL wheels: {', '.join(copy.wheels)}", "one nvidia-nccl wheel"),
                Evidence(copy.path, "one file for all of them: the wheel installed last wrote it"),
            )
    # Left-over versioned files (no libnccl.so.2 link reaches them) are no version a loader picks.
    installed = [c for c in nccl_libs.copies if c.origin == "system" and c.version and not c.unreached]
    system = sorted({c.version for c in installed if c.version})
    if len(system) > 1:
        # A warning: one process loads one libnccl.so.2, the first its search order finds; which
        # one depends on the job's order, and the job-environment case above is the conflict.
        yield present(
            "library path",
            *(Evidence(c.path, f"NCCL {c.version}") for c in installed),
            Evidence("system library directories", f"{len(system)} versions: {', '.join(system)}", "one NCCL version"),
            severity=Severity.WARNING,
        )


@check("NCCL012", profiles=("full",))
def nccl_ras_query_crash(nccl_libs: NcclLibFacts, job: JobFacts) -> Iterator[Observation]:
    """An NCCL release with the RAS crash is installed and RAS is not switched off for jobs."""
    if not nccl_libs.copies:
        raise NotApplicable(NO_NCCL)
    ras = job.nccl("NCCL_RAS_ENABLE")
    if ras is not None and ras.value.strip() == "0":
        return
    for copy in loaded_copies(nccl_libs).copies:
        if copy.version in RAS_CRASH_VERSIONS:
            yield present(
                copy.path,
                Evidence(copy.path, f"NCCL {copy.version}", "a release without the RAS query crash"),
                Evidence("NCCL_RAS_ENABLE", ras.value if ras else "unset (RAS on by default)", "0 until NCCL is upgraded"),
                severity=Severity.INFO if copy.bypassed else Severity.WARNING,
                fix=bypassed_fix(copy) if copy.bypassed else RAS_QUERY_FIX,
            )


def _nonblocking_triggers(job: JobFacts, frameworks: FrameworkFacts) -> tuple[list[Evidence], bool]:
    """Evidence that the job splits or creates non-blocking communicators, and whether it is only
    a risk (a PyTorch release that turns non-blocking on when init_process_group gets device_id)."""
    found: list[Evidence] = []
    torch_env = job.environ.get("TORCH_NCCL_USE_COMM_NONBLOCKING", "").strip().lower()
    if torch_env in ("1", "true", "yes", "y", "on"):
        found.append(Evidence("/proc/self/environ TORCH_NCCL_USE_COMM_NONBLOCKING", torch_env, "0 or unset"))
    share = job.nccl("NCCL_COMM_SPLIT_SHARE_RESOURCES")
    if share is not None and share.value.strip() == "1":
        found.append(setting_evidence(job, "NCCL_COMM_SPLIT_SHARE_RESOURCES", "0 or unset"))
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
    made = "TORCH_NCCL_USE_COMM_NONBLOCKING" in job.environ or job.nccl("NCCL_COMM_SPLIT_SHARE_RESOURCES") is not None
    if not triggers and not made and not frameworks.versions("torch"):
        # Code that asks ncclCommSplit for non-blocking communicators itself leaves no trace here.
        raise job.nothing_to_judge(
            "TORCH_NCCL_USE_COMM_NONBLOCKING and NCCL_COMM_SPLIT_SHARE_RESOURCES",
            "no PyTorch installed to judge either; a program that asks NCCL for non-blocking communicators itself is not visible here",
        )
    if triggers:
        libs = loaded_copies(nccl_libs)
        if not any(evidence.source.endswith("NCCL_COMM_SPLIT_SHARE_RESOURCES") for evidence in triggers):
            # Only PyTorch asks: only the NCCL it loads matters.
            libs = replace(libs, copies=tuple(copy for copy in libs.copies if not copy.bypassed))
        yield from release_findings(libs, SPLIT_NONBLOCKING, *triggers, severity=Severity.WARNING if only_risk else None)


@check("NCCL013", profiles=("full",))
def nccl_ras_init_race(nccl_libs: NcclLibFacts, job: JobFacts) -> Iterator[Observation]:
    """An NCCL release from 2.24 to 2.26 with RAS on (its default); as for NCCL012, a status query
    is what crashes it, and nothing on the node says whether anything will query (a warning)."""
    require_nccl(nccl_libs)
    if switched_off(job, "NCCL_RAS_ENABLE"):
        return
    setting = setting_evidence(job, "NCCL_RAS_ENABLE", "0 until NCCL is upgraded (unset: RAS on)")
    yield from release_findings(loaded_copies(nccl_libs), RAS_INIT_RACE, setting, severity=Severity.WARNING, fix=RAS_QUERY_FIX)


# NCCL keeps each protocol's buffer size in an int (src/init.cc, v2.27.3-1: NCCL_PARAM(BuffSize,
# "BUFFSIZE") is 64-bit, comm->buffSizes[] is int), so 2 GiB and more no longer fits.
INT_MAX = (1 << 31) - 1
BUFFSIZE_NAMES = ("NCCL_BUFFSIZE", "NCCL_LL_BUFFSIZE", "NCCL_LL128_BUFFSIZE")
DEFAULT_BUFFSIZE = 4 << 20  # src/init.cc DEFAULT_BUFFSIZE
# Four times the default: each of the NCCL_STEPS = 8 slots then carries more than 2 MiB per
# network step, which the socket transport's single proxy thread moves over one TCP stream.
SOCKET_BUFFSIZE_LIMIT = 4 * DEFAULT_BUFFSIZE
# Not judged: net.core.rmem_max/wmem_max. NCCL calls setsockopt(SO_SNDBUF/SO_RCVBUF) only for
# NCCL_SOCKET_SNDBUF/NCCL_SOCKET_RCVBUF (from 2.27; src/misc/socket.cc and src/os/linux.cc at
# v2.30.7-1), never from NCCL_BUFFSIZE, and TCP autotuning is bounded by tcp_rmem/tcp_wmem, so
# those two sysctls do not cap the buffers this reference is about.


def _buffsize(value: str) -> int | None:
    try:
        number = int(value.strip(), 0)
    except ValueError:
        return None  # not a number: MEM002 reports the value itself
    return number if number > 0 else None


def socket_transport(job: JobFacts, rdma: RdmaFacts) -> Evidence | None:
    """Why NCCL will move inter-node data over its socket transport, or None when it will not.
    NCCL_NET picks a network by name, compared without case (src/plugin/net.cc, v2.27.3-1); a
    non-zero NCCL_IB_DISABLE turns the IB transport off (src/transport/net_ib.cc); without an RDMA
    device only sockets are left. EFA devices are driven by the aws-ofi-nccl plugin instead."""
    net = job.nccl("NCCL_NET")
    if net is not None:
        return setting_evidence(job, "NCCL_NET", "IB or a network plugin") if net.value.strip().lower() == "socket" else None
    if rdma.class_unread:
        raise Unknown(rdma.class_unread)
    if not rdma.devices:
        return Evidence(IB_CLASS, "no RDMA devices", "an InfiniBand, RoCE or EFA device for NCCL's network")
    disabled = job.nccl("NCCL_IB_DISABLE")
    if disabled is not None and nccl_int(disabled.value, 0) != 0 and not any(device.efa for device in rdma.devices):
        return setting_evidence(job, "NCCL_IB_DISABLE", "unset or 0")
    return None


def _size_evidence(job: JobFacts, name: str, size: int, expected: str) -> Evidence:
    setting = job.nccl(name)
    where = "/proc/self/environ" if setting is None or setting.origin == "environment" else setting.origin
    return Evidence(f"{where} {name}", f"{format_size(size)} ({size} bytes)", expected)


@check("NCCL002", profiles=("prolog",))
def nccl_buffsize_socket_stall(job: JobFacts, rdma: RdmaFacts) -> Iterator[Observation]:
    """Buffer sizes NCCL cannot store (2 GiB and more), and an NCCL_BUFFSIZE far above the default
    on a job whose network traffic will go over the socket transport."""
    settings = {name: setting for name in BUFFSIZE_NAMES if (setting := job.nccl(name)) is not None}
    if not settings:
        raise job.nothing_to_judge(", ".join(BUFFSIZE_NAMES), f"NCCL's default buffer sizes apply, {format_size(DEFAULT_BUFFSIZE)} for Simple")
    sizes = {name: size for name, setting in settings.items() if (size := _buffsize(setting.value))}
    for name, size in sizes.items():
        if size > INT_MAX:
            yield present(name, _size_evidence(job, name, size, "below 2 GiB: NCCL keeps buffer sizes in a 32-bit integer"))
    simple = sizes.get("NCCL_BUFFSIZE")
    if simple is None or not SOCKET_BUFFSIZE_LIMIT < simple <= INT_MAX:
        return
    transport = socket_transport(job, rdma)
    if transport is not None:
        yield present(
            "NCCL_BUFFSIZE",
            _size_evidence(job, "NCCL_BUFFSIZE", simple, f"at most {format_size(SOCKET_BUFFSIZE_LIMIT)} over TCP (default {format_size(DEFAULT_BUFFSIZE)})"),
            transport,
            severity=Severity.WARNING,
        )


MONITORING = ("TORCH_NCCL_ENABLE_MONITORING",)  # no older name: the monitor came with PyTorch 2.2


@check("NCCL006", profiles=("prolog",))
def watchdog_heartbeat_hang(job: JobFacts, frameworks: FrameworkFacts) -> Iterator[Observation]:
    """The job switches ProcessGroupNCCL's heartbeat monitor off, so a watchdog stuck in a CUDA or
    NCCL call hangs the job instead of ending it. A warning: the setting neither breaks nor slows
    a job, it only changes how a rank that already hung ends (jobs set it on purpose around long
    checkpoints), and it is the job's own choice, the same on every node."""
    if job.environ_error:
        raise Unknown(f"/proc/self/environ unreadable ({job.environ_error})")
    if not any(name in job.environ for name in MONITORING):
        raise job.nothing_to_judge(MONITORING[0], "ProcessGroupNCCL's default 1: the monitor runs", conf_files=False)
    for prefixed, release in readers_for(job.environ, MONITORING, frameworks).variants():
        setting = read_setting(job.environ, MONITORING, prefixed)
        if setting is not None and as_bool(setting.value) is False:
            evidence = [Evidence(f"/proc/self/environ {setting.name}", repr(setting.value), "unset or 1 (the monitor aborts a rank whose watchdog stopped)")]
            if release is not None:
                evidence.append(release)
            yield present(setting.name, *evidence, severity=Severity.WARNING)
            return


#: NCCL's troubleshooting guide asks containers for --shm-size=1g (section "Docker"): NCCL puts the
#: buffers of its SHM transport and its proxies' shared state in /dev/shm segments, several MiB
#: per local peer and channel, and Docker's default tmpfs is 64 MiB.
NCCL_SHM_MIN_SIZE = 1 << 30


#: Where /dev/shm is small: a container's runtime option, or the host's own mount.
SMALL_SHM_FIX = (
    "In a container, start it with --ipc=host or --shm-size=1g or more (Kubernetes: an emptyDir with medium: Memory "
    "mounted at /dev/shm). On a host, /dev/shm is systemd's tmpfs, half of RAM unless a size= option shrank it: "
    "mount -o remount,size=50% /dev/shm now, and fix the size= of its /etc/fstab line (or the unit that mounts it)."
)


@check("NCCL007", profiles=("full",))
def nccl_init_system_error(shm: ShmFacts, nccl_libs: NcclLibFacts, gpudirect: GpuDirectFacts) -> Iterator[Observation]:
    """/dev/shm missing, or smaller than NCCL's container guidance, where NCCL runs between local
    GPUs: creating its shared-memory segments then fails with a system error. The reference's
    other causes have checks of their own (NET001, NET004, MEM001, IB007)."""
    require_nccl(nccl_libs)
    if gpudirect.nvidia_gpus == 1:
        raise NotApplicable("one GPU on this node: NCCL shares no memory between local ranks")
    if shm.error:
        raise Unknown(f"statvfs {shm.path}: {shm.error}")
    wanted = f"a tmpfs of at least {format_size(NCCL_SHM_MIN_SIZE)} (docker --shm-size=1g or --ipc=host; on a host, /dev/shm's size= mount option)"
    if shm.usage is None:
        yield present(shm.path, Evidence(shm.path, "missing", wanted))
    elif shm.usage.size < NCCL_SHM_MIN_SIZE and not shm.unlimited:
        observed = f"size {format_size(shm.usage.size)}, {format_size(shm.usage.available)} available"
        yield present(shm.path, Evidence(f"statvfs {shm.path}", observed, wanted), severity=Severity.WARNING, fix=SMALL_SHM_FIX)


# nvmlClocksThrottleReason* (nvml.h; ClocksEventReason* in recent headers, same bits): the reasons
# that say the hardware is holding the GPU back. An idle GPU before a job reports GpuIdle (0x1)
# and nothing else; SwPowerCap (0x4) and SyncBoost (0x10) follow the load and the application.
SLOWDOWN_REASONS = {
    0x08: "HW slowdown (clocks cut by half or more: too hot, an external power brake, or power draw too high)",
    0x20: "SW thermal slowdown (above the GPU's maximum operating temperature)",
    0x40: "HW thermal slowdown (temperature too high)",
    0x80: "HW power brake slowdown (an external power brake signal)",
}


#: nvmlClocksThrottleReasonGpuIdle: nothing runs on the GPU. A prolog and an epilog see it set; a
#: health check run while a job runs (HealthCheckNodeState=ANY) sees it clear.
GPU_IDLE = 0x01
#: HwSlowdown alone, without the thermal or power-brake bit that names its cause: nvml.h says the
#: bit "may be also reported during PState or clock change", as when a GPU leaves its idle state.
HW_SLOWDOWN = 0x08

LONE_HW_SLOWDOWN_FIX = (
    "HW slowdown without a thermal or power-brake reason can be a passing clock or P-state change "
    "(nvml.h): read it again (nvidia-smi -q -d PERFORMANCE). If it stays set on an idle GPU, check "
    "the GPU's temperature and the node's power delivery."
)


BUSY_SLOWDOWN_FIX = (
    "The GPU was busy when it was read, and one reading under load can catch a passing power or "
    "temperature excursion: read it again when it is idle (nvidia-smi -q -d PERFORMANCE). If it "
    "stays slowed down, check the GPU's cooling and the node's power delivery."
)


@check("NCCL011", profiles=("prolog",))
def straggler_rank(gpu_health: GpuHealthFacts, gpus: GpuFacts) -> Iterator[Observation]:
    """A GPU whose clocks its hardware is already holding down before the job starts: its rank
    will run every step slower than the others, and every collective waits for it."""
    unusable = nvml_unusable(gpu_health, gpus)
    if unusable is not None:
        raise unusable
    decided = 0
    for gpu in gpu_health.gpus:
        if gpu.clock_reasons_error in ("NVML_ERROR_NOT_SUPPORTED", "NVML_ERROR_FUNCTION_NOT_FOUND"):
            continue
        if gpu.clock_reasons is None:
            yield undecided(f"GPU{gpu.index}", f"nvmlDeviceGetCurrentClocksThrottleReasons: {gpu.clock_reasons_error}")
            continue
        decided += 1
        slowed = [text for bit, text in SLOWDOWN_REASONS.items() if gpu.clock_reasons & bit]
        if slowed:
            # An idle GPU held down has a fault of its own; a busy one may be passing through a
            # power or heat peak of the load it carries, which must not drain the node; nor may
            # one reading of a bare HW slowdown bit, which a clock change also sets.
            busy = not gpu.clock_reasons & GPU_IDLE
            lone = not busy and gpu.clock_reasons & sum(SLOWDOWN_REASONS) == HW_SLOWDOWN
            yield present(
                f"GPU{gpu.index}",
                Evidence(f"nvmlDeviceGetCurrentClocksThrottleReasons(GPU {gpu.index})", f"0x{gpu.clock_reasons:x}: " + "; ".join(slowed)
                         + ("; the GPU was busy (not idle)" if busy else ""),
                         "no hardware or thermal slowdown on a GPU waiting for a job"),
                severity=Severity.WARNING if busy or lone else None,
                fix=BUSY_SLOWDOWN_FIX if busy else LONE_HW_SLOWDOWN_FIX if lone else "",
            )
    if not decided and all(gpu.clock_reasons_error in ("NVML_ERROR_NOT_SUPPORTED", "NVML_ERROR_FUNCTION_NOT_FOUND") for gpu in gpu_health.gpus):
        raise NotApplicable("the driver reports no clock throttle reasons for these GPUs")


@check("NCCL004", profiles=("prolog",))
def nccl_socket_connect_timeout(firewall: FirewallFacts, sockets: SocketFacts, job: JobFacts, rdma: RdmaFacts) -> Iterator[Observation]:
    """The host firewall silently drops TCP connections from other hosts to the ephemeral ports
    NCCL listens on, so peers' connects time out and NCCL's retry loop runs for minutes."""
    yield from nccl_port_findings(firewall, sockets, job, rdma, frozenset({"dropped"}))
