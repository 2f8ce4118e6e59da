"""Link-down history of RDMA ports and retry settings that make a short outage fatal (IB006).

When a link goes down, or retrains, while a queue pair is sending, the HCA retries until its
timeout and retry count run out and then completes the work request with "transport retry
counter exceeded" (status 12, vendor err 129): the job dies although the link is back a moment
later. A port that has gone down since boot is likely to do it again under load, and a job that
shortens NCCL_IB_TIMEOUT or NCCL_IB_RETRY_CNT turns a blip into a failure.

Sources:

* ``/sys/class/infiniband/<dev>/ports/<n>/counters/link_downed`` and ``link_error_recovery``:
  the port's PMA counters (since the driver loaded, or since ``perfquery -R``);
* the kernel log since boot (:mod:`preflight.probes.kernel_log`): the Ethernet drivers' link-down
  messages (mlx5e's and ionic's ``Link down``, ice's ``NIC Link is Down``) for RoCE ports after
  the link was up, matched to the RDMA device by PCI function; the only witness for drivers that
  keep no PMA counters;
* the job's ``NCCL_IB_TIMEOUT`` and ``NCCL_IB_RETRY_CNT``.
"""

from __future__ import annotations

from msgspec import Struct

from preflight.probes.rdma import parse_link_layer
from preflight.probing import FactReader
from preflight.registry import probe
from preflight.sources import NodeFS, SourceError

IB_SYSFS = "/sys/class/infiniband"


class PortHistory(Struct, frozen=True):
    device: str
    port: str
    bus: str  # PCI function of the device, "" for virtual devices
    link_downed: int | None
    link_error_recovery: int | None
    problem: str  # why the counters could not be read, "" when they were
    # ports/<n>/link_layer: "InfiniBand", "Ethernet", or another layer NCCL's IB transport never
    # opens (EFA's "Unknown"/"Unspecified", whose driver keeps no PMA counters); None: unread
    link_layer: str | None = None


class LinkHistoryFacts(Struct, frozen=True):
    ports: tuple[PortHistory, ...]
    unlisted: str = ""  # why the RDMA devices could not be listed, "" when they were


def _counter(reader: FactReader, path: str) -> int | None:
    text = reader.text(path)
    if text is None:
        return None
    try:
        return int(text.strip())
    except ValueError:
        reader.problems.append(f"{path}: not a number ({text.strip()[:40]!r})")
        return None


def _bus(fs: NodeFS, device: str) -> tuple[str, str]:
    """The device's PCI function (``<dev>/device`` names it), or "" and why the link could not be
    read: kept with that device's ports, so the other devices' history still counts."""
    path = f"{IB_SYSFS}/{device}/device"
    try:
        target = fs.readlink(path) or ""
    except SourceError as error:
        return "", f"{path}: {error.reason}"
    return (target.rsplit("/", 1)[-1] if target else ""), ""


@probe("link_history")
def probe_link_history(fs: NodeFS) -> LinkHistoryFacts:
    """The link-down counters of every RDMA port."""
    reader = FactReader(fs)
    ports = []
    devices = reader.listing(IB_SYSFS)
    if devices is None:
        return LinkHistoryFacts((), reader.problems[0])
    for device in devices:
        bus, link_problem = _bus(fs, device)
        numbers = reader.listing(f"{IB_SYSFS}/{device}/ports")
        if numbers is None:
            ports.append(PortHistory(device, "*", bus, None, None, reader.problems[-1]))
            continue
        # Ports are numbered in ASCII digits; anything else in the directory is no port.
        for port in (name for name in numbers if name.isascii() and name.isdigit()):
            # Unread or garbled: None, and the port is judged as before.
            text = FactReader(fs).text(f"{IB_SYSFS}/{device}/ports/{port}/link_layer")
            layer = parse_link_layer(text) if text is not None else None
            if layer == "Unknown":  # the kernel's word for neither InfiniBand nor Ethernet (EFA)
                ports.append(PortHistory(device, port, bus, None, None, "", layer))
                continue  # no counters to read: the kernel makes them for IB and RoCE ports only
            base = f"{IB_SYSFS}/{device}/ports/{port}/counters"
            before = len(reader.problems)
            downed = _counter(reader, f"{base}/link_downed")
            recovered = _counter(reader, f"{base}/link_error_recovery")
            problem = "; ".join(reader.problems[before:])
            if downed is None and not problem and layer == "Ethernet" and _without_counters(fs, f"{IB_SYSFS}/{device}/ports/{port}"):
                # The kernel makes the PMA counters only for drivers with process_mad (add_port() in
                # drivers/infiniband/core/sysfs.c): mlx5 has it, ionic and irdma do not. Their
                # RoCE ports' history is the kernel log's alone.
                ports.append(PortHistory(device, port, bus, None, None, link_problem, layer))
                continue
            if downed is None and not problem:
                problem = f"{base}/link_downed: missing"
            ports.append(PortHistory(device, port, bus, downed, recovered, problem or link_problem, layer))
    return LinkHistoryFacts(tuple(ports))


def _without_counters(fs: NodeFS, port: str) -> bool:
    """Whether the port's directory was listed and holds no ``counters``: a driver's choice, not a
    gap in what was read (an unlisted directory is no answer)."""
    listed = FactReader(fs).listing(port)
    return listed is not None and "counters" not in listed
