"""The built wheel carries every check and reference; the code stays Python 3.10 compatible."""

from __future__ import annotations

import json
import subprocess
import sys
import venv
from pathlib import Path

from conftest import REPO

def test_wheel_in_a_fresh_venv_finds_all_checks_and_references(tmp_path: Path, example_root: Path) -> None:
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "build", "--wheel", "--outdir", str(dist), str(REPO)], check=True, capture_output=True, timeout=300)
    (wheel,) = dist.glob("preflight-*.whl")
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
    checks_in_repo = set()
    for module in (REPO / "checks").glob("*.py"):
        for line in module.read_text().splitlines():
            if line.startswith('@check("'):
                checks_in_repo.add(line.split('"')[1])
    assert decided == checks_in_repo and decided


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
