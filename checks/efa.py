"""The AWS EFA path NCCL needs: aws-ofi-nccl, libfabric and the efa provider (reference EFA001).

NCCL's own IB transport ignores EFA devices (their link layer reads ``Unknown``); NCCL reaches
them only through a network plugin, aws-ofi-nccl, that drives libfabric's ``efa`` provider.
What a node's files can tell about that chain:

* the job's settings: ``FI_PROVIDER`` (libfabric; anything without ``efa`` hides the EFA
  provider), ``NCCL_NET`` (``Socket`` or ``IB`` bypass the plugin), ``NCCL_NET_PLUGIN`` (``none``
  disables plugins; otherwise the names NCCL dlopens: the value itself, then
  ``libnccl-net-<value>.so``; unset: ``libnccl-net.so``; ``src/plugin/plugin_open.cc``);
* whether those libraries and ``libfabric.so.1`` exist in the directories the dynamic loader
  searches: the job's ``LD_LIBRARY_PATH``, ``/etc/ld.so.conf`` and its ``include`` files, the
  default directories, and the EFA installer's and DLAMI's own directories
  (``/opt/amazon/efa/lib*``, ``/opt/amazon/ofi-nccl/lib``, ``/opt/aws-ofi-nccl/lib``).

A missing library is a warning only: a container image can bring its own plugin and libfabric,
and this root shows the host. The efa driver reports its ports ACTIVE unconditionally, so port
state says nothing about EFA health (IB009 still lists them), and ``/dev/infiniband`` access is
IB007's question.
"""

from __future__ import annotations

import fnmatch
import posixpath
from collections.abc import Iterator

from preflight.checks.job import JobFacts, Setting, parse_environ
from preflight.checks.rdma import IB_CLASS, RdmaFacts, looks_like_efa, require_rdma
from preflight.model import Evidence, NotApplicable, Observation, Severity, Unknown, present, undecided
from preflight.probing import FactReader
from preflight.records import frozen
from preflight.registry import check, probe
from preflight.sources import NodeFS, SourceError

DEFAULT_LIBRARY_DIRS = (
    "/lib", "/usr/lib", "/lib64", "/usr/lib64",
    "/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/lib/aarch64-linux-gnu", "/usr/lib/aarch64-linux-gnu",
)
EFA_LIBRARY_DIRS = ("/opt/amazon/efa/lib", "/opt/amazon/efa/lib64", "/opt/amazon/ofi-nccl/lib", "/opt/aws-ofi-nccl/lib")
LD_SO_CONF = "/etc/ld.so.conf"
PLUGIN_PREFIX = "libnccl-net"
LIBFABRIC = "libfabric.so.1"
# NCCL_NET values that name NCCL's built-in transports instead of a plugin (strcasecmp).
BUILTIN_NETS = ("socket", "ib")


@frozen
class EfaFacts:
    library_dirs: tuple[str, ...]  # directories searched, in loader order
    libraries: tuple[str, ...]  # paths of libnccl-net*.so* and libfabric.so* found there
    problems: tuple[str, ...]


def parse_ld_so_conf(text: str) -> tuple[list[str], list[str]]:
    """Directories and ``include`` patterns of an ld.so.conf file (ldconfig(8))."""
    directories, includes = [], []
    for line in text.splitlines():
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        if fields[0] == "include":
            includes += fields[1:]
        elif fields[0].startswith("/"):
            directories.append(fields[0].rstrip(":"))
    return directories, includes


def _conf_dirs(reader: FactReader) -> list[str]:
    directories, includes = parse_ld_so_conf(reader.text(LD_SO_CONF) or "")
    for pattern in includes:
        pattern = pattern if pattern.startswith("/") else posixpath.join(posixpath.dirname(LD_SO_CONF), pattern)
        folder, name = posixpath.split(pattern)
        for entry in reader.listing(folder) or []:  # unlisted: in problems, the check says unknown
            if fnmatch.fnmatch(entry, name):
                directories += parse_ld_so_conf(reader.text(f"{folder}/{entry}") or "")[0]
    return directories


@probe("efa")
def probe_efa(fs: NodeFS) -> EfaFacts | None:
    """List the libraries NCCL needs for EFA; ``None`` (nothing read) on nodes without EFA."""
    reader = FactReader(fs)
    if not any(looks_like_efa(name, reader.text(f"{IB_CLASS}/{name}/device/vendor")) for name in reader.listing(IB_CLASS) or []):
        return None
    try:
        environ = parse_environ(fs.read_bytes("/proc/self/environ") or b"")
    except SourceError:
        environ = {}
    job_dirs = [d for d in environ.get("LD_LIBRARY_PATH", "").split(":") if d.startswith("/")]
    directories = list(dict.fromkeys(job_dirs + _conf_dirs(reader) + list(DEFAULT_LIBRARY_DIRS) + list(EFA_LIBRARY_DIRS)))
    found = [
        f"{folder.rstrip('/')}/{entry}"
        for folder in directories
        for entry in reader.listing(folder) or []
        if entry.startswith((PLUGIN_PREFIX, "libfabric.so"))
    ]
    return EfaFacts(tuple(directories), tuple(found), tuple(reader.problems))


def plugin_names(setting: Setting | None) -> list[str] | None:
    """The file names NCCL tries for its net plugin; ``None`` when plugins are disabled."""
    if setting is None:
        return [f"{PLUGIN_PREFIX}.so"]
    if setting.value.strip().lower() == "none":
        return None
    names = []
    for item in setting.value.split(","):
        if not item:
            continue
        names.append(item)
        if "/" not in item and not (item.startswith("lib") and item.endswith(".so")):
            names.append(f"{PLUGIN_PREFIX}-{item}.so")
    return names


def _where(setting: Setting, name: str) -> str:
    return f"{'/proc/self/environ' if setting.origin == 'environment' else setting.origin} {name}"


def _found(efa: EfaFacts, names: list[str]) -> list[str]:
    wanted = {posixpath.basename(name) for name in names}
    absolute = {name for name in names if name.startswith("/")}
    return [path for path in efa.libraries if posixpath.basename(path) in wanted or path in absolute]


#: Device names the kernel's other RDMA drivers give: never an EFA, whatever the vendor file
#: says. A name from rdma-core's rename policy (``rdmap16s27``) could be either.
_OTHER_DRIVERS = ("mlx", "hfi1", "qib", "irdma", "i40iw", "bnxt_re", "rxe", "siw", "hns", "qedr", "erdma", "mana", "cxgb", "ocrdma", "vmw_pvrdma", "usnic", "ionic")


@check("EFA001", profiles=("prolog",))
def efa_provider_unavailable(rdma: RdmaFacts, efa: EfaFacts | None, job: JobFacts) -> Iterator[Observation]:
    """The job's settings or the node's libraries keep NCCL off the EFA devices."""
    require_rdma(rdma)
    devices = [device.name for device in rdma.devices if device.efa]
    if not devices:
        # A device whose PCI vendor could not be read may be an EFA with a non-"efa" name.
        unread = [
            p for d in rdma.devices if not d.name.startswith(_OTHER_DRIVERS)
            for p in d.problems if p.path in (f"{d.path}/device", f"{d.path}/device/vendor")
        ]
        if unread:
            raise Unknown(f"cannot tell whether {unread[0].path.split('/')[4]} is an EFA: {unread[0]}")
    if not devices or efa is None:
        raise NotApplicable("no EFA devices in /sys/class/infiniband")
    on_node = Evidence(IB_CLASS, f"EFA devices: {', '.join(devices)}")
    provider = job.environ.get("FI_PROVIDER")
    if provider is not None and "efa" not in provider.lower().split(","):
        yield present("FI_PROVIDER", on_node, Evidence("/proc/self/environ FI_PROVIDER", repr(provider), "efa (or unset)"))
    net = job.nccl("NCCL_NET")
    if net is not None and net.value.strip().lower() in BUILTIN_NETS:
        yield present("NCCL_NET", on_node, Evidence(_where(net, "NCCL_NET"), repr(net.value), "the plugin's name (Libfabric / AWS Libfabric) or unset"))
    plugin_setting = job.nccl("NCCL_NET_PLUGIN")
    names = plugin_names(plugin_setting)
    if names is None and plugin_setting is not None:
        yield present("NCCL_NET_PLUGIN", on_node, Evidence(_where(plugin_setting, "NCCL_NET_PLUGIN"), repr(plugin_setting.value), "aws-ofi-nccl's library (or unset)"))
    elif names is not None and not _found(efa, names) and efa.problems:
        yield undecided("aws-ofi-nccl", f"no {', '.join(names)} found, but: {efa.problems[0]}")
    elif names is not None and not _found(efa, names):
        yield present(
            "aws-ofi-nccl",
            on_node,
            Evidence(", ".join(efa.library_dirs), f"none of {', '.join(names)}", "aws-ofi-nccl (libnccl-net.so or libnccl-net-ofi.so)"),
            severity=Severity.WARNING,
        )
    if not any(posixpath.basename(path).startswith("libfabric.so") for path in efa.libraries):
        if efa.problems:
            yield undecided("libfabric", f"no {LIBFABRIC} found, but: {efa.problems[0]}")
            return
        yield present(
            "libfabric",
            on_node,
            Evidence(", ".join(efa.library_dirs), f"no {LIBFABRIC}", "libfabric 1.22 or newer with the efa provider"),
            severity=Severity.WARNING,
        )
