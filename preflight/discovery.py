"""Find check modules: the built-in ``preflight.checks`` package, installed plugins (entry-point
group ``preflight.checks``) and site directories (``--checks-dir``, NHC's scripts-folder idea).

Each module is imported once per process; its tagged probes and checks are collected into a fresh
:class:`~preflight.registry.Registry`, which is then validated against the catalogue.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Iterable
from types import ModuleType

from preflight.catalogue import load_reference, reference_ids
from preflight.registry import RegistrationError, Registry

ENTRY_POINT_GROUP = "preflight.checks"


#: Built-in modules a prolog run does not import: their checks run in the full profile only and
#: their probes are gathered only there or by such checks (~20 ms saved before every job);
#: tests/test_engine.py keeps this list true.
FULL_ONLY_MODULES = frozenset({
    "preflight.probes.fabric", "preflight.probes.interfaces", "preflight.probes.nccl_platform",
    "preflight.probes.p2p", "preflight.probes.routing", "preflight.probes.nccl_socket", "preflight.checks.net",
})


def builtin_probe_modules() -> list[ModuleType]:
    """Every built-in probe module (``preflight.probes``), without the check modules."""
    import preflight.probes as probes

    names = sorted(name[:-3] for directory in probes.__path__ for name in os.listdir(directory) if name.endswith(".py") and not name.startswith("_"))
    return [importlib.import_module(f"preflight.probes.{name}") for name in names]


def builtin_modules(profile: str | None = None) -> list[ModuleType]:
    """The built-in probe modules (``preflight.probes``) and check modules (``preflight.checks``);
    for ``profile="prolog"``, only those it can use."""
    import preflight.checks as checks
    import preflight.probes as probes

    names = [
        f"{package.__name__}.{name[:-3]}"
        for package in (probes, checks)
        for directory in package.__path__
        for name in sorted(os.listdir(directory))
        if name.endswith(".py") and not name.startswith("_")
    ]
    if profile == "prolog":
        names = [name for name in names if name not in FULL_ONLY_MODULES]
    return [importlib.import_module(name) for name in names]


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
        modules.append(module)
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
        module_name = f"preflight_site_checks_{digest}.{name[:-3]}"
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


def build_registry(checks_dirs: Iterable[str] = (), plugins: bool = True, profile: str | None = None) -> Registry:
    """All probes and checks, validated against the catalogue; raises RegistrationError."""
    registry = Registry()
    modules = builtin_modules(profile)
    if plugins:
        modules += plugin_modules()
    for directory in checks_dirs:
        modules += directory_modules(directory)
    for module in modules:
        registry.collect(module, profile)
    known = set(reference_ids())
    symbols = {ref_id: load_reference(ref_id).symbol for ref_id in registry.checks if ref_id in known}
    registry.validate(symbols)
    return registry
