"""GPU002: row remapping pending or failed (replayed NVML answers) and hardware Xids since boot
(a recorded kernel log in /dev/kmsg's record format)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from preflight.checks.gpu_health import nccl_cuda_call_failed, probe_gpu_health
from preflight.checks.kernel_log import parse_xids, probe_kernel_log
from preflight.model import NotApplicable, Status
from preflight.sources import Sources


def verdicts(root: Path) -> list[tuple[str, Status, str]]:
    sources = Sources.for_node(str(root), None)
    found = nccl_cuda_call_failed(probe_gpu_health(sources.nvml), probe_kernel_log(sources.fs))
    return [(o.subject, o.status, " ".join(e.observed for e in o.evidence) + o.reason) for o in found]


def set_rows(root: Path, answers: dict[str, object]) -> None:
    path = root / ".preflight/nvml.json"
    document = json.loads(path.read_text())
    document["calls"]["nvmlDeviceGetRemappedRows"].update(answers)
    path.write_text(json.dumps(document))


def test_healthy_gpus_are_absent(example_root: Path) -> None:
    assert verdicts(example_root) == []


def test_pending_and_failed_remaps_are_present(node_copy: Path) -> None:
    set_rows(node_copy, {"1": {"result": [0, 2, 1, 0]}, "4": {"result": [1, 9, 0, 1]}, "6": {"error": "NVML_ERROR_UNKNOWN"}, "7": {"result": "garbage"}})
    found = {subject: (status, text) for subject, status, text in verdicts(node_copy)}
    assert found["GPU1"][0] is Status.PRESENT and "remap pending; 2 rows" in found["GPU1"][1]
    assert found["GPU4"][0] is Status.PRESENT and "remapping failed" in found["GPU4"][1]
    assert found["GPU6"][0] is Status.UNKNOWN and found["GPU7"][0] is Status.UNKNOWN
    assert set(found) == {"GPU1", "GPU4", "GPU6", "GPU7"}


def test_gpus_without_row_remapping_are_not_applicable(node_copy: Path) -> None:
    set_rows(node_copy, {str(i): {"error": "NVML_ERROR_NOT_SUPPORTED"} for i in range(8)})
    with pytest.raises(NotApplicable, match="before Ampere"):
        verdicts(node_copy)


KMSG = (
    "6,1021,8812532211,-;NVRM: GPU at PCI:0000:5d:00: GPU-1f3a9c2e-7d41-4b1e-9d2a-1c0b8e7f6a55\n"
    "4,1022,8812532219,-;NVRM: Xid (PCI:0000:5d:00): 79, pid=51022, name=python, GPU has fallen off the bus.\n"
    "4,1023,8813000000,-;NVRM: Xid (PCI:0000:18:00): 13, pid=4410, name=train.py, Graphics SM Warp Exception\n"
    "4,1024,8814000000,-;NVRM: Xid (PCI:0000:5d:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.\n"
)


def test_hardware_xids_since_boot_are_present_and_application_faults_are_not(node_copy: Path) -> None:
    (node_copy / ".preflight/kmsg").write_text(KMSG)
    found = verdicts(node_copy)
    assert [(s, st) for s, st, _ in found] == [("GPU 0000:5d:00", Status.PRESENT)]
    assert "Xid 79 (GPU has fallen off the bus); 2 event(s)" in found[0][2]
    assert [e.code for e in parse_xids(KMSG.splitlines())] == [79, 13, 79]


def test_unreadable_kernel_log_leaves_the_nvml_verdict(node_copy: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    from preflight.sources import NodeFS

    def refuse(path: str, flags: int, *args: object) -> int:
        raise PermissionError(13, "Operation not permitted", path)

    monkeypatch.setattr(os, "open", refuse)  # what /dev/kmsg answers a non-root reader under dmesg_restrict
    facts = probe_kernel_log(NodeFS("/"))
    assert "permission denied (EACCES); needs root" in facts.error and not facts.read
    monkeypatch.undo()
    assert verdicts(node_copy) == []  # no recorded log: the NVML part alone decides


def test_live_kernel_log_reads_or_names_the_privilege(tmp_path: Path) -> None:
    from preflight.sources import NodeFS, SourceError

    try:
        records = NodeFS("/").read_kernel_log(max_bytes=1 << 16)
    except SourceError as error:
        assert "needs root" in str(error) or "kmsg" in str(error)
    else:
        assert records is None or all(isinstance(record, str) for record in records)
