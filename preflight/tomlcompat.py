"""TOML parsing on every supported Python: ``tomllib`` from 3.11, the ``tomli`` backport on 3.10."""

from __future__ import annotations

import sys

if sys.version_info >= (3, 11):
    from tomllib import TOMLDecodeError, loads  # novermin: guarded by the version check above
else:  # pragma: no cover - exercised on Python 3.10 only
    from tomli import TOMLDecodeError, loads  # type: ignore[import-not-found, unused-ignore]

__all__ = ["TOMLDecodeError", "loads"]
