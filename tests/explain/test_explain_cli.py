"""``preflight explain`` end to end: the log corpus, inputs of every kind, bad input, --check.

The corpus under tests/data/explain/corpus holds realistic logs named ``<ID>__<what>.log``: the
reference that must rank first. ``none__*.log`` files fail for reasons outside the catalogue
(or do not fail), and explain must say it found nothing rather than guess.
"""

from __future__ import annotations

import gzip
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

from conftest import REPO, Runner, preflight_command

CORPUS = REPO / "tests" / "data" / "explain" / "corpus"
SCHEMA = json.loads((REPO / "preflight" / "schemas" / "explain-v1.schema.json").read_text())
CORPUS_FILES = sorted(CORPUS.glob("*.log"))


def explain_json(run_cli: Runner, *args: str, input: str | None = None) -> tuple[int, dict]:  # type: ignore[type-arg]
    result = run_cli("explain", "--format", "json", *args, input=input)
    assert result.returncode in (0, 1, 2, 3), result.stderr
    assert "Traceback" not in result.stderr
    document = json.loads(result.stdout)
    jsonschema.validate(document, SCHEMA)
    return result.returncode, document


def test_corpus_is_broad_enough() -> None:
    expected = {path.name.split("__")[0] for path in CORPUS_FILES}
    assert len(CORPUS_FILES) >= 40
    assert len(expected - {"none"}) >= 30
    assert "none" in expected


def test_every_corpus_log_ranks_its_reference_first(run_cli: Runner) -> None:
    # One process for the whole corpus would blur the per-file answers, so run each file.
    wrong = []
    for path in CORPUS_FILES:
        expected = path.name.split("__")[0]
        code, document = explain_json(run_cli, str(path))
        top = document["candidates"][0]["id"] if document["candidates"] else "none"
        if top != expected:
            ranked = [c["id"] for c in document["candidates"][:4]]
            wrong.append(f"{path.name}: got {top} (ranking {ranked})")
        elif expected == "none" and "error" in path.name:
            # A failure no reference describes is named, never passed over in silence.
            assert code == 1 and document["status"] == "uncatalogued", path.name
            # the first line of the failure; a traceback is named by the exception that ends it
            first = document["first_failure"]
            assert first["location"].endswith(":1") or re.search(r"\w(?:Error|Exception): ", first["text"]), first
        elif expected == "none":
            assert code == 0 and document["status"] == "nothing-found" and document["first_failure"] is None
        else:
            assert code == 1 and document["status"] == "candidates"
            assert document["candidates"][0]["evidence_lines"], path.name
    assert not wrong, "\n".join(wrong)


def test_no_signature_fires_on_healthy_logs(run_cli: Runner) -> None:
    """Normal NCCL/PyTorch start-up and training output must not look like a failure or a
    suspicious setting: a context signature that matches ordinary INFO lines is noise."""
    healthy = [p for p in CORPUS_FILES if p.name.startswith("none__healthy")]
    assert healthy
    for path in healthy:
        code, document = explain_json(run_cli, str(path))
        assert (code, document["candidates"], document["settings_seen"]) == (0, [], []), path.name


def test_text_output_names_evidence_lines_and_fix(run_cli: Runner) -> None:
    path = next(p for p in CORPUS_FILES if p.name.startswith("MEM001__"))
    result = run_cli("explain", str(path))
    assert result.returncode == 1, result.stderr
    first = result.stdout.split("\n2. ")[0]
    assert "1. MEM001" in first and f"{path}:" in first
    assert "Why only a candidate" in first and "Fix:" in first and "preflight node --select MEM001" in first


def test_a_log_only_reference_says_why_no_node_check_decides_it(run_cli: Runner, tmp_path: Path) -> None:
    """NCCL009 (ranks running different collectives) leaves no trace on a node before the job:
    explain says so, with the catalogue's reason, instead of pointing at a check."""
    import tomllib

    reason = tomllib.loads((Path(__file__).resolve().parents[2] / "references" / "NCCL009.toml").read_text())["detect"]["why_log_only"]
    log = tmp_path / "rank0.log"
    log.write_text("[rank0]: RuntimeError: Detected mismatch between collectives on ranks. Rank 0 is running collective: "
                   "CollectiveFingerPrint(SequenceNumber=214, OpType=ALLREDUCE), but Rank 2 is running collective: "
                   "CollectiveFingerPrint(SequenceNumber=214, OpType=BROADCAST)\n")
    text = run_cli("explain", str(log))
    first = text.stdout.split("\n2. ")[0]
    assert "1. NCCL009" in first and f"No node check: {reason}" in first and "preflight node --select" not in first
    document = json.loads(run_cli("explain", str(log), "--format", "json").stdout)
    candidate = document["candidates"][0]
    assert candidate["id"] == "NCCL009" and candidate["no_check_reason"] == reason and candidate["checks"] == []


def _watchdog_timeout(rank: int, sequence: int = 15037) -> str:
    return (
        f"[rank{rank}]:[E ProcessGroupNCCL.cpp:563] [Rank {rank}] Watchdog caught collective operation timeout: WorkNCCL(SeqNum={sequence},"
        " OpType=_ALLGATHER_BASE, NumelIn=131072512, NumelOut=524290048, Timeout(ms)=600000) ran for 600055 milliseconds before timing out.\n"
    )


def test_watchdog_timeouts_are_compared_across_ranks(run_cli: Runner, tmp_path: Path) -> None:
    """The comparison NCCL003's fix asks for: ranks 1-3 and 5 timed out in one collective, ranks 0
    and 4 printed no timeout for it (the collective waited for them)."""
    log = tmp_path / "job.log"
    log.write_text("".join(_watchdog_timeout(rank) for rank in (3, 1, 2, 5)) + _watchdog_timeout(3))
    text = run_cli("explain", str(log)).stdout
    assert f"Watchdog timeouts: ranks 1-3, 5 timed out in collective #15037 (_ALLGATHER_BASE), first at {log}:1." in text
    assert "No timeout from ranks 0, 4 in these logs: the collective waited for them" in text
    _code, document = explain_json(run_cli, str(log))
    assert document["timeouts"] == {
        "sequence": 15037, "operation": "_ALLGATHER_BASE", "ranks": [1, 2, 3, 5], "silent_ranks": [0, 4], "first_location": f"{log}:1",
    }
    # One rank's timeout has nothing to compare with; every rank up to the highest reporting: no silent rank.
    log.write_text(_watchdog_timeout(4))
    assert explain_json(run_cli, str(log))[1]["timeouts"] is None
    log.write_text(_watchdog_timeout(0) + _watchdog_timeout(1))
    assert explain_json(run_cli, str(log))[1]["timeouts"]["silent_ranks"] == []
    assert "No timeout from" not in run_cli("explain", str(log)).stdout
    # Timeouts naming different collectives (several process groups, or a mismatch): no summary.
    log.write_text(_watchdog_timeout(0) + _watchdog_timeout(1).replace("_ALLGATHER_BASE", "ALLREDUCE"))
    _code, document = explain_json(run_cli, str(log))
    assert document["timeouts"] is None and "NCCL009" not in [c["id"] for c in document["candidates"]]


def test_nothing_found_is_said_plainly(run_cli: Runner, tmp_path: Path) -> None:
    log = tmp_path / "fine.log"
    log.write_text("epoch 1 loss 2.31\nepoch 2 loss 1.97\ntraining finished\n")
    result = run_cli("explain", str(log))
    assert result.returncode == 0
    assert "No failure found" in result.stdout and "does not guess" in result.stdout


def test_nccl_tests_run_as_separate_tests_in_json(run_cli: Runner, tmp_path: Path) -> None:
    log = tmp_path / "alltoall.log"
    footer = "# Out of bounds values : 0 OK\n# Avg bus bandwidth    : 3.94145 \n#\n"
    log.write_text(footer + footer)
    code, document = explain_json(run_cli, str(log))
    assert (code, document["status"]) == (1, "uncatalogued")
    assert document["separate_tests"]["location"] == f"{log}:4" == document["first_failure"]["location"]
    assert "built without MPI=1" in document["separate_tests"]["meaning"]
    text = run_cli("explain", str(log)).stdout
    assert text.startswith("nccl-tests ran as separate one-process tests") and f"{log}:4: # Out of bounds values" in text and "make MPI=1" in text
    log.write_text(footer)
    assert explain_json(run_cli, str(log))[1]["separate_tests"] is None


def test_stdin_gzip_and_directories_of_rank_logs(run_cli: Runner, tmp_path: Path) -> None:
    source = next(p for p in CORPUS_FILES if p.name.startswith("MEM001__")).read_text()
    code, document = explain_json(run_cli, "-", input=source)
    assert document["candidates"][0]["id"] == "MEM001"
    ranks = tmp_path / "ranks"
    ranks.mkdir()
    for rank in range(4):
        (ranks / f"rank{rank}.log").write_text("step 10 loss 2.0\n" * 20)
    with gzip.open(ranks / "rank4.log.gz", "wt") as handle:
        handle.write(source)
    code, document = explain_json(run_cli, str(ranks))
    assert document["inputs"]["files"] == 5 and document["candidates"][0]["id"] == "MEM001"
    assert document["candidates"][0]["evidence_lines"][0]["location"].startswith(str(ranks / "rank4.log.gz"))


def test_bad_inputs_get_a_message_not_a_traceback(run_cli: Runner, tmp_path: Path) -> None:
    binary = tmp_path / "core.bin"
    binary.write_bytes(bytes(range(256)) * 64)
    garbage = tmp_path / "latin1.log"
    garbage.write_bytes(b"\xff\xfe caf\xe9 \x80\x81 NCCL WARN Call to ibv_reg_mr failed with error Cannot allocate memory\n")
    code, document = explain_json(run_cli, str(binary), str(tmp_path / "nope.log"), str(garbage))
    problems = " ".join(document["inputs"]["problems"])
    assert "core.bin: binary data" in problems and "nope.log: cannot read" in problems
    assert document["candidates"][0]["id"] == "MEM001"  # the non-UTF-8 file is still scanned
    result = run_cli("explain", str(tmp_path / "nope.log"))
    assert result.returncode == 3 and "No input could be read" in result.stdout and "Traceback" not in result.stderr
    # Why, on stderr too: a report redirected to a file must not hide it.
    assert f"preflight: {tmp_path / 'nope.log'}: cannot read (" in result.stderr
    assert "preflight: error: No input could be read" in result.stderr and "cannot read" not in result.stdout
    result = run_cli("explain", "--format", "yaml", str(garbage))
    assert result.returncode == 3 and "Traceback" not in result.stderr


def test_empty_inputs_explain_nothing_and_say_so(run_cli: Runner, tmp_path: Path) -> None:
    """An empty log (a wrong path, a log not yet written) is no clean run, and a directory with no
    files in it is named: both exit 3, with the reason on stderr."""
    empty_dir = tmp_path / "logs"
    empty_dir.mkdir()
    result = run_cli("explain", str(empty_dir))
    assert result.returncode == 3 and f"preflight: {empty_dir}: no files in it" in result.stderr
    (tmp_path / "empty.log").write_text("")
    result = run_cli("explain", str(tmp_path / "empty.log"))
    assert result.returncode == 3 and "The input was empty (1 read, 0 lines); nothing was explained." in result.stdout
    assert "preflight: error: The input was empty" in result.stderr
    code, document = explain_json(run_cli, "-", input="")
    assert code == 3 and document["status"] == "no-input" and document["inputs"]["lines"] == 0


def test_a_directory_of_many_unreadable_files_names_a_few_and_counts_the_rest(run_cli: Runner, tmp_path: Path) -> None:
    """A job's output directory with checkpoints beside its logs: the skipped files are counted,
    not printed one by one above the explanation."""
    from preflight.explain.reader import MAX_PROBLEMS

    run = tmp_path / "run"
    run.mkdir()
    for index in range(MAX_PROBLEMS + 7):
        (run / f"shard-{index:03}.pt").write_bytes(bytes(range(256)) * 8)
    (run / "rank0.log").write_text("NCCL WARN Call to ibv_reg_mr failed with error Cannot allocate memory\n")
    code, document = explain_json(run_cli, str(run))
    problems = document["inputs"]["problems"]
    assert len(problems) == MAX_PROBLEMS + 1 and problems[-1] == "7 more input problem(s) not listed"
    assert problems[0].endswith("shard-000.pt: binary data, not a text log (skipped)")
    assert document["candidates"][0]["id"] == "MEM001"
    shown = run_cli("explain", str(run))
    assert shown.stderr.count("binary data, not a text log") == MAX_PROBLEMS and "7 more input problem(s)" in shown.stderr
    assert "binary data" not in shown.stdout and shown.stdout.startswith("1 candidate")


def test_a_50_mb_single_line_streams_in_bounded_memory(tmp_path: Path) -> None:
    log = tmp_path / "one-line.log"
    with open(log, "wb") as handle:
        block = b"NCCL INFO noise without end " * 4096
        while handle.tell() < 50_000_000:
            handle.write(block)
        handle.write(b"\nnode1:1:2 [0] NCCL WARN Call to ibv_reg_mr failed with error Cannot allocate memory\n")
    # Measure the child alone: a fresh Python that runs explain and reports its own peak RSS.
    script = (
        "import resource, subprocess, sys;"
        f"r = subprocess.run({preflight_command()!r} + ['explain', '--format', 'json', {str(log)!r}], capture_output=True, text=True);"
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); print(r.returncode); sys.stdout.write(r.stdout)"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    peak_kib, code, body = result.stdout.split("\n", 2)
    document = json.loads(body)
    assert int(code) == 1 and document["inputs"]["split_lines"] > 700
    assert int(peak_kib) < 150 * 1024, f"peak RSS {int(peak_kib) // 1024} MiB"


def record_job_step(root: Path) -> None:
    """Make ``root`` a recording taken inside a job step: its environ without the prolog's context."""
    environ = root / "proc/self/environ"
    pairs = [item for item in environ.read_bytes().split(b"\0") if item and not item.startswith(b"SLURM_SCRIPT_CONTEXT=")]
    environ.write_bytes(b"\0".join([*pairs, b"SLURM_STEP_ID=0"]) + b"\0")


def test_check_confirms_and_refutes_on_a_recorded_node(run_cli: Runner, example_root: Path, clean_root: Path) -> None:
    path = next(p for p in CORPUS_FILES if p.name.startswith("MEM001__"))
    code, planted = explain_json(run_cli, str(path), "--check", "--root", str(example_root))
    top = planted["candidates"][0]
    assert code == 2 and top["verdict"]["status"] == "confirmed" and top["verdict"]["findings"]
    code, clean = explain_json(run_cli, str(path), "--check", "--root", str(clean_root))
    # MEM001's checks read slurmd's, this process's and limits.conf's memlock, not a container's
    # --ulimit: a clean node leaves it undecided and says what was tested.
    verdict = clean["candidates"][0]["verdict"]
    assert verdict["status"] == "undecided" and verdict["reason"].startswith("the node checks test only ") and code == 1
    # GDR001's check reads every cause it lists (peer-memory modules, DMA-BUF, NCCL_DMABUF_ENABLE).
    # Recorded by a prolog, which sees none of what the job exports (NCCL_DMABUF_ENABLE), a clean
    # root rules out nothing of the job's settings; recorded in a job step it refutes.
    gdr = next(p for p in CORPUS_FILES if p.name.startswith("GDR001__"))
    code, gdr_prolog = explain_json(run_cli, str(gdr), "--check", "--root", str(clean_root))
    verdict = gdr_prolog["candidates"][0]["verdict"]
    assert verdict["status"] == "undecided" and "not the failed job's" in verdict["reason"] and code == 1
    record_job_step(clean_root)
    code, gdr_clean = explain_json(run_cli, str(gdr), "--check", "--root", str(clean_root))
    assert gdr_clean["candidates"][0]["verdict"]["status"] == "refuted" and code == 1
    without_checks = [c for c in clean["candidates"] if not c["checks"]]
    assert all(c["verdict"]["status"] == "undecided" for c in without_checks)
    refused = run_cli("explain", "--format", "json", str(path), "--check", "--root", "/no/such/root")
    assert refused.returncode == 3 and refused.stdout == "" and "/no/such/root" in refused.stderr
    assert "Traceback" not in refused.stderr


def test_check_names_what_the_node_shows_behind_a_symptom(run_cli: Runner, example_root: Path, clean_root: Path, tmp_path: Path) -> None:
    """A log that shows only a symptom ("unhandled system error") sends the reader to an earlier
    cause: --check also runs the checks of the references the symptom lists as related, and names
    those the node shows, apart from the candidates (which keep their own verdicts)."""
    log = tmp_path / "rank0.log"
    log.write_text(
        "torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/NCCLUtils.hpp:317, "
        "unhandled system error (run with NCCL_DEBUG=INFO for details), NCCL version 2.21.5\n"
    )
    # The example node was recorded by a prolog: the NCCL copies its job-reading checks found are not
    # the job's, so SOCK002 is named only where the root was recorded in a job step.
    code, prolog = explain_json(run_cli, str(log), "--check", "--root", str(example_root))
    assert "SOCK002" not in {entry["id"] for entry in prolog["related_on_node"]}
    in_job = tmp_path / "in-job"
    shutil.copytree(example_root, in_job, symlinks=True)
    record_job_step(in_job)
    example_root = in_job
    code, found = explain_json(run_cli, str(log), "--check", "--root", str(example_root))
    assert [c["id"] for c in found["candidates"]] == ["NCCL007"] and found["candidates"][0]["tier"] == "symptom"
    related = {entry["id"]: entry for entry in found["related_on_node"]}
    # The example node's NCCL 2.21.5 retries a failed connect on the same socket (SOCK002, related
    # to NCCL007); its 8 MiB memlock is MEM001, whose check NCCL007's own verdict already ran and shows.
    assert "SOCK002" in related and related["SOCK002"]["symptoms"] == ["NCCL007"]
    assert all(f["status"] == "present" and f["severity"] in ("warning", "error", "critical") for f in related["SOCK002"]["findings"])
    assert "MEM001" not in related and any(f["id"] == "MEM001" for f in found["candidates"][0]["verdict"]["findings"])
    assert code == 2  # NCCL007's own verdict is confirmed (memlock); the related list does not set the code
    text = run_cli("explain", str(log), "--check", "--root", str(example_root)).stdout
    assert "Found on the node, related to the symptoms above" in text and "SOCK002" in text.split("Found on the node")[1]
    code, clean = explain_json(run_cli, str(log), "--check", "--root", str(clean_root))
    assert clean["related_on_node"] == [] and code == 1
    code, unchecked = explain_json(run_cli, str(log))
    assert unchecked["related_on_node"] == []
    assert "Found on the node" not in run_cli("explain", str(log), "--check", "--root", str(clean_root)).stdout


def test_check_replays_a_snapshot_archive(run_cli: Runner, example_root: Path, tmp_path: Path) -> None:
    """`--root` takes a `preflight snapshot` archive, as `preflight node --root` does; a broken
    archive is a check error, not a traceback."""
    archive = tmp_path / "gpu017.tar.gz"
    assert run_cli("snapshot", str(archive), "--root", str(example_root)).returncode == 0
    path = next(p for p in CORPUS_FILES if p.name.startswith("MEM001__"))
    code, replayed = explain_json(run_cli, str(path), "--check", "--root", str(archive))
    top = replayed["candidates"][0]
    assert code == 2 and top["verdict"]["status"] == "confirmed", replayed.get("check_error")
    assert any("8 MiB" in line["observed"] for f in top["verdict"]["findings"] for line in f["evidence"])
    broken = tmp_path / "broken.tar.gz"
    broken.write_bytes(archive.read_bytes()[:300])
    code, failed = explain_json(run_cli, str(path), "--check", "--root", str(broken))
    assert code == 3 and "broken.tar.gz" in failed["check_error"]  # candidates stand, no verdict
    assert failed["candidates"]


@pytest.mark.parametrize("name", ["adversarial"])
def test_adversarial_lines_stay_fast(run_cli: Runner, tmp_path: Path, name: str) -> None:
    """Lines built from the catalogue's own literals, repeated, cannot blow up the matcher."""
    from preflight.catalogue import load_all
    from preflight.signatures import required_literals

    literals = [lit for r in load_all() for s in r.signatures for lit in required_literals(s["pattern"])]
    log = tmp_path / f"{name}.log"
    with open(log, "w") as handle:
        for literal in literals:
            handle.write((literal + " ") * 2000 + "\n")
            handle.write(literal * 3000 + "\n")
    # A blow-up would run into run_cli's timeout, a hang guard here; bench/reliability.py
    # times these lines at scale.
    result = run_cli("explain", "--format", "json", str(log), timeout=60)
    assert result.returncode in (0, 1) and "Traceback" not in result.stderr
    assert json.loads(result.stdout)["inputs"]["lines"] == 2 * len(literals)  # every line was scanned
