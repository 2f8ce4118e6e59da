"""Name resolution the job depends on (DNS references)."""

from __future__ import annotations

import ipaddress
import re
from typing import TYPE_CHECKING

from preflight.model import Evidence, Observation, Severity, present, undecided
from preflight.probes.hostname import (
    HEALTHY_RCODES,
    ROLE_HOST,
    ROLE_MASTER,
    ROLE_PEER,
    HostnameFacts,
    NameLookup,
    is_ip_literal,
    is_loopback_address,
    libc_lookup,
    same_host,
)
from preflight.registry import check

if TYPE_CHECKING:
    from collections.abc import Iterator, Sequence

    from preflight.sources.dns import DnsAnswer, NameserverCheck

#: A cluster resolver answers a name in its own zone in milliseconds; a second means overload or
#: a forwarding chain timing out upstream, and every uncached lookup at job start pays it.
SLOW_NAMESERVER_S = 1.0


SYSTEMD_RESOLVED_STUB = "127.0.0.53"


# -- check ------------------------------------------------------------------------------------
def _dns_summary(answers: Sequence[DnsAnswer]) -> str:
    return "; ".join(f"{a.rdtype}: {a.error} {a.detail}".strip() for a in answers)


def _disagreement(lookup: NameLookup) -> Evidence | None:
    """/etc/hosts and DNS both know the name but give different addresses for one family."""
    hosts = {entry.address for entry in lookup.hosts_entries if not is_loopback_address(entry.address)}
    dns = {address for answer in lookup.dns_answers for address in answer.addresses}
    for family in (4, 6):
        in_hosts = {a for a in hosts if is_ip_literal(a) and ipaddress.ip_address(a.split("%")[0]).version == family}
        in_dns = {a for a in dns if is_ip_literal(a) and ipaddress.ip_address(a.split("%")[0]).version == family}
        if in_hosts and in_dns and in_hosts != in_dns:
            where = ", ".join(entry.source for entry in lookup.hosts_entries if entry.address in in_hosts)
            return Evidence(
                f"{where} vs DNS",
                f"/etc/hosts: {', '.join(sorted(in_hosts))}; DNS: {', '.join(sorted(in_dns))}",
                "the same addresses in both",
            )
    return None


def _reverse_mismatches(lookup: NameLookup) -> list[Evidence]:
    return [
        Evidence(f"DNS PTR {answer.name}", ", ".join(answer.names), f"{lookup.name} (forward and reverse agree)")
        for answer in lookup.reverse
        if answer.names and not any(same_host(target, lookup.name) or _names_the_address(target, answer.name) for target in answer.names)
    ]


def _names_the_address(target: str, address: str) -> bool:
    """A PTR name made from the address itself, as a cloud's DNS answers for every private address
    (AWS's ``ip-10-1-42-17.ec2.internal``, and ``10-1-42-17.<zone>`` names): it names the address,
    not another host, so it is no disagreement with the node's own name."""
    dashed = address.lower().replace(".", "-").replace(":", "-")
    first = target.split(".", 1)[0].lower()
    return len(dashed) > 6 and re.search(rf"(?<![0-9a-f]){re.escape(dashed)}(?![0-9a-f])", first) is not None


DNS_SERVICES = ("dns", "resolve")  # nsswitch.conf services that ask the nameservers

PEER_NOT_FOUND_FIX = (
    "No record for another node's name: jobs that dial it (MASTER_ADDR, the c10d store, Gloo) fail on "
    "every node alike, so this node is not drained for it. Add the name to DNS or to the cluster's "
    "managed /etc/hosts (or make Slurm's node names resolvable: NodeAddr/NodeHostname), and check with "
    "'getent ahosts <name>' on any node."
)


SINGLE_NODE_FIX = (
    "This job runs on one node, where loopback reaches every rank, so it is not hurt; a job of "
    "several nodes would be. Replace the loopback line for the host name in /etc/hosts with the "
    "node's cluster address, or remove it so DNS answers ('getent ahosts $(hostname)' must show "
    "an address peers can reach first)."
)


GLOO_IFNAME_FIX = (
    "GLOO_SOCKET_IFNAME names Gloo's interface, so Gloo neither binds to nor advertises this loopback "
    "address, and torch elastic publishes the host's name, which each peer resolves itself: this job is "
    "not hurt. Jobs without the setting would be: replace the loopback line for the host name in "
    "/etc/hosts with the node's cluster address ('getent ahosts $(hostname)' must show an address peers "
    "can reach first)."
)


LOOPBACK_MASTER_FIX = (
    "MASTER_ADDR names loopback, which is the job's setting and the same on every node, so this node is "
    "not drained for it: on several nodes each one meets only its own ranks there. Set MASTER_ADDR to the "
    "first node of the job (e.g. $(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n 1))."
)


#: Names that mean this very host on every node (RFC 6761 reserves localhost and .localhost;
#: Debian's /etc/hosts adds the ip6- aliases): naming one in MASTER_ADDR is the job's choice.
#: Where cloud-init writes /etc/hosts at every boot, editing the file does not last.
CLOUD_INIT_FIX = (
    "cloud-init writes this /etc/hosts from its template at every boot (manage_etc_hosts: true, as the "
    "file's header says): change the template (/etc/cloud/templates/hosts.debian.tmpl, hosts.redhat.tmpl "
    "on RHEL) so the host name maps to the node's cluster address, or set manage_etc_hosts: false in "
    "/etc/cloud/cloud.cfg.d/ and fix the file; then check with getent ahosts $(hostname)."
)


LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"})


def _loopback_name(name: str) -> bool:
    plain = name.lower().rstrip(".")
    return plain in LOOPBACK_NAMES or plain.endswith(".localhost")


def _loopback_downgrade(lookup: NameLookup, facts: HostnameFacts) -> str:
    """Why a name on loopback is only a warning here, as the fix to show; "" when it is an error."""
    if ROLE_HOST in lookup.roles:
        if facts.nodes_in_job == 1:
            # A job of one node: its ranks meet on this host, where loopback reaches them all. The
            # node still needs the fix before a job of several nodes, which the warning says;
            # failing this job's prolog for it would requeue a job it cannot hurt.
            return SINGLE_NODE_FIX
        if facts.gloo_socket_ifname:
            return GLOO_IFNAME_FIX  # Gloo's default device is what the host name's address feeds
    elif ROLE_MASTER in lookup.roles and _loopback_name(lookup.name):
        return LOOPBACK_MASTER_FIX
    return ""


def _judge_name(lookup: NameLookup, facts: HostnameFacts) -> Observation | None:
    result = libc_lookup(lookup, facts)
    subject = lookup.name
    if result.status == "unavailable":
        return undecided(subject, f"DNS did not answer for {subject}: {_dns_summary(lookup.dns_answers) or result.detail}")
    if result.status == "not_found":
        evidence = [
            Evidence("/etc/hosts", "missing" if facts.hosts_missing else "no entry"),
            Evidence("DNS", ", ".join(f"{a.rdtype} {a.error or ' '.join(a.addresses)}" for a in lookup.dns_answers),
                     "an A or AAAA record"),
        ]
        if any(answer.addresses for answer in lookup.dns_answers):
            # DNS knows the name, but the hosts line stops libc before asking it.
            line = " ".join(s.name + "".join(f" [{a}]" for a in s.actions) for s in facts.hosts_order)
            evidence.append(Evidence("/etc/nsswitch.conf", f"hosts: {line}", "a service order that reaches DNS"))
            return present(subject, *evidence)  # this node's nsswitch.conf is at fault
        if ROLE_HOST not in lookup.roles:
            # Another node's name with no record: the job needing it may fail, but the record is
            # missing for every node alike; draining each node that looks the name up would
            # drain the cluster for one missing entry.
            return present(subject, *evidence, severity=Severity.WARNING, fix=PEER_NOT_FOUND_FIX)
        return present(subject, *evidence)
    errors: list[Evidence] = []
    # Gloo binds to the first address and c10d dials them in order: a loopback address behind a
    # routable one (a global IPv6 address outranks IPv4 by glibc's default precedence) is not used.
    loopback = [a for a in result.addresses[:1] if is_loopback_address(a)]
    if not loopback and any(is_loopback_address(a) for a in result.addresses) and (unsure := _order_unknown(facts)):
        return undecided(subject, f"{subject} -> {', '.join(result.addresses)}: which comes first cannot be told ({unsure})")
    if loopback and (ROLE_HOST in lookup.roles or ROLE_PEER in lookup.roles or facts.nodes_in_job > 1):
        expected = (
            "a routable address of this node (Gloo binds to and advertises it unless GLOO_SOCKET_IFNAME names an interface; NCCL picks an interface instead)"
            if ROLE_HOST in lookup.roles
            else "the peer's routable address (the c10d rendezvous and Gloo dial it; NCCL's unique ID travels through it)"
        )
        entry = next((e for e in lookup.hosts_entries if is_loopback_address(e.address)), None)
        if result.service == "files" and entry is not None:
            # libc returns every matching line and sorts loopback first, wherever the line is.
            errors.append(Evidence(entry.source, f"{entry.address} {' '.join(entry.names)}", expected))
        else:
            errors.append(Evidence(result.service, f"{subject} -> {', '.join(loopback)}", expected))
    # Nothing NCCL, Gloo or torch.distributed does looks an address up backwards, and a pod's
    # PTR record names what the cluster DNS gives it (Kubernetes' DNS specification), not the pod.
    warnings = _reverse_mismatches(lookup) if not facts.kubernetes_pod else []
    disagreement = _disagreement(lookup)
    if disagreement is not None:
        warnings.insert(0, disagreement)
    if not (errors or warnings):
        # What libc would answer is unknown (no DNS answers, an NSS service we cannot follow).
        return undecided(subject, f"{subject}: {result.detail}") if result.status == "undetermined" else None
    downgrade = _loopback_downgrade(lookup, facts) if errors else ""
    if downgrade:
        return present(subject, *errors, *warnings, severity=Severity.WARNING, fix=downgrade)
    rewritten = errors and facts.hosts_by_cloud_init and any(e.source.startswith("/etc/hosts:") for e in errors)
    return present(subject, *errors, *warnings, severity=None if errors else Severity.WARNING, fix=CLOUD_INIT_FIX if rewritten else "")


def _order_unknown(facts: HostnameFacts) -> str:
    """Why getaddrinfo's order of a name's addresses is unknown here ("" when known): /etc/gai.conf
    unread, or whether the node can send IPv6 at all."""
    if facts.gai_error:
        return f"/etc/gai.conf: {facts.gai_error}"
    return "/proc/net/if_inet6 could not be read" if facts.ipv6_usable is None else ""


def _judge_nameserver(server: NameserverCheck, facts: HostnameFacts) -> Observation | None:
    where = f"DNS query to {server.server} ({facts.nameserver_origin})"
    if server.error:
        observed = f"{server.error.lower()}: {server.detail}".strip(": ")
        fix = ""
        if is_loopback_address(server.server):
            stub = "the systemd-resolved stub" if server.server == SYSTEMD_RESOLVED_STUB else "a resolver on loopback"
            observed += f"; {server.server} is {stub}, reachable only where that resolver runs"
            fix = (
                f"Point resolv.conf at resolvers reachable from the job's network namespace: with systemd-resolved, "
                f"use /run/systemd/resolve/resolv.conf (the upstream servers) instead of the {SYSTEMD_RESOLVED_STUB} "
                "stub file, or give containers host networking or the cluster's DNS servers."
            )
        anyone = any(not c.error and c.rcode in HEALTHY_RCODES for c in facts.nameservers)
        unneeded = "" if anyone else _dns_unneeded(facts)
        if unneeded:
            observed += f"; the job's names do not need DNS here: {unneeded}"
        return present(
            f"nameserver {server.server}",
            Evidence(where, observed, "an answer"),
            severity=Severity.WARNING if anyone or unneeded else None,
            fix=fix,
        )
    if server.rcode not in HEALTHY_RCODES:
        return present(f"nameserver {server.server}", Evidence(where, f"answers {server.rcode}", "NOERROR or NXDOMAIN"),
                       severity=Severity.WARNING)
    if server.elapsed_s is not None and server.elapsed_s > SLOW_NAMESERVER_S:
        return present(
            f"nameserver {server.server}",
            Evidence(where, f"answered in {server.elapsed_s:.2f} s", f"under {SLOW_NAMESERVER_S:g} s"),
            severity=Severity.WARNING,
        )
    return None


def _dns_unneeded(facts: HostnameFacts) -> str:
    """Why libc never asks DNS for the names the job needs (so a dead nameserver cannot fail
    it), or "" where it may: nsswitch.conf's hosts line names no DNS service, or this host's name
    and every sampled peer's, another node's among them, were answered by an earlier service (a
    cluster-wide /etc/hosts). This host's own line alone proves nothing: container runtimes and
    Kubernetes write it into every /etc/hosts, and their pods find each other through DNS."""
    if facts.hosts_order_error:
        return ""
    if not any(service.name in DNS_SERVICES for service in facts.hosts_order):
        return "/etc/nsswitch.conf's hosts line names no DNS service"
    if facts.peers_error or facts.hostname is None:
        return ""
    if not any(not same_host(peer.name, facts.hostname) for peer in facts.peers):
        return ""
    results = [libc_lookup(lookup, facts) for lookup in facts.lookups()]
    if not all(result.status == "found" and result.service not in DNS_SERVICES for result in results):
        return ""
    services = ", ".join(sorted({result.service for result in results}))
    return f"this host's name and the {len(facts.peers)} peer name(s) looked up are answered by {services} before DNS"


@check("DNS001", profiles=("prolog",))
def hostname_resolution_broken(hostname: HostnameFacts) -> Iterator[Observation]:
    """Names the job needs resolve to loopback, not at all, or inconsistently; nameservers fail."""
    if hostname.hostname is None:
        yield undecided("hostname", "; ".join(hostname.problems) or "/proc/sys/kernel/hostname is empty")
    for lookup in hostname.lookups():
        observation = _judge_name(lookup, hostname)
        if observation is not None:
            yield observation
    if hostname.peers_error:
        yield undecided("job peers", hostname.peers_error)
    if hostname.dns_error and not hostname.nameservers:
        yield undecided("nameservers", f"not queried: {hostname.dns_error}")
    for server in hostname.nameservers:
        observation = _judge_nameserver(server, hostname)
        if observation is not None:
            yield observation
