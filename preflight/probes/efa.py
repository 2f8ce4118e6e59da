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

from msgspec import Struct

from preflight.probes.job import library_path_dirs, parse_environ
from preflight.probes.rdma import IB_CLASS, looks_like_efa
from preflight.probing import FactReader
from preflight.registry import probe
from preflight.sources import NodeFS, SourceError

DEFAULT_LIBRARY_DIRS = (
    "/lib", "/usr/lib", "/lib64", "/usr/lib64",
    "/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/lib/aarch64-linux-gnu", "/usr/lib/aarch64-linux-gnu",
)


EFA_LIBRARY_DIRS = ("/opt/amazon/efa/lib", "/opt/amazon/efa/lib64", "/opt/amazon/ofi-nccl/lib", "/opt/aws-ofi-nccl/lib")


LD_SO_CONF = "/etc/ld.so.conf"


PLUGIN_PREFIX = "libnccl-net"


class EfaFacts(Struct, frozen=True):
    library_dirs: tuple[str, ...]  # directories searched, in loader order
    libraries: tuple[str, ...]  # paths of libnccl-net*.so* and libfabric.so* found there
    problems: tuple[str, ...]
    # The directories the dynamic loader searches (the job's LD_LIBRARY_PATH, ld.so.conf, the
    # defaults): NCCL dlopens its plugin by bare name, so a plugin only in an installer's directory
    # (/opt/amazon/ofi-nccl/lib without its ld.so.conf.d entry) is not found; libfabric is, through
    # the plugin's RPATH. Empty in reports written before this field: every directory counted.
    loader_dirs: tuple[str, ...] = ()


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


def loader_dirs(reader: FactReader, environ: dict[str, str]) -> list[str]:
    """Where the dynamic loader looks for a library asked for by bare name, in its order: the
    job's LD_LIBRARY_PATH, ld.so.conf (with its include globs), the default directories."""
    return list(dict.fromkeys(library_path_dirs(environ) + _conf_dirs(reader) + list(DEFAULT_LIBRARY_DIRS)))


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
    loader = loader_dirs(reader, environ)
    directories = list(dict.fromkeys(loader + list(EFA_LIBRARY_DIRS)))
    found = [
        f"{folder.rstrip('/')}/{entry}"
        for folder in directories
        for entry in reader.listing(folder) or []
        if entry.startswith((PLUGIN_PREFIX, "libfabric.so"))
    ]
    return EfaFacts(tuple(directories), tuple(found), tuple(reader.problems), tuple(loader))
