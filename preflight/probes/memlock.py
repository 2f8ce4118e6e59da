"""Locked-memory limits as an RDMA job will get them (references MEM001, MEM002).

Sources:

* ``/proc/self/limits`` and ``/proc/<slurmd pid>/limits``, row ``Max locked memory`` (proc(5));
  slurmd's pid from ``/run/slurmd.pid`` (``SlurmdPidFile``), else a scan of ``/proc/*/comm``.
* ``/etc/systemd/system.conf`` and ``system.conf.d/*.conf``: ``DefaultLimitMEMLOCK=`` in
  ``[Manager]`` (systemd-system.conf(5); systemd's own default is 8M).
* the slurmd unit and its drop-ins: ``LimitMEMLOCK=`` in ``[Service]`` (systemd.exec(5)), read as
  systemd reads them: continued lines, drop-ins in file-name order with a name in ``/etc`` hiding
  the same name further down, an empty assignment resetting the limit (systemd.unit(5)).
* ``/etc/security/limits.conf`` and ``limits.d/*.conf``: ``<domain> <type> memlock <KiB>``
  (limits.conf(5)); these apply to PAM sessions (ssh, login), not to services.
* ``slurm.conf`` as Slurm reads it (:mod:`preflight.slurm_conf`: ``$SLURM_CONF``, ``/etc/slurm``, the
  configless copy in ``/run/slurm/conf``; its Include files): ``PropagateResourceLimits`` /
  ``PropagateResourceLimitsExcept`` (slurm.conf(5)); when neither is set every limit of the
  submitting shell, MEMLOCK included, is propagated to the job.
* ``/proc/meminfo`` ``MemTotal``.

Why: ``ib_umem_get()`` charges pinned pages to RLIMIT_MEMLOCK unless the process has
CAP_IPC_LOCK, so ``ibv_reg_mr`` fails with ENOMEM for a job user whose limit is low.
"""

from __future__ import annotations

import re

from msgspec import Struct

from preflight.probing import FactReader, container_marker
from preflight.registry import probe
from preflight.slurm_conf import find_job_slurm_conf, find_slurmd
from preflight.slurm_conf import propagated as propagated_limit
from preflight.sources import NodeFS
from preflight.units import UNLIMITED, parse_size

NCCL_DEFAULT_BUFFSIZE = 4 * 1024 * 1024  # NCCL_BUFFSIZE default (NCCL environment variable docs)


_UNIT_DIRS = ("/etc/systemd/system", "/run/systemd/system", "/usr/lib/systemd/system", "/lib/systemd/system")


class Limit(Struct, frozen=True):
    """A soft/hard pair (``UNLIMITED`` for unlimited) in the limit's unit, bytes for memory and a
    count for open files, and where it was read."""

    soft: int
    hard: int
    source: str


class PamLimit(Struct, frozen=True):
    """One ``memlock`` line of limits.conf or limits.d."""

    domain: str  # "*", "@group", "user", "%group"
    kind: str  # "soft", "hard" or "-" (both)
    value: int  # bytes
    source: str  # "/etc/security/limits.conf:12"


class Exemption(Struct, frozen=True):
    """What ``/proc/self/status`` and ``/proc/self/uid_map`` say about this process's rights:
    ib_umem_get() and mlock(2) skip the RLIMIT_MEMLOCK charge for a holder of CAP_IPC_LOCK
    (``capable()``, i.e. in the initial user namespace)."""

    ipc_lock: bool | None  # CapEff bit 14 (CAP_IPC_LOCK) in the initial user namespace; None: held, namespace unread
    full_root: bool  # uid 0 with CAP_SYS_ADMIN: an administrator's shell, not a granted right
    evidence: str  # "CapEff 00000000a80435fb (CAP_IPC_LOCK), uid 0, initial user namespace"


class MemlockFacts(Struct, frozen=True):
    """Every place the job's RLIMIT_MEMLOCK can come from."""

    process: Limit | None  # /proc/self/limits
    slurmd_pid: int | None  # /run/slurmd.pid or /proc/*/comm == "slurmd"
    slurmd: Limit | None  # /proc/<slurmd pid>/limits
    systemd_default: Limit | None  # DefaultLimitMEMLOCK= (None: not set, systemd's 8M applies)
    slurmd_unit: str | None  # path of slurmd.service
    slurmd_unit_limit: Limit | None  # LimitMEMLOCK= in the unit or its drop-ins
    pam_limits: tuple[PamLimit, ...]  # /etc/security/limits.conf, limits.d/*.conf
    slurm_conf: str | None  # path of slurm.conf read
    memlock_propagated: bool | None  # whether slurm.conf lets the submit host's MEMLOCK through; None: unread
    propagation_setting: str  # the deciding slurm.conf line, or "(default: ALL)"
    mem_total: int | None  # /proc/meminfo MemTotal, bytes
    rdma_devices: tuple[str, ...] | None  # /sys/class/infiniband; None when unknown
    problems: tuple[str, ...]  # files that could not be read or were not captured: "path: reason"
    # This process's exemption from RLIMIT_MEMLOCK (None: /proc/self/status unread or unparsed)
    exemption: Exemption | None = None
    # slurmd runs as systemd's slurmd.service (its /proc/<pid>/cgroup names the unit), False where
    # something else starts it (supervisord in a Slinky pod, a shell), None when unread or no slurmd
    slurmd_systemd: bool | None = None
    # For a full-root process on a node without slurmd only: the container marker it runs beside
    # ("/.dockerenv"), "" where none is there (or it was not asked), None where one could not be
    # looked for.
    # A privileged container is where its workloads run, with the same limit and the same rights.
    container: str | None = ""


def parse_limits_memlock(text: str, source: str) -> Limit | None:
    """The ``Max locked memory`` row of ``/proc/<pid>/limits``."""
    return parse_limits_row(text, "Max locked memory", source)


def parse_limits_row(text: str, row: str, source: str) -> Limit | None:
    """One row of ``/proc/<pid>/limits`` (``Max locked memory``, ``Max open files``), in the
    row's own unit; None when the row is missing or garbled."""
    for line in text.splitlines():
        if line.startswith(row):
            fields = line[len(row) :].split()
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


def parse_unit_setting(text: str, key: str, section: str = "Service") -> str | None:
    """The last assignment of ``key`` in ``[section]`` of a systemd unit or configuration file
    (systemd.syntax(7)): ``#``/``;`` comment lines, a trailing backslash continues a line, keys
    elsewhere do not count. ``""`` is an empty assignment, which resets the setting to its
    default; None: not assigned."""
    value: str | None = None
    current = ""
    pending = ""
    for raw in text.splitlines():
        line = (pending + " " + raw.strip()) if pending else raw.strip()
        pending = ""
        if line.startswith(("#", ";")):
            continue
        if line.endswith("\\"):
            pending = line[:-1].rstrip()
            continue
        if line.startswith("[") and line.endswith("]"):
            current = line[1:-1].strip()
            continue
        name, equals, assigned = line.partition("=")
        if equals and current == section and name.strip() == key:
            value = assigned.strip()
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


def parse_meminfo_total(text: str) -> int | None:
    match = re.search(r"^MemTotal:\s+(\d+)\s*kB", text, re.MULTILINE)
    return int(match.group(1)) * 1024 if match else None


def _drop_in_files(reader: FactReader, directory: str) -> list[str]:
    """``*.conf`` in ``directory``; an unlisted directory is in ``problems``, which undecide the
    subjects it could have changed (:func:`_unread_subject`)."""
    return [f"{directory}/{name}" for name in reader.listing(directory) or [] if name.endswith(".conf")]


def _systemd_default(reader: FactReader) -> Limit | None:
    """``DefaultLimitMEMLOCK`` of systemd's ``[Manager]`` (system.conf and its drop-ins); None:
    systemd's own default."""
    found: Limit | None = None
    files = ["/etc/systemd/system.conf"] + _ordered_drop_ins(reader, ("/etc/systemd/system.conf.d", "/run/systemd/system.conf.d", "/usr/lib/systemd/system.conf.d"))
    for path in files:
        text = reader.text(path)
        value = parse_unit_setting(text, "DefaultLimitMEMLOCK", section="Manager") if text else None
        if value == "":
            found = None  # an empty assignment resets it to systemd's own default
        elif value is not None:
            found = parse_systemd_limit(value, path) or found
    return found


def _ordered_drop_ins(reader: FactReader, directories: tuple[str, ...]) -> list[str]:
    """The ``*.conf`` drop-ins systemd applies, in its order: by file name across the
    directories, a name in an earlier (higher-priority) directory hiding the same name in a later
    one (systemd.unit(5), "drop-in")."""
    by_name: dict[str, str] = {}
    for directory in directories:
        for path in _drop_in_files(reader, directory):
            by_name.setdefault(path.rsplit("/", 1)[-1], path)
    return [by_name[name] for name in sorted(by_name)]


def _slurmd_unit(reader: FactReader) -> tuple[str | None, Limit | None]:
    unit = next((f"{d}/slurmd.service" for d in _UNIT_DIRS if reader.text(f"{d}/slurmd.service") is not None), None)
    if unit is None:
        return None, None
    limit = None
    text = reader.text(unit) or ""
    value = parse_unit_setting(text, "LimitMEMLOCK")
    if value:
        limit = parse_systemd_limit(value, unit)
    for path in _ordered_drop_ins(reader, tuple(f"{d}/slurmd.service.d" for d in _UNIT_DIRS)):
        value = parse_unit_setting(reader.text(path) or "", "LimitMEMLOCK")
        if value == "":
            limit = None  # reset: the manager's DefaultLimitMEMLOCK applies again
        elif value is not None:
            limit = parse_systemd_limit(value, path) or limit
    return unit, limit


CAP_IPC_LOCK = 14  # include/uapi/linux/capability.h
CAP_SYS_ADMIN = 21
_INITIAL_UID_MAP = ("0", "0", "4294967295")  # user_namespaces(7): the initial namespace's map


def parse_exemption(status: str, uid_map: str | None) -> Exemption | None:
    """CAP_IPC_LOCK from ``CapEff`` (hex, proc(5)); None when the line or the Uid line is
    missing. Outside the initial user namespace the capability does not satisfy ``capable()``:
    with ``uid_map`` unread (None) a capability held is of an unknown namespace."""
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    try:
        capabilities = int(fields["CapEff"].strip(), 16)
        uid = int(fields["Uid"].split()[1])  # real, effective, saved, filesystem: the effective uid
    except (KeyError, ValueError, IndexError):
        return None
    held = bool(capabilities >> CAP_IPC_LOCK & 1)
    if uid_map is None:
        initial: bool | None = None
        where = "user namespace not known (/proc/self/uid_map not read)"
    else:
        initial = tuple(uid_map.split()) == _INITIAL_UID_MAP
        where = "initial user namespace" if initial else f"user namespace with uid_map {' '.join(uid_map.split())[:60]!r}"
    return Exemption(
        ipc_lock=held and initial if held else False,
        full_root=uid == 0 and bool(capabilities >> CAP_SYS_ADMIN & 1),
        evidence=f"CapEff {fields['CapEff'].strip()[:16]} ({'CAP_IPC_LOCK' if held else 'no CAP_IPC_LOCK'}), uid {uid}, {where}",
    )


def _read_exemption(reader: FactReader) -> Exemption | None:
    status = reader.text("/proc/self/status")
    return parse_exemption(status, reader.text("/proc/self/uid_map")) if status is not None else None


def _read_memlock(reader: FactReader, path: str) -> Limit | None:
    """The memlock row of a limits file; a file read without a row that parses is a problem
    (MEM001 then says unknown for it), not a process without a limit."""
    text = reader.text(path)
    limit = parse_limits_memlock(text, path) if text is not None else None
    if text is not None and limit is None:
        reader.problems.append(f"{path}: no 'Max locked memory' row that parses")
    return limit


@probe("memlock")
def probe_memlock(fs: NodeFS) -> MemlockFacts:
    """Gather every source of the job's locked-memory limit."""
    reader = FactReader(fs)
    process = _read_memlock(reader, "/proc/self/limits")
    slurmd_pid = find_slurmd(reader)
    slurmd = _read_memlock(reader, f"/proc/{slurmd_pid}/limits") if slurmd_pid is not None else None
    unit, unit_limit = _slurmd_unit(reader)
    pam: list[PamLimit] = []
    for path in ["/etc/security/limits.conf"] + _drop_in_files(reader, "/etc/security/limits.d"):
        pam.extend(parse_pam_limits(reader.text(path) or "", path))
    conf, conf_problems = find_job_slurm_conf(fs, slurmd_pid)
    reader.problems.extend(conf_problems)
    propagated, setting = propagated_limit(conf, "MEMLOCK") if conf is not None else (None, "")
    slurm_conf = conf.path if conf is not None else None
    meminfo = reader.text("/proc/meminfo")
    rdma = reader.listing("/sys/class/infiniband")
    exemption = _read_exemption(FactReader(fs))
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
        # Read apart: an unreadable status leaves the exemption unknown, never a limit unknown.
        exemption=exemption,
        slurmd_systemd=_under_systemd(FactReader(fs), slurmd_pid) if slurmd_pid is not None else None,
        # Asked only where it can matter: a full-root process on a node where no slurmd gives jobs
        # their limit (every Slurm prolog runs as full root, and never needs it).
        container=container_marker(FactReader(fs)) if exemption is not None and exemption.full_root and slurmd is None and unit is None else "",
    )


def _under_systemd(reader: FactReader, pid: int) -> bool | None:
    """Whether slurmd is systemd's slurmd.service: every cgroup line of a unit's process ends in
    its unit's name (``0::/system.slice/slurmd.service`` on cgroup v2)."""
    text = reader.text(f"/proc/{pid}/cgroup")
    if not text:
        return None
    return any(line.rstrip().endswith(".service") and "slurmd" in line.rsplit("/", 1)[-1] for line in text.splitlines())
