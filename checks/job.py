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
"""

from __future__ import annotations


from preflight.model import Unknown
from preflight.records import frozen
from preflight.registry import probe
from preflight.sources import NodeFS, SourceError
from preflight.sources.fs import FileUser

SYSTEM_NCCL_CONF = "/etc/nccl.conf"
# Only variables that steer communication are kept: reports travel to fleet dashboards and bug
# trackers, and a job environment can hold tokens and passwords.
KEPT_PREFIXES = ("NCCL_", "SLURM_", "CUDA_", "TORCH_", "TORCHELASTIC_", "GLOO_", "UCX_", "FI_", "OMPI_", "PMIX_", "NVSHMEM_", "GDRCOPY_")
KEPT_NAMES = frozenset({
    "HOME", "USER", "LD_LIBRARY_PATH", "LD_PRELOAD",
    # torch.distributed's env:// rendezvous, and what torchrun adds for each worker
    "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    # the job's Python environment, where its frameworks and NCCL wheel live
    "VIRTUAL_ENV", "CONDA_PREFIX",
})


@frozen
class Setting:
    """The value NCCL would see for one variable, and where it came from."""

    value: str
    origin: str  # "environment" or the configuration file's path


@frozen
class NcclConfFile:
    path: str
    entries: tuple[tuple[str, str], ...]  # (name, value) in file order; names untrimmed
    error: str = ""  # why the file could not be read, "" when it was read


@frozen
class JobFacts:
    """The job environment and NCCL's configuration files."""

    environ: dict[str, str]  # /proc/self/environ, communication-related variables only
    environ_error: str  # why /proc/self/environ could not be read, "" when it was read
    nccl_conf_files: tuple[NcclConfFile, ...]  # in NCCL's precedence order
    # Whose rights files the environment names are read with (another user's job, seen by a
    # prolog running as root): SLURM_JOB_UID, SLURM_JOB_GID and the user's groups in /etc/group.
    file_user: FileUser | None = None

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
    def in_slurm_job(self) -> bool:
        return "SLURM_JOB_ID" in self.environ


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


def parse_nccl_conf(text: str) -> tuple[tuple[str, str], ...]:
    """``NAME=value`` lines as NCCL reads them: no trimming, ``#`` lines and lines without ``=``
    ignored, values cut at 1023 characters (NCCL's buffer)."""
    entries = []
    for line in text.split("\n"):
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
    if not uid.isdigit():
        return None
    gids = [int(environ["SLURM_JOB_GID"])] if environ.get("SLURM_JOB_GID", "").isdigit() else []
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
    return JobFacts(environ, "", tuple(files), user)
