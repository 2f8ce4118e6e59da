"""GPU002: row remapping pending or failed, uncorrectable volatile ECC errors (replayed NVML
answers) and hardware Xids since boot (a recorded kernel log in /dev/kmsg's record format)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from preflight.probes.gpu_health import GpuHealth, probe_gpu_health
from preflight.checks.gpu import nccl_cuda_call_failed
from preflight.probes.gpus import probe_gpus
from preflight.probes.nvlink import probe_nvlink
from preflight.probes.kernel_log import KernelLogFacts, parse_xids, probe_kernel_log
from preflight.model import NotApplicable, Severity, Status, Unknown
from preflight.sources import Sources


def verdicts(root: Path, kernel_log: KernelLogFacts | None = None) -> list[tuple[str, Status, str]]:
    sources = Sources.for_node(str(root), None)
    log = kernel_log if kernel_log is not None else probe_kernel_log(sources.fs)
    found = nccl_cuda_call_failed(probe_gpu_health(sources.nvml), log, probe_gpus(sources.fs, sources.nvml), probe_nvlink(sources.nvml))
    return [(o.subject, o.status, " ".join(e.observed for e in o.evidence) + o.reason) for o in found]


def set_answers(root: Path, function: str, answers: dict[str, object]) -> None:
    path = root / ".preflight/nvml.json"
    document = json.loads(path.read_text())
    document["calls"].setdefault(function, {}).update(answers)
    path.write_text(json.dumps(document))


def set_rows(root: Path, answers: dict[str, object]) -> None:
    set_answers(root, "nvmlDeviceGetRemappedRows", answers)


def test_probe_reads_every_health_query_of_the_example(example_root: Path) -> None:
    facts = probe_gpu_health(Sources.for_node(str(example_root)).nvml)
    assert facts.nvml_error == "" and len(facts.gpus) == 8
    assert facts.gpus[3] == GpuHealth(3, 0, 0, False, False, "", True, "", True, True, "", 0, "", 0x1, "", None, "NVML_ERROR_NOT_SUPPORTED")


def test_clock_throttle_reasons_decide_nccl011(node_copy: Path) -> None:
    """NCCL011: an idle GPU's clocks held down by its hardware make its rank the straggler;
    idleness and the load-following power cap do not; an unanswered query is unknown, an
    unsupported one leaves the GPU out."""
    from preflight.checks.nccl import straggler_rank

    def decide() -> list[tuple[str, str]]:
        sources = Sources.for_node(str(node_copy))
        gpus = probe_gpus(sources.fs, sources.nvml)
        return [(o.subject, o.status.value) for o in straggler_rank(probe_gpu_health(sources.nvml), gpus)]

    def severity() -> list[Severity | None]:
        sources = Sources.for_node(str(node_copy))
        return [o.severity for o in straggler_rank(probe_gpu_health(sources.nvml), probe_gpus(sources.fs, sources.nvml))]

    assert decide() == []
    set_answers(node_copy, "nvmlDeviceGetCurrentClocksThrottleReasons", {"2": {"result": 0x5}, "5": {"result": 0x41}})
    assert decide() == [("GPU5", "present")]  # 0x5: idle under the power cap; 0x41: HW thermal slowdown
    assert severity() == [None]  # idle and held down: the reference's error
    # Busy (no GpuIdle bit), as a health check beside a running job reads it: a slowdown under load
    # may be a passing peak, a warning that never drains.
    for busy in (0x40, 0x08, 0x0C):
        set_answers(node_copy, "nvmlDeviceGetCurrentClocksThrottleReasons", {"5": {"result": busy}})
        assert decide() == [("GPU5", "present")] and severity() == [Severity.WARNING]
    # Idle with the bare HW slowdown bit: nvml.h says a clock or P-state change sets it too, so one
    # reading is a warning; with the thermal or power-brake bit that names a cause, an error.
    set_answers(node_copy, "nvmlDeviceGetCurrentClocksThrottleReasons", {"5": {"result": 0x09}})
    assert decide() == [("GPU5", "present")] and severity() == [Severity.WARNING]
    for named in (0x49, 0x89, 0x21):
        set_answers(node_copy, "nvmlDeviceGetCurrentClocksThrottleReasons", {"5": {"result": named}})
        assert decide() == [("GPU5", "present")] and severity() == [None]
    set_answers(node_copy, "nvmlDeviceGetCurrentClocksThrottleReasons", {"5": {"error": "NVML_ERROR_UNKNOWN"}})
    assert decide() == [("GPU5", "unknown")]
    set_answers(node_copy, "nvmlDeviceGetCurrentClocksThrottleReasons", {"5": {"error": "NVML_ERROR_NOT_SUPPORTED"}})
    assert decide() == []


def test_healthy_gpus_are_absent(example_root: Path) -> None:
    assert verdicts(example_root) == []


def test_pending_and_failed_remaps_are_present(node_copy: Path) -> None:
    set_rows(node_copy, {"1": {"result": [0, 2, 1, 0]}, "4": {"result": [1, 9, 0, 1]}, "6": {"error": "NVML_ERROR_UNKNOWN"}, "7": {"result": "garbage"}})
    found = {subject: (status, text) for subject, status, text in verdicts(node_copy)}
    assert found["GPU1"][0] is Status.PRESENT and "remap pending; 2 rows" in found["GPU1"][1]
    assert found["GPU4"][0] is Status.PRESENT and "remapping failed" in found["GPU4"][1]
    assert found["GPU6"][0] is Status.UNKNOWN and found["GPU7"][0] is Status.UNKNOWN
    assert set(found) == {"GPU1", "GPU4", "GPU6", "GPU7"}


def test_gpus_before_ampere_are_judged_by_page_retirement(node_copy: Path) -> None:
    """Before Ampere a bad page is retired, not a row remapped, at the next driver load, reset or
    reboot: a retirement pending is present; a status that could not be read, or was not recorded,
    is unknown; GPUs that retire no pages (GeForce) are judged by their ECC counts alone."""
    set_rows(node_copy, {str(i): {"error": "NVML_ERROR_NOT_SUPPORTED"} for i in range(8)})
    set_answers(node_copy, "nvmlDeviceGetRetiredPagesPendingStatus", {
        **{str(i): {"result": 0} for i in range(8)}, "2": {"result": 1}, "5": {"error": "NVML_ERROR_UNKNOWN"},
        "6": {"error": "NVML_ERROR_NOT_SUPPORTED"},
    })
    document = json.loads((node_copy / ".preflight/nvml.json").read_text())
    del document["calls"]["nvmlDeviceGetRetiredPagesPendingStatus"]["7"]  # a recording made before it was read
    (node_copy / ".preflight/nvml.json").write_text(json.dumps(document))
    found = {subject: (status, text) for subject, status, text in verdicts(node_copy)}
    assert found["GPU2"] == (Status.PRESENT, "page retirement pending")
    assert found["GPU5"][0] is Status.UNKNOWN and "nvmlDeviceGetRetiredPagesPendingStatus: NVML_ERROR_UNKNOWN" in found["GPU5"][1]
    assert found["GPU7"][0] is Status.UNKNOWN and "NVML_NOT_RECORDED" in found["GPU7"][1]
    assert set(found) == {"GPU2", "GPU5", "GPU7"}


def test_gpus_without_row_remapping_are_not_applicable(node_copy: Path) -> None:
    set_rows(node_copy, {str(i): {"error": "NVML_ERROR_NOT_SUPPORTED"} for i in range(8)})
    set_answers(node_copy, "nvmlDeviceGetRetiredPagesPendingStatus", {str(i): {"error": "NVML_ERROR_NOT_SUPPORTED"} for i in range(8)})
    assert verdicts(node_copy) == []  # pre-Ampere GPUs with ECC: the ECC counts still decide
    set_answers(node_copy, "nvmlDeviceGetTotalEccErrors", {f"{i}/1/0": {"error": "NVML_ERROR_NOT_SUPPORTED"} for i in range(8)})
    with pytest.raises(NotApplicable, match="before Ampere"):
        verdicts(node_copy)


KMSG = (
    "6,1021,8812532211,-;NVRM: GPU at PCI:0000:5d:00: GPU-1f3a9c2e-7d41-4b1e-9d2a-1c0b8e7f6a55\n"
    "4,1022,8812532219,-;NVRM: Xid (PCI:0000:5d:00): 79, pid=51022, name=python, GPU has fallen off the bus.\n"
    "4,1023,8813000000,-;NVRM: Xid (PCI:0000:18:00): 13, pid=4410, name=train.py, Graphics SM Warp Exception\n"
    "4,1024,8814000000,-;NVRM: Xid (PCI:0000:5d:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.\n"
)


def severities(root: Path) -> dict[str, tuple[Status, Severity | None, str]]:
    sources = Sources.for_node(str(root), None)
    found = nccl_cuda_call_failed(probe_gpu_health(sources.nvml), probe_kernel_log(sources.fs), probe_gpus(sources.fs, sources.nvml), probe_nvlink(sources.nvml))
    return {o.subject: (o.status, o.severity, " | ".join(e.observed for e in o.evidence)) for o in found}


def test_hardware_xids_since_boot_are_present_and_application_faults_are_not(node_copy: Path) -> None:
    (node_copy / ".preflight/kmsg").write_text(KMSG)
    set_answers(node_copy, "nvmlDeviceGetName", {"3": {"error": "NVML_ERROR_GPU_IS_LOST"}})  # 0000:5d:00.0 is GPU3
    set_rows(node_copy, {"3": {"error": "NVML_ERROR_GPU_IS_LOST"}})
    found = verdicts(node_copy)
    assert [(s, st) for s, st, _ in found] == [("GPU 0000:5d:00", Status.PRESENT), ("GPU3", Status.UNKNOWN)]
    assert "Xid 79 (GPU has fallen off the bus); 2 event(s)" in found[0][2]
    assert severities(node_copy)["GPU 0000:5d:00"][1] is None  # still lost: the reference's error
    assert [e.code for e in parse_xids(KMSG.splitlines())] == [79, 13, 79]


def test_pci_device_key_reads_the_kernel_logs_sysfs_and_nvmls_forms() -> None:
    from preflight.probes.gpus import pci_device_key

    assert pci_device_key("0000:5d:00") == pci_device_key("0000:5d:00.0") == pci_device_key("00000000:5D:00.0") == (0, 0x5D, 0)
    assert pci_device_key("5d:00") == (0, 0x5D, 0) and pci_device_key("0001:3b:01.1") == (1, 0x3B, 1)
    for garbage in ("", "gpu", "0000:5d", "0000::00.0", "zz:yy:xx", "0000:5d:00:00", "123456789:00:00"):
        assert pci_device_key(garbage) is None, garbage


def test_an_xid_of_a_gpu_nvml_reads_clean_now_is_a_warning(node_copy: Path) -> None:
    """The kernel log keeps an Xid until the next reboot; after the GPU was reset, NVML reads it
    clean, and an old Xid must not drain the node at every job. An Xid whose aftermath NVML's
    queries cannot show (GSP) stays an error."""
    (node_copy / ".preflight/kmsg").write_text(
        KMSG
        + "4,1025,8815000000,-;NVRM: Xid (PCI:0000:18:00): 94, pid=7194, name=python, Contained: CE User Channel (0x9). RST: No, D-RST: No\n"
        + "4,1026,8816000000,-;NVRM: Xid (PCI:0000:2a:00): 119, pid=1, name=nvidia-smi, Timeout after 6s of waiting for RPC response from GPU1 GSP!\n"
    )
    found = severities(node_copy)  # every GPU of the example reads clean
    status, severity, text = found["GPU 0000:5d:00"]
    assert (status, severity) == (Status.PRESENT, Severity.WARNING)
    assert text.endswith(" | GPU3 answers NVML (not lost)")  # fallen off the bus (79): answering again is the reading
    assert found["GPU 0000:18:00"][:2] == (Status.PRESENT, Severity.WARNING)
    assert "GPU0: 0 uncorrectable ECC errors since the GPU was initialised" in found["GPU 0000:18:00"][2]
    assert found["GPU 0000:2a:00"][:2] == (Status.PRESENT, None)  # GSP: nothing NVML reads shows a reset
    # The contained error not yet cleared by a reset: uncorrectable errors counted since init.
    set_answers(node_copy, "nvmlDeviceGetTotalEccErrors", {"0/1/0": {"result": 1}})
    found = severities(node_copy)
    assert found["GPU 0000:18:00"][:2] == (Status.PRESENT, None) and found["GPU0"][0] is Status.PRESENT


def test_an_nvlink_xid_of_a_gpu_whose_links_are_all_up_now_is_a_warning(node_copy: Path) -> None:
    """An NVLink error (Xid 74) takes the link down until the GPU is reset: every link of that GPU
    active now is the reading that shows the reset. One link still down keeps the error."""
    (node_copy / ".preflight/kmsg").write_text(
        "4,1025,8815000000,-;NVRM: Xid (PCI:0000:2a:00): 74, pid=7194, name=python, NVLink: fatal error detected on link 3(0x0, 0x0, 0x10000, 0x0, 0x0, 0x0, 0x0)\n"
    )
    status, severity, text = severities(node_copy)["GPU 0000:2a:00"]  # GPU1
    assert (status, severity) == (Status.PRESENT, Severity.WARNING) and text.endswith(" | GPU1: all 18 NVLinks active")
    set_answers(node_copy, "nvmlDeviceGetNvLinkState", {"1/3": {"result": 0}})
    assert severities(node_copy)["GPU 0000:2a:00"][:2] == (Status.PRESENT, None)


def test_an_xid_is_cleared_only_by_the_reading_that_shows_its_aftermath(node_copy: Path) -> None:
    """A row-remap Xid (64) needs the remapped-rows reading: a GPU that answers NOT_SUPPORTED there
    (MIG mode, as real MIG A100 dumps show) is not clean because its ECC count reads 0."""
    (node_copy / ".preflight/kmsg").write_text(
        "4,1025,8815000000,-;NVRM: Xid (PCI:0000:18:00): 64, pid=7194, name=python, Row Remapping Failure\n"
    )
    set_rows(node_copy, {"0": {"error": "NVML_ERROR_NOT_SUPPORTED"}})
    assert severities(node_copy)["GPU 0000:18:00"][:2] == (Status.PRESENT, None)
    set_rows(node_copy, {"0": {"result": [0, 0, 0, 0]}})  # read clean: reset since, remap applied
    status, severity, text = severities(node_copy)["GPU 0000:18:00"]
    assert (status, severity) == (Status.PRESENT, Severity.WARNING) and "GPU0: no row remap pending or failed" in text


def test_a_page_retirement_xid_before_ampere_is_cleared_by_no_retirement_pending(node_copy: Path) -> None:
    """Before Ampere Xid 63 is a page retired at the next driver load, which NVML shows pending
    until then: none pending now means the GPU was reset since. A failed retirement (64) shows
    nowhere in NVML there and stays an error."""
    (node_copy / ".preflight/kmsg").write_text(
        "4,1025,8815000000,-;NVRM: Xid (PCI:0000:18:00): 63, pid=7194, name=python, Dynamic Page Retirement: New retired page\n"
        "4,1026,8815000001,-;NVRM: Xid (PCI:0000:2a:00): 64, pid=7194, name=python, Dynamic Page Retirement: Fatal error\n"
    )
    set_rows(node_copy, {"0": {"error": "NVML_ERROR_NOT_SUPPORTED"}, "1": {"error": "NVML_ERROR_NOT_SUPPORTED"}})
    set_answers(node_copy, "nvmlDeviceGetRetiredPagesPendingStatus", {"0": {"result": 0}, "1": {"result": 0}})
    found = severities(node_copy)
    status, severity, text = found["GPU 0000:18:00"]
    assert (status, severity) == (Status.PRESENT, Severity.WARNING) and "GPU0: no page retirement pending" in text
    assert found["GPU 0000:2a:00"][:2] == (Status.PRESENT, None)
    set_answers(node_copy, "nvmlDeviceGetRetiredPagesPendingStatus", {"0": {"result": 1}})
    found = severities(node_copy)
    assert found["GPU 0000:18:00"][:2] == (Status.PRESENT, None) and found["GPU0"][0] is Status.PRESENT


def test_xids_of_a_gpu_in_mig_mode_name_their_instance_and_still_count() -> None:
    """In MIG mode the driver puts the GPU (and compute) instance inside the parenthesis; the
    line is NVIDIA's own example (open-gpu-kernel-modules, kern_gpu_error_cont_ga100.c)."""
    records = [
        "NVRM: Xid (PCI:0000:01:00 GPU-I:05): 94, pid=7194, Contained: CE User Channel (0x9). RST: No, D-RST: No",
        "NVRM: Xid (PCI:0000:3b:00 GPU-I:01 GPU-CI:02): 95, pid=9, name=a, Uncontained: LTC TAG (0x2, 0x1). RST: Yes, D-RST: No",
    ]
    assert [(event.bus, event.code) for event in parse_xids(records)] == [("0000:01:00", 94), ("0000:3b:00", 95)]


def test_unreadable_kernel_log_is_unknown_beside_the_nvml_verdict(node_copy: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    from preflight.sources import NodeFS

    def refuse(path: str, flags: int, *args: object) -> int:
        raise PermissionError(13, "Operation not permitted", path)

    monkeypatch.setattr(os, "open", refuse)  # what /dev/kmsg answers a non-root reader under dmesg_restrict
    facts = probe_kernel_log(NodeFS("/"))
    assert "permission denied (EACCES); needs root" in facts.error and not facts.read
    monkeypatch.undo()
    set_rows(node_copy, {"2": {"result": [0, 1, 1, 0]}})
    found = {subject: (status, text) for subject, status, text in verdicts(node_copy, facts)}
    assert found["kernel log"][0] is Status.UNKNOWN and "Xid history since boot unread" in found["kernel log"][1]
    assert "needs root" in found["kernel log"][1] and found["GPU2"][0] is Status.PRESENT  # the NVML half still decides
    (node_copy / ".preflight/kmsg").unlink()
    # No recorded log at all is no quiet log: the Xid half stays unknown, and says why.
    missing = {subject: (status, text) for subject, status, text in verdicts(node_copy)}
    assert missing["GPU2"][0] is Status.PRESENT and missing["kernel log"][0] is Status.UNKNOWN
    assert "records no kernel log (.preflight/kmsg)" in missing["kernel log"][1]


def test_uncorrectable_volatile_ecc_errors_are_present(node_copy: Path) -> None:
    set_answers(node_copy, "nvmlDeviceGetTotalEccErrors", {"4/1/0": {"result": 3}, "6/1/0": {"result": 2}})
    set_answers(node_copy, "nvmlDeviceGetPersistenceMode", {"6": {"result": 0}})
    set_answers(node_copy, "nvmlDeviceGetEccMode", {"6": {"result": [0, 1]}})  # ECC off now: nothing is counted
    found = verdicts(node_copy)
    assert [(s, st) for s, st, _ in found] == [("GPU4", Status.PRESENT)]
    assert "3 uncorrectable ECC errors since the driver initialised the GPU (persistence mode on" in found[0][2]
    set_answers(node_copy, "nvmlDeviceGetEccMode", {"6": {"result": [1, 1]}})
    found = dict((s, text) for s, _, text in verdicts(node_copy))
    assert "initialised for the current or last client (persistence mode off)" in found["GPU6"]


def test_ecc_and_persistence_errors_and_garbage(node_copy: Path) -> None:
    set_answers(node_copy, "nvmlDeviceGetTotalEccErrors", {
        "0/1/0": {"error": "NVML_ERROR_NOT_SUPPORTED"}, "1/1/0": {"error": "NVML_ERROR_NO_PERMISSION"},
        "2/1/0": {"result": -4}, "3/1/0": {"error": "NVML_ERROR_GPU_IS_LOST"},
    })
    set_answers(node_copy, "nvmlDeviceGetEccMode", {"5": {"result": "on"}})
    found = {subject: (status, text) for subject, status, text in verdicts(node_copy)}
    assert set(found) == {"GPU1", "GPU2", "GPU3"} and all(status is Status.UNKNOWN for status, _ in found.values())
    assert "NO_PERMISSION" in found["GPU1"][1] and "unexpected answer -4" in found["GPU2"][1]
    assert "GPU001 reports the lost GPU" in found["GPU3"][1]
    facts = probe_gpu_health(Sources.for_node(str(node_copy)).nvml)
    assert facts.gpus[5].ecc_current is None and "unexpected answer" in facts.gpus[5].ecc_mode_error


def test_nvml_unavailable_is_unknown_with_gpus_on_the_bus(node_copy: Path) -> None:
    path = node_copy / ".preflight/nvml.json"
    path.write_text(json.dumps({"format": "preflight-nvml/1", "init": {"error": "NVML_ERROR_LIBRARY_NOT_FOUND"}}))
    with pytest.raises(Unknown, match="LIBRARY_NOT_FOUND.*8 GPUs on the PCI bus"):
        verdicts(node_copy)
    (node_copy / ".preflight/kmsg").write_text(KMSG)
    found = verdicts(node_copy)  # the kernel log still speaks; NVML's half is unknown
    assert [(s, st) for s, st, _ in found] == [("GPU 0000:5d:00", Status.PRESENT), ("NVML", Status.UNKNOWN)]
    assert severities(node_copy)["GPU 0000:5d:00"][1] is None  # nothing read says it recovered: an error


def test_live_kernel_log_reads_or_names_the_privilege(tmp_path: Path) -> None:
    from preflight.sources import NodeFS, SourceError

    try:
        records = NodeFS("/").read_kernel_log(max_bytes=1 << 16)
    except SourceError as error:
        assert "needs root" in str(error) or "kmsg" in str(error)
    else:
        assert records is None or all(isinstance(record, str) for record in records)
