"""Layer 4: the installed ``preflight`` command end to end on recorded roots."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from conftest import REPO, Runner, write

SCHEMA = json.loads((REPO / "preflight" / "schemas" / "report-v1.schema.json").read_text())


def findings(report: dict[str, object], status: str = "present") -> set[tuple[str, str]]:
    return {(f["id"], f["subject"]) for f in report["findings"] if f["status"] == status}  # type: ignore[index,union-attr]


def test_example_node_json_is_valid_and_finds_planted_problems(run_cli: Runner, example_root: Path) -> None:
    result = run_cli("node", "--root", str(example_root), "--format", "json")
    assert result.returncode == 2, result.stderr
    report = json.loads(result.stdout)
    jsonschema.validate(report, SCHEMA)
    assert findings(report) == {
        ("MEM001", "slurmd"), ("MEM001", "slurm.conf"), ("MEM002", "NCCL_BUFFSIZE"),
        ("GDR001", "node"), ("GDR002", "gdrdrv"), ("DNS001", "gpu017"), ("PCI001", "bridge 0000:5c:00.0"),
        ("SOCK002", "/usr/lib/x86_64-linux-gnu/libnccl.so.2.21.5"), ("SOCK002", "/usr/local/lib/python3.10/dist-packages/nvidia/nccl/lib/libnccl.so.2"),
    }
    assert findings(report, "absent") >= {("GPU001", "node"), ("TOPO005", "node")}
    assert report["host"] == "gpu017" and {p["status"] for p in report["probes"]} == {"ok"}
    assert report["facts"]["gpus"]["devices"][0]["bus_id"] == "0000:18:00.0"
    assert {link["name"] for link in report["facts"]["interfaces"]["links"]} >= {"eno1", "docker0", "ibp26s0"}


def test_golden_json_for_example_node(run_cli: Runner, example_root: Path) -> None:
    """The whole report minus timings equals the committed golden file."""
    result = run_cli("node", "--root", str(example_root), "--format", "json")
    report = json.loads(result.stdout)
    for volatile in ("started_at", "duration_s", "root"):
        report.pop(volatile)
    for probe in report["probes"]:
        probe.pop("duration_s")
    golden = REPO / "tests" / "golden" / "hgx-h100.json"
    assert report == json.loads(golden.read_text())
    # Probes finish in any order; the report lists their facts by name on every run.
    assert list(report["facts"]) == sorted(report["facts"])


def test_clean_root_exits_zero(run_cli: Runner, clean_root: Path) -> None:
    result = run_cli("node", "--root", str(clean_root), "--format", "json")
    assert result.returncode == 0, result.stdout
    assert findings(json.loads(result.stdout)) == set()


def test_warning_only_exits_one(run_cli: Runner, clean_root: Path) -> None:
    write(clean_root, "/etc/slurm/slurm.conf", "ClusterName=x\n")  # MEMLOCK propagated again: a warning
    result = run_cli("node", "--root", str(clean_root))
    assert result.returncode == 1, result.stdout
    assert "WARNING" in result.stdout and "slurm.conf" in result.stdout


def test_table_groups_by_severity_and_hides_absent(run_cli: Runner, example_root: Path) -> None:
    result = run_cli("node", "--root", str(example_root), env={"COLUMNS": "200"})  # the summary on one line
    out = result.stdout
    assert out.index("ERROR") < out.index("WARNING") < out.index("HOW TO FIX")
    assert "GPU001" not in out and "ABSENT" not in out
    report = json.loads(run_cli("node", "--root", str(example_root), "--format", "json").stdout)
    present = [f for f in report["findings"] if f["status"] == "present"]
    errors = sum(1 for f in present if f["severity"] in ("error", "critical"))
    by_status: dict[str, set[str]] = {}
    for finding in report["findings"]:
        by_status.setdefault(finding["status"], set()).add(finding["id"])
    checks = {f["id"] for f in report["findings"]}
    with_problem = by_status["present"]
    absent = by_status["absent"] - with_problem
    # Checks are counted once each (MEM001 and SOCK002 have two present findings each), so the
    # summary adds up to the header's count; findings are named as findings.
    assert len(with_problem) == 7 and len(present) == 9 and len(checks) == 64
    expected = (
        f"64 checks: 7 present (9 findings: {errors} error, {9 - errors} warning), 0 unknown, "
        f"{len(absent)} absent, {64 - 7 - len(absent)} not applicable."
    )
    assert out.endswith(f"\n{expected}\n") and out.startswith("preflight ") and " 64 checks in " in out.replace("\n", " ")
    assert "GPU001" in run_cli("node", "--root", str(example_root), "--show-all").stdout


def test_select_and_ignore_by_prefix_and_symbol(run_cli: Runner, example_root: Path) -> None:
    result = run_cli("node", "--root", str(example_root), "--format", "json", "--select", "MEM,gpu-unusable-by-driver", "--ignore", "MEM002")
    assert {f["id"] for f in json.loads(result.stdout)["findings"]} == {"MEM001", "GPU001"}
    bad = run_cli("node", "--root", str(example_root), "--select", "NOPE")
    assert bad.returncode == 3 and "matches no reference" in bad.stderr


def test_prolog_profile_skips_full_only_probes(run_cli: Runner, example_root: Path) -> None:
    report = json.loads(run_cli("node", "--root", str(example_root), "--format", "json", "--profile", "prolog").stdout)
    assert "interfaces" not in {p["name"] for p in report["probes"]}
    assert report["profile"] == "prolog"


def test_prometheus_output(run_cli: Runner, example_root: Path) -> None:
    out = run_cli("node", "--root", str(example_root), "--format", "prometheus").stdout
    assert 'preflight_reference_status{id="MEM001",symbol="memlock-limit-too-low",severity="error",status="present"} 1' in out
    assert 'preflight_reference_status{id="GPU001",symbol="gpu-unusable-by-driver",severity="critical",status="absent"} 1' in out
    assert 'preflight_probe_success{probe="memlock"} 1' in out
    for line in out.splitlines():
        assert line.startswith("#") or line.count(" ") >= 1 and line.rsplit(" ", 1)[1].replace(".", "").isdigit()


def test_junit_output(run_cli: Runner, example_root: Path) -> None:
    from xml.etree import ElementTree

    suite = ElementTree.fromstring(run_cli("node", "--root", str(example_root), "--format", "junit").stdout)
    report = json.loads(run_cli("node", "--root", str(example_root), "--format", "json").stdout)
    present = {f["id"] for f in report["findings"] if f["status"] == "present"}
    assert suite.get("tests") == str(len({f["id"] for f in report["findings"]})) and suite.get("failures") == str(len(present))
    failed = {case.get("name", "").split()[0] for case in suite if case.find("failure") is not None}
    assert failed == present >= {"MEM001", "MEM002", "GDR001", "GDR002", "DNS001", "PCI001"}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--root", "/nonexistent/root"], "no such directory"),
        (["--format", "yaml"], "--format"),
        (["--profile", "fast"], "--profile"),
        (["--timeout", "-1"], "--timeout"),
        (["--config", "/nonexistent.toml"], "no such file"),
        (["--bogus"], "No such option"),
        (["--select", ","], "--select ',' names nothing"),
        (["--ignore="], "--ignore '' names nothing"),
    ],
)
def test_bad_arguments_exit_3_without_traceback(run_cli: Runner, example_root: Path, args: list[str], message: str) -> None:
    result = run_cli("node", *([] if "--root" in args else ["--root", str(example_root)]), *args)
    assert result.returncode == 3
    assert message in result.stderr and "Traceback" not in result.stderr


def test_a_run_in_which_every_check_is_unknown_is_no_verdict(run_cli: Runner, node_copy: Path) -> None:
    """Nothing decided is not a healthy node: exit 3 with the first reason, the report still shown."""
    nvml_path = node_copy / ".preflight" / "nvml.json"
    nvml = json.loads(nvml_path.read_text())
    nvml["calls"]["nvmlDeviceGetCount"] = {"hang": True}
    nvml_path.write_text(json.dumps(nvml))
    result = run_cli("node", "--root", str(node_copy), "--select", "GPU001", "--timeout", "2")
    assert result.returncode == 3, result.stdout
    assert "1 check" in result.stdout and "1 unknown" in result.stdout
    assert "preflight: error: no verdict: every check is unknown (GPU001: " in result.stderr
    decided = run_cli("node", "--root", str(node_copy), "--select", "GPU001,DNS001", "--timeout", "2")
    assert decided.returncode == 2  # DNS001 is present on the example node: one decided check is a verdict


def test_a_root_that_is_a_fifo_device_or_dash_is_named_for_what_it_is(run_cli: Runner, tmp_path: Path) -> None:
    import os

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for root, message in ((str(fifo), "neither a directory nor a snapshot archive; not opened"), ("/dev/null", "neither a directory"),
                          ("-", "--root does not read standard input")):
        result = run_cli("node", "--root", root, timeout=30)
        assert result.returncode == 3 and message in result.stderr, (root, result.stderr)


def test_config_typo_names_file_line_and_key(run_cli: Runner, example_root: Path, tmp_path: Path) -> None:
    config = tmp_path / "preflight.toml"
    config.write_text("[run]\ntimeout = 5\n\n[expect]\nmemlock_minimum = \"unlimited\"\n")
    result = run_cli("node", "--root", str(example_root), "--config", str(config))
    assert result.returncode == 3
    assert f"{config}:5: expect.memlock_minimum: unknown key" in result.stderr


def test_config_given_sets_expectations_and_severity_but_one_inside_the_root_is_ignored(run_cli: Runner, node_copy: Path) -> None:
    """A config recorded inside --root is evidence from another node, never settings: only
    --config (or this machine's /etc/preflight/preflight.toml) is obeyed."""
    write(node_copy, "/etc/preflight/preflight.toml", '[expect]\nmemlock_min = "4MiB"\n\n[[hosts]]\nmatch = "gpu[001-032]"\nseverity = { DNS001 = "warning" }\ndisable = ["GDR002"]\n')
    ignored = json.loads(run_cli("node", "--root", str(node_copy), "--format", "json").stdout)
    assert ("MEM001", "slurmd") in findings(ignored) and "GDR002" in {f["id"] for f in ignored["findings"]}
    assert ignored["config"] == ""
    config = str(node_copy / "etc" / "preflight" / "preflight.toml")
    report = json.loads(run_cli("node", "--root", str(node_copy), "--config", config, "--format", "json").stdout)
    assert ("MEM001", "slurmd") not in findings(report)  # 8 MiB satisfies a 4 MiB minimum
    assert "GDR002" not in {f["id"] for f in report["findings"]}
    assert {f["severity"] for f in report["findings"] if f["id"] == "DNS001"} == {"warning"}
    assert report["config"] == config


def test_references_list_and_show(run_cli: Runner) -> None:
    listed = json.loads(run_cli("references", "list", "--format", "json").stdout)
    assert {r["id"] for r in listed} >= {"MEM001", "MEM002", "GDR001", "GDR002", "GPU001", "DNS001"}
    shown = run_cli("references", "show", "memlock-limit-too-low")
    assert shown.returncode == 0 and "OFI Memlock Exhaustion" in shown.stdout and "Sources" in shown.stdout
    # MEM001's checks read the memlock limits of slurmd, this process and limits.conf, not a container's
    assert "The node checks test only:" in shown.stdout and "The node checks test only:" not in run_cli("references", "show", "GDR001").stdout
    assert next(r for r in listed if r["id"] == "MEM001")["detect"]["tests_only"].startswith("slurmd's memlock limit")
    assert run_cli("references", "show", "XYZ999").returncode == 3
    assert len(listed) == 90
    table = run_cli("references", "list", env={"COLUMNS": "300"})  # wide enough for one line per row
    assert table.returncode == 0 and len(table.stdout.splitlines()) == 92  # header, rule, 90 rows


def test_references_search(run_cli: Runner) -> None:
    found = run_cli("references", "search", "vendor", "err", "129")
    assert found.returncode == 0
    ids = [line.split()[0] for line in found.stdout.splitlines()[2:] if not line.startswith(" ")]  # not wrapped titles
    assert ids[0] == "IB006" and "ROCE006" in ids  # title matches first
    as_json = json.loads(run_cli("references", "search", "memlock", "--format", "json").stdout)
    assert "MEM001" in {r["id"] for r in as_json}
    nothing = run_cli("references", "search", "no-such-words-anywhere")
    assert nothing.returncode == 1 and "No reference mentions" in nothing.stdout
    nothing = run_cli("references", "search", "no-such-words-anywhere", "--format", "json")
    assert nothing.returncode == 1 and json.loads(nothing.stdout) == []


def test_version(run_cli: Runner) -> None:
    from preflight import __version__

    result = run_cli("--version")
    assert result.returncode == 0 and result.stdout.strip() == f"preflight {__version__}"


def test_every_declared_command_is_served_by_typer_with_the_declared_options() -> None:
    """The typer application is built from the declarations: each command, with exactly the
    declared options, so the fast entry and typer cannot disagree about what a command takes."""
    import typer.main

    from preflight.cli.app import build_app
    from preflight.cli.spec import COMMAND_MODULES
    from preflight.cli.start import declared

    root = typer.main.get_command(build_app())
    seen = 0
    for word in COMMAND_MODULES:
        for command in declared(word):
            node = root
            for part in command.path:
                node = node.commands[part]  # type: ignore[attr-defined]
            flags = {opt for param in node.params for opt in param.opts if opt.startswith("-")} - {"--help"}
            assert flags == {option.flag for option in command.options}, command.path
            seen += 1
    assert seen == 12  # node, snapshot, explain, fleet, probes list, references x3, slurm x4


def test_help_paragraphs_are_rewrapped_to_the_terminal_not_broken_where_the_source_wraps() -> None:
    """The declarations wrap their help at 100 columns; typer's rich help keeps those breaks, which
    cut 'Exit codes: ...' mid-sentence at 80 columns. Every paragraph reaches typer as one line."""
    import typer.main

    from preflight.cli.app import build_app
    from preflight.cli.spec import COMMAND_MODULES
    from preflight.cli.start import declared

    root = typer.main.get_command(build_app())
    for word in COMMAND_MODULES:
        for command in declared(word):
            node = root
            for part in command.path:
                node = node.commands[part]  # type: ignore[attr-defined]
            texts = [node.help or ""] + [getattr(param, "help", None) or "" for param in node.params]
            for text in texts:
                assert all("\n" not in paragraph for paragraph in text.split("\n\n")), (command.path, text)
    fleet = root.commands["fleet"]  # type: ignore[attr-defined]
    assert "Exit codes: 0 all agree and nothing at warning or above, 1 warnings present or a file skipped," in (fleet.help or "")


def test_the_fast_parser_reads_what_it_fully_understands_and_leaves_the_rest_to_typer(tmp_path: Path, run_cli: Runner) -> None:
    """`preflight fleet` and `preflight node` start without typer when their command lines are well
    formed; typer answers anything else (here: no report given)."""
    from preflight.cli.fleet import FLEET
    from preflight.cli.node import NODE
    from preflight.cli.spec import parse

    assert parse(FLEET, ["a.json", "--format=json", "dir", "--ignore-fact", "kernel,mtu"]) == {
        "inputs": ("a.json", "dir"), "output_format": "json", "output": None, "ignore_fact": ("kernel", "mtu"), "node_names": "host",
    }
    assert parse(FLEET, ["dir", "--bogus"]) is None
    node = parse(NODE, ["--select", "MEM,GDR001", "--select=dns", "--timeout", "2.5", "--show-all"])
    assert node is not None and node["select"] == ("MEM", "GDR001", "dns") and node["timeout"] == 2.5 and node["show_all"] is True
    assert parse(NODE, ["--timeout", "soon"]) is None  # typer says what is wrong with the number
    assert parse(NODE, ["--root", "/a", "--root", "/b"]) is None
    assert parse(NODE, ["--root"]) is None
    missing = run_cli("fleet")
    assert missing.returncode == 3 and "give report files" in missing.stderr and "Traceback" not in missing.stderr


def test_explain_takes_the_fast_parser_and_reads_a_lone_dash_as_stdin(run_cli: Runner) -> None:
    """`explain` runs once per failed job in some sites' epilogs: typer's start-up would be most
    of a short log's time. "-" is stdin for both parsers, never an unknown option."""
    from preflight.cli.explain import EXPLAIN
    from preflight.cli.spec import parse
    from preflight.cli.start import fast_command

    assert fast_command(["explain", "a.log"]) == (EXPLAIN, ["a.log"])
    parsed = parse(EXPLAIN, ["a.log", "-", "--format=json", "--checks-dir", "site"])
    assert parsed is not None and parsed["inputs"] == ("a.log", "-") and parsed["output_format"] == "json"
    assert parsed["checks_dirs"] == ("site",) and parsed["check"] is False
    assert parse(EXPLAIN, ["-x"]) is None and parse(EXPLAIN, ["--check=yes"]) is None
    piped = run_cli("explain", "-", input="node1:1:1 [0] NCCL WARN NET/IB : Got completion from peer 10.0.0.2<1> with status=12 opcode=1 len=0 vendor err 129\n")
    assert piped.returncode == 1 and "IB006" in piped.stdout, piped.stderr
    typo = run_cli("explain", "--formt", "json", "a.log")
    assert typo.returncode == 3 and "--formt" in typo.stderr and "Traceback" not in typo.stderr


def test_live_node_runs_without_crashing(run_cli: Runner) -> None:
    result = run_cli("node", "--format", "json", "--show-all")
    assert result.returncode in (0, 1, 2), result.stderr
    report = json.loads(result.stdout)
    jsonschema.validate(report, SCHEMA)
    assert report["root"] == "/"


def test_every_reference_present_and_absent_on_recorded_roots(run_cli: Runner, example_root: Path, clean_root: Path) -> None:
    """Each reference is present on the example root (or a planted variant of it) and absent on the clean root."""
    clean = json.loads(run_cli("node", "--root", str(clean_root), "--format", "json").stdout)
    statuses = {f["id"]: f["status"] for f in clean["findings"]}
    assert set(statuses.values()) <= {"absent", "not_applicable"}, statuses
    assert {ref for ref, status in statuses.items() if status == "absent"} >= {"DNS001", "GDR001", "GPU001", "MEM001"}
    # GDR002 and MEM002 judge settings the clean root does not make; made harmlessly, they are absent.
    assert statuses["GDR002"] == statuses["MEM002"] == "not_applicable"
    write(clean_root, "/etc/nccl.conf", "NCCL_IB_HCA=mlx5\nNCCL_GDRCOPY_ENABLE=0\nNCCL_BUFFSIZE=4194304\n")
    settings = json.loads(run_cli("node", "--root", str(clean_root), "--format", "json", "--select", "GDR002,MEM002").stdout)
    assert {f["id"]: f["status"] for f in settings["findings"]} == {"GDR002": "absent", "MEM002": "absent"}
    planted = {f["id"] for f in json.loads(run_cli("node", "--root", str(example_root), "--format", "json").stdout)["findings"] if f["status"] == "present"}
    nvml = json.loads((clean_root / ".preflight/nvml.json").read_text())
    nvml["calls"]["nvmlDeviceGetName"]["3"] = {"error": "NVML_ERROR_GPU_IS_LOST"}
    write(clean_root, "/.preflight/nvml.json", json.dumps(nvml))
    lost = json.loads(run_cli("node", "--root", str(clean_root), "--format", "json").stdout)
    assert findings(lost) == {("GPU001", "GPU3")}
    assert planted | {"GPU001"} >= {"DNS001", "GDR001", "GDR002", "GPU001", "MEM001", "MEM002"}


@pytest.mark.parametrize(
    ("args", "reason"),
    [
        (["--select", "IB001"], "IB001: no node check (preflight explain finds it in logs)"),
        (["--profile", "prolog", "--select", "SOCK002"], "SOCK002: not in the prolog profile (runs in: full)"),
        (["--select", "MEM001", "--ignore", "MEM"], "MEM001: removed by --ignore MEM"),
        (["--select", "IB002,SOCK002", "--profile", "prolog"],
         "IB002: no node check (preflight explain finds it in logs); SOCK002: not in the prolog profile (runs in: full)"),
    ],
)
def test_a_selection_that_runs_nothing_is_no_verdict(run_cli: Runner, example_root: Path, args: list[str], reason: str) -> None:
    """Zero checks and exit 0 would read as a healthy node."""
    result = run_cli("node", "--root", str(example_root), *args)
    assert (result.returncode, result.stdout) == (3, "")
    assert result.stderr == f"preflight: error: no check left to run: {reason}\n"


def test_a_selection_the_config_disables_is_no_verdict_but_a_partial_one_runs(run_cli: Runner, example_root: Path, tmp_path: Path) -> None:
    config = tmp_path / "site.toml"
    config.write_text('disable = ["MEM001"]\n')
    disabled = run_cli("node", "--root", str(example_root), "--select", "MEM001", "--config", str(config))
    assert disabled.returncode == 3 and disabled.stderr == f"preflight: error: no check left to run: MEM001: disabled by {config}\n"
    partial = run_cli("node", "--root", str(example_root), "--profile", "prolog", "--select", "SOCK002,MEM001", "--format", "json")
    assert partial.returncode == 2 and {f["id"] for f in json.loads(partial.stdout)["findings"]} == {"MEM001"}


def widest_line(text: str) -> int:
    return max(len(line) for line in text.splitlines())


def test_tables_fit_the_terminal_width(run_cli: Runner, example_root: Path) -> None:
    """At COLUMNS=80 every line fits (183 columns before); without COLUMNS, output into a pipe
    gets 80 too; a wide terminal keeps one line per reference."""
    for columns in ("80", "60"):
        for args in (["node", "--root", str(example_root), "--show-all"], ["references", "list"], ["references", "search", "nccl"]):
            result = run_cli(*args, env={"COLUMNS": columns})
            assert result.returncode in (0, 2) and widest_line(result.stdout) <= int(columns), (args, columns)
    piped = run_cli("node", "--root", str(example_root), env={"COLUMNS": ""})
    assert widest_line(piped.stdout) <= 80
    wide = run_cli("node", "--root", str(example_root), env={"COLUMNS": "250"}).stdout
    assert "  /usr/local/lib/python3.10/dist-packages/nvidia/nccl/lib/libnccl.so.2  " in wide  # the whole subject in its cell
    assert widest_line(wide) > 100
    # Wrapped, nothing is lost: every word of the evidence is still there, in order.
    narrow = run_cli("node", "--root", str(example_root), "--format", "table", env={"COLUMNS": "80"}).stdout
    header, _rule, *rows = narrow.split("\nWARNING\n")[1].split("\n\nHOW TO FIX")[0].splitlines()
    evidence_column = " ".join(row[header.index("Evidence"):] for row in rows)
    assert "MEMLOCK propagated from the submitting shell: (neither PropagateResourceLimits" in " ".join(evidence_column.split())


def test_reference_commands_are_printed_whole(monkeypatch: pytest.MonkeyPatch, run_cli: Runner) -> None:
    """Every evidence command of every reference is on a line of its own, as written in the
    catalogue, so it can be pasted; prose fits 80 columns unless a single word (a URL) is longer."""
    from preflight.catalogue import load_all
    from preflight.cli.references import render_reference

    monkeypatch.setenv("COLUMNS", "80")
    commands = 0
    for reference in load_all():
        lines = render_reference(reference).splitlines()
        verbatim = {f"$ {item['command']}" for item in reference.evidence if item.get("command")}
        verbatim |= {f"- [{s['role']}] {s['pattern']}".strip() for s in reference.signatures}
        stripped = {line.strip() for line in lines}
        assert verbatim <= stripped, reference.id
        commands += len(verbatim)
        for line in lines:
            assert len(line) <= 80 or line.strip() in verbatim or " " not in line.strip().lstrip("-0123456789. ").strip(), (reference.id, line)
    assert commands > 200
    shown = run_cli("references", "show", "MEM001", env={"COLUMNS": "80"}).stdout
    assert "\n    $ grep 'Max locked memory' /proc/$(pidof slurmd)/limits\n" in shown


@pytest.mark.parametrize("name", ["x.zip", "x.tar", "snapshot", "x.gz"])
def test_snapshot_refuses_a_name_that_promises_another_format(run_cli: Runner, example_root: Path, tmp_path: Path, name: str) -> None:
    target = tmp_path / name
    result = run_cli("snapshot", str(target), "--root", str(example_root))
    assert result.returncode == 3
    assert result.stderr == f"preflight: error: {target}: a snapshot is a gzip-compressed tar archive; name it *.tar.gz or *.tgz\n"
    assert list(tmp_path.iterdir()) == []


def test_snapshot_refuses_a_scrub_option_that_names_nothing(run_cli: Runner, example_root: Path, tmp_path: Path) -> None:
    """``--scrub "$UNSET"`` must not write an unscrubbed snapshot meant to leave the site."""
    result = run_cli("snapshot", str(tmp_path / "node.tar.gz"), "--root", str(example_root), "--scrub", "")
    assert result.returncode == 3 and "--scrub '' names nothing" in result.stderr
    assert not (tmp_path / "node.tar.gz").exists()


def test_snapshot_with_a_tgz_name_replays(run_cli: Runner, example_root: Path, tmp_path: Path) -> None:
    target = tmp_path / "gpu017.TGZ"
    assert run_cli("snapshot", str(target), "--root", str(example_root)).returncode == 0
    assert target.read_bytes()[:2] == b"\x1f\x8b"  # gzip, as the name says
    assert run_cli("node", "--root", str(target), "--select", "MEM001").returncode == 2


def test_explain_refuses_node_options_without_check_and_a_missing_root(run_cli: Runner, example_root: Path) -> None:
    log = REPO / "tests" / "data" / "explain" / "corpus"
    path = str(next(p for p in sorted(log.iterdir()) if p.name.startswith("MEM001__")))
    for args, message in (
        (["--root", str(example_root)], "--root needs --check (it gives the node --check examines)"),
        (["--config", "/etc/preflight/preflight.toml"], "--config needs --check (it gives the site config --check runs with)"),
        (["--check", "--root", "/nonexistent"], "--root /nonexistent: no such directory"),
        (["--check", "--root", str(REPO / "docs")], f"--root {REPO / 'docs'}: not a node root"),
    ):
        result = run_cli("explain", path, *args)
        assert (result.returncode, result.stdout) == (3, ""), args
        assert result.stderr.startswith(f"preflight: error: {message}") and result.stderr.count("\n") == 1, result.stderr
    checked = run_cli("explain", path, "--check", "--root", str(example_root))
    assert checked.returncode == 2  # confirmed: MEM001 is planted on the example node


def test_probes_list_shows_each_probe_its_sources_needs_checks_and_facts(run_cli: Runner) -> None:
    result = run_cli("probes", "list", "--format", "json")
    assert result.returncode == 0, result.stderr
    rows = {row["name"]: row for row in json.loads(result.stdout)}
    roce = rows["roce"]
    assert roce["module"] == "preflight.probes.roce" and roce["sources"] == ["fs"] and roce["needs"] == ["job"]
    assert {"ROCE001", "ROCE005"} <= set(roce["checks"]) and roce["facts"]["type"] == "RoceFacts" and "ports" in roce["facts"]["fields"]
    assert rows["roce_dcb"]["needs"] == ["roce"] and rows["job"]["needs"] == []
    assert all(row["facts"]["fields"] for row in rows.values()), [name for name, row in rows.items() if not row["facts"]["fields"]]
    table = run_cli("probes", "list")
    assert table.returncode == 0 and "RoceFacts" in table.stdout


def test_shell_completion_comes_from_typer(run_cli: Runner) -> None:
    """Completion is typer's: the script for a shell names the program and its completion hook."""
    # Named, not detected: detection walks the process tree for a shell, and a test runner started
    # from a service or cron has none above it (typer then takes the option as a flag).
    result = run_cli("--show-completion", "bash", env={"_TYPER_COMPLETE_TEST_DISABLE_SHELL_DETECTION": "1"})
    assert result.returncode == 0 and "_preflight_completion" in result.stdout and "complete" in result.stdout, result.stderr
