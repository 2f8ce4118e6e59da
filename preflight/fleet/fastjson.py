"""orjson, when it is installed: the fleet's fast path for decoding reports and encoding its own.

It is a dependency, but the audit must work (more slowly) without it, so every user keeps the
standard library's ``json`` as the fallback and as the judge of input orjson refuses: integers
beyond 64 bits, nesting beyond 1,024 levels, lone surrogates. At 10,000 nodes orjson decodes a
report 3-4x faster than ``json.loads`` and writes the fleet report several times faster than
``json.dumps``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def _orjson() -> Any:
    try:
        import orjson
    except ImportError:
        return None
    return orjson


_ORJSON = _orjson()
#: ``orjson.loads``; raises ValueError (orjson.JSONDecodeError) for anything it will not decode.
loads: Callable[[bytes], Any] | None = _ORJSON.loads if _ORJSON else None
#: ``orjson.dumps`` (compact; dataclasses as objects); raises TypeError (orjson.JSONEncodeError).
dumps: Callable[[Any], bytes] | None = _ORJSON.dumps if _ORJSON else None
