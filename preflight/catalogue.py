"""The reference catalogue: one TOML file per reference in ``references/`` (shipped inside the
wheel as ``preflight/references``), named ``<ID>.toml``.

Files are read lazily, one at a time, because the prolog needs only the references of the
checks it runs; their parsed documents come from the index the build wrote
(:mod:`preflight.catalogue_index`) while it matches them. ``validate_document`` is the schema: the
loader, the tests and the references that site checks and plugins bring (:class:`References`,
filled by :mod:`preflight.discovery`) all use the same code.
"""

from __future__ import annotations

import os
import re
from functools import lru_cache
from typing import Any

import msgspec
from msgspec import Raw, Struct, field

from preflight.catalogue_index import INDEX_FORMAT, INDEX_NAME, digest
from preflight.model import REFERENCE_ID, SYMBOL, Reference, Severity
from preflight.signatures import MIN_LITERAL, ROLES, required_literals, safety_problems
from preflight.tomlcompat import TomlError, parse_toml

DETECT_MODES = ("node", "config", "runtime")
_REQUIRED_STRINGS = ("id", "symbol", "title", "area", "severity", "summary")
_STRING_LISTS = ("causes", "fix", "related", "sources", "old_ids")
_KNOWN_KEYS = frozenset((*_REQUIRED_STRINGS, *_STRING_LISTS, "detect", "evidence", "signatures"))
_AREA = re.compile(r"^[a-z][a-z0-9-]*$")
_FLEET_KEY = re.compile(r"^[a-z][a-z0-9_]*$")


class CatalogueError(Exception):
    """A reference file is missing or does not follow the schema."""


def catalogue_dir() -> str:
    """Where the installed package keeps its references."""
    import preflight.references as package

    return list(package.__path__)[0]


def reference_ids(directory: str | None = None) -> list[str]:
    """IDs of all references, from file names alone (no parsing)."""
    folder = directory or catalogue_dir()
    return sorted(name[:-5] for name in os.listdir(folder) if name.endswith(".toml") and REFERENCE_ID.match(name[:-5]))


class _IndexFile(Struct):
    format: str
    references: dict[str, Raw]  # each entry left encoded until its reference is asked for


class _IndexEntry(Struct):
    digest: str
    document: dict[str, Any]


@lru_cache(maxsize=None)
def _index(directory: str) -> dict[str, Raw]:
    """The still-encoded entries of ``directory``'s build-time index
    (:mod:`preflight.catalogue_index`); empty when there is none or it is not one. A prolog run
    needs a third of the references: decoding only theirs halves the index's cost (~2 ms)."""
    try:
        with open(os.path.join(directory, INDEX_NAME), "rb") as handle:
            index = msgspec.json.decode(handle.read(), type=_IndexFile)
    except (OSError, msgspec.DecodeError):
        return {}
    return index.references if index.format == INDEX_FORMAT else {}


def _index_document(directory: str, ref_id: str, data: bytes) -> dict[str, Any] | None:
    """The indexed document of ``ref_id`` when the index has this file's bytes ``data``."""
    raw = _index(directory).get(ref_id)
    if raw is None:
        return None
    try:
        entry = msgspec.json.decode(raw, type=_IndexEntry)
    except msgspec.DecodeError:
        return None
    return entry.document if entry.digest == digest(data) else None


def _read_document(ref_id: str, directory: str | None) -> tuple[dict[str, Any], str]:
    """The document of ``<ID>.toml``: from the index while the index has this file's bytes,
    else parsed from the file."""
    folder = directory or catalogue_dir()
    path = os.path.join(folder, f"{ref_id}.toml")
    try:
        with open(path, "rb") as handle:
            data = handle.read()
    except FileNotFoundError:
        raise CatalogueError(f"no reference {ref_id} ({path} is missing)") from None
    except OSError as error:
        raise CatalogueError(f"{path}: {error.strerror}") from None
    document = _index_document(folder, ref_id, data)
    return (document, path) if document is not None else (_parse_document(data, path), path)


def _parse_document(data: bytes, path: str) -> dict[str, Any]:
    try:
        return parse_toml(data.decode("utf-8"))
    except UnicodeDecodeError as error:
        raise CatalogueError(f"{path}: not UTF-8 text: {error.reason} at byte {error.start}") from None
    except TomlError as error:
        raise CatalogueError(f"{path}: not valid TOML: {error}") from None


@lru_cache(maxsize=None)
def load_reference(ref_id: str, directory: str | None = None) -> Reference:
    """Parse and validate ``<ID>.toml`` of the packaged catalogue (or of ``directory``)."""
    document, path = _read_document(ref_id, directory)
    return _reference(document, path, ref_id, analyse_signatures=False)


def reference_from_file(data: bytes, path: str, ref_id: str) -> Reference:
    """A reference shipped beside site checks or a plugin, from its file's bytes, fully
    validated: unlike the packaged catalogue, no test of this project has seen it."""
    return _reference(_parse_document(data, path), path, ref_id, analyse_signatures=True)


def _reference(document: dict[str, Any], path: str, ref_id: str, analyse_signatures: bool) -> Reference:
    problems = validate_document(document, expected_id=ref_id, analyse_signatures=analyse_signatures)
    if problems:
        raise CatalogueError(f"{path}: " + "; ".join(problems))
    detect = document.get("detect", {})
    return Reference(
        id=document["id"],
        symbol=document["symbol"],
        title=document["title"],
        area=document["area"],
        severity=Severity(document["severity"]),
        summary=document["summary"].strip(),
        fix=tuple(step.strip() for step in document.get("fix", [])),
        detect=tuple(detect.get("modes", [])),
        checks=tuple(detect.get("checks", [])),
        why_log_only=detect.get("why_log_only", "").strip(),
        candidate=detect.get("candidate", "").strip(),
        fleet=tuple(detect.get("fleet", [])),
        tests_only=detect.get("tests_only", "").strip(),
        causes=tuple(document.get("causes", [])),
        evidence=tuple(document.get("evidence", [])),
        related=tuple(document.get("related", [])),
        signatures=tuple(document.get("signatures", [])),
        sources=tuple(document.get("sources", [])),
        old_ids=tuple(document.get("old_ids", [])),
    )


def load_all(directory: str | None = None) -> list[Reference]:
    return [load_reference(ref_id, directory) for ref_id in reference_ids(directory)]


class References(Struct, frozen=True):
    """The references one run knows: the packaged catalogue, plus those that site check
    directories and plugins ship beside their checks (``extra``, by ID; discovery refuses an
    extra ID that the catalogue or another extension already has)."""

    extra: dict[str, Reference] = field(default_factory=dict)
    origins: dict[str, str] = field(default_factory=dict)  # extra ID -> the file it came from

    def get(self, ref_id: str) -> Reference:
        """The reference ``ref_id``; CatalogueError when nobody has it."""
        found = self.extra.get(ref_id)
        return found if found is not None else load_reference(ref_id)

    def ids(self) -> list[str]:
        return sorted({*reference_ids(), *self.extra})

    def all(self) -> list[Reference]:
        return [self.get(ref_id) for ref_id in self.ids()]


def validate_document(document: dict[str, Any], expected_id: str | None = None, analyse_signatures: bool = True) -> list[str]:
    """Every way ``document`` breaks the reference schema; empty when it is valid.

    ``analyse_signatures=False`` checks the signatures' shape only, skipping the compilation,
    example matching and literal/backtracking analysis that take most of the time: the prolog
    loads references on every job start, and ``explain`` analyses the patterns it compiles
    anyway (:class:`preflight.explain.matcher.Matcher`). Tests validate everything."""
    unknown = [f"unknown key {key!r}" for key in sorted(set(document) - _KNOWN_KEYS)]
    problems: list[str] = []
    for key in _REQUIRED_STRINGS:
        if not isinstance(document.get(key), str) or not document[key].strip():
            problems.append(f"{key!r} must be a non-empty string")
    for key in _STRING_LISTS:
        value = document.get(key, [])
        if not isinstance(value, list) or not all(isinstance(item, str) and item.strip() for item in value):
            problems.append(f"{key!r} must be a list of non-empty strings")
    if problems:
        return unknown + problems  # the checks below need these types
    problems = unknown
    if not REFERENCE_ID.match(document["id"]):
        problems.append(f"id {document['id']!r} is not AREA + 3 digits")
    if expected_id is not None and document["id"] != expected_id:
        problems.append(f"id {document['id']!r} does not match the file name {expected_id}.toml")
    if not SYMBOL.match(document["symbol"]):
        problems.append(f"symbol {document['symbol']!r} is not kebab-case")
    if not _AREA.match(document["area"]):
        problems.append(f"area {document['area']!r} is not kebab-case")
    if document["severity"] not in {item.value for item in Severity}:
        problems.append(f"severity {document['severity']!r} is not one of {[s.value for s in Severity]}")
    if not document.get("fix"):
        problems.append("'fix' needs at least one step")
    if not document.get("sources"):
        problems.append("'sources' needs at least one URL")
    for url in document.get("sources", []):
        if not url.startswith("https://"):
            problems.append(f"source {url!r} is not an https URL")
    problems.extend(_validate_detect(document.get("detect")))
    problems.extend(_validate_evidence(document.get("evidence", [])))
    problems.extend(_validate_signatures(document.get("signatures", []), analyse_signatures))
    for related in document.get("related", []):
        if not REFERENCE_ID.match(related):
            problems.append(f"related {related!r} is not a reference ID")
    return problems


def _validate_detect(detect: Any) -> list[str]:
    """``[detect]``: how a reference is decided. ``modes`` says what preflight does today (``node`` and
    ``config`` only where a check reads that evidence); a reference without a check says why in
    exactly one of ``why_log_only`` (no evidence exists before the job), ``candidate`` (evidence
    exists and a check is still to be written: what it would read) or ``fleet`` (keys of
    ``preflight.fleet.facts.FACTS`` whose comparison across nodes decides it)."""
    if not isinstance(detect, dict):
        return ["'detect' must be a table with 'modes' (and optionally 'checks')"]
    problems = []
    modes = detect.get("modes")
    if not isinstance(modes, list) or not modes or any(mode not in DETECT_MODES for mode in modes):
        problems.append(f"detect.modes must be a non-empty subset of {list(DETECT_MODES)}")
    checks = detect.get("checks", [])
    if not isinstance(checks, list) or any(not isinstance(c, str) or not REFERENCE_ID.match(c) for c in checks):
        problems.append("detect.checks must list check IDs")
    for key in ("why_log_only", "candidate", "tests_only"):
        if key in detect and (not isinstance(detect[key], str) or not detect[key].strip()):
            problems.append(f"detect.{key} must be a non-empty sentence")
    if "tests_only" in detect and not checks:
        problems.append("detect.tests_only says what the checks test: it needs detect.checks")
    fleet = detect.get("fleet", [])
    if not isinstance(fleet, list) or any(not isinstance(key, str) or not _FLEET_KEY.match(key) for key in fleet):
        problems.append("detect.fleet must list fleet fact keys (snake_case)")
    reasons = [key for key in ("why_log_only", "candidate", "fleet") if detect.get(key)]
    if len(reasons) > 1:
        problems.append(f"detect: {' and '.join(reasons)} contradict each other; keep one")
    if checks and "why_log_only" in detect:
        problems.append("detect.why_log_only: a reference that a check decides is not log-only")
    if "why_log_only" in detect and isinstance(modes, list) and set(modes) & {"node", "config"}:
        problems.append("detect.why_log_only: modes may not claim node or config evidence")
    for key in set(detect) - {"modes", "checks", "why_log_only", "candidate", "fleet", "tests_only"}:
        problems.append(f"unknown key detect.{key}")
    return problems


def _validate_evidence(items: Any) -> list[str]:
    if not isinstance(items, list):
        return ["'evidence' must be an array of tables"]
    problems = []
    for number, item in enumerate(items, 1):
        if not isinstance(item, dict) or not isinstance(item.get("what"), str) or not item["what"].strip():
            problems.append(f"evidence #{number} needs 'what'")
            continue
        for key in set(item) - {"what", "command", "check"}:
            problems.append(f"evidence #{number}: unknown key {key!r}")
        if "check" in item and not REFERENCE_ID.match(str(item["check"])):
            problems.append(f"evidence #{number}: check {item['check']!r} is not a check ID")
    return problems


def _validate_signatures(items: Any, analyse: bool = True) -> list[str]:
    if not isinstance(items, list):
        return ["'signatures' must be an array of tables"]
    problems = []
    for number, item in enumerate(items, 1):
        if not isinstance(item, dict) or not isinstance(item.get("pattern"), str):
            problems.append(f"signature #{number} needs 'pattern'")
            continue
        if not analyse:
            if item.get("role") not in ROLES or not isinstance(item.get("examples"), list):
                problems.append(f"signature #{number} needs a role in {list(ROLES)} and a list of examples")
            continue
        try:
            compiled = re.compile(item["pattern"])
        except re.error as error:
            problems.append(f"signature #{number}: pattern does not compile: {error}")
            continue
        examples = item.get("examples")
        if not isinstance(examples, list) or not examples:
            problems.append(f"signature #{number} needs at least one example line")
            continue
        for example in examples:
            if not isinstance(example, str) or not compiled.search(example):
                problems.append(f"signature #{number}: example {example!r} does not match its pattern")
        if item.get("role") not in ROLES:
            problems.append(f"signature #{number}: role must be one of {list(ROLES)}")
        if compiled.flags & re.IGNORECASE or not required_literals(item["pattern"]):
            problems.append(
                f"signature #{number}: needs a case-sensitive literal of at least {MIN_LITERAL} characters"
                " that every match contains (explain scans for it before running the pattern)"
            )
        problems.extend(f"signature #{number}: {problem}" for problem in safety_problems(item["pattern"]))
        if "source" in item and not isinstance(item["source"], str):
            problems.append(f"signature #{number}: 'source' names where the message is printed, as a string")
        if "after_failure" in item and (not isinstance(item["after_failure"], bool) or item.get("role") != "symptom"):
            problems.append(f"signature #{number}: 'after_failure' is true or false, on a symptom signature only")
        for key in set(item) - {"pattern", "examples", "role", "source", "after_failure"}:
            problems.append(f"signature #{number}: unknown key {key!r}")
    return problems
