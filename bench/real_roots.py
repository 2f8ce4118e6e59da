"""Survey: ``preflight node`` on every real capture of ``tests/data/real-roots``, then on the
root each real ``nvidia-smi -q -x`` dump of ``tests/data/real-nvml`` reads back into (NVML's
answers alone).

Prints, per capture, the exit code and the ``present`` findings by severity, then the totals:
the figure the "missing is not empty" work is judged by (a real capture with nothing planted
should give no ``present`` at error or above unless the capture itself shows it). Give another
build's command to compare, e.g. the last release installed in another venv:

    .venv/bin/python bench/real_roots.py [--preflight /path/to/other/venv/bin/preflight] [--details]

Each run gets an empty ``--config`` so that this machine's /etc/preflight does not colour it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CAPTURES = REPO / "tests" / "data" / "real-roots"
NVML_DUMPS = REPO / "tests" / "data" / "real-nvml"


def survey(preflight: list[str], archive: Path, config: str) -> tuple[int, list[dict[str, str]], Counter[str]]:
    result = subprocess.run(
        [*preflight, "node", "--root", str(archive), "--format", "json", "--config", config],
        capture_output=True, text=True, timeout=120,
    )
    # Exit 3 with a report: every check was unknown (a capture of a few files), which is no verdict
    # but no refusal either; its findings are counted like the others'.
    decided_nothing = result.returncode == 3 and "every check is unknown" in result.stderr
    if result.returncode not in (0, 1, 2) and not decided_nothing:
        return result.returncode, [{"id": "-", "severity": "refused", "subject": result.stderr.strip()[:120]}], Counter()
    report = json.loads(result.stdout)
    present = [f for f in report["findings"] if f["status"] == "present"]
    counted = Counter(f["status"] for f in report["findings"])
    return result.returncode, present, counted


def _nvml_roots(workdir: Path) -> list[Path]:
    """A node root per dump of ``tests/data/real-nvml``, written by its importer."""
    sys.path.insert(0, str(NVML_DUMPS))
    import import_nvidia_smi as importer
    roots = []
    for dump in sorted((NVML_DUMPS / "dumps").glob("*.xml")):
        importer.write_root(dump.read_bytes(), workdir / dump.stem)
        roots.append(workdir / dump.stem)
    return roots


def _survey_all(preflight: list[str], roots: list[Path], config: str, details: bool, what: str) -> None:
    totals: Counter[str] = Counter()
    statuses: Counter[str] = Counter()
    for root in roots:
        code, present, counted = survey(preflight, root, config)
        statuses.update(counted)
        totals["no verdict"] += code == 3 and "refused" not in {f["severity"] for f in present}
        by_severity = Counter(f["severity"] for f in present)
        totals.update(by_severity)
        shown = ", ".join(f"{n} {s}" for s, n in sorted(by_severity.items())) or "-"
        print(f"{root.name.removesuffix('.tar.gz'):48} exit {code}  present: {shown}")
        if details:
            for finding in present:
                print(f"    {finding['id']} {finding['severity']} {finding['subject']}")
    errors = totals["error"] + totals["critical"]
    print(f"\n{len(roots)} {what}: present at error or above {errors}, warnings {totals['warning']}, "
          f"refused {totals['refused']}, no verdict (every check unknown) {totals['no verdict']}; "
          f"all findings {dict(sorted(statuses.items()))}\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preflight", default=str(Path(sys.executable).parent / "preflight"))
    parser.add_argument("--details", action="store_true", help="list every present finding")
    args = parser.parse_args()
    with tempfile.NamedTemporaryFile("w", suffix=".toml") as config, tempfile.TemporaryDirectory() as workdir:
        _survey_all([args.preflight], sorted(CAPTURES.glob("*.tar.gz")), config.name, args.details, "captures")
        _survey_all([args.preflight], _nvml_roots(Path(workdir)), config.name, args.details, "nvidia-smi dumps")


if __name__ == "__main__":
    main()
