"""NVL006 (GPUs outside a completed NVLink fabric, NVSwitch systems without their fabric manager)
and NVL004 (fabric manager restarted after boot), from replayed NVML fabric answers, the PCI bus,
/proc and the fabric manager's command socket, on the example HGX H100 and the GB200 tray."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from preflight.probes.fabric import FabricFacts, parse_fm_config, parse_start_after_boot, probe_fabric
from preflight.checks.nvl import nvls_cuda_invalid_argument, nvls_multicast_init_failure
from preflight.probes.job import probe_job
from preflight.probes.rdma import probe_rdma
from preflight.model import NotApplicable, Severity, Status
from preflight.sources import Sources

from conftest import write

NODES = Path(__file__).resolve().parents[1] / "fixtures" / "nodes"
HEALTHY = {"clusterUuid": [0] * 16, "status": 0, "cliqueId": 0, "state": 3}
FM_LISTEN_LINE = "   2: 0100007F:1A0A"


def facts(root: Path) -> FabricFacts:
    sources = Sources.for_node(str(root), None)
    return probe_fabric(sources.fs, sources.nvml)


def verdicts(root: Path) -> list[tuple[str, Status, str]]:
    sources = Sources.for_node(str(root), None)
    found = nvls_multicast_init_failure(probe_fabric(sources.fs, sources.nvml), probe_job(sources.fs), probe_rdma(sources.fs))
    return [(o.subject, o.status, " ".join(e.observed for e in o.evidence) + o.reason) for o in found]


def restarts(root: Path) -> list[tuple[str, Status, Severity | None, str]]:
    found = nvls_cuda_invalid_argument(facts(root), probe_rdma(Sources.for_node(str(root), None).fs))
    return [(o.subject, o.status, o.severity, " ".join(f"{e.observed} / {e.expected}" for e in o.evidence) + o.reason) for o in found]


def edit_fabric(root: Path, answers: dict[str, Any]) -> None:
    path = root / ".preflight/nvml.json"
    document = json.loads(path.read_text())
    document["calls"]["nvmlDeviceGetGpuFabricInfo"] = answers
    path.write_text(json.dumps(document))


def stop_fabric_manager(root: Path, process: bool = True, socket: bool = True) -> None:
    if process:
        shutil.rmtree(root / "proc/1843")
    if socket:
        tcp = root / "proc/net/tcp"
        tcp.write_text("".join(line for line in tcp.read_text().splitlines(True) if not line.startswith(FM_LISTEN_LINE)))


@pytest.fixture
def gb200(tmp_path: Path) -> Path:
    target = tmp_path / "gb200-tray"
    shutil.copytree(NODES / "gb200-tray", target, symlinks=True)
    return target


# -- probe on recorded roots --------------------------------------------------------------------
def test_example_fabric_manager_is_seen_three_ways(example_root: Path) -> None:
    manager = facts(example_root).fabric_manager
    assert (manager.pids, manager.host_view, manager.pid1) == ((1843,), True, "systemd")
    assert manager.listening == "127.0.0.1:6666 (/proc/net/tcp:4)"
    assert manager.started_after_boot_s == 42.15 and manager.problems == ()


def test_gb200_tray_is_a_multi_node_fabric_member() -> None:
    tray = facts(NODES / "gb200-tray")
    assert tray.nvswitches == () and tray.multi_node_tray  # Grace's 0x0604 root ports are not NVSwitches
    assert {(g.state, g.status, g.clique_id) for g in tray.gpus} == {(3, 0, 32766)}
    assert tray.gpus[0].cluster_uuid == "5a1f3c089e444b61a7023dc17710e42b"
    assert not tray.fabric_manager.running


# -- NVL006 -------------------------------------------------------------------------------------
def test_completed_fabric_is_absent(example_root: Path) -> None:
    assert verdicts(example_root) == []
    assert verdicts(NODES / "gb200-tray") == []  # no fabric manager on a compute tray, and none needed


def test_gpu_whose_fabric_is_not_started_is_present(node_copy: Path) -> None:
    answers = {str(i): {"result": HEALTHY} for i in range(8)}
    answers["6"] = {"result": {**HEALTHY, "state": 1}}
    edit_fabric(node_copy, answers)
    stop_fabric_manager(node_copy)
    write(node_copy, "/proc/self/environ", b"NCCL_NVLS_ENABLE=1\0")
    found = verdicts(node_copy)
    assert [(s, st) for s, st, _ in found] == [("fabric manager", Status.PRESENT), ("GPU6", Status.PRESENT)]
    assert "no nv-fabricmanager process" in found[0][2] and "4 NVSwitches" in found[0][2]
    assert "fabric not started" in found[1][2] and found[1][2].endswith(" 1")


def test_fabric_manager_not_seen_beside_a_completed_fabric_is_unknown(node_copy: Path) -> None:
    """Every GPU reporting its fabric completed with success is the fabric manager's work: one not
    seen may run where this view cannot see it, so at most unknown, never an error."""
    stop_fabric_manager(node_copy, socket=False)
    assert verdicts(node_copy) == []  # its command port still listens: it runs where /proc cannot see it
    stop_fabric_manager(node_copy, process=False)
    found = verdicts(node_copy)
    assert [(s, st) for s, st, _ in found] == [("fabric manager", Status.UNKNOWN)] and "fabric completed" in found[0][2]


def test_old_driver_falls_back_on_the_fabric_manager(node_copy: Path) -> None:
    edit_fabric(node_copy, {str(i): {"error": "NVML_ERROR_FUNCTION_NOT_FOUND"} for i in range(8)})
    assert verdicts(node_copy) == []
    stop_fabric_manager(node_copy)
    assert [s for s, _, _ in verdicts(node_copy)] == ["fabric manager"]


def test_fabric_manager_on_a_configured_port_or_unix_socket(node_copy: Path) -> None:
    stop_fabric_manager(node_copy)
    write(node_copy, "/usr/share/nvidia/nvswitch/fabricmanager.cfg", "LOG_LEVEL=4\nFM_CMD_PORT_NUMBER=16001\n")
    tcp = node_copy / "proc/net/tcp"
    tcp.write_text(tcp.read_text() + "   5: 0100007F:3E81 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 99 1 0 100 0 0 10 0\n")
    assert verdicts(node_copy) == []
    write(node_copy, "/usr/share/nvidia/nvswitch/fabricmanager.cfg", "FM_CMD_UNIX_SOCKET_PATH=/run/nvidia-fabricmanager/fm.sock\n")
    write(node_copy, "/proc/net/unix", "Num       RefCount Protocol Flags    Type St Inode Path\n"
                                        "0000000000000000: 00000002 00000000 00010000 0001 01 31337 /run/nvidia-fabricmanager/fm.sock\n")
    assert facts(node_copy).fabric_manager.listening == "/run/nvidia-fabricmanager/fm.sock"
    assert verdicts(node_copy) == []


def test_container_process_table_makes_a_missing_fabric_manager_unknown(node_copy: Path) -> None:
    stop_fabric_manager(node_copy)
    edit_fabric(node_copy, {str(i): {"result": {**HEALTHY, "state": 1}} for i in range(8)})  # not started: NVL006's other half
    assert [(s, st) for s, st, _ in verdicts(node_copy)][0] == ("fabric manager", Status.PRESENT)  # the host's table
    write(node_copy, "/proc/1/comm", "pause\n")
    assert verdicts(node_copy)[0] == ("fabric manager", Status.UNKNOWN,
                                      "no nv-fabricmanager process seen, but PID 1 is pause, not the host's init: "
                                      "this is not the host's process table")
    (node_copy / "proc/1/comm").unlink()
    assert "PID 1 is unreadable" in verdicts(node_copy)[0][2]
    # NVL004 cannot date a fabric manager it cannot see either: unknown, not "none runs"
    write(node_copy, "/proc/1/comm", "pause\n")
    [(subject, status, _, said)] = restarts(node_copy)
    assert (subject, status) == ("fabric manager", Status.UNKNOWN) and "PID 1 is pause" in said


@pytest.mark.parametrize(
    ("planted", "said"),
    [
        ({"/proc/1/environ": b"container=lxc\0HOME=/\0"}, "container="),  # LXD/Incus, systemd-nspawn, podman
        ({"/run/systemd/container": "lxc\n"}, "/run/systemd/container exists"),
        ({"/.dockerenv": ""}, "/.dockerenv exists"),
        ({"/run/.containerenv": ""}, "/run/.containerenv exists"),
        ({"/etc/hosts": "# Kubernetes-managed hosts file.\n127.0.0.1\tlocalhost\n"}, "/etc/hosts (kubelet's) exists"),  # a pod under containerd
        ({"/proc/1/environ": None}, "/proc/1/environ is missing"),
    ],
)
def test_a_system_container_s_own_systemd_is_not_the_host(node_copy: Path, planted: dict[str, str | bytes | None], said: str) -> None:
    """LXD/Incus, systemd-nspawn and pods whose entrypoint is /sbin/init run their own systemd as
    PID 1 in their own PID and network namespaces: the host's fabric manager is invisible there.
    The table counts as the host's only on positive evidence (PID 1's environment read, no
    container marker), else a missing fabric manager is unknown."""
    stop_fabric_manager(node_copy)
    edit_fabric(node_copy, {str(i): {"result": {**HEALTHY, "state": 1}} for i in range(8)})
    for path, content in planted.items():
        if content is None:
            (node_copy / path.lstrip("/")).unlink()
        else:
            write(node_copy, path, content)
    manager = facts(node_copy).fabric_manager
    assert manager.host_view is (None if "missing" in said else False) and said in manager.not_host
    found = verdicts(node_copy)
    assert found[0][:2] == ("fabric manager", Status.UNKNOWN) and said in found[0][2]


def test_not_applicable_without_nvswitches_or_fabric(node_copy: Path) -> None:
    for bdf in ("0000:05:00.0", "0000:06:00.0", "0000:07:00.0", "0000:08:00.0"):
        (node_copy / "sys/bus/pci/devices" / bdf).unlink()
    with pytest.raises(NotApplicable, match="no NVSwitch"):
        verdicts(node_copy)
    with pytest.raises(NotApplicable, match="no NVSwitch"):
        verdicts(NODES / "rtx5090-workstation")


def test_blackwell_board_is_known_by_its_nvswitch_management_functions(node_copy: Path) -> None:
    """HGX/DGX B200: the NVSwitches are not on the host's PCI bus (Fabric Manager and NVLSM reach
    them through the baseboard's ConnectX functions whose VPD says SMDL=SW_MNG), yet GPUs whose
    fabric never completed fail CUDA's start: the fabric is judged as on a Hopper board."""
    for bdf in ("0000:05:00.0", "0000:06:00.0", "0000:07:00.0", "0000:08:00.0"):
        (node_copy / "sys/bus/pci/devices" / bdf).unlink()
    write(node_copy, "/sys/class/infiniband/mlx5_0/device/vpd", b"\x82\x10\x00ConnectX-7 Bridge\x90\x10\x00V2\x0bSMDL=SW_MNG\x78\x00")
    assert verdicts(node_copy) == [] and restarts(node_copy) == []  # judged, and healthy
    answers = {str(i): {"result": HEALTHY} for i in range(8)}
    answers["3"] = {"result": {**HEALTHY, "state": 2}}
    edit_fabric(node_copy, answers)
    stop_fabric_manager(node_copy)
    found = verdicts(node_copy)
    assert [(s, st) for s, st, _ in found] == [("fabric manager", Status.PRESENT), ("GPU3", Status.PRESENT)]
    assert "mlx5_0: NVSwitch management functions (SMDL=SW_MNG)" in found[0][2]


def test_gb200_gpu_outside_the_fabric_is_present_without_asking_for_a_fabric_manager(gb200: Path) -> None:
    document = json.loads((gb200 / ".preflight/nvml.json").read_text())
    answers = document["calls"]["nvmlDeviceGetGpuFabricInfo"]
    answers["1"] = {"result": {**answers["1"]["result"], "state": 2}}
    edit_fabric(gb200, answers)
    found = verdicts(gb200)
    assert [(s, st) for s, st, _ in found] == [("GPU1", Status.PRESENT)]
    assert "fabric in progress" in found[0][2] and "clique 32766" in found[0][2]


def test_fabric_query_errors_are_unknown_per_gpu(node_copy: Path) -> None:
    answers = {str(i): {"result": HEALTHY} for i in range(8)}
    answers["2"] = {"error": "NVML_ERROR_UNKNOWN"}
    answers["4"] = {"result": "garbage"}
    edit_fabric(node_copy, answers)
    assert [(s, st) for s, st, _ in verdicts(node_copy)] == [("GPU2", Status.UNKNOWN), ("GPU4", Status.UNKNOWN)]


def test_garbage_tcp_table_is_a_problem_not_a_crash(node_copy: Path) -> None:
    stop_fabric_manager(node_copy, socket=False)
    (node_copy / "proc/net/tcp").write_text("garbage\n")
    manager = facts(node_copy).fabric_manager
    assert manager.listening is None and manager.problems == ("/proc/net/tcp: not a TCP table",)


# -- NVL004 -------------------------------------------------------------------------------------
def test_fabric_manager_started_at_boot_is_absent(example_root: Path) -> None:
    assert restarts(example_root) == []


def test_fabric_manager_restarted_hours_after_boot_is_present(node_copy: Path) -> None:
    stat = node_copy / "proc/1843/stat"
    stat.write_text(stat.read_text().replace(" 4215 ", " 1143000 "))
    assert restarts(node_copy) == [("fabric manager", Status.PRESENT, Severity.WARNING,
                                    "nv-fabricmanager (pid 1843) started 3 h 10 min after boot / "
                                    "started at boot (within 30 min), not restarted since")]


@pytest.mark.parametrize("content", [None, "1843 (nv-fabricmanage) S 1\n", "\xff\xfe"])
def test_unreadable_start_time_is_unknown(node_copy: Path, content: str | None) -> None:
    stat = node_copy / "proc/1843/stat"
    if content is None:
        stat.unlink()
    else:
        stat.write_bytes(content.encode("latin-1"))
    (found,) = restarts(node_copy)
    assert found[:2] == ("fabric manager", Status.UNKNOWN) and "/proc/1843/stat" in found[3]


def test_restart_check_needs_an_nvswitch_and_a_running_fabric_manager(node_copy: Path) -> None:
    with pytest.raises(NotApplicable, match="no NVSwitch"):
        restarts(NODES / "gb200-tray")
    stop_fabric_manager(node_copy, socket=False)
    (found,) = restarts(node_copy)
    assert found[1] is Status.UNKNOWN and "127.0.0.1:6666" in found[3]
    stop_fabric_manager(node_copy, process=False)
    with pytest.raises(NotApplicable, match="NVL006"):
        restarts(node_copy)


# -- parsers ------------------------------------------------------------------------------------
def test_parse_start_after_boot_survives_parentheses_in_the_name() -> None:
    assert parse_start_after_boot("77 (odd) name) S 1 77 77 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 6000 0 0\n") == 60.0
    with pytest.raises(ValueError):
        parse_start_after_boot("77 (x) S 1 2")


def test_parse_fm_config() -> None:
    assert parse_fm_config("") == (6666, "127.0.0.1", "")
    assert parse_fm_config("# FM_CMD_PORT_NUMBER=1\nFM_CMD_PORT_NUMBER = 7000\nFM_CMD_BIND_INTERFACE=10.0.0.1\n") == (7000, "10.0.0.1", "")
    assert parse_fm_config("FM_CMD_PORT_NUMBER=abc\n")[0] == 6666


# -- the prolog's look-up: the pid file first, no scan where no fabric manager runs ---------------
def test_the_pid_file_names_the_fabric_manager_without_a_scan(node_copy: Path) -> None:
    """A daemonised fabric manager writes its pid file (PID_FILE_PATH, /var/run being /run): that
    process alone is asked, and no other process's name is read. A second nv-fabricmanager,
    which a scan would list, shows that none ran."""
    write(node_copy, "/proc/1999/comm", "nv-fabricmanager\n")
    write(node_copy, "/run/nvidia-fabricmanager/nv-fabricmanager.pid", "1843\n")
    manager = facts(node_copy).fabric_manager
    assert (manager.pids, manager.listening, manager.started_after_boot_s) == ((1843,), None, 42.15)
    # Another path in fabricmanager.cfg is followed.
    (node_copy / "run/nvidia-fabricmanager/nv-fabricmanager.pid").unlink()
    write(node_copy, "/usr/share/nvidia/nvswitch/fabricmanager.cfg", "PID_FILE_PATH=/run/fm/fm.pid\n")
    write(node_copy, "/run/fm/fm.pid", "1843\n")
    assert facts(node_copy).fabric_manager.pids == (1843,)


@pytest.mark.parametrize("content", ["77\n", "garbage\n", "", "-1\n"])
def test_a_stale_or_garbage_pid_file_falls_back_to_the_scan(node_copy: Path, content: str) -> None:
    write(node_copy, "/run/nvidia-fabricmanager/nv-fabricmanager.pid", content)
    manager = facts(node_copy).fabric_manager
    assert manager.pids == (1843,) and manager.listening == "127.0.0.1:6666 (/proc/net/tcp:4)"
    stop_fabric_manager(node_copy, socket=False)
    assert facts(node_copy).fabric_manager.pids == ()


def test_no_fabric_manager_is_looked_for_where_none_runs(gb200: Path) -> None:
    """PCIe boards (every GPU's fabric "not supported", no NVSwitch) and GB200/GB300 trays run no
    fabric manager: a prolog does not read every process's name for it."""
    assert "multi-node NVLink fabric" in facts(gb200).fabric_manager.not_looked_for
    edit_fabric(gb200, {str(i): {"result": {**HEALTHY, "state": 0}} for i in range(4)})
    manager = facts(gb200).fabric_manager
    assert "'not supported'" in manager.not_looked_for and not manager.running
    with pytest.raises(NotApplicable):
        verdicts(gb200)
    # Without NVML (a host without GPUs, a broken driver) NVL006 judges nothing: no scan either.
    (gb200 / ".preflight/nvml.json").unlink()
    assert "NVML is unavailable" in facts(gb200).fabric_manager.not_looked_for


def test_nvl006_runs_in_the_prolog(run_cli: Any, node_copy: Path) -> None:
    answers = {str(i): {"result": HEALTHY} for i in range(8)}
    answers["6"] = {"result": {**HEALTHY, "state": 1}}
    edit_fabric(node_copy, answers)
    stop_fabric_manager(node_copy)
    result = run_cli("node", "--root", str(node_copy), "--profile", "prolog", "--select", "NVL", "--format", "json")
    found = sorted((f["id"], f["status"], f["subject"]) for f in json.loads(result.stdout)["findings"])
    assert ("NVL006", "present", "fabric manager") in found and ("NVL006", "present", "GPU6") in found
    assert not any(ref == "NVL004" for ref, _, _ in found)


def test_a_view_that_is_not_the_hosts_says_the_fabric_completed(node_copy: Path) -> None:
    """A Slurm-on-Kubernetes prolog (supervisord as PID 1) beside GPUs whose fabric completed:
    still unknown, since whether the manager still serves NVLS is out of sight, but the reason
    says what the GPUs showed."""
    stop_fabric_manager(node_copy)
    write(node_copy, "/proc/1/comm", "supervisord\n")
    [found] = verdicts(node_copy)
    assert found[1] is Status.UNKNOWN and "PID 1 is supervisord" in found[2] and "fabric completed with success" in found[2]
