"""Turn signature hits into ranked candidates and a cascade timeline.

Ranking follows how failures propagate in a collective job. A line that names a specific
cause (``vendor err 129``, ``ibv_reg_mr`` ENOMEM, ``Network is unreachable``) is what an
operator must act on; the watchdog timeouts, ``ncclRemoteError`` and closed connections that
every other rank prints afterwards are symptoms of it. So candidates are ordered by tier:

1. ``cause``   - at least one cause signature matched;
2. ``context`` - a configuration line tied to the reference (NCCL bound to ``docker0``, GPU
   Direct RDMA disabled) appeared in a log that also shows a failure;
3. ``symptom`` - only generic downstream signatures matched;

then by a score: the specificity of the best signature matched in that tier (its literal
characters, digits counted twice, so ``vendor err 129 ... localGid fe80:`` beats ``vendor err
129``) shared out among the references matching the same line, half the worth of each further
signature, and a bonus when the reference is on the
first line of the first actor (host or rank) to fail. Equal scores go to the reference that
fewer of the other candidates list as related (a hub such as the cascade or a generic timeout
is a symptom of the others), then to the earliest first hit. Never to the alphabet.

Memory stays bounded: each reference keeps a few example lines and counters, and the cascade
keeps one first failure per actor, up to ``MAX_ACTORS`` actors.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field

from preflight.explain.combinations import NCCL_TESTS_TABLE, NO_VERBS, OBSERVATION, Derived, Observations, Sighting
from preflight.explain.matcher import EXCEPTION_LINE, FAILURE_WORDS, TRACEBACK_HEADER, Hit
from preflight.explain.prefixes import LineMeta, parse_line

TIERS = ("cause", "context", "symptom")
_DISPLAY_ORDER = ("cause", "symptom", "context")  # failures first, settings after
_OTHER_SIGNATURES = 0.5  # share of each further signature's worth added to the best one's
_FIRST_ACTOR_BONUS = 10
_UNEXPLAINED_CASCADE_BONUS = 100
RDMA_AREAS = frozenset({"infiniband", "roce", "efa", "gdr-fabric"})  # reference areas of the RDMA NICs
GENERIC_FAILURE = ""  # reference ID of the matcher's built-in, uncatalogued failure signatures
MAX_EXAMPLES_PER_ROLE = 3  # example lines kept per reference and role: memory stays bounded
MAX_ACTORS = 10_000
CASCADE_REFERENCE = "NCCL014"
DERIVED_SIGNATURE = 0  # signature number of evidence read from several lines together (combinations)
_UNSET = object()  # a cascade not worked out yet (None means: there is none)
_TRACEBACK_HEADER = re.compile(TRACEBACK_HEADER)
_EXCEPTION_LINE = re.compile(EXCEPTION_LINE)
_NCCL_INFO = "NCCL INFO "  # posts often lose the host:pid:tid [dev] before it
# UCX's levels below DIAG (src/ucs/debug/log.c, "%-4s %-5s": "UCX  DEBUG "): what it logs there is
# a fallback it took, never what stopped the run; UCX reports that at WARN, ERROR or FATAL.
_UCX_QUIET = re.compile(r"\bUCX {1,3}(?:INFO|DEBUG|TRACE|REQ|DATA|ASYNC|FUNC|POLL) ")
# nccl-tests' table header names a column "error" in older releases: every healthy run prints it.
_NCCL_TESTS_HEADER = re.compile(NCCL_TESTS_TABLE)
# A text table's header row, whose failure word is a column title ("| Trial name | # failures |
# error file |", Ray Tune's summary of failed trials): every cell is a few words of letters with
# no number, path or address in it, and none is a status in capitals, so a data row ("| trial_a |
# ERROR | 10.0.0.1:4242 |", "| a | FAILED |") is not.
_TABLE_HEADER = re.compile(r"^\s*\|(?:[ \t]*(?![A-Z]+[ \t]*\|)[A-Za-z#][A-Za-z#()/]*(?: [A-Za-z#()/]+){0,5}[ \t]*\|){2,16}\s*$")


@dataclass
class Evidence:
    source: str
    line_number: int
    text: str
    role: str
    signature: int
    time_text: str | None = None
    actor: str | None = None
    host: str | None = None

    @property
    def location(self) -> str:
        return f"{self.source}:{self.line_number}"


@dataclass
class ReferenceHits:
    reference_id: str
    roles: dict[int, str] = field(default_factory=dict)  # signature number -> role
    specificity: dict[int, int] = field(default_factory=dict)  # signature number -> specificity
    first_line: dict[int, str] = field(default_factory=dict)  # signature number -> first location
    lines: int = 0
    examples: list[Evidence] = field(default_factory=list)
    first: tuple[float, int] = (float("inf"), 0)  # (time or inf, arrival order)
    actors: set[str] = field(default_factory=set)


@dataclass
class FirstFailure:
    actor: str
    evidence: Evidence
    reference_id: str  # "" for an uncatalogued failure (a Python exception, a traceback)
    sort_key: tuple[float, int]
    references_on_line: set[str] = field(default_factory=set)


@dataclass
class Cascade:
    """One actor failed first and others failed after it."""

    first: FirstFailure
    later: int  # how many other actors failed afterwards
    last_time_text: str | None
    ordered_by: str  # "timestamps" or "line order"


@dataclass
class Candidate:
    reference_id: str
    tier: str
    score: int
    hits: ReferenceHits
    on_first_actor: bool
    synthesized: bool = False  # added by the cascade analysis, not by a signature


class Analysis:
    """Feed hits in input order; ``candidates()`` and ``cascade()`` summarise them."""

    def __init__(
        self, year: int | None = None, related: dict[str, tuple[str, ...]] | None = None, areas: dict[str, str] | None = None
    ) -> None:
        self._year = year or time.gmtime().tm_year
        self._related = related or {}
        # Reference ID -> area, for the catalogue the log is read against: when given, only its
        # references are candidates.
        self._areas = areas
        self.by_reference: dict[str, ReferenceHits] = {}
        self.first_failures: dict[str, FirstFailure] = {}
        # Lines without any prefix belong to the process that wrote the file's other lines: the
        # last actor named in the same source. Before any is named they wait under the source's
        # name and join its actor when the source turns out to have exactly one.
        self._last_actor: dict[str, str] = {}
        self._actors_in: dict[str, set[str]] = {}
        self._cascade: Cascade | None | object = _UNSET
        self.weak_first: Evidence | None = None  # first uncatalogued error-ish line (NCCL WARN, "error:")
        self.failure_lines = 0
        self._order = 0
        self._all_timed = True
        self._sources: set[str] = set()
        self.observations = Observations()
        self._setting_line: tuple[str, int] | None = None  # the last line read as a setting
        # References whose failure lines have been read: a tear-down notice or a launcher's report
        # read after another reference's failure adds nothing to its own reference's score.
        self._failed_references: set[str] = set()

    def add(self, hit: Hit) -> None:
        self._order += 1
        signature = hit.signature
        if signature.reference_id.startswith(OBSERVATION):
            # Channel lines and fingerprints come by the thousand: summarised, never parsed here.
            self.observations.add(signature.reference_id, Sighting(hit.source, hit.line_number, hit.text))
            if signature.reference_id == NO_VERBS:
                self._read_as_setting(hit)  # NCCL up to 2.10 logged it as a WARN
            return
        self._cascade = _UNSET
        if signature.reference_id == GENERIC_FAILURE:
            meta, _message = parse_line(hit.text, self._year)
            actor = self._actor(meta, hit.source)
            evidence = Evidence(hit.source, hit.line_number, hit.text, "symptom", 0, meta.time_text, actor, meta.host)
            if signature.role == "context":  # weak: names a failing line, says nothing of order
                if self.weak_first is None and (hit.source, hit.line_number) != self._setting_line and not _handled_quietly(hit):
                    self.weak_first = evidence
                return
            self._note_failure(actor, evidence, "", meta, (meta.time if meta.time is not None else float("inf"), self._order), hit.source)
            return
        if signature.role == "context" and _NCCL_INFO in hit.text:
            self._read_as_setting(hit)
        entry = self.by_reference.get(signature.reference_id)
        if signature.role == "context" and entry is not None and _examples_of(entry, "context") >= MAX_EXAMPLES_PER_ROLE:
            entry.roles[signature.number] = signature.role
            entry.lines += 1  # a setting repeated by every rank: count it, skip the prefix parse
            return
        meta, _message = parse_line(hit.text, self._year)
        actor = self._actor(meta, hit.source)
        evidence = Evidence(hit.source, hit.line_number, hit.text, signature.role, signature.number, meta.time_text, actor, meta.host)
        entry = self.by_reference.setdefault(signature.reference_id, ReferenceHits(signature.reference_id))
        entry.roles[signature.number] = signature.role
        worth = 0 if signature.after_failure and self._failed_references - {signature.reference_id} else signature.specificity
        entry.specificity[signature.number] = max(worth, entry.specificity.get(signature.number, 0))
        entry.first_line.setdefault(signature.number, evidence.location)
        entry.lines += 1
        if _examples_of(entry, signature.role) < MAX_EXAMPLES_PER_ROLE and all(e.location != evidence.location for e in entry.examples):
            entry.examples.append(evidence)
            entry.examples.sort(key=lambda e: _DISPLAY_ORDER.index(e.role))
        key = (meta.time if meta.time is not None else float("inf"), self._order)
        entry.first = min(entry.first, key)
        if len(entry.actors) < MAX_ACTORS:
            entry.actors.add(actor)
        if signature.role != "context":
            self._note_failure(actor, evidence, signature.reference_id, meta, key, hit.source)
            self._failed_references.add(signature.reference_id)  # bounded by the catalogue's size

    def _read_as_setting(self, hit: Hit) -> None:
        """A line read as a setting ("Failed to open libibverbs.so[.1]" on a node without RDMA, an
        INFO line a reference reads as context) is not the run's failing line, whatever words it uses."""
        self._setting_line = (hit.source, hit.line_number)
        if self.weak_first is not None and (self.weak_first.source, self.weak_first.line_number) == self._setting_line:
            self.weak_first = None

    def _actor(self, meta: LineMeta, source: str) -> str:
        """Who wrote a line: its prefixes' actor, else the source's last named actor, else the
        source itself (a per-rank file, or a single process that never names itself)."""
        actor = meta.actor
        if actor is None:
            return self._last_actor.get(source) or _actor_from_source(source)
        self._last_actor[source] = actor
        known = self._actors_in.setdefault(source, set())
        if len(known) < 2:
            known.add(actor)  # only "none, one or several" matters
        return actor

    def _merged_failures(self) -> dict[str, FirstFailure]:
        """First failures per actor, with each source's unnamed lines joined to the one actor
        that source names (a single process's traceback is not another rank)."""
        merged = dict(self.first_failures)
        for source, actors in self._actors_in.items():
            unnamed = _actor_from_source(source)
            if len(actors) != 1 or unnamed not in merged or unnamed in actors:
                continue
            (owner,) = actors
            orphan = merged.pop(unnamed)
            known = merged.get(owner)
            if known is None or orphan.sort_key < known.sort_key:
                orphan.actor = owner
                merged[owner] = orphan
        return merged

    def _note_failure(self, actor: str, evidence: Evidence, reference_id: str, meta: LineMeta, key: tuple[float, int], source: str) -> None:
        self.failure_lines += 1
        self._sources.add(source)
        if meta.time is None:
            self._all_timed = False
        known = self.first_failures.get(actor)
        if known is None and len(self.first_failures) >= MAX_ACTORS:
            return
        if known is not None and not known.reference_id and reference_id and _same_moment(known, evidence, key):
            # A traceback header came first; the catalogued message that ends it is the failure.
            known.evidence, known.reference_id, known.references_on_line = evidence, reference_id, {reference_id}
        elif known is not None and not reference_id and _ends_traceback(known, evidence) and _same_moment(known, evidence, key):
            known.evidence = evidence  # the exception an uncatalogued traceback ends with says more than its header
        elif known is not None and known.evidence.location == evidence.location:
            known.references_on_line.add(reference_id)  # another signature on the same first line
            if not known.reference_id:
                known.reference_id = reference_id
        elif known is None or key < known.sort_key:
            self.first_failures[actor] = FirstFailure(actor, evidence, reference_id, key, {reference_id})

    def cascade(self) -> Cascade | None:
        """Asked for by the ranking, the first failure and the report alike: worked out once
        after the last hit."""
        if self._cascade is _UNSET:
            self._cascade = self._find_cascade()
        return self._cascade  # type: ignore[return-value]

    def _find_cascade(self) -> Cascade | None:
        failures = self._merged_failures()
        if len(failures) < 2:
            return None
        if self._all_timed:
            ordered_by = "timestamps"
        elif len(self._sources) == 1:
            ordered_by = "line order"  # one interleaved file: earlier lines were written earlier
        else:
            return None  # separate files without timestamps cannot be put in order
        ordered = sorted(failures.values(), key=lambda f: f.sort_key if ordered_by == "timestamps" else (0, f.sort_key[1]))
        return Cascade(ordered[0], len(ordered) - 1, ordered[-1].evidence.time_text, ordered_by)

    def candidates(self, stalled: bool = False) -> list[Candidate]:
        """The references the log points at, best first; ``stalled``: the log ends in a hang
        (:mod:`preflight.explain.stall`), a failure without a failing line, so the settings tied
        to failures count as they would beside one. A hang inside one node
        (``observations.intra_node_stall``) never used the RDMA NICs, so their settings are left out."""
        failure_seen = self.failure_lines > 0 or stalled
        cascade = self.cascade()
        first_actor = cascade.first.actor if cascade else None
        result = []
        derived = self.observations.derived()
        entries = self._with_derived(derived)
        sharing = self._line_sharing(entries)
        for entry in entries.values():
            roles = set(entry.roles.values())
            tier = next((t for t in TIERS if t in roles), "context")
            if tier == "context" and not failure_seen:
                continue  # a setting seen in a healthy log is not a failure candidate
            if self._areas is not None:
                area = self._areas.get(entry.reference_id)
                if area is None:
                    continue  # evidence for a reference this catalogue does not have
                if tier == "context" and self.observations.intra_node_stall and area in RDMA_AREAS:
                    continue  # a run that stopped inside one node never used its RDMA NICs: their settings cannot explain the hang
            score = _tier_score(entry, tier, sharing)
            on_first = first_actor is not None and first_actor in entry.actors and tier != "context"
            if on_first and cascade and entry.reference_id in cascade.first.references_on_line:
                # Shared out like specificity: a first line three references claim tells them
                # apart no better than it tells them from the rest.
                claimants = len(cascade.first.references_on_line - {GENERIC_FAILURE})
                score += round(_FIRST_ACTOR_BONUS / max(1, claimants))
            if cascade and entry.reference_id == CASCADE_REFERENCE and self._cascade_unexplained(cascade):
                score += _UNEXPLAINED_CASCADE_BONUS
            result.append(Candidate(entry.reference_id, tier, score, entry, on_first))
        if cascade and CASCADE_REFERENCE not in entries and (self._areas is None or CASCADE_REFERENCE in self._areas):
            bonus = _UNEXPLAINED_CASCADE_BONUS if self._cascade_unexplained(cascade) else 0
            result.append(Candidate(CASCADE_REFERENCE, "symptom", bonus, ReferenceHits(CASCADE_REFERENCE), False, synthesized=True))
        _keep_ahead(result, derived)
        named = {c.reference_id for c in result}
        listed_by = {
            c.reference_id: sum(1 for other in named if other != c.reference_id and c.reference_id in self._related.get(other, ()))
            for c in result
        }
        result.sort(key=lambda c: (TIERS.index(c.tier), -c.score, listed_by[c.reference_id], c.hits.first))
        return result

    def _with_derived(self, derived: list[Derived]) -> dict[str, ReferenceHits]:
        """The references' hits with the evidence read from several lines together added as a
        signature of its own, cause tier unless the rule says otherwise (copies: asking twice
        gives the same answer)."""
        if not derived:
            return self.by_reference
        entries = dict(self.by_reference)
        for item in derived:
            known = entries.get(item.reference_id)
            entry = _copy_hits(known) if known else ReferenceHits(item.reference_id)
            self._add_derived(entry, item)
            entries[item.reference_id] = entry
        return entries

    def _add_derived(self, entry: ReferenceHits, item: Derived) -> None:
        """Add one rule's evidence; when two rules name the same reference (a busy rank's
        picture at cause tier, the barrier's at symptom tier), the stronger tier keeps its worth."""
        known = entry.roles.get(DERIVED_SIGNATURE)
        if known is None or TIERS.index(item.role) < TIERS.index(known):
            entry.roles[DERIVED_SIGNATURE] = item.role
            entry.specificity[DERIVED_SIGNATURE] = item.specificity
        for sighting in item.sightings:
            meta, evidence = self._sighting_evidence(sighting, item.role)
            entry.first_line.setdefault(DERIVED_SIGNATURE, evidence.location)
            entry.lines += 1
            if all(e.location != evidence.location for e in entry.examples):
                entry.examples.insert(0, evidence)
            entry.first = min(entry.first, (meta.time if meta.time is not None else float("inf"), 0))
            if len(entry.actors) < MAX_ACTORS and evidence.actor is not None:
                entry.actors.add(evidence.actor)
        entry.examples.sort(key=lambda e: _DISPLAY_ORDER.index(e.role))

    def _sighting_evidence(self, sighting: Sighting, role: str) -> tuple[LineMeta, Evidence]:
        meta, _message = parse_line(sighting.text, self._year)
        actor = self._actor_of(meta, sighting.source)
        return meta, Evidence(sighting.source, sighting.line_number, sighting.text, role, DERIVED_SIGNATURE, meta.time_text, actor, meta.host)

    def separate_tests(self) -> Evidence | None:
        """The line that shows nccl-tests ran as separate tests (its second header or footer)."""
        pair = self.observations.separate_tests
        return None if pair is None else self._sighting_evidence(pair[1], "symptom")[1]

    def _actor_of(self, meta: LineMeta, source: str) -> str:
        """Who wrote a line read after the scan: its prefixes' actor, else the source's."""
        return meta.actor or self._last_actor.get(source) or _actor_from_source(source)

    def _line_sharing(self, entries: dict[str, ReferenceHits]) -> dict[str, int]:
        """For each line some signature first matched, how many references matched it."""
        counts: dict[str, int] = {}
        for entry in entries.values():
            for location in set(entry.first_line.values()):
                counts[location] = counts.get(location, 0) + 1
        return counts

    def first_failure(self) -> Evidence | None:
        """The earliest failing line of the run, catalogued or not: what to read first when no
        candidate explains the log."""
        cascade = self.cascade()
        if cascade is not None:
            return cascade.first.evidence
        failures = sorted(self._merged_failures().values(), key=lambda f: f.sort_key)
        if failures:
            return failures[0].evidence
        return self.weak_first

    def _cascade_unexplained(self, cascade: Cascade) -> bool:
        """The first actor failed with an exception or traceback no reference describes, and the
        others failed after it: the cascade is then the best description of what happened."""
        return cascade.first.references_on_line <= {GENERIC_FAILURE}

    def settings_seen(self, stalled: bool = False) -> list[ReferenceHits]:
        """Context-only matches in a log without failures (a stall is one): worth a mention, not a
        diagnosis."""
        if self.failure_lines or stalled:
            return []
        return [e for e in self.by_reference.values() if set(e.roles.values()) == {"context"}]


def _handled_quietly(hit: Hit) -> bool:
    """An NCCL INFO line whose only sign of trouble is a failure word, or any UCX line below its
    DIAG level: a fallback the library took and logged as information (a plugin's older symbol
    version, a missing optional library, a registration cache it could not create), not a
    failure; both report what they cannot get past as a WARN or an ERROR. Also nccl-tests' table
    header, whose "error" column is in every healthy run's output, and any text table's header row,
    whose failure words are column titles."""
    return (
        (_NCCL_INFO in hit.text and hit.signature.pattern.pattern == FAILURE_WORDS)
        or _UCX_QUIET.search(hit.text) is not None
        or _NCCL_TESTS_HEADER.search(hit.text) is not None
        or _TABLE_HEADER.match(hit.text) is not None
    )


def _keep_ahead(candidates: list[Candidate], derived: list[Derived]) -> None:
    """Lower the score of every candidate a rule ranks its own reference ahead of (same tier)
    to just below that reference's, so that their many matched lines cannot carry them past it."""
    by_id = {candidate.reference_id: candidate for candidate in candidates}
    for rule in derived:
        own = by_id.get(rule.reference_id)
        if own is None or own.tier != rule.role:
            continue
        for reference_id in rule.ahead_of:
            other = by_id.get(reference_id)
            if other is not None and other.tier == own.tier and other.score >= own.score:
                other.score = max(0, own.score - 1)


def _tier_score(entry: ReferenceHits, tier: str, sharing: dict[str, int]) -> int:
    """How strongly the log points at this reference in its tier.

    Each matched signature is worth its specificity divided by the number of references whose
    signatures matched the same line: a message three references share tells them apart no
    better than a coin, while a line only this reference explains is worth all of it. The best
    signature of the tier counts in full, the others (context included) half each."""
    worth = {
        number: entry.specificity.get(number, 0) / max(1, sharing.get(entry.first_line.get(number, ""), 1))
        for number in entry.roles
    }
    in_tier = [number for number, role in entry.roles.items() if role == tier]
    if not in_tier:
        return 0
    best = max(in_tier, key=lambda number: worth[number])
    return round(worth[best] + _OTHER_SIGNATURES * sum(value for number, value in worth.items() if number != best))


def _copy_hits(entry: ReferenceHits) -> ReferenceHits:
    return ReferenceHits(
        entry.reference_id, dict(entry.roles), dict(entry.specificity), dict(entry.first_line), entry.lines,
        list(entry.examples), entry.first, set(entry.actors),
    )


def _examples_of(entry: ReferenceHits, role: str) -> int:
    return sum(1 for example in entry.examples if example.role == role)


def _ends_traceback(known: FirstFailure, evidence: Evidence) -> bool:
    """``evidence`` is the exception line of the traceback whose header is ``known``'s line."""
    return (
        not known.reference_id
        and _TRACEBACK_HEADER.search(known.evidence.text) is not None
        and _TRACEBACK_HEADER.search(evidence.text) is None
        and _EXCEPTION_LINE.search(evidence.text) is not None
    )


def _same_moment(known: FirstFailure, evidence: Evidence, key: tuple[float, int]) -> bool:
    """Two lines of one actor that belong to the same error report (one traceback)."""
    if known.evidence.source != evidence.source:
        return False
    if key[0] != float("inf") and known.sort_key[0] != float("inf"):
        return abs(key[0] - known.sort_key[0]) <= 1.0
    return 0 <= evidence.line_number - known.evidence.line_number <= 60


def _actor_from_source(source: str) -> str:
    """Per-rank log directories name the rank in the file name; use that when lines do not."""
    return source.rsplit("/", 1)[-1]
