"""Safety of the package source, read with ``ast``: no ``shell=True``; every subprocess call has a
``timeout=`` and an argument list rather than a command string; no ``os.system``/``os.popen``
(or the other ``os`` calls that hand a string to a shell or replace the process)."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import REPO

PACKAGE_DIRS = (REPO / "preflight", REPO / "checks")
SUBPROCESS_CALLS = frozenset({"run", "call", "check_call", "check_output", "Popen", "getoutput", "getstatusoutput"})
# Popen has no timeout of its own: its communicate()/wait() must carry one (checked below).
NEEDS_TIMEOUT = SUBPROCESS_CALLS - {"Popen", "getoutput", "getstatusoutput"}
FORBIDDEN_OS = frozenset({"system", "popen", "execl", "execlp", "execle", "execv", "execvp", "execvpe", "spawnl", "spawnlp", "spawnv", "spawnvp"})


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


class SafetyScan(ast.NodeVisitor):
    """Collects unsafe process calls in one module, resolving ``import subprocess as sp`` and
    ``from subprocess import run``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.aliases: dict[str, str] = {}  # local name -> "subprocess" / "subprocess.run" / "os" / "os.system"
        self.problems: list[str] = []

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.name in ("subprocess", "os"):
                self.aliases[alias.asname or alias.name] = alias.name

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.module in ("subprocess", "os"):
            for alias in node.names:
                self.aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"

    def _target(self, func: ast.AST) -> str:
        dotted = _dotted(func)
        head, _, rest = dotted.partition(".")
        if head in self.aliases:
            return f"{self.aliases[head]}.{rest}" if rest else self.aliases[head]
        return ""

    def visit_Call(self, node: ast.Call) -> None:
        target = self._target(node.func)
        where = f"{self.path.relative_to(REPO)}:{node.lineno}"
        keywords = {keyword.arg: keyword.value for keyword in node.keywords}
        module, _, name = target.partition(".")
        if module == "subprocess" and name in SUBPROCESS_CALLS:
            shell = keywords.get("shell")
            if shell is not None and not (isinstance(shell, ast.Constant) and shell.value is False):
                self.problems.append(f"{where}: subprocess.{name} with shell={ast.unparse(shell)}")
            if name in ("getoutput", "getstatusoutput"):
                self.problems.append(f"{where}: subprocess.{name} runs a shell")
            if name in NEEDS_TIMEOUT and "timeout" not in keywords:
                self.problems.append(f"{where}: subprocess.{name} without timeout=")
            command = node.args[0] if node.args else keywords.get("args")
            if isinstance(command, (ast.Constant, ast.JoinedStr, ast.BinOp)) or (
                isinstance(command, ast.Call) and _dotted(command.func).endswith(("format", "join"))
                and not isinstance(command.func, ast.Name)
            ):
                self.problems.append(f"{where}: subprocess.{name} with a command string, not an argument list")
        if module == "os" and name in FORBIDDEN_OS:
            self.problems.append(f"{where}: os.{name}")
        if isinstance(node.func, ast.Attribute) and node.func.attr in ("communicate", "wait") and "timeout" not in keywords:
            receiver = _dotted(node.func.value)
            if receiver and not receiver.endswith(("event", "gate", "done", "stop")) and not node.args:
                # Popen.communicate()/wait() without a timeout waits forever on a hung child.
                if any(word in receiver.lower() for word in ("proc", "popen", "child")):
                    self.problems.append(f"{where}: {receiver}.{node.func.attr}() without timeout=")
        self.generic_visit(node)


def scan(source: str, path: Path = REPO / "preflight" / "example.py") -> list[str]:
    scanner = SafetyScan(path)
    scanner.visit(ast.parse(source))
    return scanner.problems


def package_files() -> list[Path]:
    return sorted(path for directory in PACKAGE_DIRS for path in directory.rglob("*.py"))


def test_package_runs_no_shell_and_no_unbounded_subprocess() -> None:
    problems = [problem for path in package_files() for problem in scan(path.read_text(), path)]
    assert problems == []


def test_scan_finds_what_it_looks_for() -> None:
    """The scanner itself: each unsafe form is reported, the safe form is not."""
    unsafe = {
        "import subprocess\nsubprocess.run(['ls'], shell=True, timeout=1)\n": "shell=True",
        "import subprocess\nsubprocess.run(['ls'])\n": "without timeout=",
        "import subprocess as sp\nsp.check_output('ls -l', timeout=1)\n": "command string",
        "from subprocess import run\nrun(f'ls {x}', timeout=1)\n": "command string",
        "import os\nos.system('reboot')\n": "os.system",
        "from os import popen\npopen('ls')\n": "os.popen",
        "import subprocess\nsubprocess.getoutput('ls')\n": "runs a shell",
        "import subprocess\nproc = subprocess.Popen(['ls'])\nproc.communicate()\n": "communicate() without timeout",
    }
    for source, expected in unsafe.items():
        found = scan(source)
        assert any(expected in problem for problem in found), (source, found)
    safe = "import subprocess\nsubprocess.run(['scontrol', 'show', 'node', name], timeout=5, check=False)\n"
    assert scan(safe) == []
    assert package_files(), "the scan must see the package"
