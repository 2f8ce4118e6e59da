"""Reliability figures: the test suite's reliability checks at larger scale, written to
``docs/reliability.md``.

* mutated recorded roots: thousands of seeded mutations (``tests/reliability_harness.py``),
  counted per kind, judged by the same oracle as ``tests/reliability/test_reliability_mutations.py``;
* hung sources: 100 in-process runs with NVML, netlink, DNS and a sysfs read all stuck, with
  thread and descriptor counts (and, for comparison, the thread growth the engine had before it
  stopped restarting stuck probes), then a loop of CLI processes with a hung NVML;
* unprivileged: the CLI as ``nobody`` on a root-owned tree and on this machine (when the
  interpreter allows it);
* untrusted inputs: ``explain`` on a 10 GiB sparse file, a 200 MiB log, a gzip bomb, a 200 MiB
  line without a newline and adversarial lines, with wall time and peak RSS; every config key
  with every wrong type;
* safety: the ast scan of the package for shells and unbounded subprocesses.

Counts depend only on ``--seed``; times and memory depend on the machine. Run with the
interpreter of the venv preflight is installed in (for the unprivileged part, a venv nobody can
execute, e.g. one made from ``/usr/bin/python3``), as root:

    .venv/bin/python bench/reliability.py [--mutations 2000] [--seed 20240601]
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

import reliability_harness as harness  # noqa: E402

from preflight import engine  # noqa: E402
from preflight.config import HostConfig  # noqa: E402
from preflight.engine import RunOptions, run  # noqa: E402

DOC = REPO / "docs" / "reliability.md"
PREFLIGHT = str(Path(sys.executable).parent / "preflight")


# -- capture units ----------------------------------------------------------------------------
def bench_capture_units(workdir: Path) -> dict[str, Any]:
    """Every capture unit of every recorded root and real capture deleted in turn (the property
    of tests/sources/test_capture_units.py, which samples two instances of each pattern)."""
    registry = harness.build_registry(plugins=False)
    roots = [*harness.recorded_roots()]
    copies = workdir / "capture-units"
    copies.mkdir()
    sources = [*roots, *harness.extracted_real_roots(copies)]
    tried = 0
    violations: list[str] = []
    slowest = 0.0
    for source in sources:
        root = source if source.is_relative_to(copies) else copies / source.name
        if root != source:
            shutil.copytree(source, root, symlinks=True)
        baseline = harness.run_root(registry, root)
        for unit in harness.capture_unit_instances(root):
            begin = time.monotonic()
            with harness.deleted(root, unit):
                report = harness.run_root(registry, root)
            slowest = max(slowest, time.monotonic() - begin)
            tried += 1
            violations += [f"{root.name} without {unit.node_path}: {v}" for v in harness.capture_violations(baseline, report, unit)]
    return {"roots": len(sources), "recorded": len(roots), "real": len(sources) - len(roots), "tried": tried,
            "violations": violations, "slowest_s": round(slowest, 3)}


# -- mutations --------------------------------------------------------------------------------
def bench_mutations(workdir: Path, count: int, seed: int) -> dict[str, Any]:
    bench = harness.MutationBench(workdir / "mutations")
    rng = random.Random(seed)
    tried: collections.Counter[str] = collections.Counter()
    changed_runs: collections.Counter[str] = collections.Counter()
    per_root: collections.Counter[str] = collections.Counter()
    unreadable_runs = crashes = timeouts = 0
    violations: list[str] = []
    known_gaps: list[str] = []
    slowest = (0.0, "")
    names = sorted(bench.roots)
    for number in range(count):
        name = names[number % len(names)]
        mutations = harness.random_mutations(rng, bench, name)
        recordings = [t for t in bench.targets[name] if t.recording and t.relative not in {m.target.relative for m in mutations}]
        if number % 4 == 0 and recordings:
            # Recordings are few among the files read; break one in every fourth run.
            target = rng.choice(recordings)
            mutations.append(harness.Mutation(rng.choice(harness.kinds_for(target)), target, rng.randrange(2**32)))
        outcome = bench.try_mutations(name, mutations)
        per_root[name] += 1
        for mutation in mutations:
            tried[mutation.kind] += 1
            if outcome.changed:
                changed_runs[mutation.kind] += 1
        unreadable_runs += all(m.unreadable() for m in mutations)
        if outcome.crash:
            crashes += 1
            violations.append(f"{name} {[m.describe() for m in mutations]}: crash {outcome.crash}")
        violations += [f"{name} {[m.describe() for m in mutations]}: {problem}" for problem in outcome.problems]
        if outcome.seconds > harness.RUN_TIMEOUT_S + 0.5:
            violations.append(f"{name} {[m.describe() for m in mutations]}: took {outcome.seconds:.2f} s against a {harness.RUN_TIMEOUT_S} s deadline")
        known_gaps += [f"{name} {[m.describe() for m in mutations]}: {problem}" for problem in outcome.known_gaps]
        if outcome.report is not None:
            timeouts += sum(1 for probe in outcome.report.probes if probe.status == "timeout")
        if outcome.seconds > slowest[0]:
            slowest = (outcome.seconds, f"{name}: {', '.join(m.describe() for m in mutations)}")
    return {
        "runs": count,
        "roots": len(names),
        "targets": sum(len(t) for t in bench.targets.values()),
        "tried": dict(sorted(tried.items())),
        "changed": dict(sorted(changed_runs.items())),
        "unreadable_runs": unreadable_runs,
        "crashes": crashes,
        "violations": violations,
        "known_gaps": known_gaps,
        "probe_timeouts": timeouts,
        "slowest_s": round(slowest[0], 3),
        "slowest": slowest[1],
        "deadline_s": harness.RUN_TIMEOUT_S,
    }


# -- hung sources -----------------------------------------------------------------------------
def _hung_root(workdir: Path, name: str) -> Path:
    root = workdir / name
    shutil.copytree(harness.EXAMPLE, root, symlinks=True)
    harness.hang_nvml(root)
    (root / ".preflight" / "dns.json").unlink()
    hosts = (root / "etc/hosts").read_text().replace("gpu017", "elsewhere")
    (root / "etc/hosts").write_text(hosts)
    return root


def bench_hangs(workdir: Path, runs: int, deadline: float) -> dict[str, Any]:
    from preflight.discovery import build_registry

    registry = build_registry(plugins=False)
    options = RunOptions(profile="full", timeout_s=deadline, probe_timeout_s=deadline)
    server = harness.SilentDnsServer("127.0.0.80")
    hung = harness.HungSources(_hung_root(workdir, "hung"), server)
    threads = {"before": threading.active_count()}
    fds = {"before": harness.open_fds()}
    slowest = 0.0
    stuck_sources: collections.Counter[str] = collections.Counter()
    unknown_timed_out = 0
    for number in range(runs):
        begin = time.monotonic()
        report = run(registry, hung.sources(), HostConfig(), options, "gpu017")
        slowest = max(slowest, time.monotonic() - begin)
        timed_out = {p.name for p in report.probes if p.status == "timeout"}
        for source, probes in {"nvml": {"gpus"}, "netlink": {"interfaces"}, "dns": {"hostname"}, "sysfs": {"sockets"}}.items():
            stuck_sources[source] += bool(probes & timed_out)
        unknown_timed_out += sum(1 for f in report.findings if f.status.value == "unknown" and "timed out" in f.reason)
        if number == 0:
            threads["after 1 run"] = threading.active_count()
            fds["after 1 run"] = harness.open_fds()
    threads[f"after {runs} runs"] = threading.active_count()
    fds[f"after {runs} runs"] = harness.open_fds()
    hung.release()
    time.sleep(1.0)
    threads["after releasing netlink and sysfs"] = threading.active_count()

    # The engine before it remembered stuck probes: every run started them all again.
    unbounded = harness.HungSources(_hung_root(workdir, "hung-unbounded"), server)
    start = threading.active_count()
    for _ in range(20):
        with engine._ABANDONED_LOCK:
            engine._ABANDONED.clear()
        run(registry, unbounded.sources(), HostConfig(), options, "gpu017")
    growth = (threading.active_count() - start) / 20
    unbounded.release()
    server.close()
    return {
        "runs": runs,
        "deadline_s": deadline,
        "slowest_s": round(slowest, 3),
        "stuck_sources": dict(stuck_sources),
        "unknown_timed_out": unknown_timed_out,
        "threads": threads,
        "fds": fds,
        "old_growth_per_run": round(growth, 1),
    }


def bench_process_loop(workdir: Path, runs: int, deadline: float) -> dict[str, Any]:
    root = workdir / "hung-cli"
    shutil.copytree(harness.EXAMPLE, root, symlinks=True)
    harness.hang_nvml(root)
    codes: collections.Counter[int] = collections.Counter()
    walls, durations, tracebacks = [], [], 0
    for _ in range(runs):
        begin = time.monotonic()
        result = subprocess.run(
            [PREFLIGHT, "node", "--root", str(root), "--format", "json", "--timeout", str(deadline)],
            capture_output=True, text=True, timeout=60, cwd="/",
        )
        walls.append(time.monotonic() - begin)
        codes[result.returncode] += 1
        tracebacks += "Traceback" in result.stderr
        durations.append(json.loads(result.stdout)["duration_s"])
    leftovers = [pid for pid in os.listdir("/proc") if pid.isdigit() and _cmdline_has(pid, str(root))]
    return {
        "runs": runs,
        "deadline_s": deadline,
        "max_duration_s": round(max(durations), 3),
        "max_wall_s": round(max(walls), 3),
        "median_wall_s": round(sorted(walls)[len(walls) // 2], 3),
        "exit_codes": dict(codes),
        "tracebacks": tracebacks,
        "leftover_processes": len(leftovers),
    }


def _cmdline_has(pid: str, marker: str) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return marker.encode() in handle.read()
    except OSError:
        return False


# -- unprivileged -----------------------------------------------------------------------------
def bench_unprivileged() -> dict[str, Any]:
    import test_reliability_unprivileged as unprivileged

    if unprivileged.BIN is None:
        return {"skipped": unprivileged._WHY_NOT}
    figures: dict[str, Any] = {}
    base = Path(tempfile.mkdtemp(prefix="preflight-unprivileged-"))
    try:
        base.chmod(0o755)
        root = base / "node"
        shutil.copytree(harness.EXAMPLE, root, symlinks=True)
        for private in ("proc/2187", "etc/slurm/slurm.conf", "etc/nccl.conf", ".preflight/nvml.json"):
            (root / private).chmod(0o700 if (root / private).is_dir() else 0o600)
        Path(os.path.realpath(root / "sys/class/infiniband/mlx5_0")).chmod(0o700)
        for label, args in (("recorded root, parts 0700/0600", ["--root", str(root)]), ("live node", [])):
            files_before = unprivileged.nobody_files()
            tree_before = unprivileged.tree_state(root)
            as_nobody = unprivileged.run_as_nobody("node", *args, "--format", "json")
            as_root = unprivileged.run_as_root("node", *args, "--format", "json")
            nobody_doc, root_doc = json.loads(as_nobody.stdout), json.loads(as_root.stdout)
            changed = {
                ref for ref, found in unprivileged.verdicts_of(nobody_doc).items()
                if found != unprivileged.verdicts_of(root_doc).get(ref)
            }
            figures[label] = {
                "exit_code": as_nobody.returncode,
                "tracebacks": int("Traceback" in as_nobody.stderr),
                "references": len({f["id"] for f in nobody_doc["findings"]}),
                "changed_vs_root": len(changed),
                "changed_but_not_unknown": len([
                    ref for ref in changed
                    if not any(f["id"] == ref and f["status"] == "unknown" for f in nobody_doc["findings"])
                ]),
                "unknown_needs_root": sum(
                    1 for f in nobody_doc["findings"]
                    if f["status"] == "unknown" and any(w in f["reason"].lower() for w in unprivileged.PERMISSION_WORDS)
                ),
                "files_written": len(unprivileged.nobody_files() - files_before)
                + int(unprivileged.tree_state(root) != tree_before),
            }
    finally:
        shutil.rmtree(base)
    return figures


# -- untrusted inputs -------------------------------------------------------------------------
def bench_inputs(workdir: Path, megabytes: int) -> dict[str, Any]:
    from preflight.catalogue import load_all
    from preflight.signatures import required_literals

    inputs = workdir / "inputs"
    inputs.mkdir()
    cases: dict[str, Path] = {}
    cases["binary (1 MiB of every byte value)"] = inputs / "core"
    cases["binary (1 MiB of every byte value)"].write_bytes(bytes(range(256)) * 4096)
    cases["10 GiB sparse file"] = inputs / "sparse.log"
    harness.sparse_file(cases["10 GiB sparse file"], 10 << 30)
    log = inputs / "ranks.log"
    harness.repetitive_log(log, megabytes << 20)
    cases[f"{megabytes} MiB log, catalogue examples among NCCL chatter"] = log
    bomb = inputs / "ranks.log.gz"
    line = b"gpu017:2187:2301 [3] NCCL INFO Channel 05/0 : 3[3] -> 4[4] via P2P/CUMEM/read\n"
    block = line * ((1 << 20) // len(line))
    with gzip.open(bomb, "wb", compresslevel=9) as target:
        for _ in range(5 * megabytes):
            target.write(block)
        target.write(b"NCCL WARN NET/IB : Got completion from peer 10.0.0.2<52318> with status=12 opcode=0 len=0 vendor err 129 (Recv)\n")
    cases[f"gzip bomb ({bomb.stat().st_size / 1e6:.1f} MB inflating to {5 * megabytes} MiB of one line)"] = bomb
    endless = inputs / "endless.log"
    with open(endless, "wb") as handle:
        block = b"x" * (1 << 20)
        for _ in range(megabytes):
            handle.write(block)
    cases[f"{megabytes} MiB without a newline"] = endless
    typography = inputs / "rendered.log"
    with open(typography, "wb") as handle:  # every character one that undo_posting replaces
        block = ("\u00a0\u2019&lt;\u200b" * (1 << 16)).encode()
        for _ in range((megabytes << 20) // len(block)):
            handle.write(block)
    cases[f"{typography.stat().st_size >> 20} MiB of one line of no-break spaces, curly quotes and entities"] = typography
    adversarial = inputs / "adversarial.log"
    literals = [lit for r in load_all() for s in r.signatures for lit in required_literals(s["pattern"])]
    with open(adversarial, "w") as handle:
        for literal in literals:  # test_explain_cli's construction, 5x longer lines
            handle.write((literal + " ") * 10000 + "\n")
            handle.write(literal * 15000 + "\n")
    cases[f"adversarial lines ({len(literals)} signature literals repeated)"] = adversarial
    rows = {}
    for label, path in cases.items():
        result = harness.measure([PREFLIGHT, "explain", "--format", "json", str(path)], timeout=900)
        report = json.loads(result.stdout)
        size = path.stat().st_size
        rows[label] = {
            "exit_code": result.returncode,
            "tracebacks": int("Traceback" in result.stderr),
            "seconds": round(result.seconds, 2),
            "max_rss_mb": round(result.max_rss_mb, 1),
            "input_mb": round(size / 1e6, 1),
            "candidates": len(report["candidates"]),
            "problems": [problem.replace(str(inputs) + "/", "") for problem in report["inputs"]["problems"][:1]],
        }
    return rows


def bench_config() -> dict[str, Any]:
    import test_reliability_inputs as inputs

    from preflight.config import ConfigError, parse_config

    cases = inputs._config_cases()
    rejected = accepted = escaped = 0
    for text, _, _ in cases:
        try:
            parse_config(text, "/etc/preflight/preflight.toml", "gpu017")
            accepted += 1
        except ConfigError:
            rejected += 1
        except Exception:
            escaped += 1
    return {"cases": len(cases), "rejected": rejected, "accepted (valid for that key)": accepted, "escaped": escaped}


def bench_safety() -> dict[str, Any]:
    import test_reliability_safety as safety

    files = safety.package_files()
    problems = [p for path in files for p in safety.scan(path.read_text(), path)]
    return {"files": len(files), "problems": len(problems)}


# -- the document -----------------------------------------------------------------------------
def table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def render(figures: dict[str, Any], args: argparse.Namespace) -> str:
    m, h, p, u, i, c, s = (figures[k] for k in ("mutations", "hangs", "processes", "unprivileged", "inputs", "config", "safety"))
    crashes = m["crashes"] + sum(r["tracebacks"] for r in i.values()) + p["tracebacks"] + c["escaped"]
    crashes += sum(r.get("tracebacks", 0) for r in u.values() if isinstance(r, dict))
    out = [
        "# Reliability figures",
        "",
        f"Generated by `bench/reliability.py --mutations {args.mutations} --seed {args.seed} --input-mb {args.input_mb}` "
        f"(Python {platform.python_version()}, {os.cpu_count()} CPUs). Counts depend only on the seed; "
        "times and memory on the machine. The same checks run, smaller, in `tests/reliability/test_reliability_*.py`.",
        "",
        "## Summary",
        "",
        table(["figure", "value"], [
            ["capture units deleted (roots x units), property violations",
             f"{figures['capture_units']['tried']} over {figures['capture_units']['roots']} roots, {len(figures['capture_units']['violations'])}"],
            ["mutated-root runs", m["runs"]],
            ["mutations tried", sum(m["tried"].values())],
            ["oracle violations (silent absent, lost findings, unknown without reason)", len(m["violations"])],
            ["hung-source runs survived (in process + CLI processes)", h["runs"] + p["runs"]],
            ["crashes (exceptions, tracebacks, config errors escaping)", crashes],
            ["slowest mutated run / deadline", f"{m['slowest_s']} s / {m['deadline_s']} s"],
            ["slowest hung run / deadline (target: deadline + 0.5 s)", f"{h['slowest_s']} s / {h['deadline_s']} s"],
            ["unsafe subprocess uses in the package", s["problems"]],
        ]),
        "",
        "## Capture units deleted",
        "",
        f"Every capture unit (`preflight/sources/capture.py`) of {figures['capture_units']['roots']} roots "
        f"({figures['capture_units']['recorded']} recorded roots and {figures['capture_units']['real']} real captures of "
        f"`tests/data/real-roots`) moved out of the root in turn, {figures['capture_units']['tried']} runs: no finding may "
        "become `present`, no `unknown` may become `absent` or `not_applicable`, no reference with a present or unknown "
        f"finding may end with only healthy ones. Violations: {len(figures['capture_units']['violations'])}; "
        f"slowest run {figures['capture_units']['slowest_s']} s.",
        "",
        *(f"- {v}" for v in figures["capture_units"]["violations"][:20]),
        "",
        "## Mutated recorded roots",
        "",
        f"{m['runs']} runs over {m['roots']} recorded roots ({m['targets']} files the probes read), one to three "
        "mutations each plus a broken `.preflight` recording in every fourth run, every full-profile check run "
        "in-process through the engine. A run is judged against the "
        "unmutated root: no exception, nothing caught by the engine's safety net, every `unknown` with a reason, and, "
        "where every mutation made evidence unreadable, no reference turned healthier (a `present` finding vanishing "
        "without an `unknown`, or a checked reference becoming only `absent`/`not_applicable`). "
        f"{m['unreadable_runs']} runs had only unreadable-evidence mutations.",
        "",
        table(["kind", "applied", "in runs that changed a verdict"], [[k, v, m["changed"].get(k, 0)] for k, v in m["tried"].items()]),
        "",
        f"Crashes: {m['crashes']}. Oracle violations: {len(m['violations'])}. Probe timeouts: {m['probe_timeouts']}. "
        f"Slowest run: {m['slowest_s']} s ({m['slowest']}).",
        "",
        *(f"- {v}" for v in m["violations"][:20]),
        "",
        f"Known gaps, not counted as violations (`KNOWN_GAP_REFERENCES` in `tests/reliability_harness.py`): "
        f"{len(m['known_gaps'])} findings in which a reference that decides \"no GPU / no NVSwitch here\" from PCI "
        "`vendor`/`class` files turned `not_applicable` (or lost a finding) when such a file became unreadable"
        + ("; the first few:" if m["known_gaps"] else "."),
        "",
        *(f"- {v}" for v in m["known_gaps"][:8]),
        "",
        "## Hung sources",
        "",
        f"{h['runs']} runs in one process with NVML (`{{\"hang\": true}}` in the replay), netlink (a stub whose dumps "
        "never return), DNS (a loopback server that reads queries and never answers) and a sysfs read (`/proc/net/tcp`) "
        f"all blocked, deadline {h['deadline_s']} s. Slowest run: {h['slowest_s']} s. Runs in which each source was "
        f"stuck and reported `timed out`: {', '.join(f'{k} {v}' for k, v in h['stuck_sources'].items())}; "
        f"unknown findings saying `timed out`: {h['unknown_timed_out']}.",
        "",
        table(["", "threads", "open fds"], [[k, v, h["fds"].get(k, "")] for k, v in h["threads"].items()]),
        "",
        f"Before the engine remembered stuck probes, every run started them again: "
        f"{h['old_growth_per_run']} more threads per run, without bound.",
        "",
        f"A loop of {p['runs']} `preflight node` processes on a root whose NVML hangs, `--timeout {p['deadline_s']}`: "
        f"report duration at most {p['max_duration_s']} s, wall time at most {p['max_wall_s']} s "
        f"(median {p['median_wall_s']} s, interpreter start-up included), exit codes {p['exit_codes']}, "
        f"tracebacks {p['tracebacks']}, processes left behind {p['leftover_processes']}.",
        "",
        "## Unprivileged",
        "",
    ]
    if "skipped" in u:
        out += [f"Skipped: {u['skipped']}", ""]
    else:
        out += [
            "`runuser -u nobody -- preflight node`, compared with the same run as root. Files written: what `nobody` "
            "owns in /tmp, /var/tmp and /dev/shm before and after, and the root's listing and mtimes.",
            "",
            table(
                ["tree", "exit code", "tracebacks", "references", "changed vs root", "changed but not unknown", "unknown: needs root", "files written"],
                [[k, r["exit_code"], r["tracebacks"], r["references"], r["changed_vs_root"], r["changed_but_not_unknown"], r["unknown_needs_root"], r["files_written"]] for k, r in u.items()],
            ),
            "",
        ]
    out += [
        "## Untrusted inputs",
        "",
        "`preflight explain --format json` on each input, peak RSS from `getrusage(RUSAGE_CHILDREN)` of a wrapper "
        "whose only child is the command.",
        "",
        table(
            ["input", "MB", "exit code", "seconds", "peak RSS MB", "candidates", "tracebacks", "first problem"],
            [[k, r["input_mb"], r["exit_code"], r["seconds"], r["max_rss_mb"], r["candidates"], r["tracebacks"], "; ".join(r["problems"])] for k, r in i.items()],
        ),
        "",
        f"Config files: {c['cases']} cases (every key of every section, also inside `[[hosts]]`, with strings, booleans, "
        f"arrays, tables, negative numbers, zero, nan, inf and overflowing numbers): {c['rejected']} rejected with the "
        f"file, line and key, {c['accepted (valid for that key)']} valid for their key, {c['escaped']} other exceptions.",
        "",
        "## Safety",
        "",
        f"The ast scan of {s['files']} package files (`preflight/`, `checks/`) for `shell=True`, subprocess calls "
        f"without `timeout=` or with a command string, and `os.system`/`os.popen`/`exec*`: {s['problems']} found.",
        "",
    ]
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mutations", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=20240601)
    parser.add_argument("--hung-runs", type=int, default=100)
    parser.add_argument("--process-runs", type=int, default=20)
    parser.add_argument("--input-mb", type=int, default=200, help="size of the generated logs for explain")
    parser.add_argument("--output", default=str(DOC))
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="preflight-reliability-"))
    figures: dict[str, Any] = {}
    try:
        steps = [
            ("capture_units", lambda: bench_capture_units(workdir)),
            ("mutations", lambda: bench_mutations(workdir, args.mutations, args.seed)),
            ("hangs", lambda: bench_hangs(workdir, args.hung_runs, 1.0)),
            ("processes", lambda: bench_process_loop(workdir, args.process_runs, 1.0)),
            ("unprivileged", bench_unprivileged),
            ("inputs", lambda: bench_inputs(workdir, args.input_mb)),
            ("config", bench_config),
            ("safety", bench_safety),
        ]
        for name, step in steps:
            begin = time.monotonic()
            figures[name] = step()
            print(f"{name}: {time.monotonic() - begin:.1f} s", json.dumps(figures[name], default=str)[:400], flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(render(figures, args))
    print(f"wrote {args.output}")
    # Stuck probe threads of the hung-source runs must not hold the interpreter's exit.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
