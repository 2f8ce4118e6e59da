"""Evidence that no single line carries: what several healthy-looking lines say together.

Some causes never print a message of their own; they show only in how lines disagree:

* **GPUDirect RDMA missing on one side.** NCCL names the transport of every network channel
  (``Channel 00/0 : 0[0] -> 8[0] [receive] via NET/IB/0/GDRDMA``, ``src/transport/net.cc``); the
  ``/GDRDMA`` suffix appears when that GPU and NIC use GPUDirect RDMA. A receive uses it whenever
  both support it and are close enough (``ncclTopoCheckGdr`` with ``read=0``: no further
  condition), so a ``[receive]`` channel without the suffix in a log where other channels on the
  same network have it means GPUDirect RDMA is off for that GPU. When the host that lacks it shows
  it nowhere, the node has no GPUDirect RDMA path (GDR001); when the same host uses it for some
  GPUs and not others, the GPU-to-NIC distance decided it (TOPO005, or ROCE002 on RoCE ports).
* **GPUDirect RDMA turned off by distance, on RoCE.** NCCL's ``GPU Direct RDMA Disabled for GPU
  ... (distance X > Y)`` does not name the fabric: alone it is TOPO005 (GPU and HCA too far
  apart); beside RoCE ports (``NET/IB : Using [0]mlx5_0:1/RoCE``) it is ROCE002, the RoCE case of
  the same decision.
* **Ranks disagreeing about one collective.** With ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` PyTorch's
  ProcessGroupWrapper logs ``Running collective: CollectiveFingerPrint(SequenceNumber=N,
  OpType=..., TensorShape=[...], TensorDtypes=...)`` on every rank. Two ranks with different
  operation, shape or type for the same sequence number are running mismatched collectives
  (NCCL009). Several process groups number their collectives separately, so a rank that logs one
  sequence number with two fingerprints makes the comparison unusable and the rule stays quiet.
  The watchdog's timeout lines are not compared that way: each names its rank within the
  process group that timed out (``[Rank 3] Watchdog caught collective operation timeout:
  WorkNCCL(SeqNum=412, OpType=ALLREDUCE, NumelIn=1048576, NumelOut=1048576, Timeout(ms)=600000)``,
  ``ProcessGroupNCCL.cpp``) but not the group, and FSDP's or a device mesh's groups number their
  collectives alike from 1, so two ranks of different groups time out at one sequence number in
  different operations and sizes without any mismatch. They only summarise a wait
  (:meth:`Observations.waited_collective`) when every one of them names the same collective.
* **Sockets over InfiniBand for want of libibverbs.** NCCL logs that it could not open
  libibverbs at INFO level (``Failed to open libibverbs.so[.1]``, ``Count not open
  libibverbs.so``, from 2.31 ``Could not open libibverbs.so``; ``src/misc/ibvsymbols.cc``) because a node without RDMA is normal; the same run
  choosing an IPoIB interface for its socket transport (``NET/Socket : Using [0]ib0:...``,
  ``src/transport/net_socket.cc``) shows an InfiniBand node whose verbs stack is missing in the
  job's environment (IB009).
* **A consumer Blackwell board with an NCCL too old for it.** NCCL before 2.26.2 did not fit its
  kernels' shared memory to compute capability 12.0 boards (RTX 5090, RTX PRO Blackwell; the
  2.26.2 release notes, NVIDIA/nccl#1637), so a log naming such a board (``NVIDIA GeForce RTX
  5090`` in a device list) and an older version (``NCCL version 2.25.1+cuda12.8``) shows the
  cause even when the shared-memory warning itself is not in the post (PCI005).
* **A bus error inside NCCL's shared-memory setup.** NCCL up to 2.18 sized each /dev/shm segment
  with ``ftruncate`` and then wrote it (``ncclShmOpen``, ``src/misc/shmutils.cc``), so on a tmpfs
  too small or full for it the kernel killed the process with SIGBUS instead of returning an
  error; 2.19 reserves the space with ``fallocate`` and warns. A SIGBUS report (``received signal
  SIGBUS``, ``Bus error``) together with a backtrace frame in ``ncclShmOpen`` is the container's
  small /dev/shm (NCCL007) even though NCCL printed nothing.
* **An interface other hosts cannot reach, and a connection to it that failed.** NCCL keeps any
  interface but loopback and docker* when it picks its socket interfaces (``src/misc/socket.cc``),
  so a link-local (169.254.0.0/16) or Docker default-bridge (172.17.0.0/16) address can be the one it
  advertises. An interface list (``NET/Socket : Using ... [1]pod-id-link0:169.254.170.23<0>``,
  ``Bootstrap : Using eth0:172.17.0.2<0>``) together with a failed connection to that very address
  (``connect to 169.254.170.23<51877> returned Connection refused``) is the selection at fault
  (NET001), ahead of the refused connection's usual reading, a peer that was not listening (SOCK004).
* **Waiting in a barrier.** PyTorch runs ``barrier()`` on the NCCL backend as an all-reduce of one
  element, and the object collectives (``all_gather_object``, ``broadcast_object_list``) start by
  exchanging one-element sizes, so a watchdog timeout whose first record names a one-element
  all-reduce or all-gather (``OpType=ALLREDUCE, NumelIn=1, NumelOut=1``, or ``OpType=BARRIER``)
  shows ranks that waited at a synchronisation point for a rank that was elsewhere: writing a
  checkpoint (TORCH009), busy with single-rank work or stuck (NCCL011), or on a code path that
  skips the barrier (TORCH002); the checkpoint comes last when rank 0, its writer, timed out in
  the barrier too. None of them prints a line of its own, so the three are offered at
  symptom tier, ahead of the generic timeout (NCCL003) and the all-reduce hang (NCCL001) that a
  one-element exchange is not.
* **A rank still busy with its own work when the others time out.** tqdm redraws a progress bar
  with a carriage return and no newline, so the next line any process writes to the same
  terminal lands on the bar's line. When a watchdog report (``[E ProcessGroupNCCL.cpp:...]``)
  lands on a bar that stopped short of 100 % while rank 0, which draws the bars in most training
  scripts, printed no timeout of its own, the others waited in a collective for a rank that was
  still tokenising, scanning labels or evolving anchors: one rank's long single-rank work
  (NCCL011). A bar that reached 100 % (the loop ended, something after it hung), or a rank 0 that
  timed out too (it was waiting like the rest), shows nothing of the kind.
* **nccl-tests run as several separate tests.** Only rank 0 of an nccl-tests job prints the
  header (``# nThread 1 nGpus 8 minBytes ...``), the result table and the footer (``# Out of
  bounds values : 0 OK``; ``src/common.cu``). A binary built without MPI (or against another MPI
  than the one that started it) runs one test per process, each its own rank 0, so one log shows
  a second header before any result table, or a second footer with no header between: every
  process measured its own node alone. No line fails, so this is named only when nothing else is.
* **Silence after connecting inside one node** (:mod:`preflight.explain.stall`): a log without
  failures that ends in NCCL's intra-node connection lines, with no network channel anywhere,
  is offered as PCI003 at symptom tier.

The matcher finds the lines with built-in signatures whose reference ID starts with
:data:`OBSERVATION`; :class:`Observations` keeps a bounded summary of them, and
:meth:`Observations.derived` turns it into cause-tier evidence for the analysis.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

OBSERVATION = "~"  # reference-ID prefix of the built-in observation signatures
CHANNEL = OBSERVATION + "channel"
ROCE_PORTS = OBSERVATION + "roce-ports"
FINGERPRINT = OBSERVATION + "fingerprint"
WATCHDOG = OBSERVATION + "watchdog-timeout"
DISTANCE = OBSERVATION + "gdr-distance"
NO_VERBS = OBSERVATION + "no-libibverbs"
SM120_BOARD = OBSERVATION + "sm120-board"
NCCL_VERSION = OBSERVATION + "nccl-version"
SOCKET_ON_IB = OBSERVATION + "socket-on-ib"
BUS_ERROR = OBSERVATION + "bus-error"
SHM_FRAME = OBSERVATION + "nccl-shm-frame"
NCCL_TESTS = OBSERVATION + "nccl-tests"
PROGRESS_CUT = OBSERVATION + "progress-cut"
UNROUTED_USE = OBSERVATION + "unrouted-interface"
UNROUTED_CONNECT = OBSERVATION + "unrouted-connect"

# nccl-tests' result table header ("#  size  count  type  redop  root  time  algbw  busbw  #wrong";
# "error" for "#wrong" in older releases)
NCCL_TESTS_TABLE = r"#\s{1,12}size\s{1,16}count\s{1,12}type\s{1,12}redop"

# (reference ID, pattern) of the lines the matcher reports as observations.
OBSERVATION_SIGNATURES = (
    (CHANNEL, r"\[(?:send|receive)\] via NET/[^/\n]{1,40}/\d"),
    (ROCE_PORTS, r"\[\d+\]\w{1,40}:\d+/RoCE\b"),  # "NET/IB : Using [0]mlx5_0:1/RoCE": scanned for "/RoCE"
    (FINGERPRINT, r"Running collective: CollectiveFingerPrint\(SequenceNumber=\d+, OpType=\w+"),
    (WATCHDOG, r"Rank \d{1,7}\] Watchdog caught collective operation timeout(?: for work)?: WorkNCCL\(SeqNum=\d"),
    (NO_VERBS, r"Failed to open libibverbs\.so|(?:Count|Could) not open libibverbs\.so"),
    (SM120_BOARD, r"NVIDIA (?:GeForce RTX 50[5-9]0(?: Ti)?|RTX PRO [0-9]{4} Blackwell)"),
    (NCCL_VERSION, r"NCCL version \d{1,2}\.\d{1,3}\.\d{1,3}"),
    (SOCKET_ON_IB, r"NET/Socket : Using .{0,400}?\[\d+\]ib\w{0,15}[:.<]"),
    (BUS_ERROR, r"SIGBUS|Bus error"),
    (SHM_FRAME, r"\bncclShmOpen\b"),  # a backtrace frame: NCCL prints the name in no message
    # a progress bar short of 100 % ("  9%|███▊      | 280000/2969526 [29:55<4:48:08, ...]") with
    # a ProcessGroupNCCL report written onto its line
    (PROGRESS_CUT, r"(?<![\d.])\d{1,2}%\|[^\n]{0,800}?ProcessGroupNCCL\.cpp:\d{1,5}\]"),
    # nccl-tests' header, its result table's column line and its footer (each printed by rank 0 only)
    (NCCL_TESTS, rf"# nThread \d{{1,4}} nGpus \d{{1,4}}|{NCCL_TESTS_TABLE}|# Out of bounds values\s{{0,4}}:"),
    # NCCL's interface list naming a link-local or Docker default-bridge address, and a connection
    # to such an address that failed (NET001's picture when both name the same address)
    (UNROUTED_USE, r"(?:Bootstrap ?: ?Using|NET/Socket : Using) [^\n]{0,600}?:(?:169\.254|172\.17)\.\d{1,3}\.\d{1,3}<"),
    (UNROUTED_CONNECT, r"[Cc]onnect to (?:169\.254|172\.17)\.\d{1,3}\.\d{1,3}<[^>\s]{1,12}>,? (?:failed|returned)"),
    (DISTANCE, r"GPU Direct RDMA Disabled for GPU(?: \S{1,40} / HCA \S+ \(|/\S{1,40} \(rank \d+\) - NET/\S+ \()distance \d+ >=? \d+\)"),  # ">=" up to 2.5
)

_CHANNEL = re.compile(r"\[(send|receive)\] via NET/([^/\n]{1,40}?)/\d+(?:\(\d+\))?(/GDRDMA)?")
_NCCL_HOST = re.compile(r"([\w.-]+):\d+:\d+ \[\d+\] NCCL ")
_FINGERPRINT = re.compile(
    r"SequenceNumber=(\d+), OpType=(\w+)(?:, TensorShape=\[([^\]]{0,400})\])?(?:, TensorDtypes=(\w+))?"
)
_RANK = re.compile(r"\[Rank (\d+)\]|\[rank(\d+)\]")
# The whole record, up to its Timeout(ms) field: a line cut short inside it is never compared.
_WATCHDOG = re.compile(
    r"Rank (\d{1,7})\] Watchdog caught collective operation timeout(?: for work)?: WorkNCCL\(SeqNum=(\d{1,20}), "
    r"OpType=(\w{1,40}), (?:NumelIn=(\d{1,20}), NumelOut=(\d{1,20}), |TensorShape=\[([^\]]{0,400})\], )?Timeout\(ms\)=\d"
)
_NCCL_VERSION = re.compile(r"NCCL version (\d{1,2})\.(\d{1,3})\.(\d{1,3})")
_UNROUTED_ADDRESS = re.compile(r"(?<![\d.])((?:169\.254|172\.17)\.\d{1,3}\.\d{1,3})<")
MAX_UNROUTED = 64  # link-local or bridge addresses remembered from interface lists and failed connects
_NCCL_TESTS_PART = re.compile(r"(# nThread )|(redop)|(# Out of bounds values)")
SM120_FIXED_IN = (2, 26, 2)  # the first NCCL release whose kernels fit sm_120's shared memory

_VIA = b"] via NET/"
MAX_KEYS = 4096  # distinct channel lines remembered per run before every line is passed on again
MAX_HOSTS = 4096  # hosts (and networks) remembered per network: a log naming a million stays bounded


def repeat_key(raw: bytes) -> bytes | None:
    """What makes a channel line news: who wrote it (the token before NCCL's ``[dev]``, that is
    ``host:pid:tid`` with any rank prefix, less pid and tid) and what follows its direction
    (``send] via NET/IB/0/GDRDMA``). Every rank prints one per channel and peer, so the matcher
    passes on only the first line of each key; None for other lines. Byte searches only: this
    runs on every channel line of a big job."""
    via = raw.find(_VIA)
    if via < 0:
        return None
    start, bracket = writer_span(raw, raw.rfind(b" NCCL", 0, via))
    writer = raw[start:bracket].rsplit(b":", 2)[0] if bracket > 0 else b""
    return writer + b"|" + raw[max(0, via - 8) :]


def writer_span(raw: bytes, header: int) -> tuple[int, int]:
    """Start and end of the token that NCCL's `` [dev] NCCL`` header (``header``: where its " NCCL"
    is) follows: ``host:pid:tid``, with any rank prefix a launcher put before it. (-1, -1) when
    the line has no such header."""
    bracket = raw.rfind(b" [", 0, header + 1) if header > 0 else -1
    if bracket <= 0:
        return -1, -1
    return raw.rfind(b" ", 0, bracket) + 1, bracket


GDR_SPECIFICITY = 40  # about a specific one-line NCCL warning: a sure sign, but of a performance loss
ROCE_DISTANCE_SPECIFICITY = 60  # the distance line (55 of its own) plus what the RoCE ports add
MISMATCH_SPECIFICITY = 60  # two ranks' own records of one collective disagreeing: direct evidence
NO_VERBS_SPECIFICITY = 40  # two INFO lines that together name the missing piece
SM120_SPECIFICITY = 50  # a board and a version that the release notes name together
SHM_SIGBUS_SPECIFICITY = 50  # a crash report and the NCCL function it struck in
# A one-element collective in the watchdog's record: more than the operation's name, which
# NCCL001 keys on (55). The rank away from a barrier was most often writing a checkpoint, which
# TORCH009 describes as this very picture; then comes any other work or hang, then a skipped call.
# Steps of BARRIER_STEP keep that order after the line's worth is shared among the five
# references that claim it.
BARRIER_SPECIFICITY = 70
BARRIER_STEP = 5
BARRIER_WAITERS = ("TORCH009", "NCCL011", "TORCH002")
CHECKPOINT_WRITER = "TORCH009"  # rank 0 away writing a checkpoint
# The generic timeout and the all-reduce hang: every timeout line matches them, so a log with many
# ranks' reports piles up their worth, yet a one-element exchange is neither a data collective that
# hung nor news about which rank was away. The waiters stay ahead of them however many lines match.
BARRIER_BEFORE = ("NCCL003", "NCCL001")
_ONE_ELEMENT_OPS = ("ALLREDUCE", "ALLGATHER", "_ALLGATHER_BASE")
# A rank's own progress cut by the others' timeout reports: one picture, read from two facts
# (the bar and the ranks that timed out), so worth about a specific one-line message.
BUSY_RANK_SPECIFICITY = 45
BUSY_RANK = "NCCL011"
# NCCL advertised an interface whose address other hosts cannot reach, and a peer's connection to
# exactly that address failed: the selection, not the peer, is at fault. Worth more than the plugin
# or refusal lines (about 60) that the same run prints on its way to the socket transport.
UNROUTED_SPECIFICITY = 65
UNROUTED_REFERENCE = "NET001"
UNROUTED_AHEAD_OF = ("SOCK004",)  # the refused connection is the symptom of the address, not of a dead peer
STALL_SPECIFICITY = 10  # silence after intra-node connections: a picture, not a message
INTRA_NODE_STALL = "PCI003"  # P2P traffic dropped by ACS redirect or a translating IOMMU
MAX_SEQUENCES = 4096  # fingerprints kept per run: memory stays bounded on endless DETAIL logs


@dataclass(frozen=True)
class Sighting:
    """Where an observation was made; the analysis turns it into evidence."""

    source: str
    line_number: int
    text: str


@dataclass(frozen=True)
class Derived:
    reference_id: str
    specificity: int
    sightings: tuple[Sighting, ...]  # the lines that together make the evidence, first first
    role: str = "cause"
    # References in the same tier that this reading of their own lines makes less likely: the
    # candidate ranks ahead of them whatever their lines add up to.
    ahead_of: tuple[str, ...] = ()


@dataclass(frozen=True)
class WaitedCollective:
    """The collective every watchdog timeout in the logs names, and who printed no timeout for it.

    A rank that never reached the collective, or is stuck before it, prints no timeout of its own
    (NCCL011) while every rank that did reach it waits and times out (NCCL003); NCCL003's fix asks
    for exactly this comparison. ``silent`` lists the ranks below the highest one reporting that
    printed no timeout: the rank the others waited for, unless the post left its lines out."""

    sequence: int
    operation: str
    ranks: tuple[int, ...]
    silent: tuple[int, ...]
    first: Sighting


MAX_RANK_GAP = 1 << 16  # ranks kept with a timeout, and the highest rank expanded into the ranks below it


@dataclass
class _Network:
    with_gdr: dict[str | None, Sighting] = field(default_factory=dict)  # host -> first line with /GDRDMA
    receive_without: dict[str | None, Sighting] = field(default_factory=dict)  # host -> first receive without


@dataclass
class Observations:
    networks: dict[str, _Network] = field(default_factory=dict)
    roce: Sighting | None = None
    distance: Sighting | None = None
    no_verbs: Sighting | None = None
    socket_on_ib: Sighting | None = None
    sm120_board: Sighting | None = None
    nccl_before_sm120_fix: Sighting | None = None
    bus_error: Sighting | None = None
    shm_frame: Sighting | None = None
    fingerprints: dict[str, dict[str, tuple[str, Sighting]]] = field(default_factory=dict)  # seq -> rank -> (print, line)
    mismatch: tuple[Sighting, Sighting] | None = None
    ambiguous_sequences: bool = False
    # Watchdog timeouts: the collective the first one names, and each rank's first line naming it.
    timeout_record: tuple[int, str, str | None, str | None, str | None] | None = None
    timed_out: dict[int, Sighting] = field(default_factory=dict)
    timeouts_disagree: bool = False
    barrier_timeout: Sighting | None = None  # the first timeout, when it names a one-element collective
    # A run connected only inside one node, then went silent (preflight.explain.stall): set
    # after the scan, for a log without failures.
    intra_node_stall: tuple[Sighting, Sighting] | None = None
    # nccl-tests: the last header, table or footer seen in each source, and two headers (or
    # footers) of one source with no table (or header) between, which separate tests printed.
    nccl_tests_last: dict[str, tuple[str, Sighting]] = field(default_factory=dict)
    separate_tests: tuple[Sighting, Sighting] | None = None
    progress_cut: Sighting | None = None  # the first unfinished progress bar a ProcessGroupNCCL report cut
    # link-local or bridge address -> the first interface list naming it, the first failed connect to it
    unrouted_used: dict[str, Sighting] = field(default_factory=dict)
    unrouted_failed: dict[str, Sighting] = field(default_factory=dict)

    def add(self, kind: str, sighting: Sighting) -> None:
        if kind == CHANNEL:
            self._channel(sighting)
        elif kind == ROCE_PORTS:
            self.roce = self.roce or sighting
        elif kind == FINGERPRINT:
            self._fingerprint(sighting)
        elif kind == WATCHDOG:
            self._watchdog(sighting)
        elif kind == DISTANCE:
            self.distance = self.distance or sighting
        elif kind == NO_VERBS:
            self.no_verbs = self.no_verbs or sighting
        elif kind == SOCKET_ON_IB:
            self.socket_on_ib = self.socket_on_ib or sighting
        elif kind == SM120_BOARD:
            self.sm120_board = self.sm120_board or sighting
        elif kind == BUS_ERROR:
            self.bus_error = self.bus_error or sighting
        elif kind == SHM_FRAME:
            self.shm_frame = self.shm_frame or sighting
        elif kind == NCCL_TESTS:
            self._nccl_tests(sighting)
        elif kind == PROGRESS_CUT:
            self.progress_cut = self.progress_cut or sighting
        elif kind in (UNROUTED_USE, UNROUTED_CONNECT):
            seen = self.unrouted_used if kind == UNROUTED_USE else self.unrouted_failed
            for address in _UNROUTED_ADDRESS.findall(sighting.text):
                if address not in seen and len(seen) < MAX_UNROUTED:
                    seen[address] = sighting
        elif kind == NCCL_VERSION and self.nccl_before_sm120_fix is None:
            found = _NCCL_VERSION.search(sighting.text)
            if found is not None and tuple(int(part) for part in found.groups()) < SM120_FIXED_IN:
                self.nccl_before_sm120_fix = sighting

    def _channel(self, sighting: Sighting) -> None:
        found = _CHANNEL.search(sighting.text)
        if found is None:
            return
        direction, net, gdr = found.groups()
        host_match = _NCCL_HOST.search(sighting.text, 0, found.start())
        host = host_match.group(1) if host_match else None
        if net not in self.networks and len(self.networks) >= MAX_HOSTS:
            return
        network = self.networks.setdefault(net, _Network())
        known = network.with_gdr if gdr else network.receive_without if direction == "receive" else None
        if known is not None and (host in known or len(known) < MAX_HOSTS):
            known.setdefault(host, sighting)  # the first hosts tell it; a log naming more stays bounded

    def _nccl_tests(self, sighting: Sighting) -> None:
        found = _NCCL_TESTS_PART.search(sighting.text)
        if found is None or self.separate_tests is not None:
            return
        part = "header" if found.group(1) else "table" if found.group(2) else "footer"
        last = self.nccl_tests_last.get(sighting.source)
        if last is not None and last[0] == part != "table":
            self.separate_tests = (last[1], sighting)
        elif last is not None or len(self.nccl_tests_last) < MAX_HOSTS:
            self.nccl_tests_last[sighting.source] = (part, sighting)

    def _fingerprint(self, sighting: Sighting) -> None:
        if self.ambiguous_sequences:
            return  # keeps looking after a mismatch: a later duplicate still disqualifies it
        found = _FINGERPRINT.search(sighting.text)
        rank_match = _RANK.search(sighting.text)
        if found is None or rank_match is None:
            return
        sequence, op, shape, dtypes = found.groups()
        rank = rank_match.group(1) or rank_match.group(2)
        printed = f"{op}|{shape}|{dtypes}"
        by_rank = self.fingerprints.get(sequence)
        if by_rank is None:
            if len(self.fingerprints) >= MAX_SEQUENCES:
                del self.fingerprints[next(iter(self.fingerprints))]
            by_rank = self.fingerprints[sequence] = {}
        known = by_rank.get(rank)
        if known is not None:
            if known[0] != printed:
                self.ambiguous_sequences = True  # two process groups share the numbering
            return
        other = next((seen for seen in by_rank.values() if seen[0] != printed), None)
        by_rank[rank] = (printed, sighting)
        if other is not None and self.mismatch is None:
            self.mismatch = (other[1], sighting)

    def _watchdog(self, sighting: Sighting) -> None:
        """A watchdog timeout: the collective this rank waited in. Kept while every timeout names the
        same collective; a second one makes the summary unusable (several groups, or a mismatch)."""
        found = _WATCHDOG.search(sighting.text)
        if found is None or self.timeouts_disagree:
            return
        rank, sequence, op, numel_in, numel_out, shape = found.groups()
        launcher = _RANK.match(sighting.text.lstrip())  # torchrun's "[rankN]:" is the global rank; "[Rank N]" the group's
        if launcher is not None and len(launcher.group(2) or launcher.group(1)) <= len("9999999"):
            rank = launcher.group(2) or launcher.group(1)
        record = (int(sequence), op, numel_in, numel_out, shape)
        if self.timeout_record is None:
            self.timeout_record = record
            if op == "BARRIER" or (op in _ONE_ELEMENT_OPS and numel_in == "1"):
                self.barrier_timeout = sighting
        elif record != self.timeout_record:
            self.timeouts_disagree = True
            return
        if len(self.timed_out) < MAX_RANK_GAP:
            self.timed_out.setdefault(int(rank), sighting)

    def waited_collective(self) -> WaitedCollective | None:
        """The collective every watchdog timeout in the logs names, when two or more ranks timed
        out in it and no timeout names another."""
        if self.timeout_record is None or self.timeouts_disagree or len(self.timed_out) < 2:
            return None
        ranks = tuple(sorted(self.timed_out))
        silent = tuple(rank for rank in range(ranks[-1]) if rank not in self.timed_out) if ranks[-1] <= MAX_RANK_GAP else ()
        first = min(self.timed_out.values(), key=lambda sighting: (sighting.source, sighting.line_number))
        return WaitedCollective(self.timeout_record[0], self.timeout_record[1], ranks, silent, first)

    def derived(self) -> list[Derived]:
        result = []
        for network in self.networks.values():
            result.extend(self._gdr_missing(network))
        if self.distance is not None and self.roce is not None:
            result.append(Derived("ROCE002", ROCE_DISTANCE_SPECIFICITY, (self.distance, self.roce)))
        if self.mismatch is not None and not self.ambiguous_sequences:
            result.append(Derived("NCCL009", MISMATCH_SPECIFICITY, self.mismatch))
        if self.no_verbs is not None and self.socket_on_ib is not None:
            result.append(Derived("IB009", NO_VERBS_SPECIFICITY, (self.no_verbs, self.socket_on_ib)))
        if self.sm120_board is not None and self.nccl_before_sm120_fix is not None:
            result.append(Derived("PCI005", SM120_SPECIFICITY, (self.sm120_board, self.nccl_before_sm120_fix)))
        if self.bus_error is not None and self.shm_frame is not None:
            result.append(Derived("NCCL007", SHM_SIGBUS_SPECIFICITY, (self.bus_error, self.shm_frame)))
        if self.intra_node_stall is not None:
            result.append(Derived(INTRA_NODE_STALL, STALL_SPECIFICITY, self.intra_node_stall, role="symptom"))
        unrouted = next((address for address in self.unrouted_failed if address in self.unrouted_used), None)
        if unrouted is not None:
            pair = sorted((self.unrouted_used[unrouted], self.unrouted_failed[unrouted]), key=lambda seen: (seen.source, seen.line_number))
            result.append(Derived(UNROUTED_REFERENCE, UNROUTED_SPECIFICITY, tuple(pair), ahead_of=UNROUTED_AHEAD_OF))
        busy = self._busy_rank()
        if busy is not None:
            result.append(Derived(BUSY_RANK, BUSY_RANK_SPECIFICITY, busy))
        if self.barrier_timeout is not None:
            result.extend(
                Derived(
                    reference_id, BARRIER_SPECIFICITY - BARRIER_STEP * place, (self.barrier_timeout,), role="symptom",
                    ahead_of=BARRIER_BEFORE,
                )
                for place, reference_id in enumerate(self._barrier_waiters())
            )
        return result

    def _barrier_waiters(self) -> tuple[str, ...]:
        """The barrier's readings, likeliest first. A checkpoint is written by rank 0 (TORCH009's
        first cause), so when rank 0 itself timed out in the barrier it was not the rank away
        writing: the checkpoint reading goes last."""
        if 0 not in self.timed_out:
            return BARRIER_WAITERS
        return (*(waiter for waiter in BARRIER_WAITERS if waiter != CHECKPOINT_WRITER), CHECKPOINT_WRITER)

    def _busy_rank(self) -> tuple[Sighting, ...] | None:
        """The unfinished progress bar a timeout report cut, and the first timeout, when the
        watchdog timed out and rank 0 (the rank that draws the bars) is not among those it names."""
        if self.progress_cut is None or self.timeout_record is None or 0 in self.timed_out:
            return None
        first = min(self.timed_out.values(), key=lambda sighting: (sighting.source, sighting.line_number), default=None)
        return (self.progress_cut,) if first is None or first == self.progress_cut else (self.progress_cut, first)

    def _gdr_missing(self, network: _Network) -> list[Derived]:
        if not network.with_gdr or not network.receive_without:
            return []
        named_both = [host for host in network.receive_without if host is not None and host in network.with_gdr]
        if named_both:
            # One node uses GPUDirect RDMA for some GPUs and not for others: the path is there,
            # the GPU-to-NIC distance turned it off.
            host = named_both[0]
            reference_id = "ROCE002" if self.roce is not None else "TOPO005"
            return [Derived(reference_id, GDR_SPECIFICITY, (network.receive_without[host], network.with_gdr[host]))]
        without = next(iter(network.receive_without.values()))
        return [Derived("GDR001", GDR_SPECIFICITY, (without, next(iter(network.with_gdr.values()))))]
