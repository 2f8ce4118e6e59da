"""Benchmark: two builds of preflight side by side, in one run (a renovation's before and after).

Each build is a directory that ``pip install --no-deps --target DIR <checkout>`` filled; both run
with the interpreter of the venv this script runs in (so the same dependencies). Commands are
interleaved round by round, and CPU time (user + system of the whole process tree) is the
figure: a busy machine slows both builds alike and CPU time is the least disturbed by it. Rows:
a bare interpreter, ``node --profile prolog`` and ``node`` (full) on the example root, ``explain``
on a generated multi-rank log (bench/explain.py's generator), ``fleet`` over copies of the
example report, and ``snapshot`` of the example root.

    .venv/bin/python bench/builds.py OLD_DIR NEW_DIR [--runs 11] [--log-lines 200000] [--nodes 2000]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "nodes" / "hgx-h100"
sys.path.insert(0, str(REPO / "bench"))

from explain import generate as generate_log  # noqa: E402 - bench/ is not a package


def cpu_seconds(command: list[str], env: dict[str, str], cwd: str) -> float:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(command, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old")
    parser.add_argument("new")
    parser.add_argument("--runs", type=int, default=11)
    parser.add_argument("--log-lines", type=int, default=200_000)
    parser.add_argument("--nodes", type=int, default=2_000)
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="preflight-builds-")
    log = os.path.join(work, "job.log")
    generate_log(log, args.log_lines)
    report = subprocess.run(
        [sys.executable, "-m", "preflight", "node", "--root", str(EXAMPLE), "--format", "json"],
        env={**os.environ, "PYTHONPATH": os.path.abspath(args.new)}, cwd=work, capture_output=True, text=True, check=False,
    ).stdout
    document = json.loads(report)
    reports = os.path.join(work, "reports")
    os.mkdir(reports)
    for number in range(args.nodes):
        document["host"] = f"gpu{number:05d}"
        with open(os.path.join(reports, f"gpu{number:05d}.json"), "w", encoding="utf-8") as handle:
            json.dump(document, handle)
    py = [sys.executable]
    rows = {
        "bare interpreter": py + ["-c", "pass"],
        "node --profile prolog": py + ["-m", "preflight", "node", "--profile", "prolog", "--root", str(EXAMPLE), "--format", "json"],
        "node (full)": py + ["-m", "preflight", "node", "--root", str(EXAMPLE), "--format", "json"],
        f"explain ({args.log_lines:,} lines)": py + ["-m", "preflight", "explain", log, "--format", "json"],
        f"fleet ({args.nodes:,} reports)": py + ["-m", "preflight", "fleet", reports, "--format", "json"],
        "snapshot": py + ["-m", "preflight", "snapshot", os.path.join(work, "node.tar.gz"), "--root", str(EXAMPLE)],
    }
    builds = {"old": os.path.abspath(args.old), "new": os.path.abspath(args.new)}
    times: dict[tuple[str, str], list[float]] = {(row, build): [] for row in rows for build in builds}
    for _ in range(args.runs):
        for row, command in rows.items():
            for build, path in builds.items():
                env = {**os.environ, "PYTHONPATH": path}
                times[(row, build)].append(cpu_seconds(command, env, work))
    median = {key: statistics.median(values) for key, values in times.items()}
    bare = {build: median[("bare interpreter", build)] for build in builds}
    print(f"{'row':32} {'old ms':>8} {'new ms':>8} {'old x':>7} {'new x':>7} {'new/old':>8}")
    for row in rows:
        old, new = median[(row, "old")], median[(row, "new")]
        print(f"{row:32} {old * 1000:8.1f} {new * 1000:8.1f} {old / bare['old']:7.1f} {new / bare['new']:7.1f} {new / old:8.3f}")
    print(f"(CPU time medians of {args.runs} interleaved rounds; x = times a bare interpreter)")


if __name__ == "__main__":
    main()
