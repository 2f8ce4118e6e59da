"""One netlink dump's answers, read from a plain ``AF_NETLINK`` socket (netlink(7)): the messages
of one request's sequence number, each as (type, payload), until ``NLMSG_DONE``. Shared by the
nf_tables ruleset reader and the rtnetlink address dump, which must not import pyroute2 (over
100 ms) on the prolog's path.

Bounded: the dump must end before ``deadline`` and within ``max_bytes``; a message whose length
overruns what was received, a timeout, or an ``NLMSG_ERROR`` with a non-zero errno ends it with
``SourceError`` (the errno's text from ``describe``).
"""

from __future__ import annotations

import errno as errno_codes
import struct
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from preflight.sources.fs import SourceError

if TYPE_CHECKING:  # the socket module (and selectors) load only where a live dump runs
    import socket

NLMSG_ERROR = 2
NLMSG_DONE = 3
_HEADER = struct.Struct("=IHHII")  # struct nlmsghdr: length, type, flags, sequence, port id


def dump_messages(
    sock: socket.socket, sequence: int, deadline: float, source: str, max_bytes: int, describe: Callable[[int], str]
) -> Iterator[tuple[int, bytes]]:
    """(message type, payload) of every answer to request ``sequence``, until the dump is done."""
    total = 0
    late = f"no complete answer within {max(deadline - time.monotonic(), 0):.1f} s"
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise SourceError(source, late)
        sock.settimeout(remaining)
        try:
            data = sock.recv(1 << 20)
        except TimeoutError:  # socket.timeout
            raise SourceError(source, late) from None
        total += len(data)
        if total > max_bytes:
            raise SourceError(source, f"the dump exceeds {max_bytes} bytes")
        offset = 0
        while offset + _HEADER.size <= len(data):
            length, kind, _flags, seq, _port = _HEADER.unpack_from(data, offset)
            if length < _HEADER.size or offset + length > len(data):
                raise SourceError(source, f"malformed netlink message (length {length})")
            payload = data[offset + _HEADER.size : offset + length]
            offset += (length + 3) & ~3
            if seq != sequence:
                continue
            if kind == NLMSG_DONE:
                return
            if kind == NLMSG_ERROR:
                code = -struct.unpack_from("=i", payload, 0)[0] if len(payload) >= 4 else errno_codes.EIO
                if code:
                    raise SourceError(source, describe(code))
                continue  # an acknowledgement
            yield kind, payload
