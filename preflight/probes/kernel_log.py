"""The kernel log since boot, read once and shared: hardware Xid events of the NVIDIA driver
(GPU002), link-downs of mlx5 Ethernet/RoCE ports (IB006), mlx5 lossless-buffer setup errors
(ROCE001) and IPoIB multicast joins the subnet administrator refused (IB008).

Source: ``NodeFS.read_kernel_log`` - ``/dev/kmsg`` on a live node (root where
``kernel.dmesg_restrict`` is set), ``.preflight/kmsg`` in a recorded root. Message formats:
``NVRM: Xid (PCI:0000:5d:00): 79, pid=..., GPU has fallen off the bus.`` (the NVIDIA driver) and
mlx5e's ``netdev_info(priv->netdev, "Link down\n")`` in ``mlx5e_update_carrier``
(``drivers/net/ethernet/mellanox/mlx5/core/en_main.c``), which the kernel prints as
``mlx5_core 0000:c1:00.0 ens1f0np0: Link down``. IPoIB's ``ipoib_warn(priv, "multicast join failed
for %pI6, status %d
", ...)`` in ``ipoib_mcast_join_complete``
(``drivers/infiniband/ulp/ipoib/ipoib_multicast.c``) is printed with the interface name first:
``ib0: multicast join failed for ff12:401b:ffff:0000:0000:0000:ffff:ffff, status -22``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

from msgspec import Struct

from preflight.model import Observation, undecided
from preflight.registry import probe
from preflight.sources import NodeFS, SourceError

# pr_err() in update_xoff_threshold() (mlx5/core/en/port_buffer.c): a lossless priority's port
# buffer cannot hold the xoff threshold plus one MTU, so the PFC setup the site asked for failed.
_LOSSLESS_BUFFER = re.compile(r"buffer[_ ]size(?:\[\d\]=| )\d+ is not enough for lossless buffer")


# netdev_info()'s "<driver> <bdf> <netdev>: <text>" for a RoCE port's link going down: mlx5e
# (mlx5e_update_carrier), ionic (ionic_link_status_check) and ice (ice_print_link_msg).
_CARRIER = r"(?:mlx5_core|ionic|ice) (?P<bus>[0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.\d) (?P<netdev>[\w.-]{1,15}): (?:NIC )?Link (?:is )?"
_LINK_DOWN = re.compile(_CARRIER + "[Dd]own")
_LINK_UP = re.compile(_CARRIER + "[Uu]p")


_JOIN_FAILED = re.compile(
    r"(?P<netdev>[\w.-]{1,15}): multicast join failed for (?P<group>[0-9a-fA-F:]{2,39}), status (?P<status>-?\d{1,4})"
)


# On a GPU in MIG mode the driver adds the GPU instance (and compute instance) an error is
# attributed to: "NVRM: Xid (PCI:0000:01:00 GPU-I:05): 94, pid=7194, Contained: ..." (NVIDIA's
# open-gpu-kernel-modules, src/nvidia/src/kernel/gpu/arch/ampere/kern_gpu_error_cont_ga100.c).
_XID = re.compile(r"NVRM: Xid \(PCI:(?P<bus>[0-9A-Fa-f:.]{7,16})(?: GPU-I:\d{1,3}(?: GPU-CI:\d{1,3})?)?\): (?P<code>\d{1,3}),(?P<rest>.{0,200})")


# Hardware and driver Xids (NVIDIA's Xid catalogue, docs.nvidia.com/deploy/xid-errors):
# ECC and row remapping, fallen off the bus, NVLink, GSP and other firmware faults.
HARDWARE_XIDS = {
    48: "double-bit ECC error", 63: "row remapping event", 64: "row remapping failure", 74: "NVLink error",
    79: "GPU has fallen off the bus", 92: "high single-bit ECC error rate", 94: "contained ECC error",
    95: "uncontained ECC error", 119: "GSP RPC timeout", 120: "GSP error",
}


class XidEvent(Struct, frozen=True):
    bus: str  # as the driver prints it, e.g. 0000:5d:00
    code: int
    text: str


class LinkEvent(Struct, frozen=True):
    bus: str  # PCI function of the NIC, e.g. 0000:c1:00.0
    netdev: str
    text: str


class JoinFailure(Struct, frozen=True):
    """An IPoIB multicast group join the subnet administrator did not grant."""

    netdev: str
    group: str  # the multicast GID; ff12:401b:ffff::ffff:ffff... is the IPoIB broadcast group
    status: int  # negative errno: -22 (EINVAL) rejected, -110 (ETIMEDOUT) no answer
    text: str


class KernelLogFacts(Struct, frozen=True):
    xids: tuple[XidEvent, ...]
    link_downs: tuple[LinkEvent, ...]
    lossless_buffer_errors: tuple[str, ...]
    error: str  # why the kernel log could not be read or is not there, "" when it was read
    read: bool  # whether any log was read at all
    join_failures: tuple[JoinFailure, ...] = ()
    # IPoIB interfaces with join failures that are up now (operstate): IPoIB turns carrier on only
    # once the broadcast group is joined, so the subnet administrator granted a later retry
    joined_since: tuple[str, ...] = ()

    def unread(self, history: str, subject: str = "kernel log") -> Iterator[Observation]:
        """The undecided half of a check whose ``history`` since boot only this log shows, when it
        could not be read or is not there: a log not read is no quiet one."""
        if self.error:
            yield undecided(subject, f"{history} since boot unread: {self.error}")


NOT_READ = KernelLogFacts((), (), (), "", False)


def parse_xids(records: list[str]) -> tuple[XidEvent, ...]:
    """Xid events in kernel log records (``pri,seq,usec,flags;message`` or plain lines)."""
    found = []
    for record in records:
        if "Xid" not in record:
            continue
        match = _XID.search(record)
        if match:
            found.append(XidEvent(match.group("bus").lower(), int(match.group("code")), record.split(";", 1)[-1][:300]))
    return tuple(found)


def parse_link_downs(records: list[str]) -> tuple[LinkEvent, ...]:
    """RoCE NICs' carrier messages (``mlx5_core 0000:c1:00.0 ens1f0np0: Link down``, ionic's alike,
    ``ice 0000:1a:00.0 ens26f0: NIC Link is Down``) for links that were up before: mlx5e reports
    the carrier each time an interface opens (mlx5e_update_carrier prints either word), so a boot
    logs "Link down" for every port before it trains, and that is no flap."""
    found = []
    was_up: set[tuple[str, str]] = set()
    for record in records:
        if "Link" not in record:  # a cheap test before the expressions
            continue
        match = _LINK_DOWN.search(record)
        if match:
            key = (match.group("bus").lower(), match.group("netdev"))
            if key in was_up:
                found.append(LinkEvent(*key, record.split(";", 1)[-1][:300]))
                was_up.discard(key)
            continue
        match = _LINK_UP.search(record)
        if match:
            was_up.add((match.group("bus").lower(), match.group("netdev")))
    return tuple(found)


def parse_join_failures(records: list[str]) -> tuple[JoinFailure, ...]:
    """IPoIB multicast join failures (``ib0: multicast join failed for <gid>, status -22``)."""
    found = []
    for record in records:
        if "multicast join failed" not in record:
            continue
        match = _JOIN_FAILED.search(record)
        if match:
            text = record.split(";", 1)[-1][:300]
            found.append(JoinFailure(match.group("netdev"), match.group("group").lower(), int(match.group("status")), text))
    return tuple(found)


#: The texts of the records this probe parses: the others are not kept, so that a busy log's
#: noise cannot push an Xid out of the read budget.
RECORDS_READ = ("Xid", "Link down", "Link is Down", "Link up", "Link is Up", "multicast join failed", "lossless buffer")


@probe("kernel_log")
def probe_kernel_log(fs: NodeFS) -> KernelLogFacts:
    """Hardware Xid events, RDMA NIC link-downs and refused IPoIB joins since boot."""
    try:
        records = fs.read_kernel_log(keep=RECORDS_READ)
    except SourceError as error:
        return KernelLogFacts((), (), (), str(error), False)
    if records is None:
        # No log is no evidence of a quiet one: a container without /dev/kmsg, a recorded root
        # without .preflight/kmsg (a partial capture, NVML answers alone).
        where = "/dev/kmsg is not there (a container without the kernel log)" if fs.is_live else "not captured: this root records no kernel log (.preflight/kmsg)"
        return KernelLogFacts((), (), (), where, False)
    lossless = tuple(record.split(";", 1)[-1][:300] for record in records if "lossless buffer" in record and _LOSSLESS_BUFFER.search(record))
    joins = parse_join_failures(records)
    return KernelLogFacts(parse_xids(records), parse_link_downs(records), lossless, "", True, joins, _up_now(fs, joins))


def _up_now(fs: NodeFS, joins: tuple[JoinFailure, ...]) -> tuple[str, ...]:
    """The interfaces among ``joins``' that are up now (/sys/class/net/<if>/operstate): read only
    where a join failed, at most a few interfaces."""
    up = []
    for netdev in sorted({failure.netdev for failure in joins})[:MAX_JOIN_INTERFACES]:
        try:
            state = fs.read(f"/sys/class/net/{netdev}/operstate")
        except SourceError:
            continue  # unread: the failures stand
        if (state or "").strip() == "up":
            up.append(netdev)
    return tuple(up)


MAX_JOIN_INTERFACES = 16
