"""Benchmark: ``preflight node --profile prolog --root <example node>`` against a bare interpreter.

Reports medians and the ratio in one run, so the figure does not depend on the machine's speed
(target: <= 10x ``python -c pass``). Run with the interpreter of the venv preflight is installed in:

    .venv/bin/python bench/prolog.py [--runs 21]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "nodes" / "hgx-h100"


def median_seconds(command: list[str], runs: int) -> float:
    samples = []
    for _ in range(runs):
        begin = time.perf_counter()
        subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
        samples.append(time.perf_counter() - begin)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=21)
    args = parser.parse_args()
    preflight = str(Path(sys.executable).parent / "preflight")
    bare = median_seconds([sys.executable, "-c", "pass"], args.runs)
    cases = {
        "prolog, table": [preflight, "node", "--profile", "prolog", "--root", str(EXAMPLE)],
        "prolog, json": [preflight, "node", "--profile", "prolog", "--root", str(EXAMPLE), "--format", "json"],
        "full, table": [preflight, "node", "--root", str(EXAMPLE)],
    }
    print(f"python -c pass: {bare * 1000:.1f} ms (median of {args.runs})")
    for name, command in cases.items():
        seconds = median_seconds(command, args.runs)
        print(f"preflight node {name}: {seconds * 1000:.1f} ms = {seconds / bare:.1f}x python -c pass")


if __name__ == "__main__":
    main()
