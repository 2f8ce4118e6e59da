"""Untrusted inputs: ``preflight explain`` on binary, huge, endless-line, compressed-bomb and
deeply repetitive logs stays in bounded memory with a clear answer, and finishes (each run's
subprocess timeout is a hang guard; ``bench/reliability.py`` reports the wall times); config files with a
wrong-typed value for every key fail with file, line and key, exit code 3, no traceback.

Regex blow-up attempts against every catalogue signature are already covered where the
signatures live: ``test_catalogue.test_every_signature_is_linear_on_adversarial_lines`` (each
pattern on near misses and long runs) and ``test_explain_cli.test_adversarial_lines_stay_fast``
(the CLI on lines of repeated literals); ``bench/reliability.py`` repeats the latter at scale
with its memory measured.
"""

from __future__ import annotations

import gzip
import itertools
import json
import os
from pathlib import Path

import pytest

from conftest import EXAMPLE_ROOT, Runner, preflight_command
from reliability_harness import measure, repetitive_log, sparse_file
from preflight.config import _DNS_KEYS, _EXPECT_KEYS, _RUN_KEYS, ConfigError, parse_config

MAX_RSS_MB = 150  # a prolog-sized process: the interpreter, the catalogue and one chunk of log


def explain(*args: str) -> tuple[int, dict, str, float]:
    result = measure([*preflight_command(), "explain", "--format", "json", *args], timeout=120)
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    return result.returncode, json.loads(result.stdout), result.stderr, result.max_rss_mb


def test_binary_input_is_named_and_skipped(tmp_path: Path) -> None:
    core = tmp_path / "core.1234"
    core.write_bytes(bytes(range(256)) * 4096)
    code, report, _, rss = explain(str(core))
    assert code == 3 and report["candidates"] == []
    assert any("binary data" in problem for problem in report["inputs"]["problems"]), report["inputs"]["problems"]
    assert rss < MAX_RSS_MB


def test_huge_sparse_file_is_rejected_without_reading_it(tmp_path: Path) -> None:
    huge = tmp_path / "huge.log"
    sparse_file(huge, 1 << 30)  # 1 GiB of NULs, no disk
    code, report, _, rss = explain(str(huge))
    assert code == 3 and any("binary data" in problem for problem in report["inputs"]["problems"])
    assert rss < MAX_RSS_MB


def test_endless_line_is_scanned_in_pieces(tmp_path: Path) -> None:
    """40 MB without a newline, the catalogue's example buried at the end."""
    from preflight.catalogue import load_all

    example = next(e for r in load_all() for item in r.signatures for e in item.get("examples", []))
    endless = tmp_path / "endless.log"
    with open(endless, "wb") as handle:
        handle.write(b"x" * (40 << 20))
        handle.write(example.encode())
    code, report, _, rss = explain(str(endless))
    assert code in (0, 1) and report["inputs"]["split_lines"] >= 40 * 16
    assert rss < MAX_RSS_MB


def test_repetitive_log_and_gzip_bomb_stay_bounded(tmp_path: Path) -> None:
    """20 MB of chatter with every catalogue example spread through it, plain and as a gzip
    stream that inflates over 20x (the bench inflates one to 1 GiB): memory does not grow with
    the input, candidates are found."""
    log = tmp_path / "rank0.log"
    repetitive_log(log, 20 << 20)
    code, report, _, rss = explain(str(log))
    assert code == 1 and report["candidates"]
    assert rss < MAX_RSS_MB
    bomb = tmp_path / "rank1.log.gz"
    with gzip.open(bomb, "wb", compresslevel=9) as handle:
        handle.write(log.read_bytes())
    assert os.path.getsize(bomb) * 20 < os.path.getsize(log)
    code, report, _, rss = explain(str(bomb))
    assert code == 1 and report["candidates"]
    assert rss < MAX_RSS_MB


def test_fifo_in_a_log_directory_is_not_waited_on(tmp_path: Path) -> None:
    """A directory of per-rank logs may hold a named pipe; explain must not block on it."""
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "rank0.log").write_text("NCCL INFO Bootstrap : Using eth0:10.0.0.1<0>\n")
    os.mkfifo(logs / "rank1.pipe")
    code, report, _, _ = explain(str(logs))
    assert code in (0, 1)  # measure()'s subprocess timeout is the hang guard


def test_a_fifo_named_on_the_command_line_is_refused_not_waited_on(tmp_path: Path) -> None:
    pipe = tmp_path / "rank0.log"
    os.mkfifo(pipe)
    code, report, stderr, _ = explain(str(pipe))  # a hang would end in explain()'s timeout
    assert "not a regular file (a FIFO)" in json.dumps(report) + stderr


def test_a_gzip_bomb_is_not_inflated_in_full(tmp_path: Path) -> None:
    """A 1 GiB stream of one log line that compresses 1000x: inflated up to 100x its size (or
    256 MiB), then scanned no further, with a note."""
    bomb = tmp_path / "rank0.log.gz"
    line = b"[rank0]: NCCL INFO Channel 00/32 : 0 1 2 3 4 5 6 7\n"
    with gzip.open(bomb, "wb", compresslevel=9) as handle:
        block = line * ((1 << 20) // len(line))
        for _ in range(1024):
            handle.write(block)
    code, report, stderr, rss = explain(str(bomb))
    assert "gzip bomb" in json.dumps(report) + stderr
    assert report["inputs"]["bytes"] < 300 << 20 and rss < MAX_RSS_MB


# -- config files -----------------------------------------------------------------------------
# Values of every TOML type, and the numbers TOML allows that bound nothing.
WRONG_VALUES = ('"a string"', "true", "[1, 2]", '["", "x"]', "{ a = 1 }", "-1", "0", "1.5", "nan", "inf", "-inf", "1e999", "99999999999999999999")
SECTIONS = {"run": _RUN_KEYS, "expect": _EXPECT_KEYS, "dns": _DNS_KEYS, "policy": {"unknown": None}}


def _config_cases() -> list[tuple[str, str, str]]:
    cases = []
    for (section, keys), value in itertools.product(SECTIONS.items(), WRONG_VALUES):
        for key in keys:
            cases.append((f"# site config\n[{section}]\n{key} = {value}\n", f"{section}.{key}", value))
            cases.append((f'[[hosts]]\nmatch = "gpu*"\n[hosts.{section}]\n{key} = {value}\n', f"hosts[0].{section}.{key}", value))
    for value in WRONG_VALUES:
        cases.append((f"[severity]\nMEM001 = {value}\n", "severity.MEM001", value))
        cases.append((f"disable = {value}\n", "disable", value))
        cases.append((f"[[hosts]]\nmatch = {value}\n", "hosts[0].match", value))
    for table in ("run", "expect", "dns", "policy", "severity"):
        cases.append((f"{table} = 5\n", table, "5"))
    cases.append(("hosts = 5\n", "hosts", "5"))
    return cases


def _is_valid(text: str) -> bool:
    try:
        parse_config(text, "/etc/preflight/preflight.toml", "gpu017")
    except ConfigError:
        return False
    return True


def test_every_config_key_with_every_wrong_type() -> None:
    """Each value either parses (it is valid for that key, e.g. 1.5 seconds) or fails with a
    ConfigError naming the file, the line and the key; nothing else ever escapes."""
    rejected = 0
    for text, key, value in _config_cases():
        if key.startswith("hosts[0].") and key.split(".")[1] in ("run", "dns", "policy"):
            expected_key = f"hosts[0].{key.split('.')[1]}"  # only expect/severity/disable belong in [[hosts]]
        else:
            expected_key = key
        try:
            parse_config(text, "/etc/preflight/preflight.toml", "gpu017")
        except ConfigError as error:
            message = str(error)
            rejected += 1
            assert message.startswith("/etc/preflight/preflight.toml"), message
            if "not valid TOML" not in message:
                assert f": {expected_key}" in message, (text, message)
                assert ":" in message.split(" ", 1)[0][len("/etc/preflight/preflight.toml"):], f"no line number: {message}"
        except Exception as error:  # the bug this test hunts
            pytest.fail(f"{key} = {value}: {type(error).__name__}: {error}")
    assert rejected > 200


@pytest.mark.parametrize("text", [
    '[run]\ntimeout = "soon"\n', "[run]\ntimeout = nan\n", "[run]\nprobe_timeout = inf\n", "[dns]\nport = 70000\n",
    '[expect]\nmemlock_min = "9999999999999999999999999999999999999999999999999999999999999999999999999999999999999999999999999999999999999999999999999999999999999999999999999999999999999999999999999999999999999999999999999999999999999999999999999999999999999999999999999999999999999999999999999999999999999999999999999999999999999999999999999999GiB"\n',
    "[expect]\nhcas = [1]\n", "[[hosts]]\nmatch = 5\n", "severity = 5\n",
])
def test_wrong_config_through_the_cli(run_cli: Runner, tmp_path: Path, text: str) -> None:
    config = tmp_path / "preflight.toml"
    config.write_text(text)
    result = run_cli("node", "--root", str(EXAMPLE_ROOT), "--config", str(config), "--profile", "prolog")
    assert result.returncode == 3 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.startswith(f"preflight: error: {config}:"), result.stderr
    assert not _is_valid(text)


@pytest.mark.parametrize("value", ["inf", "nan", "-1", "0"])
def test_unbounded_timeout_on_the_command_line(run_cli: Runner, value: str) -> None:
    result = run_cli("node", "--root", str(EXAMPLE_ROOT), "--timeout", value)
    assert result.returncode == 3 and "Traceback" not in result.stderr and "--timeout" in result.stderr, result.stderr
