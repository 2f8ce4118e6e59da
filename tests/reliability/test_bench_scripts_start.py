"""The benchmarks in bench/ are run by hand and quoted in closing notes, so nothing else notices
when one stops importing (bench/fuzz.py lost tests/reliability from its path when the tests moved
there). Each must at least start and print its usage; their figures are never timed here."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# explain_accuracy.py takes no options: it measures at once, and tests/explain runs its figures.
SCRIPTS = sorted(path for path in (REPO / "bench").glob("*.py") if path.name != "explain_accuracy.py")


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda path: path.stem)
def test_bench_script_starts(script: Path) -> None:
    result = subprocess.run([sys.executable, str(script), "--help"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "usage:" in result.stdout, result.stderr[-2000:]
