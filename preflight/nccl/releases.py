"""NCCL releases with known bugs: which releases carry each bug and which release fixed it.

Data only, shared by ``nccl_versions`` and ``gpudirect`` (kept apart from both so that neither
imports the other's dependencies). Each row is read off NCCL's release notes (the annotated
``v2.X.Y-1`` tags of NVIDIA/nccl) and the issue that reported the bug; the reference named in the
row explains it. A row says nothing about whether the bug can bite on a given node: the checks
that use it decide that from the node's hardware and the job's settings.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

from msgspec import Struct
from msgspec.structs import replace

from preflight.model import Evidence, NotApplicable, Observation, Severity, Unknown, present, undecided
from preflight.probes.nccl_libs import NcclCopy, NcclLibFacts


class KnownBug(Struct, frozen=True):
    reference_id: str
    first: str  # first release that carries the bug
    fixed: str  # first release without it
    bug: str  # one line: what goes wrong


# fmt: off
#: NVLS and NVLS-Tree across nodes on dual-port NICs: heap corruption or hangs, reported on 2.18.5
#: and 2.19.3 (NVIDIA/nccl#1043, #1035); NVLS-Tree arrived in 2.18.1; 2.20.3 stopped counting a
#: head GPU twice ("Duplicate head is not allowed", src/graph/connect.cc).
NVLS_DUAL_PORT = KnownBug("NVL005", "2.18.1", "2.20.3", "multi-node NVLS with both ports of dual-port NICs corrupts the heap or hangs")


#: socketStartConnect retried connect() on the socket that had just failed, which Linux answers
#: with ECONNABORTED, from 2.16.2 (first release with socketStartConnect) until 2.24.3 ("Avoid
#: 'Software caused connection abort' errors on retries").
CONNECT_RETRY = KnownBug("SOCK002", "2.16.2", "2.24.3", "a refused or timed-out connect is retried on the failed socket and ends in ECONNABORTED")


#: ncclCommSplit (2.18.1) with non-blocking communicators: 2.26.2 fixed a non-blocking creation
#: race, 2.27.3 multithreaded non-blocking init and memory corruption in split with shared resources.
SPLIT_NONBLOCKING = KnownBug("NCCL018", "2.18.1", "2.27.3", "races in non-blocking communicator creation and in ncclCommSplit")


#: The RAS thread (2.24.3) read peers of communicators still initialising; fixed in 2.27.3
#: (issues #1669, #1718).
RAS_INIT_RACE = KnownBug("NCCL013", "2.24.3", "2.27.3", "a RAS status query during communicator init reads peer data not yet filled in")


#: MNNVL (inter-node NVLink) arrived in 2.20.3; 2.28.3 raises the thread stack to 8192 KB itself
#: when RLIMIT_STACK is unlimited or smaller (setCpuStackSize in src/init.cc, NVIDIA/nccl#2186).
MNNVL_STACK = KnownBug("NVL002", "2.20.3", "2.28.3", "NCCL's threads get glibc's 2 MiB stack when the stack limit is unlimited")


#: Alltoall-like traffic (MoE dispatch and combine) could hang on MNNVL systems beyond 80 ranks; the
#: v2.26.5-1 release notes work around it and v2.27.3-1 lists the fix. MNNVL arrived in 2.20.3.
MNNVL_ALLTOALL = KnownBug("NVL001", "2.20.3", "2.26.5", "alltoall-like traffic can hang on multi-node NVLink beyond 80 ranks")


#: NVLS graph search read past its NIC array on 2.18.3 (NVIDIA/nccl#931), fixed in 2.18.5.
NVLS_SEARCH = KnownBug("TOPO003", "2.18.3", "2.18.5", "the NVLS graph search reads past its NIC array and crashes")


#: Topology detection without PCI link speeds (VMs) was not deterministic; 2.19.4 "Make topology
#: detection more deterministic when PCI speeds are not available" (issue #1020).
PCI_SPEED_DETECTION = KnownBug("TOPO003", "2.18.3", "2.19.4", "topology detection guesses differently between runs when sysfs has no PCI link speed")


#: Before 2.23.4 NCCL tested only /sys/kernel/mm/memory_peers/nv_mem{,_nc}/version for GPUDirect
#: RDMA, not /sys/module/nvidia_peermem/version ("Add new check for nvidia peermem").
PEERMEM_DETECTION = KnownBug("GDR001", "0", "2.23.4", "GPUDirect RDMA is reported disabled when only nvidia_peermem (no memory_peers client) is loaded")


#: Before 2.31.2 GDRCopy meant libgdrapi and the gdrdrv driver only. From 2.31.2 (read in the
#: released libraries' messages and the 2.31.0a7 development sources, src/misc/gdrwrap.cc) NCCL
#: maps GPU memory through DMA-BUF itself when gdr_open fails, and NCCL_GDRCOPY_USE_INTERNAL_DMABUF
#: = 1 or 2 skips libgdrapi altogether.
GDRCOPY_NEEDS_GDRDRV = KnownBug("GDR002", "0", "2.31.2", "GDRCopy works only through the gdrdrv driver (no DMA-BUF stand-in)")


KNOWN_BUGS = (NVLS_DUAL_PORT, CONNECT_RETRY, SPLIT_NONBLOCKING, RAS_INIT_RACE, MNNVL_STACK, MNNVL_ALLTOALL, NVLS_SEARCH, PCI_SPEED_DETECTION, PEERMEM_DETECTION, GDRCOPY_NEEDS_GDRDRV)


def version_tuple(text: str) -> tuple[int, ...] | None:
    """``"2.21.5"`` -> ``(2, 21, 5)``; NCCL versions are plain dotted numbers."""
    return tuple(int(part) for part in text.split(".")) if re.fullmatch(r"\d+(?:\.\d+)*", text) else None


def carries(bug: KnownBug, version: str) -> bool:
    """Whether release ``version`` is in ``[bug.first, bug.fixed)``."""
    release, first, fixed = version_tuple(version), version_tuple(bug.first), version_tuple(bug.fixed)
    return release is not None and first is not None and fixed is not None and first <= release < fixed


def loaded_copies(libs: NcclLibFacts) -> NcclLibFacts:
    """``libs`` without the versioned files no loader picks (``NcclCopy.unreached``): a release
    bug in a file left over beside the one ``libnccl.so.2`` links to bites no job. NotApplicable
    when those are all the node holds (the file the link reaches lies in a directory not searched)."""
    loaded = tuple(copy for copy in libs.copies if not copy.unreached)
    if libs.copies and not loaded:
        stale = libs.copies[0]
        raise NotApplicable(f"every libnccl found is a file no loader picks: {stale.path} ({stale.unreached})")
    return replace(libs, copies=loaded)


#: Why a node has no NCCL to judge, and where it was looked for.
NO_NCCL = (
    "no libnccl on this node's library path or in its Python or conda environments (a stack that links NCCL "
    "by RPATH alone and names it nowhere in the job's environment, as Spack's views do, is not searched)"
)


def require_nccl(libs: NcclLibFacts) -> None:
    """NotApplicable without any NCCL; Unknown when none was found but some place was unreadable."""
    if not libs.copies:
        if libs.problems:
            raise Unknown(f"no libnccl found, and {libs.problems[0]}")
        raise NotApplicable(NO_NCCL)


def affected(libs: NcclLibFacts, bug: KnownBug) -> tuple[list[NcclCopy], list[NcclCopy]]:
    """Copies whose release carries ``bug``, and copies whose release the node does not name;
    files no loader picks (``NcclCopy.unreached``) are neither: their bugs bite no job."""
    loaded = [copy for copy in libs.copies if not copy.unreached]
    carrying = [copy for copy in loaded if copy.version is not None and carries(bug, copy.version)]
    unnamed = [copy for copy in loaded if copy.version is None]
    return carrying, unnamed


def release_evidence(copy: NcclCopy, bug: KnownBug) -> Evidence:
    return Evidence(copy.path, f"NCCL {copy.version}: {bug.bug}", f"NCCL {bug.fixed} or newer")


def bypassed_fix(copy: NcclCopy) -> str:
    """What to say of a release bug in a copy the node's PyTorch does not load (information)."""
    return f"Not what PyTorch loads here: {copy.bypassed}. Upgrade or remove it if other programs use it."


def release_findings(
    libs: NcclLibFacts, bug: KnownBug, *context: Evidence, severity: Severity | None = None, fix: str = ""
) -> Iterator[Observation]:
    """A finding per copy carrying ``bug``; ``unknown`` per copy whose release is not named."""
    carrying, unnamed = affected(libs, bug)
    for copy in carrying:
        if copy.bypassed:
            yield present(copy.path, release_evidence(copy, bug), *context, severity=Severity.INFO, fix=bypassed_fix(copy))
            continue
        yield present(copy.path, release_evidence(copy, bug), *context, severity=severity, fix=fix)
    for copy in unnamed:
        yield undecided(copy.path, f"the NCCL release of {copy.path} is not named by its file or wheel", *context)
