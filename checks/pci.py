"""PCIe links, ACS/IOMMU and peer-to-peer paths (PCI references)."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from msgspec import Struct
from msgspec.structs import replace

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
from preflight.nccl.gdr import gdr_level, within
from preflight.probes.nvlink import require_nvml
from preflight.probes.pcie import DIRECT_TRANSLATED, REDIRECT_BITS, TRANSLATED_DOMAINS, PciEndpoint, PcieFacts, entry_port, path_class, unclassified_reason
from preflight.registry import check
from preflight.units import MAX_DIGITS

if TYPE_CHECKING:
    from collections.abc import Iterator

    from preflight.config import Expectations
    from preflight.probes.gpus import GpuFacts
    from preflight.probes.job import JobFacts, Setting
    from preflight.probes.nccl_libs import NcclLibFacts
    from preflight.probes.p2p import P2pFacts
    from preflight.probes.pcie_p2p import P2pStatus, PcieP2pFacts

STATUS_OK = 0


STATUS_DISABLED_BY_REGKEY = 4


# nvidia-smi topo -p2p's abbreviations, which operators know.
P2P_STATUS_NAMES = {0: "OK", 1: "CNS (chipset not supported)", 2: "GNS (GPU not supported)",
                    3: "TNS (topology not supported)", 4: "DR (disabled by regkey)", 5: "NS (not supported)",
                    6: "U (unknown)"}


SM120_MAJOR = 12  # RTX 5090 / RTX PRO Blackwell: compute capability 12.x


# NCCL 2.26.2 fitted its kernels' shared memory to these GPUs (release notes; NVIDIA/nccl#1637).
SM120_MIN_NCCL = (2, 26, 2)


def _strtol(text: str) -> int | None:
    """C ``strtol(text, NULL, 0)`` for the forms people write: leading blanks, sign, decimal,
    0x hex or 0 octal; None where strtol would return 0 because no digits were read."""
    match = re.match(r"\s*([+-]?)(0[xX][0-9a-fA-F]+|0[0-7]*|[1-9][0-9]*)", text)
    if not match or len(match.group(2)) > MAX_DIGITS:
        return None  # no digits, or beyond long (which int() would refuse to read at all)
    digits = match.group(2)
    value = int(digits, 16) if digits[:2].lower() == "0x" else int(digits, 8) if digits.startswith("0") else int(digits)
    return -value if match.group(1) == "-" else value


class P2pOverride(Struct, frozen=True):
    """A job setting that switches NCCL's P2P transport off for every GPU pair on this node."""

    name: str
    setting: Setting
    why: str

    def evidence(self) -> Evidence:
        return Evidence(f"{self.name} ({self.setting.origin})", self.setting.value, f"unset: {self.why}")


def p2p_switched_off(job: JobFacts, any_nvlink: bool | None) -> P2pOverride | None:
    """The setting that turns NCCL's P2P transport off for every pair on this node.

    ``any_nvlink``: whether some GPU pair is NVLink-connected (None: not known), for
    NCCL_P2P_LEVEL=NVL, which keeps P2P only over NVLink."""
    disable = job.nccl("NCCL_P2P_DISABLE")
    if disable is not None and _strtol(disable.value) == 1:
        return P2pOverride("NCCL_P2P_DISABLE", disable, "1 turns the P2P transport off")
    level = job.nccl("NCCL_P2P_LEVEL")
    if level is None:
        return None
    if level.value == "LOC" or (level.value[:1].isdigit() and _strtol(level.value) == 0):
        return P2pOverride("NCCL_P2P_LEVEL", level, "LOC allows P2P only within one GPU")
    if level.value in ("NVL", "NVB") and any_nvlink is False:
        return P2pOverride("NCCL_P2P_LEVEL", level, f"{level.value} allows P2P only over NVLink, which no GPU pair here has")
    return None


AMD_X86 = "AuthenticAMD"


class P2pLevel(Struct, frozen=True):
    """The farthest PCI path over which NCCL lets two GPUs of this node use P2P."""

    candidates: tuple[str, ...]  # one NCCL path name, or two where the CPU vendor was not read
    why: Evidence


def nccl_p2p_level(pcie: PcieFacts, job: JobFacts) -> P2pLevel:
    """``ncclTopoCheckP2p``'s level (paths.cc@v2.30.7-1): the job's NCCL_P2P_DISABLE=1 (LOC) or
    NCCL_P2P_LEVEL as ncclGetLevel reads it; else PXB, and SYS on an AMD x86 CPU. NCCL gives
    AMD SYS only when the communicator has at most two GPUs on the node (2.23.4 and later; every
    count before), so any pair of an AMD node carries P2P for a two-GPU job. Raises Unknown when
    an NCCL configuration file that may set them could not be read."""
    disable = job.nccl("NCCL_P2P_DISABLE")
    if disable is not None and _strtol(disable.value) == 1:
        return P2pLevel(("LOC",), Evidence(f"NCCL_P2P_DISABLE ({disable.origin})", disable.value))
    level = job.nccl("NCCL_P2P_LEVEL")
    name = gdr_level(level.value) if level is not None else None
    if level is not None and name is not None:
        return P2pLevel((name,), Evidence(f"NCCL_P2P_LEVEL ({level.origin})", f"{level.value}: P2P up to {name} paths"))
    if pcie.cpu_vendor is None:
        return P2pLevel(("PXB", "SYS"), Evidence("/proc/cpuinfo", "unread: whether the CPU is AMD (NCCL's P2P level SYS) is not known"))
    if pcie.cpu_vendor == AMD_X86:
        return P2pLevel(("SYS",), Evidence("/proc/cpuinfo", f"{AMD_X86}: NCCL allows P2P across the CPU (level SYS) for jobs of up to two GPUs"))
    return P2pLevel(("PXB",), Evidence("NCCL's P2P level", "PXB (its default off AMD CPUs): P2P only between GPUs under one PCIe switch"))


def nccl_uses_p2p(pcie: PcieFacts, level: P2pLevel, first: PciEndpoint, second: PciEndpoint) -> bool | None:
    """Whether the path between two GPUs is within ``level`` (None: it depends on what was not read)."""
    kind = path_class(first, second, pcie.sockets)
    kinds = ("PHB", "SYS") if kind == "UNKNOWN" else (kind,)  # different root ports, sockets not known
    answers = {within(path, limit) for path in kinds for limit in level.candidates}
    return answers.pop() if len(answers) == 1 else None


def _subject(override: P2pOverride) -> str:
    return "job environment" if override.setting.origin == "environment" else override.setting.origin


def _pairs(p2p: P2pFacts) -> dict[tuple[int, int], list[P2pStatus]]:
    """Both directions of every unordered pair."""
    pairs: dict[tuple[int, int], list[P2pStatus]] = {}
    for status in p2p.statuses:
        pairs.setdefault((min(status.source, status.target), max(status.source, status.target)), []).append(status)
    return pairs


def _named(status: int | None) -> str:
    return P2P_STATUS_NAMES.get(status, f"status {status}") if status is not None else "query failed"


def _describe(directions: list[P2pStatus]) -> str:
    return "; ".join(
        f"GPU{s.source}->GPU{s.target}: read {_named(s.read)}, write {_named(s.write)}, NVLink {_named(s.nvlink)}"
        for s in directions
    )


def _read_write_ok(directions: list[P2pStatus]) -> bool:
    return all(s.read == STATUS_OK and s.write == STATUS_OK for s in directions)


@check("PCI004", profiles=("full",))
def p2p_transport_disabled(p2p: P2pFacts, job: JobFacts, gpus: GpuFacts, expect: Expectations) -> Iterator[Observation]:
    """P2P switched off by the job's NCCL settings, or reported not OK by the driver between GPUs
    that are NVLink-connected, whose P2P a registry key disabled, or that the site expects to
    have NVLink."""
    if p2p.nvml_error:
        if not gpus.pci_gpus:
            require_nvml(p2p.nvml_error, p2p.nvml_detail, gpus, "the driver's P2P status")
        if len(gpus.pci_gpus) < 2:
            if gpus.problems:  # a GPU whose vendor or class could not be read is not counted
                raise Unknown(f"NVML unavailable ({p2p.nvml_error}) and the PCI bus not fully read: {gpus.problems[0]}")
            raise NotApplicable("one GPU on this node: no peer-to-peer traffic inside it")
        override = p2p_switched_off(job, None)
        if override is None:
            require_nvml(p2p.nvml_error, p2p.nvml_detail, gpus, "the driver's P2P status")
            return
        yield present(_subject(override), override.evidence())
        yield undecided("GPU pairs", f"NVML unavailable ({p2p.nvml_error}); the driver's P2P status cannot be read")
        return
    if len(p2p.gpus) < 2:
        seen = f"{len(p2p.gpus)} GPU(s) visible to NVML here" if len(gpus.pci_gpus) > len(p2p.gpus) else f"{len(p2p.gpus)} GPU(s) on this node"
        raise NotApplicable(f"{seen}: no peer-to-peer traffic between them")
    pairs = _pairs(p2p)
    answered = {key: directions for key, directions in pairs.items() if not any(s.error for s in directions)}
    ok_pairs = [key for key, directions in answered.items() if _read_write_ok(directions)]
    nvlink_pairs = {key for key, directions in answered.items() if any(s.nvlink == STATUS_OK for s in directions)}
    complete = len(answered) == len(pairs)
    override = p2p_switched_off(job, bool(nvlink_pairs) if complete or nvlink_pairs else None)
    # On hardware without peer access the setting takes nothing away: NCCL would use SHM anyway.
    if override is not None and (ok_pairs or not complete):
        yield present(
            _subject(override),
            override.evidence(),
            Evidence("nvmlDeviceGetP2PStatus", f"the driver reports read/write OK for {len(ok_pairs)} of {len(pairs)} GPU pairs"),
        )
    failed: dict[str, list[str]] = {}
    for (first, second), directions in sorted(pairs.items()):
        for status in directions:
            if status.error:
                failed.setdefault(status.error, []).append(f"GPU{status.source}->GPU{status.target}")
    for error, where in sorted(failed.items()):
        yield undecided("GPU pairs", f"nvmlDeviceGetP2PStatus: {error} for {', '.join(where[:6])}{' ...' if len(where) > 6 else ''}")
    ignore = job.nccl("NCCL_IGNORE_DISABLED_P2P")
    mig = gpus.mig_indices  # a GPU in MIG mode does no peer-to-peer at all (NVIDIA's MIG user guide)
    for (first, second), directions in sorted(answered.items()):
        if _read_write_ok(directions) or first in mig or second in mig:
            continue
        observed = Evidence("nvmlDeviceGetP2PStatus", _describe(directions), "read and write OK")
        subject = f"GPU{first}-GPU{second}"
        if (first, second) in nvlink_pairs:
            hidden = [Evidence(f"NCCL_IGNORE_DISABLED_P2P ({ignore.origin})", ignore.value, "unset: NCCL would stop here")] if ignore else []
            yield present(subject, observed, *hidden, severity=Severity.CRITICAL,
                          fix="NVLink-connected GPUs without P2P point at an NVLink, NVSwitch or driver fault: check "
                              "nvidia-smi nvlink --status and the fabric manager, then reset or service the GPUs.")
        elif any(s.read == STATUS_DISABLED_BY_REGKEY or s.write == STATUS_DISABLED_BY_REGKEY for s in directions):
            yield present(subject, observed, Evidence("NVIDIA driver registry keys", "P2P disabled by a regkey", "driver defaults"))
        elif expect.nvlinks_per_gpu is not None:
            yield present(subject, observed, Evidence("expect.nvlinks_per_gpu", str(expect.nvlinks_per_gpu), "an NVLink platform: P2P between all GPUs"),
                          severity=Severity.ERROR)


def _version(text: str) -> tuple[int, ...] | None:
    try:
        return tuple(int(part) for part in text.split("."))
    except ValueError:
        return None


@check("PCI005", profiles=("full",))
def blackwell_sm120_multi_gpu_failure(p2p: P2pFacts, nccl_libs: NcclLibFacts, job: JobFacts, gpus: GpuFacts, pcie: PcieFacts) -> Iterator[Observation]:
    """Several sm_120 GPUs with an NCCL older than 2.26.2 on the node, or with P2P offered under
    a translating IOMMU between cards NCCL lets use P2P."""
    require_nvml(p2p.nvml_error, p2p.nvml_detail, gpus, "the GPUs' compute capability")
    unknown = [gpu for gpu in p2p.gpus if gpu.compute_capability is None]
    sm120 = [gpu for gpu in p2p.gpus if gpu.compute_capability and gpu.compute_capability[0] == SM120_MAJOR]
    if len(sm120) < 2:
        if unknown and len(sm120) + len(unknown) >= 2:
            yield undecided("node", "nvmlDeviceGetCudaComputeCapability failed for " + ", ".join(f"GPU{gpu.index}" for gpu in unknown))
            return
        raise NotApplicable(f"{len(sm120)} GPU(s) of compute capability 12.x on this node; the failures need two or more")
    cards = Evidence("nvmlDeviceGetName/nvmlDeviceGetCudaComputeCapability",
                     ", ".join(f"GPU{gpu.index} {gpu.name or '?'} sm_{gpu.compute_capability[0]}{gpu.compute_capability[1]}"
                               for gpu in sm120 if gpu.compute_capability))
    minimum = ".".join(map(str, SM120_MIN_NCCL))
    for copy in nccl_libs.copies:
        version = _version(copy.version) if copy.version else None
        if copy.version is None or version is None:
            yield undecided(copy.path, f"the NCCL version of {copy.path} is not known")
        elif version < SM120_MIN_NCCL:
            yield present(copy.path, Evidence(copy.path, f"NCCL {copy.version}", f"NCCL {minimum} or newer on sm_120 GPUs"), cards)
    if p2p_switched_off(job, None) is not None:
        return
    indexes = {gpu.index for gpu in sm120}
    offered = [
        key for key, directions in _pairs(p2p).items()
        if key[0] in indexes and key[1] in indexes and not any(s.error for s in directions) and _read_write_ok(directions)
    ]
    domains = {gpu.index: gpu.iommu_domain for gpu in sm120}
    level: P2pLevel | None = None
    for first, second in sorted(offered):
        translated = [f"GPU{i} {domains[i]}" for i in (first, second) if domains[i] in TRANSLATED_DOMAINS]
        if not translated:
            continue
        level = level or nccl_p2p_level(pcie, job)
        used = _cards_use_p2p(pcie, level, p2p, first, second)
        subject = f"GPU{first}-GPU{second}"
        if used is None:
            yield undecided(subject, f"{', '.join(translated)}: whether NCCL uses P2P between them is not known "
                                     f"(not placed in the PCI tree, or {_path_unknown(level)})")
        elif used:
            yield present(
                subject,
                Evidence("nvmlDeviceGetP2PStatus", "read and write OK: NCCL will use P2P between these cards"),
                level.why,
                Evidence("/sys/bus/pci/devices/*/iommu_group/type", ", ".join(translated), "identity (iommu=pt) or no IOMMU"),
                cards,
                severity=Severity.WARNING,
            )


def _cards_use_p2p(pcie: PcieFacts, level: P2pLevel, p2p: P2pFacts, first: int, second: int) -> bool | None:
    """nccl_uses_p2p for two GPUs by NVML index; None where either is not placed in the PCI tree."""
    bus = {gpu.index: gpu.bus_id for gpu in p2p.gpus}
    placed = {gpu.bdf: gpu for gpu in pcie.gpus}
    a, b = placed.get(bus.get(first) or ""), placed.get(bus.get(second) or "")
    return nccl_uses_p2p(pcie, level, a, b) if a is not None and b is not None else None


# Kernel parameters that make the default IOMMU domain passthrough (identity).
PASSTHROUGH_PARAMETERS = ("iommu=pt", "iommu.passthrough=1", "iommu.passthrough=y", "amd_iommu=pt")


@check("PCI001", profiles=("prolog",))
def acs_redirect_breaks_gpudirect_rdma(pcie: PcieFacts) -> Iterator[Observation]:
    """ACS P2P redirect on a bridge between a GPU and its nearest RDMA NIC, on bare metal, unless the
    NIC translates its requests through ATS and its port lets translated requests pass (Direct
    Translated P2P)."""
    yield from _on_bare_metal(pcie, _gpu_nic_redirects(pcie))


#: Which ACS redirect bits of a bridge on a GPU-NIC path GPUDirect RDMA meets, by the bridge's place
#: on it. The NIC starts every transfer: its requests enter the switch at its own port (Request
#: Redirect), the GPU's completions to its reads at the GPU's (Completion Redirect). Request
#: Redirect on the GPU's port and Completion Redirect on the NIC's act only on what the GPU starts,
#: so rdma_topo sets them on purpose on Grace trays with a Data Direct function (GPU port 101,
#: DMA port 110). A shared bridge judged for want of downstream ports counts either bit.
_NIC_PORT, _GPU_PORT, _TURNAROUND = 0x0004, 0x0008, REDIRECT_BITS


def _gpu_nic_redirects(pcie: PcieFacts) -> Iterator[Observation]:
    pairs = (*pcie.pairs, *pcie.data_direct_pairs)
    unclassified = unclassified_reason(pcie)
    if unclassified and not (pcie.gpus and pcie.nics and pairs):
        raise Unknown(unclassified)
    if unclassified:
        yield undecided("PCI devices", unclassified)
    if not pcie.gpus or not pcie.nics:
        raise NotApplicable("needs NVIDIA GPUs and RDMA NICs on this node")
    if pcie.hypervisor:
        raise NotApplicable(
            f"inside a virtual machine ({pcie.virtualisation}): the guest's emulated bridges do not route P2P traffic; "
            "check ACS and the IOMMU on the host"
        )
    if not pairs:
        raise NotApplicable("no GPU shares a PCIe switch with an RDMA NIC or its Data Direct function; their traffic crosses the CPU anyway")
    chains = {device.bdf: (*device.chain, device.bdf) for device in (*pcie.gpus, *pcie.nics, *pcie.data_direct)}
    data_direct = {function.bdf for function in pcie.data_direct}
    # bridge -> (gpu, nic) -> the redirect bits that matter there for that pair
    meets: dict[str, dict[tuple[str, str], int]] = {}
    for gpu, nic, between in pairs:
        for bdf in between:
            role = _NIC_PORT if bdf == entry_port(chains[nic], chains[gpu]) else _GPU_PORT if bdf == entry_port(chains[gpu], chains[nic]) else _TURNAROUND
            meets.setdefault(bdf, {})[gpu, nic] = role
    translated = _translated_past_redirect(pcie, chains)
    iommu = _iommu_note(pcie)
    for bridge in pcie.bridges:
        if bridge.bdf not in meets:
            continue  # only on a GPU-to-GPU path: PCI003's
        if bridge.unreadable:
            yield undecided(f"bridge {bridge.bdf}", bridge.unreadable)
            continue
        if bridge.acs is None:
            continue
        control = bridge.acs.control
        redirected = sorted(pair for pair, role in meets[bridge.bdf].items() if control & role)
        if not redirected:
            continue
        acs = Evidence(f"/sys/bus/pci/devices/{bridge.bdf}/config", f"ACSCtl 0x{control:04x}: {bridge.acs.describe()}",
                       "ReqRedir- CmpltRedir- on GPU-to-NIC paths")
        hurt = [pair for pair in redirected if translated.get(pair, (False, ""))[0] is False]
        if hurt:
            named = "; ".join(f"GPU {gpu} <-> NIC {'Data Direct function ' if nic in data_direct else ''}{nic}" for gpu, nic in hurt)
            evidence = [acs, Evidence("path", named)]
            unused = {nic: translated[gpu, nic][1] for gpu, nic in hurt if (gpu, nic) in translated}
            evidence += [Evidence(f"NIC {nic} ATS", f"{detail}: the DirectTrans+ of its port does not apply") for nic, detail in sorted(unused.items())]
            if iommu:
                evidence.append(Evidence("IOMMU", iommu))
            yield present(f"bridge {bridge.bdf}", *evidence)
        elif unknown := [pair for pair in redirected if translated[pair][0] is None]:
            nic = unknown[0][1]
            yield undecided(
                f"bridge {bridge.bdf}",
                f"{acs.observed}; the port of NIC {nic} has DirectTrans+, which lets the NIC's requests pass the redirect "
                f"only if the NIC translates them through ATS, and whether it does is not known: {translated[unknown[0]][1]}",
                acs,
            )
        # Otherwise every pair through this bridge is a NIC whose ATS-translated requests pass
        # its port's redirect (rdma_topo --virt): GPUDirect RDMA turns around in the switch.


def _translated_past_redirect(pcie: PcieFacts, chains: dict[str, tuple[str, ...]]) -> dict[tuple[str, str], tuple[bool | None, str]]:
    """For each GPU-NIC pair whose NIC enters their switch through a port with Direct Translated
    P2P set: whether the NIC's GPUDirect RDMA requests pass that switch's redirect (the NIC
    translates them through ATS), None where its ATS was not read, and what was read. Pairs
    whose NIC's port lacks that bit are not listed: their requests are redirected."""
    direct = {bridge.bdf for bridge in pcie.bridges if bridge.acs is not None and bridge.acs.control & DIRECT_TRANSLATED}
    ats = {reading.nic: (reading.enabled, reading.detail) for reading in pcie.nic_ats}
    return {
        (gpu, nic): ats.get(nic, (None, "its ATS was not read"))
        for gpu, nic, _ in (*pcie.pairs, *pcie.data_direct_pairs)
        if entry_port(chains[nic], chains[gpu]) in direct
    }


def _on_bare_metal(pcie: PcieFacts, observations: Iterator[Observation]) -> Iterator[Observation]:
    """The PCI findings hold on bare metal only: a guest's bridges, ACS bits, IOMMU and slots
    are emulated. Where whether the node is a guest was not read, a finding is undecided."""
    for observation in observations:
        if pcie.hypervisor is None and observation.status is Status.PRESENT:
            seen = observation.evidence[0].observed if observation.evidence else "found"
            yield undecided(
                observation.subject,
                f"{seen}, but whether this node is a virtual machine is not known ({pcie.virtualisation}); "
                "in a guest this is the emulated hardware's, not the host's",
                *observation.evidence,
            )
        else:
            yield observation


def _iommu_note(pcie: PcieFacts) -> str:
    if not pcie.iommu_units:
        return ""
    note = f"active ({', '.join(pcie.iommu_units)}); the kernel enables ACS on every bridge when an IOMMU is active"
    if "iommu=pt" in pcie.cmdline.split():
        note += ", and iommu=pt does not change that"
    return note


@check("PCI002", profiles=("prolog",))
def p2p_bandwidth_degraded(pcie: PcieFacts) -> Iterator[Observation]:
    """A GPU or RDMA NIC whose PCIe link trained narrower than it can run."""
    yield from _on_bare_metal(pcie, _narrow_links(pcie))


def _narrow_links(pcie: PcieFacts) -> Iterator[Observation]:
    endpoints = [("GPU", gpu) for gpu in pcie.gpus] + [("NIC", nic) for nic in pcie.nics]
    unclassified = unclassified_reason(pcie)
    if not endpoints:
        if unclassified:
            raise Unknown(unclassified)
        raise NotApplicable("no NVIDIA GPUs or RDMA NICs on the PCI bus")
    if unclassified:
        yield undecided("PCI devices", unclassified)
    if all(endpoint.link.problem for _, endpoint in endpoints):
        raise Unknown(f"no link width readable for any of the {len(endpoints)} GPUs and NICs ({endpoints[0][1].link.problem})")
    for kind, endpoint in endpoints:
        subject = f"{kind} {endpoint.bdf}" + (f" ({', '.join(endpoint.rdma_devices)})" if endpoint.rdma_devices else "")
        link = endpoint.link
        if link.problem or link.current_width is None or link.max_width is None:
            yield undecided(subject, link.problem or "link width not read")
        elif link.current_width == 0:
            where = link.function or endpoint.bdf
            why = ("inside a virtual machine, whose emulated link registers may read 0" if pcie.hypervisor is True
                   else "the link is down or the device is powered off")
            yield undecided(subject, f"/sys/bus/pci/devices/{where}/current_link_width is 0: {why}")
        elif link.current_width < link.max_width:
            observation = _narrow_link(subject, endpoint, pcie.hypervisor is True)
            if observation is not None:
                yield observation


def _narrow_link(subject: str, endpoint: PciEndpoint, hypervisor: bool) -> Observation | None:
    """A link narrower than the function can run: degraded where the port above it could run it
    wider; the slot's own width where it cannot (no finding); undecided where the port is not
    there to ask (a guest's root bus) or emulated (any guest), or its width unread. Real
    nvidia-smi dumps (tests/data/real-nvml) show x8 of x16 on working machines: a T4 and an A10G
    at 0000:00:1e.0 (a guest's root bus), a Quadro P2000, an RTX 3060 laptop GPU."""
    link = endpoint.link
    assert link.current_width is not None and link.max_width is not None
    narrow = f"x{link.current_width} of the x{link.max_width} the device can run"
    if hypervisor:
        return undecided(subject, f"{narrow}, inside a virtual machine: the port above it is emulated, so a narrow physical slot and a degraded link look the same")
    if not link.port:
        return undecided(subject, f"{narrow}, with no bridge above it in sysfs: the slot's width cannot be read")
    if link.port_max_width is None:
        return undecided(subject, f"{narrow}; /sys/bus/pci/devices/{link.port}/max_link_width (the port above it) not read")
    if link.current_width >= link.port_max_width:
        return None  # as wide as the slot allows
    speed = f"; speed {link.current_speed or '?'} of {link.max_speed or '?'} (speed drops at idle and is not judged)"
    expected = min(link.max_width, link.port_max_width)
    return present(
        subject,
        Evidence(f"/sys/bus/pci/devices/{link.function or endpoint.bdf}/current_link_width", f"x{link.current_width}{speed}",
                 f"x{expected} (max_link_width of the device and of port {link.port} above it)"),
    )


def _pcie_p2p_offered(p2p: PcieP2pFacts | Unread, first: str, second: str) -> bool | None:
    """Whether the driver offers P2P over PCIe between two GPUs (by PCI address): read and write
    OK both ways, not over NVLink. None when that is not known (the reason: _p2p_unknown)."""
    if isinstance(p2p, Unread):
        return None
    index = dict(p2p.by_bus)
    if not p2p.asked or p2p.nvml_error or first not in index or second not in index:
        return None
    pair = {index[first], index[second]}
    directions = [status for status in p2p.statuses if {status.source, status.target} == pair]
    if len(directions) != 2 or any(status.error for status in directions):
        return None
    return _read_write_ok(directions) and not all(status.nvlink == STATUS_OK for status in directions)


def _p2p_unknown(p2p: PcieP2pFacts | Unread) -> str:
    if isinstance(p2p, Unread):
        return f"whether the GPUs offer P2P is unread ({p2p})"
    if not p2p.asked:
        return "the driver's P2P answers were not asked"
    if p2p.nvml_error:
        return f"NVML cannot be asked whether the GPUs offer P2P ({p2p.nvml_error})"
    return "nvmlDeviceGetP2PStatus did not answer for every GPU of the pair"


@check("PCI003", profiles=("prolog",), optional=("pcie_p2p", "job", "gpus"))
def p2p_transfers_hang_or_fault(pcie: PcieFacts, pcie_p2p: PcieP2pFacts | Unread, job: JobFacts | Unread,
                                gpus: GpuFacts | Unread = NOT_GIVEN) -> Iterator[Observation]:
    """ACS redirect on a bridge between two GPUs, or an IOMMU translating the GPUs' DMA, on bare
    metal without NVSwitches, where the driver offers P2P over PCIe between those GPUs (and, for
    the IOMMU, NCCL's P2P level reaches their path); GPUs in MIG mode do no peer-to-peer."""
    mig = _mig_gpus(gpus)
    if mig:
        pcie = replace(pcie, gpus=tuple(gpu for gpu in pcie.gpus if gpu.bdf not in mig),
                       gpu_pairs=tuple(pair for pair in pcie.gpu_pairs if not {pair[0], pair[1]} & mig))
    yield from _on_bare_metal(pcie, _gpu_gpu_blockers(pcie, pcie_p2p, job, len(mig)))


def _mig_gpus(gpus: GpuFacts | Unread) -> set[str]:
    """PCI addresses of the GPUs in MIG mode: MIG's user guide supports peer-to-peer only between
    instances of one GPU, so such a GPU sends no peer traffic over PCIe or NVLink."""
    if isinstance(gpus, Unread):
        return set()
    return {device.bus_id for device in gpus.devices if device.mig and device.bus_id}


def _gpu_gpu_blockers(pcie: PcieFacts, pcie_p2p: PcieP2pFacts | Unread, job: JobFacts | Unread, in_mig: int = 0) -> Iterator[Observation]:
    unclassified = unclassified_reason(pcie)
    if len(pcie.gpus) < 2:
        if unclassified:
            raise Unknown(unclassified)
        if in_mig:
            raise NotApplicable(f"{in_mig} GPU(s) in MIG mode, which do no peer-to-peer over PCIe or NVLink, and "
                                f"{len(pcie.gpus)} other: no GPU peer-to-peer traffic inside the node")
        raise NotApplicable("fewer than two NVIDIA GPUs: no GPU peer-to-peer traffic inside the node")
    if unclassified:
        yield undecided("PCI devices", unclassified)
    if pcie.hypervisor:
        raise NotApplicable(
            f"inside a virtual machine ({pcie.virtualisation}): the guest's emulated bridges and IOMMU do not route GPU peer traffic; "
            "check ACS and the IOMMU on the host"
        )
    if pcie.nvswitches:
        raise NotApplicable(
            f"GPU peer traffic runs over NVLink through {len(pcie.nvswitches)} NVSwitches, not through PCIe bridges or the IOMMU"
        )
    partners: dict[str, list[tuple[str, str]]] = {}
    for first, second, between in pcie.gpu_pairs:
        for bdf in between:
            partners.setdefault(bdf, []).append((first, second))
    for bridge in pcie.bridges:
        if bridge.bdf not in partners:
            continue
        if bridge.unreadable:
            yield undecided(f"bridge {bridge.bdf}", bridge.unreadable)
        elif bridge.acs is not None and bridge.acs.control & REDIRECT_BITS:
            offers = {pair: _pcie_p2p_offered(pcie_p2p, *pair) for pair in partners[bridge.bdf]}
            acs = Evidence(f"/sys/bus/pci/devices/{bridge.bdf}/config", f"ACSCtl 0x{bridge.acs.control:04x}: {bridge.acs.describe()}",
                           "ReqRedir- CmpltRedir- on GPU-to-GPU paths")
            hurt = sorted(f"GPU {first} <-> GPU {second}" for (first, second), offered in offers.items() if offered)
            if hurt:
                yield present(f"bridge {bridge.bdf}", acs, Evidence("path", "; ".join(hurt)), _P2P_OFFERED)
            elif None in offers.values():
                yield undecided(f"bridge {bridge.bdf}", f"{acs.observed}, which matters only where the GPUs use P2P, and {_p2p_unknown(pcie_p2p)}")
    yield from _translating_iommu(pcie, pcie_p2p, job)


_P2P_OFFERED = Evidence("nvmlDeviceGetP2PStatus", "read and write OK over PCIe: NCCL will send GPU-to-GPU traffic this way")


def _translating_iommu(pcie: PcieFacts, pcie_p2p: PcieP2pFacts | Unread, job: JobFacts | Unread) -> Iterator[Observation]:
    if pcie.iommu_units is None:
        reason = next((problem for problem in pcie.problems if problem.startswith("/sys/class/iommu")), "/sys/class/iommu unreadable")
        yield undecided("IOMMU", f"whether an IOMMU translates the GPUs' DMA is not known: {reason}")
        return
    if not pcie.iommu_units:
        return  # no IOMMU: nothing translates
    passthrough = [word for word in pcie.cmdline.split() if word in PASSTHROUGH_PARAMETERS]
    translated: dict[str, list[str]] = {}
    translated_bdfs = set()
    for gpu in pcie.gpus:
        if gpu.iommu_group is None and not gpu.iommu_problem:
            continue  # not behind an IOMMU
        if gpu.iommu_domain in TRANSLATED_DOMAINS:
            translated.setdefault(gpu.iommu_domain, []).append(f"GPU {gpu.bdf} (group {gpu.iommu_group})")
            translated_bdfs.add(gpu.bdf)
        elif gpu.iommu_problem:
            yield undecided(f"GPU {gpu.bdf}", f"IOMMU group or domain type unreadable: {gpu.iommu_problem}")
        elif not gpu.iommu_domain and not passthrough:
            yield undecided(
                f"GPU {gpu.bdf}",
                f"/sys/kernel/iommu_groups/{gpu.iommu_group}/type is missing (Linux before 5.11) and /proc/cmdline has no iommu=pt: "
                "whether the IOMMU translates this GPU's DMA is not known",
            )
    if translated:
        observed = "; ".join(f"{domain}: {', '.join(gpus)}" for domain, gpus in sorted(translated.items()))
        domain = Evidence("/sys/kernel/iommu_groups/*/type", f"translating domain for {observed}", "identity (passthrough, iommu=pt)")
        yield from _translated_pairs(pcie, pcie_p2p, job, domain, translated_bdfs)


def _translated_pairs(pcie: PcieFacts, pcie_p2p: PcieP2pFacts | Unread, job: JobFacts | Unread, domain: Evidence,
                      translated: set[str]) -> Iterator[Observation]:
    """Only GPU-to-GPU traffic over PCIe meets the translation, and only between GPUs that NCCL
    lets use P2P: where the driver offers none, or their path is beyond NCCL's P2P level (GPUs on
    separate root ports of an Intel host), NCCL copies through host memory and nothing faults."""
    # The job's settings matter only here: an unread environment or nccl.conf makes every level
    # possible, while the ACS findings, and a node without two GPUs, stand without them.
    try:
        level = nccl_p2p_level(pcie, job) if not isinstance(job, Unread) else P2pLevel(("LOC", "SYS"), Evidence("NCCL_P2P_LEVEL", f"not known ({job})"))
    except Unknown as error:
        level = P2pLevel(("LOC", "SYS"), Evidence("NCCL_P2P_LEVEL", f"not known ({error})"))
    pairs = [(first, second) for i, first in enumerate(pcie.gpus) for second in pcie.gpus[i + 1:] if {first.bdf, second.bdf} & translated]
    judged = [(f"GPU {a.bdf} <-> GPU {b.bdf}", _pcie_p2p_offered(pcie_p2p, a.bdf, b.bdf), nccl_uses_p2p(pcie, level, a, b)) for a, b in pairs]
    hurt = [pair for pair, offered, used in judged if offered and used]
    if hurt:
        yield present("IOMMU", domain, Evidence("/proc/cmdline", pcie.cmdline or "(empty)"),
                      Evidence("nvmlDeviceGetP2PStatus", f"read and write OK over PCIe: {'; '.join(hurt)}"), level.why)
        return
    offer_unknown = [pair for pair, offered, used in judged if offered is None and used is not False]
    path_unknown = [pair for pair, offered, used in judged if used is None and offered is not False]
    if offer_unknown:
        yield undecided("IOMMU", f"{domain.observed}, which matters only where the GPUs use P2P, and {_p2p_unknown(pcie_p2p)}")
    elif path_unknown:
        yield undecided("IOMMU", f"{domain.observed}, and whether NCCL uses P2P between {path_unknown[0]} is not known: {_path_unknown(level)}")


def _path_unknown(level: P2pLevel) -> str:
    if len(level.candidates) > 1:
        return f"{level.why.source} {level.why.observed}"
    return "their numa_node is not reported on this multi-socket node"
