"""Helpers for probes that read many files and must survive some of them being unreadable.

Three answers, never two: a file or directory has *content* (possibly empty), is *absent* (the
node has no such thing: its capture unit is there, see :mod:`preflight.sources.capture`), or is
*unknown* (unreadable, or its source was not captured). :class:`FactReader` keeps the third apart
from the first two in its return types (``None`` from :meth:`FactReader.listing` and
:meth:`FactReader.presence`) and remembers why in ``problems``, so a probe that wants "absent"
and "unknown" to look alike has to write so.
"""

from __future__ import annotations

from preflight.sources import NodeFS, SourceError


class FactReader:
    """Reads through a :class:`NodeFS`, remembering files that could not be read (or whose
    source was not captured) in ``problems``, so that a probe returns what it could read and its
    checks can say ``unknown`` for the rest instead of a silent ``absent``."""

    def __init__(self, fs: NodeFS) -> None:
        self.fs = fs
        self.problems: list[str] = []

    def text(self, path: str) -> str | None:
        """The file's text; ``None`` when absent *or* unknown (then the reason is in
        ``problems``: use :meth:`known_text` where the two must differ)."""
        try:
            return self.fs.read(path)
        except SourceError as error:
            self.problems.append(str(error))
            return None

    def known_text(self, path: str) -> tuple[bool, str | None]:
        """``(True, text or None when absent)`` when known, ``(False, None)`` when unknown."""
        try:
            return True, self.fs.read(path)
        except SourceError as error:
            self.problems.append(str(error))
            return False, None

    def presence(self, path: str) -> bool | None:
        """True when ``path`` exists, False when the node has no such path, None when that is
        unknown (the reason in ``problems``)."""
        try:
            return self.fs.exists(path)
        except SourceError as error:
            self.problems.append(str(error))
            return None

    def listing(self, path: str) -> list[str] | None:
        """A directory's entries: ``[]`` when the directory is absent or empty, ``None`` when
        unknown (the reason in ``problems``)."""
        try:
            return self.fs.listdir(path) or []
        except SourceError as error:
            self.problems.append(str(error))
            return None


# Files container managers create inside a container (systemd-detect-virt looks for them too):
# systemd-nspawn's and others', Docker's, Podman's and CRI-O's.
CONTAINER_MARKERS = ("/run/systemd/container", "/.dockerenv", "/run/.containerenv")
#: The first line kubelet writes into every pod's /etc/hosts (pkg/kubelet/kubelet_pods.go): a
#: pod under containerd has none of the files above.
KUBELET_HOSTS_HEADER = "# Kubernetes-managed hosts file"


def container_marker(reader: FactReader) -> str | None:
    """What shows that this process runs in a container: one of CONTAINER_MARKERS, or a pod's
    kubelet-managed /etc/hosts; "" where none does, None where one could not be looked for."""
    for marker in CONTAINER_MARKERS:
        there = reader.presence(marker)
        if there is None:
            return None
        if there:
            return marker
    known, hosts = reader.known_text("/etc/hosts")
    if not known:
        return None
    return "/etc/hosts (kubelet's)" if hosts is not None and hosts.startswith(KUBELET_HOSTS_HEADER) else ""
