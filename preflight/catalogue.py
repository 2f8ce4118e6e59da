"""The reference catalogue: one TOML file per reference in ``references/`` (shipped inside the
wheel as ``preflight/references``), named ``<ID>.toml``.

Files are parsed lazily, one at a time, because the prolog needs only the references of the
checks it runs. ``validate_document`` is the schema: the loader and the tests use the same code.
"""

from __future__ import annotations

import json
import os
import re
import sys
from functools import lru_cache
from typing import Any

from preflight.model import REFERENCE_ID, SYMBOL, Reference, Severity
from preflight.signatures import MIN_LITERAL, ROLES, required_literals, safety_problems
from preflight.tomlcompat import TomlError, parse_toml

DETECT_MODES = ("node", "config", "runtime")
_REQUIRED_STRINGS = ("id", "symbol", "title", "area", "severity", "summary")
_STRING_LISTS = ("causes", "fix", "related", "sources", "old_ids")
_KNOWN_KEYS = frozenset((*_REQUIRED_STRINGS, *_STRING_LISTS, "detect", "evidence", "signatures"))
_AREA = re.compile(r"^[a-z][a-z0-9-]*$")


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


INDEX_NAME = "index.json"
INDEX_FORMAT = "preflight-catalogue-index/1"


@lru_cache(maxsize=1)
def _packaged_index() -> dict[str, Any]:
    """The packaged catalogue as one JSON document (``references/index.json``).

    Parsing ~30 TOML files costs ~45 ms, a third of a prolog run; one JSON file costs a few.
    The TOML files stay the source: ``python -m preflight.catalogue references`` rewrites the
    index and a test fails when it is stale. A missing or unreadable index falls back to TOML."""
    try:
        with open(os.path.join(catalogue_dir(), INDEX_NAME), encoding="utf-8") as handle:
            index = json.load(handle)
    except (OSError, ValueError):
        return {}
    if not isinstance(index, dict) or index.get("format") != INDEX_FORMAT or not isinstance(index.get("references"), dict):
        return {}
    return dict(index["references"])


def _read_document(ref_id: str, directory: str | None) -> tuple[dict[str, Any], str]:
    path = os.path.join(directory or catalogue_dir(), f"{ref_id}.toml")
    if directory is None:
        document = _packaged_index().get(ref_id)
        if isinstance(document, dict):
            return document, path
    try:
        with open(path, encoding="utf-8") as handle:
            return parse_toml(handle.read()), path
    except FileNotFoundError:
        raise CatalogueError(f"no reference {ref_id} ({path} is missing)") from None
    except (OSError, UnicodeDecodeError, TomlError) as error:
        raise CatalogueError(f"{path}: {error}") from None


def build_index(directory: str) -> dict[str, Any]:
    """The index document for the TOML files in ``directory``."""
    references = {}
    for ref_id in reference_ids(directory):
        with open(os.path.join(directory, f"{ref_id}.toml"), encoding="utf-8") as handle:
            references[ref_id] = parse_toml(handle.read())
    return {"format": INDEX_FORMAT, "references": references}


@lru_cache(maxsize=None)
def load_reference(ref_id: str, directory: str | None = None) -> Reference:
    """Parse and validate ``<ID>.toml`` (from the packaged index when it has it)."""
    document, path = _read_document(ref_id, directory)
    problems = validate_document(document, expected_id=ref_id, analyse_signatures=False)
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
        causes=tuple(document.get("causes", [])),
        evidence=tuple(document.get("evidence", [])),
        related=tuple(document.get("related", [])),
        signatures=tuple(document.get("signatures", [])),
        sources=tuple(document.get("sources", [])),
        old_ids=tuple(document.get("old_ids", [])),
    )


def load_all(directory: str | None = None) -> list[Reference]:
    return [load_reference(ref_id, directory) for ref_id in reference_ids(directory)]


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
    if not isinstance(detect, dict):
        return ["'detect' must be a table with 'modes' (and optionally 'checks')"]
    problems = []
    modes = detect.get("modes")
    if not isinstance(modes, list) or not modes or any(mode not in DETECT_MODES for mode in modes):
        problems.append(f"detect.modes must be a non-empty subset of {list(DETECT_MODES)}")
    checks = detect.get("checks", [])
    if not isinstance(checks, list) or any(not isinstance(c, str) or not REFERENCE_ID.match(c) for c in checks):
        problems.append("detect.checks must list check IDs")
    for key in set(detect) - {"modes", "checks"}:
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
        for key in set(item) - {"pattern", "examples", "role", "source"}:
            problems.append(f"signature #{number}: unknown key {key!r}")
    return problems


if __name__ == "__main__":  # python -m preflight.catalogue references  (rewrites references/index.json)
    folder = sys.argv[1] if len(sys.argv) > 1 else "references"
    with open(os.path.join(folder, INDEX_NAME), "w", encoding="utf-8") as out:
        json.dump(build_index(folder), out, indent=0, sort_keys=True, ensure_ascii=False)
        out.write("\n")
