"""``preflight explain``: which catalogued failures a run's logs point at, best first.

The pipeline streams every input through :class:`~preflight.explain.matcher.Matcher`, feeds the
hits to :class:`~preflight.explain.analysis.Analysis`, optionally asks the node about each
candidate (:mod:`preflight.explain.confirm`), and renders text or JSON
(:mod:`preflight.explain.render`).
"""

from __future__ import annotations

import os
import stat
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, BinaryIO, Iterable

from preflight.explain.analysis import Analysis, Candidate, Cascade, Evidence
from preflight.explain.combinations import WaitedCollective
from preflight.explain.confirm import RelatedOnNode, Verdict
from preflight.explain.reader import ReadStats, iter_inputs
from preflight.explain.stall import DUMP, SourceTails, Stall, find_stall
from preflight.model import Reference


if TYPE_CHECKING:
    from preflight.explain.matcher import Matcher


@dataclass
class Explanation:
    stats: ReadStats
    candidates: list[Candidate]
    references: dict[str, Reference]
    cascade: Cascade | None
    settings_seen: list[str]
    duration_s: float
    first_failure: Evidence | None = None  # the earliest failing line, catalogued or not
    stall: Stall | None = None  # where a log without failures went silent in NCCL's output
    waited: WaitedCollective | None = None  # the collective the ranks' watchdogs timed out in
    # nccl-tests run as separate one-process tests: the line showing it, named as the first
    # failing line when nothing else failed
    separate_tests: Evidence | None = None
    verdicts: dict[str, Verdict] = field(default_factory=dict)
    check_error: str | None = None
    # --check: misconfigurations found on the node that a symptom candidate lists as related
    related_on_node: list[RelatedOnNode] = field(default_factory=list)


@dataclass
class Catalogue:
    """The references and their compiled matcher: built once, reused for many inputs."""

    references: dict[str, Reference]
    matcher: "Matcher"


def load_catalogue(catalogue_dir: str | None = None, extra: Iterable[Reference] = ()) -> Catalogue:
    """The packaged catalogue (or ``catalogue_dir``'s) plus ``extra``: the references that site
    check directories and plugins ship, whose signatures a site writes for its own failures.
    Discovery has already refused an extra ID the catalogue has, and validated every pattern."""
    from preflight.catalogue import load_all
    from preflight.explain.matcher import Matcher

    references = {reference.id: reference for reference in load_all(catalogue_dir)}
    references.update((reference.id, reference) for reference in extra)
    return Catalogue(references, Matcher(references.values()))


def explain(
    paths: list[str], stdin: BinaryIO | None = None, catalogue_dir: str | None = None, catalogue: Catalogue | None = None
) -> Explanation:
    """Scan ``paths`` (``-`` or none for stdin) and rank the candidates."""
    from preflight.explain.parallel import scan_chunks

    started = time.perf_counter()
    catalogue = catalogue or load_catalogue(catalogue_dir)
    references = catalogue.references
    catalogue.matcher.forget_repeats()
    stats = ReadStats()
    analysis = Analysis(
        related={reference.id: tuple(reference.related) for reference in references.values()},
        areas={reference.id: reference.area for reference in references.values()},
    )
    tails = SourceTails()
    chunks = tails.watch(iter_inputs(paths, stats, stdin))
    for hit in scan_chunks(catalogue.matcher, chunks, stats, expected_bytes=_plain_file_bytes(paths)):
        analysis.add(hit)
    candidates = analysis.candidates()
    first_failure = analysis.first_failure()
    stall = None
    if not candidates and (first_failure is None or analysis.failure_lines == 0):
        stall = find_stall(tails, network_seen=bool(analysis.observations.networks))
        if stall is not None and first_failure is not None:
            # Only a warning-like line was read: it decides, unless it belongs to the stack dump the
            # log ends with (gdb's "syscall-template.S: No such file or directory." banner).
            stall = stall if _within_dump(stall, first_failure) else None
        if stall is not None:
            first_failure = None
            if stall.peer is not None:
                analysis.observations.intra_node_stall = (stall.peer, stall.last)
            candidates = analysis.candidates(stalled=True)
    separate_tests = analysis.separate_tests() if not candidates and first_failure is None and stall is None else None
    settings = [entry.reference_id for entry in analysis.settings_seen(stalled=stall is not None)]
    return Explanation(
        stats, candidates, references, analysis.cascade(), settings, time.perf_counter() - started, first_failure or separate_tests,
        stall=stall, waited=analysis.observations.waited_collective(), separate_tests=separate_tests,
    )


def _within_dump(stall: Stall, line: Evidence) -> bool:
    """``line`` is part of the stack dump ``stall`` starts at: debugger output, not the run's."""
    return stall.what == DUMP and line.source == stall.last.source and line.line_number >= stall.last.line_number


def _plain_file_bytes(paths: list[str]) -> int:
    """The total size of the regular files among ``paths`` (directories, stdin and anything that
    cannot be stat'ed count nothing): a hint for when to scan in parallel, never trusted further."""
    total = 0
    for path in paths:
        try:
            status = os.stat(path)
        except (OSError, ValueError):
            continue
        if stat.S_ISREG(status.st_mode):
            total += status.st_size
    return total


def check_candidates(explanation: Explanation, root: str, config_path: str | None, checks_dirs: tuple[str, ...] = ()) -> None:
    """Fill ``explanation.verdicts`` from the node checks of every candidate, and
    ``explanation.related_on_node`` from those of the references a symptom candidate lists as
    related: a symptom says to look for an earlier cause, and the node may hold it even when the
    log never names it."""
    from preflight.explain.confirm import (
        NodeCheckError, checks_reading_the_job, node_findings, outside_the_job, related_found, related_to_symptoms, verdict_for,
    )
    references = explanation.references
    related = related_to_symptoms([(c.reference_id, c.tier) for c in explanation.candidates], references)
    named = [c.reference_id for c in explanation.candidates]
    wanted = {check for ref_id in [*named, *related] for check in references[ref_id].checks}
    try:
        node = node_findings(wanted, root, config_path, checks_dirs)
    except NodeCheckError as error:
        explanation.check_error = str(error)
        return
    findings = node.by_reference
    for ref_id in named:
        explanation.verdicts[ref_id] = verdict_for(references[ref_id], findings)
    # The job's settings the checks read come from the environment they ran in: this shell's on the
    # live node, the recorder's in a root or snapshot (a prolog, an audit). Unless that is a job's,
    # what those checks found or missed is not about the failed job: its refutations and its
    # confirmations become undecided, and a related reference it decides is not shown (related_found).
    decided = [ref_id for ref_id, verdict in explanation.verdicts.items() if verdict.status in ("refuted", "confirmed")]
    if not node.read_a_job and decided:
        job_reading = checks_reading_the_job({check for ref_id in decided for check in references[ref_id].checks}, checks_dirs)
        for ref_id in decided:
            explanation.verdicts[ref_id] = outside_the_job(explanation.verdicts[ref_id], references[ref_id], job_reading)
    shell_settings = None
    if not node.read_a_job and related:
        shell_settings = checks_reading_the_job({check for ref_id in related for check in references[ref_id].checks}, checks_dirs)
    explanation.related_on_node = related_found(related, findings, references, shell_settings)
