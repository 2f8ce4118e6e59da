"""The job's own settings judged before it starts (NCCL002, TORCH006, NCCL006): checks on
hand-built facts for each rule, including how the installed PyTorch reads its variables, and
PyTorch's parsing of integers and booleans on short strings."""

from __future__ import annotations

import pytest
from preflight.checks.nccl import nccl_buffsize_socket_stall, watchdog_heartbeat_hang
from preflight.checks.torch import nccl_async_error_handling_mode

from preflight.model import Observation, Severity, Unknown
from preflight.probes.frameworks import FrameworkFacts, PythonPackage
from preflight.probes.job import JobFacts, NcclConfFile
from preflight.probes.rdma import Problem, RdmaDevice, RdmaFacts, RdmaPort
from preflight.torch_settings import as_bool, as_int, read_setting

MiB = 1 << 20
SITE = "/usr/local/lib/python3.12/dist-packages"


def job(environ: dict[str, str], conf: dict[str, str] | None = None) -> JobFacts:
    files = (NcclConfFile("/etc/nccl.conf", tuple(conf.items())),) if conf else ()
    return JobFacts(environ, "", files)


def hca(name: str, link_layer: str = "InfiniBand", efa: bool = False) -> RdmaDevice:
    path = f"/sys/class/infiniband/{name}"
    port = RdmaPort(name, 1, f"{path}/ports/1", 4, "ACTIVE", 5, "LinkUp", None, link_layer, None, None, (), "", ())
    return RdmaDevice(name, path, "CA", "1.0", None, "0000:1a:00.0", "0x1d0f" if efa else "0x15b3", efa, False, (), None, (port,), ())


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
        ({"NCCL_NET": "Socket"}, IB_NODE),  # the default buffer
    ],
)
def test_buffer_that_does_not_cross_tcp_or_is_modest_is_absent(environ: dict[str, str], facts: RdmaFacts) -> None:
    assert list(nccl_buffsize_socket_stall(job(environ), facts)) == []


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
        ({}, ("2.6.0",)),
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
def test_heartbeat_monitor_switched_off_is_present(value: str) -> None:
    found = list(watchdog_heartbeat_hang(job({"TORCH_NCCL_ENABLE_MONITORING": value}), torch("2.6.0")))
    assert subjects(found) == ["TORCH_NCCL_ENABLE_MONITORING"] and found[0].evidence[-1].observed == "PyTorch 2.6.0"


@pytest.mark.parametrize(
    "environ, versions",
    [
        ({}, ("2.6.0",)),
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
