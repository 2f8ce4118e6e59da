"""The real-log corpus (``tests/data/real-logs``) and how ``explain`` scores on it.

Used by ``tests/explain/test_explain_real_logs.py`` (the held-back figures CI guards) and by
``bench/explain_accuracy.py`` (the figures, and per-log results of the development part only).
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

from preflight.explain import Catalogue, explain, load_catalogue

CORPUS = Path(__file__).resolve().parent / "data" / "real-logs"
OUTSIDE = "outside"
THREAD_URL = re.compile(r"https://github\.com/[\w.-]+/[\w.-]+/(?:issues|pull|discussions)/\d+")  # a label's ``thread``


@dataclass(frozen=True)
class LabelledLog:
    id: str
    thread: str
    reference: str  # a catalogue ID, or OUTSIDE
    confidence: str
    split: str
    truncated: bool

    @property
    def path(self) -> Path:
        return CORPUS / "logs" / f"{self.id}.log"


@dataclass(frozen=True)
class Outcome:
    log: LabelledLog
    ranking: tuple[str, ...]  # candidate IDs, best first
    tiers: tuple[str, ...]
    status: str  # explain's JSON status

    @property
    def top1(self) -> bool:
        return self.ranking[:1] == (self.log.reference,)

    @property
    def top3(self) -> bool:
        return self.log.reference in self.ranking[:3]

    @property
    def silent(self) -> bool:
        """No candidate and no named failing line: the worst answer to a failure log."""
        return self.status == "nothing-found"

    @property
    def catalogued_cause(self) -> bool:
        """An out-of-catalogue log given a catalogued candidate at cause tier."""
        return "cause" in self.tiers


def corpus(split: str | None = None) -> list[LabelledLog]:
    logs = []
    for labels in sorted(CORPUS.glob("labels-*.toml")):
        for entry in tomllib.loads(labels.read_text())["log"]:
            log = LabelledLog(entry["id"], entry["thread"], entry["reference"], entry["confidence"], entry["split"], entry["truncated"])
            if split is None or log.split == split:
                logs.append(log)
    return logs


def evaluate(logs: list[LabelledLog], catalogue: Catalogue | None = None) -> list[Outcome]:
    from preflight.explain.render import exit_status

    catalogue = catalogue or load_catalogue()
    outcomes = []
    for log in logs:
        explanation = explain([str(log.path)], catalogue=catalogue)
        ranking = tuple(c.reference_id for c in explanation.candidates)
        tiers = tuple(c.tier for c in explanation.candidates)
        outcomes.append(Outcome(log, ranking, tiers, exit_status(explanation)))
    return outcomes


@dataclass(frozen=True)
class Figures:
    catalogued: int
    top1: float
    top3: float
    no_candidate: float  # share of catalogued-cause logs with no candidate at all
    silent: int  # failure logs (all of them) answered "nothing found"
    outside: int
    outside_with_cause: float  # share of out-of-catalogue logs given a cause-tier candidate

    def lines(self) -> list[str]:
        return [
            f"catalogued-cause logs: {self.catalogued}",
            f"top-1: {self.top1:.1%}   top-3: {self.top3:.1%}   no candidate: {self.no_candidate:.1%}",
            f"silent on a failure: {self.silent}",
            f"out-of-catalogue logs: {self.outside}, given a catalogued cause: {self.outside_with_cause:.1%}",
        ]


def figures(outcomes: list[Outcome]) -> Figures:
    inside = [o for o in outcomes if o.log.reference != OUTSIDE]
    outside = [o for o in outcomes if o.log.reference == OUTSIDE]

    def share(items: list[Outcome], test: str) -> float:
        return sum(1 for o in items if getattr(o, test)) / len(items) if items else 0.0

    no_candidate = sum(1 for o in inside if not o.ranking) / len(inside) if inside else 0.0
    return Figures(
        len(inside), share(inside, "top1"), share(inside, "top3"), no_candidate,
        sum(1 for o in outcomes if o.silent), len(outside), share(outside, "catalogued_cause"),
    )
