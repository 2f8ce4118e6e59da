"""A netlink dump read from a socket: answers of the request's sequence until NLMSG_DONE, bounded
in time and bytes; a garbled or failing answer is a SourceError, never a hang or a traceback.
(The live dumps, nf_tables' and RTM_GETADDR's, run in the firewall tests' namespaces.)"""

from __future__ import annotations

import socket
import struct
import time

import pytest

from preflight.sources.fs import SourceError
from preflight.sources.nlmsg import NLMSG_DONE, NLMSG_ERROR, dump_messages


def message(kind: int, sequence: int, payload: bytes = b"") -> bytes:
    raw = struct.pack("=IHHII", 16 + len(payload), kind, 0, sequence, 0) + payload
    return raw + b"\0" * ((4 - len(raw) % 4) % 4)


def read(*datagrams: bytes, seconds: float = 1.0, max_bytes: int = 1 << 20) -> list[tuple[int, bytes]]:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    with ours, theirs:
        for datagram in datagrams:
            theirs.send(datagram)
        return list(dump_messages(ours, 7, time.monotonic() + seconds, "test dump", max_bytes, lambda code: f"errno {code}"))


def test_answers_of_the_request_until_done() -> None:
    first = message(20, 7, b"abcd") + message(20, 99, b"other") + message(NLMSG_ERROR, 7, struct.pack("=i", 0))
    assert read(first, message(21, 7, b"efgh") + message(NLMSG_DONE, 7)) == [(20, b"abcd"), (21, b"efgh")]


@pytest.mark.parametrize(
    ("datagrams", "reason"),
    [
        ((message(NLMSG_ERROR, 7, struct.pack("=i", -1)),), "errno 1"),
        ((struct.pack("=IHHII", 4000, 20, 0, 7, 0) + b"x" * 8,), r"malformed netlink message \(length 4000\)"),
        ((struct.pack("=IHHII", 3, 20, 0, 7, 0),), r"malformed netlink message \(length 3\)"),
        ((message(20, 7, b"x" * 600),), "the dump exceeds 512 bytes"),
        ((message(20, 7, b"abcd"),), "no complete answer within"),  # never done
    ],
)
def test_a_failing_garbled_endless_or_oversized_dump_ends_with_a_reason(datagrams: tuple[bytes, ...], reason: str) -> None:
    with pytest.raises(SourceError, match=reason):
        read(*datagrams, seconds=0.3, max_bytes=512)
