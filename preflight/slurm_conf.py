"""slurm.conf as Slurm itself reads it, for the settings the probes judge.

Slurm's parser (``src/common/parse_config.c``, ``read_config.c``) decides what a setting is, so
this follows it rather than reading ``Key=value`` lines naively:

* a line ending in an odd number of backslashes continues on the next one (the backslash goes);
* ``#`` starts a comment unless escaped (``\\#``); then ``\\x`` becomes ``x``;
* a line holds one ``Key=value`` (the value quoted when it has spaces); keys ignore case, and
  the last assignment wins;
* ``Include PATH`` (any case) reads another file in place: a relative path is taken from the
  directory of the slurm.conf being read, ``%c`` is the cluster name in lower case, and a path
  with ``*`` is skipped, as Slurm skips it.

Which file: ``$SLURM_CONF`` (slurmd sets it for prologs, epilogs and job steps), else the file
slurmd itself was told (its ``-f``, else its own ``SLURM_CONF``: a health check gets neither),
else the copy slurmd keeps in configless mode (``/run/slurm/conf``, a link into its spool
directory's conf-cache, which slurmd makes only when it fetched its configuration from
slurmctld: ``_handle_slash_run`` in slurmd.c; a slurmd started with ``--conf-server`` ignores any
local file, so a left-over /etc/slurm/slurm.conf is not what its jobs get), else the packaged
default (``/etc/slurm/slurm.conf``, Debian's older ``/etc/slurm-llnl``). Where slurmd runs and
none is found, the settings are unknown. An Include that cannot be read leaves every setting
undecided: what it would have said may override anything read before or after it. Work is
bounded: at most :data:`MAX_FILES` files, each read through the node view (inside the root,
size-capped).
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Callable, Iterator, Mapping
from typing import NamedTuple

from preflight.config import MAX_SCRIPT_TIMEOUT_S
from preflight.probes.job import job_file_user, parse_environ
from preflight.probing import FactReader
from preflight.sources.fs import NodeFS, SourceError
from preflight.units import is_number

SLURM_CONF_PATHS = ("/run/slurm/conf/slurm.conf", "/etc/slurm/slurm.conf", "/etc/slurm-llnl/slurm.conf")
MAX_FILES = 32  # slurm.conf and the files it includes, nested or not
MAX_UNREAD = 8  # Include failures kept: the first one decides, the rest only explain it
DEFAULT_PROPAGATION = "(neither PropagateResourceLimits nor PropagateResourceLimitsExcept set: ALL)"

_KEY_VALUE = re.compile(r'\s*([A-Za-z0-9_.]+)\s*[-*+/]?=\s*(?:"([^"]*)"|(\S+))(?:\s|$)')
_INCLUDE = re.compile(r"(?i)include\s+(\S+)")

#: Reads one file of the node: its text, None when it is not there; SourceError when unreadable.
Reader = Callable[[str], "str | None"]


class Setting(NamedTuple):
    key: str  # as written
    value: str
    where: str  # path:line


class SlurmConf(NamedTuple):
    path: str  # the slurm.conf read
    settings: dict[str, Setting]  # lower-case key -> the assignment that wins
    unread: tuple[str, ...]  # Include lines whose file could not be read, with the reason


def logical_lines(text: str) -> Iterator[tuple[int, str]]:
    """``(first line number, line)`` after continuations, comments and escapes, as Slurm's
    ``_get_next_line`` makes them; blank lines are left out."""
    pending: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), 1):
        if not pending:
            start = number
        line = _without_comment(raw)
        stripped = line.rstrip()
        trailing = len(stripped) - len(stripped.rstrip("\\"))
        if trailing % 2 == 1:
            pending.append(stripped[:-1])
            continue
        pending.append(line)
        joined = _unescape("".join(pending))
        pending = []
        if joined.strip():
            yield start, joined
    if pending and (joined := _unescape("".join(pending))).strip():
        yield start, joined


def _without_comment(line: str) -> str:
    backslashes = 0
    for index, char in enumerate(line):
        if char == "#" and backslashes % 2 == 0:
            return line[:index]
        backslashes = backslashes + 1 if char == "\\" else 0
    return line


def _unescape(line: str) -> str:
    return re.sub(r"\\(.)", r"\1", line)


def read_slurm_conf(read: Reader, path: str) -> SlurmConf | None:
    """The settings of the slurm.conf at ``path`` and the files it includes; None when ``path``
    is not there (SourceError when it cannot be read)."""
    text = read(path)
    if text is None:
        return None
    settings: dict[str, Setting] = {}
    unread: list[str] = []
    budget = [MAX_FILES - 1]
    _read_into(read, path, text, posixpath.dirname(path), settings, unread, budget)
    return SlurmConf(path, settings, tuple(unread))


def _read_into(
    read: Reader, path: str, text: str, base: str, settings: dict[str, Setting], unread: list[str], budget: list[int],
) -> None:
    for number, line in logical_lines(text):
        include = _INCLUDE.match(line.lstrip())
        if include:
            _include(read, include.group(1), f"{path}:{number}", base, settings, unread, budget)
            continue
        match = _KEY_VALUE.match(line)
        if match:
            value = match.group(2) if match.group(2) is not None else match.group(3)
            settings[match.group(1).lower()] = Setting(match.group(1), value, f"{path}:{number}")


def _include(
    read: Reader, target: str, where: str, base: str, settings: dict[str, Setting], unread: list[str], budget: list[int],
) -> None:
    if len(unread) >= MAX_UNREAD:
        return  # undecided already; a file of a million failing Include lines stays cheap
    if "%c" in target:
        cluster = settings.get("clustername")
        if cluster is None:
            unread.append(f"{where}: Include {target}: no ClusterName before it for %c")
            return
        target = target.replace("%c", cluster.value.lower())
    if "*" in target:
        return  # Slurm does not expand globs: it logs an error and reads nothing
    path = posixpath.normpath(target if target.startswith("/") else posixpath.join(base, target))
    if budget[0] <= 0:
        unread.append(f"{where}: Include {target}: more than {MAX_FILES} files (an include loop?)")
        return
    budget[0] -= 1
    try:
        text = read(path)
    except SourceError as error:
        unread.append(f"{where}: Include {target}: {error}")
        return
    if text is None:
        unread.append(f"{where}: Include {target}: {path} is not there")
        return
    _read_into(read, path, text, base, settings, unread, budget)


def find_slurm_conf(read: Reader, override: str = "", read_override: Reader | None = None) -> tuple[SlurmConf | None, list[str]]:
    """The slurm.conf Slurm would read (``$SLURM_CONF`` as ``override``, read with
    ``read_override`` when the job names it), and the problems met on the way."""
    problems: list[str] = []
    candidates = [(override, read_override or read)] if override.startswith("/") else []
    for path, reader in candidates + [(path, read) for path in SLURM_CONF_PATHS]:
        try:
            conf = read_slurm_conf(reader, path)
        except SourceError as error:
            problems.append(str(error))
            continue
        if conf is not None:
            return conf, problems
    return None, problems


def find_job_slurm_conf(fs: NodeFS, slurmd_pid: int | None = None) -> tuple[SlurmConf | None, list[str]]:
    """:func:`find_slurm_conf` for the environment preflight runs in (``/proc/self/environ``: a
    prolog's or a job step's, where Slurm sets ``$SLURM_CONF``). ``$SLURM_CONF`` is the job's to
    name, so it and what it includes are read with the job user's rights. Without it (a health
    check, which slurmd starts with SLURMD_NODENAME alone; cron; an operator's shell) the file is
    the one slurmd itself reads (:func:`slurmd_conf`); ``slurmd_pid`` saves a second search for it."""
    try:
        environ = parse_environ(fs.read_bytes("/proc/self/environ") or b"")
    except SourceError:
        environ = {}  # the job probe reports an unreadable environment
    if environ.get("SLURM_CONF", "").startswith("/"):
        user = job_file_user(fs, environ)
        return find_slurm_conf(fs.read, environ["SLURM_CONF"], lambda path: fs.read_for(path, user))
    return find_node_slurm_conf(fs, slurmd_pid)


def find_named_slurm_conf(fs: NodeFS, environ: Mapping[str, str]) -> tuple[SlurmConf | None, list[str]]:
    """The slurm.conf for a process of this node's own (a health check, ``preflight slurm
    config`` in an admin's shell): the one ``environ``'s ``$SLURM_CONF`` names, else slurmd's."""
    named = environ.get("SLURM_CONF", "")
    return find_slurm_conf(fs.read, named) if named.startswith("/") else find_node_slurm_conf(fs)


def find_node_slurm_conf(fs: NodeFS, slurmd_pid: int | None = None) -> tuple[SlurmConf | None, list[str]]:
    """The slurm.conf slurmd reads: the file its ``-f`` or ``$SLURM_CONF`` names (Base Command
    Manager sets SLURM_CONF in slurmd's unit and keeps the file under /cm/shared), else the first
    of :data:`SLURM_CONF_PATHS` there. Where slurmd runs and reads a file preflight did not find
    (a compiled-in default such as /usr/local/etc/slurm.conf; a named file not there), that is a
    problem, so what the file says is unknown rather than unset."""
    pid = slurmd_pid if slurmd_pid is not None else find_slurmd(FactReader(fs))
    named = slurmd_conf(fs, pid) if pid is not None else SlurmdConf("", "")
    if not named.path:
        conf, problems = find_slurm_conf(fs.read)
        if conf is None and pid is not None:
            unread = f"; its environment, which may name another, is unread ({named.unread})" if named.unread else ""
            problems.append(f"{SLURMD_CONF_UNFOUND}: slurmd (pid {pid}) runs, and none of {', '.join(SLURM_CONF_PATHS)} is there{unread}")
        return conf, problems
    try:
        conf = read_slurm_conf(fs.read, named.path)
    except SourceError as error:
        return None, [f"{SLURMD_CONF_UNFOUND}: slurmd reads {named.path} ({named.source}): {error}"]
    if conf is None:
        return None, [f"{SLURMD_CONF_UNFOUND}: slurmd reads {named.path} ({named.source}), which is not there"]
    return conf, []


#: The subject of the problem "slurmd runs and its slurm.conf was not found".
SLURMD_CONF_UNFOUND = "slurm.conf"


class SlurmdConf(NamedTuple):
    path: str  # the file slurmd was told to read; "" when it was told none
    source: str  # where that was read: "/proc/<pid>/cmdline (-f)", "/proc/<pid>/environ (SLURM_CONF)"
    unread: str = ""  # why slurmd's environment could not be read ("" when it was)


#: slurmd's short options that take a value (its getopt string "bcCd:Df:F::GhL:Mn:N:svVZ"; F's
#: value is optional and so only ever attached) and its long options that take one (slurmd.c).
_SHORT_WITH_VALUE = frozenset("dfLnN")
_LONG_WITH_VALUE = frozenset({"ca-cert-file", "conf", "conf-server", "extra", "instance-id", "instance-type", "parameters"})


def slurmd_conf_option(cmdline: bytes) -> str | None:
    """The file slurmd's ``-f`` names in its NUL-separated command line, by getopt's rules
    (``-f FILE``, ``-fFILE``, ``-Df FILE``; the last one wins); None without one."""
    args = cmdline.decode("utf-8", "surrogateescape").split("\0")
    found, index = None, 1
    while index < len(args):
        arg, index = args[index], index + 1
        if arg == "--":
            break
        if arg.startswith("--"):
            name, equals, _ = arg[2:].partition("=")
            index += 1 if name in _LONG_WITH_VALUE and not equals else 0
            continue
        for position in range(1, len(arg) if arg.startswith("-") else 0):
            letter = arg[position]
            if letter == "F":
                break
            if letter in _SHORT_WITH_VALUE:
                value = arg[position + 1:]
                if not value and index < len(args):
                    value, index = args[index], index + 1
                found = value if letter == "f" else found
                break
    return found


def slurmd_conf(fs: NodeFS, pid: int) -> SlurmdConf:
    """What slurmd ``pid`` was told to read, by its own precedence (slurmd.c,
    ``_slurm_conf_file_exists``): ``-f``, then ``$SLURM_CONF``. Another process's environment is
    root's to read; unread, the path stays "" and says why."""
    try:
        option = slurmd_conf_option(fs.read_bytes(f"/proc/{pid}/cmdline") or b"")
    except SourceError:
        option = None  # a command line hides nothing from root; without root the environment decides below
    if option:
        return SlurmdConf(option, f"/proc/{pid}/cmdline (-f)")
    try:
        environ = parse_environ(fs.read_bytes(f"/proc/{pid}/environ") or b"")
    except SourceError as error:
        return SlurmdConf("", "", f"environment is unread ({error})")
    path = environ.get("SLURM_CONF", "")
    return SlurmdConf(path if path.startswith("/") else "", f"/proc/{pid}/environ (SLURM_CONF)")


def find_slurmd(reader: FactReader) -> int | None:
    """slurmd's pid: from its pid file (``SlurmdPidFile``'s defaults), else a scan of
    ``/proc/*/comm``; None when it does not run (or /proc is unlisted, which is in the problems)."""
    for pid_file in ("/run/slurmd.pid", "/var/run/slurmd.pid"):
        text = reader.text(pid_file)
        if text is None:
            continue  # not there: the older location may hold it
        if is_number(text.strip()):
            pid = int(text.strip())
            if (reader.text(f"/proc/{pid}/comm") or "").strip() == "slurmd":
                return pid
        break  # /var/run is a link to /run on current distributions: the same file, read once
    for entry in reader.listing("/proc") or []:  # unlisted: the problem makes slurmd undecided
        if is_number(entry):
            try:
                comm = reader.fs.read(f"/proc/{entry}/comm")
            except SourceError:
                continue  # processes come and go, and hidepid hides others
            if (comm or "").strip() == "slurmd" and _runs_as_root(reader, entry):
                return int(entry)
    return None


def _runs_as_root(reader: FactReader, pid: str) -> bool:
    """A process any user can start and name ``slurmd`` is no evidence of slurmd's limits or
    files: only one running as root (real uid 0 in ``/proc/<pid>/status``) is taken for it."""
    try:
        status = reader.fs.read(f"/proc/{pid}/status")
    except SourceError:
        return False
    uid = next((line.split()[1:2] for line in (status or "").splitlines() if line.startswith("Uid:")), [])
    return uid == ["0"]


def propagated(conf: SlurmConf, limit: str) -> tuple[bool | None, str]:
    """Whether slurmd hands the submitting shell's ``limit`` (``MEMLOCK``, ``STACK``) to the job's
    tasks (slurm.conf(5), PropagateResourceLimits[Except]), and the setting that decides it.
    None while an Include could not be read."""
    if conf.unread:
        return None, f"{conf.unread[0]}; it may set PropagateResourceLimits"
    for key, keeps in (("propagateresourcelimitsexcept", False), ("propagateresourcelimits", True)):
        setting = conf.settings.get(key)
        if setting is not None:
            names = {item.strip().upper() for item in setting.value.split(",")}
            named = bool(names & {limit.upper(), "ALL"})
            shown = f"{setting.key}={setting.value}" + ("" if setting.where.startswith(conf.path + ":") else f" ({setting.where})")
            return named == keeps, shown
    return True, DEFAULT_PROPAGATION


#: slurmd's HealthCheckProgram limit when slurm.conf does not set one: fixed before Slurm 26.05,
#: the default of ``HealthCheckTimeout`` since (``DEFAULT_HEALTH_CHECK_TIMEOUT``, slurm.conf(5)).
DEFAULT_HEALTH_CHECK_TIMEOUT_S = 60
#: The keys that limit each script, the first one set winning (``read_config.c``): PrologTimeout
#: and EpilogTimeout (Slurm 25.05) before PrologEpilogTimeout; HealthCheckTimeout (26.05). A
#: slurmd older than a key refuses a slurm.conf that sets it, so a key set speaks for its slurmd.
SCRIPT_TIMEOUT_KEYS = {
    "prolog": ("PrologTimeout", "PrologEpilogTimeout"),
    "epilog": ("EpilogTimeout", "PrologEpilogTimeout"),
    "healthcheck": ("HealthCheckTimeout",),
}


class KillTime(NamedTuple):
    """When slurmd kills a Prolog, Epilog or HealthCheckProgram, and what says so."""

    seconds: int | None  # None: slurmd waits for it as long as it runs
    source: str  # the setting read, or why Slurm's default is assumed


def script_kill_time(found: tuple[SlurmConf | None, list[str]], mode: str) -> KillTime:
    """When slurmd kills the ``mode`` script (prolog, epilog, healthcheck), from what
    :func:`find_slurm_conf` found: the run's ``max_wait`` (``prep_script_slurmd.c``,
    ``slurmd.c``). Without a key set, slurmd waits for a Prolog or Epilog and kills
    HealthCheckProgram at 60 s. A value is read as ``s_p_handle_uint16`` reads it (``strtoul`` with
    base 0); slurmd resets a HealthCheckTimeout of 0 to its default."""
    keys = SCRIPT_TIMEOUT_KEYS[mode]
    default = DEFAULT_HEALTH_CHECK_TIMEOUT_S if mode == "healthcheck" else None
    assumed = f"Slurm's default ({f'{default} s' if default else 'no limit'})"
    conf, problems = found
    if conf is None:
        return KillTime(default, f"{problems[0] if problems else 'no slurm.conf found'}: {assumed} assumed")
    setting = next((conf.settings[key.lower()] for key in keys if key.lower() in conf.settings), None)
    if setting is None:
        either = " or ".join(keys)
        if conf.unread:
            return KillTime(default, f"{conf.unread[0]}; it may set {either}: {assumed} assumed")
        unset = f"neither {keys[0]} nor {keys[1]} set" if len(keys) > 1 else f"{keys[0]} not set"
        return KillTime(default, f"{unset} in {conf.path}: {assumed}")
    shown = f"{setting.key}={setting.value} ({setting.where})"
    seconds = _slurm_uint16(setting.value)
    if seconds is None or (seconds == 0 and mode == "healthcheck"):
        return KillTime(default, f"{shown} is not a limit slurmd keeps: {assumed}")
    if seconds == 0:
        return KillTime(None, f"{shown}: no limit")  # run_command waits without end for max_wait <= 0
    return KillTime(seconds, shown)


def gpus_as_gres(found: tuple[SlurmConf | None, list[str]]) -> tuple[bool | None, str]:
    """Whether the cluster can give a job GPUs as GRES (``GresTypes`` names ``gpu``; Slurm sets
    ``SLURM_JOB_GPUS`` only for those), and the setting that says so; None when no slurm.conf was
    read or an Include that could set it was not."""
    conf, problems = found
    if conf is None:
        return None, problems[0] if problems else "no slurm.conf found"
    setting = conf.settings.get("grestypes")
    if setting is not None:
        shown = f"{setting.key}={setting.value} ({setting.where})"
        return "gpu" in {name.strip().lower() for name in setting.value.split(",")}, shown
    if conf.unread:
        return None, f"{conf.unread[0]}; it may set GresTypes"
    return False, f"GresTypes not set in {conf.path}"


def _slurm_uint16(text: str) -> int | None:
    """A number as ``strtoul(text, &end, 0)`` reads it in full (0x hex, leading-0 octal), or the
    maximum for UNLIMITED/INFINITE; None when Slurm would reject it."""
    if text.upper() in ("UNLIMITED", "INFINITE"):
        return MAX_SCRIPT_TIMEOUT_S
    body = text.strip()  # strtoul skips leading space; _KEY_VALUE keeps no trailing space
    if body.startswith("+"):
        body = body[1:]
    if re.fullmatch(r"0[xX][0-9a-fA-F]{1,8}", body):
        value = int(body, 16)
    elif re.fullmatch(r"0[0-7]{0,11}", body):
        value = int(body, 8)
    elif re.fullmatch(r"[1-9][0-9]{0,9}", body):
        value = int(body)
    else:
        return None
    return value if value <= MAX_SCRIPT_TIMEOUT_S else None
