"""Fleet findings: references whose misconfiguration *is* nodes disagreeing (NCCL017 on the NCCL
versions, ROCE006 on the MTU of RoCE netdevs), reported by ``preflight fleet`` with the
reference's ID, symbol, title and severity.

Every report is the golden report of the example node (real facts from a real probe run) with its
findings cleared and one fact changed by hand, as in test_fleet.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from conftest import Runner
from preflight.catalogue import load_reference
from preflight.exitcodes import ExitCode
from preflight.fleet import audit
from preflight.fleet.compare import Fleet, FleetFinding, fleet_exit_code
from preflight.fleet.render import render_json, render_table
from test_fleet import SCHEMA, report, set_mtu, write_all


def set_nccl(document: dict[str, Any], version: str | None) -> None:
    """Every NCCL copy on the node at ``version`` (None: a copy whose version was not read)."""
    for copy in document["facts"]["nccl_libs"]["copies"]:
        copy["version"] = version


def findings(fleet: Fleet, ref_id: str) -> list[FleetFinding]:
    return [f for f in fleet.findings if f.id == ref_id]


def one(fleet: Fleet, ref_id: str) -> FleetFinding:
    (found,) = findings(fleet, ref_id)
    return found


def checked_json(fleet: Fleet) -> dict[str, Any]:
    document = json.loads(render_json(fleet))
    jsonschema.validate(document, SCHEMA)
    return document


def test_a_node_with_another_nccl_version_has_nccl017_present(tmp_path: Path) -> None:
    documents = [report(f"gpu00{i}") for i in range(1, 5)]
    set_nccl(documents[2], "2.18.3")
    fleet = audit([str(write_all(tmp_path / "r", documents))])
    reference = load_reference("NCCL017")
    found = one(fleet, "NCCL017")
    assert (found.symbol, found.title, found.severity) == (reference.symbol, reference.title, reference.severity.value)
    assert (found.status, found.fact, found.nodes, found.majority, found.tie) == ("present", "nccl_versions", ("gpu003",), "2.21.5", False)
    (evidence,) = found.evidence
    assert (evidence.host, evidence.source, evidence.observed, evidence.expected) == ("gpu003", "nccl_libs.copies", "2.18.3", "2.21.5")
    assert fleet_exit_code(fleet) is ExitCode.ERROR
    table = render_table(fleet, width=200)
    assert "FLEET FINDINGS" in table and "NCCL017" in table and "gpu003: 2.18.3" in table
    document = checked_json(fleet)
    assert document["summary"]["fleet_findings_present"] == 1
    (item,) = [f for f in document["findings"] if f["id"] == "NCCL017"]
    assert item["evidence"] == [{"host": "gpu003", "source": "nccl_libs.copies", "observed": "2.18.3", "expected": "2.21.5"}]


def test_a_leftover_copy_no_loader_reaches_is_not_a_version_mismatch(tmp_path: Path) -> None:
    """A package upgrade can leave libnccl.so.2.21.5 beside libnccl.so.2 -> 2.26.2: no job loads
    it (the node report marks it unreached), so one node keeping it is no NCCL017."""
    documents = [report(f"gpu00{i}") for i in range(1, 5)]
    copies = documents[1]["facts"]["nccl_libs"]["copies"]
    copies.append({**copies[0], "path": "/usr/lib/x86_64-linux-gnu/libnccl.so.2.18.3", "version": "2.18.3",
                   "unreached": "libnccl.so.2 links to libnccl.so.2.21.5"})
    fleet = audit([str(write_all(tmp_path / "r", documents))])
    assert [f.status for f in findings(fleet, "NCCL017")] == ["absent"]


def test_where_a_copy_lies_is_not_a_version_mismatch(tmp_path: Path) -> None:
    """The same release from a wheel only, against a wheel and a system package: NCCL017 asks
    which release each rank runs, not where it was installed."""
    documents = [report(f"gpu00{i}") for i in range(1, 5)]
    documents[0]["facts"]["nccl_libs"]["copies"] = documents[0]["facts"]["nccl_libs"]["copies"][1:]
    fleet = audit([str(write_all(tmp_path / "r", documents))])
    assert [c.fact.key for c in fleet.disagreements] == ["nccl_libraries"]
    assert one(fleet, "NCCL017").status == "absent"


def test_an_agreeing_fleet_has_nccl017_absent_and_no_findings_section(tmp_path: Path) -> None:
    fleet = audit([str(write_all(tmp_path / "r", [report(f"gpu00{i}") for i in range(1, 4)]))])
    found = one(fleet, "NCCL017")
    assert (found.status, found.nodes, found.unknown_nodes, found.evidence, found.majority) == ("absent", (), (), (), "2.21.5")
    assert not findings(fleet, "ROCE006")  # InfiniBand only: no node has a RoCE port to compare
    assert fleet_exit_code(fleet) is ExitCode.OK
    assert "FLEET FINDINGS" not in render_table(fleet, width=200)
    assert checked_json(fleet)["summary"]["fleet_findings_present"] == 0


@pytest.mark.parametrize("unreadable", ["missing", "unversioned"])
def test_a_node_whose_nccl_facts_cannot_be_read_makes_nccl017_unknown_not_present(tmp_path: Path, unreadable: str) -> None:
    documents = [report(f"gpu00{i}") for i in range(1, 5)]
    if unreadable == "missing":
        del documents[1]["facts"]["nccl_libs"]  # an older report, or the probe failed
    else:
        set_nccl(documents[1], None)
    fleet = audit([str(write_all(tmp_path / "r", documents))])
    found = one(fleet, "NCCL017")
    assert (found.status, found.nodes, found.unknown_nodes, found.evidence) == ("unknown", (), ("gpu002",), ())
    assert "could not be read on gpu002" in found.reason and "3 others agree on '2.21.5'" in found.reason
    # an unknown finding does not count, as for node findings; an unversioned copy is still
    # odd in the list of libraries (nccl_libraries), a disagreement like any other
    assert [c.fact.key for c in fleet.disagreements] == ([] if unreadable == "missing" else ["nccl_libraries"])
    assert fleet_exit_code(fleet) is (ExitCode.OK if unreadable == "missing" else ExitCode.ERROR)
    assert "NCCL017" in render_table(fleet, width=200)
    checked_json(fleet)


def test_an_unreadable_node_beside_a_different_one_leaves_the_finding_present_and_names_both(tmp_path: Path) -> None:
    documents = [report(f"gpu00{i}") for i in range(1, 6)]
    set_nccl(documents[0], "2.18.3")
    del documents[4]["facts"]["nccl_libs"]
    found = one(audit([str(write_all(tmp_path / "r", documents))]), "NCCL017")
    assert (found.status, found.nodes, found.unknown_nodes) == ("present", ("gpu001",), ("gpu005",))


def test_a_tie_names_every_side_and_picks_no_majority(tmp_path: Path) -> None:
    documents = [report(f"gpu00{i}") for i in range(1, 5)]
    set_nccl(documents[2], "2.18.3")
    set_nccl(documents[3], "2.18.3")
    fleet = audit([str(write_all(tmp_path / "r", documents))])
    found = one(fleet, "NCCL017")
    assert (found.status, found.tie, found.majority) == ("present", True, None)
    assert found.nodes == ("gpu001", "gpu002", "gpu003", "gpu004")
    assert [(e.host, e.observed) for e in found.evidence] == [
        ("gpu001", "2.21.5"), ("gpu002", "2.21.5"), ("gpu003", "2.18.3"), ("gpu004", "2.18.3"),
    ]
    assert found.reason.startswith("no majority (2 nodes hold '2.18.3'; 2 nodes hold '2.21.5')")
    assert fleet_exit_code(fleet) is ExitCode.ERROR
    assert "(tie: no majority)" in render_table(fleet, width=200)
    item = next(f for f in checked_json(fleet)["findings"] if f["id"] == "NCCL017")
    assert item["majority"] is None and item["tie"] is True


def test_a_node_without_nccl_on_the_host_is_not_compared(tmp_path: Path) -> None:
    """No libnccl on the host (the job brings its own in a container): nothing to disagree with."""
    documents = [report(f"gpu00{i}") for i in range(1, 5)]
    documents[3]["facts"]["nccl_libs"]["copies"] = []
    found = one(audit([str(write_all(tmp_path / "r", documents))]), "NCCL017")
    assert (found.status, found.nodes) == ("absent", ())


def as_roce(document: dict[str, Any]) -> dict[str, Any]:
    for device in document["facts"]["rdma"]["devices"]:
        for port in device["ports"]:
            port["link_layer"] = "Ethernet"
    return document


def test_a_roce_node_with_another_netdev_mtu_has_roce006_present(tmp_path: Path) -> None:
    documents = [as_roce(report(f"roce{i}")) for i in range(1, 5)]
    set_mtu(documents[0], "ibp26s0", 1500)
    fleet = audit([str(write_all(tmp_path / "r", documents))])
    found = one(fleet, "ROCE006")
    assert (found.status, found.nodes, found.majority, found.severity) == ("present", ("roce1",), "4092", load_reference("ROCE006").severity.value)
    assert [(e.observed, e.expected) for e in found.evidence] == [("1500, 4092", "4092")]
    checked_json(fleet)


def test_ipoib_mtu_differences_are_not_roce006(tmp_path: Path) -> None:
    """An InfiniBand port's netdev is IPoIB: its MTU is no RDMA path MTU. The comparison still
    shows the difference (rdma_mtu); no RoCE finding is made of it."""
    documents = [report(f"gpu00{i}") for i in range(1, 5)]
    set_mtu(documents[0], "ibp26s0", 2044)
    fleet = audit([str(write_all(tmp_path / "r", documents))])
    assert [c.fact.key for c in fleet.disagreements] == ["rdma_mtu"]
    assert not findings(fleet, "ROCE006")


def test_findings_are_per_hardware_class(tmp_path: Path) -> None:
    """Two classes each agreeing inside but on different releases: no finding (a job that spans
    both classes is not something the fleet knows of)."""
    h100 = [report(f"h{i}") for i in range(1, 4)]
    a100 = [report(f"a{i}") for i in range(1, 4)]
    for document in a100:
        set_nccl(document, "2.18.3")
        for gpu in document["facts"]["gpus"]["devices"]:
            gpu["name"] = "NVIDIA A100-SXM4-80GB"
    fleet = audit([str(write_all(tmp_path / "r", h100 + a100))])
    assert sorted((f.status, f.majority) for f in findings(fleet, "NCCL017")) == [("absent", "2.18.3"), ("absent", "2.21.5")]


def test_cli_json_carries_findings_and_exit_code(run_cli: Runner, tmp_path: Path) -> None:
    documents = [report(f"gpu00{i}") for i in range(1, 5)]
    set_nccl(documents[0], "2.18.3")
    directory = write_all(tmp_path / "r", documents)
    result = run_cli("fleet", str(directory), "--format", "json")
    assert result.returncode == ExitCode.ERROR
    document = json.loads(result.stdout)
    jsonschema.validate(document, SCHEMA)
    (item,) = [f for f in document["findings"] if f["status"] == "present"]
    assert (item["id"], item["nodes"], item["severity"]) == ("NCCL017", ["gpu001"], "error")


def test_markdown_and_html_pages_show_fleet_findings(tmp_path: Path) -> None:
    from preflight.fleet.pages import render_html, render_markdown

    documents = [report(f"gpu00{i}") for i in range(1, 5)]
    set_nccl(documents[3], "2.18.3")
    fleet = audit([str(write_all(tmp_path / "r", documents))])
    markdown = render_markdown(fleet)
    assert "## Fleet findings" in markdown and "| NCCL017 | nccl-version-mismatch-across-ranks | error | present |" in markdown
    assert "gpu004: 2.18.3" in markdown
    page = render_html(fleet)
    assert "Fleet findings" in page and "gpu004: 2.18.3" in page
    clean = audit([str(write_all(tmp_path / "clean", [report("a1"), report("a2")]))])
    assert "Fleet findings" not in render_markdown(clean)


def test_two_nodes_one_unreadable_is_unknown_and_says_nothing_was_compared(tmp_path: Path) -> None:
    documents = [report("gpu001"), report("gpu002")]
    del documents[1]["facts"]["nccl_libs"]
    found = one(audit([str(write_all(tmp_path / "r", documents))]), "NCCL017")
    assert (found.status, found.nodes, found.unknown_nodes) == ("unknown", (), ("gpu002",))
    assert found.reason == "NCCL versions installed could not be read on gpu002; only gpu001 has a value ('2.21.5'), with nothing to compare it to"


def test_a_single_node_gives_no_finding(tmp_path: Path) -> None:
    assert not audit([str(write_all(tmp_path / "r", [report("gpu001")]))]).findings


def test_cli_end_to_end_on_recorded_roce_roots(run_cli: Runner, tmp_path: Path) -> None:
    """Reports written by `preflight node` on copies of a recorded RoCE root (tests/fixtures/nodes/
    roce-mtu4096, whose first netdev is at 4096 and the others at 9000); on three copies that
    netdev is raised to 9000 as well, so the fourth node is the one whose RoCE MTUs differ."""
    import shutil

    from conftest import REPO, write

    reports = tmp_path / "reports"
    reports.mkdir()
    for number in range(1, 5):
        root = tmp_path / f"node{number}"
        shutil.copytree(REPO / "tests" / "fixtures" / "nodes" / "roce-mtu4096", root, symlinks=True)
        write(root, "/proc/sys/kernel/hostname", f"roce{number}\n")
        if number != 4:
            netlink = root / ".preflight" / "netlink.json"
            recorded = json.loads(netlink.read_text())
            for link in recorded["links"]:
                link["mtu"] = 9000
            netlink.write_text(json.dumps(recorded))
        result = run_cli("node", "--root", str(root), "--format", "json")
        assert result.returncode in (0, 1, 2), result.stderr
        (reports / f"roce{number}.json").write_text(result.stdout)
    as_json = run_cli("fleet", "--format", "json", str(reports))
    assert as_json.returncode == ExitCode.ERROR, as_json.stderr
    document = json.loads(as_json.stdout)
    jsonschema.validate(document, SCHEMA)
    (roce006,) = [f for f in document["findings"] if f["id"] == "ROCE006"]
    assert (roce006["status"], roce006["nodes"], roce006["majority"]) == ("present", ["roce4"], "9000")
    assert roce006["evidence"] == [{"host": "roce4", "source": roce006["evidence"][0]["source"], "observed": "4096, 9000", "expected": "9000"}]
    assert "interfaces.links.mtu" in roce006["evidence"][0]["source"]
    # the recorded root has no NCCL library: no node has a release to disagree on
    assert not [f for f in document["findings"] if f["id"] == "NCCL017"]


def test_ignoring_the_deciding_fact_leaves_its_finding_out(tmp_path: Path) -> None:
    documents = [report(f"gpu00{i}") for i in range(1, 5)]
    set_nccl(documents[0], "2.18.3")
    directory = str(write_all(tmp_path / "r", documents))
    assert one(audit([directory]), "NCCL017").status == "present"
    assert not findings(audit([directory], ignore_facts=["nccl_versions"]), "NCCL017")
