"""The parts of ``preflight explain``: prefix peeling, the streaming reader, the literal-gated
matcher (including hard-wrapped lines) and the ranking of causes above symptoms."""

from __future__ import annotations

import gzip
import io
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from preflight.explain.analysis import Analysis
from preflight.explain.matcher import Matcher
from preflight.explain.prefixes import parse_line, strip_ansi
from preflight.explain.reader import MAX_LINE, ReadStats, iter_inputs
from preflight.model import Evidence as FindingEvidence, Finding, Reference, Severity, Status
from preflight.signatures import required_literals, safety_problems

if TYPE_CHECKING:
    from preflight.explain import Explanation


def _explained(tmp_path: Path, text: str, name: str = "run.log") -> "Explanation":
    """``explain`` on ``text`` written to a log file, with the packaged catalogue."""
    from preflight.explain import explain, load_catalogue

    log = tmp_path / name
    log.write_text(text)
    return explain([str(log)], catalogue=load_catalogue())


def _ranked(explanation: "Explanation") -> list[tuple[str, str]]:
    return [(c.reference_id, c.tier) for c in explanation.candidates]

NCCL_WARN = "gpu-node-07:20871:21002 [3] NCCL WARN NET/IB : Got completion from peer 10.1.2.8<41937> with status=12 opcode=1 len=0 vendor err 129 (Recv)"


@pytest.mark.parametrize(
    ("line", "host", "rank", "time_text"),
    [
        (NCCL_WARN, "gpu-node-07", None, None),
        (NCCL_WARN.replace("[3] NCCL", "[3] transport/net_ib.cc:1909 NCCL"), "gpu-node-07", None, None),
        ("2026-03-14T09:21:33.123456789Z [rank3]:" + NCCL_WARN, "gpu-node-07", 3, "2026-03-14T09:21:33.123456789Z"),
        ("[1,5]<stderr>:" + NCCL_WARN, "gpu-node-07", 5, None),
        ("node07: " + NCCL_WARN, "gpu-node-07", None, None),
        ("  12: " + NCCL_WARN, "gpu-node-07", 12, None),
        ("(RayWorkerWrapper pid=81234, ip=10.0.3.7) " + NCCL_WARN, "gpu-node-07", None, None),
        ("(RayWorkerWrapper pid=81234, ip=10.0.3.7) RuntimeError: x", "10.0.3.7", None, None),
        ("[pod/trainer-3/pytorch] [default6]:" + NCCL_WARN, "gpu-node-07", 6, None),
        ("[pod/trainer-3/pytorch] [default6]:RuntimeError: x", "trainer-3", 6, None),
        ("2026-03-14T09:21:33.123Z\tjob/worker-2\t" + NCCL_WARN, "gpu-node-07", None, "2026-03-14T09:21:33.123Z"),
        ("[rank5]:[E0314 09:31:34.000 ProcessGroupNCCL.cpp:616] [Rank 5] Watchdog caught collective operation timeout", None, 5, "03-14 09:31:34"),
        ("Mar 14 09:20:01 gpu-node-02 kernel: [ 1234.567890] mlx5_core 0000:1a:00.0: port down", "gpu-node-02", None, "Mar 14 09:20:01"),
        ("RuntimeError: NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled system error", None, None, None),
        ("[1773480093.500000] [gpu-node-07:20871:0]    ib_mlx5_log.c:177  UCX  ERROR Transport retry", "gpu-node-07", None, "2026-03-14T09:21:33.500000Z"),
        ("node07: [2026-03-14 09:21:33,123] [INFO] [comm.py:652:init_distributed] RuntimeError: x", "node07", None, "2026-03-14 09:21:33,123"),
    ],
)
def test_prefixes_name_host_rank_and_time(line: str, host: str | None, rank: int | None, time_text: str | None) -> None:
    meta, message = parse_line(line, 2026)
    assert (meta.host, meta.rank, meta.time_text) == (host, rank, time_text)
    assert message.split()[0] in {"NET/IB", "mlx5_core", "RuntimeError:", "Transport"} or "Watchdog" in message


def test_timestamps_compare_across_formats_and_zones() -> None:
    early, _ = parse_line("2026-03-14T10:21:33+01:00 x", 2026)
    late, _ = parse_line("2026-03-14T09:21:34Z x", 2026)
    assert early.time is not None and late.time is not None and early.time < late.time


def test_colour_codes_and_their_remnants_are_removed() -> None:
    assert strip_ansi("\x1b[33mNCCL WARN\x1b[0m x") == "NCCL WARN x"
    assert strip_ansi("[31mNCCL WARN[0m x") == "NCCL WARN x"
    assert strip_ansi("[rank3]: x[1]") == "[rank3]: x[1]"


def _reference(ref_id: str, *signatures: tuple[str, str]) -> Reference:
    return Reference(
        id=ref_id, symbol=ref_id.lower(), title=ref_id, area="test", severity=Severity.ERROR, summary="s", fix=("f",),
        signatures=tuple({"pattern": pattern, "role": role, "examples": []} for role, pattern in signatures),
    )


CAUSE = _reference("IBX001", ("cause", r"vendor err 129"))
SYMPTOM = _reference("NCX001", ("symptom", r"Watchdog caught collective operation timeout"))
SETTING = _reference("NEX001", ("context", r"NET/Socket : Using \[0\]docker0"))


def _explain(text: str, *references: Reference) -> Analysis:
    matcher = Matcher(references or (CAUSE, SYMPTOM, SETTING))
    analysis = Analysis(year=2026)
    stats = ReadStats()
    for chunk in iter_inputs(["-"], stats, io.BytesIO(text.encode())):
        for hit in matcher.scan(chunk):
            analysis.add(hit)
    return analysis


def test_cause_outranks_earlier_and_more_numerous_symptoms() -> None:
    lines = [f"2026-03-14T09:3{n}:00Z [rank{n}]:[Rank {n}] Watchdog caught collective operation timeout" for n in range(5)]
    lines.append("2026-03-14T09:29:00Z [rank3]:" + NCCL_WARN)
    analysis = _explain("\n".join(lines) + "\n")
    ranked = [c.reference_id for c in analysis.candidates()]
    assert ranked == ["IBX001", "NCX001", "NCCL014"]  # the cascade reference comes last, as a symptom
    cascade = analysis.cascade()
    assert cascade is not None and cascade.first.actor == "rank 3" and cascade.first.evidence.host == "gpu-node-07"
    assert cascade.later == 4
    assert cascade.ordered_by == "timestamps"


def test_a_tear_down_notice_after_another_failure_adds_nothing_to_its_reference() -> None:
    """A notice printed because of a failure read before it (PyTorch's tear-down, a launcher's
    report of a worker that exited) ranks below that failure's reference, however long its text;
    alone, or after its own reference's failure, it keeps its worth."""
    teardown = {
        "pattern": r"To avoid data inconsistency, we are taking the entire process down",
        "role": "symptom", "examples": [], "after_failure": True,
    }
    down = Reference(
        id="TDX001", symbol="tdx001", title="TDX001", area="test", severity=Severity.ERROR, summary="s", fix=("f",),
        signatures=(teardown,),
    )
    timeout = "[E ProcessGroupNCCL.cpp:475] [Rank 1] Watchdog caught collective operation timeout\n"
    notice = "[E ProcessGroupNCCL.cpp:495] To avoid data inconsistency, we are taking the entire process down.\n"
    ranked = [(c.reference_id, c.score) for c in _explain(timeout + notice, SYMPTOM, down).candidates()]
    assert [r for r, _ in ranked] == ["NCX001", "TDX001"] and dict(ranked)["TDX001"] == 0
    assert [c.reference_id for c in _explain(notice + timeout, SYMPTOM, down).candidates()] == ["TDX001", "NCX001"]
    alone = _explain(notice, SYMPTOM, down).candidates()
    assert [c.reference_id for c in alone] == ["TDX001"] and alone[0].score > 0


def test_launcher_reports_of_a_worker_that_died_of_a_timeout_do_not_outrank_it(tmp_path: Path) -> None:
    """torchrun's and srun's reports of the worker the watchdog took down name no cause: with the
    packaged catalogue the timeout's references come first and TORCH011 is worth nothing (before
    its report signatures were marked after_failure it ranked first, on their long literals)."""
    log = "\n".join([
        "[rank1]:[E1015 04:12:55.118734913 ProcessGroupNCCL.cpp:632] [Rank 1] Watchdog caught collective operation timeout:"
        " WorkNCCL(SeqNum=412, OpType=ALLREDUCE, NumelIn=1048576, NumelOut=1048576, Timeout(ms)=600000) ran for 600073 milliseconds before timing out.",
        "E1015 04:13:40.512000 140213 torch/distributed/elastic/multiprocessing/api.py:869] failed (exitcode: -6) local_rank: 1 (pid: 20871) of binary: /usr/bin/python3",
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:",
        "srun: error: gpu-node-03: task 1: Aborted (core dumped)",
    ]) + "\n"
    candidates = _explained(tmp_path, log).candidates
    scores = {c.reference_id: c.score for c in candidates}
    assert candidates[0].reference_id != "TORCH011" and scores["TORCH011"] == 0 and scores["NCCL003"] > 0
    # Alone, the report still names TORCH011.
    alone = _explained(tmp_path, log.split("\n", 1)[1]).candidates
    assert alone[0].reference_id == "TORCH011" and alone[0].score > 0


def test_a_setting_counts_only_when_the_log_also_fails() -> None:
    setting = "host:1:2 [0] NCCL INFO NET/Socket : Using [0]docker0:172.17.0.2<0>\n"
    assert _explain(setting * 3).candidates() == []
    assert [e.reference_id for e in _explain(setting).settings_seen()] == ["NEX001"]
    failing = setting + "[Rank 0] Watchdog caught collective operation timeout\n"
    assert [c.reference_id for c in _explain(failing).candidates()] == ["NEX001", "NCX001"]


def test_line_numbers_survive_chunking(monkeypatch: pytest.MonkeyPatch) -> None:
    import preflight.explain.reader as reader

    monkeypatch.setattr(reader, "CHUNK", 64)
    text = "".join(f"noise line {n}\n" for n in range(1, 200)) + NCCL_WARN + "\n" + "tail\n" * 50
    analysis = _explain(text)
    example = analysis.by_reference["IBX001"].examples[0]
    assert example.line_number == 200


def test_hard_wrapped_message_is_rejoined() -> None:
    wrapped = NCCL_WARN[:100] + "\n" + NCCL_WARN[100:] + "\n"
    assert "vendor err 129" not in wrapped.splitlines()[0]
    analysis = _explain(wrapped, _reference("IBX002", ("cause", r"Got completion from peer \S+ with status=12 opcode=1")))
    assert [c.reference_id for c in analysis.candidates()] == ["IBX002"]


def test_a_line_that_matched_alone_is_not_counted_again_joined_to_the_next() -> None:
    """The next line has no log prefix, so the two are tried joined (a possible hard wrap); the
    signature lies wholly in the first, which already counted it."""
    log = NCCL_WARN + "\nsrc/transport/ibrc.cpp:486: non-zero status: 2 Unable to register memory handle\n"
    analysis = _explain(log)
    assert analysis.by_reference["IBX001"].lines == 1


def _read_all(paths: list[str], stdin: bytes = b"") -> tuple[ReadStats, bytes]:
    stats = ReadStats()
    data = b"".join(chunk.data for chunk in iter_inputs(paths, stats, io.BytesIO(stdin)))
    return stats, data


def test_reader_handles_gzip_directories_and_bad_inputs(tmp_path: Path) -> None:
    (tmp_path / "ranks").mkdir()
    (tmp_path / "ranks" / "rank0.log").write_text("a\nb\n")
    with gzip.open(tmp_path / "ranks" / "rank1.log.gz", "wt") as handle:
        handle.write("c\nd")
    (tmp_path / "core").write_bytes(b"\x7fELF\x00\x00\x01" * 100)
    (tmp_path / "latin1.log").write_bytes("caf\xe9 vendor\n".encode("latin-1"))
    (tmp_path / "broken.gz").write_bytes(b"\x1f\x8b\x08\x00garbage")
    stats, data = _read_all([str(tmp_path / "ranks"), str(tmp_path / "core"), str(tmp_path / "missing.log"), str(tmp_path / "latin1.log"), str(tmp_path / "broken.gz")])
    assert data == b"a\nb\nc\nd\ncaf\xe9 vendor\n"
    assert stats.files == 3 and stats.lines == 5
    problems = "\n".join(stats.problems)
    assert "core: binary data" in problems and "missing.log: cannot read" in problems and "ENOENT" in problems
    assert "broken.gz" in problems


def test_an_endless_line_is_scanned_in_pieces(tmp_path: Path) -> None:
    path = tmp_path / "one-line.log"
    path.write_bytes(b"x" * (MAX_LINE * 5 + 10))
    stats = ReadStats()
    sizes = [len(chunk.data) for chunk in iter_inputs([str(path)], stats)]
    assert max(sizes) <= MAX_LINE + 1 and stats.split_lines == 5 and stats.lines == 1


def test_literals_and_safety_of_patterns() -> None:
    assert required_literals(r"Got completion (?:from peer \S+ )?with") == ("Got completion ",)
    assert required_literals(r"(?:Connection refused|ECONNREFUSED)") == ("Connection refused", "ECONNREFUSED")
    assert required_literals(r"(?i)vendor err") == ()
    assert required_literals(r"\d+ ab") == ()
    assert safety_problems(r"(a+)+b") and safety_problems(r".*a.*b.*c") and safety_problems(r"(a)\1")
    assert safety_problems(r"vendor err (\d+).{0,80}status") == []


def test_built_in_failure_warning_and_observation_patterns_are_safe() -> None:
    """The matcher's own patterns face the same untrusted lines as the catalogue's."""
    from preflight.explain.combinations import OBSERVATION_SIGNATURES
    from preflight.explain.matcher import GENERIC_FAILURES, GENERIC_WARNINGS

    for pattern in [*GENERIC_FAILURES, *GENERIC_WARNINGS, *(pattern for _, pattern in OBSERVATION_SIGNATURES)]:
        assert safety_problems(pattern) == [], pattern
        assert required_literals(pattern), pattern


def test_parallel_scan_reports_the_same_hits_in_the_same_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import preflight.explain.parallel as parallel
    import preflight.explain.reader as reader
    from preflight.catalogue import load_all

    monkeypatch.setattr(reader, "CHUNK", 4096)
    monkeypatch.setattr(parallel, "PARALLEL_AFTER_BYTES", 8192)
    log = tmp_path / "ranks.log"
    with open(log, "w") as handle:
        for n in range(20000):
            handle.write(f"host{n % 7}:1:2 [0] NCCL INFO Channel {n % 32:02d}/0 : 0[0] -> 1[1] via P2P/IPC\n")
            if n % 997 == 0:
                handle.write(f"[rank{n % 64}]:" + NCCL_WARN + "\n")
    matcher = Matcher(load_all())

    def hits(workers: int) -> list[tuple[str, int, int, str]]:
        stats = ReadStats()
        found = parallel.scan_chunks(matcher, iter_inputs([str(log)], stats), stats, workers=workers)
        return [(h.signature.reference_id, h.signature.number, h.line_number, h.text) for h in found]

    serial = hits(1)
    assert len(serial) >= 20 and serial == hits(2)

    # Sizes that promise a large input start the pool before the first chunk; same answer.
    started = []
    real_start = parallel._start_pool
    monkeypatch.setattr(parallel, "_start_pool", lambda m, count: started.append(count) or real_start(m, count))
    stats = ReadStats()
    found = parallel.scan_chunks(matcher, iter_inputs([str(log)], stats), stats, workers=2, expected_bytes=log.stat().st_size)
    early = [(h.signature.reference_id, h.signature.number, h.line_number, h.text) for h in found]
    assert early == serial and started == [2]


def test_only_a_plain_record_start_skips_the_wrap_join() -> None:
    """The byte-level shortcut must agree with the normalised check: anything normalise() could
    change at the start of the next line (a redraw, colours, quoting, inline code, indentation)
    goes the slow way."""
    from preflight.explain.matcher import _surely_new_record
    from preflight.explain.posts import is_continuation, normalise

    plain = [b"host1:12:34 [0] NCCL INFO x", b"2026-03-14T09:21:33Z rank1 x", b"[rank3]: x", b"Mar  4 10:00:01 node kernel: x"]
    for raw in plain:
        assert _surely_new_record(raw) and not is_continuation(normalise(raw.decode()))
    tricky = [
        b"\x1b[0mcontinued text",  # colour codes in front of a continuation
        b"[0mcontinued text",  # the same with the ESC byte lost in a copy
        b"> continued text",  # a quoted post
        b"`continued text`",
        b"  indented rest",
        b"progress 10%\rcontinued text",
        b"continued text",
        b"",
    ]
    assert not any(_surely_new_record(raw) for raw in tricky)


def _channel(host: str | None, rank: int, peer: int, direction: str, via: str) -> str:
    header = f"{host}:4121:4188 [{rank % 8}] NCCL INFO " if host else ""
    return f"{header}Channel 00/0 : {peer}[{peer % 8}] -> {rank}[{rank % 8}] [{direction}] via {via}"


def _tiered(text: str) -> list[tuple[str, str]]:
    return [(c.reference_id, c.tier) for c in _explain(text, CAUSE).candidates()]


def test_a_receive_channel_without_gdrdma_where_others_have_it_is_gpudirect_rdma_missing() -> None:
    """The combination alone makes GDR001 a cause; the lines one at a time are healthy INFO."""
    log = _channel(None, 9, 2, "send", "NET/IB/0/GDRDMA") + "\n" + _channel(None, 2, 9, "receive", "NET/IB/1") + "\n"
    assert _tiered(log) == [("GDR001", "cause")]
    analysis = _explain(log, CAUSE)
    evidence = analysis.candidates()[0].hits.examples
    assert {e.line_number for e in evidence} == {1, 2} and all(e.signature == 0 for e in evidence)
    assert [c.reference_id for c in analysis.candidates()] == ["GDR001"]  # asked twice, same answer
    # The node without it shows it nowhere, the other node everywhere: the node lacks the path.
    two_nodes = "\n".join([_channel("node-a", 0, 8, "receive", "NET/IB/0/GDRDMA"), _channel("node-b", 8, 0, "receive", "NET/IB/0")]) + "\n"
    assert _tiered(two_nodes) == [("GDR001", "cause")]


@pytest.mark.parametrize(
    "lines",
    [
        # Socket transport: never GPUDirect RDMA, on a healthy node too.
        [_channel("n1", 0, 8, "send", "NET/Socket/0"), _channel("n1", 0, 8, "receive", "NET/Socket/0")],
        # Sends without it are NCCL's default before Ampere (GDR reads off); receives have it.
        [_channel("n1", 0, 8, "send", "NET/IB/0"), _channel("n1", 0, 8, "receive", "NET/IB/0/GDRDMA")],
        # Nothing has it: no disagreement to read (the node may simply have no GPUDirect RDMA).
        [_channel("n1", 0, 8, "receive", "NET/IB/0"), _channel("n2", 8, 0, "receive", "NET/IB/0")],
        # GPUDirect RDMA on IB, and a socket channel without it: different networks.
        [_channel("n1", 0, 8, "receive", "NET/IB/0/GDRDMA"), _channel("n1", 1, 9, "receive", "NET/Socket/0")],
    ],
)
def test_channel_lines_that_agree_are_no_cause(lines: list[str]) -> None:
    assert _tiered("\n".join(lines) + "\n") == []


def test_one_host_with_and_without_gdrdma_is_the_gpu_to_nic_distance() -> None:
    lines = [_channel("node-a", 0, 8, "receive", "NET/IB/0/GDRDMA"), _channel("node-a", 4, 12, "receive", "NET/IB/1")]
    assert _tiered("\n".join(lines) + "\n") == [("TOPO005", "cause")]
    roce = "node-a:4121:4121 [0] NCCL INFO NET/IB : Using [0]mlx5_0:1/RoCE [1]mlx5_1:1/RoCE ; OOB eth0:10.0.0.1<0>"
    assert _tiered("\n".join([roce, *lines]) + "\n") == [("ROCE002", "cause")]


def _fingerprint(rank: int, sequence: int, shape: str, op: str = "ALLREDUCE") -> str:
    return (
        f"[rank{rank}]:[I1017 19:34:58.923985894 ProcessGroupWrapper.cpp:587] [Rank {rank}] Running collective: "
        f"CollectiveFingerPrint(SequenceNumber={sequence}, OpType={op}, TensorShape=[{shape}], TensorDtypes=Float, "
        "TensorDeviceTypes=TensorOptions(dtype=float (default), device=cuda))"
    )


def test_ranks_disagreeing_about_one_collective_are_a_mismatch() -> None:
    log = "\n".join([_fingerprint(0, 38, "100, 1"), _fingerprint(1, 38, "100, 1"), _fingerprint(2, 38, "77, 1")]) + "\n"
    assert _tiered(log) == [("NCCL009", "cause")]
    other_op = "\n".join([_fingerprint(0, 5, "4"), _fingerprint(1, 5, "4", op="BROADCAST")]) + "\n"
    assert _tiered(other_op) == [("NCCL009", "cause")]


def _timeout(rank: int, sequence: int, op: str = "ALLREDUCE", numel: str = "NumelIn=1, NumelOut=1, ") -> str:
    return (
        f"[rank{rank}]:[E1015 04:12:55.118734913 ProcessGroupNCCL.cpp:632] [Rank {rank}] Watchdog caught collective operation"
        f" timeout: WorkNCCL(SeqNum={sequence}, OpType={op}, {numel}Timeout(ms)=600000) ran for 600073 milliseconds before timing out."
    )


def test_watchdog_timeouts_summarise_one_collective_and_never_claim_a_mismatch() -> None:
    """Each rank's watchdog line names the collective it waited in, but not its process group:
    FSDP's and a device mesh's groups number their collectives alike, so timeouts that name
    different collectives are several groups as often as a mismatch, and say nothing."""
    from preflight.explain.combinations import WATCHDOG, Observations, Sighting

    def observed(*lines: str) -> Observations:
        observations = Observations()
        for number, line in enumerate(lines, 1):
            observations.add(WATCHDOG, Sighting("job.log", number, line))
        return observations

    one = observed(_timeout(3, 412), _timeout(1, 412), _timeout(3, 412), _timeout(5, 412))
    waited = one.waited_collective()
    assert waited is not None and (waited.sequence, waited.operation, waited.ranks, waited.silent) == (412, "ALLREDUCE", (1, 3, 5), (0, 2, 4))
    assert waited.first.line_number == 1 and "NCCL009" not in {item.reference_id for item in one.derived()}
    older = observed(_timeout(0, 3, "ALLREDUCE", ""), _timeout(1, 3, "ALLREDUCE", "")).waited_collective()
    assert older is not None and older.silent == ()
    # The launcher's global rank prefix wins over the rank within the group.
    assert observed(_timeout(1, 7), _timeout(2, 7).replace("[rank2]:", "[rank6]:")).waited_collective().ranks == (1, 6)  # type: ignore[union-attr]
    for lines in (
        [_timeout(0, 412), _timeout(1, 412, "BROADCAST")],  # two operations at one number
        [_timeout(0, 9, "ALLGATHER", "NumelIn=8, NumelOut=64, "), _timeout(1, 9, "ALLGATHER", "NumelIn=16, NumelOut=64, ")],
        [_timeout(0, 412), _timeout(1, 413)],
        [_timeout(4, 412)],  # one rank: nothing to compare with
    ):
        disagreeing = observed(*lines)
        assert disagreeing.waited_collective() is None and "NCCL009" not in {item.reference_id for item in disagreeing.derived()}, lines
    # A launcher prefix with an absurd rank number is not taken for the rank.
    absurd = _timeout(2, 7).replace("[rank2]:", "[rank" + "9" * 5000 + "]:")
    assert observed(_timeout(1, 7), absurd).waited_collective().ranks == (1, 2)  # type: ignore[union-attr]
    # A line cut inside its record (a post wrapped at a fixed width) is not read.
    cut = _timeout(1, 2).split("NumelOut=")[0] + "NumelOut="
    assert observed(_timeout(0, 2), cut).waited_collective() is None


def test_agreeing_fingerprints_or_several_process_groups_are_no_mismatch() -> None:
    agreeing = "\n".join(_fingerprint(rank, sequence, "8") for sequence in (1, 2) for rank in range(4)) + "\n"
    assert _tiered(agreeing) == []
    # Rank 0 logs sequence 7 twice with different tensors: two groups number collectives alike.
    groups = "\n".join([_fingerprint(0, 7, "8"), _fingerprint(0, 7, "16"), _fingerprint(1, 7, "16")]) + "\n"
    assert _tiered(groups) == []
    seen_late = "\n".join([_fingerprint(0, 7, "8"), _fingerprint(1, 7, "16"), _fingerprint(1, 7, "8")]) + "\n"
    assert _tiered(seen_late) == []


def test_copies_of_a_channel_line_are_skipped_but_never_a_catalogued_one() -> None:
    """A big job prints the same channel line per channel and peer; only the first reaches the
    analysis, unless a catalogue signature wants the line too (its count stays right)."""
    socket_channel = _reference("SOX001", ("context", r"via NET/Socket/\d"))
    lines = [_channel("n1", 0, 8, "send", "NET/IB/0/GDRDMA")] * 50 + [_channel("n1", 0, 8, "send", "NET/Socket/0")] * 5
    matcher = Matcher([socket_channel])
    hits = [hit for chunk in iter_inputs(["-"], ReadStats(), io.BytesIO(("\n".join(lines) + "\n").encode())) for hit in matcher.scan(chunk)]
    assert sum(1 for hit in hits if hit.signature.reference_id == "SOX001") == 5
    assert sum(1 for hit in hits if hit.signature.reference_id.startswith("~")) == 1 + 5  # IB once; every Socket line


def test_a_new_run_sees_channel_lines_again(tmp_path: Path) -> None:
    from preflight.explain import explain, load_catalogue

    log = tmp_path / "run.log"
    log.write_text(_channel(None, 9, 2, "send", "NET/IB/0/GDRDMA") + "\n" + _channel(None, 2, 9, "receive", "NET/IB/1") + "\n")
    catalogue = load_catalogue()
    for _ in range(2):
        assert [c.reference_id for c in explain([str(log)], catalogue=catalogue).candidates] == ["GDR001"]


@pytest.mark.parametrize(
    "distance",
    [
        "node3:4121:4188 [0] NCCL INFO GPU Direct RDMA Disabled for GPU ca000 / HCA 0 (distance 7 > 4)",
        "gpu-a17:91533:91702 [5] NCCL INFO GPU Direct RDMA Disabled for GPU/0-827392 (rank 5) - NET/0-3 (distance 8 > 5)",
        "node1:1234:5678 [0] NCCL INFO NET/IB : GPU Direct RDMA Disabled for GPU 0[0] / HCA 0 (distance 4 >= 2)",  # NCCL 2.4-2.5
    ],
)
def test_gpudirect_rdma_off_by_distance_is_topology_and_on_roce_ports_the_roce_case(tmp_path: Path, distance: str) -> None:
    from preflight.explain import explain, load_catalogue

    catalogue = load_catalogue()
    alone = tmp_path / "alone.log"
    alone.write_text(distance + "\n")
    ranked = [(c.reference_id, c.tier) for c in explain([str(alone)], catalogue=catalogue).candidates]
    assert ranked[0] == ("TOPO005", "cause") and ("ROCE002", "cause") not in ranked
    on_roce = tmp_path / "roce.log"
    on_roce.write_text("node3:4121:4121 [0] NCCL INFO NET/IB : Using [0]mlx5_0:1/RoCE ; OOB eth0:10.0.0.3<0>\n" + distance + "\n")
    assert [c.reference_id for c in explain([str(on_roce)], catalogue=catalogue).candidates][:2] == ["ROCE002", "TOPO005"]


def test_a_link_local_roce_gid_on_a_retry_exceeded_completion_ranks_the_gid_reference_first(tmp_path: Path) -> None:
    """The same completion line is read by IB006, ROCE006, ROCE007 and ROCE005; only the fe80:
    local GID tells the GID-index cause apart, and it must decide the order."""
    from preflight.explain import explain, load_catalogue

    line = (
        "gpu1:123:456 [0] transport/net_ib.cc:2121 NCCL WARN NET/IB: Got completion from peer 10.0.0.2<1234> with "
        "status=12 opcode=0 len=0 vendor err 129 (Recv) localGid {gid} remoteGids {gid} hca mlx5_0\n"
    )
    catalogue = load_catalogue()
    link_local = tmp_path / "fe80.log"
    link_local.write_text(line.format(gid="fe80::1"))
    assert explain([str(link_local)], catalogue=catalogue).candidates[0].reference_id == "ROCE005"
    routable = tmp_path / "v4.log"
    routable.write_text(line.format(gid="::ffff:10.0.0.1"))
    assert "ROCE005" not in [c.reference_id for c in explain([str(routable)], catalogue=catalogue).candidates]


@pytest.mark.parametrize(
    "no_verbs",
    [
        "gpu4:3101:3160 [0] NCCL INFO Failed to open libibverbs.so[.1]",  # up to 2.29
        "gpu4:3101:3160 [0] NCCL INFO Count not open libibverbs.so.1",  # 2.30
        "gpu4:3101:3160 [0] NCCL INFO Could not open libibverbs.so.1",  # 2.31.2, 2.32 (released libraries)
    ],
)
def test_a_missing_libibverbs_is_a_setting_unless_sockets_run_over_infiniband(tmp_path: Path, no_verbs: str) -> None:
    """NCCL logs the failed dlopen at INFO on every node without RDMA; beside a socket transport on
    an IPoIB interface it names the cause (IB009), and alone it is never the failing line."""
    from preflight.explain import explain, load_catalogue

    catalogue = load_catalogue()
    on_ib = tmp_path / "ib.log"
    on_ib.write_text(no_verbs + "\ngpu4:3101:3160 [0] NCCL INFO NET/Socket : Using [0]ib0:10.10.0.4<0> [1]eth0:192.168.1.4<0>\n")
    ranked = explain([str(on_ib)], catalogue=catalogue).candidates
    assert [(c.reference_id, c.tier) for c in ranked] == [("IB009", "cause")]
    assert {e.line_number for e in ranked[0].hits.examples} == {1, 2}
    on_ethernet = tmp_path / "eth.log"
    on_ethernet.write_text(
        no_verbs + "\ngpu4:3101:3160 [0] NCCL INFO NET/Socket : Using [0]eth0:192.168.1.4<0>\n"
        "gpu4:3101:3101 [0] NCCL INFO comm 0x5581 rank 0 nranks 2 cudaDev 0 busId 1b000 - Destroy COMPLETE\n"
    )
    alone = explain([str(on_ethernet)], catalogue=catalogue)
    assert alone.candidates == [] and alone.first_failure is None and alone.settings_seen == ["IB009"]


def test_a_stalled_log_offers_the_settings_tied_to_failures(tmp_path: Path) -> None:
    explanation = _explained(
        tmp_path,
        "gpu4:3101:3160 [0] NCCL INFO Failed to open libibverbs.so[.1]\n"
        "gpu4:3101:3160 [0] NCCL INFO NET/Socket : Using [0]eth0:192.168.1.4<0>\n"
        "gpu4:3101:3160 [0] NCCL INFO Channel 00/0 : 0[0] -> 8[0] [send] via NET/Socket/0\n",
    )
    assert explanation.stall is not None and explanation.settings_seen == []
    assert ("IB009", "context") in _ranked(explanation)


def test_channel_lines_of_different_hosts_are_never_taken_for_copies() -> None:
    """Timestamps in front of the NCCL header must not make two hosts' lines look alike."""
    lines = [
        "2026-03-14T09:21:33Z " + _channel("node-b", 8, 0, "receive", "NET/IB/1"),
        "2026-03-14T09:21:33Z " + _channel("node-a", 0, 8, "receive", "NET/IB/0/GDRDMA"),
        "2026-03-14T09:21:34Z " + _channel("node-a", 4, 12, "receive", "NET/IB/1"),
    ]
    assert _tiered("\n".join(lines) + "\n") == [("TOPO005", "cause")]


def _scan(matcher: Matcher, text: str) -> list[tuple[int, str]]:
    return [
        (hit.line_number, hit.signature.reference_id)
        for chunk in iter_inputs(["-"], ReadStats(), io.BytesIO(text.encode()))
        for hit in matcher.scan(chunk)
    ]


def test_the_quiet_key_drops_only_time_pid_and_thread() -> None:
    from preflight.explain.matcher import quiet_key

    info = "gpu-node-07:20871:21002 [3] NCCL INFO NET/IB : Using [0]mlx5_0:1/IB ; OOB eno1:10.1.0.7<0>"
    gate = info.index("NET/IB")
    stamped = "2026-03-14T09:21:33.123456789Z " + info.replace("20871:21002", "20999:21111")
    assert quiet_key(info.encode(), gate) == b"gpu-node-07 [3] NCCL INFO NET/IB : Using [0]mlx5_0:1/IB ; OOB eno1:10.1.0.7<0>"
    assert quiet_key(stamped.encode(), stamped.index("NET/IB")) == quiet_key(info.encode(), gate)
    assert quiet_key(info.replace("gpu-node-07", "gpu-node-08").encode(), gate) != quiet_key(info.encode(), gate)
    assert quiet_key(info.replace("[3]", "[4]").encode(), gate) != quiet_key(info.encode(), gate)
    # Anything but a numeric timestamp before the header, a gate there, or no pid:tid: no key.
    assert quiet_key(("error: " + info).encode(), gate + 7) is None
    assert quiet_key(stamped.encode(), 5) is None
    assert quiet_key(info.replace("20871:21002", "pid:tid").encode(), gate) is None
    assert quiet_key(b"plain text NET/IB : Using", 11) is None


def test_copies_of_a_quiet_nccl_line_are_skipped_but_never_one_that_hits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only lines that matched nothing are skipped when another rank or a later time repeats
    them; every copy of a line that hits is reported, and a copy whose next line continues a
    hard-wrapped message is still joined with it."""
    ib_using = _reference("IBU001", ("context", r"NET/IB : Using \[0\]mlx5_0:1/IB \[1\]"))
    wrapped = _reference("IBW001", ("cause", r"NET/IB : Using \[0\]mlx5_0:1/IB ; OOB eno1:\S+<0>then the port went down"))
    quiet = "{t} gpu-node-0{h}:2087{n}:2100{n} [{n}] NCCL INFO NET/IB : Using [0]mlx5_0:1/IB ; OOB eno1:10.1.0.7<0>"
    loud = "{t} gpu-node-01:2087{n}:2100{n} [{n}] NCCL INFO NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_1:1/IB ; OOB eno1:10.1.0.7<0>"
    lines = [quiet.format(t=f"2026-03-14T09:21:{s:02d}Z", h=1, n=s % 8) for s in range(40)]
    lines += [loud.format(t=f"2026-03-14T09:22:{s:02d}Z", n=s % 8) for s in range(10)]
    lines += [quiet.format(t="2026-03-14T09:23:00Z", h=1, n=3), "then the port went down"]
    matcher = Matcher([ib_using, wrapped])
    hits = _scan(matcher, "\n".join(lines) + "\n")
    assert [line for line, ref in hits if ref == "IBU001"] == list(range(41, 51))
    assert [line for line, ref in hits if ref == "IBW001"] == [51]
    assert len(matcher._quiet_keys) == 8  # one per device of node 1: its 40 lines were scanned 8 times
    # The same log without the skip: the same hits.
    monkeypatch.setattr("preflight.explain.matcher.quiet_key", lambda raw, gate: None)
    assert sorted(_scan(Matcher([ib_using, wrapped]), "\n".join(lines) + "\n")) == sorted(hits)


def test_channel_observations_stay_bounded_when_every_line_names_another_host() -> None:
    from preflight.explain.combinations import CHANNEL, MAX_HOSTS, Observations, Sighting

    observations = Observations()
    for n in range(MAX_HOSTS + 500):
        for direction, suffix in (("send", "/GDRDMA"), ("receive", "")):
            line = _channel(f"h{n}", 0, 8, direction, f"NET/IB/0{suffix}")
            observations.add(CHANNEL, Sighting("job.log", n, line))
    (network,) = observations.networks.values()
    assert len(network.with_gdr) == len(network.receive_without) == MAX_HOSTS
    assert [d.reference_id for d in observations.derived()] == ["TOPO005"]  # h0 has both: distance


def test_invalid_argument_is_nvls_only_where_nvls_printed_it(tmp_path: Path) -> None:
    """NVL004's own summary: the error text alone comes from many CUDA calls; transport/nvls.cc
    printing it is what ties it to NVLS setup."""
    from preflight.explain import explain, load_catalogue

    catalogue = load_catalogue()
    line = "gpu-a03:77120:77190 [1] {where} NCCL WARN Cuda failure 1 'invalid argument'\n"
    tiers = {}
    for where in ("transport/nvls.cc:598", "enqueue.cc:1500"):
        log = tmp_path / f"{where.split(':')[0].replace('/', '_')}.log"
        log.write_text(line.format(where=where))
        tiers[where] = {c.reference_id: c.tier for c in explain([str(log)], catalogue=catalogue).candidates}
    assert tiers["transport/nvls.cc:598"]["NVL004"] == "cause"
    assert tiers["enqueue.cc:1500"]["NVL004"] == "symptom" and "cause" not in tiers["enqueue.cc:1500"].values()


@pytest.mark.parametrize(("version", "expected"), [("2.25.1", True), ("2.26.2", False), ("2.9.9", True), ("2.27.3", False)])
def test_a_consumer_blackwell_board_with_nccl_before_2_26_2_is_pci005(tmp_path: Path, version: str, expected: bool) -> None:
    ranked = _ranked(_explained(
        tmp_path,
        "#  Rank  0 Group  0 Pid  12225 on       node device  0 [0000:16:00] NVIDIA GeForce RTX 5090\n"
        f"node:12225:12225 [0] NCCL INFO NCCL version {version}+cuda12.8\n"
        "node:12225:12255 [0] NCCL INFO comm 0x55cc27005c20 rank 0 nranks 2 cudaDev 0 busId 16000 - Init START\n"
        "RuntimeError: NCCL error in: ../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:1970, unhandled cuda error\n",
    ))
    assert (ranked[0] == ("PCI005", "cause")) is expected, ranked


def test_enomem_creating_a_completion_queue_is_memlock_before_the_generic_qp_cq_failure(tmp_path: Path) -> None:
    """The kernel charges a CQ's ring to RLIMIT_MEMLOCK; IB001 reads any CQ creation failure."""
    ranked = _ranked(_explained(
        tmp_path,
        "[1652739463.054681] [cn0022:4071024:0]        ib_iface.c:1035 UCX  ERROR ibv_create_cq(cqe=4096) failed: Cannot allocate memory\n"
        "[cn0022:4071024] pml_ucx.c:309  Error: Failed to create UCP worker\n",
    ))
    assert ranked[:2] == [("MEM001", "cause"), ("IB001", "cause")], ranked
    other = "[1652739463.054681] [cn0022:4071024:0]        ib_iface.c:1035 UCX  ERROR ibv_create_cq(cqe=4096) failed: Invalid argument\n"
    assert _ranked(_explained(tmp_path, other))[0][0] == "IB001"


def test_an_escaping_cpp_exception_is_the_first_failing_line(tmp_path: Path) -> None:
    explanation = _explained(
        tmp_path,
        "[1]<stderr>:some setup line\n"
        "[1]<stderr>:terminate called after throwing an instance of 'gloo::IoException'\n"
        "[1]<stderr>:  what():  [horovod/common/gloo/http_store.cc:53] Wait timeout for key(s): 0\n",
    )
    assert explanation.first_failure is not None and explanation.first_failure.line_number == 2


def test_scan_gates_never_start_at_a_space_a_literal_can_do_without() -> None:
    """The scan stops at every byte that can start a gate; a space is the commonest byte of a log,
    so it may start one only for a literal that has no other opening. (Ten catalogue literals once
    made the greedy cover pick it, and the 1M-line bench went from 1.3 s to 1.8 s.)"""
    from preflight.catalogue import load_all
    from preflight.explain.matcher import _gates

    gates = list(Matcher(load_all())._literals_by_gate)
    assert gates and not any(gate.startswith(b" ") for gate in gates)
    assert _gates(["    x", "Defaulting to rank 0", "Port number 1 state is Down"]).keys() >= {b"    x"}
    assert not any(gate.startswith(b" ") for gate in _gates(["a DUE TO X", " DUE TO TIME LIMIT", " ON node CANCELLED"]))


def test_a_truncated_bootstrap_message_is_nccls_version_mismatch_only_when_nccl_printed_it(tmp_path: Path) -> None:
    """NVSHMEM's copy of NCCL's bootstrap prints the same words for another cause (a stray or
    mis-sized unique-ID exchange), so NCCL017 needs NCCL's own WARN header."""
    nccl = "node07:12001:12001 [0] bootstrap.cc:73 NCCL WARN Message truncated : received 4096 bytes instead of 4160\n"
    assert ("NCCL017", "cause") in _ranked(_explained(tmp_path, nccl))
    nvshmem = "/opt/nvshmem/src/modules/bootstrap/uid/bootstrap_uid.cpp:bootstrap_net_recv:99: Message truncated : received 36 bytes instead of 1\n"
    assert "NCCL017" not in [reference for reference, _ in _ranked(_explained(tmp_path, nvshmem))]


def test_a_gdrcopy_failure_libfabric_reports_by_errno_alone_is_a_symptom(tmp_path: Path) -> None:
    """libfabric's wrapper gives only the errno of gdr_pin_buffer, which other causes share
    (memory another process owns, on an old kernel): never GDR002 at cause tier from it."""
    line = "libfabric:6413:1763620725::core:core:cuda_gdrcopy_dev_register():320<warn> gdr_pin_buffer failed! error: Invalid argument ptr: 0xdc12000000 len: 146800640\n"
    assert _ranked(_explained(tmp_path, line)) == [("GDR002", "symptom")]


def test_the_shared_memory_ring_warning_is_vllms_only_under_vllms_logger(tmp_path: Path) -> None:
    """SGLang's copy of vLLM's ring prints the same words under its own ``[time TPn]`` prefix,
    where they describe another path; VLLM001 needs vLLM's ``shm_broadcast.py:N]``."""
    vllm = "(VllmWorkerProcess pid=1634044) WARNING 11-26 13:07:36 shm_broadcast.py:391] No available block found in 60 second. \n"
    assert ("VLLM001", "cause") in _ranked(_explained(tmp_path, vllm))
    sglang = "[2026-11-03 14:01:20 TP1] No available block found in 60 second. \n"
    assert "VLLM001" not in [reference for reference, _ in _ranked(_explained(tmp_path, sglang))]


def test_a_socket_address_of_no_family_is_a_symptom_of_a_missing_interface(tmp_path: Path) -> None:
    """ncclSocketInit prints it for any address that never was one: an interface that is not
    there is one cause, a unique ID that did not arrive intact (NVSHMEM's copy) another."""
    line = "ncclSocketInit: connecting to address  with family 0 is neither AF_INET(2) nor AF_INET6(10)\n"
    assert ("NET005", "symptom") in _ranked(_explained(tmp_path, line))
    assert all(tier != "cause" for _, tier in _ranked(_explained(tmp_path, line)))


# Fallbacks a library logs as information, then the line it prints when it cannot go on.
# NCCL looks for each net-plugin symbol version in turn and says so at INFO ("Failed to find
# ncclNetPlugin_v6 symbol") before loading an older one; UCX at DEBUG says which optional pieces it
# went without ("failed to create registration cache"). What stops a run is a WARN or an ERROR.
QUIET_FALLBACKS = {
    "nccl-info": (
        [
            "node-1:440225:440225 [0] NCCL INFO Bootstrap : Using ens7:10.128.0.30<0>",
            "node-1:440225:440225 [0] NCCL INFO NET/Plugin: Failed to find ncclNetPlugin_v6 symbol.",
            "node-1:440225:440225 [0] NCCL INFO NET/Plugin: Loaded net plugin FastSocket (v4)",
        ],
        "node-1:440225:440262 [0] misc/socket.cc:484 NCCL WARN socketStartConnect: exceeded retries (20000)",
    ),
    "ucx-debug": (
        [
            "[1601415622.654729] [h13n02:130948:0]          ib_md.c:1149 UCX  DEBUG mlx5_1: failed to create registration cache: Unsupported operation",
            "[1601415622.673312] [h13n02:130948:0]        knem_md.c:374  UCX  DEBUG Could not create registration cache: Unsupported operation",
            "[1601415622.673312] [h13n02:130948:0]         parser.c:1991 UCX  INFO  UCX_* env variable: UCX_MEM_MMAP_HOOK_MODE=none",
        ],
        "[1601415623.000001] [h13n02:130948:0]       ucp_worker.c:1870 UCX  ERROR failed to create worker: No resources are available",
    ),
}


@pytest.mark.parametrize("library", sorted(QUIET_FALLBACKS))
def test_a_fallback_logged_as_information_is_not_the_failing_line(tmp_path: Path, library: str) -> None:
    fallbacks, failure = QUIET_FALLBACKS[library]
    assert _explained(tmp_path, "\n".join(fallbacks) + "\n").first_failure is None
    named = _explained(tmp_path, "\n".join([*fallbacks, failure]) + "\n").first_failure
    assert named is not None and named.text == failure


@pytest.mark.parametrize(("frame", "expected"), [("ncclShmOpen", True), ("ncclProxyService", False)])
def test_a_bus_error_inside_nccl_shm_setup_is_nccl007(tmp_path: Path, frame: str, expected: bool) -> None:
    """NCCL up to 2.18 wrote its /dev/shm segment after an ftruncate: a full tmpfs is a SIGBUS in
    ncclShmOpen with no NCCL message. The bus error alone, or a frame elsewhere, names nothing."""
    ranked = _ranked(_explained(
        tmp_path,
        'Thread 12 "python" received signal SIGBUS, Bus error.\n'
        f"0x00007f6b59544f3b in {frame}(char*, unsigned long, void**, void**, int, void**) () from /usr/lib/libnccl.so.2\n"
        "#1 0x00007f6b595436d7 in start_thread () from /lib/x86_64-linux-gnu/libc.so.6\n",
    ))
    assert (("NCCL007", "cause") in ranked) is expected, ranked


@pytest.mark.parametrize(
    ("record", "barrier"),
    [
        ("OpType=ALLREDUCE, NumelIn=1, NumelOut=1", True),  # barrier() on the NCCL backend
        ("OpType=ALLGATHER, NumelIn=1, NumelOut=8", True),  # the size exchange of all_gather_object
        ("OpType=BARRIER, NumelIn=1, NumelOut=1", True),
        ("OpType=ALLREDUCE, NumelIn=1048576, NumelOut=1048576", False),  # gradients: no barrier
    ],
)
def test_a_timeout_in_a_barrier_names_the_rank_that_was_elsewhere(tmp_path: Path, record: str, barrier: bool) -> None:
    """Ranks that timed out in a one-element collective waited at a synchronisation point for a
    rank busy elsewhere: the checkpoint writer, single-rank work, or a skipped call. All symptom
    tier (no line says which), and ahead of the generic timeout."""
    log = (
        f"[rank1]:[E1204 10:00:00.000000 ProcessGroupNCCL.cpp:632] [Rank 1] Watchdog caught collective operation timeout: "
        f"WorkNCCL(SeqNum=4117, {record}, Timeout(ms)=600000) ran for 600046 milliseconds before timing out.\n"
    )
    explanation = _explained(tmp_path, log)
    ranked = _ranked(explanation)
    waiters = [("TORCH009", "symptom"), ("NCCL011", "symptom"), ("TORCH002", "symptom")]
    if barrier:
        from preflight.explain.render import render_text

        assert ranked[:3] == waiters, ranked
        assert ranked.index(("NCCL003", "symptom")) > 2
        assert "timed out in a one-element collective" in render_text(explanation)  # says why, not "a downstream symptom"
    else:
        assert not set(waiters) & set(ranked), ranked


def test_the_barrier_waiters_stay_ahead_however_many_ranks_report_the_timeout(tmp_path: Path) -> None:
    """Every rank's report and its tear-down lines match the generic timeout (NCCL003) and the
    all-reduce hang (NCCL001) again and again; the barrier's reading of the same lines keeps its
    three waiters first all the same."""
    lines = []
    for rank in range(1, 8):
        lines += [
            _timeout(rank, 3),
            f"[rank{rank}]:[E1015 04:12:55.118 ProcessGroupNCCL.cpp:1537] [PG 0 Rank {rank}] Timeout at NCCL work: 3, last enqueued NCCL work: 3, last completed NCCL work: 2.",
            f"[rank{rank}]:[E1015 04:12:55.118 ProcessGroupNCCL.cpp:577] [Rank {rank}] Some NCCL operations have failed or timed out. Due to the asynchronous nature of CUDA kernels, subsequent GPU operations might run on corrupted/incomplete data.",
        ]
    ranked = _ranked(_explained(tmp_path, "\n".join(lines) + "\n"))
    assert ranked[:3] == [("TORCH009", "symptom"), ("NCCL011", "symptom"), ("TORCH002", "symptom")], ranked
    assert ("NCCL003", "symptom") in ranked[3:]


@pytest.mark.parametrize(("ranks", "order"), [((1, 2, 3), ("TORCH009", "NCCL011", "TORCH002")), ((0,), ("NCCL011", "TORCH002", "TORCH009")), ((0, 1, 2), ("NCCL011", "TORCH002", "TORCH009"))])
def test_a_barrier_rank_0_timed_out_in_was_not_held_up_by_rank_0s_checkpoint(tmp_path: Path, ranks: tuple[int, ...], order: tuple[str, ...]) -> None:
    """Rank 0 writes the checkpoint TORCH009 describes: while it waited in the barrier itself, the
    rank away from the barrier was busy otherwise or skipped it, and the checkpoint reading goes last."""
    ranked = _ranked(_explained(tmp_path, "\n".join(_timeout(rank, 3) for rank in ranks) + "\n"))
    assert tuple(reference_id for reference_id, _tier in ranked[:3]) == order, ranked


@pytest.mark.parametrize(("count", "expected"), [("290", ("TORCH007", "cause")), ("0", ("TORCH007", "symptom"))])
def test_a_ddp_parameter_count_of_0_is_an_exchange_that_never_delivered_not_another_model(tmp_path: Path, count: str, expected: tuple[str, str]) -> None:
    """DDP reads the other ranks' counts from a buffer the all-gather should have filled: 0 says the
    exchange failed (a straggler, or no data moved), so only a real count is TORCH007's cause."""
    line = f"RuntimeError: DDP expects same model across all ranks, but Rank 5 has 288 params, while rank 0 has inconsistent {count} params.\n"
    assert expected in _ranked(_explained(tmp_path, line))


@pytest.mark.parametrize(
    ("line", "net001"),
    [
        ("[E socket.cpp:922] [c10d] The client socket has timed out after 1800s while trying to connect to (172.17.0.2\n, 44737).", True),
        ("[W socket.cpp:601] [c10d] The client socket has failed to connect to [172.17.0.3]:29500 (errno: 110 - Connection timed out).", True),
        ("[E socket.cpp:922] [c10d] The client socket has timed out after 1800s while trying to connect to (10.1.2.3, 29500).", False),
        ("[W socket.cpp:601] [c10d] The client socket has failed to connect to [172.170.0.3]:29500 (errno: 110 - Connection timed out).", False),
    ],
)
def test_a_c10d_store_client_failing_on_a_docker_bridge_address_is_net001(tmp_path: Path, line: str, net001: bool) -> None:
    """c10d's TCPStore client naming a 172.17.x.y address: the rendezvous points at a container's
    private bridge address (NET001), also when the post wraps the record before the port."""
    ranked = _ranked(_explained(tmp_path, line + "\n"))
    assert (("NET001", "cause") in ranked) is net001, ranked


@pytest.mark.parametrize(("advertised", "first"), [("169.254.170.23", "NET001"), ("169.254.9.9", "EFA001"), ("172.17.0.2", "NET001")])
def test_a_failed_connect_to_the_unreachable_address_nccl_advertised_is_its_interface_choice(tmp_path: Path, advertised: str, first: str) -> None:
    """NCCL listed a link-local or bridge address among its interfaces, and a connection to that very
    address failed: the interface choice (NET001) comes before the plugin's fallback on the way
    (EFA001) and a peer that was not listening (SOCK004). Another address proves nothing of the kind."""
    target = "172.17.0.2" if advertised.startswith("172.") else "169.254.170.23"
    log = (
        "node-3:5512:5512 [0] NCCL INFO NET/OFI No eligible providers were found\n"
        "node-3:5512:5512 [0] NCCL INFO NET/OFI aws-ofi-nccl initialization failed\n"
        f"node-3:5512:5512 [0] NCCL INFO NET/Socket : Using [0]enp73s0:10.1.216.156<0> [1]pod-id-link0:{advertised}<0>\n"
        f"node-4:6120:6190 [0] NCCL INFO socketPollConnect: connect to {target}<51877> returned Connection refused, retrying (13/34) after sleep for 1300 msec\n"
    )
    ranked = _ranked(_explained(tmp_path, log))
    assert ranked[0] == (first, "cause"), ranked
    if first == "NET001":
        assert ranked.index(("SOCK004", "cause")) > 0


@pytest.mark.parametrize(("local_gid", "first"), [("fe80::ba59:9fff:fe3c:10a2", "ROCE005"), ("::ffff:10.20.2.13", "IB002")])
def test_a_timed_out_rtr_names_the_gid_index_only_for_a_link_local_source_gid(tmp_path: Path, local_gid: str, first: str) -> None:
    """NCCL 2.24+ prints the queue pair's GIDs when a move to RTR fails. A timeout there is an
    unresolved peer address (IB002) unless the source GID is link-local: then the GID NCCL used
    is the cause (ROCE005)."""
    line = (
        "gpu-node-03:1422:1530 [0] misc/ibvwrap.cc:376 NCCL WARN Call to ibv_modify_qp failed with 110 Connection timed out,"
        f" on dev mlx5_2:1, curr state INIT, next state RTR, local GID index 3, local GID {local_gid}, remote GID ::ffff:10.20.5.41\n"
    )
    ranked = _ranked(_explained(tmp_path, line))
    assert ranked[0] == (first, "cause"), ranked


BUSY_BAR = "Running tokenizer on dataset:  {percent}%|███▊      | 280000/2969526 [29:55<4:48:08, 155.57 examples/s]"


@pytest.mark.parametrize(
    ("percent", "rank_zero_timed_out", "busy"),
    [
        ("9", False, True),  # rank 0 still tokenising when the others' 30 minutes ran out
        ("100", False, False),  # the loop finished: whatever hung came after it
        ("9", True, False),  # rank 0 waited in the collective like the others
    ],
)
def test_a_progress_bar_cut_by_the_others_timeouts_names_the_busy_rank(
    tmp_path: Path, percent: str, rank_zero_timed_out: bool, busy: bool
) -> None:
    """tqdm redraws its bar without a newline, so a watchdog report lands on the bar's line: an
    unfinished bar there, with rank 0 (the one drawing it) timing out nowhere, is one rank's long
    single-rank work that the others waited for (NCCL011 at cause tier, ahead of the barrier's
    symptom-tier guesses). A finished bar, or rank 0 timing out too, is no such picture."""
    bar = BUSY_BAR.format(percent=percent)
    ranks = [0, 1, 2] if rank_zero_timed_out else [1, 2, 3]
    lines = [bar + "[E ProcessGroupNCCL.cpp:475] " + _timeout(ranks[0], 2).split("] ", 1)[1]]
    lines += [_timeout(rank, 2) for rank in ranks[1:]]
    ranked = _ranked(_explained(tmp_path, "\n".join(lines) + "\n"))
    assert (ranked[0] == ("NCCL011", "cause")) is busy, ranked
    if not busy:
        assert ("NCCL011", "cause") not in ranked, ranked
        assert ("NCCL011", "symptom") in ranked  # the barrier's guess stays


def test_a_traceback_through_set_device_points_at_the_rank_to_gpu_mapping(tmp_path: Path) -> None:
    # The post stops inside the traceback, before the exception line: the frame that chose the GPU
    # is what the log still says. Posted code with the same call, and no failure, names nothing.
    cut = (
        "Traceback (most recent call last):\n"
        '  File "/opt/app/context.py", line 519, in set_device\n'
        "    torch.cuda.set_device(device_ordinal)\n"
        "  File\n"
    )
    assert _ranked(_explained(tmp_path, cut)) == [("TORCH010", "context")]
    code = "def setup(rank):\n    torch.cuda.set_device(rank)\n    dist.init_process_group('nccl')\n"
    assert _explained(tmp_path, code, "code.log").candidates == []


def test_a_clean_check_refutes_only_a_reference_whose_causes_it_all_tests() -> None:
    """GPU002's check reads GPU health; a driver older than the CUDA runtime is one of its causes too,
    so a healthy GPU leaves the candidate undecided, naming what was tested, instead of refuted."""
    from preflight.explain.confirm import verdict_for
    from preflight.model import Finding, Status

    whole = Reference(id="GPU902", symbol="s", title="t", area="gpu", severity=Severity.ERROR, summary="s", fix=(), checks=("GPU902",))
    partial = Reference(
        id="GPU902", symbol="s", title="t", area="gpu", severity=Severity.ERROR, summary="s", fix=(), checks=("GPU902",),
        tests_only="GPU health, not the driver and CUDA runtime versions",
    )
    clean = {"GPU902": [Finding("GPU902", "s", "t", Status.ABSENT, Severity.ERROR, "GPU0")]}
    assert verdict_for(whole, clean).status == "refuted"
    verdict = verdict_for(partial, clean)
    assert verdict.status == "undecided" and "test only GPU health, not the driver" in verdict.reason
    found = {"GPU902": [Finding("GPU902", "s", "t", Status.PRESENT, Severity.ERROR, "GPU0")]}
    assert verdict_for(partial, found).status == "confirmed"
    # An info-level note (a deliberate setting the check only mentions) confirms nothing.
    noted = {"GPU902": [Finding("GPU902", "s", "t", Status.PRESENT, Severity.INFO, "GPU0")]}
    verdict = verdict_for(whole, noted)
    assert verdict.status == "undecided" and "noted only information" in verdict.reason and verdict.findings
    # A warning is what its check calls no fault on its own (GPU001's persistence mode off): shown,
    # it leaves the candidate undecided instead of telling the reader to drain the node.
    warned = {"GPU902": [Finding("GPU902", "s", "t", Status.PRESENT, Severity.WARNING, "GPU0")]}
    verdict = verdict_for(whole, warned)
    assert verdict.status == "undecided" and "only warnings" in verdict.reason and verdict.findings and verdict.harmful
    both = {"GPU902": [*warned["GPU902"], Finding("GPU902", "s", "t", Status.PRESENT, Severity.CRITICAL, "GPU3")]}
    verdict = verdict_for(whole, both)
    assert verdict.status == "confirmed" and [f.subject for f in verdict.findings] == ["GPU3"]


def test_a_refutation_from_a_shell_outside_the_job_is_undecided_for_checks_of_the_job_settings() -> None:
    """GDR001 reads NCCL_DMABUF_ENABLE from the job's environment: run from an operator's shell on the
    live node, a clean result says nothing about the failed job. PCI001 reads only config space."""
    from preflight.catalogue import load_all
    from preflight.explain.confirm import Verdict, checks_reading_the_job, outside_the_job

    reading = checks_reading_the_job({"GDR001", "PCI001"})
    assert reading == {"GDR001"}
    by_id = {reference.id: reference for reference in load_all()}
    refuted = Verdict("refuted", "the node checks found no sign of it; look at the next candidate")
    moved = outside_the_job(refuted, by_id["GDR001"], reading)
    assert moved.status == "undecided" and "inside the job's allocation" in moved.reason
    assert outside_the_job(refuted, by_id["PCI001"], reading) is refuted
    # A confirmation stands where it rests on the node (a module, /etc/nccl.conf every job reads) and
    # not where it rests only on the checking process itself (its environment, its limits).
    node_wide = Finding("GDR001", "s", "t", Status.PRESENT, Severity.ERROR, "node", (FindingEvidence("/etc/nccl.conf NCCL_DMABUF_ENABLE", "0"),))
    confirmed = Verdict("confirmed", "the node shows the misconfiguration", [node_wide])
    assert outside_the_job(confirmed, by_id["GDR001"], reading) is confirmed
    own = Finding("MEM001", "s", "t", Status.PRESENT, Severity.ERROR, "process", (FindingEvidence("/proc/self/limits", "memlock 8 MiB"),))
    moved = outside_the_job(Verdict("confirmed", "the node shows the misconfiguration", [own]), by_id["MEM001"], reading)
    assert moved.status == "undecided" and "not the failed job's" in moved.reason


def test_every_probe_that_reads_the_environment_counts_as_reading_the_job() -> None:
    """A probe that reads /proc/self/environ (a library path, who the job runs as, slurm.conf's
    place) judges the shell's environment on the live node: its checks' refutations must be
    reconsidered there, so the list in confirm.py cannot miss one."""
    import re

    import preflight.probes
    from preflight.explain.confirm import JOB_PROBES

    reading = set()
    for module in Path(preflight.probes.__file__).parent.glob("*.py"):
        text = module.read_text()
        if 'read_bytes("/proc/self/environ")' in text:
            reading |= set(re.findall(r'@probe\("(\w+)"', text))
    assert reading and reading <= JOB_PROBES, reading - JOB_PROBES


def test_check_candidates_reconsiders_refutations_only_on_the_live_node_outside_a_job(monkeypatch: pytest.MonkeyPatch) -> None:
    """The wiring: GDR001 refuted by clean checks stays refuted inside a Slurm job or on a recorded
    root, and is undecided on the live node from a shell outside any job."""
    import preflight.explain.confirm as confirm
    from preflight.catalogue import load_all
    from preflight.explain import Explanation, check_candidates
    from preflight.explain.analysis import Candidate
    from preflight.explain.reader import ReadStats
    from preflight.model import Finding, Status

    references = {reference.id: reference for reference in load_all()}
    clean = {"GDR001": [Finding("GDR001", "s", "t", Status.ABSENT, Severity.ERROR, "node")]}

    def verdict(read_a_job: bool) -> str:
        monkeypatch.setattr(confirm, "node_findings", lambda *args, **kwargs: confirm.NodeFindings(clean, read_a_job))
        candidate = Candidate("GDR001", "cause", 1, None, True)  # type: ignore[arg-type]  (hits unused here)
        explanation = Explanation(ReadStats(), [candidate], references, None, [], 0.0)
        check_candidates(explanation, "/srv/snapshots/gpu017", None)
        return explanation.verdicts["GDR001"].status

    assert verdict(read_a_job=False) == "undecided" and verdict(read_a_job=True) == "refuted"


@pytest.mark.parametrize(
    ("environ", "a_job"),
    [
        ({"HOME": "/root", "PATH": "/usr/bin"}, False),  # an operator's shell, an Ansible audit
        ({"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0"}, True),  # a job step
        ({"SLURM_JOB_ID": "4242", "SLURM_SCRIPT_CONTEXT": "prolog_slurmd"}, False),  # a prolog sees none of what the job exports
        ({"OMPI_COMM_WORLD_RANK": "3"}, True),  # a rank mpirun started
        (None, False),  # no environ recorded: nothing says it is a job's
    ],
)
def test_whether_the_checks_read_a_jobs_environment_comes_from_the_root_they_read(
    tmp_path: Path, environ: dict[str, str] | None, a_job: bool
) -> None:
    """The live node's /proc/self/environ is this process's; a root's or snapshot's is the one its
    recorder ran in (a prolog, an audit, a job step): either way it is what the job-reading checks
    read, so it decides whether their results are about a job."""
    from preflight.explain.confirm import node_findings

    (tmp_path / "proc/self").mkdir(parents=True)
    if environ is not None:
        (tmp_path / "proc/self/environ").write_bytes(b"".join(f"{k}={v}".encode() + b"\0" for k, v in environ.items()))
    assert node_findings({"PCI001"}, str(tmp_path), None).read_a_job is a_job


def test_a_directory_walk_stops_at_its_file_count_and_depth(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A directory of logs is read under caps of count and depth, and says where it stopped."""
    import preflight.explain.reader as reader

    monkeypatch.setattr(reader, "MAX_WALK_FILES", 3)
    monkeypatch.setattr(reader, "MAX_WALK_DEPTH", 2)
    for rank in range(5):
        (tmp_path / f"rank{rank}.log").write_text(f"rank {rank}\n")
    deep = tmp_path / "a" / "b" / "c"
    deep.mkdir(parents=True)
    (tmp_path / "a" / "b" / "two-deep.log").write_text("read\n")
    (deep / "three-deep.log").write_text("not read\n")
    stats = ReadStats()
    sources = [chunk.source for chunk in iter_inputs([str(tmp_path)], stats)]
    assert sources == [str(tmp_path / f"rank{rank}.log") for rank in range(3)]  # a folder's files come before its subfolders
    assert stats.problems == [f"{tmp_path}: more than 3 files; read the first 3 in name order"]
    monkeypatch.setattr(reader, "MAX_WALK_FILES", 100)
    stats = ReadStats()
    sources = [chunk.source for chunk in iter_inputs([str(tmp_path)], stats)]
    assert sources[-1] == str(tmp_path / "a" / "b" / "two-deep.log") and len(sources) == 6
    assert stats.problems == [f"{tmp_path / 'a' / 'b'}: more than 2 folders deep; its subfolders were not read"]


def _checked(ref_id: str, checks: tuple[str, ...], related: tuple[str, ...] = ()) -> Reference:
    return Reference(
        id=ref_id, symbol=ref_id.lower(), title=ref_id, area="test", severity=Severity.ERROR, summary="s", fix=("f",),
        checks=checks, related=related,
    )


def _finding(ref_id: str, status: Status, severity: Severity = Severity.ERROR) -> Finding:
    return Finding(ref_id, ref_id.lower(), ref_id, status, severity, "node", (FindingEvidence("/proc/x", "seen", "not"),))


def test_related_references_the_node_shows_behind_a_symptom() -> None:
    """--check's second look: the checked references a symptom lists as related, found on the node,
    the most severe first; none whose checks a candidate already ran, none for a cause candidate's
    relations, and none decided by a check that read this shell's settings instead of the job's."""
    from preflight.explain.confirm import related_found, related_to_symptoms

    references = {
        "SYM001": _checked("SYM001", ("MEMX01",), related=("WRN001", "ERR001", "MEMX01", "CLN001", "LOG001")),
        "CAU001": _checked("CAU001", (), related=("OTH001",)),
        "WRN001": _checked("WRN001", ("WRN001",)),
        "ERR001": _checked("ERR001", ("ERR001",)),
        "MEMX01": _checked("MEMX01", ("MEMX01",)),  # its check is SYM001's own: its verdict shows it
        "CLN001": _checked("CLN001", ("CLN001",)),
        "LOG001": _checked("LOG001", ()),  # no node check
        "OTH001": _checked("OTH001", ("OTH001",)),
    }
    related = related_to_symptoms([("CAU001", "cause"), ("SYM001", "symptom")], references)
    assert related == {"WRN001": ("SYM001",), "ERR001": ("SYM001",), "CLN001": ("SYM001",)}
    findings = {
        "WRN001": [_finding("WRN001", Status.PRESENT, Severity.WARNING)],
        "ERR001": [_finding("ERR001", Status.PRESENT), _finding("ERR001", Status.ABSENT)],
        "CLN001": [_finding("CLN001", Status.ABSENT)],
    }
    found = related_found(related, findings, references)
    assert [(entry.reference_id, entry.symptoms) for entry in found] == [("ERR001", ("SYM001",)), ("WRN001", ("SYM001",))]
    assert [f.status for f in found[0].findings] == [Status.PRESENT]
    assert [entry.reference_id for entry in related_found(related, findings, references, job_reading={"ERR001"})] == ["WRN001"]
    assert related_found(related, {"CLN001": findings["CLN001"]}, references) == []

# nccl-tests as its rank 0 prints it (src/common.cu): header, device list, table, footer.
NCCL_TESTS_HEADER = "# nThread 1 nGpus 8 minBytes 1073741824 maxBytes 8589934592 step: 2(factor) warmup iters: 5 iters: 20 agg iters: 1 validation: 1 graph: 0\n#\n# Using devices\n"
NCCL_TESTS_DEVICE = "#  Rank  {rank} Group  0 Pid    798 on       {host} device  {rank} [0x0f] NVIDIA H800\n"
NCCL_TESTS_TABLE = (
    "#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong\n"
    "  1073741824     268435456     float     sum      -1   4312.1  249.00  435.75      0   4305.8  249.37  436.40      0\n"
)
NCCL_TESTS_FOOTER = "# Out of bounds values : 0 OK\n# Avg bus bandwidth    : 436.075 \n#\n"


def test_nccl_tests_run_as_separate_tests_is_named(tmp_path: Path) -> None:
    """Each process its own rank 0: a second header before any result table, or a second footer
    with no header between, is the one sign a log of such a launch carries."""
    devices = "".join(NCCL_TESTS_DEVICE.format(rank=rank, host="hw14") for rank in range(2))
    for text, line in (
        (NCCL_TESTS_HEADER + NCCL_TESTS_HEADER + devices, 4),
        (NCCL_TESTS_FOOTER + NCCL_TESTS_FOOTER, 4),
    ):
        explanation = _explained(tmp_path, text)
        assert explanation.separate_tests is not None and explanation.separate_tests.line_number == line
        assert explanation.first_failure == explanation.separate_tests and not explanation.candidates


def test_nccl_tests_run_one_after_another_or_per_rank_file_are_one_test_each(tmp_path: Path) -> None:
    run = NCCL_TESTS_HEADER + NCCL_TESTS_DEVICE.format(rank=0, host="hw14") + NCCL_TESTS_TABLE + NCCL_TESTS_FOOTER
    assert _explained(tmp_path, run + run).separate_tests is None  # two runs pasted one after the other
    assert _explained(tmp_path, run + "node1:2330:2658 [2] NCCL WARN NET/IB : Got completion from peer 10.1.2.8<41937> with status=12 opcode=1 len=0 vendor err 129 (Recv)\n").separate_tests is None
    from preflight.explain import explain, load_catalogue

    (tmp_path / "rank0.log").write_text(run)
    (tmp_path / "rank1.log").write_text(run)  # one file per process: each its own test, nothing shared
    assert explain([str(tmp_path / "rank0.log"), str(tmp_path / "rank1.log")], catalogue=load_catalogue()).separate_tests is None
    # A real failure in the log is named instead of the repeated header.
    failing = NCCL_TESTS_HEADER + NCCL_TESTS_HEADER + "RuntimeError: CUDA error: out of memory\n"
    explanation = _explained(tmp_path, failing)
    assert explanation.separate_tests is None and explanation.first_failure is not None and explanation.first_failure.line_number == 7
