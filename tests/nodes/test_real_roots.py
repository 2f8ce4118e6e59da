"""Real captures of real machines (``tests/data/real-roots``): verdicts that hold on real nodes.

Nothing is planted in these captures, and most of them lack whole sources (no ``/etc``, no job
environment, no ``/proc/net``, a ``dev/`` with only a cpuset mount). On every one of them:

* no ``present`` finding at error or above, except those verified from the capture itself and
  listed with the reason in ``verified-findings.toml`` beside the data;
* no crash, no probe or check exception caught by the engine, every ``unknown`` with a reason;
* every capture has its provenance (repository, commit, path, licence) and the licence text.

The false alarms and false "fine" verdicts these captures exposed are pinned below, each on the
capture that showed it (the figures before and after are in the corpus's ``findings.md``).
"""

from __future__ import annotations

import re
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from preflight.probes.gpudirect import probe_gpudirect
from preflight.probes.rdma import probe_rdma
from preflight.discovery import build_registry
from preflight.engine import Report
from preflight.model import Severity, Status
from preflight.registry import Registry
from preflight.sources import NodeFS, NotCaptured
from preflight.sources.netlink import FileNetlink

from conftest import Runner
from reliability_harness import REAL_ROOTS, extracted_real_roots, real_root_archives, run_root, safety_net_catches, unclean_run

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

PROVENANCE = tomllib.loads((REAL_ROOTS / "PROVENANCE.toml").read_text())["capture"]
VERIFIED = tomllib.loads((REAL_ROOTS / "verified-findings.toml").read_text()).get("finding", [])
REDISTRIBUTABLE = {"BSD-3-Clause", "GPL-2.0-or-later", "MIT", "Apache-2.0"}


@pytest.fixture(scope="module")
def roots(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    yield {root.name: root for root in extracted_real_roots(tmp_path_factory.mktemp("real"))}


@pytest.fixture(scope="module")
def reports(roots: dict[str, Path]) -> dict[str, Report]:
    registry: Registry = build_registry(plugins=False)
    return {name: run_root(registry, root) for name, root in roots.items()}


def test_the_corpus_is_real_varied_and_documented() -> None:
    archives = {path.name[: -len(".tar.gz")] for path in real_root_archives()}
    assert len(archives) >= 30
    assert archives == {entry["name"] for entry in PROVENANCE}
    for entry in PROVENANCE:
        assert re.fullmatch(r"[0-9a-f]{40}", entry["commit"]), entry["name"]
        assert entry["repository"].count("/") == 1 and entry["path"] and entry["description"], entry["name"]
        owner = entry["repository"].replace("/", "-")
        assert any(path.name.startswith(owner) for path in (REAL_ROOTS / "LICENSES").iterdir()), entry["name"]
        assert entry["licence"] in REDISTRIBUTABLE, entry["licence"]
    architectures = {entry["arch"] for entry in PROVENANCE}
    assert {"x86_64", "aarch64"} <= architectures and any(arch.startswith("ppc") for arch in architectures)
    kinds = {kind for entry in PROVENANCE for kind in entry["has"]}
    assert {"infiniband", "net", "pci", "nvidia-driver"} <= kinds


def test_no_problem_is_claimed_that_the_capture_does_not_show(reports: dict[str, Report]) -> None:
    allowed = {(item["capture"], item["id"], item["subject"]) for item in VERIFIED}
    for item in VERIFIED:
        assert item["why"].strip(), item
    claimed = {
        (name, finding.reference_id, finding.subject)
        for name, report in reports.items()
        for finding in report.findings
        if finding.status is Status.PRESENT and finding.severity in (Severity.ERROR, Severity.CRITICAL)
    }
    assert claimed <= allowed, sorted(claimed - allowed)
    assert allowed <= claimed, f"verified findings no longer reported: {sorted(allowed - claimed)}"


def test_every_capture_runs_clean_and_says_why_it_cannot_tell(reports: dict[str, Report]) -> None:
    assert {name: unclean_run(report) for name, report in reports.items() if unclean_run(report)} == {}


# -- the false alarms and false "fine" verdicts, on the captures that showed them ----------------
def test_addresses_of_a_capture_without_proc_net_are_not_captured_not_none(roots: dict[str, Path]) -> None:
    """NET005 "nothing matched" on every capture without /proc/net: the file fallback read the
    missing fib_trie as "no addresses"."""
    fs = NodeFS(str(roots["hwloc-8em64t-4c2t"]))
    with pytest.raises(NotCaptured, match="/proc/net"):
        FileNetlink(fs).addresses()


def test_a_dev_holding_only_a_cpuset_mount_says_nothing_of_device_nodes(roots: dict[str, Path], reports: dict[str, Report]) -> None:
    """IB007 "/dev/infiniband missing" on the QLogic capture whose dev/ is hwloc's cpuset mount;
    its ib_uverbs was loaded (the PCI function's own infiniband_verbs/uverbs0 shows it)."""
    name = "hwloc-40intel64-2g2n4c+pcilocality"
    facts = probe_rdma(NodeFS(str(roots[name])))
    assert [(d.name, d.uverbs) for d in facts.devices] == [("qib0", "uverbs0")] and facts.verbs_class_present is True
    assert facts.dev_infiniband is None and any("devices.json" in p.reason for p in facts.problems)
    verdicts = {f.status for f in reports[name].findings if f.reference_id == "IB007"}
    assert verdicts == {Status.UNKNOWN}


def test_gpus_listed_by_the_driver_mean_the_driver_is_loaded(roots: dict[str, Path]) -> None:
    """GDR001/GDR002 "driver not loaded" while /proc/driver/nvidia/gpus lists GPUs (a capture
    without /sys/module)."""
    facts = probe_gpudirect(NodeFS(str(roots["hwloc-nvidiagpunumanodes"])))
    assert facts.nvidia_loaded is True and facts.nvidia_gpus == 6


def test_pci_questions_of_a_capture_without_the_pci_bus_are_unknown(reports: dict[str, Report]) -> None:
    """PCI002/PCI003/NVL004 "no GPUs here" on a capture whose PCI tree was left out."""
    report = reports["hwloc-nvidiagpunumanodes"]
    for reference in ("PCI001", "PCI002", "PCI003", "NVL004", "NVL006"):
        assert {f.status for f in report.findings if f.reference_id == reference} == {Status.UNKNOWN}, reference


def test_an_empty_directory_is_not_a_node_root(run_cli: Runner, tmp_path: Path) -> None:
    result = run_cli("node", "--root", str(tmp_path))
    assert result.returncode == 3 and result.stdout == ""
    assert result.stderr.strip() == f"preflight: error: --root {tmp_path}: not a node root (it has none of sys/, proc/, etc/, .preflight/)"


def test_a_partial_copy_of_a_real_capture_stays_undecided(roots: dict[str, Path], tmp_path: Path) -> None:
    """Half-captured: the InfiniBand capture with its PCI device tree cut away leaves dangling
    class links; nothing about the HCA becomes present or absent."""
    root = tmp_path / "half"
    shutil.copytree(roots["hwloc-32em64t-2n8c+dax+nvme+mic+dimms"], root, symlinks=True)
    shutil.rmtree(root / "sys" / "devices")
    registry = build_registry(plugins=False)
    report = run_root(registry, root)
    assert not safety_net_catches(report)
    for finding in report.findings:
        if finding.reference_id.startswith("IB"):
            assert finding.status in (Status.UNKNOWN, Status.NOT_APPLICABLE), finding
    ib = [f for f in report.findings if f.reference_id in ("IB007", "IB009")]
    assert ib and all(f.status is Status.UNKNOWN for f in ib)


def test_forced_ooo_rq_on_real_infiniband_hcas_is_no_roce_finding(roots: dict[str, Path]) -> None:
    """ROCE003 on the two real RDMA captures, with a job that forces NCCL_IB_OOO_RQ under NCCL
    2.30.3: the QLogic qib0 port's link layer reads InfiniBand, so there is no RoCE port to judge;
    the mlx4 capture also lists Intel's scif0, whose ports were not copied, so there it cannot
    tell. (No real capture has a RoCE port or hw_counters.)"""
    from preflight.checks.roce import roce_packet_reordering

    from preflight.model import NotApplicable, Unknown
    from preflight.probes.job import JobFacts
    from preflight.probes.nccl_libs import NcclCopy, NcclLibFacts

    job = JobFacts({"NCCL_IB_OOO_RQ": "1"}, "", ())
    libs = NcclLibFacts((NcclCopy("/usr/lib/x86_64-linux-gnu/libnccl.so.2.30.3", "2.30.3", "system"),), ())
    qlogic = probe_rdma(NodeFS(str(roots["hwloc-40intel64-2g2n4c+pcilocality"])))
    assert [(port.subject, port.link_layer) for port in qlogic.data_ports] == [("qib0/1", "InfiniBand")]
    with pytest.raises(NotApplicable, match="no RDMA port with link_layer Ethernet"):
        list(roce_packet_reordering(qlogic, job, libs))
    with pytest.raises(Unknown, match="scif0/ports: not captured"):
        list(roce_packet_reordering(probe_rdma(NodeFS(str(roots["hwloc-32em64t-2n8c+dax+nvme+mic+dimms"]))), job, libs))
