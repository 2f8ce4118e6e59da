"""Layer 1: parsers on short strings in the kernel's and tools' real formats."""

from __future__ import annotations

from pathlib import Path

import pytest

from preflight.probes.gpudirect import access_decided, can_read_write, DeviceNode, JobIdentity, parse_status_ids, read_job_identity
from preflight.nss import groups_beyond_files
from preflight.probing import FactReader
from preflight.sources import NodeFS
from preflight.checks.gdr import parse_kernel_version
from preflight.probes.job import parse_group_membership
from preflight.probes.gpus import normalise_bus_id
from preflight.probes.hostname import parse_hosts
from preflight.probes.job import in_job_process, parse_environ, parse_nccl_conf, probe_job
from preflight.probes.memlock import Limit, parse_limits_memlock, parse_meminfo_total, parse_pam_limits, parse_systemd_limit, parse_unit_setting
from preflight.slurm_conf import SlurmConf, propagated, read_slurm_conf
from preflight.hostlist import HostlistError, expand, matches, number_runs
from preflight.sources.dns import parse_resolv_conf
from preflight.sources.netlink import Address, parse_fib_trie_locals, parse_if_inet6, parse_proc_net_route
from preflight.units import UNLIMITED, format_size, parse_size

LIMITS = (
    "Limit                     Soft Limit           Hard Limit           Units     \n"
    "Max stack size            8388608              unlimited            bytes     \n"
    "Max locked memory         65536                unlimited            bytes     \n"
)


def test_parse_limits_memlock_reads_soft_and_hard() -> None:
    assert parse_limits_memlock(LIMITS, "/proc/1/limits") == Limit(65536, UNLIMITED, "/proc/1/limits")


def test_parse_limits_memlock_missing_row_and_garbage() -> None:
    assert parse_limits_memlock("Limit Soft Hard\n", "x") is None
    assert parse_limits_memlock("Max locked memory  lots  more bytes\n", "x") is None


@pytest.mark.parametrize(
    ("text", "soft", "hard"),
    [("infinity", UNLIMITED, UNLIMITED), ("8M", 8 << 20, 8 << 20), ("64K:infinity", 64 << 10, UNLIMITED), ("1048576", 1 << 20, 1 << 20)],
)
def test_parse_systemd_limit(text: str, soft: int, hard: int) -> None:
    assert parse_systemd_limit(text, "unit") == Limit(soft, hard, "unit")


def test_parse_systemd_limit_rejects_garbage() -> None:
    assert parse_systemd_limit("lots", "unit") is None
    assert parse_systemd_limit("", "unit") is None


def test_parse_unit_setting_last_wins_and_empty_resets() -> None:
    text = "[Service]\nLimitMEMLOCK=8M\n# LimitMEMLOCK=1\nLimitMEMLOCK=infinity\n"
    assert parse_unit_setting(text, "LimitMEMLOCK") == "infinity"
    assert parse_unit_setting(text + "LimitMEMLOCK=\n", "LimitMEMLOCK") == ""  # a reset, not "unset"
    assert parse_unit_setting("[Service]\nLimitNOFILE=1\n", "LimitMEMLOCK") is None


def test_parse_unit_setting_reads_sections_and_continued_lines_as_systemd_does() -> None:
    """Only [Service] sets a service's limits (systemd.syntax(7)); a trailing backslash continues
    the line; system.conf's defaults live in [Manager]."""
    text = "[Unit]\nLimitMEMLOCK=1\n[Service]\n; LimitMEMLOCK=2\nLimitMEMLOCK=\\\n  infinity\n[Install]\nLimitMEMLOCK=3\n"
    assert parse_unit_setting(text, "LimitMEMLOCK") == "infinity"
    assert parse_unit_setting("LimitMEMLOCK=8M\n", "LimitMEMLOCK") is None  # outside any section
    assert parse_unit_setting("[Manager]\nDefaultLimitMEMLOCK=64M\n", "DefaultLimitMEMLOCK", section="Manager") == "64M"
    # the unit Debian's slurmd package installs, as this machine has it (the CI installs slurmd)
    packaged = Path("/lib/systemd/system/slurmd.service")
    if packaged.exists():
        assert parse_unit_setting(packaged.read_text(), "LimitMEMLOCK") == "infinity"


def test_parse_pam_limits_kib_and_unlimited() -> None:
    text = "# comment\n*  hard  memlock  65536\n@hpc - memlock unlimited\nalice soft nofile 1024\n"
    entries = parse_pam_limits(text, "/etc/security/limits.conf")
    assert [(e.domain, e.kind, e.value, e.source) for e in entries] == [
        ("*", "hard", 65536 * 1024, "/etc/security/limits.conf:2"),
        ("@hpc", "-", UNLIMITED, "/etc/security/limits.conf:3"),
    ]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("ClusterName=x\n", True),
        ("PropagateResourceLimitsExcept=MEMLOCK\n", False),
        ("propagateresourcelimitsexcept=NOFILE,MEMLOCK # comment\n", False),
        ("PropagateResourceLimitsExcept=NOFILE\n", True),
        ("PropagateResourceLimits=NONE\n", False),
        ("PropagateResourceLimits=ALL\n", True),
        ("PropagateResourceLimits=CORE,MEMLOCK\n", True),
        ("#PropagateResourceLimitsExcept=MEMLOCK\n", True),
    ],
)
def test_parse_slurm_propagation(text: str, expected: bool) -> None:
    conf = read_slurm_conf({"/etc/slurm/slurm.conf": text}.get, "/etc/slurm/slurm.conf")
    assert isinstance(conf, SlurmConf) and memlock_propagated(conf) is expected


def memlock_propagated(conf: SlurmConf) -> bool | None:
    return propagated(conf, "MEMLOCK")[0]


def test_parse_meminfo_total() -> None:
    assert parse_meminfo_total("MemTotal:       16318508 kB\nMemFree: 1 kB\n") == 16318508 * 1024
    assert parse_meminfo_total("garbage") is None


def test_parse_environ_keeps_only_communication_variables() -> None:
    data = b"NCCL_BUFFSIZE=8388608\0SECRET_TOKEN=abc\0SLURM_JOB_ID=7\0HOME=/home/a\0junk\0"
    assert parse_environ(data) == {"NCCL_BUFFSIZE": "8388608", "SLURM_JOB_ID": "7", "HOME": "/home/a"}


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        (b"SLURM_JOB_ID=7\0SLURM_STEP_ID=0\0", True),  # srun's task
        (b"SLURM_JOB_ID=7\0SLURM_SCRIPT_CONTEXT=prolog_slurmd\0OMPI_COMM_WORLD_RANK=0\0", False),  # slurmd's prolog
        (b"OMPI_COMM_WORLD_RANK=3\0OMPI_COMM_WORLD_SIZE=16\0", True),  # mpirun, an MPIJob
        (b"PMIX_RANK=3\0", True),  # prterun, srun --mpi=pmix
        (b"PMI_RANK=3\0PMI_SIZE=16\0", True),  # MPICH's Hydra, Intel MPI
        (b"TORCHELASTIC_RUN_ID=none\0LOCAL_RANK=0\0", True),  # a torchrun worker
        (b"MASTER_ADDR=trainer-0\0RANK=3\0WORLD_SIZE=16\0", True),  # a PyTorchJob pod
        (b"MASTER_ADDR=trainer-0\0MASTER_PORT=29500\0", False),  # settings in a shell, no rank
        (b"HOME=/root\0USER=root\0", False),  # an operator's shell, a health check
    ],
)
def test_a_job_process_is_recognised_by_what_its_launcher_sets(environ: bytes, expected: bool) -> None:
    assert in_job_process(parse_environ(environ)) is expected


@pytest.mark.parametrize(
    "cgroup, job, step, task",
    [
        ("0::/system.slice/slurmstepd.scope/job_4242/step_extern/user/task_special\n", "job_4242", "step_extern", False),  # cgroup v2
        ("0::/system.slice/slurmstepd.scope/sEKNKTV3WPV500/step_0/user/task_0\n", "sEKNKTV3WPV500", "step_0", True),  # v2 from 26.05: the SLUID
        ("12:devices:/slurm/uid_1001/job_77/step_batch\n4:cpuset:/slurm/uid_1001/job_77/step_batch\n", "job_77", "step_batch", True),  # v1
        ("0::/system.slice/slurmd.service\n", "", "", False),  # slurmd's own: a prolog run outside the job
        ("0::/user.slice/user-1001.slice/session-3.scope\n", "", "", False),
        ("", "", "", False),
        (None, None, None, False),  # not read: not known
    ],
)
def test_the_slurm_job_cgroup_holding_this_process(tmp_path: Path, cgroup: str | None, job: str | None, step: str | None, task: bool) -> None:
    """The job and step whose cgroup holds this process. A task of a step is the job's own even
    with an emptied environment (Apptainer --cleanenv or --containall); the extern step holds
    adopted ssh sessions and a RunInJob prolog, which are not."""
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/self/environ").write_bytes(b"")
    if cgroup is not None:
        (tmp_path / "proc/self/cgroup").write_text(cgroup)
    facts = probe_job(NodeFS(str(tmp_path)))
    assert (facts.cgroup_job, facts.cgroup_step, facts.in_job_process) == (job, step, task)


def test_parse_nccl_conf_does_not_trim_like_nccl() -> None:
    text = "# comment\nNCCL_DEBUG=INFO\nNCCL_IB_HCA = mlx5_0\nno equals sign\n"
    assert parse_nccl_conf(text) == (("NCCL_DEBUG", "INFO"), ("NCCL_IB_HCA ", " mlx5_0"))
    # NCCL drops the line end, a Windows one included (src/misc/param.cc, setEnvFile), and nothing else
    assert parse_nccl_conf("NCCL_IB_GID_INDEX=3\r\nNCCL_DEBUG=WARN \r\n") == (("NCCL_IB_GID_INDEX", "3"), ("NCCL_DEBUG", "WARN "))


def test_parse_if_inet6() -> None:
    text = "fe800000000000007ec255fffe1a2b3c 02 40 20 80     eno1\n00000000000000000000000000000001 01 80 10 80 lo\nbad line\n"
    assert parse_if_inet6(text) == [
        Address("eno1", 6, "fe80::7ec2:55ff:fe1a:2b3c", 64, "link"),
        Address("lo", 6, "::1", 128, "host"),
    ]


FIB_TRIE = """Main:
  +-- 0.0.0.0/0 3 0 5
     |-- 0.0.0.0
        /0 universe UNICAST
     +-- 10.10.0.0/16 2 0 2
        |-- 10.10.0.0
           /16 link UNICAST
        |-- 10.10.1.17
           /32 host LOCAL
Local:
  +-- 0.0.0.0/0 3 0 5
     |-- 10.10.1.17
        /32 host LOCAL
"""


def test_parse_fib_trie_locals_once_each() -> None:
    assert parse_fib_trie_locals(FIB_TRIE) == ["10.10.1.17"]
    # A damaged leaf is no address of this host (it reached the probes as one before).
    assert parse_fib_trie_locals(FIB_TRIE.replace("10.10.1.17", "10.10.1.x")) == []


def test_parse_proc_net_route_keeps_connected_routes() -> None:
    text = "Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\n" "eno1\t00000000\t01010A0A\t0003\t0\t0\t0\t00000000\n" "eno1\t00000A0A\t00000000\t0001\t0\t0\t0\t0000FFFF\n"
    routes = parse_proc_net_route(text)
    assert [(r.ifname, str(r.network)) for r in routes] == [("eno1", "10.10.0.0/16")]


ROUTE_HEADER = "Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\n"


def test_an_ipv4_address_procfs_cannot_place_on_one_interface_is_unknown_not_misplaced() -> None:
    """procfs names no interface for an IPv4 address: the subnet route holding it does. Rails
    sharing a subnet, or a /32 reached through an on-link gateway, leave the holder unknown."""
    from preflight.sources import SourceError
    from preflight.sources.netlink import attach_ipv4

    rails = parse_proc_net_route(ROUTE_HEADER + "r1\t00320A0A\t00000000\t0001\t0\t0\t0\t00FFFFFF\n" "r2\t00320A0A\t00000000\t0001\t0\t0\t0\t00FFFFFF\n")
    with pytest.raises(SourceError, match="in the subnet of r1, r2 alike"):
        attach_ipv4("10.10.50.3", rails)
    with pytest.raises(SourceError, match="in no interface's subnet"):
        attach_ipv4("10.10.1.17", parse_proc_net_route(ROUTE_HEADER + "eno1\t01000A0A\t00000000\t0005\t0\t0\t0\tFFFFFFFF\n"))
    one = parse_proc_net_route(ROUTE_HEADER + "eno1\t00000A0A\t00000000\t0001\t0\t0\t0\t0000FFFF\n" "ib0\t00010A0A\t00000000\t0001\t0\t0\t0\t00FFFFFF\n")
    assert attach_ipv4("10.10.1.17", one) == Address("ib0", 4, "10.10.1.17", 24, "global")  # the most specific wins


@pytest.mark.parametrize(
    ("expression", "hosts"),
    [
        ("gpu[001-003]", ["gpu001", "gpu002", "gpu003"]),
        ("gpu[1,3-4],cpu7", ["gpu1", "gpu3", "gpu4", "cpu7"]),
        ("r[1-2]n[01-02]", ["r1n01", "r1n02", "r2n01", "r2n02"]),
        ("login", ["login"]),
    ],
)
def test_hostlist_expand(expression: str, hosts: list[str]) -> None:
    assert expand(expression) == hosts


@pytest.mark.parametrize("bad", ["gpu[1-", "gpu]1[", "gpu[a-b]", "gpu[5-1]", "n[0-99999999]"])
def test_hostlist_rejects_bad_expressions(bad: str) -> None:
    with pytest.raises(HostlistError):
        expand(bad)


def test_hostlist_matches_globs_ranges_and_short_names() -> None:
    assert matches("gpu[001-064]", "gpu017.cluster")
    assert not matches("gpu[001-016]", "gpu017")
    assert matches("login*,gpu0[1-2]", "gpu02")


@pytest.mark.parametrize(("text", "value"), [("unlimited", UNLIMITED), ("64GiB", 64 << 30), ("8M", 8 << 20), (4096, 4096), ("1.5K", 1536)])
def test_parse_size(text: object, value: int) -> None:
    assert parse_size(text) == value


@pytest.mark.parametrize("bad", ["lots", -1, "12 parsecs", None])
def test_parse_size_rejects(bad: object) -> None:
    with pytest.raises(ValueError):
        parse_size(bad)


def test_format_size() -> None:
    assert format_size(8 << 20) == "8 MiB"
    assert format_size(UNLIMITED) == "unlimited"
    assert format_size(1536) == "1.5 KiB"
    assert format_size(None) == "unknown"


def test_parse_resolv_conf() -> None:
    conf = parse_resolv_conf("# x\nnameserver 10.0.0.2\nsearch a.example b.example\nnameserver 10.0.0.3 ; tail\n")
    assert conf.nameservers == ("10.0.0.2", "10.0.0.3")
    assert conf.search == ("a.example", "b.example")


def test_parse_hosts() -> None:
    entries = parse_hosts("127.0.0.1 localhost\n127.0.1.1\tgpu1.cluster gpu1 # installer\n\n")
    assert entries[1].address == "127.0.1.1" and entries[1].names == ("gpu1.cluster", "gpu1") and entries[1].source == "/etc/hosts:2"


def test_normalise_bus_id() -> None:
    assert normalise_bus_id("00000000:18:00.0") == "0000:18:00.0"
    assert normalise_bus_id("0000:AB:00.0") == "0000:ab:00.0"


def test_parse_kernel_version() -> None:
    assert parse_kernel_version("5.15.0-105-generic") == (5, 15)
    assert parse_kernel_version("garbage") is None


def test_parse_status_ids_and_groups() -> None:
    status = "Name:\tbash\nUid:\t1001\t1001\t1001\t1001\nGid:\t1001\t1001\t1001\t1001\nGroups:\t44 996 \n"
    assert parse_status_ids(status) == (1001, (1001, 44, 996))
    assert parse_status_ids("Name: x\n") is None
    assert parse_group_membership("video:x:44:bob,alice\nrdma:x:996:carol\n", "alice") == (44,)


def test_can_read_write_uses_owner_group_other_bits() -> None:
    node = DeviceNode("/dev/gdrdrv", 0o20660, 0, 44)
    assert can_read_write(node, JobIdentity(1001, (1001, 44), "t"))
    assert not can_read_write(node, JobIdentity(1001, (1001,), "t"))
    assert can_read_write(node, JobIdentity(0, (0,), "t"))
    assert can_read_write(DeviceNode("/dev/gdrdrv", 0o20666, 0, 0), JobIdentity(1001, (1001,), "t"))


@pytest.mark.parametrize(
    ("nsswitch", "group", "elsewhere"),
    [
        ("", "", ()),  # no nsswitch.conf line: glibc asks files only
        ("group:  files systemd\n", "", ()),  # Debian's default: nss-systemd adds no site users
        ("passwd: files sss\ngroup: files [SUCCESS=merge] sss\n", "", ("sss",)),
        ("group: files ldap # site directory\n", "", ("ldap",)),
        ("group: compat\n", "video:x:44:bob\n", ()),
        ("group: compat\n", "video:x:44:bob\n+:::\n", ("nis (compat)",)),
    ],
)
def test_groups_beyond_files_names_the_group_services_etc_group_does_not_hold(nsswitch: str, group: str, elsewhere: tuple[str, ...]) -> None:
    assert groups_beyond_files(nsswitch, group) == elsewhere


def test_a_job_users_groups_read_from_etc_group_are_incomplete_under_a_directory_service(tmp_path: Path) -> None:
    """The prolog reads a job user's groups from /etc/group; where nsswitch.conf also asks sss or
    ldap, a membership only the directory holds decides nothing either way."""
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc/group").write_text("rdma:x:996:bob\n")
    (tmp_path / "etc/nsswitch.conf").write_text("group: files sss\n")
    environ = {"SLURM_JOB_UID": "1001", "SLURM_JOB_GID": "1001", "SLURM_JOB_USER": "alice"}
    identity = read_job_identity(FactReader(NodeFS(str(tmp_path))), environ)
    assert identity is not None and identity.gids == (1001,) and identity.groups_elsewhere == ("sss",)
    group_only = DeviceNode("/dev/infiniband/uverbs0", 0o20660, 0, 996)
    assert access_decided(group_only, identity) is None
    assert access_decided(DeviceNode("/dev/infiniband/uverbs0", 0o20600, 0, 996), identity) is False  # no group can open it
    assert access_decided(DeviceNode("/dev/infiniband/uverbs0", 0o20666, 0, 996), identity) is True
    assert access_decided(group_only, JobIdentity(1001, (1001,), "t")) is False  # /etc/group is all there is
    (tmp_path / "etc/nsswitch.conf").write_text("group: files systemd\n")
    assert read_job_identity(FactReader(NodeFS(str(tmp_path))), environ) == JobIdentity(1001, (1001,), identity.source)


def test_number_runs_are_the_ranges_a_hostlist_would_write() -> None:
    assert number_runs([1, 2, 3, 7, 9, 10]) == [(1, 3), (7, 7), (9, 10)]
    assert number_runs([]) == []
    # written back as a hostlist, the runs expand to the numbers they came from
    assert expand("n[" + ",".join(f"{a}-{b}" for a, b in number_runs([4, 5, 6, 8])) + "]") == ["n4", "n5", "n6", "n8"]
