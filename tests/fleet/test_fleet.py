"""``preflight fleet`` on hand-built report sets: odd one out, hardware classes, ties, missing
and garbage facts, per-reference rows, exit codes, and the JSON schema.

Every report starts from the golden report of the example node (real facts from a real probe
run) with its findings cleared, then has the one fact a test is about changed by hand.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from conftest import REPO, Runner
from preflight.exitcodes import ExitCode
from preflight.fleet import audit, run_fleet
from preflight.fleet.compare import ODD, SAME, TIE, fleet_exit_code
from preflight.fleet.facts import FACTS, Fact, extract_all
from preflight.hostlist import expand
from preflight.fleet.render import compress_hosts, fleet_json, render_table

GOLDEN = json.loads((REPO / "tests" / "golden" / "hgx-h100.json").read_text())
SCHEMA = json.loads((REPO / "preflight" / "schemas" / "fleet-v1.schema.json").read_text())


def report(host: str, findings: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """A clean report of the example node under another name."""
    document = copy.deepcopy(GOLDEN)
    document.update(host=host, root="/", started_at=1.0, duration_s=0.5, findings=findings or [])
    return document


def finding(ref_id: str, status: str = "present", severity: str = "error", subject: str = "node", **extra: Any) -> dict[str, Any]:
    base = {"id": ref_id, "symbol": "some-symbol", "title": "t", "status": status, "severity": severity,
            "subject": subject, "evidence": [], "fix": "", "reason": ""}
    return {**base, **extra}


def set_mtu(document: dict[str, Any], netdev: str, mtu: int) -> None:
    for link in document["facts"]["interfaces"]["links"]:
        if link["name"] == netdev:
            link["mtu"] = mtu


def write_all(directory: Path, documents: list[dict[str, Any]]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for document in documents:
        (directory / f"{document['host']}.json").write_text(json.dumps(document))
    return directory


def comparison(fleet: Any, key: str) -> Any:
    (found,) = [c for c in fleet.comparisons if c.fact.key == key]
    return found


def test_a_minority_value_is_flagged_with_the_majority_value(tmp_path: Path) -> None:
    documents = [report(f"gpu00{i}") for i in range(1, 5)]
    set_mtu(documents[2], "ibp26s0", 2044)
    fleet = audit([str(write_all(tmp_path / "r", documents))])
    mtu = comparison(fleet, "rdma_mtu")
    assert (mtu.verdict, mtu.odd, mtu.common) == (ODD, ("gpu003",), "4092")
    assert [(g.value, g.hosts) for g in mtu.values] == [("4092", ("gpu001", "gpu002", "gpu004")), ("2044, 4092", ("gpu003",))]
    assert [c.fact.key for c in fleet.disagreements] == ["rdma_mtu"]
    assert fleet_exit_code(fleet) is ExitCode.ERROR
    table = render_table(fleet, width=200)  # wide: no cell wraps
    assert "ODD ONE OUT" in table and "gpu003" in table and "4092 (3 nodes)" in table


def test_an_unreadable_or_unrecorded_rdma_stack_is_unknown_not_odd(tmp_path: Path) -> None:
    documents = [report(f"gpu00{i}") for i in range(1, 5)]
    documents[1]["facts"]["rdma"].update(mlx5_driver_version=None, problems=[{"path": "/sys/module/mlx5_core/version", "reason": "permission denied (EACCES)"}])
    del documents[2]["facts"]["rdma"]["mlx5_driver_version"]  # a report from an older preflight
    stack = comparison(audit([str(write_all(tmp_path / "r", documents))]), "rdma_stack")
    assert (stack.verdict, stack.common, stack.unknown) == (SAME, "24.01-0.3.3", ("gpu002", "gpu003"))


@pytest.mark.parametrize(
    ("key", "unread"),
    [
        ("hca_firmware", lambda d: d["facts"]["rdma"]["devices"][3].update(fw_ver=None)),
        ("port_rates", lambda d: d["facts"]["rdma"]["devices"][1]["ports"][0].update(rate=None)),
        ("nccl_conf", lambda d: d["facts"]["job"]["nccl_conf_files"][0].update(entries=[], error="permission denied (EACCES)")),
        ("peer_memory", lambda d: d["facts"]["gpudirect"].update(peer_memory_files=[], peer_memory_unknown=["/sys/module/nvidia_peermem/version"])),
        ("memlock_slurmd", lambda d: d["facts"]["memlock"].update(slurmd=None, slurmd_pid=None, problems=["/proc: permission denied (EACCES)"])),
    ],
)
def test_a_value_a_node_could_not_read_makes_it_unknown_not_the_odd_one_out(tmp_path: Path, key: str, unread: Any) -> None:
    """Missing is not empty: a firmware, rate, nccl.conf, peer-memory file or /proc listing the
    probe could not read leaves that node out of the comparison, under unknown, instead of naming
    it the odd one out (and failing the audit) for a read error."""
    documents = [report(f"node{i}") for i in range(1, 6)]
    unread(documents[2])
    found = comparison(audit([str(write_all(tmp_path / "r", documents))]), key)
    assert (found.verdict, found.unknown) == (SAME, ("node3",))


def test_reports_of_other_profiles_or_versions_are_named_in_the_summary(tmp_path: Path) -> None:
    """A node audited with the prolog profile shows nothing for the checks only the full profile
    runs: the summary says the runs are mixed, in the table and the pages alike."""
    from preflight.fleet.pages import render_markdown

    documents = [report(f"gpu00{i}") for i in range(1, 6)]
    documents[4]["profile"] = "prolog"
    documents[3]["tool"]["version"] = documents[2]["tool"]["version"] = "0.0.1"
    fleet = audit([str(write_all(tmp_path / "r", documents))])
    assert "mixed runs, compare with care: profiles: full 4, prolog 1 · preflight versions: " in render_table(fleet, width=200)
    assert "0.0.1 2" in render_table(fleet, width=200) and "mixed runs, compare with care" in render_markdown(fleet)
    same = audit([str(write_all(tmp_path / "same", documents[:2]))])
    assert "mixed runs" not in render_table(same, width=200)


def test_an_agreeing_clean_fleet_exits_zero_and_lists_nothing_odd(tmp_path: Path) -> None:
    fleet = audit([str(write_all(tmp_path / "r", [report(f"gpu00{i}") for i in range(1, 4)]))])
    assert not fleet.disagreements and not fleet.references
    assert {c.verdict for c in fleet.comparisons} == {SAME}
    assert fleet_exit_code(fleet) is ExitCode.OK
    assert "ODD ONE OUT" not in render_table(fleet, width=200)


@pytest.mark.parametrize(
    ("key", "change", "odd_value"),
    [
        ("nccl_libraries", lambda d: d["facts"]["nccl_libs"]["copies"][0].update(version="2.18.3"), "2.18.3 (system), 2.21.5 (python)"),
        ("nvidia_driver", lambda d: d["facts"]["gpus"].update(driver_version="535.104.05"), "535.104.05"),
        ("hca_firmware", lambda d: d["facts"]["rdma"]["devices"][5].update(fw_ver="28.36.1010"), "28.36.1010, 28.39.1002"),
        ("rdma_stack", lambda d: d["facts"]["rdma"].update(mlx5_driver_version="23.10-1.1.9"), "23.10-1.1.9"),
        ("rdma_stack", lambda d: d["facts"]["rdma"].update(mlx5_driver_version=""), "inbox"),
        ("rdma_stack", lambda d: d["facts"]["rdma"].update(mlx5_driver_version=d["facts"]["gpudirect"]["kernel_release"]), "inbox"),
        ("rdma_stack", lambda d: d["facts"]["rdma"].update(mlx5_driver_version=None), "mlx5_core not loaded"),
        ("kernel", lambda d: d["facts"]["gpudirect"].update(kernel_release="5.15.0-91-generic"), "5.15.0-91-generic"),
        ("memlock_slurmd", lambda d: d["facts"]["memlock"]["slurmd"].update(soft=65536, hard=65536), "soft 64 KiB, hard 64 KiB"),
        ("nccl_conf", lambda d: d["facts"]["job"]["nccl_conf_files"][0].update(entries=[["NCCL_IB_HCA", "mlx5_0"]]), "/etc/nccl.conf: NCCL_IB_HCA=mlx5_0"),
        ("peer_memory", lambda d: d["facts"]["gpudirect"].update(peer_memory_files=["/sys/module/nvidia_peermem/version"]), "nvidia_peermem"),
        ("acs_redirect", lambda d: d["facts"]["pcie"]["bridges"][0]["acs"].update(control=0x1D), "on at 0000:17:00.0, 0000:5c:00.0"),
        ("hca_names", lambda d: d["facts"]["rdma"]["devices"][7].update(name="mlx5_9"), "mlx5_0, mlx5_1, mlx5_2, mlx5_3, mlx5_4, mlx5_5, mlx5_6, mlx5_9"),
        ("gpu_count_nvml", lambda d: d["facts"]["gpus"].update(devices=d["facts"]["gpus"]["devices"][:7]), "7"),
        ("hca_count", lambda d: d["facts"]["rdma"]["devices"].pop(), "7"),
        ("port_rates", lambda d: d["facts"]["rdma"]["devices"][1]["ports"][0]["rate"].update(gbps=200.0, speed="HDR"),
         "200 Gb/s (4X HDR), 400 Gb/s (4X NDR)"),
        ("ipoib_mode", lambda d: d["facts"]["rdma"]["devices"][0]["ports"][0].update(ipoib_mode="connected"), "connected, datagram"),
        ("driver_flavour", lambda d: d["facts"]["gpudirect"].update(driver_flavour="open"), "open"),
        ("gdrdrv", lambda d: d["facts"]["gpudirect"].update(gdrdrv_loaded=True), "yes"),
        ("memlock_propagated", lambda d: d["facts"]["memlock"].update(memlock_propagated=False), "no"),
        ("nvswitches", lambda d: d["facts"]["fabric"].update(nvswitches=d["facts"]["fabric"]["nvswitches"][:3]), "3"),
        ("fabric_manager", lambda d: d["facts"]["fabric"]["fabric_manager"].update(pids=[], listening=None), "no"),
        ("nvlinks_active", lambda d: d["facts"]["nvlink"]["gpus"][5].update(active_count=12),
         "GPU0 18, GPU1 18, GPU2 18, GPU3 18, GPU4 18, GPU5 12, GPU6 18, GPU7 18"),
        ("ecc_mode", lambda d: d["facts"]["gpu_health"]["gpus"][2].update(ecc_current=False, ecc_pending=False),
         "GPU0 on, GPU1 on, GPU2 off, GPU3 on, GPU4 on, GPU5 on, GPU6 on, GPU7 on"),
        ("ecc_mode", lambda d: [gpu.update(ecc_pending=False) for gpu in d["facts"]["gpu_health"]["gpus"]], "on (pending off)"),
    ],
)
def test_each_compared_fact_flags_the_node_that_differs(tmp_path: Path, key: str, change: Any, odd_value: str) -> None:
    documents = [report(f"node{i}") for i in range(1, 6)]
    change(documents[3])
    fleet = audit([str(write_all(tmp_path / "r", documents))])
    found = comparison(fleet, key)
    assert found.verdict == ODD and found.odd == ("node4",)
    assert [g.value for g in found.values if "node4" in g.hosts] == [odd_value]
    # a missing HCA is also a missing name; another NCCL copy's version is also another version
    follows = {"hca_count": {"hca_names"}, "nccl_libraries": {"nccl_versions"}}.get(key, set())
    assert {c.fact.key for c in fleet.disagreements} == {key} | follows


def roce_port(device: str, index: int | None) -> dict[str, Any]:
    """The parts of a RocePort (checks/roce.py) the fleet reads."""
    return {"device": device, "port": 1, "nccl_job": {"index": index, "forced": False}, "mtu": 4200}


def test_the_gid_index_nccl_picks_is_compared_on_roce_nodes(tmp_path: Path) -> None:
    documents = [report(f"roce{i}") for i in range(1, 6)]
    for document in documents:
        document["facts"]["roce"]["ports"] = [roce_port("mlx5_0", 3), roce_port("mlx5_1", 3)]
    documents[1]["facts"]["roce"]["ports"][1]["nccl_job"]["index"] = 0  # a port without its RoCE v2 IPv4 GID
    documents[2]["facts"]["roce"]["ports"][0]["nccl_job"] = None  # the table was unreadable
    documents[3]["facts"]["roce"]["ports"][0]["nccl_job"]["index"] = None  # no GID NCCL can use
    found = comparison(audit([str(write_all(tmp_path / "r", documents))]), "nccl_gid_index")
    assert (found.verdict, found.common, found.odd, found.unknown) == (ODD, "3", ("roce2", "roce4"), ("roce3",))
    assert [(g.value, g.hosts) for g in found.values] == [("3", ("roce1", "roce5")), ("0, 3", ("roce2",)), ("3, no usable GID", ("roce4",))]


def test_nodes_are_compared_only_within_their_hardware_class(tmp_path: Path) -> None:
    h100 = [report(f"h{i}") for i in range(1, 4)]
    a100 = [report(f"a{i}") for i in range(1, 3)]
    for document in a100:
        for device in document["facts"]["gpus"]["devices"]:
            device["name"] = "NVIDIA A100-SXM4-80GB"
        document["facts"]["gpus"]["driver_version"] = "535.104.05"
        for device in document["facts"]["rdma"]["devices"]:
            device["hca_type"] = "MT4123"
            device["fw_ver"] = "20.39.1002"
    fleet = audit([str(write_all(tmp_path / "r", h100 + a100))])
    assert [(g.hardware.label, g.hosts) for g in fleet.classes] == [
        ("8x NVIDIA H100 80GB HBM3 / MT4129", ("h1", "h2", "h3")),
        ("8x NVIDIA A100-SXM4-80GB / MT4123", ("a1", "a2")),
    ]
    # Two classes that differ in driver and firmware: nobody is odd.
    assert not fleet.disagreements
    drivers = [c for c in fleet.comparisons if c.fact.key == "nvidia_driver"]
    assert sorted((c.group, c.common) for c in drivers) == [
        ("8x NVIDIA A100-SXM4-80GB / MT4123", "535.104.05"),
        ("8x NVIDIA H100 80GB HBM3 / MT4129", "550.54.15"),
    ]


def test_a_node_that_lost_a_gpu_from_the_bus_is_its_own_class_but_flagged_in_its_family(tmp_path: Path) -> None:
    documents = [report(f"gpu00{i}") for i in range(1, 5)]
    facts = documents[1]["facts"]["gpus"]
    facts["pci_gpus"] = facts["pci_gpus"][:7]
    facts["devices"] = facts["devices"][:7]
    fleet = audit([str(write_all(tmp_path / "r", documents))])
    assert [g.hardware.gpu_count for g in fleet.classes] == ["8", "7"]
    found = comparison(fleet, "gpu_count_pci")
    assert (found.group, found.verdict, found.odd, found.common) == ("NVIDIA H100 80GB HBM3 / MT4129", ODD, ("gpu002",), "8")
    # Within its own one-node class there is nobody to compare with.
    assert {c.fact.key for c in fleet.disagreements} == {"gpu_count_pci"}


def test_a_tie_names_no_node_but_counts_as_a_disagreement(tmp_path: Path) -> None:
    documents = [report(f"gpu00{i}") for i in range(1, 5)]
    for document in documents[2:]:
        document["facts"]["gpudirect"]["kernel_release"] = "6.8.0-45-generic"
    fleet = audit([str(write_all(tmp_path / "r", documents))])
    kernel = comparison(fleet, "kernel")
    assert (kernel.verdict, kernel.odd, kernel.common) == (TIE, (), None)
    assert [g.hosts for g in kernel.values] == [("gpu001", "gpu002"), ("gpu003", "gpu004")]
    assert fleet_exit_code(fleet) is ExitCode.ERROR
    table = render_table(fleet, width=200)  # wide: no cell wraps
    assert "(tie: no majority)" in table and "6.8.0-45-generic: gpu[003-004]" in table
    assert fleet_json(fleet)["summary"]["odd_nodes"] == []


def test_tables_fit_the_terminal_width_and_lose_no_word(tmp_path: Path) -> None:
    documents = [report(f"gpu00{i}") for i in range(1, 8)]
    long_release = "6.8.0-45-generic with a long vendor build tag"
    documents[3]["facts"]["gpudirect"]["kernel_release"] = long_release
    set_mtu(documents[5], "ibp26s0", 2044)
    fleet = audit([str(write_all(tmp_path / "r", documents))])
    for width in (80, 100):
        table = render_table(fleet, width=width)
        assert max(len(line) for line in table.splitlines()) <= width, table
        words = set(table.split())
        assert {"gpu004", "gpu006", "2044,"} <= words and set(long_release.split()) <= words


def test_a_three_way_split_flags_everyone_outside_the_most_common_value(tmp_path: Path) -> None:
    documents = [report(f"n{i}") for i in range(1, 6)]
    documents[3]["facts"]["gpus"]["driver_version"] = "535.1"
    documents[4]["facts"]["gpus"]["driver_version"] = "535.2"
    found = comparison(audit([str(write_all(tmp_path / "r", documents))]), "nvidia_driver")
    assert (found.verdict, found.odd, found.common) == (ODD, ("n4", "n5"), "550.54.15")


def test_missing_and_garbage_facts_are_unknown_never_odd(tmp_path: Path) -> None:
    documents = [report(f"gpu00{i}") for i in range(1, 6)]
    del documents[0]["facts"]["nccl_libs"]  # an older report, or the probe failed
    documents[0]["probes"] = [{"name": "nccl_libs", "status": "timeout", "duration_s": 3.0, "error": "timed out after 3.0 s"}]
    documents[1]["facts"]["interfaces"]["links"] = "garbage"
    documents[2]["facts"]["memlock"]["slurmd"] = {"soft": 1.5e300, "hard": "lots"}
    documents[3]["facts"]["pcie"]["bridges"][2]["unreadable"] = "config: 64 bytes (needs root)"
    documents[4]["facts"]["gpudirect"] = ["not", "an", "object"]
    fleet = audit([str(write_all(tmp_path / "r", documents))])
    assert not fleet.skipped and not fleet.disagreements
    unknown = {c.fact.key: c.unknown for c in fleet.comparisons if c.unknown}
    assert unknown == {
        "nccl_libraries": ("gpu001",),
        "nccl_versions": ("gpu001",),
        "rdma_mtu": ("gpu002",),
        "memlock_slurmd": ("gpu003",),
        "acs_redirect": ("gpu004",),
        "driver_flavour": ("gpu005",),
        "kernel": ("gpu005",),
        "peer_memory": ("gpu005",),
        "gdrdrv": ("gpu005",),
    }
    node = next(n for n in fleet.nodes if n.host == "gpu001")
    assert node.failed_probes == {"nccl_libs": "timed out after 3.0 s"}
    assert "nccl_libs: gpu001" in render_table(fleet, width=200)


def test_a_report_without_rdma_facts_gets_an_unknown_nic_class(tmp_path: Path) -> None:
    documents = [report(f"gpu00{i}") for i in range(1, 4)]
    del documents[0]["facts"]["rdma"]  # a prolog-profile report: rdma is a full-profile probe
    fleet = audit([str(write_all(tmp_path / "r", documents))])
    assert sorted(g.hardware.label for g in fleet.classes) == [
        "8x NVIDIA H100 80GB HBM3 / MT4129", "8x NVIDIA H100 80GB HBM3 / unknown NIC",
    ]


def test_extraction_never_raises_whatever_the_facts() -> None:
    def broken(facts: Any) -> str | None:
        raise ZeroDivisionError

    table = (*FACTS, Fact("broken", "Broken", (), broken))
    for facts in ({}, {"rdma": None}, {"rdma": {"devices": [1, "x", None, {"ports": "y"}]}}, {"gpus": {"devices": {}}},
                  {"job": {"nccl_conf_files": [{"entries": [[1, 2], "x", ["a"]]}]}}, {"roce": {"ports": [{"nccl_job": 5}]}}):
        values = extract_all(facts, table)
        assert set(values) == {fact.key for fact in table} and values["broken"] is None


def test_per_reference_rows_name_present_and_unknown_nodes(tmp_path: Path) -> None:
    documents = [
        report("gpu001", [finding("MEM001", subject="slurmd", evidence=[{"source": "/proc/2187/limits", "observed": "8 MiB", "expected": "unlimited"}])]),
        report("gpu002", [finding("MEM001", status="unknown", reason="/proc/2187/limits: permission denied")]),
        report("gpu003", [finding("NCCL002", severity="warning")]),
        report("gpu004"),
    ]
    fleet = audit([str(write_all(tmp_path / "r", documents))])
    rows = {row.id: row for row in fleet.references}
    assert [(m.host, m.subjects, m.detail) for m in rows["MEM001"].present] == [("gpu001", ("slurmd",), ("8 MiB (expected unlimited)",))]
    assert [(m.host, m.detail) for m in rows["MEM001"].unknown] == [("gpu002", ("/proc/2187/limits: permission denied",))]
    assert rows["NCCL002"].worst is not None and rows["NCCL002"].worst.value == "warning"
    assert fleet_exit_code(fleet) is ExitCode.ERROR


def test_warnings_alone_exit_one_and_unknowns_alone_exit_zero(tmp_path: Path) -> None:
    warned = audit([str(write_all(tmp_path / "w", [report("a", [finding("NCCL002", severity="warning")]), report("b")]))])
    assert fleet_exit_code(warned) is ExitCode.WARNING
    unknown = audit([str(write_all(tmp_path / "u", [report("a", [finding("MEM001", status="unknown")]), report("b")]))])
    assert fleet_exit_code(unknown) is ExitCode.OK
    info = audit([str(write_all(tmp_path / "i", [report("a", [finding("NCCL002", severity="info")]), report("b")]))])
    assert fleet_exit_code(info) is ExitCode.OK


def test_site_expectations_from_findings_are_shown_beside_the_count(tmp_path: Path) -> None:
    documents = [report(f"gpu00{i}") for i in range(1, 4)]
    documents[0]["findings"] = [finding("GPU001", evidence=[
        {"source": "nvmlDeviceGetCount", "observed": "8 GPUs", "expected": "16 (expect.gpu_count)"}])]
    fleet = audit([str(write_all(tmp_path / "r", documents))])
    expectations = comparison(fleet, "gpu_count_nvml").expectations
    assert [(e.host, e.reference_id, e.observed, e.expected) for e in expectations] == [("gpu001", "GPU001", "8 GPUs", "16 (expect.gpu_count)")]
    assert "EXPECTED VS ACTUAL" in render_table(fleet, width=200)


def test_ignore_fact_leaves_a_fact_out(tmp_path: Path) -> None:
    documents = [report(f"gpu00{i}") for i in range(1, 4)]
    set_mtu(documents[0], "ibp26s0", 2044)
    directory = str(write_all(tmp_path / "r", documents))
    fleet = audit([directory], ignore_facts=["rdma_mtu"])
    assert not fleet.disagreements and "rdma_mtu" not in {fact.key for fact in fleet.facts}
    assert run_fleet([directory], ignore_facts=["no_such_fact"]) == ExitCode.NO_VERDICT


def test_json_output_follows_the_fleet_schema(tmp_path: Path) -> None:
    documents = [report(f"gpu00{i}") for i in range(1, 5)]
    set_mtu(documents[1], "ibp44s0", 9000)
    documents[0]["findings"] = [finding("MEM001"), finding("DNS001", status="unknown", reason="timeout")]
    directory = write_all(tmp_path / "r", documents)
    (directory / "junk.json").write_text("{")
    output = tmp_path / "fleet.json"
    code = run_fleet([str(directory)], "json", str(output))
    document = json.loads(output.read_text())
    jsonschema.validate(document, SCHEMA)
    assert code == ExitCode.ERROR == document["summary"]["exit_code"]
    assert document["summary"]["odd_nodes"] == ["gpu002"]
    assert document["summary"]["nodes_with_present"] == ["gpu001"]
    assert [s["file"] for s in document["skipped"]] == [str(directory / "junk.json")]
    assert [f["key"] for f in document["facts"]] == [fact.key for fact in FACTS]


def test_node_names_from_file_names_name_nodes_by_inventory_name_as_well_as_host(run_cli: Runner, tmp_path: Path) -> None:
    """Reports saved under inventory names whose host names differ (two even share one, as
    cloned images do): with --node-names file every node is kept and named by its file, and
    the JSON and the table give its host name beside it."""
    reports = tmp_path / "reports"
    reports.mkdir()
    documents = {"rack1-a": report("localhost"), "rack1-b": report("localhost"), "rack1-c": report("gpu-c")}
    set_mtu(documents["rack1-b"], "ibp26s0", 2044)
    for name, document in documents.items():
        (reports / f"{name}.json").write_text(json.dumps(document))
    (reports / "bad name!.json").write_text(json.dumps(report("gpu-d")))

    by_host = json.loads(run_cli("fleet", "--format", "json", str(reports)).stdout)
    assert [n["name"] for n in by_host["nodes"]] == ["gpu-c", "gpu-d", "localhost"]  # one localhost dropped
    assert any("a second report for host localhost" in s["reason"] for s in by_host["skipped"])

    result = run_cli("fleet", "--node-names", "file", "--format", "json", str(reports))
    document = json.loads(result.stdout)
    jsonschema.validate(document, SCHEMA)
    assert [(n["name"], n["host"]) for n in document["nodes"]] == [("rack1-a", "localhost"), ("rack1-b", "localhost"), ("rack1-c", "gpu-c")]
    assert document["summary"]["odd_nodes"] == ["rack1-b"]
    assert [(s["file"], s["reason"]) for s in document["skipped"]] == [
        (str(reports / "bad name!.json"), "file name 'bad name!' is not a plain node name (letters, digits, '.', '-', '_')")
    ]
    table = run_cli("fleet", "--node-names", "file", str(reports)).stdout
    assert "NODE NAMES" in table and "  rack1-a: localhost\n" in table and "  rack1-c: gpu-c\n" in table
    refused = run_cli("fleet", "--node-names", "inventory", str(reports))
    assert refused.returncode == ExitCode.NO_VERDICT and "--node-names 'inventory': choose one of host, file" in refused.stderr


def test_fact_table_keys_and_labels_are_unique() -> None:
    assert len({fact.key for fact in FACTS}) == len({fact.label for fact in FACTS}) == len(FACTS)
    assert {fact.scope for fact in FACTS} <= {"class", "family"}


def test_compress_hosts() -> None:
    assert compress_hosts(["gpu003", "gpu001", "gpu002", "gpu007", "login", "gpu1"]) == "gpu1,gpu[001-003,007],login"
    fqdn = ["gpu02.dc1.example", "gpu01.dc1.example", "gpu03.dc2.example", "gpu04.dc1.example"]
    folded = compress_hosts(fqdn)
    assert folded == "gpu03.dc2.example,gpu[01-02,04].dc1.example"
    assert sorted(expand(folded)) == sorted(fqdn)  # the fold is a Slurm hostlist that expands back
    assert compress_hosts(["a9", "a10", "a11"]) == "a9,a[10-11]"  # widths differ: not one zero-padded range


def test_cli_end_to_end_on_real_reports(run_cli: Runner, tmp_path: Path, clean_root: Path) -> None:
    """Reports written by `preflight node` on recorded roots; one node's nccl.conf differs."""
    import shutil

    from conftest import write

    reports = tmp_path / "reports"
    reports.mkdir()
    for number in range(1, 4):
        root = tmp_path / f"node{number}"
        shutil.copytree(clean_root, root, symlinks=True)
        write(root, "/proc/sys/kernel/hostname", f"gpu00{number}\n")
        if number == 2:
            write(root, "/etc/nccl.conf", "NCCL_IB_HCA=mlx5\nNCCL_IB_GID_INDEX=3\n")
        result = run_cli("node", "--root", str(root), "--format", "json")
        assert result.returncode in (0, 1), result.stderr
        (reports / f"gpu00{number}.json").write_text(result.stdout)
    table = run_cli("fleet", str(reports))
    assert table.returncode == ExitCode.ERROR, table.stderr
    assert "nccl.conf" in table.stdout and "gpu002" in table.stdout
    as_json = run_cli("fleet", "--format", "json", *sorted(str(p) for p in reports.iterdir()))
    document = json.loads(as_json.stdout)
    jsonschema.validate(document, SCHEMA)
    assert document["summary"]["odd_nodes"] == ["gpu002"]
    assert [c["fact"] for c in document["comparisons"] if c["verdict"] in ("odd", "tie")] == ["nccl_conf"]


def test_cli_usage_errors_exit_three(run_cli: Runner, tmp_path: Path) -> None:
    assert run_cli("fleet").returncode == ExitCode.NO_VERDICT
    empty = tmp_path / "empty"
    empty.mkdir()
    result = run_cli("fleet", str(empty))
    assert result.returncode == ExitCode.NO_VERDICT and "no usable node report" in result.stderr
    (empty / "a.json").write_text(json.dumps(report("a")))
    assert run_cli("fleet", "--format", "pdf", str(empty)).returncode == ExitCode.NO_VERDICT
    result = run_cli("fleet", "--output", str(tmp_path / "no" / "such" / "dir" / "f.txt"), str(empty))
    assert result.returncode == ExitCode.NO_VERDICT and "--output" in result.stderr


def test_many_reports_load_in_worker_processes_with_the_same_result(tmp_path: Path) -> None:
    from preflight.fleet.load import PARALLEL_AFTER_FILES, load_reports

    documents = [report(f"n{i:03d}") for i in range(PARALLEL_AFTER_FILES + 20)]
    set_mtu(documents[5], "ibp26s0", 2044)
    directory = write_all(tmp_path / "r", documents)
    (directory / "zz-broken.json").write_text("{")
    (directory / "zz-duplicate.json").write_text(json.dumps(documents[0]))
    serial = load_reports([str(directory)], workers=1)
    parallel = load_reports([str(directory)], workers=2)
    assert serial == parallel
    assert len(parallel[0]) == len(documents) and [Path(s.file).name for s in parallel[1]] == ["zz-broken.json", "zz-duplicate.json"]


def test_the_cyclic_collector_is_paused_for_the_audit_and_restored(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import gc

    from preflight import fleet as fleet_package

    seen: list[bool] = []
    real_audit = fleet_package.audit

    def watched(*args: Any, **kwargs: Any) -> Any:
        seen.append(gc.isenabled())
        return real_audit(*args, **kwargs)

    monkeypatch.setattr(fleet_package, "audit", watched)
    directory = write_all(tmp_path / "r", [report("gpu001"), report("gpu002")])
    assert gc.isenabled()
    assert fleet_package.run_fleet([str(directory)], "json", str(tmp_path / "out.json")) == ExitCode.OK
    assert seen == [False] and gc.isenabled()
    monkeypatch.setattr(fleet_package, "audit", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError):
        fleet_package.run_fleet([str(directory)], "json")
    assert gc.isenabled()  # restored on the way out of an error too


def test_a_file_reached_twice_is_read_once(run_cli: Runner, tmp_path: Path) -> None:
    """A directory and a file in it, or one file under two names, are one report: never a
    "second report" for its node, which would raise a clean fleet's exit code."""
    directory = write_all(tmp_path / "r", [report("gpu001"), report("gpu002")])
    (tmp_path / "alias.json").symlink_to(directory / "gpu002.json")
    result = run_cli("fleet", str(directory), str(directory / "gpu002.json"), f"{directory}/./gpu001.json", str(tmp_path / "alias.json"))
    assert result.returncode == 0 and "skipped" not in result.stderr, result.stderr
    assert "2 of 2 nodes" in result.stdout or "2 nodes" in result.stdout


def test_a_fleet_report_saved_among_node_reports_is_left_out(run_cli: Runner, tmp_path: Path) -> None:
    """The same command run twice over a directory it writes into gives the same verdict: its own
    earlier output is no node's report. Named on its own, a fleet report is skipped with the reason."""
    directory = write_all(tmp_path / "r", [report("gpu001"), report("gpu002")])
    output = directory / "fleet.json"
    for _run in range(2):
        result = run_cli("fleet", "--format", "json", "--output", str(output), str(directory))
        assert result.returncode == 0 and result.stderr == "", result.stderr
        assert len(json.loads(output.read_text())["nodes"]) == 2
    named = run_cli("fleet", str(directory / "gpu001.json"), str(output))
    assert named.returncode == 1
    assert f"skipped {output}: a fleet report ('preflight-fleet/1'), not a node report" in named.stderr


def test_output_never_replaces_a_node_report_it_compared(run_cli: Runner, tmp_path: Path) -> None:
    directory = write_all(tmp_path / "r", [report("gpu001"), report("gpu002")])
    before = (directory / "gpu001.json").read_bytes()
    for inputs in ([str(directory / "gpu001.json"), str(directory / "gpu002.json")], [str(directory)]):
        result = run_cli("fleet", "--format", "json", "--output", str(directory / "gpu001.json"), *inputs)
        assert result.returncode == 3
        assert f"--output {directory / 'gpu001.json'} is the report" in result.stderr and "write the fleet report elsewhere" in result.stderr
    assert (directory / "gpu001.json").read_bytes() == before


def test_nccl_conf_lines_in_another_order_are_the_same_settings(tmp_path: Path) -> None:
    """NCCL sets a line's variable only where it is not set yet (setEnvFile, src/misc/param.cc):
    distinct keys in another order, or a repeated key after its first line, change nothing."""
    documents = [report(f"gpu00{i}") for i in range(1, 4)]
    settings = [["NCCL_IB_HCA", "mlx5"], ["NCCL_IB_GID_INDEX", "3"]]
    for number, document in enumerate(documents):
        entries = list(reversed(settings)) if number == 1 else settings + ([["NCCL_IB_HCA", "mlx5_0"]] if number == 2 else [])
        document["facts"]["job"]["nccl_conf_files"][0].update(entries=entries)
    fleet = audit([str(write_all(tmp_path / "r", documents))])
    assert not [c for c in fleet.comparisons if c.fact.key == "nccl_conf" and c.verdict in ("odd", "tie")]
    documents[1]["facts"]["job"]["nccl_conf_files"][0].update(entries=[["NCCL_IB_HCA", "mlx5_0"], *settings])
    fleet = audit([str(write_all(tmp_path / "r2", documents))])
    assert [c.fact.key for c in fleet.comparisons if c.verdict == "odd"] == ["nccl_conf"]


def test_a_node_whose_nvml_failed_stays_in_its_class(tmp_path: Path) -> None:
    """A driver upgraded without a reboot: NVML answers 'Driver/library version mismatch' and names
    no GPU, while the bus still holds the same GPUs. The node stays in the one class of its NIC
    and GPU count, so another drift on it (an NCCL release) is still seen."""
    documents = [report(f"gpu00{i}") for i in range(1, 5)]
    broken = documents[2]["facts"]["gpus"]
    broken.update(devices=[], nvml_error="NVML_ERROR_LIB_RM_VERSION_MISMATCH")
    for copy in documents[2]["facts"]["nccl_libs"]["copies"]:
        copy["version"] = "2.18.3"
    fleet = audit([str(write_all(tmp_path / "r", documents))])
    assert [len(group.hosts) for group in fleet.classes] == [4]
    assert [f.nodes for f in fleet.findings if f.id == "NCCL017" and f.status == "present"] == [("gpu003",)]


def test_a_port_that_is_down_is_a_port_rate_drift(tmp_path: Path) -> None:
    """A pulled cable leaves the port DOWN with no rate to read: that node's rates differ from
    the others', not an unknown that hides it."""
    documents = [report(f"gpu00{i}") for i in range(1, 5)]
    port = documents[1]["facts"]["rdma"]["devices"][3]["ports"][0]
    port.update(state=1, state_name="DOWN", rate=None)
    fleet = audit([str(write_all(tmp_path / "r", documents))])
    (rates,) = [c for c in fleet.comparisons if c.fact.key == "port_rates"]
    assert rates.verdict == "odd" and rates.odd == ("gpu002",)
    assert any("1 port(s) not ACTIVE" in group.value for group in rates.values)


def test_the_fleet_table_keeps_to_80_columns(tmp_path: Path) -> None:
    """The playbook writes fleet.txt with no terminal (80 columns): the odd-one-out table of an HGX
    fleet, whose class label is long, fits the page instead of being re-wrapped line by line."""
    documents = [report(f"gpu00{i}") for i in range(1, 9)]
    documents[5]["facts"]["gpudirect"].update(kernel_release="5.15.0-107-generic")
    fleet = audit([str(write_all(tmp_path / "r", documents))])
    lines = render_table(fleet, width=80).splitlines()
    assert [line for line in lines if len(line) > 80] == []
    # no table line was cut and carried on below it (a separator's tail, "(7" then "nodes)")
    assert [line for line in lines if line.startswith(" ") and set(line.strip()) == {"-"}] == []
