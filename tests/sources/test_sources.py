"""Sources against real kernel state and recorded roots."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from preflight.sources import NodeFS, NotCaptured, SourceError
from preflight.sources.netlink import FileNetlink, LiveNetlink, ReplayNetlink, dump
from preflight.sources.nvml import Gpu, LiveNvml, NvmlError, ReplayNvml, plain


def test_live_netlink_agrees_with_the_kernel_files() -> None:
    """pyroute2's dump and /sys/class/net + /proc/net describe the same links on this host."""
    live = {(link.name, link.mtu, link.index) for link in LiveNetlink().links()}
    files = {(link.name, link.mtu, link.index) for link in FileNetlink(NodeFS("/")).links()}
    assert live == files and live
    live_v4 = {(a.ifname, a.address) for a in LiveNetlink().addresses() if a.family == 4}
    file_v4 = {(a.ifname, a.address) for a in FileNetlink(NodeFS("/")).addresses() if a.family == 4}
    assert live_v4 == file_v4


def test_netlink_recording_round_trips(tmp_path: Path) -> None:
    recording = tmp_path / "netlink.json"
    recording.write_text(json.dumps(dump(LiveNetlink())))
    replay = ReplayNetlink.from_file(str(recording))
    assert replay.links() == LiveNetlink().links()
    (tmp_path / "bad.json").write_text("[1, 2")
    with pytest.raises(SourceError, match="unreadable netlink recording"):
        ReplayNetlink.from_file(str(tmp_path / "bad.json")).links()


def test_file_netlink_on_the_example_root(example_root: Path) -> None:
    netlink = FileNetlink(NodeFS(str(example_root)))
    links = {link.name: link for link in netlink.links()}
    assert links["docker0"].kind == "bridge" and links["ibp26s0"].link_type == "infiniband" and links["ibp26s0"].mtu == 4092
    addresses = {(a.ifname, a.address) for a in netlink.addresses()}
    assert ("eno1", "10.10.1.17") in addresses and ("lo", "127.0.0.1") in addresses


def test_absolute_symlinks_stay_inside_the_root(tmp_path: Path) -> None:
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "real").write_text("inside\n")
    os.symlink("/etc/real", tmp_path / "etc" / "link")
    os.symlink("/etc/passwd", tmp_path / "etc" / "escape")
    fs = NodeFS(str(tmp_path))
    assert fs.read("/etc/link") == "inside\n"
    with pytest.raises(NotCaptured, match="links to a path"):  # /etc/passwd of the root: not there
        fs.read("/etc/escape")
    os.symlink("loop", tmp_path / "etc" / "loop")
    with pytest.raises(SourceError, match="ELOOP|symbolic links"):
        fs.read("/etc/loop")


def test_bounded_and_binary_reads(tmp_path: Path) -> None:
    (tmp_path / "big").write_bytes(b"x" * 200)
    (tmp_path / "bin").write_bytes(b"\xff\x00\xfe")
    fs = NodeFS(str(tmp_path), max_bytes=100)
    with pytest.raises(SourceError, match="larger than 100 bytes"):
        fs.read("/big")
    with pytest.raises(SourceError, match="not UTF-8"):
        fs.read("/bin")
    assert fs.read("/missing") is None and fs.listdir("/missing") is None


def test_replayed_nvml_answers_errors_and_missing_entries() -> None:
    nvml = ReplayNvml({"calls": {"nvmlDeviceGetCount": {"result": 2}, "nvmlDeviceGetName": {"0": {"error": "NVML_ERROR_GPU_IS_LOST"}}}})
    assert nvml.call("nvmlDeviceGetCount") == 2
    with pytest.raises(NvmlError) as lost:
        nvml.call("nvmlDeviceGetName", 0)
    assert lost.value.code == "NVML_ERROR_GPU_IS_LOST"
    with pytest.raises(NvmlError) as missing:
        nvml.call("nvmlDeviceGetName", 1)
    assert missing.value.code == "NVML_NOT_RECORDED"
    broken = ReplayNvml({"init": {"error": "NVML_ERROR_DRIVER_NOT_LOADED"}})
    with pytest.raises(NvmlError, match="DRIVER_NOT_LOADED"):
        broken.call("nvmlDeviceGetCount")


def test_a_recorded_device_count_beyond_any_node_is_refused(tmp_path: Path) -> None:
    """Probes ask NVML per device and per pair of devices: a recording claiming a billion GPUs
    would choose unbounded work, so the replay refuses it as unreadable (checks say unknown)."""
    import time

    from preflight.probes.gpus import probe_gpus
    from preflight.sources import NodeFS

    huge = ReplayNvml({"calls": {"nvmlDeviceGetCount": {"result": 10**9}, "nvmlSystemGetDriverVersion": {"result": "550.54.15"}}})
    with pytest.raises(NvmlError) as refused:
        huge.call("nvmlDeviceGetCount")
    assert refused.value.code == "NVML_REPLAY_UNREADABLE" and "1000000000 devices" in str(refused.value)
    assert ReplayNvml({"calls": {"nvmlDeviceGetCount": {"result": 256}}}).call("nvmlDeviceGetCount") == 256
    start = time.monotonic()
    facts = probe_gpus(NodeFS(str(tmp_path)), huge)
    assert facts.nvml_error == "NVML_REPLAY_UNREADABLE" and facts.devices == () and time.monotonic() - start < 60  # hang guard only


def test_replayed_nvml_calls_with_arguments_use_slash_keys() -> None:
    nvml = ReplayNvml({"calls": {
        "nvmlDeviceGetNvLinkState": {"0/0": {"result": 1}, "0/1": {"error": "NVML_ERROR_NOT_SUPPORTED"}},
        "nvmlDeviceGetP2PStatus": {"0/gpu1/0": {"result": 0}},
    }})
    assert nvml.call("nvmlDeviceGetNvLinkState", 0, 0) == 1
    assert nvml.call("nvmlDeviceGetP2PStatus", 0, Gpu(1), 0) == 0
    with pytest.raises(NvmlError, match="NOT_SUPPORTED"):
        nvml.call("nvmlDeviceGetNvLinkState", 0, 1)
    with pytest.raises(NvmlError, match=r"nvmlDeviceGetNvLinkState\[0/2\] is not in"):
        nvml.call("nvmlDeviceGetNvLinkState", 0, 2)


def test_live_nvml_passes_arguments_and_second_device_handles(monkeypatch: pytest.MonkeyPatch) -> None:
    """The live source turns ``Gpu(n)`` into that device's handle, as the C API wants."""
    import types

    calls: list[tuple[object, ...]] = []
    fake = types.ModuleType("pynvml")

    class NVMLError(Exception):
        value = 0

    fake.NVMLError = NVMLError  # type: ignore[attr-defined]
    fake.nvmlInit = lambda: None  # type: ignore[attr-defined]
    fake.nvmlDeviceGetHandleByIndex = lambda index: f"handle{index}"  # type: ignore[attr-defined]

    def p2p(*arguments: object) -> int:
        calls.append(arguments)
        return 0

    fake.nvmlDeviceGetP2PStatus = p2p  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    assert LiveNvml().call("nvmlDeviceGetP2PStatus", 0, Gpu(3), 2) == 0
    assert calls == [("handle0", "handle3", 2)]


def test_plain_turns_pynvml_process_objects_into_dicts() -> None:
    """pynvml hands nvmlDeviceGetComputeRunningProcesses back as plain objects, not ctypes structs."""
    import pynvml

    listed = [pynvml.nvmlFriendlyObject({"pid": 4242, "usedGpuMemory": 1 << 30, "gpuInstanceId": 0xFFFFFFFF, "computeInstanceId": 0xFFFFFFFF})]
    assert plain(listed) == [{"pid": 4242, "usedGpuMemory": 1 << 30, "gpuInstanceId": 0xFFFFFFFF, "computeInstanceId": 0xFFFFFFFF}]


def test_plain_keeps_every_byte_of_a_binary_uuid_field() -> None:
    """A cluster UUID with a zero byte early on stays 16 bytes (ctypes would cut it at the NUL);
    text fields stay text."""
    import ctypes

    class FabricInfo(ctypes.Structure):
        _fields_ = [("clusterUuid", ctypes.c_char * 16), ("state", ctypes.c_uint), ("name", ctypes.c_char * 8)]

    info = FabricInfo(b"", 3, b"gb200")
    # as the driver fills it; a bytes initialiser would itself stop at the NUL
    ctypes.memmove(ctypes.addressof(info) + FabricInfo.clusterUuid.offset, bytes([0x9A, 0, 0x41]), 3)
    assert plain(info) == {"clusterUuid": [0x9A, 0, 0x41] + [0] * 13, "state": 3, "name": "gb200"}


def test_one_view_reads_each_file_once(tmp_path: Path) -> None:
    """Probes sharing a view see one consistent picture and do not repeat I/O."""
    (tmp_path / "proc").mkdir()
    environ = tmp_path / "proc" / "environ"
    environ.write_bytes(b"NCCL_DEBUG=INFO\0")
    fs = NodeFS(str(tmp_path))
    assert fs.read_bytes("/proc/environ") == b"NCCL_DEBUG=INFO\0"
    environ.write_bytes(b"NCCL_DEBUG=WARN\0")
    assert fs.read_bytes("/proc/environ") == b"NCCL_DEBUG=INFO\0"
    assert NodeFS(str(tmp_path)).read_bytes("/proc/environ") == b"NCCL_DEBUG=WARN\0"
    listing = fs.listdir("/proc")
    assert listing == ["environ"]
    listing.append("mutated by a caller")  # callers get their own copy
    assert fs.listdir("/proc") == ["environ"]
    (tmp_path / "bin").write_bytes(b"\xff")
    with pytest.raises(SourceError):
        fs.read("/bin")
    with pytest.raises(SourceError):  # the remembered failure, not a second read
        fs.read("/bin")


def test_a_view_that_remembered_a_failure_is_freed_without_a_gc_pass(tmp_path: Path) -> None:
    """A remembered failure raised again must not tie the view to the error (through the raising
    frame): the view, and the descriptor of its root, would then live until a GC pass, and a
    process that runs the prolog in a loop piled up descriptors."""
    import gc
    import weakref

    (tmp_path / "sys" / "class").mkdir(parents=True)
    gc.disable()
    try:
        fs = NodeFS(str(tmp_path))
        for _ in range(2):
            with pytest.raises(NotCaptured):
                fs.listdir("/sys/class/iommu")  # a capture unit this root lacks
        alive = weakref.ref(fs)
        del fs
        assert alive() is None
    finally:
        gc.enable()


def test_a_root_without_a_statvfs_recording_answers_nothing_about_mounts(tmp_path: Path) -> None:
    """Missing is not empty: a root whose taker recorded no file system sizes says nothing of
    /dev/shm (NCCL007 and VLLM001 would otherwise read "missing" and report it present)."""
    (tmp_path / "dev").mkdir()
    with pytest.raises(NotCaptured, match="statvfs.json"):
        NodeFS(str(tmp_path)).statvfs("/dev/shm")
    (tmp_path / ".preflight").mkdir()
    (tmp_path / ".preflight" / "statvfs.json").write_text('{"format": "preflight-statvfs/1", "mounts": {}}')
    (tmp_path / "mnt").mkdir()
    assert NodeFS(str(tmp_path)).statvfs("/mnt/data") is None  # sizes recorded, and no such directory


def test_a_directory_past_the_listing_cap_is_an_error_not_a_partial_list(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An untrusted root may hold a directory with millions of entries: the listing stops at the
    cap and says so, because a cut listing would report what it left out as absent."""
    import preflight.sources.fs as fs_module

    monkeypatch.setattr(fs_module, "MAX_DIR_ENTRIES", 5)
    full = tmp_path / "usr" / "lib"
    full.mkdir(parents=True)
    for index in range(5):
        (full / f"lib{index}.so").write_bytes(b"")
    assert NodeFS(str(tmp_path)).listdir("/usr/lib") == [f"lib{index}.so" for index in range(5)]
    (full / "libibverbs.so.1").write_bytes(b"")
    with pytest.raises(SourceError, match="more than 5 entries; not listed"):
        NodeFS(str(tmp_path)).listdir("/usr/lib")


def test_live_kernel_log_keeps_the_newest_records_within_its_budget() -> None:
    """/dev/kmsg hands out records oldest first; past the budget the oldest are dropped, so a
    large ring buffer still shows the last job's Xid."""
    fs = NodeFS("/")
    try:
        whole = fs.read_kernel_log()
    except SourceError as error:
        pytest.skip(f"this machine's kernel log cannot be read: {error}")
    if not whole or sum(len(record) for record in whole) < 8192:
        pytest.skip("this machine's kernel log is too short to cut")
    newest = fs.read_kernel_log(max_bytes=4096)
    assert newest is not None and 0 < len(newest) < len(whole)
    # Records logged between the two reads only add at the end.
    first = whole.index(newest[0])
    assert whole[first:] == newest[: len(whole) - first]


@pytest.mark.parametrize("live", [True, False])
def test_a_path_with_a_nul_byte_is_a_source_error(live: bool, example_root: Path) -> None:
    """Probes build paths from what files say (a netdev name in gid_attrs/ndevs); a NUL byte in one
    made os raise ValueError, which ended the roce probe (fuzz seed 45000561)."""
    fs = NodeFS("/" if live else str(example_root))
    path = "/sys/class/net/ens1f\0np0/mtu"
    for operation in (fs.read, fs.listdir, fs.readlink, fs.stat, fs.exists):
        with pytest.raises(SourceError, match="NUL byte"):
            operation(path)


def test_a_live_process_entry_that_is_not_there_says_why_it_may_be_missing() -> None:
    """On a live node a pid another file names (slurmd's pid file) may have ended, or /proc may
    hide other users' processes (hidepid): not 'not captured', which speaks of a copied root."""
    pid = 4_194_305  # above PID_MAX_LIMIT (4194304): no process can hold it
    with pytest.raises(NotCaptured, match=rf"/proc/{pid} is not visible: the process ended, or /proc is mounted with hidepid"):
        NodeFS("/").read(f"/proc/{pid}/comm")
