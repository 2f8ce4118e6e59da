"""Pinned memory: memlock limits and what the job's buffers need (MEM references)."""

from __future__ import annotations

import re
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
from preflight.nccl.gid import nccl_int
from preflight.nccl.ib import sockets_only
from preflight.probes.memlock import Limit, MemlockFacts, PamLimit
from preflight.slurm_conf import SLURM_CONF_PATHS, SLURMD_CONF_UNFOUND
from preflight.registry import check
from preflight.units import format_size

if TYPE_CHECKING:
    from collections.abc import Iterator

    from preflight.config import Expectations
    from preflight.probes.gpudirect import GpuDirectFacts
    from preflight.probes.job import JobFacts
    from preflight.probes.nccl_libs import NcclLibFacts

SYSTEMD_DEFAULT_MEMLOCK = 8 * 1024 * 1024  # systemd >= 253 default when DefaultLimitMEMLOCK is unset


NCCL_MAX_CHANNELS = 64  # MAXCHANNELS in NCCL's src/include/device.h (older releases: 32)


def _limit_evidence(limit: Limit, minimum: int) -> Evidence:
    return Evidence(
        limit.source,
        f"memlock soft {format_size(limit.soft)}, hard {format_size(limit.hard)}",
        f">= {format_size(minimum)}",
    )


def _require_rdma(memlock: MemlockFacts) -> None:
    if memlock.rdma_devices is None:
        raise Unknown(next((p for p in memlock.problems if p.startswith("/sys/class/infiniband")), "RDMA devices not read"))
    if not memlock.rdma_devices:
        raise NotApplicable("no RDMA devices in /sys/class/infiniband; memlock limits only bind RDMA registration")


def _unread_subject(path: str, memlock: MemlockFacts) -> str:
    """The MEM001 subject an unreadable file leaves undecided ("" for files MEM001 does not use)."""
    if path.endswith("/limits"):
        return path
    if (path == "/proc" or path.endswith(("/comm", "/slurmd.pid"))) and memlock.slurmd_pid is None:
        return "slurmd"  # whether slurmd runs, and so its limit, is unknown
    if path in SLURM_CONF_PATHS or path in (memlock.slurm_conf, SLURMD_CONF_UNFOUND):
        return "slurm.conf"
    if "/slurmd.service" in path:
        return "slurmd.service"
    if path.startswith("/etc/security/limits"):
        return "limits.conf"
    if path.startswith(("/etc/systemd/system.conf", "/usr/lib/systemd/system.conf")):
        return "slurmd.service" if memlock.slurmd_unit is not None else ""
    return ""


#: Where slurmd is no systemd service (supervisord starts it in a Slinky pod), a unit's
#: LimitMEMLOCK does nothing: slurmd inherits what its starter and the container runtime give.
SLURMD_OUTSIDE_SYSTEMD_FIX = (
    "slurmd here is not started by systemd (a container's supervisord, a shell): it inherits the limit of what starts "
    "it. Raise the container runtime's limit (LimitMEMLOCK=infinity for containerd.service or docker.service, or the "
    "runtime's default ulimits) or run ulimit -l unlimited in slurmd's entrypoint before it starts, then restart "
    "slurmd; jobs inherit slurmd's limit and cannot raise it above slurmd's hard limit."
)


@check("MEM001", profiles=("prolog",))
def memlock_limit_too_low(memlock: MemlockFacts, job: JobFacts, expect: Expectations) -> Iterator[Observation]:
    """The locked-memory limit a job gets is below the site minimum."""
    _require_rdma(memlock)
    minimum = expect.memlock_min
    # A script slurmd runs (the prolog) has slurmd's limit: its own limit decides slurmd's.
    decided_by_process = {"slurmd"} if job.in_slurmd_script and memlock.process is not None else set()
    for problem in memlock.problems:
        subject = _unread_subject(problem.split(":", 1)[0], memlock)
        if subject and subject not in decided_by_process:
            yield undecided(subject, problem)
    slurmd_undecided = memlock.slurmd_pid is None and any(_unread_subject(p.split(":", 1)[0], memlock) == "slurmd" for p in memlock.problems)
    if memlock.process is not None and memlock.process.soft < minimum and not (job.in_slurmd_script and memlock.slurmd is not None):
        # A script slurmd runs has slurmd's limit: without slurmd's own entry it is the evidence.
        # Outside a job on a Slurm node (an operator's shell, cron, an audit over ssh) this
        # process's limit is not what jobs get: slurmd's entries above and below decide that.
        if _process_limit_is_jobs(memlock, job):
            waived = _limit_waived(memlock, job)  # waived: its RDMA registrations and mlock are not charged
            if waived is None:
                yield undecided("process", f"memlock {format_size(memlock.process.soft)} is below {format_size(minimum)}, but {_waiver_unknown(memlock)}")
            elif not waived:
                yield present("slurmd" if job.in_slurmd_script else "process", _limit_evidence(memlock.process, minimum))
        elif _slurmd_decides(memlock) or not _users_covered(memlock.pam_limits, minimum):
            yield present(
                "process",
                _limit_evidence(memlock.process, minimum),
                severity=Severity.WARNING,
                fix=_own_limit_fix(memlock),
            )
    if memlock.slurmd is not None and min(memlock.slurmd.soft, memlock.slurmd.hard) < minimum:
        yield present(
            "slurmd",
            _limit_evidence(memlock.slurmd, minimum),
            fix=SLURMD_OUTSIDE_SYSTEMD_FIX if memlock.slurmd_systemd is False else
            "Set LimitMEMLOCK=infinity for slurmd (systemctl edit slurmd), then restart slurmd; "
            "jobs inherit slurmd's limit and cannot raise it above slurmd's hard limit.",
        )
    elif memlock.slurmd_pid is None and memlock.slurmd_unit is not None and not slurmd_undecided:
        unit_limit = memlock.slurmd_unit_limit or memlock.systemd_default
        soft = unit_limit.soft if unit_limit else SYSTEMD_DEFAULT_MEMLOCK
        if soft < minimum:
            source = unit_limit.source if unit_limit else f"{memlock.slurmd_unit} (no LimitMEMLOCK; systemd default)"
            yield present(
                "slurmd.service",
                Evidence(source, f"slurmd will start with memlock {format_size(soft)}", f">= {format_size(minimum)}"),
                fix="Add LimitMEMLOCK=infinity to slurmd's unit (a drop-in in /etc/systemd/system/slurmd.service.d/).",
            )
    if memlock.slurm_conf is not None and memlock.memlock_propagated is None:
        yield undecided("slurm.conf", f"{memlock.slurm_conf}: {memlock.propagation_setting}")  # an Include unread
    if memlock.slurm_conf is not None and memlock.memlock_propagated:
        yield present(
            "slurm.conf",
            Evidence(
                memlock.slurm_conf,
                f"MEMLOCK propagated from the submitting shell: {memlock.propagation_setting}",
                "PropagateResourceLimitsExcept=MEMLOCK (or a list without MEMLOCK)",
            ),
            severity=Severity.WARNING,
            fix="Set PropagateResourceLimitsExcept=MEMLOCK in slurm.conf so jobs take slurmd's "
            "limit instead of the login node's, then run 'scontrol reconfigure'.",
        )
    low = _low_pam_limits(memlock.pam_limits, minimum)
    for entry in low[:_PAM_LINES_SHOWN]:
        yield present(
            f"limits.conf {entry.domain}",
            Evidence(entry.source, f"{entry.domain} {entry.kind} memlock {format_size(entry.value)}", f">= {format_size(minimum)}"),
            severity=Severity.WARNING,
            fix=f"Raise or remove the memlock line at {entry.source}; ssh-launched ranks (mpirun, pdsh) get it.",
        )
    if len(low) > _PAM_LINES_SHOWN:
        yield present(
            "limits.conf",
            Evidence("/etc/security/limits.conf, limits.d", f"{len(low) - _PAM_LINES_SHOWN} more low memlock lines", f">= {format_size(minimum)}"),
            severity=Severity.WARNING,
        )


def _users_covered(entries: tuple[PamLimit, ...], minimum: int) -> bool:
    """A limits.conf wildcard line gives every user's session (sshd's PAM: ranks mpirun or pdsh
    start) a soft memlock of ``minimum`` or more; limits.conf(5) leaves root out of ``*``, which
    is why a root cron job or audit keeps the kernel's default while the users' ranks do not."""
    return any(entry.domain == "*" and entry.kind in ("soft", "-") and entry.value >= minimum for entry in entries)


_PAM_LINES_SHOWN = 8  # one finding per low line up to here: a root with thousands gets one more, not thousands


def _low_pam_limits(entries: tuple[PamLimit, ...], minimum: int) -> list[PamLimit]:
    """The limits.conf lines that leave a domain's soft or hard memlock below ``minimum``.

    The soft limit is the one a process runs with (NCCL does not raise it), so a soft-only line
    counts as much as a hard one. pam_limits lets a later line of the same domain override an
    earlier one, and the order of limits.conf against limits.d differs between PAM releases: a
    line is reported only when no line of its domain sets that limit to ``minimum`` or more."""
    low: set[int] = set()  # positions in ``entries``: linear in the lines a recorded root holds
    for kind in ("soft", "hard"):
        by_domain: dict[str, list[int]] = {}
        for position, entry in enumerate(entries):
            if entry.kind in (kind, "-"):
                by_domain.setdefault(entry.domain, []).append(position)
        for positions in by_domain.values():
            if all(entries[position].value < minimum for position in positions):
                low.update(positions)
    return [entries[position] for position in sorted(low)]


OWN_LIMIT_FIX = (
    "This is the limit of the shell or service preflight ran from, not of Slurm jobs (they get "
    "slurmd's, judged separately); ranks started from such a shell (ssh, mpirun, pdsh) get it: "
    "raise it in /etc/security/limits.d/ or the service's LimitMEMLOCK."
)
NO_SLURMD_OWN_LIMIT_FIX = (
    "This is the limit of the root shell or service preflight ran from (cron, an audit over ssh); "
    "jobs on this node get the limit of whatever starts them: a container runtime (docker run "
    "--ulimit memlock=-1, or default-ulimits in /etc/docker/daemon.json), sshd's PAM session "
    "(/etc/security/limits.d/) or a service's LimitMEMLOCK. Run preflight the way the jobs start "
    "(inside their container, or as their user over ssh) to judge theirs."
)


def _limit_waived(memlock: MemlockFacts, job: JobFacts) -> bool | None:
    """Whether this process holds CAP_IPC_LOCK as a granted right: ib_umem_get() (drivers/
    infiniband/core/umem.c) and mlock(2) charge pinned pages to RLIMIT_MEMLOCK only without it,
    and a container that NVIDIA's and the clouds' RDMA recipes start with ``capabilities: add:
    [IPC_LOCK]`` keeps the runtime's low limit on purpose. A full root shell (uid 0 with
    CAP_SYS_ADMIN) outside a job holds it by being root, which says nothing of the jobs' rights,
    and a script slurmd runs has slurmd's rights, not the job's. None: whether it holds the
    right is not known (/proc/self/status, or the namespace of a capability held, unread)."""
    exemption = memlock.exemption
    if job.in_slurmd_script or (exemption is not None and exemption.full_root and not job.in_job_process and not _jobs_container(memlock)):
        return False
    return None if exemption is None else exemption.ipc_lock


def _jobs_container(memlock: MemlockFacts) -> bool:
    """A full-root process in a container on a node where no slurmd starts jobs: a privileged
    container (vLLM's multi-node recipe runs Ray with --privileged) is where its workloads run, with
    this process's limit and its rights, not an operator's shell on the host."""
    return bool(memlock.container) and not _slurmd_decides(memlock)


def _waiver_unknown(memlock: MemlockFacts) -> str:
    """Why :func:`_limit_waived` could not tell."""
    exemption = memlock.exemption
    known = exemption.evidence if exemption is not None else "/proc/self/status not read or without CapEff and Uid lines"
    return f"whether this process holds CAP_IPC_LOCK, which lifts the limit for its registrations, is not known: {known}"


def _process_limit_is_jobs(memlock: MemlockFacts, job: JobFacts) -> bool:
    """Whether this process's memlock limit is the one the job's ranks get: inside a job or a
    script slurmd runs, or on a node where no slurmd (process or unit) decides it. Outside a job on
    a Slurm node (an operator's shell, cron, a timer) it is only the limit of whatever started us,
    and so is a full root shell's outside any job on a node without slurmd: jobs there start
    from a container runtime (docker run --ulimit), sshd's PAM session or an agent of their own."""
    if job.in_slurmd_script or job.in_job_process:
        return True
    if _slurmd_decides(memlock):
        return False
    return not (memlock.exemption is not None and memlock.exemption.full_root) or _jobs_container(memlock)


def _slurmd_decides(memlock: MemlockFacts) -> bool:
    """A slurmd (process or unit) gives this node's jobs their limit."""
    return memlock.slurmd is not None or memlock.slurmd_unit is not None


def _own_limit_fix(memlock: MemlockFacts) -> str:
    """The fix for a limit that is this process's own, not the jobs'."""
    return OWN_LIMIT_FIX if _slurmd_decides(memlock) else NO_SLURMD_OWN_LIMIT_FIX


# NCCL_BUFFSIZE as ncclParamBuffSize reads it: strtoll(value, NULL, 0), so "8388608 # 8 MiB" is
# 8388608 and "4M" is 4 bytes; an empty value, or -2, leaves NCCL's default
# (src/misc/param.cc and computeBuffSizes in src/init.cc, v2.30.7-1).
NCCL_DEFAULT_MARK = -2
_LEADING_NUMBER = re.compile(r"\s*[+-]?(?:0[xX][0-9a-fA-F]+|\d+)")


def _buffsize_problem(value: str, number: int) -> str:
    """Why NCCL's reading of ``value`` (``number``) is not what was written ("" when it is): no
    buffer at all, or a number cut short by a unit or separator strtoll stops at ("4M", "4_194_304").
    A comment after the number, as nccl.conf lines carry, changes nothing."""
    if number <= 0:
        return f"NCCL reads {number}: no buffer"
    match = _LEADING_NUMBER.match(value)
    rest = value[match.end():].strip() if match else value
    if rest and not rest.startswith("#"):
        return f"NCCL reads {number} bytes and ignores {rest!r}"
    return ""


@check("MEM002", profiles=("prolog",), optional=("nccl_libs",))
def nccl_buffsize_exceeds_pinned_memory(
    job: JobFacts, memlock: MemlockFacts, gpudirect: GpuDirectFacts, nccl_libs: NcclLibFacts | Unread = NOT_GIVEN
) -> Iterator[Observation]:
    """NCCL_BUFFSIZE is too large for the job's locked-memory limit or the host's memory."""
    setting = job.nccl("NCCL_BUFFSIZE")
    if setting is None:
        raise job.nothing_to_judge("NCCL_BUFFSIZE", "NCCL's default of 4 MiB applies")
    source = "environment" if setting.origin == "environment" else setting.origin
    where = "/proc/self/environ NCCL_BUFFSIZE" if source == "environment" else f"{source} NCCL_BUFFSIZE"
    buffsize = nccl_int(setting.value, NCCL_DEFAULT_MARK)
    if buffsize == NCCL_DEFAULT_MARK:
        raise NotApplicable(f"NCCL_BUFFSIZE={setting.value!r} ({source}) leaves NCCL's default of 4 MiB")
    problem = _buffsize_problem(setting.value, buffsize)
    if problem:
        yield present("NCCL_BUFFSIZE", Evidence(where, f"{setting.value!r}: {problem}", "a positive byte count such as 4194304"))
        return
    # The smallest footprint NCCL can have over the network: one channel, one send and one
    # receive buffer, each registered with the NIC and so charged to RLIMIT_MEMLOCK.
    smallest = 2 * buffsize
    # slurmd first: on a tie its limit is the one jobs inherit, the clearer evidence. The
    # process's own limit counts only where it is the job's (MEM001 reads it the same way).
    # A granted CAP_IPC_LOCK lifts the limit for this process's registrations (MEM001 likewise).
    waived = _limit_waived(memlock, job)
    own = memlock.process if memlock.process is not None and _process_limit_is_jobs(memlock, job) and waived is not True else None
    limits = [limit for limit in (memlock.slurmd, own) if limit is not None]
    if memlock.rdma_devices is None and limits and min(limit.soft for limit in limits) < smallest:
        # Too low for registration, if the node has RDMA devices: that is not known.
        yield undecided("NCCL_BUFFSIZE", next((p for p in memlock.problems if p.startswith("/sys/class/infiniband")), "RDMA devices not read"))
        return
    # Over NCCL's sockets nothing is registered with a NIC, whatever RDMA devices the node shows.
    registered = not sockets_only(job, nccl_libs)
    if memlock.rdma_devices and registered:
        tightest = min(limits, key=lambda limit: limit.soft) if limits else None
        if tightest is not None and tightest.soft < smallest and tightest is own and waived is None:
            yield undecided("NCCL_BUFFSIZE", f"memlock soft {format_size(tightest.soft)} is below 2 x NCCL_BUFFSIZE, but {_waiver_unknown(memlock)}")
            return
        if tightest is not None and tightest.soft < smallest:
            yield present(
                "NCCL_BUFFSIZE",
                Evidence(where, format_size(buffsize)),
                Evidence(tightest.source, f"memlock soft {format_size(tightest.soft)}", f">= {format_size(smallest)} (2 x NCCL_BUFFSIZE)"),
            )
            return
        if memlock.process is not None and own is None and not waived and memlock.process.soft < smallest:
            yield present(
                "NCCL_BUFFSIZE",
                Evidence(where, format_size(buffsize)),
                Evidence(memlock.process.source, f"memlock soft {format_size(memlock.process.soft)}", f">= {format_size(smallest)} (2 x NCCL_BUFFSIZE)"),
                severity=Severity.WARNING,
                fix=_own_limit_fix(memlock),
            )
            return
    # The largest footprint: every channel of every local GPU with a send and a receive buffer
    # in pinned host memory (the case without GPUDirect RDMA).
    gpus = max(1, gpudirect.nvidia_gpus or 0)  # unknown: the smallest footprint, still a lower bound
    largest = 2 * buffsize * NCCL_MAX_CHANNELS * gpus
    if memlock.mem_total is not None and largest > memlock.mem_total // 2:
        yield present(
            "NCCL_BUFFSIZE",
            Evidence(where, format_size(buffsize)),
            Evidence(
                "/proc/meminfo MemTotal",
                f"{format_size(memlock.mem_total)}; up to {format_size(largest)} pinned "
                f"(2 x {NCCL_MAX_CHANNELS} channels x {gpus} GPUs x NCCL_BUFFSIZE)",
                "at most half of host memory",
            ),
            severity=Severity.WARNING,
        )
