"""The job's own settings judged before it starts (NCCL002, TORCH006, NCCL006, GLOO001, TOPO002) and the
/dev/shm NCCL needs (NCCL007): checks on
hand-built facts for each rule, including how the installed PyTorch reads its variables, and
PyTorch's parsing of integers and booleans on short strings."""

from __future__ import annotations

import pytest
from preflight.checks.gloo import gloo_transport_misconfigured
from preflight.checks.nccl import nccl_buffsize_socket_stall, nccl_init_system_error, watchdog_heartbeat_hang
from preflight.checks.topo import nccl_nic_fusion_failure
from preflight.checks.torch import nccl_async_error_handling_mode

from preflight.model import NotApplicable, Observation, Severity, Unknown
from preflight.nccl.ib import parse_force_merge
from preflight.probes.frameworks import FrameworkFacts, PythonPackage
from preflight.probes.gpudirect import GpuDirectFacts
from preflight.probes.interfaces import InterfaceFacts
from preflight.probes.job import JobFacts, NcclConfFile
from preflight.probes.nccl_libs import NcclCopy, NcclLibFacts
from preflight.probes.rdma import Problem, RdmaDevice, RdmaFacts, RdmaPort
from preflight.probes.shm import ShmFacts
from preflight.sources.fs import FsUsage
from preflight.sources.netlink import Address, Link
from preflight.torch_settings import as_bool, as_int, read_setting

MiB = 1 << 20
SITE = "/usr/local/lib/python3.12/dist-packages"


def job(environ: dict[str, str], conf: dict[str, str] | None = None) -> JobFacts:
    files = (NcclConfFile("/etc/nccl.conf", tuple(conf.items())),) if conf else ()
    return JobFacts(environ, "", files)


def hca(name: str, link_layer: str = "InfiniBand", efa: bool = False, ports: int = 1, state: int = 4) -> RdmaDevice:
    path = f"/sys/class/infiniband/{name}"
    made = tuple(RdmaPort(name, n, f"{path}/ports/{n}", state, "ACTIVE", 5, "LinkUp", None, link_layer, None, None, (), "", ()) for n in range(1, ports + 1))
    return RdmaDevice(name, path, "CA", "1.0", None, "0000:1a:00.0", "0x1d0f" if efa else "0x15b3", efa, False, (), None, made, ())


def rdma(*devices: RdmaDevice, problems: tuple[Problem, ...] = ()) -> RdmaFacts:
    return RdmaFacts(tuple(devices), True, (), (), None, problems)


def torch(*versions: str, problems: tuple[str, ...] = ()) -> FrameworkFacts:
    packages = tuple(PythonPackage("torch", version, f"{SITE}/torch-{version}.dist-info/METADATA") for version in versions)
    return FrameworkFacts((SITE,), packages, problems)


def subjects(observations: list[Observation]) -> list[str]:
    return [observation.subject for observation in observations]


# -- NCCL002 ------------------------------------------------------------------------------------
IB_NODE = rdma(hca("mlx5_0"), hca("mlx5_1"))


@pytest.mark.parametrize(
    "environ, facts",
    [
        ({"NCCL_NET": "socket"}, IB_NODE),  # NCCL compares the name without case
        ({"NCCL_IB_DISABLE": "1"}, IB_NODE),
        ({}, rdma()),  # no RDMA device: only sockets are left
    ],
)
def test_large_buffer_over_the_socket_transport_is_a_warning(environ: dict[str, str], facts: RdmaFacts) -> None:
    found = list(nccl_buffsize_socket_stall(job(environ, {"NCCL_BUFFSIZE": str(256 * MiB)}), facts))
    assert subjects(found) == ["NCCL_BUFFSIZE"] and found[0].severity is Severity.WARNING
    assert found[0].evidence[0].source == "/etc/nccl.conf NCCL_BUFFSIZE" and found[0].evidence[0].observed.startswith("256 MiB")


@pytest.mark.parametrize(
    "environ, facts",
    [
        ({"NCCL_BUFFSIZE": str(256 * MiB)}, IB_NODE),  # NCCL uses the HCAs
        ({"NCCL_BUFFSIZE": str(256 * MiB), "NCCL_NET": "IB"}, rdma()),  # another network was named
        ({"NCCL_BUFFSIZE": str(256 * MiB), "NCCL_IB_DISABLE": "0"}, IB_NODE),
        ({"NCCL_BUFFSIZE": str(256 * MiB), "NCCL_IB_DISABLE": "1"}, rdma(hca("rdmap16s27", "Unknown", efa=True))),  # aws-ofi-nccl drives EFA
        ({"NCCL_BUFFSIZE": str(16 * MiB), "NCCL_NET": "Socket"}, IB_NODE),  # within four times the default
        ({"NCCL_BUFFSIZE": "lots", "NCCL_NET": "Socket"}, IB_NODE),  # not a number: MEM002 reports it
    ],
)
def test_buffer_that_does_not_cross_tcp_or_is_modest_is_absent(environ: dict[str, str], facts: RdmaFacts) -> None:
    assert list(nccl_buffsize_socket_stall(job(environ), facts)) == []


def test_settings_the_job_does_not_make_leave_nothing_to_judge() -> None:
    with pytest.raises(NotApplicable, match="NCCL_BUFFSIZE, NCCL_LL_BUFFSIZE, NCCL_LL128_BUFFSIZE not set"):
        list(nccl_buffsize_socket_stall(job({"NCCL_NET": "Socket"}), IB_NODE))  # the default buffer
    with pytest.raises(NotApplicable, match="TORCH_NCCL_ASYNC_ERROR_HANDLING and TORCH_NCCL_BLOCKING_WAIT"):
        list(nccl_async_error_handling_mode(job({}), torch("2.6.0")))
    with pytest.raises(NotApplicable, match="TORCH_NCCL_ENABLE_MONITORING not set in the environment"):
        list(watchdog_heartbeat_hang(job({"TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "1200"}), torch("2.6.0")))


def test_sizes_nccl_cannot_store_are_errors_on_any_transport() -> None:
    environ = {"NCCL_BUFFSIZE": str(3 << 30), "NCCL_LL128_BUFFSIZE": str(1 << 31)}
    found = list(nccl_buffsize_socket_stall(job(environ), IB_NODE))
    assert subjects(found) == ["NCCL_BUFFSIZE", "NCCL_LL128_BUFFSIZE"]
    assert all(f.severity is None for f in found)  # the reference's own severity


def test_unreadable_rdma_class_is_unknown_only_when_it_decides() -> None:
    unreadable = rdma(problems=(Problem("/sys/class/infiniband", "permission denied (EACCES)"),))
    with pytest.raises(Unknown, match="EACCES"):
        list(nccl_buffsize_socket_stall(job({"NCCL_BUFFSIZE": str(64 * MiB)}), unreadable))
    assert list(nccl_buffsize_socket_stall(job({"NCCL_BUFFSIZE": str(4 * MiB)}), unreadable)) == []
    assert subjects(list(nccl_buffsize_socket_stall(job({"NCCL_BUFFSIZE": str(64 * MiB), "NCCL_NET": "Socket"}), unreadable))) == ["NCCL_BUFFSIZE"]


# -- TORCH006 -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "environ, versions, subject",
    [
        ({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}, ("2.6.0+cu124",), "TORCH_NCCL_ASYNC_ERROR_HANDLING"),
        ({"NCCL_ASYNC_ERROR_HANDLING": "0"}, ("2.1.2",), "TORCH_NCCL_ASYNC_ERROR_HANDLING"),  # the only name 2.1 reads
        ({"NCCL_ASYNC_ERROR_HANDLING": "0"}, ("2.6.0",), "TORCH_NCCL_ASYNC_ERROR_HANDLING"),  # still read, deprecated
        ({"TORCH_NCCL_BLOCKING_WAIT": "True"}, ("2.6.0",), "TORCH_NCCL_BLOCKING_WAIT"),
        ({"NCCL_BLOCKING_WAIT": "1"}, ("1.13.1",), "TORCH_NCCL_BLOCKING_WAIT"),
        ({"TORCH_NCCL_ASYNC_ERROR_HANDLING": " 0"}, (), "TORCH_NCCL_ASYNC_ERROR_HANDLING"),  # no torch seen: a container's
    ],
)
def test_error_handling_switched_off_is_present(environ: dict[str, str], versions: tuple[str, ...], subject: str) -> None:
    found = list(nccl_async_error_handling_mode(job(environ), torch(*versions)))
    assert subjects(found) == [subject]
    if versions and any(name.startswith("TORCH_") for name in environ):
        assert found[0].evidence[-1].observed == f"PyTorch {versions[0]}"


@pytest.mark.parametrize(
    "environ, versions",
    [
        ({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}, ("2.6.0",)),
        ({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "NCCL_ASYNC_ERROR_HANDLING": "0"}, ("2.6.0",)),  # the TORCH_ name wins
        ({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}, ("2.1.2",)),  # a name 2.1 never reads
        ({"TORCH_NCCL_BLOCKING_WAIT": "0", "NCCL_BLOCKING_WAIT": "1"}, ("2.4.1",)),
        ({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "off"}, ("2.6.0",)),  # refused by stoi: PyTorch stops loudly
    ],
)
def test_error_handling_left_on_is_absent(environ: dict[str, str], versions: tuple[str, ...]) -> None:
    assert list(nccl_async_error_handling_mode(job(environ), torch(*versions))) == []


def test_two_installs_are_judged_by_the_one_that_reads_the_setting() -> None:
    found = list(nccl_async_error_handling_mode(job({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}), torch("2.1.2", "2.5.1")))
    assert subjects(found) == ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] and found[0].evidence[-1].observed == "PyTorch 2.5.1"


def test_unreadable_pytorch_is_unknown_only_when_the_version_decides() -> None:
    unreadable = torch(problems=(f"{SITE}/torch-2.6.0.dist-info/METADATA: permission denied (EACCES)",))
    with pytest.raises(Unknown, match="EACCES"):
        list(nccl_async_error_handling_mode(job({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}), unreadable))
    # the old name is read by every release, so its value decides without the version
    assert subjects(list(nccl_async_error_handling_mode(job({"NCCL_ASYNC_ERROR_HANDLING": "0"}), unreadable))) == ["TORCH_NCCL_ASYNC_ERROR_HANDLING"]


# -- NCCL006 ------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["0", "false", "NO", " n "])
def test_heartbeat_monitor_switched_off_is_a_warning(value: str) -> None:
    """The monitor off breaks and slows nothing: it changes only how an already hung rank ends,
    and the job chose it. Reported, never a drain."""
    found = list(watchdog_heartbeat_hang(job({"TORCH_NCCL_ENABLE_MONITORING": value}), torch("2.6.0")))
    assert subjects(found) == ["TORCH_NCCL_ENABLE_MONITORING"] and found[0].evidence[-1].observed == "PyTorch 2.6.0"
    assert found[0].severity is Severity.WARNING


@pytest.mark.parametrize(
    "environ, versions",
    [
        ({"TORCH_NCCL_ENABLE_MONITORING": "1", "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "1200"}, ("2.6.0",)),
        ({"TORCH_NCCL_ENABLE_MONITORING": "0"}, ("2.1.2",)),  # a release without the monitor or its variable
        ({"TORCH_NCCL_ENABLE_MONITORING": "maybe"}, ("2.6.0",)),  # refused by PyTorch at start
    ],
)
def test_heartbeat_monitor_left_on_is_absent(environ: dict[str, str], versions: tuple[str, ...]) -> None:
    assert list(watchdog_heartbeat_hang(job(environ), torch(*versions))) == []


# -- how PyTorch reads them ---------------------------------------------------------------------
def test_pytorch_parsing_and_precedence() -> None:
    assert [as_int(v) for v in ("0", " 3", "1x", "x1", "-1")] == [0, 3, 1, None, -1]
    assert [as_bool(v) for v in ("1", "TRUE", "y", "0", "No", "2")] == [True, True, True, False, False, None]
    both = {"TORCH_NCCL_BLOCKING_WAIT": "0", "NCCL_BLOCKING_WAIT": "1"}
    names = ("TORCH_NCCL_BLOCKING_WAIT", "NCCL_BLOCKING_WAIT")
    assert read_setting(both, names, prefixed_names_read=True).name == "TORCH_NCCL_BLOCKING_WAIT"  # type: ignore[union-attr]
    assert read_setting(both, names, prefixed_names_read=False).name == "NCCL_BLOCKING_WAIT"  # type: ignore[union-attr]
    assert read_setting({}, names, prefixed_names_read=True) is None


# -- GLOO001 ------------------------------------------------------------------------------------
NODE = InterfaceFacts(
    (Link("lo", 1, 65536, "unknown", "loopback", "", "", ""), Link("eno1", 2, 1500, "up", "ether", "", "", "7c:c2:55:1a:2b:3c"),
     Link("ibp26s0", 3, 4092, "up", "infiniband", "", "", ""), Link("bond0", 4, 9000, "down", "ether", "bond", "", "")),
    (Address("lo", 4, "127.0.0.1", 8, "host"), Address("eno1", 4, "10.10.1.17", 24, "global"), Address("bond0", 6, "fd00::17", 64, "global")),
)


@pytest.mark.parametrize(
    "value, subjects_found",
    [
        ("eth0", ["eth0"]),  # a name from another node type
        ("ibp26s0", ["ibp26s0"]),  # exists, no address
        ("eno1,ibp26s0,eth0", ["ibp26s0", "eth0"]),  # every listed device must work
        ("eno", ["eno"]),  # Gloo matches names exactly, unlike NCCL's prefixes
    ],
)
def test_gloo_interface_without_address_is_present(value: str, subjects_found: list[str]) -> None:
    assert subjects(list(gloo_transport_misconfigured(job({"GLOO_SOCKET_IFNAME": value}), NODE))) == subjects_found


@pytest.mark.parametrize("value", ["eno1", "eno1,bond0", "bond0"])  # bond0 is down but addressed: Gloo binds it
def test_gloo_interface_with_an_address_is_absent(value: str) -> None:
    assert list(gloo_transport_misconfigured(job({"GLOO_SOCKET_IFNAME": value}), NODE)) == []


def test_gloo_without_an_interface_setting_is_not_applicable() -> None:
    with pytest.raises(NotApplicable, match="host name"):
        list(gloo_transport_misconfigured(job({"NCCL_SOCKET_IFNAME": "eno1"}), NODE))
    # PyTorch's binding reads GLOO_SOCKET_IFNAME only when longer than one character (init.cpp)
    with pytest.raises(NotApplicable, match="ignored"):
        list(gloo_transport_misconfigured(job({"GLOO_SOCKET_IFNAME": "e"}), NODE))


# -- TOPO002 ------------------------------------------------------------------------------------
FUSED_NODE = rdma(hca("mlx5_0"), hca("mlx5_1"), hca("mlx5_2", "Ethernet"), hca("mlx5_3", ports=2), hca("mlx5_4", state=1))


def libs(*versions: str | None) -> NcclLibFacts:
    copies = tuple(NcclCopy(f"/usr/lib/x86_64-linux-gnu/libnccl.so.{v or '2'}", v, "system") for v in versions)
    return NcclLibFacts(copies, ())


def test_force_merge_parses_as_nccl_does() -> None:
    groups = parse_force_merge("mlx5_0,mlx5_1;;mlx5_3:2,x:y;a,b,c,d,e;:1,")
    assert [(group, [(e.name, e.port) for e in entries]) for group, entries in groups] == [
        ("mlx5_0,mlx5_1", [("mlx5_0", None), ("mlx5_1", None)]),
        ("mlx5_3:2,x:y", [("mlx5_3", 2), ("x", 0)]),  # atoi("y") is 0
        ("a,b,c,d,e", [("a", None), ("b", None), ("c", None), ("d", None)]),  # four names at most
        (":1,", []),  # nothing NCCL can parse
    ]


@pytest.mark.parametrize(
    "value, subject",
    [
        ("mlx5_0,mlx5_9", "mlx5_0,mlx5_9"),  # absent device
        ("mlx5_0,mlx5_", "mlx5_0,mlx5_"),  # names are exact here, not prefixes
        ("mlx5_0,mlx5_4", "mlx5_0,mlx5_4"),  # mlx5_4's port is down: NCCL never lists it
        ("mlx5_0,mlx5_3", "mlx5_0,mlx5_3"),  # mlx5_3 without a port matches both of its ports
        ("mlx5_0,mlx5_2", "mlx5_0,mlx5_2"),  # InfiniBand with RoCE
        ("mlx5_0,mlx5_1;:2", ":2"),  # NCCL loops on a group it cannot parse
    ],
)
def test_force_merge_nccl_cannot_fuse_is_present(value: str, subject: str) -> None:
    found = list(nccl_nic_fusion_failure(job({"NCCL_NET_FORCE_MERGE": value}), FUSED_NODE, libs("2.26.2")))
    assert subjects(found) == [subject] and found[0].evidence[-1].observed == "2.26.2"


@pytest.mark.parametrize("value", ["mlx5_0,mlx5_1", "mlx5_3:1,mlx5_3:2;mlx5_0,mlx5_1", "mlx5_2"])
def test_force_merge_nccl_can_fuse_is_absent(value: str) -> None:
    assert list(nccl_nic_fusion_failure(job({"NCCL_NET_FORCE_MERGE": value}), FUSED_NODE, libs("2.27.3"))) == []


def test_force_merge_follows_nccl_ib_hca_and_nccl_net() -> None:
    hidden = job({"NCCL_NET_FORCE_MERGE": "mlx5_0,mlx5_1", "NCCL_IB_HCA": "=mlx5_0"})
    assert subjects(list(nccl_nic_fusion_failure(hidden, FUSED_NODE, libs("2.26.2")))) == ["mlx5_0,mlx5_1"]
    with pytest.raises(NotApplicable, match="NCCL_NET=Socket"):
        list(nccl_nic_fusion_failure(job({"NCCL_NET_FORCE_MERGE": "x", "NCCL_NET": "Socket"}), FUSED_NODE, libs("2.26.2")))


def test_force_merge_before_fusion_or_unset_is_not_applicable() -> None:
    with pytest.raises(NotApplicable, match="older than 2.24"):
        list(nccl_nic_fusion_failure(job({"NCCL_NET_FORCE_MERGE": "mlx5_0,mlx5_9"}), FUSED_NODE, libs("2.23.4", "2.21.5")))
    with pytest.raises(NotApplicable, match="unset"):
        list(nccl_nic_fusion_failure(job({}), FUSED_NODE, libs("2.26.2")))
    # a copy whose release is not named may have fusion: judged
    assert subjects(list(nccl_nic_fusion_failure(job({"NCCL_NET_FORCE_MERGE": "mlx5_9"}), FUSED_NODE, libs(None)))) == ["mlx5_9"]


# -- NCCL007 ------------------------------------------------------------------------------------
def gpus(count: int | None) -> GpuDirectFacts:
    return GpuDirectFacts(nvidia_driver=None, nvidia_loaded=None, driver_flavour=None, nvidia_gpus=count, kernel_release=None,
                          peer_memory_files=(), peer_memory_unknown=(), nv_peer_mem_loaded=None, rdma_devices=None,
                          gdrdrv_loaded=None, gdrdrv_node=None, job_identity=None, problems=())


def shm(size: int | None, error: str = "") -> ShmFacts:
    return ShmFacts("/dev/shm", FsUsage(size, size, size) if size is not None else None, error)


@pytest.mark.parametrize(
    "facts, count, severity",
    [
        (shm(64 * MiB), 8, Severity.WARNING),  # Docker's default
        (shm(64 * MiB), None, Severity.WARNING),  # a container shows no GPU count
        (shm(None), 4, None),  # no /dev/shm at all: the reference's own severity
    ],
)
def test_shared_memory_too_small_for_nccl_is_present(facts: ShmFacts, count: int | None, severity: Severity | None) -> None:
    found = list(nccl_init_system_error(facts, libs("2.21.5"), gpus(count)))
    assert subjects(found) == ["/dev/shm"] and found[0].severity is severity


def test_shared_memory_for_nccl_decided_otherwise() -> None:
    assert list(nccl_init_system_error(shm(16 << 30), libs("2.21.5"), gpus(8))) == []
    assert list(nccl_init_system_error(shm(0), libs("2.21.5"), gpus(8))) == []  # tmpfs size=0: no limit
    with pytest.raises(NotApplicable, match="one GPU"):
        list(nccl_init_system_error(shm(64 * MiB), libs("2.21.5"), gpus(1)))
    with pytest.raises(NotApplicable, match="no libnccl"):
        list(nccl_init_system_error(shm(64 * MiB), libs(), gpus(8)))
    with pytest.raises(Unknown, match="EACCES"):
        list(nccl_init_system_error(shm(None, "permission denied (EACCES)"), libs("2.21.5"), gpus(8)))
