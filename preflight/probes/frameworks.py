"""The training and serving frameworks installed for the job's Python, read from package metadata.

Several catalogued failures are bound to a framework release rather than to the node (PyTorch 2.6
and 2.7.0 put eagerly initialised NCCL communicators into non-blocking mode, NCCL018), and vLLM's
shared-memory rings decide how much ``/dev/shm`` a node needs (VLLM001). Importing ``torch`` to
ask costs seconds and may touch the GPUs, so the versions come from the metadata that pip and
conda write beside each package, without importing anything.

Sources, read through the node's filesystem:

* the Python environments ``preflight.probes.nccl_libs`` searches (``/usr/lib/python3*``,
  ``/usr/local/lib/python3*``, ``/opt/conda/lib/python3*``; ``site-packages`` and
  ``dist-packages``), and those the job environment names: ``$VIRTUAL_ENV`` and
  ``$CONDA_PREFIX`` (``<prefix>/lib/python3*/site-packages``), and the directories of its
  ``$PYTHONPATH`` (EasyBuild's and Spack's PyTorch modules put theirs there);
* in each, ``<name>-<version>.dist-info/METADATA`` (core metadata, RFC 822 headers ``Name:`` and
  ``Version:``; packaging.python.org "Core metadata specifications") or, for older setuptools
  installs, ``<name>-<version>.egg-info/PKG-INFO`` (same headers).
"""

from __future__ import annotations

import re

from msgspec import Struct

from preflight.model import Unknown
from preflight.probes.job import job_file_user, parse_environ
from preflight.probes.nccl_libs import python_path_dirs, python_prefixes, site_dirs
from preflight.probing import FactReader
from preflight.registry import probe
from preflight.sources import NodeFS, SourceError

#: Distribution names (normalised as PEP 503 does) whose versions some reference depends on.
FRAMEWORKS = frozenset({
    "torch", "deepspeed", "megatron-core", "vllm",
    # Horovod and the other frameworks it builds an extension for (HVD001)
    "horovod", "tensorflow", "tensorflow-cpu", "tensorflow-gpu", "mxnet",
})


_METADATA_BYTES = 256 * 1024  # headers come first; torch's METADATA is ~40 KiB with its long description


_UNREAD_METADATA = re.compile(r"/(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*?)-[^-/]+?\.(?:dist-info|egg-info)/")


_INSTALLED = re.compile(r"^(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*?)-(?P<version>[^-/]+?)\.(?P<kind>dist-info|egg-info)$")


class PythonPackage(Struct, frozen=True):
    name: str  # normalised distribution name: "torch", "megatron-core"
    version: str  # Version: header ("2.6.0+cu124")
    metadata: str  # the METADATA/PKG-INFO file it was read from
    # A Requires-Dist: header names an nvidia-nccl-cu* wheel: PyPI's CUDA builds of torch do, and
    # their libraries load it by DT_RPATH; builds from source (NGC, conda-forge, Spack) do not
    nccl_wheel: bool = False


class FrameworkFacts(Struct, frozen=True):
    site_dirs: tuple[str, ...]  # package directories that exist and were listed
    packages: tuple[PythonPackage, ...]  # installed FRAMEWORKS, in site order
    problems: tuple[str, ...]  # metadata or directories that exist but could not be read

    def versions(self, name: str) -> tuple[PythonPackage, ...]:
        """The installed versions of ``name``; Unknown when none was read but a metadata file of
        ``name`` could not be: "not installed" would be a guess."""
        found = tuple(package for package in self.packages if package.name == name)
        if not found:
            # A directory that could not be listed (a site, or where sites are looked for) may
            # hold any package; an unreadable metadata file only its own (below).
            unlisted = next((p for p in self.problems if not _UNREAD_METADATA.search(p)), None)
            if unlisted:
                raise Unknown(f"{name}: {unlisted}")
            for problem in self.problems:
                entry = _UNREAD_METADATA.search(problem)
                if entry and normalise(entry.group("name")) == name:
                    raise Unknown(f"{name}: {problem}")
        return found


def normalise(name: str) -> str:
    """PEP 503 normalisation: ``Megatron_Core`` -> ``megatron-core``."""
    return re.sub(r"[-_.]+", "-", name).lower()


_NCCL_WHEEL = re.compile(r"nvidia[-_.]nccl[-_.]cu\d+", re.IGNORECASE)


def parse_metadata(text: str) -> tuple[str, str, bool] | None:
    """``(Name, Version, requires an nvidia-nccl-cu* wheel)`` from core-metadata headers (they
    end at the first empty line; Requires-Dist may repeat)."""
    headers: dict[str, str] = {}
    nccl_wheel = False
    for line in text.splitlines():
        if not line.strip():
            break
        key, separator, value = line.partition(":")
        if separator and not key.startswith((" ", "\t")):
            headers.setdefault(key.strip().lower(), value.strip())
            nccl_wheel = nccl_wheel or (key.strip().lower() == "requires-dist" and bool(_NCCL_WHEEL.match(value.strip())))
    name, version = headers.get("name"), headers.get("version")
    return (name, version, nccl_wheel) if name and version else None


def parse_version(text: str) -> tuple[int, ...] | None:
    """The release part of a PEP 440 version: ``"2.7.0+cu126"`` -> ``(2, 7, 0)``, ``"2.6.0a0"`` -> ``(2, 6, 0)``."""
    match = re.match(r"^\s*v?(\d+(?:\.\d+)*)", text)
    return tuple(int(part) for part in match.group(1).split(".")) if match else None


@probe("frameworks", gather_in=("full",))
def probe_frameworks(fs: NodeFS) -> FrameworkFacts:
    """Versions of PyTorch, DeepSpeed, Megatron Core, vLLM, Horovod, TensorFlow and MXNet in the
    job's Python environments."""
    reader = FactReader(fs)
    try:
        environ = parse_environ(fs.read_bytes("/proc/self/environ") or b"")
    except SourceError:
        environ = {}  # the job probe reports an unreadable environment
    prefixes = python_prefixes(environ, reader)
    user = job_file_user(fs, environ)  # the job's own environments are read with its user's rights
    own_paths = python_path_dirs(environ)
    sites = site_dirs(reader, prefixes, own_paths)
    packages = []
    for site in sites:
        owner = user if site in own_paths or any(site.startswith(f"{prefix}/") for prefix in prefixes) else None
        for entry in reader.listing(site) or []:  # unlisted: in problems
            match = _INSTALLED.match(entry)
            if not match or normalise(match.group("name")) not in FRAMEWORKS:
                continue
            path = f"{site}/{entry}/{'METADATA' if match.group('kind') == 'dist-info' else 'PKG-INFO'}"
            try:
                text = fs.read_for(path, owner, max_bytes=_METADATA_BYTES)
            except SourceError as error:
                reader.problems.append(str(error))
                continue
            parsed = parse_metadata(text) if text is not None else None
            if parsed is None:
                reader.problems.append(f"{path}: {'missing' if text is None else 'no Name/Version headers'}")
                continue
            packages.append(PythonPackage(normalise(parsed[0]), parsed[1], path, parsed[2]))
    return FrameworkFacts(tuple(sites), tuple(packages), tuple(reader.problems))
