"""The fleet's fast decoder reads only the parts of a report the audit uses, and decodes findings
straight into checked objects (``preflight/fleet/shape.py``). It must never change a verdict: for
every recorded node's report, and for hundreds of mutated ones, the audit of the fast decode
equals the audit of the careful path (the standard parser and load.py's own checks), or both
refuse the file with the same words."""

from __future__ import annotations

import copy
import json
import random
import typing
from pathlib import Path
from typing import Any

import pytest

from conftest import EXAMPLE_ROOT, REPO
from preflight.cli.node import NODE, run_node
from preflight.cli.spec import values_for
from preflight.fleet.facts import FactsView
from preflight.fleet import load
from preflight.fleet.shape import NodeFinding
from preflight.model import Severity, Status

FIXTURES = REPO / "tests" / "fixtures" / "nodes"
ROOTS = [EXAMPLE_ROOT, *sorted(path for path in FIXTURES.iterdir() if path.is_dir())]
GOLDEN = (REPO / "tests" / "golden" / "hgx-h100.json").read_bytes()


def both_ways(data: bytes, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Any]:
    """(fast, careful): each a NodeReport or the ReportError message."""
    def audit() -> Any:
        try:
            return load.report_from_bytes(data, "r.json")
        except load.ReportError as error:
            return str(error)

    fast = audit()
    with monkeypatch.context() as patch:
        patch.setattr(load, "_FAST_PARTS", None)
        patch.setattr(load, "_FAST_LOADS", None)
        careful = audit()
    return fast, careful


def test_the_decoder_knows_every_status_and_severity() -> None:
    fields = typing.get_type_hints(NodeFinding)
    assert set(fields["status"].__args__) == {status.value for status in Status}
    assert set(fields["severity"].__args__) == {severity.value for severity in Severity}


@pytest.mark.parametrize("root", ROOTS, ids=lambda path: path.name)
def test_every_recorded_node_is_audited_alike_both_ways(root: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    code = run_node(values_for(NODE, root=str(root), output_format="json"))
    data = capsys.readouterr().out.encode()
    assert code in (0, 1, 2)
    fast_parts = load.parse_report(data)
    assert all(type(item) is NodeFinding for item in fast_parts["findings"])  # the fast path ran
    assert isinstance(fast_parts["facts"], FactsView)  # ... and decoded the facts into the probes' types
    fast, careful = both_ways(data, monkeypatch)
    assert not isinstance(fast, str), fast
    assert fast == careful


# -- mutations ---------------------------------------------------------------------------------

REPLACEMENTS: list[Any] = [
    None, 0, -1, 7, 2**70, 1.5, True, False, "", "x", "MEM001", "present", "unknown", "error", "x" * 3000,
    [], [1, "a"], [{}], [{"name": "mlx5_9"}], {}, {"k": []}, {"index": "0"}, [[[[[]]]]],
]


def paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    found = [prefix] if prefix else []
    if isinstance(value, dict):
        for key, item in value.items():
            found.extend(paths(item, (*prefix, key)))
    elif isinstance(value, list):
        for index, item in enumerate(value[:12]):  # enough of each list to reach every shape
            found.extend(paths(item, (*prefix, index)))
    return found


def mutated(document: dict[str, Any], rng: random.Random, every: list[tuple[Any, ...]]) -> dict[str, Any]:
    changed = copy.deepcopy(document)
    for _ in range(rng.choice((1, 1, 2, 3))):
        path = rng.choice(every)
        parent = changed
        try:
            for step in path[:-1]:
                parent = parent[step]
            if isinstance(parent, dict) and rng.random() < 0.2:
                parent.pop(path[-1], None)
            else:
                parent[path[-1]] = copy.deepcopy(rng.choice(REPLACEMENTS))
        except (KeyError, IndexError, TypeError):  # an earlier change removed the way there
            continue
    return changed


@pytest.mark.parametrize("seed", range(8))
def test_mutated_reports_are_audited_alike_both_ways(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(seed)
    document = json.loads(GOLDEN)
    every = paths(document)
    outcomes = {"audited": 0, "refused": 0}
    # 90 mutations each, and more until one is refused: how many paths the audit reads, and so
    # how often a mutation hits one, moves with every field the golden report gains.
    for attempt in range(400):
        if attempt >= 90 and outcomes["refused"]:
            break
        data = json.dumps(mutated(document, rng, every)).encode()
        fast, careful = both_ways(data, monkeypatch)
        assert fast == careful, data[:300]
        outcomes["refused" if isinstance(fast, str) else "audited"] += 1
    assert outcomes["audited"] >= 20 and outcomes["refused"] >= 1, outcomes


def test_a_huge_number_where_the_audit_never_reads_does_not_refuse_the_report(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fast decoder skips what the audit does not read without converting it, so a number
    past Python's 4,300-digit limit in an unread fact is no reason to drop the node. (Where the
    audit reads, the standard parser still refuses it: test_fleet_untrusted.)"""
    document = json.loads(GOLDEN)
    document["facts"]["bar1"] = {"total": 0}
    data = json.dumps(document).encode().replace(b'"total": 0', b'"total": ' + b"9" * 5000)
    fast, careful = both_ways(data, monkeypatch)
    assert not isinstance(fast, str) and fast.host == "gpu017"
    assert isinstance(careful, str) and "not JSON" in careful
