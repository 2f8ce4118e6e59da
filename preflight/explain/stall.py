"""Where a run that neither failed nor finished stopped: a hang shows as silence.

A job that hangs prints no error; it is killed later, or its owner gives up and posts what it
printed. When such a log's last lines are NCCL's own setup output, the run stopped while NCCL
was setting up or using its first connections, and saying so names the line to start from
instead of "no failure found". NCCL prints one line per connection it makes (``Channel 00/0 :
0[0] -> 1[1] via P2P/IPC``, ``... via SHM/direct/direct``, older releases ``Ring 00 : ... via
P2P/IPC`` or ``via direct shared memory``; ``src/transport/p2p.cc``, ``shm.cc``), and a finished
run says ``Destroy COMPLETE`` (communicator freed) or, in nccl-tests, ``Avg bus bandwidth``.

The NCCL test programs (nccl-tests, and the ``test/single`` programs of NCCL 1.x) print no NCCL
line of their own unless NCCL_DEBUG is set: they list the ranks and devices, print the header of
their results table (``time  algbw  busbw``, then a units line in newer releases), and then one row
per message size (``src/util.cu``; NCCL 1.x ``test/single/all_reduce_test.cu``). A log that ends
at that header stopped inside the first collective.

A hang is also what a stack dump of a waiting process shows: users attach py-spy (``Thread 4711
(idle): "MainThread"`` and one frame per line) or gdb (``Thread 1 (Thread 0x7f... (LWP 4711))``,
``#0  0x00007f... in sched_yield ()``) or lldb (``thread #16, name = 'python', stop reason = signal
SIGSTOP``, ``frame #0: 0x00007f... libc.so.6`syscall + 29``) to a job that stopped moving and
post what it printed. A
log without failures that holds such a dump in its last lines is stalled at the dump's first
thread.

Without NCCL_DEBUG a hang in setting up the process group prints no NCCL line at all, and what the
log ends with is the framework's own start-up line right before the group's first collective: the
ranks meet in ``init_process_group`` or in their first ``barrier()``. Those lines are printed by
every healthy run too (``references/coverage``: DeepSpeed's ``Initializing TorchBackend in
DeepSpeed with backend nccl``, ``deepspeed/comm/comm.py``; Lightning's ``Initializing distributed:
GLOBAL_RANK: 0, MEMBER: 1/8``, ``lightning/fabric/utilities/distributed.py``; ProcessGroupNCCL's
``using GPU 0 to perform barrier as devices used by this process are currently unknown``, printed by
a ``barrier()`` without ``device_ids``; vLLM's ``vLLM is using nccl==2.26.2``, printed when its own
NCCL communicator is set up, ``vllm/distributed/device_communicators/pynccl.py``), so only a log
that ends within a few lines of one, with nothing after it saying the run went on, finished or
failed, is stalled there.

CUDA's p2pBandwidthLatencyTest sample, the program threads run to see whether GPUs of one node
reach each other, lists the devices and which pairs can access each other, then measures one
matrix after another, each printed under its title (``Unidirectional P2P=Disabled Bandwidth Matrix
(GB/s)``, ``... P2P=Enabled Bandwidth (P2P Writes) Matrix (GB/s)``, ``P2P=Disabled Latency Matrix
(us)``; ``Samples/5_Domain_Specific/p2pBandwidthLatencyTest``) with a header row (``D\\D 0 1 ...``,
``GPU 0 1 ...``) above the values, and ends with its ``NOTE: The CUDA Samples are not meant for
performance measurements``. A log that ends at a title or a header row, with no values under it,
stopped inside that measurement: GPU-to-GPU copies inside one node that never completed.

One case points at a catalogued cause: a run whose only connections were inside one node (GPU
to GPU through P2P or shared memory, no network channel anywhere in the log) and which then
went silent, a test whose ranks all ran on one host and stopped at its first size, or the CUDA
peer-to-peer sample stopped inside a measurement, is the
classic picture of peer-to-peer traffic dropped by the PCIe fabric (ACS redirect or a
translating IOMMU, PCI003), which NCCL's troubleshooting guide names for hangs among GPUs of one
node. It is offered at symptom tier: silence is weak evidence, and
``explain --check`` asks the node about ACS and the IOMMU.

Only the tail of each input is kept (``TAIL_BYTES`` for up to ``MAX_SOURCES`` inputs), so
memory stays bounded whatever the input size.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Iterator

from preflight.explain.combinations import Sighting
from preflight.explain.posts import normalise
from preflight.explain.reader import Chunk

TAIL_BYTES = 16 << 10
MAX_SOURCES = 1024
DUMP = "a stack dump of the waiting process"  # Stall.what of a dump
FRAMEWORK_SETUP = "the framework's last line before the first collective"  # Stall.what of a framework stall
LAST_LINES = 20  # NCCL's last line must be among a source's last this many non-blank lines

_NCCL_INFO = re.compile(r"\[\d+\] NCCL INFO \S")  # posts often lose the host:pid:tid before it
_PEER_CONNECTION = re.compile(r"\] via (?:P2P/|SHM/|direct shared memory)")
_NETWORK_CONNECTION = re.compile(r"\] via NET/")
_FINISHED = re.compile(r"Destroy COMPLETE|Abort COMPLETE|Avg bus bandwidth|Out of bounds values|NOTE: The CUDA Samples are not meant for performance")
# py-spy's thread header and frame ("    broadcast (torch/distributed/distributed_c10d.py:2772)"),
# gdb's thread header, numbered frame, stop line after attaching, and backtrace command, and
# lldb's thread header and frame ("  thread #16, name = 'python', stop reason = signal SIGSTOP",
# "    frame #3: 0x00007fb090db1068 libtorch_cuda.so`c10d::ProcessGroupNCCL::abort() + 664"),
# and the thread header of Python's faulthandler ("Thread 0x00007f... (most recent call first):",
# CPython's Python/traceback.c), which dump_traceback_later and SIGUSR1 handlers print for a
# process that stopped moving; after a crash its "Fatal Python error" is a failure, so no stall.
_STACK_DUMP = re.compile(
    r"^\s*Thread (?:\d+|0x[0-9a-fA-F]+) \((?:idle|active|Thread 0x[0-9a-fA-F]+ \(LWP \d+\))\)"
    r"|^\s{2,}[\w<>.]{1,200} \([^()\s]{1,400}\.py:\d+\)\s*$"
    r"|^\s*#\d{1,4} +0x[0-9a-fA-F]{6,16} in \S"
    r"|^0x[0-9a-fA-F]{6,16} in \S{1,200} \("  # where gdb stopped the process it attached to
    r"|^\(gdb\) (?:bt|backtrace|where|thread apply all bt)\b"
    r"|^\s*\*?\s*thread #\d{1,6}(?:: tid = \S{1,20})?, (?:name = '[^'\n]{0,200}', )?(?:queue = '[^'\n]{0,200}', )?stop reason = "
    r"|^\s*\*?\s*frame #\d{1,4}: 0x[0-9a-fA-F]{6,16} \S"
    r"|^(?:Current thread|Thread) 0x[0-9a-fA-F]{6,16} \(most recent call first\):"
)
# The frameworks' last lines before the process group's first collective (module docstring).
_FRAMEWORK_SETUP = re.compile(
    r"Initializing TorchBackend in DeepSpeed with backend \w"
    r"|Initializing distributed: GLOBAL_RANK: \d{1,7}, MEMBER: \d{1,7}/\d{1,7}"
    r"|using GPU \d{1,4} to perform barrier as devices used by this process are currently unknown"
    r"|vLLM is using nccl==\d"
)
# A framework's setup line must be among a source's last this many non-blank lines: they are
# followed at once by the first collective, so more output after one means the run went past it.
FRAMEWORK_LAST_LINES = 6
# The CUDA peer-to-peer sample's matrix titles (older releases say "P2P=Enabled Bandwidth Matrix",
# newer ones name the copy kind, "(P2P Writes)" or "(P2P Reads)"), the header row under each, and
# the line it opens with.
_P2P_SAMPLE_TITLE = re.compile(
    r"^\s*(?:(?:Uni|Bi)directional P2P=(?:Enabled|Disabled) Bandwidth(?: \(P2P \w{1,10}\))? Matrix \(GB/s\)"
    r"|P2P=(?:Enabled|Disabled) Latency(?: \(P2P \w{1,10}\))? Matrix \(us\))\s*$"
)
_P2P_SAMPLE_HEADER = re.compile(r"^\s*(?:D\\D|GPU|CPU)(?:\s+\d{1,3}){1,64}\s*$")
_P2P_SAMPLE_START = re.compile(r"\[P2P \(Peer-to-Peer\) GPU Bandwidth Latency Test\]|^\s*Device: \d{1,3}, .{1,200}, pciBusID: ")
_TESTS_HEADER = re.compile(r"\balgbw\s+busbw\b|\(GB/s\)\s+\(GB/s\)")
# The units line newer releases print under the header ("#  (B)  (elements)  ...  (us)  (GB/s)"), matched
# by its start: a post cut inside it still ends at the header.
_TESTS_UNITS = re.compile(r"^#?\s*\(B\)\s+\(elements\)")
# "#  Rank  0 Group  0 Pid  4242 on node03 device  0 [...]", "#   Rank  0 Pid  4242 on node03 device  0",
# "#   Rank  0 on node03 device  0 [0x00]",
# and NCCL 1.x's single-process "#   Rank  0 uses device  0 [0x05]" (no host: one node by construction).
_TESTS_RANK = re.compile(r"\bRank +\d+ (?:Group +\d+ +)?(?:Pid +\d+ +)?(?:on +(\S+) +device|uses device) +\d+ ")


@dataclass(frozen=True)
class Stall:
    """Where a source that ends without an error or a finish went silent: NCCL's last line, an NCCL
    test's results header, or the first line of a stack dump (``what`` says which)."""

    last: Sighting
    lines_after: int  # non-blank lines the source printed after it
    peer: Sighting | None  # an intra-node connection line, when the log shows no network channel
    what: str = "NCCL's last line"  # how the text names ``last``


class SourceTails:
    """The last bytes of every input, kept while the chunks stream past."""

    def __init__(self) -> None:
        self._tails: dict[str, tuple[bytes, int]] = {}  # source -> (tail, number of its last line)

    def watch(self, chunks: Iterable[Chunk]) -> Iterator[Chunk]:
        for chunk in chunks:
            self._keep(chunk)
            yield chunk

    def _keep(self, chunk: Chunk) -> None:
        if not chunk.data:
            return
        known = self._tails.get(chunk.source)
        if known is None and len(self._tails) >= MAX_SOURCES:
            return
        last_line = chunk.first_line + chunk.data.count(b"\n", 0, len(chunk.data) - 1)
        tail = ((known[0] if known else b"") + chunk.data[-TAIL_BYTES:])[-TAIL_BYTES:]
        self._tails[chunk.source] = (tail, last_line)

    def lines(self, source: str) -> list[Sighting]:
        """The source's kept last lines, whole lines only, normalised, blank ones left out."""
        tail, last_line = self._tails[source]
        text = tail.decode("utf-8", "replace").split("\n")
        if text and text[-1] == "":
            text.pop()  # the newline that ends the last line
        if len(tail) >= TAIL_BYTES and text:
            text.pop(0)  # cut by the tail's start
        first = last_line - len(text) + 1
        result = []
        for offset, raw in enumerate(text):
            line = normalise(raw)  # the last redraw, without quoting, colours or a bare fence
            if line.strip():
                result.append(Sighting(source, first + offset, line))
        return result

    @property
    def sources(self) -> list[str]:
        return list(self._tails)


def find_stall(tails: SourceTails, network_seen: bool) -> Stall | None:
    """The first input whose last lines are NCCL setup or connection output with nothing after
    them that says the run failed or finished; ``network_seen``: the log shows a network channel
    somewhere (then the intra-node reading does not apply). Asked only of logs without failures."""
    for source in tails.sources:
        kept = tails.lines(source)
        lines = kept[-LAST_LINES:]
        if any(_FINISHED.search(line.text) for line in lines):
            continue
        nccl = [index for index, line in enumerate(lines) if _NCCL_INFO.search(line.text)]
        if not nccl:
            stall = _tests_stall(kept, network_seen) or _p2p_sample_stall(kept) or _dump_stall(kept) or _framework_stall(kept)
            if stall is not None:
                return stall
            continue
        last = lines[nccl[-1]]
        peers = [lines[index] for index in nccl if _PEER_CONNECTION.search(lines[index].text)]
        networked = network_seen or any(_NETWORK_CONNECTION.search(lines[index].text) for index in nccl)
        # A test run set up on one host also stopped inside that node, before its first connection line.
        peer = peers[-1] if peers else _one_host_rank(kept)
        return Stall(last, len(lines) - 1 - nccl[-1], peer if not networked else None)
    return None


def _tests_stall(lines: list[Sighting], network_seen: bool) -> Stall | None:
    """A test program's output that ends at its results header: the first size never finished.
    Intra-node when every rank it lists ran on one host and the log shows no network channel."""
    after = 0
    if lines and _TESTS_UNITS.search(lines[-1].text) and not _TESTS_HEADER.search(lines[-1].text):
        lines, after = lines[:-1], 1  # the units line, cut before its "(GB/s)" columns
    if not lines or not _TESTS_HEADER.search(lines[-1].text):
        return None
    one_host = _one_host_rank(lines)
    return Stall(lines[-1], after, one_host if not network_seen else None, "the test's results header")


def _p2p_sample_stall(lines: list[Sighting]) -> Stall | None:
    """CUDA's p2pBandwidthLatencyTest ending at a matrix title or its header row: the copies of that
    measurement never completed. One process drives every GPU of one node, so it is intra-node."""
    if not lines:
        return None
    end = len(lines) - 1
    if _P2P_SAMPLE_HEADER.search(lines[end].text) and end > 0 and _P2P_SAMPLE_TITLE.search(lines[end - 1].text):
        end -= 1
    elif not _P2P_SAMPLE_TITLE.search(lines[end].text):
        return None
    started = [line for line in lines[:end] if _P2P_SAMPLE_START.search(line.text)]
    return Stall(lines[end], len(lines) - 1 - end, started[-1] if started else lines[end], "the peer-to-peer test's matrix title")


def _one_host_rank(lines: list[Sighting]) -> Sighting | None:
    """The last line of an NCCL test's device list when every rank it lists ran on one host."""
    listed = [(line, found.group(1)) for line in lines if (found := _TESTS_RANK.search(line.text)) is not None]
    return listed[-1][0] if listed and len({host for _, host in listed}) == 1 else None


def _dump_stall(lines: list[Sighting]) -> Stall | None:
    """A py-spy, gdb or lldb stack dump among the source's last lines: the process was waiting when it
    was taken. Named at the dump's first line."""
    if not any(_STACK_DUMP.search(line.text) for line in lines[-LAST_LINES:]):
        return None
    index = next(index for index, line in enumerate(lines) if _STACK_DUMP.search(line.text))
    return Stall(lines[index], len(lines) - 1 - index, None, DUMP)


def _framework_stall(lines: list[Sighting]) -> Stall | None:
    """A framework's start-up line right before the process group's first collective among the
    source's last few lines: the ranks never got through it. Named at the last such line."""
    recent = lines[-FRAMEWORK_LAST_LINES:]
    setup = [index for index, line in enumerate(recent) if _FRAMEWORK_SETUP.search(line.text)]
    if not setup:
        return None
    return Stall(recent[setup[-1]], len(recent) - 1 - setup[-1], None, FRAMEWORK_SETUP)
