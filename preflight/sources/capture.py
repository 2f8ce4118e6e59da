"""Capture units: the parts of a node whose absence is no evidence about the node.

A missing file means two different things. ``/sys/module/nvidia_peermem`` missing from a node's
``/sys/module`` says the module is not loaded; the same path missing from a copied root that has
no ``sys/module`` at all says only that nobody copied it. A partial capture, a container without
``/dev``, an old kernel, a snapshot taken by someone else: all lack whole sources. So
:class:`~preflight.sources.fs.NodeFS` answers "absent" (``None``) only when the path's capture
units are there, and raises :class:`~preflight.sources.fs.NotCaptured` otherwise; probes that turn ``None`` into "empty"
can then only do so for absences the node really reported.

A unit is a node path pattern (components separated by ``/``; ``*`` is one component, ``<pid>``
one all-digit component, ``**`` any number of components) of one of two kinds:

* a **directory** the kernel (or the distribution) always has when the source it belongs to
  exists: ``/dev``, ``/etc``, ``/proc/net``, ``/sys/module``, a port's ``gids/``. Missing, it
  means the source was not captured, and nothing below it can be judged absent. The directories
  above a unit without wildcards are units too (``/sys/bus`` above ``/sys/bus/pci/devices``);
* a **file** the kernel always creates beside its siblings: ``/proc/net/fib_trie``,
  ``/proc/self/limits``, an interface's ``mtu``. Missing while its directory is there, the
  capture is partial.

``/sys/class/infiniband_verbs`` is a unit although a node without ``ib_uverbs`` lacks it:
whether the module is loaded is decided from ``/sys/module`` (its absence there is evidence once
``/sys/module`` itself was captured), never from a class directory a capture may have skipped.
``/sys/class/iommu`` is one for the same reason: every kernel built with IOMMU support has it
(empty when no IOMMU is enabled), and a capture that skipped it says nothing about the IOMMU.

Probes that add a source add its units here. The reliability property
(``tests/sources/test_capture_units.py``) deletes each unit from every recorded root and requires that
no finding becomes ``present`` and no ``unknown`` becomes ``absent``.
"""

from __future__ import annotations

#: The unit of a process's own /proc directory.
PROCESS_ENTRY = "process entry"

#: (pattern, what it is) — the second part completes "this root has no ..." in reasons.
CAPTURE_UNITS: tuple[tuple[str, str], ...] = (
    # whole trees
    ("/dev", "device nodes"),
    ("/etc", "configuration files"),
    ("/usr/lib", "installed software"),
    ("/proc", "procfs"),
    ("/sys", "sysfs"),
    # procfs
    ("/proc/net", "network tables"),
    ("/proc/net/fib_trie", "IPv4 address table"),
    ("/proc/net/route", "IPv4 routing table"),
    ("/proc/net/tcp", "TCP socket table"),
    ("/proc/net/dev", "interface statistics"),
    ("/proc/self", "the reading process's own entries"),
    ("/proc/self/limits", "resource limits"),
    ("/proc/self/status", "process status"),
    ("/proc/self/environ", "environment"),
    ("/proc/<pid>", PROCESS_ENTRY),
    ("/proc/<pid>/limits", "resource limits"),
    ("/proc/<pid>/status", "process status"),
    ("/proc/<pid>/stat", "process status"),
    ("/proc/<pid>/comm", "process name"),
    ("/proc/cpuinfo", "CPU description"),
    ("/proc/meminfo", "memory counters"),
    ("/proc/cmdline", "kernel command line"),
    ("/proc/sys", "sysctls"),
    ("/proc/sys/kernel/hostname", "host name"),
    ("/proc/sys/kernel/osrelease", "kernel release"),
    ("/proc/sys/net", "network sysctls"),
    ("/proc/sys/net/ipv4/ip_local_port_range", "ephemeral port range"),
    ("/proc/sys/net/core/somaxconn", "listen backlog cap"),
    ("/proc/sys/net/ipv4/conf/all", "IPv4 interface settings"),
    # sysfs
    ("/sys/class", "device classes"),
    ("/sys/class/net", "network interfaces"),
    ("/sys/class/net/*/ifindex", "interface index"),
    ("/sys/class/net/*/mtu", "interface MTU"),
    ("/sys/class/net/*/type", "interface type"),
    ("/sys/class/net/*/operstate", "interface state"),
    ("/sys/class/infiniband/*/ports", "RDMA ports"),
    ("/sys/class/infiniband/*/ports/*/gids", "GID table"),
    ("/sys/class/infiniband/*/ports/*/gid_attrs", "GID attributes"),
    ("/sys/class/infiniband/*/ports/*/gid_attrs/types", "GID types"),
    ("/sys/class/infiniband/*/ports/*/gid_attrs/ndevs", "GID netdevs"),
    ("/sys/class/infiniband/*/ports/*/state", "port state"),
    ("/sys/class/infiniband/*/ports/*/phys_state", "port physical state"),
    ("/sys/class/infiniband/*/ports/*/link_layer", "port link layer"),
    ("/sys/class/infiniband_verbs", "verbs devices (ib_uverbs)"),
    ("/sys/class/iommu", "IOMMU units"),
    ("/sys/module", "kernel modules"),
    ("/sys/kernel", "kernel objects"),
    ("/sys/bus/pci/devices", "PCI devices"),
    ("/sys/bus/pci/devices/*/vendor", "PCI vendor"),
    ("/sys/bus/pci/devices/*/device", "PCI device ID"),
    ("/sys/bus/pci/devices/*/class", "PCI class"),
    ("/sys/bus/pci/devices/*/config", "PCI configuration space"),
    ("/sys/devices", "device tree"),
    ("/sys/devices/**/config", "PCI configuration space"),
)


_WILDCARDS = frozenset({"*", "<pid>", "**"})


def _matches(pattern: tuple[str, ...], parts: list[str]) -> bool:
    """Whether the path components ``parts`` fit ``pattern``'s: ``*`` is any one component,
    ``<pid>`` one all-digit component, ``**`` one or more components."""
    if not pattern:
        return not parts
    head, rest = pattern[0], pattern[1:]
    if head == "**":
        return all(parts[:1]) and any(all(parts[:end]) and _matches(rest, parts[end:]) for end in range(1, len(parts) + 1))
    if not parts:
        return False
    part = parts[0]
    if (head == "*" and part) or (head == "<pid>" and part.isascii() and part.isdigit()) or head == part:
        return _matches(rest, parts[1:])
    return False


# Matched component by component rather than as one compiled expression: compiling the
# alternation of every unit cost 3 ms of each run's start, and a path is only looked up here when
# it turned out to be absent. Literal units answer from a dictionary.
_LITERAL_UNITS = {pattern: what for pattern, what in CAPTURE_UNITS if not _WILDCARDS & set(pattern.split("/"))}
_WILDCARD_UNITS = tuple(
    (tuple(pattern.split("/")), what) for pattern, what in CAPTURE_UNITS if _WILDCARDS & set(pattern.split("/"))
)


# A unit without wildcards is there on every node, and so is every directory above it
# (/sys/bus and /sys/bus/pci, for /sys/bus/pci/devices); above a wildcard nothing follows
# (/sys/class/infiniband is absent on a node without RDMA devices).
_ALWAYS_ABOVE = {
    "/".join(pattern.split("/")[:end]): what
    for pattern, what in CAPTURE_UNITS
    if not _WILDCARDS & set(pattern.split("/"))
    for end in range(2, pattern.count("/") + 1)
}


def unit_of(path: str) -> str | None:
    """What the unit ``path`` is (its description), or None when it is none."""
    literal = _LITERAL_UNITS.get(path)
    if literal is not None:
        return literal
    parts = path.split("/")
    for pattern, what in _WILDCARD_UNITS:
        if len(pattern) <= len(parts) and _matches(pattern, parts):
            return what
    return _ALWAYS_ABOVE.get(path)
