"""Pause-storm evidence of an Ethernet interface through the ethtool ioctl (``SIOCETHTOOL``).

A ConnectX port driven by mlx5_core counts how often its stall watchdog fired: the driver
statistics ``tx_pause_storm_warning_events`` (the port has asserted pause for longer than the
warning watermark) and ``tx_pause_storm_error_events`` (past the critical timeout, after which
the NIC stops sending pause frames to protect the fabric), shown by ``ethtool -S``. The
watchdog's timeout is the ``pfc-prevention-tout`` tunable (``ethtool --get-tunable <if>
pfc-prevention-tout``; 0 disables it, 0xffff means the driver default). Neither is exposed in
sysfs or through rtnetlink, so this module asks the kernel the way ethtool does
(``include/uapi/linux/ethtool.h``):

* ``ETHTOOL_GSSET_INFO`` with the ``ETH_SS_STATS`` bit: how many driver statistics there are;
* ``ETHTOOL_GSTRINGS`` for their names (32 bytes each) and ``ETHTOOL_GSTATS`` for their values
  (one u64 each, same order);
* ``ETHTOOL_GTUNABLE`` with ``ETHTOOL_PFC_PREVENTION_TOUT`` (a u16 in milliseconds); drivers
  without it answer EOPNOTSUPP.

Only the counters whose names mention ``pause`` are kept: a ConnectX-7 reports over a thousand
statistics, and the per-priority pause counters are the ones an operator compares with the
storm counters. Nothing here changes the interface.
"""

from __future__ import annotations

import errno as errno_codes
import struct

from msgspec import Struct

from preflight.sources.fs import SourceError

SIOCETHTOOL = 0x8946
ETHTOOL_GSTRINGS = 0x1B
ETHTOOL_GSTATS = 0x1D
ETHTOOL_GSSET_INFO = 0x37
ETHTOOL_GTUNABLE = 0x48
ETH_SS_STATS = 1  # enum ethtool_stringset
ETH_GSTRING_LEN = 32
ETHTOOL_PFC_PREVENTION_TOUT = 3  # enum tunable_id
ETHTOOL_TUNABLE_U16 = 2  # enum tunable_type_id
PFC_STORM_PREVENTION_AUTO = 0xFFFF
# A sanity bound: no driver has this many statistics, and a garbage count must not allocate GBs.
_MAX_STATS = 65536
IFNAMSIZ = 16


class PauseState(Struct, frozen=True):
    """Pause counters and the stall-prevention timeout of one interface."""

    ifname: str
    counters: tuple[tuple[str, int], ...]  # ethtool -S statistics whose name contains "pause"
    # pfc-prevention-tout in ms (0: watchdog off, 0xffff: driver default); None: no such tunable.
    prevention_timeout_ms: int | None

    def counter(self, name: str) -> int | None:
        return dict(self.counters).get(name)


def query_pause(ifname: str) -> PauseState:
    """Ask the kernel for ``ifname``'s pause counters and stall-prevention timeout."""
    import socket

    source = f"SIOCETHTOOL {ifname}"
    encoded = ifname.encode()
    if not encoded or len(encoded) >= IFNAMSIZ:
        raise SourceError(source, "not an interface name")
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            statistics = _statistics(sock.fileno(), encoded)
            timeout = _prevention_timeout(sock.fileno(), encoded)
    except OSError as error:
        raise SourceError(source, error.strerror or str(error)) from None
    counters = tuple((name, value) for name, value in statistics if "pause" in name)
    return PauseState(ifname, counters, timeout)


def driver_statistics(ifname: str) -> list[tuple[str, int]]:
    """Every ``ethtool -S`` statistic of ``ifname``, in the driver's order."""
    import socket

    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            return _statistics(sock.fileno(), ifname.encode())
    except OSError as error:
        raise SourceError(f"SIOCETHTOOL {ifname}", error.strerror or str(error)) from None


def _statistics(fd: int, ifname: bytes) -> list[tuple[str, int]]:
    count = _stats_count(fd, ifname)
    if count == 0:
        return []
    return list(zip(_stat_names(fd, ifname, count), _stat_values(fd, ifname, count)))


def _ioctl(fd: int, ifname: bytes, request: bytearray) -> bytearray:
    """Run one ethtool command: ``request`` is the command struct, filled in place by the kernel."""
    import ctypes
    import fcntl

    buffer = (ctypes.c_char * len(request)).from_buffer(request)
    ifreq = struct.pack(f"{IFNAMSIZ}sP", ifname, ctypes.addressof(buffer))
    fcntl.ioctl(fd, SIOCETHTOOL, ifreq)
    del buffer  # release the export so the bytearray may be resized or freed
    return request


def _stats_count(fd: int, ifname: bytes) -> int:
    request = bytearray(struct.pack("=IIQI", ETHTOOL_GSSET_INFO, 0, 1 << ETH_SS_STATS, 0))
    try:
        _ioctl(fd, ifname, request)
    except OSError as error:
        if error.errno == errno_codes.EOPNOTSUPP:
            return 0  # no ethtool statistics at all (the loopback device)
        raise
    _, _, mask, count = struct.unpack("=IIQI", bytes(request))
    if not mask & (1 << ETH_SS_STATS):
        return 0  # the driver has no statistics
    if count > _MAX_STATS:
        raise OSError(errno_codes.EINVAL, f"driver claims {count} statistics")
    return int(count)


def _stat_names(fd: int, ifname: bytes, count: int) -> list[str]:
    request = bytearray(struct.pack("=III", ETHTOOL_GSTRINGS, ETH_SS_STATS, count)) + bytearray(count * ETH_GSTRING_LEN)
    _ioctl(fd, ifname, request)
    data = bytes(request[12:])
    return [data[i : i + ETH_GSTRING_LEN].split(b"\0", 1)[0].decode("ascii", "replace") for i in range(0, count * ETH_GSTRING_LEN, ETH_GSTRING_LEN)]


def _stat_values(fd: int, ifname: bytes, count: int) -> list[int]:
    request = bytearray(struct.pack("=II", ETHTOOL_GSTATS, count)) + bytearray(count * 8)
    _ioctl(fd, ifname, request)
    return list(struct.unpack(f"={count}Q", bytes(request[8:])))


def _prevention_timeout(fd: int, ifname: bytes) -> int | None:
    request = bytearray(struct.pack("=IIIIH", ETHTOOL_GTUNABLE, ETHTOOL_PFC_PREVENTION_TOUT, ETHTOOL_TUNABLE_U16, 2, 0))
    try:
        _ioctl(fd, ifname, request)
    except OSError as error:
        if error.errno in (errno_codes.EOPNOTSUPP, errno_codes.EINVAL):
            return None  # the driver has no such tunable (veth, most non-mlx5 NICs)
        raise
    return int(struct.unpack("=IIIIH", bytes(request))[4])
