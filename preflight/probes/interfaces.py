"""Network interfaces and their addresses, for the report and for fleet comparison.

Sources: rtnetlink link and address dumps (live), ``<root>/.preflight/netlink.json`` (replay),
or ``/sys/class/net`` with ``/proc/net/{if_inet6,fib_trie,route}`` (a copied root); see
``preflight.sources.netlink``. Checks that judge interface selection build on these facts.
"""

from __future__ import annotations

from msgspec import Struct

from preflight.registry import probe
from preflight.sources.netlink import Address, Link, Netlink


class InterfaceFacts(Struct, frozen=True):
    links: tuple[Link, ...]
    addresses: tuple[Address, ...]


@probe("interfaces", gather_in=("full",))
def probe_interfaces(netlink: Netlink) -> InterfaceFacts:
    """Dump links and addresses once."""
    return InterfaceFacts(tuple(netlink.links()), tuple(netlink.addresses()))
