"""The RDMA devices NCCL's topology search passes over when NCCL_IB_HCA leaves it every port
(:mod:`preflight.nccl.net_choice` has the model and its sources). Built from the rdma and pcie
probes' facts, once per run, for the RoCE and IB checks that leave those devices out."""

from __future__ import annotations

from collections.abc import Mapping

from msgspec import Struct

from preflight.model import Unread
from preflight.nccl.net_choice import passed_over
from preflight.probes.pcie import PcieFacts
from preflight.probes.rdma import RdmaFacts
from preflight.registry import probe


class NcclNetsFacts(Struct, frozen=True):
    passed_over: tuple[tuple[str, str], ...]  # (device, why), in device order


@probe("nccl_nets")
def probe_nccl_nets(rdma: RdmaFacts, pcie: PcieFacts) -> NcclNetsFacts:
    """Which RDMA devices no GPU would take as its network device."""
    return NcclNetsFacts(tuple(sorted(passed_over(rdma, pcie).items())))


def skipped_devices(nets: NcclNetsFacts | Unread) -> Mapping[str, str]:
    """{device: why} NCCL passes over; nothing where the probe failed (every port then counts)."""
    return {} if isinstance(nets, Unread) else dict(nets.passed_over)
