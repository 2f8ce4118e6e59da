"""When NCCL uses GPUDirect RDMA between a GPU and a NIC (reference ROCE002).

NCCL's rule, ``ncclTopoCheckGdr`` in ``src/graph/paths.cc`` (read at v2.18.1-1, v2.22.3-1,
v2.26.2-1, v2.27.3-1 and v2.30.7-1; unchanged in substance across them):

* The distance is the path type from the GPU to the NET node NCCL assigned to it
  (``gpu->paths[NET][n].type``). NCCL gives each GPU the NICs nearest to it, so on a node where
  a GPU's nearest usable NIC is too far, every NIC it could be given is too far.
* GDR is refused when that distance is greater than the level: ``NCCL_NET_GDR_LEVEL`` if set,
  else PXB (since 2.29 ``NCCL_NET_GDR_C2C`` makes the default P2C, which on a PCIe-only host
  accepts exactly what PXB accepts: PIX and PXB, not PHB or SYS).
* A path of type PXN (the GPU reaches the NIC through an NVLink-connected peer GPU that sits
  close to it, set up when ``NCCL_PXN_DISABLE`` is not 1) is judged with the peer's distance.
  NCCL builds such a path only when the peer is within PXB of the NIC and GDR is allowed for
  the peer (the PXN block of ``ncclTopoComputePaths``).
* ``NCCL_NET_GDR_LEVEL`` is read by ``ncclGetLevel``: the value compared exactly (``strcmp``,
  so upper case only) with the path names, else, when it starts with a digit, an old-style
  number (``strtol``, base 0): 0 LOC, 1 PIX, 2 PXB, 3 PHB, 4 and above SYS. Anything else is
  ignored and the default applies.
* ``NCCL_NET_GDR_READ=0`` turns GDR off for the sending side (``read``) whatever the distance.

The path types in NCCL's order (``src/include/graph.h`` at v2.30.7-1; C2C arrived in 2.26 and
P2C in 2.27, and a release that lacks a name ignores it). PIX < PXB < PHB < SYS, the only types a
GPU-to-NIC path on a PCIe host can have, keep that order in every release.
"""

from __future__ import annotations

from preflight.nccl.gid import nccl_int
from preflight.units import is_number

#: NCCL's path types, nearest first (``PATH_LOC`` .. ``PATH_SYS`` at v2.30.7-1).
NCCL_PATHS = ("LOC", "NVL", "NVB", "C2C", "PIX", "PXB", "P2C", "PXN", "PHB", "SYS")


PATH_RANK = {name: rank for rank, name in enumerate(NCCL_PATHS)}


#: ``levelsOldToNew``: the numbers NCCL_NET_GDR_LEVEL took before path names.
_OLD_LEVELS = ("LOC", "PIX", "PXB", "PHB", "SYS", "SYS")


DEFAULT_GDR_LEVEL = "PXB"


#: The farthest a PXN peer may sit from the NIC (``pxnType``: PXB, or P2C on C2C hosts).
PXN_PEER_LIMIT = "PXB"


def gdr_level(value: str | None) -> str | None:
    """The level ``NCCL_NET_GDR_LEVEL=value`` sets, or None when NCCL ignores it (unset, a name
    in the wrong case, garbage): the default then applies."""
    if value is None:
        return None
    if value in PATH_RANK:
        return value
    if is_number(value[:1]):
        number = nccl_int(value, 0)
        return _OLD_LEVELS[min(max(number, 0), len(_OLD_LEVELS) - 1)]
    return None


def within(path: str, level: str) -> bool:
    """Whether NCCL allows GDR over a path of type ``path`` at ``level`` (``distance <= level``)."""
    return PATH_RANK[path] <= PATH_RANK[level]
