"""``explain --check``: ask the node whether each candidate's cause is really there.

A log line only says a failure happened. The checks in a candidate's ``detect.checks`` look
at the node (this one, or a recorded root) for the misconfiguration itself; one engine run
covers every candidate, and each candidate becomes confirmed (a check found it at error or
above), refuted (every check ran and found nothing) or undecided (no check covers it, a check
could not reach a verdict, it found only warnings or information, or the checks found nothing
but test only some of the reference's causes: ``[detect] tests_only``). A warning is a finding
its check itself calls no fault on its own (persistence mode off, a limit that is this shell's
and not the jobs'): shown beside the candidate, it does not confirm a cause the log names.

A symptom candidate (a watchdog timeout, "unhandled system error") asks for an earlier cause the
log may never print: the same run also covers the checks of the references each symptom lists as
related, and those the node shows become :class:`RelatedOnNode` entries, apart from the ranking.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from preflight.model import Finding, Reference, Severity, Status
from preflight.sources import NodeFS, SourceError


@dataclass
class Verdict:
    status: str  # confirmed | refuted | undecided
    reason: str
    findings: list[Finding] = field(default_factory=list)

    @property
    def harmful(self) -> bool:
        """The checks found something at warning or above: a confirmation, or the warnings that
        leave a candidate undecided (enough to name a related reference a symptom points at)."""
        return any(f.status is Status.PRESENT and f.severity.rank > Severity.INFO.rank for f in self.findings)


@dataclass
class RelatedOnNode:
    """A reference no log line names, whose checks found it on the node, and that the catalogue
    relates to a symptom the log does show: the earlier cause a symptom tells the reader to find."""

    reference_id: str
    symptoms: tuple[str, ...]  # the symptom candidates that list it as related
    findings: list[Finding]


class NodeCheckError(Exception):
    """The node could not be checked at all (bad root, broken config or plugin)."""


@dataclass
class NodeFindings:
    """What one engine run on the node found, by reference ID, and whether the environment its
    checks read (``/proc/self/environ``: this process's on the live node, the recorded one in a
    root or snapshot) is a job's; False where it is not or could not be read."""

    by_reference: dict[str, list[Finding]]
    read_a_job: bool


def node_findings(
    check_ids: set[str], root: str, config_path: str | None, checks_dirs: tuple[str, ...] = ()
) -> NodeFindings:
    """Run exactly ``check_ids`` on ``root`` (a directory, or a snapshot archive) with the full
    profile."""
    from preflight.catalogue import CatalogueError
    from preflight.config import ConfigError
    from preflight.registry import RegistrationError
    from preflight.run import NothingToRun, inspect_node, open_node, unpack_budget
    from preflight.sources import RootError
    from preflight.sources.archive import ArchiveError, opened_root

    if not check_ids:
        return NodeFindings({}, False)
    try:
        # A snapshot archive (preflight snapshot) is replayed as `preflight node --root` does.
        with opened_root(root, time.monotonic() + unpack_budget(root, None, config_path)) as (directory, _label):
            node = open_node(directory, config_path)
            read_a_job = _environ_is_a_jobs(node.fs)
            report = inspect_node(node, profile="full", select=tuple(sorted(check_ids)), checks_dirs=checks_dirs)
    except NothingToRun:
        return NodeFindings({}, False)
    except (RootError, ConfigError, RegistrationError, CatalogueError, ArchiveError) as error:
        raise NodeCheckError(str(error)) from None
    by_reference: dict[str, list[Finding]] = {}
    for finding in report.findings:
        by_reference.setdefault(finding.reference_id, []).append(finding)
    return NodeFindings(by_reference, read_a_job)


def _environ_is_a_jobs(fs: NodeFS) -> bool:
    """The environment the job probe reads on ``fs`` belongs to a job's process."""
    from preflight.probes.job import in_job_process, parse_environ

    try:
        data = fs.read_bytes("/proc/self/environ")
    except SourceError:
        return False
    return data is not None and in_job_process(parse_environ(data))


def related_to_symptoms(candidates: list[tuple[str, str]], references: dict[str, Reference]) -> dict[str, tuple[str, ...]]:
    """The checked references that the symptom candidates (``(id, tier)`` pairs, best first) list
    as related, leaving out those whose checks a candidate's verdict already shows: reference ID
    -> those symptoms, in the catalogue's order."""
    named = {ref_id for ref_id, _tier in candidates}
    shown = {check for ref_id in named for check in references[ref_id].checks}
    related: dict[str, list[str]] = {}
    for symptom in (ref_id for ref_id, tier in candidates if tier == "symptom"):
        for ref_id in references[symptom].related:
            reference = references.get(ref_id)
            if reference is not None and reference.checks and ref_id not in named and not set(reference.checks) <= shown:
                related.setdefault(ref_id, []).append(symptom)
    return {ref_id: tuple(symptoms) for ref_id, symptoms in related.items()}


def related_found(
    related: dict[str, tuple[str, ...]], findings: dict[str, list[Finding]], references: dict[str, Reference], job_reading: set[str] | None = None
) -> list[RelatedOnNode]:
    """The ``related`` references (from :func:`related_to_symptoms`) whose checks found them on the
    node, the most severe first. ``job_reading`` (the live node outside the job: the checks that
    read this shell's settings instead of the job's) leaves out a reference any of those checks
    decide: no log line stands behind it, and its evidence would describe the wrong process."""
    found = {ref_id: verdict for ref_id in related if (verdict := verdict_for(references[ref_id], findings)).harmful}
    if job_reading is not None:
        found = {ref_id: verdict for ref_id, verdict in found.items() if not set(references[ref_id].checks) & job_reading}
    # sorted() keeps the catalogue's order of relations among findings of one severity
    order = sorted(found, key=lambda ref_id: -max(f.severity.rank for f in found[ref_id].findings))
    return [RelatedOnNode(ref_id, related[ref_id], found[ref_id].findings) for ref_id in order]


def verdict_for(reference: Reference, findings: dict[str, list[Finding]]) -> Verdict:
    if not reference.checks:
        return Verdict("undecided", "no node check decides this reference; collect the evidence below by hand")
    results = [finding for check in reference.checks for finding in findings.get(check, [])]
    present = [f for f in results if f.status is Status.PRESENT]
    # An info-level finding is a note, not a misconfiguration (NET005's deliberate NCCL_SOCKET_IFNAME
    # on a separate data network): it neither confirms the candidate nor rules it out.
    faults = [f for f in present if f.severity.rank >= Severity.ERROR.rank]
    if faults:
        return Verdict("confirmed", "the node shows the misconfiguration", faults)
    warnings = [f for f in present if f.severity.rank > Severity.INFO.rank]
    if warnings:
        return Verdict("undecided", "the node checks found only warnings, which by themselves do not cause this failure", warnings)
    if present:
        notes = "; ".join(f"{f.subject}: {f.evidence[0].observed}" if f.evidence else f.subject for f in present[:3])
        return Verdict("undecided", f"the node checks noted only information, no misconfiguration ({notes})", present)
    ran = {f.reference_id for f in results}
    if ran == set(reference.checks) and all(f.status is Status.ABSENT for f in results):
        if reference.tests_only:
            # A clean result rules out only what the checks test; the log's cause may be another.
            return Verdict("undecided", f"the node checks test only {reference.tests_only}, and found none of it", results)
        return Verdict("refuted", "the node checks found no sign of it; look at the next candidate", results)
    reasons = [f"{f.reference_id}: {f.status.value}" + (f" ({f.reason})" if f.reason else "") for f in results if f.status is not Status.ABSENT]
    missing = [check for check in reference.checks if check not in findings]
    reasons += [f"{check}: did not run" for check in missing]
    return Verdict("undecided", "; ".join(reasons) or "the checks did not run", results)


#: The probes whose facts depend on the environment preflight runs in (/proc/self/environ): the
#: job's settings and nccl.conf (job), who the job runs as (rdma, gpudirect, memlock), its library
#: and Python paths (nccl_libs, frameworks, efa, verbs), its slurm.conf (nccl_platform), its
#: rendezvous address (hostname). tests/explain holds the list to every probe that reads it.
JOB_PROBES = frozenset({"job", "rdma", "gpudirect", "memlock", "nccl_libs", "frameworks", "efa", "verbs", "nccl_platform", "hostname"})


def checks_reading_the_job(check_ids: set[str], checks_dirs: tuple[str, ...] = ()) -> set[str]:
    """The checks among ``check_ids`` that judge the job's settings (they take a probe of
    :data:`JOB_PROBES`)."""
    from preflight.discovery import build_registry
    from preflight.registry import RegistrationError

    try:
        registry = build_registry(checks_dirs, select=tuple(sorted(check_ids)))
    except RegistrationError:
        return set(check_ids)  # cannot tell (the node run got past it moments ago): assume they all do
    return {ref_id for ref_id, spec in registry.checks.items() if ref_id in check_ids and JOB_PROBES & set(spec.probes)}


def outside_the_job(verdict: Verdict, reference: Reference, job_reading: set[str]) -> Verdict:
    """``verdict`` as it stands when the checks read an environment that is not the failed job's
    (the live node from a shell, a root or snapshot recorded outside a job): a check that read the
    job's settings read that process's instead, so neither its clean result nor what it found
    says anything about the job. A refutation by such checks, or a confirmation resting only on
    what that process itself showed (its environment, limits or credentials, /proc/self/...),
    becomes undecided, saying where to run it. Findings about the node (slurmd's limits, a
    module, /etc/nccl.conf, which every job reads) still confirm."""
    where = (
        "run --check inside the job's allocation (srun ... preflight explain --check) or on a snapshot taken there"
    )
    if verdict.status == "refuted" and set(reference.checks) & job_reading:
        return Verdict(
            "undecided",
            f"the node checks found no sign of it, but read the job's settings from an environment that is not the failed job's: {where}",
            verdict.findings,
        )
    if verdict.status == "confirmed" and verdict.findings and all(_read_from_this_process(finding) for finding in verdict.findings):
        return Verdict(
            "undecided",
            f"the node checks found it in the settings of an environment that is not the failed job's: {where}",
            verdict.findings,
        )
    return verdict


def _read_from_this_process(finding: Finding) -> bool:
    """The finding rests on something of the process the checks ran in (/proc/self/environ,
    limits, status), not of the node."""
    return any(evidence.source.startswith("/proc/self/") for evidence in finding.evidence)
