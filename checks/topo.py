"""Topology NCCL sees: NIC fusion, topology files and GPU-NIC affinity (TOPO references)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from preflight.model import (
    NOT_GIVEN,
    Evidence,
    NotApplicable,
    Observation,
    Severity,
    Unknown,
    Unread,
    present,
    undecided,
)
from preflight.nccl.nvls import nvls_ruled_out
from preflight.nccl.releases import release_findings
from preflight.probes.job import switched_off
from preflight.registry import check

if TYPE_CHECKING:  # imported where a topology file is parsed: most nodes have none
    from collections.abc import Iterator

    from preflight.probes.job import JobFacts
    from preflight.probes.nccl_libs import NcclLibFacts
    from preflight.probes.p2p import P2pFacts
    from preflight.probes.topo_file import TopoFileFacts
    pass
from preflight.nccl.gdr import DEFAULT_GDR_LEVEL, gdr_level, within
from preflight.nccl.ib import FUSION_SINCE, data_direct_gpus, nccl_selection, parse_force_merge, sockets_only
from preflight.nccl.releases import (
    NVLS_SEARCH,
    PCI_SPEED_DETECTION,
    affected,
    require_nccl,
    version_tuple,
)
from preflight.probes.nccl_platform import NcclPlatformFacts
from preflight.probes.pcie import PcieFacts, unclassified_reason
from preflight.probes.rdma import RdmaFacts, require_rdma


@check("TOPO003", profiles=("full",), optional=("p2p",))
def nccl_topology_search_regression(
    nccl_libs: NcclLibFacts, nccl_platform: NcclPlatformFacts, rdma: RdmaFacts, job: JobFacts,
    p2p: P2pFacts | Unread = NOT_GIVEN,
) -> Iterator[Observation]:
    """NCCL 2.18.3-2.19.3 where its known topology regressions apply: the NVLS search crash on
    NVSwitch nodes of Hopper or later GPUs with network devices (before 2.18.5), and run-to-run
    differences where sysfs has no PCI link speed for a GPU (before 2.19.4)."""
    require_nccl(nccl_libs)
    rdma_unread = rdma.class_unread
    # An A100 board has NVSwitches too, but NCCL never runs the NVLS search below Hopper.
    nvls_search = bool(nccl_platform.nvswitches) and nvls_ruled_out(p2p) is None
    if nvls_search and rdma_unread and any(affected(nccl_libs, NVLS_SEARCH)):
        yield undecided("node", f"NVSwitches present, but whether RDMA devices are: {rdma_unread}")
    if nvls_search and rdma.devices and not switched_off(job, "NCCL_NVLS_ENABLE"):
        yield from release_findings(
            nccl_libs, NVLS_SEARCH,
            Evidence("/sys/bus/pci/devices", f"{len(nccl_platform.nvswitches)} NVSwitches (NVLS) and {len(rdma.devices)} RDMA devices"),
        )
    at_risk = any(part for bug in (NVLS_SEARCH, PCI_SPEED_DETECTION) for part in affected(nccl_libs, bug))
    if at_risk and nccl_platform.unclassified and not (nccl_platform.nvswitches and nccl_platform.pci_gpus):
        # an unreadable function may be the NVSwitch or the GPU without a link speed
        yield undecided("node", f"{len(nccl_platform.unclassified)} PCI function(s) could not be classified "
                                f"(vendor or class unreadable), e.g. {nccl_platform.unclassified[0]}")
    missing = nccl_platform.gpus_without_link_speed
    speed_risk = any(affected(nccl_libs, PCI_SPEED_DETECTION))
    # A topology file replaces sysfs detection; asked only where some copy could carry the bug.
    if missing and speed_risk and job.nccl("NCCL_TOPO_FILE") is None:
        yield from release_findings(
            nccl_libs, PCI_SPEED_DETECTION,
            Evidence("/sys/bus/pci/devices/*/max_link_speed", f"missing for GPU {', '.join(missing)} or its parent bridge", "readable (or an NCCL_TOPO_FILE)"),
        )


@check("TOPO005", profiles=("prolog",), optional=("nccl_libs",))
def gpu_hca_cross_numa_gdr(pcie: PcieFacts, job: JobFacts, nccl_libs: NcclLibFacts | Unread = NOT_GIVEN) -> Iterator[Observation]:
    """A GPU whose nearest RDMA NIC is on another NUMA node (NCCL's SYS: another socket, or another
    sub-NUMA cluster of one), or GPUDirect RDMA forced across the CPU; not where NCCL's sockets
    carry the data, which use no GPUDirect RDMA."""
    sockets = sockets_only(job, nccl_libs)
    if sockets:
        raise NotApplicable(sockets)
    unclassified = unclassified_reason(pcie)
    if not pcie.gpus or not pcie.nics:
        if unclassified:
            raise Unknown(unclassified)
        raise NotApplicable("needs NVIDIA GPUs and RDMA NICs on this node")
    if unclassified:
        yield undecided("PCI devices", unclassified)
    setting = job.nccl("NCCL_NET_GDR_LEVEL")
    # Read as ncclGetLevel reads it: exact path names (strcmp, so "phb" is ignored) or old numbers.
    forced = gdr_level(setting.value) if setting else None
    data_direct = data_direct_gpus(pcie, job)
    for gpu, nic, distance in pcie.nearest_nic:
        if gpu in data_direct:
            continue  # NCCL places the NIC at the Data Direct function in this GPU's own switch
        if distance == "UNKNOWN":
            yield undecided(f"GPU {gpu}", f"numa_node of GPU {gpu} or NIC {nic} is not reported on this node of several NUMA nodes with CPUs")
        elif distance == "SYS":
            yield present(
                f"GPU {gpu}",
                Evidence(f"/sys/bus/pci/devices/{gpu}/numa_node", f"nearest RDMA NIC {nic} is {distance} (on another NUMA node: another socket, or "
                         "another sub-NUMA cluster of one, which NCCL joins by SYS too, so GPUDirect RDMA is off)",
                         "a NIC under the GPU's own PCIe switch or root complex"),
            )
        elif setting and forced and within(distance, forced) and not within(distance, DEFAULT_GDR_LEVEL):
            if distance == "PHB" and pcie.arm_cpu:
                # A Grace GPU reaches its socket over NVLink-C2C: NCCL classes that path P2C and,
                # from 2.27 (NCCL_NET_GDR_C2C), uses GPUDirect RDMA over it by default; forcing PHB
                # is what older NCCL needs there. Its memory as CPU-less NUMA nodes shows C2C; the
                # driver's own management of that memory (NVreg_CoherentGPUMemoryMode=driver, as
                # Azure's GB200 image sets) shows none, so no such nodes proves nothing.
                if pcie.memory_only_nodes is None:
                    yield undecided(f"GPU {gpu}", "an Arm host whose NUMA nodes with CPUs could not be read: whether the GPU "
                                                  "attaches over NVLink-C2C (a path NCCL classes P2C) is not known")
                elif pcie.memory_only_nodes == 0:
                    yield undecided(f"GPU {gpu}", "an Arm host: a Grace GPU reaches its CPU over NVLink-C2C (a path NCCL classes P2C, "
                                                  "where forcing PHB is right), and one whose memory the driver manages shows no "
                                                  "NUMA node of its own, so whether this GPU attaches that way is not known")
                continue
            hidden = _switches_hidden(pcie, gpu, nic)
            if hidden and job.nccl("NCCL_TOPO_FILE") is not None:
                continue  # NCCL takes the paths from the topology file (TOPO004 checks it), not from sysfs
            if hidden:
                yield undecided(f"GPU {gpu}", hidden)
                continue
            yield present(
                f"GPU {gpu}",
                Evidence("NCCL_NET_GDR_LEVEL", f"{setting.value}: GPUDirect RDMA forced over a {distance} path to NIC {nic}",
                         f"unset (NCCL's default {DEFAULT_GDR_LEVEL} stages such transfers through host memory)"),
            )


def _switches_hidden(pcie: PcieFacts, gpu: str, nic: str) -> str:
    """Why sysfs cannot show the path between ``gpu`` and ``nic``: in a virtual machine that puts
    each device alone on a root bus (Hyper-V's vPCI on Azure's ND series), the PCIe switch they
    share on the host is out of sight and every pair looks PHB. "" when the path is seen."""
    if not pcie.hypervisor:
        return ""
    ends = [device for device in (*pcie.gpus, *pcie.nics) if device.bdf in (gpu, nic)]
    if len(ends) == 2 and not any(device.chain for device in ends):
        return (f"GPU {gpu} and NIC {nic} each sit alone on a root bus of a virtual machine ({pcie.virtualisation}): "
                "the PCIe switch between them, if any, is the host's and not visible here")
    return ""


@check("TOPO004", profiles=("prolog",))
def nccl_topo_xml_nic_without_busid(topo_file: TopoFileFacts) -> Iterator[Observation]:
    """NCCL_TOPO_FILE missing or unparsable, NICs in it without a PCI bus ID, or GPU/NIC bus IDs
    this node does not have."""
    setting = topo_file.setting
    if setting is None:
        raise NotApplicable("the job sets no NCCL_TOPO_FILE")
    where = Evidence(f"NCCL_TOPO_FILE ({setting.origin})", setting.value.strip())
    if topo_file.read_error:
        if topo_file.exists:
            yield undecided("NCCL_TOPO_FILE", topo_file.read_error, where)
        else:
            yield present("NCCL_TOPO_FILE", where, Evidence("path", topo_file.read_error, "an absolute path"), severity=Severity.WARNING)
        return
    if not topo_file.exists:
        # ncclTopoGetXmlFromFile logs the failed fopen and returns success; NCCL then detects the
        # node from sysfs as if the variable were unset (xml.cc, topo.cc@v2.7.8-1..v2.30.7-1).
        # The job runs: the file meant for this node type is missing, which is worth a warning.
        yield present(
            "NCCL_TOPO_FILE", where,
            Evidence(setting.value.strip(), "does not exist on this node: NCCL detects the node from sysfs instead",
                     "the topology file for this node type"),
            severity=Severity.WARNING,
        )
        return
    if topo_file.parse_error:
        # Every release's reader stops (ncclInternalError/ncclInvalidUsage): every rank's init fails.
        yield present("NCCL_TOPO_FILE", where, Evidence(setting.value.strip(), f"NCCL's topology reader refuses it: {topo_file.parse_error}",
                                                        "a file NCCL's reader accepts (src/graph/xml.cc)"))
        return
    if topo_file.parse_unknown:
        yield undecided("NCCL_TOPO_FILE", topo_file.parse_unknown, where)
        return
    for nic in topo_file.nics:
        if nic.busid is None:
            # NCCL (ncclTopoAddCpu, 2.7.8 to 2.30.7) accepts a <nic> under <cpu> and hangs it off
            # that CPU: jobs run, with GPUDirect RDMA to it judged across the CPU (off at the
            # default NCCL_NET_GDR_LEVEL), and a merge of it with another NIC (NIC fusion, 2.24+)
            # fails. A loss to warn of, not a node that fails every job.
            yield present(
                f"nic {','.join(nic.names) or '?'}",
                where,
                Evidence(setting.value.strip(), "<nic> outside any <pci busid=...> node: NCCL attaches it to the CPU",
                         "each <nic> inside the <pci> node of its PCI function"),
                severity=Severity.WARNING,
            )
    missing = sorted(set(topo_file.device_busids) - set(topo_file.node_busids))
    if missing and topo_file.node_busids:
        # Since v2.8.3-1 ncclTopoGetSystem trims every file branch that no GPU or NIC of this
        # node claimed (ncclTopoTrimXml, topo.cc/xml.cc to v2.30.7-1): this node's GPUs are read
        # from sysfs and a NIC is placed by its <net name>. A file written for another machine
        # misplaces devices, it does not stop the job (2.7 had no trim).
        yield present(
            "NCCL_TOPO_FILE",
            where,
            Evidence(setting.value.strip(), f"GPU/NIC bus IDs not on this node: {', '.join(missing)} (NCCL drops those entries)",
                     "the bus IDs in /sys/bus/pci/devices"),
            severity=Severity.WARNING,
        )


def _fusing_copies(nccl_libs: NcclLibFacts) -> list[str]:
    """Versions of the installed NCCL copies that have NIC fusion, or whose version is not named."""
    require_nccl(nccl_libs)
    found = []
    for copy in nccl_libs.copies:
        release = version_tuple(copy.version) if copy.version else None
        if release is None or release[:2] >= FUSION_SINCE:
            found.append(copy.version or f"{copy.path} (release not named)")
    return found


@check("TOPO002", profiles=("full",))
def nccl_nic_fusion_failure(job: JobFacts, rdma: RdmaFacts, nccl_libs: NcclLibFacts) -> Iterator[Observation]:
    """An NCCL_NET_FORCE_MERGE group that NCCL's IB transport cannot fuse on this node: its names
    match another number of ports than they list (absent, misspelled, filtered by NCCL_IB_HCA, or a
    name without a port on a dual-port NIC), it mixes InfiniBand and RoCE ports, or NCCL cannot
    parse it at all."""
    setting = job.nccl("NCCL_NET_FORCE_MERGE")
    if setting is None:
        raise NotApplicable("NCCL_NET_FORCE_MERGE is unset; a failed automatic merge is retried with fewer devices, not fatal")
    fusing = _fusing_copies(nccl_libs)
    if not fusing:
        raise NotApplicable("every NCCL installed here is older than 2.24, which has no NIC fusion and ignores NCCL_NET_FORCE_MERGE")
    net = job.nccl("NCCL_NET")
    if net is not None and net.value.strip().lower() != "ib":
        raise NotApplicable(f"NCCL_NET={net.value}: the groups name another network's devices")
    require_rdma(rdma)
    selection = nccl_selection(rdma, job)
    if selection.unlisted or selection.undecided:
        raise Unknown(selection.unlisted[0] if selection.unlisted else selection.undecided[0].why("state" if selection.undecided[0].state is None else "link_layer"))
    where = "/proc/self/environ" if setting.origin == "environment" else setting.origin
    stated = Evidence(f"{where} NCCL_NET_FORCE_MERGE", repr(setting.value), "';'-separated groups of ','-separated ports NCCL's IB transport uses")
    version = Evidence("NCCL installed", ", ".join(fusing))
    for group, entries in parse_force_merge(setting.value):
        if not entries:
            # ncclTopoForceMerge logs the group and 'continue's without taking the next one
            # (every release from 2.24.3 to 2.30.7): communicator creation never returns.
            yield present(group, stated, Evidence("group", repr(group), "at least one device name"), version)
            continue
        matched = [port for port in selection.ports if any(port.device == e.name and (e.port is None or e.port == port.number) for e in entries)]
        shown = ", ".join(f"{port.device}:{port.number}" for port in matched) or "none"
        if len(matched) != len(entries):
            yield present(
                group, stated,
                Evidence("ports NCCL's IB transport would use", f"{shown} ({len(matched)} for {len(entries)} names)", "exactly one port for each name ('Only matched N devices' otherwise)"),
                version,
            )
        elif len({port.link_layer for port in matched}) > 1:
            layers = ", ".join(f"{port.device}:{port.number} {port.link_layer}" for port in matched)
            yield present(group, stated, Evidence("link layers", layers, "one link layer per fused NIC"), version)
