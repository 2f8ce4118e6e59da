"""Find catalogue signatures in chunks of log text, fast.

Every signature has required literals (see :mod:`preflight.signatures`). All literals of the
catalogue go into one regular expression shaped as a trie, so the regex engine walks a chunk
once, skipping every position whose byte cannot start a literal; only the few lines that
contain a literal are decoded and tried against the full signatures. On a log that is mostly
INFO noise this is what makes a million lines take seconds instead of minutes.

A hard-wrapped message (a shipper cutting lines at a fixed width) can split a signature over
two lines; when a line holds a literal but no signature matches it, the matcher also tries it
joined with its neighbours. A post wrapped at a fixed width, which cuts through literals too, is
unwrapped before the scan (:func:`preflight.explain.posts.unwrap_hard_wraps`); a long file a
program wrote is not, and a wrap there that cuts a literal still goes unseen.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Iterator

from msgspec import Struct

from preflight.catalogue import CatalogueError
from preflight.explain.combinations import MAX_KEYS, OBSERVATION_SIGNATURES, repeat_key, writer_span
from preflight.explain.posts import (
    RECORD_START,
    UNWRAP_MAX_BYTES,
    is_continuation,
    normalise,
    segments,
    undo_posting,
    unwrap_hard_wraps,
)
from preflight.explain.reader import MAX_LINE, Chunk
from preflight.model import Reference
from preflight.signatures import analyse

_MIN_WRAP_WIDTH = 60  # shorter lines are not the first half of a hard wrap
_MAX_GATE_STEPS = 512  # gate occurrences stepped through in one line before asking per gate


class Signature(Struct, frozen=True):
    reference_id: str
    number: int  # 1-based position in the reference file, for messages and JSON
    role: str
    pattern: re.Pattern[str]
    literals: tuple[str, ...]
    specificity: int  # see preflight.signatures.specificity: ranking prefers the higher
    # Printed only after, and because of, another failure (a tear-down notice, a launcher's report
    # of a worker that exited): read after another reference's failure line it adds nothing to its
    # reference's score (preflight.explain.analysis).
    after_failure: bool = False


@dataclass
class Hit:
    """One line that matched one signature."""

    signature: Signature
    source: str
    line_number: int
    text: str  # the whole line, colour codes removed


# Failures no reference describes still tell a cascade analysis who failed first: a rank that
# raised a Python exception before everyone else timed out is the rank to look at. These hits
# carry the empty reference ID and never become candidates.
TRACEBACK_HEADER = r"Traceback \(most recent call last\)"
EXCEPTION_LINE = r"(?:^|[\s:\]])(?:[A-Za-z_][\w.]{0,100}\.)?[A-Z]\w{0,60}(?:Error|Exception): \S"  # "ValueError: ..."
GENERIC_FAILURES = (
    TRACEBACK_HEADER,
    EXCEPTION_LINE,
    r"slurmstepd: error: \*\*\* (?:STEP|JOB) \S+ ON \S+ CANCELLED AT",  # time limit, scancel, node failure
    r"srun: error: \S+: tasks? [\d,-]+: (?:Exited with exit code|Killed|Terminated|Segmentation fault)",
    r"\] exits with return code = -?[1-9]\d{0,2}\b",  # DeepSpeed's launcher after a worker failed
    # A crash belongs to no one reference: many causes end in one, so it orders the cascade
    # and names the first failing line without pointing anywhere.
    r"Caught signal 11 \(Segmentation fault|Signal: Segmentation fault \(11\)|Fatal Python error: Segmentation fault",
    # The C++ runtime's last words when an exception escapes (std::terminate): the process aborts.
    r"terminate called after throwing an instance of '",
)
# Words of a failure, in any program's voice; NCCL uses them at INFO level for fallbacks it handled
# ("NET/Plugin: Failed to find ncclNetPlugin_v6 symbol"), so on an NCCL INFO line they name nothing.
FAILURE_WORDS = (
    r"\b(?:[Ff]ailed|FAILED|[Aa]borted|Killed|[Ii]nsufficient|[Uu]nable to|[Tt]imed out|Couldn't|Could not|Cannot|Can't"
    # strerror texts any program prints when a call failed, and the shell's "orted: command not found"
    r"|No such file or directory|Permission denied|Operation not permitted|No space left on device|Too many open files"
    r"|command not found)\b"
)
# Lines that say something went wrong without saying that this process failed (NCCL warns on
# healthy runs too). They never order a cascade; when nothing else failed, the first of them is
# the line ``explain`` names as uncatalogued instead of saying nothing.
GENERIC_WARNINGS = (
    r"NCCL WARN ",
    # NCCL's return-code trace ("NCCL INFO transport/net.cc:515 -> 2"): printed only when a call
    # returned an error, so a log of nothing but INFO lines still shows where it failed.
    r"\.cc:\d{1,5} -> [1-9]\d{0,2}\b",
    # torch.cuda's warning that the build has no kernels for this GPU: every CUDA call fails after it.
    r"is not compatible with the current PyTorch installation",
    # errno texts and loader/driver failures that mean a call failed whatever printed them
    r"\b(?:Connection refused|Connection reset by peer|No route to host|Network is unreachable|Address already in use)\b",
    r": undefined symbol: \S",
    r"\b[Oo]ut of memory\b",
    r"NVRM: Xid \(",
    r"\bnccl(?:UnhandledCuda|System|Internal|InvalidArgument|InvalidUsage|Remote)Error\b",
    r"\b(?:Segmentation fault|SIGSEGV|SIGABRT|SIGBUS|core dumped)\b",
    # UCX's backtrace header ("==== backtrace (tid: 123) ====", "==== backtrace ====" before 1.6):
    # printed by its error handler, so a post cut before "Caught signal" still shows a crash.
    r"==== backtrace(?: \(tid: *\d{1,10}\))? ====",
    r"\b(?:CUDA|NCCL|UCX|OFI|EFA|NET/\w+) ?(?:error|ERROR|failure)\b",
    r"(?:^|[\s\]:\[])(?:ERROR|FATAL|Fatal error|fatal error|error)\]?:? ",
    FAILURE_WORDS,
    r"\b(?:Error|Exception|WARN|Traceback)\b|\berror:",
    # A Python traceback's frame: printed only while an exception propagates, so a post that kept
    # the frames but lost the header and the exception line still shows where it failed.
    r'File "[^"\n]{1,400}", line \d{1,7}, in \S',
    # glog's error severity, as c10d writes it ("[E ProcessGroupGloo.cpp:138]", "[E1203 12:34:56.789
    # ProcessGroupNCCL.cpp:616]"): the line says an error even when its words do not.
    r"\[E(?:\d{4} \d\d:\d\d:\d\d\.\d{1,9})? ?\w[\w.]{0,80}\.cpp:\d{1,6}\]",
    r"\[E(?:\d{4} \d\d:\d\d:\d\d\.\d{1,9})? ?\w[\w.]{0,80}\.cc:\d{1,6}\]",
)


class Matcher:
    def __init__(self, references: Iterable[Reference]) -> None:
        self.signatures: list[Signature] = []
        by_literal: dict[str, list[Signature]] = {}
        generic = [("", number, {"pattern": p, "role": "symptom"}) for number, p in enumerate(GENERIC_FAILURES, 1)]
        generic += [("", number, {"pattern": p, "role": "context"}) for number, p in enumerate(GENERIC_WARNINGS, 101)]
        # Lines that mean something only together with others (preflight.explain.combinations).
        generic += [(kind, number, {"pattern": p, "role": "context"}) for number, (kind, p) in enumerate(OBSERVATION_SIGNATURES, 201)]
        catalogued = [(r.id, number, item) for r in references for number, item in enumerate(r.signatures, 1)]
        for reference_id, number, item in [*catalogued, *generic]:
            try:
                literals, specificity = analyse(item["pattern"])
                compiled = re.compile(item["pattern"])
            except re.error as error:
                raise CatalogueError(f"{reference_id}: signature #{number} does not compile: {error}") from None
            if not literals:
                raise CatalogueError(f"{reference_id}: signature #{number} has no required literal to scan for")
            signature = Signature(reference_id, number, item["role"], compiled, literals, specificity, bool(item.get("after_failure", False)))
            self.signatures.append(signature)
            for literal in literals:
                by_literal.setdefault(literal, []).append(signature)
        self._by_literal = by_literal
        self._observing = {id(s) for s in self.signatures if s.reference_id.startswith("~")}
        self._seen_keys: set[bytes] = set()
        self._quiet_keys: set[bytes] = set()  # see quiet_key
        self._literals_by_gate = _gates(list(by_literal))
        gates = sorted(self._literals_by_gate)
        self.gate = re.compile(_trie_pattern(gates)) if gates else None

    def scan(self, chunk: Chunk) -> Iterator[Hit]:
        """Every signature hit in ``chunk``, in line order."""
        if self.gate is None:
            return
        data = undo_posting(chunk.data)  # a link or a no-break space can split a literal: undone before the scan
        starts = None  # input line of each line of data, where a hard wrap was undone
        if chunk.first_line == 1 and len(data) <= UNWRAP_MAX_BYTES:
            unwrapped = unwrap_hard_wraps(data)
            if unwrapped is not None:
                data, starts = unwrapped
        lines_before = 0
        counted_to = 0
        position = 0
        while True:
            # One search per line that holds a gate; the rest of that line is _candidates' work,
            # so a line with thousands of gates costs one step here, not thousands.
            found = self.gate.search(data, position)
            if found is None:
                break
            start = data.rfind(b"\n", 0, found.start()) + 1
            end = data.find(b"\n", found.end())
            end = len(data) if end < 0 else end
            position = end + 1
            raw = data[start : min(end, start + MAX_LINE)]
            key = repeat_key(raw)
            if key is not None and key in self._seen_keys:
                continue  # a copy of a channel line already passed on (see _note_key)
            quiet = quiet_key(raw, found.start() - start) if key is None else None
            if quiet is not None and quiet in self._quiet_keys and _next_is_new_record(data, end):
                continue  # another rank's, or a later time's, copy of a line that matched nothing
            candidates = self._candidates(raw, found.start() - start, found.group())
            if not candidates:
                continue  # a gate without its full literal: noise
            if key is not None:
                self._note_key(key, candidates)
            lines_before += data.count(b"\n", counted_to, start)
            counted_to = start
            line_number = chunk.first_line + (starts[lines_before] if starts else lines_before)
            texts = segments(_decode(raw))
            hits = list(self._match_line(texts, candidates, chunk.source, line_number))
            if not any(hit.signature.reference_id for hit in hits):  # generic hits do not end the search
                # The message a terminal shows is the last redraw (what normalise() keeps).
                hits += self._match_wrapped(data, start, end, texts[-1] if texts else "", chunk.source, line_number)
            if not hits and quiet is not None and len(self._quiet_keys) < MAX_KEYS and _next_is_new_record(data, end):
                self._quiet_keys.add(quiet)
            yield from hits

    def forget_repeats(self) -> None:
        """Start a new run: every channel line and every quiet NCCL line is news again."""
        self._seen_keys.clear()
        self._quiet_keys.clear()

    def _note_key(self, key: bytes, candidates: list[Signature]) -> None:
        """Remember a channel line that only an observation signature wants: the thousands of
        copies a big job prints (same host, same transport) then cost a set lookup, not a match.
        A line some catalogue signature wants too is never skipped."""
        if len(candidates) == 1 and id(candidates[0]) in self._observing and len(self._seen_keys) < MAX_KEYS:
            self._seen_keys.add(key)

    def _candidates(self, raw: bytes, position: int = 0, first_gate: bytes = b"") -> list[Signature]:
        """Signatures one of whose literals occurs in the raw line at or after ``position``
        (where the scan found ``first_gate``, when it passes one: that search is not repeated)."""
        assert self.gate is not None
        gates: set[bytes] = set()
        if first_gate:
            gates.add(first_gate)
            position += 1  # gates may overlap
        for _ in range(_MAX_GATE_STEPS):
            match = self.gate.search(raw, position)
            if match is None:
                break
            gates.add(match.group())
            position = match.start() + 1  # gates may overlap
        else:
            # A long line dense with gates (a literal repeated thousands of times): the rest is
            # collected in one C-level pass. It does not see a gate that starts inside another
            # one; a real message has long ended after this many steps.
            gates.update(self.gate.findall(raw, position))
        found: dict[int, Signature] = {}
        for gate in gates:
            for literal in self._literals_by_gate[gate]:
                if literal in raw:
                    for signature in self._by_literal[literal.decode()]:
                        found[id(signature)] = signature
        return list(found.values())

    def _match_line(self, texts: list[str], candidates: list[Signature], source: str, line_number: int) -> Iterator[Hit]:
        for text in texts:
            for signature in candidates:
                if signature.pattern.search(text):
                    yield Hit(signature, source, line_number, text)

    def _match_joined(self, joined: str, boundary: int, source: str, line_number: int) -> Iterator[Hit]:
        """Signatures matched across the join at ``boundary``: one lying wholly in either line
        is that line's own hit (or miss), and counting it again here would count one line twice."""
        raw = joined.encode("utf-8", "replace")
        for signature in self._candidates(raw):
            if any(match.start() < boundary < match.end() for match in signature.pattern.finditer(joined)):
                yield Hit(signature, source, line_number, joined)

    def _match_wrapped(self, data: bytes, start: int, end: int, line: str, source: str, line_number: int) -> Iterator[Hit]:
        """Try the line joined with the previous or the next line (a hard-wrapped message).

        Only a line that starts without any log prefix can be a continuation; two consecutive
        records of an interleaved log are never joined. ``line`` is already normalised."""
        if start > 0 and is_continuation(line):
            previous_start = data.rfind(b"\n", 0, start - 1) + 1
            previous = normalise(_decode(data[previous_start : start - 1]))
            if len(previous) >= _MIN_WRAP_WIDTH:
                yield from self._match_joined(previous + line, len(previous), source, line_number - 1)
        if len(line) >= _MIN_WRAP_WIDTH and end < len(data):
            next_end = data.find(b"\n", end + 1)
            following_raw = data[end + 1 : len(data) if next_end < 0 else next_end]
            if _surely_new_record(following_raw):
                return  # the usual case in a big log, decided without decoding the next line
            following = normalise(_decode(following_raw))
            if is_continuation(following):
                yield from self._match_joined(line + following, len(line), source, line_number)
            elif following[:1] in (" ", "\t") and line.rstrip().endswith(",") and following.strip():
                # Wrapped at a word boundary, the rest indented (a post, a log formatter): a
                # message that stops at a comma goes on there, after one space.
                yield from self._match_joined(line.rstrip() + " " + following.strip(), len(line.rstrip()) + 1, source, line_number)


# Printable bytes from the most to the least frequent in GPU job logs (measured on the test
# corpus). Gates start at rare bytes, so the regex engine skips most positions of a line with a
# single bitmap test instead of trying hundreds of alternatives there.
_COMMON_TO_RARE = (
    " 01eron:t2a-iscdl4p3Cu5[]Nm./6I8g7k9hLf_bOT,=vFREyxPDwBGS>(*)UAMZ<WHz|qV\"+^'j#;Y\tKX?!%{}QJ@$&`\\~"
)
_RARITY = {ord(char): rank for rank, char in enumerate(_COMMON_TO_RARE)}
_GATE_MIN = 4
_SPACE = ord(" ")
_GATE_MAX = 12


def _gates(literals: list[str]) -> dict[bytes, list[bytes]]:
    """Short substrings ("gates") such that every literal contains one, each starting with a
    byte from a small set of rare bytes; maps each gate to the literals it stands for.

    The start bytes are a greedy weighted set cover: repeatedly take the byte that opens a gate
    in the most remaining literals per unit of its frequency in logs."""
    encoded = [literal.encode() for literal in literals]
    openings = [{raw[i] for i in range(max(1, len(raw) - _GATE_MIN + 1))} for raw in encoded]
    by_byte: dict[int, set[int]] = {}
    for index, bytes_ in enumerate(openings):
        for byte in bytes_:
            by_byte.setdefault(byte, set()).add(index)
    weight = {byte: len(_RARITY) - _RARITY.get(byte, len(_RARITY)) + 1 for byte in by_byte}
    # A space is several times as frequent as any other byte in a log, far more than its rank
    # says: a gate may start at one only for a literal that has no other opening.
    if _SPACE in weight:
        weight[_SPACE] = 10**9
    uncovered = set(range(len(encoded)))
    chosen: set[int] = set()
    while uncovered:
        byte = max(by_byte, key=lambda b: (len(by_byte[b] & uncovered) / weight[b], -b))
        chosen.add(byte)
        uncovered -= by_byte[byte]
    gate_of = {}
    for raw in encoded:
        start = next(i for i in range(max(1, len(raw) - _GATE_MIN + 1)) if raw[i] in chosen)
        gate_of[raw] = raw[start : start + _GATE_MAX]
    # A gate that is a prefix of another also stands for that one's literals: the trie stops at
    # the shorter gate, so the longer one is never reported on its own.
    # In sorted order every gate that starts with another follows it directly or after others
    # that start with it too, so one pass over the sorted gates finds all prefix pairs.
    literals_of: dict[bytes, list[bytes]] = {}
    for raw, gate in gate_of.items():
        literals_of.setdefault(gate, []).append(raw)
    ordered = sorted(literals_of)
    result: dict[bytes, list[bytes]] = {}
    for index, gate in enumerate(ordered):
        result[gate] = []
        for other in ordered[index:]:
            if not other.startswith(gate):
                break
            result[gate] += literals_of[other]
    return result


_RECORD_START_BYTES = re.compile(RECORD_START.pattern.encode())
_ANSI_FRAGMENT = re.compile(rb"\[[0-9][0-9;]{0,7}m")  # what strip_ansi removes even without an ESC byte


def _surely_new_record(raw: bytes) -> bool:
    """The raw line starts a new record, and nothing :func:`normalise` would undo (a redraw,
    colours, quoting, inline code) could change how it starts: then it is no continuation and
    not an indented rest either, whatever its normalised text would be."""
    head = raw[:64]
    return (
        raw[:1] not in (b" ", b"\t", b"")
        and b"\r" not in raw
        and b"\x1b" not in head
        and b"`" not in head[:8]
        and b">" not in head[:4]
        and _ANSI_FRAGMENT.search(head) is None
        and _RECORD_START_BYTES.match(raw) is not None
    )


_TIMESTAMP_BYTES = b"0123456789-:T.Z ,+/"


def quiet_key(raw: bytes, gate: int) -> bytes | None:
    """What a line of NCCL's own output (``host:pid:tid [dev] NCCL ...``) says, less when and by
    which process and thread it was written; None for other lines, and for lines where anything
    but a numeric timestamp comes before that header, or a gate (at ``gate``) lies in it.

    Every rank prints the same setup lines at every communicator it creates, a million-line log
    holds tens of thousands of copies, and signatures describe messages, never the digits of a
    timestamp, pid or thread: a copy of a line that matched nothing matches nothing either, so
    the scan skips it for one set lookup. Only lines that matched nothing are remembered (a hit
    is always reported), and only where no hard-wrap join could have found anything."""
    writer_start, bracket = writer_span(raw, raw.find(b" NCCL "))
    if writer_start < 0 or gate < writer_start or raw[:writer_start].translate(None, _TIMESTAMP_BYTES):
        return None
    writer, pid, thread = (raw[writer_start:bracket].rsplit(b":", 2) + [b"", b""])[:3]
    if not (pid.isdigit() and thread.isdigit()):
        return None
    return writer + raw[bracket:]


def _next_is_new_record(data: bytes, end: int) -> bool:
    """The line after the one ending at ``end`` starts a new record (or there is none), so no
    hard-wrap join of the two is tried."""
    if end >= len(data):
        return True
    next_end = data.find(b"\n", end + 1)
    return _surely_new_record(data[end + 1 : len(data) if next_end < 0 else next_end])


def _decode(raw: bytes) -> str:
    """The line as text; colours, quoting and redraws are left to :mod:`posts`."""
    return raw[:MAX_LINE].decode("utf-8", "replace")


def _trie_pattern(literals: list[bytes]) -> bytes:
    """One regex matching any of ``literals``, shared prefixes factored out."""
    trie: dict[int, dict] = {}  # type: ignore[type-arg]
    for literal in literals:
        node = trie
        for byte in literal:
            node = node.setdefault(byte, {})
        node[-1] = {}

    def build(node: dict) -> bytes:  # type: ignore[type-arg]
        ends_here = -1 in node
        branches = [re.escape(bytes([byte])) + build(child) for byte, child in sorted(node.items()) if byte != -1]
        if not branches:
            return b""
        body = branches[0] if len(branches) == 1 else b"(?:" + b"|".join(branches) + b")"
        # A literal ending here is already a full match; the longer ones need not be tried.
        return b"" if ends_here else body

    return build(trie)
