"""Missing is not empty, case by case: each false alarm and false "fine" that a source missing
from a root used to cause, on a copy of the example node (or the RoCE fixture) with that source
taken away. ``tests/sources/test_capture_units.py`` guards the same for every unit and every check."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from preflight.probes.memlock import parse_limits_memlock
from preflight.config import HostConfig
from preflight.discovery import build_registry
from preflight.engine import Report, RunOptions, run
from preflight.sources import NodeFS, NotCaptured, Sources
from preflight.units import UNLIMITED

from conftest import REPO, write

ROCE = REPO / "tests" / "fixtures" / "nodes" / "roce-v1v2"
REGISTRY = build_registry(plugins=False)


def judge(root: Path, *select: str) -> dict[str, set[tuple[str, str]]]:
    report: Report = run(REGISTRY, Sources.for_node(str(root)), HostConfig(), RunOptions(profile="full", select=select), "node")
    found: dict[str, set[tuple[str, str]]] = {}
    for finding in report.findings:
        found.setdefault(finding.reference_id, set()).add((finding.status.value, finding.subject))
    return found


def statuses(found: dict[str, set[tuple[str, str]]], reference: str) -> set[str]:
    return {status for status, _ in found[reference]}


def test_the_kernels_page_rounded_infinity_is_unlimited() -> None:
    line = "Max locked memory         18446744073708503040 18446744073708503040 bytes\n"
    limit = parse_limits_memlock(line, "/proc/self/limits")
    assert limit is not None and limit.soft == limit.hard == UNLIMITED
    assert parse_limits_memlock("Max locked memory         8388608              8388608              bytes\n", "x").soft == 8 << 20  # type: ignore[union-attr]


def test_memlock_of_a_root_without_its_limits_is_unknown_not_fine(node_copy: Path) -> None:
    (node_copy / "proc/self/limits").unlink()
    assert ("unknown", "/proc/self/limits") in judge(node_copy, "MEM001")["MEM001"]


def test_nccl_ib_hca_is_not_unset_where_there_is_no_job_environment(node_copy: Path) -> None:
    (node_copy / "proc/self/environ").unlink()
    found = judge(node_copy, "IB003", "IB004", "IB005", "GDR002")
    for reference in ("IB003", "IB004", "IB005", "GDR002"):
        assert statuses(found, reference) == {"unknown"}, (reference, found[reference])


def test_an_unreadable_rdma_tree_is_unknown_not_inapplicable(node_copy: Path) -> None:
    ports = {f"/sys/class/infiniband/mlx5_{n}/ports": "EACCES" for n in range(8)}
    write(node_copy, "/.preflight/read-errors.json", json.dumps({"format": "preflight-read-errors/1", "errors": {}, "listdir": ports}))
    found = judge(node_copy, "IB003", "IB004", "IB005")
    for reference in ("IB003", "IB004", "IB005"):
        assert "not_applicable" not in statuses(found, reference) and "unknown" in statuses(found, reference), found[reference]


def test_a_port_without_its_gid_table_is_not_a_zero_slot_table(tmp_path: Path) -> None:
    root = tmp_path / "roce"
    shutil.copytree(ROCE, root, symlinks=True)
    gids = NodeFS(str(root))._resolve("/sys/class/infiniband/mlx5_0/ports/1/gids")
    shutil.rmtree(gids)
    found = judge(root, "ROCE004", "ROCE005", "ROCE006")
    assert ("unknown", "mlx5_0/1") in found["ROCE005"] and not any(s == "present" for s, subject in found["ROCE005"] if subject == "mlx5_0/1")


def test_gpus_the_driver_lists_keep_gpudirect_judged_without_sys_module(node_copy: Path) -> None:
    shutil.rmtree(node_copy / "sys/module")
    found = judge(node_copy, "GDR001", "GDR002")
    assert statuses(found, "GDR001") == {"unknown"} and statuses(found, "GDR002") == {"unknown"}


def test_device_nodes_of_a_tree_without_their_recording_are_not_captured(node_copy: Path) -> None:
    (node_copy / ".preflight/devices.json").unlink()
    fs = NodeFS(str(node_copy))
    with pytest.raises(NotCaptured, match="devices.json"):
        fs.stat("/dev/infiniband/uverbs0")  # a placeholder file: its type and mode are unknown
    with pytest.raises(NotCaptured, match="devices.json"):
        fs.stat("/dev/gdrdrv")  # absent from the tree, but nothing recorded /dev
    assert statuses(judge(node_copy, "IB007"), "IB007") == {"unknown"}


def test_what_a_captured_unit_lacks_is_absent(node_copy: Path) -> None:
    fs = NodeFS(str(node_copy))
    assert fs.read("/sys/module/nvidia_peermem/version") is None  # /sys/module captured: not loaded
    assert fs.read("/etc/no-such.conf") is None
    assert fs.stat("/dev/gdrdrv") is None  # devices.json recorded this node's /dev
    shutil.rmtree(node_copy / "sys/module")
    with pytest.raises(NotCaptured, match="this root has no /sys/module"):
        NodeFS(str(node_copy)).read("/sys/module/nvidia_peermem/version")
