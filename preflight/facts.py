"""What a probe's facts look like: the record type a probe returns and its fields."""

from __future__ import annotations

import typing
from collections.abc import Callable
from typing import Any

import msgspec


def facts_type(probe: Callable[..., Any]) -> Any:
    """The type a probe function declares it returns, or None when it names none."""
    try:
        return typing.get_type_hints(probe).get("return")
    except Exception:  # an annotation that does not resolve: shown by name below
        return None


def fact_fields(probe: Callable[..., Any]) -> dict[str, Any]:
    """``{"type": name, "fields": [names]}`` for a probe's facts record."""
    kind = facts_type(probe)
    # ``Facts | None``: a probe that finds nothing to report on this node
    present = [arg for arg in typing.get_args(kind) if arg is not type(None)]
    if len(present) == 1:
        kind = present[0]
    if kind is None:
        name = str(getattr(probe, "__annotations__", {}).get("return", "?"))
        return {"type": name, "fields": []}
    fields = [field.name for field in msgspec.structs.fields(kind)] if isinstance(kind, type) and issubclass(kind, msgspec.Struct) else []
    return {"type": getattr(kind, "__name__", str(kind)), "fields": fields}
