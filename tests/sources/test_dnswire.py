"""The DNS stub client (preflight.sources.dnswire) against messages and servers built with dnspython,
an independent implementation of the same RFCs: names with compression, CNAME chains, truncation and
the TCP retry, a failing first server, the search list, and bytes that are not DNS at all."""

from __future__ import annotations

import errno
import socket
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import dns.flags
import dns.message
import dns.rcode
import dns.rrset
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from preflight.sources import dnswire
from preflight.sources.dns import LiveDns, ResolvConf

ADDRESS = "127.0.0.63"


def response_to(query_wire: bytes, *rrsets: tuple[str, str, str], rcode: int = dns.rcode.NOERROR, truncated: bool = False) -> bytes:
    query = dns.message.from_wire(query_wire)
    response = dns.message.make_response(query)
    response.set_rcode(rcode)
    for owner, rdtype, data in rrsets:
        response.answer.append(dns.rrset.from_text(owner, 60, "IN", rdtype, data))
    if truncated:
        response.flags |= dns.flags.TC
        response.answer.clear()
    return response.to_wire()


def test_a_cname_chain_with_compressed_names_is_followed() -> None:
    ident, query = dnswire.make_query("head.cluster.", "A")
    wire = response_to(query, ("head.cluster.", "CNAME", "gpu01.rack1.cluster."), ("gpu01.rack1.cluster.", "A", "10.0.0.1"),
                       ("gpu01.rack1.cluster.", "A", "10.0.0.9"))
    response = dnswire.parse_response(wire, ident, "head.cluster", "A")
    assert response is not None and response.rcode == "NOERROR" and not response.truncated
    assert dnswire.chase(response, "head.cluster", "A") == ("10.0.0.1", "10.0.0.9")
    assert dnswire.chase(response, "head.cluster", "AAAA") == ()


def test_aaaa_and_ptr_data_read_as_dnspython_writes_them() -> None:
    ident, query = dnswire.make_query("gpu01.cluster", "AAAA")
    wire = response_to(query, ("gpu01.cluster.", "AAAA", "fd00::1"), ("gpu01.cluster.", "AAAA", "::ffff:10.0.0.1"))
    response = dnswire.parse_response(wire, ident, "gpu01.cluster", "AAAA")
    assert response is not None and dnswire.chase(response, "gpu01.cluster", "AAAA") == ("::ffff:10.0.0.1", "fd00::1")
    ident, query = dnswire.make_query("1.0.0.10.in-addr.arpa.", "PTR")
    wire = response_to(query, ("1.0.0.10.in-addr.arpa.", "PTR", r"odd\032name\.x.cluster."))
    response = dnswire.parse_response(wire, ident, "1.0.0.10.in-addr.arpa.", "PTR")
    assert response is not None
    assert dnswire.chase(response, "1.0.0.10.in-addr.arpa.", "PTR") == (r"odd\032name\.x.cluster.",)  # escaped as dnspython prints it


def test_an_answer_to_another_question_is_not_ours() -> None:
    ident, query = dnswire.make_query("gpu01.cluster", "A")
    other_ident, other_query = dnswire.make_query("gpu02.cluster", "A")
    wire = response_to(other_query, ("gpu02.cluster.", "A", "10.0.0.2"))
    assert dnswire.parse_response(wire, ident, "gpu01.cluster", "A") is None  # another ID (or, rarely, the same ID)...
    patched = struct.pack("!H", ident) + wire[2:]
    assert dnswire.parse_response(patched, ident, "gpu01.cluster", "A") is None  # ...and another question
    assert dnswire.parse_response(query, ident, "gpu01.cluster", "A") is None  # the query itself: not a response


def test_compression_loops_and_cut_messages_are_wire_errors() -> None:
    header = struct.pack("!HHHHHH", 7, 0x8180, 1, 0, 0, 0)
    with pytest.raises(dnswire.WireError, match="backwards"):
        dnswire.parse_response(header + b"\xc0\x0c\x00\x01\x00\x01", 7, "x", "A")  # points at itself
    ident, query = dnswire.make_query("gpu01.cluster", "A")
    wire = response_to(query, ("gpu01.cluster.", "A", "10.0.0.1"))
    for cut in range(12, len(wire)):
        try:
            dnswire.parse_response(wire[:cut], ident, "gpu01.cluster", "A")
        except dnswire.WireError:
            pass


@pytest.mark.parametrize("name", ["a..b", "x" * 64 + ".cluster", ".".join(["abcdefgh"] * 30), "gpü.cluster"])
def test_names_that_cannot_be_asked(name: str) -> None:
    with pytest.raises(dnswire.WireError):
        dnswire.encode_name(name)


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=600))
def test_any_bytes_parse_or_fail_cleanly(data: bytes) -> None:
    try:
        response = dnswire.parse_response(data, int.from_bytes(data[:2] or b"\0\0", "big"), "gpu01.cluster", "A")
    except dnswire.WireError:
        return
    assert response is None or isinstance(response, dnswire.Response)


class Server:
    """A UDP (and TCP) server on loopback answering from ``handler(query_wire, over_tcp)``;
    None drops the question."""

    def __init__(self, handler, with_tcp: bool = False) -> None:  # type: ignore[no-untyped-def]
        self.handler = handler
        self.udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.udp.bind((ADDRESS, 0))
        self.port = self.udp.getsockname()[1]
        self.tcp: socket.socket | None = None
        if with_tcp:
            self.tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            self.tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.tcp.bind((ADDRESS, self.port))
            self.tcp.listen()
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self.serve_udp, daemon=True)]
        if self.tcp is not None:
            self.threads.append(threading.Thread(target=self.serve_tcp, daemon=True))
        for thread in self.threads:
            thread.start()

    def serve_udp(self) -> None:
        self.udp.settimeout(0.05)
        while not self.stop.is_set():
            try:
                wire, peer = self.udp.recvfrom(4096)
            except OSError:
                continue
            answer = self.handler(wire, False)
            if answer is not None:
                self.udp.sendto(answer, peer)

    def serve_tcp(self) -> None:
        assert self.tcp is not None
        self.tcp.settimeout(0.05)
        while not self.stop.is_set():
            try:
                connection, _ = self.tcp.accept()
            except OSError:
                continue
            with connection:
                connection.settimeout(2)
                (length,) = struct.unpack("!H", connection.recv(2))
                answer = self.handler(connection.recv(length), True)
                connection.sendall(struct.pack("!H", len(answer)) + answer)

    def close(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join()
        self.udp.close()
        if self.tcp is not None:
            self.tcp.close()


@pytest.fixture
def servers() -> Iterator[list[Server]]:
    made: list[Server] = []
    yield made
    for server in made:
        server.close()


def test_a_truncated_answer_is_asked_again_over_tcp(servers: list[Server]) -> None:
    def handler(wire: bytes, over_tcp: bool) -> bytes:
        return response_to(wire, ("gpu01.cluster.", "A", "10.0.0.1"), truncated=not over_tcp)

    servers.append(Server(handler, with_tcp=True))
    response = dnswire.ask(ADDRESS, servers[0].port, "gpu01.cluster.", "A", time.monotonic() + 2)
    assert not response.truncated and dnswire.chase(response, "gpu01.cluster.", "A") == ("10.0.0.1",)


def test_a_failing_server_passes_the_question_on_and_the_search_list_is_walked(servers: list[Server]) -> None:
    """SERVFAIL from the first server, then the second: NXDOMAIN for the first search domain,
    the answer for the second. The same port on two addresses is not possible here, so both
    servers share one port through the resolver's port and separate handlers by address."""
    asked: list[str] = []

    def handler(wire: bytes, over_tcp: bool) -> bytes:
        name = dns.message.from_wire(wire).question[0].name.to_text()
        asked.append(name)
        if name == "gpu01.a.cluster.":
            return response_to(wire, rcode=dns.rcode.NXDOMAIN)
        return response_to(wire, ("gpu01.b.cluster.", "A", "10.0.0.1"))

    servers.append(Server(handler))
    failing = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    failing.bind(("127.0.0.64", servers[0].port))
    stop = threading.Event()

    def refuse() -> None:
        failing.settimeout(0.05)
        while not stop.is_set():
            try:
                wire, peer = failing.recvfrom(4096)
            except OSError:
                continue
            failing.sendto(response_to(wire, rcode=dns.rcode.SERVFAIL), peer)

    thread = threading.Thread(target=refuse, daemon=True)
    thread.start()
    try:
        resolver = LiveDns(ResolvConf(("127.0.0.64", ADDRESS), ("a.cluster", "b.cluster"), ndots=1), port=servers[0].port, lifetime=2)
        answer = resolver.resolve("gpu01", "A")
    finally:
        stop.set()
        thread.join()
        failing.close()
    assert answer.addresses == ("10.0.0.1",) and not answer.error
    assert asked == ["gpu01.a.cluster.", "gpu01.b.cluster."]  # search list first: "gpu01" has fewer dots than ndots


def test_every_server_failing_is_servfail_with_the_reasons(servers: list[Server]) -> None:
    servers.append(Server(lambda wire, over_tcp: response_to(wire, rcode=dns.rcode.REFUSED)))
    answer = LiveDns(ResolvConf((ADDRESS,), ()), port=servers[0].port, lifetime=2).resolve("gpu01.cluster", "A")
    assert answer.error == "SERVFAIL" and "REFUSED" in answer.detail


def test_a_silent_server_is_a_timeout_within_the_lifetime(servers: list[Server]) -> None:
    servers.append(Server(lambda wire, over_tcp: None))
    answer = LiveDns(ResolvConf((ADDRESS,), ()), port=servers[0].port, lifetime=0.3).resolve("gpu01.cluster", "A")
    assert answer.error == "TIMEOUT"


@pytest.mark.parametrize(
    ("name", "ndots", "expected"),
    [
        ("gpu01", 1, ["gpu01.a.", "gpu01.b.", "gpu01."]),
        ("gpu01.rack", 1, ["gpu01.rack.", "gpu01.rack.a.", "gpu01.rack.b."]),
        ("gpu01.rack", 2, ["gpu01.rack.a.", "gpu01.rack.b.", "gpu01.rack."]),
        ("gpu01.rack.", 5, ["gpu01.rack."]),
    ],
)
def test_names_tried_in_glibc_order(name: str, ndots: int, expected: list[str]) -> None:
    assert LiveDns(ResolvConf((), ("a", "b."), ndots=ndots))._qnames(name) == expected


LINK_LOCAL_ASK = """
import socket, struct, threading, time
from preflight.sources import dnswire
server = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
server.bind(("fe80::1", 0, 0, socket.if_nametoindex("eth0")))
def answer():
    wire, peer = server.recvfrom(4096)
    server.sendto(wire[:2] + struct.pack("!H", 0x8183) + wire[4:], peer)  # the question back, NXDOMAIN
threading.Thread(target=answer, daemon=True).start()
response = dnswire.ask("fe80::1%eth0", server.getsockname()[1], "gpu017.cluster.", "A", time.monotonic() + 5)
print(response.rcode)
try:
    dnswire.ask("fe80::1%nosuch0", 53, "gpu017.cluster.", "A", time.monotonic() + 5)
except OSError as error:
    print(error.errno)
"""


def test_a_link_local_nameserver_is_asked_on_its_interface(tmp_path: Path) -> None:
    """resolv.conf may name a link-local IPv6 server with its interface (fe80::1%eth0: glibc's
    res_init reads it so; NetworkManager writes router-advertised servers so). The kernel refuses
    such a destination without the interface's index as the scope id (EINVAL); an interface that
    is not there is EINVAL too, never a traceback."""
    from netns_lab import namespace

    with namespace("dnsll", tmp_path) as lab:
        lab.nic("eth0")
        lab.sysctl(ipv6__conf__eth0__disable_ipv6="0", ipv6__conf__eth0__accept_dad="0")  # usable at once
        lab.addr("eth0", "fe80::1/64")
        assert lab.python(LINK_LOCAL_ASK).split() == ["NXDOMAIN", str(errno.EINVAL)]
