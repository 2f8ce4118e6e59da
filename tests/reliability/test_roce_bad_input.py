"""Bad input on a recorded RoCE root: each file the RoCE probes read, in turn missing, empty,
garbage, a directory or failing with EINVAL, gives a report where the checks that need it are
unknown with the reason (or still decided where the file is not needed), never a crash."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from preflight.config import Expectations, HostConfig
from preflight.discovery import build_registry
from preflight.engine import RunOptions, run
from preflight.sources import Sources

from test_bad_input import mutate as mutate_file

NODE = Path(__file__).resolve().parents[1] / "fixtures" / "nodes" / "roce-v1v2"
PORT = "/sys/class/infiniband/mlx5_0/ports/1"
NET = "/sys/class/net/ens1f0np0"
REGISTRY = build_registry(plugins=False)
# ROCE002 needs the PCI tree, which this root does not record (unknown by design: its own tests
# cover it); ROCE003 reads the link layers and the job's settings, which set nothing it judges.
JUDGED = ("ROCE001", "ROCE003", "ROCE004", "ROCE005", "ROCE006")
# file -> the checks that must turn unknown when it cannot be read
FILES = {
    f"{PORT}/link_layer": {"ROCE001", "ROCE004", "ROCE005", "ROCE006"},
    f"{PORT}/gids/3": {"ROCE004", "ROCE005"},
    f"{PORT}/gid_attrs/types/3": {"ROCE004", "ROCE005"},
    f"{NET}/mtu": {"ROCE006"},
    f"{NET}/ecn/roce_np/enable/3": {"ROCE001"},
    "/.preflight/netlink.json": {"ROCE001"},
}


def real_path(root: Path, host: str) -> Path:
    """Where the tree stores ``host`` (sysfs class entries are symlinks)."""
    parent, _, name = host.rpartition("/")
    return (root / parent.lstrip("/")).resolve() / name


def mutate(root: Path, host: str, how: str) -> None:
    """The shared mutations of tests/reliability/test_bad_input.py, plus EINVAL on read, which only a
    recorded root's read-errors.json can express."""
    mutate_file(root, host.lstrip("/"), "empty" if how == "einval" else how)
    if how == "einval":
        real_path(root, host).write_text("kept\n")  # listed, as sysfs lists it; reads fail
        errors = root / ".preflight/read-errors.json"
        document = json.loads(errors.read_text())
        document["errors"] = {host: "EINVAL", **document["errors"]}
        errors.write_text(json.dumps(document))
    elif how == "missing" and "/gid_attrs/" in host:
        (root / ".preflight/read-errors.json").unlink()  # else the fixture's pattern answers EINVAL


def statuses(root: Path) -> dict[str, set[tuple[str, str]]]:
    config = HostConfig(expect=Expectations(lossless_priority=3))
    report = run(REGISTRY, Sources.for_node(str(root)), config, RunOptions(select=JUDGED), "gpu017")
    found: dict[str, set[tuple[str, str]]] = {}
    for finding in report.findings:
        found.setdefault(finding.reference_id, set()).add((finding.status.value, finding.reason))
    return found


def test_the_unmutated_root_is_clean() -> None:
    assert {ref: {status for status, _ in found} for ref, found in statuses(NODE).items()} == {
        "ROCE001": {"absent"}, "ROCE003": {"absent"}, "ROCE004": {"absent"}, "ROCE005": {"absent"}, "ROCE006": {"absent"},
    }


@pytest.mark.parametrize("how", ["missing", "empty", "garbage", "directory", "einval"])
@pytest.mark.parametrize("host", sorted(FILES))
def test_mutated_file(tmp_path: Path, host: str, how: str) -> None:
    root = tmp_path / "node"
    shutil.copytree(NODE, root, symlinks=True)
    mutate(root, host, how)
    # An NCCL that aborts on a GID type read answering EINVAL (2.21-2.25); without one on the
    # node, that read is not ROCE004's business (and this root records no /usr at all).
    (root / "usr/lib/x86_64-linux-gnu").mkdir(parents=True)
    (root / "usr/lib/x86_64-linux-gnu/libnccl.so.2.23.4").write_bytes(b"")
    found = statuses(root)
    assert set(found) == set(JUDGED)
    if host.endswith("types/3") and how in ("einval", "directory"):
        # Not unreadable facts but node states NCCL trips over: decided, not unknown. (A
        # missing types file is a partial copy: the kernel has one for every slot.)
        assert ("present", "") in found["ROCE004"]
        return
    for ref in FILES[host]:
        unknown = [reason for status, reason in found[ref] if status == "unknown"]
        assert unknown and all(reason for reason in unknown), (ref, found[ref])
