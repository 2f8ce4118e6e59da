"""Benchmark: the prolog's cost against a bare interpreter, before and after, in one run.

Rows (issue 16's table): ``node --profile prolog`` on the example root (JSON and table),
``slurm prolog`` as slurmd starts it for a job with two GPUs (on the clean and on the planted
example, whose drain call goes to a stand-in scontrol that exits at once), the live prolog and
the live full run on this machine, and LBNL NHC running 11 shallow checks as an anchor when a
checkout of it is given. Each row shows median wall time, its ratio to ``python -c pass`` of the
same interpreter, median CPU time (user + system of the whole process tree: ``wait4`` counts the
probes' child process, which the run reaps) and the largest resident set of any of its processes.

``--before DIR`` adds the same rows for another build, a directory that
``pip install --no-deps --target DIR <checkout>`` filled: both builds run with this interpreter
(so the same dependencies), as ``python -m preflight``, interleaved round by round, so that a busy
machine slows them alike and the ratios stay comparable. Install the test extra (the clean root
comes from the tests' ``make_clean``). Run with the interpreter of the venv preflight is in:

    .venv/bin/python bench/prolog.py [--runs 21] [--before DIR] [--nhc NHC_CHECKOUT]

An NHC checkout is a directory holding its ``nhc`` script and ``scripts/`` (e.g.
``git -C mirror/mej+nhc archive HEAD | tar -x -C DIR``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "nodes" / "hgx-h100"

#: NHC's shallow checks that a plain VM passes or fails in a few milliseconds each
NHC_CHECKS = """\
* || check_fs_mount_rw -f /
* || check_fs_free / 1%
* || check_fs_inodes / 1k
* || check_hw_cpuinfo
* || check_hw_physmem 1kB 1TB
* || check_hw_swap 0kB 1TB
* || check_hw_mem 1kB 2TB
* || check_hw_physmem_free 1kB
* || check_hw_mem_free 1kB
* || check_ps_loadavg 10000
* || check_file_test -r /etc/hostname
"""


class Case:
    """One command line and the environment it runs with (None: this process's)."""

    def __init__(self, command: list[str], env: dict[str, str] | None = None, cwd: str | None = None) -> None:
        self.command, self.env, self.cwd = command, env, cwd


#: Starts one command and reports its wall time, CPU time and peak memory. The bench itself is a
#: large process, and a child's peak RSS counts the memory of the process it was forked from until
#: it execs; started from this small launcher instead, every figure is the command's own.
LAUNCHER = """
import os, sys, time
null = os.open(os.devnull, os.O_RDWR)
actions = [(os.POSIX_SPAWN_DUP2, null, 1), (os.POSIX_SPAWN_DUP2, null, 2)]
begin = time.perf_counter()
pid = os.posix_spawn(sys.argv[1], sys.argv[1:], os.environ, file_actions=actions)
_, status, usage = os.wait4(pid, 0)
print(time.perf_counter() - begin, usage.ru_utime + usage.ru_stime, usage.ru_maxrss)
"""


class Sample:
    def __init__(self) -> None:
        self.walls: list[float] = []
        self.cpus: list[float] = []
        self.rss_kib: list[int] = []

    def add(self, case: Case) -> None:
        command = [shutil.which(case.command[0]) or case.command[0], *case.command[1:]]
        result = subprocess.run([sys.executable, "-S", "-c", LAUNCHER, *command], env=case.env, cwd=case.cwd,
                                capture_output=True, text=True, check=True)
        wall, cpu, rss = result.stdout.split()
        self.walls.append(float(wall))
        self.cpus.append(float(cpu))
        self.rss_kib.append(int(rss))

    def row(self, name: str, bare: Sample | None) -> str:
        wall, cpu = statistics.median(self.walls), statistics.median(self.cpus)
        text = f"| {name} | {wall * 1000:.0f} ms"
        if bare is not None:
            text += f" = {wall / statistics.median(bare.walls):.1f}x"
        text += f" | {cpu * 1000:.0f} ms"
        if bare is not None:
            text += f" = {cpu / statistics.median(bare.cpus):.1f}x"
        return text + f" | {max(self.rss_kib) / 1024:.0f} MiB |"


def build_cases(prefix: list[str], env: dict[str, str] | None, work: Path, config: Path, clean: Path) -> dict[str, Case]:
    """The rows for one build: ``prefix`` starts preflight (``python -m preflight``)."""
    job = {**(env or {}), "SLURM_JOB_ID": "4242", "SLURM_JOB_GPUS": "0,1", "SLURMD_NODENAME": "gpu017", "SLURM_SCRIPT_CONTEXT": "prolog_slurmd"}
    job.pop("PATH", None)  # slurmd starts the prolog without one
    slurm = [*prefix, "slurm", "prolog", "--config", str(config), "--root"]
    cwd = str(work)  # never the checkout: `python -m preflight` there would import it instead of the build
    return {
        "node --profile prolog, example root, json": Case([*prefix, "node", "--profile", "prolog", "--root", str(EXAMPLE), "--format", "json"], env, cwd),
        "node --profile prolog, example root, table": Case([*prefix, "node", "--profile", "prolog", "--root", str(EXAMPLE)], env, cwd),
        "slurm prolog, job with 2 GPUs, clean root": Case([*slurm, str(clean)], job, cwd),
        "slurm prolog, job with 2 GPUs, planted root (drains)": Case([*slurm, str(EXAMPLE)], job, cwd),
        "live prolog (this machine), json": Case([*prefix, "node", "--profile", "prolog", "--format", "json"], env, cwd),
        "live full (this machine), json": Case([*prefix, "node", "--format", "json"], env, cwd),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=21)
    parser.add_argument("--before", help="a build directory (pip install --no-deps --target DIR CHECKOUT) to compare with")
    parser.add_argument("--nhc", help="an LBNL NHC checkout (its nhc script and scripts/), timed as an anchor")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)
        config = slurm_site(work)
        clean = clean_example(work)
        builds: dict[str, dict[str, Case]] = {"now": build_cases([sys.executable, "-m", "preflight"], None, work, config, clean)}
        if args.before:
            before_env = {**os.environ, "PYTHONPATH": os.path.abspath(args.before)}
            builds = {"before": build_cases([sys.executable, "-m", "preflight"], before_env, work, config, clean), **builds}
        extra: dict[str, Case] = {}
        if args.nhc:
            extra["LBNL NHC, 11 shallow checks (anchor)"] = nhc_case(Path(args.nhc), work)
        bare_case = Case([sys.executable, "-c", "pass"])
        bare = Sample()
        samples = {(build, name): Sample() for build, cases in builds.items() for name in cases}
        extra_samples = {name: Sample() for name in extra}
        for _ in range(args.runs):
            bare.add(bare_case)
            for (build, name), sample in samples.items():
                sample.add(builds[build][name])
            for name, sample in extra_samples.items():
                sample.add(extra[name])
    print(f"{args.runs} rounds, interleaved; ratios against python -c pass ({statistics.median(bare.walls) * 1000:.1f} ms wall, "
          f"{statistics.median(bare.cpus) * 1000:.1f} ms CPU, {max(bare.rss_kib) / 1024:.0f} MiB)\n")
    print("| run | " + " | ".join(f"{build}: wall | {build}: CPU | {build}: max RSS" for build in builds) + " |")
    print("|---|" + "---|---|---|" * len(builds))
    names = list(next(iter(builds.values())))
    for name in names:
        cells = [samples[(build, name)].row("", bare)[4:-2] for build in builds]
        print(f"| {name} | " + " | ".join(cells) + " |")
    for name, sample in extra_samples.items():
        print(sample.row(name, bare))


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


def nhc_case(checkout: Path, work: Path) -> Case:
    """NHC as a Slurm HealthCheckProgram runs it, in the foreground, on a config of shallow checks."""
    conf = work / "nhc.conf"
    conf.write_text(NHC_CHECKS)
    command = ["bash", str(checkout / "nhc"), "-c", str(conf), "-D", str(checkout), "-l", str(work / "nhc.log"), "-t", "30", "-q"]
    # MARK_OFFLINE=0: a failed check must not drain this machine through a real scontrol.
    return Case(command, {**os.environ, "NHC_RM": "slurm", "MARK_OFFLINE": "0"}, str(work))


if __name__ == "__main__":
    main()
