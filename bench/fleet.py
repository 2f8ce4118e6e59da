"""Benchmark: ``preflight fleet`` over generated node reports.

Each report is the example node's golden report (``tests/golden/hgx-h100.json``, a full-profile
report of an 8-GPU, 8-HCA node, about 40 KB) under its own host name; every 500th node has its
RDMA MTU changed and every 700th its driver, so the audit has odd ones out to find. The
benchmark prints the wall time and peak RSS of ``preflight fleet DIR --format json`` (target:
10,000 reports in <= 3 s).

Run with the interpreter of the venv preflight is installed in:

    .venv/bin/python bench/fleet.py [--nodes 10000]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def generate(directory: str, nodes: int) -> None:
    with open(os.path.join(REPO, "tests", "golden", "hgx-h100.json"), encoding="utf-8") as handle:
        golden = json.load(handle)
    golden.update(root="/", started_at=0.0, duration_s=1.0)
    plain = json.dumps(golden, indent=2)
    for number in range(nodes):
        host = f"gpu{number:05d}"
        if number % 500 == 7 or number % 700 == 9:
            document = copy.deepcopy(golden)
            if number % 500 == 7:
                document["facts"]["interfaces"]["links"][4]["mtu"] = 2044
            else:
                document["facts"]["gpus"]["driver_version"] = "535.104.05"
            text = json.dumps(document, indent=2)
        else:
            text = plain
        with open(os.path.join(directory, f"{host}.json"), "w", encoding="utf-8") as handle:
            handle.write(text.replace('"host": "gpu017"', f'"host": "{host}"', 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=10_000)
    args = parser.parse_args()
    preflight = os.path.join(os.path.dirname(sys.executable), "preflight")
    work = tempfile.mkdtemp(prefix="preflight-fleet-bench-")
    try:
        reports = os.path.join(work, "reports")
        os.mkdir(reports)
        generate(reports, args.nodes)
        size = sum(entry.stat().st_size for entry in os.scandir(reports))
        output = os.path.join(work, "fleet.json")
        started = time.perf_counter()
        result = subprocess.run([preflight, "fleet", reports, "--format", "json", "--output", output],
                                capture_output=True, text=True, timeout=600)
        elapsed = time.perf_counter() - started
        peak_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
        with open(output, encoding="utf-8") as handle:
            summary = json.load(handle)["summary"]
        print(f"{args.nodes} reports, {size / 1e6:.0f} MB: preflight fleet {elapsed:.2f} s "
              f"(exit {result.returncode}), peak RSS {peak_mb:.0f} MB (largest process), "
              f"{len(summary['odd_nodes'])} odd nodes, {summary['skipped']} skipped")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
