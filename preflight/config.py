"""Site configuration: ``--config FILE``, else ``/etc/preflight/preflight.toml`` of the machine
preflight runs on. A config inside ``--root`` or a snapshot is never read as settings: a root is
evidence from another node, not instructions (``docs/security.md``).

.. code-block:: toml

    disable = ["GDR002"]    # references never reported (top-level keys go before every [table])

    [run]
    timeout = 10.0          # whole-run deadline, seconds
    probe_timeout = 3.0     # default deadline of one probe
    profile = "full"        # default --profile of `preflight node`
    checks_dirs = ["/etc/preflight/checks.d"]

    [policy]
    unknown = "ignore"      # what an unknown finding does to the exit code: ignore|warning|error

    [expect]                # what this site's nodes should look like
    memlock_min = "unlimited"   # or bytes / "64GiB"
    gpu_count = 8
    mtu = 4200
    hcas = ["mlx5_0", "mlx5_1"]  # the data HCAs; their ports are judged even when down
    rate_gbps = 400         # expected active rate of each data RDMA port
    peers = ["gpu[001-064]", "10.0.0.5"]  # hosts routes must reach, beyond the job's own
    lossless_priority = 3   # the RoCE priority PFC protects (0-7)
    nvlinks_per_gpu = 18    # active NVLinks each GPU should have (H100/H200/B200 SXM: 18)

    [severity]              # per-reference severity overrides
    MEM002 = "error"

    [dns]
    nameservers = ["10.0.0.2"]
    port = 53
    lifetime = 2.0

    [slurm]                 # `preflight slurm prolog|epilog|healthcheck` (docs/operators/slurm.md)
    timeout = 8.0           # prolog/epilog budget, scontrol included; below PrologEpilogTimeout
    healthcheck_timeout = 50.0  # HealthCheckProgram budget; slurmd kills it at HealthCheckTimeout (60 s)
    scontrol_timeout = 3.0  # one scontrol call; never retried
    drain_severity = "error"    # present findings at or above this drain the node
    fail_closed = false     # true: unknown findings at or above drain_severity drain too
    drain = true            # false: exit code only, never call scontrol
    scontrol = "scontrol"   # program name (PATH, then /usr/bin, /usr/sbin...) or absolute path
    node_name = ""          # Slurm's name for this node; default $SLURMD_NODENAME, then hostname -s
    opt_out = "preflight=off"   # item in a job's extra/comment that skips checks ("" = no opt-out)
    opt_out_variables = ["SLURM_JOB_EXTRA", "SLURM_JOB_COMMENT"]
    cpu_job_ignore = ["GPU", "GDR", "NVL", "IB", "ROCE", "EFA", "PCI", "TOPO", "MEM", "NCCL"]
    single_node_job_ignore = []  # e.g. ["IB", "ROCE", "EFA", "GDR001"]: what a one-node job never uses
    epilog_profile = "prolog"
    last_result = "/var/lib/preflight/slurm-{mode}.json"  # {mode}: prolog, epilog, healthcheck
    syslog = true
    syslog_socket = "/dev/log"

    [[hosts]]               # later sections override earlier ones for matching hosts
    match = "gpu[001-064]"  # Slurm hostlist, globs, comma-separated
    expect = { gpu_count = 4 }
    severity = { GDR001 = "warning" }
    disable = ["DNS001"]

Every unknown key or bad value is an error naming the file, the line and the key.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

from msgspec import Struct, field
from msgspec.structs import replace

from preflight.catalogue import reference_ids
from preflight.hostlist import HostlistError, expand, matches, split_top_level
from preflight.model import REFERENCE_ID, Severity
from preflight.sources import DnsSettings
from preflight.tomlcompat import TomlError, parse_toml
from preflight.units import UNLIMITED, parse_size

DEFAULT_CONFIG_PATH = "/etc/preflight/preflight.toml"
UNKNOWN_POLICIES = ("ignore", "warning", "error")


class ConfigError(Exception):
    """The configuration file cannot be used; the message names file, line and key."""


class Expectations(Struct, frozen=True):
    """What the site expects of this host; ``None`` means "no expectation"."""

    memlock_min: int = UNLIMITED  # bytes; NVIDIA and Slurm both recommend unlimited for RDMA jobs
    gpu_count: int | None = None
    mtu: int | None = None
    hcas: tuple[str, ...] | None = None
    # Hostlists, names or addresses whose routes the network checks look up, in addition to the
    # job's own peers (SLURM_JOB_NODELIST, MASTER_ADDR, NCCL_COMM_ID).
    peers: tuple[str, ...] = ()
    rate_gbps: float | None = None  # per RDMA port, as /sys/class/infiniband/*/ports/*/rate shows it
    lossless_priority: int | None = None  # the 802.1p priority RoCE traffic is lossless on (PFC)
    # Active NVLinks per GPU (nvmlDeviceGetNvLinkState); without it GPUs of one model on a node
    # are compared with each other.
    nvlinks_per_gpu: int | None = None


#: References that only matter to jobs with GPUs or RDMA: a CPU-only job's prolog skips them.
CPU_JOB_IGNORE = ("GPU", "GDR", "NVL", "IB", "ROCE", "EFA", "PCI", "TOPO", "MEM", "NCCL")


class SlurmSettings(Struct, frozen=True):
    """How ``preflight slurm ...`` runs under Slurm (``[slurm]``); see docs/operators/slurm.md."""

    timeout_s: float = 8.0  # prolog/epilog: everything, the scontrol call included
    healthcheck_timeout_s: float = 50.0  # slurmd kills HealthCheckProgram at HealthCheckTimeout (60 s)
    scontrol_timeout_s: float = 3.0
    drain_severity: Severity = Severity.ERROR
    fail_closed: bool = False  # unknown never drains unless the site asks for it
    drain: bool = True
    scontrol: str = "scontrol"
    node_name: str = ""
    opt_out: str = "preflight=off"
    opt_out_variables: tuple[str, ...] = ("SLURM_JOB_EXTRA", "SLURM_JOB_COMMENT")
    cpu_job_ignore: tuple[str, ...] = CPU_JOB_IGNORE
    # References a GPU job of one node skips: off unless the site lists them, because the node
    # still has what they find and the next job of several nodes will meet it.
    single_node_job_ignore: tuple[str, ...] = ()
    epilog_profile: str = "prolog"
    last_result: str = "/var/lib/preflight/slurm-{mode}.json"
    syslog: bool = True
    syslog_socket: str = "/dev/log"


class HostConfig(Struct, frozen=True):
    """The configuration that applies to one host after host sections are merged."""

    expect: Expectations = field(default_factory=Expectations)
    severity: dict[str, Severity] = field(default_factory=dict)
    disabled: frozenset[str] = frozenset()
    timeout_s: float = 10.0
    probe_timeout_s: float = 3.0
    profile: str = "full"
    unknown_policy: str = "ignore"
    checks_dirs: tuple[str, ...] = ()
    dns: DnsSettings = field(default_factory=DnsSettings)
    slurm: SlurmSettings = field(default_factory=SlurmSettings)
    origin: str = ""  # the file this came from, "" for built-in defaults


#: The longest deadline any run takes: past it, select() and the timers refuse the number
#: (OverflowError), and no node check needs a day.
MAX_TIMEOUT_S = 86_400.0


def seconds_problem(value: float) -> str:
    """Why ``value`` is no usable deadline, "" when it is one."""
    return "" if 0 < value <= MAX_TIMEOUT_S else f"must be a positive number of seconds, at most {MAX_TIMEOUT_S:g}"


def _positive_float(value: Any) -> float:
    # TOML has nan and inf: neither bounds a run.
    if isinstance(value, bool) or not isinstance(value, (int, float)) or seconds_problem(value):
        raise ValueError(seconds_problem(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else "must be a positive number of seconds")
    return float(value)


def _positive_int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError("must be a positive integer")
    return value


def _positive_number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ValueError("must be a positive number")
    return float(value)


def _string_list(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(item, str) and item for item in value):
        raise ValueError("must be a list of strings")
    return tuple(value)


def _boolean(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError("must be true or false")
    return value


def _text(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError("must be a string")
    return value


def _absolute_path(value: Any) -> str:
    if not isinstance(value, str) or not value.startswith("/") or "\0" in value:
        raise ValueError("must be an absolute path")
    return value


def _program(value: Any) -> str:
    if not isinstance(value, str) or not value.strip() or "\0" in value or (("/" in value) and not value.startswith("/")):
        raise ValueError("must be a program name or an absolute path")
    return value


def _severity(value: Any) -> Severity:
    try:
        return Severity(value)
    except ValueError:
        raise ValueError(f"must be one of {[s.value for s in Severity]}") from None


def _node_name(value: Any) -> str:
    if not isinstance(value, str) or not re.fullmatch(r"[A-Za-z0-9._-]*", value):
        raise ValueError("must be a Slurm node name (letters, digits, '.', '_', '-')")
    return value


def _variable_names(value: Any) -> tuple[str, ...]:
    names = _string_list(value)
    for name in names:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise ValueError(f"{name!r} is not an environment variable name")
    return names


def _last_result(value: Any) -> str:
    import string  # only where a site sets last_result

    path = _absolute_path(value)
    try:
        # "{mode}" alone: a format spec ("{mode:>99999999999}") would make every run build a
        # string of that width, and other fields name nothing
        fields = [(name, spec, conversion) for _text, name, spec, conversion in string.Formatter().parse(path) if name is not None]
    except ValueError:
        fields = [("", "", None)]
    if any(field != ("mode", "", None) for field in fields):
        raise ValueError("may contain no placeholder other than {mode}")
    return path


def _nameservers(value: Any) -> tuple[str, ...]:
    """Addresses only: a name would be resolved by this machine's own resolver, not asked."""
    import ipaddress  # only where a site names its nameservers

    names = _string_list(value)
    for name in names:
        try:
            ipaddress.ip_address(name)
        except ValueError:
            raise ValueError(f"{name!r} is not an IP address") from None
    return names


def _choice(options: tuple[str, ...]) -> Callable[[Any], str]:
    def parse(value: Any) -> str:
        if value not in options:
            raise ValueError(f"must be one of {list(options)}")
        return str(value)

    return parse


def _priority(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 7:
        raise ValueError("must be a priority from 0 to 7")
    return value


def _memlock(value: Any) -> int:
    if isinstance(value, bool):
        raise ValueError("must be bytes, a size like \"64GiB\", or \"unlimited\"")
    return parse_size(value)


def _hostlists(value: Any) -> tuple[str, ...]:
    items = _string_list(value)
    for item in items:
        try:
            expand(item)
        except HostlistError as error:
            raise ValueError(str(error)) from None
    return items


def _port(value: Any) -> int:
    port = _positive_int(value)
    if port > 65535:
        raise ValueError("must be a port number")
    return port


_EXPECT_KEYS: dict[str, Callable[[Any], Any]] = {
    "memlock_min": _memlock,
    "gpu_count": _positive_int,
    "mtu": _positive_int,
    "hcas": _string_list,
    "peers": _hostlists,
    "rate_gbps": _positive_number,
    "lossless_priority": _priority,
    "nvlinks_per_gpu": _positive_int,
}
_RUN_KEYS: dict[str, Callable[[Any], Any]] = {
    "timeout": _positive_float,
    "probe_timeout": _positive_float,
    "profile": _choice(("prolog", "full")),
    "checks_dirs": _string_list,
}
_DNS_KEYS: dict[str, Callable[[Any], Any]] = {
    "nameservers": _nameservers,
    "port": _port,
    "lifetime": _positive_float,
}
# [slurm] key -> (SlurmSettings field, parser)
_SLURM_KEYS: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "timeout": ("timeout_s", _positive_float),
    "healthcheck_timeout": ("healthcheck_timeout_s", _positive_float),
    "scontrol_timeout": ("scontrol_timeout_s", _positive_float),
    "drain_severity": ("drain_severity", _severity),
    "fail_closed": ("fail_closed", _boolean),
    "drain": ("drain", _boolean),
    "scontrol": ("scontrol", _program),
    "node_name": ("node_name", _node_name),
    "opt_out": ("opt_out", _text),
    "opt_out_variables": ("opt_out_variables", _variable_names),
    "cpu_job_ignore": ("cpu_job_ignore", lambda value: () if value == [] else _string_list(value)),
    "single_node_job_ignore": ("single_node_job_ignore", lambda value: () if value == [] else _string_list(value)),
    "epilog_profile": ("epilog_profile", _choice(("prolog", "full"))),
    "last_result": ("last_result", _last_result),
    "syslog": ("syslog", _boolean),
    "syslog_socket": ("syslog_socket", _absolute_path),
}
_TOP_KEYS = ("run", "policy", "expect", "severity", "disable", "dns", "slurm", "hosts")
_HOST_KEYS = ("match", "expect", "severity", "disable")


class _Reader:
    """Validates one parsed document, reporting errors with the line they come from."""

    def __init__(self, path: str, text: str) -> None:
        self.path = path
        self.lines = text.splitlines()
        self.known_ids: list[str] | None = None  # the catalogue's IDs, read once when needed
        # [run] checks_dirs, and the IDs of the references they and plugins ship (read once, when
        # an ID is not the catalogue's): a site may disable or re-rate its own checks.
        self.checks_dirs: tuple[str, ...] = ()
        self.site_ids: set[str] | None = None

    def line_of(self, key: str) -> int | None:
        pattern = re.compile(rf"^\s*(\[+\s*)?[\"']?{re.escape(key)}[\"']?\s*(=|\])")
        inline = re.compile(rf"[{{,]\s*{re.escape(key)}\s*=")
        for number, line in enumerate(self.lines, 1):
            if pattern.search(line) or inline.search(line):
                return number
        return None

    def fail(self, key: str, message: str) -> ConfigError:
        leaf = key.rsplit(".", 1)[-1]
        line = self.line_of(leaf)
        where = f"{self.path}:{line}" if line else self.path
        return ConfigError(f"{where}: {key}: {message}")

    def table(self, value: Any, key: str) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise self.fail(key, "must be a table")
        return value

    def keys(self, table: dict[str, Any], allowed: tuple[str, ...] | dict[str, Any], prefix: str) -> None:
        for key in table:
            if key not in allowed:
                raise self.fail(f"{prefix}{key}", f"unknown key; expected one of {sorted(allowed)}")

    def values(self, table: dict[str, Any], parsers: dict[str, Callable[[Any], Any]], prefix: str) -> dict[str, Any]:
        self.keys(table, parsers, prefix)
        parsed = {}
        for key, value in table.items():
            try:
                parsed[key] = parsers[key](value)
            except ValueError as error:
                raise self.fail(f"{prefix}{key}", f"{value!r} {error}") from None
        return parsed

    def unknown_reference(self, ref_id: str) -> str | None:
        """Why ``ref_id`` names no catalogued reference (with the nearest ID), or None: an
        override or a disable of a misspelt ID would otherwise be accepted and do nothing."""
        if self.known_ids is None:
            self.known_ids = reference_ids()
        if ref_id in self.known_ids:
            return None
        if self.site_ids is None and REFERENCE_ID.match(ref_id):
            from preflight.discovery import shipped_reference_ids  # only a site's own IDs pay for it

            self.site_ids = shipped_reference_ids(self.checks_dirs)
        if ref_id in (self.site_ids or ()):
            return None
        import difflib  # only a wrong config pays for it

        close = difflib.get_close_matches(ref_id.upper(), self.known_ids, n=1)
        problem = (
            "is no reference in the catalogue, nor shipped by [run] checks_dirs or a plugin"
            if REFERENCE_ID.match(ref_id)
            else "is not a reference ID like MEM001"
        )
        return problem + (f" (did you mean {close[0]}?)" if close else "")

    def severities(self, table: Any, prefix: str) -> dict[str, Severity]:
        result = {}
        for ref_id, value in self.table(table, prefix.rstrip(".")).items():
            problem = self.unknown_reference(ref_id)
            if problem:
                raise self.fail(f"{prefix}{ref_id}", problem)
            try:
                result[ref_id] = Severity(value)
            except ValueError:
                raise self.fail(f"{prefix}{ref_id}", f"{value!r} must be one of {[s.value for s in Severity]}") from None
        return result

    def disabled(self, value: Any, key: str) -> frozenset[str]:
        try:
            items = _string_list(value)
        except ValueError as error:
            raise self.fail(key, str(error)) from None
        for item in items:
            problem = self.unknown_reference(item)
            if problem:
                raise self.fail(key, f"{item!r} {problem}")
        return frozenset(items)


def parse_config(text: str, path: str, hostname: str) -> HostConfig:
    """Parse and validate a configuration file and merge the sections matching ``hostname``."""
    try:
        document = parse_toml(text)
    except TomlError as error:
        raise ConfigError(f"{path}: not valid TOML: {error}") from None
    reader = _Reader(path, text)
    reader.keys(document, _TOP_KEYS, "")
    config = HostConfig(origin=path)

    run = reader.values(reader.table(document.get("run", {}), "run"), _RUN_KEYS, "run.")
    config = replace(
        config,
        timeout_s=run.get("timeout", config.timeout_s),
        probe_timeout_s=run.get("probe_timeout", config.probe_timeout_s),
        profile=run.get("profile", config.profile),
        checks_dirs=run.get("checks_dirs", config.checks_dirs),
    )
    reader.checks_dirs = config.checks_dirs
    policy = reader.values(reader.table(document.get("policy", {}), "policy"), {"unknown": _choice(UNKNOWN_POLICIES)}, "policy.")
    config = replace(config, unknown_policy=policy.get("unknown", config.unknown_policy))
    dns = reader.values(reader.table(document.get("dns", {}), "dns"), _DNS_KEYS, "dns.")
    config = replace(config, dns=replace(config.dns, **dns))
    config = replace(config, slurm=_slurm_settings(reader, document.get("slurm", {})))
    config = _apply_section(config, reader, document, "")

    hosts = document.get("hosts", [])
    if not isinstance(hosts, list):
        raise reader.fail("hosts", "must be an array of tables ([[hosts]])")
    for number, section in enumerate(hosts):
        prefix = f"hosts[{number}]."
        section = reader.table(section, prefix.rstrip("."))
        reader.keys(section, _HOST_KEYS, prefix)
        pattern = section.get("match")
        if not isinstance(pattern, str) or not pattern.strip():
            raise reader.fail(f"{prefix}match", "must be a hostlist or glob such as \"gpu[001-064]\"")
        try:
            split_top_level(pattern)
            selected = matches(pattern, hostname)
        except HostlistError as error:
            raise reader.fail(f"{prefix}match", str(error)) from None
        # Validate every section, even those for other hosts: a typo must fail everywhere.
        merged = _apply_section(config, reader, section, prefix)
        if selected:
            config = merged
    return config


def _apply_section(config: HostConfig, reader: _Reader, section: dict[str, Any], prefix: str) -> HostConfig:
    if "expect" in section:
        expect = reader.values(reader.table(section["expect"], f"{prefix}expect"), _EXPECT_KEYS, f"{prefix}expect.")
        config = replace(config, expect=replace(config.expect, **expect))
    if "severity" in section:
        config = replace(config, severity={**config.severity, **reader.severities(section["severity"], f"{prefix}severity.")})
    if "disable" in section:
        config = replace(config, disabled=config.disabled | reader.disabled(section["disable"], f"{prefix}disable"))
    return config


def _slurm_settings(reader: _Reader, table: Any) -> SlurmSettings:
    parsers = {key: parser for key, (_, parser) in _SLURM_KEYS.items()}
    values = reader.values(reader.table(table, "slurm"), parsers, "slurm.")
    settings = replace(SlurmSettings(), **{_SLURM_KEYS[key][0]: value for key, value in values.items()})
    # The drain call must fit inside the budget it is part of, with time left for the checks.
    for key, budget in (("timeout", settings.timeout_s), ("healthcheck_timeout", settings.healthcheck_timeout_s)):
        if settings.scontrol_timeout_s * 2 >= budget:
            raise reader.fail(f"slurm.{key}", f"{budget:g} must be more than twice slurm.scontrol_timeout ({settings.scontrol_timeout_s:g})")
    problem = healthcheck_budget_problem(settings.healthcheck_timeout_s)
    if problem:
        raise reader.fail("slurm.healthcheck_timeout", problem)
    return settings


#: slurm.conf's script time limits (HealthCheckTimeout, PrologTimeout...) are 16-bit counts of
#: seconds (``s_p_handle_uint16``); UNLIMITED/INFINITE parse to this maximum.
MAX_SCRIPT_TIMEOUT_S = 0xFFFF


def healthcheck_budget_problem(seconds: float) -> str:
    """Why a health-check budget cannot work ("" when it can): shared by ``[slurm]
    healthcheck_timeout`` and ``preflight slurm healthcheck --timeout``. No slurmd lets
    HealthCheckProgram run that long; the node's own limit (``HealthCheckTimeout``, else 60 s) is
    known only on the node, where :mod:`preflight.slurm` cuts a budget that would outlast it."""
    if seconds < MAX_SCRIPT_TIMEOUT_S:
        return ""
    return f"{seconds:g} must be below {MAX_SCRIPT_TIMEOUT_S} (the longest HealthCheckTimeout slurmd accepts)"


_TABLE_HEADER = re.compile(r"^\s*\[")
_SLURM_HEADER = re.compile(r"^\s*\[\s*slurm\s*\]\s*(?:#.*)?$")


def _slurm_lines(text: str) -> dict[str, Any]:
    """The ``[slurm]`` keys of a file that is not valid TOML, each line read on its own: a
    syntax error elsewhere (or on another line of the table) must not lose ``last_result``."""
    found: dict[str, Any] = {}
    inside = False
    for line in text.splitlines()[:10_000]:
        if _TABLE_HEADER.match(line):
            inside = bool(_SLURM_HEADER.match(line))
            continue
        if inside and "=" in line:
            try:
                found.update(parse_toml(line))
            except TomlError:
                continue  # this key keeps its default
    return found


def salvage_slurm_settings(text: str) -> SlurmSettings:
    """The ``[slurm]`` keys that are valid on their own in a config that failed validation, the
    defaults for the rest: a prolog that cannot decide still leaves its trace (last-result file,
    syslog) where the site looks for it."""
    try:
        table = parse_toml(text).get("slurm")
    except TomlError:
        table = _slurm_lines(text)
    values: dict[str, Any] = {}
    for key, value in (table.items() if isinstance(table, dict) else ()):
        if key in _SLURM_KEYS:
            name, parser = _SLURM_KEYS[key]
            try:
                values[name] = parser(value)
            except ValueError:
                pass  # this key keeps its default
    return replace(SlurmSettings(), **values)
