"""Probes started before the checks are imported (engine.start_early, run.inspect_node).

Each case runs in a fresh interpreter: the probes fork only from a single-threaded process, and
the test process has threads of its own."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import EXAMPLE_ROOT

#: Runs inspect_node on a root, with or without the early start, and prints the report and the
#: child processes still alive afterwards (the probes' child must be reaped or killed).
SCRIPT = """
import json, os, sys, time
from preflight import run as assembly
from preflight.reporters.json_report import dumps
root, mode = sys.argv[1], sys.argv[2]
started = []
original = assembly.start_early
assembly.start_early = lambda *args: started.append(original(*args)) or started[-1]
if mode == "late":
    assembly._start_early = lambda *args: None
node = assembly.open_node(root, None)
try:
    report = assembly.inspect_node(node, profile=sys.argv[3], apart=True).to_json()
except assembly.UsageProblem as problem:
    report = {"problem": str(problem)}
time.sleep(0.2)  # a killed child is gone by now
children = []
for task in os.listdir(f"/proc/{os.getpid()}/task"):
    with open(f"/proc/{os.getpid()}/task/{task}/children") as handle:
        children += handle.read().split()
live = []
for child in children:
    with open(f"/proc/{child}/stat") as handle:
        state = handle.read().rsplit(")", 1)[1].split()[0]
    if state != "Z":
        live.append(child)
print(json.dumps({"report": report, "live_children": live, "started_early": any(s is not None for s in started)}))
"""


def inspect(root: Path, mode: str, profile: str, cwd: Path) -> dict[str, object]:
    result = subprocess.run([sys.executable, "-c", SCRIPT, str(root), mode, profile], capture_output=True, text=True, timeout=120, cwd=cwd)
    assert result.returncode == 0, result.stderr[-2000:]
    outcome: dict[str, object] = json.loads(result.stdout)
    return outcome


def comparable(report: dict[str, object]) -> dict[str, object]:
    for volatile in ("started_at", "duration_s", "root"):
        report.pop(volatile, None)
    for probe in report["probes"]:  # type: ignore[attr-defined]
        probe.pop("duration_s")
    return report


def test_early_and_late_starts_report_the_same(tmp_path: Path) -> None:
    for profile in ("prolog", "full"):
        early = inspect(EXAMPLE_ROOT, "early", profile, tmp_path)
        late = inspect(EXAMPLE_ROOT, "late", profile, tmp_path)
        assert early["live_children"] == [] and late["live_children"] == []
        assert early["started_early"] and not late["started_early"]
        assert comparable(early["report"]) == comparable(late["report"])  # type: ignore[arg-type]
        assert early["report"]["findings"]  # type: ignore[index]


def test_a_run_that_stops_before_its_checks_leaves_no_probe_child(tmp_path: Path) -> None:
    """A config that disables every check: the run ends with NothingToRun after the probes were
    started early; their child is killed, not left running."""
    config = tmp_path / "preflight.toml"
    ids = sorted(path.stem for path in (Path(__file__).resolve().parents[2] / "references").glob("*.toml"))
    config.write_text("disable = [" + ", ".join(f'"{ref_id}"' for ref_id in ids) + "]\n")
    script = SCRIPT.replace("assembly.open_node(root, None)", f"assembly.open_node(root, {str(config)!r})")
    result = subprocess.run([sys.executable, "-c", script, str(EXAMPLE_ROOT), "early", "prolog"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    outcome = json.loads(result.stdout)
    assert "no check left to run" in outcome["report"]["problem"] and outcome["started_early"]
    assert outcome["live_children"] == []


def test_a_probe_the_early_start_did_not_know_is_run_in_threads(tmp_path: Path) -> None:
    """engine.run given early probes that lack one the checks need starts over in threads: the
    report is complete, never one with a probe missing."""
    script = """
import json, sys
from preflight.config import HostConfig
from preflight.discovery import build_registry, builtin_probe_registry
from preflight.engine import RunOptions, run, start_early
from preflight.sources import Sources
sources = Sources.for_node(sys.argv[1])
options = RunOptions(profile="prolog", apart=True)
partial = builtin_probe_registry("prolog")
del partial.probes["memlock"]
early = start_early(partial, sources, HostConfig(), options)
assert early is not None
report = run(build_registry(profile="prolog"), sources, HostConfig(), options, "gpu017", early=early)
print(json.dumps({p.name: p.status for p in report.probes}))
"""
    result = subprocess.run([sys.executable, "-c", script, str(EXAMPLE_ROOT)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    statuses = json.loads(result.stdout)
    assert statuses["memlock"] == "ok" and all(status == "ok" for status in statuses.values())
