"""How this node's own name resolves (reference DNS001).

Sources:

* ``/proc/sys/kernel/hostname`` (the UTS name ``gethostname()`` returns);
* ``/etc/hosts`` (hosts(5)): libc consults it first under the usual ``hosts: files dns``;
* DNS ``A``/``AAAA`` answers for the name, only when ``/etc/hosts`` has no entry for it, through
  the node's resolv.conf (bounded lifetime; see ``preflight.sources.dns``).

torchrun, Gloo and NCCL's bootstrap advertise the address the host name resolves to; Debian-style
``127.0.1.1 <hostname>`` lines make every peer dial its own loopback.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterator
from dataclasses import dataclass

from preflight.model import Evidence, Observation, Unknown, present
from preflight.probing import FactReader
from preflight.registry import check, probe
from preflight.sources import NodeFS
from preflight.sources.dns import Dns, DnsAnswer


@dataclass(frozen=True)
class HostsEntry:
    address: str
    names: tuple[str, ...]
    source: str  # "/etc/hosts:3"


@dataclass(frozen=True)
class HostnameFacts:
    hostname: str | None  # /proc/sys/kernel/hostname
    hosts_entries: tuple[HostsEntry, ...]  # /etc/hosts lines naming this host (full or short name)
    dns_answers: tuple[DnsAnswer, ...]  # A and AAAA, only asked when /etc/hosts has no entry
    problems: tuple[str, ...]


def parse_hosts(text: str, path: str = "/etc/hosts") -> list[HostsEntry]:
    entries = []
    for number, line in enumerate(text.splitlines(), 1):
        fields = line.split("#", 1)[0].split()
        if len(fields) >= 2:
            entries.append(HostsEntry(fields[0], tuple(fields[1:]), f"{path}:{number}"))
    return entries


def _names(hostname: str) -> set[str]:
    return {hostname, hostname.split(".", 1)[0]}


@probe("hostname")
def probe_hostname(fs: NodeFS, dns: Dns) -> HostnameFacts:
    """Read the host name, its /etc/hosts entries and, if needed, its DNS answers."""
    reader = FactReader(fs)
    raw = reader.text("/proc/sys/kernel/hostname")
    hostname = raw.strip() if raw and raw.strip() else None
    if hostname is None:
        return HostnameFacts(None, (), (), tuple(reader.problems))
    wanted = _names(hostname)
    entries = tuple(
        entry for entry in parse_hosts(reader.text("/etc/hosts") or "") if wanted & set(entry.names)
    )
    answers: tuple[DnsAnswer, ...] = ()
    if not entries:
        answers = tuple(dns.resolve(hostname, rdtype) for rdtype in ("A", "AAAA"))
    return HostnameFacts(hostname, entries, answers, tuple(reader.problems))


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address.split("%", 1)[0]).is_loopback
    except ValueError:
        return False


@check("DNS001", profiles=("prolog",))
def hostname_resolution_broken(hostname: HostnameFacts) -> Iterator[Observation]:
    """This host's name resolves to loopback, or does not resolve at all."""
    if hostname.hostname is None:
        raise Unknown("; ".join(hostname.problems) or "/proc/sys/kernel/hostname is empty")
    loopback = [entry for entry in hostname.hosts_entries if _is_loopback(entry.address)]
    routable = [entry for entry in hostname.hosts_entries if not _is_loopback(entry.address)]
    if loopback and not (routable and hostname.hosts_entries.index(routable[0]) < hostname.hosts_entries.index(loopback[0])):
        # libc returns the first matching line; a loopback line first is what peers receive.
        first = loopback[0]
        yield present(
            hostname.hostname,
            Evidence(first.source, f"{first.address} {' '.join(first.names)}", "a routable address of this node"),
        )
        return
    if hostname.hosts_entries:
        return
    if any(answer.addresses for answer in hostname.dns_answers):
        loop = [a for answer in hostname.dns_answers for a in answer.addresses if _is_loopback(a)]
        if loop:
            yield present(hostname.hostname, Evidence("DNS", ", ".join(loop), "a routable address of this node"))
        return
    errors = {answer.error for answer in hostname.dns_answers}
    if errors & {"TIMEOUT", "SERVFAIL", "NO_NAMESERVERS"}:
        details = "; ".join(f"{a.rdtype}: {a.error} {a.detail}".strip() for a in hostname.dns_answers)
        raise Unknown(f"DNS did not answer for {hostname.hostname}: {details}")
    yield present(
        hostname.hostname,
        Evidence("/etc/hosts", "no entry"),
        Evidence("DNS", ", ".join(f"{a.rdtype} {a.error}" for a in hostname.dns_answers), "an A or AAAA record"),
    )
