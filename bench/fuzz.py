"""Fuzzing at scale: the targets of ``tests/fuzz_targets.py`` (snapshot archives, replay
recordings, site configs, fleet reports, slurm.conf files a job names, node roots with edited
files) on many seeded random and mutated inputs, with the figures the security notes quote:
inputs tried, crashes, the slowest input, peak memory.

    .venv/bin/python bench/fuzz.py [--inputs 20000] [--root-inputs 2000] [--seed 1]

Node roots (each input a whole run of every probe and check, about 0.1 s) start from the example
node, the fixture roots and the real captures in ``tests/data/real-roots``.

A crash prints the target, the exception and the input's seed, and the run exits 1.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tarfile
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# The checkout's preflight, as the tests use it, not an installed copy an edit has not reached yet.
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "tests" / "reliability"))  # where test_fuzz_untrusted lives

import fuzz_targets as targets  # noqa: E402
from test_fuzz_untrusted import GOOD_ARCHIVE, SAMPLE_CONFIG  # noqa: E402


def peak_mib() -> float:
    """This process's peak resident memory (VmHWM), MiB."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmHWM")) / 1024


def node_root_seeds(scratch: Path) -> list[Path]:
    """The fixture roots and the real captures, unpacked under ``scratch``."""
    seeds = list(targets.NODE_ROOT_SEEDS)
    for archive in sorted((REPO / "tests" / "data" / "real-roots").glob("*.tar.gz")):
        target = scratch / archive.name.removesuffix(".tar.gz")
        with tarfile.open(archive) as tar:
            tar.extractall(target, filter="data")
        seeds.append(target)
    return seeds


def cases(rng: random.Random, roots: list[Path]) -> dict[str, Callable[[], None]]:
    document = json.loads(targets.GOLDEN_REPORT)

    def archive() -> None:
        if rng.random() < 0.3:
            targets.fuzz_archive(rng.randbytes(rng.randint(0, 8192)))
        else:
            targets.fuzz_archive(targets.mutate_bytes(GOOD_ARCHIVE, rng))

    def recording() -> None:
        name = rng.choice(sorted(targets.RECORDING_SEEDS))
        targets.fuzz_recording(name, targets.mutate_document(targets.RECORDING_SEEDS[name], rng))

    def config() -> None:
        text = SAMPLE_CONFIG
        for _ in range(rng.randint(1, 5)):
            at = rng.randrange(len(text) + 1)
            text = text[:at] + rng.choice(['"', "[", "]", "{", "=", "\n", "1e999", "-", "\x00", "é", "[[hosts]]\n"]) + text[at:]
        targets.fuzz_config(text)

    def fleet() -> None:
        targets.fuzz_fleet_report(json.dumps(targets.mutate_document(document, rng)).encode())

    def slurm_conf() -> None:
        text = targets.SLURM_CONF_SAMPLE
        for _ in range(rng.randint(1, 8)):
            at = rng.randrange(len(text) + 1)
            text = text[:at] + rng.choice(["\\", "#", '"', "=", "\n", "Include slurm.conf\n", "%c", "*", "\x00", "é"]) + text[at:]
        targets.fuzz_slurm_conf(text, rng.choice([text, targets.SLURM_CONF_SAMPLE, "", "\\" * rng.randint(1, 9)]))

    def node_root() -> None:
        targets.fuzz_root(rng.choice(roots), rng)

    return {"archive": archive, "recording": recording, "config": config, "fleet report": fleet, "slurm.conf": slurm_conf,
            "node root": node_root}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inputs", type=int, default=20000, help="inputs per target")
    parser.add_argument("--root-inputs", type=int, default=2000, help="node roots to edit and run")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    crashed = False
    scratch = tempfile.TemporaryDirectory(prefix="preflight-fuzz-roots-")
    roots = node_root_seeds(Path(scratch.name))
    for name in ("archive", "recording", "config", "fleet report", "slurm.conf", "node root"):
        slowest, crashes, begin = 0.0, 0, time.monotonic()
        inputs = args.root_inputs if name == "node root" else args.inputs
        for index in range(inputs):
            seed = args.seed * 1_000_003 + index
            target = cases(random.Random(seed), roots)[name]
            start = time.monotonic()
            try:
                target()
            except Exception:  # the very thing the bench looks for
                crashes += 1
                crashed = True
                print(f"CRASH {name} seed {seed}:\n{traceback.format_exc()}", file=sys.stderr)
            slowest = max(slowest, time.monotonic() - start)
        print(f"{name}: {inputs} inputs, {crashes} crashes, slowest {slowest * 1000:.1f} ms, "
              f"{time.monotonic() - begin:.1f} s, peak RSS so far {peak_mib():.0f} MiB", flush=True)
    scratch.cleanup()
    sys.exit(1 if crashed else 0)


if __name__ == "__main__":
    main()
