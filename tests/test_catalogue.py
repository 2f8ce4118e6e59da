"""The catalogue is consistent: every file validates, IDs and symbols are unique, links resolve,
and every check's reference says which check decides it."""

from __future__ import annotations

from pathlib import Path

from preflight.catalogue import load_all, validate_document
from preflight.discovery import build_registry
from preflight.tomlcompat import loads

REFERENCES = Path(__file__).resolve().parent.parent / "references"


def test_every_reference_file_validates() -> None:
    files = sorted(REFERENCES.glob("*.toml"))
    assert files
    for path in files:
        assert validate_document(loads(path.read_text()), expected_id=path.stem) == [], path.name


def test_ids_symbols_unique_and_links_resolve() -> None:
    references = load_all()
    ids = [r.id for r in references]
    symbols = [r.symbol for r in references]
    assert len(set(ids)) == len(ids) and len(set(symbols)) == len(symbols)
    for reference in references:
        assert set(reference.related) <= set(ids), reference.id
        assert reference.id not in reference.related


def test_checks_and_references_point_at_each_other() -> None:
    registry = build_registry()
    by_id = {r.id: r for r in load_all()}
    for ref_id in registry.checks:
        assert ref_id in by_id[ref_id].checks, f"{ref_id}.toml does not list its own check in detect.checks"
    for reference in by_id.values():
        assert set(reference.checks) <= set(registry.checks), reference.id


def test_validation_reports_schema_breaks() -> None:
    document = loads((REFERENCES / "MEM001.toml").read_text())
    broken = {**document, "severity": "fatal", "surprise": 1, "signatures": [{"pattern": "a(", "examples": ["a"]}]}
    problems = validate_document(broken, expected_id="MEM002")
    assert any("severity" in p for p in problems) and any("surprise" in p for p in problems)
    broken = {**document, "signatures": [{"pattern": "abc", "examples": ["xyz"]}]}
    assert any("does not match" in p for p in validate_document(broken))
