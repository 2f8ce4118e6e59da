"""The house rules of the code base, checked on the source: no import cycles, no private names
imported across modules, probes apart from checks, and an ID that tells its file."""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[0] == "checks":  # shipped as preflight.checks
        parts = ["preflight", "checks", *parts[1:]]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in [*(REPO / "preflight").rglob("*.py"), *(REPO / "checks").glob("*.py")]}


def _for_type_checkers_only(parents: list[ast.AST]) -> bool:
    return any(isinstance(parent, ast.If) and "TYPE_CHECKING" in ast.unparse(parent.test) for parent in parents)


def imports(module: str) -> list[tuple[str, list[str]]]:
    """(imported module, names) of every import that runs, also inside functions (a lazy import
    is still a dependency); imports for type checkers only are left out."""
    found = []
    stack: list[tuple[ast.AST, list[ast.AST]]] = [(ast.parse(MODULES[module].read_text()), [])]
    while stack:
        node, parents = stack.pop()
        stack.extend((child, [*parents, node]) for child in ast.iter_child_nodes(node))
        if _for_type_checkers_only(parents):
            continue
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.append((node.module, [alias.name for alias in node.names]))
        elif isinstance(node, ast.Import):
            found.extend((alias.name, []) for alias in node.names)
    return found


def dependency_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = defaultdict(set)
    for module in MODULES:
        for target, names in imports(module):
            for name in names or [""]:
                full = f"{target}.{name}" if f"{target}.{name}" in MODULES else target
                if full in MODULES and full != module:
                    graph[module].add(full)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(set(graph) | {target for targets in graph.values() for target in targets}):
        if node not in index:
            visit(node)
    return found


def test_no_import_cycles() -> None:
    assert cycles(dependency_graph()) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_private_name_is_imported_from_another_module() -> None:
    private = [
        f"{module} imports {name} from {target}"
        for module in MODULES
        for target, names in imports(module)
        for name in names
        if target.startswith("preflight") and name.startswith("_") and not name.startswith("__")
    ]
    assert private == []


def _decorated(path: Path, decorator: str) -> list[str]:
    """First arguments of ``@decorator("...")`` in a module."""
    return re.findall(rf'^@{decorator}\("([^"]+)"', path.read_text(), re.M)


def test_an_id_tells_its_file_and_check_modules_only_judge() -> None:
    """checks/<family>.py decides exactly the references of its family (PCI003 -> checks/pci.py)
    and defines no probe."""
    families = sorted((REPO / "checks").glob("*.py"))
    assert families
    for path in families:
        ids = _decorated(path, "check")
        assert ids, f"{path.name} decides nothing"
        assert {re.match(r"[A-Z]+", ref_id).group(0).lower() for ref_id in ids} == {path.stem}, path.name  # type: ignore[union-attr]
        assert _decorated(path, "probe") == [], f"{path.name} defines probes"


def test_probe_modules_are_named_after_their_probe_and_never_judge() -> None:
    for path in sorted((REPO / "preflight" / "probes").glob("[!_]*.py")):
        names = _decorated(path, "probe")
        assert names and names[0] == path.stem, f"{path.name}: first probe {names[:1]}"
        assert all(name.startswith(path.stem) for name in names), path.name
        assert _decorated(path, "check") == [], f"{path.name} defines checks"
