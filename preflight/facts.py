"""What a probe's facts look like: the record type a probe returns and its fields."""

from __future__ import annotations

import typing
from collections.abc import Callable
from typing import Any

import msgspec


def facts_type(probe: Callable[..., Any]) -> Any:
    """The type a probe function declares it returns, or None when it names none or the name
    does not resolve (parameters are not resolved: their types may be imported for type
    checkers only)."""
    annotation = getattr(probe, "__annotations__", {}).get("return")
    return _resolved(annotation, getattr(probe, "__globals__", {}))


def _resolved(annotation: Any, namespace: dict[str, Any]) -> Any:
    if not isinstance(annotation, str):
        return annotation
    try:
        return eval(annotation, dict(namespace))  # noqa: S307 - our own modules' annotations, not input
    except Exception:
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
    fields = list(kind.__struct_fields__) if isinstance(kind, type) and issubclass(kind, msgspec.Struct) else []
    return {"type": getattr(kind, "__name__", str(kind)), "fields": fields}


# -- partial views of facts, for readers of reports -------------------------------------------------
#
# A fleet audit reads a few fields of a few probes' facts from thousands of reports. It decodes
# them into *views*: Struct types made from the probes' own fact types, keeping only the fields
# that are read (each optional, so that a report from an older preflight or a failed probe still
# decodes) with the probes' own field types. A field name that the facts do not have is an
# error when the view is made, so a reader can never drift from what the probes report.


def probe_facts_types() -> dict[str, type]:
    """Every built-in probe's name -> the facts type it returns."""
    from preflight.discovery import builtin_probe_modules
    from preflight.registry import Registry

    registry = Registry()
    for module in builtin_probe_modules():
        registry.collect(module)
    found = {}
    for name, spec in registry.probes.items():
        kind = _unoptional(facts_type(spec.func))
        if isinstance(kind, type) and issubclass(kind, msgspec.Struct):
            found[name] = kind
    return found


def _unoptional(kind: Any) -> Any:
    present = [arg for arg in typing.get_args(kind) if arg is not type(None)]
    return present[0] if len(present) == 1 and type(None) in typing.get_args(kind) else kind


def field_types(struct: type) -> dict[str, Any]:
    """A Struct's fields and their resolved types (the probes annotate with strings); None for
    a type that does not resolve at run time."""
    import sys

    namespace = vars(sys.modules[struct.__module__])
    return {name: _resolved(annotation, namespace) for name, annotation in struct.__annotations__.items()}


def view_of(struct: type, fields: dict[str, Any], name: str | None = None) -> type:
    """A frozen Struct type with only ``fields`` of ``struct`` (a tree: field -> sub-fields of a
    nested record, or an empty dict for a field read whole), each optional with default None."""
    types = field_types(struct)
    unknown = sorted(set(fields) - set(struct.__struct_fields__))  # type: ignore[attr-defined]
    if unknown:
        raise TypeError(f"{struct.__name__} has no fields {unknown}")
    made = []
    for field, below in fields.items():
        if types[field] is None:
            raise TypeError(f"{struct.__name__}.{field}: its type {struct.__annotations__[field]!r} does not resolve at run time")
        kind = _narrowed(types[field], below, f"{name or struct.__name__}.{field}") if below else types[field]
        # UNSET: the report has no such key (an older preflight); None: the probe said None
        made.append((field, typing.Union[kind, None, msgspec.UnsetType], msgspec.UNSET))
    return msgspec.defstruct(f"{name or struct.__name__}View", made, frozen=True, kw_only=True)


def _narrowed(kind: Any, fields: dict[str, Any], where: str) -> Any:
    """``kind`` with every record type in it replaced by its view of ``fields``."""
    if isinstance(kind, type) and issubclass(kind, msgspec.Struct):
        return view_of(kind, fields, kind.__name__)
    origin, arguments = typing.get_origin(kind), typing.get_args(kind)
    if origin is None or not arguments:
        raise TypeError(f"{where}: sub-fields {sorted(fields)} asked of {kind!r}, which holds no record")
    narrowed = tuple(
        argument if argument is Ellipsis or argument is type(None) or not _holds_record(argument) else _narrowed(argument, fields, where)
        for argument in arguments
    )
    if origin in (typing.Union, __import__("types").UnionType):
        return typing.Union[narrowed]
    generic: Any = origin  # tuple, list, dict: subscripted with the narrowed arguments
    return generic[narrowed]


def _holds_record(kind: Any) -> bool:
    if isinstance(kind, type) and issubclass(kind, msgspec.Struct):
        return True
    return any(_holds_record(argument) for argument in typing.get_args(kind) if argument is not Ellipsis)


def view_tree(paths: typing.Iterable[str]) -> dict[str, Any]:
    """``["rdma.devices.name", "rdma.devices.ports.rate"]`` -> ``{"rdma": {"devices": {"name": {},
    "ports": {"rate": {}}}}}``."""
    tree: dict[str, Any] = {}
    for path in paths:
        node = tree
        for part in path.split("."):
            node = node.setdefault(part, {})
    return tree


def facts_view(paths: typing.Iterable[str], name: str = "Facts") -> type:
    """The view of a report's ``facts`` object that reads ``paths`` (``probe.field.sub...``): one
    optional field per probe, holding that probe's view."""
    kinds = probe_facts_types()
    tree = view_tree(paths)
    unknown = sorted(set(tree) - set(kinds))
    if unknown:
        raise TypeError(f"no probe named {unknown}")
    made = [
        (probe, typing.Union[view_of(kinds[probe], fields, kinds[probe].__name__), None, msgspec.UnsetType], msgspec.UNSET)
        for probe, fields in tree.items()
    ]
    return msgspec.defstruct(f"{name}View", made, frozen=True, kw_only=True)
