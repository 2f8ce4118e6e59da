"""IB006: RDMA ports that went down since boot (PMA counters, mlx5e kernel messages) and retry
settings too short to ride out a retrain, on copies of the example node."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from preflight.probes.job import probe_job
from preflight.probes.kernel_log import parse_link_downs, probe_kernel_log
from preflight.checks.ib import ib_transport_retry_exceeded
from preflight.probes.link_history import probe_link_history
from preflight.model import NotApplicable, Status
from preflight.sources import NodeFS

from conftest import bare_node, write

PORT = "sys/devices/pci0000:5a/0000:5a:01.0/0000:5c:00.0/0000:5f:00.0/infiniband/mlx5_3/ports/1/counters"


def verdicts(root: Path) -> list[tuple[str, Status, str]]:
    fs = NodeFS(str(root))
    found = ib_transport_retry_exceeded(probe_link_history(fs), probe_kernel_log(fs), probe_job(fs))
    return [(o.subject, o.status, " ".join(e.observed for e in o.evidence) + o.reason) for o in found]


def test_example_node_ports_never_went_down(example_root: Path) -> None:
    assert verdicts(example_root) == []


def test_counted_link_downs_are_present_as_warnings(node_copy: Path) -> None:
    (node_copy / PORT / "link_downed").write_text("3\n")
    (node_copy / PORT / "link_error_recovery").write_text("12\n")
    fs = NodeFS(str(node_copy))
    found = list(ib_transport_retry_exceeded(probe_link_history(fs), probe_kernel_log(fs), probe_job(fs)))
    assert [(o.subject, o.severity and o.severity.value) for o in found] == [("mlx5_3/1", "warning")]
    assert found[0].evidence[0].observed == "3"


def test_kernel_link_downs_are_matched_to_the_rdma_device(node_copy: Path) -> None:
    """A link that goes down after it was up; mlx5e's "Link down" as each interface opens at boot,
    before its port trains, is none (mlx5e_update_carrier prints the carrier whenever called)."""
    kmsg = node_copy / ".preflight/kmsg"
    boot = kmsg.read_text() + ("6,890,12345678,-;mlx5_core 0000:5f:00.0 ibp95s0: Link down\n"
                               "6,891,15345678,-;mlx5_core 0000:5f:00.0 ibp95s0: Link up\n")
    kmsg.write_text(boot)
    assert verdicts(node_copy) == []
    kmsg.write_text(boot + "6,900,912345678,-;mlx5_core 0000:5f:00.0 ibp95s0: Link down\n"
                    "6,901,912345999,-;mlx5_core 0000:5f:00.0 ibp95s0: Link up\n"
                    "6,902,999999000,-;mlx5_core 0000:77:00.0 eth9: Link up\n"
                    "6,903,999999999,-;mlx5_core 0000:77:00.0 eth9: Link down\n")  # not an RDMA device here
    found = verdicts(node_copy)
    assert [(s, st) for s, st, _ in found] == [("mlx5_3 (ibp95s0)", Status.PRESENT)] and "1 link-down(s)" in found[0][2]
    assert len(parse_link_downs(kmsg.read_text().splitlines())) == 2


def test_short_timeouts_in_the_job_are_present(node_copy: Path) -> None:
    write(node_copy, "/proc/self/environ", b"NCCL_IB_TIMEOUT=12\0NCCL_IB_RETRY_CNT=abc\0")
    found = {s: (st, text) for s, st, text in verdicts(node_copy)}
    assert found["NCCL_IB_TIMEOUT"][0] is Status.PRESENT and found["NCCL_IB_RETRY_CNT"][0] is Status.UNKNOWN


@pytest.mark.parametrize(
    ("environ", "found"),
    [
        # A "flipping links" workaround seen in job scripts: the 3-bit retry field keeps 2 of 50.
        (b"NCCL_IB_TIMEOUT=250\0NCCL_IB_RETRY_CNT=50\0", {"NCCL_IB_RETRY_CNT": "50, of which the QP's 3-bit field keeps 2"}),
        (b"NCCL_IB_TIMEOUT=32\0NCCL_IB_RETRY_CNT=7\0", {"NCCL_IB_TIMEOUT": "32, of which the QP's 5-bit field keeps 0 (0: the QP never times out"}),
        (b"NCCL_IB_TIMEOUT=22\0NCCL_IB_RETRY_CNT=7\0", {}),
        # ibv_qp_attr's fields are unsigned bytes: -12 is 244, of which the 5-bit field keeps 20.
        (b"NCCL_IB_TIMEOUT=-12\0NCCL_IB_RETRY_CNT=-2\0", {"NCCL_IB_RETRY_CNT": "-2, of which the QP's 3-bit field keeps 6"}),
    ],
)
def test_retry_settings_are_judged_as_the_qp_keeps_them(node_copy: Path, environ: bytes, found: dict[str, str]) -> None:
    """NCCL passes NCCL_IB_TIMEOUT and NCCL_IB_RETRY_CNT unchecked into ibv_modify_qp; the QP
    context keeps 5 and 3 bits of them (mlx5's MLX5_SET), so a large value can mean a small one."""
    write(node_copy, "/proc/self/environ", environ)
    judged = {subject: text for subject, status, text in verdicts(node_copy) if status is Status.PRESENT}
    assert set(judged) == set(found) and all(judged[name].startswith(text) for name, text in found.items())


def test_garbage_counters_are_unknown_and_no_rdma_is_not_applicable(node_copy: Path, tmp_path: Path) -> None:
    (node_copy / PORT / "link_downed").write_text("lots\n")
    found = verdicts(node_copy)
    assert [(s, st) for s, st, _ in found] == [("mlx5_3/1", Status.UNKNOWN)] and "not a number" in found[0][2]
    with pytest.raises(NotApplicable):
        verdicts(bare_node(tmp_path))


def test_a_kernel_log_not_read_leaves_the_link_down_history_undecided(node_copy: Path) -> None:
    """Counters can be cleared; the kernel log is the other witness. A root that records none
    (or a container without /dev/kmsg) gives the counters' verdict beside an unknown for the log."""
    (node_copy / ".preflight/kmsg").unlink()
    found = verdicts(node_copy)
    assert [(s, st) for s, st, _ in found] == [("kernel log", Status.UNKNOWN)]
    assert "link-down history since boot unread" in found[0][2] and "records no kernel log" in found[0][2]


def test_an_unreadable_device_link_or_an_odd_port_entry_stays_with_its_device(node_copy: Path) -> None:
    """The PCI link only matches kernel messages to the device: one that cannot be read leaves
    that device's ports unknown and the others judged; a non-numeric entry under ports/ is no port."""
    (node_copy / PORT).parents[1].joinpath("³").mkdir()
    write(node_copy, "/.preflight/read-errors.json", json.dumps({"readlink": {"/sys/class/infiniband/mlx5_3/device": "EACCES"}}).encode())
    facts = probe_link_history(NodeFS(str(node_copy)))
    assert "³" not in {port.port for port in facts.ports} and facts.unlisted == ""
    broken = [(port.device, port.port, port.problem) for port in facts.ports if port.problem]
    assert broken == [("mlx5_3", "1", "/sys/class/infiniband/mlx5_3/device: permission denied (EACCES); needs root")]
    assert len(facts.ports) > 1


def test_efa_ports_are_not_the_ib_transports(tmp_path: Path) -> None:
    """EFA's ports report link layer "Unknown" and no PMA counters (the kernel makes
    ports/<n>/counters for InfiniBand and RoCE ports only); NCCL's IB transport never opens them
    (aws-ofi-nccl does), so IB006 does not apply, where every port said "counters missing"."""
    efa = Path(__file__).resolve().parents[1] / "fixtures" / "nodes" / "efa-p4d"
    facts = probe_link_history(NodeFS(str(efa)))
    assert {(port.link_layer, port.problem) for port in facts.ports} == {("Unknown", "")} and len(facts.ports) == 4
    fs = NodeFS(str(efa))
    with pytest.raises(NotApplicable, match="link layer Unknown"):
        list(ib_transport_retry_exceeded(facts, probe_kernel_log(fs), probe_job(fs)))
    root = bare_node(tmp_path)  # a port whose link layer is not recorded keeps its counters' verdict
    write(root, "/sys/class/infiniband/mlx5_0/ports/1/counters/link_downed", "3\n")
    write(root, "/sys/class/infiniband/mlx5_0/ports/1/counters/link_error_recovery", "0\n")
    (port,) = probe_link_history(NodeFS(str(root))).ports
    assert (port.link_layer, port.link_downed) == (None, 3)


def test_a_garbled_link_layer_keeps_the_counters_verdict(tmp_path: Path) -> None:
    """Only the kernel's own "Unknown" marks a port NCCL's IB transport never opens; a garbled
    file says nothing, and the port's counters are read as before."""
    root = bare_node(tmp_path)
    write(root, "/sys/class/infiniband/mlx5_0/ports/1/link_layer", "\x00\xffUnk\n")
    write(root, "/sys/class/infiniband/mlx5_0/ports/1/counters/link_downed", "2\n")
    (port,) = probe_link_history(NodeFS(str(root))).ports
    assert (port.link_layer, port.link_downed) == (None, 2)


def test_roce_drivers_without_pma_counters_are_judged_by_the_kernel_log(tmp_path: Path) -> None:
    """ionic (AMD Pollara) and irdma (Intel E810) have no process_mad, so the kernel makes no
    ports/<n>/counters for them (add_port() in drivers/infiniband/core/sysfs.c): their RoCE ports'
    history is their Ethernet drivers' link-down lines, not an unknown for ever."""
    root = bare_node(tmp_path)
    for device, bus in (("ionic_0", "0000:09:00.0"), ("rocep26s0f0", "0000:1a:00.0")):
        port = f"/sys/devices/pci0000:00/0000:00:01.0/{bus}/infiniband/{device}/ports/1"
        write(root, f"{port}/link_layer", "Ethernet\n")
        write(root, f"{port}/state", "4: ACTIVE\n")
        (root / "sys/class/infiniband").mkdir(parents=True, exist_ok=True)
        link = root / "sys/class/infiniband" / device
        if not link.is_symlink():
            link.symlink_to(f"../../devices/pci0000:00/0000:00:01.0/{bus}/infiniband/{device}")
        (root / f"sys/devices/pci0000:00/0000:00:01.0/{bus}/infiniband/{device}/device").symlink_to(f"../../../{bus}")
    write(root, "/.preflight/kmsg", "6,1,100,-;ionic 0000:09:00.0 enp9s0np0: Link up\n6,2,200,-;ice 0000:1a:00.0 ens26f0: NIC Link is Up 100 Gbps Full Duplex\n"
                                    "6,3,1000,-;ionic 0000:09:00.0 enp9s0np0: Link down\n6,4,2000,-;ice 0000:1a:00.0 ens26f0: NIC Link is Down\n")
    facts = probe_link_history(NodeFS(str(root)))
    assert {(port.device, port.problem) for port in facts.ports} == {("ionic_0", ""), ("rocep26s0f0", "")}
    fs = NodeFS(str(root))
    found = {o.subject: o.status for o in ib_transport_retry_exceeded(facts, probe_kernel_log(fs), probe_job(fs))}
    assert found == {"ionic_0 (enp9s0np0)": Status.PRESENT, "rocep26s0f0 (ens26f0)": Status.PRESENT}
    # An InfiniBand port without counters is still a gap in what was read.
    write(root, "/sys/devices/pci0000:00/0000:00:01.0/0000:09:00.0/infiniband/ionic_0/ports/1/link_layer", "InfiniBand\n")
    assert any(port.problem.endswith("link_downed: missing") for port in probe_link_history(NodeFS(str(root))).ports)
