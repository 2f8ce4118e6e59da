"""Aggregate node reports: findings per reference, and the odd one out per hardware class.

The odd-one-out rule has no expectations of its own. Within a group of comparable nodes (a
hardware class, or for the GPU count the nodes of the same GPU and NIC models), nodes whose value
could not be read are left out; if the most common of the remaining values is held by more nodes
than any other, every node holding another value is flagged, with that common value beside it.
When two or more values share the top count there is no majority to go by: the comparison is a
"tie" and names no node, but still counts as a disagreement.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from preflight.exitcodes import ExitCode
from preflight.fleet.facts import FACTS, Fact, HardwareClass
from preflight.fleet.load import NodeFinding, NodeReport, Skipped
from preflight.model import Severity, Status

#: Verdicts of one comparison.
SAME, ODD, TIE, ALONE = "same", "odd", "tie", "alone"
DISAGREEMENTS = (ODD, TIE)
#: Severity value -> rank, without building an enum member per finding.
_RANK = {severity.value: severity.rank for severity in Severity}


@dataclass(frozen=True)
class ValueGroup:
    value: str
    hosts: tuple[str, ...]


@dataclass(frozen=True)
class Expectation:
    """A present finding on one node that states what the site expects of a compared fact."""

    host: str
    reference_id: str
    observed: str
    expected: str


@dataclass(frozen=True)
class Comparison:
    fact: Fact
    group: str  # the hardware class label, or the family label for family-scoped facts
    verdict: str  # SAME, ODD, TIE or ALONE (fewer than two nodes with a known value)
    common: str | None  # the value most nodes hold; None on a tie or with no known value
    values: tuple[ValueGroup, ...]  # most common first
    odd: tuple[str, ...]  # hosts flagged
    unknown: tuple[str, ...]  # hosts whose value could not be read
    expectations: tuple[Expectation, ...]


@dataclass(frozen=True)
class ClassGroup:
    hardware: HardwareClass
    hosts: tuple[str, ...]


@dataclass(frozen=True)
class NodeMention:
    host: str
    severity: str
    subjects: tuple[str, ...]
    detail: tuple[str, ...]  # evidence ("observed (expected ...)") for present, reasons for unknown


@dataclass(frozen=True)
class ReferenceRow:
    id: str
    symbol: str
    title: str
    present: tuple[NodeMention, ...]
    unknown: tuple[NodeMention, ...]

    @property
    def worst(self) -> Severity | None:
        severities = {mention.severity for mention in self.present}
        return Severity(max(severities, key=_RANK.__getitem__)) if severities else None


@dataclass(frozen=True)
class Fleet:
    nodes: tuple[NodeReport, ...]
    skipped: tuple[Skipped, ...]
    classes: tuple[ClassGroup, ...]
    references: tuple[ReferenceRow, ...]
    comparisons: tuple[Comparison, ...]
    facts: tuple[Fact, ...]  # what was compared (FACTS less --ignore-fact)

    @property
    def disagreements(self) -> tuple[Comparison, ...]:
        return tuple(c for c in self.comparisons if c.verdict in DISAGREEMENTS)


def compare_values(values: dict[str, str | None]) -> tuple[str, str | None, tuple[ValueGroup, ...], tuple[str, ...], tuple[str, ...]]:
    """(verdict, common value, groups, odd hosts, unknown hosts) for host -> value."""
    unknown = tuple(sorted(host for host, value in values.items() if value is None))
    hosts_by_value: dict[str, list[str]] = defaultdict(list)
    for host, value in values.items():
        if value is not None:
            hosts_by_value[value].append(host)
    groups = tuple(sorted(
        (ValueGroup(value, tuple(sorted(hosts))) for value, hosts in hosts_by_value.items()),
        key=lambda group: (-len(group.hosts), group.value),
    ))
    known = sum(len(group.hosts) for group in groups)
    if known < 2:
        return ALONE, groups[0].value if groups else None, groups, (), unknown
    if len(groups) == 1:
        return SAME, groups[0].value, groups, (), unknown
    if len(groups[0].hosts) == len(groups[1].hosts):
        return TIE, None, groups, (), unknown
    odd = tuple(sorted(host for group in groups[1:] for host in group.hosts))
    return ODD, groups[0].value, groups, odd, unknown


def _expectations(fact: Fact, nodes: Sequence[NodeReport]) -> tuple[Expectation, ...]:
    if not fact.references:
        return ()
    found = []
    for node in nodes:
        for finding in node.findings:
            if finding.id in fact.references and finding.status == Status.PRESENT.value:
                for line in finding.evidence:
                    if line.expected:
                        found.append(Expectation(node.host, finding.id, line.observed, line.expected))
    return tuple(found)


def compare(nodes: Sequence[NodeReport], facts: Sequence[Fact]) -> tuple[Comparison, ...]:
    by_class: dict[str, list[NodeReport]] = defaultdict(list)
    by_family: dict[str, list[NodeReport]] = defaultdict(list)
    for node in nodes:
        by_class[node.hardware.label].append(node)
        by_family[node.hardware.family].append(node)
    comparisons = []
    for fact in facts:
        groups = by_family if fact.scope == "family" else by_class
        for label in sorted(groups):
            members = groups[label]
            verdict, common, values, odd, unknown = compare_values({node.host: node.values.get(fact.key) for node in members})
            comparisons.append(Comparison(fact, label, verdict, common, values, odd, unknown, _expectations(fact, members)))
    return tuple(comparisons)


def _mention(host: str, findings: list[NodeFinding], known: dict[tuple[int, ...], NodeMention]) -> NodeMention:
    """What one node shows for one reference. Nodes of a fleet mostly repeat the same findings
    (the same objects, as the workers intern them): the parts that do not depend on the host are
    worked out once per distinct set of findings."""
    key = tuple(map(id, findings))  # the findings are held by their nodes, so ids stay unique
    same = known.get(key)
    if same is not None:
        return NodeMention(host, same.severity, same.subjects, same.detail)
    worst = max((f.severity for f in findings), key=_RANK.__getitem__)
    detail = []
    for finding in findings:
        if finding.status == Status.UNKNOWN.value:
            detail.append(finding.reason or "no reason given")
        else:
            detail.extend(
                line.observed + (f" (expected {line.expected})" if line.expected else "") for line in finding.evidence[:2]
            )
    subjects = tuple(dict.fromkeys(f.subject for f in findings))
    mention = NodeMention(host, worst, subjects, tuple(dict.fromkeys(detail))[:5])
    known[key] = mention
    return mention


def reference_rows(nodes: Sequence[NodeReport]) -> tuple[ReferenceRow, ...]:
    found: dict[str, dict[str, dict[str, list[NodeFinding]]]] = defaultdict(lambda: {"present": {}, "unknown": {}})
    titles: dict[str, tuple[str, str]] = {}
    for node in nodes:
        for finding in node.findings:
            titles.setdefault(finding.id, (finding.symbol, finding.title))
            found[finding.id][finding.status].setdefault(node.host, []).append(finding)
    rows = []
    known: dict[tuple[int, ...], NodeMention] = {}
    for ref_id in sorted(found):
        symbol, title = titles[ref_id]
        present = tuple(_mention(host, items, known) for host, items in sorted(found[ref_id]["present"].items()))
        unknown = tuple(_mention(host, items, known) for host, items in sorted(found[ref_id]["unknown"].items()))
        rows.append(ReferenceRow(ref_id, symbol, title, present, unknown))
    return tuple(rows)


def build_fleet(nodes: Sequence[NodeReport], skipped: Sequence[Skipped], ignore_facts: Sequence[str] = ()) -> Fleet:
    facts = tuple(fact for fact in FACTS if fact.key not in ignore_facts)
    members: dict[HardwareClass, list[str]] = defaultdict(list)
    for node in nodes:
        members[node.hardware].append(node.host)
    classes = tuple(sorted(
        (ClassGroup(hardware, tuple(sorted(hosts))) for hardware, hosts in members.items()),
        key=lambda group: (-len(group.hosts), group.hardware.label),
    ))
    return Fleet(
        nodes=tuple(sorted(nodes, key=lambda node: node.host)),
        skipped=tuple(skipped),
        classes=classes,
        references=reference_rows(nodes),
        comparisons=compare(nodes, facts),
        facts=facts,
    )


def fleet_exit_code(fleet: Fleet) -> ExitCode:
    """3 no report could be read; 2 an error or critical finding present on some node, or a
    disagreement (odd one out or tie); 1 a warning present on some node, or a file skipped;
    0 otherwise. Unknown findings do not count, as for ``preflight node``."""
    if not fleet.nodes:
        return ExitCode.NO_VERDICT
    ranks = [row.worst.rank for row in fleet.references if row.worst is not None]
    if fleet.disagreements or any(rank >= Severity.ERROR.rank for rank in ranks):
        return ExitCode.ERROR
    if fleet.skipped or any(rank >= Severity.WARNING.rank for rank in ranks):
        return ExitCode.WARNING
    return ExitCode.OK
