"""GPUDirect RDMA, GDRCopy and the BAR1 window peers map (GDR references)."""

from __future__ import annotations

import re
import stat as stat_codes
from typing import TYPE_CHECKING, NamedTuple

from preflight.model import (
    NOT_GIVEN,
    Evidence,
    NotApplicable,
    Observation,
    Severity,
    Status,
    Unknown,
    Unread,
    present,
    undecided,
)
from preflight.nccl.gdr import DEFAULT_GDR_LEVEL, PATH_RANK, gdr_level, within
from preflight.nccl.gid import nccl_int
from preflight.nccl.ib import plugin_transport, sockets_only
from preflight.nccl.releases import GDRCOPY_NEEDS_GDRDRV, PEERMEM_DETECTION, affected, bypassed_fix, release_evidence
from preflight.probes.bar1 import MOSTLY_MAPPED
from preflight.probes.gpudirect import (
    NVIDIA_PEERMEM_VERSION,
    GpuDirectFacts,
    access_decided,
    membership_unknown,
)
from preflight.probes.rdma import IB_CLASS
from preflight.registry import check
from preflight.sources.nvml import UNANSWERED
from preflight.units import format_size

if TYPE_CHECKING:
    from collections.abc import Iterator

    from preflight.probes.bar1 import Bar1, Bar1Facts
    from preflight.probes.gpus import GpuFacts
    from preflight.probes.job import JobFacts
    from preflight.probes.nccl_libs import NcclCopy, NcclLibFacts
    from preflight.probes.pcie import PcieFacts
    from preflight.probes.rdma import RdmaDevice, RdmaFacts

SMALL_BAR1 = 256 << 20  # the legacy window consumer boards keep with Resizable BAR off


_UNIFIED_MEMORY = ("GH200", "GB10", "GB200", "GB300")


@check("GDR003", profiles=("prolog",))
def peermem_gpu_mapping_rejected(bar1: Bar1Facts, gpus: GpuFacts, rdma: RdmaFacts) -> Iterator[Observation]:
    """BAR1 too small for GPUDirect RDMA, or mostly mapped before the job starts, on a node whose
    RDMA NICs map GPU memory through it."""
    # BAR1 is the window a NIC reaches GPU memory through (peer memory or DMA-BUF): without a data
    # RDMA device nothing maps it for the network, and a 256 MiB BAR1 (T4, Quadro, GeForce
    # without Resizable BAR) is no fault. Real nvidia-smi dumps of such GPUs showed the check
    # draining healthy inference nodes (tests/data/real-nvml).
    unread_rdma = rdma.class_unread
    if not unread_rdma and not rdma.data_devices:
        raise NotApplicable(f"no RDMA devices in {IB_CLASS}: no NIC maps GPU memory through BAR1 here")
    for observation in _bar1_observations(bar1, gpus):
        if observation.status is Status.PRESENT and unread_rdma:
            shown = "; ".join(e.observed for e in observation.evidence)
            yield undecided(observation.subject, f"{shown}, which matters only where an RDMA NIC maps GPU memory, and {unread_rdma}")
        else:
            yield observation


def _bar1_observations(bar1: Bar1Facts, gpus: GpuFacts) -> Iterator[Observation]:
    """Each GPU whose BAR1 is too small or mostly mapped, or unread."""
    if bar1.nvml_error in UNANSWERED:  # no recording, or a broken one
        raise Unknown(f"no NVML answers recorded for this root ({bar1.nvml_error})")
    on_bus = len(gpus.pci_gpus)
    if bar1.nvml_error:
        if on_bus:
            raise Unknown(f"NVML unavailable ({bar1.nvml_error}): BAR1 of the {on_bus} GPUs on the PCI bus cannot be read")
        raise NotApplicable(f"no NVIDIA GPUs (NVML: {bar1.nvml_error})")
    if not bar1.gpus:
        if on_bus:
            raise Unknown(f"NVML lists no GPUs, but {on_bus} are on the PCI bus (GPU001)")
        raise NotApplicable("no NVIDIA GPUs")
    if all(gpu.error == "NVML_ERROR_NOT_SUPPORTED" and _unified(gpu) for gpu in bar1.gpus):
        raise NotApplicable("unified-memory GPUs: NICs reach their memory without BAR1")
    for gpu in bar1.gpus:
        subject = f"GPU{gpu.index}"
        source = "nvmlDeviceGetBAR1MemoryInfo"
        if gpu.error == "NVML_ERROR_NOT_SUPPORTED" and _unified(gpu):
            continue
        if gpu.error or gpu.total is None:
            if gpu.error in UNANSWERED:  # a recording without the call says nothing of the window
                yield undecided(subject, f"its BAR1 is not in the NVML answers recorded for this root ({gpu.error})")
            elif gpu.aperture is not None and gpu.aperture <= SMALL_BAR1:
                # The same window NVML would have reported, so the same warning as below.
                aperture = Evidence(f"/sys/bus/pci/devices/{gpu.bus_id}/resource", f"BAR1 aperture {format_size(gpu.aperture)}", "more than 256 MiB")
                yield present(subject, aperture, severity=Severity.WARNING, fix=SMALL_BAR1_FIX)
            elif gpu.error == "NVML_ERROR_NO_PERMISSION" and gpu.index in gpus.mig_indices:
                # nvml.h: in MIG mode the parent's handle answers the aggregate only to a privileged
                # caller; each instance's BAR1 is asked through its own MIG handle.
                yield undecided(subject, "the GPU is in MIG mode, where NVML reports the parent GPU's aggregate BAR1 only to a "
                                         "privileged caller (NVML_ERROR_NO_PERMISSION); its instances' BAR1 is not read here")
            else:
                yield undecided(subject, f"NVML does not report BAR1 for a GPU that has one ({gpu.error or 'no size'})")
            continue
        if gpu.total <= SMALL_BAR1:
            evidence = [Evidence(source, f"bar1Total {format_size(gpu.total)} ({gpu.name or 'GPU'})", "more than 256 MiB: large BAR enabled")]
            if gpu.aperture is not None:
                evidence.append(Evidence(f"/sys/bus/pci/devices/{gpu.bus_id}/resource", f"aperture {format_size(gpu.aperture)}"))
            # A warning: registrations fit until a job's buffers outgrow the window, which depends
            # on its scale, and some boards (T4) have no larger BAR1 to enable.
            yield present(subject, *evidence, severity=Severity.WARNING, fix=SMALL_BAR1_FIX)
        elif gpu.used is not None and gpu.used > gpu.total * MOSTLY_MAPPED:
            yield _mostly_mapped(subject, gpu, Evidence(source, f"bar1Used {format_size(gpu.used)} of {format_size(gpu.total)}",
                                                        f"at most {int(MOSTLY_MAPPED * 100)}% mapped on an idle GPU"))


SMALL_BAR1_FIX = (
    "NICs reach this GPU's memory through a 256 MiB window, which many communicators or large "
    "NCCL_BUFFSIZE values outgrow (ibv_reg_mr then fails). Enable large BAR where the board and BIOS "
    "allow it ('Above 4G decoding', 'Re-Size BAR support'); where they do not (T4), keep NCCL's buffers "
    "at their defaults, or keep GPUDirect RDMA off for such nodes (NCCL_NET_GDR_LEVEL=LOC)."
)


def _mostly_mapped(subject: str, gpu: Bar1, usage: Evidence) -> Observation:
    """Mappings left behind, when the GPU runs nothing. A GPU running work has its buffers mapped
    (a health check runs beside jobs), so there the share is no fault of the node: a warning-level
    unknown, which never drains, says what runs (a stray process, when a prolog finds one)."""
    if gpu.processes == 0:
        return present(subject, usage, Evidence("nvmlDeviceGetComputeRunningProcesses", "no compute process on the GPU"))
    if gpu.processes is None:
        why = f"whether the GPU is idle is unread ({gpu.processes_error})"
    else:
        why = f"{gpu.processes} compute process(es) run on the GPU, whose buffers are mapped through BAR1"
    return Observation(subject, (usage,), Severity.WARNING, status=Status.UNKNOWN, reason=f"{usage.observed}, but {why}")


def _unified(gpu: Bar1) -> bool:
    return any(model in (gpu.name or "") for model in _UNIFIED_MEMORY)


DMABUF_MIN_KERNEL = (5, 12)


def parse_kernel_version(release: str) -> tuple[int, int] | None:
    """``"5.15.0-105-generic"`` -> ``(5, 15)``."""
    match = re.match(r"(\d+)\.(\d+)", release.strip())
    return (int(match.group(1)), int(match.group(2))) if match else None


def dmabuf_capable(gpudirect: GpuDirectFacts) -> bool | None:
    """Whether the node's kernel and NVIDIA driver can export GPU memory as DMA-BUF: open kernel
    modules on Linux 5.12 or newer. None while the one fact that would decide it is unread."""
    kernel = parse_kernel_version(gpudirect.kernel_release or "")
    if gpudirect.driver_flavour == "proprietary" or (kernel is not None and kernel < DMABUF_MIN_KERNEL):
        return False
    if kernel is None or gpudirect.driver_flavour is None:
        return None
    return True


def dmabuf_unread(gpudirect: GpuDirectFacts) -> list[str]:
    """The files whose missing or unparseable facts leave :func:`dmabuf_capable` undecided."""
    kernel = parse_kernel_version(gpudirect.kernel_release or "")
    return [path for path, value in (("/proc/sys/kernel/osrelease", kernel), ("/proc/driver/nvidia/version", gpudirect.driver_flavour)) if value is None]


def dmabuf_evidence(gpudirect: GpuDirectFacts) -> Evidence:
    return Evidence(
        "/proc/driver/nvidia/version",
        f"{gpudirect.driver_flavour or 'unknown'} kernel modules, kernel {gpudirect.kernel_release or 'unknown'}",
        "open kernel modules and Linux >= 5.12 for the DMA-BUF path",
    )


def _require_nvidia(gpudirect: GpuDirectFacts) -> None:
    if gpudirect.nvidia_loaded is None:
        raise Unknown(f"whether the NVIDIA driver is loaded: {gpudirect.why('/sys/module/nvidia')}")
    if not gpudirect.nvidia_loaded:
        raise NotApplicable("the NVIDIA kernel driver is not loaded (/sys/module/nvidia is absent)")


def _efa_gpu_memory(devices: list[RdmaDevice], gpudirect: GpuDirectFacts) -> Iterator[Observation]:
    """EFA devices: Amazon's efa.ko maps GPU memory through its own provider (nvidia_p2p_* or
    efa_nv_peermem, amzn-drivers efa_p2p.c), never through ib_core's peer-memory clients, and
    names the provider it can use in device/p2p."""
    providers = {device.name: device.efa_gpu_memory for device in devices}
    if any(provider and provider.startswith("NVIDIA") for provider in providers.values()):
        return
    if all(provider is not None for provider in providers.values()):
        name, provider = next(iter(providers.items()))
        yield present(
            "node",
            Evidence(f"{IB_CLASS}/{name}/device/p2p", provider or "empty (no provider available)", "NVIDIA or NVIDIA peermem"),
            fix="efa.ko finds no NVIDIA GPU-memory provider: check that the nvidia module is loaded and that the efa "
            "driver of the AWS EFA installer (built with GPUDirect support) is the one loaded; "
            f"'cat {IB_CLASS}/*/device/p2p' should name NVIDIA.",
        )
        return
    if dmabuf_capable(gpudirect):
        return
    unnamed = next(name for name, provider in providers.items() if provider is None)
    raise Unknown(
        f"{unnamed} is an EFA device without efa.ko's device/p2p or device/gdr (the kernel's own efa driver, or not "
        "readable): whether it maps GPU memory is not read here"
    )


def _gdr_out_of_reach(pcie: PcieFacts | Unread, job: JobFacts | Unread) -> Evidence | None:
    """Why NCCL would not use GPUDirect RDMA on this node whatever the driver offers: on bare metal,
    every GPU's path to every RDMA NIC is farther than NCCL_NET_GDR_LEVEL (PXB by default: the GPU
    and the NIC under one PCIe switch; ncclTopoCheckGdr in src/graph/paths.cc), as on PCIe servers
    with one NIC on its own root port. None where a path may be near enough: a guest's emulated
    bridges or an NCCL_TOPO_FILE (a cloud VM's) decide instead, a Grace GPU's C2C path may count,
    a path is unplaced, or the facts are unread."""
    if isinstance(pcie, Unread) or isinstance(job, Unread) or pcie.hypervisor is not False or pcie.arm_cpu:
        return None
    if not pcie.gpus or not pcie.nics or job.nccl("NCCL_TOPO_FILE") is not None:
        return None
    setting = job.nccl("NCCL_NET_GDR_LEVEL")
    level = gdr_level(setting.value if setting else None) or DEFAULT_GDR_LEVEL
    paths = {pcie.path(gpu.bdf, nic.bdf) for gpu in pcie.gpus for nic in pcie.nics}
    if not paths <= set(PATH_RANK) or any(within(kind, level) for kind in paths if kind):
        return None
    nearest = min((kind for kind in paths if kind), key=PATH_RANK.__getitem__)
    return Evidence(
        "/sys/bus/pci/devices", f"nearest GPU-NIC path {nearest}, beyond NCCL_NET_GDR_LEVEL {level}{'' if setting else ' (the default)'}",
        "GPUs and NICs under one PCIe switch, where NCCL uses GPUDirect RDMA",
    )


#: GDR001's old-NCCL case as a prolog sees it: the job's LD_LIBRARY_PATH, which may bring a network
#: plugin that tests GPUDirect RDMA itself, is out of its sight.
UNSEEN_PLUGIN = Evidence(
    "job environment", "not visible to a script slurmd runs (prolog, epilog)",
    "no network plugin on the job's LD_LIBRARY_PATH: a job that loads HPC-X's nccl-rdma-sharp-plugins (which accepts "
    "nvidia_peermem since its update for NCCL 2.23.4) keeps GPUDirect RDMA",
)


@check("GDR001", profiles=("prolog",), optional=("job", "pcie"))
def gpudirect_rdma_unavailable(
    gpudirect: GpuDirectFacts, rdma: RdmaFacts, job: JobFacts | Unread, nccl_libs: NcclLibFacts, pcie: PcieFacts | Unread = NOT_GIVEN
) -> Iterator[Observation]:
    """Neither the peer-memory nor the DMA-BUF path to GPUDirect RDMA is available, or only
    nvidia_peermem is, which NCCL before 2.23.4 does not look for (unknown where a network plugin,
    which tests GPUDirect itself, carries the traffic). EFA devices are judged by
    efa.ko's own GPU-memory provider."""
    _require_nvidia(gpudirect)
    if gpudirect.rdma_devices is None:
        raise Unknown(gpudirect.why("/sys/class/infiniband"))
    if not gpudirect.rdma_devices:
        raise NotApplicable("no RDMA devices in /sys/class/infiniband")
    if rdma.devices and not rdma.data_devices and not rdma.class_unread:
        # HGX B200's NVSwitch management functions (SMDL=SW_MNG in device/vpd) are RDMA devices
        # that carry no job traffic: no NIC here maps GPU memory (as GDR003 and IB007 read them).
        raise NotApplicable(f"the RDMA devices are NVSwitch management functions only ({', '.join(d.name for d in rdma.devices[:4])})")
    efa = [device for device in rdma.devices if device.efa]
    if efa and set(gpudirect.rdma_devices) <= {device.name for device in efa}:
        yield from _efa_gpu_memory(efa, gpudirect)
        return
    peer_clients = [path for path in gpudirect.peer_memory_files if path != NVIDIA_PEERMEM_VERSION]
    if peer_clients or gpudirect.nv_peer_mem_loaded:
        return  # every NCCL release finds a memory_peers client
    if isinstance(job, Unread):  # NCCL_DMABUF_ENABLE unread: it matters only where DMA-BUF could work
        if dmabuf_capable(gpudirect) is not False:
            raise Unknown(f"no peer-memory client; whether NCCL_DMABUF_ENABLE keeps the DMA-BUF path is unread ({job})")
        dmabuf_setting = None
    else:
        dmabuf_setting = job.nccl("NCCL_DMABUF_ENABLE")
    # NCCL reads it with strtoll and turns DMA-BUF off only at 0 ("false" and "0 # off" read as 0):
    # dmaBufSupported in src/init.cc, v2.19.3-1 to v2.30.7-1.
    dmabuf_disabled = dmabuf_setting is not None and nccl_int(dmabuf_setting.value, 1) == 0
    if dmabuf_capable(gpudirect) and not dmabuf_disabled:
        return
    unread = [*gpudirect.peer_memory_unknown, *(["/sys/module/nv_peer_mem"] if gpudirect.nv_peer_mem_loaded is None else [])]
    if not dmabuf_disabled:
        unread += dmabuf_unread(gpudirect)
    if unread:
        raise Unknown(f"neither GPUDirect path is confirmed, and {gpudirect.why(unread[0])}")
    dmabuf = dmabuf_evidence(gpudirect)
    dmabuf_off = [Evidence(f"{dmabuf_setting.origin} NCCL_DMABUF_ENABLE", dmabuf_setting.value, "unset or 1")] if dmabuf_disabled and dmabuf_setting else []
    sockets = sockets_only(job, nccl_libs)
    if NVIDIA_PEERMEM_VERSION in gpudirect.peer_memory_files:
        if sockets:
            return  # NCCL's sockets carry the data: its own GPUDirect test never runs
        old, unnamed = affected(nccl_libs, PEERMEM_DETECTION)
        loaded = Evidence(NVIDIA_PEERMEM_VERSION, "present, but no /sys/kernel/mm/memory_peers client", "a memory_peers client (nv_mem), or NCCL 2.23.4 or newer")
        plugin = plugin_transport(job, nccl_libs)
        for copy in old:
            if copy.bypassed:
                yield present(copy.path, release_evidence(copy, PEERMEM_DETECTION), loaded, severity=Severity.INFO, fix=bypassed_fix(copy))
            elif plugin:
                yield undecided(
                    copy.path,
                    f"NCCL {copy.version}'s own InfiniBand transport would report GPUDirect RDMA disabled, but NCCL loads the "
                    f"network plugin {plugin}, whose own test decides (nccl-rdma-sharp-plugins accepts nvidia_peermem "
                    "since its update for NCCL 2.23.4; older builds do not)",
                    loaded,
                )
            elif not isinstance(job, Unread) and job.in_slurmd_script:
                # A prolog sees slurmd's environment, not the job's: a job that loads HPC-X puts
                # its network plugin on LD_LIBRARY_PATH, and that plugin accepts nvidia_peermem.
                yield present(copy.path, release_evidence(copy, PEERMEM_DETECTION), loaded, dmabuf, *dmabuf_off, UNSEEN_PLUGIN,
                              severity=Severity.WARNING)
            else:
                yield present(copy.path, release_evidence(copy, PEERMEM_DETECTION), loaded, dmabuf, *dmabuf_off)
        for copy in unnamed:
            yield undecided(copy.path, f"the NCCL release of {copy.path} is not named by its file or wheel", loaded)
        return
    # Where no GPU sits near enough a NIC for NCCL to use GPUDirect RDMA, or NCCL's sockets carry
    # the data (NCCL_IB_DISABLE=1 on Ethernet nodes whose ConnectX still shows an RDMA device),
    # nothing of NCCL's is lost now; a warning, since other settings or software would need it.
    far = _gdr_out_of_reach(pcie, job)
    if sockets and far is None:
        far = Evidence("NCCL", sockets, "NCCL's IB transport or a network plugin, which use GPUDirect RDMA")
    yield present(
        "node",
        Evidence("/sys/module/nvidia_peermem", "not loaded", "loaded (modprobe nvidia-peermem)"),
        Evidence("/sys/kernel/mm/memory_peers", "no nv_mem/nv_mem_nc peer client", "present with MLNX_OFED nv_peer_mem"),
        dmabuf,
        *dmabuf_off,
        *([far] if far else []),
        severity=Severity.WARNING if far else None,
    )


def _gdrcopy_lost(subject: str, *evidence: Evidence) -> Observation:
    # A warning, whatever the reference's severity: when gdr_open fails NCCL keeps a NULL handle
    # and runs on without GDRCopy (initGdrCopy returns success, every GDRCopy path tests the
    # handle; src/init.cc, 2.12-2.30), so the job loses speed, not its start. What fails a job is
    # a pin the driver cannot place in BAR1, which no node fact here predicts.
    return present(subject, *evidence, severity=Severity.WARNING)


#: NCCL_GDRCOPY_USE_INTERNAL_DMABUF (NCCL 2.31.2+): 1 demands NCCL's own DMA-BUF mapping and fails
#: ncclInit without it, 2 prefers it and runs on without GDRCopy when it is missing; both skip
#: libgdrapi, so gdrdrv does not matter. Any other value keeps libgdrapi first.
INTERNAL_DMABUF_REQUIRED, INTERNAL_DMABUF_PREFERRED = "1", "2"
#: NCCL's own DMA-BUF mapping starts only on a driver for CUDA 13.3 or newer (ncclGdrDmaBufSupported,
#: src/misc/gdrwrap.cc), in NVML's encoding of nvmlSystemGetCudaDriverVersion_v2.
CUDA_FOR_DMABUF_MAPPING = 13030


class DmabufMapping(NamedTuple):  # a dataclass would import inspect and ast on the prolog's path
    """Whether NCCL's own DMA-BUF mapping can start on this node, and the facts that say so."""

    works: bool | None  # None: a fact that decides it is unread
    evidence: tuple[Evidence, ...]
    unread: str  # why ``works`` is None


def dmabuf_mapping(gpudirect: GpuDirectFacts, gpus: GpuFacts) -> DmabufMapping:
    """NCCL's mapping needs the kernel and modules to export DMA-BUF and a CUDA 13.3+ driver. Every
    GPU must also report DMA-BUF support, which only CUDA can tell; the open modules on a supported
    kernel are what the node shows of it."""
    capable = dmabuf_capable(gpudirect)
    cuda = gpus.cuda_driver_version
    cuda_text = f"{cuda // 1000}.{cuda % 1000 // 10}" if cuda is not None else f"not read ({gpus.cuda_driver_error or 'no answer'})"
    evidence = (
        dmabuf_evidence(gpudirect),
        Evidence("nvmlSystemGetCudaDriverVersion_v2", f"CUDA {cuda_text}", "CUDA 13.3 or newer for NCCL's own DMA-BUF mapping"),
    )
    if capable is False or (cuda is not None and cuda < CUDA_FOR_DMABUF_MAPPING):
        return DmabufMapping(False, evidence, "")
    if capable is None:
        return DmabufMapping(None, evidence, gpudirect.why(dmabuf_unread(gpudirect)[0]))
    if cuda is None:
        return DmabufMapping(None, evidence, f"nvmlSystemGetCudaDriverVersion_v2: {gpus.cuda_driver_error or 'no answer'}")
    return DmabufMapping(True, evidence, "")


@check("GDR002", profiles=("prolog",))
def gdrcopy_driver_unusable(gpudirect: GpuDirectFacts, job: JobFacts, nccl_libs: NcclLibFacts, gpus: GpuFacts) -> Iterator[Observation]:
    """The job asks NCCL for GDRCopy, but the gdrdrv driver or its device node is unusable and the
    node's NCCL has no working stand-in for it, or the job demands NCCL's own DMA-BUF mapping on a
    node where it cannot start."""
    _require_nvidia(gpudirect)
    setting = job.nccl("NCCL_GDRCOPY_ENABLE")
    if setting is None:
        raise job.nothing_to_judge("NCCL_GDRCOPY_ENABLE", "NCCL's default 0: GDRCopy is not loaded")
    if nccl_int(setting.value, 0) != 1:
        # initGdrCopy loads GDRCopy only when the value reads as exactly 1 (strtoll: "true" is 0,
        # "2" is 2), src/init.cc v2.12.12-1 to v2.30.7-1: the setting keeps it off.
        return
    requested = Evidence(f"{setting.origin} NCCL_GDRCOPY_ENABLE", setting.value)
    backend = job.nccl("NCCL_GDRCOPY_USE_INTERNAL_DMABUF")
    choice = backend.value.strip() if backend is not None else ""
    older, unnamed = affected(nccl_libs, GDRCOPY_NEEDS_GDRDRV)
    newer = [copy for copy in nccl_libs.copies if copy not in older and copy not in unnamed]
    mapping = dmabuf_mapping(gpudirect, gpus) if newer else None
    if backend is not None and choice in (INTERNAL_DMABUF_REQUIRED, INTERNAL_DMABUF_PREFERRED) and mapping is not None:
        chosen = Evidence(f"{backend.origin} NCCL_GDRCOPY_USE_INTERNAL_DMABUF", backend.value)
        yield from _mapping_unavailable(mapping, newer, choice == INTERNAL_DMABUF_REQUIRED, requested, chosen)
    only_newer = bool(newer) and not older and not unnamed
    if only_newer and choice in (INTERNAL_DMABUF_REQUIRED, INTERNAL_DMABUF_PREFERRED):
        return  # every NCCL on the node skips libgdrapi: gdrdrv is not used
    if only_newer and mapping is not None and mapping.works:
        return  # whatever gdrdrv does, NCCL maps GPU memory itself when gdr_open fails
    # A release that falls back to DMA-BUF when gdr_open fails says so in the evidence, with why
    # the fallback cannot be counted on here.
    fallback = [Evidence(copy.path, f"NCCL {copy.version}: maps GPU memory through DMA-BUF when gdr_open fails", "gdrdrv usable, or the DMA-BUF mapping's conditions met") for copy in newer]
    yield from _gdrdrv_unusable(gpudirect, requested, *fallback, *(mapping.evidence if mapping else ()))


def _mapping_unavailable(mapping: DmabufMapping, copies: list[NcclCopy], required: bool, *settings: Evidence) -> Iterator[Observation]:
    """NCCL_GDRCOPY_USE_INTERNAL_DMABUF=1 or 2 where NCCL's mapping cannot start. With 1 ncclInit
    fails ("... NCCL internal DMA-BUF mmap backend could not initialize", ncclSystemError); with 2
    NCCL runs on without GDRCopy, the slower path an unusable gdrdrv leads to."""
    for copy in copies:
        if mapping.works is None:
            yield undecided(copy.path, f"whether NCCL's DMA-BUF mapping can start: {mapping.unread}", *settings)
        elif not mapping.works and required:
            evidence = Evidence(copy.path, f"NCCL {copy.version}: fails its init without its DMA-BUF mapping")
            yield present(copy.path, *settings, evidence, *mapping.evidence, severity=Severity.ERROR)
        elif not mapping.works:
            evidence = Evidence(copy.path, f"NCCL {copy.version}: runs without GDRCopy, gdrdrv not tried")
            yield _gdrcopy_lost(copy.path, *settings, evidence, *mapping.evidence)


def _gdrdrv_unusable(gpudirect: GpuDirectFacts, requested: Evidence, *fallback: Evidence) -> Iterator[Observation]:
    if gpudirect.gdrdrv_loaded is None:
        yield undecided("gdrdrv", gpudirect.why("/sys/module/gdrdrv"), requested)
        return
    if not gpudirect.gdrdrv_loaded:
        yield _gdrcopy_lost("gdrdrv", requested, Evidence("/sys/module/gdrdrv", "not loaded", "loaded"), *fallback)
        return
    node = gpudirect.gdrdrv_node
    unreadable_node = next((p for p in gpudirect.problems if p.startswith("/dev/gdrdrv: ")), None)
    if node is None and unreadable_node:
        yield undecided("/dev/gdrdrv", unreadable_node, requested)
        return
    if node is None or not stat_codes.S_ISCHR(node.mode):
        observed = "missing" if node is None else "not a character device"
        yield _gdrcopy_lost("/dev/gdrdrv", requested, Evidence("/dev/gdrdrv", observed, "character device"), *fallback)
        return
    identity = gpudirect.job_identity
    if identity is None:
        yield undecided("/dev/gdrdrv", f"who the job runs as is unknown: {gpudirect.why('/proc/self/status')}", requested)
        return
    access = access_decided(node, identity)
    if access is None:
        yield undecided("/dev/gdrdrv", membership_unknown(node, identity), requested)
    elif not access:
        yield _gdrcopy_lost(
            "/dev/gdrdrv",
            requested,
            Evidence(
                "/dev/gdrdrv",
                f"mode {stat_codes.filemode(node.mode)} owner {node.uid}:{node.gid}",
                f"read-write for uid {identity.uid} (groups {','.join(map(str, identity.gids)) or 'none'})",
            ),
            *fallback,
        )
