"""Site check directories and plugins ship the references their checks decide: ``<ID>.toml``
beside the module. A valid one is used everywhere an ID is looked up; a malformed, untrusted,
oversized or colliding one stops the run with a one-line error before any site module runs."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

from conftest import Runner, site_config
from preflight.config import DEFAULT_CONFIG_PATH
from preflight.discovery import module_directory

RELEASE = "5.15.0-105-generic"  # what the example node runs (/proc/sys/kernel/osrelease)


def check_module(ref_id: str, symbol: str, marker: Path | None = None) -> str:
    """A module with one probe and the check for ``ref_id``: present unless the kernel is 6.8.
    With ``marker``, importing it writes that file (to prove it was or was not imported)."""
    probe_name = f"{ref_id.lower()}_kernel"
    return textwrap.dedent(f'''
        import pathlib

        from preflight.model import Evidence, present
        from preflight.registry import check, probe

        if {str(marker) if marker else ""!r}:
            pathlib.Path({str(marker) if marker else ""!r}).write_text("imported")


        @probe({probe_name!r})
        def probe_{probe_name}(fs):
            return (fs.read("/proc/sys/kernel/osrelease") or "").strip()


        @check({ref_id!r}, profiles=("prolog",))
        def {symbol.replace("-", "_")}({probe_name}):
            if not {probe_name}.startswith("6.8."):
                yield present("kernel", Evidence("/proc/sys/kernel/osrelease", {probe_name}, "6.8.*"))
    ''')


def reference_toml(ref_id: str, symbol: str, severity: str = "error", extra: str = "") -> str:
    return textwrap.dedent(f'''
        id = "{ref_id}"
        symbol = "{symbol}"
        title = "Kernel {ref_id} is older than the site's"
        area = "site-kernel"
        severity = "{severity}"
        summary = "The site runs 6.8 kernels only."
        fix = ["Reimage the node with the site's 6.8 image ({ref_id})."]
        sources = ["https://wiki.example.com/kernels"]
        {extra}
        [detect]
        modes = ["node"]
        checks = ["{ref_id}"]
    ''')


def site_dir(parent: Path, files: dict[str, str], name: str = "checks.d") -> Path:
    """A trusted site directory (mode 0755, files 0644) holding ``files``."""
    directory = parent / name
    directory.mkdir()
    directory.chmod(0o755)
    for file_name, text in files.items():
        (directory / file_name).write_text(text)
        (directory / file_name).chmod(0o644)
    return directory


def acme_site(tmp_path: Path, marker: Path | None = None, **references: str) -> Path:
    """checks.d with ACME001's check, and ``references`` (file stem -> text) beside it."""
    files = {"acme.py": check_module("ACME001", "kernel-too-old", marker)}
    files.update({f"{stem}.toml": text for stem, text in references.items()})
    return site_dir(tmp_path, files)


def findings(result: subprocess.CompletedProcess[str]) -> dict[str, dict[str, object]]:
    return {finding["id"]: finding for finding in json.loads(result.stdout)["findings"]}


def test_a_site_reference_is_used_wherever_an_id_is_looked_up(run_cli: Runner, example_root: Path, tmp_path: Path) -> None:
    site = acme_site(tmp_path, ACME001=reference_toml("ACME001", "kernel-too-old"))
    root = str(example_root)
    for token in ("ACME001", "ACME", "kernel-too-old"):  # ID, prefix and symbol all select it
        result = run_cli("node", "--root", root, "--checks-dir", str(site), "--select", token, "--format", "json")
        assert result.returncode == 2, result.stderr
        assert findings(result) == {"ACME001": {
            "id": "ACME001", "symbol": "kernel-too-old", "title": "Kernel ACME001 is older than the site's",
            "status": "present", "severity": "error", "subject": "kernel",
            "evidence": [{"source": "/proc/sys/kernel/osrelease", "observed": RELEASE, "expected": "6.8.*"}],
            "fix": "Reimage the node with the site's 6.8 image (ACME001).", "reason": "",
        }}
    # The prolog profile and a whole run decide it beside the packaged checks.
    prolog = run_cli("node", "--root", root, "--checks-dir", str(site), "--profile", "prolog", "--format", "json")
    assert "ACME001" in findings(prolog) and "MEM001" in findings(prolog)
    # preflight references sees it only when given the directory.
    shown = run_cli("references", "show", "kernel-too-old", "--checks-dir", str(site), "--format", "json")
    assert json.loads(shown.stdout)["id"] == "ACME001"
    listed = run_cli("references", "list", "--checks-dir", str(site), "--format", "json")
    assert "ACME001" in {item["id"] for item in json.loads(listed.stdout)}
    assert "ACME001" not in {item["id"] for item in json.loads(run_cli("references", "list", "--format", "json").stdout)}
    assert run_cli("references", "show", "ACME001").returncode == 3
    # Without the directory the ID is nobody's.
    unknown = run_cli("node", "--root", root, "--select", "ACME001")
    assert unknown.returncode == 3 and "'ACME001' matches no reference" in unknown.stderr


def test_a_site_check_without_its_reference_is_refused(run_cli: Runner, example_root: Path, tmp_path: Path) -> None:
    site = acme_site(tmp_path)
    result = run_cli("node", "--root", str(example_root), "--checks-dir", str(site))
    assert result.returncode == 3
    assert "no reference ACME001 in the catalogue, nor as ACME001.toml beside the module" in result.stderr


def test_the_site_config_may_disable_and_rerate_its_own_references(run_cli: Runner, example_root: Path, tmp_path: Path) -> None:
    site = acme_site(tmp_path, ACME001=reference_toml("ACME001", "kernel-too-old"))
    root = str(example_root)
    rerated = site_config(tmp_path / "node", f'[run]\nchecks_dirs = ["{site}"]\n\n[severity]\nACME001 = "warning"\n')
    result = run_cli("node", "--root", root, "--config", rerated, "--select", "ACME001", "--format", "json")
    assert result.returncode == 1 and findings(result)["ACME001"]["severity"] == "warning"
    disabled = site_config(tmp_path / "other", f'disable = ["ACME001"]\n\n[run]\nchecks_dirs = ["{site}"]\n')
    result = run_cli("node", "--root", root, "--config", disabled, "--select", "ACME001")
    assert result.returncode == 3 and "ACME001: disabled by" in result.stderr
    # An ID that neither the catalogue nor the configured directory ships is still a typo.
    typo = site_config(tmp_path / "typo", f'disable = ["ACME002"]\n\n[run]\nchecks_dirs = ["{site}"]\n')
    result = run_cli("node", "--root", root, "--config", typo)
    assert result.returncode == 3 and "'ACME002' is no reference in the catalogue, nor shipped by [run] checks_dirs" in result.stderr


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        (reference_toml("ACME001", "kernel-too-old").replace('fix = ["Reimage', 'fixes = ["Reimage'), "unknown key 'fixes'"),
        (reference_toml("ACME001", "kernel-too-old", severity="fatal"), "severity 'fatal' is not one of"),
        (reference_toml("ACME001", "Kernel Too Old"), "symbol 'Kernel Too Old' is not kebab-case"),
        (reference_toml("ACME002", "kernel-too-old"), "id 'ACME002' does not match the file name ACME001.toml"),
        (reference_toml("ACME001", "kernel-too-old").replace("sources = [", "sources = [[["), "not valid TOML: Unclosed array"),
        # Signatures are analysed in full: nobody else has tested a site's patterns.
        (
            reference_toml("ACME001", "kernel-too-old", extra='[[signatures]]\nrole = "cause"\npattern = "kernel too old"\nexamples = ["nothing alike"]\n'),
            "signature #1: example 'nothing alike' does not match its pattern",
        ),
    ],
    ids=["unknown-key", "severity", "symbol", "id-not-file-name", "not-toml", "signature"],
)
def test_a_malformed_site_reference_stops_the_run_before_any_site_module(
    run_cli: Runner, example_root: Path, tmp_path: Path, text: str, problem: str
) -> None:
    marker = tmp_path / "imported"
    site = acme_site(tmp_path, marker, ACME001=text)
    result = run_cli("node", "--root", str(example_root), "--checks-dir", str(site), "--format", "json")
    assert result.returncode == 3 and result.stdout == ""
    assert result.stderr.startswith(f"preflight: error: reference {site / 'ACME001.toml'}: ") and problem in result.stderr
    assert result.stderr.count("\n") == 1  # one line
    assert not marker.exists()


def test_an_id_or_symbol_that_is_taken_is_refused(run_cli: Runner, example_root: Path, tmp_path: Path) -> None:
    root = str(example_root)
    for name in ("a", "b", "c"):
        (tmp_path / name).mkdir()
    packaged = acme_site(tmp_path / "a", MEM001=reference_toml("MEM001", "site-memlock"))
    result = run_cli("node", "--root", root, "--checks-dir", str(packaged))
    assert result.returncode == 3 and "MEM001 is a packaged reference; give the site's reference an ID of its own" in result.stderr

    symbol = acme_site(tmp_path / "b", ACME001=reference_toml("ACME001", "memlock-limit-too-low"))
    result = run_cli("node", "--root", root, "--checks-dir", str(symbol))
    assert result.returncode == 3 and "symbol 'memlock-limit-too-low' already names MEM001" in result.stderr

    first = acme_site(tmp_path / "c", ACME001=reference_toml("ACME001", "kernel-too-old"))
    second = site_dir(tmp_path / "c", {"ACME001.toml": reference_toml("ACME001", "kernel-older")}, name="more.d")
    result = run_cli("node", "--root", root, "--checks-dir", str(first), "--checks-dir", str(second))
    assert result.returncode == 3
    assert f"reference {second / 'ACME001.toml'}: ACME001 is also shipped as {first / 'ACME001.toml'}" in result.stderr


def test_reference_files_are_trusted_and_bounded_like_modules(run_cli: Runner, example_root: Path, tmp_path: Path) -> None:
    marker = tmp_path / "imported"
    site = acme_site(tmp_path, marker, ACME001=reference_toml("ACME001", "kernel-too-old"))
    reference = site / "ACME001.toml"
    root = str(example_root)

    def refused(expected: str) -> None:
        result = run_cli("node", "--root", root, "--checks-dir", str(site), timeout=60)  # a FIFO must not hang it
        assert result.returncode == 3 and expected in result.stderr, result.stderr
        assert not marker.exists()

    reference.chmod(0o666)
    refused("writable by its group or by everyone")
    reference.chmod(0o644)
    if os.geteuid() == 0:
        os.chown(reference, 12345, 12345)
        refused("owned by uid 12345")
        os.chown(reference, 0, 0)
    reference.write_text(reference_toml("ACME001", "kernel-too-old") + "# padding\n" * 8000)
    refused("larger than 64 KiB")
    reference.unlink()
    os.mkfifo(reference, 0o644)
    refused("not a regular file")


def build_plugin_wheel(directory: Path, files: dict[str, str], entry_points: str) -> Path:
    """A wheel of the distribution ``acme-preflight`` 1.0 holding ``files``, made by hand (a
    wheel is a zip with a dist-info folder) so that pip installs it without a build backend."""
    dist_info = "acme_preflight-1.0.dist-info"
    contents = {
        **files,
        f"{dist_info}/METADATA": "Metadata-Version: 2.1\nName: acme-preflight\nVersion: 1.0\n",
        f"{dist_info}/WHEEL": "Wheel-Version: 1.0\nGenerator: preflight-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        f"{dist_info}/entry_points.txt": entry_points,
    }
    record = []
    for name, text in contents.items():
        data = text.encode()
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(data)}")
    record.append(f"{dist_info}/RECORD,,")
    wheel = directory / "acme_preflight-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for name, text in contents.items():
            archive.writestr(name, text)
        archive.writestr(f"{dist_info}/RECORD", "\n".join(record) + "\n")
    return wheel


def install(wheel: Path, target: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", str(target), str(wheel)],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]


def test_an_installed_plugin_ships_references_in_its_package(run_cli: Runner, example_root: Path, tmp_path: Path) -> None:
    wheel = build_plugin_wheel(
        tmp_path,
        {
            "acme_preflight/__init__.py": "",
            "acme_preflight/checks.py": check_module("ACME002", "kernel-too-old-for-acme"),
            "acme_preflight/ACME002.toml": reference_toml("ACME002", "kernel-too-old-for-acme", severity="warning"),
        },
        "[preflight.checks]\nacme = acme_preflight.checks\n",
    )
    target = tmp_path / "site-packages"
    install(wheel, target)
    env = {"PYTHONPATH": str(target)}
    result = run_cli("node", "--root", str(example_root), "--select", "ACME002", "--format", "json", env=env)
    assert result.returncode == 1, result.stderr
    finding = findings(result)["ACME002"]
    assert (finding["status"], finding["severity"], finding["symbol"]) == ("present", "warning", "kernel-too-old-for-acme")
    shown = run_cli("references", "show", "ACME002", "--format", "json", env=env)
    assert json.loads(shown.stdout)["title"] == "Kernel ACME002 is older than the site's"
    # Uninstalled, nothing of it is left.
    assert run_cli("references", "show", "ACME002").returncode == 3


def test_a_top_level_plugin_module_cannot_ship_references(run_cli: Runner, example_root: Path, tmp_path: Path) -> None:
    """site-packages/ belongs to every distribution: a reference file there is nobody's."""
    wheel = build_plugin_wheel(
        tmp_path,
        {"acme_single.py": check_module("ACME003", "kernel-too-old-single"), "ACME003.toml": reference_toml("ACME003", "kernel-too-old-single")},
        "[preflight.checks]\nacme = acme_single\n",
    )
    target = tmp_path / "site-packages"
    install(wheel, target)
    assert (target / "ACME003.toml").is_file()
    result = run_cli("node", "--root", str(example_root), "--select", "ACME", env={"PYTHONPATH": str(target)})
    assert result.returncode == 3 and "no reference ACME003 in the catalogue" in result.stderr


def test_where_a_plugin_module_keeps_its_references() -> None:
    import preflight.discovery as package_module
    import textwrap as top_level_module

    assert module_directory(package_module) == str(Path(package_module.__file__).parent)
    assert module_directory(top_level_module) is None


def test_a_prolog_without_extensions_reads_only_its_own_references(example_root: Path, tmp_path: Path) -> None:
    """Nothing beyond the packaged catalogue is read when no site directory or plugin is
    configured, and of the catalogue only the references of the checks the prolog runs."""
    script = textwrap.dedent(f'''
        import json, os, sys
        opened = []
        sys.addaudithook(lambda event, args: opened.append(str(args[0])) if event == "open" and isinstance(args[0], (str, bytes)) else None)
        from preflight.catalogue import catalogue_dir
        from preflight.run import inspect_node, open_node
        report = inspect_node(open_node({str(example_root)!r}, None), profile="prolog")
        print(json.dumps({{"opened": opened, "catalogue": catalogue_dir(), "decided": sorted({{f.reference_id for f in report.findings}})}}))
    ''')
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=str(tmp_path),
                            env={**os.environ, "PYTHONPATH": ""})
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout.splitlines()[-1])
    catalogue = seen["catalogue"]
    assert seen["decided"] and os.path.join(catalogue, "index.json") in seen["opened"]
    tomls = sorted(path for path in seen["opened"] if path.endswith(".toml") and os.path.dirname(path) == catalogue)
    assert tomls == [os.path.join(catalogue, f"{ref_id}.toml") for ref_id in seen["decided"]]
    others = {path for path in seen["opened"] if path.endswith(".toml") and os.path.dirname(path) != catalogue}
    assert others <= {DEFAULT_CONFIG_PATH}  # the site config, which this machine need not have


def test_explain_matches_the_signatures_a_site_reference_ships(run_cli: Runner, example_root: Path, tmp_path: Path) -> None:
    """A site writes signatures for failures only it has; explain ranks them beside the
    catalogue's, and --check runs the site check that decides them."""
    signature = textwrap.dedent('''
        [[signatures]]
        role = "cause"
        pattern = 'acme-fs: scratch quota exceeded on \\S+'
        examples = ["acme-fs: scratch quota exceeded on /scratch/job42"]
    ''')
    site = acme_site(tmp_path, ACME001=reference_toml("ACME001", "kernel-too-old", extra=signature))
    log = tmp_path / "job.log"
    log.write_text("step 10 loss 2.1\nacme-fs: scratch quota exceeded on /scratch/job42\nTraceback (most recent call last):\n")
    plain = run_cli("explain", str(log), "--format", "json")
    assert "ACME001" not in {c["id"] for c in json.loads(plain.stdout)["candidates"]}
    matched = run_cli("explain", str(log), "--checks-dir", str(site), "--format", "json")
    assert matched.returncode == 1, matched.stderr
    assert [c["id"] for c in json.loads(matched.stdout)["candidates"]][:1] == ["ACME001"]
    checked = run_cli("explain", str(log), "--checks-dir", str(site), "--check", "--root", str(example_root), "--format", "json")
    assert checked.returncode == 2, checked.stderr  # the site check finds the example node's kernel too old
    assert json.loads(checked.stdout)["candidates"][0]["id"] == "ACME001"
    # A malformed site reference is a one-line error, as for node.
    (site / "ACME001.toml").write_text("id = ")
    broken = run_cli("explain", str(log), "--checks-dir", str(site))
    assert broken.returncode == 3 and "ACME001.toml" in broken.stderr and "Traceback" not in broken.stderr
