"""Reports are untrusted input: every malformed, hostile, foreign or duplicate file is skipped
with a reason naming it, in bounded time and memory, and the other reports are still audited."""

from __future__ import annotations

import importlib
import json
import os
import tracemalloc
from pathlib import Path
from typing import Any

import pytest

from conftest import Runner
from preflight.exitcodes import ExitCode
from preflight.fleet import audit
from preflight.fleet.compare import fleet_exit_code
from preflight.fleet.load import MAX_REPORT_BYTES, ReportError, load_report
from preflight.fleet.render import render_table
from test_fleet import finding, report, write_all


def good_pair(directory: Path) -> None:
    write_all(directory, [report("gpu001"), report("gpu002")])


def skipped_reason(tmp_path: Path, name: str, content: bytes | str) -> str:
    """Audit two good reports plus one bad file; the bad one must be the only one skipped."""
    directory = tmp_path / "reports"
    good_pair(directory)
    path = directory / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    fleet = audit([str(directory)])
    assert [node.host for node in fleet.nodes] == ["gpu001", "gpu002"]
    (skipped,) = fleet.skipped
    assert skipped.file == str(path)
    return skipped.reason


def with_host(host: Any) -> str:
    document = report("x")
    document["host"] = host
    return json.dumps(document)


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        ("", "not JSON"),
        ('{"schema": "preflight-report/1", "host": "gpu003", "findings": [', "not JSON"),  # truncated
        ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
        ('{"schema": "preflight-report/1", "host": ' + "9" * 100_000 + "}", "not JSON"),  # over the int digit limit
        ('{"schema": "preflight-report/1", "n": NaN}', "NaN is not JSON"),
        (b"\xff\xfe{}", "not UTF-8"),
        ("[1, 2, 3]", "top level is not an object"),
        ('{"hello": "world"}', 'no "schema" field'),
        ('{"schema": "preflight-report/2", "host": "gpu003"}', "report schema 'preflight-report/2' is not supported"),
        ('{"schema": 3}', "report schema int is not supported"),
        (with_host("../../etc/passwd"), "host '../../etc/passwd' is not a plain host name"),
        (with_host("gpu\x1b[2J003"), "host 'gpu\\x1b[2J003' is not a plain host name"),
        (with_host("a/b"), "is not a plain host name"),
        (with_host(""), "is not a plain host name"),
        (with_host(7), "host int is not a plain host name"),
        (with_host("x" * 300), "is not a plain host name"),
        (with_host("gpu001\n"), "is not a plain host name"),  # would pass a "$" anchor as a node of its own
    ],
)
def test_bad_files_are_skipped_with_a_reason(tmp_path: Path, content: str | bytes, reason: str) -> None:
    assert reason in skipped_reason(tmp_path, "bad.json", content)


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (lambda d: d.update(findings={"a": 1}), '"findings" is not a list'),
        (lambda d: d.update(facts=[]), '"facts" is not an object'),
        (lambda d: d["findings"].append("x"), "findings[0]: expected an object"),
        (lambda d: d["findings"].append(finding("MEM001", status="broken")), "findings[0].status: 'broken' is not one of"),
        (lambda d: d["findings"].append(finding("../x")), "findings[0].id: '../x' is not a reference ID"),
        (lambda d: d["findings"].append(finding("MEM001", severity="apocalyptic")), "findings[0].severity"),
        (lambda d: d["findings"].append(finding("MEM001", status=["present"])), "findings[0].status: list is not one of"),
        (lambda d: d["findings"].append(finding("MEM001", severity={"x": 1})), "findings[0].severity: dict is not one of"),
        (lambda d: d["findings"].extend([finding("MEM001"), finding("MEM001", evidence=[{"observed": ["x"]}])]),
         "findings[1].evidence[0].observed: expected a string"),
        (lambda d: d["findings"].append(finding("MEM001", evidence="x")), "findings[0].evidence: expected a list"),
        (lambda d: d["findings"].append(finding("MEM001", title=["x"])), "findings[0].title: expected a string"),
    ],
)
def test_malformed_findings_skip_the_file(tmp_path: Path, change: Any, reason: str) -> None:
    document = report("gpu003")
    change(document)
    assert reason in skipped_reason(tmp_path, "gpu003.json", json.dumps(document))


def test_a_file_over_the_size_cap_is_not_read(tmp_path: Path) -> None:
    directory = tmp_path / "reports"
    good_pair(directory)
    huge = directory / "huge.json"
    with open(huge, "wb") as handle:  # sparse: costs no disk
        handle.truncate(MAX_REPORT_BYTES + 1)
    # Memory, not time, shows the file was not read: reading it would allocate its 16 MiB.
    tracemalloc.start()
    try:
        fleet = audit([str(directory)])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < MAX_REPORT_BYTES // 4, peak
    (skipped,) = fleet.skipped
    assert skipped.file == str(huge) and f"over the {MAX_REPORT_BYTES}-byte limit" in skipped.reason


def test_a_fifo_or_a_directory_named_like_a_report_is_skipped_without_blocking(tmp_path: Path) -> None:
    directory = tmp_path / "reports"
    good_pair(directory)
    os.mkfifo(directory / "pipe.json")
    (directory / "sub.json").mkdir()
    fleet = audit([str(directory)])
    assert sorted((Path(s.file).name, s.reason) for s in fleet.skipped) == [
        ("pipe.json", "not a regular file"), ("sub.json", "not a regular file"),
    ]


def test_missing_files_and_symlink_loops_are_skipped(tmp_path: Path) -> None:
    directory = tmp_path / "reports"
    good_pair(directory)
    (directory / "loop.json").symlink_to(directory / "loop.json")
    fleet = audit([str(directory), str(tmp_path / "nope.json")])
    assert sorted(Path(s.file).name for s in fleet.skipped) == ["loop.json", "nope.json"]
    assert all(s.reason.startswith("cannot open") for s in fleet.skipped)


def test_a_second_report_for_the_same_host_is_skipped(tmp_path: Path) -> None:
    directory = tmp_path / "reports"
    good_pair(directory)
    (directory / "zz-copy.json").write_text(json.dumps(report("gpu001")))
    fleet = audit([str(directory)])
    (skipped,) = fleet.skipped
    assert skipped.reason == f"a second report for host gpu001, not the newer one (kept: {directory / 'gpu001.json'})"
    assert fleet_exit_code(fleet) is ExitCode.WARNING


@pytest.mark.parametrize(("started_at", "kept_lost"), [(2.0, True), (0.5, False)])
def test_of_two_reports_for_a_host_the_newer_is_compared_and_the_other_still_counts(
    tmp_path: Path, started_at: float, kept_lost: bool
) -> None:
    """A report with a lost GPU beside a clean one for the same host, sorted after it: compared
    where it started later; skipped where it is the older, its critical finding kept in the exit
    code all the same (which of two reports is current, file names do not say)."""
    directory = tmp_path / "reports"
    good_pair(directory)
    lost = report("gpu001")
    lost["started_at"] = started_at
    lost["findings"].append(finding("GPU001", severity="critical", subject="GPU3"))
    (directory / "zz-gpu001-other.json").write_text(json.dumps(lost))
    fleet = audit([str(directory)])
    (skipped,) = fleet.skipped
    (node,) = [n for n in fleet.nodes if n.host == "gpu001"]
    assert (node.file.endswith("zz-gpu001-other.json")) is kept_lost
    assert skipped.duplicate_worst == ("" if kept_lost else "critical") and "not the newer one" in skipped.reason
    assert fleet_exit_code(fleet) is ExitCode.ERROR


def test_huge_numbers_and_odd_types_in_facts_are_unknown_or_shown_safely(tmp_path: Path) -> None:
    document = report("gpu003")
    document["facts"]["memlock"]["slurmd"]["soft"] = 10**4000  # within Python's digit limit
    document["facts"]["gpus"]["driver_version"] = "550\x1b]0;pwned\x07"
    document["facts"]["job"]["nccl_conf_files"][0]["entries"] = [["NCCL_IB_HCA", "x" * 100_000]]
    directory = tmp_path / "reports"
    good_pair(directory)
    write_all(directory, [document])
    fleet = audit([str(directory)])
    assert not fleet.skipped
    values = next(node.values for node in fleet.nodes if node.host == "gpu003")
    assert values["memlock_slurmd"] == "soft unlimited, hard 8 MiB"
    assert len(values["nccl_conf"] or "") < 500 and "(sha256 " in (values["nccl_conf"] or "")
    table = render_table(fleet, width=200)
    assert "\x1b" not in table and "\x07" not in table
    assert "550\\x1b]0;pwned\\x07" in table


def test_control_characters_in_file_names_are_escaped(tmp_path: Path, run_cli: Runner) -> None:
    directory = tmp_path / "reports"
    good_pair(directory)
    (directory / "evil\x1b[31m.json").write_text("{")
    result = run_cli("fleet", str(directory))
    assert result.returncode == ExitCode.WARNING  # a skipped file, nothing else
    assert "\x1b" not in result.stdout + result.stderr
    assert "evil\\x1b[31m.json" in result.stderr and "evil\\x1b[31m.json" in result.stdout


def test_a_directory_of_garbage_never_raises(tmp_path: Path, run_cli: Runner) -> None:
    directory = tmp_path / "reports"
    directory.mkdir()
    for number, content in enumerate(["null", "0", '"x"', "{}", '{"schema": null}', '{"schema": "preflight-report/1"}']):
        (directory / f"{number}.json").write_text(content)
    result = run_cli("fleet", "--format", "json", str(directory))
    assert result.returncode == ExitCode.NO_VERDICT and "Traceback" not in result.stderr
    assert len(json.loads(result.stdout)["skipped"]) == 6


def test_load_report_raises_report_error_only(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    path.write_text("{}")
    with pytest.raises(ReportError):
        load_report(str(path))


@pytest.mark.parametrize("data", [
    b'{"a": NaN}', b'{"a": Infinity}', b"[" * 5000 + b"]" * 5000, b'{"schema": ' + b"9" * 5000 + b"}",
    b'{"host": "\xff\xfe"}', b'{"a": 1,}', b"",
])
def test_the_fast_parser_refuses_what_the_standard_one_refuses_with_the_same_words(data: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    """msgspec speeds the fleet up, but a file it refuses is judged by the standard parser, so the
    reason a bad report is skipped does not depend on which decoder ran."""
    from preflight.fleet import load

    assert load._FAST_LOADS is not None and load._FAST_PARTS is not None  # msgspec: a dependency
    with pytest.raises(load.ReportError) as whole:
        load.parse_json(data)
    with pytest.raises(load.ReportError) as parts:
        load.parse_report(data)
    monkeypatch.setattr(load, "_FAST_LOADS", None)
    monkeypatch.setattr(load, "_FAST_PARTS", None)
    with pytest.raises(load.ReportError) as standard:
        load.parse_json(data)
    assert str(whole.value) == str(parts.value) == str(standard.value)


def test_the_fast_parser_reads_a_report_as_the_standard_one_does(monkeypatch: pytest.MonkeyPatch) -> None:
    from preflight.fleet import load

    data = (Path(__file__).resolve().parents[1] / "golden" / "hgx-h100.json").read_bytes()
    fast = load.parse_json(data)
    monkeypatch.setattr(load, "_FAST_LOADS", None)
    assert fast == load.parse_json(data)


def test_the_fast_encoder_writes_what_the_standard_one_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """msgspec writes the fleet JSON; without it (or for a string it refuses) the standard encoder
    must give the same document."""
    render = importlib.import_module("preflight.fleet.render")  # the package's `render` is the function

    directory = tmp_path / "reports"
    odd = report("gpu003")
    odd["facts"]["gpus"]["driver_version"] = "550.54.15-é"
    odd["findings"].append(finding("MEM001", status="present"))
    write_all(directory, [report("gpu001"), report("gpu002"), odd])
    fleet = audit([str(directory)])
    fast = json.loads(render.render_json(fleet))
    monkeypatch.setattr(render, "_FAST_DUMPS", None)
    assert json.loads(render.render_json(fleet)) == fast
    (driver,) = [c for c in fast["comparisons"] if c["fact"] == "nvidia_driver"]
    assert driver["values"][1] == {"value": "550.54.15-é", "hosts": ["gpu003"]}
    assert fast["references"][0]["present"][0]["host"] == "gpu003"


def test_a_lone_surrogate_and_non_ascii_text_reach_the_json_output_whatever_the_locale(tmp_path: Path, run_cli: Runner) -> None:
    """The standard parser lets a report carry "\\ud800", which msgspec will not encode: the fleet
    falls back to the standard encoder. JSON on stdout is UTF-8 even under a Latin-1 locale."""
    directory = tmp_path / "reports"
    odd = report("gpu003")
    odd["facts"]["gpus"]["driver_version"] = "550\ud800"
    wide = report("gpu004")
    wide["facts"]["gpus"]["driver_version"] = "550-日本"
    good_pair(directory)
    (directory / "gpu003.json").write_text(json.dumps(odd))  # ensure_ascii: "\ud800" as an escape
    write_all(directory, [wide])
    result = run_cli("fleet", "--format", "json", str(directory), env={"PYTHONIOENCODING": "latin-1", "LC_ALL": "C"})
    assert "Traceback" not in result.stderr, result.stderr
    document = json.loads(result.stdout)
    drivers = {group["value"] for c in document["comparisons"] if c["fact"] == "nvidia_driver" for group in c["values"]}
    assert {"550\ud800", "550-日本"} <= drivers


def test_reports_past_the_count_cap_are_not_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A directory of reports is read up to a count in name order; the rest are named once."""
    import preflight.fleet.load as load

    monkeypatch.setattr(load, "MAX_REPORTS", 3)
    for index in range(5):
        (tmp_path / f"gpu{index:03}.json").write_text("{}")
    paths, skipped, _listed = load.report_paths([str(tmp_path)])
    assert paths == [str(tmp_path / f"gpu{index:03}.json") for index in range(3)]
    assert [(s.file, s.reason) for s in skipped] == [(str(tmp_path / "gpu003.json"), "not read: over the 3-report limit, nor are 1 more after it in name order")]
    (tmp_path / "gpu004.json").unlink()  # exactly one over: named alone
    assert [s.reason for s in load.report_paths([str(tmp_path)])[1]] == ["not read: over the 3-report limit"]
