"""Benchmark: ``preflight snapshot`` of the 8-GPU example node: archive size and time.

Targets: <= 1 MB and <= 1 s. Reports medians and ratios in one run, so the figures do not depend
on the machine's speed: the whole command against ``preflight node`` (full profile) on the same
root and against a bare interpreter, and the recording itself (engine run through the recording
sources, scrubbing, compression, writing) measured in-process. Run with the interpreter of the
venv preflight is installed in:

    .venv/bin/python bench/snapshot.py [--runs 11]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "nodes" / "hgx-h100"


def median_seconds(command: list[str], runs: int) -> float:
    samples = []
    for _ in range(runs):
        begin = time.perf_counter()
        subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False, timeout=120)
        samples.append(time.perf_counter() - begin)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=11)
    args = parser.parse_args()
    from preflight.snapshot import SnapshotArgs, take_snapshot

    preflight = str(Path(sys.executable).parent / "preflight")
    with tempfile.TemporaryDirectory() as workspace:
        out = str(Path(workspace) / "gpu017.tar.gz")
        bare = median_seconds([sys.executable, "-c", "pass"], args.runs)
        node = median_seconds([preflight, "node", "--root", str(EXAMPLE), "--format", "json"], args.runs)
        print(f"python -c pass: {bare * 1000:.1f} ms; preflight node (full, json): {node * 1000:.1f} ms (medians of {args.runs})")
        for label, scrub in (("plain", ()), ("--scrub all", ("all",))):
            command = [preflight, "snapshot", out, "--root", str(EXAMPLE), *(["--scrub", "all", "--scrub-key", "bench"] if scrub else [])]
            whole = median_seconds(command, args.runs)
            take_snapshot(SnapshotArgs(output=out, root=str(EXAMPLE), scrub=scrub, scrub_key="bench"))  # warm imports
            inner = [take_snapshot(SnapshotArgs(output=out, root=str(EXAMPLE), scrub=scrub, scrub_key="bench")) for _ in range(args.runs)]
            recording = statistics.median(result.seconds for result in inner)
            size = inner[-1].size
            print(
                f"snapshot {label}: {size} bytes = {size / 1_000_000:.3f} MB of 1 MB, {inner[-1].members} entries; "
                f"recording {recording * 1000:.0f} ms = {recording:.2f} of 1 s; whole command {whole * 1000:.0f} ms = "
                f"{whole / node:.1f}x preflight node, {whole / bare:.1f}x python -c pass"
            )


if __name__ == "__main__":
    main()
