"""What real posts do to a log, and how ``explain`` copes: quoting, autolinks, fences, progress
bars and carriage returns, launcher prefixes; who wrote an unprefixed line; ranking by specificity
instead of the alphabet; and a failure no reference describes, which is named, never silent.

The lines here are written for these tests (the real posts are in tests/data/real-logs and are
judged by tests/explain/test_explain_real_logs.py)."""

from __future__ import annotations

import io

import pytest

from preflight.explain.analysis import Analysis
from preflight.explain.matcher import Matcher
from preflight.explain.posts import normalise, segments, undo_posting, unwrap_hard_wraps
from preflight.explain.prefixes import parse_line
from preflight.explain.reader import ReadStats, iter_inputs
from preflight.model import Reference, Severity
from preflight.signatures import specificity

WARN = "gpu-node-07:20871:21002 [3] NCCL WARN NET/IB : Got completion from peer 10.1.3.201<41937> with status=12 opcode=1 len=0 vendor err 129 (Recv)"


def _reference(ref_id: str, *signatures: tuple[str, str], related: tuple[str, ...] = ()) -> Reference:
    return Reference(
        id=ref_id, symbol=ref_id.lower(), title=ref_id, area="test", severity=Severity.ERROR, summary="s", fix=("f",),
        related=related, signatures=tuple({"pattern": p, "role": role, "examples": []} for role, p in signatures),
    )


PEER = _reference("IBX001", ("cause", r"Got completion from peer 10\.1\.3\.201<\d+> with status=12"))


def _analyse(text: str, *references: Reference) -> Analysis:
    matcher = Matcher(references)
    analysis = Analysis(year=2026, related={r.id: tuple(r.related) for r in references})
    stats = ReadStats()
    for chunk in iter_inputs(["-"], stats, io.BytesIO(text.encode())):
        for hit in matcher.scan(chunk):
            analysis.add(hit)
    return analysis


def _ranked(text: str, *references: Reference) -> list[str]:
    return [c.reference_id for c in _analyse(text, *references).candidates()]


@pytest.mark.parametrize(
    "posted",
    [
        "> " + WARN,
        "> > " + WARN,
        ">" + WARN,
        WARN.replace("10.1.3.201", "[10.1.3.201](http://10.1.3.201/)"),
        WARN.replace("[3] NCCL", "[3] transport/[net_ib.cc:101](http://net_ib.cc:101/) NCCL").replace("10.1.3.201", "[10.1.3.201](http://10.1.3.201/)"),
        "> " + WARN.replace("10.1.3.201", "[10.1.3.201](http://10.1.3.201/)"),
        "\x1b[31m" + WARN + "\x1b[0m",
        WARN + "\r",
        "Loading:  45%|####5     | 9/20 [00:01<00:02,  6.12it/s]\r" + WARN,
        # copied out of a rendered page, a chat or a mail, or out of a page's HTML source
        WARN.replace(" ", "\u00a0"),
        WARN.replace(" ", "\u202f").replace("peer", "\u200bpeer"),
        WARN.replace("<", "&lt;").replace(">", "&gt;"),
    ],
)
def test_posted_line_matches_like_the_original(posted: str) -> None:
    assert _ranked("```\n" + posted + "\n```\n", PEER) == ["IBX001"]


def test_normalise_undoes_quoting_autolinks_and_redraws() -> None:
    assert normalise(undo_posting(b"> [10.0.0.1](http://10.0.0.1/): x").decode()) == "10.0.0.1: x"
    assert undo_posting(b"a\n[x](http://x/)\nb") == b"a\nx\nb"  # line numbers stay
    assert normalise("```text") == ""
    assert normalise("bar 10%\rbar 20%\rRuntimeError: x") == "RuntimeError: x"
    assert undo_posting(b"see [the docs](https://example.org/a b)") == b"see [the docs](https://example.org/a b)"
    assert segments("error first\rbar 90%") == ["error first", "bar 90%"]


def test_typography_is_undone_in_bytes_and_in_text_without_moving_lines() -> None:
    posted = "a\u00a0b\n\u2018c\u2019 \u201cd\u201d\u2026\ufeff\n&lt;e&gt; &amp;&#39;\n"
    assert undo_posting(posted.encode()) == b"a b\n'c' \"d\"...\n<e> &'\n"
    assert normalise("Call to connect returned Connection\u00a0refused, retrying\u2026") == "Call to connect returned Connection refused, retrying..."
    # a program's own non-ASCII text (progress-bar glyphs, a path) is left as it was written
    assert undo_posting("100%|\u2588\u2588| /data/\u6a21\u578b".encode()) == "100%|\u2588\u2588| /data/\u6a21\u578b".encode()


def test_a_signature_drawn_over_by_a_progress_bar_still_matches() -> None:
    assert _ranked(WARN + "\rEpoch 3:  12%|#2   | 12/100\n", PEER) == ["IBX001"]


@pytest.mark.parametrize(
    ("line", "actor"),
    [
        ("[2025-05-19 06:08:25 TP3 EP3] Scheduler hit an exception: x", "TP3 EP3"),
        ("[1763] RuntimeError: boom", "pid 1763"),
        ("10.0.0.7: [rank2]: RuntimeError: boom", "rank 2"),
        ("10.0.0.7: RuntimeError: boom", "10.0.0.7"),
        ("Loading checkpoint shards:  45%|####5     | 9/20 [00:01<00:02,  6.12it/s][rank3]: Traceback (most recent call last):", "rank 3"),
        ("  3: [default3]:RuntimeError: boom", "rank 3"),
        ("[1,5]<stderr>:RuntimeError: boom", "rank 5"),
    ],
)
def test_launcher_prefixes_name_the_actor(line: str, actor: str) -> None:
    meta, message = parse_line(normalise(line), 2026)
    assert meta.actor == actor
    assert message.startswith(("RuntimeError", "Traceback", "Scheduler"))


def test_unprefixed_lines_of_a_single_process_log_are_that_process() -> None:
    """One process: NCCL's lines name it, its Python traceback does not. That is one actor, so
    no cascade and no "one rank failed first" reference."""
    log = "\n".join(
        [
            WARN,
            "Traceback (most recent call last):",
            '  File "train.py", line 3, in <module>',
            "torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled system error",
        ]
    )
    analysis = _analyse(log + "\n", PEER)
    assert analysis.cascade() is None
    assert [c.reference_id for c in analysis.candidates()] == ["IBX001"]


def test_a_traceback_before_the_process_names_itself_joins_it() -> None:
    log = "Traceback (most recent call last):\nRuntimeError: boom\n" + WARN + "\n"
    assert _analyse(log, PEER).cascade() is None


def test_two_named_ranks_in_one_file_still_make_a_cascade() -> None:
    log = "[rank0]: RuntimeError: boom\n[rank1]: RuntimeError: later\n"
    cascade = _analyse(log, PEER).cascade()
    assert cascade is not None and cascade.first.actor == "rank 0" and cascade.later == 1


def test_the_more_specific_signature_on_a_line_ranks_first() -> None:
    generic = _reference("AAA001", ("cause", r"vendor err 129"))
    specific = _reference("ZZZ001", ("cause", r"vendor err 129 \(Recv\) localGid fe80:"))
    line = WARN.replace("(Recv)", "(Recv) localGid fe80::1 remoteGid fe80::2")
    assert specificity(specific.signatures[0]["pattern"]) > specificity(generic.signatures[0]["pattern"])
    assert _ranked(line + "\n", generic, specific) == ["ZZZ001", "AAA001"]


def test_a_line_only_one_reference_explains_outweighs_a_shared_one() -> None:
    """Three references claim the same completion error; a fourth has a line of its own."""
    shared = r"Got completion from peer \S+ with status=12 opcode=\d+ len=\d+ vendor err 129"
    crowd = [_reference(f"CRD00{n}", ("cause", shared)) for n in range(3)]
    storm = _reference("PFC001", ("cause", r"tx_pause_storm_error_events: [1-9]"))
    log = WARN + "\nnode2:      tx_pause_storm_error_events: 2\n"
    assert _ranked(log, *crowd, storm)[0] == "PFC001"


def test_equal_scores_never_fall_back_to_the_alphabet() -> None:
    """Same pattern, same line: the one the other lists as related (a symptom hub) goes last."""
    pattern = r"Watchdog caught collective operation timeout"
    hub = _reference("AAA001", ("symptom", pattern))
    specific = _reference("ZZZ001", ("symptom", pattern), related=("AAA001",))
    line = "[rank0]:[E0314 09:31:34.000 ProcessGroupNCCL.cpp:616] [Rank 0] Watchdog caught collective operation timeout\n"
    assert _ranked(line, hub, specific) == ["ZZZ001", "AAA001"]
    assert _ranked(line, specific, hub) == ["ZZZ001", "AAA001"]


def test_a_failure_no_reference_describes_is_named() -> None:
    analysis = _analyse("epoch 1 loss 2.3\n[rank0]: ValueError: shapes (3,) and (4,) do not match\n", PEER)
    assert analysis.candidates() == []
    first = analysis.first_failure()
    assert first is not None and first.line_number == 2 and first.actor == "rank 0"


def test_an_uncatalogued_traceback_is_named_by_the_exception_it_ends_with() -> None:
    log = 'epoch 1\nTraceback (most recent call last):\n  File "train.py", line 3, in <module>\n    main()\nValueError: bad shape\n'
    first = _analyse(log, PEER).first_failure()
    assert first is not None and first.line_number == 5 and first.text == "ValueError: bad shape"
    # A header whose exception line was cut off stays the first failing line; a second traceback's
    # exception far below is not its ending.
    assert (cut := _analyse(log.rsplit("ValueError", 1)[0], PEER).first_failure()) is not None and cut.line_number == 2
    far = log.rsplit("ValueError", 1)[0] + "step\n" * 70 + "KeyError: 'x'\n"
    assert (kept := _analyse(far, PEER).first_failure()) is not None and kept.line_number == 2


def test_a_warning_alone_is_named_when_nothing_else_failed() -> None:
    first = _analyse("init ok\nnode1:1:2 [0] NCCL WARN Cuda failure 'out of memory'\n", PEER).first_failure()
    assert first is not None and first.line_number == 2


def test_a_healthy_log_has_no_first_failure() -> None:
    log = "node1:1:2 [0] NCCL INFO Init COMPLETE\nepoch 1 loss 2.3\ntraining finished\n"
    assert _analyse(log, PEER).first_failure() is None


def test_the_cascade_is_worked_out_again_after_a_new_hit() -> None:
    matcher = Matcher([PEER])
    analysis = Analysis(year=2026)
    stats = ReadStats()
    for text in ("[rank0]: RuntimeError: boom\n", "[rank1]: RuntimeError: later\n"):
        for chunk in iter_inputs(["-"], stats, io.BytesIO(text.encode())):
            for hit in matcher.scan(chunk):
                analysis.add(hit)
        if text.startswith("[rank0]"):
            assert analysis.cascade() is None  # one actor so far
    cascade = analysis.cascade()
    assert cascade is not None and cascade.later == 1


def test_a_line_posted_as_inline_code_is_read_without_its_backticks() -> None:
    assert normalise("`RuntimeError: Expected all tensors to be on the same device`") == "RuntimeError: Expected all tensors to be on the same device"
    assert normalise("  `" + WARN + "`") == WARN
    assert normalise("see `x` and `y`") == "see `x` and `y`"  # prose with code spans stays as it is
    assert _ranked("`" + WARN + "`\n", PEER) == ["IBX001"]
    first = _analyse("`RuntimeError: Expected all tensors to be on the same device, but found cpu and cuda:0`\n", PEER).first_failure()
    assert first is not None and first.line_number == 1


@pytest.mark.parametrize(
    "line",
    [
        "node1:2330:2658 [2] NCCL INFO transport/net.cc:515 -> 2",
        "NVIDIA RTX A6000 with CUDA capability sm_86 is not compatible with the current PyTorch installation.",
    ],
)
def test_a_log_of_only_error_traces_or_an_unsupported_gpu_is_not_silent(line: str) -> None:
    first = _analyse("node1:2330:2658 [2] NCCL INFO Init START\n" + line + "\n", PEER).first_failure()
    assert first is not None and first.line_number == 2


def test_a_successful_return_code_trace_is_not_a_failure() -> None:
    assert _analyse("node1:1:2 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/IPC\nnode1:1:2 [0] NCCL INFO init.cc:12 -> 0\n", PEER).first_failure() is None


# Table headers whose column titles hold failure words: older nccl-tests name a column "error";
# Ray Tune's summary of failed trials titles its columns "# failures" and "error file". The line
# after the table (mpirun's abort, Tune's "Trials did not complete") is the first failure.
TABLE_HEADERS = {
    "nccl-tests": (
        "#                                                     out-of-place                       in-place\n"
        "#       size         count    type   redop     time   algbw   busbw  error     time   algbw   busbw  error\n"
        "#        (B)    (elements)                     (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)\n",
        "a non-zero exit code. Per user-direction, the job has been aborted.\n",
    ),
    "ray-tune": (
        "| Trial name               |   # failures | error file                                |\n"
        "|--------------------------+--------------+-------------------------------------------|\n"
        "| TorchTrainer_96bfe_00000 |            1 | /home/ray/ray_results/TorchTrainer/error.txt |\n",
        "2022-11-15 19:26:36,618\tERROR tune.py:773 -- Trials did not complete: [TorchTrainer_96bfe_00000]\n",
    ),
}


@pytest.mark.parametrize("name", sorted(TABLE_HEADERS))
def test_a_table_header_is_not_a_failure(name: str) -> None:
    table, failure = TABLE_HEADERS[name]
    assert _analyse(table, PEER).first_failure() is None
    first = _analyse(table + failure, PEER).first_failure()
    assert first is not None and first.line_number == 4


def test_a_text_table_row_whose_status_says_error_is_a_failure() -> None:
    status = _analyse("| Trial name | status | loc |\n| TorchTrainer_1 | ERROR | 10.0.0.1:4242 |\n", PEER).first_failure()
    assert status is not None and status.line_number == 2


def test_a_message_wrapped_at_a_comma_with_an_indented_rest_is_rejoined() -> None:
    refused = _reference("GLX001", ("cause", r"SO_ERROR: Connection refused, ?remote=\[[^\]]{1,80}\]:\d+"))
    log = (
        "[rank8] Gloo connectFullMesh failed ... timed out connecting: SO_ERROR: Connection refused,\n"
        "        remote=[127.0.0.1]:14215\n"
    )
    assert _ranked(log, refused) == ["GLX001"]
    # A traceback's indented line after a line that does not stop at a comma is not joined.
    assert _ranked(log.replace("refused,\n", "refused, code 111\n"), refused) == []


@pytest.mark.parametrize(
    "line",
    [
        "ssh: connect to host node2 port 22: Connection refused",
        "mpi_lib.cpython-38-x86_64-linux-gnu.so: undefined symbol: _ZN3c104cuda",
        "CUDA out of memory. Tried to allocate 2.00 GiB",
        "NVRM: Xid (PCI:0000:3b:00): 48, pid=1234, An uncorrectable double bit error (DBE) has been detected on GPU",
        "ORTE was unable to reliably start one or more daemons.",
        "bash: orted: command not found",
        "cp: cannot create regular file '/dev/shm/nccl-x1': No space left on device",
        "open /dev/infiniband/uverbs0: Permission denied",
        "Couldn't register GPU MR",
        "==== backtrace (tid: 296459) ====",
        "==== backtrace ====",
    ],
)
def test_errno_texts_loader_and_driver_failures_name_the_failing_line(line: str) -> None:
    first = _analyse("starting\n" + line + "\n", PEER).first_failure()
    assert first is not None and first.line_number == 2


def test_deepspeeds_launcher_failure_orders_the_cascade_and_names_the_line() -> None:
    line = "[2023-11-28 10:00:34,590] [ERROR] [launch.py:321:sigkill_handler] ['/usr/bin/python', '-u', 'train.py'] exits with return code = -9"
    first = _analyse("step 10 loss 1.2\n" + line + "\n", PEER).first_failure()
    assert first is not None and first.line_number == 2
    assert _analyse("[INFO] [launch.py:347:main] Process 1 exits successfully.\n", PEER).first_failure() is None


def _hard_wrapped(text: str, width: int) -> str:
    """What a terminal or mailer breaking every line at ``width`` characters makes of ``text``."""
    out = []
    for line in text.split("\n"):
        while len(line) > width:
            out.append(line[:width])
            line = line[width:]
        out.append(line)
    return "\n".join(out)


def test_a_post_wrapped_at_a_fixed_width_through_a_signature_still_matches() -> None:
    other = "gpu-node-07:20871:21003 [1] NCCL WARN NET/IB : some other long message of this run that also wraps"
    posted = _hard_wrapped(f"{other}\n{WARN}\n", 64)
    assert "vendor err 129" not in posted and "ven" in posted  # the wrap cuts the signature's words
    assert _ranked(posted, PEER) == ["IBX001"]
    unwrapped = unwrap_hard_wraps(posted.encode())
    assert unwrapped is not None
    data, starts = unwrapped
    assert data.decode().split("\n")[:2] == [other, WARN] and starts[:3] == [0, 2, 5]


@pytest.mark.parametrize(
    "text",
    [
        # the longest message printed three times, each time followed by an unprefixed line
        "\n".join(["ERR:  Error getting the gdrdrv driver version with ioctl error (errno=22). gdrdrv might be too old.", 'Assertion "!((g) == ((void*)0))" failed at sanity.cpp:181'] * 3),
        # a table whose rows are all as wide as its longest line
        "\n".join(["| " + "name".ljust(70) + " |", "+" + "-" * 72 + "+", "| " + "value".ljust(70) + " |", "| " + "other".ljust(70) + " |"]),
        # short lines: no width to have been wrapped at
        "Traceback (most recent call last):\nRuntimeError: x",
    ],
)
def test_a_log_that_only_looks_wrapped_is_left_as_written(text: str) -> None:
    assert unwrap_hard_wraps(text.encode()) is None
