"""NVL003: active NVLinks per GPU from replayed NVML, on the example HGX H100, the GB200 tray and
the RTX 5090 workstation, with planted inactive links and bad NVML answers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from preflight.probes.gpus import probe_gpus
from preflight.probes.nvlink import GpuNvlinks, NvlinkFacts, probe_nvlink
from preflight.checks.nvl import nvlink_ring_search_fallback
from preflight.config import ConfigError, Expectations, parse_config
from preflight.model import NotApplicable, Severity, Status, Unknown
from preflight.sources import Sources

from conftest import Runner, bare_node

NODES = Path(__file__).resolve().parents[1] / "fixtures" / "nodes"
H100 = "NVIDIA H100 80GB HBM3"


def facts(root: Path) -> NvlinkFacts:
    return probe_nvlink(Sources.for_node(str(root), None).nvml)


def verdicts(root: Path, expect: Expectations = Expectations()) -> list[tuple[str, Status, str]]:
    sources = Sources.for_node(str(root), None)
    found = nvlink_ring_search_fallback(probe_nvlink(sources.nvml), probe_gpus(sources.fs, sources.nvml), expect)
    return [(o.subject, o.status, " | ".join(f"{e.observed} / {e.expected}" for e in o.evidence) + o.reason) for o in found]


def edit_nvml(root: Path, function: str, answers: dict[str, Any]) -> None:
    path = root / ".preflight/nvml.json"
    document = json.loads(path.read_text())
    document["calls"].setdefault(function, {}).update(answers)
    path.write_text(json.dumps(document))


def copy_fixture(tmp_path: Path, name: str) -> Path:
    target = tmp_path / name
    shutil.copytree(NODES / name, target, symlinks=True)
    return target


# -- probe on recorded roots --------------------------------------------------------------------
def test_example_node_has_eighteen_active_links_per_gpu(example_root: Path) -> None:
    assert facts(example_root) == NvlinkFacts(
        tuple(GpuNvlinks(i, H100, tuple(range(18)), tuple(range(18)), 18, "") for i in range(8)), "", ""
    )


def test_gb200_tray_and_rtx5090_facts() -> None:
    gb200 = facts(NODES / "gb200-tray")
    assert [(g.name, g.active_count, len(g.links)) for g in gb200.gpus] == [("NVIDIA GB200", 18, 18)] * 4
    rtx = facts(NODES / "rtx5090-workstation")
    assert rtx == NvlinkFacts(tuple(GpuNvlinks(i, "NVIDIA GeForce RTX 5090", (), (), 0, "") for i in range(2)), "", "")


# -- the check ----------------------------------------------------------------------------------
def test_healthy_nodes_are_absent(example_root: Path) -> None:
    assert verdicts(example_root) == []
    assert verdicts(example_root, Expectations(nvlinks_per_gpu=18)) == []
    assert verdicts(NODES / "gb200-tray") == []


def test_gpu_with_fewer_links_than_its_siblings_is_present(node_copy: Path) -> None:
    edit_nvml(node_copy, "nvmlDeviceGetNvLinkState", {"3/5": {"result": 0}, "3/11": {"result": 0}})
    found = verdicts(node_copy)
    assert [(s, st) for s, st, _ in found] == [("GPU3", Status.PRESENT)]
    assert "16 of 18 NVLinks active; inactive: link 5, 11 / 18 active, as on GPU0" in found[0][2]
    assert facts(node_copy).gpus[3].active_count == 16


def test_no_active_link_is_a_warning_and_no_link_answered_is_unknown(node_copy: Path) -> None:
    """A GPU with every link down sits outside the NVLink graph (a PCIe card without its bridge;
    an SXM GPU whose fabric failed is NVL006's): a warning. One that answers NOT_SUPPORTED for
    every link number reports no NVLink at all, which says nothing about links down: unknown."""
    edit_nvml(node_copy, "nvmlDeviceGetNvLinkState", {f"6/{link}": {"result": 0} for link in range(18)})
    edit_nvml(node_copy, "nvmlDeviceGetNvLinkState", {f"7/{link}": {"error": "NVML_ERROR_NOT_SUPPORTED"} for link in range(18)})
    sources = Sources.for_node(str(node_copy), None)
    found = {o.subject: o for o in nvlink_ring_search_fallback(probe_nvlink(sources.nvml), probe_gpus(sources.fs, sources.nvml), Expectations())}
    assert (found["GPU6"].status, found["GPU6"].severity) == (Status.PRESENT, Severity.WARNING) and "bridge" in found["GPU6"].fix
    assert found["GPU7"].status is Status.UNKNOWN and "reports no NVLink on this GPU" in found["GPU7"].reason


def test_gpus_in_mig_mode_are_left_out(node_copy: Path) -> None:
    """A GPU in MIG mode does no peer-to-peer over NVLink (NVIDIA's MIG user guide): its links,
    whatever NVML says of them, are not compared with the others', even where the site gives a
    count; with every GPU in MIG mode there is nothing to judge."""
    edit_nvml(node_copy, "nvmlDeviceGetNvLinkState", {f"{g}/{link}": {"result": 0} for g in (4, 5, 6, 7) for link in range(18)})
    edit_nvml(node_copy, "nvmlDeviceGetMigMode", {str(g): {"result": [1, 1]} for g in (4, 5, 6, 7)})
    assert verdicts(node_copy) == [] and verdicts(node_copy, Expectations(nvlinks_per_gpu=18)) == []
    edit_nvml(node_copy, "nvmlDeviceGetMigMode", {"7": {"error": "NVML_NOT_RECORDED"}})  # not known: judged as before
    assert [(s, st) for s, st, _ in verdicts(node_copy)] == [("GPU7", Status.PRESENT)]
    edit_nvml(node_copy, "nvmlDeviceGetMigMode", {str(g): {"result": [1, 1]} for g in range(8)})
    with pytest.raises(NotApplicable, match="every GPU is in MIG mode"):
        verdicts(node_copy)


def test_expected_count_judges_every_gpu(node_copy: Path) -> None:
    # An A100-like board: only 12 links answer, all active; the site says 18.
    edit_nvml(node_copy, "nvmlDeviceGetNvLinkState",
              {f"{g}/{link}": {"error": "NVML_ERROR_INVALID_ARGUMENT"} for g in range(8) for link in range(12, 18)})
    assert verdicts(node_copy) == []
    found = verdicts(node_copy, Expectations(nvlinks_per_gpu=18))
    assert [s for s, _, _ in found] == [f"GPU{i}" for i in range(8)]
    assert "12 of 12 NVLinks active / 18 active (expect.nvlinks_per_gpu)" in found[0][2]


def test_different_models_are_not_compared(node_copy: Path) -> None:
    edit_nvml(node_copy, "nvmlDeviceGetName", {"7": {"result": "NVIDIA H100 PCIe"}})
    edit_nvml(node_copy, "nvmlDeviceGetNvLinkState", {f"7/{link}": {"result": 0} for link in range(18)})
    assert verdicts(node_copy) == []


def test_no_nvlink_is_not_applicable_unless_the_site_expects_it() -> None:
    with pytest.raises(NotApplicable, match="no GPU on this node has NVLinks"):
        verdicts(NODES / "rtx5090-workstation")
    found = verdicts(NODES / "rtx5090-workstation", Expectations(nvlinks_per_gpu=4))
    assert [(s, st) for s, st, _ in found] == [("GPU0", Status.PRESENT), ("GPU1", Status.PRESENT)]
    assert "0 of 0 NVLinks active" in found[0][2]


# -- bad NVML answers ---------------------------------------------------------------------------
def test_failing_link_query_is_unknown_for_that_gpu_only(node_copy: Path) -> None:
    edit_nvml(node_copy, "nvmlDeviceGetNvLinkState", {"2/4": {"error": "NVML_ERROR_GPU_IS_LOST"}, "5/3": {"result": 0}})
    found = verdicts(node_copy)
    assert [(s, st) for s, st, _ in found] == [("GPU2", Status.UNKNOWN), ("GPU5", Status.PRESENT)]
    assert "NVML_ERROR_GPU_IS_LOST (link 4)" in found[0][2]
    assert facts(node_copy).gpus[2].active_count is None


def test_garbage_link_answer_is_unknown(node_copy: Path) -> None:
    edit_nvml(node_copy, "nvmlDeviceGetNvLinkState", {"0/0": {"result": "yes"}})
    assert verdicts(node_copy) == [("GPU0", Status.UNKNOWN, "nvmlDeviceGetNvLinkState: unexpected answer 'yes' (link 0)")]


def test_unrecorded_links_are_unknown(node_copy: Path) -> None:
    document = json.loads((node_copy / ".preflight/nvml.json").read_text())
    del document["calls"]["nvmlDeviceGetNvLinkState"]
    (node_copy / ".preflight/nvml.json").write_text(json.dumps(document))
    found = verdicts(node_copy)
    assert {st for _, st, _ in found} == {Status.UNKNOWN} and len(found) == 8
    assert "NVML_NOT_RECORDED (link 0)" in found[0][2]


def test_nvml_that_does_not_start_is_unknown(node_copy: Path) -> None:
    path = node_copy / ".preflight/nvml.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "init": {"error": "NVML_ERROR_DRIVER_NOT_LOADED"}}))
    with pytest.raises(Unknown, match="NVML_ERROR_DRIVER_NOT_LOADED"):
        verdicts(node_copy)
    (node_copy / ".preflight/nvml.json").unlink()
    with pytest.raises(Unknown, match="nvml"):
        verdicts(node_copy)


def test_node_without_gpus_or_driver_is_not_applicable(tmp_path: Path) -> None:
    bare_node(tmp_path)  # its .preflight holds the device recording
    (tmp_path / ".preflight/nvml.json").write_text(json.dumps({"init": {"error": "NVML_ERROR_LIBRARY_NOT_FOUND"}}))
    with pytest.raises(NotApplicable, match="no NVIDIA GPU"):
        verdicts(tmp_path)


# -- configuration and the prolog ---------------------------------------------------------------
def test_nvlinks_per_gpu_in_the_config() -> None:
    assert parse_config("[expect]\nnvlinks_per_gpu = 18\n", "p.toml", "gpu1").expect.nvlinks_per_gpu == 18
    for bad in ("0", "-2", '"18"', "true", "1.5"):
        with pytest.raises(ConfigError, match="p.toml:2: expect.nvlinks_per_gpu"):
            parse_config(f"[expect]\nnvlinks_per_gpu = {bad}\n", "p.toml", "gpu1")


def test_prolog_reports_a_down_link_with_the_site_expectation(run_cli: Runner, node_copy: Path) -> None:
    edit_nvml(node_copy, "nvmlDeviceGetNvLinkState", {"6/17": {"result": 0}})
    config = node_copy / "preflight.toml"
    config.write_text("[expect]\nnvlinks_per_gpu = 18\n")
    result = run_cli("node", "--root", str(node_copy), "--profile", "prolog", "--select", "NVL003", "--format", "json",
                     "--config", str(config))
    findings = [(f["status"], f["subject"], f["severity"]) for f in json.loads(result.stdout)["findings"]]
    assert findings == [("present", "GPU6", "error")], result.stderr
