"""TOML parsing on every supported Python: ``tomllib`` from 3.11, the ``tomli`` backport on 3.10.

The parser is imported on first use: ``tomllib`` pulls in ``datetime`` and compiles its regular
expressions at import, ~10 ms that a prolog run without a configuration file never needs (the
catalogue itself is read from its JSON index).
"""

from __future__ import annotations

import sys
from typing import Any


class TomlError(ValueError):
    """The text is not valid TOML; the message says where."""


def parse_toml(text: str) -> dict[str, Any]:
    """The document ``text`` as plain Python values."""
    if sys.version_info >= (3, 11):
        from tomllib import TOMLDecodeError, loads  # novermin: guarded by the version check above
    else:  # pragma: no cover - exercised on Python 3.10 only
        from tomli import TOMLDecodeError, loads  # type: ignore[import-not-found, unused-ignore]
    try:
        document: dict[str, Any] = loads(text)
    except TOMLDecodeError as error:
        raise TomlError(str(error)) from None
    return document


__all__ = ["TomlError", "parse_toml"]
