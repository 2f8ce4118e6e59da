"""``@frozen`` (preflight/records.py) behaves as ``@dataclass(frozen=True)`` does: the same
equality, hashing, repr, immutability and dataclass helpers (what it saves, definition time, is
measured by bench/prolog.py)."""

from __future__ import annotations

import dataclasses
import pickle
from dataclasses import dataclass, field

import pytest

from preflight.records import frozen


@frozen
class Port:
    name: str
    rate: float | None = None
    netdevs: tuple[str, ...] = ()
    extra: dict[str, int] = field(default_factory=dict, hash=False)
    note: str = field(default="", compare=False, repr=False)


@dataclass(frozen=True)
class PortDataclass:
    name: str
    rate: float | None = None
    netdevs: tuple[str, ...] = ()


@frozen
class Child(Port):
    depth: int = 0


def test_it_is_a_frozen_dataclass() -> None:
    port = Port("mlx5_0/1", 400.0, ("ibp26s0",))
    assert dataclasses.is_dataclass(port) and [f.name for f in dataclasses.fields(port)] == ["name", "rate", "netdevs", "extra", "note"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        port.name = "x"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        del port.rate  # type: ignore[misc]
    assert dataclasses.replace(port, rate=200.0) == Port("mlx5_0/1", 200.0, ("ibp26s0",))
    assert dataclasses.asdict(port) == {"name": "mlx5_0/1", "rate": 400.0, "netdevs": ("ibp26s0",), "extra": {}, "note": ""}
    assert pickle.loads(pickle.dumps(port)) == port


def test_equality_hash_and_repr_are_the_generated_ones() -> None:
    a, b = Port("mlx5_0/1", 400.0, ("ibp26s0",)), Port("mlx5_0/1", 400.0, ("ibp26s0",))
    generated = PortDataclass("mlx5_0/1", 400.0, ("ibp26s0",))
    assert a == b and a is not b and a != Port("mlx5_1/1") and hash(a) == hash(b)
    assert a != generated and Child("mlx5_0/1", 400.0, ("ibp26s0",)) != a  # another class is never equal
    assert a.__eq__(generated) is NotImplemented
    assert hash(a) == hash(("mlx5_0/1", 400.0, ("ibp26s0",)))  # field(hash=False) is left out, as a dataclass does
    assert hash(generated) == hash(("mlx5_0/1", 400.0, ("ibp26s0",)))
    assert repr(a) == "Port(name='mlx5_0/1', rate=400.0, netdevs=('ibp26s0',), extra={})"
    assert repr(Child("p")) == "Child(name='p', rate=None, netdevs=(), extra={}, depth=0)"
    assert {a, b} == {a}
    assert Port("p", note="one") == Port("p", note="two")  # compare=False
