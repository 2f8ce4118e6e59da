"""A small DNS stub client: the A, AAAA and PTR questions the hostname probe asks, on the wire.

The prolog asks a handful of questions before every job. dnspython answered them, but importing it
(with ``importlib.metadata``, which it loads to look for optional features) cost 60-90 ms, more
than everything else a prolog run does on a node; this module needs ``socket`` and ``struct``.

What it does, from RFC 1035 (message format, sections 4.1-4.2; name compression, 4.1.4) and
RFC 3596 (AAAA): one query per message with recursion desired, over UDP on a connected socket (an
ICMP port-unreachable comes back as ECONNREFUSED at once, not as a timeout), over TCP when the
answer is truncated; a response counts only when its ID, QR bit and question match the query;
answers follow the CNAME chain from the name asked. No EDNS, DNSSEC or caching.

Responses are untrusted bytes: every read is bounds-checked, compression pointers may only point
backwards (so they cannot loop), and anything malformed raises :class:`WireError`.
"""

from __future__ import annotations

import errno
import os
import socket
import struct
import time
from typing import Any

from msgspec import Struct

TYPES = {"A": 1, "CNAME": 5, "PTR": 12, "AAAA": 28}
CLASS_IN = 1
RCODES = ("NOERROR", "FORMERR", "SERVFAIL", "NXDOMAIN", "NOTIMP", "REFUSED", "YXDOMAIN", "YXRRSET", "NXRRSET", "NOTAUTH", "NOTZONE")
_HEADER = struct.Struct("!HHHHHH")
_RR_FIXED = struct.Struct("!HHIH")  # type, class, TTL, RDLENGTH
_FLAG_QR, _FLAG_TC, _FLAG_RD = 0x8000, 0x0200, 0x0100
_MAX_NAME = 255  # octets on the wire, RFC 1035 2.3.4
#: Characters printed as they are in a name; others are escaped as dnspython and BIND print them
#: (``\.`` for a dot inside a label, ``\DDD`` for bytes outside printable ASCII).
_PLAIN = frozenset(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_*/+=!#%&'`~^{}|[]<>?,:")


class WireError(Exception):
    """A malformed name or message."""


class Record(Struct, frozen=True):
    owner: str  # absolute, lower case, trailing dot
    rdtype: int
    data: str  # an address (A, AAAA) or an absolute name with its trailing dot (CNAME, PTR)


class Response(Struct, frozen=True):
    rcode: str
    answers: tuple[Record, ...]
    truncated: bool


def rcode_text(code: int) -> str:
    return RCODES[code] if 0 <= code < len(RCODES) else str(code)


def encode_name(name: str) -> bytes:
    """``gpu01.cluster.`` (or without the final dot) as wire labels; WireError when it cannot be one."""
    text = name[:-1] if name.endswith(".") else name
    if not text:
        return b"\0"
    wire = bytearray()
    for label in text.split("."):
        try:
            raw = label.encode("ascii")
        except UnicodeEncodeError:
            raise WireError(f"{name!r} is not an ASCII name") from None
        if not 0 < len(raw) <= 63:
            raise WireError(f"{name!r} has an empty label or one longer than 63 octets")
        wire += bytes([len(raw)]) + raw
    wire += b"\0"
    if len(wire) > _MAX_NAME:
        raise WireError(f"{name!r} is longer than 255 octets")
    return bytes(wire)


def make_query(name: str, rdtype: str) -> tuple[int, bytes]:
    """(message ID, wire bytes) of a recursive query for ``name``/``rdtype``."""
    ident = int.from_bytes(os.urandom(2), "big")
    return ident, _HEADER.pack(ident, _FLAG_RD, 1, 0, 0, 0) + encode_name(name) + struct.pack("!HH", TYPES[rdtype], CLASS_IN)


def _read_name(message: bytes, offset: int) -> tuple[str, int]:
    """The name at ``offset`` (printable, absolute) and the offset after it in the message."""
    labels: list[str] = []
    end: int | None = None
    length = 0
    position = offset
    while True:
        if position >= len(message):
            raise WireError("name runs past the end of the message")
        size = message[position]
        if size & 0xC0 == 0xC0:
            if position + 1 >= len(message):
                raise WireError("compression pointer cut short")
            target = ((size & 0x3F) << 8) | message[position + 1]
            if end is None:
                end = position + 2
            if target >= position:  # only backwards: a pointer cannot start a loop
                raise WireError("compression pointer does not point backwards")
            position = target
            continue
        if size & 0xC0:
            raise WireError(f"label type 0x{size & 0xC0:02x} is not supported")
        position += 1
        if size == 0:
            break
        raw = message[position:position + size]
        if len(raw) < size:
            raise WireError("label runs past the end of the message")
        length += size + 1
        if length > _MAX_NAME:
            raise WireError("name longer than 255 octets")
        labels.append("".join(chr(byte) if byte in _PLAIN else ("\\" + chr(byte) if 0x20 < byte < 0x7F else f"\\{byte:03d}") for byte in raw))
        position += size
    return ".".join(labels) + ".", (end if end is not None else position)


def parse_response(message: bytes, ident: int, name: str, rdtype: str) -> Response | None:
    """The response in ``message``, or None when it is not the answer to this query (another ID,
    not a response, another question). WireError when it is malformed."""
    if len(message) < _HEADER.size:
        raise WireError("shorter than a DNS header")
    got_id, flags, questions, answers, _, _ = _HEADER.unpack_from(message)
    if got_id != ident or not flags & _FLAG_QR or questions != 1:
        return None
    qname, offset = _read_name(message, _HEADER.size)
    if offset + 4 > len(message):
        raise WireError("question cut short")
    qtype, qclass = struct.unpack_from("!HH", message, offset)
    offset += 4
    if qname.lower() != absolute(name).lower() or qtype != TYPES[rdtype] or qclass != CLASS_IN:
        return None
    records = []
    for _ in range(answers):
        owner, offset = _read_name(message, offset)
        if offset + _RR_FIXED.size > len(message):
            raise WireError("resource record cut short")
        rr_type, rr_class, _, rdlength = _RR_FIXED.unpack_from(message, offset)
        offset += _RR_FIXED.size
        rdata_end = offset + rdlength
        if rdata_end > len(message):
            raise WireError("record data runs past the end of the message")
        if rr_class == CLASS_IN:
            data = _rdata(message, offset, rdata_end, rr_type)
            if data is not None:
                records.append(Record(owner.lower(), rr_type, data))
        offset = rdata_end
    return Response(rcode_text(flags & 0x000F), tuple(records), bool(flags & _FLAG_TC))


def _rdata(message: bytes, start: int, end: int, rr_type: int) -> str | None:
    if rr_type == TYPES["A"]:
        if end - start != 4:
            raise WireError("A record data is not 4 octets")
        return socket.inet_ntop(socket.AF_INET, message[start:end])
    if rr_type == TYPES["AAAA"]:
        if end - start != 16:
            raise WireError("AAAA record data is not 16 octets")
        return socket.inet_ntop(socket.AF_INET6, message[start:end])
    if rr_type in (TYPES["CNAME"], TYPES["PTR"]):
        target, after = _read_name(message, start)
        if after != end:
            raise WireError("name in record data does not fill it")
        return target
    return None  # other types (RRSIG, ...) are not ours to read


def absolute(name: str) -> str:
    return name if name.endswith(".") else name + "."


def chase(response: Response, name: str, rdtype: str) -> tuple[str, ...]:
    """The ``rdtype`` data for ``name``, following CNAMEs within the answer (at most 16 hops)."""
    owner = absolute(name).lower()
    for _ in range(16):
        found = tuple(sorted(r.data for r in response.answers if r.owner == owner and r.rdtype == TYPES[rdtype]))
        if found:
            return found
        alias = next((r.data for r in response.answers if r.owner == owner and r.rdtype == TYPES["CNAME"]), None)
        if alias is None:
            return ()
        owner = alias.lower()
    return ()


def ask(server: str, port: int, name: str, rdtype: str, deadline: float) -> Response:
    """One question to one server, by ``deadline`` (a ``time.monotonic()`` value): UDP, then TCP
    when the answer was truncated. Raises TimeoutError, OSError (refused, unreachable) or
    WireError."""
    ident, query = make_query(name, rdtype)
    family, address = server_address(server, port)
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        sock.connect(address)  # connected: an ICMP port-unreachable is ECONNREFUSED
        sock.send(query)
        while True:
            sock.settimeout(_remaining(deadline))
            try:
                response = parse_response(sock.recv(65535), ident, name, rdtype)
            except WireError:
                continue  # garbage or a stray datagram: keep waiting for ours
            if response is not None:
                break
    if response.truncated:
        response = _ask_tcp(family, address, ident, query, name, rdtype, deadline)
    return response


def server_address(server: str, port: int) -> tuple[int, tuple[Any, ...]]:
    """The family and socket address of a nameserver written as an IP address. A link-local IPv6
    server carries its interface after a '%' (``fe80::1%eth0``: glibc's res_init reads it so, and
    NetworkManager writes router-advertised servers so); the kernel refuses such a destination
    without that interface's index as the scope id. Raises OSError for what is no address here."""
    try:
        family, _, _, _, address = socket.getaddrinfo(server, port, 0, socket.SOCK_DGRAM, 0, socket.AI_NUMERICHOST)[0]
    except (socket.gaierror, UnicodeError, ValueError) as error:
        raise OSError(errno.EINVAL, f"not an IP address or no such interface: {server[:64]!r}") from error
    return family, address


def _ask_tcp(family: int, address: tuple[Any, ...], ident: int, query: bytes, name: str, rdtype: str, deadline: float) -> Response:
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.settimeout(_remaining(deadline))
        sock.connect(address)
        sock.sendall(struct.pack("!H", len(query)) + query)
        (length,) = struct.unpack("!H", _receive(sock, 2, deadline))
        response = parse_response(_receive(sock, length, deadline), ident, name, rdtype)
    if response is None:
        raise WireError("the TCP answer is not for this question")
    return response


def _receive(sock: socket.socket, size: int, deadline: float) -> bytes:
    data = b""
    while len(data) < size:
        sock.settimeout(_remaining(deadline))
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise WireError("the server closed the connection mid-answer")
        data += chunk
    return data


def _remaining(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError
    return left
