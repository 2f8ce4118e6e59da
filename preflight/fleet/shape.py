"""The parts of a node report that a fleet audit reads, as types for the fast decoder.

A report is about 95 KB of JSON for an 8-GPU, 8-HCA node, and the audit reads perhaps a tenth of
it: the findings without their fixes, each probe's status, and the facts that :data:`FACTS
<preflight.fleet.facts.FACTS>` and the hardware class read. msgspec decodes only those parts (it
skips the rest without building Python objects for it), and decodes findings straight into
checked :class:`NodeFinding` objects: decoding is most of a 10,000-node audit's time.

The facts part is :data:`~preflight.fleet.facts.FactsView`, made from the probes' own fact types
and the fields the comparison table reads, so nothing here re-declares a fact. These types only
decide speed, never a verdict: a report that does not fit them (an object where a list is
declared, a finding with an unknown status, one probe's malformed facts) is decoded whole instead
and judged by the careful path in :mod:`preflight.fleet.load`, which names what is wrong or
leaves that probe's facts unknown. ``tests/fleet/test_fleet_shape.py`` audits every recorded report and many mutated ones
both ways and requires the same result.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal, TypedDict

import msgspec

from preflight.fleet.facts import FactsView

if TYPE_CHECKING:
    FactsViewType = Any  # made at run time from the probes' types: opaque to type checkers
else:
    FactsViewType = FactsView

#: Characters kept of one finding's title, reason or evidence field, and of its subject.
TEXT_CAP = 2000
SUBJECT_CAP = 200
#: Evidence lines kept of one finding.
EVIDENCE_CAP = 50

_Text = Annotated[str, msgspec.Meta(max_length=TEXT_CAP)]
#: preflight.model.Status and Severity values (a test keeps them equal).
StatusValue = Literal["present", "absent", "unknown", "not_applicable"]
SeverityValue = Literal["critical", "error", "warning", "info"]


# Findings decode straight into the audit's own objects: the decoder checks every type, status
# and severity in C. A finding outside these types (or longer than the caps, which the careful
# path in load.py shortens) sends the report to the careful path, which says what is wrong.

class EvidenceLine(msgspec.Struct, frozen=True, kw_only=True):
    source: _Text = ""
    observed: _Text = ""
    expected: _Text = ""


class NodeFinding(msgspec.Struct, frozen=True, kw_only=True):
    """A finding of one node, as its report gave it (the fix is not read). Frozen, so hashable:
    the workers keep one object per distinct finding."""

    id: str  # load.py matches IDs and symbols: a pattern here would double the decoding time
    symbol: str
    status: StatusValue
    severity: SeverityValue
    title: _Text = ""
    subject: Annotated[str, msgspec.Meta(max_length=SUBJECT_CAP)] = ""
    reason: _Text = ""
    evidence: Annotated[tuple[EvidenceLine, ...], msgspec.Meta(max_length=EVIDENCE_CAP)] = ()


class ProbeShape(TypedDict, total=False):
    name: Any
    status: Any
    error: Any


class ReportShape(TypedDict, total=False):
    schema: Any
    host: Any
    tool: Any
    profile: Any
    started_at: Any
    findings: list[NodeFinding]
    probes: list[ProbeShape]
    facts: FactsViewType  # the probes' own fact types, narrowed to what the audit reads


#: What a refused input raises: msgspec.DecodeError and ValidationError are MsgspecErrors; deep
#: nesting raises RecursionError.
DECODE_FAILURES: tuple[type[BaseException], ...] = (msgspec.MsgspecError, RecursionError)
#: A report's parts the audit reads, findings as :class:`NodeFinding`, facts as :data:`FactsView`.
decode_report_parts = msgspec.json.Decoder(ReportShape).decode
#: Any JSON document, whole.
decode_any = msgspec.json.Decoder().decode
#: Compact JSON (dataclasses and Structs as objects, fields in order); TypeError or ValueError
#: (a lone surrogate) for what it cannot write.
encode = msgspec.json.encode
