"""Only ``preflight/sources`` touches the node: no other module opens files, lists directories,
opens sockets, runs programs or loads native libraries.

A few modules read the tool's *own* data (the packaged catalogue, check modules) and the launcher
exits the process; they are listed with the reason.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
FORBIDDEN_CALLS = {
    "open", "os.open", "os.listdir", "os.scandir", "os.stat", "os.lstat", "os.readlink", "os.walk",
    "os.path.exists", "os.path.isfile", "os.path.isdir", "os.path.islink", "os.path.realpath",
    "io.open", "socket.socket", "socket.create_connection", "socket.getaddrinfo", "socket.gethostname",
    "subprocess.run", "subprocess.Popen", "subprocess.check_output", "subprocess.call", "os.system",
    "ctypes.CDLL", "ctypes.cdll.LoadLibrary", "resource.getrlimit",
}
FORBIDDEN_METHODS = {"read_text", "read_bytes", "open", "iterdir", "glob", "rglob"}
FORBIDDEN_IMPORTS = {"pynvml", "pyroute2", "dns", "pyudev", "socket", "subprocess", "ctypes"}
# module -> why it may do I/O that is not about the node
ALLOWED = {
    "preflight/catalogue.py": "reads the packaged reference catalogue",
    "preflight/catalogue_index.py": "reads and (at build time) writes the packaged catalogue's index",
    "preflight/discovery.py": "lists check modules to import them, and the references they ship",
    "preflight/explain/reader.py": "reads the log files a user hands to explain, not the node",
    "preflight/fleet/load.py": "reads the node reports a user hands to fleet, not the node",
    "preflight/sourcetree.py": "looks at the package's own checkout (pyproject.toml, checks/), not the node",
    "preflight/slurm.py": "the Slurm boundary, like a source: runs scontrol, writes the last-result file, sends syslog",
}


def python_files() -> list[Path]:
    files = sorted((REPO / "preflight").rglob("*.py")) + sorted((REPO / "checks").rglob("*.py"))
    return [f for f in files if "sources" not in f.relative_to(REPO).parts]


def dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{dotted(node.value)}.{node.attr}"
    return ""


def violations(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call):
            name = dotted(node.func)
            if name in FORBIDDEN_CALLS:
                found.append(f"{path.name}:{node.lineno} calls {name}")
            elif (
                isinstance(node.func, ast.Attribute)
                and node.func.attr in FORBIDDEN_METHODS
                and not dotted(node.func.value).endswith("fs")  # the injected NodeFS source
            ):
                found.append(f"{path.name}:{node.lineno} calls .{node.func.attr}()")
        elif isinstance(node, ast.Import):
            found += [f"{path.name}:{node.lineno} imports {a.name}" for a in node.names if a.name.split(".")[0] in FORBIDDEN_IMPORTS]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in FORBIDDEN_IMPORTS:
            found.append(f"{path.name}:{node.lineno} imports {node.module}")
    return found


@pytest.mark.parametrize("path", python_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_no_direct_node_io_outside_sources(path: Path) -> None:
    if str(path.relative_to(REPO)) in ALLOWED:
        return
    assert violations(path) == []


def test_the_scanner_catches_violations(tmp_path: Path) -> None:
    sample = tmp_path / "bad.py"
    sample.write_text("import subprocess\nfrom pathlib import Path\nopen('/sys/x')\nPath('/proc').read_text()\nimport pynvml\n")
    assert len(violations(sample)) == 4
