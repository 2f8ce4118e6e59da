"""Benchmark: ``preflight explain`` on a generated 1,000,000-line multi-rank log.

The log is what a 64-rank job over 8 hosts leaves behind: NCCL INFO setup chatter, PyTorch
progress lines, then one rank's RDMA failure and everybody's watchdog timeouts. The benchmark
reports, in one run:

* wall time and peak RSS of ``preflight explain`` (targets: <= 5 s, <= 150 MB);
* ``grep -c -E`` over the same file with as many patterns as the catalogue has signatures (each
  signature's required literal), and the ratio of the two times.

Run with the interpreter of the venv preflight is installed in:

    .venv/bin/python bench/explain.py [--lines 1000000] [--unique-hosts]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time

NOISE = (
    "{ts} [rank{r}]:{host}:{pid}:{tid} [{d}] NCCL INFO Channel {c:02d}/0 : {r}[{d}] -> {r2}[{d2}] via P2P/IPC/read",
    "{ts} [rank{r}]:{host}:{pid}:{tid} [{d}] NCCL INFO NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_1:1/IB ; OOB eno1:10.1.{h}.7<0>",
    "{ts} [rank{r}]:[2026-03-14 09:21:33,123] INFO: iteration {c} loss 2.{pid} lr 1e-4 tokens/s {tid}",
    "{ts} [rank{r}]:{host}:{pid}:{tid} [{d}] NCCL INFO Connected all rings, use ring PXN 0 GDR 1",
    "{ts} [rank{r}]:{host}:{pid}:{tid} [{d}] NCCL INFO comm 0x55d1c2a0 rank {r} nranks 64 cudaDev {d} nvmlDev {d} busId 1b000 commId 0x9f1e - Init COMPLETE",
    "{ts} [rank{r}]:{host}:{pid}:{tid} [{d}] NCCL INFO Channel {c:02d}/1 : {r}[{d}] -> {r2}[{d2}] [send] via NET/IB/{d}/GDRDMA",
)
FAILURE = "{ts} [rank3]:gpu-node-01:20871:21002 [3] NCCL WARN NET/IB : Got completion from peer 10.1.2.8<41937> with status=12 opcode=1 len=0 vendor err 129 (Recv) localGid ::ffff:10.1.1.7 remoteGid ::ffff:10.1.2.8 hca mlx5_3"
TIMEOUT = "{ts} [rank{r}]:[E0314 09:41:33.551287019 ProcessGroupNCCL.cpp:616] [Rank {r}] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=412, OpType=ALLREDUCE, NumelIn=1048576, NumelOut=1048576, Timeout(ms)=600000) ran for 600073 milliseconds before timing out."


def generate(path: str, lines: int, unique_hosts: bool = False) -> None:
    """The log; with ``unique_hosts`` every line names its own host, so no NCCL line repeats and
    the matcher's skipping of repeated lines (channel lines, quiet NCCL lines) never applies."""
    with open(path, "w", encoding="utf-8") as out:
        for i in range(lines):
            seconds = 1_773_480_093 + i // 2000
            ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)) + f".{i % 1_000_000_000:09d}Z"
            if i == lines // 2:
                out.write(FAILURE.format(ts=ts) + "\n")
            elif i > lines * 0.9 and i % 5000 == 0:
                out.write(TIMEOUT.format(ts=ts, r=i % 64) + "\n")
            else:
                r = i % 64
                host = f"n{i:07d}" if unique_hosts else f"gpu-node-{r // 8:02d}"
                out.write(
                    NOISE[i % len(NOISE)].format(
                        ts=ts, r=r, r2=(r + 1) % 64, d=r % 8, d2=(r + 1) % 8, host=host, h=r // 8, pid=20000 + r, tid=21000 + r, c=i % 32
                    )
                    + "\n"
                )


def grep_patterns(path: str) -> int:
    """Write one ERE per catalogue signature (its required literal); returns how many."""
    from preflight.catalogue import load_all
    from preflight.signatures import required_literals

    patterns = []
    for reference in load_all():
        for item in reference.signatures:
            literals = required_literals(item["pattern"])
            patterns.append("|".join(re.sub(r"([][.^$*+?(){}|\\])", r"\\\1", lit) for lit in literals))
    with open(path, "w", encoding="utf-8") as out:
        out.write("\n".join(patterns) + "\n")
    return len(patterns)


def timed(command: list[str]) -> tuple[float, subprocess.CompletedProcess[str]]:
    begin = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    return time.perf_counter() - begin, result


def tree_rss_kib(pid: int) -> int:
    """Resident memory of a process and all its descendants (explain forks scan workers)."""
    total = 0
    pending = [pid]
    while pending:
        current = pending.pop()
        try:
            with open(f"/proc/{current}/status", encoding="ascii") as status:
                total += next((int(line.split()[1]) for line in status if line.startswith("VmRSS:")), 0)
            for task in os.listdir(f"/proc/{current}/task"):
                with open(f"/proc/{current}/task/{task}/children", encoding="ascii") as children:
                    pending += [int(child) for child in children.read().split()]
        except (OSError, ValueError):
            continue
    return total


def timed_with_tree_rss(command: list[str]) -> tuple[float, int, str]:
    """Wall time, the peak summed RSS of the process tree (sampled every 20 ms), stdout."""
    begin = time.perf_counter()
    with tempfile.TemporaryFile() as output:
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.DEVNULL)
        peak = 0
        while process.poll() is None:
            peak = max(peak, tree_rss_kib(process.pid))
            time.sleep(0.02)
        elapsed = time.perf_counter() - begin
        output.seek(0)
        return elapsed, peak, output.read().decode()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=1_000_000)
    parser.add_argument(
        "--unique-hosts", action="store_true", help="every line from its own host: no line repeats (the worst case for the scan)"
    )
    args = parser.parse_args()
    preflight = os.path.join(os.path.dirname(sys.executable), "preflight")
    with tempfile.TemporaryDirectory() as folder:
        log = os.path.join(folder, "job.log")
        generate(log, args.lines, args.unique_hosts)
        patterns_file = os.path.join(folder, "patterns.ere")
        count = grep_patterns(patterns_file)
        grep_s, grep = timed(["grep", "-c", "-E", "-f", patterns_file, log])
        explain_s, tree_kib, stdout = timed_with_tree_rss([preflight, "explain", log, "--format", "json"])
        peak_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
        document = json.loads(stdout)
    top = document["candidates"][0]["id"] if document["candidates"] else "none"
    size_mb = document["inputs"]["bytes"] / 1e6
    shape = ", every line from its own host" if args.unique_hosts else ""
    print(f"log: {args.lines:,} lines, {document['inputs']['bytes'] / 1e6:.0f} MB{shape}; {count} signatures")
    print(f"grep -c -E ({count} patterns): {grep_s:.2f} s ({grep.stdout.strip()} matching lines)")
    print(f"preflight explain: {explain_s:.2f} s = {explain_s / grep_s:.1f}x grep; top candidate {top}")
    print(f"peak RSS: largest process {peak_mb:.0f} MB, whole process tree {tree_kib / 1024:.0f} MB (shared pages counted per process)")
    print(f"throughput: {args.lines / explain_s / 1e6:.2f} M lines/s ({size_mb / explain_s:.0f} MB/s)")


if __name__ == "__main__":
    main()
