"""Helpers for probes that read many files and must survive some of them being unreadable."""

from __future__ import annotations

from preflight.sources import NodeFS, SourceError


class FactReader:
    """Reads through a :class:`NodeFS`, treating absent files as ``None``/empty and remembering
    files that exist but cannot be read (``problems``), so that a probe returns what it could
    read and its checks can say ``unknown`` for the rest instead of a silent ``absent``."""

    def __init__(self, fs: NodeFS) -> None:
        self.fs = fs
        self.problems: list[str] = []

    def text(self, path: str) -> str | None:
        try:
            return self.fs.read(path)
        except SourceError as error:
            self.problems.append(str(error))
            return None

    def exists(self, path: str) -> bool:
        try:
            return self.fs.exists(path)
        except SourceError as error:
            self.problems.append(str(error))
            return False

    def listing(self, path: str) -> list[str]:
        try:
            return self.fs.listdir(path) or []
        except SourceError as error:
            self.problems.append(str(error))
            return []
