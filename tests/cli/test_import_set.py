"""The prolog's import set, guarded in both of its processes.

``python -X importtime`` misses modules loaded through ``importlib.import_module`` (every check
module) and everything the probes' child process imports after the fork. So this records
``sys.modules`` itself: in the reporting process when it exits, and in the probes' child when it
leaves through ``os._exit``. Each library named here cost the prolog milliseconds it does not
need on that path (figures from bench/prolog.py's history in docs/performance.md).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conftest import HEAVY

#: Run in place of the console entry: both processes write their module names on the way out.
RECORDER = """
import os, sys
target = sys.argv[1]
real_exit = os._exit
def record():
    with open(f"{target}.{os.getpid()}", "w") as out:
        out.write("\\n".join(sorted(sys.modules)))
def leave(code):
    record()
    real_exit(code)
os._exit = leave
import atexit
atexit.register(record)
from preflight.cli.start import main
main(sys.argv[2:])
"""

#: Never on the prolog's path: the CLI framework and node libraries a recorded root does not use,
#: and what a careless import pulls in (typing_extensions -> inspect -> ast, tokenize;
#: importlib.metadata -> email, zipfile, csv; dataclasses -> inspect; msgspec -> uuid -> platform).
NEVER = HEAVY | {
    "typing_extensions", "inspect", "ast", "tokenize", "dataclasses", "importlib.metadata", "email", "zipfile", "csv",
    "tomllib", "asyncio", "ssl", "platform",
}


def imported(args: list[str], cwd: Path) -> list[set[str]]:
    """The modules of each process of one run, the reporting process (the one started) first."""
    target = cwd / "modules"
    process = subprocess.Popen([sys.executable, "-c", RECORDER, str(target), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd)
    _, stderr = process.communicate(timeout=120)
    assert "Traceback" not in stderr, stderr[-2000:]
    files = sorted(cwd.glob("modules.*"), key=lambda path: path.name != f"modules.{process.pid}")
    return [set(path.read_text().split()) for path in files]


def test_prolog_on_a_recorded_root_imports_nothing_it_does_not_use(example_root: Path, tmp_path: Path) -> None:
    processes = imported(["node", "--root", str(example_root), "--profile", "prolog", "--format", "json"], tmp_path)
    assert len(processes) == 2, "the probes ran in a child process"
    reporting, probing = processes
    for names in processes:
        assert names & NEVER == set(), sorted(names & NEVER)
    assert "preflight.checks.gpu" in reporting and "preflight.checks.net" not in reporting  # full-profile only
    # The child was started before the check modules were imported: it has the probes alone.
    assert "preflight.probes.rdma" in probing and not any(name.startswith("preflight.checks.") for name in probing)


def test_live_prolog_imports_no_dns_library_or_package_metadata(tmp_path: Path) -> None:
    """The live prolog asks DNS and NVML; the DNS client is preflight's own (dnspython with
    importlib.metadata cost 60-90 ms a run), and NVML's library is the only node library."""
    processes = imported(["node", "--profile", "prolog", "--format", "json"], tmp_path)
    never_live = NEVER - {"pynvml", "socket"}
    for names in processes:
        assert names & never_live == set(), sorted(names & never_live)
