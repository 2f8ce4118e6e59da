"""RDMA checks on recorded roots, run through the engine as ``preflight node`` runs them: each
check present, absent, not applicable and unknown on real-format trees; and bad input (every
port and device attribute missing, empty, garbage, a directory or EINVAL in turn) gives unknown
with the reason for exactly the checks that need the file, never a crash."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from preflight.config import Expectations, HostConfig
from preflight.discovery import build_registry
from preflight.engine import Report, RunOptions, run
from preflight.sources import NodeFS, SourceError, Sources

from conftest import bare_node

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "nodes"
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "nodes" / "hgx-h100"
IDS = ("IB003", "IB004", "IB005", "IB007", "IB008", "IB009", "EFA001")
REGISTRY = build_registry(plugins=False)


def judge(root: Path | NodeFS, expect: Expectations | None = None) -> Report:
    fs = root if isinstance(root, NodeFS) else NodeFS(str(root))
    config = HostConfig(expect=expect or Expectations())
    return run(REGISTRY, Sources.for_fs(fs), config, RunOptions(profile="prolog", select=IDS), "test")


def verdicts(report: Report) -> dict[str, set[tuple[str, str]]]:
    """ID -> {(status, subject)}."""
    found: dict[str, set[tuple[str, str]]] = {ref_id: set() for ref_id in IDS}
    for finding in report.findings:
        found[finding.reference_id].add((finding.status.value, finding.subject))
    return found


def copy(root: Path, tmp_path: Path) -> Path:
    target = tmp_path / root.name
    shutil.copytree(root, target, symlinks=True)
    return target


def test_ib_node_without_subnet_manager() -> None:
    found = verdicts(judge(FIXTURES / "ib-no-sm"))
    ports = {f"mlx5_{i}/1" for i in range(4)}
    assert found["IB008"] == {("present", port) for port in ports}
    # The root was taken in a job but holds no /usr: whether libibverbs is there stays unknown.
    assert found["IB009"] == {("present", port) for port in ports} | {("unknown", "libibverbs")}
    assert {ref: found[ref] for ref in ("IB003", "IB004", "IB005", "IB007")} == {ref: {("absent", "node")} for ref in ("IB003", "IB004", "IB005", "IB007")}
    assert found["EFA001"] == {("not_applicable", "node")}


def test_efa_node() -> None:
    report = judge(FIXTURES / "efa-p4d")
    found = verdicts(report)
    assert found["EFA001"] == {("present", "FI_PROVIDER"), ("present", "aws-ofi-nccl")}
    assert found["IB007"] == found["IB009"] == {("absent", "node")}
    for ref in ("IB003", "IB004", "IB005", "IB008"):
        assert found[ref] == {("not_applicable", "node")}, ref


def test_container_without_dev_infiniband() -> None:
    found = verdicts(judge(FIXTURES / "container-roce"))
    assert found["IB007"] == {("present", "/dev/infiniband")}
    assert found["IB003"] == {("present", "node")}
    assert found["IB008"] == found["EFA001"] == {("not_applicable", "node")}
    assert found["IB004"] == found["IB005"] == found["IB009"] == {("absent", "node")}


def test_degraded_b200_node() -> None:
    found = verdicts(judge(FIXTURES / "degraded-b200"))
    assert found["IB009"] == {("present", "mlx5_2/1"), ("present", "mlx5_7/1")}
    assert found["IB004"] == {
        ("present", "NCCL_IB_HCA 'mlx5_1'"), ("present", "mlx5_7/1"), ("present", "NCCL_IB_HCA ' mlx5_9'"),
        ("present", "NCCL IB selection"),
    }
    assert found["IB005"] == {("present", "node")}
    # The management functions sit in INIT with LID 0: NVLSM's business, not the InfiniBand SM's.
    assert found["IB008"] == found["IB007"] == found["IB003"] == {("absent", "node")}


def test_degraded_b200_with_site_expectations() -> None:
    expect = Expectations(hcas=tuple(f"mlx5_{i}" for i in (0, 1, 2, 3, 6, 7, 8, 9, 12)), rate_gbps=400)
    assert verdicts(judge(FIXTURES / "degraded-b200", expect))["IB009"] == {
        ("present", "mlx5_12"), ("present", "mlx5_2/1"), ("present", "mlx5_7/1"),
    }


def test_clean_example_is_absent_or_not_applicable() -> None:
    found = verdicts(judge(EXAMPLE))
    assert found == {ref: {("not_applicable" if ref == "EFA001" else "absent", "node")} for ref in IDS}


def test_efa_root_absent_once_fixed(tmp_path: Path) -> None:
    root = copy(FIXTURES / "efa-p4d", tmp_path)
    (root / "opt/amazon/ofi-nccl/lib").mkdir(parents=True)
    (root / "opt/amazon/ofi-nccl/lib/libnccl-net.so").write_text("")
    (root / "proc/self/environ").write_bytes(b"FI_PROVIDER=efa\0SLURM_JOB_UID=1001\0")
    # installed without telling the loader (the installer's ld.so.conf.d entry): NCCL cannot find it
    assert ("present", "aws-ofi-nccl") in verdicts(judge(root))["EFA001"]
    (root / "etc/ld.so.conf.d").mkdir(parents=True, exist_ok=True)
    (root / "etc/ld.so.conf.d/100_ofinccl.conf").write_text("/opt/amazon/ofi-nccl/lib\n")
    assert verdicts(judge(root))["EFA001"] == {("absent", "node")}


@pytest.mark.parametrize(
    ("fixture", "mutation", "ref_id"),
    [
        ("efa-p4d", "library directory loops", "EFA001"),
        ("hgx", "device recording garbage", "IB007"),
        ("container-roce", "class directory loops", "IB003"),
    ],
)
def test_unknown_on_mutated_roots(tmp_path: Path, fixture: str, mutation: str, ref_id: str) -> None:
    root = copy(EXAMPLE if fixture == "hgx" else FIXTURES / fixture, tmp_path)
    if mutation == "library directory loops":
        (root / "opt/amazon").mkdir(parents=True, exist_ok=True)
        os.symlink("ofi-nccl", root / "opt/amazon/ofi-nccl")
    elif mutation == "device recording garbage":
        (root / ".preflight/devices.json").write_text('{"nodes": {"/dev/infiniband/uverbs0": {"type": "pipe"}}}')
    else:
        shutil.rmtree(root / "sys/class/infiniband")
        os.symlink("infiniband", root / "sys/class/infiniband")
    unknown = {(f.subject, f.reason) for f in judge(root).findings if f.reference_id == ref_id and f.status.value == "unknown"}
    assert unknown, judge(root).findings
    assert all(reason for _, reason in unknown)
    if ref_id == "IB003":  # every check needs the class directory
        assert {f.status.value for f in judge(root).findings} == {"unknown"}


def test_no_rdma_devices_is_not_applicable(tmp_path: Path) -> None:
    found = verdicts(judge(bare_node(tmp_path)))
    assert found == {ref: {("not_applicable", "node")} for ref in IDS}


# -- bad input --------------------------------------------------------------------------------
DEVICE = "/sys/class/infiniband/mlx5_3"
# attribute -> the checks that must become unknown when it cannot be read
NEEDED_BY = {
    "ports/1/state": {"IB003", "IB004", "IB005", "IB008", "IB009"},
    "ports/1/phys_state": {"IB009"},
    "ports/1/rate": {"IB009"},
    "ports/1/link_layer": {"IB003", "IB004", "IB005", "IB008"},
    "ports/1/lid": {"IB008"},
    "ports/1/sm_lid": {"IB008"},
    "device": {"IB005"},
    # Recorded for the report and fleet comparison; no check decides on them.
    "node_type": set(),
    "fw_ver": set(),
}
HOWS = ("missing", "empty", "garbage", "nonsense", "directory", "EINVAL")


class FailingFS(NodeFS):
    """A view on which one path answers EINVAL, as sysfs does for attributes it cannot show."""

    def __init__(self, root: str, failing: str) -> None:
        super().__init__(root)
        self.failing = failing

    def read_bytes(self, path: str, max_bytes: int | None = None) -> bytes | None:
        if path == self.failing:
            raise SourceError(path, "invalid argument (EINVAL)")
        return super().read_bytes(path, max_bytes)

    def readlink(self, path: str) -> str | None:
        if path == self.failing:
            raise SourceError(path, "invalid argument (EINVAL)")
        return super().readlink(path)


def mutate(root: Path, attribute: str, how: str) -> None:
    target = Path(os.path.realpath(root / DEVICE.lstrip("/"))) / attribute
    if target.is_symlink() or target.is_file():
        target.unlink()
    if how == "empty":
        target.write_text("" if attribute != "device" else "\n")
    elif how == "garbage":
        if attribute == "device":
            os.symlink("../../../\x7fgarbage", target)
        else:
            target.write_bytes(b"\xff\xfe\x00garbage\x80\n")
    elif how == "nonsense":
        if attribute == "device":
            os.symlink("../../../virtual/net/lo", target)
        else:
            target.write_text("banana\n")
    elif how == "directory":
        target.mkdir()


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("attribute", sorted(NEEDED_BY))
def test_unreadable_attribute_gives_unknown_with_reason(tmp_path: Path, attribute: str, how: str) -> None:
    path = f"{DEVICE}/{attribute}"
    if how == "EINVAL":
        fs: NodeFS = FailingFS(str(EXAMPLE), path)
    else:
        root = copy(EXAMPLE, tmp_path)
        mutate(root, attribute, how)
        fs = NodeFS(str(root))
    report = judge(fs)
    unknown = {f.reference_id: f.reason for f in report.findings if f.status.value == "unknown"}
    expected = set(NEEDED_BY[attribute])
    if attribute == "device" and how == "missing":
        expected = set()  # no device link: a virtual device (rxe, siw) with no PCI address to order
    if attribute == "fw_ver" and how == "nonsense":
        expected = set()  # any text is a firmware version
    assert set(unknown) == expected
    for reason in unknown.values():
        assert path in reason, reason
    facts = json.dumps(report.facts["rdma"])
    if expected or attribute in ("node_type", "fw_ver") and not (attribute == "fw_ver" and how == "nonsense"):
        assert path in facts  # the problem is recorded with the facts
    assert {f.status.value for f in report.findings} <= {"absent", "not_applicable", "unknown"}


def test_refused_ipoib_join_in_the_recorded_kernel_log(tmp_path: Path) -> None:
    """The example node's SM is healthy; a broadcast-group join the SA refused since boot (as
    ipoib_multicast.c prints it) makes IB008 a warning on that interface, nothing else."""
    root = copy(EXAMPLE, tmp_path)
    assert verdicts(judge(root))["IB008"] == {("absent", "node")}
    log = root / ".preflight/kmsg"
    log.write_text(log.read_text() + "4,9001,120000000,-;ibp26s0: multicast join failed for ff12:401b:ffff:0000:0000:0000:ffff:ffff, status -22\n")
    # Up now, the interface was granted a later join (its carrier waits for the broadcast group).
    assert verdicts(judge(root))["IB008"] == {("absent", "node")}
    operstate = (root / "sys/class/net/ibp26s0").resolve() / "operstate"
    operstate.write_text("down\n")
    report = judge(root)
    assert verdicts(report)["IB008"] == {("present", "ibp26s0")}
    (finding,) = [f for f in report.findings if f.reference_id == "IB008"]
    assert finding.severity.value == "warning" and "status -22" in finding.evidence[0].observed


def write_pkey_tables(root: Path, table: dict[int, int], size: int = 128) -> None:
    """Every rail's P_Key table as the kernel shows it: ``size`` entries of 0x%04x, unused slots 0x0000."""
    for port in (root / "sys/class/infiniband").iterdir():
        pkeys = port / "ports/1/pkeys"
        pkeys.mkdir()
        for index in range(size):
            (pkeys / str(index)).write_text(f"0x{table.get(index, 0):04x}\n")


RAILS = {f"mlx5_{i}/1" for i in range(8)}


@pytest.mark.parametrize(
    ("setting", "expected"),
    [
        (None, {("absent", "node")}),  # NCCL takes index 0, the port's default partition: nothing read
        ("1", {("absent", "node")}),  # the job's partition, full member
        ("0x1", {("absent", "node")}),  # strtoll(value, NULL, 0)
        ("0x8001", {("present", port) for port in RAILS}),  # a P_Key given where NCCL wants its index
        ("2", {("present", port) for port in RAILS}),  # an empty slot
        ("3", {("present", port) for port in RAILS}),  # a limited member (warning)
    ],
)
def test_nccl_ib_pkey_names_an_index_of_each_ports_table(tmp_path: Path, setting: str | None, expected: set[tuple[str, str]]) -> None:
    """NCCL_IB_PKEY is the index NCCL gives every queue pair (qpAttr.pkey_index in net_ib, NCCL
    issue 1323): beyond the table ibv_modify_qp fails, an empty slot or a limited member's key
    reaches no node set up alike."""
    root = copy(EXAMPLE, tmp_path)
    write_pkey_tables(root, {0: 0xFFFF, 1: 0x8001, 3: 0x0002})
    if setting is not None:
        with (root / "etc/nccl.conf").open("a") as conf:
            conf.write(f"NCCL_IB_PKEY={setting}\n")
    findings = [f for f in judge(root).findings if f.reference_id == "IB009"]
    assert {(f.status.value, f.subject) for f in findings} == expected
    severities = {f.severity.value for f in findings if f.status.value == "present"}
    assert severities == ({"warning"} if setting == "3" else {"error"} if expected != {("absent", "node")} else set())
    if setting == "0x8001":
        assert "128 entries; NCCL uses index 32769 (NCCL_IB_PKEY=0x8001 (/etc/nccl.conf))" in findings[0].evidence[0].observed
        assert "grep -H . /sys/class/infiniband/mlx5_0/ports/1/pkeys/*" in findings[0].fix


def test_nccl_ib_pkey_on_an_unread_table_is_unknown(tmp_path: Path) -> None:
    """A capture without a port's P_Key table, or a garbled entry: unknown for that port, not absent."""
    root = copy(EXAMPLE, tmp_path)
    write_pkey_tables(root, {0: 0xFFFF, 1: 0x8001})
    shutil.rmtree(root / "sys/class/infiniband/mlx5_3/ports/1/pkeys")
    (root / "sys/class/infiniband/mlx5_5/ports/1/pkeys/1").write_text("full\n")
    (root / "proc/self/environ").write_bytes((root / "proc/self/environ").read_bytes() + b"NCCL_IB_PKEY=1\0")
    findings = {f.subject: f for f in judge(root).findings if f.reference_id == "IB009"}
    assert {subject: f.status.value for subject, f in findings.items()} == {"mlx5_3/1": "unknown", "mlx5_5/1": "unknown"}
    assert findings["mlx5_3/1"].reason == "/sys/class/infiniband/mlx5_3/ports/1/pkeys: missing"
    assert findings["mlx5_5/1"].reason == "/sys/class/infiniband/mlx5_5/ports/1/pkeys/1: not a P_Key ('full')"


def test_nccl_ib_pkey_on_roce_ports(tmp_path: Path) -> None:
    """A RoCE port's table has one entry, 0xffff at index 0 (UCX PR 7724): any other index fails."""
    root = copy(FIXTURES / "container-roce", tmp_path)
    ports = sorted((root / "sys/class/infiniband").iterdir())
    for port in ports:
        (port / "ports/1/pkeys").mkdir()
        (port / "ports/1/pkeys/0").write_text("0xffff\n")
    environ = root / "proc/self/environ"
    base = environ.read_bytes()
    assert not {f.status.value for f in judge(root).findings if f.reference_id == "IB009"} & {"present", "unknown"}
    environ.write_bytes(base + b"NCCL_IB_PKEY=0\0")
    assert not {f.status.value for f in judge(root).findings if f.reference_id == "IB009"} & {"present", "unknown"}
    environ.write_bytes(base + b"NCCL_IB_PKEY=1\0")
    found = [f for f in judge(root).findings if f.reference_id == "IB009"]
    assert {f.subject for f in found if f.status.value == "present"} == {f"{port.name}/1" for port in ports}
    assert "Unset NCCL_IB_PKEY" in found[0].fix
