"""Locked-memory limits as an RDMA job will get them (references MEM001, MEM002).

Sources:

* ``/proc/self/limits`` and ``/proc/<slurmd pid>/limits``, row ``Max locked memory`` (proc(5));
  slurmd's pid from ``/run/slurmd.pid`` (``SlurmdPidFile``), else a scan of ``/proc/*/comm``.
* ``/etc/systemd/system.conf`` and ``system.conf.d/*.conf``: ``DefaultLimitMEMLOCK=``
  (systemd-system.conf(5); systemd's own default is 8M).
* the slurmd unit and its drop-ins: ``LimitMEMLOCK=`` (systemd.exec(5)).
* ``/etc/security/limits.conf`` and ``limits.d/*.conf``: ``<domain> <type> memlock <KiB>``
  (limits.conf(5)); these apply to PAM sessions (ssh, login), not to services.
* ``slurm.conf`` (``$SLURM_CONF`` or ``/etc/slurm/slurm.conf``): ``PropagateResourceLimits`` /
  ``PropagateResourceLimitsExcept`` (slurm.conf(5)); when neither is set every limit of the
  submitting shell, MEMLOCK included, is propagated to the job.
* ``/proc/meminfo`` ``MemTotal``.

Why: ``ib_umem_get()`` charges pinned pages to RLIMIT_MEMLOCK unless the process has
CAP_IPC_LOCK, so ``ibv_reg_mr`` fails with ENOMEM for a job user whose limit is low.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

from preflight.checks.gpudirect import GpuDirectFacts
from preflight.checks.job import JobFacts, job_file_user, parse_environ
from preflight.config import Expectations
from preflight.model import Evidence, NotApplicable, Observation, Severity, Unknown, present, undecided
from preflight.probing import FactReader
from preflight.records import frozen
from preflight.registry import check, probe
from preflight.sources import NodeFS, SourceError
from preflight.units import UNLIMITED, format_size, parse_size

SYSTEMD_DEFAULT_MEMLOCK = 8 * 1024 * 1024  # systemd >= 253 default when DefaultLimitMEMLOCK is unset
NCCL_DEFAULT_BUFFSIZE = 4 * 1024 * 1024  # NCCL_BUFFSIZE default (NCCL environment variable docs)
NCCL_MAX_CHANNELS = 64  # MAXCHANNELS in NCCL's src/include/device.h (older releases: 32)
_UNIT_DIRS = ("/etc/systemd/system", "/run/systemd/system", "/usr/lib/systemd/system", "/lib/systemd/system")
_SLURM_CONF_PATHS = ("/etc/slurm/slurm.conf", "/etc/slurm-llnl/slurm.conf")


@frozen
class Limit:
    """A soft/hard pair in bytes (``UNLIMITED`` for unlimited) and where it was read."""

    soft: int
    hard: int
    source: str


@frozen
class PamLimit:
    """One ``memlock`` line of limits.conf or limits.d."""

    domain: str  # "*", "@group", "user", "%group"
    kind: str  # "soft", "hard" or "-" (both)
    value: int  # bytes
    source: str  # "/etc/security/limits.conf:12"


@frozen
class MemlockFacts:
    """Every place the job's RLIMIT_MEMLOCK can come from."""

    process: Limit | None  # /proc/self/limits
    slurmd_pid: int | None  # /run/slurmd.pid or /proc/*/comm == "slurmd"
    slurmd: Limit | None  # /proc/<slurmd pid>/limits
    systemd_default: Limit | None  # DefaultLimitMEMLOCK= (None: not set, systemd's 8M applies)
    slurmd_unit: str | None  # path of slurmd.service
    slurmd_unit_limit: Limit | None  # LimitMEMLOCK= in the unit or its drop-ins
    pam_limits: tuple[PamLimit, ...]  # /etc/security/limits.conf, limits.d/*.conf
    slurm_conf: str | None  # path of slurm.conf read
    memlock_propagated: bool | None  # whether slurm.conf lets the submit host's MEMLOCK through
    propagation_setting: str  # the deciding slurm.conf line, or "(default: ALL)"
    mem_total: int | None  # /proc/meminfo MemTotal, bytes
    rdma_devices: tuple[str, ...] | None  # /sys/class/infiniband; None when unknown
    problems: tuple[str, ...]  # files that could not be read or were not captured: "path: reason"


def parse_limits_memlock(text: str, source: str) -> Limit | None:
    """The ``Max locked memory`` row of ``/proc/<pid>/limits``."""
    for line in text.splitlines():
        if line.startswith("Max locked memory"):
            fields = line[len("Max locked memory") :].split()
            if len(fields) >= 2:
                try:
                    return Limit(_limit_value(fields[0]), _limit_value(fields[1]), source)
                except ValueError:
                    return None
    return None


#: The kernel prints RLIM_INFINITY as "unlimited", but a limit set to it through a path that
#: rounds to pages shows as 18446744073708503040 (2**64 - 1 MiB) on some systems: anything this
#: large is no limit on a machine that exists.
EFFECTIVELY_UNLIMITED = 1 << 62


def _limit_value(text: str) -> int:
    value = UNLIMITED if text == "unlimited" else int(text)
    return UNLIMITED if value >= EFFECTIVELY_UNLIMITED else value


def parse_systemd_limit(value: str, source: str) -> Limit | None:
    """``LimitMEMLOCK=``/``DefaultLimitMEMLOCK=`` values: ``infinity``, ``8M``, ``soft:hard``."""
    value = value.strip()
    if not value:
        return None
    soft_text, _, hard_text = value.partition(":")
    try:
        soft = parse_size(soft_text)
        hard = parse_size(hard_text) if hard_text else soft
    except ValueError:
        return None
    return Limit(soft, hard, source)


def parse_unit_setting(text: str, key: str) -> str | None:
    """Last assignment of ``key`` in a systemd INI file; an empty assignment resets it."""
    value: str | None = None
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith((";", "#")) or "=" not in stripped:
            continue
        name, _, assigned = stripped.partition("=")
        if name.strip() == key:
            value = assigned.strip() or None
    return value


def parse_pam_limits(text: str, path: str) -> list[PamLimit]:
    """``memlock`` lines of limits.conf(5): values are KiB, or ``unlimited``/``infinity``."""
    entries = []
    for number, line in enumerate(text.splitlines(), 1):
        fields = line.split("#", 1)[0].split()
        if len(fields) != 4 or fields[2] != "memlock":
            continue
        domain, kind, _, value = fields
        try:
            size = UNLIMITED if value in ("unlimited", "infinity", "-1") else int(value) * 1024
        except ValueError:
            continue
        size = UNLIMITED if size >= EFFECTIVELY_UNLIMITED else size
        entries.append(PamLimit(domain, kind, size, f"{path}:{number}"))
    return entries


def parse_slurm_propagation(text: str) -> tuple[bool, str]:
    """Whether slurm.conf propagates MEMLOCK from the submit host, and the deciding line."""
    propagate = except_ = None
    for line in text.splitlines():
        stripped = line.split("#", 1)[0].strip()
        match = re.match(r"(?i)^(PropagateResourceLimits(?:Except)?)\s*=\s*(\S*)", stripped)
        if match:
            if match.group(1).lower().endswith("except"):
                except_ = (stripped, match.group(2))
            else:
                propagate = (stripped, match.group(2))
    if except_ is not None:
        names = {item.strip().upper() for item in except_[1].split(",")}
        return "MEMLOCK" not in names and "ALL" not in names, except_[0]
    if propagate is not None:
        names = {item.strip().upper() for item in propagate[1].split(",")}
        return "ALL" in names or "MEMLOCK" in names, propagate[0]
    return True, "(neither PropagateResourceLimits nor PropagateResourceLimitsExcept set: ALL)"


def parse_meminfo_total(text: str) -> int | None:
    match = re.search(r"^MemTotal:\s+(\d+)\s*kB", text, re.MULTILINE)
    return int(match.group(1)) * 1024 if match else None


def _find_slurmd(reader: FactReader) -> int | None:
    for pid_file in ("/run/slurmd.pid", "/var/run/slurmd.pid"):
        text = reader.text(pid_file)
        if text and text.strip().isdigit():
            pid = int(text.strip())
            if (reader.text(f"/proc/{pid}/comm") or "").strip() == "slurmd":
                return pid
    for entry in reader.listing("/proc") or []:  # unlisted: the problem makes slurmd undecided
        if entry.isdigit():
            try:
                comm = reader.fs.read(f"/proc/{entry}/comm")
            except SourceError:
                continue  # processes come and go, and hidepid hides others
            if (comm or "").strip() == "slurmd" and _runs_as_root(reader, entry):
                return int(entry)
    return None


def _runs_as_root(reader: FactReader, pid: str) -> bool:
    """A process any user can start and name ``slurmd`` is no evidence of slurmd's limits: only
    one running as root (real uid 0 in ``/proc/<pid>/status``) is taken for it."""
    try:
        status = reader.fs.read(f"/proc/{pid}/status")
    except SourceError:
        return False
    uid = next((line.split()[1:2] for line in (status or "").splitlines() if line.startswith("Uid:")), [])
    return uid == ["0"]


def _drop_in_files(reader: FactReader, directory: str) -> list[str]:
    """``*.conf`` in ``directory``; an unlisted directory is in ``problems``, which undecide the
    subjects it could have changed (:func:`_unread_subject`)."""
    return [f"{directory}/{name}" for name in reader.listing(directory) or [] if name.endswith(".conf")]


def _systemd_default(reader: FactReader) -> Limit | None:
    found: Limit | None = None
    files = ["/etc/systemd/system.conf"] + sorted(
        _drop_in_files(reader, "/etc/systemd/system.conf.d") + _drop_in_files(reader, "/usr/lib/systemd/system.conf.d"),
        key=lambda path: path.rsplit("/", 1)[-1],
    )
    for path in files:
        text = reader.text(path)
        value = parse_unit_setting(text, "DefaultLimitMEMLOCK") if text else None
        if value is not None:
            found = parse_systemd_limit(value, path) or found
    return found


def _slurmd_unit(reader: FactReader) -> tuple[str | None, Limit | None]:
    unit = next((f"{d}/slurmd.service" for d in _UNIT_DIRS if reader.text(f"{d}/slurmd.service") is not None), None)
    if unit is None:
        return None, None
    limit = None
    text = reader.text(unit) or ""
    value = parse_unit_setting(text, "LimitMEMLOCK")
    if value is not None:
        limit = parse_systemd_limit(value, unit)
    drop_ins = sorted(
        (path for d in _UNIT_DIRS for path in _drop_in_files(reader, f"{d}/slurmd.service.d")),
        key=lambda path: path.rsplit("/", 1)[-1],
    )
    for path in drop_ins:
        value = parse_unit_setting(reader.text(path) or "", "LimitMEMLOCK")
        if value is not None:
            limit = parse_systemd_limit(value, path) or limit
    return unit, limit


@probe("memlock")
def probe_memlock(fs: NodeFS) -> MemlockFacts:
    """Gather every source of the job's locked-memory limit."""
    reader = FactReader(fs)
    limits_text = reader.text("/proc/self/limits")
    process = parse_limits_memlock(limits_text, "/proc/self/limits") if limits_text else None
    slurmd_pid = _find_slurmd(reader)
    slurmd = None
    if slurmd_pid is not None:
        source = f"/proc/{slurmd_pid}/limits"
        text = reader.text(source)
        slurmd = parse_limits_memlock(text, source) if text else None
    unit, unit_limit = _slurmd_unit(reader)
    pam: list[PamLimit] = []
    for path in ["/etc/security/limits.conf"] + _drop_in_files(reader, "/etc/security/limits.d"):
        pam.extend(parse_pam_limits(reader.text(path) or "", path))
    try:
        environ = parse_environ(fs.read_bytes("/proc/self/environ") or b"")
    except SourceError:
        environ = {}  # the job probe reports an unreadable environment
    conf_override, user = environ.get("SLURM_CONF", ""), job_file_user(fs, environ)
    slurm_conf = propagated = None
    setting = ""
    for path in ((conf_override,) if conf_override.startswith("/") else ()) + _SLURM_CONF_PATHS:
        try:  # $SLURM_CONF is the job's to name: read with its user's rights
            text = fs.read_for(path, user if path == conf_override else None)
        except SourceError as error:
            reader.problems.append(str(error))
            text = None
        if text is not None:
            slurm_conf = path
            propagated, setting = parse_slurm_propagation(text)
            break
    meminfo = reader.text("/proc/meminfo")
    rdma = reader.listing("/sys/class/infiniband")
    return MemlockFacts(
        process=process,
        slurmd_pid=slurmd_pid,
        slurmd=slurmd,
        systemd_default=_systemd_default(reader),
        slurmd_unit=unit,
        slurmd_unit_limit=unit_limit,
        pam_limits=tuple(pam),
        slurm_conf=slurm_conf,
        memlock_propagated=propagated,
        propagation_setting=setting,
        mem_total=parse_meminfo_total(meminfo) if meminfo else None,
        rdma_devices=None if rdma is None else tuple(rdma),
        problems=tuple(reader.problems),
    )


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


# SLURM_SCRIPT_CONTEXT values of scripts that slurmd itself runs (Slurm's prolog/epilog guide):
# they inherit slurmd's limits, not the job's, so their own limit is no separate finding.
_SLURMD_SCRIPT_CONTEXTS = frozenset({"prolog_slurmd", "epilog_slurmd"})


def _unread_subject(path: str, memlock: MemlockFacts) -> str:
    """The MEM001 subject an unreadable file leaves undecided ("" for files MEM001 does not use)."""
    if path.endswith("/limits"):
        return path
    if (path == "/proc" or path.endswith(("/comm", "/slurmd.pid"))) and memlock.slurmd_pid is None:
        return "slurmd"  # whether slurmd runs, and so its limit, is unknown
    if path in _SLURM_CONF_PATHS:
        return "slurm.conf"
    if "/slurmd.service" in path:
        return "slurmd.service"
    if path.startswith("/etc/security/limits"):
        return "limits.conf"
    if path.startswith(("/etc/systemd/system.conf", "/usr/lib/systemd/system.conf")):
        return "slurmd.service" if memlock.slurmd_unit is not None else ""
    return ""


@check("MEM001", profiles=("prolog",))
def memlock_limit_too_low(memlock: MemlockFacts, job: JobFacts, expect: Expectations) -> Iterator[Observation]:
    """The locked-memory limit a job gets is below the site minimum."""
    _require_rdma(memlock)
    minimum = expect.memlock_min
    slurmd_script = job.environ.get("SLURM_SCRIPT_CONTEXT") in _SLURMD_SCRIPT_CONTEXTS
    # A script slurmd runs (the prolog) has slurmd's limit: its own limit decides slurmd's.
    decided_by_process = {"slurmd"} if slurmd_script and memlock.process is not None else set()
    for problem in memlock.problems:
        subject = _unread_subject(problem.split(":", 1)[0], memlock)
        if subject and subject not in decided_by_process:
            yield undecided(subject, problem)
    slurmd_undecided = memlock.slurmd_pid is None and any(_unread_subject(p.split(":", 1)[0], memlock) == "slurmd" for p in memlock.problems)
    if memlock.process is not None and memlock.process.soft < minimum and not (slurmd_script and memlock.slurmd is not None):
        # A script slurmd runs has slurmd's limit: without slurmd's own entry it is the evidence.
        yield present("slurmd" if slurmd_script else "process", _limit_evidence(memlock.process, minimum))
    if memlock.slurmd is not None and min(memlock.slurmd.soft, memlock.slurmd.hard) < minimum:
        yield present(
            "slurmd",
            _limit_evidence(memlock.slurmd, minimum),
            fix="Set LimitMEMLOCK=infinity for slurmd (systemctl edit slurmd), then restart slurmd; "
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
    for entry in memlock.pam_limits:
        if entry.value < minimum and entry.kind in ("hard", "-"):
            yield present(
                f"limits.conf {entry.domain}",
                Evidence(entry.source, f"{entry.domain} {entry.kind} memlock {format_size(entry.value)}", f">= {format_size(minimum)}"),
                severity=Severity.WARNING,
                fix=f"Raise or remove the memlock line at {entry.source}; ssh-launched ranks (mpirun, pdsh) get it.",
            )


def _parse_buffsize(value: str) -> int | None:
    try:
        number = int(value.strip(), 0)
    except ValueError:
        return None
    return number if number > 0 else None


@check("MEM002", profiles=("prolog",))
def nccl_buffsize_exceeds_pinned_memory(
    job: JobFacts, memlock: MemlockFacts, gpudirect: GpuDirectFacts
) -> Iterator[Observation]:
    """NCCL_BUFFSIZE is too large for the job's locked-memory limit or the host's memory."""
    setting = job.nccl("NCCL_BUFFSIZE")
    if setting is None:
        return  # NCCL's default of 4 MiB applies
    source = "environment" if setting.origin == "environment" else setting.origin
    where = "/proc/self/environ NCCL_BUFFSIZE" if source == "environment" else f"{source} NCCL_BUFFSIZE"
    buffsize = _parse_buffsize(setting.value)
    if buffsize is None:
        yield present("NCCL_BUFFSIZE", Evidence(where, repr(setting.value), "a positive byte count such as 4194304"))
        return
    # The smallest footprint NCCL can have over the network: one channel, one send and one
    # receive buffer, each registered with the NIC and so charged to RLIMIT_MEMLOCK.
    smallest = 2 * buffsize
    # slurmd first: on a tie its limit is the one jobs inherit, the clearer evidence.
    limits = [limit for limit in (memlock.slurmd, memlock.process) if limit is not None]
    if memlock.rdma_devices is None and limits and min(limit.soft for limit in limits) < smallest:
        # Too low for registration, if the node has RDMA devices: that is not known.
        yield undecided("NCCL_BUFFSIZE", next((p for p in memlock.problems if p.startswith("/sys/class/infiniband")), "RDMA devices not read"))
        return
    if memlock.rdma_devices and limits:
        tightest = min(limits, key=lambda limit: limit.soft)
        if tightest.soft < smallest:
            yield present(
                "NCCL_BUFFSIZE",
                Evidence(where, format_size(buffsize)),
                Evidence(tightest.source, f"memlock soft {format_size(tightest.soft)}", f">= {format_size(smallest)} (2 x NCCL_BUFFSIZE)"),
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
