"""How PyTorch's ProcessGroupNCCL reads its environment variables, for the checks that judge a job's
settings against the PyTorch installed for it (TORCH006, NCCL006).

* ProcessGroupNCCL reads each setting through ``getCvarInt`` / ``getCvarBool``
  (``torch/csrc/distributed/c10d/Utils.hpp``) with a list of names, newest first: every set
  name is parsed in reverse order, so the first name of the list wins when several are set, and an
  older name only draws a deprecation warning.
* PyTorch 2.2.0 renamed the variables with a ``TORCH_`` prefix and kept the old ``NCCL_*`` names
  as the fallback (pytorch/pytorch#114077, commit 8f8722e3f1d1121345b80428117be89209ccd772);
  releases before 2.2 read only the old names, so a ``TORCH_NCCL_*`` variable is ignored there.
* Integers are parsed with ``std::stoi`` (leading blanks skipped, digits up to the first other
  character); booleans accept ``1``/``true``/``y``/``yes`` and ``0``/``false``/``n``/``no``, in
  any case. Anything else stops the process group at creation, which is loud, not a hang.
"""

from __future__ import annotations

import re

from msgspec import Struct

from preflight.model import Evidence
from preflight.probes.frameworks import FrameworkFacts, PythonPackage, parse_version
from preflight.units import MAX_DIGITS

#: The release that reads the TORCH_-prefixed names (pytorch/pytorch#114077).
TORCH_PREFIX_SINCE = (2, 2)

_TRUE = frozenset({"1", "true", "y", "yes"})
_FALSE = frozenset({"0", "false", "n", "no"})
_INTEGER = re.compile(r"^\s*([+-]?\d+)")


class TorchSetting(Struct, frozen=True):
    """The variable a PyTorch release takes a setting from, and its raw value."""

    name: str
    value: str


def read_setting(environ: dict[str, str], names: tuple[str, ...], prefixed_names_read: bool) -> TorchSetting | None:
    """The variable ProcessGroupNCCL takes ``names`` (newest first) from; ``prefixed_names_read``
    is False for releases before 2.2, which know only the names without ``TORCH_``."""
    for name in names:
        if name.startswith("TORCH_") and not prefixed_names_read:
            continue
        if name in environ:
            return TorchSetting(name, environ[name])
    return None


def as_int(value: str) -> int | None:
    """The value ``std::stoi`` would read; None where it would throw."""
    match = _INTEGER.match(value)
    if match is None or len(match.group(1)) > MAX_DIGITS:
        return None  # beyond int, where std::stoi throws out_of_range
    return int(match.group(1))


def as_bool(value: str) -> bool | None:
    """The value ``getCvarBool`` would read; None where PyTorch refuses it."""
    text = value.strip().lower()
    return True if text in _TRUE else False if text in _FALSE else None


class TorchReaders(Struct, frozen=True):
    """The PyTorch installs a job here can use, grouped by how they read their variables."""

    installs: tuple[PythonPackage, ...]  # the torch packages found; empty when none was

    def variants(self) -> list[tuple[bool, Evidence | None]]:
        """(whether TORCH_ names are read, evidence of the release that reads them so) for every
        distinct reading among the installs. Without any install (a container the node cannot
        see into) a job that sets these variables runs some PyTorch: judged as 2.2 and later read."""
        if not self.installs:
            return [(True, None)]
        seen: dict[bool, Evidence] = {}
        for package in self.installs:
            version = parse_version(package.version)
            prefixed = version is None or version[:2] >= TORCH_PREFIX_SINCE
            seen.setdefault(prefixed, Evidence(package.metadata, f"PyTorch {package.version}"))
        return list(seen.items())


def readers_for(environ: dict[str, str], names: tuple[str, ...], frameworks: FrameworkFacts) -> TorchReaders:
    """The installs to judge ``names`` against. Their versions matter only when a ``TORCH_`` name
    is set (every release reads the old names), so only then may an unreadable environment make
    the answer Unknown (:meth:`FrameworkFacts.versions`)."""
    if any(name.startswith("TORCH_") and name in environ for name in names):
        return TorchReaders(frameworks.versions("torch"))
    return TorchReaders(())
