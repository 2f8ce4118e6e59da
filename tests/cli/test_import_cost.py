"""The prolog path must not pay for imports it does not use (DESIGN.md: import cost is part of
the budget). Measured with ``python -X importtime`` on the real command."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conftest import HEAVY


def imported_top_level(args: list[str], cwd: Path) -> set[str]:
    # Run outside the repository: with "-c", the current directory comes first on sys.path and
    # the source tree (without checks/ mapped into it) would shadow the installed package.
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", "import sys; from preflight.cli.start import main; main(sys.argv[1:])", *args],
        capture_output=True, text=True, timeout=60, cwd=cwd,
    )
    assert result.returncode in (0, 1, 2) and "Traceback" not in result.stderr, result.stderr[-2000:]
    modules = set()
    for line in result.stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            modules.add(line.rsplit("|", 1)[1].strip().split(".")[0])
    return modules


def test_prolog_json_on_recorded_root_imports_nothing_heavy(example_root: Path, tmp_path: Path) -> None:
    modules = imported_top_level(["node", "--root", str(example_root), "--profile", "prolog", "--format", "json"], tmp_path)
    assert "preflight" in modules
    assert modules & HEAVY == set()


def test_table_output_imports_tabulate_but_not_the_cli_framework(example_root: Path, tmp_path: Path) -> None:
    modules = imported_top_level(["node", "--root", str(example_root), "--profile", "prolog"], tmp_path)
    assert "tabulate" in modules
    assert modules & {"typer", "pydantic", "rich", "click", "pyroute2", "pynvml"} == set()


def test_live_nvml_is_imported_only_by_the_probe_that_uses_it(example_root: Path, tmp_path: Path) -> None:
    modules = imported_top_level(["node", "--root", str(example_root), "--profile", "prolog", "--format", "json", "--select", "MEM"], tmp_path)
    assert "pynvml" not in modules and "dns" not in modules


def test_fleet_imports_neither_the_cli_framework_nor_node_probing(tmp_path: Path) -> None:
    """A 10,000-node audit has a 3 s budget: typer's start-up alone would be a tenth of it."""
    (tmp_path / "gpu001.json").write_text((Path(__file__).resolve().parents[1] / "golden" / "hgx-h100.json").read_text())
    modules = imported_top_level(["fleet", str(tmp_path), "--format", "json"], tmp_path)
    assert "preflight" in modules and "msgspec" in modules
    assert modules & HEAVY == set()


def test_explain_imports_neither_the_cli_framework_nor_node_probing(tmp_path: Path) -> None:
    log = tmp_path / "job.log"
    log.write_text("node1:1:1 [0] NCCL WARN NET/IB : Got completion from peer 10.0.0.2<1> with status=12 opcode=1 len=0 vendor err 129\n")
    modules = imported_top_level(["explain", str(log), "--format", "json"], tmp_path)
    assert "preflight" in modules
    assert modules & HEAVY == set()
