"""Installed NCCL releases with known bugs, flagged where this node and job can trigger them
(references NVL005, SOCK002, NCCL018, NCCL013, NVL002, TOPO003).

The releases come from ``preflight.probes.nccl_libs`` (every copy a job could load) and the table
in ``checks/_nccl_releases.py``. A release in a buggy range is only a finding when the node's facts
make the bug reachable: dual-port NICs under NVLS for NVL005, a multi-node NVLink clique and an
unsafe stack limit for NVL002, a non-blocking or split-sharing job for NCCL018, RAS left on for
NCCL013 (as NCCL012 does). Copies whose release the node does not name are ``unknown`` where the
rest of the conditions hold.

The multi-node NVLink fabric comes from the ``fabric`` probe (NVML ``nvmlDeviceGetGpuFabricInfo``:
NCCL enables MNNVL when every rank's fabric state is completed and the cluster UUIDs are non-zero
and equal, ``src/mnnvl.cc``). Sources beyond the other probes (``nccl_platform``):
* ``/proc/self/limits`` ``Max stack size``: glibc sizes new threads' stacks from RLIMIT_STACK, but
  uses 2 MiB when it is unlimited. A Slurm prolog inherits slurmd's limits (Slurm's unit file sets
  ``LimitSTACK=infinity``); the job gets the submitting shell's stack limit unless ``slurm.conf``
  excludes STACK from ``PropagateResourceLimits`` (slurm.conf(5)), in which case it gets slurmd's.
* ``/sys/bus/pci/devices/*/{vendor,class}``: NVSwitches (NVIDIA, class 0x0680, as
  ``preflight.probes.fabric`` finds them, but without waiting on NVML) and GPUs;
  ``/sys/bus/pci/devices/<gpu>/max_link_speed`` and the parent bridge's: NCCL's topology
  detection reads both and logs "could not read ..., ignoring" without them (VMs, passthrough).
"""

from __future__ import annotations

import posixpath

from msgspec import Struct

from preflight.model import (
    Unknown,
)
from preflight.probing import FactReader
from preflight.registry import probe
from preflight.slurm_conf import find_job_slurm_conf
from preflight.slurm_conf import propagated as propagated_limit
from preflight.sources import NodeFS, SourceError
from preflight.units import UNLIMITED, is_number

pass
PCI_DEVICES = "/sys/bus/pci/devices"


_NVIDIA, _GPU_CLASSES, _NVSWITCH_CLASS = "0x10de", ("0x0300", "0x0302"), "0x0680"




class NcclPlatformFacts(Struct, frozen=True):
    """What makes known NCCL bugs reachable on this node, from its files."""

    stack_soft: int | None  # /proc/self/limits "Max stack size" soft, bytes (UNLIMITED)
    slurm_conf: str | None  # the slurm.conf read
    stack_propagated: bool | None  # whether slurm.conf lets the submitting shell's STACK through
    propagation_setting: str  # the deciding slurm.conf line
    nvswitches: tuple[str, ...]  # NVIDIA bridges of class 0x0680 in /sys/bus/pci/devices (NVLS-capable)
    pci_gpus: tuple[str, ...]  # NVIDIA display/3D functions in /sys/bus/pci/devices
    gpus_without_link_speed: tuple[str, ...]  # those with no max_link_speed (own or parent's)
    problems: tuple[str, ...]
    # PCI functions whose vendor or class could not be read: any of them may be a GPU or NVSwitch.
    unclassified: tuple[str, ...] = ()

    def require_classified(self, missing: str) -> None:
        """Unknown rather than "no such device" when ``missing`` may hide among unreadable functions."""
        if self.unclassified:
            raise Unknown(f"{missing} among the classified PCI functions, but {len(self.unclassified)} could not be "
                          f"classified (vendor or class unreadable), e.g. {self.unclassified[0]}")


def parse_stack_limit(text: str) -> int | None:
    """Soft ``Max stack size`` of ``/proc/<pid>/limits`` in bytes (``UNLIMITED`` for unlimited)."""
    for line in text.splitlines():
        if line.startswith("Max stack size"):
            fields = line[len("Max stack size"):].split()
            if fields and (fields[0] == "unlimited" or is_number(fields[0])):
                return UNLIMITED if fields[0] == "unlimited" else int(fields[0])
    return None


def _nvidia_functions(fs: NodeFS, reader: FactReader) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """NVSwitches and GPUs on the PCI bus, the GPUs whose own or parent's ``max_link_speed`` is
    missing (NCCL reads both), and the functions that could not be classified. Read from sysfs,
    not NVML, so a wedged driver holds none of it."""
    switches, gpus, missing, unclassified = [], [], [], []
    listed = reader.listing(PCI_DEVICES)
    if listed is None:
        unclassified.append(PCI_DEVICES)  # the whole bus: nothing is known to be absent
    for bdf in listed or []:
        base = f"{PCI_DEVICES}/{bdf}"
        known_problems = len(reader.problems)
        vendor = (reader.text(f"{base}/vendor") or "").strip()
        klass = (reader.text(f"{base}/class") or "").strip() if vendor in (_NVIDIA, "") else ""
        if len(reader.problems) > known_problems:
            unclassified.append(bdf)
            continue
        if vendor != _NVIDIA:
            continue
        if klass.startswith(_NVSWITCH_CLASS):
            switches.append(bdf)
        if not klass.startswith(_GPU_CLASSES):
            continue
        gpus.append(bdf)
        try:
            target = fs.readlink(base)
        except SourceError as error:
            reader.problems.append(str(error))
            continue
        # The parent is the bridge above the function in /sys/devices; paths are normalised
        # lexically, so ".." must be taken off the resolved link, not off the bus directory.
        real = posixpath.normpath(posixpath.join(PCI_DEVICES, target)) if target else base
        speeds = {reader.presence(f"{real}/max_link_speed"), reader.presence(f"{posixpath.dirname(real)}/max_link_speed")}
        if None in speeds:
            unclassified.append(bdf)  # not captured or unreadable: not known to be missing
        elif False in speeds:
            missing.append(bdf)
    return tuple(switches), tuple(gpus), tuple(missing), tuple(unclassified)


@probe("nccl_platform", gather_in=("full",))
def probe_nccl_platform(fs: NodeFS) -> NcclPlatformFacts:
    """The stack limit NCCL's threads will get, and GPUs without PCI link speeds."""
    reader = FactReader(fs)
    limits = reader.text("/proc/self/limits")
    nvswitches, pci_gpus, without_link_speed, unclassified = _nvidia_functions(fs, reader)
    conf, conf_problems = find_job_slurm_conf(fs)
    reader.problems.extend(conf_problems)
    propagated, setting = propagated_limit(conf, "STACK") if conf is not None else (None, "")
    slurm_conf = conf.path if conf is not None else None
    return NcclPlatformFacts(
        stack_soft=parse_stack_limit(limits) if limits else None,
        slurm_conf=slurm_conf,
        stack_propagated=propagated,
        propagation_setting=setting,
        nvswitches=nvswitches,
        pci_gpus=pci_gpus,
        unclassified=unclassified,
        gpus_without_link_speed=without_link_speed,
        problems=tuple(reader.problems),
    )


# -- helpers ------------------------------------------------------------------------------------
