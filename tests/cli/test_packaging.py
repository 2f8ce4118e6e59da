"""The built wheel (distribution ``gpu-preflight``, with its licence) carries every check and
reference; an editable install and ``python -m preflight`` in the checkout find them too; the
code stays Python 3.10 compatible."""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
import venv
import zipfile
from pathlib import Path

from conftest import REPO

from preflight import __version__
from preflight.catalogue_index import build_index


def checks_in_repo() -> set[str]:
    """Reference IDs of the ``@check`` functions in the repository's ``checks/``."""
    found = set()
    for module in (REPO / "checks").glob("*.py"):
        for line in module.read_text().splitlines():
            if line.startswith('@check("'):
                found.add(line.split('"')[1])
    return found


def test_wheel_in_a_fresh_venv_finds_all_checks_and_references(tmp_path: Path, example_root: Path) -> None:
    dist = tmp_path / "dist"
    # Plain `python -m build`: the sdist, then the wheel built from it (so the sdist carries
    # everything the build needs, setup.py's index step included).
    subprocess.run([sys.executable, "-m", "build", "--outdir", str(dist), str(REPO)], check=True, capture_output=True, timeout=600)
    (wheel,) = dist.glob("gpu_preflight-*.whl")
    (sdist,) = dist.glob("gpu_preflight-*.tar.gz")
    with tarfile.open(sdist) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    assert {"setup.py", "preflight/catalogue_index.py", "references/MEM001.toml"} <= names
    assert "references/index.json" not in names  # built from the TOML files, never shipped stale
    with zipfile.ZipFile(wheel) as archive:
        dist_info = f"gpu_preflight-{__version__}.dist-info"
        metadata = archive.read(f"{dist_info}/METADATA").decode()
        assert archive.read(f"{dist_info}/licenses/LICENSE") == (REPO / "LICENSE").read_bytes()
        index = json.loads(archive.read("preflight/references/index.json"))
    assert index == build_index(str(REPO / "references"))
    assert "Name: gpu-preflight\n" in metadata and "License-Expression: Apache-2.0\n" in metadata
    assert "Apache License" in (REPO / "LICENSE").read_text() and "Version 2.0, January 2004" in (REPO / "LICENSE").read_text()
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = env_dir / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "-q", str(wheel)], check=True, capture_output=True, timeout=300)
    listed = subprocess.run([str(env_dir / "bin" / "preflight"), "references", "list", "--format", "json"], capture_output=True, text=True, timeout=60)
    shipped = {item["id"] for item in json.loads(listed.stdout)}
    assert shipped == {path.stem for path in (REPO / "references").glob("*.toml")}
    report = subprocess.run(
        [str(env_dir / "bin" / "preflight"), "node", "--root", str(example_root), "--format", "json"],
        capture_output=True, text=True, timeout=60,
    )
    decided = {finding["id"] for finding in json.loads(report.stdout)["findings"]}
    assert decided == checks_in_repo() and decided


def test_editable_install_and_python_m_in_the_checkout(tmp_path: Path) -> None:
    """`pip install -e .` (what contributors do) and `python -m preflight` in the repository find
    checks/ and references/ at the top of the checkout, not a copy."""
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = str(env_dir / "bin" / "python")
    install = subprocess.run([python, "-m", "pip", "install", "-q", "-e", str(REPO)], capture_output=True, text=True, timeout=600)
    assert install.returncode == 0, install.stderr[-2000:]
    where = subprocess.run(
        [python, "-c", "import importlib.metadata as m, preflight, preflight.checks as c, preflight.catalogue as r;"
         "print(m.version('gpu-preflight'), preflight.__file__, *c.__path__, r.catalogue_dir())"],
        capture_output=True, text=True, timeout=60, cwd=str(tmp_path),
    )
    assert where.stdout.split() == [
        __version__, str(REPO / "preflight" / "__init__.py"), str(REPO / "checks"), str(REPO / "references")
    ], where.stderr
    # The editable build wrote the catalogue's index into the checkout (git ignores it).
    assert json.loads((REPO / "references" / "index.json").read_text()) == build_index(str(REPO / "references"))
    # The editable console script, and `python -m` both in this venv and in the one running the
    # tests (there the checkout's preflight/ shadows the installed copy).
    for command in ([str(env_dir / "bin" / "preflight")], [python, "-m", "preflight"], [sys.executable, "-m", "preflight"]):
        version = subprocess.run([*command, "--version"], capture_output=True, text=True, timeout=60, cwd=str(REPO))
        assert (version.returncode, version.stdout) == (0, f"preflight {__version__}\n"), version.stderr
        report = subprocess.run(
            [*command, "node", "--root", "examples/nodes/hgx-h100", "--format", "json"],
            capture_output=True, text=True, timeout=60, cwd=str(REPO),
        )
        assert report.returncode == 2, report.stderr
        assert {finding["id"] for finding in json.loads(report.stdout)["findings"]} == checks_in_repo()


def test_source_is_python_310_compatible() -> None:
    result = subprocess.run(
        [str(Path(sys.executable).parent / "vermin"), "--no-tips", "--violations", "-t=3.10-", "--eval-annotations",
         str(REPO / "preflight"), str(REPO / "checks")],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_installed_package_passes_mypy_strict(tmp_path: Path) -> None:
    """Type-check what ships (checks/ mapped into preflight.checks), with the repo's settings."""
    result = subprocess.run(
        [str(Path(sys.executable).parent / "mypy"), "--config-file", str(REPO / "pyproject.toml"),
         "--cache-dir", str(tmp_path / "cache"), "-p", "preflight"],
        capture_output=True, text=True, timeout=300, cwd=str(tmp_path),
    )
    assert result.returncode == 0, result.stdout + result.stderr
