"""Which RDMA devices NCCL's topology search passes over when NCCL_IB_HCA is unset: a slow
front-end function beside the rails (Azure's mlx5_an0 next to eight 400 Gb/s InfiniBand VFs)
is never a GPU's network device, so its empty GID table, its link layer and its place in the
device order are judged for no job (ROCE005, IB004, IB005). Facts are the example node's, with
one more function added the way the probes would report it."""

from __future__ import annotations

import pytest
from msgspec.structs import replace

from preflight.checks.ib import ib_device_order_differs_across_nodes, ib_hca_selection_mismatch
from preflight.checks.roce import roce_gid_index_mismatch, roce_gpudirect_rdma_not_used
from preflight.config import Expectations
from preflight.model import NotApplicable
from preflight.nccl.net_choice import passed_over
from preflight.probes.nccl_nets import probe_nccl_nets
from preflight.probes.job import JobFacts
from preflight.probes.nccl_libs import NcclLibFacts
from preflight.probes.nvlink import probe_nvlink
from preflight.probes.pcie import PcieFacts, probe_pcie
from preflight.probes.rdma import PortRate, RdmaFacts, probe_rdma
from preflight.sources import NodeFS, Sources

from conftest import EXAMPLE_ROOT
from test_roce_checks import facts, port

FS = NodeFS(str(EXAMPLE_ROOT))
RDMA, PCIE = probe_rdma(FS), probe_pcie(FS)
FRONT_END = "0000:b1:00.0"


def with_front_end(gbps: float, numa: int | None = 0, chain: tuple[str, ...] = ("0000:b0:01.0",)) -> tuple[RdmaFacts, PcieFacts]:
    """The example node plus an Ethernet function ``mlx5_an0`` of ``gbps`` on NUMA node ``numa``,
    on a root port of its own (no switch shared with a GPU) unless ``chain`` says otherwise."""
    rail = RDMA.devices[0]
    link = replace(rail.ports[0], device="mlx5_an0", link_layer="Ethernet", rate=PortRate(gbps, 1, "EDR"))
    device = replace(rail, name="mlx5_an0", path="/sys/class/infiniband/mlx5_an0", pci_address=FRONT_END, ports=(link,), netdevs=("enP1s1",))
    nic = replace(PCIE.nics[0], bdf=FRONT_END, chain=chain, numa_node=numa, rdma_devices=("mlx5_an0",))
    return replace(RDMA, devices=(device, *RDMA.devices)), replace(PCIE, nics=(*PCIE.nics, nic))


def test_a_slow_front_end_function_is_passed_over_and_a_rail_is_not() -> None:
    rdma, pcie = with_front_end(40)
    skipped = passed_over(rdma, pcie)
    assert list(skipped) == ["mlx5_an0"] and "every GPU has a port faster and as near, or as fast and nearer (GPU 0000:18:00.0: mlx5_0, 400 Gb/s, PIX)" in skipped["mlx5_an0"]
    # As fast as a rail but farther from every GPU than its rail (a DGX H100's storage ports on
    # CPU root ports): equal bandwidths leave the choice to the nearer path, the rail's.
    assert list(passed_over(*with_front_end(400))) == ["mlx5_an0"]
    # Under a GPU's own switch, as near as that GPU's rail: NCCL may well use it, at any speed
    # above half a rail's (a narrow PCIe link could tie them).
    rail_switch = PCIE.nics[0].chain
    assert passed_over(*with_front_end(400, chain=rail_switch)) == {}
    assert passed_over(*with_front_end(250, chain=rail_switch)) == {}
    assert list(passed_over(*with_front_end(100, chain=rail_switch))) == ["mlx5_an0"]
    assert list(passed_over(*with_front_end(40, numa=None))) == ["mlx5_an0"]  # wherever it is, PIX rails win
    assert passed_over(rdma, replace(pcie, gpus=())) == {}  # no GPU seen: nothing is known to win


def test_the_port_named_is_the_one_the_gpu_takes() -> None:
    """The example in the reason is the GPU's own rail (nearest, then fastest), not the first port
    listed that beats the passed-over one: on a DGX B200 that was an NVSwitch management function
    (mlx5_0, PHB) instead of the GPU's rail under its own switch."""
    rdma, pcie = with_front_end(40)
    far, far_nic = replace(rdma.devices[0], name="mlx5_a0", pci_address="0000:b2:00.0"), replace(pcie.nics[-1], bdf="0000:b2:00.0", chain=("0000:b2:01.0",), rdma_devices=("mlx5_a0",))
    far = replace(far, ports=tuple(replace(p, device="mlx5_a0", link_layer="InfiniBand", rate=PortRate(400, 4, "NDR")) for p in far.ports))
    skipped = passed_over(replace(rdma, devices=(far, *rdma.devices)), replace(pcie, nics=(*pcie.nics, far_nic)))
    assert "(GPU 0000:18:00.0: mlx5_0, 400 Gb/s, PIX)" in skipped["mlx5_an0"]


def test_only_a_path_on_the_gpus_socket_wins() -> None:
    """Across sockets the inter-CPU link sets a path's bandwidth, and a slow port can tie there
    with a fast one: rails that are all on the other socket from the GPUs win nothing."""
    rdma, pcie = with_front_end(40)
    rails = tuple(replace(nic, numa_node=1, chain=("0000:c0:01.0",)) for nic in pcie.nics if nic.bdf != FRONT_END)
    far = replace(pcie, nics=(*rails, pcie.nics[-1]), gpus=tuple(replace(gpu, numa_node=0) for gpu in pcie.gpus))
    assert passed_over(rdma, far) == {}


STEP = JobFacts({"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0"}, "", ())  # a job step that sets no NCCL_IB_HCA


def test_checks_leave_a_passed_over_port_out_only_where_nccl_ib_hca_is_unset() -> None:
    rdma, pcie = with_front_end(40)
    nets = probe_nccl_nets(rdma, pcie)
    assert [device for device, _ in nets.passed_over] == ["mlx5_an0"]
    empty = facts(port(device="mlx5_an0", entries=[], netdev="enP1s1"))  # no address on its netdev: no GID
    with pytest.raises(NotApplicable, match="passed over by NCCL's topology search"):
        list(roce_gid_index_mismatch(empty, STEP, Expectations(), nets))
    assert [o.severity for o in roce_gid_index_mismatch(empty, STEP, Expectations())] == [None]  # without the facts: an error
    named = JobFacts({**STEP.environ, "NCCL_IB_HCA": "=mlx5_an0"}, "", ())
    assert [o.subject for o in roce_gid_index_mismatch(empty, named, Expectations(), nets)] == ["mlx5_an0/1"]
    # IB004: the IB/RoCE mix is only with a port NCCL leaves out; IB005: its name sorts first, no rail moves
    assert list(ib_hca_selection_mismatch(rdma, STEP, nets)) == []
    assert [o.subject for o in ib_hca_selection_mismatch(rdma, STEP)] == ["NCCL IB selection"]
    unsorted = NcclLibFacts((), ())
    assert list(ib_device_order_differs_across_nodes(rdma, STEP, unsorted, nets)) == []
    assert [o.subject for o in ib_device_order_differs_across_nodes(rdma, STEP, unsorted)] == ["node"]


def test_roce002_says_the_roce_port_is_passed_over_not_left_out_by_a_setting() -> None:
    """With NCCL_IB_HCA unset, a RoCE front end NCCL passes over makes ROCE002 not applicable for
    that reason: the reason named NCCL_IB_HCA, which nothing had set."""
    rdma, pcie = with_front_end(40)
    nets = probe_nccl_nets(rdma, pcie)
    nvlink = probe_nvlink(Sources.for_node(str(EXAMPLE_ROOT), None).nvml)
    with pytest.raises(NotApplicable, match="no ACTIVE RoCE port NCCL would use: mlx5_an0 is passed over"):
        list(roce_gpudirect_rdma_not_used(pcie, rdma, nvlink, STEP, nets))
