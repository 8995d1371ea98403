"""The house: every import of the project's own modules points down, and no module's imports lead back to it.

Floors: `capture_format` (the shared format) < the four stages `sglang_patch`, `collector_service`, `client`,
`trainer` (each imports only the format and itself) < `eagle_tap` (the command line, what runs on top of the
stages, and the CPU test bed). Every import statement counts, at module level or inside a function: a lazy
import is still an arrow. The checks can fail: each is also run on a made-up graph that breaks it.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
FLOORS = {"capture_format": 0, "sglang_patch": 1, "collector_service": 1, "client": 1, "trainer": 1, "eagle_tap": 2}
STAND_INS = REPO_ROOT / "eagle_tap" / "cpu_standins"
"""Modules SGLang imports in its own processes in place of GPU packages: not part of the import graph."""


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO_ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_imports(path: Path) -> set[str]:
    """The project modules `path` imports (a `from package import name` names package.name when that is a module)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = module_name(path).rsplit(".", 1)[0] if path.name != "__init__.py" else module_name(path)
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            names = [f"{base}.{alias.name}" for alias in node.names]  # trimmed to `base` unless a module
        else:
            continue
        found.update(name for name in names if name.split(".")[0] in FLOORS)
    return found


def import_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports (names resolved to modules that exist)."""
    paths = [path for floor in FLOORS for path in (REPO_ROOT / floor).rglob("*.py") if STAND_INS not in path.parents]
    modules = {module_name(path): path for path in paths}
    graph = {}
    for name, path in modules.items():
        targets = set()
        for imported in project_imports(path):
            while imported not in modules and "." in imported:  # `from a.b import f`: the module is a.b
                imported = imported.rsplit(".", 1)[0]
            if imported in modules and imported != name:
                targets.add(imported)
        graph[name] = targets
    return graph


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Arrows from a floor to a higher one, or between two parts of the stages' floor."""
    wrong = []
    for source, targets in graph.items():
        for target in targets:
            here, there = source.split(".")[0], target.split(".")[0]
            if FLOORS[there] > FLOORS[here] or (FLOORS[there] == FLOORS[here] and here != there):
                wrong.append(f"{source} -> {target}")
    return sorted(wrong)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def test_the_checks_find_a_circle_and_an_upward_import_when_there_is_one() -> None:
    made_up = {"trainer.a": {"trainer.b"}, "trainer.b": {"trainer.a", "capture_format.x"},
               "capture_format.x": {"eagle_tap.cli"}, "eagle_tap.cli": {"trainer.a"}, "client.c": {"trainer.a"}}
    assert cycles(made_up) == [["capture_format.x", "eagle_tap.cli", "trainer.a", "trainer.b"]]
    assert upward_imports(made_up) == ["capture_format.x -> eagle_tap.cli", "client.c -> trainer.a"]


def test_no_import_points_up_a_floor_or_across_the_stages() -> None:
    assert upward_imports(import_graph()) == []


def test_no_import_circle() -> None:
    assert cycles(import_graph()) == []
