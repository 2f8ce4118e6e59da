"""``preflight slurm prolog|epilog|healthcheck|config``: running under Slurm.

Slurm facts this module is built on (``/work/shared/research/peers.md``, Slurm's prolog/epilog
guide and slurm.conf man page):

* A Prolog that exits non-zero drains the node; slurmctld requeues a batch job held ("launch
  failed requeued held", until ``scontrol release``; ``SchedulerParameters=nohold_on_prolog_fail``
  drops the hold) and cancels an srun/salloc job, then slurmd runs the Epilog of that job anyway.
  An Epilog that exits non-zero drains the node. Either way Slurm keeps a reason already set
  (checked on Slurm 22.05), and slurmd logs the script's output at error level; a Prolog's that
  exits 0 only at debug2.
* Slurm asks prologs not to call Slurm commands (a slow controller would stall every job start),
  so a clean prolog run calls nothing. Only a failing run makes one bounded ``scontrol update ...
  State=DRAIN Reason="preflight: ..."`` call (never retried), so the node carries a meaningful
  reason; a failing epilog first reads the node's state, so as not to replace a reason already
  there (the failed prolog's, for a job that never ran).
* The prolog runs outside the job's cgroup with a minimal environment (no ``PATH``): the job's
  GPUs are ``SLURM_JOB_GPUS`` (``CUDA_VISIBLE_DEVICES`` there is not the job's view). It holds
  Slurm's GRES indices (``gres_common_prep_set_env``), which are NVML's indices where gres.conf
  has ``AutoDetect=nvml`` (``gres_gpu.c`` sorts the GPUs in NVML's PCI-bus order) and otherwise
  the order in which gres.conf names the device files (``File=/dev/nvidia[0-7]``), NVML's too
  where the minor numbers follow the bus order, as they usually do. The job's ``--extra`` and
  ``--comment`` are ``SLURM_JOB_EXTRA`` and ``SLURM_JOB_COMMENT``, the node is ``SLURMD_NODENAME``.
* ``HealthCheckProgram`` is killed after ``HealthCheckTimeout`` (Slurm 26.05 and later; 60 s by
  default, and fixed at 60 s before) and also runs when slurmd starts, before the node
  has registered, when ``scontrol`` can hang (NHC issue #159): every call here has a timeout.
  It drains NHC-style: the reason prefix ``preflight:`` marks the drains it owns; it never
  overwrites a reason someone else set and resumes only nodes it drained.

This module is the one place besides ``preflight/sources`` that acts on the node (it runs
``scontrol``, writes the last-result file and sends syslog lines), like a source: checks never
call Slurm.
"""

from __future__ import annotations

import math
import os
import re
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from msgspec import Struct, field, structs

from preflight.config import (
    DEFAULT_CONFIG_PATH,
    ConfigError,
    SlurmSettings,
    healthcheck_budget_problem,
    salvage_slurm_settings,
    seconds_problem,
)
from preflight.exitcodes import ExitCode
from preflight.hostlist import HostlistError, expand
from preflight.model import Finding, Status
from preflight.probes.gpus import pci_device_key
from preflight.probes.job import SLUID, parse_gpu_indices
from preflight.slurm_conf import (
    DEFAULT_HEALTH_CHECK_TIMEOUT_S, KillTime, SlurmConf, find_named_slurm_conf, gpus_as_gres, script_kill_time,
)
from preflight.sources import NodeFS, SourceError

if TYPE_CHECKING:
    from preflight.run import OpenedNode

MODES = ("prolog", "epilog", "healthcheck")
RESULT_SCHEMA = "preflight-slurm-result/1"
#: Drain reasons preflight sets start with this; a reason that does not is someone else's.
REASON_PREFIX = "preflight:"
# Findings about room a running job's own use fills (the space its processes keep in /dev/shm,
# the ephemeral ports its connections hold): on a node running other jobs no run can tell them
# from a fault of the node, so they alone do not drain it there. The health check asks slurmctld
# whether the node runs jobs; the prolog and the epilog, which must not call Slurm on a clean run
# and run beside their own job, look for other jobs' cgroups (other_jobs_on_node). On a node
# running nothing else they are judged as found.
FILLED_BY_RUNNING_JOBS = {"VLLM001": "/dev/shm space", "SOCK005": "ephemeral ports"}
# Where slurmstepd keeps each running job's cgroup: under cgroup v2,
# <cgroup root>/<slice>/[<node>_]slurmstepd.scope/job_<id> (src/plugins/cgroup/v2/cgroup_v2.c; the
# slice is CgroupSlice, system.slice by default), or from Slurm 26.05 .../<SLUID> unless
# cgroup.conf has CgroupJobIdPaths=yes; under v1,
# <mount>/<controller>/slurm[_<node>]/uid_<uid>/job_<id> (v1/xcgroup.c, CgroupPrepend).
CGROUP_ROOT = "/sys/fs/cgroup"
CGROUP_V1_CONTROLLERS = ("freezer", "cpuset", "memory", "devices")
_JOB_CGROUP = re.compile(rf"^job_(\d{{1,10}})$|^({SLUID})$")
MAX_CGROUP_ENTRIES = 4096  # directory entries looked at per level: a huge tree stays bounded
#: sinfo -R shows reasons in a narrow column and slurmctld keeps them in its state file: stay short.
REASON_MAX = 160
#: The prolog and HealthCheckProgram environments have no PATH.
FALLBACK_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_GPU_SUBJECT = re.compile(r"^GPU(\d+)$")
# A GPU named by its PCI address ("GPU 0000:5d:00.0"; an Xid names the device: "GPU 0000:5d:00").
_GPU_ADDRESS_SUBJECT = re.compile(r"^GPU ([0-9a-fA-F:.]{7,20})$")
# syslog priorities (RFC 3164): facility daemon (3) * 8 + severity
SYSLOG_ERR, SYSLOG_NOTICE, SYSLOG_INFO = 3 * 8 + 3, 3 * 8 + 5, 3 * 8 + 6


class SlurmArgs(Struct, frozen=True):
    """Arguments of ``preflight slurm prolog|epilog|healthcheck``."""

    mode: str
    root: str = "/"
    config: str | None = None
    timeout: float | None = None  # overrides [slurm] timeout / healthcheck_timeout
    checks_dirs: tuple[str, ...] = ()


class JobScope(Struct, frozen=True):
    """What part of the node one job uses, from the prolog's environment."""

    job_id: str = ""  # "" for the healthcheck (no job)
    gpus: tuple[int, ...] | None = None  # SLURM_JOB_GPUS; None: no GPUs (CPU-only) or not a job
    gpus_text: str | None = None  # SLURM_JOB_GPUS (or the variable gpus_from names) as given; None when unset
    opted_out_by: str = ""  # "SLURM_JOB_COMMENT=preflight=off" when the job opted out
    ignore: tuple[str, ...] = ()  # reference tokens skipped for this job (CPU-only or one-node jobs)
    ignored_for: str = ""  # why: "no SLURM_JOB_GPUS" or "a one-node job"
    gpus_from: str = "SLURM_JOB_GPUS"  # CUDA_VISIBLE_DEVICES in the prolog and epilog of Slurm before 21.08

    def to_json(self) -> dict[str, Any]:
        return {
            "job_id": self.job_id,
            "gpus": None if self.gpus is None else list(self.gpus),
            "slurm_job_gpus": self.gpus_text,
            "gpus_from": self.gpus_from,
            "opted_out_by": self.opted_out_by,
            "ignored": list(self.ignore),
        }


class Verdict(Struct, frozen=True):
    """What the findings mean for the node under the site's drain policy."""

    drain: tuple[Finding, ...]  # present (or, fail-closed, unknown) at or above drain severity
    undecided: tuple[Finding, ...]  # unknown at or above drain severity, not draining
    out_of_scope: tuple[Finding, ...]  # about GPUs the job was not given

    @property
    def outcome(self) -> str:
        return "drain" if self.drain else "undecided" if self.undecided else "clean"


class CommandResult(Struct, frozen=True):
    """One bounded external command and how it ended."""

    argv: tuple[str, ...]
    status: str  # "ok", "failed", "timeout", "not-run"
    returncode: int | None = None
    output: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"argv": list(self.argv), "status": self.status, "returncode": self.returncode, "output": self.output}


class NodeState(Struct, frozen=True):
    """``scontrol show node -o NAME``: the node's state flags and reason."""

    state: str  # "IDLE+DRAIN", "DOWN*", "MIXED"...
    reason: str  # "" when none

    @property
    def drained(self) -> bool:
        return "DRAIN" in self.state

    @property
    def down(self) -> bool:
        return self.state.startswith("DOWN") or "+DOWN" in self.state

    @property
    def ours(self) -> bool:
        return self.reason.startswith(REASON_PREFIX)

    @property
    def runs_jobs(self) -> bool:
        """Allocated to jobs (``ALLOCATED``, ``MIXED``, also while draining) or finishing one."""
        base = re.sub(r"[^A-Z].*", "", self.state)
        return base in ("ALLOCATED", "MIXED") or "COMPLETING" in self.state

    @property
    def explained(self) -> bool:
        """Drained or down with a reason, anyone's."""
        return (self.drained or self.down) and bool(self.reason)

    @property
    def held_by_someone_else(self) -> bool:
        """Drained or down with a reason preflight did not set: never touch it."""
        return self.explained and not self.ours


# ---- pure logic: scope, opt-out, verdict, reason, parsing ----------------------------------------


def opt_out_source(environ: Mapping[str, str], settings: SlurmSettings) -> str:
    """``NAME=item`` for the variable whose comma/space-separated items include the opt-out
    token (``SLURM_JOB_EXTRA=foo=1,preflight=off``), else ""."""
    token = settings.opt_out.strip().lower()
    if not token:
        return ""
    for name in settings.opt_out_variables:
        items = re.split(r"[,;\s]+", environ.get(name, "").lower())
        if token in items:
            return f"{name}={settings.opt_out.strip()}"
    return ""


#: What older Slurm gives a prolog and an epilog instead of SLURM_JOB_GPUS.
PRE_21_08_GPUS = "CUDA_VISIBLE_DEVICES"


def job_scope(mode: str, environ: Mapping[str, str], settings: SlurmSettings) -> JobScope:
    """The job's part of the node (prolog, epilog) or the whole node (healthcheck)."""
    if mode == "healthcheck":
        return JobScope()
    job_id = environ.get("SLURM_JOB_ID", "")
    opted_out_by = opt_out_source(environ, settings)
    name, gpus_text = "SLURM_JOB_GPUS", environ.get("SLURM_JOB_GPUS")
    if (gpus_text is None or not gpus_text.strip()) and environ.get(PRE_21_08_GPUS, "").strip():
        # Slurm 19.05 to 21.07 gives the prolog, and every release before 21.08 the epilog, only
        # CUDA_VISIBLE_DEVICES: the same gres indices, or gres.conf's unique IDs (gres_gpu.c,
        # gres_p_epilog_set_env; SchedMD commit f6e8d16 put SLURM_JOB_GPUS back in 21.08).
        name, gpus_text = PRE_21_08_GPUS, environ[PRE_21_08_GPUS]
    if gpus_text is None or not gpus_text.strip():
        # A job without GPUs cannot be hurt by GPU, GPUDirect or RDMA misconfigurations (where the
        # cluster gives GPUs as GRES at all: _job_without_gpu_gres).
        return JobScope(job_id, None, gpus_text, opted_out_by, tuple(settings.cpu_job_ignore), "no SLURM_JOB_GPUS")
    # Unparsable (unique IDs too): judge every GPU rather than guess which are the job's.
    return JobScope(job_id, parse_gpu_indices(gpus_text), gpus_text, opted_out_by, *_gpu_job_ignore(environ, settings), gpus_from=name)


def _gpu_job_ignore(environ: Mapping[str, str], settings: SlurmSettings) -> tuple[tuple[str, ...], str]:
    """What a GPU job skips, and why: ``single_node_job_ignore`` for a job on one node."""
    if settings.single_node_job_ignore and _one_node(environ):
        return tuple(settings.single_node_job_ignore), "a one-node job"
    return (), ""


def _job_without_gpu_gres(session: _Session, found: tuple[SlurmConf | None, list[str]]) -> JobScope:
    """A job without ``SLURM_JOB_GPUS`` is a CPU job only where the cluster gives GPUs as GRES.
    Elsewhere (whole-node jobs on a cluster without ``GresTypes=gpu``) nothing says which GPUs it
    uses, so it is judged as a job that may use them all. Where slurm.conf could not say, the
    CPU-job skips stay, and the note says why."""
    scope = session.outcome.scope
    gres, shown = gpus_as_gres(found)
    if gres is False:
        session.outcome.notes.append(f"no SLURM_JOB_GPUS on a cluster that gives no GPUs as GRES ({shown}): judged as using every GPU")
        ignore, ignored_for = _gpu_job_ignore(session.environ, session.settings)
        return structs.replace(scope, ignore=ignore, ignored_for=ignored_for)
    if gres is None and scope.ignore:
        session.outcome.notes.append(f"no SLURM_JOB_GPUS, and whether the cluster gives GPUs as GRES is not known ({shown}): judged as a CPU job")
    return scope


def _one_node(environ: Mapping[str, str]) -> bool:
    """Whether SLURM_JOB_NODELIST names exactly one host; False when it is unset or unparsable,
    so nothing is skipped on a guess."""
    text = environ.get("SLURM_JOB_NODELIST", "").strip()
    if not text:
        return False
    try:
        return len(expand(text)) == 1
    except HostlistError:
        return False


GpuIndices = Mapping[tuple[int, int, int], int]  # PCI (domain, bus, device) -> NVML index


def gpu_indices(facts: Mapping[str, Any]) -> dict[tuple[int, int, int], int]:
    """The NVML index of each GPU by PCI address, from a report's ``gpus`` facts; empty when
    they are missing (NVML unavailable, the probe timed out): then a GPU named by its address
    counts for every job, as nothing says whose it is."""
    gpus = facts.get("gpus")
    devices = gpus.get("devices") if isinstance(gpus, dict) else None
    found: dict[tuple[int, int, int], int] = {}
    for device in devices if isinstance(devices, list) else ():
        index, bus_id = (device.get("index"), device.get("bus_id")) if isinstance(device, dict) else (None, None)
        key = pci_device_key(bus_id) if isinstance(bus_id, str) else None
        if isinstance(index, int) and key is not None:
            found[key] = index
    return found


def view_scope(scope: JobScope, facts: Mapping[str, Any]) -> JobScope:
    """The scope to judge a run's findings by. A prolog or epilog in the job's cgroup
    (PrologFlags=RunInJob, with ConstrainDevices) sees only the job's GPUs, and NVML numbers them
    from 0: every GPU NVML names there is the job's, whatever node indices SLURM_JOB_GPUS holds,
    so the GPU findings all count. Where a GPU is in MIG mode, Slurm makes each MIG instance one
    GPU GRES (gpu_nvml.c) and SLURM_JOB_GPUS numbers instances, not NVML's GPUs: which GPU is the
    job's is not known, and every GPU finding counts."""
    job, gpus = facts.get("job"), facts.get("gpus")
    in_job_cgroup = isinstance(job, dict) and bool(job.get("cgroup_job"))
    devices = gpus.get("devices") if isinstance(gpus, dict) else None
    on_bus = gpus.get("pci_gpus") if isinstance(gpus, dict) else None
    narrowed = isinstance(devices, list) and isinstance(on_bus, list) and len(devices) < len(on_bus)
    mig = isinstance(devices, list) and any(isinstance(device, dict) and device.get("mig") is True for device in devices)
    return structs.replace(scope, gpus=None) if (mig or (in_job_cgroup and narrowed)) and scope.gpus is not None else scope


def _gpu_of(subject: str, indices: GpuIndices) -> int | None:
    """The NVML index of the GPU a finding is about, None when it is about no one GPU."""
    match = _GPU_SUBJECT.match(subject)
    if match is not None:
        return int(match.group(1))
    match = _GPU_ADDRESS_SUBJECT.match(subject)
    key = pci_device_key(match.group(1)) if match is not None else None
    return indices.get(key) if key is not None else None


def in_scope(finding: Finding, scope: JobScope, indices: GpuIndices | None = None) -> bool:
    """Findings about one GPU, by index or by PCI address, count only when the job was given
    that GPU."""
    index = _gpu_of(finding.subject, indices or {})
    return scope.gpus is None or index is None or index in scope.gpus


def judge_findings(findings: Sequence[Finding], settings: SlurmSettings, scope: JobScope, indices: GpuIndices | None = None) -> Verdict:
    """Split findings into those that drain, those that leave the node undecided, and those about
    GPUs the job does not use. ``unknown`` drains only when the site chose fail-closed."""
    threshold = settings.drain_severity.rank
    drain, undecided, out_of_scope = [], [], []
    for finding in findings:
        if finding.status not in (Status.PRESENT, Status.UNKNOWN) or finding.severity.rank < threshold:
            continue
        if not in_scope(finding, scope, indices):
            out_of_scope.append(finding)
        elif finding.status is Status.PRESENT or settings.fail_closed:
            drain.append(finding)
        else:
            undecided.append(finding)
    return Verdict(tuple(drain), tuple(undecided), tuple(out_of_scope))


def sanitise_reason(text: str, limit: int = REASON_MAX) -> str:
    """One printable ASCII line without quotes or backslashes, at most ``limit`` characters."""
    text = re.sub(r"[^\x20-\x7e]|[\"'\\`]", " ", text)
    text = re.sub(r"\s+", " ", text).strip()
    return text if len(text) <= limit else text[: limit - 3].rstrip() + "..."


def drain_reason(findings: Sequence[Finding], mode: str, job_id: str = "", limit: int = REASON_MAX) -> str:
    """``preflight: MEM001,DNS001 memlock-limit-too-low on slurmd (prolog job 42)``: the reference
    IDs first, worst first, so that truncation keeps them."""
    ordered = sorted(findings, key=lambda f: (-f.severity.rank, f.status is not Status.PRESENT, f.reference_id))
    ids = list(dict.fromkeys(f.reference_id for f in ordered))
    context = f"({mode} job {job_id})" if job_id else f"({mode})"
    shown, rest = ids, list[str]()
    while len(f"{REASON_PREFIX} {','.join(shown)}{',+99' if rest else ''} {context}") > limit and len(shown) > 1:
        shown, rest = shown[:-1], [shown[-1], *rest]
    id_text = ",".join(shown) + (f",+{len(rest)}" if rest else "")
    first = ordered[0]
    what = first.symbol if first.status is Status.PRESENT else f"{first.symbol} unknown"
    detail = f"{what} on {first.subject}"
    room = limit - len(f"{REASON_PREFIX} {id_text}  {context}")
    if room < len(detail):
        detail = detail[: max(room - 3, 0)] + "..." if room > 8 else ""
    return sanitise_reason(" ".join(part for part in (REASON_PREFIX, id_text, detail, context) if part), limit)


# What scontrol prints after a reason in one-line mode (src/api/node_info.c): the reason's
# `` [user@time]`` when it has a time, then these optional fields.
_AFTER_REASON = re.compile(
    r"\s\[[^\[\]@\s]*@[^\[\]]*\]|\s(?:Comment|Extra|InstanceId|InstanceType|ReservationName|TLSCertTokenSet|Topology|Parameters)="
)


def parse_show_node(text: str) -> NodeState | None:
    """``scontrol show node -o NAME``: one line of ``Key=value`` pairs; the reason may contain
    spaces and ends at its `` [user@time]``, or at the next optional field."""
    line = next((line for line in text.splitlines() if "NodeName=" in line), "")
    state = re.search(r"(?:^|\s)State=(\S+)", line)
    if state is None:
        return None
    reason = ""
    found = re.search(r"(?:^|\s)Reason=(.*)$", line)
    if found:
        end = _AFTER_REASON.search(found.group(1))
        reason = found.group(1)[: end.start() if end else None].strip()
        reason = "" if reason == "(null)" else reason
    return NodeState(state.group(1), reason)


# ---- acting on the node: scontrol, syslog, the last-result file ---------------------------------


def resolve_program(program: str, environ: Mapping[str, str]) -> str:
    """An absolute path for ``program``: as given when absolute, else searched in PATH and the
    usual system directories (Slurm starts prologs without PATH)."""
    if program.startswith("/"):
        return program
    import shutil

    search = ":".join(part for part in (environ.get("PATH", ""), FALLBACK_PATH) if part)
    return shutil.which(program, path=search) or program


def run_command(argv: Sequence[str], timeout_s: float, environ: Mapping[str, str] | None = None) -> CommandResult:
    """Run one command with a timeout, never retried; its own failure is a result, not an error.
    ``environ`` replaces this process's environment for it."""
    import subprocess

    if timeout_s <= 0:
        return CommandResult(tuple(argv), "not-run", output="no time left in the run's budget")
    try:
        completed = subprocess.run(
            list(argv), stdin=subprocess.DEVNULL, capture_output=True, text=True, errors="replace",
            timeout=timeout_s, check=False, env=environ,
        )
    except subprocess.TimeoutExpired:
        return CommandResult(tuple(argv), "timeout", output=f"timed out after {timeout_s:.1f} s")
    except OSError as error:
        return CommandResult(tuple(argv), "failed", output=f"{type(error).__name__}: {error.strerror or error}")
    output = (completed.stdout + completed.stderr).strip()[-2000:]
    return CommandResult(tuple(argv), "ok" if completed.returncode == 0 else "failed", completed.returncode, output)


def send_syslog(socket_path: str, priority: int, message: str) -> None:
    """One RFC 3164 line to the local syslog socket; never blocks, never fails the run (no
    /dev/log in a container, a stuck journald)."""
    import socket

    data = f"<{priority}>preflight[{os.getpid()}]: {message}".encode("utf-8", "replace")[:2048]
    for kind in (socket.SOCK_DGRAM, socket.SOCK_STREAM):
        sock = socket.socket(socket.AF_UNIX, kind)
        try:
            sock.setblocking(False)
            sock.connect(socket_path)
            sock.send(data if kind == socket.SOCK_DGRAM else data + b"\0")
            return
        except OSError as error:
            if kind == socket.SOCK_DGRAM and error.errno == 91:  # EPROTOTYPE: a stream socket
                continue
            return
        finally:
            sock.close()


def write_atomically(path: str, text: str, mode: int = 0o600) -> str:
    """Replace ``path`` with ``text`` so that readers see the old or the new file, never half of
    one. Returns "" on success, else why it failed. The default mode 0600 keeps a last-result
    file root's alone: it names the previous job's user, comment and nodes."""
    temporary = f"{path}.{os.getpid()}.tmp"
    try:
        directory = os.path.dirname(path)
        if directory:
            os.makedirs(directory, mode=0o755, exist_ok=True)
        descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
            os.fchmod(handle.fileno(), mode)  # exactly this mode, whatever the umask
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except OSError as error:
        try:
            os.unlink(temporary)
        except OSError:
            pass
        return f"{path}: {error.strerror or error}"
    return ""


def node_name(settings: SlurmSettings, environ: Mapping[str, str]) -> str:
    """Slurm's name for this node: config, then ``SLURMD_NODENAME`` (set for prologs, epilogs
    and HealthCheckProgram), then the short host name."""
    if settings.node_name:
        return settings.node_name
    if environ.get("SLURMD_NODENAME"):
        return environ["SLURMD_NODENAME"]
    import socket

    return socket.gethostname().split(".")[0]


# ---- the commands ------------------------------------------------------------------------------


class _Outcome(Struct):
    """What one run did, for stdout, syslog and the last-result file."""

    mode: str
    node: str
    started_at: float
    verdict: str = "no-verdict"  # drain, clean, undecided, opted-out, no-verdict
    reason: str = ""
    message: str = ""
    exit_code: int = 0
    scope: JobScope = field(default_factory=JobScope)
    node_state: NodeState | None = None
    actions: list[CommandResult] = field(default_factory=list)
    report: dict[str, Any] | None = None
    errors: list[str] = field(default_factory=list)
    kill_time: KillTime | None = None  # when slurmd kills the run; None before it was read
    notes: list[str] = field(default_factory=list)  # what the run changed about itself (a cut budget)

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": RESULT_SCHEMA,
            "mode": self.mode,
            "node": self.node,
            "finished_at": round(time.time(), 3),
            "duration_s": round(time.time() - self.started_at, 3),
            "verdict": self.verdict,
            "reason": self.reason,
            "message": self.message,
            "exit_code": self.exit_code,
            "job": self.scope.to_json(),
            "node_state": None if self.node_state is None else {"state": self.node_state.state, "reason": self.node_state.reason},
            "actions": [action.to_json() for action in self.actions],
            "errors": self.errors,
            "kill_time": None if self.kill_time is None else self.kill_time._asdict(),
            "notes": self.notes,
            "report": self.report,
        }


class _Session:
    """One ``preflight slurm`` run: its settings, environment and budget."""

    def __init__(self, args: SlurmArgs, environ: Mapping[str, str], settings: SlurmSettings) -> None:
        self.args = args
        self.environ = environ
        self.settings = settings
        self.begin = time.monotonic()
        self.budget = args.timeout if args.timeout is not None else (
            settings.healthcheck_timeout_s if args.mode == "healthcheck" else settings.timeout_s
        )
        self.outcome = _Outcome(args.mode, node_name(settings, environ), time.time(), scope=job_scope(args.mode, environ, settings))
        self.slurm_conf = ""  # the slurm.conf scontrol is told (SLURM_CONF) where the run's environment names none

    def remaining(self) -> float:
        return self.budget - (time.monotonic() - self.begin)

    def fit_kill_time(self, found: tuple[SlurmConf | None, list[str]]) -> None:
        """slurmd kills a Prolog, Epilog or HealthCheckProgram that outlasts the node's limit
        (slurm.conf PrologTimeout, EpilogTimeout, PrologEpilogTimeout, HealthCheckTimeout): a
        killed prolog or epilog drains the node, a killed health check leaves no verdict. A budget
        that would not end :data:`STARTUP_MARGIN_S` before the limit is cut to end then, and the cut
        is noted."""
        limit = script_kill_time(found, self.args.mode)
        self.outcome.kill_time = limit
        if limit.seconds is None or self.budget + STARTUP_MARGIN_S <= limit.seconds:
            return
        # A limit too short for the margin still gets half its time for the checks.
        cut = limit.seconds - STARTUP_MARGIN_S if limit.seconds > 2 * STARTUP_MARGIN_S else limit.seconds / 2
        note = f"budget cut from {self.budget:g} s to {cut:g} s: slurmd kills the {self.args.mode} at {limit.seconds} s ({limit.source})"
        self.outcome.notes.append(note)
        self.log(SYSLOG_NOTICE, f"preflight: {note}")
        self.budget = cut

    def scontrol(self, *arguments: str) -> CommandResult:
        program = resolve_program(self.settings.scontrol, self.environ)
        environ = {**os.environ, "SLURM_CONF": self.slurm_conf} if self.slurm_conf else None
        result = run_command([program, *arguments], min(self.settings.scontrol_timeout_s, self.remaining()), environ)
        self.outcome.actions.append(result)
        return result

    def log(self, priority: int, message: str) -> None:
        if self.settings.syslog:
            send_syslog(self.settings.syslog_socket, priority, message)

    def finish(self) -> int:
        """Write the last-result file and return the exit code."""
        path = self.settings.last_result.replace("{mode}", self.args.mode)
        from preflight.reporters.json_report import dumps

        problem = write_atomically(path, dumps(self.outcome.to_json()) + "\n")
        if problem:
            print(f"preflight: cannot write the last-result file {problem}", file=sys.stderr)
        return self.outcome.exit_code


def run_slurm(args: SlurmArgs, environ: Mapping[str, str] | None = None) -> int:
    """``preflight slurm prolog|epilog|healthcheck``: returns the exit code, never raises.

    0: the job may run / nothing to drain (also when preflight itself could not decide: a broken
    config must not drain a fleet); 2: the node has findings that drain it (prolog and epilog
    then fail, which makes Slurm drain the node); 3 (healthcheck only): no verdict.
    """
    try:
        return _run_slurm(args, os.environ if environ is None else environ)
    except Exception as error:  # a bug before the session exists (its own setup) fails no job either
        print(f"preflight: no verdict ({args.mode}): internal error: {type(error).__name__}: {str(error)[:300]}", file=sys.stderr)
        return ExitCode.NO_VERDICT if args.mode == "healthcheck" else ExitCode.OK


def _run_slurm(args: SlurmArgs, environ: Mapping[str, str]) -> int:
    from preflight.catalogue import CatalogueError
    from preflight.registry import RegistrationError
    from preflight.run import UsageProblem, open_node
    from preflight.sources import RootError

    if args.mode not in MODES:
        print(f"preflight: error: unknown mode {args.mode!r}; choose one of {', '.join(MODES)}", file=sys.stderr)
        return ExitCode.NO_VERDICT
    try:
        if args.timeout is not None and seconds_problem(args.timeout):
            raise UsageProblem(f"--timeout {seconds_problem(args.timeout)}")
        # The same bound as [slurm] healthcheck_timeout; the node's own limit is applied below.
        problem = healthcheck_budget_problem(args.timeout) if args.mode == "healthcheck" and args.timeout else ""
        if problem:
            raise UsageProblem(f"--timeout {problem}")
        node = open_node(args.root, args.config)
        settings = node.config.slurm
    except (UsageProblem, RootError, ConfigError) as error:
        return _no_verdict(_Session(args, environ, trace_settings(args.config)), str(error))
    session = _Session(args, environ, settings)
    try:
        return _judge_node(session, node)
    except (UsageProblem, RegistrationError, CatalogueError) as error:
        return _no_verdict(session, str(error))
    except Exception as error:  # a bug in preflight must not fail jobs or drain nodes
        return _no_verdict(session, f"internal error: {type(error).__name__}: {error}")


def trace_settings(config_path: str | None) -> SlurmSettings:
    """Where a run that cannot decide (a wrong --root, a typo in the config) leaves its trace:
    the config's ``[slurm]`` keys that are valid on their own, the defaults for the rest."""
    try:
        text = NodeFS("/").read(os.path.abspath(config_path or DEFAULT_CONFIG_PATH), max_bytes=1024 * 1024)
    except SourceError:
        text = None
    return salvage_slurm_settings(text or "")


def _no_verdict(session: _Session, problem: str) -> int:
    outcome = session.outcome
    outcome.verdict, outcome.message = "no-verdict", f"preflight: no verdict ({session.args.mode}): {problem}"
    outcome.errors.append(problem)
    # A checker that cannot run must not fail jobs (a typo in the config would drain the fleet).
    # The line on stderr is what slurmd logs (at SlurmdDebug=debug2 for a prolog that exits 0).
    outcome.exit_code = ExitCode.NO_VERDICT if session.args.mode == "healthcheck" else ExitCode.OK
    print(outcome.message, file=sys.stderr)
    session.log(SYSLOG_ERR, outcome.message)
    return session.finish()


def _judge_node(session: _Session, node: OpenedNode) -> int:
    from preflight.run import inspect_node

    args, settings, outcome = session.args, session.settings, session.outcome
    scope = outcome.scope
    if scope.opted_out_by:
        outcome.verdict = "opted-out"
        outcome.message = f"preflight: skipped, job {scope.job_id or '?'} opted out ({scope.opted_out_by})"
        print(outcome.message)
        session.log(SYSLOG_INFO, outcome.message)
        return session.finish()

    found = find_named_slurm_conf(node.fs, session.environ)
    if not session.environ.get("SLURM_CONF", "").startswith("/") and found[0] is not None and os.path.realpath(session.args.root) == "/":
        # A health check runs with SLURMD_NODENAME alone: the file is the one slurmd reads, and
        # scontrol, whose compiled-in default may differ (Base Command Manager), is told it.
        session.slurm_conf = found[0].path
    session.fit_kill_time(found)
    if args.mode != "healthcheck" and not (scope.gpus_text or "").strip():
        scope = outcome.scope = _job_without_gpu_gres(session, found)
    profile = {"prolog": "prolog", "epilog": settings.epilog_profile, "healthcheck": "full"}[args.mode]
    # The scontrol calls this run may make get their time before the checks do.
    calls = (1 if args.mode == "prolog" else 2) if settings.drain else 0
    check_budget = max(session.remaining() - calls * settings.scontrol_timeout_s - 0.2, 0.5)
    report = inspect_node(node, profile=profile, timeout_s=check_budget, ignore=scope.ignore, checks_dirs=args.checks_dirs, apart=True)
    outcome.report = report.to_json()
    verdict = judge_findings(report.findings, settings, view_scope(scope, report.facts), gpu_indices(report.facts))
    outcome.verdict = verdict.outcome
    if verdict.drain:
        outcome.reason = drain_reason(verdict.drain, args.mode, scope.job_id)
        outcome.exit_code = ExitCode.ERROR
    filled = _filled_by_jobs(verdict) if args.mode != "healthcheck" else []
    others = other_jobs_on_node(node.fs, scope.job_id, session.environ.get("SLURM_JOB_SLUID", "").strip()) if filled else None
    if args.mode == "healthcheck":
        _healthcheck_actions(session, verdict)
    elif others:
        outcome.verdict, outcome.exit_code, outcome.reason = "undecided", ExitCode.OK, ""
        listed = ", ".join(others[:8]) + (f" and {len(others) - 8} more" if len(others) > 8 else "")
        outcome.message = (
            f"preflight: {outcome.node} also runs job(s) {listed}, whose own use may fill {', '.join(filled)}: "
            f"not drained ({args.mode} job {scope.job_id or '?'})"
        )
        session.log(SYSLOG_NOTICE, outcome.message)
    elif verdict.drain:
        outcome.message = outcome.reason
        if settings.drain:
            _drain_for_job(session)
        session.log(SYSLOG_ERR, _with_actions(outcome))
    else:
        outcome.message = _summary(outcome, report.findings, verdict, report.duration_s)
    print(outcome.message)
    return session.finish()


def other_jobs_on_node(fs: NodeFS, own_job: str, own_sluid: str = "") -> tuple[str, ...] | None:
    """The IDs (or SLUIDs) of the Slurm jobs other than ``own_job`` (``own_sluid``) with a cgroup
    on this node, from the tree slurmstepd keeps (``CGROUP_ROOT``); None where no slurmstepd tree
    was found (no cgroup plugin, cgroup unreadable, a recorded root without it): then nobody can say."""
    found: set[str] = set()
    tree_seen = False
    for slice_name in _entries(fs, CGROUP_ROOT, lambda name: name.endswith(".slice")):
        for scope in _entries(fs, f"{CGROUP_ROOT}/{slice_name}", lambda name: name.endswith("slurmstepd.scope")):
            tree_seen = True
            found.update(_job_ids(fs, f"{CGROUP_ROOT}/{slice_name}/{scope}"))
    for controller in CGROUP_V1_CONTROLLERS:
        base = f"{CGROUP_ROOT}/{controller}"
        for prefix in _entries(fs, base, lambda name: name == "slurm" or name.startswith("slurm_")):
            tree_seen = True
            for user in _entries(fs, f"{base}/{prefix}", lambda name: name.startswith("uid_")):
                found.update(_job_ids(fs, f"{base}/{prefix}/{user}"))
    if not tree_seen:
        return None
    return tuple(sorted(found - {own_job, own_sluid}, key=lambda job: (not job.isdigit(), job.zfill(10))))


def _entries(fs: NodeFS, path: str, wanted: Callable[[str], bool]) -> list[str]:
    """The names in ``path`` that ``wanted`` accepts, at most MAX_CGROUP_ENTRIES looked at; none
    where the directory cannot be read."""
    try:
        names = fs.listdir(path) or []
    except SourceError:
        return []
    return [name for name in names[:MAX_CGROUP_ENTRIES] if wanted(name)]


def _job_ids(fs: NodeFS, path: str) -> set[str]:
    return {found.group(1) or found.group(2) for name in _entries(fs, path, lambda name: name[:1] in "js") if (found := _JOB_CGROUP.match(name))}


def _filled_by_jobs(verdict: Verdict) -> list[str]:
    """``VLLM001 (/dev/shm space)``, ...: what the drain findings are, when every one of them is
    room a running job's own use may fill; empty when any is not."""
    if not verdict.drain or not all(
        finding.status is Status.PRESENT and finding.reference_id in FILLED_BY_RUNNING_JOBS for finding in verdict.drain
    ):
        return []
    return sorted({f"{finding.reference_id} ({FILLED_BY_RUNNING_JOBS[finding.reference_id]})" for finding in verdict.drain})


def _summary(outcome: _Outcome, findings: Sequence[Finding], verdict: Verdict, seconds: float) -> str:
    present = sum(1 for f in findings if f.status is Status.PRESENT)
    unknown = sum(1 for f in findings if f.status is Status.UNKNOWN)
    job = f" job {outcome.scope.job_id}" if outcome.scope.job_id else ""
    extra = f"; {len(verdict.out_of_scope)} about GPUs outside the job" if verdict.out_of_scope else ""
    if outcome.scope.ignore:
        extra += f"; skipped for {outcome.scope.ignored_for or 'this job'}: {', '.join(outcome.scope.ignore)}"
    return (
        f"preflight ok ({outcome.mode}{job}): {len(findings)} findings, {present} present (none drains), "
        f"{unknown} unknown{extra}, {seconds:.2f} s"
    )


def _with_actions(outcome: _Outcome) -> str:
    done = [f"{action.argv[1] if len(action.argv) > 1 else action.argv[0]} {action.status}" for action in outcome.actions]
    return outcome.message + (f" [scontrol {', '.join(done)}]" if done else "")


def _read_node_state(session: _Session) -> tuple[NodeState | None, CommandResult]:
    """``scontrol show node -o``: None when the state cannot be read (not registered yet, the
    controller unreachable, an unknown node name)."""
    shown = session.scontrol("show", "node", "-o", session.outcome.node)
    state = parse_show_node(shown.output) if shown.status == "ok" else None
    session.outcome.node_state = state
    return state, shown


def _drain_for_job(session: _Session) -> None:
    """The prolog's and the epilog's drain call. The epilog first reads the node: after a failed
    prolog (the job never ran) or an operator's drain, the reason already there is the one that
    explains the node, and Slurm keeps it when the epilog then fails."""
    outcome = session.outcome
    if session.args.mode == "epilog":
        state, _ = _read_node_state(session)
        if state is not None and state.explained:
            outcome.message = f"{outcome.reason} (node already {state.state} with reason {state.reason!r}; kept)"
            return
    session.scontrol("update", f"NodeName={outcome.node}", "State=DRAIN", f"Reason={outcome.reason}")


def describe_unknowns(findings: Sequence[Finding], limit: int = 4) -> str:
    """``GPU001 gpu-unusable-by-driver on node (probe gpus: timed out after 3.0 s), ...``: the
    findings still unknown, worst first, with why: what keeps a node from being decided."""
    worst_first = sorted(findings, key=lambda f: (-f.severity.rank, f.reference_id, f.subject))
    shown = [
        f"{f.reference_id} {f.symbol} on {f.subject}" + (f" ({sanitise_reason(f.reason, 80)})" if f.reason else "")
        for f in worst_first[:limit]
    ]
    return ", ".join(shown) + (f" and {len(findings) - limit} more" if len(findings) > limit else "")


def _healthcheck_actions(session: _Session, verdict: Verdict) -> None:
    """Drain or resume the node NHC-style, owning only reasons that start with ``preflight:``."""
    settings, outcome = session.settings, session.outcome
    node = outcome.node
    if not settings.drain:
        outcome.message = outcome.reason or f"preflight ok (healthcheck): {verdict.outcome}"
        return
    state, shown = _read_node_state(session)
    if state is None:
        # Not registered yet (first run at slurmd start), controller unreachable, unknown node:
        # leave the node alone rather than guess whose reason is there.
        why = shown.output.splitlines()[0] if shown.output else shown.status
        outcome.message = f"{outcome.reason or 'preflight: ' + verdict.outcome} (node state unreadable: {why}; left alone)"
        session.log(SYSLOG_ERR if verdict.drain else SYSLOG_INFO, outcome.message)
        return
    what = _filled_by_jobs(verdict)
    if what and state.runs_jobs:
        outcome.verdict, outcome.exit_code, outcome.reason = "undecided", ExitCode.OK, ""
        outcome.message = (
            f"preflight: {node} runs jobs ({state.state}), whose own use may fill {', '.join(what)}: not drained; "
            "judged again when it is idle"
        )
        session.log(SYSLOG_NOTICE, outcome.message)
        return
    if verdict.drain:
        if state.held_by_someone_else:
            outcome.message = f"{outcome.reason} (node already {state.state} with reason {state.reason!r}; left alone)"
        elif state.drained and state.reason == outcome.reason:
            outcome.message = f"{outcome.reason} (already drained with this reason)"
        else:
            session.scontrol("update", f"NodeName={node}", "State=DRAIN", f"Reason={outcome.reason}")
            outcome.message = outcome.reason
        session.log(SYSLOG_ERR, _with_actions(outcome))
        return
    if verdict.outcome == "clean" and state.drained and state.ours:
        result = session.scontrol("update", f"NodeName={node}", "State=RESUME")
        outcome.message = f"preflight: resumed {node} (was {state.reason!r}): {result.status}"
        session.log(SYSLOG_NOTICE, outcome.message)
        return
    if verdict.outcome == "undecided" and state.drained and state.ours:
        # Resuming needs every drain-severity finding decided: say which ones are not.
        outcome.message = (
            f"preflight: {node} stays drained ({state.reason!r}) while unknown: {describe_unknowns(verdict.undecided)}"
        )
        session.log(SYSLOG_NOTICE, outcome.message)
        return
    undecided = f" ({describe_unknowns(verdict.undecided)})" if verdict.undecided else ""
    outcome.message = f"preflight ok (healthcheck): {verdict.outcome}{undecided}, node {state.state}" + (
        f" with reason {state.reason!r}" if state.reason else ""
    ) + ("; not preflight's reason, left alone" if state.held_by_someone_else else "")


# ---- preflight slurm config --------------------------------------------------------------------


def preflight_program() -> str:
    """The installed ``preflight`` script that is running now, for the wrappers to exec."""
    argv0 = os.path.abspath(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    if os.path.basename(argv0) == "preflight":
        return argv0
    import shutil

    return shutil.which("preflight") or f"{sys.executable} -m preflight"


#: Slurm's default MessageTimeout (slurm.conf(5)).
SLURM_MESSAGE_TIMEOUT_S = 10
#: Between the end of preflight's budget and Slurm's kill: interpreter start and imports before
#: the budget starts (about 0.2 s on the 2-core development machine), writing the result file
#: after it, and room for a loaded node.
STARTUP_MARGIN_S = 2.0


def prolog_epilog_timeout(settings: SlurmSettings) -> int:
    """``PrologEpilogTimeout``: the prolog/epilog budget plus the start-up margin, whole seconds."""
    return math.ceil(settings.timeout_s + STARTUP_MARGIN_S)


def prolog_timeout_problem(settings: SlurmSettings, message_timeout_s: int) -> str:
    """Why ``[slurm] timeout`` cannot be covered ("" when it can). slurm.conf(5) expects a Prolog
    to complete in less time than MessageTimeout, so PrologEpilogTimeout stays within it; a
    budget it cannot cover would have Slurm kill the prolog before it writes its verdict."""
    needed = prolog_epilog_timeout(settings)
    if needed <= message_timeout_s:
        return ""
    problem = (
        f"[slurm] timeout = {settings.timeout_s:g} needs PrologEpilogTimeout={needed} ({STARTUP_MARGIN_S:g} s more, to start "
        f"and write the result), above MessageTimeout={message_timeout_s}, within which slurm.conf(5) expects a Prolog "
        "to finish: "
    )
    fits = message_timeout_s - STARTUP_MARGIN_S
    if fits <= 0:
        return problem + f"no prolog budget fits in a MessageTimeout of {STARTUP_MARGIN_S:g} s or less; raise the cluster's MessageTimeout"
    # The budget must also hold two scontrol calls ([slurm] scontrol_timeout; config.py's rule).
    scontrol = "" if settings.scontrol_timeout_s * 2 < fits else f" and [slurm] scontrol_timeout below {fits / 2:g}"
    return problem + f"set [slurm] timeout to {fits:g} or less{scontrol}, or give the cluster's MessageTimeout with --message-timeout"


def _kept(existing: SlurmConf | None, key: str, ours: str) -> list[str]:
    """``key=ours``, or, where the node's slurm.conf already sets ``key`` to something else (LBNL
    NHC as HealthCheckProgram, a site Prolog), that line commented out with why: included after
    it, ours would silently win (the last assignment does) and switch the site's off."""
    setting = existing.settings.get(key.lower()) if existing is not None else None
    if setting is None or setting.value == ours:
        return [f"{key}={ours}"]
    return [
        f"# {setting.where} already sets {setting.key}={setting.value}: ours would replace it. Call preflight",
        f"# from it instead (docs/operators/slurm.md), or uncomment this to replace it:",
        f"#{key}={ours}",
    ]


def _merged_flags(existing: SlurmConf | None) -> str:
    """PrologFlags with Alloc added to the node's own (Contain, X11...): one line replaces them all."""
    setting = existing.settings.get("prologflags") if existing is not None else None
    flags = [flag for flag in (setting.value.split(",") if setting is not None else []) if flag.strip()]
    if not any(flag.strip().lower() == "alloc" for flag in flags):
        flags.append("Alloc")
    return "PrologFlags=" + ",".join(flag.strip() for flag in flags)


def slurm_conf_lines(
    settings: SlurmSettings, wrapper_dir: str = "/etc/slurm", interval_s: int = 300,
    message_timeout_s: int = SLURM_MESSAGE_TIMEOUT_S, existing: SlurmConf | None = None,
) -> str:
    """The slurm.conf lines, nothing else: the output can be included from slurm.conf as it is.
    ``existing``: the node's slurm.conf, whose own Prolog, Epilog, HealthCheckProgram and
    PrologFlags the lines keep. Call :func:`prolog_timeout_problem` first."""
    health = _kept(existing, "HealthCheckProgram", f"{wrapper_dir}/preflight-healthcheck")
    health_lines = [f"HealthCheckInterval={interval_s}", "HealthCheckNodeState=ANY", *healthcheck_timeout_lines(settings)]
    if len(health) > 1:  # the site's own health check stays: so do its interval and node states
        health_lines = [line if line.startswith("#") else f"#{line}" for line in health_lines]
    return "\n".join([
        "# slurm.conf lines for preflight (generated by `preflight slurm config`).",
        *_kept(existing, "Prolog", f"{wrapper_dir}/preflight-prolog"),
        *_kept(existing, "Epilog", f"{wrapper_dir}/preflight-epilog"),
        "# Run the prolog when the job is allocated, before any step starts on the node.",
        _merged_flags(existing),
        f"# Slurm kills Prolog and Epilog after this: preflight's budget of {settings.timeout_s:g} s ([slurm] timeout,",
        f"# scontrol included) plus {STARTUP_MARGIN_S:g} s to start and write its result, within MessageTimeout",
        f"# ({message_timeout_s} s), which slurm.conf(5) expects a Prolog to finish in.",
        f"PrologEpilogTimeout={prolog_epilog_timeout(settings)}",
        *health,
        *health_lines,
        "# When the prolog fails, the node drains (with preflight's reason) and slurmctld",
        "# requeues a batch job held: squeue shows \"launch failed requeued held\" until",
        "# `scontrol release JOBID`. srun and salloc jobs are cancelled. To requeue batch jobs",
        "# without the hold, so that they start on another node, add nohold_on_prolog_fail to",
        "# the cluster's SchedulerParameters (one comma-separated line):",
        "#SchedulerParameters=nohold_on_prolog_fail",
        "",
    ])


def printed_healthcheck_timeout(settings: SlurmSettings) -> int | None:
    """The ``HealthCheckTimeout`` the health check's budget needs, only where that is more than
    slurmd's default 60 s (slurmd before 26.05 refuse the key, and kill at 60 s whatever it says)."""
    needed = math.ceil(settings.healthcheck_timeout_s + STARTUP_MARGIN_S)
    return needed if needed > DEFAULT_HEALTH_CHECK_TIMEOUT_S else None


def healthcheck_timeout_lines(settings: SlurmSettings) -> list[str]:
    """The ``HealthCheckTimeout`` line and its comment, where :func:`printed_healthcheck_timeout`
    gives one."""
    needed = printed_healthcheck_timeout(settings)
    if needed is None:
        return []
    return [
        f"# slurmd kills HealthCheckProgram after this: preflight's budget of {settings.healthcheck_timeout_s:g} s",
        f"# ([slurm] healthcheck_timeout) plus {STARTUP_MARGIN_S:g} s. Slurm 26.05 and later only: earlier slurmd refuse",
        f"# this key and kill at {DEFAULT_HEALTH_CHECK_TIMEOUT_S} s, where the health check cuts its budget to "
        f"{DEFAULT_HEALTH_CHECK_TIMEOUT_S - STARTUP_MARGIN_S:g} s.",
        f"HealthCheckTimeout={needed}",
    ]


def wrapper_scripts(program: str, wrapper_dir: str = "/etc/slurm", config: str | None = None) -> dict[str, str]:
    """Path -> text of the three wrappers: Slurm runs Prolog, Epilog and HealthCheckProgram
    without arguments (and prologs without PATH), so each mode gets an absolute ``exec``."""
    import shlex

    config_arg = f" --config {shlex.quote(config)}" if config else ""
    return {
        f"{wrapper_dir}/preflight-{mode}": (
            f"#!/bin/sh\n# Slurm {mode} wrapper, generated by `preflight slurm config`\n"
            f"exec {program} slurm {mode}{config_arg}\n"
        )
        for mode in MODES
    }


def commented_wrappers(wrappers: Mapping[str, str]) -> str:
    """The wrappers as slurm.conf comments, each after a ``# ---- PATH`` line: the whole output of
    ``preflight slurm config`` stays loadable, and ``sed -n 's/^# //p'`` between two markers
    recovers a script."""
    lines = [
        "",
        "# Wrapper scripts: install each root-owned, mode 0755, on every node (or let",
        "# `preflight slurm config --wrapper-dir DIR` write them).",
    ]
    for path, text in wrappers.items():
        lines += [f"# ---- {path}", *(f"# {line}" for line in text.splitlines())]
    return "\n".join(lines) + "\n"


def wrapper_dir_problem(directory: str) -> str:
    """Why the wrappers cannot be written to ``directory`` ("" when they can)."""
    if directory.startswith("/") and os.path.isdir(directory):
        return ""
    return f"--wrapper-dir {directory}: must be an existing directory, as an absolute path"


def write_wrappers(wrappers: Mapping[str, str]) -> str:
    """Write each wrapper atomically, mode 0755; "" on success, else the first failure."""
    for path, text in wrappers.items():
        problem = write_atomically(path, text, mode=0o755)
        if problem:
            return f"cannot write {problem}"
    return ""
