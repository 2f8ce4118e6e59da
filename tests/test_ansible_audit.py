"""The Ansible fleet audit, run for real: ``ansible-playbook ansible/audit.yml`` against four
hosts on this machine (``ansible_connection=local``), each auditing its own recorded root.

One host installs preflight from a wheel built here into a fresh venv (the path a site uses);
the other three use the test venv's preflight (``preflight_install: false``), which keeps the
test inside its time budget. ``gpu003``'s root has one RDMA netdev at MTU 2044 instead of 4092:
the fleet report must flag it, and nothing else.

Three runs, in order: ``--check`` before anything is installed (no change on the hosts, the
uninstalled host is not audited), the real run, and a second real run that must change nothing
(asked to fail on findings, which it then does).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import BIN, EXAMPLE_ROOT, REPO, make_clean, write

pytestmark = pytest.mark.integration

PLAYBOOK = REPO / "ansible" / "audit.yml"
ANSIBLE_PLAYBOOK = BIN / "ansible-playbook"
HOSTS = ("gpu001", "gpu002", "gpu003", "gpu004")
ODD_HOST = "gpu003"
RECAP = re.compile(r"^(\S+)\s+:\s+ok=(\d+)\s+changed=(\d+)\s+unreachable=(\d+)\s+failed=(\d+)", re.M)


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not ANSIBLE_PLAYBOOK.exists():
        pytest.skip("ansible-playbook is not installed (pip install '.[test]')")
    lab = tmp_path_factory.mktemp("ansible-lab")
    dist = lab / "dist"
    subprocess.run([sys.executable, "-m", "build", "--wheel", "--outdir", str(dist), str(REPO)],
                   check=True, capture_output=True, timeout=300)
    (wheel,) = dist.glob("preflight-*.whl")
    hosts = {}
    for host in HOSTS:
        root = lab / "roots" / host
        shutil.copytree(EXAMPLE_ROOT, root, symlinks=True)
        make_clean(root)
        write(root, "/proc/sys/kernel/hostname", f"{host}\n")
        if host == ODD_HOST:
            write(root, "/sys/class/net/ibp26s0/mtu", "2044\n")
        variables: dict[str, object] = {
            "ansible_connection": "local",
            "ansible_python_interpreter": sys.executable,
            "preflight_root": str(root),
        }
        if host == "gpu001":  # the wheel-install path
            variables.update(preflight_wheel=str(wheel), preflight_venv=str(lab / "venv-gpu001"), preflight_python=sys.executable)
        else:
            variables.update(preflight_install=False, preflight_command=str(BIN / "preflight"))
        hosts[host] = variables
    inventory = {"all": {"hosts": hosts, "vars": {
        "preflight_report_dir": str(lab / "reports"),
        "preflight_controller_command": str(BIN / "preflight"),
    }}}
    (lab / "inventory.json").write_text(json.dumps(inventory))
    return lab


def playbook(lab: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "ANSIBLE_HOME": str(lab / "ansible-home"),
        "ANSIBLE_LOCAL_TEMP": str(lab / "ansible-tmp"),
        "ANSIBLE_REMOTE_TEMP": str(lab / "ansible-tmp"),
        "ANSIBLE_CONFIG": str(lab / "no-ansible.cfg"),  # ignore any ansible.cfg around
        "ANSIBLE_NOCOLOR": "1",
        "ANSIBLE_RETRY_FILES_ENABLED": "0",
        "ANSIBLE_FORKS": "4",
        "ANSIBLE_PIPELINING": "1",  # one process per task and host, no module file copies
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    return subprocess.run(
        [str(ANSIBLE_PLAYBOOK), "-i", str(lab / "inventory.json"), str(PLAYBOOK), *extra],
        capture_output=True, text=True, timeout=300, cwd=str(lab), env=env,
    )


def recap(result: subprocess.CompletedProcess[str]) -> dict[str, dict[str, int]]:
    return {host: {"ok": int(ok), "changed": int(changed), "unreachable": int(unreachable), "failed": int(failed)}
            for host, ok, changed, unreachable, failed in RECAP.findall(result.stdout)}


def fleet_report(lab: Path) -> dict[str, object]:
    document: dict[str, object] = json.loads((lab / "reports" / "fleet.json").read_text())
    return document


def test_check_mode_changes_nothing_and_audits_the_installed_hosts(lab: Path) -> None:
    result = playbook(lab, "--check")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert not (lab / "venv-gpu001").exists()  # nothing installed
    assert "preflight is not installed at" in result.stdout
    assert all(counts["failed"] == 0 for counts in recap(result).values())
    document = fleet_report(lab)
    assert sorted(node["host"] for node in document["nodes"]) == ["gpu002", "gpu003", "gpu004"]  # type: ignore[index]
    assert document["summary"]["odd_nodes"] == [ODD_HOST]  # type: ignore[index]


def test_audit_installs_from_the_wheel_and_flags_the_odd_host_only(lab: Path) -> None:
    shutil.rmtree(lab / "reports", ignore_errors=True)
    result = playbook(lab)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert (lab / "venv-gpu001" / "bin" / "preflight").exists()
    counts = recap(result)
    assert set(counts) >= set(HOSTS) and all(c["failed"] == 0 and c["unreachable"] == 0 for c in counts.values())
    assert counts["gpu001"]["changed"] >= 2  # the venv, the wheel, the install
    assert sorted(path.name for path in (lab / "reports").glob("gpu*.json")) == [f"{host}.json" for host in HOSTS]

    document = fleet_report(lab)
    summary = document["summary"]
    assert sorted(node["host"] for node in document["nodes"]) == list(HOSTS)  # type: ignore[index]
    assert summary["odd_nodes"] == [ODD_HOST]  # type: ignore[index]
    assert summary["nodes_with_present"] == []  # type: ignore[index]
    assert summary["exit_code"] == 2  # type: ignore[index]
    flagged = [(c["fact"], c["odd"], c["common"]) for c in document["comparisons"] if c["verdict"] in ("odd", "tie")]  # type: ignore[union-attr]
    assert flagged == [("rdma_mtu", [ODD_HOST], "4092")]
    table = (lab / "reports" / "fleet.txt").read_text()
    assert "ODD ONE OUT" in table and ODD_HOST in table
    assert "MTU of RDMA netdevs" in result.stdout  # the play shows the fleet table


def test_a_second_run_changes_nothing_and_can_fail_on_findings(lab: Path) -> None:
    """The second run also asks the play to fail on findings: every task still runs (and
    changes nothing), then the last one fails because gpu003 is the odd one out."""
    (lab / "reports" / "fleet.json").unlink()
    result = playbook(lab, "-e", "preflight_fail_on_findings=true")
    assert result.returncode != 0
    assert "preflight fleet found errors or an odd one out" in result.stdout
    counts = recap(result)
    assert set(counts) >= set(HOSTS)
    assert {host: c["changed"] for host, c in counts.items()} == {host: 0 for host in counts}
    assert sum(c["failed"] for c in counts.values()) == 1  # the assert, run once
    assert fleet_report(lab)["summary"]["odd_nodes"] == [ODD_HOST]  # type: ignore[index]
