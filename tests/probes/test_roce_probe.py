"""The RoCE probes on the recorded roots in tests/fixtures/nodes, the recorded read errors of
NodeFS, and the DCB netlink message (encoded, decoded, asked of the live kernel, replayed)."""

from __future__ import annotations

import json
import shutil
import socket
import struct
from pathlib import Path

import pytest

from preflight.nccl.gid import GidSettings
from preflight.probes.job import probe_job
from preflight.probes.roce import EcnState, GidEntry, NcclGid, RocePort, probe_roce, probe_roce_dcb, roce_mtu
from preflight.sources import NodeFS, SourceError, Sources
from preflight.sources.netlink import (
    DcbConfig,
    FileNetlink,
    ReplayNetlink,
    decode_dcb_reply,
    dump,
    encode_dcb_request,
    query_dcb,
)

NODES = Path(__file__).resolve().parents[1] / "fixtures" / "nodes"
V1, V2 = "IB/RoCE v1", "RoCE v2"


ZERO_GID = "0000:0000:0000:0000:0000:0000:0000:0000\n"


def copy_node(tmp_path: Path, name: str) -> Path:
    target = tmp_path / name
    shutil.copytree(NODES / name, target, symlinks=True)
    return target


@pytest.mark.parametrize(("netdev_mtu", "expected"), [(1500, 1024), (4096, 2048), (4192, 4096), (4200, 4096), (9000, 4096), (300, None)])
def test_roce_mtu_follows_iboe_get_mtu(netdev_mtu: int, expected: int | None) -> None:
    assert roce_mtu(netdev_mtu) == expected


def test_v1v2_node_whole_port_facts() -> None:
    facts = probe_roce(NodeFS(str(NODES / "roce-v1v2")), probe_job(NodeFS(str(NODES / "roce-v1v2"))))
    assert [port.subject for port in facts.ports] == ["mlx5_0/1", "mlx5_1/1"] and facts.unreadable_ports == ()
    assert facts.gid_variables == ()
    chosen = NcclGid(GidSettings(), 3, False, (), None, "")
    assert facts.ports[0] == RocePort(
        device="mlx5_0",
        port=1,
        state="4: ACTIVE",
        table_size=16,
        gids=(
            GidEntry(0, "fe80:0000:0000:0000:ba59:9fff:fe3c:10a2", V1, "", "ens1f0np0", None),
            GidEntry(1, "fe80:0000:0000:0000:ba59:9fff:fe3c:10a2", V2, "", "ens1f0np0", None),
            GidEntry(2, "0000:0000:0000:0000:0000:ffff:0a0a:0011", V1, "", "ens1f0np0", "10.10.0.17"),
            GidEntry(3, "0000:0000:0000:0000:0000:ffff:0a0a:0011", V2, "", "ens1f0np0", "10.10.0.17"),
        ),
        unreadable_gids=(),
        nccl_job=chosen,
        nccl_default=chosen,
        netdev="ens1f0np0",
        netdev_source="/sys/class/infiniband/mlx5_0/ports/1/gid_attrs/ndevs/3",
        mtu=9000,
        mtu_error="",
        roce_mtu=4096,
        trust=None,
        ecn=EcnState((3,), (3,), ""),
        dcb_interfaces=("ens1f0np0",),
    )


def test_macvlan_pod_facts() -> None:
    facts = probe_roce(NodeFS(str(NODES / "roce-macvlan-pod")), probe_job(NodeFS(str(NODES / "roce-macvlan-pod"))))
    (port,) = facts.ports
    assert [entry.index for entry in port.gids] == [4, 5, 6, 7] and port.table_size == 256
    assert [(entry.netdev, entry.ipv4, entry.roce_type) for entry in port.gids[:2]] == [("net1", "11.0.4.1", V1), ("net1", "11.0.4.1", V2)]
    assert port.nccl_job == NcclGid(GidSettings(gid_index=3), 3, True, (), None, "")
    assert port.nccl_default is not None and port.nccl_default.index == 5
    assert (port.netdev, port.netdev_source, port.mtu) == ("net1", "/sys/class/infiniband/mlx5_0/ports/1/gid_attrs/ndevs/4", 9000)
    assert facts.gid_variables == (("NCCL_IB_GID_INDEX", "3", "environment"),)


def test_netdev_from_device_net_when_no_gid_names_one(tmp_path: Path) -> None:
    root = copy_node(tmp_path, "roce-v1v2")
    port = root / "sys/devices/pci0000:00/0000:00:01.0/0000:0d:00.0/infiniband/mlx5_0/ports/1"
    for index in range(4):
        (port / f"gid_attrs/ndevs/{index}").unlink()
    facts = probe_roce(NodeFS(str(root)), probe_job(NodeFS(str(root))))
    assert (facts.ports[0].netdev, facts.ports[0].netdev_source) == ("ens1f0np0", "/sys/class/infiniband/mlx5_0/device/net")


def test_dcb_probe_replays_the_recording() -> None:
    sources = Sources.for_node(str(NODES / "roce-pfc-misconfigured"))
    readings = probe_roce_dcb(sources.fs, sources.netlink, probe_roce(sources.fs, probe_job(sources.fs))).readings
    assert [(r.netdev, r.ports, r.config.pfc_enabled if r.config else None) for r in readings] == [
        ("ens1f0np0", ("mlx5_0/1",), (3,)),
        ("ens2f0np0", ("mlx5_1/1",), ()),
    ]
    pod = Sources.for_node(str(NODES / "roce-macvlan-pod"))
    (reading,) = probe_roce_dcb(pod.fs, pod.netlink, probe_roce(pod.fs, probe_job(pod.fs))).readings
    assert reading.config is None and "EOPNOTSUPP" in reading.error


def test_dcb_asks_the_members_of_a_bond(tmp_path: Path) -> None:
    root = copy_node(tmp_path, "roce-v1v2")
    bond = root / "sys/devices/virtual/net/bond0"
    bond.mkdir(parents=True)
    (bond / "mtu").write_text("9000\n")
    (bond / "bonding").mkdir()
    (bond / "bonding/slaves").write_text("ens1f0np0 ens2f0np0\n")
    (root / "sys/class/net/bond0").symlink_to("../../devices/virtual/net/bond0")
    port = root / "sys/devices/pci0000:00/0000:00:01.0/0000:0d:00.0/infiniband/mlx5_0/ports/1/gid_attrs/ndevs"
    for index in range(4):
        (port / str(index)).write_text("bond0\n")
    sources = Sources.for_node(str(root))
    readings = probe_roce_dcb(sources.fs, sources.netlink, probe_roce(sources.fs, probe_job(sources.fs))).readings
    assert [(r.netdev, r.ports) for r in readings] == [("ens1f0np0", ("mlx5_0/1",)), ("ens2f0np0", ("mlx5_0/1", "mlx5_1/1"))]
    # DCQCN and QoS trust are the members' too (a bond has no ecn/ or qos/ of its own): a priority
    # counts as enabled only where every member enables it, and members that agree give the trust.
    assert mlx5_0(root).ecn == EcnState((3,), (3,), "") and mlx5_0(root).netdev == "bond0"
    (root / "sys/class/net/ens2f0np0/ecn/roce_np/enable/3").write_text("0\n")
    assert mlx5_0(root).ecn.notification_point == ()
    for member, trust in (("ens1f0np0", "dscp"), ("ens2f0np0", "dscp")):
        (root / f"sys/class/net/{member}/qos").mkdir(exist_ok=True)
        (root / f"sys/class/net/{member}/qos/trust").write_text(f"{trust}\n")
    assert mlx5_0(root).trust == "dscp"
    (root / "sys/class/net/ens2f0np0/qos/trust").write_text("pcp\n")
    assert mlx5_0(root).trust is None  # members that disagree: mlnx_qos's rule decides from the DSCP map


# -- bad input: every file in turn missing, empty, garbage or failing with EINVAL -----------------
PORT = "sys/devices/pci0000:00/0000:00:01.0/0000:0d:00.0/infiniband/mlx5_0/ports/1"


NET = "sys/devices/pci0000:00/0000:00:01.0/0000:0d:00.0/net/ens1f0np0"


def plant(root: Path, relative: str, how: str) -> None:
    """Make ``relative`` (under PORT or NET) missing, empty, garbage or fail with EINVAL."""
    target = root / relative
    if target.exists() and how != "einval":
        target.unlink()
    if how == "empty":
        target.write_bytes(b"")
    elif how == "garbage":
        target.write_bytes(b"\xff\xfe\x00garbage\x80\n")
    elif how == "einval":
        # The file stays (sysfs lists it); recorded errors name the path probes ask for.
        host = relative.replace(PORT, "/sys/class/infiniband/mlx5_0/ports/1").replace(NET, "/sys/class/net/ens1f0np0")
        errors = json.loads((root / ".preflight/read-errors.json").read_text())
        errors["errors"] = {host: "EINVAL", **errors["errors"]}
        (root / ".preflight/read-errors.json").write_text(json.dumps(errors))
    elif how == "missing":
        # The fixture makes every absent gid_attrs file fail with EINVAL; a missing one must not.
        (root / ".preflight/read-errors.json").write_text(json.dumps({"format": "preflight-read-errors/1", "errors": {}}))


def mlx5_0(root: Path) -> RocePort:
    return next(port for port in probe_roce(NodeFS(str(root)), probe_job(NodeFS(str(root)))).ports if port.device == "mlx5_0")


@pytest.mark.parametrize("how", ["missing", "empty", "garbage", "einval"])
def test_bad_link_layer_makes_the_port_unreadable(tmp_path: Path, how: str) -> None:
    root = copy_node(tmp_path, "roce-v1v2")
    plant(root, f"{PORT}/link_layer", how)
    facts = probe_roce(NodeFS(str(root)), probe_job(NodeFS(str(root))))
    assert [port.subject for port in facts.ports] == ["mlx5_1/1"]
    ((subject, reason),) = facts.unreadable_ports
    assert subject == "mlx5_0/1" and "link_layer" in reason
    assert {"missing": "not captured", "empty": "''", "garbage": "UTF-8", "einval": "EINVAL"}[how] in reason


@pytest.mark.parametrize("how", ["empty", "garbage", "einval"])
def test_bad_gid_slot_is_recorded_not_guessed(tmp_path: Path, how: str) -> None:
    root = copy_node(tmp_path, "roce-v1v2")
    plant(root, f"{PORT}/gids/3", how)
    port = mlx5_0(root)
    (problem,) = port.unreadable_gids
    assert problem.startswith("/sys/class/infiniband/mlx5_0/ports/1/gids/3: ")
    assert {"empty": "not a GID", "garbage": "UTF-8", "einval": "EINVAL"}[how] in problem
    assert port.nccl_job is None and port.mtu == 9000  # the MTU still comes from the other slots


def test_missing_gid_type_is_a_partial_copy_not_a_failing_read(tmp_path: Path) -> None:
    """The kernel has a types file for every slot: one missing beside its gids/ entry was not
    copied, and decides nothing about NCCL's choice (unlike a read that fails on the node)."""
    root = copy_node(tmp_path, "roce-v1v2")
    plant(root, f"{PORT}/gid_attrs/types/3", "missing")
    port = mlx5_0(root)
    assert port.nccl_job is None
    assert port.unreadable_gids == ("/sys/class/infiniband/mlx5_0/ports/1/gid_attrs/types/3: no such file or directory (ENOENT)",)


@pytest.mark.parametrize("index", ["4097", "100000000", "9" * 200])
def test_a_gid_index_past_any_kernels_table_makes_the_table_garbled(tmp_path: Path, index: str) -> None:
    """Kernel tables are gid_tbl_len slots long (256 on mlx5 RoCE): a higher slot number is a
    garbled copy, reported as such at once instead of sizing a table (and a gap list) by it."""
    root = copy_node(tmp_path, "roce-v1v2")
    (root / PORT / "gids" / index).write_text("")
    port = mlx5_0(root)
    assert port.nccl_job is None and port.gids == () and port.table_size == 0
    assert port.unreadable_gids == (f"/sys/class/infiniband/mlx5_0/ports/1/gids/{index[:24]}: index above 4096, past any kernel's GID table (garbled copy)",)
    (root / PORT / "gids" / index).unlink()
    (root / PORT / "gids/4096").write_text(ZERO_GID)  # the bound itself is a table, with its gaps counted
    assert mlx5_0(root).unreadable_gids == ("/sys/class/infiniband/mlx5_0/ports/1/gids: 4080 of 4097 slots missing, the first 16",)


def test_gaps_in_the_gid_table_are_counted_and_odd_names_ignored(tmp_path: Path) -> None:
    root = copy_node(tmp_path, "roce-v1v2")
    for name in ("5", "9"):
        (root / PORT / "gids" / name).unlink()
    (root / PORT / "gids/²").write_text("")  # str.isdigit() takes it, int() does not
    (root / PORT.replace("ports/1", "ports/³")).mkdir()
    facts = probe_roce(NodeFS(str(root)), probe_job(NodeFS(str(root))))
    assert [port.subject for port in facts.ports] == ["mlx5_0/1", "mlx5_1/1"] and facts.unreadable_ports == ()
    assert facts.ports[0].unreadable_gids == ("/sys/class/infiniband/mlx5_0/ports/1/gids: 2 of 16 slots missing, the first 5",)
    assert facts.ports[0].nccl_job is None and [entry.index for entry in facts.ports[0].gids] == [0, 1, 2, 3]


@pytest.mark.parametrize(("how", "error"), [("empty", "unexpected value ''"), ("garbage", "UTF-8"), ("einval", "EINVAL")])
def test_bad_gid_type(tmp_path: Path, how: str, error: str) -> None:
    root = copy_node(tmp_path, "roce-v1v2")
    plant(root, f"{PORT}/gid_attrs/types/3", how)
    port = mlx5_0(root)
    entry = port.entry(3)
    assert entry is not None and entry.roce_type is None and error in entry.type_error
    assert port.nccl_job is not None
    if how == "einval":  # the container case: 2.26+ skips it and ends on the v1 GID
        assert (port.nccl_job.index, port.nccl_job.einval_reads) == (2, (3,))
    else:
        assert (port.nccl_job.index, port.nccl_job.failed_read) == (None, 3)


@pytest.mark.parametrize(("how", "error"), [("missing", "not captured"), ("empty", "not a number"), ("garbage", "UTF-8"), ("einval", "EINVAL")])
def test_bad_netdev_mtu(tmp_path: Path, how: str, error: str) -> None:
    root = copy_node(tmp_path, "roce-v1v2")
    plant(root, f"{NET}/mtu", how)
    port = mlx5_0(root)
    assert port.mtu is None and port.roce_mtu is None and error in port.mtu_error


@pytest.mark.parametrize("how", ["empty", "garbage", "einval"])
def test_bad_ecn_switch(tmp_path: Path, how: str) -> None:
    root = copy_node(tmp_path, "roce-v1v2")
    plant(root, f"{NET}/ecn/roce_np/enable/3", how)
    ecn = mlx5_0(root).ecn
    assert ecn.notification_point is None and "ecn/roce_np/enable/3" in ecn.error


@pytest.mark.parametrize(("how", "error"), [("garbage", "UTF-8"), ("empty", "unexpected value ''"), ("einval", "EINVAL")])
def test_garbled_port_state_is_unknown_not_inactive(tmp_path: Path, how: str, error: str) -> None:
    root = copy_node(tmp_path, "roce-v1v2")
    plant(root, f"{PORT}/state", how)
    port = mlx5_0(root)
    assert port.state is None and port.state_error.startswith("/sys/class/infiniband/mlx5_0/ports/1/state: ") and error in port.state_error


# -- NodeFS recorded read errors ------------------------------------------------------------------
def test_recorded_read_errors(tmp_path: Path) -> None:
    (tmp_path / "sys").mkdir()
    (tmp_path / "sys/present").write_text("here\n")
    (tmp_path / ".preflight").mkdir()
    (tmp_path / "sys/listed").write_text("kept so that listings show it\n")
    (tmp_path / ".preflight/read-errors.json").write_text(json.dumps({"errors": {"/sys/listed": "EINVAL", "/sys/*": "EINVAL", "/other": "EIO"}}))
    fs = NodeFS(str(tmp_path))
    assert fs.read("/sys/present") == "here\n"  # patterns only cover absent files
    with pytest.raises(SourceError, match=r"\(EINVAL\)"):
        fs.read("/sys/listed")  # a plain path fails even though its file exists
    with pytest.raises(SourceError, match=r"invalid argument \(EINVAL\)"):
        fs.read("/sys/absent")
    with pytest.raises(SourceError, match=r"\(EIO\)"):
        fs.read("/other")
    assert fs.read("/elsewhere") is None
    (tmp_path / ".preflight/read-errors.json").write_text("{broken")
    assert NodeFS(str(tmp_path)).read("/sys/absent") is None  # a broken list records nothing


# -- DCB netlink ----------------------------------------------------------------------------------
def reply(ifname: str, pfc_en: int, apps: list[tuple[int, int, int]], dcbx: int | None = 9) -> bytes:
    """An RTM_GETDCB answer built by hand with struct, as net/dcb/dcbnl.c lays it out."""

    def attr(kind: int, payload: bytes) -> bytes:
        return struct.pack("=HH", 4 + len(payload), kind) + payload + bytes(-len(payload) % 4)

    pfc = struct.pack("=BBBxH2x", 8, pfc_en, 0, 0) + bytes(128)
    table = b"".join(attr(1, struct.pack("=BBH", selector, priority, protocol)) for selector, priority, protocol in apps)
    body = attr(1, ifname.encode() + b"\0") + attr(13, attr(2, pfc) + attr(3, table))
    if dcbx is not None:
        body += attr(14, bytes([dcbx]))
    payload = struct.pack("=BBH", 0, 21, 0) + body
    return struct.pack("=IHHII", 16 + len(payload), 78, 0, 1, 0) + payload


def test_dcb_reply_decodes() -> None:
    apps = [(5, 3, 26), (5, 6, 48), (1, 0, 0)]  # two DSCP entries and a default-priority entry
    config = decode_dcb_reply("ens1f0np0", reply("ens1f0np0", 0b00001000, apps))
    assert config == DcbConfig("ens1f0np0", 8, (3,), ((26, 3), (48, 6)), 9)
    assert decode_dcb_reply("x", reply("x", 0, [], None)) == DcbConfig("x", 8, (), (), None)


def test_dcb_request_layout() -> None:
    data = encode_dcb_request("ens1f0np0", sequence=7)
    length, kind, flags, sequence = struct.unpack_from("=IHHI", data)
    assert (length, kind, flags & 1, sequence) == (len(data), 78, 1, 7)
    assert data[16:18] == bytes([0, 21]) and b"ens1f0np0\0" in data


def test_dcb_error_replies() -> None:
    error = struct.pack("=IHHII", 36, 2, 0, 1, 0) + struct.pack("=i", -95) + bytes(16)
    with pytest.raises(SourceError, match="EOPNOTSUPP.*no DCB support"):
        decode_dcb_reply("eth0", error)
    with pytest.raises(SourceError, match="short netlink reply"):
        decode_dcb_reply("eth0", b"\0" * 8)
    without_pfc = struct.pack("=IHHII", 24, 78, 0, 1, 0) + struct.pack("=BBH", 0, 21, 0) + struct.pack("=HH", 4, 13)
    with pytest.raises(SourceError, match="no PFC configuration"):
        decode_dcb_reply("eth0", without_pfc)


def test_live_dcb_query_on_loopback() -> None:
    """The real kernel: loopback has no DCB operations, so the answer is a clear error, quickly."""
    try:
        socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 0).close()
    except OSError as error:
        pytest.skip(f"no netlink sockets here: {error}")
    with pytest.raises(SourceError, match="RTM_GETDCB lo: .*EOPNOTSUPP"):
        query_dcb("lo")
    with pytest.raises(SourceError, match="ENODEV"):
        query_dcb("no-such-if0")


def test_dcb_replay_and_file_sources(tmp_path: Path) -> None:
    with pytest.raises(SourceError, match="only exposed through netlink"):
        FileNetlink(NodeFS(str(tmp_path))).dcb("eth0")
    recorded = ReplayNetlink({"dcb": {"a": {"ifname": "a", "pfc_cap": 8, "pfc_enabled": [3], "dscp_to_priority": [[26, 3]], "dcbx": None},
                                      "b": {"error": "no such device (ENODEV)"}, "c": {"ifname": "c"}}})
    assert recorded.dcb("a") == DcbConfig("a", 8, (3,), ((26, 3),), None)
    with pytest.raises(SourceError, match="ENODEV"):
        recorded.dcb("b")
    with pytest.raises(SourceError, match="malformed DCB entry"):
        recorded.dcb("c")
    with pytest.raises(SourceError, match="no DCB state recorded"):
        recorded.dcb("d")
    document = json.loads(json.dumps(dump(recorded, dcb_interfaces=["a", "b"])))
    assert document["dcb"]["a"]["pfc_enabled"] == [3] and document["dcb"]["b"] == {"error": "no such device (ENODEV)"}
