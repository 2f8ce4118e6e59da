"""Which framework extensions each installed Horovod was built with, from the files its build left
(reference HVD001).

Horovod compiles one extension module per framework when pip builds it, and CMake skips a
framework it cannot find (or that ``HOROVOD_WITHOUT_<FW>=1`` excludes) without failing the build
(``horovod/torch/CMakeLists.txt`` at v0.28.1 returns early when PyTorch is not found). At import,
``horovod.common.util.check_extension`` looks for ``<package>/<framework>/<module><EXT_SUFFIX>``
and reports "Extension horovod.<framework> has not been built" when it is not there. The modules
(``setup.py`` at v0.28.1: ``CMakeExtension``):

* ``horovod/torch/mpi_lib_v2<EXT_SUFFIX>``
* ``horovod/tensorflow/mpi_lib<EXT_SUFFIX>``
* ``horovod/mxnet/mpi_lib<EXT_SUFFIX>``

``EXT_SUFFIX`` is the interpreter's (``.cpython-310-x86_64-linux-gnu.so`` for CPython 3.10), so a
module built for another Python does not count. Sources: the Horovod installs the frameworks probe
found (``horovod-<version>.dist-info``) and a listing of ``<site>/horovod/<framework>/`` beside
each; nothing is imported or executed.
"""

from __future__ import annotations

import re

from msgspec import Struct

from preflight.model import Unknown
from preflight.probes.frameworks import FrameworkFacts
from preflight.probing import FactReader
from preflight.registry import probe
from preflight.sources import NodeFS

#: framework distribution names -> (Horovod subpackage, extension module name)
EXTENSIONS: dict[str, tuple[str, str]] = {
    "torch": ("torch", "mpi_lib_v2"),
    "tensorflow": ("tensorflow", "mpi_lib"),
    "tensorflow-cpu": ("tensorflow", "mpi_lib"),
    "tensorflow-gpu": ("tensorflow", "mpi_lib"),
    "mxnet": ("mxnet", "mpi_lib"),
}


_PYTHON_DIR = re.compile(r"/python3\.(\d+)/")


class FrameworkExtension(Struct, frozen=True):
    framework: str  # the framework's distribution name installed beside Horovod ("torch")
    framework_metadata: str  # its METADATA file
    directory: str  # <site>/horovod/<subpackage>
    listed: bool | None  # True: listed; False: the directory is absent; None: unreadable or not captured
    extension: str | None  # the extension module's file name found there; None when none is


class HorovodInstall(Struct, frozen=True):
    version: str  # Version: of horovod's METADATA
    metadata: str  # horovod-<version>.dist-info/METADATA
    package: str  # <site>/horovod
    package_listed: bool | None  # whether <site>/horovod exists (None: unreadable or not captured)
    extensions: tuple[FrameworkExtension, ...]  # one per framework installed in the same site


class HorovodFacts(Struct, frozen=True):
    installs: tuple[HorovodInstall, ...]
    problems: tuple[str, ...]  # directories that could not be listed: "path: reason"
    # why "no Horovod" cannot be said (a site or its metadata unreadable); "" when it can
    installs_unknown: str = ""


def extension_file(entries: list[str], module: str, site: str) -> str | None:
    """The entry Python would load as ``module``: ``<module>.cpython-3XY-<platform>.so`` for the
    site's CPython 3.XY, or ``<module>.so`` (the suffix when sysconfig has no EXT_SUFFIX)."""
    version = _PYTHON_DIR.search(f"{site}/")
    tag = f"{module}.cpython-3{version.group(1)}" if version else f"{module}.cpython-3"
    for entry in sorted(entries):
        if entry == f"{module}.so" or (entry.startswith(tag) and entry.endswith(".so") and entry[len(tag) :][:1] in ("-", "d", "m")):
            return entry
    return None


def _site_of(metadata: str) -> str:
    return metadata.rsplit("/", 2)[0]  # <site>/<name>-<version>.dist-info/METADATA


@probe("horovod")
def probe_horovod(fs: NodeFS, frameworks: FrameworkFacts) -> HorovodFacts:
    """Horovod installs and, for each framework installed in the same site, its extension module."""
    reader = FactReader(fs)
    installs = []
    try:
        found = frameworks.versions("horovod")
        unknown = ""
    except Unknown as error:
        found, unknown = (), str(error)
    for package in found:
        site = _site_of(package.metadata)
        root = f"{site}/horovod"
        present = reader.presence(root)
        extensions = []
        for other in frameworks.packages:
            if other.name not in EXTENSIONS or _site_of(other.metadata) != site:
                continue
            subpackage, module = EXTENSIONS[other.name]
            directory = f"{root}/{subpackage}"
            listed: bool | None
            entries = None
            if present:
                exists = reader.presence(directory)
                entries = reader.listing(directory) if exists else None
                listed = False if exists is False else None if entries is None else True
            else:
                listed = None
            module_file = extension_file(entries, module, site) if entries is not None else None
            extensions.append(FrameworkExtension(other.name, other.metadata, directory, listed, module_file))
        installs.append(HorovodInstall(package.version, package.metadata, root, present, tuple(extensions)))
    return HorovodFacts(tuple(installs), tuple(reader.problems), unknown)
