"""A log without failures that goes silent in NCCL's output: explain names where it stopped
(``stalled``), and an intra-node-only run is offered PCI003 at symptom tier."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from conftest import REPO, Runner
from preflight.explain import explain, load_catalogue
from preflight.explain.reader import Chunk
from preflight.explain.render import render_json, render_text
from preflight.explain.stall import LAST_LINES, TAIL_BYTES, SourceTails, find_stall

SCHEMA = json.loads((REPO / "preflight" / "schemas" / "explain-v1.schema.json").read_text())
HEADER = "gpu7:4410:4460 [{d}] NCCL INFO "
SETUP = [
    HEADER.format(d=0) + "Bootstrap : Using eth0:10.0.0.7<0>",
    HEADER.format(d=0) + "NCCL version 2.21.5+cuda12.4",
    HEADER.format(d=0) + "comm 0x55d1c2a0 rank 0 nranks 2 cudaDev 0 nvmlDev 0 busId 1b000 commId 0x9f1e - Init START",
]
PEER = [HEADER.format(d=d) + f"Channel 0{c}/0 : {d}[{d}] -> {1 - d}[{1 - d}] via P2P/IPC/read" for c in range(2) for d in range(2)]
NETWORK = [HEADER.format(d=0) + "Channel 00/0 : 1[1] -> 0[0] [receive] via NET/IB/0/GDRDMA"]


def _explained(tmp_path: Path, lines: list[str]) -> tuple[str, dict]:  # type: ignore[type-arg]
    log = tmp_path / "job.log"
    log.write_text("\n".join(lines) + "\n")
    explanation = explain([str(log)], catalogue=load_catalogue())
    document = json.loads(render_json(explanation))
    jsonschema.validate(document, SCHEMA)
    return render_text(explanation), document


def _tails(text: str, chunk_lines: int = 1000) -> SourceTails:
    tails = SourceTails()
    lines = text.splitlines(keepends=True)
    chunks = [
        Chunk("job.log", "".join(lines[start : start + chunk_lines]).encode(), start + 1)
        for start in range(0, len(lines), chunk_lines)
    ]
    assert list(tails.watch(chunks)) == chunks  # passed on untouched
    return tails


def test_a_run_silent_after_connecting_inside_one_node_is_offered_pci003_at_symptom_tier(tmp_path: Path) -> None:
    text, document = _explained(tmp_path, [*SETUP, *PEER, "Processed prompts:   0%|          | 0/16 [00:00<?, ?it/s]"])
    assert document["status"] == "candidates"
    assert [(c["id"], c["tier"]) for c in document["candidates"]] == [("PCI003", "symptom")]
    assert document["stall"] == {"location": f"{tmp_path}/job.log:7", "text": PEER[-1], "lines_after": 1}
    assert "stopped without an error and without finishing: NCCL's last line (" in text and "is 1 line before the log's end." in text
    assert "silence names no cause by itself" in text


def test_a_run_silent_with_a_network_channel_is_stalled_without_a_candidate(tmp_path: Path) -> None:
    text, document = _explained(tmp_path, [*SETUP, *PEER[:2], *NETWORK])
    assert document["status"] == "stalled" and document["candidates"] == []
    assert document["stall"]["text"] == NETWORK[0] and document["stall"]["lines_after"] == 0
    assert "NCCL's last line is the log's last line:" in text


@pytest.mark.parametrize(
    "ending",
    [
        [HEADER.format(d=0) + "comm 0x55d1c2a0 rank 0 nranks 2 cudaDev 0 busId 1b000 - Destroy COMPLETE"],
        ["#  Avg bus bandwidth    : 33.3227"],
        [f"iteration {n} loss 2.{n}" for n in range(LAST_LINES)],  # long past setup: not a setup stall
    ],
)
def test_a_finished_run_or_one_long_past_setup_is_no_stall(tmp_path: Path, ending: list[str]) -> None:
    _text, document = _explained(tmp_path, [*SETUP, *PEER, *ending])
    assert document["status"] == "nothing-found" and document["stall"] is None


def test_a_failure_is_named_instead_of_a_stall(tmp_path: Path) -> None:
    _text, document = _explained(tmp_path, [*SETUP, *PEER, "RuntimeError: something broke"])
    assert document["status"] == "uncatalogued" and document["stall"] is None


def test_a_log_without_nccl_output_is_no_stall(tmp_path: Path) -> None:
    _text, document = _explained(tmp_path, ["loading model", "Processed prompts:   0%|"])
    assert document["status"] == "nothing-found" and document["stall"] is None


def test_tails_keep_line_numbers_across_chunks_and_drop_a_cut_first_line() -> None:
    text = "".join(f"line {n} " + "x" * 60 + "\n" for n in range(1, 2001))
    tails = _tails(text, chunk_lines=7)
    kept = tails.lines("job.log")
    assert kept[-1].line_number == 2000 and kept[-1].text.startswith("line 2000 ")
    assert all(line.text.startswith(f"line {line.line_number} ") for line in kept)
    assert len(kept) < 2000 and sum(len(line.text) + 1 for line in kept) <= TAIL_BYTES


def test_stall_reads_the_last_nccl_line_and_whether_only_peers_were_connected() -> None:
    stall = find_stall(_tails("\n".join([*SETUP, *PEER, "```", "", "waiting"]) + "\n"), network_seen=False)
    assert stall is not None and stall.last.line_number == 7 and stall.lines_after == 1
    assert stall.peer is not None and stall.peer.text == PEER[-1]
    networked = find_stall(_tails("\n".join([*SETUP, *PEER]) + "\n"), network_seen=True)
    assert networked is not None and networked.peer is None


def test_explain_cli_exits_1_on_a_stalled_log(tmp_path: Path, run_cli: Runner) -> None:
    log = tmp_path / "job.log"
    log.write_text("\n".join([*SETUP, *NETWORK]) + "\n")
    result = run_cli("explain", str(log), "--format", "json")
    assert result.returncode == 1 and json.loads(result.stdout)["status"] == "stalled", result.stderr


# nccl-tests' own output (src/util.cu): the rank list, then the results header, then a row per size.
TESTS_HEAD = [
    "# nThread 1 nGpus 1 minBytes 8 maxBytes 134217728 step: 2(factor) warmup iters: 5 iters: 20 agg iters: 1 validation: 1 graph: 0",
    "#",
    "# Using devices",
]
TESTS_TABLE = [
    "#                                                              out-of-place                       in-place",
    "#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong",
    "#        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)",
]


def _ranks(hosts: list[str]) -> list[str]:
    return [f"#  Rank {r:2d} Group  0 Pid {4100 + r:6d} on {host:>10s} device {r % 8:2d} [0000:1b:00] NVIDIA H100 80GB HBM3" for r, host in enumerate(hosts)]


def test_a_test_stopped_at_its_first_size_on_one_host_is_offered_pci003(tmp_path: Path) -> None:
    text, document = _explained(tmp_path, [*TESTS_HEAD, *_ranks(["gpu7"] * 4), *TESTS_TABLE])
    assert [(c["id"], c["tier"]) for c in document["candidates"]] == [("PCI003", "symptom")]
    assert document["stall"]["text"] == TESTS_TABLE[-1] and document["stall"]["lines_after"] == 0
    assert "the test's results header (" in text and "used the GPUs of one node only" in text


def test_a_units_line_cut_short_still_ends_at_the_header(tmp_path: Path) -> None:
    # A post cut inside the units line ("... (us)  (GB/") stopped at the header all the same.
    cut = TESTS_TABLE[-1][: TESTS_TABLE[-1].index("(GB/s)") + 4]
    _text, document = _explained(tmp_path, [*TESTS_HEAD, *_ranks(["gpu7"] * 2), *TESTS_TABLE[:-1], cut])
    assert [c["id"] for c in document["candidates"]] == ["PCI003"]
    assert document["stall"]["text"] == TESTS_TABLE[1] and document["stall"]["lines_after"] == 1


def test_nccl_1_single_process_tests_count_as_one_node(tmp_path: Path) -> None:
    old = [f"#   Rank {r:2d} uses device {r:2d} [0x{5 + r:02x}] Tesla M40 24GB" for r in range(4)]
    header = "#      bytes             N    type      op     time  algbw  busbw      res     time  algbw  busbw      res"
    _text, document = _explained(tmp_path, ["# Using devices", *old, "", header])
    assert [c["id"] for c in document["candidates"]] == ["PCI003"]


def test_a_test_across_hosts_stopped_at_its_first_size_is_stalled_without_a_candidate(tmp_path: Path) -> None:
    text, document = _explained(tmp_path, [*TESTS_HEAD, *_ranks(["gpu7", "gpu7", "gpu8", "gpu8"]), *TESTS_TABLE])
    assert document["status"] == "stalled" and document["candidates"] == []
    assert "The test's results header is the log's last line:" in text


def test_a_test_with_result_rows_or_a_summary_is_no_stall(tmp_path: Path) -> None:
    row = "           8             2     float     sum      -1    24.51    0.00    0.00      0    23.98    0.00    0.00      0"
    for ending in ([row], [row, "# Out of bounds values : 0 OK", "# Avg bus bandwidth    : 0.0012"]):
        _text, document = _explained(tmp_path, [*TESTS_HEAD, *_ranks(["gpu7"] * 2), *TESTS_TABLE, *ending])
        assert document["status"] == "nothing-found" and document["stall"] is None


@pytest.mark.parametrize(
    "dump",
    [
        # py-spy dump of a rank waiting in a collective
        [
            'Thread 474480 (idle): "MainThread"',
            "    broadcast (torch/distributed/distributed_c10d.py:2772)",
            "    _zero_init_param (deepspeed/runtime/zero/partition_parameters.py:1054)",
        ],
        # gdb attached to the process: its stop line, then the backtrace command and frames
        [
            "0x00007f59364f8c9b in sched_yield () at ../sysdeps/unix/syscall-template.S:120",
            "(gdb) thread apply all bt",
            "Thread 1 (Thread 0x7f5936b1e740 (LWP 6042)) \"python\":",
            "#0  0x00007f59364f8c9b in sched_yield () at ../sysdeps/unix/syscall-template.S:120",
        ],
        # lldb's "bt all": a thread header with its stop reason, then one frame per line
        [
            "  thread #16, name = 'python', stop reason = signal SIGSTOP",
            "    frame #0: 0x00007fb0b7f0792d libc.so.6`syscall + 29",
            "    frame #3: 0x00007fb090db1068 libtorch_cuda.so`c10d::ProcessGroupNCCL::abort() + 664",
        ],
        # Python's faulthandler (dump_traceback_later, or a SIGUSR1 handler registered for hangs)
        [
            "Thread 0x00007f3c2effd640 (most recent call first):",
            '  File "/usr/lib/python3.10/threading.py", line 324 in wait',
            '  File "/opt/conda/lib/python3.10/site-packages/torch/distributed/distributed_c10d.py", line 2772 in broadcast',
        ],
    ],
)
def test_a_stack_dump_of_a_waiting_process_is_a_stall_named_at_its_first_line(tmp_path: Path, dump: list[str]) -> None:
    text, document = _explained(tmp_path, ["$ py-spy dump --pid 4711", *dump])
    assert document["status"] == "stalled" and document["candidates"] == []
    assert document["stall"]["location"].endswith("job.log:2") and document["stall"]["text"] == dump[0]
    assert "A stack dump of the waiting process is " in text


def test_a_debuggers_missing_source_banner_inside_the_dump_does_not_hide_the_stall(tmp_path: Path) -> None:
    # gdb prints "120\t../sysdeps/...: No such file or directory." after attaching: the dump's own
    # words, not the run's failure. An NCCL WARN before the dump is the run's line and decides.
    dump = [
        "0x00007f59364f8c9b in sched_yield () at ../sysdeps/unix/syscall-template.S:120",
        "120\t../sysdeps/unix/syscall-template.S: No such file or directory.",
        "(gdb) thread apply all bt",
    ]
    _text, document = _explained(tmp_path, ["$ gdb -p 4711", *dump])
    assert document["status"] == "stalled" and document["stall"]["text"] == dump[0]
    warned = ["node1:4711:4790 [0] bootstrap.cc:279 NCCL WARN [Rem Allocator] Allocation failed (segment 0, fd 130)", *dump]
    _text, document = _explained(tmp_path, warned)
    assert document["status"] == "uncatalogued" and document["first_failure"]["location"].endswith(":1")


def test_a_stack_dump_long_before_the_end_is_no_stall(tmp_path: Path) -> None:
    lines = ['Thread 474480 (idle): "MainThread"', "    broadcast (torch/distributed/distributed_c10d.py:2772)"]
    _text, document = _explained(tmp_path, [*lines, *[f"step {n} loss 1.{n}" for n in range(LAST_LINES)]])
    assert document["status"] == "nothing-found" and document["stall"] is None


def test_an_nccl_stall_in_a_test_run_on_one_host_is_intra_node_before_any_connection_line(tmp_path: Path) -> None:
    # nccl-tests of 2019-2020 listed "Rank  0 Pid  15833 on host device  0"; NCCL 2.4 logged the
    # missing libibverbs as a WARN, which is a setting, not the run's failing line.
    ranks = [f"#   Rank {r:2d} Pid  15833 on    gpu-box device {r:2d} [0x0{r + 2}] GeForce GTX 1080 Ti" for r in range(4)]
    nccl = [
        "gpu-box:15833:15833 [0] misc/ibvwrap.cc:63 NCCL WARN Failed to open libibverbs.so[.1]",
        "gpu-box:15833:15833 [0] NCCL INFO NET/Socket : Using [0]eth0:10.2.3.32<0>",
        "gpu-box:15833:15833 [1] NCCL INFO Setting affinity for GPU 1 to ff00ff",
    ]
    _text, document = _explained(tmp_path, ["# Using devices", *ranks, *nccl])
    assert document["status"] == "candidates" and document["first_failure"] is None
    ranked = [(c["id"], c["tier"]) for c in document["candidates"]]
    # The missing libibverbs is an RDMA NIC setting: a run inside one node never used the NIC.
    assert ranked[0] == ("PCI003", "symptom") and "IB009" not in dict(ranked), ranked
    assert document["stall"]["text"] == nccl[-1]


# CUDA's p2pBandwidthLatencyTest, laid out as Samples/5_Domain_Specific/p2pBandwidthLatencyTest prints it.
P2P_SAMPLE = [
    "[P2P (Peer-to-Peer) GPU Bandwidth Latency Test]",
    "Device: 0, NVIDIA GeForce RTX 4090, pciBusID: 41, pciDeviceID: 0, pciDomainID:0",
    "Device: 1, NVIDIA GeForce RTX 4090, pciBusID: 61, pciDeviceID: 0, pciDomainID:0",
    "Device=0 CAN Access Peer Device=1",
    "Device=1 CAN Access Peer Device=0",
    "P2P Connectivity Matrix",
    "     D\\D     0     1",
    "     0\t     1     1",
    "     1\t     1     1",
    "Unidirectional P2P=Disabled Bandwidth Matrix (GB/s)",
    "   D\\D     0      1",
    "     0 909.92  22.47",
    "     1  22.67 918.56",
    "Unidirectional P2P=Enabled Bandwidth (P2P Writes) Matrix (GB/s)",
    "   D\\D     0      1",
]


@pytest.mark.parametrize("cut", [14, 15, 10], ids=["at-a-title", "at-its-header-row", "at-the-first-title"])
def test_the_cuda_peer_to_peer_sample_stopped_inside_a_matrix_is_offered_pci003(tmp_path: Path, cut: int) -> None:
    text, document = _explained(tmp_path, P2P_SAMPLE[:cut])
    assert [(c["id"], c["tier"]) for c in document["candidates"]] == [("PCI003", "symptom")]
    title = max(index for index in range(cut) if "Matrix (GB/s)" in P2P_SAMPLE[index])
    assert document["stall"] == {"location": f"{tmp_path}/job.log:{title + 1}", "text": P2P_SAMPLE[title], "lines_after": cut - 1 - title}
    assert "the peer-to-peer test's matrix title (" in text and "used the GPUs of one node only" in text


def test_the_cuda_peer_to_peer_sample_with_values_or_its_closing_note_is_no_stall(tmp_path: Path) -> None:
    note = "NOTE: The CUDA Samples are not meant for performance measurements. Results may vary when GPU Boost is enabled."
    for lines in (P2P_SAMPLE[:13], [*P2P_SAMPLE, "     0 913.03  27.07", "     1  11.46 916.42", note]):
        _text, document = _explained(tmp_path, lines)
        assert document["status"] == "nothing-found" and document["stall"] is None, lines[-1]


# Each framework's own start-up line right before the process group's first collective, as those
# frameworks print it (references/coverage: deepspeed.toml, lightning.toml, pytorch-2x.toml, vllm.toml).
FRAMEWORK_SETUP_LINES = [
    "[2024-06-11 00:23:36,254] [INFO] [comm.py:668:init_distributed] Initializing TorchBackend in DeepSpeed with backend nccl",
    "Initializing distributed: GLOBAL_RANK: 3, MEMBER: 4/16",
    "[rank1]:[W1105 13:37:10.134661876 ProcessGroupNCCL.cpp:4115] [PG ID 0 PG GUID 0 Rank 1]  using GPU 1 to perform barrier"
    " as devices used by this process are currently unknown. This can potentially cause a hang if this rank to GPU mapping is incorrect.",
    "(VllmWorker rank=0 pid=4887) INFO 07-08 10:09:09 [pynccl.py:70] vLLM is using nccl==2.26.2",
]


@pytest.mark.parametrize("setup", FRAMEWORK_SETUP_LINES)
def test_a_log_ending_at_a_frameworks_last_line_before_the_first_collective_is_stalled_there(tmp_path: Path, setup: str) -> None:
    text, document = _explained(tmp_path, ["loading model", setup, "", "```", "waiting"])
    # vLLM's line is also NCCL016's context, a candidate beside a hang: "candidates", not "stalled"
    assert document["status"] == ("candidates" if "vLLM" in setup else "stalled")
    assert document["stall"] == {"location": f"{tmp_path}/job.log:2", "text": setup, "lines_after": 1}
    assert "the framework's last line before the first collective" in text.lower()


@pytest.mark.parametrize("setup", FRAMEWORK_SETUP_LINES)
def test_a_frameworks_setup_line_followed_by_progress_finish_or_failure_is_no_stall(tmp_path: Path, setup: str) -> None:
    went_on = [setup, *[f"step {n} loss 1.{n}" for n in range(6)]]
    assert _explained(tmp_path, went_on)[1]["stall"] is None
    finished = [setup, "gpu7:4410:4410 [0] NCCL INFO comm 0x55d1c2a0 rank 0 nranks 2 cudaDev 0 busId 1b000 - Destroy COMPLETE"]
    assert _explained(tmp_path, finished)[1]["stall"] is None
    failed = [setup, "RuntimeError: NCCL error in: ../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:1269, unhandled system error"]
    assert _explained(tmp_path, failed)[1]["status"] != "stalled"


def test_a_framework_stall_lets_the_settings_the_log_shows_count_as_beside_a_failure(tmp_path: Path) -> None:
    # Ray's /dev/shm size (NCCL007's context signature) is a candidate only beside a failure or a hang.
    shm = (
        "2023-11-18 03:39:16,283 WARNING services.py:1996 -- WARNING: The object store is using /tmp instead of /dev/shm"
        " because /dev/shm has only 67108864 bytes available. This will harm performance!"
    )
    assert _explained(tmp_path, [shm, "loading model"])[1]["candidates"] == []
    _text, document = _explained(tmp_path, [shm, FRAMEWORK_SETUP_LINES[0]])
    assert document["status"] == "candidates" and [c["id"] for c in document["candidates"]] == ["NCCL007"]
