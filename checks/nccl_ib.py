"""Which RDMA ports NCCL's IB transport would use on this node (references IB003, IB004, IB005).

NCCL's rules (``src/transport/net_ib/init.cc`` ``ncclIbInitDevices``, ``src/misc/utils.cc``
``parseStringList``/``matchIfList``, NCCL 2.30):

* ``NCCL_IB_HCA`` (environment, then the NCCL configuration files; see ``preflight.checks.job``):
  a leading ``^`` excludes the listed devices; after it, a leading ``=`` makes names exact;
  otherwise every name is a *prefix* (``strncmp`` over the entry's length), so ``mlx5_1`` also
  selects ``mlx5_10``. Entries are split at commas (empty ones dropped) and read as
  ``name[:port[:rail[:plane]]]`` with ``atoi`` for the port (``mlx5_0:x`` asks for port 0, which
  no device has). Nothing is trimmed: ``mlx5_0, mlx5_1`` names ``" mlx5_1"``. An empty list
  selects everything, so ``^`` alone excludes everything.
* Only ports whose state is ACTIVE and whose link layer is InfiniBand or Ethernet are kept (EFA's
  ``Unknown`` link layer is the aws-ofi-nccl plugin's business).
* Device order: since 2.29.7 NCCL sorts its devices by PCI address unless
  ``NCCL_IB_DEVICE_PCI_ORDER=0``; earlier releases number them as libibverbs lists them, which
  follows the kernel's registration order, the order that ``mlx5_<N>`` names are handed out in.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

from preflight.checks.job import JobFacts, Setting
from preflight.checks.rdma import (
    IB_CLASS,
    PORT_ACTIVE,
    RdmaDevice,
    RdmaFacts,
    RdmaPort,
    natural_key,
    port_evidence,
    ports_unlisted,
    require_rdma,
)
from preflight.model import Evidence, NotApplicable, Observation, Severity, Unknown, present, undecided
from preflight.records import frozen
from preflight.registry import check

NCCL_LINK_LAYERS = ("InfiniBand", "Ethernet")
_ATOI = re.compile(r"^\s*([+-]?\d+)")
RAIL_NIC_COUNTS = "2, 4 or 8 NICs, identical on every node"


@frozen
class HcaEntry:
    """One ``NCCL_IB_HCA`` entry."""

    text: str  # as written: "mlx5_1:1"
    name: str  # "mlx5_1"
    port: int | None  # None: any port


@frozen
class HcaList:
    """``NCCL_IB_HCA`` as NCCL parses it."""

    exclude: bool  # leading "^"
    exact: bool  # leading "=" (after any "^")
    entries: tuple[HcaEntry, ...]

    def entry_matches(self, entry: HcaEntry, device: str, port: int) -> bool:
        name_ok = device == entry.name if self.exact else device.startswith(entry.name)
        return name_ok and (entry.port is None or entry.port == port)

    def selects(self, device: str, port: int) -> bool:
        listed = not self.entries or any(self.entry_matches(entry, device, port) for entry in self.entries)
        return listed != self.exclude


def _atoi(text: str) -> int:
    match = _ATOI.match(text)
    return int(match.group(1)) if match else 0


def parse_nccl_ib_hca(value: str | None) -> HcaList:
    """Parse ``NCCL_IB_HCA`` the way NCCL does; ``None`` (unset) selects everything."""
    text = value or ""
    exclude = text.startswith("^")
    text = text[1:] if exclude else text
    exact = text.startswith("=")
    text = text[1:] if exact else text
    entries = []
    for item in text.split(","):
        name, _, rest = item.partition(":")
        if not name:
            continue
        port_text = rest.split(":", 1)[0]
        entries.append(HcaEntry(item, name, _atoi(port_text) if port_text else None))
    return HcaList(exclude, exact, tuple(entries))


@frozen
class Selection:
    """What NCCL's IB transport would open on this node."""

    setting: Setting | None  # NCCL_IB_HCA and where it came from
    hca: HcaList
    ports: tuple[RdmaPort, ...]  # kept ports, in device order
    undecided: tuple[RdmaPort, ...]  # listed ports whose state or link layer is unknown
    unlisted: tuple[str, ...] = ()  # "path: reason" of selected devices whose ports are unknown

    @property
    def devices(self) -> list[str]:
        return list(dict.fromkeys(port.device for port in self.ports))

    def describe(self) -> str:
        return ", ".join(f"{port.subject} {port.link_layer}" for port in self.ports) or "nothing"


def nccl_selection(rdma: RdmaFacts, job: JobFacts) -> Selection:
    setting = job.nccl("NCCL_IB_HCA")
    hca = parse_nccl_ib_hca(setting.value if setting else None)
    kept, unknown, unlisted = [], [], []
    for device in rdma.devices:
        problem = ports_unlisted(device)
        if problem is not None and (hca.exclude or not hca.entries or any(device.name.startswith(e.name.strip()) for e in hca.entries)):
            unlisted.append(str(problem))
        for port in device.ports:
            if not hca.selects(device.name, port.number):
                continue
            if port.state is None or port.link_layer is None:
                unknown.append(port)
            elif port.state == PORT_ACTIVE and port.link_layer in NCCL_LINK_LAYERS:
                kept.append(port)
    return Selection(setting, hca, tuple(kept), tuple(unknown), tuple(unlisted))


def _selected_devices(rdma: RdmaFacts, selection: Selection) -> list[RdmaDevice]:
    names = set(selection.devices)
    return [device for device in rdma.devices if device.name in names]


def require_ib_transport(rdma: RdmaFacts) -> None:
    """NotApplicable when no port could ever be NCCL's (EFA-only or soft devices)."""
    require_rdma(rdma)
    ports = [port for device in rdma.devices for port in device.ports]
    unlisted = [problem for device in rdma.devices if (problem := ports_unlisted(device)) is not None]
    if unlisted and not ports:
        raise Unknown(str(unlisted[0]))
    if not any(port.link_layer in NCCL_LINK_LAYERS or port.link_layer is None for port in ports):
        raise NotApplicable("no InfiniBand or RoCE ports; NCCL's IB transport does not use them")


def _decided(selection: Selection) -> None:
    if selection.unlisted:
        raise Unknown(selection.unlisted[0])
    if selection.undecided:
        port = selection.undecided[0]
        raise Unknown(port.why("state" if port.state is None else "link_layer"))


def _setting_evidence(setting: Setting | None, expected: str = "") -> Evidence:
    if setting is None:
        return Evidence("NCCL_IB_HCA", "unset (every device)", expected)
    where = "/proc/self/environ" if setting.origin == "environment" else setting.origin
    return Evidence(f"{where} NCCL_IB_HCA", repr(setting.value), expected)


# -- IB004 ------------------------------------------------------------------------------------
def accidental_prefix(entry: HcaEntry, device: str) -> bool:
    """``mlx5_1`` matching ``mlx5_10``: the prefix ends inside a number. ``mlx5`` matching
    ``mlx5_0`` is a deliberate family prefix."""
    return (
        len(device) > len(entry.name)
        and device.startswith(entry.name)
        and entry.name[-1:].isdigit()
        and device[len(entry.name)].isdigit()
    )


def _unmatched_note(entry: HcaEntry) -> str:
    if entry.name != entry.name.strip():
        return "; NCCL does not trim spaces"
    if entry.name[:1] in ("^", "="):
        return "; '^' must come first ('^=name'), anything later is part of the name"
    return ""


def _entry_findings(rdma: RdmaFacts, selection: Selection) -> Iterator[Observation]:
    hca = selection.hca
    for entry in hca.entries:
        matched = [
            device
            for device in rdma.devices
            if any(hca.entry_matches(entry, device.name, port.number) for port in device.ports)
        ]
        subject = f"NCCL_IB_HCA {entry.text!r}"
        if not matched and selection.unlisted:
            yield undecided(subject, f"no device with listed ports matches, and {selection.unlisted[0]}")
            continue
        if not matched:
            names = ", ".join(device.name for device in rdma.devices)
            yield present(
                subject,
                _setting_evidence(selection.setting),
                Evidence(IB_CLASS, f"no device{' port' if entry.port is not None else ''} matches {entry.text!r}{_unmatched_note(entry)} (devices: {names})"),
                severity=Severity.WARNING,
            )
            continue
        extra = [device.name for device in matched if not hca.exact and accidental_prefix(entry, device.name)]
        if extra:
            verb = "also excludes" if hca.exclude else "also selects"
            yield present(
                subject,
                _setting_evidence(selection.setting, f"exact names: {'^' if hca.exclude else ''}={','.join(e.text.strip() for e in hca.entries)}"),
                Evidence(IB_CLASS, f"prefix {entry.name!r} {verb} {', '.join(extra)}"),
            )
        if not hca.exclude:
            yield from _listed_but_down(hca, entry, matched, selection)


def _listed_but_down(hca: HcaList, entry: HcaEntry, matched: list[RdmaDevice], selection: Selection) -> Iterator[Observation]:
    """Ports an entry names outright (``mlx5_3``, ``mlx5_3:1``) that NCCL will skip; a family
    prefix such as ``mlx5`` names no port in particular."""
    for device in matched:
        if device.name != entry.name:
            continue
        for port in device.ports:
            if hca.entry_matches(entry, device.name, port.number) and port.state is not None and port.state != PORT_ACTIVE:
                yield present(
                    port.subject,
                    _setting_evidence(selection.setting),
                    port_evidence(port, "state", "phys_state", expected="4: ACTIVE (NCCL skips other ports)"),
                )


def _mixed_and_management(rdma: RdmaFacts, selection: Selection, severity: Severity | None) -> Iterator[Observation]:
    layers = sorted({port.link_layer or "?" for port in selection.ports})
    if len(layers) > 1:
        yield present(
            "NCCL IB selection",
            _setting_evidence(selection.setting, "one link layer (NCCL 2.26 and later refuse IB/RoCE mixes)"),
            Evidence(IB_CLASS, selection.describe()),
            severity=severity,
        )
    management = [device.name for device in _selected_devices(rdma, selection) if device.nvswitch_management]
    if management:
        yield present(
            "NCCL IB selection",
            _setting_evidence(selection.setting, "data NICs only"),
            Evidence(f"{IB_CLASS}/*/device/vpd", f"{', '.join(management)}: NVSwitch management function (SMDL=SW_MNG)"),
            severity=Severity.WARNING,
        )


@check("IB004", profiles=("prolog",))
def ib_hca_selection_mismatch(rdma: RdmaFacts, job: JobFacts) -> Iterator[Observation]:
    """NCCL_IB_HCA entries that match nothing or too much, an empty or mixed selection."""
    require_ib_transport(rdma)
    selection = nccl_selection(rdma, job)
    for port in selection.undecided:
        yield undecided(port.subject, port.why("state" if port.state is None else "link_layer"))
    for problem in selection.unlisted:
        yield undecided(problem.split(": ", 1)[0], problem)
    if selection.setting is None:
        yield from _mixed_and_management(rdma, selection, Severity.WARNING)
        return
    yield from _entry_findings(rdma, selection)
    if not selection.ports and not selection.undecided and not selection.unlisted:
        yield present(
            "NCCL_IB_HCA",
            _setting_evidence(selection.setting, "at least one ACTIVE InfiniBand or RoCE port"),
            Evidence(IB_CLASS, "selects nothing: NCCL logs 'NET/IB : No device found.' and falls back to sockets"),
        )
    yield from _mixed_and_management(rdma, selection, None)


# -- IB003 ------------------------------------------------------------------------------------
@check("IB003", profiles=("prolog",))
def ib_odd_nic_count_rail_hang(rdma: RdmaFacts, job: JobFacts) -> Iterator[Observation]:
    """NCCL would use exactly three IB/RoCE ports on this node."""
    require_ib_transport(rdma)
    selection = nccl_selection(rdma, job)
    _decided(selection)
    if len(selection.ports) == 3:
        yield present(
            "node",
            _setting_evidence(selection.setting),
            Evidence(f"{IB_CLASS}/*/ports/*/{{state,link_layer}}", f"NCCL would use 3: {selection.describe()}", RAIL_NIC_COUNTS),
            severity=Severity.WARNING,
        )


# -- IB005 ------------------------------------------------------------------------------------
def pci_key(address: str) -> tuple[int, ...]:
    """``0000:1a:00.0`` -> ``(0, 26, 0, 0)``."""
    return tuple(int(part, 16) for part in re.split(r"[:.]", address))


def _pci_order_setting(job: JobFacts) -> tuple[Setting | None, bool]:
    """NCCL_IB_DEVICE_PCI_ORDER and whether it asks for PCI order (NCCL_PARAM: integer, default 1)."""
    setting = job.nccl("NCCL_IB_DEVICE_PCI_ORDER")
    if setting is None:
        return None, True
    try:
        return setting, int(setting.value.strip(), 0) != 0
    except ValueError:
        return setting, True  # NCCL warns and keeps the default


@check("IB005", profiles=("prolog",))
def ib_device_order_differs_across_nodes(rdma: RdmaFacts, job: JobFacts) -> Iterator[Observation]:
    """The RDMA devices NCCL uses are not numbered in PCI address order."""
    require_ib_transport(rdma)
    selection = nccl_selection(rdma, job)
    _decided(selection)
    setting, pci_order = _pci_order_setting(job)
    if setting is not None and pci_order:
        return  # the job asks NCCL (2.29.7 and later) to sort by PCI address
    devices = _selected_devices(rdma, selection)
    unreadable = [p for device in devices for p in device.problems if p.path == f"{device.path}/device"]
    if unreadable:
        raise Unknown(str(unreadable[0]))
    located = [device for device in devices if device.pci_address is not None]
    by_name = sorted(located, key=lambda device: natural_key(device.name))
    by_pci = sorted(located, key=lambda device: pci_key(device.pci_address or ""))
    if [d.name for d in by_name] == [d.name for d in by_pci]:
        return
    if setting is None:
        order = Evidence("NCCL_IB_DEVICE_PCI_ORDER", "unset: NCCL 2.29.7 and later sort by PCI address, earlier releases do not")
    else:
        where = "/proc/self/environ" if setting.origin == "environment" else setting.origin
        order = Evidence(f"{where} NCCL_IB_DEVICE_PCI_ORDER", repr(setting.value), "1 (sort devices by PCI address)")
    yield present(
        "node",
        Evidence(
            f"{IB_CLASS}/*/device",
            "; ".join(f"{d.name} {d.pci_address}" for d in by_name),
            "names numbered in PCI address order: " + ", ".join(d.name for d in by_pci),
        ),
        order,
        severity=Severity.WARNING if setting is None else None,
    )
