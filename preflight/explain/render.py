"""Text and JSON output of ``preflight explain``."""

from __future__ import annotations

import json
import textwrap
from typing import Any

from preflight.explain import Explanation
from preflight.explain.analysis import DERIVED_SIGNATURE, Candidate, Evidence
from preflight.explain.combinations import BARRIER_WAITERS, INTRA_NODE_STALL, WaitedCollective
from preflight.hostlist import number_runs
from preflight.model import Finding
from preflight.text import printable_lines

SCHEMA = "preflight-explain/1"
DETAILED = 3  # candidates shown in full; the rest get one line each
_MAX_LINE_SHOWN = 240

_WHY = {
    "cause": "the log names this failure, but more than one configuration produces the same message",
    "context": "a setting or step tied to this failure appears in a log that fails; alone it proves nothing",
    "symptom": "this is a downstream symptom that many root causes produce; look for an earlier cause",
}


def why_candidate(candidate: Candidate, explanation: Explanation | None = None) -> str:
    if candidate.synthesized:
        return "several ranks or hosts failed one after another; the first failure is the one to explain"
    stall = explanation.stall if explanation is not None else None
    if stall is not None and stall.peer is not None and candidate.reference_id == INTRA_NODE_STALL:
        return (
            "the run used the GPUs of one node only and then went silent, the usual picture of peer-to-peer "
            "traffic the PCIe fabric drops, but silence names no cause by itself; the node checks can"
        )
    if candidate.tier == "symptom" and candidate.reference_id in BARRIER_WAITERS and DERIVED_SIGNATURE in candidate.hits.roles:
        return (
            "the ranks timed out in a one-element collective (a barrier, or the size exchange of an object "
            "collective), so one rank was elsewhere; no line says where, and "
            + ", ".join(BARRIER_WAITERS[:-1]) + " and " + BARRIER_WAITERS[-1] + " are the readings that fit"
        )
    reason = _WHY[candidate.tier]
    shared = _sharing_lines(candidate, explanation) if explanation else []
    if shared:
        reason += "; the same lines also match " + ", ".join(shared)
    return reason


def _sharing_lines(candidate: Candidate, explanation: Explanation) -> list[str]:
    """Other candidates that matched one of this candidate's example lines."""
    mine = {e.location for e in candidate.hits.examples}
    return [
        other.reference_id
        for other in explanation.candidates
        if other is not candidate and mine & {e.location for e in other.hits.examples}
    ]


def exit_status(explanation: Explanation) -> str:
    if not explanation.stats.files or not explanation.stats.lines:
        return "no-input"  # nothing read, or only empty inputs: a wrong path, a log not written yet
    if not explanation.candidates:
        # A log that fails in a way no reference describes is not a log without failures.
        if explanation.first_failure:
            return "uncatalogued"
        return "stalled" if explanation.stall else "nothing-found"
    if any(v.status == "confirmed" for v in explanation.verdicts.values()):
        return "confirmed"
    return "candidates"


def no_input_message(explanation: Explanation) -> str:
    """Why a run explained nothing (status ``no-input``)."""
    files = explanation.stats.files
    if not files:
        return "No input could be read; nothing was explained."
    return f"{'Every input was' if files > 1 else 'The input was'} empty ({files} read, 0 lines); nothing was explained."


def render_text(explanation: Explanation) -> str:
    stats = explanation.stats
    out: list[str] = []  # the inputs' problems go to stderr (preflight.cli.explain), not here
    count = len(explanation.candidates)
    scanned = f"{stats.lines:,} lines of {stats.files} input{'s' if stats.files != 1 else ''} in {explanation.duration_s:.2f} s"
    if not stats.files or not stats.lines:
        out.append(no_input_message(explanation))
        return printable_lines("\n".join(out)) + "\n"
    first = explanation.first_failure
    if not count and first is not None and explanation.separate_tests is not None:
        out.append(f"nccl-tests ran as separate one-process tests, which the catalogue does not describe ({scanned}).")
        out.append("The line that shows it:")
        out.append(f"  {_evidence_line(first)}")
        out.append(SEPARATE_TESTS)
        out.append("Fix: rebuild nccl-tests against the MPI whose mpirun starts it (make clean; make MPI=1 MPI_HOME=...); "
                   "one job then lists each rank once, with its own 'Rank N ... on <host>' line.")
        if explanation.settings_seen:
            out.append("Settings noted (not failures): " + ", ".join(explanation.settings_seen))
        return printable_lines("\n".join(out)) + "\n"
    if not count and first is not None:
        out.append(f"The run failed in a way the catalogue does not describe ({scanned}).")
        who = f" ({first.actor})" if first.actor and first.actor not in first.source else ""
        out.append(f"First failing line, not catalogued{who}:")
        out.append(f"  {_evidence_line(first)}")
        out.append("preflight names no cause for it; read the log from that line.")
        if explanation.settings_seen:
            out.append("Settings noted (not failures): " + ", ".join(explanation.settings_seen))
        return printable_lines("\n".join(out)) + "\n"
    stall = explanation.stall
    if not count and stall is not None:
        out.append(f"The run stopped without an error and without finishing ({scanned}).")
        out.append(f"{stall.what[0].upper()}{stall.what[1:]} {_lines_after(stall.lines_after)}:")
        out.append(f"  {stall.last.source}:{stall.last.line_number}: {stall.last.text}")
        out.append("A hang from there on (or a log cut short there): a rank, or a connection it waits for, never answered.")
        out.append("preflight names no cause for it; find the rank that stopped first, and what it was doing.")
        return printable_lines("\n".join(out)) + "\n"
    if not count:
        out.append(f"No failure found ({scanned}).")
        out.append("The logs match none of the catalogue's signatures and show no error; preflight does not guess beyond them.")
        if explanation.settings_seen:
            out.append("Settings noted (not failures): " + ", ".join(explanation.settings_seen))
        return printable_lines("\n".join(out)) + "\n"
    out.append(f"{count} candidate{'s' if count != 1 else ''}, best first ({scanned}).")
    out.append("A matching message alone does not confirm a cause; each candidate lists how to check it.")
    if stall is not None:
        place = f"{stall.last.source}:{stall.last.line_number}"
        out.append(f"The run stopped without an error and without finishing: {stall.what} ({place}) {_lines_after(stall.lines_after)}.")
    if stats.split_lines:
        out.append(f"Note: {stats.split_lines} over-long lines were scanned in pieces.")
    if explanation.check_error:
        out.append(f"Node checks could not run: {explanation.check_error}")
    cascade = explanation.cascade
    if cascade:
        leader = cascade.first
        when = f" at {leader.evidence.time_text}" if leader.evidence.time_text else ""
        where = f" on {leader.evidence.host}" if leader.evidence.host and leader.evidence.host not in leader.actor else ""
        out.append("")
        out.append(f"First failure: {leader.actor}{where}{when} ({leader.evidence.location}, {leader.reference_id or 'not catalogued'}).")
        until = f", the last at {cascade.last_time_text}" if cascade.last_time_text else ""
        out.append(f"  Then {cascade.later} other rank(s)/host(s) failed{until} (ordered by {cascade.ordered_by}).")
    if explanation.waited is not None:
        out.extend(_waited_lines(explanation.waited))
    for position, candidate in enumerate(explanation.candidates, 1):
        out.append("")
        if position <= DETAILED:
            out.extend(_detailed(position, candidate, explanation))
        else:
            out.append(_one_line(position, candidate, explanation))
    out.extend(_related_on_node_lines(explanation))
    # Log lines, host names and actors come from the logs: shown, never obeyed by the terminal.
    return printable_lines("\n".join(out)) + "\n"


def _related_on_node_lines(explanation: Explanation) -> list[str]:
    """What --check found on the node among the references the symptom candidates relate to."""
    if not explanation.related_on_node:
        return []
    lines = ["", "Found on the node, related to the symptoms above though no log line names it (--check):"]
    for related in explanation.related_on_node:
        reference = explanation.references[related.reference_id]
        severity = max((f.severity for f in related.findings), key=lambda severity: severity.rank)
        lines.append(f"  {reference.id}  {reference.title}  [{severity.value}], related to {', '.join(related.symptoms)}")
        lines.extend(f"     {_finding_facts(finding)}" for finding in related.findings[:3])
        if reference.fix:
            wrapped = textwrap.wrap("Fix: " + " ".join(reference.fix[0].split()), 96) or [""]
            lines.extend(f"     {part}" for part in wrapped)
    return lines


def _finding_facts(finding: Finding) -> str:
    """A present finding in one line: its subject, then where each fact was read and what it said
    (the place once, when the subject already is that file)."""
    facts = "; ".join(e.observed if e.source == finding.subject else f"{e.source}: {e.observed}" for e in finding.evidence[:3])
    return f"{finding.subject}: {facts}"


def _waited_lines(waited: WaitedCollective) -> list[str]:
    """The comparison NCCL003's fix asks for: which ranks timed out in which collective, and which
    ranks below them printed no timeout."""
    where = f"{waited.first.source}:{waited.first.line_number}"
    lines = ["", f"Watchdog timeouts: ranks {_rank_list(waited.ranks)} timed out in collective #{waited.sequence} ({waited.operation}), first at {where}."]
    if waited.silent:
        several = len(waited.silent) > 1
        lines.append(
            f"  No timeout from rank{'s' if several else ''} {_rank_list(waited.silent)} in these logs:"
            f" the collective waited for {'them' if several else 'it'} (a stuck or late rank, NCCL011),"
            f" unless {'their' if several else 'its'} lines were left out."
        )
    return lines


def _rank_list(ranks: tuple[int, ...], most: int = 12) -> str:
    """Sorted rank numbers as runs (``0, 4-7, 9``), the first ``most`` runs and a count of the rest."""
    runs = number_runs(list(ranks))
    shown = [f"{start}" if start == end else f"{start}-{end}" for start, end in runs[:most]]
    rest = len(runs) - most
    return ", ".join(shown) + (f" and {rest} more run{'s' if rest > 1 else ''}" if rest > 0 else "")


def _header(position: int, candidate: Candidate, explanation: Explanation) -> str:
    reference = explanation.references[candidate.reference_id]
    verdict = explanation.verdicts.get(candidate.reference_id)
    tag = f" - {verdict.status.upper()}" if verdict else ""
    return f"{position}. {reference.id}  {reference.title}  [{candidate.tier}, {reference.severity.value}]{tag}"


def _one_line(position: int, candidate: Candidate, explanation: Explanation) -> str:
    first = candidate.hits.examples[0].location if candidate.hits.examples else "cascade analysis"
    return _header(position, candidate, explanation) + f"\n   {candidate.hits.lines} line(s), first at {first}"


def _detailed(position: int, candidate: Candidate, explanation: Explanation) -> list[str]:
    reference = explanation.references[candidate.reference_id]
    hits = candidate.hits
    lines = [_header(position, candidate, explanation)]
    if hits.examples:
        actors = len(hits.actors)
        lines.append(f"   Matched {hits.lines} line(s) from {actors} rank(s)/host(s)/file(s):")
        lines.extend(f"     {_evidence_line(item)}" for item in hits.examples[:3])
    lines.append("   Why only a candidate: " + why_candidate(candidate, explanation) + ".")
    verdict = explanation.verdicts.get(candidate.reference_id)
    if verdict:
        lines.append(f"   On the node: {verdict.status}: {verdict.reason}")
        lines.extend(f"     {_finding_facts(finding)}" for finding in verdict.findings[:3] if finding.status.value == "present")
    elif reference.checks:
        lines.append(f"   Check the node: preflight node --select {','.join(reference.checks)}   (or explain --check)")
    elif reference.why_log_only:
        lines.append(f"   No node check: {reference.why_log_only}")
    evidence = [item for item in reference.evidence if item.get("command")]
    if evidence:
        lines.append("   Evidence to collect:")
        lines.extend(f"     - {item['what']}: {item['command']}" for item in evidence[:4])
    if reference.fix:
        lines.append("   Fix:")
        for step in reference.fix[:4]:
            wrapped = textwrap.wrap(" ".join(step.split()), 96) or [""]
            lines.append(f"     - {wrapped[0]}")
            lines.extend(f"       {more}" for more in wrapped[1:])
    if reference.related:
        lines.append(f"   Related: {', '.join(reference.related)}   (preflight references show ID)")
    return lines


def _evidence_line(item: Evidence) -> str:
    text = item.text if len(item.text) <= _MAX_LINE_SHOWN else item.text[: _MAX_LINE_SHOWN - 3] + "..."
    return f"{item.location}: {text}"


def _lines_after(count: int) -> str:
    """Where the stall's line stands, as the rest of a sentence that names it."""
    if count == 0:
        return "is the log's last line"
    return f"is {count} line{'s' if count != 1 else ''} before the log's end"


SEPARATE_TESTS = (
    "Only rank 0 of an nccl-tests job prints its header and footer; here one is printed again with no result "
    "table (or no new header) between, so each process ran a test of its own, on its own node: a binary built "
    "without MPI=1, or against another MPI than the mpirun that started it."
)


def render_json(explanation: Explanation) -> str:
    stats = explanation.stats
    cascade = explanation.cascade
    first = explanation.first_failure
    document: dict[str, Any] = {
        "schema": SCHEMA,
        "status": exit_status(explanation),
        "inputs": {
            "files": stats.files,
            "lines": stats.lines,
            "bytes": stats.bytes,
            "split_lines": stats.split_lines,
            "problems": stats.problem_lines(),
        },
        "duration_s": round(explanation.duration_s, 4),
        "cascade": None
        if cascade is None
        else {
            "first_actor": cascade.first.actor,
            "first_host": cascade.first.evidence.host,
            "first_reference": cascade.first.reference_id,
            "first_location": cascade.first.evidence.location,
            "first_time": cascade.first.evidence.time_text,
            "later_actors": cascade.later,
            "last_time": cascade.last_time_text,
            "ordered_by": cascade.ordered_by,
        },
        "first_failure": None
        if first is None
        else {"location": first.location, "time": first.time_text, "actor": first.actor, "text": first.text[:2000]},
        "stall": None
        if explanation.stall is None
        else {
            "location": f"{explanation.stall.last.source}:{explanation.stall.last.line_number}",
            "text": explanation.stall.last.text[:2000],
            "lines_after": explanation.stall.lines_after,
        },
        "timeouts": None
        if explanation.waited is None
        else {
            "sequence": explanation.waited.sequence,
            "operation": explanation.waited.operation,
            "ranks": list(explanation.waited.ranks),
            "silent_ranks": list(explanation.waited.silent),
            "first_location": f"{explanation.waited.first.source}:{explanation.waited.first.line_number}",
        },
        "separate_tests": None
        if explanation.separate_tests is None
        else {"location": explanation.separate_tests.location, "meaning": SEPARATE_TESTS},
        "candidates": [_candidate_json(p, c, explanation) for p, c in enumerate(explanation.candidates, 1)],
        "settings_seen": explanation.settings_seen,
        "check_error": explanation.check_error,
        "related_on_node": [
            {
                "id": related.reference_id,
                "title": explanation.references[related.reference_id].title,
                "symptoms": list(related.symptoms),
                "findings": [finding.to_json() for finding in related.findings],
                "fix": list(explanation.references[related.reference_id].fix),
            }
            for related in explanation.related_on_node
        ],
    }
    return json.dumps(document, indent=2) + "\n"


def _candidate_json(position: int, candidate: Candidate, explanation: Explanation) -> dict[str, Any]:
    reference = explanation.references[candidate.reference_id]
    verdict = explanation.verdicts.get(candidate.reference_id)
    return {
        "rank": position,
        "id": reference.id,
        "symbol": reference.symbol,
        "title": reference.title,
        "severity": reference.severity.value,
        "tier": candidate.tier,
        "score": candidate.score,
        "synthesized": candidate.synthesized,
        "lines": candidate.hits.lines,
        "actors": len(candidate.hits.actors),
        "on_first_failing_actor": candidate.on_first_actor,
        "evidence_lines": [
            {"location": e.location, "time": e.time_text, "actor": e.actor, "role": e.role, "signature": e.signature, "text": e.text[:2000]}
            for e in candidate.hits.examples
        ],
        "why_candidate": why_candidate(candidate, explanation),
        "checks": list(reference.checks),
        "no_check_reason": "" if reference.checks else reference.why_log_only,
        "verdict": None
        if verdict is None
        else {"status": verdict.status, "reason": verdict.reason, "findings": [f.to_json() for f in verdict.findings]},
        "evidence": [dict(item) for item in reference.evidence],
        "fix": list(reference.fix),
        "related": list(reference.related),
    }
