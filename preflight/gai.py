"""The order in which glibc's getaddrinfo returns a name's addresses (RFC 6724 as glibc does it).

Gloo binds to the first address its own host name resolves to, and c10d dials a peer's
addresses in order, so which address comes first decides whether a ``127.0.1.1 <hostname>`` line
in /etc/hosts hurts. glibc sorts every answer of more than one address (``rfc3484_sort`` in
sysdeps/posix/getaddrinfo.c); for the addresses /etc/hosts and DNS give a name, three of its
rules decide:

* rule 1, avoid unusable destinations: an IPv6 address where the node has no IPv6 address to
  send from (IPv6 disabled, or only link-local addresses) sorts last;
* rule 6, higher precedence first: glibc's default table (the RFC 3484 one) gives ::1 50, other
  IPv6 40 and IPv4 10, so a node's global IPv6 address comes before any IPv4 address, loopback
  included; ``precedence`` lines in /etc/gai.conf replace the whole table (gai.conf(5)), the usual
  one (``precedence ::ffff:0:0/96 100``) putting IPv4 first;
* rule 8, smaller scope first: glibc puts 127/8 and 169.254/16 in link-local scope, so among IPv4
  addresses loopback comes first wherever its line is.

Ties keep the order the service gave. Measured with glibc 2.36: ``127.0.1.1`` and ``fd00::18`` for
one name come back IPv6 first without /etc/gai.conf, IPv4 loopback first with the line above.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence

#: A precedence table: (prefix, precedence), longest prefix first, as facts keep it (plain text).
Table = tuple[tuple[str, int], ...]
#: glibc's default_precedence (sysdeps/posix/getaddrinfo.c), longest prefix first.
DEFAULT_PRECEDENCE: Table = (("::1/128", 50), ("::ffff:0:0/96", 10), ("::/96", 20), ("2002::/16", 30), ("::/0", 40))
MAX_GAI_LINES = 256  # a gai.conf is a handful of lines; more is not read


def parse_precedence(text: str) -> Table | None:
    """The ``precedence <prefix>/<length> <value>`` lines of /etc/gai.conf, longest prefix first;
    None when there are none (glibc then keeps its default table). Lines it would refuse are skipped."""
    table = []
    for line in text.splitlines()[:MAX_GAI_LINES]:
        fields = line.split("#", 1)[0].split()
        if len(fields) != 3 or fields[0] != "precedence" or not fields[2].isdigit():
            continue
        try:
            network = ipaddress.IPv6Network(fields[1], strict=False)
        except ValueError:
            continue
        table.append((network.prefixlen, str(network), int(fields[2])))
    return tuple((prefix, value) for _, prefix, value in sorted(table, key=lambda item: -item[0])) or None


def precedence(address: str, table: Table | None) -> int:
    """The precedence glibc gives ``address`` (IPv4 as ::ffff:a.b.c.d): its longest matching
    prefix's, 0 when none matches."""
    parsed = ipaddress.ip_address(address)
    mapped = ipaddress.IPv6Address(f"::ffff:{parsed}") if isinstance(parsed, ipaddress.IPv4Address) else parsed
    return next((value for prefix, value in table or DEFAULT_PRECEDENCE if mapped in ipaddress.IPv6Network(prefix)), 0)


def scope(address: str) -> int:
    """glibc's scope: 2 for link-local (IPv4 127/8 and 169.254/16 too), 5 site-local, 14 global."""
    parsed = ipaddress.ip_address(address)
    if parsed.version == 4:
        return 2 if parsed.is_loopback or parsed.is_link_local else 14
    if parsed.is_multicast:
        return int(parsed.packed[1]) & 0xF
    if parsed.is_loopback or parsed.is_link_local:
        return 2
    return 5 if parsed.is_site_local else 14


def gai_order(addresses: Sequence[str], table: Table | None = None, ipv6_usable: bool | None = True) -> tuple[str, ...]:
    """``addresses`` (literals, duplicates dropped) as getaddrinfo orders them: usable first, then
    higher precedence, then smaller scope; ties in the given order. ``ipv6_usable`` False puts
    IPv6 addresses other than ::1 last (the node has no routable IPv6 source address)."""
    unique = list(dict.fromkeys(addresses))

    def key(address: str) -> tuple[int, int, int]:
        parsed = ipaddress.ip_address(address)
        unusable = parsed.version == 6 and not parsed.is_loopback and ipv6_usable is False
        return (1 if unusable else 0, -precedence(address, table), scope(address))

    return tuple(sorted(unique, key=key))
