"""Recorded roots must mean the same in a fresh clone as in the tree that generated them."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ROOTS = (REPO / "tests" / "fixtures" / "nodes", REPO / "examples" / "nodes")


def test_no_recorded_root_holds_an_empty_directory() -> None:
    """git keeps no empty directories: a probe that lists one (/sys/class/iommu/<unit>, an empty
    GID table) would see it here and not in CI's clone. Generators must put a file inside."""
    empty = [
        str(Path(directory).relative_to(REPO))
        for base in ROOTS
        for directory, subdirectories, files in os.walk(base)
        if not subdirectories and not files
    ]
    assert empty == []
