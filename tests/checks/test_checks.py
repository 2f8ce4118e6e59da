"""Layer 3: every check on hand-built facts, with a present and an absent case per reference.

Facts start from the example node's probes (so they are realistic) and are varied with
``msgspec.structs.replace``.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from msgspec.structs import replace

from preflight.probes.gpudirect import DeviceNode, GpuDirectFacts, JobIdentity, probe_gpudirect
from preflight.checks.gdr import gdrcopy_driver_unusable, gpudirect_rdma_unavailable
from preflight.probes.gpu_health import GpuHealthFacts, probe_gpu_health
from preflight.probes.gpus import GpuFacts, probe_gpus
from preflight.checks.gpu import gpu_unusable_by_driver
from preflight.probes.hostname import HostnameFacts, HostsEntry
from preflight.checks.dns import hostname_resolution_broken
from preflight.probes.job import JobFacts, NcclConfFile
from preflight.probes.nccl_libs import NcclCopy, NcclLibFacts
from preflight.probes.pcie import PcieFacts, PciEndpoint, PcieLink
from preflight.probes.rdma import RdmaDevice, RdmaFacts, probe_rdma
from preflight.probes.memlock import Limit, MemlockFacts, PamLimit, parse_exemption, probe_memlock
from preflight.checks.mem import memlock_limit_too_low, nccl_buffsize_exceeds_pinned_memory
from preflight.config import Expectations
from preflight.model import NotApplicable, Observation, Severity, Status, Unknown, Unread
from preflight.sources import NodeFS, Sources
from preflight.sources.dns import DnsAnswer
from preflight.units import UNLIMITED

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "nodes" / "hgx-h100"
GIB = 1 << 30


@pytest.fixture(scope="module")
def memlock() -> MemlockFacts:
    return probe_memlock(NodeFS(str(EXAMPLE)))


#: The example node's RDMA devices as the rdma probe reads them (ConnectX, no EFA).
MLX = probe_rdma(NodeFS(str(EXAMPLE)))


@pytest.fixture(scope="module")
def gpudirect() -> GpuDirectFacts:
    return probe_gpudirect(NodeFS(str(EXAMPLE)))


@pytest.fixture(scope="module")
def gpus() -> GpuFacts:
    return probe_gpus(NodeFS(str(EXAMPLE)), Sources.for_node(str(EXAMPLE)).nvml)


@pytest.fixture(scope="module")
def health() -> GpuHealthFacts:
    return probe_gpu_health(Sources.for_node(str(EXAMPLE)).nvml)


def job(environ: dict[str, str] | None = None, conf: dict[str, str] | None = None) -> JobFacts:
    files = (NcclConfFile("/etc/nccl.conf", tuple((conf or {}).items())),)
    return JobFacts(environ or {}, "", files)


def unlimited(memlock: MemlockFacts) -> MemlockFacts:
    good = Limit(UNLIMITED, UNLIMITED, "/proc/self/limits")
    return replace(memlock, process=good, slurmd=replace(good, source="/proc/2187/limits"), memlock_propagated=False)


# MEM001 ------------------------------------------------------------------------------------
def test_mem001_present_for_slurmd_process_and_propagation(memlock: MemlockFacts) -> None:
    found = list(memlock_limit_too_low(memlock, job(), Expectations()))
    assert {o.subject for o in found} == {"process", "slurmd", "slurm.conf"}
    slurmd = next(o for o in found if o.subject == "slurmd")
    assert slurmd.evidence[0].source == "/proc/2187/limits" and "8 MiB" in slurmd.evidence[0].observed
    assert next(o for o in found if o.subject == "slurm.conf").severity is Severity.WARNING


def test_mem001_fix_for_a_slurmd_that_systemd_does_not_start(memlock: MemlockFacts, tmp_path: Path) -> None:
    """slurmd under supervisord in a Slinky pod is no systemd service: a unit's LimitMEMLOCK does
    nothing there, the runtime's limit or the entrypoint's ulimit does. The probe tells them apart
    by slurmd's cgroup; unread, the unit's fix stays."""
    from conftest import write
    from preflight.probes.memlock import _under_systemd
    from preflight.probing import FactReader

    write(tmp_path, "/proc/2187/cgroup", "0::/system.slice/slurmd.service\n")
    write(tmp_path, "/proc/77/cgroup", "0::/kubepods.slice/kubepods-pod1f2e.slice/cri-containerd-9b1c.scope\n")
    reader = FactReader(NodeFS(str(tmp_path)))
    assert (_under_systemd(reader, 2187), _under_systemd(reader, 77), _under_systemd(reader, 5)) == (True, False, None)
    fixes = {o.subject: o.fix for o in memlock_limit_too_low(replace(memlock, slurmd_systemd=False), job(), Expectations())}
    assert fixes["slurmd"].startswith("slurmd here is not started by systemd") and "ulimit -l unlimited" in fixes["slurmd"]
    fixes = {o.subject: o.fix for o in memlock_limit_too_low(memlock, job(), Expectations())}
    assert fixes["slurmd"].startswith("Set LimitMEMLOCK=infinity for slurmd (systemctl edit slurmd)")


def test_mem001_prolog_reports_slurmd_not_its_own_copy_of_the_limit(memlock: MemlockFacts) -> None:
    prolog = job(environ={"SLURM_SCRIPT_CONTEXT": "prolog_slurmd"})
    assert {o.subject for o in memlock_limit_too_low(memlock, prolog, Expectations())} == {"slurmd", "slurm.conf"}
    task_prolog = job(environ={"SLURM_SCRIPT_CONTEXT": "prolog_task"})  # runs inside the job
    assert "process" in {o.subject for o in memlock_limit_too_low(memlock, task_prolog, Expectations())}


def test_mem001_own_limit_outside_a_job_on_a_slurm_node_is_a_warning(memlock: MemlockFacts) -> None:
    """An operator's shell, cron or an audit over ssh has its own (often 8 MiB) limit while
    slurmd, whose limit jobs inherit, has none: a warning about ssh-launched ranks, not a drain.
    In a job's process, or where no slurmd says what jobs get, the own limit is the job's."""
    low_self = replace(unlimited(memlock), process=Limit(8 << 20, 8 << 20, "/proc/self/limits"))
    [found] = memlock_limit_too_low(low_self, job(), Expectations())
    assert (found.subject, found.severity) == ("process", Severity.WARNING) and "not of Slurm jobs" in found.fix
    in_job = job(environ={"SLURM_JOB_ID": "42", "SLURM_STEP_ID": "0"})
    assert [o.severity for o in memlock_limit_too_low(low_self, in_job, Expectations())] == [None]
    no_slurm = replace(low_self, slurmd=None, slurmd_pid=None, slurmd_unit=None)
    assert [(o.subject, o.severity) for o in memlock_limit_too_low(no_slurm, job(), Expectations())] == [("process", None)]


def test_mem001_absent_when_unlimited_and_not_propagated(memlock: MemlockFacts) -> None:
    assert list(memlock_limit_too_low(unlimited(memlock), job(), Expectations())) == []


def test_mem001_slurm_conf_with_an_unread_include_is_undecided(memlock: MemlockFacts) -> None:
    """An Include that cannot be read may set PropagateResourceLimits: neither the warning nor
    silence, but unknown with the Include named."""
    unread = replace(unlimited(memlock), memlock_propagated=None,
                     propagation_setting="/etc/slurm/slurm.conf:7: Include site.conf: /etc/slurm/site.conf is not there; it may set PropagateResourceLimits")
    found = list(memlock_limit_too_low(unread, job(), Expectations()))
    assert [(o.subject, o.status) for o in found] == [("slurm.conf", Status.UNKNOWN)] and "Include site.conf" in found[0].reason


def test_mem001_site_minimum_accepts_finite_limits(memlock: MemlockFacts) -> None:
    finite = replace(unlimited(memlock), slurmd=Limit(64 * GIB, 64 * GIB, "/proc/2187/limits"))
    assert list(memlock_limit_too_low(finite, job(), Expectations(memlock_min=32 * GIB))) == []
    assert [o.subject for o in memlock_limit_too_low(finite, job(), Expectations())] == ["slurmd"]


def test_mem001_unit_file_when_slurmd_not_running(memlock: MemlockFacts) -> None:
    stopped = replace(unlimited(memlock), slurmd=None, slurmd_pid=None)
    found = list(memlock_limit_too_low(stopped, job(), Expectations()))
    assert [o.subject for o in found] == ["slurmd.service"]
    with_limit = replace(stopped, slurmd_unit_limit=Limit(UNLIMITED, UNLIMITED, "/etc/systemd/system/slurmd.service.d/memlock.conf"))
    assert list(memlock_limit_too_low(with_limit, job(), Expectations())) == []


def test_mem001_pam_limits_and_not_applicable_without_rdma(memlock: MemlockFacts) -> None:
    pam = replace(unlimited(memlock), pam_limits=(PamLimit("*", "hard", 64 << 10, "/etc/security/limits.conf:9"),))
    assert [o.subject for o in memlock_limit_too_low(pam, job(), Expectations())] == ["limits.conf *"]
    with pytest.raises(NotApplicable):
        list(memlock_limit_too_low(replace(memlock, rdma_devices=()), job(), Expectations()))


def test_mem001_limits_conf_soft_lines_count_and_a_raising_line_of_the_domain_clears_it(memlock: MemlockFacts) -> None:
    """ssh-launched ranks run with the soft limit, so '* soft memlock 64' is as bad as a hard line;
    a line of the same domain that raises the limit may come later (pam_limits lets it override,
    and PAM releases order limits.conf and limits.d differently): then nothing is reported."""
    def found(*lines: tuple[str, str, int]) -> list[str]:
        pam = tuple(PamLimit(domain, kind, size, f"/etc/security/limits.d/9{n}.conf:1") for n, (domain, kind, size) in enumerate(lines))
        return [o.evidence[0].observed for o in memlock_limit_too_low(replace(unlimited(memlock), pam_limits=pam), job(), Expectations())]

    assert found(("*", "soft", 64 << 10), ("*", "hard", UNLIMITED)) == ["* soft memlock 64 KiB"]
    assert found(("*", "soft", 64 << 10), ("*", "-", UNLIMITED)) == []
    assert found(("*", "hard", 64 << 10), ("*", "hard", UNLIMITED)) == []
    assert found(("@hpc", "soft", 64 << 10), ("*", "soft", UNLIMITED)) == ["@hpc soft memlock 64 KiB"]  # another domain
    assert found(("*", "-", 64 << 10)) == ["* - memlock 64 KiB"]  # one line, reported once
    many = found(*((f"user{n}", "soft", 64 << 10) for n in range(5000)))
    assert len(many) == 9 and many[-1] == "4992 more low memlock lines"  # bounded output


def test_mem001_unreadable_limits_is_unknown_not_absent(memlock: MemlockFacts) -> None:
    facts = replace(unlimited(memlock), slurmd=None, problems=("/proc/2187/limits: permission denied (EACCES); needs root",))
    found = list(memlock_limit_too_low(facts, job(), Expectations()))
    assert [(o.status, o.subject) for o in found] == [(Status.UNKNOWN, "/proc/2187/limits")]



@pytest.mark.parametrize("row", ["Max locked memory         8M                   8M                   bytes\n", ""])
def test_mem001_limits_file_without_a_memlock_row_that_parses_is_unknown(node_copy: Path, row: str) -> None:
    """A limits file read whose memlock row is garbled or missing leaves that limit unknown: it
    was reported absent (no finding), as if the process had no limit to judge."""
    limits = node_copy / "proc/self/limits"
    kept = [line for line in limits.read_text().splitlines(keepends=True) if not line.startswith("Max locked memory")]
    limits.write_text("".join(kept) + row)
    facts = probe_memlock(NodeFS(str(node_copy)))
    assert facts.process is None and "/proc/self/limits: no 'Max locked memory' row that parses" in facts.problems
    found = list(memlock_limit_too_low(replace(facts, slurmd=None, slurmd_pid=None, slurmd_unit=None), job(), Expectations()))
    assert ("/proc/self/limits", Status.UNKNOWN) in [(o.subject, o.status) for o in found]

# MEM002 ------------------------------------------------------------------------------------
def test_mem002_present_when_buffsize_exceeds_memlock(memlock: MemlockFacts, gpudirect: GpuDirectFacts) -> None:
    found = list(nccl_buffsize_exceeds_pinned_memory(job(conf={"NCCL_BUFFSIZE": "268435456"}), memlock, gpudirect))
    assert len(found) == 1 and found[0].evidence[0].source == "/etc/nccl.conf NCCL_BUFFSIZE"


def test_mem002_over_nccls_sockets_nothing_is_registered(memlock: MemlockFacts, gpudirect: GpuDirectFacts) -> None:
    """NCCL_IB_DISABLE=1 with no network plugin: the socket transport registers no buffer with a
    NIC, so memlock does not bound NCCL_BUFFSIZE there (an RDMA device that the Ethernet ConnectX
    shows changes nothing)."""
    sockets = job(environ={"NCCL_IB_DISABLE": "1"}, conf={"NCCL_BUFFSIZE": "268435456"})
    assert list(nccl_buffsize_exceeds_pinned_memory(sockets, memlock, gpudirect, NCCL_2_28)) == []
    assert len(list(nccl_buffsize_exceeds_pinned_memory(sockets, memlock, gpudirect))) == 1  # which NCCL loads: unknown


def test_mem002_absent_with_default_or_modest_buffsize(memlock: MemlockFacts, gpudirect: GpuDirectFacts) -> None:
    with pytest.raises(NotApplicable, match="NCCL_BUFFSIZE not set"):
        list(nccl_buffsize_exceeds_pinned_memory(job(), memlock, gpudirect))
    modest = job(environ={"NCCL_BUFFSIZE": "8388608"})
    assert list(nccl_buffsize_exceeds_pinned_memory(modest, unlimited(memlock), gpudirect)) == []


def test_mem002_environment_wins_and_host_memory_bound(memlock: MemlockFacts, gpudirect: GpuDirectFacts) -> None:
    huge = job(environ={"NCCL_BUFFSIZE": str(8 * GIB)}, conf={"NCCL_BUFFSIZE": "4194304"})
    found = list(nccl_buffsize_exceeds_pinned_memory(huge, unlimited(memlock), gpudirect))
    assert len(found) == 1 and found[0].severity is Severity.WARNING
    assert found[0].evidence[0].source == "/proc/self/environ NCCL_BUFFSIZE"


def test_mem002_garbage_value_is_present(memlock: MemlockFacts, gpudirect: GpuDirectFacts) -> None:
    found = list(nccl_buffsize_exceeds_pinned_memory(job(environ={"NCCL_BUFFSIZE": "4MB"}), unlimited(memlock), gpudirect))
    assert found and "4MB" in found[0].evidence[0].observed



@pytest.mark.parametrize(
    ("value", "verdict"),
    [
        ("8388608 # 8 MiB for IB", "absent"),  # nccl.conf keeps the comment; strtoll stops before it
        (" 0x800000", "absent"),
        ("", "not applicable"),  # an empty value leaves NCCL's default
        ("-2", "not applicable"),  # computeBuffSizes' mark for "default"
        ("4_194_304", "present"),  # Python's int() took it; strtoll reads 4 bytes
        ("4M", "present"),
        ("lots", "present"),
        ("0", "present"),
    ],
)
def test_mem002_reads_the_value_as_nccl_does(memlock: MemlockFacts, gpudirect: GpuDirectFacts, value: str, verdict: str) -> None:
    setting = job(conf={"NCCL_BUFFSIZE": value})
    if verdict == "not applicable":
        with pytest.raises(NotApplicable, match="NCCL's default"):
            list(nccl_buffsize_exceeds_pinned_memory(setting, unlimited(memlock), gpudirect))
        return
    found = list(nccl_buffsize_exceeds_pinned_memory(setting, unlimited(memlock), gpudirect))
    assert (found[0].evidence[0].observed.split(":")[1].split()[:2] == ["NCCL", "reads"]) if verdict == "present" else found == []


def test_mem002_own_limit_outside_a_job_is_a_warning(memlock: MemlockFacts, gpudirect: GpuDirectFacts) -> None:
    """Run from cron or an operator's shell on a Slurm node, preflight's own memlock limit is not
    the one jobs get (slurmd's is): a warning, as MEM001 says of the same limit."""
    no_right = parse_exemption("Uid:\t1001\t1001\t1001\t1001\nCapEff:\t0000000000000000\n", "0 0 4294967295\n")
    low_own = replace(unlimited(memlock), process=Limit(8 << 20, 8 << 20, "/proc/self/limits"), exemption=no_right)
    found = list(nccl_buffsize_exceeds_pinned_memory(job(conf={"NCCL_BUFFSIZE": str(16 << 20)}), low_own, gpudirect))
    assert [(o.severity, o.evidence[1].source) for o in found] == [(Severity.WARNING, "/proc/self/limits")]
    in_job = job(environ={"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0"}, conf={"NCCL_BUFFSIZE": str(16 << 20)})
    found = list(nccl_buffsize_exceeds_pinned_memory(in_job, low_own, gpudirect))
    assert [(o.severity, o.evidence[1].source) for o in found] == [(None, "/proc/self/limits")]

# GDR001 ------------------------------------------------------------------------------------
NCCL_2_28 = NcclLibFacts((NcclCopy("/usr/lib/x86_64-linux-gnu/libnccl.so.2.28.9", "2.28.9", "system"),), ())
NCCL_2_21 = NcclLibFacts((NcclCopy("/usr/lib/x86_64-linux-gnu/libnccl.so.2.21.5", "2.21.5", "system"),), ())


def test_gdr001_present_without_peermem_on_proprietary_driver(gpudirect: GpuDirectFacts) -> None:
    found = list(gpudirect_rdma_unavailable(gpudirect, MLX, job(), NCCL_2_28))
    assert [o.subject for o in found] == ["node"]


def test_gdr001_absent_with_peermem_or_dmabuf(gpudirect: GpuDirectFacts) -> None:
    with_peermem = replace(gpudirect, peer_memory_files=("/sys/module/nvidia_peermem/version",))
    assert list(gpudirect_rdma_unavailable(with_peermem, MLX, job(), NCCL_2_28)) == []
    with_peer_client = replace(gpudirect, peer_memory_files=("/sys/kernel/mm/memory_peers/nv_mem/version", "/sys/module/nvidia_peermem/version"))
    assert list(gpudirect_rdma_unavailable(with_peer_client, MLX, job(), NCCL_2_21)) == []
    open_modules = replace(gpudirect, driver_flavour="open")
    assert list(gpudirect_rdma_unavailable(open_modules, MLX, job(), NCCL_2_28)) == []
    for off in ("0", "0 # off", "false"):  # strtoll reads each as 0
        disabled = job(environ={"NCCL_DMABUF_ENABLE": off})
        assert len(list(gpudirect_rdma_unavailable(open_modules, MLX, disabled, NCCL_2_28))) == 1
    old_kernel = replace(open_modules, kernel_release="4.18.0-553.el8.x86_64")
    assert len(list(gpudirect_rdma_unavailable(old_kernel, MLX, job(), NCCL_2_28))) == 1


def test_gdr001_without_the_jobs_facts(gpudirect: GpuDirectFacts) -> None:
    """NCCL_DMABUF_ENABLE matters only where DMA-BUF could work: without the job's facts the
    proprietary driver's missing peer-memory client is still present, an open-module node unknown."""
    unread = Unread("job", "/proc/self/environ: not captured")
    assert [o.subject for o in gpudirect_rdma_unavailable(gpudirect, MLX, unread, NCCL_2_28)] == ["node"]
    with pytest.raises(Unknown, match="NCCL_DMABUF_ENABLE .*probe job: /proc/self/environ: not captured"):
        list(gpudirect_rdma_unavailable(replace(gpudirect, driver_flavour="open"), MLX, unread, NCCL_2_28))


def efa_node(*providers: str | None) -> RdmaFacts:
    """A p4d-like node: one EFA device per provider reading (None: no device/p2p or gdr)."""
    devices = tuple(
        RdmaDevice(f"rdmap{16 * (i + 1)}s27", f"/sys/class/infiniband/rdmap{16 * (i + 1)}s27", "unspecified", None, None,
                   f"0000:{16 * (i + 1):02x}:1b.0", "0x1d0f", True, False, (), f"uverbs{i}", (), (), efa_gpu_memory=provider)
        for i, provider in enumerate(providers)
    )
    return replace(MLX, devices=devices)


def test_gdr001_efa_devices_are_judged_by_efa_ko_own_provider(gpudirect: GpuDirectFacts) -> None:
    """EFA maps GPU memory through efa.ko's own provider (amzn-drivers efa_p2p.c), not through
    nvidia_peermem: a p4d with the proprietary driver and no peermem has GPUDirect RDMA."""
    def verdict(rdma: RdmaFacts, facts: GpuDirectFacts = gpudirect) -> list[Observation]:
        names = tuple(device.name for device in rdma.devices)
        return list(gpudirect_rdma_unavailable(replace(facts, rdma_devices=names), rdma, job(), NCCL_2_28))

    assert verdict(efa_node("NVIDIA", "NVIDIA")) == [] and verdict(efa_node("NVIDIA peermem")) == []
    [found] = verdict(efa_node("", ""))
    assert found.evidence[0].source.endswith("/device/p2p") and "no provider available" in found.evidence[0].observed
    assert "NEURON" in verdict(efa_node("NEURON"))[0].evidence[0].observed
    # The kernel's own efa driver has no device/p2p: DMA-BUF decides, else the check cannot tell.
    assert verdict(efa_node(None), replace(gpudirect, driver_flavour="open")) == []
    with pytest.raises(Unknown, match="without efa.ko's device/p2p"):
        verdict(efa_node(None))
    # A ConnectX next to the EFA devices still needs a peer-memory client or DMA-BUF.
    mixed = replace(MLX, devices=efa_node("NVIDIA").devices + MLX.devices)
    assert [o.subject for o in verdict(mixed)] == ["node"]


def test_gdr001_nvidia_peermem_alone_with_nccl_before_2_23_4(gpudirect: GpuDirectFacts) -> None:
    with_peermem = replace(gpudirect, peer_memory_files=("/sys/module/nvidia_peermem/version",))
    [found] = gpudirect_rdma_unavailable(with_peermem, MLX, job(), NCCL_2_21)
    assert found.subject == "/usr/lib/x86_64-linux-gnu/libnccl.so.2.21.5" and "2.23.4" in found.evidence[0].expected
    unnamed = NcclLibFacts((NcclCopy("/opt/nccl/lib/libnccl.so.2", None, "system"),), ())
    [found] = gpudirect_rdma_unavailable(with_peermem, MLX, job(), unnamed)
    assert found.status is Status.UNKNOWN and "not named" in found.reason
    assert list(gpudirect_rdma_unavailable(replace(with_peermem, driver_flavour="open"), MLX, job(), NCCL_2_21)) == []  # DMA-BUF instead
    # A prolog sees slurmd's environment: a job that loads HPC-X brings a plugin that accepts
    # nvidia_peermem on its own LD_LIBRARY_PATH, so there the old copy is a warning, not a drain.
    [found] = gpudirect_rdma_unavailable(with_peermem, MLX, job({"SLURM_SCRIPT_CONTEXT": "prolog_slurmd"}), NCCL_2_21)
    assert found.severity is Severity.WARNING and found.evidence[-1].source == "job environment"
    assert found.subject == "/usr/lib/x86_64-linux-gnu/libnccl.so.2.21.5"
    # A copy the job does not load (its PyTorch wheel's, or another on its LD_LIBRARY_PATH, comes first): information.
    bypassed = replace(NCCL_2_21, copies=tuple(replace(copy, bypassed="PyTorch here loads its own wheel") for copy in NCCL_2_21.copies))
    [found] = gpudirect_rdma_unavailable(with_peermem, MLX, job(), bypassed)
    assert found.severity is Severity.INFO and "Not what PyTorch loads here" in found.fix


def pcie_server(gpu_chain: tuple[str, ...], nic_chain: tuple[str, ...], hypervisor: bool | None = False) -> PcieFacts:
    """One GPU and one RDMA NIC, on one socket, at the given places."""
    link = PcieLink(16, 16, "32.0 GT/s PCIe", "32.0 GT/s PCIe", "")
    gpu = PciEndpoint("0000:18:00.0", gpu_chain, 0, link, None, "", "")
    nic = PciEndpoint("0000:41:00.0", nic_chain, 0, link, None, "", "", ("mlx5_0",))
    return PcieFacts((gpu,), (nic,), (), (), (), (), (), hypervisor, (), "", ())


def test_gdr001_where_no_gpu_is_near_enough_a_nic_for_nccl_it_is_a_warning(gpudirect: GpuDirectFacts) -> None:
    """An H100 PCIe server with one ConnectX on its own root port: every GPU-NIC path is PHB, past
    NCCL_NET_GDR_LEVEL's default PXB, so NCCL uses no GPUDirect RDMA there, peer memory or not."""
    phb = pcie_server(("0000:15:01.0",), ("0000:40:01.0",))
    [found] = gpudirect_rdma_unavailable(gpudirect, MLX, job(), NCCL_2_28, phb)
    assert found.severity is Severity.WARNING and "beyond NCCL_NET_GDR_LEVEL PXB (the default)" in found.evidence[-1].observed
    # Under one switch, with the level raised to PHB, in a VM or with a topology file: an error as before.
    switch = pcie_server(("0000:15:01.0", "0000:16:00.0", "0000:17:00.0"), ("0000:15:01.0", "0000:16:00.0", "0000:17:01.0"))
    for facts, where in ((switch, job()), (phb, job(environ={"NCCL_NET_GDR_LEVEL": "PHB"})),
                         (pcie_server(("0000:15:01.0",), ("0000:40:01.0",), hypervisor=True), job()),
                         (phb, job(environ={"NCCL_TOPO_FILE": "/opt/microsoft/ndv5-topo.xml"})), (Unread("pcie", "x"), job())):
        [found] = gpudirect_rdma_unavailable(gpudirect, MLX, where, NCCL_2_28, facts)
        assert found.severity is None, (facts, where)


def test_gdr001_where_nccls_sockets_carry_the_data_it_is_a_warning(gpudirect: GpuDirectFacts) -> None:
    """An on-prem Ethernet node: the ConnectX shows an RDMA device, and the site sets
    NCCL_IB_DISABLE=1. With no network plugin for NCCL to load, its sockets carry the data and no
    GPUDirect RDMA is used; a plugin would still register GPU memory with the NIC."""
    off = job(environ={"NCCL_IB_DISABLE": "1"})
    [found] = gpudirect_rdma_unavailable(gpudirect, MLX, off, NCCL_2_28)
    assert found.severity is Severity.WARNING and "socket transport carries the data" in found.evidence[-1].observed
    plugin = replace(NCCL_2_28, net_plugins=("/opt/amazon/ofi-nccl/lib/libnccl-net.so",))
    [found] = gpudirect_rdma_unavailable(gpudirect, MLX, off, plugin)
    assert found.severity is None
    [found] = gpudirect_rdma_unavailable(gpudirect, MLX, job(environ={"NCCL_NET": "Socket"}), NCCL_2_28)
    assert found.severity is Severity.WARNING
    with_peermem = replace(gpudirect, peer_memory_files=("/sys/module/nvidia_peermem/version",))
    assert list(gpudirect_rdma_unavailable(with_peermem, MLX, off, NCCL_2_21)) == []  # the old NCCL's own test never runs


def test_gdr001_a_network_plugin_tests_gpudirect_itself(gpudirect: GpuDirectFacts) -> None:
    """HPC-X's nccl-rdma-sharp plugin (libnccl-net.so on the job's LD_LIBRARY_PATH) carries the
    IB traffic with its own GPUDirect test, which accepts nvidia_peermem since its update for NCCL
    2.23.4 (p2p_plugin.c): an old NCCL's own test no longer decides, and the plugin's build is
    unknown, so the finding is unknown, not a drain."""
    with_peermem = replace(gpudirect, peer_memory_files=("/sys/module/nvidia_peermem/version",))
    hpcx = replace(NCCL_2_21, net_plugins=("/opt/hpcx/nccl_rdma_sharp_plugin/lib/libnccl-net.so",))
    [found] = gpudirect_rdma_unavailable(with_peermem, MLX, job(), hpcx)
    assert found.status is Status.UNKNOWN and "/opt/hpcx/nccl_rdma_sharp_plugin/lib/libnccl-net.so" in found.reason
    # NCCL_NET=IB keeps NCCL's own transport; NCCL_NET_PLUGIN=none loads no plugin; a plugin
    # named by NCCL_NET_PLUGIN is looked up as libnccl-net-<name>.so.
    for environ in ({"NCCL_NET": "IB"}, {"NCCL_NET_PLUGIN": "none"}, {"NCCL_NET_PLUGIN": "aws-ofi"}):
        [found] = gpudirect_rdma_unavailable(with_peermem, MLX, job(environ=environ), hpcx)
        assert found.status is Status.PRESENT, environ
    named = replace(NCCL_2_21, net_plugins=("/opt/hpcx/nccl_rdma_sharp_plugin/lib/libnccl-net-ucx.so",))
    [found] = gpudirect_rdma_unavailable(with_peermem, MLX, job(environ={"NCCL_NET_PLUGIN": "ucx"}), named)
    assert found.status is Status.UNKNOWN


def test_gdr001_not_applicable_without_driver_or_rdma(gpudirect: GpuDirectFacts) -> None:
    with pytest.raises(NotApplicable):
        list(gpudirect_rdma_unavailable(replace(gpudirect, nvidia_driver=None, nvidia_loaded=False), MLX, job(), NCCL_2_28))
    with pytest.raises(NotApplicable):
        list(gpudirect_rdma_unavailable(replace(gpudirect, rdma_devices=()), MLX, job(), NCCL_2_28))


def test_gdr001_unknown_where_a_source_was_not_read(gpudirect: GpuDirectFacts) -> None:
    """Missing is not empty: no driver, no RDMA class, no peer-memory client are claims that
    need their source; unread, each makes GDR001 unknown, never not_applicable or present."""
    why = ("/sys/module/nvidia: not captured: this root has no /sys/module (kernel modules)",)
    with pytest.raises(Unknown, match="not captured"):
        list(gpudirect_rdma_unavailable(replace(gpudirect, nvidia_driver=None, nvidia_loaded=None, problems=why), MLX, job(), NCCL_2_28))
    with pytest.raises(Unknown):
        list(gpudirect_rdma_unavailable(replace(gpudirect, rdma_devices=None), MLX, job(), NCCL_2_28))
    unread = replace(gpudirect, peer_memory_unknown=("/sys/kernel/mm/memory_peers/nv_mem/version",))
    with pytest.raises(Unknown, match="neither GPUDirect path is confirmed"):
        list(gpudirect_rdma_unavailable(unread, MLX, job(), NCCL_2_28))
    with pytest.raises(Unknown):
        list(gpudirect_rdma_unavailable(replace(gpudirect, kernel_release=None), MLX, job(), NCCL_2_28))
    # an open driver on a new kernel needs no peer client: unread peer files change nothing
    assert list(gpudirect_rdma_unavailable(replace(unread, driver_flavour="open"), MLX, job(), NCCL_2_28)) == []



@pytest.mark.parametrize(
    ("text", "flavour"),
    [
        ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024\n", "proprietary"),
        ("NVRM version: NVIDIA UNIX Open Kernel Module for aarch64  570.133.20  Release Build\n", "open"),
        ("\x00\x00garbage\n", None),  # a damaged file names neither: DMA-BUF undecided, not "proprietary"
    ],
)
def test_driver_flavour_only_from_the_nvrm_line(node_copy: Path, text: str, flavour: str | None) -> None:
    (node_copy / "proc/driver/nvidia/version").write_text(text)
    facts = probe_gpudirect(NodeFS(str(node_copy)))
    assert facts.driver_flavour == flavour and facts.nvidia_loaded
    assert any(p.startswith("/proc/driver/nvidia/version") for p in facts.problems) == (flavour is None)


def test_gdr001_not_applicable_where_the_rdma_devices_are_nvswitch_management_functions(gpudirect: GpuDirectFacts) -> None:
    """A node whose only RDMA devices are NVSwitch management functions (SMDL=SW_MNG) has no NIC
    that maps GPU memory for jobs, whatever the driver flavour."""
    management = replace(MLX, devices=tuple(replace(device, nvswitch_management=True) for device in MLX.devices))
    with pytest.raises(NotApplicable, match="NVSwitch management functions only"):
        list(gpudirect_rdma_unavailable(gpudirect, management, job(), NCCL_2_28))
    assert len(list(gpudirect_rdma_unavailable(gpudirect, MLX, job(), NCCL_2_28))) == 1  # the data NICs: judged


def test_driver_not_loaded_only_where_sys_module_was_read(node_copy: Path) -> None:
    """A capture without /sys/module and without /proc/driver says nothing of the driver: unknown,
    not "not loaded" (which made GDR001 not applicable beside NVML's answers)."""
    shutil.rmtree(node_copy / "sys/module")
    shutil.rmtree(node_copy / "proc/driver")
    facts = probe_gpudirect(NodeFS(str(node_copy)))
    assert facts.nvidia_loaded is None
    with pytest.raises(Unknown, match="NVIDIA driver is loaded"):
        list(gpudirect_rdma_unavailable(facts, MLX, job(), NCCL_2_28))

# GDR002 ------------------------------------------------------------------------------------
def test_gdr002_present_when_enabled_without_gdrdrv(gpudirect: GpuDirectFacts, gpus: GpuFacts) -> None:
    found = list(gdrcopy_driver_unusable(gpudirect, job(conf={"NCCL_GDRCOPY_ENABLE": "1"}), NCCL_2_28, gpus))
    assert [o.subject for o in found] == ["gdrdrv"]
    # NCCL runs on without GDRCopy when gdr_open fails: slower, not failed, so no drain
    assert [o.severity for o in found] == [Severity.WARNING]


def test_gdr002_device_node_missing_or_not_accessible(gpudirect: GpuDirectFacts, gpus: GpuFacts) -> None:
    loaded = replace(gpudirect, gdrdrv_loaded=True)
    enabled = job(environ={"NCCL_GDRCOPY_ENABLE": "1"})
    assert [o.subject for o in gdrcopy_driver_unusable(loaded, enabled, NCCL_2_28, gpus)] == ["/dev/gdrdrv"]
    node = DeviceNode("/dev/gdrdrv", 0o20660, 0, 44)
    alice = JobIdentity(1001, (1001, 996), "SLURM_JOB_UID")
    locked = replace(loaded, gdrdrv_node=node, job_identity=alice)
    found = list(gdrcopy_driver_unusable(locked, enabled, NCCL_2_28, gpus))
    assert found and "crw-rw----" in found[0].evidence[1].observed and found[0].severity == Severity.WARNING
    member = replace(locked, job_identity=JobIdentity(1001, (1001, 44), "SLURM_JOB_UID"))
    assert list(gdrcopy_driver_unusable(member, enabled, NCCL_2_28, gpus)) == []
    # the job user's groups read from /etc/group while nsswitch.conf also asks sss: group 44 may be theirs
    directory = replace(locked, job_identity=replace(alice, groups_elsewhere=("sss",)))
    found = list(gdrcopy_driver_unusable(directory, enabled, NCCL_2_28, gpus))
    assert [(o.subject, o.status) for o in found] == [("/dev/gdrdrv", Status.UNKNOWN)] and "also asks sss" in found[0].reason


def test_gdr002_absent_when_not_requested(gpudirect: GpuDirectFacts, gpus: GpuFacts) -> None:
    with pytest.raises(NotApplicable, match="NCCL_GDRCOPY_ENABLE not set"):
        list(gdrcopy_driver_unusable(gpudirect, job(), NCCL_2_28, gpus))
    assert list(gdrcopy_driver_unusable(gpudirect, job(environ={"NCCL_GDRCOPY_ENABLE": "0"}), NCCL_2_28, gpus)) == []
    # initGdrCopy loads GDRCopy only when the value reads as exactly 1 through strtoll
    for value in ("true", "2", "yes"):
        assert list(gdrcopy_driver_unusable(gpudirect, job(environ={"NCCL_GDRCOPY_ENABLE": value}), NCCL_2_28, gpus)) == []
    assert list(gdrcopy_driver_unusable(gpudirect, job(environ={"NCCL_GDRCOPY_ENABLE": "1 # on"}), NCCL_2_28, gpus)) != []


NCCL_2_32 = NcclLibFacts((NcclCopy("/opt/venv/lib/python3.12/site-packages/nvidia/nccl/lib/libnccl.so.2", "2.32.6", "wheel"),), ())


def test_gdr002_internal_dmabuf_skips_gdrdrv_on_nccl_2_31_2_and_later(gpudirect: GpuDirectFacts, gpus: GpuFacts) -> None:
    """NCCL_GDRCOPY_USE_INTERNAL_DMABUF=1 or 2 makes NCCL 2.31.2+ skip libgdrapi, so a missing
    gdrdrv is no finding there; NCCL before 2.31.2 ignores the variable and still needs gdrdrv."""
    open_modules = replace(gpudirect, driver_flavour="open")  # the example node runs Linux 5.15
    gpus = replace(gpus, cuda_driver_version=13030)  # NCCL's own DMA-BUF mapping can start
    for choice in ("1", "2"):
        internal = job(environ={"NCCL_GDRCOPY_ENABLE": "1", "NCCL_GDRCOPY_USE_INTERNAL_DMABUF": choice})
        assert list(gdrcopy_driver_unusable(open_modules, internal, NCCL_2_32, gpus)) == []
        assert [o.subject for o in gdrcopy_driver_unusable(open_modules, internal, NCCL_2_21, gpus)] == ["gdrdrv"]
    both = NcclLibFacts(NCCL_2_32.copies + NCCL_2_21.copies, ())
    preferred = job(environ={"NCCL_GDRCOPY_ENABLE": "1", "NCCL_GDRCOPY_USE_INTERNAL_DMABUF": "2"})
    assert [o.subject for o in gdrcopy_driver_unusable(open_modules, preferred, both, gpus)] == ["gdrdrv"]
    invalid = job(environ={"NCCL_GDRCOPY_ENABLE": "1", "NCCL_GDRCOPY_USE_INTERNAL_DMABUF": "3"})  # NCCL warns, uses libgdrapi
    [found] = gdrcopy_driver_unusable(open_modules, invalid, NCCL_2_32, replace(gpus, cuda_driver_version=12040))
    assert found.subject == "gdrdrv" and found.severity is Severity.WARNING
    assert any("DMA-BUF when gdr_open fails" in item.observed for item in found.evidence)  # the release's own fallback is named


def test_gdr002_internal_dmabuf_required_without_dmabuf_fails_init(gpudirect: GpuDirectFacts, gpus: GpuFacts) -> None:
    """=1 on proprietary modules, a kernel before 5.12 or a driver older than CUDA 13.3: NCCL's init
    returns an error. A fact that decides it unread makes the finding unknown, never absent."""
    required = job(conf={"NCCL_GDRCOPY_ENABLE": "1", "NCCL_GDRCOPY_USE_INTERNAL_DMABUF": "1"})
    [found] = gdrcopy_driver_unusable(gpudirect, required, NCCL_2_32, gpus)  # the example: proprietary modules
    assert found.status is Status.PRESENT and found.severity is Severity.ERROR
    assert found.subject == NCCL_2_32.copies[0].path and any("proprietary" in item.observed for item in found.evidence)
    old_kernel = replace(gpudirect, driver_flavour="open", kernel_release="4.18.0-553.el8.x86_64")
    assert [o.severity for o in gdrcopy_driver_unusable(old_kernel, required, NCCL_2_32, gpus)] == [Severity.ERROR]
    unread = replace(gpudirect, driver_flavour=None, problems=("/proc/driver/nvidia/version: permission denied",))
    cuda_13_3 = replace(gpus, cuda_driver_version=13030)
    [found] = gdrcopy_driver_unusable(unread, required, NCCL_2_32, cuda_13_3)
    assert found.status is Status.UNKNOWN and "permission denied" in found.reason
    garbled = replace(gpudirect, driver_flavour="open", kernel_release="??", problems=())
    [found] = gdrcopy_driver_unusable(garbled, required, NCCL_2_32, cuda_13_3)  # a release that does not parse names that file
    assert found.status is Status.UNKNOWN and "/proc/sys/kernel/osrelease" in found.reason
    [found] = gdrcopy_driver_unusable(unread, required, NCCL_2_32, gpus)  # the example's CUDA 12.4 driver decides alone
    assert found.status is Status.PRESENT and any(item.observed == "CUDA 12.4" for item in found.evidence)
    open_modules = replace(gpudirect, driver_flavour="open")
    unrecorded = replace(gpus, cuda_driver_version=None, cuda_driver_error="NVML_NOT_RECORDED")
    [found] = gdrcopy_driver_unusable(open_modules, required, NCCL_2_32, unrecorded)
    assert found.status is Status.UNKNOWN and "nvmlSystemGetCudaDriverVersion_v2: NVML_NOT_RECORDED" in found.reason
    assert list(gdrcopy_driver_unusable(open_modules, required, NCCL_2_32, cuda_13_3)) == []
    [found] = gdrcopy_driver_unusable(open_modules, required, NCCL_2_32, replace(gpus, cuda_driver_version=13020))
    assert found.severity is Severity.ERROR and any(item.observed == "CUDA 13.2" for item in found.evidence)


def test_gdr002_internal_dmabuf_preferred_without_the_mapping_loses_gdrcopy(gpudirect: GpuDirectFacts, gpus: GpuFacts) -> None:
    """=2 where NCCL's mapping cannot start: NCCL does not try gdrdrv and runs on without GDRCopy,
    a warning like an unusable gdrdrv; a driver version nobody read leaves it unknown."""
    preferred = job(environ={"NCCL_GDRCOPY_ENABLE": "1", "NCCL_GDRCOPY_USE_INTERNAL_DMABUF": "2"})
    ready = replace(gpudirect, driver_flavour="open", gdrdrv_loaded=True)  # gdrdrv itself would do
    [found] = gdrcopy_driver_unusable(ready, preferred, NCCL_2_32, gpus)  # the example's CUDA 12.4 driver
    assert found.subject == NCCL_2_32.copies[0].path and found.status is Status.PRESENT and found.severity is Severity.WARNING
    assert any(item.observed == "CUDA 12.4" for item in found.evidence)
    unrecorded = replace(gpus, cuda_driver_version=None, cuda_driver_error="NVML_NOT_RECORDED")
    assert [o.status for o in gdrcopy_driver_unusable(ready, preferred, NCCL_2_32, unrecorded)] == [Status.UNKNOWN]
    assert list(gdrcopy_driver_unusable(ready, preferred, NCCL_2_32, replace(gpus, cuda_driver_version=13030))) == []


def test_gdr002_no_gdrdrv_is_no_finding_where_nccl_maps_gpu_memory_itself(gpudirect: GpuDirectFacts, gpus: GpuFacts) -> None:
    """NCCL 2.31.2+ falls back to its own DMA-BUF mapping when gdr_open fails: with the open modules
    on Linux 5.12+ and a CUDA 13.3 driver the job keeps GDRCopy's speed without gdrdrv. A driver
    too old for it, or a CUDA version nobody read, leaves the warning with the reason."""
    enabled = job(environ={"NCCL_GDRCOPY_ENABLE": "1"})
    ready = replace(gpudirect, driver_flavour="open")
    assert list(gdrcopy_driver_unusable(ready, enabled, NCCL_2_32, replace(gpus, cuda_driver_version=13030))) == []
    [found] = gdrcopy_driver_unusable(ready, enabled, NCCL_2_32, replace(gpus, cuda_driver_version=12040))
    assert found.subject == "gdrdrv" and found.severity is Severity.WARNING
    assert any(item.observed == "CUDA 12.4" for item in found.evidence)
    unrecorded = replace(gpus, cuda_driver_version=None, cuda_driver_error="NVML_NOT_RECORDED")
    [found] = gdrcopy_driver_unusable(ready, enabled, NCCL_2_32, unrecorded)
    assert found.severity is Severity.WARNING and any("NVML_NOT_RECORDED" in item.observed for item in found.evidence)
    # an older NCCL beside the new one still needs gdrdrv
    both = NcclLibFacts(NCCL_2_32.copies + NCCL_2_21.copies, ())
    assert [o.subject for o in gdrcopy_driver_unusable(ready, enabled, both, replace(gpus, cuda_driver_version=13030))] == ["gdrdrv"]


# GPU001 ------------------------------------------------------------------------------------
def test_gpu001_absent_on_healthy_node(gpus: GpuFacts, health: GpuHealthFacts) -> None:
    assert len(gpus.devices) == 8 and len(gpus.pci_gpus) == 8 and len(health.gpus) == 8
    assert list(gpu_unusable_by_driver(gpus, health, job(), Expectations(gpu_count=8))) == []


def test_gpu001_lost_gpu_missing_gpu_and_version_mismatch(gpus: GpuFacts, health: GpuHealthFacts) -> None:
    lost = replace(gpus, devices=gpus.devices[:3] + (replace(gpus.devices[3], error="NVML_ERROR_GPU_IS_LOST"),) + gpus.devices[4:])
    assert [o.subject for o in gpu_unusable_by_driver(lost, health, job(), Expectations())] == ["GPU3"]
    missing = replace(gpus, devices=gpus.devices[:7])
    found = list(gpu_unusable_by_driver(missing, health, job(), Expectations()))
    assert found and gpus.pci_gpus[7] in found[0].evidence[1].observed
    mismatch = replace(gpus, nvml_error="NVML_ERROR_LIB_RM_VERSION_MISMATCH", nvml_detail="RM has detected an NVML/RM version mismatch.", devices=())
    assert [o.subject for o in gpu_unusable_by_driver(mismatch, health, job(), Expectations())] == ["node"]
    assert [o.subject for o in gpu_unusable_by_driver(gpus, health, job(), Expectations(gpu_count=16))] == ["node"]


def test_gpu001_views_narrowed_on_purpose_are_not_missing_gpus(gpus: GpuFacts, health: GpuHealthFacts) -> None:
    """In a container (the runtime's own /proc/driver/nvidia) or a Slurm job step with
    ConstrainDevices, NVML lists the GPUs given to it while sysfs shows the whole bus."""
    two = replace(gpus, devices=gpus.devices[:2])
    container = replace(two, container_gpus=gpus.pci_gpus[:2])
    assert list(gpu_unusable_by_driver(container, health, job(), Expectations(gpu_count=8))) == []
    # A GPU given to the container that NVML does not list is still missing.
    [found] = gpu_unusable_by_driver(replace(container, devices=gpus.devices[:1]), health, job(), Expectations())
    assert found.evidence[1].observed == f"not visible to NVML: {gpus.pci_gpus[1]}; 6 not given to this container"
    assert "the container's" in found.evidence[0].expected
    step = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0"}
    assert list(gpu_unusable_by_driver(two, health, job(environ={**step, "SLURM_STEP_GPUS": "0,1"}), Expectations(gpu_count=8))) == []
    assert list(gpu_unusable_by_driver(two, health, job(environ={**step, "SLURM_JOB_GPUS": "4-5"}), Expectations())) == []
    # A job process that names no GPUs given to it (a CPU-only step, gres/shard, a launcher
    # outside Slurm) may have a device cgroup hiding the rest: unknown, not missing GPUs.
    [unknown] = gpu_unusable_by_driver(two, health, job(environ=step), Expectations(gpu_count=8))
    assert unknown.status is Status.UNKNOWN and "names no GPUs given to it" in unknown.reason
    # Given three but NVML lists two, or outside a job: a GPU is missing.
    assert [o.subject for o in gpu_unusable_by_driver(two, health, job(environ={**step, "SLURM_STEP_GPUS": "0-2"}), Expectations())] == ["node"]
    assert [o.subject for o in gpu_unusable_by_driver(two, health, job(environ={"SLURM_JOB_GPUS": "0,1"}), Expectations())] == ["node"]
    # A step given no GPU inside a GPU job (srun --gres=none): Slurm unsets SLURM_STEP_GPUS, keeps
    # SLURM_JOB_GPUS, and the step's device cgroup hides every GPU.
    assert list(gpu_unusable_by_driver(replace(gpus, devices=()), health, job(environ={**step, "SLURM_JOB_GPUS": "0,1"}), Expectations())) == []
    # A prolog in the job's cgroup (PrologFlags=RunInJob, ConstrainDevices) sees the job's GPUs only;
    # one run by slurmd outside it sees every GPU, so two listed there are six missing.
    prolog = {"SLURM_JOB_ID": "7", "SLURM_SCRIPT_CONTEXT": "prolog_slurmd", "SLURM_JOB_GPUS": "4,5"}
    assert list(gpu_unusable_by_driver(two, health, replace(job(environ=prolog), cgroup_job="job_7"), Expectations(gpu_count=8))) == []
    outside = replace(job(environ=prolog), cgroup_job="")
    assert [(o.subject, o.status) for o in gpu_unusable_by_driver(two, health, outside, Expectations())] == [("node", Status.PRESENT)]
    [unknown] = gpu_unusable_by_driver(two, health, job(environ=prolog), Expectations())  # /proc/self/cgroup not read
    assert unknown.status is Status.UNKNOWN and "PrologFlags=RunInJob" in unknown.reason
    # In a job's cgroup without its environment (Apptainer --cleanenv or --containall, an ssh session
    # pam_slurm_adopt put in the job): the device cgroup may hide the rest, unknown, not missing.
    [unknown] = gpu_unusable_by_driver(two, health, replace(job(environ={}), cgroup_job="job_4242"), Expectations())
    assert unknown.status is Status.UNKNOWN and "in the cgroup of Slurm's job_4242 whose environment names no GPUs" in unknown.reason
    # Whether a runtime narrowed the view could not be read: unknown, not a lost GPU.
    [unknown] = gpu_unusable_by_driver(replace(two, view_error="/proc/self/mountinfo: not in this root"), health, job(), Expectations())
    assert unknown.status is Status.UNKNOWN and "NVML lists 2 of the 8 GPUs" in unknown.reason
    # ... unless the count is the job step's own: Slurm's variables explain it whatever a runtime did.
    unread_view = replace(two, view_error="/proc/self/mountinfo: not in this root")
    assert list(gpu_unusable_by_driver(unread_view, health, job(environ={**step, "SLURM_STEP_GPUS": "0,1"}), Expectations())) == []
    # Nor whether this is a job step given two GPUs, when the job probe failed; the rest is judged.
    unread = Unread("job", "/proc/self/environ: not captured")
    [unknown] = gpu_unusable_by_driver(two, health, unread, Expectations())
    assert unknown.status is Status.UNKNOWN and unknown.reason.endswith("probe job: /proc/self/environ: not captured")
    assert list(gpu_unusable_by_driver(gpus, health, unread, Expectations(gpu_count=8))) == []


def test_gpu001_mig_instances_of_one_gpu_are_one_gpu_in_the_job_view(gpus: GpuFacts, health: GpuHealthFacts) -> None:
    """Slurm makes each MIG instance one GPU GRES (gpu_nvml.c) and the device cgroup opens their
    parents: a step given two 1g.10gb instances of one A100 (SLURM_STEP_GPUS=8,9) sees one GPU."""
    one_mig = replace(gpus, devices=(replace(gpus.devices[1], mig=True),))
    step = {"SLURM_JOB_ID": "5001", "SLURM_STEP_ID": "0", "SLURM_STEP_GPUS": "8,9"}
    assert list(gpu_unusable_by_driver(one_mig, health, job(environ=step), Expectations(gpu_count=8))) == []
    # Without MIG the same count is a missing GPU; with MIG, more parents than instances is too.
    whole = replace(gpus, devices=gpus.devices[1:2])
    assert [o.subject for o in gpu_unusable_by_driver(whole, health, job(environ=step), Expectations())] == ["node"]
    three = replace(gpus, devices=tuple(replace(d, mig=True) for d in gpus.devices[:3]))
    assert [o.subject for o in gpu_unusable_by_driver(three, health, job(environ=step), Expectations())] == ["node"]


def test_gpu001_lost_in_a_health_query_is_present_once(gpus: GpuFacts, health: GpuHealthFacts) -> None:
    lost_ecc = replace(health, gpus=health.gpus[:5] + (replace(health.gpus[5], volatile_error="NVML_ERROR_GPU_IS_LOST"),) + health.gpus[6:])
    (found,) = gpu_unusable_by_driver(gpus, lost_ecc, job(), Expectations())
    assert found.subject == "GPU5" and found.evidence[0].source == "nvmlDeviceGetTotalEccErrors"
    both = replace(gpus, devices=gpus.devices[:5] + (replace(gpus.devices[5], error="NVML_ERROR_GPU_IS_LOST"),) + gpus.devices[6:])
    assert [o.subject for o in gpu_unusable_by_driver(both, lost_ecc, job(), Expectations())] == ["GPU5"]


def test_gpu001_persistence_off_is_one_warning(gpus: GpuFacts, health: GpuHealthFacts) -> None:
    off = replace(health, gpus=tuple(replace(gpu, persistence=gpu.index >= 6) for gpu in health.gpus))
    (found,) = gpu_unusable_by_driver(gpus, off, job(), Expectations())
    assert found.subject == "nvidia-persistenced" and found.severity is Severity.WARNING
    assert "disabled on GPU0, GPU1, GPU2, GPU3, GPU4, GPU5 (6 of 8)" in found.evidence[0].observed and "nvidia-persistenced" in found.fix
    refused = replace(health, gpus=(replace(health.gpus[0], persistence=None, persistence_error="NVML_ERROR_NO_PERMISSION"),) + health.gpus[1:])
    (unknown,) = gpu_unusable_by_driver(gpus, refused, job(), Expectations())
    assert unknown.status is Status.UNKNOWN and "NO_PERMISSION" in unknown.reason
    unsupported = replace(health, gpus=tuple(replace(gpu, persistence=None, persistence_error="NVML_ERROR_NOT_SUPPORTED") for gpu in health.gpus))
    assert list(gpu_unusable_by_driver(gpus, unsupported, job(), Expectations())) == []


def test_gpu001_not_applicable_and_unknown(gpus: GpuFacts, health: GpuHealthFacts) -> None:
    with pytest.raises(NotApplicable):
        list(gpu_unusable_by_driver(GpuFacts((), "NVML_ERROR_LIBRARY_NOT_FOUND", "", None, (), ()), health, job(), Expectations()))
    with pytest.raises(Unknown):
        list(gpu_unusable_by_driver(replace(gpus, nvml_error="NVML_NOT_RECORDED"), health, job(), Expectations()))
    no_library = replace(gpus, nvml_error="NVML_ERROR_LIBRARY_NOT_FOUND", nvml_detail="libnvidia-ml.so.1: cannot open shared object file", devices=())
    with pytest.raises(Unknown, match="cannot ask the driver about the 8 NVIDIA GPUs"):
        list(gpu_unusable_by_driver(no_library, health, job(), Expectations()))


# DNS001 ------------------------------------------------------------------------------------
def hostname_facts(entries: list[tuple[str, str]], answers: tuple[DnsAnswer, ...] = ()) -> HostnameFacts:
    hosts = tuple(HostsEntry(address, ("gpu1",), f"/etc/hosts:{n}") for n, (address, _) in enumerate(entries, 1))
    return HostnameFacts("gpu1", hosts, answers, ())


def test_dns001_loopback_first_is_present() -> None:
    found = list(hostname_resolution_broken(hostname_facts([("127.0.1.1", ""), ("10.0.0.1", "")])))
    assert found and found[0].evidence[0].source == "/etc/hosts:1"


def test_dns001_loopback_after_routable_is_still_present() -> None:
    # glibc's getaddrinfo returns every matching /etc/hosts line and sorts IPv4 loopback ahead of
    # routable addresses (RFC 6724 rule 8; reproduced with glibc 2.36), so line order does not help.
    found = list(hostname_resolution_broken(hostname_facts([("10.0.0.1", ""), ("127.0.1.1", "")])))
    assert found and found[0].evidence[0].source == "/etc/hosts:2"
    assert list(hostname_resolution_broken(hostname_facts([("10.0.0.1", "")]))) == []


def test_dns001_dns_answers() -> None:
    good = (DnsAnswer("gpu1", "A", ("10.0.0.1",)), DnsAnswer("gpu1", "AAAA", error="NOANSWER"))
    assert list(hostname_resolution_broken(hostname_facts([], good))) == []
    missing = (DnsAnswer("gpu1", "A", error="NXDOMAIN"), DnsAnswer("gpu1", "AAAA", error="NXDOMAIN"))
    assert len(list(hostname_resolution_broken(hostname_facts([], missing)))) == 1
    dead = (DnsAnswer("gpu1", "A", error="TIMEOUT"), DnsAnswer("gpu1", "AAAA", error="TIMEOUT"))
    (unknown,) = hostname_resolution_broken(hostname_facts([], dead))
    assert unknown.status is Status.UNKNOWN and "TIMEOUT" in unknown.reason


def test_mem001_a_granted_cap_ipc_lock_lifts_the_process_limit(memlock: MemlockFacts) -> None:
    """A pod started with capabilities: add: [IPC_LOCK] keeps the runtime's 8 MiB limit, which
    ib_umem_get() and mlock(2) do not charge a CAP_IPC_LOCK holder; an administrator's full root
    shell outside a job holds the capability by being root, which says nothing of the jobs."""
    initial = "         0          0 4294967295\n"
    pod = parse_exemption("Name:\tpython\nUid:\t0\t0\t0\t0\nCapEff:\t00000000a80465fb\n", initial)
    shell = parse_exemption("Uid:\t0\t0\t0\t0\nCapEff:\t000001ffffffffff\n", initial)
    rootless = parse_exemption("Uid:\t0\t0\t0\t0\nCapEff:\t00000000a80465fb\n", "0 1000 1\n")
    assert pod is not None and pod.ipc_lock and not pod.full_root and "CAP_IPC_LOCK" in pod.evidence
    assert shell is not None and shell.full_root and rootless is not None and not rootless.ipc_lock
    assert parse_exemption("Uid:\t0\t0\t0\t0\nCapEff:\tzz\n", initial) is None
    low = replace(memlock, slurmd=None, slurmd_pid=None, slurmd_unit=None, memlock_propagated=None, slurm_conf=None,
                  process=Limit(8 << 20, 8 << 20, "/proc/self/limits"), pam_limits=())
    assert [o.subject for o in memlock_limit_too_low(replace(low, exemption=pod), job(), Expectations())] == []
    for exemption in (shell, rootless):
        assert [(o.subject, o.status) for o in memlock_limit_too_low(replace(low, exemption=exemption), job(), Expectations())] == [("process", Status.PRESENT)]
    # Whether the right is held is not known: status unread, or a capability of an unread namespace.
    # Without the capability the namespace does not matter.
    unmapped = parse_exemption("Uid:\t1001\t1001\t1001\t1001\nCapEff:\t00000000a80465fb\n", None)
    plain = parse_exemption("Uid:\t1001\t1001\t1001\t1001\nCapEff:\t0000000000000000\n", None)
    assert unmapped is not None and unmapped.ipc_lock is None and plain is not None and plain.ipc_lock is False
    for exemption in (None, unmapped):
        [found] = memlock_limit_too_low(replace(low, exemption=exemption), job(), Expectations())
        assert found.status is Status.UNKNOWN and "CAP_IPC_LOCK" in found.reason and "8 MiB" in found.reason
    assert [o.status for o in memlock_limit_too_low(replace(low, exemption=plain), job(), Expectations())] == [Status.PRESENT]
    [found] = nccl_buffsize_exceeds_pinned_memory(job(environ={"NCCL_BUFFSIZE": str(16 << 20)}), replace(low, exemption=unmapped), probe_gpudirect(NodeFS(str(EXAMPLE))))
    assert found.status is Status.UNKNOWN and "CAP_IPC_LOCK" in found.reason
    prolog = job(environ={"SLURM_SCRIPT_CONTEXT": "prolog_slurmd"})  # slurmd's rights, not the job's
    assert [o.subject for o in memlock_limit_too_low(replace(low, exemption=pod), prolog, Expectations())] == ["slurmd"]
    in_job = job(environ={"SLURM_JOB_ID": "42", "SLURM_STEP_ID": "0"})  # root's own job step: root's rights are its ranks'
    assert [o.subject for o in memlock_limit_too_low(replace(low, exemption=shell), in_job, Expectations())] == []
    big = job(environ={"NCCL_BUFFSIZE": str(16 << 20)})
    assert list(nccl_buffsize_exceeds_pinned_memory(big, replace(low, exemption=pod), probe_gpudirect(NodeFS(str(EXAMPLE))))) == []
    assert [o.subject for o in nccl_buffsize_exceeds_pinned_memory(big, replace(low, exemption=shell), probe_gpudirect(NodeFS(str(EXAMPLE))))] == ["NCCL_BUFFSIZE"]


def test_mem001_a_root_shell_outside_any_job_on_a_node_without_slurmd(memlock: MemlockFacts) -> None:
    """Root's cron audit on a Docker-only node: the jobs run in containers started with their own
    --ulimit, so root's 8 MiB is a warning that says where the jobs' limit comes from, not a
    drain; a process that is not a full root shell (a pod, a user's job) is judged as the jobs'."""
    initial = "         0          0 4294967295\n"
    shell = parse_exemption("Uid:\t0\t0\t0\t0\nCapEff:\t000001ffffffffff\n", initial)
    user = parse_exemption("Uid:\t1001\t1001\t1001\t1001\nCapEff:\t0000000000000000\n", initial)
    low = replace(memlock, slurmd=None, slurmd_pid=None, slurmd_unit=None, memlock_propagated=None, slurm_conf=None,
                  process=Limit(8 << 20, 8 << 20, "/proc/self/limits"), pam_limits=())
    [found] = memlock_limit_too_low(replace(low, exemption=shell), job(), Expectations())
    assert (found.status, found.severity) == (Status.PRESENT, Severity.WARNING) and "docker run --ulimit memlock=-1" in found.fix
    [found] = memlock_limit_too_low(replace(low, exemption=user), job(), Expectations())
    assert (found.status, found.severity) == (Status.PRESENT, None)
    # A node whose ranks mpirun or pdsh start over ssh, with limits.d giving every user unlimited
    # memlock: limits.conf(5) leaves root out of "*", so root's cron keeps the default, the users' ranks do not.
    users = (PamLimit("*", "soft", UNLIMITED, "/etc/security/limits.d/rdma.conf:1"), PamLimit("*", "hard", UNLIMITED, "/etc/security/limits.d/rdma.conf:2"))
    assert list(memlock_limit_too_low(replace(low, exemption=shell, pam_limits=users), job(), Expectations())) == []
    # The same root process in a privileged container (vLLM's multi-node recipe runs Ray with
    # --privileged): the container is where the workloads run, with its limit and its rights, and
    # CAP_IPC_LOCK lifts the limit for their registrations.
    assert list(memlock_limit_too_low(replace(low, exemption=shell, container="/.dockerenv"), job(), Expectations())) == []
    [found] = memlock_limit_too_low(replace(low, exemption=shell, container=None), job(), Expectations())
    assert found.severity is Severity.WARNING  # whether it is a container was not read: as on the host


def test_memlock_probe_looks_for_a_container_only_for_a_full_root_process_without_slurmd(node_copy: Path) -> None:
    """The container marker matters only to a full-root process on a node where no slurmd gives
    jobs their limit: every Slurm prolog runs as full root and never needs it."""
    status = node_copy / "proc/self/status"
    status.write_text("Name:\tpython\nUid:\t0\t0\t0\t0\nCapEff:\t000001ffffffffff\n")
    (node_copy / "proc/self/uid_map").write_text("         0          0 4294967295\n")
    (node_copy / ".dockerenv").write_text("")
    facts = probe_memlock(NodeFS(str(node_copy)))
    assert (facts.slurmd is not None or facts.slurmd_unit is not None) and facts.container == ""  # a Slurm node: not asked
    (node_copy / "run/slurmd.pid").unlink(missing_ok=True)
    for unit in node_copy.rglob("slurmd.service"):
        unit.unlink()
    for pid in (node_copy / "proc").iterdir():
        if (pid / "comm").is_file() and (pid / "comm").read_text().strip() == "slurmd":
            (pid / "comm").write_text("sleep\n")
    facts = probe_memlock(NodeFS(str(node_copy)))
    assert facts.slurmd is None and facts.slurmd_unit is None and facts.container == "/.dockerenv"
    (node_copy / ".dockerenv").unlink()
    assert probe_memlock(NodeFS(str(node_copy))).container == ""
    (node_copy / "etc/hosts").write_text("# Kubernetes-managed hosts file.\n127.0.0.1\tlocalhost\n")
    assert probe_memlock(NodeFS(str(node_copy))).container == "/etc/hosts (kubelet's)"
    status.write_text("Name:\tpython\nUid:\t1001\t1001\t1001\t1001\nCapEff:\t0000000000000000\n")
    assert probe_memlock(NodeFS(str(node_copy))).container == ""  # not full root: not asked


def test_container_marker_unread_is_unknown_not_none(tmp_path: Path) -> None:
    """Missing is not empty: an /etc/hosts that cannot be read leaves "in a container" unknown."""
    from preflight.probing import FactReader, container_marker

    (tmp_path / "etc/hosts").mkdir(parents=True)  # not a file: read fails
    reader = FactReader(NodeFS(str(tmp_path)))
    assert container_marker(reader) is None and reader.problems
    (tmp_path / "etc/hosts").rmdir()
    assert container_marker(FactReader(NodeFS(str(tmp_path)))) == ""  # absent: a host's
