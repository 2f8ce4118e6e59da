"""Gloo's transport: the interfaces the job tells Gloo to use (GLOO references).

Sources: the job environment (``preflight.probes.job``; ``GLOO_SOCKET_IFNAME``) and the node's
interfaces and addresses (``preflight.probes.interfaces``).

* PyTorch splits ``GLOO_SOCKET_IFNAME`` at commas and creates one Gloo TCP device per name
  (``createDeviceForInterface``; ``torch/csrc/distributed/c10d/init.cpp``); unset, Gloo takes
  the address the host name resolves to instead.
* Gloo's ``lookupAddrForIface`` (``gloo/transport/tcp/device.cc``) walks getifaddrs(3) for an
  entry whose name equals the interface exactly and that carries an IPv4 or IPv6 address; with
  none it stops with "Unable to find address for: <name>". The link's state is not consulted.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from msgspec.structs import replace

from preflight.model import Evidence, NotApplicable, Observation, Severity, Status, Unknown, merge_by_subject, present
from preflight.probes.firewall import (
    ADDRESSES_UNKNOWN,
    FirewallFacts,
    blocked_findings,
    gloo_interfaces,
    no_listener_here,
    on_one_node,
    only_if_every_interface,
    port_fates,
    readable_ruleset,
)
from preflight.probes.sockets import PORT_RANGE, job_master_port
from preflight.registry import check

if TYPE_CHECKING:
    from collections.abc import Iterator

    # annotations only: the interfaces probe module is not imported for a prolog run
    from preflight.probes.interfaces import InterfaceFacts
    from preflight.probes.job import JobFacts
    from preflight.probes.sockets import SocketFacts

GLOO_IFNAME = "GLOO_SOCKET_IFNAME"
_SHOWN_NAMES = 12  # interfaces listed in the evidence; a node with hundreds of VFs needs no more


@check("GLOO001", profiles=("full",))
def gloo_transport_misconfigured(job: JobFacts, interfaces: InterfaceFacts) -> Iterator[Observation]:
    """GLOO_SOCKET_IFNAME names an interface this node does not have, or one without an IPv4 or
    IPv6 address, so Gloo cannot create its device and the process group fails."""
    if job.environ_error:
        raise Unknown(f"/proc/self/environ unreadable ({job.environ_error})")
    value = job.environ.get(GLOO_IFNAME)
    if value is None:
        raise NotApplicable(f"{GLOO_IFNAME} is unset: Gloo uses the address the host name resolves to (DNS001 judges a loopback one)")
    if len(value) <= 1:
        # ProcessGroupGloo's binding reads the variable only when it is longer than one character
        # (torch/csrc/distributed/c10d/init.cpp: strlen(ifnameEnv) > 1), as NCCL does its own.
        raise NotApplicable(f"{GLOO_IFNAME}={value!r} is ignored (PyTorch reads it only when longer than one character): Gloo uses the host name's address")
    setting = Evidence(f"/proc/self/environ {GLOO_IFNAME}", repr(value))
    links = sorted(link.name for link in interfaces.links)
    addressed = {address.ifname for address in interfaces.addresses}
    for name in dict.fromkeys(part for part in value.split(",") if part):
        if name not in links:
            shown = ", ".join(links[:_SHOWN_NAMES]) + (", ..." if len(links) > _SHOWN_NAMES else "")
            yield present(name, setting, Evidence("network interfaces", f"no interface {name!r}; this node has {shown or 'none'}", "an interface of exactly that name"))
        elif name not in addressed:
            yield present(name, setting, Evidence(f"addresses of {name}", "none", "an IPv4 or IPv6 address for Gloo to bind and publish"))


@check("GLOO002", profiles=("prolog",))
def gloo_rendezvous_connection_refused(firewall: FirewallFacts, sockets: SocketFacts, job: JobFacts) -> Iterator[Observation]:
    """The host firewall rejects or drops TCP connections from other hosts to the rendezvous port
    (MASTER_PORT, 29500 by default: the TCPStore when this node runs rank 0) or to the ephemeral
    ports Gloo's pairs listen on, so the process group cannot connect."""
    ruleset = readable_ruleset(firewall)
    if job.environ_error:
        raise Unknown(f"/proc/self/environ unreadable ({job.environ_error})")
    if sockets.port_range is None:
        raise Unknown(f"{PORT_RANGE} unread: the ports Gloo listens on are not known")
    store = job_master_port(job)
    if store.port is None:
        raise Unknown(store.origin)
    port = store.port
    # Gloo takes GLOO_SOCKET_IFNAME as exact names; unset, the host name's address (any interface).
    names = job.environ.get(GLOO_IFNAME)
    interfaces = gloo_interfaces(firewall.interfaces, names, firewall.reachable())
    if not interfaces:
        no_listener_here(firewall)
        raise NotApplicable(f"no interface Gloo would listen on (only loopback, or {GLOO_IFNAME} names none this node has)")
    blocked = frozenset({"dropped", "rejected"})
    # A prolog or epilog sees none of what the job exports: an unset MASTER_PORT there says
    # nothing of the job's, and PyTorch's default is only the port of a job that sets none.
    unseen = not store.named and job.in_slurmd_script
    origin = (
        f"MASTER_PORT not visible to a slurmd script: PyTorch's default {port}, used only by a job that sets none" if unseen
        else store.origin
    )
    # The store's clients dial MASTER_ADDR in whichever family it resolves to; Gloo's pairs use
    # GLOO_SOCKET_IFNAME's first address (IPv4 where there is one), else the host name's.
    rendezvous = blocked_findings(
        port_fates(firewall, ruleset, interfaces, ((port, port),), ipv6=None), blocked,
        f"the rendezvous port ({origin})", "accepted: the TCPStore of rank 0 listens there",
    )
    if unseen:
        rendezvous = [replace(item, severity=Severity.WARNING) if item.status is Status.PRESENT else item for item in rendezvous]
    ephemeral = blocked_findings(
        port_fates(firewall, ruleset, interfaces, (sockets.port_range,), ipv6=False if names else None), blocked,
        "ephemeral port", "accepted: Gloo's pairs listen on ports the kernel picks from ip_local_port_range",
    )
    merged = on_one_node(job, merge_by_subject(rendezvous + ephemeral))  # one finding per interface
    if names and firewall.addressed is not None:
        yield from merged
    else:
        # Unset, Gloo listens on one address only, the host name's, where peers reach the node.
        doubt = f"{GLOO_IFNAME} is unset, so Gloo listens on the host name's address alone" if not names else ADDRESSES_UNKNOWN
        yield from only_if_every_interface(merged, interfaces, doubt)
