"""Benchmark: ``preflight fleet`` over generated node reports, against the cost of merely reading
and JSON-decoding the same files.

Each report is the example node's golden report (``tests/golden/hgx-h100.json``: what
``preflight node --format json`` writes for a full-profile run on an 8-GPU, 8-HCA node, indented,
about 95 KB) made into another node: its own host name (in the facts and in DNS001's finding), run
time, slurmd PID (in MEM001's and MEM002's evidence), MAC addresses, GPU UUIDs and address, as
real reports of different nodes differ. A few nodes differ so that the audit has odd ones out to
find: every 500th has one RDMA netdev's MTU changed, every 700th another driver, every 900th one
HCA's firmware, every 1100th another MLNX_OFED; every 300th has one more present finding.

Four commands run in interleaved rounds (so that a busy machine slows them all alike), each as a
child process, and the medians of wall time and CPU time (user + system, self and children) are
printed with ratios to the baselines:

* ``cat`` of every file (reading the bytes);
* ``json.loads`` of every file in one process (the decode alone, on one core);
* ``json.loads`` of every file in as many forked processes as ``preflight fleet`` uses (the
  decode alone, on every core: the floor for any audit that decodes each report whole);
* ``preflight fleet DIR --format json --output FILE``, and the same with the other formats.

Target (issue 6): 10,000 reports in <= 3 s. Run with the interpreter of the venv preflight is
installed in:

    .venv/bin/python bench/fleet.py [--nodes 10000] [--runs 3]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The decode floor: read and json.loads every file given (argv[1] workers, then the directory).
DECODE_ONLY = r"""
import json, os, sys
workers, directory = int(sys.argv[1]), sys.argv[2]
paths = sorted(os.path.join(directory, n) for n in os.listdir(directory) if n.endswith(".json"))
def decode(part):
    for path in part:
        with open(path, "rb") as handle:
            json.loads(handle.read())
if workers <= 1:
    decode(paths)
else:
    children = []
    for number in range(workers):
        pid = os.fork()
        if pid == 0:
            decode(paths[number::workers])
            os._exit(0)
        children.append(pid)
    for pid in children:
        os.waitpid(pid, 0)
"""


def as_node(text: str, host: str, number: int) -> str:
    """The example node's report text with this node's identity: what differs between the
    reports of two nodes of one fleet besides what the audit compares."""
    low, high = number % 256, number // 256 % 256
    text = EXAMPLE_HOST.sub(host, text)
    text = EXAMPLE_SLURMD_PID.sub(str(1000 + number * 7 % 60000), text)
    text = EXAMPLE_ADDRESS.sub(lambda m: f"10.{10 + number // 65536}.{high}.{(low + int(m[1])) % 256}", text)
    text = GPU_UUID_TAIL.sub(lambda m: f"{m[1]}{number:06x}{m[2]}", text)
    return MAC.sub(lambda m: m[0] if m[0] == "00:00:00:00:00:00" else f"{m[0][:9]}{high:02x}:{low:02x}:{m[0][15:]}", text)


EXAMPLE_HOST = re.compile(r"\bgpu017\b")
EXAMPLE_SLURMD_PID = re.compile(r"(?<![\d.])2187(?![\d.])")
EXAMPLE_ADDRESS = re.compile(r"\b10\.10\.1\.(1[78])\b")
GPU_UUID_TAIL = re.compile(r"(GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-)0{6}([0-9a-f]{6})")
MAC = re.compile(r"\b[0-9a-f]{2}(?::[0-9a-f]{2}){5}\b")


def generate(directory: str, nodes: int) -> None:
    with open(os.path.join(REPO, "tests", "golden", "hgx-h100.json"), encoding="utf-8") as handle:
        golden = json.load(handle)
    extra_finding = {
        "id": "MEM001", "symbol": "memlock-too-low", "title": "memlock limit too low for RDMA", "status": "present",
        "severity": "error", "subject": "slurmd", "reason": "", "fix": "Set LimitMEMLOCK=infinity for slurmd.",
        "evidence": [{"source": "/proc/2187/limits", "observed": "8 MiB", "expected": "unlimited"}],
    }
    for number in range(nodes):
        host = f"gpu{number:05d}"
        document = copy.deepcopy(golden) if number % 100 == 7 else golden
        if number % 500 == 7:
            document["facts"]["interfaces"]["links"][4]["mtu"] = 2044
        if number % 700 == 7:
            document["facts"]["gpus"]["driver_version"] = "535.104.05"
        if number % 900 == 7:
            document["facts"]["rdma"]["devices"][3]["fw_ver"] = "28.36.1010"
        if number % 1100 == 7:
            document["facts"]["rdma"]["mlx5_driver_version"] = "23.10-1.1.9"
        if number % 300 == 7:
            document["findings"] = [*document["findings"], extra_finding]
        # The fields the golden normalisation drops, as a real run writes them.
        head = {"schema": document["schema"], "tool": document["tool"], "host": host, "root": "/",
                "profile": document["profile"], "config": document["config"],
                "started_at": 1796050000.0 + number, "duration_s": 4.2 + (number % 97) / 100}
        text = json.dumps({**head, **{k: v for k, v in document.items() if k not in head}}, indent=2) + "\n"
        text = as_node(text, host, number)
        with open(os.path.join(directory, f"{host}.json"), "w", encoding="utf-8") as handle:
            handle.write(text)


def measure(command: list[str]) -> tuple[float, float]:
    """Wall and CPU seconds (user + system of the child and everything it waited for)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    begin = time.perf_counter()
    result = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, check=False, timeout=900)
    wall = time.perf_counter() - begin
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if result.returncode not in (0, 1, 2):
        raise SystemExit(f"{command[0]} failed ({result.returncode}): {result.stderr.decode()[-500:]}")
    return wall, after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=10_000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--keep", metavar="DIR", help="generate into DIR (reused when it holds --nodes reports)")
    args = parser.parse_args()
    preflight = os.path.join(os.path.dirname(sys.executable), "preflight")
    work = tempfile.mkdtemp(prefix="preflight-fleet-bench-")
    try:
        reports = args.keep or os.path.join(work, "reports")
        os.makedirs(reports, exist_ok=True)
        if len([n for n in os.listdir(reports) if n.endswith(".json")]) != args.nodes:
            generate(reports, args.nodes)
        names = sorted(n for n in os.listdir(reports) if n.endswith(".json"))
        size = sum(os.path.getsize(os.path.join(reports, name)) for name in names)
        output = os.path.join(work, "fleet.json")
        try:
            from preflight.fleet.load import worker_count
        except ImportError:  # before worker_count existed
            workers = min(os.cpu_count() or 1, 8)
        else:
            workers = worker_count(args.nodes)
        cases = {
            "cat": ["cat", *(os.path.join(reports, name) for name in names)],
            "json.loads, 1 process": [sys.executable, "-c", DECODE_ONLY, "1", reports],
            f"json.loads, {workers} processes": [sys.executable, "-c", DECODE_ONLY, str(workers), reports],
            "preflight fleet": [preflight, "fleet", reports, "--format", "json", "--output", output],
            **{f"  same, --format {kind}": [preflight, "fleet", reports, "--format", kind, "--output", f"{output}.{kind}"]
               for kind in ("table", "markdown", "html")},
        }
        measure(cases["cat"])  # the page cache holds them from here on
        walls: dict[str, list[float]] = {name: [] for name in cases}
        cpus: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(args.runs):
            for name, command in cases.items():
                wall, cpu = measure(command)
                walls[name].append(wall)
                cpus[name].append(cpu)
        with open(output, encoding="utf-8") as handle:
            summary = json.load(handle)["summary"]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    wall = {name: statistics.median(values) for name, values in walls.items()}
    cpu = {name: statistics.median(values) for name, values in cpus.items()}
    print(f"{args.nodes} reports, {size / 1e6:.0f} MB ({size / len(names) / 1e3:.0f} KB each), "
          f"{workers} workers, medians of {args.runs} runs on {os.cpu_count()} CPUs:")
    single = "json.loads, 1 process"
    for name in cases:
        print(f"  {name:26} wall {wall[name]:6.2f} s  CPU {cpu[name]:6.2f} s  "
              f"({wall[name] / wall[single]:.2f}x / {cpu[name] / cpu[single]:.2f}x json.loads in 1 process)")
    print(f"  fleet found {len(summary['odd_nodes'])} odd nodes, {len(summary['nodes_with_present'])} with present "
          f"findings, {summary['skipped']} files skipped")


if __name__ == "__main__":
    main()
