"""Layer 4 for the network checks: the installed CLI on the recorded roots of
``tests/fixtures/nodes`` (netlink replay and the sysfs/procfs fallback)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from conftest import REPO, Runner, write

FIXTURES = REPO / "tests" / "fixtures" / "nodes"


def report(run_cli: Runner, root: Path) -> dict[str, Any]:
    # A config recorded in a root is never obeyed; the fixture's is the site config it was made for.
    config = root / "etc" / "preflight" / "preflight.toml"
    given = ("--config", str(config)) if config.is_file() else ()
    result = run_cli("node", "--root", str(root), "--select", "NET", "--format", "json", *given)
    # 3 only when the selection decided nothing (every NET check unknown): still a full report
    assert result.returncode in (0, 1, 2) or "no verdict: every check is unknown" in result.stderr, result.stderr
    parsed: dict[str, Any] = json.loads(result.stdout)
    return parsed


def rows(parsed: dict[str, Any]) -> dict[tuple[str, str], tuple[str, str]]:
    return {(f["id"], f["subject"]): (f["status"], f["severity"]) for f in parsed["findings"] if f["status"] != "absent"}


EXPECTED = {
    "container-bridge": {("NET001", "eth0"): ("present", "error")},
    "ipoib-link-local": {("NET003", "ib0"): ("present", "error"), ("NET005", "ib0"): ("present", "warning")},
    "multirail-same-subnet": {
        ("NET005", "ens1f0np0"): ("present", "warning"),
        ("NET005", "ens2f0np0"): ("present", "error"),
        ("NET005", "ens3f0np0"): ("present", "error"),
        ("NET005", "ens4f0np0"): ("present", "error"),
    },
    "no-route-to-master": {("NET004", "10.70.0.5"): ("present", "error"), ("NET004", "10.80.1.1"): ("present", "error")},
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_recorded_roots(run_cli: Runner, name: str) -> None:
    parsed = report(run_cli, FIXTURES / name)
    assert rows(parsed) == EXPECTED[name]
    assert {p["status"] for p in parsed["probes"]} == {"ok"}


def test_replayed_choice_and_file_fallback_facts(run_cli: Runner) -> None:
    container = report(run_cli, FIXTURES / "container-bridge")["facts"]
    assert container["nccl_socket"]["bootstrap"]["interfaces"][0]["address"] == "172.17.0.2"
    assert container["routing"]["peers"][0]["routes"][0]["gateway"] == "172.17.0.1"
    copied = report(run_cli, FIXTURES / "no-route-to-master")["facts"]
    cn02 = [peer for peer in copied["routing"]["peers"] if peer["name"] == "cn02"][0]
    assert cn02["resolved_by"] == "/etc/hosts:3" and cn02["routes"][0]["origin"] == "/proc/net/route"
    assert copied["nccl_socket"]["devices"]["interfaces"][0]["ifname"] == "eth0"


def test_clean_example_root_has_no_network_findings(run_cli: Runner, clean_root: Path) -> None:
    parsed = report(run_cli, clean_root)
    assert {f["status"] for f in parsed["findings"]} == {"absent"}
    assert parsed["facts"]["nccl_socket"]["bootstrap"]["interfaces"][0]["ifname"] == "eno1"
    assert parsed["facts"]["routing"]["peers"][0]["routes"][0]["ifname"] == "eno1"


def test_broken_recording_makes_every_network_reference_unknown(run_cli: Runner, tmp_path: Path) -> None:
    root = tmp_path / "root"
    shutil.copytree(FIXTURES / "container-bridge", root)
    write(root, "/.preflight/netlink.json", "{\"links\": [")
    parsed = report(run_cli, root)
    assert {(f["id"], f["status"]) for f in parsed["findings"]} == {(f"NET00{n}", "unknown") for n in range(1, 6)}
    assert all("unreadable netlink recording" in f["reason"] for f in parsed["findings"])


@pytest.mark.parametrize("address", ["fe80::7ec2:55ff:fe0b:'101", "10.0.0.x", "fe80::1"])
def test_a_recorded_address_that_is_no_address_makes_the_recording_malformed(run_cli: Runner, tmp_path: Path, address: str) -> None:
    """Types alone passed an address that is no IP address, or a v6 text recorded as family 4, to
    the probes, which parse it again (the fuzz target found NCCL's interface choice failing with
    a ValueError): the replay refuses the entry, and the network references are unknown."""
    root = tmp_path / "root"
    shutil.copytree(FIXTURES / "container-bridge", root)
    recording = json.loads((root / ".preflight/netlink.json").read_text())
    recording["addresses"][0].update(address=address, family=4)
    write(root, "/.preflight/netlink.json", json.dumps(recording))
    parsed = report(run_cli, root)
    net = [f for f in parsed["findings"] if f["id"].startswith("NET")]
    assert net and all(f["status"] == "unknown" and "malformed address entry" in f["reason"] for f in net), net


def test_unrecorded_route_lookup_is_unknown_for_that_peer(run_cli: Runner, tmp_path: Path) -> None:
    root = tmp_path / "root"
    shutil.copytree(FIXTURES / "container-bridge", root)
    write(root, "/proc/self/environ", b"MASTER_ADDR=10.20.0.6\0")
    finding = [f for f in report(run_cli, root)["findings"] if f["id"] == "NET004"][0]
    assert (finding["status"], finding["subject"]) == ("unknown", "10.20.0.6")
    assert "no recorded route for 10.20.0.6" in finding["reason"]


def test_garbage_route_table_on_a_copied_root_is_unknown_not_unreachable(run_cli: Runner, tmp_path: Path) -> None:
    root = tmp_path / "root"
    shutil.copytree(FIXTURES / "no-route-to-master", root)
    write(root, "/proc/net/route", "Iface\tDestination\n\x01\x02 garbage line\n")
    findings = [f for f in report(run_cli, root)["findings"] if f["id"] == "NET004"]
    # the route table places no local address on an interface, nor routes the master: both unknown
    assert {f["status"] for f in findings} == {"unknown"} and all("/proc/net/route" in f["reason"] for f in findings)
