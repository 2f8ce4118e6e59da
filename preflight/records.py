"""``@frozen``: the project's frozen dataclass, cheaper to define.

``@dataclass(frozen=True)`` compiles six methods for every class with ``exec``: ``__init__``,
``__repr__``, ``__eq__``, ``__hash__``, and the frozen ``__setattr__``/``__delattr__``. That is
about 0.7 ms a class here, and a prolog run defines close to a hundred (engine, sources, and the
facts of every check module): a sixth of the whole run. ``@frozen`` lets ``dataclasses`` generate
only what depends on the class's fields (``__init__`` and the frozen pair) and takes
``__eq__``, ``__hash__`` and ``__repr__`` from here, written once with the same behaviour as the
generated ones: equal when of the same class with equal fields, hashed on the fields, shown as
``Name(field=value, ...)``. Such a class is still a dataclass: ``fields()``, ``replace()`` and
``asdict()`` work on it.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, TypeVar, cast

if TYPE_CHECKING:
    from typing_extensions import dataclass_transform
else:  # the decorator only informs type checkers

    def dataclass_transform(**_: Any) -> Any:
        return lambda decorator: decorator


_Class = TypeVar("_Class", bound=type)


def _values(self: Any, names: tuple[str, ...]) -> tuple[Any, ...]:
    return tuple([getattr(self, name) for name in names])


def _eq(self: Any, other: Any) -> Any:
    if other.__class__ is self.__class__:
        names = self.__record_compared__
        return _values(self, names) == _values(other, names)
    return NotImplemented


def _hash(self: Any) -> int:
    return hash(_values(self, self.__record_hashed__))


def _repr(self: Any) -> str:
    shown = ", ".join(f"{name}={getattr(self, name)!r}" for name in self.__record_shown__)
    return f"{self.__class__.__qualname__}({shown})"


@dataclass_transform(frozen_default=True)
def frozen(cls: _Class) -> _Class:
    """``@dataclass(frozen=True)``, defined in a fraction of the time (see the module docstring)."""
    made: Any = dataclasses.dataclass(frozen=True, eq=False, repr=False)(cls)
    fields = dataclasses.fields(made)
    # field(compare=..., hash=..., repr=...) mean what they mean for a dataclass
    made.__record_compared__ = tuple(f.name for f in fields if f.compare)
    made.__record_hashed__ = tuple(f.name for f in fields if (f.compare if f.hash is None else f.hash))
    made.__record_shown__ = tuple(f.name for f in fields if f.repr)
    for name, method in (("__eq__", _eq), ("__hash__", _hash), ("__repr__", _repr)):
        setattr(made, name, method)
    return cast(_Class, made)
