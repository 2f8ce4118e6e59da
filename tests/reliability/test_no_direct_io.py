"""Only ``preflight/sources`` touches the node: no other module opens files, lists directories,
opens sockets, runs programs or loads native libraries.

The rule is enforced at run time, in every test: ``tests/audit/io_audit.py`` is an audit hook
that ``conftest.py`` installs for the whole session (and, through ``sitecustomize``, in the
Python processes the tests start); a test during which a check, a probe or any other preflight
module outside the sources and ``io_audit.ALLOWED`` raised a node event fails with the module,
the event and its arguments. This file proves the hook catches what it must and only that.

What no audit event announces (``os.stat``, ``os.path.exists``, ``Path.exists()``, ``os.readlink``,
``resource.getrlimit``, ``pwd``, ``os.environ``, ``importlib.import_module``...) a small AST check
below looks for, in check and probe modules only (``checks/``, ``preflight/probes/``): there,
such calls read the node; elsewhere (the CLI checking ``--output``, the catalogue) they do not.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

import io_audit
from conftest import AUDIT, EXAMPLE_ROOT, REPO, Runner

# ---- the audit hook ----------------------------------------------------------------------------


@contextmanager
def captured() -> Iterator[list[io_audit.Violation]]:
    """The violations recorded in this process inside the block, taken out of the session's
    list so that they do not fail the test that provoked them on purpose."""
    start = len(io_audit.violations)
    found: list[io_audit.Violation] = []
    try:
        yield found
    finally:
        found.extend(io_audit.violations[start:])
        del io_audit.violations[start:]


LISTING_PROBES = {
    "os.listdir": """
        import os
        from preflight.registry import probe

        @probe("listing", gather_in=("full",))
        def probe_listing(fs):
            return {"names": sorted(os.listdir(fs.root))}
    """,
    "from os import listdir": """
        from os import listdir
        from preflight.registry import probe

        @probe("listing", gather_in=("full",))
        def probe_listing(fs):
            return {"names": sorted(listdir(fs.root))}
    """,
}


def site_checks(tmp_path: Path, source: str) -> Path:
    directory = tmp_path / "checks.d"
    directory.mkdir()
    (directory / "lister.py").write_text(textwrap.dedent(source))
    return directory


@pytest.mark.parametrize("source", LISTING_PROBES.values(), ids=LISTING_PROBES.keys())
def test_a_site_probe_listing_the_node_is_caught_in_process(tmp_path: Path, source: str) -> None:
    from preflight.config import HostConfig
    from preflight.discovery import build_registry
    from preflight.engine import RunOptions, run
    from preflight.sources import Sources

    registry = build_registry([str(site_checks(tmp_path, source))], plugins=False)
    with captured() as found:
        report = run(registry, Sources.for_node(str(EXAMPLE_ROOT)), HostConfig(), RunOptions(select=("MEM001",)), "gpu017")
    assert next(p for p in report.probes if p.name == "listing").status == "ok"  # it ran, in a probe thread
    (violation,) = [v for v in found if v.event == "os.listdir"]
    assert violation.module.startswith("preflight_site_checks_") and violation.module.endswith(".lister")
    assert violation.arguments == repr((str(EXAMPLE_ROOT),))
    assert violation.location.endswith("lister.py:7")


@pytest.mark.parametrize("source", LISTING_PROBES.values(), ids=LISTING_PROBES.keys())
def test_a_site_probe_listing_the_node_is_caught_in_a_child_process(run_cli: Runner, tmp_path: Path, source: str) -> None:
    log = tmp_path / "audit.tsv"  # this run's own log, so that the session's stays clean
    result = run_cli("node", "--root", str(EXAMPLE_ROOT), "--checks-dir", str(site_checks(tmp_path, source)), "--format", "json",
                     env={io_audit.LOG_VARIABLE: str(log)})
    assert result.returncode in (0, 1, 2), result.stderr
    found, _ = io_audit.read_log(str(log), 0)
    assert [(v.module.rpartition(".")[2], v.event, v.arguments) for v in found] == [("lister", "os.listdir", repr((str(EXAMPLE_ROOT),)))]


def run_as(module: str, code: str, **names: object) -> list[io_audit.Violation]:
    """Run ``code`` as if it were module ``module`` and return what the hook recorded."""
    with captured() as found:
        exec(compile(textwrap.dedent(code), f"<{module}>", "exec"), {"__name__": module, **names})
    return found


@pytest.mark.parametrize("module", ["preflight.checks.fake", "preflight.probes.fake", "preflight.engine", "preflight.reporters.fake"])
def test_node_io_from_any_module_but_the_sources_is_a_violation(tmp_path: Path, module: str) -> None:
    (tmp_path / "hostname").write_text("gpu017\n")
    found = run_as(module, """
        import os, pathlib, socket, subprocess
        os.listdir(where)
        pathlib.Path(where, "hostname").read_text()
        list(pathlib.Path(where).glob("*"))
        socket.socket(socket.AF_INET, socket.SOCK_DGRAM).close()
        subprocess.run(["true"], check=True)
    """, where=str(tmp_path))
    assert [v.event for v in found] == ["os.listdir", "open", "pathlib.Path.glob", "os.scandir", "socket.__new__", "subprocess.Popen"]
    assert {v.module for v in found} == {module}


def test_first_import_of_a_node_library_is_a_violation() -> None:
    # sys.audit raises the event an import statement raises for a module not yet imported.
    found = run_as("preflight.checks.fake", 'import sys\nsys.audit("import", "pynvml", None, sys.path, sys.meta_path, sys.path_hooks)')
    assert [(v.module, v.event) for v in found] == [("preflight.checks.fake", "import")]
    assert run_as("preflight.checks.fake", 'import sys\nsys.audit("import", "json.decoder", None, [], [], [])') == []


def test_sources_and_the_allowed_modules_may_do_io(tmp_path: Path) -> None:
    for module in ("preflight.sources.fs", "preflight.sources.future_source", *io_audit.ALLOWED):
        assert run_as(module, "import os\nos.listdir(where)", where=str(tmp_path)) == [], module


def test_io_of_tests_and_libraries_is_not_attributed(tmp_path: Path) -> None:
    with captured() as found:
        os.listdir(tmp_path)
        (tmp_path / "x").write_text("x")
        subprocess.run(["true"], check=True)
    assert found == []


def test_what_a_source_does_for_a_check_is_the_sources_doing(tmp_path: Path) -> None:
    """A check calls the source; the source, the innermost preflight frame, opens the file."""
    from preflight.sources import Sources

    fs = Sources.for_node(str(EXAMPLE_ROOT)).fs
    found = run_as("preflight.checks.fake", "text = fs.read('/etc/hostname')\nnames = fs.listdir('/etc')", fs=fs)
    assert found == [] and fs.read("/etc/hostname") == "gpu017\n"


def test_the_import_machinery_reading_modules_is_not_the_importers_io(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "freshly_written_module.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        assert run_as("preflight.checks.fake", "import freshly_written_module") == []
        # ... under the name the frozen machinery has before importlib is first imported, too
        machinery: dict[str, object] = {"__name__": "_frozen_importlib_external"}
        exec("import os\ndef get_data(path):\n    return os.listdir(path)\n", machinery)
        assert run_as("preflight.checks.fake", "get_data(where)", get_data=machinery["get_data"], where=str(tmp_path)) == []
        # ... and a traceback reading preflight's own source is not I/O on the node either.
        assert run_as("preflight.checks.fake", "import traceback\ntraceback.format_stack()") == []
    finally:
        sys.modules.pop("freshly_written_module", None)


def test_a_violation_fails_the_test_it_happened_in(tmp_path: Path) -> None:
    """An inner pytest run with this suite's conftest: the test that lists a directory as a
    check module fails at teardown naming it; its neighbour passes."""
    shutil.copy(Path(__file__).resolve().parents[1] / "conftest.py", tmp_path / "conftest.py")
    shutil.copytree(AUDIT, tmp_path / "audit")
    (tmp_path / "test_inner.py").write_text(textwrap.dedent(f"""
        def test_lists_as_a_check():
            exec("import os; os.listdir({str(tmp_path)!r})", {{"__name__": "preflight.checks.inner"}})

        def test_lists_as_a_test():
            import os; os.listdir({str(tmp_path)!r})
    """))
    environment = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", io_audit.LOG_VARIABLE)}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--basetemp", str(tmp_path / "basetemp"), "test_inner.py"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path, env=environment,  # timeout: a hang guard only
    )
    assert result.returncode == 1 and "1 failed, 1 passed" in result.stdout, result.stdout + result.stderr
    assert "FAILED test_inner.py::test_lists_as_a_check" in result.stdout
    assert f"preflight.checks.inner (<string>:1): os.listdir('{tmp_path}',)" in result.stdout


# ---- what the hook cannot see: a small AST check, check and probe modules only --------------

#: Calls that read the node but raise no audit event.
SILENT_CALLS = {
    "os.stat", "os.lstat", "os.fstat", "os.statvfs", "os.access", "os.readlink", "os.uname",
    "os.getloadavg", "os.cpu_count", "os.sched_getaffinity", "os.getenv", "os.getenvb",
    "os.path.exists", "os.path.lexists", "os.path.isfile", "os.path.isdir", "os.path.islink",
    "os.path.ismount", "os.path.realpath", "os.path.getsize", "os.path.getmtime", "os.path.samefile",
    "shutil.disk_usage", "shutil.which", "resource.getrlimit", "__import__", "importlib.import_module",
}
SILENT_ATTRIBUTES = {"os.environ", "os.environb"}
#: Path methods that stat or resolve without an event; on a source (``fs.exists``) they are fine.
SILENT_METHODS = {"exists", "is_file", "is_dir", "is_symlink", "is_mount", "stat", "lstat", "resolve", "readlink", "samefile"}
#: The names probes receive their sources under (preflight.sources.Sources).
SOURCE_PARAMETERS = {"fs", "nvml", "netlink", "dns", "clock"}
#: Modules a check or probe has no business importing: node libraries (their first import is
#: audited, a later one is not), and modules whose use is node access without events.
FORBIDDEN_IMPORTS = {"pynvml", "pyroute2", "dns", "pyudev", "socket", "subprocess", "ctypes", "fcntl", "mmap",
                     "importlib", "pwd", "grp", "resource", "platform", "shutil"}


def check_and_probe_modules() -> list[Path]:
    return sorted((REPO / "checks").rglob("*.py")) + sorted((REPO / "preflight" / "probes").rglob("*.py"))


def dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{dotted(node.value)}.{node.attr}"
    return ""


def silent_io(path: Path) -> list[str]:
    """file:line and what, for every node access in ``path`` that no audit event announces."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        where = f"{path.name}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Call):
            name = dotted(node.func)
            receiver = dotted(node.func.value).rpartition(".")[2] if isinstance(node.func, ast.Attribute) else ""
            if name in SILENT_CALLS:
                found.append(f"{where} calls {name}")
            elif isinstance(node.func, ast.Attribute) and node.func.attr in SILENT_METHODS and receiver not in SOURCE_PARAMETERS:
                found.append(f"{where} calls .{node.func.attr}() on {dotted(node.func.value) or 'an expression'}")
        elif isinstance(node, ast.Attribute) and dotted(node) in SILENT_ATTRIBUTES:
            found.append(f"{where} reads {dotted(node)}")
        elif isinstance(node, ast.Import):
            found += [f"{where} imports {alias.name}" for alias in node.names if alias.name.split(".")[0] in FORBIDDEN_IMPORTS]
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module.split(".")[0] in FORBIDDEN_IMPORTS:
                found.append(f"{where} imports {node.module}")
            found += [f"{where} imports {node.module}.{alias.name}" for alias in node.names if f"{node.module}.{alias.name}" in SILENT_CALLS | SILENT_ATTRIBUTES]
    return found


@pytest.mark.parametrize("path", check_and_probe_modules(), ids=lambda p: str(p.relative_to(REPO)))
def test_check_and_probe_modules_do_no_silent_node_io(path: Path) -> None:
    assert silent_io(path) == []


def test_the_scanner_catches_what_the_hook_cannot_see(tmp_path: Path) -> None:
    sample = tmp_path / "bad.py"
    sample.write_text(textwrap.dedent("""
        import os, importlib
        from os.path import exists
        from pathlib import Path
        os.stat("/dev/nvidia0")
        Path("/sys/module/nvidia_peermem").exists()
        exists("/etc/nccl.conf")
        home = os.environ["HOME"]
        importlib.import_module("pynvml")
        fs.exists("/sys/module/nvidia_peermem")
        match.group(1)
    """))
    assert sorted(silent_io(sample)) == [
        "bad.py:2 imports importlib", "bad.py:3 imports os.path.exists", "bad.py:5 calls os.stat",
        "bad.py:6 calls .exists() on an expression", "bad.py:8 reads os.environ", "bad.py:9 calls importlib.import_module",
    ]
