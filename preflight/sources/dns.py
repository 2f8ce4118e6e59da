"""DNS answers: live through :mod:`preflight.sources.dnswire` with bounded lifetimes, or replayed
from ``<root>/.preflight/dns.json``.

The live resolver is configured from the node's ``/etc/resolv.conf`` (read through the
filesystem source, so ``--root`` and the live node behave alike) unless the site config names
nameservers.

Three kinds of question:

* ``resolve(name, "A"|"AAAA")``: forward lookups with resolv.conf's search list and ``ndots``, as
  glibc's stub resolver applies them; a server that fails (SERVFAIL, REFUSED, unreachable) passes
  the question to the next one, NXDOMAIN moves on to the next name of the search list;
* ``resolve(address, "PTR")``: the reverse lookup of an IPv4/IPv6 address (``in-addr.arpa`` /
  ``ip6.arpa``), never searched;
* ``check_nameservers(name)``: one query (``A`` of the first name glibc would send for ``name``,
  search domain included) to *each* nameserver on its own, timed, so that a dead or
  slow server is seen even when another one answers for it. The socket is connected, so an ICMP
  port-unreachable (nothing listens, e.g. a systemd-resolved stub at 127.0.0.53 seen from a
  container's network namespace) is reported at once as refused instead of as a timeout.

Every query is bounded by ``lifetime``; ``resolve_many`` and ``check_nameservers`` ask in parallel
(daemon threads), so a batch costs one lifetime, not one per question.

Replay format::

    {"format": "preflight-dns/1",
     "nameservers": ["10.0.0.2"],
     "servers": {"10.0.0.2": {"rcode": "NOERROR", "elapsed_s": 0.003},
                 "10.0.0.3": {"error": "TIMEOUT", "detail": "no answer within 2 s"}},
     "answers": {"gpu001.cluster A": {"addresses": ["10.0.0.11"]},
                 "gpu001.cluster AAAA": {"error": "NOANSWER"},
                 "10.0.0.11 PTR": {"names": ["gpu001.cluster."]},
                 "gpu002.cluster A": {"hang": true}}}

``error`` is one of ``NXDOMAIN``, ``NOANSWER``, ``TIMEOUT``, ``NO_NAMESERVERS``, ``SERVFAIL`` for
answers, and ``TIMEOUT`` or ``UNREACHABLE`` for servers. An answer or server entry
``{"source_error": {"source": ..., "reason": ...}}`` records a question that could not be asked at
all (``preflight snapshot`` writes it); it raises SourceError on replay, and so does
``"errors": {"check_nameservers": {"source": ..., "reason": ...}}`` for the health check.
"""

from __future__ import annotations

import ipaddress
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from msgspec import Struct

from preflight.sources.fs import RecordedDocument, SourceError, describe_os_error
from preflight.units import is_number

if TYPE_CHECKING:
    from preflight.sources.dnswire import Response

DNS_ERRORS = ("NXDOMAIN", "NOANSWER", "TIMEOUT", "NO_NAMESERVERS", "SERVFAIL")
SERVER_ERRORS = ("TIMEOUT", "UNREACHABLE")
# A thread that outlives its query's lifetime by this much is abandoned as timed out.
_JOIN_SLACK_S = 0.5
_T = TypeVar("_T")


class DnsAnswer(Struct, frozen=True):
    """The answer for (name, type), or why there is none."""

    name: str  # the name asked for; for PTR, the address
    rdtype: str  # "A" | "AAAA" | "PTR"
    addresses: tuple[str, ...] = ()  # A/AAAA records
    error: str = ""  # "" when the query succeeded; otherwise one of DNS_ERRORS
    detail: str = ""
    names: tuple[str, ...] = ()  # PTR records (absolute names, trailing dot)


class NameserverCheck(Struct, frozen=True):
    """How one nameserver answered one query sent to it alone."""

    server: str
    rcode: str = ""  # the response's RCODE ("NOERROR", "NXDOMAIN", "REFUSED"...); "" without one
    elapsed_s: float | None = None  # time to the response; None without one
    error: str = ""  # "" when a response came; otherwise one of SERVER_ERRORS
    detail: str = ""


class Dns(Protocol):
    """What probes may ask of DNS."""

    def nameservers(self) -> list[str]: ...

    def resolve(self, name: str, rdtype: str, nameservers: Sequence[str] | None = None) -> DnsAnswer: ...

    def resolve_many(
        self, questions: Sequence[tuple[str, str]], nameservers: Sequence[str] | None = None
    ) -> list[DnsAnswer]: ...

    def check_nameservers(self, name: str) -> list[NameserverCheck]: ...


class ResolvConf(Struct, frozen=True):
    """The parts of resolv.conf(5) the resolver and the checks need."""

    nameservers: tuple[str, ...]
    search: tuple[str, ...]
    ndots: int = 1  # options ndots:N: names with fewer dots try the search list first


def parse_resolv_conf(text: str) -> ResolvConf:
    """``nameserver``/``search``/``domain`` lines and ``options ndots:N``; the last
    ``search``/``domain`` wins, and glibc caps ``ndots`` at 15 (resolv.conf(5))."""
    nameservers: list[str] = []
    search: tuple[str, ...] = ()
    ndots = 1
    for line in text.splitlines():
        fields = line.split("#", 1)[0].split(";", 1)[0].split()
        if len(fields) < 2:
            continue
        if fields[0] == "nameserver":
            nameservers.append(fields[1])
        elif fields[0] in ("search", "domain"):
            search = tuple(fields[1:])
        elif fields[0] == "options":
            for option in fields[1:]:
                key, _, value = option.partition(":")
                if key == "ndots" and is_number(value):
                    ndots = min(int(value), 15)
    return ResolvConf(tuple(nameservers), search, ndots)


def _in_parallel(calls: Sequence[Callable[[], _T]], wait_s: float, late: Callable[[int], _T]) -> list[_T]:
    """Run ``calls`` in daemon threads and collect their results; a call still running after
    ``wait_s`` gets ``late(index)`` instead (its thread is abandoned: threads cannot be killed)."""
    results: dict[int, _T] = {}
    threads = []

    def work(index: int, call: Callable[[], _T]) -> None:
        results[index] = call()

    for index, call in enumerate(calls):
        thread = threading.Thread(target=work, args=(index, call), name=f"probe-dns-{index}", daemon=True)
        thread.start()
        threads.append(thread)
    deadline = time.monotonic() + wait_s
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    return [results[index] if index in results else late(index) for index in range(len(calls))]


class LiveDns:
    """A stub resolver with a hard lifetime per question."""

    def __init__(self, resolv: ResolvConf, port: int = 53, lifetime: float = 2.0) -> None:
        self._resolv = resolv
        self._port = port
        self._lifetime = lifetime

    def nameservers(self) -> list[str]:
        return list(self._resolv.nameservers)

    def resolve(self, name: str, rdtype: str, nameservers: Sequence[str] | None = None) -> DnsAnswer:
        from preflight.sources import dnswire  # with socket: only when a question is asked

        servers = list(self._resolv.nameservers if nameservers is None else nameservers)
        if not servers:
            return DnsAnswer(name, rdtype, error="NO_NAMESERVERS", detail="no nameserver to ask")
        deadline = time.monotonic() + self._lifetime
        if rdtype == "PTR":
            try:
                qnames = [ipaddress.ip_address(name).reverse_pointer + "."]
            except ValueError as error:
                return DnsAnswer(name, rdtype, error="SERVFAIL", detail=str(error)[:200])
        else:
            qnames = self._qnames(name)
        failures: list[str] = []
        for qname in qnames:
            outcome = self._ask_servers(servers, qname, rdtype, deadline, failures)
            if outcome is None:
                return DnsAnswer(name, rdtype, error="TIMEOUT", detail=f"no answer within {self._lifetime:g} s")
            if outcome == "NXDOMAIN":
                continue
            if isinstance(outcome, str):  # every server failed for this name
                return DnsAnswer(name, rdtype, error="SERVFAIL", detail="; ".join(failures)[:200])
            records = dnswire.chase(outcome, qname, rdtype)
            if not records:
                return DnsAnswer(name, rdtype, error="NOANSWER")
            return DnsAnswer(name, rdtype, names=records) if rdtype == "PTR" else DnsAnswer(name, rdtype, records)
        return DnsAnswer(name, rdtype, error="NXDOMAIN")

    def _qnames(self, name: str) -> list[str]:
        """The names to try, as glibc's stub resolver orders them (resolv.conf(5)): an absolute
        name alone; otherwise the name as given first when it has at least ``ndots`` dots, the
        search list first when it has fewer."""
        if name.endswith("."):
            return [name]
        searched = [f"{name}.{domain.rstrip('.')}." for domain in self._resolv.search]
        return [f"{name}.", *searched] if name.count(".") >= self._resolv.ndots else [*searched, f"{name}."]

    def _ask_servers(
        self, servers: list[str], qname: str, rdtype: str, deadline: float, failures: list[str]
    ) -> Response | str | None:
        """The first usable response for ``qname`` from ``servers`` in order; "NXDOMAIN"; another
        rcode or "FAILED" when every server failed (the reasons added to ``failures``); None when the
        lifetime ran out."""
        from preflight.sources import dnswire

        last = "FAILED"
        for server in servers:
            try:
                response = dnswire.ask(server, self._port, qname, rdtype, deadline)
            except TimeoutError:
                return None
            except dnswire.WireError as error:
                failures.append(f"{server}: {error}")
                continue
            except OSError as error:
                failures.append(f"{server}: {describe_os_error(error)}")
                continue
            if response.rcode in ("NOERROR", "NXDOMAIN"):
                return response if response.rcode == "NOERROR" else "NXDOMAIN"
            failures.append(f"{server} answered {response.rcode} for {qname}")
            last = response.rcode
        return last

    def resolve_many(
        self, questions: Sequence[tuple[str, str]], nameservers: Sequence[str] | None = None
    ) -> list[DnsAnswer]:
        calls = [lambda q=question: self.resolve(q[0], q[1], nameservers) for question in questions]

        def late(index: int) -> DnsAnswer:
            name, rdtype = questions[index]
            return DnsAnswer(name, rdtype, error="TIMEOUT", detail=f"no answer within {self._lifetime:g} s")

        return _in_parallel(calls, self._lifetime + _JOIN_SLACK_S, late)

    def check_nameservers(self, name: str) -> list[NameserverCheck]:
        # The first name glibc would send for ``name``: with a search list a short host name goes
        # out qualified, and systemd-resolved refuses a bare one-label name by design (SERVFAIL,
        # REFUSED from systemd 257), which says nothing about the names the node does look up.
        qname = self._qnames(name)[0]
        servers = list(self._resolv.nameservers)
        calls = [lambda s=server: self._check_one(s, qname) for server in servers]

        def late(index: int) -> NameserverCheck:
            return NameserverCheck(servers[index], error="TIMEOUT", detail=f"no answer within {self._lifetime:g} s")

        return _in_parallel(calls, self._lifetime + _JOIN_SLACK_S, late)

    def _check_one(self, server: str, name: str) -> NameserverCheck:
        from preflight.sources import dnswire

        begin = time.monotonic()
        try:
            response = dnswire.ask(server, self._port, dnswire.absolute(name), "A", begin + self._lifetime)
        except TimeoutError:
            return NameserverCheck(server, error="TIMEOUT", detail=f"no answer within {self._lifetime:g} s")
        except dnswire.WireError as error:
            return NameserverCheck(server, error="UNREACHABLE", detail=f"malformed answer: {error}")
        except OSError as error:
            return NameserverCheck(server, error="UNREACHABLE", detail=describe_os_error(error))
        return NameserverCheck(server, response.rcode, round(time.monotonic() - begin, 4))


class ReplayDns(RecordedDocument):
    """Answers from a recorded ``dns.json``."""

    KIND = "DNS"
    FILE = "dns.json"

    def nameservers(self) -> list[str]:
        return list(self._strings(self._checked().get("nameservers", []), "nameservers"))

    def _strings(self, value: object, what: str) -> tuple[str, ...]:
        """A recorded list of text items; SourceError for anything else (a broken recording)."""
        if not isinstance(value, list) or not all(isinstance(item, (str, int, float)) for item in value):
            raise SourceError(self._origin, f"malformed recording: {what} is not a list of strings")
        return tuple(str(item) for item in value)

    def _entry(self, table: str, key: str) -> dict[str, Any]:
        entries = self._checked().get(table, {})
        entry = entries.get(key) if isinstance(entries, dict) else None
        if not isinstance(entry, dict):
            raise SourceError(self._origin, f"no recorded {table[:-1]} for {key}")
        if entry.get("hang"):
            threading.Event().wait()  # a server that never answers and a resolver without a lifetime
        failure = entry.get("source_error")
        if isinstance(failure, dict):
            raise SourceError(str(failure.get("source", self._origin)), str(failure.get("reason", "failed")))
        return entry

    def resolve(self, name: str, rdtype: str, nameservers: Sequence[str] | None = None) -> DnsAnswer:
        entry = self._entry("answers", f"{name} {rdtype}")
        error = str(entry.get("error", ""))
        if error and error not in DNS_ERRORS:
            raise SourceError(self._origin, f"unknown DNS error {error!r} for {name} {rdtype}")
        addresses = self._strings(entry.get("addresses", []), f"addresses of {name} {rdtype}")
        names = self._strings(entry.get("names", []), f"names of {name} {rdtype}")
        return DnsAnswer(name, rdtype, addresses, error, str(entry.get("detail", "")), names)

    def resolve_many(
        self, questions: Sequence[tuple[str, str]], nameservers: Sequence[str] | None = None
    ) -> list[DnsAnswer]:
        return [self.resolve(name, rdtype) for name, rdtype in questions]

    def check_nameservers(self, name: str) -> list[NameserverCheck]:
        errors = self._checked().get("errors")
        failure = errors.get("check_nameservers") if isinstance(errors, dict) else None
        if isinstance(failure, dict):
            raise SourceError(str(failure.get("source", self._origin)), str(failure.get("reason", "failed")))
        checks = []
        for server in self.nameservers():
            entry = self._entry("servers", server)
            error = str(entry.get("error", ""))
            if error and error not in SERVER_ERRORS:
                raise SourceError(self._origin, f"unknown nameserver error {error!r} for {server}")
            elapsed = entry.get("elapsed_s")
            if elapsed is not None and (isinstance(elapsed, bool) or not isinstance(elapsed, (int, float))):
                raise SourceError(self._origin, f"elapsed_s of {server} is not a number")
            checks.append(
                NameserverCheck(
                    server, str(entry.get("rcode", "")), None if elapsed is None else float(elapsed),
                    error, str(entry.get("detail", "")),
                )
            )
        return checks


class NoDns:
    """Used for a recorded root without a DNS recording."""

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def nameservers(self) -> list[str]:
        return []

    def resolve(self, name: str, rdtype: str, nameservers: Sequence[str] | None = None) -> DnsAnswer:
        raise SourceError("dns", self.reason)

    def resolve_many(
        self, questions: Sequence[tuple[str, str]], nameservers: Sequence[str] | None = None
    ) -> list[DnsAnswer]:
        raise SourceError("dns", self.reason)

    def check_nameservers(self, name: str) -> list[NameserverCheck]:
        raise SourceError("dns", self.reason)
