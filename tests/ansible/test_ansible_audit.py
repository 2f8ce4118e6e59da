"""The Ansible fleet audit, run for real: ``ansible-playbook ansible/audit.yml`` against four
hosts on this machine (``ansible_connection=local``), each auditing its own recorded root.

One host installs preflight the way a site does by default: the controller builds a wheel from
this checkout (``pip wheel --no-deps``) and the host installs it into a fresh venv; the other
three use the test venv's preflight (``preflight_install: false``), which keeps the test inside
its time budget. ``gpu003``'s root has one RDMA netdev at MTU 2044 instead of 4092: the fleet
report must flag it, and nothing else. ``gpu004``'s host name is not its inventory name: the
fleet report names it by both. No report directory is set, so each run writes a new one under
the controller's cache (``$XDG_CACHE_HOME``, here inside the lab).

Three runs, in order: ``--check`` before anything is installed (no change on the hosts, the
uninstalled host is not audited), the real run, and a second real run that must change nothing
(asked to fail on findings, which it then does). Then ``--tags``, and the ways an audit must
fail with the reason: hosts without preflight or with an unusable report, a controller without
preflight, a variable of the wrong type, an unpinned package; and ansible-lint's production
profile on ``ansible/``.
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
ANSIBLE_LINT = BIN / "ansible-lint"
HOSTS = ("gpu001", "gpu002", "gpu003", "gpu004")
ODD_HOST = "gpu003"
RENAMED = ("gpu004", "rack2-n17")  # inventory name, host name
RECAP = re.compile(r"^(\S+)\s+:\s+ok=(\d+)\s+changed=(\d+)\s+unreachable=(\d+)\s+failed=(\d+)", re.M)


def local_host(**variables: object) -> dict[str, object]:
    return {"ansible_connection": "local", "ansible_python_interpreter": sys.executable, **variables}


def installed(**variables: object) -> dict[str, object]:
    """A host that audits with the test venv's preflight (unless ``variables`` name another)."""
    return local_host(**{"preflight_install": False, "preflight_command": str(BIN / "preflight"), **variables})


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not ANSIBLE_PLAYBOOK.exists():
        pytest.skip("ansible-playbook is not installed (pip install '.[test]')")
    lab = tmp_path_factory.mktemp("ansible-lab")
    # The wheel is built from a copy of the checkout taken now: a second build must give the same
    # bytes (the idempotence test), whatever is edited in the working tree meanwhile.
    shutil.copytree(REPO, lab / "source", ignore=shutil.ignore_patterns(
        ".*", "build", "dist", "*.egg-info", "__pycache__", "tests", "examples", "bench", "docs", "ansible"))
    hosts = {}
    for host in HOSTS:
        root = lab / "roots" / host
        shutil.copytree(EXAMPLE_ROOT, root, symlinks=True)
        make_clean(root)
        write(root, "/proc/sys/kernel/hostname", f"{RENAMED[1] if host == RENAMED[0] else host}\n")
        if host == ODD_HOST:
            write(root, "/sys/class/net/ibp26s0/mtu", "2044\n")
        if host == "gpu001":  # the default install: a wheel the controller builds from the checkout
            hosts[host] = local_host(preflight_root=str(root), preflight_venv=str(lab / "venv-gpu001"),
                                     preflight_python=sys.executable, preflight_source=str(lab / "source"))
        else:
            hosts[host] = installed(preflight_root=str(root))
    inventory = {"all": {"hosts": hosts, "vars": {"preflight_controller_command": str(BIN / "preflight")}}}
    (lab / "inventory.json").write_text(json.dumps(inventory))
    return lab


def playbook(lab: Path, *extra: str, inventory: str = "inventory.json") -> subprocess.CompletedProcess[str]:
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
        "XDG_CACHE_HOME": str(lab / "cache"),  # where the default report directory goes
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    return subprocess.run(
        [str(ANSIBLE_PLAYBOOK), "-i", str(lab / inventory), str(PLAYBOOK), *extra],
        capture_output=True, text=True, timeout=300, cwd=str(lab), env=env,
    )


def shown(result: subprocess.CompletedProcess[str]) -> str:
    return result.stdout[-6000:] + result.stderr[-2000:]


def recap(result: subprocess.CompletedProcess[str]) -> dict[str, dict[str, int]]:
    return {host: {"ok": int(ok), "changed": int(changed), "unreachable": int(unreachable), "failed": int(failed)}
            for host, ok, changed, unreachable, failed in RECAP.findall(result.stdout)}


def report_dir(lab: Path) -> Path:
    """The newest run's report directory (named by its UTC start time, so names sort by time)."""
    runs = sorted((lab / "cache" / "preflight").glob("audit-*"))
    assert runs, "no report directory under the controller's cache"
    return runs[-1]


def fleet_report(lab: Path) -> dict[str, object]:
    document: dict[str, object] = json.loads((report_dir(lab) / "fleet.json").read_text())
    return document


def test_check_mode_changes_nothing_and_audits_the_installed_hosts(lab: Path) -> None:
    result = playbook(lab, "--check")
    assert result.returncode == 0, shown(result)
    assert not (lab / "venv-gpu001").exists()  # nothing installed
    assert "preflight is not installed at" in result.stdout
    assert all(counts["failed"] == 0 for counts in recap(result).values())
    document = fleet_report(lab)
    assert sorted(node["name"] for node in document["nodes"]) == ["gpu002", "gpu003", "gpu004"]  # type: ignore[index]
    assert document["summary"]["odd_nodes"] == [ODD_HOST]  # type: ignore[index]


def test_audit_installs_the_controllers_wheel_and_flags_the_odd_host_only(lab: Path) -> None:
    result = playbook(lab)
    assert result.returncode == 0, shown(result)
    reports = report_dir(lab)
    # the default report directory: per run, under the controller's cache, not in the checkout
    assert reports.parent == lab / "cache" / "preflight" and re.fullmatch(r"audit-\d{8}T\d{6}Z-[0-9a-f]{6}", reports.name)
    assert f"Reports: {reports}" in result.stdout
    (wheel,) = (reports / "wheel").glob("*.whl")
    distribution = wheel.name.split("-")[0].replace("_", "-")
    listed = subprocess.run([str(lab / "venv-gpu001" / "bin" / "python"), "-m", "pip", "list", "--format", "json"],
                            capture_output=True, text=True, check=True)
    assert distribution in {package["name"] for package in json.loads(listed.stdout)}  # the wheel, not an index's "preflight"
    assert (lab / "venv-gpu001" / "bin" / "preflight").exists()
    counts = recap(result)
    assert set(counts) >= set(HOSTS) and all(c["failed"] == 0 and c["unreachable"] == 0 for c in counts.values())
    assert counts["gpu001"]["changed"] >= 2  # the venv, the wheel, the install
    assert sorted(path.name for path in reports.glob("gpu*.json")) == [f"{host}.json" for host in HOSTS]
    assert (reports / "missing.txt").read_text() == "" and "Not compared" not in result.stdout
    # the wheel was built from a copy, never in the checkout (pip and setuptools write build/ there)
    assert not (reports / "source").exists() and not list((lab / "source").glob("*.egg-info"))
    assert not (lab / "source" / "build").exists()

    document = fleet_report(lab)
    summary = document["summary"]
    nodes = {node["name"]: node["host"] for node in document["nodes"]}  # type: ignore[attr-defined]
    assert nodes == {host: RENAMED[1] if host == RENAMED[0] else host for host in HOSTS}
    assert summary["odd_nodes"] == [ODD_HOST]  # type: ignore[index]
    assert summary["nodes_with_present"] == []  # type: ignore[index]
    assert summary["exit_code"] == 2  # type: ignore[index]
    flagged = [(c["fact"], c["odd"], c["common"]) for c in document["comparisons"] if c["verdict"] in ("odd", "tie")]  # type: ignore[union-attr]
    assert flagged == [("rdma_mtu", [ODD_HOST], "4092")]
    table = (reports / "fleet.txt").read_text()
    assert "ODD ONE OUT" in table and ODD_HOST in table
    assert f"  {RENAMED[0]}: {RENAMED[1]}\n" in table  # inventory name, then host name
    assert "MTU of RDMA netdevs" in result.stdout  # the play shows the fleet table


def test_a_second_run_changes_nothing_and_can_fail_on_findings(lab: Path) -> None:
    """The second run also asks the play to fail on findings: every task still runs (and
    changes nothing: the controller rebuilds the same wheel byte for byte), then the last one
    fails because gpu003 is the odd one out."""
    first = report_dir(lab)
    result = playbook(lab, "-e", "preflight_fail_on_findings=true")
    assert result.returncode != 0
    assert report_dir(lab) != first  # a new directory for the new run
    assert "preflight fleet found errors or an odd one out" in result.stdout
    counts = recap(result)
    assert set(counts) >= set(HOSTS)
    assert {host: c["changed"] for host, c in counts.items()} == {host: 0 for host in counts}
    assert sum(c["failed"] for c in counts.values()) == 1  # the assert, run once
    assert fleet_report(lab)["summary"]["odd_nodes"] == [ODD_HOST]  # type: ignore[index]


def test_tags_audit_runs_the_audit_without_installing(lab: Path) -> None:
    result = playbook(lab, "--tags", "audit")
    assert result.returncode == 0, shown(result)
    assert "Run preflight node" in result.stdout and "Run preflight fleet" in result.stdout
    assert "Build the wheel" not in result.stdout and "Create the virtual environment" not in result.stdout
    assert sorted(node["name"] for node in fleet_report(lab)["nodes"]) == list(HOSTS)  # type: ignore[attr-defined]

    # without preflight_source: the wheel is built from the checkout that holds the role
    gpu001 = {key: value for key, value in json.loads((lab / "inventory.json").read_text())["all"]["hosts"]["gpu001"].items()
              if key != "preflight_source"}
    (lab / "default-source.json").write_text(json.dumps({"all": {"hosts": {"gpu001": gpu001}}}))
    stale = lab / "venv-gpu001" / "gpu_preflight-0.0.1-py3-none-any.whl"  # an earlier install's wheel
    stale.write_bytes(b"old")
    installing = playbook(lab, "--tags", "install", inventory="default-source.json")
    assert installing.returncode == 0, shown(installing)
    assert not stale.exists() and len(list((lab / "venv-gpu001").glob("*.whl"))) == 1
    assert "Build the wheel from the copy" in installing.stdout and "Install preflight" in installing.stdout
    assert "Run preflight node" not in installing.stdout and "Ask the controller" not in installing.stdout
    assert len(list((report_dir(lab) / "wheel").glob("*.whl"))) == 1


@pytest.fixture(scope="module")
def broken_lab(lab: Path) -> Path:
    """Hosts that cannot deliver a usable report, beside one that can."""
    scripts = lab / "bin"
    scripts.mkdir()
    behaviours = {
        "empty": "exit 0",  # runs, prints nothing
        "usage": "echo 'Usage: preflight [OPTIONS] COMMAND'; exit 0",  # another program called preflight
        "foreign": "echo '{\"schema\": \"other-report/9\", \"host\": \"x\"}'; exit 0",
        "wrapper": "echo 'preflight: command not found' >&2; exit 127",  # a wrapper whose target is gone
    }
    hosts: dict[str, object] = {"gpu002": installed(preflight_root=str(lab / "roots" / "gpu002"))}
    for name, body in behaviours.items():
        script = scripts / name
        script.write_text(f"#!/bin/sh\n{body}\n")
        script.chmod(0o755)
        hosts[name] = installed(preflight_command=str(script))
    hosts["missing"] = installed(preflight_command=str(lab / "nowhere" / "bin" / "preflight"))
    hosts["unstartable"] = installed(preflight_command="no-such-preflight")  # a bare name not on the PATH
    hung = scripts / "hung"
    hung.write_text("#!/bin/sh\nexec sleep 60\n")
    hung.chmod(0o755)
    hosts["hung"] = installed(preflight_command=str(hung), preflight_run_limit=5)
    hosts["fd00::17"] = installed(preflight_root=str(lab / "roots" / "gpu002"))  # an address as inventory name
    inventory = {"all": {"hosts": hosts, "vars": {"preflight_controller_command": str(BIN / "preflight")}}}
    (lab / "broken.json").write_text(json.dumps(inventory))
    return lab


def test_a_host_without_preflight_or_a_usable_report_fails_with_the_reason(broken_lab: Path) -> None:
    result = playbook(broken_lab, inventory="broken.json")
    assert result.returncode != 0
    counts = recap(result)
    assert {host: c["failed"] for host, c in counts.items()} == {
        "gpu002": 0, "empty": 1, "usage": 1, "foreign": 1, "wrapper": 1, "missing": 1, "unstartable": 1, "hung": 1, "fd00::17": 1,
    }, shown(result)
    out = result.stdout
    assert f"preflight is not installed on this host: {broken_lab / 'nowhere' / 'bin' / 'preflight'} does not exist" in out
    assert "was not found on this host (exit 127): preflight: command not found" in out
    assert "preflight node exited 0 without a report (empty output)" in out
    assert "no-such-preflight could not be started on this host (not found on the PATH, or not executable)" in out
    assert "The inventory name 'fd00::17' cannot name this host's report file" in out
    assert "Timed out after 5 second(s)" in out  # the hung host failed alone; the others were compared
    reports = report_dir(broken_lab)
    assert f"cannot be used ({reports / 'usage.json'}): not JSON" in out
    assert f"cannot be used ({reports / 'foreign.json'}): report schema 'other-report/9' is not supported" in out
    document = fleet_report(broken_lab)
    assert [node["name"] for node in document["nodes"]] == ["gpu002"]  # type: ignore[index]
    assert sorted(Path(s["file"]).name for s in document["skipped"]) == ["foreign.json", "usage.json"]  # type: ignore[attr-defined]
    # the hosts that delivered no report at all are named beside the fleet report, and by the play
    left_out = ["empty", "fd00::17", "hung", "missing", "unstartable", "wrapper"]
    assert sorted((reports / "missing.txt").read_text().split()) == left_out
    assert "Not compared (no report; see the recap): " in out


def test_a_controller_without_preflight_fails_before_any_audit(broken_lab: Path) -> None:
    result = playbook(broken_lab, "-e", f"preflight_controller_command={broken_lab / 'nowhere' / 'preflight'}", "--limit", "gpu002")
    assert result.returncode != 0
    assert "The controller needs preflight to write the fleet report" in result.stdout
    assert "could not be run (not installed or not on the PATH?)" in result.stdout
    assert "Run preflight node" not in result.stdout and "fleet.txt" not in result.stdout


def test_argument_specs_reject_a_wrong_type(lab: Path) -> None:
    result = playbook(lab, "-e", json.dumps({"preflight_timeout": "soon", "preflight_become": "maybe"}), "--limit", "gpu002")
    assert result.returncode != 0
    assert "Validation of arguments failed" in result.stdout
    assert "argument 'preflight_timeout' is of type str and we were unable to convert to float" in result.stdout
    assert "argument 'preflight_become' is of type str and we were unable to convert to bool" in result.stdout
    assert "Run preflight node" not in result.stdout


def test_a_string_for_a_list_and_a_relative_report_dir_are_refused_before_any_host_runs(lab: Path) -> None:
    as_string = playbook(lab, "-e", "preflight_node_args=--ignore", "--limit", "gpu002")
    assert as_string.returncode != 0 and "preflight_node_args and preflight_pip_args are lists: pass them as JSON" in as_string.stdout
    relative = playbook(lab, "-e", "preflight_report_dir=reports", "--limit", "gpu002")
    assert relative.returncode != 0 and "preflight_report_dir 'reports' is relative: give an absolute path" in relative.stdout
    for result in (as_string, relative):
        assert "Run preflight node" not in result.stdout


def test_the_unrelated_preflight_project_is_refused(lab: Path) -> None:
    result = playbook(lab, "-e", "preflight_package=Preflight==0.1.0", "--limit", "gpu001")
    assert result.returncode != 0 and "names the unrelated PyPI project 'preflight'" in result.stdout


@pytest.mark.parametrize("package", ["gpu-preflight", "gpu-preflight>=0.1", "gpu-preflight==0.1.*"])
def test_an_unpinned_package_is_refused(lab: Path, package: str) -> None:
    result = playbook(lab, "-e", f"preflight_package={package}", "--limit", "gpu001")
    assert result.returncode != 0
    assert f"preflight_package '{package}' is not pinned: give NAME==VERSION" in result.stdout
    assert "Install preflight" not in result.stdout.split("is not pinned")[1]  # nothing ran after the refusal


def test_ansible_lint_production_profile_passes() -> None:
    if not ANSIBLE_LINT.exists():
        pytest.skip("ansible-lint is not installed (pip install '.[test]')")
    result = subprocess.run(
        [str(ANSIBLE_LINT), "--offline", "--profile", "production", "--nocolor", "."],
        capture_output=True, text=True, timeout=300, cwd=str(REPO / "ansible"),
        env={**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"},
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "Profile 'production' was required, and it passed" in result.stdout + result.stderr
