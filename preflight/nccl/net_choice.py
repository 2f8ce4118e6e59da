"""RDMA devices NCCL's topology search passes over when NCCL_IB_HCA leaves it every port
(references ROCE001, ROCE002, ROCE004-ROCE006, IB004, IB005).

NCCL initialises every ACTIVE InfiniBand or Ethernet port, but it connects on a port only once its
topology search has made that port a GPU's network device. For each GPU, ``ncclTopoGetLocal``
(``src/graph/topo.cc``, NCCL 2.30) keeps the NICs of the highest path bandwidth and, among those,
the nearest path type; channels then cycle through them (``ncclTopoGetLocalNet``). A RoCE port's
GID table is read only when a connection is made on it (``ncclIbGetGidIndex`` is called from
``src/transport/net_ib/connect.cc``, not at init), and a link-layer mix is refused only within
one connection or against the peer's device of that connection (the "incompatible devices"
warnings there). So a front-end port several times slower than the rails beside it, such as the
accelerated-networking function ``mlx5_an0`` of Azure's ND-series VMs next to eight 400 Gb/s
InfiniBand functions, carries no NCCL traffic, and its empty GID table breaks nothing.

The model, kept on the safe side of NCCL's: a port is passed over when, for every GPU, another
port on a path that stays on the GPU's socket (PIX, PXB or PHB) beats it: at least twice as fast
and at least as near, or as fast and nearer. Twice, because a path's bandwidth is that of its
slowest link and a PCIe link can be narrower than its NIC; as fast and nearer, because equal
bandwidths leave the choice to the nearer path type (a DGX H100's storage ports on CPU root
ports beside the rails under the GPUs' switches); on the GPU's socket, because a cross-socket
path's bandwidth is the inter-CPU link's, on which a slow and a fast port can tie.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from preflight.nccl.ib import NCCL_LINK_LAYERS
from preflight.probes.pcie import LINK_RANK, PcieFacts, PciEndpoint, path_class
from preflight.probes.rdma import PORT_ACTIVE, RdmaFacts

#: How many times faster the port that takes a GPU's traffic must be.
FASTER = 2.0
SAME_SOCKET = ("PIX", "PXB", "PHB")


def passed_over(rdma: RdmaFacts, pcie: PcieFacts) -> Mapping[str, str]:
    """{device: why} for the RDMA devices none of whose ACTIVE ports NCCL's topology search would
    make any GPU's network device; {} where that is not known (no GPU seen, or no port placed).
    The nccl_nets probe asks it once per run."""
    if not pcie.gpus:
        return {}
    endpoint_of = {name: nic for nic in pcie.nics for name in nic.rdma_devices}
    ports: list[tuple[str, float, PciEndpoint]] = []  # (device, Gb/s, its PCI function)
    for device in rdma.devices:
        nic = endpoint_of.get(device.name)
        for port in device.ports:
            if port.state == PORT_ACTIVE and port.link_layer in NCCL_LINK_LAYERS and port.rate is not None and nic is not None:
                ports.append((device.name, port.rate.gbps, nic))
    classes: dict[tuple[str, str], str] = {}

    def path(gpu: PciEndpoint, nic: PciEndpoint) -> str:
        key = (gpu.bdf, nic.bdf)
        if key not in classes:
            classes[key] = path_class(gpu, nic, pcie.sockets)
        return classes[key]

    skipped: dict[str, str] = {}
    for device in rdma.devices:
        mine = [(rate, nic) for name, rate, nic in ports if name == device.name]
        active = [port for port in device.ports if port.state == PORT_ACTIVE and port.link_layer in NCCL_LINK_LAYERS]
        if not mine or len(mine) != len(active):
            continue  # no port NCCL keeps, or one whose rate or place is unknown
        first = ""
        for gpu in pcie.gpus:
            for rate, nic in mine:
                winner = _winner(path, gpu, rate, nic, device.name, ports)
                if not winner:
                    break
                first = first or winner
            else:
                continue
            break  # some GPU may take one of its ports
        else:
            skipped[device.name] = (
                f"{device.name} is passed over by NCCL's topology search: every GPU has a port faster and as near, "
                f"or as fast and nearer ({first})"
            )
    return skipped


def _winner(
    path: Callable[[PciEndpoint, PciEndpoint], str], gpu: PciEndpoint, rate: float, nic: PciEndpoint, device: str,
    ports: list[tuple[str, float, PciEndpoint]],
) -> str:
    """The port NCCL would take for ``gpu`` among those it prefers to (rate, nic), described (the
    nearest, then the fastest: the GPU's own rail, not whichever port is listed first); "" when
    there is none."""
    own = LINK_RANK[path(gpu, nic)]
    better: list[tuple[int, float, str, str]] = []
    for name, other_rate, other in ports:
        if name == device or other_rate < rate:
            continue
        kind = path(gpu, other)
        if kind in SAME_SOCKET and (LINK_RANK[kind] < own or (other_rate >= FASTER * rate and LINK_RANK[kind] <= own)):
            better.append((LINK_RANK[kind], -other_rate, name, kind))
    if not better:
        return ""
    _, speed, name, kind = min(better)
    return f"GPU {gpu.bdf}: {name}, {-speed:g} Gb/s, {kind}"
