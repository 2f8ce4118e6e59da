"""Benchmark: ``preflight node --profile prolog`` and ``preflight slurm prolog`` on the example node
against a bare interpreter.

Reports medians and the ratio in one run, so the figure does not depend on the machine's speed
(target: <= 10x ``python -c pass``). ``slurm prolog`` runs as Slurm would start it for a job with
two GPUs, on the clean and on the planted example (whose drain call goes to a stand-in scontrol
that exits at once, so the figure is preflight's own cost), with the last-result file and syslog
going to a temporary directory (the clean root comes from the tests' ``make_clean``, so install
the test extra). Run with the interpreter of the venv preflight is installed in:

    .venv/bin/python bench/prolog.py [--runs 21]
"""

from __future__ import annotations

import argparse
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "nodes" / "hgx-h100"


Case = tuple[list[str], dict[str, str] | None]  # command, environment (None: inherit)


def medians(cases: dict[str, Case], runs: int) -> dict[str, tuple[float, float]]:
    """Median wall time and median CPU time (user + system) of each command. Rounds interleave
    the commands, so that a busy machine slows them all alike and the ratios stay meaningful; CPU
    time is the figure least disturbed by other load."""
    walls: dict[str, list[float]] = {name: [] for name in cases}
    cpus: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(runs):
        for name, (command, env) in cases.items():
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            begin = time.perf_counter()
            subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False, env=env)
            walls[name].append(time.perf_counter() - begin)
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpus[name].append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
    return {name: (statistics.median(walls[name]), statistics.median(cpus[name])) for name in cases}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=21)
    args = parser.parse_args()
    preflight = str(Path(sys.executable).parent / "preflight")
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)
        config = slurm_site(work)
        clean = clean_example(work)
        # The prolog's environment as slurmd sets it: no PATH, the job's SLURM_* variables.
        job = {"SLURM_JOB_ID": "4242", "SLURM_JOB_GPUS": "0,1", "SLURMD_NODENAME": "gpu017", "SLURM_SCRIPT_CONTEXT": "prolog_slurmd"}
        slurm = [preflight, "slurm", "prolog", "--config", str(config), "--root"]
        cases: dict[str, Case] = {
            "python -c pass": ([sys.executable, "-c", "pass"], None),
            "preflight node prolog, table": ([preflight, "node", "--profile", "prolog", "--root", str(EXAMPLE)], None),
            "preflight node prolog, json": ([preflight, "node", "--profile", "prolog", "--root", str(EXAMPLE), "--format", "json"], None),
            "preflight node full, table": ([preflight, "node", "--root", str(EXAMPLE)], None),
            "preflight slurm prolog, clean root": ([*slurm, str(clean)], job),
            "preflight slurm prolog, planted root (drains)": ([*slurm, str(EXAMPLE)], job),
        }
        results = medians(cases, args.runs)
    bare, bare_cpu = results.pop("python -c pass")
    print(f"python -c pass: {bare * 1000:.1f} ms, CPU {bare_cpu * 1000:.1f} ms (medians of {args.runs})")
    for name, (seconds, cpu) in results.items():
        print(
            f"{name}: {seconds * 1000:.1f} ms = {seconds / bare:.1f}x python -c pass; "
            f"CPU {cpu * 1000:.1f} ms = {cpu / bare_cpu:.1f}x"
        )


def slurm_site(work: Path) -> Path:
    scontrol = work / "scontrol"
    scontrol.write_text("#!/bin/sh\nexit 0\n")
    scontrol.chmod(0o755)
    config = work / "preflight.toml"
    config.write_text(
        f'[slurm]\nscontrol = "{scontrol}"\nlast_result = "{work}/slurm-{{mode}}.json"\nsyslog_socket = "{work}/log.socket"\n'
    )
    return config


def clean_example(work: Path) -> Path:
    """The example node with its planted problems repaired (the tests' ``make_clean``)."""
    sys.path.insert(0, str(REPO / "tests"))
    from conftest import make_clean

    root = work / "clean"
    shutil.copytree(EXAMPLE, root, symlinks=True)
    return Path(make_clean(root))


if __name__ == "__main__":
    main()
