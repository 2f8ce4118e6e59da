"""Peer-to-peer between the GPUs of a node: switched off (PCI004), and the RTX 5090 / RTX PRO
Blackwell (sm_120) multi-GPU failures (PCI005).

Sources:

* NVML, per device: ``nvmlDeviceGetName``, ``nvmlDeviceGetCudaComputeCapability`` (major,
  minor), ``nvmlDeviceGetPciInfo`` (``busId``); per ordered pair of devices
  ``nvmlDeviceGetP2PStatus(h1, h2, caps)`` for ``NVML_P2P_CAPS_INDEX_READ`` (0), ``_WRITE`` (1)
  and ``_NVLINK`` (2), answering ``NVML_P2P_STATUS_OK`` (0), ``CHIPSET_NOT_SUPPORTED`` (1),
  ``GPU_NOT_SUPPORTED`` (2), ``IOH_TOPOLOGY_NOT_SUPPORTED`` (3), ``DISABLED_BY_REGKEY`` (4),
  ``NOT_SUPPORTED`` (5) or ``UNKNOWN`` (6) - the matrix ``nvidia-smi topo -p2p r|w|n`` prints as
  OK/CNS/GNS/TNS/DR/NS/U. (nvidia-ml-py defines ``NVML_P2P_CAPS_INDEX_READ = 0,`` - a tuple -
  so the numbers are spelled out here.)
* ``/sys/bus/pci/devices/<bdf>/iommu_group/type``: the IOMMU domain of a GPU (``identity`` for
  pass-through, ``DMA``/``DMA-FQ`` for translated; no ``iommu_group`` when there is no IOMMU).
* The job's ``NCCL_P2P_DISABLE``, ``NCCL_P2P_LEVEL`` and ``NCCL_IGNORE_DISABLED_P2P``, read as
  NCCL's ``ncclGetLevel`` (src/graph/paths.cc) does: P2P_DISABLE counts only when ``strtol`` gives
  exactly 1; P2P_LEVEL is a path name compared exactly (``LOC``, ``NVL``...) or an old-style number
  (0 is LOC).
* The NCCL libraries on the node (the ``nccl_libs`` probe).

NCCL uses P2P between two GPUs only when NVML reports read and write status OK for the pair; if
they are NVLink-connected and it does not, NCCL stops ("P2P is disabled between NVLINK connected
GPUs"), because that means a broken link or driver, not a platform limit.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

from preflight.checks.gpus import GpuFacts, normalise_bus_id
from preflight.checks.job import JobFacts, Setting
from preflight.checks.nccl_libs import NcclLibFacts
from preflight.checks.nvlink import require_nvml
from preflight.config import Expectations
from preflight.model import Evidence, NotApplicable, Observation, Severity, Unknown, present, undecided
from preflight.probing import FactReader
from preflight.records import frozen
from preflight.registry import check, probe
from preflight.sources import NodeFS
from preflight.sources.nvml import Gpu, Nvml, NvmlError

CAPS_READ, CAPS_WRITE, CAPS_NVLINK = 0, 1, 2  # NVML_P2P_CAPS_INDEX_*
STATUS_OK = 0
STATUS_DISABLED_BY_REGKEY = 4
# nvidia-smi topo -p2p's abbreviations, which operators know.
P2P_STATUS_NAMES = {0: "OK", 1: "CNS (chipset not supported)", 2: "GNS (GPU not supported)",
                    3: "TNS (topology not supported)", 4: "DR (disabled by regkey)", 5: "NS (not supported)",
                    6: "U (unknown)"}
SM120_MAJOR = 12  # RTX 5090 / RTX PRO Blackwell: compute capability 12.x
# NCCL 2.26.2 fitted its kernels' shared memory to these GPUs (release notes; NVIDIA/nccl#1637).
SM120_MIN_NCCL = (2, 26, 2)
_TRANSLATED_DOMAINS = ("DMA", "DMA-FQ")  # /sys/kernel/iommu_groups/*/type


@frozen
class P2pGpu:
    index: int
    name: str | None  # nvmlDeviceGetName
    compute_capability: tuple[int, int] | None  # nvmlDeviceGetCudaComputeCapability
    bus_id: str | None  # nvmlDeviceGetPciInfo().busId in sysfs form
    iommu_domain: str | None  # /sys/bus/pci/devices/<bdf>/iommu_group/type; None: no IOMMU group


@frozen
class P2pStatus:
    """nvmlDeviceGetP2PStatus from ``source`` to ``target``; None where the query failed."""

    source: int
    target: int
    read: int | None
    write: int | None
    nvlink: int | None
    error: str  # NVML error code of the first failed query, "" when all three answered


@frozen
class P2pFacts:
    gpus: tuple[P2pGpu, ...]
    statuses: tuple[P2pStatus, ...]  # every ordered pair of different GPUs
    nvml_error: str
    nvml_detail: str
    problems: tuple[str, ...]


def _answer(nvml: Nvml, function: str, index: int) -> object:
    try:
        return nvml.call(function, index)
    except NvmlError:
        return None


def _capability(value: object) -> tuple[int, int] | None:
    if isinstance(value, (list, tuple)) and len(value) == 2 and all(type(part) is int for part in value):
        return (value[0], value[1])
    return None


def _iommu_domain(reader: FactReader, bus_id: str | None) -> str | None:
    if bus_id is None:
        return None
    text = reader.text(f"/sys/bus/pci/devices/{bus_id}/iommu_group/type")
    return text.strip() if text is not None else None


def _status(nvml: Nvml, source: int, target: int) -> P2pStatus:
    answers: list[int | None] = []
    error = ""
    for caps in (CAPS_READ, CAPS_WRITE, CAPS_NVLINK):
        try:
            value = nvml.call("nvmlDeviceGetP2PStatus", source, Gpu(target), caps)
        except NvmlError as failure:
            answers.append(None)
            error = error or failure.code
            continue
        if type(value) is int:
            answers.append(value)
        else:
            answers.append(None)
            error = error or f"unexpected answer {value!r}"
    return P2pStatus(source, target, answers[0], answers[1], answers[2], error)


@probe("p2p")
def probe_p2p(fs: NodeFS, nvml: Nvml) -> P2pFacts:
    """The driver's P2P status for every ordered pair of GPUs, and what each GPU is."""
    reader = FactReader(fs)
    try:
        count = nvml.call("nvmlDeviceGetCount")
    except NvmlError as error:
        return P2pFacts((), (), error.code, str(error), ())
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        return P2pFacts((), (), "NVML_ERROR_UNKNOWN", f"device count {count!r}", ())
    gpus = []
    for index in range(count):
        name = _answer(nvml, "nvmlDeviceGetName", index)
        pci = _answer(nvml, "nvmlDeviceGetPciInfo", index)
        bus = pci.get("busId") if isinstance(pci, dict) else None
        bus_id = normalise_bus_id(bus) if isinstance(bus, str) else None
        gpus.append(P2pGpu(
            index,
            name if isinstance(name, str) else None,
            _capability(_answer(nvml, "nvmlDeviceGetCudaComputeCapability", index)),
            bus_id,
            _iommu_domain(reader, bus_id),
        ))
    statuses = tuple(_status(nvml, source, target) for source in range(count) for target in range(count) if source != target)
    return P2pFacts(tuple(gpus), statuses, "", "", tuple(reader.problems))


# -- PCI004 -----------------------------------------------------------------------------------

def _strtol(text: str) -> int | None:
    """C ``strtol(text, NULL, 0)`` for the forms people write: leading blanks, sign, decimal,
    0x hex or 0 octal; None where strtol would return 0 because no digits were read."""
    match = re.match(r"\s*([+-]?)(0[xX][0-9a-fA-F]+|0[0-7]*|[1-9][0-9]*)", text)
    if not match:
        return None
    digits = match.group(2)
    value = int(digits, 16) if digits[:2].lower() == "0x" else int(digits, 8) if digits.startswith("0") else int(digits)
    return -value if match.group(1) == "-" else value


@frozen
class P2pOverride:
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
        raise NotApplicable(f"{len(p2p.gpus)} GPU(s) on this node: no peer-to-peer traffic inside it")
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
    for (first, second), directions in sorted(answered.items()):
        if _read_write_ok(directions):
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


# -- PCI005 -----------------------------------------------------------------------------------

def _version(text: str) -> tuple[int, ...] | None:
    try:
        return tuple(int(part) for part in text.split("."))
    except ValueError:
        return None


@check("PCI005", profiles=("full",))
def blackwell_sm120_multi_gpu_failure(p2p: P2pFacts, nccl_libs: NcclLibFacts, job: JobFacts, gpus: GpuFacts) -> Iterator[Observation]:
    """Several sm_120 GPUs with an NCCL older than 2.26.2 on the node, or with P2P offered under
    a translating IOMMU."""
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
    for first, second in sorted(offered):
        translated = [f"GPU{i} {domains[i]}" for i in (first, second) if domains[i] in _TRANSLATED_DOMAINS]
        if translated:
            yield present(
                f"GPU{first}-GPU{second}",
                Evidence("nvmlDeviceGetP2PStatus", "read and write OK: NCCL will use P2P between these cards"),
                Evidence("/sys/bus/pci/devices/*/iommu_group/type", ", ".join(translated), "identity (iommu=pt) or no IOMMU"),
                cards,
                severity=Severity.WARNING,
            )
