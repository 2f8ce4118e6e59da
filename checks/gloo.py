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

from preflight.model import Evidence, NotApplicable, Observation, Unknown, present
from preflight.probes.interfaces import InterfaceFacts
from preflight.probes.job import JobFacts
from preflight.registry import check

if TYPE_CHECKING:
    from collections.abc import Iterator

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
    setting = Evidence(f"/proc/self/environ {GLOO_IFNAME}", repr(value))
    links = sorted(link.name for link in interfaces.links)
    addressed = {address.ifname for address in interfaces.addresses}
    for name in dict.fromkeys(part for part in value.split(",") if part):
        if name not in links:
            shown = ", ".join(links[:_SHOWN_NAMES]) + (", ..." if len(links) > _SHOWN_NAMES else "")
            yield present(name, setting, Evidence("network interfaces", f"no interface {name!r}; this node has {shown or 'none'}", "an interface of exactly that name"))
        elif name not in addressed:
            yield present(name, setting, Evidence(f"addresses of {name}", "none", "an IPv4 or IPv6 address for Gloo to bind and publish"))
