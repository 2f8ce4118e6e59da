"""The catalogue is consistent: every file validates, IDs and symbols are unique, links resolve,
and every check's reference says which check decides it."""

from __future__ import annotations

import json
from pathlib import Path

from preflight.catalogue import load_all, validate_document
from preflight.discovery import build_registry
from preflight.tomlcompat import parse_toml

REFERENCES = Path(__file__).resolve().parents[2] / "references"


def test_every_reference_file_validates() -> None:
    files = sorted(REFERENCES.glob("*.toml"))
    assert files
    for path in files:
        assert validate_document(parse_toml(path.read_text()), expected_id=path.stem) == [], path.name


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


def test_every_reference_says_how_it_is_decided() -> None:
    """A check, a fleet comparison, a reason why only logs show it, or the evidence a check still
    to be written would read: a reference with none of these makes no honest claim. And modes
    claim node or config evidence only where a check reads it."""
    from preflight.fleet.facts import FACTS

    registry = build_registry(plugins=False)
    fleet_keys = {fact.key for fact in FACTS}
    undecided, claims_without_check, unknown_fleet = [], [], []
    for reference in load_all():
        checked = reference.id in registry.checks or bool(reference.checks)
        if not (checked or reference.fleet or reference.why_log_only or reference.candidate):
            undecided.append(reference.id)
        if set(reference.detect) & {"node", "config"} and not checked:
            claims_without_check.append(reference.id)
        unknown_fleet += [f"{reference.id}: {key}" for key in reference.fleet if key not in fleet_keys]
    assert not undecided, f"neither a check, fleet, why_log_only nor candidate in [detect]: {undecided}"
    assert not claims_without_check, f"detect.modes claims node/config evidence but no check reads it: {claims_without_check}"
    assert not unknown_fleet, f"detect.fleet names facts preflight fleet does not compare: {unknown_fleet}"


def test_fleet_decided_facts_and_detect_fleet_name_each_other() -> None:
    """A fact whose disagreement is a fleet finding names its reference (``Fact.decides``), and
    that reference's [detect] fleet names the fact: the two records of one mapping agree."""
    from preflight.fleet.facts import FACTS

    by_facts = {(fact.decides, fact.key) for fact in FACTS if fact.decides}
    by_catalogue = {(reference.id, key) for reference in load_all() for key in reference.fleet}
    assert by_facts == by_catalogue
    assert {"NCCL017", "ROCE006"} <= {ref_id for ref_id, _ in by_facts}


# References whose node checks test every node-side cause they list, so a clean node refutes them
# under `explain --check`; every other reference with checks says what they test (tests_only).
# GPU001 left the list: a host-side check cannot see a container's device rules lost to a
# daemon-reload on a healthy host, one of its causes.
CHECKS_TEST_EVERY_CAUSE = {"GDR001", "NCCL013", "NVL002", "NVL005", "PCI001", "ROCE004"}


def test_a_reference_with_checks_says_whether_they_test_every_cause() -> None:
    """A clean check refutes a candidate only where it tests every listed cause (GPU002's GPU
    health check says nothing of a driver older than the runtime); the others name what they test."""
    undeclared = [
        reference.id for reference in load_all()
        if reference.checks and not reference.tests_only and reference.id not in CHECKS_TEST_EVERY_CAUSE
    ]
    assert not undeclared, f"checks that test only some causes must say which in [detect] tests_only: {undeclared}"
    assert all(not reference.tests_only for reference in load_all() if reference.id in CHECKS_TEST_EVERY_CAUSE)


def test_detect_schema_refuses_dishonest_or_contradicting_decisions() -> None:
    document = parse_toml((REFERENCES / "NCCL009.toml").read_text())
    detect = document["detect"]
    assert detect["why_log_only"] and validate_document(document) == []

    def problems(**changes: object) -> list[str]:
        return validate_document({**document, "detect": {**detect, **changes}})

    assert any("why_log_only" in p and "node or config" in p for p in problems(modes=["config", "runtime"]))
    assert any("not log-only" in p for p in problems(checks=["NCCL009"]))
    assert any("non-empty sentence" in p for p in problems(why_log_only="  "))
    assert any("contradict" in p for p in problems(candidate="NCCL_ALGO in the job environment."))
    fleet_only = {key: value for key, value in detect.items() if key != "why_log_only"}
    assert any("fleet fact keys" in p for p in validate_document({**document, "detect": {**fleet_only, "fleet": ["NCCL Libraries"]}}))
    assert any("unknown key detect.reason" in p for p in problems(reason="x"))
    assert any("needs detect.checks" in p for p in problems(tests_only="the GID table"))


def test_validation_reports_schema_breaks() -> None:
    document = parse_toml((REFERENCES / "MEM001.toml").read_text())
    broken = {**document, "severity": "fatal", "surprise": 1, "signatures": [{"pattern": "a(", "examples": ["a"]}]}
    problems = validate_document(broken, expected_id="MEM002")
    assert any("severity" in p for p in problems) and any("surprise" in p for p in problems)
    broken = {**document, "signatures": [{"pattern": "abc", "examples": ["xyz"]}]}
    assert any("does not match" in p for p in validate_document(broken))
    teardown = {"pattern": "taking the process down", "examples": ["taking the process down"], "role": "symptom", "after_failure": True}
    assert validate_document({**document, "signatures": [teardown]}) == []
    for wrong in ({"after_failure": "yes"}, {"role": "cause"}):
        problems = validate_document({**document, "signatures": [{**teardown, **wrong}]})
        assert any("'after_failure' is true or false, on a symptom signature only" in p for p in problems), wrong


SEED_TITLES = (Path(__file__).resolve().parents[1] / "data" / "seed-titles.txt").read_text().splitlines()


def test_every_seed_title_has_exactly_one_reference_with_that_title() -> None:
    titles = [r.title for r in load_all()]
    assert len(SEED_TITLES) == 90
    missing = [t for t in SEED_TITLES if t not in titles]
    assert not missing, missing
    assert sorted(titles) == sorted(SEED_TITLES)


def test_overlapping_references_link_each_other() -> None:
    by_id = {r.id: r for r in load_all()}
    for reference in by_id.values():
        for other in reference.related:
            assert reference.id in by_id[other].related, f"{reference.id} links {other}, but not back"
    for first, second in (("NCCL016", "NCCL017"), ("NCCL003", "NCCL004"), ("IB006", "ROCE006"), ("NCCL007", "NCCL008")):
        # overlapping titles say in their summaries how they differ from each other
        assert second in by_id[first].summary and first in by_id[second].summary, (first, second)


def test_references_cite_sources_and_name_no_other_product() -> None:
    for path in sorted(REFERENCES.glob("*.toml")):
        text = path.read_text()
        assert "denpex" not in text.lower(), path.name
        document = parse_toml(text)
        assert len(document["sources"]) >= 2, path.name
        assert document["signatures"], f"{path.name} has no log signature for explain"


def test_a_signature_source_that_names_a_coverage_table_names_one_that_exists() -> None:
    """``source`` says where a message is printed; a coverage table it names must be in the repo."""
    missing = []
    for path in sorted(REFERENCES.glob("*.toml")):
        for number, signature in enumerate(parse_toml(path.read_text())["signatures"], 1):
            source = signature.get("source", "")
            if source.startswith("references/coverage/") and not (REFERENCES.parent / source).is_file():
                missing.append(f"{path.stem} signature #{number}: {source}")
    assert not missing, missing


def test_every_signature_is_linear_on_adversarial_lines() -> None:
    """Built from each pattern's own examples and literals: near misses, repeats, long runs."""
    import re
    import time

    from preflight.signatures import required_literals, safety_problems

    slow = []
    for reference in load_all():
        for number, item in enumerate(reference.signatures, 1):
            pattern = re.compile(item["pattern"])
            assert safety_problems(item["pattern"]) == [], (reference.id, number)
            literals = required_literals(item["pattern"])
            inputs = ["a" * 20000, " " * 20000, "0" * 20000, ":" * 20000]
            for example in item["examples"]:
                middle = len(example) // 2
                inputs += [(example[:-1] + " ") * (20000 // len(example)), example[:middle] + example[middle - 5 : middle] * 3000]
            inputs += [(literal + " x") * (20000 // (len(literal) + 2)) for literal in literals]
            for text in inputs:
                # This thread's CPU time, not wall-clock time: another process on the machine
                # does not inflate it. A linear search of 20 kB takes well under a millisecond;
                # backtracking blow-ups take seconds. bench/deadlines.py prints the wall times.
                begin = time.thread_time()
                pattern.search(text)
                if time.thread_time() - begin > 0.05:
                    slow.append(f"{reference.id} signature #{number}")
    assert not slow, slow


def test_an_index_entry_serves_only_while_its_file_is_unchanged(tmp_path: Path) -> None:
    """references/index.json is a build product that nobody regenerates by hand: an entry is
    used while its TOML file has the bytes it was built from, and the file wins afterwards."""
    from preflight.catalogue import load_reference
    from preflight.catalogue_index import INDEX_NAME, write_index

    def catalogue_with_index(name: str) -> Path:
        folder = tmp_path / name
        folder.mkdir()
        (folder / "MEM001.toml").write_bytes((REFERENCES / "MEM001.toml").read_bytes())
        write_index(str(folder), str(folder))
        index = json.loads((folder / INDEX_NAME).read_text())
        index["references"]["MEM001"]["document"]["title"] = "Title from the index"
        (folder / INDEX_NAME).write_text(json.dumps(index))
        return folder

    fresh = catalogue_with_index("fresh")
    assert load_reference("MEM001", str(fresh)).title == "Title from the index"
    edited = catalogue_with_index("edited")
    toml = (edited / "MEM001.toml").read_text()
    (edited / "MEM001.toml").write_text(toml.replace('title = "', 'title = "Edited: ', 1))
    assert load_reference("MEM001", str(edited)).title.startswith("Edited: ")
    missing = catalogue_with_index("missing")
    (missing / INDEX_NAME).unlink()
    assert load_reference("MEM001", str(missing)).title == parse_toml(toml)["title"]


def test_the_index_holds_every_reference_as_parsed(tmp_path: Path) -> None:
    from preflight.catalogue_index import build_index, digest

    index = build_index(str(REFERENCES))
    files = sorted(REFERENCES.glob("*.toml"))
    assert sorted(index["references"]) == [path.stem for path in files]
    for path in files:
        entry = index["references"][path.stem]
        assert entry == {"digest": digest(path.read_bytes()), "document": parse_toml(path.read_text())}
    assert digest(b"a") != digest(b"b") and digest(b"ab") != digest(b"abc")
