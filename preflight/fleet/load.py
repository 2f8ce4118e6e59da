"""Read ``preflight node --format json`` reports as untrusted input.

A fleet audit reads files fetched from many hosts; any of them can be truncated, hand-edited,
from a newer preflight, or hostile. Each file is read under a size cap (a regular file only: a
FIFO or a device would block or never end), parsed with the standard library's JSON parser
(whose nesting limit turns ``[[[[...`` into an error, and whose digit limit turns a 10,000-digit
integer into one), and checked for the few fields the audit relies on. A file that fails any
step becomes a :class:`Skipped` entry naming the file and the reason, never an exception.

Facts are not kept: each report's compared values are extracted as soon as it is parsed (see
:mod:`preflight.fleet.facts`), so memory grows with the number of nodes, not with report size.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import stat
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any, cast

from msgspec import Struct

from preflight.fleet import shape
from preflight.fleet.facts import FACTS, FactsView, HardwareClass, extract_all, facts_of, hardware_class
from preflight.fleet.shape import EVIDENCE_CAP, SUBJECT_CAP, TEXT_CAP, EvidenceLine, NodeFinding, SeverityValue, StatusValue
from preflight.model import REFERENCE_ID, SYMBOL, Severity, Status

REPORT_SCHEMA = "preflight-report/1"
#: A full report of an 8-GPU, 8-HCA node is about 40 KB; 16 MiB leaves room for very large
#: nodes while keeping one hostile file from costing gigabytes once parsed.
MAX_REPORT_BYTES = 16 * 1024 * 1024
#: Reports read in one comparison: the largest GPU fleets run some tens of thousands of nodes.
MAX_REPORTS = 200_000
#: Host names as the kernel and DNS allow them; anything else (a "/", "..", a control character,
#: an escape sequence meant for the terminal that shows the fleet table) is refused.
HOST_NAME = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9._-]{0,252})\Z")  # \Z: "$" would let a final newline through
#: How a fleet names its nodes: by the host name each report gives, or by the report's file name
#: less ".json" (the Ansible role saves each report under the host's inventory name, which is
#: how its operators know the node, and which differs from the host name on many fleets).
NODE_NAMES = ("host", "file")
#: Only the findings a fleet report shows are kept; absent and not_applicable ones are counted.
_KEPT = frozenset((Status.PRESENT.value, Status.UNKNOWN.value))
_SEVERITIES = frozenset(s.value for s in Severity)
_STATUSES = frozenset(s.value for s in Status)
_COUNTED_ONLY = _STATUSES - _KEPT
_STATUS_ORDER = tuple(sorted(_STATUSES))


class ReportError(Exception):
    """This file cannot be used as a node report; the message says why."""


class FleetDocument(ReportError):
    """The file is a fleet report (an earlier ``preflight fleet --output``), not a node report."""


#: What a fleet report's own ``schema`` starts with (preflight-fleet/1).
FLEET_SCHEMA_PREFIX = "preflight-fleet/"


class Skipped(Struct, frozen=True):
    file: str
    reason: str
    # A second report for a node already read: the worst severity present in it, which the exit
    # code keeps (which report is current cannot be told, so neither may hide the other's finding).
    duplicate_worst: str = ""
    fleet_document: bool = False  # an earlier fleet report: left out when a directory listed it



#: What one node shows for one reference, less the host: (worst severity, subjects, detail), where
#: detail is evidence ("observed (expected ...)") for present findings and reasons for unknown.
MentionBody = tuple[str, tuple[str, ...], tuple[str, ...]]
#: What one node shows for one reference: (reference ID, status, symbol, title, body). Plain
#: tuples: a worker sends tens of thousands of them back to the parent.
Mention = tuple[str, str, str, str, MentionBody]
#: Severity value -> rank, without building an enum member per finding.
SEVERITY_RANK = {severity.value: severity.rank for severity in Severity}


class NodeReport(Struct, frozen=True):
    """What the audit keeps of one node's report."""

    name: str  # the node's name throughout the fleet report (see NODE_NAMES)
    host: str  # the host name the report gives
    file: str
    profile: str
    tool_version: str
    counts: dict[str, int]  # findings by status
    mentions: tuple[Mention, ...]  # one per reference present or unknown here
    expectations: tuple[tuple[str, str, str], ...]  # (reference ID, observed, expected): see FACTS
    hardware: HardwareClass
    values: dict[str, str | None]  # fact key -> canonical value, None when unknown
    failed_probes: dict[str, str]  # probe name -> why it gave no facts
    started_at: float | None = None  # when the report's run started (seconds since the epoch), None if not given


def report_paths(inputs: Sequence[str]) -> tuple[list[str], list[Skipped], set[str]]:
    """Files named on the command line, and the ``*.json`` files directly inside named
    directories (sorted, so the audit does not depend on directory order), each file once however
    often it is reached (a directory and a file in it, ``.`` and ``./x.json``); and which of them
    only a directory listed."""
    paths: list[str] = []
    skipped: list[Skipped] = []
    listed: set[str] = set()
    seen: set[object] = set()

    def add(path: str, from_directory: bool) -> None:
        identity = file_identity(path)
        if identity in seen:
            return
        seen.add(identity)
        paths.append(path)
        if from_directory:
            listed.add(path)

    for item in inputs:
        if os.path.isdir(item):
            try:
                names = sorted(os.listdir(item))
            except OSError as error:
                skipped.append(Skipped(item, f"cannot list the directory: {error.strerror or error}"))
                continue
            for name in names:
                if name.endswith(".json"):
                    add(os.path.join(item, name), True)
        else:
            add(item, False)
    if len(paths) > MAX_REPORTS:
        # One line for the rest, not one per file: their names are known, their content is not.
        more = len(paths) - MAX_REPORTS - 1
        also = f", nor are {more} more after it in name order" if more else ""
        skipped.append(Skipped(paths[MAX_REPORTS], f"not read: over the {MAX_REPORTS}-report limit{also}"))
        del paths[MAX_REPORTS:]
    return paths, skipped, listed


def file_identity(path: str) -> object:
    """What makes two names one file: device and inode, or the resolved path where the file
    cannot be looked at (it is then skipped with the reason when read)."""
    try:
        status = os.stat(path)
    except (OSError, ValueError):
        return os.path.realpath(path)
    return (status.st_dev, status.st_ino)


def read_capped(path: str, max_bytes: int) -> bytes:
    """The bytes of a regular file of at most ``max_bytes``; ReportError otherwise."""
    try:
        # O_NONBLOCK: opening a FIFO planted under a report's name must not wait for a writer.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as error:
        raise ReportError(f"cannot open: {error.strerror or error}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ReportError("not a regular file")
        if info.st_size > max_bytes:
            raise ReportError(f"{info.st_size} bytes, over the {max_bytes}-byte limit for a report")
        # One read for the whole file: a short read of a regular file means its end. Asking one
        # byte more than its size tells whether it grew since (or is a /proc file, size 0).
        first = os.read(fd, info.st_size + 1)
        if len(first) <= info.st_size:
            return first
        chunks: list[bytes] = [first]
        total = len(first)
        while True:  # the file may grow or shrink after fstat: keep to the cap whatever it does
            chunk = os.read(fd, min(1 << 20, max_bytes + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
            if total > max_bytes:
                raise ReportError(f"over the {max_bytes}-byte limit for a report")
        return b"".join(chunks)
    except OSError as error:
        raise ReportError(f"cannot read: {error.strerror or error}") from None
    finally:
        os.close(fd)


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


_MAX_INT_DIGITS = 4300  # Python 3.11's default limit; int() of longer strings is quadratic


def _bounded_int(digits: str) -> int:
    if len(digits) > _MAX_INT_DIGITS:
        raise ValueError(f"an integer of {len(digits)} digits")
    return int(digits)


# Python >= 3.11 enforces the digit limit in C; older ones need the (slower) Python-level hook.
_PARSE_INT = None if hasattr(sys, "get_int_max_str_digits") else _bounded_int


# Module attributes, looked up on each call, so that tests can send every report down the
# careful path (the standard parser, then load.py's own checks).
_FAST_PARTS: Callable[[bytes], Any] | None = shape.decode_report_parts
_FAST_LOADS: Callable[[bytes], Any] | None = shape.decode_any


def parse_json(data: bytes) -> Any:
    """The whole document. A file the fast decoder refuses goes to the standard parser, whose
    refusal names what is wrong (the same words whichever decoder is installed)."""
    if _FAST_LOADS is not None:
        try:
            return _FAST_LOADS(data)
        except shape.DECODE_FAILURES:
            pass
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ReportError(f"not UTF-8 (byte {error.start})") from None
    try:
        return json.loads(text, parse_constant=_no_constants, parse_int=_PARSE_INT)
    except RecursionError:
        raise ReportError("not JSON: nested too deeply") from None
    except ValueError as error:  # JSONDecodeError, integer digit limit, NaN/Infinity
        raise ReportError(f"not JSON: {str(error)[:200]}") from None


def parse_report(data: bytes) -> Any:
    """The parts of a report the audit reads (:mod:`preflight.fleet.shape`); the whole document
    when they do not have the declared shape, so that the audit judges it as it would anyway."""
    if _FAST_PARTS is not None:
        try:
            return _FAST_PARTS(data)
        except shape.DECODE_FAILURES:
            pass
    return parse_json(data)


def _text(value: Any, where: str, cap: int = TEXT_CAP) -> str:
    if not isinstance(value, str):
        raise ReportError(f"{where}: expected a string, got {type(value).__name__}")
    return value[:cap]


def _finding(item: Any, where: str) -> NodeFinding | str:
    """A kept finding, or the status of one that is counted only."""
    if not isinstance(item, dict):
        raise ReportError(f"{where}: expected an object")
    status = item.get("status")
    if not isinstance(status, str) or status not in _STATUSES:  # a list is not even hashable
        raise ReportError(f"{where}.status: {_shown(status)} is not one of {', '.join(sorted(_STATUSES))}")
    ref_id = item.get("id")
    if not isinstance(ref_id, str) or not REFERENCE_ID.match(ref_id):
        raise ReportError(f"{where}.id: {_shown(ref_id)} is not a reference ID")
    if status not in _KEPT:
        return str(status)
    severity = item.get("severity")
    if not isinstance(severity, str) or severity not in _SEVERITIES:
        raise ReportError(f"{where}.severity: {_shown(severity)} is not one of {', '.join(sorted(_SEVERITIES))}")
    symbol = item.get("symbol")
    if not isinstance(symbol, str) or not SYMBOL.match(symbol):
        raise ReportError(f"{where}.symbol: {_shown(symbol)} is not a reference symbol")
    evidence_items = item.get("evidence", [])
    if not isinstance(evidence_items, list):
        raise ReportError(f"{where}.evidence: expected a list")
    evidence = []
    for number, line in enumerate(evidence_items[:EVIDENCE_CAP]):
        if not isinstance(line, dict):
            raise ReportError(f"{where}.evidence[{number}]: expected an object")
        evidence.append(EvidenceLine(
            source=_text(line.get("source", ""), f"{where}.evidence[{number}].source"),
            observed=_text(line.get("observed", ""), f"{where}.evidence[{number}].observed"),
            expected=_text(line.get("expected", ""), f"{where}.evidence[{number}].expected"),
        ))
    return NodeFinding(
        id=ref_id,
        symbol=symbol,
        title=_text(item.get("title", ""), f"{where}.title"),
        status=cast(StatusValue, status),  # checked against Status above
        severity=cast(SeverityValue, severity),
        subject=_text(item.get("subject", ""), f"{where}.subject", SUBJECT_CAP),
        reason=_text(item.get("reason", ""), f"{where}.reason"),
        evidence=tuple(evidence),
    )


def _shown(value: Any) -> str:
    """A short, printable rendering of an untrusted value for an error message."""
    text = ascii(value) if isinstance(value, str) else type(value).__name__
    return text if len(text) <= 80 else text[:77] + "..."


def _failed_probes(probes: Any) -> dict[str, str]:
    failed: dict[str, str] = {}
    if not isinstance(probes, list):
        return failed
    for probe in probes:
        if isinstance(probe, dict) and probe.get("status") != "ok" and isinstance(probe.get("name"), str):
            error = probe.get("error")
            failed[probe["name"][:100]] = (error if isinstance(error, str) else str(probe.get("status")))[:300]
    return failed


#: Reports of one fleet repeat the same findings and fact values node after node. A worker keeps
#: one object per distinct value (bounded, so a hostile set of reports cannot grow it without
#: limit): equal findings become one object, whose mention is worked out once, and identical
#: objects pickle once per chunk on their way back to the parent.
_CACHE_LIMIT = 20_000
_interned: dict[Any, Any] = {}


def _intern(value: Any) -> Any:
    if len(_interned) < _CACHE_LIMIT:
        return _interned.setdefault(value, value)
    return _interned.get(value, value)


class _Careful(Exception):
    """The fast decoder's findings hold something the careful path must judge (and name)."""


_valid_ids: set[str] = set()
_valid_symbols: set[str] = set()


def _valid(value: str, pattern: re.Pattern[str], known: set[str]) -> bool:
    if value in known:
        return True
    if not pattern.match(value):
        return False
    if len(known) < _CACHE_LIMIT:
        known.add(value)
    return True


def _findings(findings_in: list[Any]) -> tuple[dict[str, int], tuple[NodeFinding, ...]]:
    """Counts by status and the kept (present and unknown) findings. The fast decoder gives
    :class:`NodeFinding` objects, whose types it checked; the careful path gives JSON objects,
    which :func:`_finding` checks one by one (raising ReportError for a bad one)."""
    counts = dict.fromkeys(_STATUS_ORDER, 0)
    kept: list[NodeFinding] = []
    for number, item in enumerate(findings_in):
        if type(item) is not NodeFinding:
            finding = _finding(item, f"findings[{number}]")
            if isinstance(finding, str):  # counted only
                counts[finding] += 1
                continue
        elif not _valid(item.id, REFERENCE_ID, _valid_ids):
            raise _Careful
        else:
            finding = item
        status = finding.status
        counts[status] += 1
        if status in _KEPT:
            if not _valid(finding.symbol, SYMBOL, _valid_symbols):
                raise _Careful
            kept.append(_intern(finding))
    return counts, tuple(kept)


#: Subjects one node's mention of one reference keeps (GPUs, ports, interfaces: a node has tens).
SUBJECTS_PER_MENTION = 64
#: Mention bodies by the ids of the findings they were worked out from (the cache holds the
#: findings, so their ids cannot be reused meanwhile).
_bodies: dict[tuple[int, ...], tuple[tuple[NodeFinding, ...], MentionBody]] = {}


def _mention_body(findings: Sequence[NodeFinding]) -> MentionBody:
    worst = max((f.severity for f in findings), key=SEVERITY_RANK.__getitem__)
    detail = []
    for finding in findings:
        if finding.status == Status.UNKNOWN.value:
            detail.append(finding.reason or "no reason given")
        else:
            detail.extend(
                line.observed + (f" (expected {line.expected})" if line.expected else "") for line in finding.evidence[:2]
            )
    subjects = tuple(dict.fromkeys(f.subject for f in findings))
    if len(subjects) > SUBJECTS_PER_MENTION:
        # a hostile report of 150,000 subjects must not keep them all for the whole audit
        subjects = (*subjects[:SUBJECTS_PER_MENTION], f"... and {len(subjects) - SUBJECTS_PER_MENTION} more")
    return worst, subjects, tuple(dict.fromkeys(detail))[:5]


def _body(items: Sequence[NodeFinding]) -> MentionBody:
    key = tuple(map(id, items))
    cached = _bodies.get(key)
    if cached is not None:
        return cached[1]
    body = _mention_body(items)
    if len(_bodies) < _CACHE_LIMIT:
        _bodies[key] = (tuple(items), body)
    return body


def _mentions(kept: tuple[NodeFinding, ...]) -> tuple[Mention, ...]:
    """One mention per reference (and status) this node has findings of. The findings are
    mostly the interned objects node after node, so a body is worked out once per distinct group
    of them; the shared bodies also pickle once per chunk on the way back."""
    if len({(f.id, f.status) for f in kept}) == len(kept):  # the common case: one finding each
        return tuple((f.id, f.status, f.symbol, f.title, _body((f,))) for f in kept)
    grouped: dict[tuple[str, str], list[NodeFinding]] = {}
    for finding in kept:
        grouped.setdefault((finding.id, finding.status), []).append(finding)
    return tuple((ref_id, status, items[0].symbol, items[0].title, _body(items)) for (ref_id, status), items in grouped.items())


#: References whose present findings state, in their evidence's "expected", what the site
#: expects of a compared fact (shown beside the comparison).
_STATING = frozenset(ref for fact in FACTS for ref in fact.references)


def _expectations(kept: tuple[NodeFinding, ...]) -> tuple[tuple[str, str, str], ...]:
    return tuple(
        (finding.id, line.observed, line.expected)
        for finding in kept if finding.id in _STATING and finding.status == Status.PRESENT.value
        for line in finding.evidence if line.expected
    )


def file_node_name(file: str) -> str:
    """The node name a report's file name gives (``reports/gpu001.json`` -> ``gpu001``)."""
    name = os.path.basename(file)
    name = name[:-len(".json")] if name.endswith(".json") else name
    if not HOST_NAME.match(name):
        raise ReportError(f"file name {_shown(name)} is not a plain node name (letters, digits, '.', '-', '_')")
    return name


def node_report(document: Any, file: str, node_names: str = "host") -> NodeReport:
    """Check the parsed document and keep what the audit needs; ``node_names`` is one of
    :data:`NODE_NAMES`."""
    if not isinstance(document, dict):
        raise ReportError("not a preflight node report (the top level is not an object)")
    schema = document.get("schema")
    if schema is None:
        raise ReportError("not a preflight node report (no \"schema\" field)")
    if isinstance(schema, str) and schema.startswith(FLEET_SCHEMA_PREFIX):
        raise FleetDocument(f"a fleet report ({_shown(schema)}), not a node report")
    if schema != REPORT_SCHEMA:
        raise ReportError(f"report schema {_shown(schema)} is not supported (this preflight reads {REPORT_SCHEMA})")
    host = document.get("host")
    if not isinstance(host, str) or not HOST_NAME.match(host):
        raise ReportError(f"host {_shown(host)} is not a plain host name (letters, digits, '.', '-', '_')")
    findings_in = document.get("findings")
    if not isinstance(findings_in, list):
        raise ReportError("\"findings\" is not a list")
    counts, kept = _findings(findings_in)
    facts = document.get("facts")
    if isinstance(facts, dict):
        facts = facts_of(facts)  # the careful path: each probe's facts decoded on their own
    elif not isinstance(facts, FactsView):
        raise ReportError("\"facts\" is not an object")
    tool = document.get("tool")
    version = tool.get("version") if isinstance(tool, dict) else None
    profile = document.get("profile")
    values = extract_all(facts, FACTS)
    return NodeReport(
        name=file_node_name(file) if node_names == "file" else host,
        host=host,
        file=file,
        profile=profile if profile in ("prolog", "full") else "unknown",
        tool_version=_intern(version[:50]) if isinstance(version, str) else "unknown",
        counts=counts,
        mentions=_mentions(kept),
        expectations=_expectations(kept),
        hardware=_intern(hardware_class(facts)),
        values={key: _intern(value) for key, value in values.items()},
        failed_probes=_failed_probes(document.get("probes")),
        started_at=_started_at(document.get("started_at")),
    )


def _started_at(value: Any) -> float | None:
    """A report's start time when it is a plain finite number of seconds."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not -1e12 < value < 1e12:
        return None
    return float(value)


def report_from_bytes(data: bytes, file: str, node_names: str = "host") -> NodeReport:
    """The audit's view of one report file's bytes; ReportError when it cannot be used."""
    try:
        return node_report(parse_report(data), file, node_names)
    except _Careful:  # an ID or symbol the fast path will not vouch for: judge the whole document
        return node_report(parse_json(data), file, node_names)


def load_report(path: str, max_bytes: int = MAX_REPORT_BYTES, node_names: str = "host") -> NodeReport:
    return report_from_bytes(read_capped(path, max_bytes), path, node_names)


def _load_one(job: tuple[str, int, str]) -> NodeReport | Skipped:
    path, max_bytes, node_names = job
    try:
        return load_report(path, max_bytes, node_names)
    except ReportError as error:
        return Skipped(path, str(error), fleet_document=isinstance(error, FleetDocument))


#: Parsing is CPU-bound (about 1 ms of CPU for a full 40 KB report): from this many files on,
#: forked workers share them out. Results come back in input order, so the outcome is the same.
PARALLEL_AFTER_FILES = 256


def worker_count(files: int, workers: int | None = None) -> int:
    """How many processes load ``files`` reports: one per CPU this process may run on (at most
    8), or only this one for a few files."""
    if files < PARALLEL_AFTER_FILES:
        return 1
    if workers is not None:
        return workers
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return min(cpus, 8)


def _load_many(paths: list[str], max_bytes: int, workers: int | None, node_names: str) -> list[NodeReport | Skipped]:
    jobs = [(path, max_bytes, node_names) for path in paths]
    count = worker_count(len(jobs), workers)
    if count > 1:
        try:
            pool = multiprocessing.get_context("fork").Pool(count)
        except (OSError, ValueError, ImportError):  # no fork, no /dev/shm: load them here
            pool = None
        if pool is not None:
            try:
                return pool.map(_load_one, jobs, chunksize=max(1, min(64, len(jobs) // (count * 4))))
            finally:
                pool.terminate()
    return [_load_one(job) for job in jobs]


def worst_present(report: NodeReport) -> str:
    """The worst severity among the report's present findings; "" when none is present."""
    present = [body[0] for _ref_id, status, _symbol, _title, body in report.mentions if status == Status.PRESENT.value]
    return max(present, key=lambda severity: SEVERITY_RANK.get(severity, 0), default="")


def load_reports(
    inputs: Iterable[str], max_bytes: int = MAX_REPORT_BYTES, workers: int | None = None, node_names: str = "host"
) -> tuple[list[NodeReport], list[Skipped]]:
    """Every usable report, and every file skipped with the reason (a fleet report a directory
    holds is left out, not skipped). Of two reports for one node
    the one that says it started later is compared (the first read when either does not say);
    the other is skipped and keeps its worst finding in the exit code (``duplicate_worst``)."""
    paths, skipped, listed = report_paths(list(inputs))
    reports: list[NodeReport] = []
    kept_at: dict[str, int] = {}  # node name -> index in reports
    what = "host" if node_names == "host" else "node"
    for report in _load_many(paths, max_bytes, workers, node_names):
        if isinstance(report, Skipped):
            # A fleet report saved beside the node reports it compared is no node's: a directory
            # that holds one is read as if it did not (named on its own, it is skipped and counted).
            if not (report.fleet_document and report.file in listed):
                skipped.append(report)
            continue
        index = kept_at.get(report.name)
        if index is None:
            kept_at[report.name] = len(reports)
            reports.append(report)
            continue
        kept = reports[index]
        if _newer(report, kept):
            reports[index], report, kept = report, kept, report
        reason = f"a second report for {what} {report.name}, not the newer one (kept: {kept.file})"
        skipped.append(Skipped(report.file, reason, worst_present(report)))
    return reports, skipped


def _newer(report: NodeReport, kept: NodeReport) -> bool:
    """``report`` started after ``kept``, both saying when; otherwise the first read stays."""
    return report.started_at is not None and kept.started_at is not None and report.started_at > kept.started_at
