"""Running from a checkout: ``preflight.checks`` and ``preflight.references`` are the
repository's top-level ``checks/`` and ``references/``, as in the wheel.

The wheel gets them from pyproject.toml's ``package-dir`` mapping. A checkout has no such mapping
at import time: ``python -m preflight`` in the repository imports ``preflight/`` from the current
directory, and setuptools' editable finder does not find a directory without ``__init__.py``
mapped below a regular package. Both then stopped at ``ModuleNotFoundError: preflight.checks``.
The directories stay where the design card puts them; this finder maps them instead.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType

#: package -> its directory at the top of the repository (pyproject.toml's package-dir)
MAPPED = {"preflight.checks": "checks", "preflight.references": "references"}


class SourceTreeFinder:
    """Finds the mapped packages of one checkout, as namespace packages (they have no
    ``__init__.py``, exactly as they are shipped)."""

    def __init__(self, top: str) -> None:
        self.top = top

    def find_spec(self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None) -> ModuleSpec | None:
        folder = MAPPED.get(fullname)
        if folder is None:
            return None
        spec = ModuleSpec(fullname, None, is_package=True)
        spec.submodule_search_locations = [os.path.join(self.top, folder)]
        return spec


def map_checkout(package_dir: str) -> None:
    """Install the finder when ``package_dir`` (``preflight/``) sits in a checkout. It goes last
    on ``sys.meta_path``: anything that already finds the packages keeps precedence."""
    top = os.path.dirname(os.path.abspath(package_dir))
    in_checkout = os.path.isfile(os.path.join(top, "pyproject.toml")) and all(
        os.path.isdir(os.path.join(top, folder)) for folder in MAPPED.values()
    )
    if in_checkout and not any(isinstance(finder, SourceTreeFinder) for finder in sys.meta_path):
        sys.meta_path.append(SourceTreeFinder(top))
