"""Find check modules: the built-in ``preflight.checks`` package, installed plugins (entry-point
group ``preflight.checks``) and site directories (``--checks-dir``, NHC's scripts-folder idea).

Each module is imported once per process; its tagged probes and checks are collected into a fresh
:class:`~preflight.registry.Registry`, which is then validated against the catalogue.

An extension brings the references its checks decide: ``<ID>.toml`` files in the directory of its
check modules (a site directory itself; a plugin module's own directory, which a top-level module
file straight on ``sys.path`` does not have). They are data: read with size and count limits,
validated by the catalogue's schema, refused when their ID or symbol is already taken. Nothing of
this is read when no site directory or plugin is configured.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import stat
import sys
from collections.abc import Collection, Iterable
from types import ModuleType

from preflight.catalogue import CatalogueError, References, load_all, reference_from_file, reference_ids
from preflight.catalogue_index import REFERENCE_FILE
from preflight.model import Reference
from preflight.registry import RegistrationError, Registry

ENTRY_POINT_GROUP = "preflight.checks"


#: Built-in modules a prolog run does not import: their checks run in the full profile only and
#: their probes are gathered only there or by such checks (~20 ms saved before every job);
#: tests/engine/test_engine.py keeps this list true.
FULL_ONLY_MODULES = frozenset({
    "preflight.probes.interfaces", "preflight.probes.nccl_platform",
    "preflight.probes.p2p", "preflight.probes.routing", "preflight.probes.nccl_socket", "preflight.checks.net",
    "preflight.probes.horovod", "preflight.checks.hvd",
})


def _module_names(package: ModuleType) -> list[str]:
    """Dotted names of a package's public modules, in name order."""
    return [
        f"{package.__name__}.{name[:-3]}"
        for directory in package.__path__
        for name in sorted(os.listdir(directory))
        if name.endswith(".py") and not name.startswith("_")
    ]


def builtin_probe_modules() -> list[ModuleType]:
    """Every built-in probe module (``preflight.probes``), without the check modules."""
    import preflight.probes as probes

    return [importlib.import_module(name) for name in _module_names(probes)]


def builtin_probe_registry(profile: str | None = None) -> Registry:
    """The built-in probes a ``profile`` run can use, without importing any check module."""
    import preflight.probes as probes

    registry = Registry()
    for name in _module_names(probes):
        if profile != "prolog" or name not in FULL_ONLY_MODULES:
            registry.collect(importlib.import_module(name), profile)
    return registry


def builtin_modules(profile: str | None = None, families: Collection[str] | None = None) -> list[ModuleType]:
    """The built-in probe modules (``preflight.probes``) and check modules (``preflight.checks``);
    for ``profile="prolog"``, only those it can use; with ``families``, only the check modules
    of those reference families (``checks/mem.py`` decides the MEM references)."""
    import preflight.checks as checks
    import preflight.probes as probes

    check_names = _module_names(checks)
    if families is not None:
        check_names = [name for name in check_names if name.rsplit(".", 1)[1] in families]
    names = [*_module_names(probes), *check_names]
    if profile == "prolog":
        names = [name for name in names if name not in FULL_ONLY_MODULES]
    return [importlib.import_module(name) for name in names]


def family(ref_id: str) -> str:
    """The check module of a reference: ``MEM001`` is decided in ``checks/mem.py``."""
    return ref_id.rstrip("0123456789").lower()


def selected_families(references: References, select: Iterable[str]) -> set[str] | None:
    """The families of the references ``select`` names (ID prefixes or symbols, as ``--select``
    takes them), so that a run of a few checks imports only their modules; None (all) when a
    token names none, which the run then reports."""
    from preflight.model import selects

    tokens = tuple(select)
    found: set[str] = set()
    for token in tokens:
        matched = {family(reference.id) for reference in references.all() if selects(token, reference)}
        if not matched:
            return None
        found |= matched
    return found


def entry_point_specs(group: str = ENTRY_POINT_GROUP) -> list[tuple[str, str]]:
    """(name, "module[:attr]") of every installed entry point in ``group``.

    ``importlib.metadata`` costs ~25 ms to import (email parsing, zipfile), a sixth of the prolog
    budget, to read a few small ``entry_points.txt`` files; this reads them directly, with the
    same precedence (the first distribution of a name on ``sys.path`` wins).
    """
    found: dict[str, str] = {}
    seen_distributions: set[str] = set()
    for directory in sys.path:
        try:
            names = sorted(os.listdir(directory or "."))
        except OSError:
            continue
        for name in names:
            if not name.endswith((".dist-info", ".egg-info")):
                continue
            distribution = name.rsplit("-", 1)[0].lower().replace("_", "-") if name.endswith(".dist-info") else name[:-9].lower()
            if distribution in seen_distributions:
                continue
            seen_distributions.add(distribution)
            try:
                with open(os.path.join(directory or ".", name, "entry_points.txt"), encoding="utf-8") as handle:
                    text = handle.read()
            except OSError:
                continue
            for entry_name, value in _section(text, group):
                found.setdefault(entry_name, value)
    return sorted(found.items())


def _section(text: str, group: str) -> list[tuple[str, str]]:
    """``name = value`` lines of one ``[group]`` section of an entry_points.txt file."""
    entries, inside = [], False
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("["):
            inside = stripped == f"[{group}]"
        elif inside and "=" in stripped and not stripped.startswith(("#", ";")):
            name, _, value = stripped.partition("=")
            entries.append((name.strip(), value.strip()))
    return entries


def plugin_modules() -> list[ModuleType]:
    """Modules named by installed distributions in the ``preflight.checks`` entry-point group."""
    return [module for _, module in _plugins()]


def _plugins() -> list[tuple[str, ModuleType]]:
    """(entry-point name, module) of every installed plugin."""
    modules = []
    for name, value in entry_point_specs():
        module_name, _, attribute = value.partition(":")
        try:
            loaded: object = importlib.import_module(module_name.strip())
            if attribute:
                for part in attribute.strip().split("."):
                    loaded = getattr(loaded, part)
        except Exception as error:
            raise RegistrationError(f"plugin {name} ({value}) failed to import: {error}") from None
        module = loaded if isinstance(loaded, ModuleType) else sys.modules.get(getattr(loaded, "__module__", ""))
        if module is None:
            raise RegistrationError(f"plugin {name} ({value}) is not a module")
        modules.append((name, module))
    return modules


def require_trusted(path: str, what: str) -> None:
    """RegistrationError unless ``path`` (links followed) belongs to root or to whoever runs
    preflight and nobody else may write it: preflight runs as root before every job, and a
    check module runs with its rights."""
    try:
        status = os.stat(path)
    except OSError as error:
        raise RegistrationError(f"{what} {path}: {error.strerror}") from None
    if status.st_uid not in (0, os.geteuid()):
        raise RegistrationError(f"{what} {path}: owned by uid {status.st_uid}, not by root or the user running preflight; refusing to import from it")
    if status.st_mode & 0o022:
        raise RegistrationError(f"{what} {path}: writable by its group or by everyone (mode {status.st_mode & 0o7777:04o}); refusing to import from it")


def directory_modules(directory: str) -> list[ModuleType]:
    """Every ``*.py`` in a site checks directory, imported under a private module name. The
    directory and each module must be trusted (:func:`require_trusted`)."""
    require_trusted(directory, "--checks-dir")
    try:
        names = sorted(name for name in os.listdir(directory) if name.endswith(".py"))
    except OSError as error:
        raise RegistrationError(f"--checks-dir {directory}: {error.strerror}") from None
    modules = []
    for name in names:
        path = os.path.join(directory, name)
        require_trusted(path, "check module")
        import hashlib  # only site directories need it; keeps the common path lean

        digest = hashlib.sha1(os.path.abspath(path).encode()).hexdigest()[:12]
        package_name = f"preflight_site_checks_{digest}"
        module_name = f"{package_name}.{name[:-3]}"
        # The private package exists too (empty, nothing importable through it), so that its
        # modules' records can be pickled by name: facts travel from the probes' child process.
        package = sys.modules.setdefault(package_name, ModuleType(package_name))
        package.__path__ = []
        if module_name in sys.modules:
            modules.append(sys.modules[module_name])
            continue
        spec = importlib.util.spec_from_file_location(module_name, path)
        if spec is None or spec.loader is None:
            raise RegistrationError(f"{path}: cannot be imported")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        try:
            spec.loader.exec_module(module)
        except RegistrationError as error:
            del sys.modules[module_name]
            raise RegistrationError(f"{path}: {error}") from None
        except Exception as error:
            del sys.modules[module_name]
            raise RegistrationError(f"{path} failed to import: {type(error).__name__}: {error}") from None
        modules.append(module)
    return modules


#: A reference is a few KiB of TOML (the largest packaged one has 9); an extension directory holds
#: a handful. The limits keep a stray file from turning into a slow or huge parse on every run.
MAX_REFERENCE_BYTES = 64 * 1024
MAX_REFERENCES_PER_DIRECTORY = 500


def module_directory(module: ModuleType) -> str | None:
    """Where a plugin module's references live: the directory of its file (a package's own
    directory), or None for a top-level module file, whose directory (site-packages) belongs to
    every installed distribution."""
    filename = getattr(module, "__file__", None)
    if not isinstance(filename, str) or not filename:
        return None
    if hasattr(module, "__path__") or "." in module.__name__:
        return os.path.dirname(os.path.abspath(filename))
    return None


def read_reference(path: str, ref_id: str, trusted_only: bool) -> Reference:
    """The reference in ``path`` (``<ref_id>.toml``), validated; RegistrationError otherwise.
    ``trusted_only``: the file must pass :func:`require_trusted` (site directories)."""
    if trusted_only:
        require_trusted(path, "reference")
    try:
        # O_NONBLOCK: a FIFO named like a reference must not hang the run; a regular file ignores it.
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as error:
        raise RegistrationError(f"reference {path}: {error.strerror}") from None
    with os.fdopen(descriptor, "rb") as handle:
        status = os.fstat(handle.fileno())
        if not stat.S_ISREG(status.st_mode):
            raise RegistrationError(f"reference {path}: not a regular file")
        data = handle.read(MAX_REFERENCE_BYTES + 1)
    if len(data) > MAX_REFERENCE_BYTES:
        raise RegistrationError(f"reference {path}: larger than {MAX_REFERENCE_BYTES // 1024} KiB, which no reference needs")
    try:
        return reference_from_file(data, path, ref_id)
    except CatalogueError as error:
        raise RegistrationError(f"reference {error}") from None


def directory_references(directory: str, what: str, trusted_only: bool) -> dict[str, tuple[Reference, str]]:
    """(reference, path) by ID of the ``<ID>.toml`` files in ``directory``."""
    try:
        names = sorted(name for name in os.listdir(directory) if REFERENCE_FILE.match(name))
    except OSError as error:
        raise RegistrationError(f"{what} {directory}: {error.strerror}") from None
    if len(names) > MAX_REFERENCES_PER_DIRECTORY:
        raise RegistrationError(f"{what} {directory}: {len(names)} reference files, more than the {MAX_REFERENCES_PER_DIRECTORY} allowed")
    found = {}
    for name in names:
        path = os.path.join(directory, name)
        found[name[:-5]] = (read_reference(path, name[:-5], trusted_only), path)
    return found


def extension_references(places: Iterable[tuple[str, str, bool]]) -> References:
    """The references shipped in ``places`` ((directory, what it is, trusted_only)), refused
    when an ID or symbol is the packaged catalogue's or another extension's: one ID must mean
    one thing in every report, config and ``--select``."""
    extra: dict[str, Reference] = {}
    origins: dict[str, str] = {}
    seen: set[str] = set()
    packaged_ids: set[str] | None = None
    packaged_symbols: dict[str, str] = {}
    for directory, what, trusted_only in places:
        if os.path.realpath(directory) in seen:
            continue
        seen.add(os.path.realpath(directory))
        for ref_id, (reference, path) in directory_references(directory, what, trusted_only).items():
            if packaged_ids is None:  # the first extension reference pays for the catalogue's
                packaged_ids = set(reference_ids())
                packaged_symbols = {r.symbol: r.id for r in load_all()}
            if ref_id in packaged_ids:
                raise RegistrationError(f"reference {path}: {ref_id} is a packaged reference; give the site's reference an ID of its own (e.g. a site prefix: ACME001)")
            if ref_id in origins:
                raise RegistrationError(f"reference {path}: {ref_id} is also shipped as {origins[ref_id]}")
            taken = packaged_symbols.get(reference.symbol) or next((r.id for r in extra.values() if r.symbol == reference.symbol), None)
            if taken:
                raise RegistrationError(f"reference {path}: symbol {reference.symbol!r} already names {taken}")
            extra[ref_id] = reference
            origins[ref_id] = path
    return References(extra, origins)


def known_references(checks_dirs: Iterable[str] = (), plugins: bool = True) -> References:
    """The packaged references plus those that ``checks_dirs`` and installed plugins ship, without
    importing the site directories' modules (``preflight references``)."""
    places = [(directory, "--checks-dir", True) for directory in checks_dirs]
    for directory in checks_dirs:
        require_trusted(directory, "--checks-dir")
    if plugins:
        places = [*_plugin_places(_plugins()), *places]
    return extension_references(places) if places else References()


def shipped_reference_ids(checks_dirs: Iterable[str]) -> set[str]:
    """IDs of the references that ``checks_dirs`` and installed plugins ship, from file names
    alone: what a config may name in ``disable`` and ``[severity]``. Unreadable places are
    skipped; loading them for a run reports them."""
    places = [*checks_dirs]
    try:
        places += [directory for directory, _, _ in _plugin_places(_plugins())]
    except RegistrationError:
        pass
    found: set[str] = set()
    for directory in places:
        try:
            found.update(name[:-5] for name in os.listdir(directory) if REFERENCE_FILE.match(name))
        except OSError:
            continue
    return found


def _plugin_places(plugins: list[tuple[str, ModuleType]]) -> list[tuple[str, str, bool]]:
    places = []
    for name, module in plugins:
        directory = module_directory(module)
        if directory is not None:
            places.append((directory, f"plugin {name}", False))
    return places


def build_registry(
    checks_dirs: Iterable[str] = (), plugins: bool = True, profile: str | None = None, select: Iterable[str] = ()
) -> Registry:
    """All probes and checks, validated against the catalogue and the references that plugins and
    site directories ship; with ``select`` (``--select`` tokens), only the built-in checks of the
    families it names. Raises RegistrationError."""
    registry = Registry()
    modules: list[ModuleType] = []
    places: list[tuple[str, str, bool]] = []
    if plugins:
        found = _plugins()
        modules += [module for _, module in found]
        places += _plugin_places(found)
    for directory in checks_dirs:
        require_trusted(directory, "--checks-dir")
        places.append((directory, "--checks-dir", True))
    if places:  # before a site module runs: a bad reference stops the run with nothing imported
        registry.references = extension_references(places)
    families = selected_families(registry.references, select) if select else None
    modules = [*builtin_modules(profile, families), *modules]
    for directory in checks_dirs:
        modules += directory_modules(directory)
    for module in modules:
        registry.collect(module, profile)
    known = set(reference_ids()) | set(registry.references.extra)
    symbols = {ref_id: registry.references.get(ref_id).symbol for ref_id in registry.checks if ref_id in known}
    registry.validate(symbols)
    return registry
