"""ROCE003 (RoCE packets out of sequence) on copies of the recorded RoCE root
tests/fixtures/nodes/roce-v1v2 (two mlx5 RoCE v2 ports), with an NCCL release and the job's
settings laid over it, and the rdma probe's hw_counters parsing."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from msgspec.structs import replace

from conftest import Runner
from preflight.checks.roce import roce_packet_reordering
from preflight.model import NotApplicable, Status, Unknown
from preflight.probes.job import probe_job
from preflight.probes.nccl_libs import probe_nccl_libs
from preflight.probes.rdma import parse_counter, probe_rdma
from preflight.sources import NodeFS

ROCE = Path(__file__).resolve().parents[1] / "fixtures" / "nodes" / "roce-v1v2"
PORT = "sys/devices/pci0000:00/0000:00:01.0/{pci}/infiniband/{dev}/ports/1"


def node(tmp_path: Path, environ: dict[str, str], nccl: str | None = "2.30.3", counters: dict[str, str] | None = None) -> Path:
    root = tmp_path / "root"
    shutil.copytree(ROCE, root, symlinks=True)
    (root / "proc/self/environ").write_bytes(b"".join(f"{k}={v}".encode() + b"\0" for k, v in {"SLURM_JOB_ID": "1", **environ}.items()))
    (root / "usr/lib/x86_64-linux-gnu").mkdir(parents=True)  # /usr captured, with or without NCCL
    if nccl is not None:
        (root / "usr/lib/x86_64-linux-gnu" / f"libnccl.so.{nccl}").write_bytes(b"")
    port = (root / "sys/class/infiniband/mlx5_0").resolve() / "ports/1"
    for name, value in (counters or {}).items():
        (port / "hw_counters").mkdir(exist_ok=True)
        (port / "hw_counters" / name).write_text(value)
    return root


def verdicts(root: Path) -> list[tuple[str, Status, str]]:
    fs = NodeFS(str(root))
    found = roce_packet_reordering(probe_rdma(fs), probe_job(fs), probe_nccl_libs(fs))
    return [(o.subject, o.status, " | ".join(f"{e.source}: {e.observed}" for e in o.evidence) + o.reason) for o in found]


def test_parse_counter_takes_decimal_counts_only() -> None:
    assert parse_counter("4819337\n") == 4819337
    assert parse_counter("0") == 0
    assert parse_counter("") is None and parse_counter("N/A") is None and parse_counter("-1") is None


def test_rdma_probe_reads_counters_and_missing_is_not_zero(tmp_path: Path) -> None:
    root = node(tmp_path, {}, counters={"out_of_sequence": "4819337\n"})
    ports = {port.subject: port for port in probe_rdma(NodeFS(str(root))).data_ports}
    assert (ports["mlx5_0/1"].out_of_sequence, ports["mlx5_0/1"].packet_seq_err) == (4819337, None)
    assert (ports["mlx5_1/1"].out_of_sequence, ports["mlx5_1/1"].packet_seq_err) == (None, None)


def test_ooo_rq_forced_without_adaptive_routing_is_present_on_every_roce_port(tmp_path: Path) -> None:
    found = verdicts(node(tmp_path, {"NCCL_IB_OOO_RQ": "1"}, counters={"out_of_sequence": "12", "packet_seq_err": "3"}))
    assert [(subject, status) for subject, status, _ in found] == [("mlx5_0/1", Status.PRESENT), ("mlx5_1/1", Status.PRESENT)]
    assert "NCCL_IB_ADAPTIVE_ROUTING: unset" in found[0][2] and "2.30.3" in found[0][2]
    assert "out_of_sequence 12, packet_seq_err 3" in found[0][2]
    assert "out_of_sequence not reported, packet_seq_err not reported" in found[1][2]


def test_adaptive_routing_set_to_zero_is_still_off(tmp_path: Path) -> None:
    found = verdicts(node(tmp_path, {"NCCL_IB_OOO_RQ": "1", "NCCL_IB_ADAPTIVE_ROUTING": "0"}))
    assert {status for _, status, _ in found} == {Status.PRESENT}


def test_ooo_rq_with_adaptive_routing_on_is_unknown_not_present(tmp_path: Path) -> None:
    """Then NCCL needs out-of-order receive on both NICs, which only mlx5dv can tell."""
    found = verdicts(node(tmp_path, {"NCCL_IB_OOO_RQ": "1", "NCCL_IB_ADAPTIVE_ROUTING": "1"}))
    assert {status for _, status, _ in found} == {Status.UNKNOWN}


def test_a_named_network_plugin_makes_its_own_rules(tmp_path: Path) -> None:
    """With NCCL_NET_PLUGIN naming a plugin (NVIDIA's Spectrum-X plugin, for one), that plugin's
    transport carries the data where it loads: NCCL's refusal is not known to apply; "none"
    loads no plugin, so NCCL's own transport and its rule stay."""
    found = verdicts(node(tmp_path / "a", {"NCCL_IB_OOO_RQ": "1", "NCCL_NET_PLUGIN": "spcx"}))
    assert {status for _, status, _ in found} == {Status.UNKNOWN} and "NCCL_NET_PLUGIN=spcx" in found[0][2]
    found = verdicts(node(tmp_path / "b", {"NCCL_IB_OOO_RQ": "1", "NCCL_NET_PLUGIN": "none"}))
    assert {status for _, status, _ in found} == {Status.PRESENT}


def test_counters_alone_never_make_a_finding(tmp_path: Path) -> None:
    """Counts since the driver loaded, which plain loss raises too: a healthy node has some."""
    assert verdicts(node(tmp_path, {}, counters={"out_of_sequence": "4819337", "packet_seq_err": "220194"})) == []
    assert verdicts(node(tmp_path / "ar", {"NCCL_IB_ADAPTIVE_ROUTING": "1"}, counters={"out_of_sequence": "9"})) == []


@pytest.mark.parametrize(("environ", "nccl", "reason"), [
    ({"NCCL_IB_OOO_RQ": "1"}, "2.29.7", "older than 2.30.3"),
    ({"NCCL_IB_OOO_RQ": "1", "NCCL_IB_HCA": "mlx5_9"}, "2.30.3", "no ACTIVE RoCE port"),
    ({"NCCL_IB_OOO_RQ": "1", "NCCL_NET": "Socket"}, "2.30.3", "NCCL_NET=Socket"),
    ({"NCCL_IB_OOO_RQ": "1"}, None, "no libnccl on this node"),
])
def test_not_applicable(tmp_path: Path, environ: dict[str, str], nccl: str | None, reason: str) -> None:
    with pytest.raises(NotApplicable, match=reason):
        verdicts(node(tmp_path, environ, nccl=nccl))


def test_an_unnamed_nccl_release_is_unknown(tmp_path: Path) -> None:
    root = node(tmp_path, {"NCCL_IB_OOO_RQ": "1"}, nccl=None)
    (root / "usr/lib/x86_64-linux-gnu/libnccl.so.2").write_bytes(b"")
    assert {status for _, status, _ in verdicts(root)} == {Status.UNKNOWN}


def test_unreadable_job_environment_is_unknown(tmp_path: Path) -> None:
    fs = NodeFS(str(node(tmp_path, {})))
    job = replace(probe_job(fs), environ={}, environ_error="permission denied (EACCES)")
    with pytest.raises(Unknown, match="EACCES"):
        list(roce_packet_reordering(probe_rdma(fs), job, probe_nccl_libs(fs)))


def test_snapshot_records_the_counters_and_replays_them(run_cli: Runner, tmp_path: Path) -> None:
    """The counters travel in a snapshot (the recording source keeps every file a probe read),
    so a replay shows the same evidence."""
    root = node(tmp_path, {"NCCL_IB_OOO_RQ": "1"}, counters={"out_of_sequence": "77\n", "packet_seq_err": "5\n"})
    archive = tmp_path / "node.tar.gz"
    assert run_cli("snapshot", str(archive), "--root", str(root)).returncode == 0
    report = json.loads(run_cli("node", "--root", str(archive), "--select", "ROCE003", "--format", "json").stdout)
    shown = {f["subject"]: f["evidence"][-1]["observed"] for f in report["findings"] if f["status"] == "present"}
    assert shown["mlx5_0/1"].startswith("out_of_sequence 77, packet_seq_err 5")
    assert shown["mlx5_1/1"].startswith("out_of_sequence not reported")
