"""Fuzzing what preflight reads from someone else (targets in ``tests/fuzz_targets.py``): random
and mutated snapshot archives, replay recordings, site configs and fleet reports are used or
refused with preflight's own error, never a crash. Bounded for CI; ``bench/fuzz.py`` runs more."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fuzz_targets as targets

FAST = settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
GOOD_ARCHIVE = targets.tar_bytes([
    ("sys/class/net/eth0/mtu", b"1500\n", "0"), ("etc", b"", "5"), ("etc/hosts", b"127.0.0.1 localhost\n", "0"),
    ("sys/class/infiniband/mlx5_0", b"../../devices/pci0000:00/0000:00:01.0/infiniband/mlx5_0", "2"),
    ("proc/self/environ", b"NCCL_DEBUG=INFO\0", "0"),
])
SAMPLE_CONFIG = """[run]
timeout = 10.0
probe_timeout = 3.0
profile = "full"

[policy]
unknown = "ignore"

[expect]
memlock_min = "unlimited"
gpu_count = 8
hcas = ["mlx5_0", "mlx5_1"]
peers = ["gpu[001-064]"]

[severity]
MEM002 = "error"

[dns]
nameservers = ["10.0.0.53"]

[[hosts]]
match = "gpu[001-032]"
expect = { gpu_count = 4 }
"""


@FAST
@given(st.binary(max_size=4096))
def test_random_bytes_as_an_archive(data: bytes) -> None:
    targets.fuzz_archive(data)


@FAST
@given(st.randoms(use_true_random=False))
def test_mutated_archives(rng: random.Random) -> None:
    targets.fuzz_archive(targets.mutate_bytes(GOOD_ARCHIVE, rng))


@FAST
@given(st.sampled_from(sorted(targets.RECORDING_SEEDS)), st.randoms(use_true_random=False))
def test_mutated_recordings(name: str, rng: random.Random) -> None:
    targets.fuzz_recording(name, targets.mutate_document(targets.RECORDING_SEEDS[name], rng))


@FAST
@given(st.text(max_size=400))
def test_random_text_as_a_config(text: str) -> None:
    targets.fuzz_config(text)


@FAST
@given(st.randoms(use_true_random=False))
def test_mutated_configs(rng: random.Random) -> None:
    lines = SAMPLE_CONFIG.splitlines()
    for _ in range(rng.randint(1, 4)):
        at = rng.randrange(len(lines))
        choice = rng.random()
        if choice < 0.4:
            lines[at] = lines[at][: rng.randrange(len(lines[at]) + 1)]
        elif choice < 0.7:
            lines.insert(at, rng.choice(lines))
        else:
            lines[at] = lines[at].replace("=", rng.choice(["= [", "= {", "= 1e999", '= "', "= -"]), 1)
    targets.fuzz_config("\n".join(lines))


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(st.randoms(use_true_random=False))
def test_mutated_fleet_reports(rng: random.Random) -> None:
    document = json.loads(targets.GOLDEN_REPORT)
    targets.fuzz_fleet_report(json.dumps(targets.mutate_document(document, rng)).encode())


@FAST
@given(st.text(max_size=400), st.text(max_size=200))
def test_random_text_as_a_slurm_conf_and_its_includes(main: str, included: str) -> None:
    targets.fuzz_slurm_conf(main, included)
    targets.fuzz_slurm_conf(targets.SLURM_CONF_SAMPLE + main, "Include slurm.conf\n" + included)



@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(targets.NODE_ROOT_SEEDS), st.randoms(use_true_random=False))
def test_node_roots_with_edited_files(seed_root: Path, rng: random.Random) -> None:
    targets.fuzz_root(seed_root, rng)


@pytest.mark.parametrize("value", ["²", "1²", "٣", "9" * 5000])
def test_every_job_variable_set_to_digits_int_refuses(value: str, node_copy: Path) -> None:
    """str.isdigit() takes a superscript two, which int() refuses: a job environment where each
    variable preflight reads holds such a value is judged without a crash."""
    environ = node_copy / "proc/self/environ"
    environ.unlink()
    environ.write_bytes(b"".join(f"{name}={value}".encode() + b"\0" for name in [*targets.JOB_VARIABLES, "SLURM_JOB_ID"]))
    targets.assert_judged_without_crash(node_copy)
