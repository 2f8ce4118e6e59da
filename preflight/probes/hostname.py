"""How the names a job depends on resolve (reference DNS001).

Subjects, one finding each: this node's host name, the job's peers (``SLURM_JOB_NODELIST``,
``MASTER_ADDR``) and every nameserver the node asks.

Sources:

* ``/proc/sys/kernel/hostname`` (the UTS name ``gethostname()`` returns);
* ``/etc/nsswitch.conf`` ``hosts:`` line (nsswitch.conf(5)): the services libc asks, in order, and
  the ``[STATUS=action]`` items between them. Without a ``hosts`` line glibc 2.36 asks ``files``
  and then ``dns`` (measured: a name in both /etc/hosts and DNS resolves to the hosts address);
* ``/etc/hosts`` (hosts(5)). Both files are read as glibc reads them, bytes line by line
  (``read_as_glibc``): a byte that is not UTF-8 in a comment changes nothing. glibc's files service
  answers UNAVAIL only when it cannot open /etc/hosts (it is missing); a file preflight could not
  read although glibc would (past the read cap, not captured) leaves the lookup undetermined;
* ``/proc/self/environ``: ``SLURM_JOB_NODELIST`` (expanded like ``scontrol show hostnames``), or
  inside an srun step (``SLURM_STEP_ID``) the step's own ``SLURM_STEP_NODELIST`` and
  ``SLURM_STEP_NUM_NODES`` (a step may run on fewer nodes than the allocation), ``MASTER_ADDR``
  and ``GLOO_SOCKET_IFNAME``;
* DNS through the node's resolv.conf (search list, ``ndots``; ``preflight.sources.dns``): one
  timed query to each nameserver on its own, then ``A``/``AAAA`` for every name and ``PTR`` for
  the addresses libc would hand out, through the nameservers that answered.

Why it matters: torchrun's c10d rendezvous, Gloo and the ``MASTER_ADDR`` store resolve host names
with ``getaddrinfo`` and dial the first address. glibc sorts an IPv4 loopback address ahead of a
routable IPv4 one for the same name wherever the lines sit in /etc/hosts (RFC 6724 rule 8 with
glibc's scope table, which puts 127/8 in link-local scope; reproduced with glibc 2.36), but a
global IPv6 address ahead of both unless /etc/gai.conf raises IPv4's precedence
(:mod:`preflight.gai`, which also reads ``/etc/gai.conf`` and ``/proc/net/if_inet6``). Gloo, unless
``GLOO_SOCKET_IFNAME`` names an interface, binds to and advertises the address its own host name
resolves to, so a Debian-style ``127.0.1.1 <hostname>`` line makes its peers dial their own
loopback. torch elastic publishes a name, not an address (``RendezvousStoreInfo.build``:
``local_addr or socket.getfqdn()``), which each peer resolves with its own resolver. NCCL's own
bootstrap never resolves this host's name: it advertises the
address of the interface it picks (``NCCL_SOCKET_IFNAME``, else ``ib*``, else the first interface
that is not docker, lo or virbr; ``src/misc/socket.cc``), so NCCL is hurt only through the
rendezvous that carries its unique ID. ``socket.getfqdn()``, which
torch elastic uses to name the local agent, follows the reverse (PTR) answer.

Peers are sampled, not all resolved: each node asks for ``MASTER_ADDR``, the first node of the
job and its next few successors in the node list, so every name in the job is asked by some node
while no node sends thousands of queries at job start.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence

from msgspec import Struct
from msgspec.structs import replace

from preflight.config import HostConfig
from preflight.gai import gai_order, parse_precedence
from preflight.hostlist import HostlistError, expand
from preflight.nss import NssService, nsswitch_services, read_as_glibc
from preflight.probes.job import RANK_COUNTS, in_srun_step, operator_nodes, parse_environ, rendezvous_host
from preflight.probing import KUBELET_HOSTS_HEADER, FactReader
from preflight.registry import probe
from preflight.sources import NodeFS, SourceError
from preflight.sources.dns import Dns, DnsAnswer, NameserverCheck
from preflight.units import is_number

#: Peers resolved by one node besides MASTER_ADDR and the first node of the job.
PEER_SUCCESSORS = 6


#: Addresses per name whose reverse (PTR) answer is checked.
MAX_REVERSE_PER_NAME = 4


#: RCODEs of a working server: it either knows the name or says it does not exist.
HEALTHY_RCODES = ("NOERROR", "NXDOMAIN")


ROLE_HOST = "this host"


ROLE_MASTER = "MASTER_ADDR"


ROLE_PEER = "peer"


class HostsEntry(Struct, frozen=True):
    address: str
    names: tuple[str, ...]
    source: str  # "/etc/hosts:3"


#: glibc 2.36 without a hosts line: files, then dns (see the module docstring).
FILES_THEN_DNS = (NssService("files"), NssService("dns"))


class NameLookup(Struct, frozen=True):
    """One name the job needs: its /etc/hosts lines, DNS answers and its addresses' PTR answers."""

    name: str
    roles: tuple[str, ...]  # ROLE_HOST, or ROLE_MASTER and/or ROLE_PEER
    hosts_entries: tuple[HostsEntry, ...]  # /etc/hosts lines naming it exactly (any case)
    dns_answers: tuple[DnsAnswer, ...]  # A and AAAA, search list applied; () when DNS was not read
    reverse: tuple[DnsAnswer, ...] = ()  # PTR for the addresses libc returns


class HostnameFacts(Struct, frozen=True):
    hostname: str | None  # /proc/sys/kernel/hostname
    hosts_entries: tuple[HostsEntry, ...]  # /etc/hosts lines naming this host exactly (any case)
    dns_answers: tuple[DnsAnswer, ...]  # this host's A and AAAA; () when DNS could not be read
    problems: tuple[str, ...]  # files that could not be read (the host name)
    reverse: tuple[DnsAnswer, ...] = ()  # PTR answers for this host's addresses
    peers: tuple[NameLookup, ...] = ()  # MASTER_ADDR and sampled SLURM_JOB_NODELIST peers
    nodes_in_job: int = 0  # nodes of the job step (SLURM_STEP_NUM_NODES) inside one, else of SLURM_JOB_NODELIST
    peers_error: str = ""  # why the job's peers are not known (environ unreadable, bad node list)
    hosts_order: tuple[NssService, ...] = FILES_THEN_DNS  # /etc/nsswitch.conf hosts:
    hosts_error: str = ""  # why /etc/hosts could not be read, "" when it was (or is missing)
    hosts_order_error: str = ""  # why /etc/nsswitch.conf's order is unknown (unread, not captured), "" when known
    hosts_missing: bool = False  # no /etc/hosts at all, which glibc's files service answers UNAVAIL
    gloo_socket_ifname: str = ""  # GLOO_SOCKET_IFNAME when PyTorch reads it (longer than one character)
    # cloud-init rewrites /etc/hosts from its template at every boot (manage_etc_hosts: true), as its
    # header says: an edit of the file itself does not last
    hosts_by_cloud_init: bool = False
    # /etc/hosts carries kubelet's header: a Kubernetes pod, whose address's PTR record is the
    # cluster DNS's name for it (a headless service's), never the pod's host name
    kubernetes_pod: bool = False
    nameservers: tuple[NameserverCheck, ...] = ()  # one timed query to each nameserver
    nameserver_origin: str = "/etc/resolv.conf"  # or the site config's [dns] nameservers
    dns_error: str = ""  # why DNS answers could not be had at all (no recording...)
    # How getaddrinfo orders a name's addresses (preflight.gai): /etc/gai.conf's precedence lines
    # (None: none, glibc's default table), and whether the node has a global IPv6 address to send
    # from (/proc/net/if_inet6; False without one or without IPv6, None when unread)
    gai_precedence: tuple[tuple[str, int], ...] | None = None
    gai_error: str = ""  # why /etc/gai.conf could not be read, "" when it was or is missing
    ipv6_usable: bool | None = False

    def lookups(self) -> list[NameLookup]:
        """This host's lookup first, then the peers'."""
        own = []
        if self.hostname is not None:
            own = [NameLookup(self.hostname, (ROLE_HOST,), self.hosts_entries, self.dns_answers, self.reverse)]
        return own + list(self.peers)


# -- parsers ----------------------------------------------------------------------------------
def parse_hosts(text: str, path: str = "/etc/hosts") -> list[HostsEntry]:
    entries = []
    for number, line in enumerate(text.splitlines(), 1):
        fields = line.split("#", 1)[0].split()
        # glibc's files service skips lines whose address does not parse (inet_pton).
        if len(fields) >= 2 and is_ip_literal(fields[0]):
            entries.append(HostsEntry(fields[0], tuple(fields[1:]), f"{path}:{number}"))
    return entries


def parse_nsswitch_hosts(text: str) -> tuple[NssService, ...]:
    """The ``hosts:`` line of nsswitch.conf; glibc's default order when there is none."""
    return nsswitch_services(text, "hosts") or FILES_THEN_DNS


# -- names ------------------------------------------------------------------------------------
def _plain(name: str) -> str:
    return name.lower().rstrip(".")


def same_host(first: str, second: str) -> bool:
    """Two spellings of one host: equal ignoring case and the root dot, or a relative name and an
    FQDN whose leading labels it is (the resolver's search domains complete gpu01 to
    gpu01.cluster.local, and a Kubernetes pod's trainer-0.trainer to
    trainer-0.trainer.default.svc.cluster.local)."""
    a, b = _plain(first).split("."), _plain(second).split(".")
    shorter, longer = (a, b) if len(a) <= len(b) else (b, a)
    return longer[: len(shorter)] == shorter


def is_ip_literal(text: str) -> bool:
    try:
        ipaddress.ip_address(text.split("%", 1)[0])
    except ValueError:
        return False
    return True


def is_loopback_address(address: str) -> bool:
    try:
        return ipaddress.ip_address(address.split("%", 1)[0]).is_loopback
    except ValueError:
        return False


def select_peers(hostname: str | None, nodes: Sequence[str], master_addr: str) -> list[tuple[str, tuple[str, ...]]]:
    """(name, roles) of the peers this node resolves: MASTER_ADDR, the job's first node and the
    next PEER_SUCCESSORS nodes after this one in the list (cyclically), without this host."""
    own = next((i for i, node in enumerate(nodes) if hostname and same_host(node, hostname)), -1)
    chosen: dict[str, list[str]] = {}
    if master_addr and not is_ip_literal(master_addr) and not (hostname and same_host(master_addr, hostname)):
        chosen[master_addr] = [ROLE_MASTER]
    successors = [nodes[(own + step) % len(nodes)] for step in range(1, min(len(nodes), PEER_SUCCESSORS + 1))]
    candidates = list(nodes[:1]) + successors
    for node in candidates:
        if hostname and same_host(node, hostname):
            continue
        known = next((name for name in chosen if same_host(name, node)), None)
        if known is None:
            chosen[node] = [ROLE_PEER]
        elif ROLE_PEER not in chosen[known]:
            chosen[known].append(ROLE_PEER)
    return [(name, tuple(roles)) for name, roles in chosen.items()]


def job_nodes(environ: dict[str, str]) -> tuple[list[str], int, str]:
    """The nodes whose names the job dials, how many nodes it runs on, and why they are not known
    ("" when they are). Inside an srun step the step's: separate single-node runs inside a larger
    allocation meet on one node whatever the allocation holds. A part of a heterogeneous job lists
    only its own nodes, while one srun across the parts is one MPI_COMM_WORLD (Slurm's
    heterogeneous_jobs.html): how many nodes meet is not known there."""
    in_step = in_srun_step(environ)
    variable = "SLURM_STEP_NODELIST" if in_step and environ.get("SLURM_STEP_NODELIST") else "SLURM_JOB_NODELIST"
    try:
        nodes = expand(environ.get(variable, ""))
    except HostlistError as error:
        return [], 0, f"{variable}: {error}"
    count = environ.get("SLURM_STEP_NUM_NODES", "").strip() if in_step else ""
    if not nodes and not is_number(count):
        return [], _launcher_nodes(environ), ""
    if environ.get("SLURM_HET_JOB_ID", "").strip() or environ.get("SLURM_PACK_JOB_ID", "").strip():
        return nodes, 0, ""
    return nodes, int(count) if is_number(count) else len(nodes), ""


def _launcher_nodes(environ: dict[str, str]) -> int:
    """The nodes of a job a launcher started outside Slurm: torchrun's GROUP_WORLD_SIZE (its
    agents, one per node), DeepSpeed's CROSS_SIZE or the training operator's PET_NNODES (its
    largest), else 1 where the job's ranks are all this node's (by any launcher's pair of
    counts: torchrun --standalone, mpirun on one host); 0 when not known."""
    for name in ("GROUP_WORLD_SIZE", "CROSS_SIZE"):
        nodes = environ.get(name, "").strip()
        if is_number(nodes):
            return int(nodes)
    most = operator_nodes(environ)  # the most nodes a Kubeflow PyTorchJob may grow to
    if most is not None:
        return most
    for world_name, local_name in RANK_COUNTS:
        world, local = environ.get(world_name, "").strip(), environ.get(local_name, "").strip()
        if is_number(world) and world == local and int(world) > 0:
            return 1
    return 0


# -- what libc would answer -------------------------------------------------------------------
class LibcResult(Struct, frozen=True):
    """getaddrinfo(name) as emulated from nsswitch.conf, /etc/hosts and the DNS answers."""

    status: str  # "found" | "not_found" | "unavailable" | "undetermined"
    addresses: tuple[str, ...]  # in getaddrinfo's order; () when the service gives this node's own
    service: str  # the service that decided (or that could not be emulated)
    detail: str


def _dns_status(answers: Sequence[DnsAnswer]) -> tuple[str, tuple[str, ...], str]:
    addresses = tuple(address for answer in answers for address in answer.addresses)
    summary = "; ".join(
        f"{a.rdtype} {', '.join(a.addresses) or (a.error + (' ' + a.detail if a.detail else ''))}" for a in answers
    )
    if addresses:
        return "SUCCESS", addresses, summary
    errors = {answer.error for answer in answers}
    if errors <= {"NXDOMAIN", "NOANSWER"}:
        return "NOTFOUND", (), summary
    if errors == {"NO_NAMESERVERS"}:
        return "UNAVAIL", (), summary
    return "TRYAGAIN", (), summary


def _action(service: NssService, status: str) -> str:
    action = "return" if status == "SUCCESS" else "continue"
    for item in service.actions:
        condition, _, chosen = item.partition("=")
        negated = condition.startswith("!")
        if (condition.lstrip("!") == status) != negated:
            action = chosen
    return action


def libc_lookup(lookup: NameLookup, facts: HostnameFacts) -> LibcResult:
    """Walk the nsswitch.conf hosts services as glibc does for ``lookup.name``."""
    status, service, detail = "NOTFOUND", "", ""
    addresses: tuple[str, ...] = ()
    if facts.hosts_order_error:
        return LibcResult("undetermined", (), "", facts.hosts_order_error)
    for service_entry in facts.hosts_order:
        service = service_entry.name
        if service == "files":
            if facts.hosts_error:
                # A read glibc would not fail (past preflight's cap, refused, not captured): what
                # glibc finds there is unknown, and calling it UNAVAIL would hand the name to DNS.
                return LibcResult("undetermined", (), service, f"/etc/hosts: {facts.hosts_error}")
            if facts.hosts_missing:
                # nss/nss_files/files-XXX.c internal_setent: a failed fopen is UNAVAIL.
                status, addresses, detail = "UNAVAIL", (), "/etc/hosts: missing (glibc's files service: UNAVAIL)"
            elif lookup.hosts_entries:
                status = "SUCCESS"
                addresses = tuple(entry.address for entry in lookup.hosts_entries)
                detail = ", ".join(entry.source for entry in lookup.hosts_entries)
            else:
                status, addresses, detail = "NOTFOUND", (), "/etc/hosts: no entry"
        elif service in ("dns", "resolve"):
            if not lookup.dns_answers:
                return LibcResult("undetermined", (), service, facts.dns_error or "DNS answers could not be read")
            status, addresses, detail = _dns_status(lookup.dns_answers)
        elif service == "myhostname":
            # nss-myhostname answers the local host name with this node's own addresses.
            name = _plain(lookup.name)
            if name == "localhost" or name.endswith(".localhost"):
                status, addresses, detail = "SUCCESS", ("127.0.0.1", "::1"), "nss-myhostname: localhost"
            elif ROLE_HOST in lookup.roles:
                status, addresses, detail = "SUCCESS", (), "nss-myhostname: this node's own addresses"
            else:
                status, addresses, detail = "NOTFOUND", (), "nss-myhostname: not this host"
        elif service.startswith("mdns") and not _plain(lookup.name).endswith(".local"):
            # nss-mdns refuses other names with UNAVAIL, so "[NOTFOUND=return]" after it does not stop.
            status, addresses, detail = "UNAVAIL", (), f"{service}: only .local names"
        else:
            return LibcResult("undetermined", (), service, f"nsswitch.conf service {service!r} cannot be emulated")
        if _action(service_entry, status) in ("return", "merge"):
            break
    results = {"SUCCESS": "found", "NOTFOUND": "not_found"}
    if status == "UNAVAIL" and service == "files":
        return LibcResult("not_found", (), service, detail)  # no /etc/hosts, and no service after it
    ordered = gai_order(addresses, facts.gai_precedence, facts.ipv6_usable)
    return LibcResult(results.get(status, "unavailable"), ordered, service, detail)


def _ipv6_usable(reader: FactReader) -> bool | None:
    """Whether the node has a global IPv6 address (``/proc/net/if_inet6``: address, ifindex,
    prefix length, scope, flags, name; scope 00 is global), which getaddrinfo needs to rank an
    IPv6 destination as usable; the file is not there where IPv6 is off. None when unread."""
    from preflight.sources.netlink import parse_if_inet6

    known, text = reader.known_text("/proc/net/if_inet6")
    if not known:
        return None
    return any(address.scope == "global" for address in parse_if_inet6(text or ""))


#: The first line kubelet writes into every pod's /etc/hosts (pkg/kubelet/kubelet_pods.go,
#: managedHostsHeader; "(host network)" follows it for hostNetwork pods, which have no veth).

#: The header of cloud-init's /etc/hosts templates (templates/hosts.*.tmpl of canonical/cloud-init).
CLOUD_INIT_MARK = "configured 'manage_etc_hosts' as True"


# -- probe ------------------------------------------------------------------------------------
@probe("hostname")
def probe_hostname(fs: NodeFS, dns: Dns, settings: HostConfig) -> HostnameFacts:
    """Read the name facts, ask each nameserver once, then resolve every name forward and back."""
    reader = FactReader(fs)
    raw = reader.text("/proc/sys/kernel/hostname")
    hostname = raw.strip() if raw and raw.strip() else None
    hosts_error, hosts_text = "", None
    try:
        hosts_text = read_as_glibc(fs, "/etc/hosts")
    except SourceError as error:
        hosts_error = error.reason
    all_entries = parse_hosts(hosts_text or "")
    try:
        order_error, order = "", parse_nsswitch_hosts(read_as_glibc(fs, "/etc/nsswitch.conf") or "")
    except SourceError as error:
        # glibc would read it (no size cap) or was not captured reading it: its order is unknown,
        # and guessing glibc's defaults could send every name to a service the node never asks.
        order_error, order = str(error), FILES_THEN_DNS
    peers_error = ""
    try:
        environ = parse_environ(fs.read_bytes("/proc/self/environ") or b"")
    except SourceError as error:
        environ, peers_error = {}, str(error)
    nodes, node_count, list_error = job_nodes(environ)
    peers_error = peers_error or list_error
    subjects = ([(hostname, (ROLE_HOST,))] if hostname else []) + select_peers(
        hostname, nodes, rendezvous_host(environ)[0]
    )
    lookups = [
        # The files service matches the name exactly (any case), with no search domains.
        NameLookup(name, roles, tuple(e for e in all_entries if _plain(name) in map(_plain, e.names)), ())
        for name, roles in subjects
    ]
    gai_error, gai_table = "", None
    try:
        gai_table = parse_precedence(read_as_glibc(fs, "/etc/gai.conf") or "")
    except SourceError as error:
        gai_error = str(error)
    origin = f"[dns] nameservers in {settings.origin or 'the site config'}" if settings.dns.nameservers else "/etc/resolv.conf"
    facts = HostnameFacts(
        hostname, (), (), (), nodes_in_job=node_count, peers_error=peers_error, hosts_order=order,
        hosts_error=hosts_error, hosts_order_error=order_error, nameserver_origin=origin,
        hosts_missing=hosts_text is None and not hosts_error,
        # ProcessGroupGloo reads it only when longer than one character (checks/gloo.py).
        gloo_socket_ifname=gloo if len(gloo := environ.get("GLOO_SOCKET_IFNAME", "")) > 1 else "",
        hosts_by_cloud_init=CLOUD_INIT_MARK in (hosts_text or "")[:4096],
        kubernetes_pod=(hosts_text or "").startswith(KUBELET_HOSTS_HEADER),
        gai_precedence=gai_table, gai_error=gai_error, ipv6_usable=_ipv6_usable(reader),
    )
    checks: list[NameserverCheck] = []
    try:
        checks = dns.check_nameservers(hostname or "localhost")
        lookups = _resolve_all(dns, lookups, facts, checks)
    except SourceError as error:
        facts = replace(facts, dns_error=str(error))
    own = lookups[0] if hostname else None
    return replace(
        facts,
        hosts_entries=own.hosts_entries if own else (),
        dns_answers=own.dns_answers if own else (),
        reverse=own.reverse if own else (),
        peers=tuple(lookups[1:] if own else lookups),
        problems=tuple(reader.problems),
        nameservers=tuple(checks),
    )


def _resolve_all(
    dns: Dns, lookups: list[NameLookup], facts: HostnameFacts, checks: list[NameserverCheck]
) -> list[NameLookup]:
    """Forward answers for every name, then PTR answers for the addresses libc would return,
    through the nameservers that answered (a dead first server would eat every lifetime)."""
    healthy = [c.server for c in checks if not c.error and c.rcode in HEALTHY_RCODES]
    questions = [(lookup.name, rdtype) for lookup in lookups for rdtype in ("A", "AAAA")]
    if checks and not healthy:
        detail = "no nameserver answered (" + "; ".join(f"{c.server}: {c.error or c.rcode}" for c in checks) + ")"
        answers = [DnsAnswer(name, rdtype, error="TIMEOUT", detail=detail) for name, rdtype in questions]
    else:
        answers = dns.resolve_many(questions, healthy or None)
    forward = {(answer.name, answer.rdtype): answer for answer in answers}
    lookups = [
        replace(lookup, dns_answers=tuple(forward[(lookup.name, t)] for t in ("A", "AAAA") if (lookup.name, t) in forward))
        for lookup in lookups
    ]
    targets = {lookup.name: _reverse_targets(lookup, facts) for lookup in lookups}
    addresses = list(dict.fromkeys(address for found in targets.values() for address in found))
    if not addresses or (checks and not healthy):
        return lookups
    reverse = {answer.name: answer for answer in dns.resolve_many([(a, "PTR") for a in addresses], healthy or None)}
    return [
        replace(lookup, reverse=tuple(reverse[a] for a in targets[lookup.name] if a in reverse)) for lookup in lookups
    ]


def _reverse_targets(lookup: NameLookup, facts: HostnameFacts) -> list[str]:
    """The routable addresses libc hands out for the name, then DNS's own if they differ."""
    result = libc_lookup(lookup, facts)
    dns_addresses = [a for answer in lookup.dns_answers for a in answer.addresses]
    targets = [a for a in (*result.addresses, *dns_addresses) if is_ip_literal(a) and not is_loopback_address(a)]
    return list(dict.fromkeys(targets))[:MAX_REVERSE_PER_NAME]
