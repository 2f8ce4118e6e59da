"""Whether NCCL can build NVLS (NVLink SHARP) channels on a node at all.

NVLS needs more than NVSwitches: NCCL's graph search returns before it looks for an NVLS graph
when the node has no NVSwitch or the least capable GPU is below compute capability 9.0
(``ncclTopoCompute`` in src/graph/search.cc, since NVLS came in v2.18.1-1), and
``ncclNvlsInit`` then leaves NVLS off (src/transport/nvls.cc: the CUDA driver must also report
CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED, which Ampere GPUs never do). So the NVLS bugs of NCCL
2.18-2.20 cannot bite on an A100 board, whose gen-2 NVSwitches are PCI functions like Hopper's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from preflight.model import Unread

if TYPE_CHECKING:  # the p2p probe's module brings NVML's; its facts are only read here
    from preflight.probes.p2p import P2pFacts

#: The lowest compute capability NCCL builds NVLS channels for (Hopper).
NVLS_MIN_CAPABILITY = (9, 0)


def nvls_ruled_out(p2p: P2pFacts | Unread) -> str | None:
    """Why no NVLS channel can be built on this node, from the GPUs' compute capability (NVML);
    None when NVLS may run, or when a capability could not be read (nothing is ruled out then)."""
    if isinstance(p2p, Unread) or p2p.nvml_error or not p2p.gpus:
        return None
    capabilities = [gpu.compute_capability for gpu in p2p.gpus]
    if any(capability is None for capability in capabilities):
        return None
    lowest = min(capability for capability in capabilities if capability is not None)
    if lowest >= NVLS_MIN_CAPABILITY:
        return None
    return (f"the GPUs' compute capability is {lowest[0]}.{lowest[1]} (nvmlDeviceGetCudaComputeCapability): NCCL builds "
            f"NVLS channels only on {NVLS_MIN_CAPABILITY[0]}.{NVLS_MIN_CAPABILITY[1]} and later, so NVLS never runs here")
