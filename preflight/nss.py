"""glibc's name-service switch as the node's libc reads it: ``/etc/nsswitch.conf`` (nsswitch.conf(5)).

Each database line (``hosts:``, ``group:``) lists the services libc asks, in order, with action
items in brackets after a service. The files are read as bytes, as glibc reads them: a stray
Latin-1 byte must not make a whole file unreadable. Shared by the hostname probe (``hosts``) and
the probes that judge a job's device permissions (``group``).
"""

from __future__ import annotations

import re

from msgspec import Struct

from preflight.sources import NodeFS

NSSWITCH_CONF = "/etc/nsswitch.conf"
# Group services whose members are all in /etc/group: files itself, compat without NIS lines,
# and nss-systemd, which adds only systemd's own dynamic and userdb groups, not a site's users.
GROUP_FILE_SERVICES = frozenset({"files", "compat", "systemd"})


class NssService(Struct, frozen=True):
    """One service of an nsswitch.conf line and the action items after it."""

    name: str  # "files", "dns", "myhostname", "resolve", "sss"...
    actions: tuple[str, ...] = ()  # "NOTFOUND=return", "!UNAVAIL=return"


def read_as_glibc(fs: NodeFS, path: str) -> str | None:
    """A file glibc's NSS reads line by line (/etc/hosts, /etc/nsswitch.conf), as glibc sees it:
    bytes, not text. Each line ends at its first NUL (glibc parses lines as C strings,
    nss/nss_readline.c) and bytes that are not UTF-8 are replaced: addresses, names and keywords
    are ASCII, so a Latin-1 comment must not make the whole file unreadable. ``None`` when absent;
    SourceError past the read cap, which glibc does not have."""
    data = fs.read_bytes(path)
    if data is None:
        return None
    return "\n".join(line.split(b"\0", 1)[0].decode("utf-8", "replace") for line in data.split(b"\n"))


_NSS_TOKEN = re.compile(r"\[([^\]]*)\]|([^\s\[]+)")


def _action_item(item: str) -> str:
    """``notfound=Return`` -> ``NOTFOUND=return``: statuses and actions are case-insensitive."""
    condition, _, action = item.partition("=")
    return f"{condition.upper()}={action.lower()}"


def nsswitch_services(text: str, database: str) -> tuple[NssService, ...] | None:
    """The services of ``database``'s line in nsswitch.conf text; None when no line names it (libc
    then uses its built-in default for that database)."""
    for line in text.splitlines():
        name, colon, rest = line.split("#", 1)[0].partition(":")
        if not colon or name.strip() != database:
            continue
        services: list[NssService] = []
        for bracket, word in _NSS_TOKEN.findall(rest):
            if word:
                services.append(NssService(word.lower()))
            elif services:
                items = tuple(_action_item(item) for item in bracket.split() if "=" in item)
                services[-1] = NssService(services[-1].name, services[-1].actions + items)
        if services:
            return tuple(services)
    return None


def groups_beyond_files(nsswitch_text: str, group_text: str) -> tuple[str, ...]:
    """The group services past /etc/group that libc also asks for a user's groups (``sss``,
    ``ldap``, ``winbind``, NIS through ``compat``'s ``+`` lines): a user's membership there
    cannot be read from a root. Empty when /etc/group holds every group libc knows; glibc
    without a ``group:`` line asks files only."""
    services = nsswitch_services(nsswitch_text, "group") or ()
    beyond = [service.name for service in services if service.name not in GROUP_FILE_SERVICES]
    if any(service.name == "compat" for service in services) and any(line.startswith(("+", "-")) for line in group_text.splitlines()):
        beyond.append("nis (compat)")
    return tuple(dict.fromkeys(beyond))
