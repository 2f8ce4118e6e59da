"""The job's view of its settings: environment and NCCL configuration files.

Sources:

* ``/proc/self/environ`` (NUL-separated ``NAME=value``): the job environment. Live, this is the
  environment preflight was started with (a Slurm prolog gets the job's ``SLURM_*`` variables);
  in a recorded root it is the environment recorded with the node.
* NCCL configuration files as NCCL reads them (``src/misc/param.cc``): ``$NCCL_CONF_FILE`` if set,
  else ``$HOME/.nccl.conf``; then ``/etc/nccl.conf``. Each line is ``NAME=value``; ``#`` starts a
  comment line; there is no whitespace trimming, so ``NCCL_X = 1`` defines ``"NCCL_X "``.
  NCCL applies them with ``setenv(..., 0)``: the environment wins, then the first file, then
  ``/etc/nccl.conf``.


How the job is launched: torch.distributed's variables against Slurm's view of the tasks
(references TORCH004, TORCH010) and a forced NCCL algorithm at the job's size (NCCL015).

Sources: the job environment (``preflight.probes.job``; ``/proc/self/environ``, so these checks
see the job's variables when preflight runs inside a job step, e.g. ``srun preflight node``;
a Slurm prolog sees none of them and the checks are not applicable there) and NCCL's
configuration files for ``NCCL_ALGO``.

* torch.distributed's ``env://`` rendezvous reads ``MASTER_ADDR``, ``MASTER_PORT`` (an integer
  port), ``WORLD_SIZE`` and ``RANK`` (``torch/distributed/rendezvous.py``); torchrun sets them per
  worker with ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK`` and ``TORCHELASTIC_RUN_ID``.
* Slurm describes the step's tasks (srun(1), "OUTPUT ENVIRONMENT VARIABLES"): ``SLURM_PROCID``
  (global task rank), ``SLURM_LOCALID`` (rank on the node), ``SLURM_STEP_NUM_TASKS`` /
  ``SLURM_NTASKS``, ``SLURM_STEP_NUM_NODES`` / ``SLURM_JOB_NUM_NODES``, ``SLURM_NTASKS_PER_NODE``;
  ``SLURM_STEP_ID`` is set only inside a step, where those numbers describe tasks actually started;
  the batch script and an salloc shell get it too (-5 and -6), and stand for the whole job.
* ``NCCL_ALGO`` (``src/graph/tuning.cc`` ``parseList``): ``;``-separated entries, only the first
  without a ``function:`` prefix; each a ``,``-separated list of algorithms, ``^`` negating it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from msgspec import Struct

from preflight.hostlist import expand
from preflight.model import Evidence, NotApplicable, Unknown
from preflight.registry import probe
from preflight.sources import NodeFS, SourceError
from preflight.sources.fs import FileUser
from preflight.units import is_number

SYSTEM_NCCL_CONF = "/etc/nccl.conf"

#: SLURM_SCRIPT_CONTEXT of the scripts slurmd runs itself (Slurm's prolog/epilog guide): they get
#: slurmd's environment and limits plus the job's SLURM_* variables, never what the job exports.
SLURMD_SCRIPT_CONTEXTS = frozenset({"prolog_slurmd", "epilog_slurmd"})


# Only variables that steer communication are kept: reports travel to fleet dashboards and bug
# trackers, and a job environment can hold tokens and passwords.
# PET_: torchrun's arguments as environment variables (PET_NNODES, PET_RDZV_ENDPOINT), which
# Kubeflow's training operator sets instead of MASTER_ADDR for its PyTorchJobs
KEPT_PREFIXES = ("NCCL_", "SLURM_", "CUDA_", "TORCH_", "TORCHELASTIC_", "GLOO_", "UCX_", "FI_", "OMPI_", "PMIX_", "NVSHMEM_", "GDRCOPY_", "PET_")


KEPT_NAMES = frozenset({
    "HOME", "USER", "LD_LIBRARY_PATH", "LD_PRELOAD",
    # torch.distributed's env:// rendezvous, and what torchrun adds for each worker
    "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    # the job's Python environment, where its frameworks and NCCL wheel live (PYTHONPATH: where
    # EasyBuild's and Spack's modules put theirs)
    "VIRTUAL_ENV", "CONDA_PREFIX", "PYTHONPATH",
    # the job's python, where no environment is activated (Ray's images put theirs on PATH)
    "PATH",
    # torch.distributed's choice of TCPStore server for env:// and tcp:// (torch/distributed/rendezvous.py)
    "USE_LIBUV",
    # fixed GID indexes of RDMA libraries that run beside NCCL (NVSHMEM_ is kept by prefix)
    "MC_GID_INDEX", "MSCCLPP_IB_GID_INDEX", "UCCL_IB_GID_INDEX", "UCCL_P2P_RDMA_GID_INDEX",
    # the verbs providers libibverbs loads besides those /etc/libibverbs.d names (rdma-core)
    "RDMAV_DRIVERS", "IBV_DRIVERS",
    # the rank MPICH's Hydra and Intel MPI give each process they start (OMPI_ and PMIX_ are kept by
    # prefix), and the ranks on its node (Hydra's MPI_LOCALNRANKS)
    "PMI_RANK", "PMI_SIZE", "MPI_LOCALNRANKS",
    # DeepSpeed's launcher: its nodes (CROSS_SIZE) and the ranks on this one (LOCAL_SIZE)
    "CROSS_SIZE", "LOCAL_SIZE",
})


#: What a launcher sets in each rank it starts: Open MPI (mpirun, the MPI Operator's MPIJob),
#: PMIx (prterun, srun --mpi=pmix), MPICH's Hydra and Intel MPI (PMI), torchrun's elastic agent.
LAUNCHED_RANK_NAMES = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "TORCHELASTIC_RUN_ID")
#: (all ranks, ranks on this node) as launchers name them: torchrun and torch.distributed's env://,
#: DeepSpeed's launcher, Open MPI (mpirun, docs.open-mpi.org "Environment variables"), MPICH's
#: Hydra and Intel MPI.
RANK_COUNTS = (
    ("WORLD_SIZE", "LOCAL_WORLD_SIZE"), ("WORLD_SIZE", "LOCAL_SIZE"),
    ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"), ("PMI_SIZE", "MPI_LOCALNRANKS"),
)
#: The names a job's world size goes by, one launcher each.
WORLD_SIZES = tuple(dict.fromkeys(world for world, _ in RANK_COUNTS))
#: torch.distributed's env:// rendezvous, which a rank needs all of: a Kubernetes PyTorchJob
#: sets them in every pod without any launcher above.
ENV_RENDEZVOUS_NAMES = ("MASTER_ADDR", "RANK", "WORLD_SIZE")


#: Where a job's ranks meet, by precedence: torch.distributed's env:// MASTER_ADDR, else the
#: rendezvous endpoint torchrun takes from Kubeflow's training operator for an elastic job
#: ("host[:port]"), else the master address it passes for a static one.
RENDEZVOUS_HOSTS = ("MASTER_ADDR", "PET_RDZV_ENDPOINT", "PET_MASTER_ADDR")


def rendezvous_endpoint(environ: Mapping[str, str]) -> tuple[str, str]:
    """The host and the port text ("" when it names none) of torchrun's ``PET_RDZV_ENDPOINT``,
    ``host[:port]`` or ``[IPv6 address]:port``, as torch's ``parse_rendezvous_endpoint`` splits it;
    ("", "") where it is unset."""
    value = environ.get("PET_RDZV_ENDPOINT", "").strip()
    if value.startswith("["):
        host, _, rest = value[1:].partition("]")
        return host, rest[1:] if rest.startswith(":") else ""
    if value.count(":") == 1:
        host, _, port = value.partition(":")
        return host, port
    return value, ""  # a bare host name, or an IPv6 address without brackets (no port)


def rendezvous_host(environ: Mapping[str, str]) -> tuple[str, str]:
    """(host, the variable that names it) of the job's rendezvous; ("", "") without one."""
    for name in RENDEZVOUS_HOSTS:
        value = rendezvous_endpoint(environ)[0] if name == "PET_RDZV_ENDPOINT" else environ.get(name, "").strip()
        if value:
            return value, name
    return "", ""


def in_job_process(environ: dict[str, str]) -> bool:
    """Whether a process with this environment is one of a job's own: a Slurm job step or task, or
    a rank an MPI launcher, torchrun or torch.distributed's env:// rendezvous started. Not a script
    slurmd runs for the job (prolog, epilog) nor a process outside any job (a shell, a health check)."""
    if environ.get("SLURM_SCRIPT_CONTEXT", "") in SLURMD_SCRIPT_CONTEXTS:
        return False
    return (
        "SLURM_JOB_ID" in environ
        or any(name in environ for name in LAUNCHED_RANK_NAMES)
        or all(name in environ for name in ENV_RENDEZVOUS_NAMES)
    )


class Setting(Struct, frozen=True):
    """The value NCCL would see for one variable, and where it came from."""

    value: str
    origin: str  # "environment" or the configuration file's path


class NcclConfFile(Struct, frozen=True):
    path: str
    entries: tuple[tuple[str, str], ...]  # (name, value) in file order; names untrimmed
    error: str = ""  # why the file could not be read, "" when it was read


class JobFacts(Struct, frozen=True):
    """The job environment and NCCL's configuration files."""

    environ: dict[str, str]  # /proc/self/environ, communication-related variables only
    environ_error: str  # why /proc/self/environ could not be read, "" when it was read
    nccl_conf_files: tuple[NcclConfFile, ...]  # in NCCL's precedence order
    # Whose rights files the environment names are read with (another user's job, seen by a
    # prolog running as root): SLURM_JOB_UID, SLURM_JOB_GID and the user's groups in /etc/group.
    file_user: FileUser | None = None
    # The Slurm job whose cgroup holds this process ("job_<id>" or its SLUID, from /proc/self/cgroup):
    # with PrologFlags=RunInJob the prolog and epilog run in the job's extern step, where
    # ConstrainDevices shows them only the job's GPUs. "": in no job's cgroup; None: not read.
    cgroup_job: str | None = None
    # The job step whose cgroup holds this process ("step_0", "step_batch", "step_extern"...), ""
    # in none, None not read: a task of a step is the job's own even where its environment was
    # emptied (an Apptainer container started with --cleanenv or --containall)
    cgroup_step: str | None = None

    def nccl(self, name: str) -> Setting | None:
        """What NCCL would use for ``name``: the environment first, then the files in order.
        Raises Unknown when a file that could set it could not be read (root-squashed NFS
        homes, a broken recording): "unset" would be a guess."""
        if name in self.environ:
            return Setting(self.environ[name], "environment")
        for conf in self.nccl_conf_files:
            if conf.error:
                raise Unknown(f"{name}: {conf.path} could not be read ({conf.error}) and may set it")
            for key, value in conf.entries:
                if key == name:
                    return Setting(value, conf.path)
        return None

    @property
    def in_slurmd_script(self) -> bool:
        """Run by slurmd itself (a prolog or epilog): this environment and these limits are
        slurmd's, not those of the job's processes."""
        return self.environ.get("SLURM_SCRIPT_CONTEXT", "") in SLURMD_SCRIPT_CONTEXTS

    @property
    def in_job_process(self) -> bool:
        """This process is one of the job's: its environment and limits are those its ranks get.
        By its environment, or by its cgroup: a task of one of the job's steps (not the extern
        step, where pam_slurm_adopt puts ssh sessions and RunInJob its prolog)."""
        return in_job_process(self.environ) or (task_step(self.cgroup_step) and not self.in_slurmd_script)

    def nothing_to_judge(self, names: str, default: str, *, conf_files: bool = True) -> NotApplicable:
        """For a check whose misconfiguration is a setting the job makes, when the job does not
        make it: ``names`` were not set (where they were looked for is added), ``default`` is what
        applies instead. A prolog cannot see what the job exports, and says so."""
        places = "the environment" + (" or NCCL's configuration files" if conf_files else "")
        unseen = "; a script slurmd runs (prolog, epilog) does not see the variables a job exports" if self.in_slurmd_script else ""
        return NotApplicable(f"{names} not set in {places} ({default}){unseen}")


def parse_environ(data: bytes) -> dict[str, str]:
    """``/proc/<pid>/environ``: NUL-separated ``NAME=value`` pairs, communication-related names
    only; later duplicates win."""
    environ = {}
    for item in data.split(b"\0"):
        if b"=" not in item:
            continue
        name, _, value = item.partition(b"=")
        key = name.decode("utf-8", "replace")
        if key in KEPT_NAMES or key.startswith(KEPT_PREFIXES):
            environ[key] = value.decode("utf-8", "replace")
    return environ


#: Directories of a job's LD_LIBRARY_PATH looked in: real ones hold a few dozen; a recorded root
#: whose environment lists thousands cannot turn each probe into thousands of directory reads.
MAX_LIBRARY_PATH_DIRS = 64


def library_path_dirs(environ: dict[str, str]) -> list[str]:
    """The absolute directories of ``LD_LIBRARY_PATH``, in order, once each, at most
    :data:`MAX_LIBRARY_PATH_DIRS` (a relative entry names a directory of the job's working
    directory, which preflight does not share)."""
    return list(dict.fromkeys(d for d in environ.get("LD_LIBRARY_PATH", "").split(":") if d.startswith("/")))[:MAX_LIBRARY_PATH_DIRS]


def parse_nccl_conf(text: str) -> tuple[tuple[str, str], ...]:
    """``NAME=value`` lines as NCCL reads them: no trimming but of one line end (``\\n``, then a
    ``\\r`` before it: a file saved with Windows line ends), ``#`` lines and lines without ``=``
    ignored, values cut at 1023 characters (NCCL's buffer)."""
    entries = []
    for line in text.split("\n"):
        line = line[:-1] if line.endswith("\r") else line
        if line.startswith("#") or "=" not in line:
            continue
        name, _, value = line.partition("=")
        entries.append((name, value[:1023]))
    return tuple(entries)


def _read_conf(fs: NodeFS, path: str, user: FileUser | None) -> NcclConfFile | None:
    try:
        text = fs.read_for(path, user, max_bytes=1024 * 1024)
    except SourceError as error:
        return NcclConfFile(path, (), error.reason)
    return None if text is None else NcclConfFile(path, parse_nccl_conf(text))


def parse_group_membership(text: str, user: str) -> tuple[int, ...]:
    """Gids of ``/etc/group`` entries that list ``user`` as a member."""
    gids = []
    for line in text.splitlines():
        fields = line.split(":")
        if len(fields) == 4 and user in fields[3].split(","):
            try:
                gids.append(int(fields[2]))
            except ValueError:
                continue
    return tuple(gids)


def job_file_user(fs: NodeFS, environ: dict[str, str]) -> FileUser | None:
    """The user a Slurm job runs as (``SLURM_JOB_UID``, ``SLURM_JOB_GID``, and the groups that
    ``/etc/group`` lists ``SLURM_JOB_USER`` in); None outside a job (the environment is then
    preflight's own). Groups that cannot be read are left out: a permission they would grant
    is then refused, never assumed."""
    uid = environ.get("SLURM_JOB_UID", "")
    if not is_number(uid):
        return None
    gids = [int(environ["SLURM_JOB_GID"])] if is_number(environ.get("SLURM_JOB_GID", "")) else []
    user = environ.get("SLURM_JOB_USER", "")
    if user:
        try:
            gids += parse_group_membership(fs.read("/etc/group") or "", user)
        except SourceError:
            pass
    return FileUser(int(uid), tuple(dict.fromkeys(gids)))


@probe("job")
def probe_job(fs: NodeFS) -> JobFacts:
    """Read the job environment and the NCCL configuration files it selects.

    Raises SourceError when the environment cannot be read: every NCCL setting, and which
    files NCCL reads, is unknown then, and reporting them as unset would judge a node NCCL sees
    otherwise. An unreadable configuration file only makes the settings it might hold unknown
    (:meth:`JobFacts.nccl`)."""
    environ = parse_environ(fs.read_bytes("/proc/self/environ") or b"")
    user = job_file_user(fs, environ)
    user_file = environ.get("NCCL_CONF_FILE") or (
        f"{environ['HOME'].rstrip('/')}/.nccl.conf" if environ.get("HOME", "").startswith("/") else ""
    )
    files = []
    for path, reader in ((user_file, user), (SYSTEM_NCCL_CONF, None)):
        if path.startswith("/"):
            conf = _read_conf(fs, path, reader)
            if conf is not None:
                files.append(conf)
    return JobFacts(environ, "", tuple(files), user, *cgroup_step_of(fs))


# Slurm's cgroup paths: v1 ".../slurm/uid_<uid>/job_<id>/step_<step>", v2
# ".../slurmstepd.scope/job_<id>/step_<step>/..."; from 26.05 v2 names the job directory by its
# SLUID ("s" and 13 base-32 characters) unless CgroupJobIdPaths=yes (src/plugins/cgroup/v1/
# xcgroup.c, v2/cgroup_v2.c, cgroup.conf(5)); the prolog gets it as SLURM_JOB_SLUID.
SLUID = r"s[0-9A-Z]{13}"
_CGROUP_JOB = re.compile(rf"/(job_\d+|{SLUID})/(step_[A-Za-z0-9_]{{1,32}})")


def cgroup_step_of(fs: NodeFS) -> tuple[str | None, str | None]:
    """(the job, its step) whose cgroup holds this process, from /proc/self/cgroup: ("", "") in
    none, (None, None) when it could not be read."""
    try:
        text = fs.read("/proc/self/cgroup", max_bytes=64 * 1024)
    except SourceError:
        return None, None
    if text is None:
        return None, None
    match = _CGROUP_JOB.search(text)
    return (match.group(1), match.group(2)) if match else ("", "")


def task_step(step: str | None) -> bool:
    """A step whose processes are the job's tasks: a numbered step, the batch step, an interactive
    one; not the extern step, which holds adopted ssh sessions and a RunInJob prolog."""
    return bool(step) and step != "step_extern"


class SlurmView(Struct, frozen=True):
    """What Slurm says about this task and its step; None where a variable is unset or garbled."""

    in_step: bool  # an srun step (SLURM_STEP_ID, not the batch or interactive step): the task numbers describe started tasks
    procid: int | None
    localid: int | None
    ntasks: int | None  # the step's tasks (SLURM_STEP_NUM_TASKS), else the job's (SLURM_NTASKS)
    nnodes: int | None  # the step's nodes, else the job's
    nodelist: tuple[str, ...]  # SLURM_JOB_NODELIST expanded


def parse_gpu_indices(text: str) -> tuple[int, ...] | None:
    """``SLURM_JOB_GPUS`` ("0,1,3"; Slurm also writes ranges "0-3" in some versions) -> indices,
    or None when it is not such a list."""
    indices: list[int] = []
    for item in text.split(","):
        item = item.strip()
        low, dash, high = item.partition("-")
        if is_number(low) and (not dash or is_number(high)):
            end = int(high) if dash else int(low)
            if end < int(low) or end - int(low) > 4096:
                return None
            indices.extend(range(int(low), end + 1))
        else:
            return None
    return tuple(sorted(set(indices)))


def integer_setting(environ: dict[str, str], *names: str) -> int | None:
    for name in names:
        value = environ.get(name, "").strip()
        if is_number(value):
            return int(value)
    return None


def operator_nodes(environ: Mapping[str, str]) -> int | None:
    """The most nodes of a Kubeflow PyTorchJob: the training operator passes torchrun's --nnodes
    as PET_NNODES, "N" or "MIN:MAX" (torch/distributed/run.py, parse_min_max_nnodes)."""
    most = environ.get("PET_NNODES", "").rsplit(":", 1)[-1].strip()
    return int(most) if is_number(most) and int(most) > 0 else None


#: The step ids of the batch script, the extern step and an salloc shell's interactive step
#: (SLURM_BATCH_SCRIPT, SLURM_EXTERN_CONT, SLURM_INTERACTIVE_STEP in slurm.h), as setup_env
#: prints them into SLURM_STEP_ID (signed, since Slurm 20.11) and unsigned: none is an srun step.
_WHOLE_JOB_STEPS = frozenset({"-4", "-5", "-6", "4294967292", "4294967291", "4294967290"})


def in_srun_step(environ: Mapping[str, str]) -> bool:
    """Whether this process is a task of an srun step, whose own node and task counts are the
    ones that meet; the batch script and an salloc shell stand for the whole job."""
    value = environ.get("SLURM_STEP_ID", "").strip()
    return bool(value) and value not in _WHOLE_JOB_STEPS


def slurm_view(job: JobFacts) -> SlurmView:
    environ = job.environ
    try:
        nodes = tuple(expand(environ["SLURM_JOB_NODELIST"])) if environ.get("SLURM_JOB_NODELIST") else ()
    except ValueError:
        nodes = ()
    return SlurmView(
        in_step=in_srun_step(environ),
        procid=integer_setting(environ, "SLURM_PROCID"),
        localid=integer_setting(environ, "SLURM_LOCALID"),
        ntasks=integer_setting(environ, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"),
        nnodes=integer_setting(environ, "SLURM_STEP_NUM_NODES", "SLURM_JOB_NUM_NODES", "SLURM_NNODES") or (len(nodes) or None),
        nodelist=nodes,
    )


def job_ranks(job: JobFacts) -> tuple[int, Evidence] | None:
    """A lower bound of the connections the job's store must hold, with where it was read: the
    largest of WORLD_SIZE (or an MPI launcher's world size), Slurm's task count and its node count
    (torchrun runs one agent per node and then nproc_per_node ranks, so Slurm's numbers can only
    undercount)."""
    environ, view = job.environ, slurm_view(job)
    bounds: list[tuple[int, Evidence]] = []
    for name in WORLD_SIZES:  # torch's env://, Open MPI's mpirun, MPICH's Hydra (and Intel MPI)
        if ranks := integer_setting(environ, name):
            bounds.append((ranks, Evidence(f"/proc/self/environ {name}", repr(environ[name]))))
    if view.ntasks:
        name = "SLURM_STEP_NUM_TASKS" if integer_setting(environ, "SLURM_STEP_NUM_TASKS") else "SLURM_NTASKS"
        bounds.append((view.ntasks, Evidence(f"/proc/self/environ {name}", repr(environ[name]))))
    if view.nnodes:
        bounds.append((view.nnodes, Evidence("/proc/self/environ SLURM_JOB_NODELIST / SLURM_*_NUM_NODES", f"{view.nnodes} nodes")))
    # torchrun's --nnodes and --nproc-per-node as Kubeflow's training operator passes them: the
    # most nodes ("N" or "MIN:MAX") times the ranks on each
    nodes, per_node = operator_nodes(environ), integer_setting(environ, "PET_NPROC_PER_NODE")
    if nodes and per_node:
        shown = f"PET_NNODES={environ['PET_NNODES']}, PET_NPROC_PER_NODE={per_node}"
        bounds.append((nodes * per_node, Evidence("/proc/self/environ PET_NNODES x PET_NPROC_PER_NODE", shown)))
    return max(bounds, key=lambda bound: bound[0]) if bounds else None


def switched_off(job: JobFacts, name: str) -> Setting | None:
    """The setting when it is 0 (NCCL reads these as integers: "0" switches the feature off)."""
    setting = job.nccl(name)
    return setting if setting is not None and setting.value.strip() == "0" else None


def named_net_plugin(job: JobFacts) -> Setting | None:
    """NCCL_NET_PLUGIN when it names a network plugin for NCCL to load ("none" and "" load none;
    src/plugin/net.cc): where that plugin loads, its transport, not NCCL's own, carries the data."""
    setting = job.nccl("NCCL_NET_PLUGIN")
    return setting if setting is not None and setting.value.strip().lower() not in ("", "none") else None


def setting_evidence(job: JobFacts, name: str, expected: str = "") -> Evidence:
    """Evidence for the value NCCL would see for ``name``, naming where it was set."""
    setting = job.nccl(name)
    if setting is None:
        return Evidence(name, "unset", expected)
    where = "/proc/self/environ" if setting.origin == "environment" else setting.origin
    return Evidence(f"{where} {name}", repr(setting.value), expected)
