"""Real NVML answers (``tests/data/real-nvml``): GPU verdicts that hold on real GPUs.

Each dump is a published ``nvidia-smi -q -x`` of a real machine; ``import_nvidia_smi.py`` reads
it back into the NVML answers preflight replays, and nothing else of the node is there. On every
one of them:

* no ``present`` finding at error or above: nothing is planted, and a dump says nothing about the
  node's NICs, kernel log or job, so no error can stand on it alone;
* no crash, no probe or check exception, every ``unknown`` with a reason;
* every dump has its provenance and its publisher's licence text, and is kept byte for byte; the
  identifiers a publisher replaced with placeholders are listed, each an element of the dump.

The false error these dumps exposed (GDR003 on every GPU with a 256 MiB BAR1, on nodes whose
NICs may not do RDMA at all) is pinned below, as are the facts the dumps do prove.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from preflight.discovery import build_registry
from preflight.engine import Report
from preflight.model import Severity, Status
from preflight.registry import Registry

from conftest import REPO, Runner, load_script
from reliability_harness import run_root, unclean_run

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

REAL_NVML = REPO / "tests" / "data" / "real-nvml"
PROVENANCE = tomllib.loads((REAL_NVML / "PROVENANCE.toml").read_text())["dump"]
FAULTY = tomllib.loads((REAL_NVML / "PROVENANCE.toml").read_text())["faulty"]
REDISTRIBUTABLE = {"MIT", "GPL-3.0-or-later", "Apache-2.0"}
SMALL_BAR1 = {  # dumps whose GPU has the legacy 256 MiB BAR1 window
    "netdata-rtx-2080-win", "netdata-rtx-4090-driver-535", "telegraf-gtx-1660-ti", "telegraf-quadro-p2000-v12",
    "telegraf-quadro-p400", "telegraf-rtx-3060-v12", "telegraf-tesla-t4", "pai-gtx-1070-x6", "pai-rtx-2080-ti-x2",
    "telegraf-grid-p4-1q", "k8s-test-infra-t4",
}


IMPORTER = load_script(REAL_NVML / "import_nvidia_smi.py")


def _dumps() -> list[Path]:
    return sorted((REAL_NVML / "dumps").glob("*.xml"))


@pytest.fixture(scope="module")
def roots(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    workdir = tmp_path_factory.mktemp("real-nvml")
    roots = {}
    for dump in _dumps():
        IMPORTER.write_root(dump.read_bytes(), workdir / dump.stem)
        roots[dump.stem] = workdir / dump.stem
    yield roots


@pytest.fixture(scope="module")
def reports(roots: dict[str, Path]) -> dict[str, Report]:
    registry: Registry = build_registry(plugins=False)
    return {name: run_root(registry, root) for name, root in roots.items()}


def _verdicts(report: Report, reference: str) -> dict[str, tuple[Status, str]]:
    return {f.subject: (f.status, f.reason + " ".join(e.observed for e in f.evidence)) for f in report.findings if f.reference_id == reference}


def test_the_dumps_are_real_documented_and_kept_byte_for_byte() -> None:
    listed = {entry["file"] for entry in PROVENANCE}
    assert listed == {f"dumps/{dump.name}" for dump in _dumps()} and len(listed) >= 15
    for entry in PROVENANCE:
        data = (REAL_NVML / entry["file"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == entry["sha256"], entry["file"]
        assert len(entry["commit"]) == 40 and entry["repository"].count("/") == 1 and entry["path"].endswith(".xml")
        assert entry["licence"] in REDISTRIBUTABLE and (REAL_NVML / entry["licence_text"]).is_file(), entry["file"]
        replaced = entry.get("identifiers_replaced", [])  # what the publisher swapped for placeholders
        assert isinstance(replaced, list) and all(isinstance(name, str) and f"<{name}>".encode() in data for name in replaced), entry["file"]
    names = {json.dumps(IMPORTER.convert((REAL_NVML / entry["file"]).read_bytes())["calls"].get("nvmlDeviceGetName")) for entry in PROVENANCE}
    assert any("A100" in name for name in names) and any("T4" in name for name in names) and any("P100" in name for name in names)


def test_no_error_stands_on_a_dump_alone(reports: dict[str, Report]) -> None:
    claimed = [
        (name, f.reference_id, f.subject)
        for name, report in reports.items()
        for f in report.findings
        if f.status is Status.PRESENT and f.severity in (Severity.ERROR, Severity.CRITICAL)
    ]
    assert claimed == []


def test_every_dump_runs_clean_and_says_why_it_cannot_tell(reports: dict[str, Report]) -> None:
    assert {name: unclean_run(report) for name, report in reports.items() if unclean_run(report)} == {}


def test_a_small_bar1_is_no_error_where_no_rdma_nic_is_known(reports: dict[str, Report]) -> None:
    """GDR003 said "error" for the 256 MiB BAR1 of T4, Quadro and GeForce boards, which drains a
    node whose NICs may not do RDMA at all; it is a fault only where an RDMA NIC maps GPU memory."""
    for name in SMALL_BAR1:
        found = _verdicts(reports[name], "GDR003")
        assert found and all(status is Status.UNKNOWN for status, _ in found.values()), (name, found)
        assert all("bar1Total 256 MiB" in text and "RDMA NIC" in text and "/sys/class" in text for _, text in found.values()), found
    large = [name for name in reports if name not in SMALL_BAR1 and "a100-sxm4-v12" not in name and "3080-v13" not in name]
    assert large and all({status for status, _ in _verdicts(reports[name], "GDR003").values()} <= {Status.ABSENT} for name in large)


def test_a_real_faulty_gpu_is_found(tmp_path: Path) -> None:
    """The one published dump of a faulty GPU (a V100 with an uncorrectable ECC error since boot
    and a retired page waiting for a reset): GPU002 is present on it, with both readings."""
    (entry,) = FAULTY
    data = (REAL_NVML / entry["file"]).read_bytes()
    assert hashlib.sha256(data).hexdigest() == entry["sha256"] and (REAL_NVML / entry["licence_text"]).is_file()
    IMPORTER.write_root(data, tmp_path / "v100")
    report = run_root(build_registry(plugins=False), tmp_path / "v100")
    present = [f for f in report.findings if f.reference_id == "GPU002" and f.status is Status.PRESENT]
    assert {f.subject for f in present} == {"GPU0"} and {f.severity for f in present} == {Severity.ERROR}
    observed = " / ".join(e.observed for f in present for e in f.evidence)
    assert "page retirement pending" in observed and "1 uncorrectable ECC errors since the driver initialised the GPU" in observed
    assert unclean_run(report) == []


def test_what_the_dumps_prove(reports: dict[str, Report]) -> None:
    """Persistence mode off is read from the dump (GPU001's warning); a GPU health verdict needs
    the kernel log too, which a dump lacks; a trimmed dump leaves its missing GPUs undecided."""
    t4 = reports["telegraf-tesla-t4"]
    persistence = _verdicts(t4, "GPU001")["nvidia-persistenced"]
    assert persistence[0] is Status.PRESENT and "disabled on GPU0 (1 of 1)" in persistence[1]
    health = _verdicts(t4, "GPU002")
    assert health["kernel log"][0] is Status.UNKNOWN and "records no kernel log" in health["kernel log"][1]
    assert Status.PRESENT not in {status for status, _ in health.values()}
    trimmed = reports["telegraf-a100-sxm4-v12"]  # 4 GPUs attached, one listed
    for reference in ("GPU002", "NCCL011", "GDR003"):
        found = _verdicts(trimmed, reference)
        assert all(found[f"GPU{index}"][0] is Status.UNKNOWN and "NVML_NOT_RECORDED" in found[f"GPU{index}"][1] for index in (1, 2, 3)), (reference, found)


# -- the importer: what a dump states, and nothing it does not ------------------------------------
def _gpu(body: str, attached: int = 1) -> bytes:
    return (
        f"<nvidia_smi_log><driver_version>535.54.03</driver_version><cuda_version>12.2</cuda_version>"
        f"<attached_gpus>{attached}</attached_gpus><gpu id=\"00000000:01:00.0\">{body}</gpu></nvidia_smi_log>"
    ).encode()


def _calls(body: str, attached: int = 1) -> dict[str, Any]:
    return dict(IMPORTER.convert(_gpu(body, attached))["calls"])


def test_the_importer_reads_back_stated_values_only() -> None:
    calls = _calls(
        "<bar1_memory_usage><total>256 MiB</total><used>5 MiB</used><free>251 MiB</free></bar1_memory_usage>"
        "<ecc_mode><current_ecc>N/A</current_ecc><pending_ecc>N/A</pending_ecc></ecc_mode>"
        "<persistence_mode>Enabled</persistence_mode><remapped_rows>N/A</remapped_rows>"
        "<clocks_event_reasons><clocks_event_reason_gpu_idle>Active</clocks_event_reason_gpu_idle>"
        "<clocks_event_reason_hw_slowdown>Active</clocks_event_reason_hw_slowdown>"
        "<clocks_event_reason_sw_power_cap>Not Active</clocks_event_reason_sw_power_cap></clocks_event_reasons>"
        "<ecc_errors><volatile><sram_uncorrectable>1</sram_uncorrectable><dram_uncorrectable>2</dram_uncorrectable></volatile></ecc_errors>",
        attached=3,
    )
    assert calls["nvmlSystemGetCudaDriverVersion_v2"] == {"result": 12020} and calls["nvmlDeviceGetCount"] == {"result": 3}
    assert calls["nvmlDeviceGetBAR1MemoryInfo"]["0"]["result"] == {"bar1Total": 256 << 20, "bar1Used": 5 << 20, "bar1Free": 251 << 20}
    assert calls["nvmlDeviceGetEccMode"]["0"]["error"] == "NVML_ERROR_NOT_SUPPORTED"
    assert calls["nvmlDeviceGetRemappedRows"]["0"]["error"] == "NVML_ERROR_NOT_SUPPORTED"
    assert calls["nvmlDeviceGetPersistenceMode"]["0"] == {"result": 1}
    assert calls["nvmlDeviceGetCurrentClocksThrottleReasons"]["0"] == {"result": 0x1 | 0x8}
    assert calls["nvmlDeviceGetTotalEccErrors"] == {"0/1/0": {"result": 3}}
    # never stated in nvidia-smi -q: left for the replay to answer NVML_NOT_RECORDED
    assert not {"nvmlDeviceGetNvLinkState", "nvmlDeviceGetP2PStatus", "nvmlDeviceGetCudaComputeCapability"} & set(calls)
    assert "1" not in calls["nvmlDeviceGetPciInfo"]  # GPUs a trimmed dump left out get no answers


def test_the_importer_lists_compute_processes_only() -> None:
    process = "<process_info><pid>{pid}</pid><type>{kind}</type><process_name>p</process_name><used_memory>{used}</used_memory></process_info>"
    calls = _calls("<processes>" + process.format(pid=725, kind="G", used="22 MiB") + process.format(pid=9001, kind="C", used="1024 MiB")
                   + process.format(pid=9002, kind="C+G", used="N/A") + "</processes>")
    assert calls["nvmlDeviceGetComputeRunningProcesses"]["0"] == {"result": [{"pid": 9001, "usedGpuMemory": 1 << 30}, {"pid": 9002, "usedGpuMemory": None}]}
    assert _calls("<processes>\n</processes>")["nvmlDeviceGetComputeRunningProcesses"]["0"] == {"result": []}
    assert "nvmlDeviceGetComputeRunningProcesses" not in _calls("")  # an older or trimmed dump: not stated
    assert "nvmlDeviceGetComputeRunningProcesses" not in _calls("<processes>" + process.format(pid="[REDACTED]", kind="C", used="1 MiB") + "</processes>")


def test_the_importer_leaves_mixed_redacted_and_unknown_values_unrecorded() -> None:
    calls = _calls(
        "<ecc_errors><volatile><sram_uncorrectable>N/A</sram_uncorrectable><dram_uncorrectable>0</dram_uncorrectable></volatile></ecc_errors>"
        "<remapped_rows><remapped_row_corr>0</remapped_row_corr><remapped_row_unc>0</remapped_row_unc>"
        "<remapped_row_pending>[REDACTED]</remapped_row_pending><remapped_row_failure>No</remapped_row_failure></remapped_rows>"
        "<clocks_throttle_reasons><clocks_throttle_reason_gpu_idle>Active</clocks_throttle_reason_gpu_idle>"
        "<clocks_throttle_reason_something_new>Not Active</clocks_throttle_reason_something_new></clocks_throttle_reasons>"
        "<fabric><state>Completed</state><status>Success</status></fabric>"
        "<persistence_mode>Maybe</persistence_mode>"
    )
    for function in ("nvmlDeviceGetTotalEccErrors", "nvmlDeviceGetRemappedRows", "nvmlDeviceGetCurrentClocksThrottleReasons",
                     "nvmlDeviceGetGpuFabricInfo", "nvmlDeviceGetPersistenceMode"):
        assert function not in calls, function
    old = _calls("<ecc_errors><volatile><double_bit><device_memory>0</device_memory><total>4</total></double_bit></volatile></ecc_errors>")
    assert old["nvmlDeviceGetTotalEccErrors"] == {"0/1/0": {"result": 4}}
    with pytest.raises(ValueError, match="not an nvidia-smi"):
        IMPORTER.convert(b"<something/>")


def test_a_root_of_nvml_answers_alone_is_a_node_root(run_cli: Runner, tmp_path: Path) -> None:
    """`preflight node --root` takes a directory holding only `.preflight/` recordings."""
    IMPORTER.write_root((REAL_NVML / "dumps" / "telegraf-tesla-t4.xml").read_bytes(), tmp_path / "t4")
    result = run_cli("node", "--root", str(tmp_path / "t4"), "--format", "json", "--select", "GPU001,GDR003")
    assert result.returncode == 1, result.stderr  # GPU001's persistence warning, nothing worse
    found = {(f["id"], f["status"]) for f in json.loads(result.stdout)["findings"]}
    assert found == {("GPU001", "present"), ("GDR003", "unknown")}
