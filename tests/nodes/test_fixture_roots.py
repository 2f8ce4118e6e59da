"""Recorded roots must mean the same in a fresh clone as in the tree that generated them, and give
the problems planted in them and no other."""

from __future__ import annotations

import os
from pathlib import Path

from preflight.discovery import build_registry
from preflight.model import Severity, Status

from reliability_harness import recorded_roots, run_root

REPO = Path(__file__).resolve().parents[2]
ROOTS = (REPO / "tests" / "fixtures" / "nodes", REPO / "examples" / "nodes")


def test_no_recorded_root_holds_an_empty_directory() -> None:
    """git keeps no empty directories: a probe that lists one (/sys/class/iommu/<unit>, an empty
    GID table) would see it here and not in CI's clone. Generators must put a file inside."""
    empty = [
        str(Path(directory).relative_to(REPO))
        for base in ROOTS
        for directory, subdirectories, files in os.walk(base)
        if not subdirectories and not files
    ]
    assert empty == []


# Every finding at error or above that a recorded root gives, and nothing else: each is a plant
# its generator's docstring describes (a root with nothing planted there gives none). A new
# false alarm on a recorded root fails here before it drains anyone's node.
PLANTED_ERRORS: dict[str, set[tuple[str, str]]] = {
    "hgx-h100": {("DNS001", "gpu017"), ("GDR001", "node"), ("MEM001", "slurmd"),  # GDR002 (gdrdrv) is a warning
                 ("MEM002", "NCCL_BUFFSIZE"), ("PCI001", "bridge 0000:5c:00.0")},
    "a100-pcie4": set(),  # healthy as recorded; its tests plant problems in copies
    "container-bridge": {("NET001", "eth0")},
    "container-roce": {("IB007", "/dev/infiniband")},
    "degraded-b200": {("IB004", "NCCL IB selection"), ("IB004", "NCCL_IB_HCA 'mlx5_1'"), ("IB004", "mlx5_7/1"),
                      ("IB009", "mlx5_2/1"), ("IB009", "mlx5_7/1")},
    "dns-peers": set(),  # its problems come from the DNS server the tests start
    "dns-stub-container": {("DNS001", "nameserver 127.0.0.53")},
    "efa-p4d": {("EFA001", "FI_PROVIDER")},
    "gb200-mnnvl": {("NVL002", "/usr/lib/aarch64-linux-gnu/libnccl.so.2.27.5")},
    "gb200-tray": set(),  # NCCL013 (NCCL 2.26.5) warns: only a RAS query crashes it
    "h800-dual-port": {("NVL005", "/usr/lib/x86_64-linux-gnu/libnccl.so.2.19.3")},
    "ib-no-sm": {(ref, f"mlx5_{n}/1") for ref in ("IB008", "IB009") for n in range(4)},
    "ipoib-link-local": {("NET003", "ib0")},
    "multirail-same-subnet": {("NET005", f"ens{n}f0np0") for n in (2, 3, 4)},
    "no-route-to-master": {("NET004", "10.70.0.5")},  # and 10.80.1.1 with its site config (test_net_recorded)
    # SOCK001 warns (the job names no MASTER_PORT), SOCK005 too: most held ports are TIME_WAIT's.
    "ports-exhausted": set(),
    # NET001 warns: the pod's eth0 is a container veth, whose address the CNI routes between nodes.
    "roce-macvlan-pod": {("ROCE005", "mlx5_0/1")},
    "roce-mtu4096": {("ROCE006", "RoCE rails")},
    "roce-pfc-misconfigured": {("ROCE001", "RoCE rails"), ("ROCE001", "ens1f0np0")},
    "roce-v1v2": set(),  # two healthy rails
    "rtx5090-workstation": set(),  # NCCL013 (NCCL 2.26.2) warns: only a RAS query crashes it
    # NCCL015 warns: a forced Tree is a tuning choice, at three nodes too.
    "srun-torchrun-per-gpu": {("TORCH004", "MASTER_ADDR"), ("TORCH010", "launcher")},
    "vllm-container": {("VLLM001", "/dev/shm")},
    "vm-no-link-speed": set(),  # TOPO003 is a warning
}


def test_recorded_roots_give_their_planted_errors_and_nothing_else() -> None:
    registry = build_registry(plugins=False)
    roots = {root.name: root for root in recorded_roots()}
    assert set(roots) == set(PLANTED_ERRORS)
    for name, root in roots.items():
        errors = {
            (f.reference_id, f.subject) for f in run_root(registry, root).findings
            if f.status is Status.PRESENT and f.severity in (Severity.ERROR, Severity.CRITICAL)
        }
        assert errors == PLANTED_ERRORS[name], name
