"""Active NVLinks per GPU: a GPU with links down leaves NCCL no NVLink ring (NVL003).

NCCL's graph search looks for channels that visit every GPU over NVLink. When one GPU has lost
links the NVLink graph is lopsided, the search for a pattern can fail outright, and NCCL falls
back to one channel in PCI order ("Could not find a path for pattern 4, falling back to simple
order"), which stalls or crawls.

Sources:

* NVML ``nvmlDeviceGetCount`` and, per device, ``nvmlDeviceGetName`` and
  ``nvmlDeviceGetNvLinkState(handle, link)`` for link 0 to ``NVML_NVLINK_MAX_LINKS - 1`` (36 in
  nvidia-ml-py 13): 1 is active, 0 inactive. A link number the GPU does not have answers
  ``NVML_ERROR_INVALID_ARGUMENT``; a GPU without NVLink answers ``NVML_ERROR_NOT_SUPPORTED``.
  An H100/H200 SXM has 18 links, an A100 SXM 12, a GB200 GPU 18 (``nvidia-smi nvlink --status``).

The facts keep each GPU's active count: the fleet report compares them across nodes.
"""

from __future__ import annotations

from msgspec import Struct

from preflight.model import (
    NotApplicable,
    Unknown,
)
from preflight.probes.gpus import GpuFacts
from preflight.registry import probe
from preflight.sources.nvml import UNANSWERED, Nvml, NvmlError

NVLINK_MAX_LINKS = 36  # NVML_NVLINK_MAX_LINKS in nvidia-ml-py 13.x (nvml.h)


# Answers that mean "this GPU has no link with that number", not "the query failed".
NO_SUCH_LINK = frozenset({"NVML_ERROR_INVALID_ARGUMENT", "NVML_ERROR_NOT_SUPPORTED"})


_ACTIVE, _INACTIVE = 1, 0  # nvmlEnableState_t


class GpuNvlinks(Struct, frozen=True):
    index: int
    name: str | None  # nvmlDeviceGetName; None when it failed
    links: tuple[int, ...]  # link numbers the GPU has (answered active or inactive)
    active: tuple[int, ...]  # link numbers nvmlDeviceGetNvLinkState reports active
    active_count: int | None  # len(active); None when a link query failed (count not known)
    error: str  # "NVML_ERROR_X (link N)" of the first failed link query, "" when all answered


class NvlinkFacts(Struct, frozen=True):
    gpus: tuple[GpuNvlinks, ...]
    nvml_error: str  # NVML_ERROR_* of nvmlInit / nvmlDeviceGetCount, "" when NVML answered
    nvml_detail: str


def _gpu_links(nvml: Nvml, index: int) -> GpuNvlinks:
    try:
        name = nvml.call("nvmlDeviceGetName", index)
    except NvmlError:
        name = None
    links: list[int] = []
    active: list[int] = []
    for link in range(NVLINK_MAX_LINKS):
        try:
            state = nvml.call("nvmlDeviceGetNvLinkState", index, link)
        except NvmlError as failure:
            if failure.code in NO_SUCH_LINK:
                continue
            # A lost GPU or a wedged driver fails every further link the same way.
            return GpuNvlinks(index, _text(name), tuple(links), tuple(active), None, f"{failure.code} (link {link})")
        if state not in (_ACTIVE, _INACTIVE):
            return GpuNvlinks(index, _text(name), tuple(links), tuple(active), None, f"unexpected answer {state!r} (link {link})")
        links.append(link)
        if state == _ACTIVE:
            active.append(link)
    return GpuNvlinks(index, _text(name), tuple(links), tuple(active), len(active), "")


def _text(value: object) -> str | None:
    return value if isinstance(value, str) else None


@probe("nvlink")
def probe_nvlink(nvml: Nvml) -> NvlinkFacts:
    """Each GPU's NVLinks and which of them are active."""
    try:
        count = nvml.call("nvmlDeviceGetCount")
    except NvmlError as error:
        return NvlinkFacts((), error.code, str(error))
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        return NvlinkFacts((), "NVML_ERROR_UNKNOWN", f"device count {count!r}")
    return NvlinkFacts(tuple(_gpu_links(nvml, index) for index in range(count)), "", "")


def require_nvml(nvml_error: str, nvml_detail: str, gpus: GpuFacts, what: str) -> None:
    """Raise NotApplicable on a node without NVIDIA GPUs, Unknown when NVML could not answer."""
    if nvml_error in UNANSWERED:  # no recording, or a broken one
        raise Unknown(nvml_detail or f"no NVML answers recorded for this root ({nvml_error})")
    if nvml_error:
        if not gpus.pci_gpus and gpus.problems:
            raise Unknown(f"NVML unavailable ({nvml_error}) and the PCI bus not fully read: {gpus.problems[0]}")
        if not gpus.pci_gpus:
            raise NotApplicable(f"no NVIDIA GPU on the PCI bus and NVML unavailable ({nvml_error})")
        raise Unknown(f"NVML unavailable ({nvml_error}); {what} cannot be read")
