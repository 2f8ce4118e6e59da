"""GPUDirect RDMA kernel support and GDRCopy (references GDR001, GDR002).

Sources (all readable without root):

* NVIDIA driver: ``/sys/module/nvidia/version``; flavour from ``/proc/driver/nvidia/version``
  (the open kernel modules call themselves "Open Kernel Module"); GPUs from
  ``/proc/driver/nvidia/gpus/<bus id>/``.
* Peer-memory path, the files NCCL itself tests (``src/transport/net_ib/gdr.cc``):
  ``/sys/kernel/mm/memory_peers/nv_mem/version``, ``.../nv_mem_nc/version`` (MLNX_OFED's peer
  memory API with ``nv_peer_mem``) and ``/sys/module/nvidia_peermem/version`` (tested by NCCL
  since 2.23.4); the legacy ``/sys/module/nv_peer_mem``. So with only ``nvidia_peermem`` loaded
  (no ``memory_peers``, as on kernels without MLNX_OFED's peer-memory API), an NCCL copy older
  than 2.23.4 (``preflight.probes.nccl_libs``) still reports GPUDirect RDMA disabled.
* DMA-BUF path: kernel >= 5.12 (``/proc/sys/kernel/osrelease``; dma-buf memory regions landed in
  5.12) with the open kernel modules, unless ``NCCL_DMABUF_ENABLE=0``.
* GDRCopy: ``/sys/module/gdrdrv`` and the device node ``/dev/gdrdrv`` (mode, owner, group), which
  the job user must be able to open read-write; the job user's groups from
  ``/proc/self/status`` or, for a job of another user (a prolog runs as root), ``SLURM_JOB_UID``,
  ``SLURM_JOB_GID``, ``SLURM_JOB_USER`` and ``/etc/group``.
"""

from __future__ import annotations

import re
import stat as stat_codes

from msgspec import Struct

from preflight.nss import NSSWITCH_CONF, groups_beyond_files, read_as_glibc
from preflight.probes.job import parse_environ, parse_group_membership
from preflight.probing import FactReader
from preflight.registry import probe
from preflight.sources import NodeFS, SourceError
from preflight.units import is_number

NVIDIA_PEERMEM_VERSION = "/sys/module/nvidia_peermem/version"


_PEER_MEMORY_FILES = (
    "/sys/kernel/mm/memory_peers/nv_mem/version",
    "/sys/kernel/mm/memory_peers/nv_mem_nc/version",
    NVIDIA_PEERMEM_VERSION,
)


class DeviceNode(Struct, frozen=True):
    """``stat`` of a device file."""

    path: str
    mode: int  # st_mode
    uid: int
    gid: int


class JobIdentity(Struct, frozen=True):
    """Who the job runs as: the credentials that open device files."""

    uid: int
    gids: tuple[int, ...]  # primary first, then supplementary
    source: str
    # Group services past /etc/group that libc also asks (nsswitch.conf group: sss, ldap...): a
    # job user's supplementary groups read from /etc/group may then miss some. () when complete.
    groups_elsewhere: tuple[str, ...] = ()


class GpuDirectFacts(Struct, frozen=True):
    """What the node has of each GPUDirect path. ``None`` in a field means unknown (its source
    could not be read or was not captured; the reason is in ``problems``), never "absent"."""

    nvidia_driver: str | None  # /sys/module/nvidia/version; "unknown" when loaded without one
    nvidia_loaded: bool | None  # /sys/module/nvidia or /proc/driver/nvidia/version exists
    driver_flavour: str | None  # "open" | "proprietary" from /proc/driver/nvidia/version
    nvidia_gpus: int | None  # entries in /proc/driver/nvidia/gpus
    kernel_release: str | None  # /proc/sys/kernel/osrelease
    peer_memory_files: tuple[str, ...]  # which of _PEER_MEMORY_FILES exist
    peer_memory_unknown: tuple[str, ...]  # which of them could not be looked up
    nv_peer_mem_loaded: bool | None  # /sys/module/nv_peer_mem
    rdma_devices: tuple[str, ...] | None  # /sys/class/infiniband
    gdrdrv_loaded: bool | None  # /sys/module/gdrdrv
    gdrdrv_node: DeviceNode | None  # /dev/gdrdrv; None when absent or unknown (see problems)
    job_identity: JobIdentity | None
    problems: tuple[str, ...]  # "path: reason" of everything that could not be read

    def why(self, path: str) -> str:
        """The recorded problem of ``path`` (or of the first unreadable thing when none names it)."""
        prefix = f"{path}: "
        named = [problem for problem in self.problems if problem.startswith(prefix)]
        return (named or list(self.problems) or [f"{path}: not read"])[0]


# /proc/driver/nvidia/version's first line: "NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05 ..."
# for the proprietary modules, "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  535.104.05 ..."
# for the open ones.
_NVRM_LINE = re.compile(r"NVRM version: NVIDIA UNIX (?P<open>Open )?.{0,40}?Kernel Module")


def parse_driver_flavour(text: str) -> str | None:
    """"open" or "proprietary"; None for text that is neither form (a damaged file says nothing)."""
    match = _NVRM_LINE.search(text)
    if match is None:
        return None
    return "open" if match.group("open") else "proprietary"


def parse_status_ids(text: str) -> tuple[int, tuple[int, ...]] | None:
    """Real uid and gids (primary, then supplementary) from ``/proc/<pid>/status``."""
    fields = {}
    for line in text.splitlines():
        name, _, value = line.partition(":")
        fields[name] = value.split()
    try:
        uid = int(fields["Uid"][0])
        gids = [int(fields["Gid"][0])] + [int(item) for item in fields.get("Groups", [])]
    except (KeyError, IndexError, ValueError):
        return None
    return uid, tuple(dict.fromkeys(gids))


def access_decided(node: DeviceNode, identity: JobIdentity) -> bool | None:
    """Whether ``identity`` can open ``node`` read-write; None when only a membership in the
    node's group would allow it and the groups were read where some may be missing
    (``groups_elsewhere``)."""
    if can_read_write(node, identity):
        return True
    group_bits = stat_codes.S_IRGRP | stat_codes.S_IWGRP
    if identity.groups_elsewhere and node.uid != identity.uid and node.gid not in identity.gids and node.mode & group_bits == group_bits:
        return None
    return False


def membership_unknown(node: DeviceNode, identity: JobIdentity) -> str:
    """Why ``access_decided`` could not decide, for a finding's reason."""
    return (
        f"{node.path} is read-write for group {node.gid} only, and whether uid {identity.uid} is in it is unknown: "
        f"/etc/group does not list it, and the group database also asks {', '.join(identity.groups_elsewhere)} (nsswitch.conf)"
    )


def can_read_write(node: DeviceNode, identity: JobIdentity) -> bool:
    """Classic Unix permission check for opening ``node`` O_RDWR as ``identity``."""
    if identity.uid == 0:
        return True
    if node.uid == identity.uid:
        bits = stat_codes.S_IRUSR | stat_codes.S_IWUSR
    elif node.gid in identity.gids:
        bits = stat_codes.S_IRGRP | stat_codes.S_IWGRP
    else:
        bits = stat_codes.S_IROTH | stat_codes.S_IWOTH
    return node.mode & bits == bits


def read_job_identity(reader: FactReader, job_environ: dict[str, str]) -> JobIdentity | None:
    """Who opens device files for the job: a prolog runs as root for another user's job."""
    own = parse_status_ids(reader.text("/proc/self/status") or "")
    job_uid = job_environ.get("SLURM_JOB_UID", "")
    if is_number(job_uid) and (own is None or int(job_uid) != own[0]):
        gids = [int(job_environ["SLURM_JOB_GID"])] if is_number(job_environ.get("SLURM_JOB_GID", "")) else []
        user = job_environ.get("SLURM_JOB_USER", "")
        elsewhere: tuple[str, ...] = ()
        if user:
            known, groups = reader.known_text("/etc/group")
            if not known:
                return None  # supplementary groups unknown: permissions cannot be judged
            gids += parse_group_membership(groups or "", user)
            elsewhere = _group_services_elsewhere(reader, groups or "")
        return JobIdentity(int(job_uid), tuple(dict.fromkeys(gids)), "SLURM_JOB_UID, SLURM_JOB_GID, /etc/group", elsewhere)
    if own is None:
        return None
    return JobIdentity(own[0], own[1], "/proc/self/status")


def _group_services_elsewhere(reader: FactReader, group_text: str) -> tuple[str, ...]:
    """The group services past /etc/group libc asks (``groups_beyond_files``); an unreadable
    nsswitch.conf says nothing of them, so it counts as one ("nsswitch.conf unread")."""
    try:
        nsswitch = read_as_glibc(reader.fs, NSSWITCH_CONF)
    except SourceError as error:
        reader.problems.append(str(error))
        return ("nsswitch.conf unread",)
    return groups_beyond_files(nsswitch or "", group_text)


@probe("gpudirect")
def probe_gpudirect(fs: NodeFS) -> GpuDirectFacts:
    """Gather the kernel pieces GPUDirect RDMA and GDRCopy need."""
    reader = FactReader(fs)
    version = reader.text("/sys/module/nvidia/version")
    flavour_known, flavour_text = reader.known_text("/proc/driver/nvidia/version")
    release = reader.text("/proc/sys/kernel/osrelease")
    node = None
    try:
        stat = fs.stat("/dev/gdrdrv")
    except SourceError as error:
        reader.problems.append(str(error))
        stat = None
    if stat is not None:
        node = DeviceNode("/dev/gdrdrv", stat.mode, stat.uid, stat.gid)
    try:
        environ: dict[str, str] | None = parse_environ(fs.read_bytes("/proc/self/environ") or b"")
    except SourceError as error:
        reader.problems.append(str(error))
        environ = None
    # The driver creates /sys/module/nvidia and /proc/driver/nvidia/{version,gpus/}; a capture
    # may hold only some of them, and either one read says "loaded". "Not loaded" needs
    # /sys/module read: a capture without it and with a partial /proc (no /proc/driver) would
    # otherwise say "not loaded" beside NVML's answers from the same node.
    gpus = reader.listing("/proc/driver/nvidia/gpus")
    procfs = bool(flavour_known and flavour_text is not None) or bool(gpus)
    module = reader.presence("/sys/module/nvidia")
    loaded = True if module or procfs else (False if module is False else None)
    peer = {path: reader.presence(path) for path in _PEER_MEMORY_FILES}
    flavour = parse_driver_flavour(flavour_text) if flavour_text else None
    if flavour_text and flavour is None:
        reader.problems.append("/proc/driver/nvidia/version: no 'NVRM version: NVIDIA UNIX ... Kernel Module' line")
    return GpuDirectFacts(
        nvidia_driver=version.strip() if version else ("unknown" if loaded else None),
        nvidia_loaded=loaded,
        driver_flavour=flavour,
        nvidia_gpus=None if gpus is None else len(gpus),
        kernel_release=release.strip() if release else None,
        peer_memory_files=tuple(path for path, there in peer.items() if there),
        peer_memory_unknown=tuple(path for path, there in peer.items() if there is None),
        nv_peer_mem_loaded=reader.presence("/sys/module/nv_peer_mem"),
        rdma_devices=_tuple_or_none(reader.listing("/sys/class/infiniband")),
        gdrdrv_loaded=reader.presence("/sys/module/gdrdrv"),
        gdrdrv_node=node,
        job_identity=read_job_identity(reader, environ) if environ is not None else None,
        problems=tuple(reader.problems),
    )


def _tuple_or_none(items: list[str] | None) -> tuple[str, ...] | None:
    return None if items is None else tuple(items)
