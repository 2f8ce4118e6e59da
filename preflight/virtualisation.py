"""Whether the node is a virtual machine, and what said so.

In a guest the PCIe bridges, their ACS bits and the IOMMU that sysfs shows are emulated; the
host's decide where GPU and NIC traffic goes. The sources, read in the order
systemd-detect-virt reads them (``src/basic/virt.c``):

* the ``hypervisor`` CPU flag in ``/proc/cpuinfo`` (x86 CPUID leaf 1, ECX bit 31), which
  hypervisors set for their guests. A hypervisor can hide it (QEMU's ``-cpu ...,-hypervisor``,
  used to pass GPUs through to guests whose old drivers refused to run in a VM), so its absence
  is weighed only after the other sources found no hypervisor;
* a ``hypervisor`` node in the device tree (Arm, POWER, RISC-V guests of KVM or Xen:
  ``/sys/firmware/devicetree/base/hypervisor``, which ``/proc/device-tree`` links to);
* DMI strings (``/sys/class/dmi/id``: product name, system, board and BIOS vendor, product
  version) that start with a name hypervisors give their guests. ``Amazon EC2`` names AWS's
  virtual machines and its bare-metal ``.metal`` instances alike: the product name tells them
  apart. Azure's Hyper-V guests say ``Microsoft Corporation`` / ``Virtual Machine``;
* devices on Hyper-V's VMBus (``/sys/bus/vmbus/devices``), which only a Hyper-V guest's kernel
  enumerates: Azure's Arm guests may give no DMI strings, and their GPUs and NICs hang off VMBus;
* SMBIOS's "system is a virtual machine" bit (bit 4 of the BIOS characteristics extension byte 2,
  DMTF DSP0134), in ``/sys/firmware/dmi/entries/0-0/raw``, readable by root only. Set, it is
  a guest; clear proves nothing (QEMU with SeaBIOS leaves it clear).

Bare metal is concluded only from what was read: CPU flags without ``hypervisor``, or, on CPUs
whose ``/proc/cpuinfo`` lists no flags (Arm), DMI that names no hypervisor. With neither (a
capture without ``/proc/cpuinfo`` and DMI) the answer is unknown, never "bare metal".
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from msgspec import Struct

from preflight.sources import SourceError

if TYPE_CHECKING:
    from preflight.sources import NodeFS

DMI_FILES = ("product_name", "sys_vendor", "board_vendor", "bios_vendor", "product_version")
# Leading words of the DMI strings hypervisors give their guests (systemd's dmi_vendor_table,
# less "Oracle Corporation": it names VirtualBox boards and Oracle's own bare-metal servers alike).
GUEST_DMI_PREFIXES = (
    "KVM", "OpenStack", "KubeVirt", "QEMU", "VMware", "VMW", "innotek GmbH", "VirtualBox",
    "Xen", "Bochs", "Parallels", "BHYVE", "Hyper-V", "Apple Virtualization", "Google Compute Engine",
)
DMI_STRING_MAX = 256  # SMBIOS strings are short; a planted huge file is cut, not read whole
AMAZON = "Amazon EC2"
SMBIOS_TYPE0 = "/sys/firmware/dmi/entries/0-0/raw"
SMBIOS_VM_BYTE = 0x13  # BIOS characteristics extension byte 2
SMBIOS_VM_BIT = 1 << 4
DEVICE_TREE_HYPERVISOR = "/sys/firmware/devicetree/base/hypervisor"
#: Devices on Hyper-V's VMBus, which only a Hyper-V guest's kernel (hv_vmbus) enumerates; Azure's
#: GPUs and NICs hang off it through the vPCI bridge (pci-hyperv), on Arm guests too.
VMBUS_DEVICES = "/sys/bus/vmbus/devices"


class Virtualisation(Struct, frozen=True):
    guest: bool | None  # None: not known (``evidence`` says what was missing)
    evidence: str


def detect(fs: NodeFS, cpuinfo: str | None) -> Virtualisation:
    """Whether the node is a guest, from ``cpuinfo`` (``None``: unread) and the sources above.
    Unreadable DMI and device-tree files count as unread, never as a problem: most captures and
    many machines have none."""
    flags = _cpu_flags(cpuinfo)
    if flags is not None and "hypervisor" in flags:
        return Virtualisation(True, "the 'hypervisor' CPU flag in /proc/cpuinfo")
    compatible = _read(fs, f"{DEVICE_TREE_HYPERVISOR}/compatible")
    if compatible is not None:
        shown = compatible.replace(b"\0", b" ").decode("utf-8", "replace").strip()
        return Virtualisation(True, f"a hypervisor node in the device tree ({shown or 'empty compatible string'})")
    dmi = {name: text for name in DMI_FILES if (text := _dmi_string(fs, name))}
    guest_dmi = _guest_dmi(dmi)
    if guest_dmi is not None:
        return guest_dmi
    vmbus = _listing(fs, VMBUS_DEVICES)
    if vmbus:
        return Virtualisation(True, f"Hyper-V VMBus devices in {VMBUS_DEVICES} ({len(vmbus)})")
    raw = _read(fs, SMBIOS_TYPE0)
    if raw is not None and len(raw) > SMBIOS_VM_BYTE and raw[1] > SMBIOS_VM_BYTE and raw[SMBIOS_VM_BYTE] & SMBIOS_VM_BIT:
        return Virtualisation(True, f"the SMBIOS virtual-machine bit in {SMBIOS_TYPE0}")
    if flags is not None:
        return Virtualisation(False, "no 'hypervisor' flag among the CPU flags in /proc/cpuinfo" + _named(dmi))
    if dmi:
        return Virtualisation(False, "DMI names no hypervisor" + _named(dmi))
    why = "/proc/cpuinfo unread" if cpuinfo is None else "/proc/cpuinfo lists no CPU flags (not x86)"
    return Virtualisation(None, f"{why} and no DMI strings in /sys/class/dmi/id")


def _cpu_flags(cpuinfo: str | None) -> set[str] | None:
    """The first CPU's flags (x86 lists them); None where cpuinfo is unread or has no flags line."""
    for line in (cpuinfo or "").splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return None


def _listing(fs: NodeFS, path: str) -> list[str]:
    """A directory's entries; empty when absent, unreadable or not captured."""
    try:
        return fs.listdir(path) or []
    except SourceError:
        return []


def _read(fs: NodeFS, path: str, max_bytes: int = 64) -> bytes | None:
    """A small file's first bytes; None when absent, unreadable or not captured (root-only
    SMBIOS tables, DMI on boards without it)."""
    try:
        return fs.read_bytes(path, max_bytes=max_bytes)
    except SourceError:
        return None


def _dmi_string(fs: NodeFS, name: str) -> str:
    """One DMI string, "" where the node has none (many Arm boards) or it is unread."""
    raw = _read(fs, f"/sys/class/dmi/id/{name}", DMI_STRING_MAX)
    return raw.decode("utf-8", "replace").strip() if raw else ""


def _guest_dmi(dmi: dict[str, str]) -> Virtualisation | None:
    """A guest's DMI, or None where the strings name no hypervisor (or AWS bare metal)."""
    product = dmi.get("product_name", "")
    if dmi.get("sys_vendor", "").startswith("Microsoft Corporation") and product.startswith("Virtual Machine"):
        return Virtualisation(True, "DMI: Microsoft Corporation 'Virtual Machine' (a Hyper-V guest)")
    for name, text in dmi.items():
        if text.startswith(AMAZON):
            if ".metal" in product:
                return None  # an EC2 bare-metal instance: the other sources decide
            return Virtualisation(True, f"DMI {name} '{text}' with product '{product}' (an EC2 instance that is not .metal)")
        prefix = next((prefix for prefix in GUEST_DMI_PREFIXES if text.startswith(prefix)), None)
        if prefix is not None:
            return Virtualisation(True, f"DMI {name} '{text}'")
    return None


def _named(dmi: dict[str, str]) -> str:
    names = [dmi[name] for name in ("sys_vendor", "product_name") if dmi.get(name)]
    return f" ({' / '.join(names)})" if names else ""
