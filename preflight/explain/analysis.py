"""Turn signature hits into ranked candidates and a cascade timeline.

Ranking follows how failures propagate in a collective job. A line that names a specific
cause (``vendor err 129``, ``ibv_reg_mr`` ENOMEM, ``Network is unreachable``) is what an
operator must act on; the watchdog timeouts, ``ncclRemoteError`` and closed connections that
every other rank prints afterwards are symptoms of it. So candidates are ordered by tier:

1. ``cause``   - at least one cause signature matched;
2. ``context`` - a configuration line tied to the reference (NCCL bound to ``docker0``, GPU
   Direct RDMA disabled) appeared in a log that also shows a failure;
3. ``symptom`` - only generic downstream signatures matched;

then by a score over the distinct signatures matched, a bonus when the cause was logged by the
first actor (host or rank) to fail, and the time of the first hit.

Memory stays bounded: each reference keeps a few example lines and counters, and the cascade
keeps one first failure per actor, up to ``MAX_ACTORS`` actors.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from preflight.explain.matcher import Hit
from preflight.explain.prefixes import LineMeta, parse_line

TIERS = ("cause", "context", "symptom")
_DISPLAY_ORDER = ("cause", "symptom", "context")  # failures first, settings after
_WEIGHTS = {"cause": 10, "context": 4, "symptom": 3}
_FIRST_ACTOR_BONUS = 5
_UNEXPLAINED_CASCADE_BONUS = 100
GENERIC_FAILURE = ""  # reference ID of the matcher's built-in, uncatalogued failure signatures
MAX_EXAMPLES_PER_ROLE = 3  # example lines kept per reference and role: memory stays bounded
MAX_ACTORS = 10_000
CASCADE_REFERENCE = "NCCL014"


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

    def __init__(self, year: int | None = None) -> None:
        self._year = year or time.gmtime().tm_year
        self.by_reference: dict[str, ReferenceHits] = {}
        self.first_failures: dict[str, FirstFailure] = {}
        self.failure_lines = 0
        self._order = 0
        self._all_timed = True
        self._sources: set[str] = set()

    def add(self, hit: Hit) -> None:
        self._order += 1
        signature = hit.signature
        if signature.reference_id == GENERIC_FAILURE:
            meta, _message = parse_line(hit.text, self._year)
            actor = meta.actor or _actor_from_source(hit.source)
            evidence = Evidence(hit.source, hit.line_number, hit.text, "symptom", 0, meta.time_text, actor, meta.host)
            self._note_failure(actor, evidence, "", meta, (meta.time if meta.time is not None else float("inf"), self._order), hit.source)
            return
        entry = self.by_reference.get(signature.reference_id)
        if signature.role == "context" and entry is not None and _examples_of(entry, "context") >= MAX_EXAMPLES_PER_ROLE:
            entry.roles[signature.number] = signature.role
            entry.lines += 1  # a setting repeated by every rank: count it, skip the prefix parse
            return
        meta, _message = parse_line(hit.text, self._year)
        actor = meta.actor or _actor_from_source(hit.source)
        evidence = Evidence(hit.source, hit.line_number, hit.text, signature.role, signature.number, meta.time_text, actor, meta.host)
        entry = self.by_reference.setdefault(signature.reference_id, ReferenceHits(signature.reference_id))
        entry.roles[signature.number] = signature.role
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
        elif known is not None and known.evidence.location == evidence.location:
            known.references_on_line.add(reference_id)  # another signature on the same first line
            if not known.reference_id:
                known.reference_id = reference_id
        elif known is None or key < known.sort_key:
            self.first_failures[actor] = FirstFailure(actor, evidence, reference_id, key, {reference_id})

    def cascade(self) -> Cascade | None:
        if len(self.first_failures) < 2:
            return None
        if self._all_timed:
            ordered_by = "timestamps"
        elif len(self._sources) == 1:
            ordered_by = "line order"  # one interleaved file: earlier lines were written earlier
        else:
            return None  # separate files without timestamps cannot be put in order
        ordered = sorted(self.first_failures.values(), key=lambda f: f.sort_key if ordered_by == "timestamps" else (0, f.sort_key[1]))
        return Cascade(ordered[0], len(ordered) - 1, ordered[-1].evidence.time_text, ordered_by)

    def candidates(self) -> list[Candidate]:
        failure_seen = self.failure_lines > 0
        cascade = self.cascade()
        first_actor = cascade.first.actor if cascade else None
        result = []
        for entry in self.by_reference.values():
            roles = set(entry.roles.values())
            tier = next((t for t in TIERS if t in roles), "context")
            if tier == "context" and not failure_seen:
                continue  # a setting seen in a healthy log is not a failure candidate
            score = sum(_WEIGHTS[role] for role in entry.roles.values())
            on_first = first_actor is not None and first_actor in entry.actors and tier != "context"
            if on_first and cascade and entry.reference_id in cascade.first.references_on_line:
                score += _FIRST_ACTOR_BONUS
            if cascade and entry.reference_id == CASCADE_REFERENCE and self._cascade_unexplained(cascade):
                score += _UNEXPLAINED_CASCADE_BONUS
            result.append(Candidate(entry.reference_id, tier, score, entry, on_first))
        if cascade and CASCADE_REFERENCE not in self.by_reference:
            bonus = _UNEXPLAINED_CASCADE_BONUS if self._cascade_unexplained(cascade) else 0
            result.append(Candidate(CASCADE_REFERENCE, "symptom", bonus, ReferenceHits(CASCADE_REFERENCE), False, synthesized=True))
        result.sort(key=lambda c: (TIERS.index(c.tier), -c.score, c.hits.first, c.reference_id))
        return result

    def _cascade_unexplained(self, cascade: Cascade) -> bool:
        """The first actor failed with an exception or traceback no reference describes, and the
        others failed after it: the cascade is then the best description of what happened."""
        return cascade.first.references_on_line <= {GENERIC_FAILURE}

    def settings_seen(self) -> list[ReferenceHits]:
        """Context-only matches in a log without failures: worth a mention, not a diagnosis."""
        if self.failure_lines:
            return []
        return [e for e in self.by_reference.values() if set(e.roles.values()) == {"context"}]


def _examples_of(entry: ReferenceHits, role: str) -> int:
    return sum(1 for example in entry.examples if example.role == role)


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
