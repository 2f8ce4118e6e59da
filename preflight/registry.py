"""Probes and checks, how they declare themselves, and the validation that makes mistakes loud.

A probe gathers facts from sources; its parameters name the sources it reads (``fs``, ``nvml``,
``netlink``, ``dns``, ``clock``), may add ``settings`` for site configuration, and may name other
probes whose facts it builds on (``job``): the engine runs those first and hands their facts over. A check decides
one catalogued reference from facts; its parameters name the probes whose facts it reads, plus
optionally ``expect`` (the site's expectations for this host). The engine injects arguments by
name, so a signature is also a declaration of data dependencies.

The decorators only validate the signature and tag the function; discovery collects tagged
functions from modules into a fresh :class:`Registry`, which then validates the whole set
against the catalogue (duplicate IDs, unknown references, unknown probes, names).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from msgspec import Struct

from preflight.catalogue import References
from preflight.model import REFERENCE_ID

#: Profiles in increasing scope: ``prolog`` runs before every job, ``full`` is the audit.
PROFILES = ("prolog", "full")
SOURCE_PARAMETERS = frozenset({"fs", "nvml", "netlink", "dns", "clock", "settings"})
PROBE_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
DEFAULT_PROBE_TIMEOUT_S = 3.0

_PROBE_TAG = "__preflight_probe__"
_CHECK_TAG = "__preflight_check__"
F = TypeVar("F", bound=Callable[..., Any])


class RegistrationError(Exception):
    """A probe or check is declared wrongly; raised at import or discovery, never at run time."""


class ProbeSpec(Struct, frozen=True):
    name: str
    func: Callable[..., Any]
    sources: tuple[str, ...]
    timeout_s: float | None  # None: the run's per-probe default
    needs: tuple[str, ...]  # probes whose facts this probe is given, by their names
    gather_in: tuple[str, ...]  # profiles that gather this probe even if no selected check needs it
    origin: str  # module that defined it


class CheckSpec(Struct, frozen=True):
    reference_id: str
    func: Callable[..., Any]
    probes: tuple[str, ...]
    wants_expect: bool
    profiles: tuple[str, ...]
    origin: str
    # Probes the check can judge without: when one fails, the check gets an Unread in place of
    # its facts instead of becoming unknown as a whole.
    optional: tuple[str, ...] = ()


# Code-object flags (CPython's CO_VARARGS and CO_VARKEYWORDS): reading the code object costs
# 0.5 us a function where inspect.signature() costs 15 us, and every start registers ~140.
_VARARGS, _VARKEYWORDS = 0x04, 0x08


def _parameters(func: Callable[..., Any], what: str) -> list[str]:
    """The names a probe or check is called with, in order: plain and keyword-only parameters."""
    while hasattr(func, "__wrapped__"):  # functools.wraps, as inspect.signature() follows it
        func = func.__wrapped__
    code = getattr(func, "__code__", None)
    if code is None:
        raise RegistrationError(f"{what} {getattr(func, '__qualname__', func)!r}: not a Python function")
    if code.co_flags & (_VARARGS | _VARKEYWORDS):
        raise RegistrationError(f"{what} {func.__qualname__}: *args/**kwargs are not allowed")
    if code.co_posonlyargcount:  # sources and facts are passed by name
        raise RegistrationError(f"{what} {func.__qualname__}: positional-only parameters are not allowed")
    return list(code.co_varnames[: code.co_argcount + code.co_kwonlyargcount])


def probe(name: str, *, timeout_s: float | None = None, gather_in: Iterable[str] = ()) -> Callable[[F], F]:
    """Declare a probe named ``name`` whose facts checks receive as the parameter ``name``."""
    if not PROBE_NAME.match(name):
        raise RegistrationError(f"probe name {name!r} must be a lower-case identifier")
    gather = tuple(gather_in)
    _check_profiles(gather, f"probe {name}")

    def decorate(func: F) -> F:
        parameters = _parameters(func, "probe")
        needs = tuple(p for p in parameters if p not in SOURCE_PARAMETERS)
        if name in needs:
            raise RegistrationError(f"probe {name} ({func.__module__}.{func.__qualname__}) cannot need itself")
        sources = tuple(p for p in parameters if p in SOURCE_PARAMETERS)
        spec = ProbeSpec(name, func, sources, timeout_s, needs, gather, func.__module__)
        setattr(func, _PROBE_TAG, spec)
        return func

    return decorate


def check(reference_id: str, *, profiles: Iterable[str] = ("full",), optional: Iterable[str] = ()) -> Callable[[F], F]:
    """Declare the check that decides reference ``reference_id``.

    ``profiles`` lists where it runs; ``full`` is always included. Checks for the ``prolog``
    profile must be cheap and must not need slow probes. ``optional`` names probes among its
    parameters that the check can judge without: when one of them fails, the check is called with
    a :class:`preflight.model.Unread` in its place (and must accept one) instead of becoming
    ``unknown`` as a whole.
    """
    if not REFERENCE_ID.match(reference_id):
        raise RegistrationError(f"check ID {reference_id!r} is not AREA + 3 digits (e.g. MEM001)")
    chosen = tuple(dict.fromkeys((*profiles, "full")))
    _check_profiles(chosen, f"check {reference_id}")
    wanted = tuple(optional)

    def decorate(func: F) -> F:
        parameters = _parameters(func, "check")
        probes = tuple(p for p in parameters if p != "expect")
        stray = [name for name in wanted if name not in probes]
        if stray:
            raise RegistrationError(f"check {reference_id}: optional {stray} are not among its probe parameters {list(probes)}")
        spec = CheckSpec(reference_id, func, probes, "expect" in parameters, chosen, func.__module__, wanted)
        setattr(func, _CHECK_TAG, spec)
        return func

    return decorate


def _check_profiles(profiles: tuple[str, ...], what: str) -> None:
    unknown = [p for p in profiles if p not in PROFILES]
    if unknown:
        raise RegistrationError(f"{what}: unknown profiles {unknown}; known: {list(PROFILES)}")


class Registry:
    """The probes and checks of one run, and the references they decide."""

    def __init__(self) -> None:
        self.probes: dict[str, ProbeSpec] = {}
        self.checks: dict[str, CheckSpec] = {}
        # Packaged, plus what site directories and plugins ship: every lookup by ID goes here.
        self.references = References()

    def collect(self, module: Any, profile: str | None = None) -> None:
        """Add every tagged probe and check defined in ``module``; with ``profile``, only the
        checks that run in it."""
        for value in vars(module).values():
            probe_spec = getattr(value, _PROBE_TAG, None)
            if isinstance(probe_spec, ProbeSpec) and probe_spec.origin == module.__name__:
                self.add_probe(probe_spec)
            check_spec = getattr(value, _CHECK_TAG, None)
            if isinstance(check_spec, CheckSpec) and check_spec.origin == module.__name__:
                if profile is None or profile in check_spec.profiles:
                    self.add_check(check_spec)

    def add_probe(self, spec: ProbeSpec) -> None:
        existing = self.probes.get(spec.name)
        if existing is not None and existing.func is not spec.func:
            raise RegistrationError(f"probe {spec.name} is defined twice: in {existing.origin} and {spec.origin}")
        self.probes[spec.name] = spec

    def add_check(self, spec: CheckSpec) -> None:
        existing = self.checks.get(spec.reference_id)
        if existing is not None and existing.func is not spec.func:
            raise RegistrationError(
                f"check {spec.reference_id} is defined twice: in {existing.origin} and {spec.origin}"
            )
        self.checks[spec.reference_id] = spec

    def validate(self, symbols: dict[str, str]) -> None:
        """Fail on checks for unknown references, misnamed checks and unknown probe parameters.

        ``symbols`` maps every known reference ID (packaged or shipped beside site checks) to
        its symbol.
        """
        problems = self._probe_problems()
        for ref_id, spec in sorted(self.checks.items()):
            where = f"check {ref_id} ({spec.origin}.{spec.func.__name__})"
            symbol = symbols.get(ref_id)
            if symbol is None:
                problems.append(
                    f"{where}: no reference {ref_id} in the catalogue, nor as {ref_id}.toml beside the module"
                )
                continue
            expected_name = symbol.replace("-", "_")
            if spec.func.__name__ != expected_name:
                problems.append(f"{where}: must be named {expected_name} after its symbol")
            missing = [p for p in spec.probes if p not in self.probes]
            if missing:
                problems.append(f"{where}: parameters {missing} name no probe; known: {sorted(self.probes)}")
        if problems:
            raise RegistrationError("; ".join(problems))

    def _probe_problems(self) -> list[str]:
        """Probes that need unknown probes, or need each other in a circle."""
        problems = []
        for name, spec in sorted(self.probes.items()):
            missing = [need for need in spec.needs if need not in self.probes]
            if missing:
                problems.append(
                    f"probe {name} ({spec.origin}.{spec.func.__name__}): parameters {missing} are neither "
                    f"sources ({sorted(SOURCE_PARAMETERS)}) nor probes"
                )
        state: dict[str, int] = {}  # 1: being visited, 2: done

        def visit(name: str, path: tuple[str, ...]) -> None:
            if state.get(name) == 2 or name not in self.probes:
                return
            if state.get(name) == 1:
                circle = path[path.index(name):] + (name,)
                problems.append(f"probes need each other in a circle: {' -> '.join(circle)}")
                return
            state[name] = 1
            for need in self.probes[name].needs:
                visit(need, (*path, name))
            state[name] = 2

        for name in sorted(self.probes):
            visit(name, ())
        return problems

    def needed_probes(self, names: Iterable[str]) -> list[str]:
        """``names`` and every probe they need, directly or through others, sorted."""
        wanted: set[str] = set()
        pending = list(names)
        while pending:
            name = pending.pop()
            if name not in wanted:
                wanted.add(name)
                pending.extend(self.probes[name].needs)
        return sorted(wanted)
