"""Site configuration: ``/etc/preflight/preflight.toml`` on the node (``--root`` aware) or
``--config FILE``.

.. code-block:: toml

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

    disable = ["GDR002"]    # references never reported on these hosts

    [dns]
    nameservers = ["10.0.0.2"]
    port = 53
    lifetime = 2.0

    [[hosts]]               # later sections override earlier ones for matching hosts
    match = "gpu[001-064]"  # Slurm hostlist, globs, comma-separated
    expect = { gpu_count = 4 }
    severity = { GDR001 = "warning" }
    disable = ["DNS001"]

Every unknown key or bad value is an error naming the file, the line and the key.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from preflight.hostlist import HostlistError, expand, matches, split_top_level
from preflight.model import REFERENCE_ID, Severity
from preflight.sources import DnsSettings
from preflight.tomlcompat import TomlError, parse_toml
from preflight.units import UNLIMITED, parse_size

DEFAULT_CONFIG_PATH = "/etc/preflight/preflight.toml"
UNKNOWN_POLICIES = ("ignore", "warning", "error")


class ConfigError(Exception):
    """The configuration file cannot be used; the message names file, line and key."""


@dataclass(frozen=True)
class Expectations:
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


@dataclass(frozen=True)
class HostConfig:
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
    origin: str = ""  # the file this came from, "" for built-in defaults


def _positive_float(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError("must be a positive number of seconds")
    return float(value)


def _positive_int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError("must be a positive integer")
    return value


def _positive_number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError("must be a positive number")
    return float(value)


def _string_list(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(item, str) and item for item in value):
        raise ValueError("must be a list of strings")
    return tuple(value)


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
    "nameservers": _string_list,
    "port": _port,
    "lifetime": _positive_float,
}
_TOP_KEYS = ("run", "policy", "expect", "severity", "disable", "dns", "hosts")
_HOST_KEYS = ("match", "expect", "severity", "disable")


class _Reader:
    """Validates one parsed document, reporting errors with the line they come from."""

    def __init__(self, path: str, text: str) -> None:
        self.path = path
        self.lines = text.splitlines()

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

    def severities(self, table: Any, prefix: str) -> dict[str, Severity]:
        result = {}
        for ref_id, value in self.table(table, prefix.rstrip(".")).items():
            if not REFERENCE_ID.match(ref_id):
                raise self.fail(f"{prefix}{ref_id}", "is not a reference ID like MEM001")
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
            if not REFERENCE_ID.match(item):
                raise self.fail(key, f"{item!r} is not a reference ID like MEM001")
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
    policy = reader.values(reader.table(document.get("policy", {}), "policy"), {"unknown": _choice(UNKNOWN_POLICIES)}, "policy.")
    config = replace(config, unknown_policy=policy.get("unknown", config.unknown_policy))
    dns = reader.values(reader.table(document.get("dns", {}), "dns"), _DNS_KEYS, "dns.")
    config = replace(config, dns=replace(config.dns, **dns))
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
