"""The NCCL libraries a job on this node can load (references NCCL016, NCCL012).

A process that ends up with two different NCCL builds (the framework wheel's copy and a system
copy pulled in by ``LD_LIBRARY_PATH`` or ``LD_PRELOAD``) fails in ways that look like memory
corruption, and a known-bad release crashes jobs whatever the fabric does.

Sources, read through the node's filesystem:

* system library directories, and those listed in ``/etc/ld.so.conf.d/*.conf``: ``libnccl.so.*``
  files, the version from the file name (``libnccl.so.2.21.5``) or the ``libnccl.so.2`` link;
* Python environments (``/usr/lib/python3*``, ``/usr/local/lib/python3*``, ``/opt/conda/lib``,
  and the job's ``$VIRTUAL_ENV`` and ``$CONDA_PREFIX``): the ``nvidia-nccl-cu*`` wheel installs
  ``nvidia/nccl/lib/libnccl.so.2``, its version is in the name of the
  ``nvidia_nccl_cu12-2.27.3.dist-info`` directory beside it;
* conda environments (``/opt/conda`` and the job's ``$CONDA_PREFIX``, each with its ``conda-meta``):
  ``<prefix>/lib/libnccl.so.*``, where conda-forge's ``nccl`` package installs and its ``pytorch``
  (built with the system NCCL of the environment) finds it by RPATH, with no LD_LIBRARY_PATH;
* the job's ``LD_LIBRARY_PATH`` and ``LD_PRELOAD`` (the job environment), which put a copy ahead
  of the one the framework was built with.

Stacks that link NCCL by RPATH alone and name it nowhere in the environment (Spack's views) are
not searched.

A program asks the loader for NCCL by its SONAME, ``libnccl.so.2`` (or links ``-lnccl`` through
``libnccl.so``), and ld.so finds that name in each directory (ld.so(8)); ldconfig points the
``libnccl.so.2`` link at the newest file it finds. A versioned file that no such link in its
directory reaches, while one does reach another version there, is left over from an older
package: no job loads it, and the checks of release bugs leave it out (``NcclCopy.unreached``).
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Mapping

from typing import TYPE_CHECKING

from msgspec import Struct
from msgspec.structs import replace

from preflight.probes.job import library_path_dirs, parse_environ
from preflight.probing import FactReader
from preflight.registry import probe
from preflight.sources import NodeFS, SourceError

if TYPE_CHECKING:
    from preflight.probes.frameworks import FrameworkFacts

SYSTEM_DIRS = (
    "/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib",
    "/usr/local/cuda/lib64", "/usr/local/nccl/lib", "/opt/nccl/lib",
)


# RHEL and Fedora keep compiled packages (torch, the nvidia-nccl wheels) in lib64 (sysconfig's
# platlib; pip as root writes /usr/local/lib64): site.getsitepackages() there lists both.
PYTHON_ROOTS = ("/usr/lib", "/usr/lib64", "/usr/local/lib", "/usr/local/lib64", "/opt/conda/lib")


_VERSIONED = re.compile(r"^libnccl\.so\.(\d+\.\d+\.\d+)$")


_WHEEL = re.compile(r"^nvidia_nccl_cu\d+-(\d+\.\d+\.\d+)[^/]*\.dist-info$")
WHEEL_LIBRARY = "nvidia/nccl/lib/libnccl.so.2"  # where every nvidia-nccl-cuXX wheel puts NCCL
# Wheel names kept per environment: real ones hold one or two; a recorded root listing thousands
# cannot grow the report with them.
WHEELS_KEPT = 8


class NcclCopy(Struct, frozen=True):
    path: str
    version: str | None  # None: a libnccl file whose version the node does not name
    # "system", "python" (an nvidia-nccl wheel), "conda" (a conda environment's lib/, where
    # conda-forge's nccl package installs and its pytorch finds it by RPATH) or "job" (a directory
    # the job's environment adds)
    origin: str
    # A Python environment's nvidia-nccl wheels beside the library ("nvidia_nccl_cu12-2.21.5"): all
    # of them install the same nvidia/nccl/lib/libnccl.so.2, so with two the last one installed won.
    wheels: tuple[str, ...] = ()
    # Why no loader picks this versioned file ("libnccl.so.2 links to libnccl.so.2.28.3"): the
    # directory's libnccl.so.2 and libnccl.so reach another version. "" when one may load it.
    unreached: str = ""
    # Why the node's PyTorch does not load this copy (it loads its own wheel by RPATH), while a
    # program linked to libnccl.so.2 without an RPATH would; "" when PyTorch may load it
    bypassed: str = ""


class NcclLibFacts(Struct, frozen=True):
    copies: tuple[NcclCopy, ...]
    problems: tuple[str, ...]
    # NCCL network plugins (libnccl-net*.so) in the directories the loader searches (the system's
    # and the job's LD_LIBRARY_PATH), in its order: NCCL dlopens libnccl-net.so, or
    # libnccl-net-<NCCL_NET_PLUGIN>.so, by bare name (src/plugin/net.cc)
    net_plugins: tuple[str, ...] = ()


def library_dirs(reader: FactReader) -> list[str]:
    dirs = list(SYSTEM_DIRS)
    # Unlisted directories stay in ``problems``: "no libnccl found, and ..." is unknown, not absent.
    for name in reader.listing("/etc/ld.so.conf.d") or []:
        if name.endswith(".conf"):
            for line in (reader.text(f"/etc/ld.so.conf.d/{name}") or "").splitlines():
                entry = line.split("#", 1)[0].strip()
                if entry.startswith("/") and entry not in dirs:
                    dirs.append(entry)
    return dirs


#: The names a program's loader asks for: the SONAME (DT_NEEDED of anything linked with -lnccl)
#: and the link name the linker resolves -lnccl through.
LOADER_NAMES = ("libnccl.so.2", "libnccl.so")
_MAX_LINK_HOPS = 8


def _link_end(fs: NodeFS, path: str) -> str:
    """The file a chain of symbolic links starting at ``path`` ends at (node paths, followed
    textually and at most _MAX_LINK_HOPS deep); SourceError when a link cannot be read."""
    for _ in range(_MAX_LINK_HOPS):
        target = fs.readlink(path)
        if target is None:
            return path
        path = posixpath.normpath(posixpath.join(posixpath.dirname(path), target))
    return path


def _stale_reason(fs: NodeFS, directory: str, names: list[str], versioned: list[str]) -> dict[str, str]:
    """Versioned files of ``directory`` that no loader name there reaches while one reaches
    another version, with why; {} when a link cannot be read (then every file is judged)."""
    reached: dict[str, str] = {}  # end of each loader link -> the link's name
    try:
        for name in LOADER_NAMES:
            if name in names:
                reached.setdefault(_link_end(fs, f"{directory}/{name}"), name)
    except SourceError:
        return {}
    here = {f"{directory}/{name}": name for name in versioned}
    others = [f"{link} links to {here[end]}" for end, link in reached.items() if end in here]
    if not others:
        return {}  # no link reaches a versioned file that is there: nothing says which one loads
    return {name: "; ".join(others) for path, name in here.items() if path not in reached}


#: The file names of NCCL network plugins (the default one and those NCCL_NET_PLUGIN names).
NET_PLUGIN_PREFIX = "libnccl-net"


def _copies_in(fs: NodeFS, reader: FactReader, directory: str, origin: str, plugins: list[str] | None = None) -> list[NcclCopy]:
    """The libnccl copies in ``directory``; its network plugins go to ``plugins`` when given."""
    names = reader.listing(directory) or []
    if plugins is not None:
        plugins += [f"{directory}/{name}" for name in names if name.startswith(NET_PLUGIN_PREFIX) and ".so" in name]
    found = []
    versioned = [name for name in names if _VERSIONED.match(name)]
    stale = _stale_reason(fs, directory, names, versioned)
    for name in versioned:
        match = _VERSIONED.match(name)
        if match:
            found.append(NcclCopy(f"{directory}/{name}", match.group(1), origin, unreached=stale.get(name, "")))
    if not found and "libnccl.so.2" in names and _reaches_a_file(fs, reader, directory, names):
        target = fs.readlink(f"{directory}/libnccl.so.2") or ""
        match = _VERSIONED.match(target.rsplit("/", 1)[-1])
        found.append(NcclCopy(f"{directory}/libnccl.so.2", match.group(1) if match else None, origin))
    return found


def _reaches_a_file(fs: NodeFS, reader: FactReader, directory: str, names: list[str]) -> bool:
    """Whether ``directory``'s libnccl.so.2 is a file or a link that ends at one: a dangling link
    (its package removed) is no copy a job could load. An unreadable link or target is in
    ``problems`` and counts as none."""
    try:
        end = _link_end(fs, f"{directory}/libnccl.so.2")
    except SourceError as error:
        reader.problems.append(str(error))
        return False
    folder, name = posixpath.split(end)
    if folder == directory:
        return name in names  # the listing already says what this directory holds
    return bool(reader.presence(end))


MAX_PATH_ENTRIES = 16  # PATH directories looked in for the job's python


def python_prefixes(environ: Mapping[str, str], reader: FactReader | None = None) -> list[str]:
    """The Python environments a job environment names (``$VIRTUAL_ENV``, ``$CONDA_PREFIX``) and,
    with ``reader``, the one whose ``bin/python3`` comes first on its ``$PATH``: Ray's images run
    /home/ray/anaconda3 that way, activating nothing. A system prefix (/usr) is searched anyway."""
    named = [environ[name].rstrip("/") for name in ("VIRTUAL_ENV", "CONDA_PREFIX") if environ.get(name, "").startswith("/")]
    if reader is not None:
        # A search, not a fact: a PATH entry that cannot be looked in (a dangling link in a
        # partial capture) passes to the next, as the shell's lookup would, and decides nothing.
        scan = FactReader(reader.fs)
        for directory in environ.get("PATH", "").split(":")[:MAX_PATH_ENTRIES]:
            directory = directory.rstrip("/")
            if directory.startswith("/") and scan.presence(f"{directory}/python3"):
                prefix = posixpath.dirname(directory) if directory.endswith("/bin") else ""
                if prefix and f"{prefix}/lib" not in PYTHON_ROOTS and prefix not in named:
                    named.append(prefix)
                break  # the python the job runs
    return named


MAX_PYTHONPATH_ENTRIES = 16  # an Lmod module stack adds a few; more is not read


def python_path_dirs(environ: Mapping[str, str]) -> list[str]:
    """The absolute directories of the job's ``$PYTHONPATH``, where EasyBuild and Spack modules
    put their packages (a PyTorch module's site-packages): Python searches them first."""
    entries = environ.get("PYTHONPATH", "").split(":")[:MAX_PYTHONPATH_ENTRIES]
    return list(dict.fromkeys(entry.rstrip("/") for entry in entries if entry.startswith("/") and entry.rstrip("/")))


def job_environ(fs: NodeFS) -> dict[str, str]:
    """The node's job environment; an unreadable one names nothing (the job probe reports it)."""
    try:
        return parse_environ(fs.read_bytes("/proc/self/environ") or b"")
    except SourceError:
        return {}


# LD_PRELOAD entries looked at: a real one names a handful of libraries.
MAX_PRELOAD_ENTRIES = 32


def preloaded(environ: Mapping[str, str]) -> list[str]:
    """The absolute paths the job's LD_PRELOAD names (space- or colon-separated, as ld.so reads
    it), at most MAX_PRELOAD_ENTRIES."""
    return [entry for entry in re.split(r"[\s:]+", environ.get("LD_PRELOAD", ""))[:MAX_PRELOAD_ENTRIES] if entry.startswith("/")]


def _job_copies(fs: NodeFS, reader: FactReader, environ: Mapping[str, str], searched: list[str], plugins: list[str]) -> list[NcclCopy]:
    """Copies only the job's environment reaches: libnccl in the directories its LD_LIBRARY_PATH
    adds (cloud images put NCCL there: /usr/local/cuda-*/lib on AWS's Deep Learning AMI, the TCPX
    and gIB plugin directories on Google's A3, a module's or uenv's prefix on HPE Cray systems),
    and a libnccl file its LD_PRELOAD names. Paths are the node's, read under its root."""
    found = []
    for directory in library_path_dirs(dict(environ)):
        if directory.rstrip("/") not in searched:
            found += _copies_in(fs, reader, directory.rstrip("/"), "job", plugins)
    preload = preloaded(environ)
    known = {copy.path for copy in found}
    for entry in preload:
        folder, name = posixpath.split(entry)
        if not name.startswith("libnccl.so") or entry in known or folder in searched or not reader.presence(entry):
            continue
        match = _VERSIONED.match(name) or _VERSIONED.match(posixpath.basename(_link_end_or_self(fs, entry)))
        found.append(NcclCopy(entry, match.group(1) if match else None, "job"))
    return found


def _link_end_or_self(fs: NodeFS, path: str) -> str:
    try:
        return _link_end(fs, path)
    except SourceError:
        return path


def site_dirs(reader: FactReader, prefixes: list[str], extra: list[str] | None = None) -> list[str]:
    """The ``site-packages``/``dist-packages`` directories of the system Pythons and of the
    environments under ``prefixes`` (``<prefix>/lib/python3*/...``) that exist on the node, after
    the ``extra`` directories that exist ($PYTHONPATH's, searched first)."""
    found = [folder for folder in extra or () if reader.presence(folder)]
    for base in [*PYTHON_ROOTS, *(f"{prefix}/lib" for prefix in prefixes)]:
        for python in reader.listing(base) or []:
            if python.startswith("python3"):
                for packages in ("site-packages", "dist-packages"):
                    folder = f"{base}/{python}/{packages}"
                    if folder not in found and reader.presence(folder):
                        found.append(folder)
    return found


def _python_copies(fs: NodeFS, reader: FactReader, environ: Mapping[str, str], prefixes: list[str]) -> list[NcclCopy]:
    found = []
    for folder in site_dirs(reader, prefixes, python_path_dirs(environ)):
        entries = reader.listing(folder) or []
        if "nvidia" not in entries:
            continue
        wheels = sorted(entry for entry in entries if _WHEEL.match(entry))
        versions = {match.group(1) for match in map(_WHEEL.match, wheels) if match}
        library = f"{folder}/{WHEEL_LIBRARY}"
        if fs.exists(library):
            version = next(iter(versions)) if len(versions) == 1 else None
            kept = tuple(wheel.removesuffix(".dist-info") for wheel in wheels[:WHEELS_KEPT])
            found.append(NcclCopy(library, version, "python", kept))
    return found


#: Frameworks that load NCCL through builds of their own, not PyTorch's (HVD001's set).
OWN_NCCL_FRAMEWORKS = frozenset({"tensorflow", "tensorflow-cpu", "tensorflow-gpu", "mxnet", "horovod"})


def _torch_bypass(copies: list[NcclCopy], frameworks: FrameworkFacts) -> tuple[str, set[str]]:
    """Why the node's PyTorch loads no copy but its own wheels, and those wheels; ("", set()) when
    it may load another: every PyTorch here
    is a PyPI CUDA build, which names an nvidia-nccl wheel (Requires-Dist) and loads it by the
    DT_RPATH $ORIGIN/../../nvidia/nccl/lib its wheel build sets (pytorch's manywheel build_cuda.sh,
    patchelf --force-rpath), searched before LD_LIBRARY_PATH and the system directories (ld.so(8));
    that wheel is beside it; no other framework loads a build of its own; every metadata file read."""
    torch = [package for package in frameworks.packages if package.name == "torch"]
    if not torch or frameworks.problems or any(package.name in OWN_NCCL_FRAMEWORKS for package in frameworks.packages):
        return "", set()
    sites = sorted({package.metadata.rsplit("/", 2)[0] for package in torch})
    own = {f"{site}/{WHEEL_LIBRARY}" for site in sites}
    if not all(package.nccl_wheel for package in torch) or not own <= {copy.path for copy in copies if copy.origin == "python"}:
        return "", set()
    reason = (
        f"PyTorch here ({', '.join(sites)}) loads its own nvidia-nccl wheel: its libraries' DT_RPATH comes before "
        "LD_LIBRARY_PATH and the system directories; a program linked to libnccl.so.2 without an RPATH loads this copy"
    )
    return reason, own


def _shadowing_job_copy(reader: FactReader, copies: list[NcclCopy], environ: Mapping[str, str]) -> str:
    """Why the system's copies are not what the job loads, "" where they may be: a file the job's
    LD_PRELOAD names, or a libnccl.so.2 in a directory of its LD_LIBRARY_PATH, which the loader
    takes before the system's directories (ld.so(8)), as Google's A3 scripts put gIB's own NCCL
    first. A versioned file without that name beside it is not what a DT_NEEDED libnccl.so.2 finds."""
    preload = set(preloaded(environ))
    for copy in copies:
        if copy.origin != "job" or copy.unreached:
            continue
        if copy.path in preload or reader.presence(f"{posixpath.dirname(copy.path)}/libnccl.so.2"):
            return (f"the job's LD_LIBRARY_PATH or LD_PRELOAD reaches {copy.path} first, which the loader takes before the "
                    "system's directories; only a program whose own DT_RPATH names a system directory loads this copy")
    return ""


@probe("nccl_libs", gather_in=("full",))
def probe_nccl_libs(fs: NodeFS, frameworks: FrameworkFacts | None = None) -> NcclLibFacts:
    """Every libnccl in the system library path, in Python environments and in the places the
    job's environment adds; where the node's PyTorch provably loads its own wheel, the system and
    other Python copies say so (``bypassed``). The job's LD_LIBRARY_PATH and LD_PRELOAD copies never do."""
    reader = FactReader(fs)
    copies: list[NcclCopy] = []
    searched = library_dirs(reader)
    job_plugins: list[str] = []
    system_plugins: list[str] = []
    for directory in searched:
        copies += _copies_in(fs, reader, directory, "system", system_plugins)
    environ = job_environ(fs)
    prefixes = python_prefixes(environ, reader)
    copies += _python_copies(fs, reader, environ, prefixes)
    conda = [f"{prefix}/lib" for prefix in dict.fromkeys(("/opt/conda", *prefixes))]
    for directory in conda:
        if directory not in searched and reader.presence(f"{directory[:-4]}/conda-meta"):
            copies += _copies_in(fs, reader, directory, "conda")
    copies += _job_copies(fs, reader, environ, [*searched, *conda], job_plugins)
    bypass, own = _torch_bypass(copies, frameworks) if frameworks is not None else ("", set())
    if bypass:
        copies = [copy if copy.origin == "job" or copy.path in own else replace(copy, bypassed=bypass) for copy in copies]
    shadow = _shadowing_job_copy(reader, copies, environ)
    if shadow:
        copies = [replace(copy, bypassed=shadow) if copy.origin == "system" and not copy.bypassed else copy for copy in copies]
    # LD_LIBRARY_PATH comes before the system's directories in the loader's order.
    return NcclLibFacts(tuple(copies), tuple(reader.problems), net_plugins=tuple(job_plugins + system_plugins))
