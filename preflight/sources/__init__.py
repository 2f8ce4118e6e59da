"""The only code that touches the node. Probes receive these sources by parameter name
(``fs``, ``nvml``, ``netlink``, ``dns``, ``clock``) and never open files, sockets or libraries
themselves; ``tests/reliability/test_no_direct_io.py`` enforces that.

``Sources.for_node(root)`` (or ``for_fs`` around an opened view) builds the live set for ``/`` and the replay set for a recorded root:
NVML, netlink and DNS answers replay from ``<root>/.preflight/{nvml,netlink,dns}.json`` (the
firewall ruleset from ``firewall.json``); without a netlink recording, links and addresses come
from the root's sysfs/procfs files.
"""

from __future__ import annotations

import os
import time

from msgspec import Struct, field
from msgspec.structs import replace

from preflight.sources.dns import Dns, LiveDns, NoDns, ReplayDns, ResolvConf, parse_resolv_conf
from preflight.sources.fs import NodeFS, NotCaptured, SourceError
from preflight.sources.netlink import FIREWALL_FILE, FileNetlink, LiveNetlink, Netlink, ReplayNetlink
from preflight.sources.nvml import LiveNvml, NoNvml, Nvml, ReplayNvml


class Clock:
    """Wall and monotonic time, injectable so reports are reproducible in tests."""

    def now(self) -> float:
        return time.time()

    def monotonic(self) -> float:
        return time.monotonic()


class DnsSettings(Struct, frozen=True):
    """Site overrides for the live resolver (``[dns]`` in the config)."""

    nameservers: tuple[str, ...] = ()
    port: int = 53
    lifetime: float = 2.0


#: A recorded root holds at least one of these; anything else is some other directory. A root of
#: replay recordings alone (``.preflight/nvml.json`` and the like, e.g. NVML's answers read back
#: from an nvidia-smi dump) is one too: every file source is then "not captured".
NODE_ROOT_DIRECTORIES = ("sys", "proc", "etc", ".preflight")


class RootError(Exception):
    """The requested root cannot be used at all (missing, not a directory)."""


class Sources(Struct):
    """One bundle of sources for one node."""

    fs: NodeFS
    nvml: Nvml
    netlink: Netlink
    dns: Dns
    clock: Clock = field(default_factory=Clock)

    @classmethod
    def for_node(cls, root: str = "/", dns_settings: DnsSettings | None = None) -> Sources:
        """Sources for the live node (``/``) or a recorded root; raises RootError."""
        return cls.for_fs(open_root(root), dns_settings)

    @classmethod
    def for_fs(cls, fs: NodeFS, dns_settings: DnsSettings | None = None) -> Sources:
        """Sources around an already opened filesystem view (shared, so its read cache is too)."""
        settings = dns_settings or DnsSettings()
        if fs.is_live:
            return cls(fs, LiveNvml(), LiveNetlink(), _live_dns(fs, settings))
        nvml_file = fs.replay_file("nvml.json")
        nvml: Nvml = ReplayNvml.from_file(nvml_file) if nvml_file else NoNvml(
            f"{fs.root} has no NVML recording (.preflight/nvml.json)"
        )
        netlink_file = fs.replay_file("netlink.json")
        netlink: Netlink
        if netlink_file:
            replay = ReplayNetlink.from_file(netlink_file)
            replay.firewall_file = fs.replay_file(FIREWALL_FILE)
            netlink = replay
        else:
            netlink = FileNetlink(fs)
        dns_file = fs.replay_file("dns.json")
        if dns_file:
            dns: Dns = ReplayDns.from_file(dns_file)
        elif settings.nameservers:
            # A site that names its nameservers asks for live answers even on a recorded root.
            dns = _live_dns(fs, settings)
        else:
            dns = NoDns(f"{fs.root} has no DNS recording (.preflight/dns.json)")
        return cls(fs, nvml, netlink, dns)

    def by_name(self, name: str) -> object:
        return getattr(self, name)


def open_root(root: str) -> NodeFS:
    """The filesystem view of ``root``; RootError when it cannot be used at all."""
    path = os.path.abspath(root)
    if not os.path.isdir(path):
        if root == "-":
            raise RootError("--root does not read standard input; give a directory or a snapshot archive")
        if os.path.exists(path):  # a link to nowhere is "no such directory" too
            raise RootError(f"--root {root}: neither a directory nor a snapshot archive; not opened")
        raise RootError(f"--root {root}: no such directory")
    if not os.access(path, os.R_OK | os.X_OK):
        raise RootError(f"--root {root}: not readable")
    if path != "/" and not any(os.path.isdir(os.path.join(path, top)) for top in NODE_ROOT_DIRECTORIES):
        raise RootError(f"--root {root}: not a node root (it has none of {', '.join(d + '/' for d in NODE_ROOT_DIRECTORIES)})")
    return NodeFS(path)


def _live_dns(fs: NodeFS, settings: DnsSettings) -> Dns:
    resolv = _read_resolv_conf(fs)
    if settings.nameservers:
        # The site's servers replace resolv.conf's; its search list and options still apply.
        resolv = replace(resolv, nameservers=settings.nameservers)
    return LiveDns(resolv, settings.port, settings.lifetime)


def _read_resolv_conf(fs: NodeFS) -> ResolvConf:
    try:
        text = fs.read("/etc/resolv.conf")
    except SourceError:
        text = None
    return parse_resolv_conf(text or "")


__all__ = [
    "Clock",
    "DnsSettings",
    "NodeFS",
    "NotCaptured",
    "RootError",
    "SourceError",
    "Sources",
    "open_root",
]
