"""DNS answers: live through dnspython with bounded lifetimes, or replayed from
``<root>/.preflight/dns.json``.

The live resolver is configured from the node's ``/etc/resolv.conf`` (read through the
filesystem source, so ``--root`` and the live node behave alike) unless the site config names
nameservers. dnspython is imported only on the first query (~75 ms here).

Replay format::

    {"format": "preflight-dns/1",
     "nameservers": ["10.0.0.2"],
     "answers": {"gpu001.cluster A": {"addresses": ["10.0.0.11"]},
                 "gpu001.cluster AAAA": {"error": "NOANSWER"},
                 "gpu002.cluster A": {"hang": true}}}

``error`` is one of ``NXDOMAIN``, ``NOANSWER``, ``TIMEOUT``, ``NO_NAMESERVERS``, ``SERVFAIL``.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Any, Protocol

from preflight.sources.fs import SourceError

DNS_ERRORS = ("NXDOMAIN", "NOANSWER", "TIMEOUT", "NO_NAMESERVERS", "SERVFAIL")


@dataclass(frozen=True)
class DnsAnswer:
    """Addresses for (name, type), or why there are none."""

    name: str
    rdtype: str  # "A" | "AAAA"
    addresses: tuple[str, ...] = ()
    error: str = ""  # "" when the query succeeded; otherwise one of DNS_ERRORS
    detail: str = ""


class Dns(Protocol):
    """What probes may ask of DNS."""

    def nameservers(self) -> list[str]: ...

    def resolve(self, name: str, rdtype: str) -> DnsAnswer: ...


@dataclass(frozen=True)
class ResolvConf:
    """The parts of resolv.conf(5) the resolver needs."""

    nameservers: tuple[str, ...]
    search: tuple[str, ...]


def parse_resolv_conf(text: str) -> ResolvConf:
    """``nameserver``/``search``/``domain`` lines; the last ``search``/``domain`` wins (resolv.conf(5))."""
    nameservers: list[str] = []
    search: tuple[str, ...] = ()
    for line in text.splitlines():
        fields = line.split("#", 1)[0].split(";", 1)[0].split()
        if len(fields) < 2:
            continue
        if fields[0] == "nameserver":
            nameservers.append(fields[1])
        elif fields[0] in ("search", "domain"):
            search = tuple(fields[1:])
    return ResolvConf(tuple(nameservers), search)


class LiveDns:
    """dnspython stub resolver with a hard lifetime per query."""

    def __init__(self, resolv: ResolvConf, port: int = 53, lifetime: float = 2.0) -> None:
        self._resolv = resolv
        self._port = port
        self._lifetime = lifetime

    def nameservers(self) -> list[str]:
        return list(self._resolv.nameservers)

    def resolve(self, name: str, rdtype: str) -> DnsAnswer:
        import dns.exception
        import dns.name
        import dns.resolver

        if not self._resolv.nameservers:
            return DnsAnswer(name, rdtype, error="NO_NAMESERVERS", detail="resolv.conf lists none")
        resolver = dns.resolver.Resolver(configure=False)
        resolver.nameservers = list(self._resolv.nameservers)
        resolver.port = self._port
        resolver.search = [dns.name.from_text(domain) for domain in self._resolv.search]
        resolver.lifetime = self._lifetime
        resolver.timeout = self._lifetime
        try:
            answer = resolver.resolve(name, rdtype, search=True, raise_on_no_answer=True)
        except dns.resolver.NXDOMAIN:
            return DnsAnswer(name, rdtype, error="NXDOMAIN")
        except dns.resolver.NoAnswer:
            return DnsAnswer(name, rdtype, error="NOANSWER")
        except dns.resolver.LifetimeTimeout:
            return DnsAnswer(name, rdtype, error="TIMEOUT", detail=f"no answer within {self._lifetime:g} s")
        except dns.resolver.NoNameservers as error:
            return DnsAnswer(name, rdtype, error="SERVFAIL", detail=str(error)[:200])
        except dns.exception.DNSException as error:
            return DnsAnswer(name, rdtype, error="SERVFAIL", detail=str(error)[:200])
        return DnsAnswer(name, rdtype, tuple(sorted(str(item) for item in answer)))


class ReplayDns:
    """Answers from a recorded ``dns.json``."""

    def __init__(self, document: dict[str, Any], origin: str = "dns.json", error: str = "") -> None:
        self._document = document
        self._origin = origin
        # A broken recording fails the probes that use it (as unknown), not the whole run.
        self._error = error

    def _checked(self) -> dict[str, Any]:
        if self._error:
            raise SourceError(self._origin, self._error)
        return self._document

    @classmethod
    def from_file(cls, path: str) -> ReplayDns:
        try:
            with open(path, encoding="utf-8") as handle:
                document = json.load(handle)
        except (OSError, ValueError) as error:
            return cls({}, path, f"unreadable DNS recording: {error}")
        if not isinstance(document, dict):
            return cls({}, path, "DNS recording is not a JSON object")
        return cls(document, origin=path)

    def nameservers(self) -> list[str]:
        return [str(item) for item in self._checked().get("nameservers", [])]

    def resolve(self, name: str, rdtype: str) -> DnsAnswer:
        answers = self._checked().get("answers", {})
        entry = answers.get(f"{name} {rdtype}") if isinstance(answers, dict) else None
        if not isinstance(entry, dict):
            raise SourceError(self._origin, f"no recorded answer for {name} {rdtype}")
        if entry.get("hang"):
            threading.Event().wait()  # a server that never answers and a resolver without a lifetime
        error = str(entry.get("error", ""))
        if error and error not in DNS_ERRORS:
            raise SourceError(self._origin, f"unknown DNS error {error!r} for {name} {rdtype}")
        addresses = tuple(str(item) for item in entry.get("addresses", []))
        return DnsAnswer(name, rdtype, addresses, error, str(entry.get("detail", "")))


class NoDns:
    """Used for a recorded root without a DNS recording."""

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def nameservers(self) -> list[str]:
        return []

    def resolve(self, name: str, rdtype: str) -> DnsAnswer:
        raise SourceError("dns", self.reason)
