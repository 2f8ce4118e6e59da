"""Aggregate node reports: findings per reference, and the odd one out per hardware class.

The odd-one-out rule has no expectations of its own. Within a group of comparable nodes (a
hardware class, or for the GPU count the nodes of the same GPU and NIC models), nodes whose value
could not be read are left out; if the most common of the remaining values is held by more nodes
than any other, every node holding another value is flagged, with that common value beside it.
When two or more values share the top count there is no majority to go by: the comparison is a
"tie" and names no node, but still counts as a disagreement.

Where a difference between nodes is itself a catalogued misconfiguration (a fact whose
``decides`` names a reference, e.g. NCCL017 for the NCCL versions), each comparison of that fact
also becomes a :class:`FleetFinding` with the reference's ID, title and severity: ``present`` for
the nodes outside the majority (or, on a tie, for every node with a known value, since the fleet
cannot tell which side is wrong), ``unknown`` when the nodes that could be read agree but some
could not be read (missing is not empty: such a node may be the one that differs), ``absent``
when all agree. A value of ``none`` (no NCCL installed on the host, no RoCE port) is not
compared: the fact does not apply to that node.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from msgspec import Struct
from msgspec.structs import replace

from preflight.catalogue import load_reference
from preflight.exitcodes import ExitCode
from preflight.fleet.facts import FACTS, NONE, UNKNOWN_GPU, Fact, HardwareClass
from preflight.fleet.load import SEVERITY_RANK, NodeReport, Skipped
from preflight.model import Reference, Severity, Status

#: Verdicts of one comparison.
SAME, ODD, TIE, ALONE = "same", "odd", "tie", "alone"
DISAGREEMENTS = (ODD, TIE)


class ValueGroup(Struct, frozen=True):
    value: str
    hosts: tuple[str, ...]


class Expectation(Struct, frozen=True):
    """A present finding on one node that states what the site expects of a compared fact."""

    host: str
    reference_id: str
    observed: str
    expected: str


class Comparison(Struct, frozen=True):
    fact: Fact
    group: str  # the hardware class label, or the family label for family-scoped facts
    verdict: str  # SAME, ODD, TIE or ALONE (fewer than two nodes with a known value)
    common: str | None  # the value most nodes hold; None on a tie or with no known value
    values: tuple[ValueGroup, ...]  # most common first
    odd: tuple[str, ...]  # hosts flagged
    unknown: tuple[str, ...]  # hosts whose value could not be read
    expectations: tuple[Expectation, ...]


class ClassGroup(Struct, frozen=True):
    hardware: HardwareClass
    hosts: tuple[str, ...]


@dataclass(slots=True)  # not frozen: a fleet makes one per node and reference (70,000 for 10,000 nodes),
class NodeMention:     # and a frozen dataclass's __init__ costs 3-4x as much
    host: str
    severity: str
    subjects: tuple[str, ...]
    detail: tuple[str, ...]  # evidence ("observed (expected ...)") for present, reasons for unknown


class ReferenceRow(Struct, frozen=True):
    id: str
    symbol: str
    title: str
    present: tuple[NodeMention, ...]
    unknown: tuple[NodeMention, ...]

    @property
    def worst(self) -> Severity | None:
        severities = {mention.severity for mention in self.present}
        return Severity(max(severities, key=SEVERITY_RANK.__getitem__)) if severities else None


class FleetEvidence(Struct, frozen=True):
    """A node finding's Evidence (source, observed, expected), with the node it was seen on."""

    host: str
    source: str  # the report fields the value was read from
    observed: str
    expected: str


class FleetFinding(Struct, frozen=True):
    """One fleet-decided reference in one group of comparable nodes."""

    id: str
    symbol: str
    title: str
    severity: str
    status: str  # present, absent or unknown
    fact: str
    scope: str
    group: str
    majority: str | None  # None on a tie, or when no node's value could be read
    tie: bool
    nodes: tuple[str, ...]  # the nodes the finding is present on
    unknown_nodes: tuple[str, ...]  # nodes whose value could not be read
    evidence: tuple[FleetEvidence, ...]
    reason: str  # why unknown, or on a tie why no node is singled out


class Fleet(Struct, frozen=True):
    nodes: tuple[NodeReport, ...]
    skipped: tuple[Skipped, ...]
    classes: tuple[ClassGroup, ...]
    references: tuple[ReferenceRow, ...]
    comparisons: tuple[Comparison, ...]
    facts: tuple[Fact, ...]  # what was compared (FACTS less --ignore-fact)
    findings: tuple[FleetFinding, ...] = ()  # fleet-decided references, one per decided comparison

    @property
    def disagreements(self) -> tuple[Comparison, ...]:
        return tuple(c for c in self.comparisons if c.verdict in DISAGREEMENTS)


def _hosts_by_value(members: Sequence[NodeReport], key: str) -> dict[str | None, list[str]]:
    """The members' names by their value of one fact (None: unknown), in the members' order."""
    values = [node.values.get(key) for node in members]
    if len(distinct := set(values)) == 1:  # the common case, at C speed
        return {distinct.pop(): [node.name for node in members]}
    grouped: dict[str | None, list[str]] = {}
    for node, value in zip(members, values):
        hosts = grouped.get(value)
        if hosts is None:
            grouped[value] = [node.name]
        else:
            hosts.append(node.name)
    return grouped


def _verdict(hosts_by_value: dict[str | None, list[str]]) -> tuple[str, str | None, tuple[ValueGroup, ...], tuple[str, ...], tuple[str, ...]]:
    """(verdict, common value, groups, odd hosts, unknown hosts) for hosts grouped by value
    (None: unknown); changes the dict."""
    # sorted() of hosts already in order (the audit passes nodes sorted) is one linear pass
    unknown = tuple(sorted(hosts_by_value.pop(None, ())))
    groups = tuple(sorted(
        (ValueGroup(value, tuple(sorted(hosts))) for value, hosts in hosts_by_value.items() if value is not None),
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


def _expectation_lines(nodes: Sequence[NodeReport]) -> dict[str, list[Expectation]]:
    """node name -> the expectations its present findings state, in name order."""
    return {
        node.name: [Expectation(node.name, ref_id, observed, expected) for ref_id, observed, expected in node.expectations]
        for node in nodes if node.expectations
    }


def compare(ordered: Sequence[NodeReport], facts: Sequence[Fact]) -> tuple[Comparison, ...]:
    """Every fact compared within each group of comparable nodes (``ordered`` by name)."""
    by_class: dict[str, list[NodeReport]] = defaultdict(list)
    by_family: dict[str, list[NodeReport]] = defaultdict(list)
    labels: dict[HardwareClass, tuple[str, str]] = {}  # properties cost a format each: once per class
    for node in ordered:
        names = labels.get(node.hardware)
        if names is None:
            names = labels[node.hardware] = (node.hardware.label, node.hardware.family)
        by_class[names[0]].append(node)
        by_family[names[1]].append(node)
    stated = _expectation_lines(ordered)
    comparisons = []
    for fact in facts:
        groups = by_family if fact.scope == "family" else by_class
        key = fact.key
        for label in sorted(groups):
            members = groups[label]
            verdict, common, values, odd, unknown = _verdict(_hosts_by_value(members, key))
            expectations = tuple(
                e for node in members if node.name in stated for e in stated[node.name] if e.reference_id in fact.references
            ) if fact.references else ()
            comparisons.append(Comparison(fact, label, verdict, common, values, odd, unknown, expectations))
    return tuple(comparisons)


def reference_rows(ordered: Sequence[NodeReport]) -> tuple[ReferenceRow, ...]:
    """Per reference, the nodes that have it present or unknown, in the order of ``ordered``
    (by name; each node's mentions were worked out by the worker that read its report)."""
    mentions: dict[str, tuple[list[NodeMention], list[NodeMention]]] = {}  # id -> (present, unknown)
    titles: dict[str, tuple[str, str]] = {}
    present = Status.PRESENT.value
    for node in ordered:
        for ref_id, status, symbol, title, (severity, subjects, detail) in node.mentions:
            row = mentions.get(ref_id)
            if row is None:
                row = mentions[ref_id] = ([], [])
                titles[ref_id] = (symbol, title)
            row[status != present].append(NodeMention(node.name, severity, subjects, detail))
    return tuple(
        ReferenceRow(ref_id, *titles[ref_id], tuple(mentions[ref_id][0]), tuple(mentions[ref_id][1]))
        for ref_id in sorted(mentions)
    )


def _hosts_text(hosts: Sequence[str], shown: int = 5) -> str:
    return ", ".join(hosts[:shown]) + (f" and {len(hosts) - shown} more" if len(hosts) > shown else "")


def _split_text(groups: Sequence[ValueGroup]) -> str:
    return "; ".join(f"{len(g.hosts)} {'node holds' if len(g.hosts) == 1 else 'nodes hold'} {g.value!r}" for g in groups)


def fleet_finding(comparison: Comparison, reference: Reference) -> FleetFinding | None:
    """The finding a comparison of a fleet-decided fact gives; None where the fact applies to
    fewer than two nodes and none is unknown (nothing to compare)."""
    fact = comparison.fact
    grouped: dict[str | None, list[str]] = {g.value: list(g.hosts) for g in comparison.values if g.value != NONE}
    if comparison.unknown:
        grouped[None] = list(comparison.unknown)
    verdict, common, groups, odd, unknown = _verdict(grouped)
    source = ", ".join(fact.reads)

    def make(status: str, nodes: Sequence[str], evidence: Sequence[FleetEvidence], reason: str = "") -> FleetFinding:
        return FleetFinding(
            reference.id, reference.symbol, reference.title, reference.severity.value, status, fact.key, fact.scope,
            comparison.group, common, verdict == TIE, tuple(nodes), unknown, tuple(evidence), reason,
        )

    if verdict == ODD:
        value_of = {host: g.value for g in groups[1:] for host in g.hosts}
        return make("present", odd, [FleetEvidence(host, source, value_of[host], common or "") for host in odd])
    if verdict == TIE:
        hosts = sorted(host for g in groups for host in g.hosts)
        value_of = {host: g.value for g in groups for host in g.hosts}
        expected = "one value on every node of the group"
        return make("present", hosts, [FleetEvidence(host, source, value_of[host], expected) for host in hosts],
                    f"no majority ({_split_text(groups)}): the fleet cannot tell which side differs, so every side is named")
    if unknown:
        known = [host for g in groups for host in g.hosts]
        if len(known) > 1:
            agreed = f"the {len(known)} others agree on {common!r}"
        elif known:
            agreed = f"only {known[0]} has a value ({common!r}), with nothing to compare it to"
        else:
            agreed = "no node's value could be read"
        return make("unknown", (), (), f"{fact.label} could not be read on {_hosts_text(unknown)}; {agreed}")
    if verdict == SAME:
        return make("absent", (), ())
    return None  # ALONE with nothing unknown: a single node, or the fact applies to none


def fleet_findings(comparisons: Sequence[Comparison]) -> tuple[FleetFinding, ...]:
    references: dict[str, Reference] = {}
    findings = []
    for comparison in comparisons:
        ref_id = comparison.fact.decides
        if not ref_id:
            continue
        reference = references.get(ref_id)
        if reference is None:
            reference = references[ref_id] = load_reference(ref_id)
        finding = fleet_finding(comparison, reference)
        if finding is not None:
            findings.append(finding)
    return tuple(findings)


def _rehomed(nodes: Sequence[NodeReport]) -> list[NodeReport]:
    """Nodes whose NVML named no GPU (a driver upgraded without a reboot: NVML's library/driver
    version mismatch) put in the one class of their NIC model and GPU count on the PCI bus, where
    there is exactly one: compared with no node, every other drift on them would go unseen. The
    node's own report says why NVML failed (GPU001)."""
    known = {node.hardware for node in nodes if node.hardware.gpu_model not in (UNKNOWN_GPU, "no GPU")}
    moved = []
    for node in nodes:
        if node.hardware.gpu_model == UNKNOWN_GPU:
            alike = [hardware for hardware in known if (hardware.gpu_count, hardware.nic_model) == (node.hardware.gpu_count, node.hardware.nic_model)]
            if len(alike) == 1:
                node = replace(node, hardware=alike[0])
        moved.append(node)
    return moved


def build_fleet(nodes: Sequence[NodeReport], skipped: Sequence[Skipped], ignore_facts: Sequence[str] = ()) -> Fleet:
    facts = tuple(fact for fact in FACTS if fact.key not in ignore_facts)
    nodes = _rehomed(nodes)
    members: dict[HardwareClass, list[str]] = defaultdict(list)
    for node in nodes:
        members[node.hardware].append(node.name)
    classes = tuple(sorted(
        (ClassGroup(hardware, tuple(sorted(hosts))) for hardware, hosts in members.items()),
        key=lambda group: (-len(group.hosts), group.hardware.label),
    ))
    ordered = tuple(sorted(nodes, key=lambda node: node.name))
    comparisons = compare(ordered, facts)
    return Fleet(
        nodes=ordered,
        skipped=tuple(skipped),
        classes=classes,
        references=reference_rows(ordered),
        comparisons=comparisons,
        facts=facts,
        findings=fleet_findings(comparisons),
    )


def fleet_exit_code(fleet: Fleet) -> ExitCode:
    """3 no report could be read; 2 an error or critical finding present on some node, in the
    fleet findings or in a second report for a node, or a disagreement (odd one out or tie); 1 a
    warning present on some node or in the fleet findings, or a file skipped; 0 otherwise. Unknown findings do not count, as for
    ``preflight node``."""
    if not fleet.nodes:
        return ExitCode.NO_VERDICT
    ranks = [row.worst.rank for row in fleet.references if row.worst is not None]
    ranks += [Severity(f.severity).rank for f in fleet.findings if f.status == Status.PRESENT.value]
    # a second report for a node, left out of the comparison, still counts with what it found
    ranks += [SEVERITY_RANK.get(s.duplicate_worst, 0) for s in fleet.skipped if s.duplicate_worst]
    if fleet.disagreements or any(rank >= Severity.ERROR.rank for rank in ranks):
        return ExitCode.ERROR
    if fleet.skipped or any(rank >= Severity.WARNING.rank for rank in ranks):
        return ExitCode.WARNING
    return ExitCode.OK
