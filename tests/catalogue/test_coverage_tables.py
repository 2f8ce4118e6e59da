"""The coverage tables in references/coverage: every failure-message format that NCCL and the
programs printing into the same logs (PyTorch, its 1.x releases too, Gloo, aws-ofi-nccl, GDRCopy, UCX, Horovod, DeepSpeed, vLLM) can write has a
decision, either a reference or "generic" with a reason, and the signatures of the decided
reference match a line rendered from that format. A new release's formats, extracted again,
fail this test until someone decides them.
"""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import pytest

from preflight.catalogue import load_all

COVERAGE = Path(__file__).resolve().parents[2] / "references" / "coverage"
TABLES = sorted(path for path in COVERAGE.glob("*.toml") if not path.name.startswith("proposed"))
REFERENCES = {reference.id: reference for reference in load_all()}


def _formats(table: Path) -> list[dict]:  # type: ignore[type-arg]
    return list(tomllib.loads(table.read_text())["format"])


def test_tables_exist_for_every_actor() -> None:
    assert {path.stem for path in TABLES} >= {"nccl", "pytorch", "pytorch-1x", "gloo", "aws-ofi-nccl", "gdrcopy", "ucx", "horovod", "deepspeed", "vllm", "perftest", "ray", "sglang", "nvshmem", "slurm", "rdma-core", "openmpi", "libfabric", "xid", "megatron", "lightning", "transformer-engine", "prrte", "jax", "nccl-tests", "dcgm", "mpich-hydra", "pytorch-2x", "cuda", "kernel", "transfer-engines", "uccl-mscclpp", "pyxis-enroot", "accelerate", "nvidia-container", "rccl", "deepep", "rl-stacks", "tensorrt-llm", "torchft-torchtitan", "kubernetes-gpu", "nvidia-utils", "nemo", "ucc", "hpcx-nccl-plugin", "cuda-samples", "nccl-diagnostics", "nccl-released-hints", "nccl-released-nvls", "nccl-released-gid-change", "nccl-released-2-32", "gpu-direct-rdma-access"}


@pytest.mark.parametrize("table", TABLES, ids=lambda path: path.stem)
def test_every_format_has_a_decision(table: Path) -> None:
    undecided = []
    for entry in _formats(table):
        decision = entry.get("decision")
        if decision == "generic":
            if not str(entry.get("reason", "")).strip():
                undecided.append(f"{entry['text']!r}: generic without a reason")
        elif decision not in REFERENCES:
            undecided.append(f"{entry['text']!r}: decision {decision!r} is neither a reference nor 'generic'")
    assert not undecided, "\n".join(undecided[:20])


@pytest.mark.parametrize("table", TABLES, ids=lambda path: path.stem)
def test_decided_formats_are_matched_by_their_reference(table: Path) -> None:
    """The rendered example of each format decided to a reference matches one of that
    reference's signatures: a wording a release prints is never left to chance."""
    unmatched = []
    for entry in _formats(table):
        reference = REFERENCES.get(entry.get("decision", ""))
        if reference is None:
            continue
        example = entry.get("example", "")
        assert example, f"{table.stem}: {entry['text']!r} is decided to {reference.id} but has no example line"
        if not any(re.search(signature["pattern"], example) for signature in reference.signatures):
            unmatched.append(f"{reference.id}: {example}")
    assert not unmatched, f"{len(unmatched)} decided formats match no signature of their reference:\n" + "\n".join(unmatched[:20])


# What varies from one run to the next in the same message: who wrote it, from where, to whom.
# A signature that needs one host's name or one run's pid would match its example and no real log.
_INCIDENTAL = (
    (re.compile(r"\b(?:\d{1,3}\.){3}\d{1,3}\b"), lambda found: "172.31.207.9"),
    (re.compile(r"^[A-Za-z][\w.-]{0,40}:\d+:\d+ \["), lambda found: "ip-10-0-12-7.ec2.internal:1048576:7 ["),
    (re.compile(r"<\d{2,5}>"), lambda found: "<61234>"),
    (re.compile(r"\b(pid[= ]|PID )\d+"), lambda found: found.group(1) + "4194301"),
    (re.compile(r"0x[0-9a-fA-F]{6,}"), lambda found: "0x" + "9e" * ((len(found.group()) - 2) // 2) + "b" * (len(found.group()) % 2)),
)


def _varied(line: str) -> str:
    for pattern, replacement in _INCIDENTAL:
        line = pattern.sub(replacement, line)
    return line


@pytest.mark.parametrize("table", TABLES, ids=lambda path: path.stem)
def test_decided_formats_are_matched_whoever_printed_them(table: Path) -> None:
    """The same example with another host, pid, IP address, port and pointer still matches its
    reference: signatures key on the message, never on the run that printed it."""
    unmatched = []
    for entry in _formats(table):
        reference = REFERENCES.get(entry.get("decision", ""))
        if reference is None:
            continue
        varied = _varied(entry["example"])
        if not any(re.search(signature["pattern"], varied) for signature in reference.signatures):
            unmatched.append(f"{reference.id}: {varied}")
    assert not unmatched, f"{len(unmatched)} decided formats lose their reference with other incidental fields:\n" + "\n".join(unmatched[:20])


def test_incidental_fields_are_varied() -> None:
    line = "gpu-a1:4021:4099 [3] NCCL WARN peer 10.1.2.3<4567> pid=12 at 0x7f88c7200000"
    assert _varied(line) == "ip-10-0-12-7.ec2.internal:1048576:7 [3] NCCL WARN peer 172.31.207.9<61234> pid=4194301 at 0x9e9e9e9e9e9e"


def test_nccl_table_decides_exactly_the_extracted_formats() -> None:
    extracted = json.loads((COVERAGE / "nccl-formats.json").read_text())
    texts = [item["text"] for item in extracted["formats"]]
    decided = [entry["text"] for entry in _formats(COVERAGE / "nccl.toml")]
    assert len(texts) == len(set(texts))
    missing = sorted(set(texts) - set(decided))
    stale = sorted(set(decided) - set(texts))
    assert not missing, f"{len(missing)} extracted NCCL formats have no decision, e.g. {missing[:5]}"
    assert not stale, f"{len(stale)} decisions for formats no longer extracted, e.g. {stale[:5]}"


def test_nccl_extraction_covers_the_releases_the_issue_names() -> None:
    tags = json.loads((COVERAGE / "nccl-formats.json").read_text())["tags"]
    assert tags[0].startswith("v2.4.") and tags[-1] >= "v2.30" and len(tags) >= 50
