"""The packaged catalogue's index, ``references/index.json``: every ``<ID>.toml`` parsed once, when
the package is built, so that a prolog run reads one JSON file instead of parsing ~45 TOML files
(~1 ms each with ``tomllib``, a third of the run).

Nobody maintains it by hand. ``setup.py`` writes it while building: into the wheel for
``pip install .`` and ``python -m build``, into the checkout's ``references/`` for
``pip install -e .`` (git ignores it there). The TOML files stay the source: each entry carries
the CRC-32 of the bytes it was parsed from, and :mod:`preflight.catalogue` uses an entry only
while its file still has those bytes. A reference edited after the index was built is parsed
from its TOML, and a checkout without any index (``python -m preflight`` before any install)
parses them all; both are correct, only slower.

This module uses the standard library only (plus ``tomli`` on Python 3.10): ``setup.py`` loads it
by path in a build environment where preflight's dependencies are not installed.
"""

from __future__ import annotations

import json
import os
import re
import sys
import zlib
from typing import Any

INDEX_NAME = "index.json"
INDEX_FORMAT = "preflight-catalogue-index/2"
#: A reference file's name: ``<ID>.toml`` (preflight.model.REFERENCE_ID, which this module
#: cannot import in a build environment).
REFERENCE_FILE = re.compile(r"^[A-Z]{2,5}[0-9]{3}\.toml$")


def digest(data: bytes) -> str:
    """What an index entry records of its file's bytes. CRC-32 detects an edit and costs nothing
    to import (``zlib`` is loaded at interpreter start); the index is a cache beside the files it
    describes, not a defence against whoever can write them."""
    return f"{zlib.crc32(data):08x}-{len(data)}"


def _parse(data: bytes) -> dict[str, Any]:
    if sys.version_info >= (3, 11):
        from tomllib import loads  # novermin: guarded by the version check above
    else:  # pragma: no cover - exercised on Python 3.10 only
        from tomli import loads  # type: ignore[import-not-found, unused-ignore]
    document: dict[str, Any] = loads(data.decode("utf-8"))
    return document


def build_index(directory: str) -> dict[str, Any]:
    """The index document for the ``<ID>.toml`` files in ``directory``."""
    references = {}
    for name in sorted(os.listdir(directory)):
        if REFERENCE_FILE.match(name):
            with open(os.path.join(directory, name), "rb") as handle:
                data = handle.read()
            references[name[:-5]] = {"digest": digest(data), "document": _parse(data)}
    return {"format": INDEX_FORMAT, "references": references}


def write_index(directory: str, target_directory: str) -> str:
    """Write the index of ``directory``'s references into ``target_directory``; its path."""
    os.makedirs(target_directory, exist_ok=True)
    path = os.path.join(target_directory, INDEX_NAME)
    text = json.dumps(build_index(directory), sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    partial = path + ".partial"
    with open(partial, "w", encoding="utf-8") as out:
        out.write(text + "\n")
    os.replace(partial, path)  # a reader never sees half an index
    return path
