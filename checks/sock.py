"""Ports and sockets NCCL's bootstrap and socket transport use (SOCK references)."""

from __future__ import annotations

import ipaddress
from typing import TYPE_CHECKING

from preflight.model import (
    Evidence,
    Observation,
    Severity,
    present,
    undecided,
)
from preflight.nccl.releases import CONNECT_RETRY, loaded_copies, release_findings, require_nccl
from preflight.probes.firewall import FirewallFacts, nccl_port_findings
from preflight.probes.hostname import is_ip_literal, is_loopback_address, same_host
from preflight.probes.job import JobFacts, rendezvous_host
from preflight.probes.sockets import (
    PORT_RANGE,
    RESERVED_PORTS,
    TCP_TABLES,
    SocketFacts,
    job_master_port,
    reserved_ports,
)
from preflight.registry import check

if TYPE_CHECKING:
    from collections.abc import Iterator

    from preflight.probes.nccl_libs import NcclLibFacts
    from preflight.probes.rdma import RdmaFacts


@check("SOCK002", profiles=("full",))
def nccl_connect_retry_econnaborted(nccl_libs: NcclLibFacts) -> Iterator[Observation]:
    """An NCCL release whose connect retry fails on the socket it retries; every multi-process
    job bootstraps over sockets, so a late peer turns into 'Software caused connection abort'."""
    require_nccl(nccl_libs)
    yield from release_findings(loaded_copies(nccl_libs), CONNECT_RETRY, severity=Severity.WARNING)


#: Below this many usable ephemeral ports a node is called narrow: eight ranks with NCCL socket
#: channels, Gloo pairs and TCPStore clients hold thousands of ports, and a restart adds 60 s of
#: TIME_WAIT on top (the 1,000-port range of NCCL's troubleshooting example is far below it).
NARROW_RANGE_PORTS = 8192


#: Share of the usable range in use at which the next burst of connections is likely to fail.
PRESSURE_WARNING = 0.5


#: Share of the usable range held by sockets still open (not closing) at which the check is an
#: error: those ports stay taken until their owner lets go.
PRESSURE_ERROR = 0.8


def usable_ports(port_range: tuple[int, int], reserved: tuple[tuple[int, int], ...]) -> int:
    """Ports of the range not reserved, counted by interval arithmetic (the range can hold
    60,000 ports and this runs in every prolog)."""
    low, high = port_range
    covered = 0
    end = low - 1  # highest port already counted as reserved
    for start, stop in sorted(reserved):
        start, stop = max(start, end + 1), min(stop, high)
        if start <= stop:
            covered += stop - start + 1
            end = stop
    return max(0, high - low + 1 - covered)


def _share(ports: int, usable: int) -> float:
    return ports / usable if usable else 1.0


def _table_problems(sockets: SocketFacts) -> str:
    """Why the socket tables cannot be trusted to be complete, "" when they can."""
    reasons = [p for p in sockets.problems if p.startswith(TCP_TABLES)]
    if sockets.bad_line_count:
        reasons.append(f"{sockets.bad_line_count} unparseable lines, first: {sockets.bad_lines[0]}")
    if "/proc/net/tcp" not in sockets.tables:
        reasons.append("/proc/net/tcp was not read")
    return "; ".join(dict.fromkeys(reasons))


#: Variables that say this node is the rendezvous store's host when they are 0: torch's env://
#: handler starts the TCPStore server on RANK 0, torchrun's static rendezvous on its node rank
#: (GROUP_RANK, or PET_NODE_RANK as Kubeflow passes torchrun's --node-rank) 0, and Slurm numbers
#: the job's first node SLURM_NODEID 0.
FIRST_RANK_NAMES = ("RANK", "GROUP_RANK", "PET_NODE_RANK", "SLURM_NODEID")


def _is_zero(value: str | None) -> bool:
    """``0`` as int() reads it (" 0 ", "+0"), as torch and launch scripts parse these variables."""
    try:
        return value is not None and int(value) == 0
    except ValueError:
        return False


def _own_address(address: str, sockets: SocketFacts) -> bool:
    if sockets.addresses is None or not is_ip_literal(address):
        return False
    wanted = ipaddress.ip_address(address.split("%", 1)[0])
    return any(is_ip_literal(a) and ipaddress.ip_address(a.split("%", 1)[0]) == wanted for a in sockets.addresses)


def store_host(sockets: SocketFacts, job: JobFacts) -> str:
    """Why this node may be the one that binds MASTER_PORT, or "" when the job shows the store on
    another node. Only the store's host listens there (torch's env:// handler on rank 0, torchrun's
    static rendezvous on node rank 0, its c10d backend where the endpoint names this machine);
    every other node only connects to it, so a listener here is no conflict for the job."""
    for name in FIRST_RANK_NAMES:
        if _is_zero(job.environ.get(name)):
            return f"{name}={job.environ[name].strip()}"
    address, named_by = rendezvous_host(job.environ)
    if not address:
        return "MASTER_ADDR unset"
    if address.lower().rstrip(".") == "localhost" or is_loopback_address(address):
        return f"{named_by}={address} (loopback)"
    if sockets.hostname is not None and same_host(address, sockets.hostname):
        return f"{named_by}={address} (this host)"
    if _own_address(address, sockets):
        return f"{named_by}={address} (an address of this node)"
    return ""


def _elsewhere(sockets: SocketFacts, job: JobFacts) -> Evidence:
    address, named_by = rendezvous_host(job.environ)
    unseen = [what for what, missing in (("its host name", sockets.hostname is None), ("its addresses", sockets.addresses is None)) if missing]
    caveat = f" (this node's {' and '.join(unseen)} could not be read)" if unseen else ""
    return Evidence(named_by, f"{address}: another host{caveat}; this node only connects to the store there",
                    "this node, for the listener to stop the store from binding")


#: The listener on the default port may be a running job's own store: look before stopping it.
GUESSED_PORT_FIX = (
    "See whose the listener is (ss -ltnp 'sport = :29500'): a job running on this node holds its own store there, and "
    "needs nothing; stop it only where it outlived its job. Jobs that share nodes should each name their own "
    "MASTER_PORT (for example 20000 + SLURM_JOB_ID % 10000) instead of the default."
)


@check("SOCK001", profiles=("prolog",))
def rendezvous_port_in_use(sockets: SocketFacts, job: JobFacts) -> Iterator[Observation]:
    """MASTER_PORT is already listened on (an error on the node that binds it), or lies in the
    ephemeral range without a reservation; not judged in a torchrun worker, whose MASTER_PORT is
    the store its agent already holds."""
    store = job_master_port(job)
    port, origin = store.port, store.origin
    if port is None:
        yield undecided("MASTER_PORT", origin)
        return
    if job.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # A torchrun worker: MASTER_PORT is the store its agent already serves (on the node that
        # hosts the rendezvous it listens here before any worker starts, on a port the agent holds),
        # torch/distributed/elastic/agent/server/local_elastic_agent.py _start_workers.
        return
    subject = f"port {port}"
    errors = [
        Evidence(s.source, f"{s.address}:{s.port} LISTEN (uid {s.uid}, inode {s.inode}); {origin}",
                 "no listener before the job starts")
        for s in sockets.listening
        if s.port == port
    ]
    in_range = _range_evidence(port, origin, sockets)
    warnings = [in_range] if isinstance(in_range, Evidence) else []
    if errors and not store.named:
        # A guessed port (torchrun's default) is no job's choice: the listener may be a running
        # job's own rendezvous (a health check runs beside jobs, a shared node runs several), so
        # it warns; only the port the job names makes the conflict certain enough to drain.
        warnings.append(Evidence("guessed port", "a running job's rendezvous, or a stale one the next job using the default trips over",
                                 "MASTER_PORT named by the job"))
        errors, warnings = [], errors + warnings
        yield present(subject, *warnings, severity=Severity.WARNING, fix=GUESSED_PORT_FIX)
        return
    elif errors and not store_host(sockets, job):
        # Another node hosts the store: the listener here (another job's, on a shared node) takes
        # nothing from this job, which draining the node for it would requeue all the same.
        errors, warnings = [], errors + [_elsewhere(sockets, job)] + warnings
    elif errors and job.in_job_process and sockets.own_uid is not None and all(
        s.uid == sockets.own_uid for s in sockets.listening if s.port == port
    ):
        # Inside the job, a listener of this very user may be the job's own store: rank 0 of
        # torch.distributed's env:// binds it before the training function runs (Ray Train),
        # as may a stale process of the same user. Which, the node cannot tell.
        errors, warnings = [], errors + [Evidence("listener's uid", f"{sockets.own_uid}, this process's: the job's own store, or a stale process of the same user")] + warnings
    if errors or warnings:
        yield present(subject, *errors, *warnings, severity=None if errors else Severity.WARNING)
        return
    incomplete = "; ".join(filter(None, [_table_problems(sockets), in_range if isinstance(in_range, str) else ""]))
    if incomplete:
        yield undecided(subject, incomplete)


def _sysctl_problems(sockets: SocketFacts, *paths: str) -> str:
    return "; ".join(p for p in sockets.problems if p.startswith(paths)) or f"{paths[0]} was not read"


def _range_evidence(port: int, origin: str, sockets: SocketFacts) -> Evidence | str | None:
    """Evidence that ``port`` lies in the ephemeral range unreserved (the kernel may hand it to
    any outgoing connection), None when it does not, or why that cannot be told: an unread range,
    or an unread reservation list for a port inside the range."""
    if sockets.port_range is None:
        return _sysctl_problems(sockets, PORT_RANGE)
    low, high = sockets.port_range
    if not low <= port <= high:
        return None
    if sockets.reserved is None:
        return _sysctl_problems(sockets, RESERVED_PORTS)
    if reserved_ports(port, sockets.reserved):
        return None
    reserved = ",".join(f"{a}-{b}" if a != b else str(a) for a, b in sockets.reserved) or "empty"
    return Evidence(
        PORT_RANGE,
        f"{low} {high} contains {port} ({origin}); ip_local_reserved_ports: {reserved}",
        f"{port} outside the range or listed in ip_local_reserved_ports",
    )


@check("SOCK005", profiles=("prolog",))
def ephemeral_port_exhaustion(sockets: SocketFacts) -> Iterator[Observation]:
    """The ephemeral range is nearly used up, or too narrow to start with."""
    subject = "ip_local_port_range"
    if sockets.port_range is None or sockets.reserved is None:
        # Reserved ports are no ephemeral ports: without the list, neither the usable count nor
        # the share in use is known ("nothing reserved" would be a guess).
        yield undecided(subject, _sysctl_problems(sockets, PORT_RANGE, RESERVED_PORTS))
        return
    low, high = sockets.port_range
    usable = usable_ports(sockets.port_range, sockets.reserved)
    range_text = f"{low} {high}: {usable} usable ports"
    evidence: list[Evidence] = []
    severity: Severity | None = Severity.WARNING
    if usable < NARROW_RANGE_PORTS:
        evidence.append(Evidence(PORT_RANGE, range_text, f"at least {NARROW_RANGE_PORTS} usable ports"))
        severity = None if usable == 0 else Severity.WARNING
    held = sockets.ephemeral_ports_in_use or 0
    busiest = sockets.busiest[0] if sockets.busiest else None
    pressure = _share(max(held, busiest.sockets if busiest else 0), usable)
    if pressure >= PRESSURE_WARNING:
        counts = ", ".join(f"{sockets.states.get(s, 0)} {s}" for s in ("ESTABLISHED", "TIME_WAIT"))
        held_open = sockets.ephemeral_ports_open or 0
        evidence.append(Evidence(
            " + ".join(sockets.tables),
            f"{held} of {usable} ephemeral ports held ({counts})"
            + (f"; {busiest.sockets} sockets to {busiest.address}:{busiest.port}" if busiest else "")
            + (f"; {held - held_open} only by closed sockets the kernel frees within about a minute" if held > held_open else ""),
            f"under {PRESSURE_WARNING:.0%} of {range_text}",
        ))
        # Only sockets still open hold their ports for good: a range filled by the TIME_WAIT of a
        # job that just ended empties on its own, and draining the node for it would be false.
        if _share(max(held_open, sockets.busiest_open), usable) >= PRESSURE_ERROR:
            severity = None
    if evidence:
        yield present(subject, *evidence, severity=severity)
        return
    incomplete = _table_problems(sockets)
    if incomplete:
        yield undecided(subject, incomplete)


@check("SOCK004", profiles=("prolog",))
def nccl_peer_connection_refused(firewall: FirewallFacts, sockets: SocketFacts, job: JobFacts, rdma: RdmaFacts) -> Iterator[Observation]:
    """The host firewall rejects TCP connections from other hosts to the ephemeral ports NCCL
    listens on (its bootstrap, proxy and socket-transport listeners bind port 0, so the kernel
    picks from net.ipv4.ip_local_port_range), so peers' connects fail at once."""
    yield from nccl_port_findings(firewall, sockets, job, rdma, frozenset({"rejected"}))

