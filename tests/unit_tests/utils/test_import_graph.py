"""The package's import graph, read from the sources: no circle, and the layers import only downwards.

Every ``import`` counts, function-level ones included (they run too, only later). Two graphs are read: the run-time
one, without the imports under ``if TYPE_CHECKING:`` (they never run), and the full one, with them: a type-only
import is still a dependency a reader (and a type checker) follows, so it may not close a circle or reach a higher
layer either.
"""

import ast
import functools
from pathlib import Path

import pytest

import megatron.bridge

PACKAGE = "megatron.bridge"
ROOT = Path(megatron.bridge.__file__).resolve().parent


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join([PACKAGE, *parts])] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST, type_only: bool = False) -> list[ast.stmt]:
    """Every import statement in ``tree`` (at any depth); those under ``if TYPE_CHECKING:`` only with ``type_only``."""
    found: list[ast.stmt] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if not type_only and isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.orelse:
                    visit_stmt(stmt)
                continue
            visit_stmt(child)

    def visit_stmt(node: ast.AST) -> None:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        visit(node)

    visit(tree)
    return found


@functools.cache
def import_graph(type_only: bool = False) -> dict[str, set[str]]:
    """Module -> the modules of this package it imports (with ``type_only``, also under ``if TYPE_CHECKING:``)."""
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in _imports(ast.parse(path.read_text(), str(path)), type_only):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                # ``from pkg import mod`` imports the module pkg.mod; ``from mod import name`` imports mod.
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            graph[name] |= {t for t in targets if t in modules and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle per strongly connected component of more than one module (Tarjan), as a closed path."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(component)

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return [_closed_path(graph, set(c)) for c in components]


def _closed_path(graph: dict[str, set[str]], members: set[str]) -> list[str]:
    """A circle through the first of ``members``, staying inside them (breadth-first, shortest)."""
    start = min(members)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt_frontier = []
        for node in frontier:
            for nxt in sorted(graph[node] & members):
                if nxt == start:
                    return [*paths[node], start]
                if nxt not in paths:
                    paths[nxt] = [*paths[node], nxt]
                    nxt_frontier.append(nxt)
        frontier = nxt_frontier
    return sorted(members)


def _short(name: str) -> str:
    return name.removeprefix(PACKAGE + ".")


@pytest.mark.parametrize("type_only", [False, True], ids=["run-time imports", "with type-only imports"])
def test_the_package_has_no_import_circle(type_only):
    found = cycles(import_graph(type_only))
    assert not found, "import circles:\n" + "\n".join(" -> ".join(map(_short, c)) for c in found)


@pytest.mark.parametrize("type_only", [False, True], ids=["run-time imports", "with type-only imports"])
def test_models_and_data_import_from_training_only_its_config(type_only):
    allowed = {f"{PACKAGE}.training", f"{PACKAGE}.training.config"}
    bad = [
        f"{_short(module)} imports {_short(target)}"
        for module, targets in import_graph(type_only).items()
        if _short(module).split(".")[0] in ("models", "data")
        for target in sorted(targets)
        if _short(target).split(".")[0] == "training" and target not in allowed
    ]
    assert not bad, "models/ and data/ may import training.config and utils only:\n" + "\n".join(bad)


def test_the_config_checks_import_neither_the_config_nor_its_sections():
    """The layers: ``config`` imports ``config_sections``, both import ``config_checks``, never the other way."""
    above = (f"{PACKAGE}.training.config", f"{PACKAGE}.training.config_sections")
    bad = [
        f"{_short(module)} imports {_short(target)}"
        for module, targets in import_graph(type_only=True).items()
        if module.startswith(f"{PACKAGE}.training.config_checks")
        for target in sorted(targets)
        if target == above[0] or target.startswith(above[1])
    ]
    assert not bad, "config_checks/ reads the objects it is given (config_checks/types.py):\n" + "\n".join(bad)


def test_utils_import_only_utils():
    bad = [
        f"{_short(module)} imports {_short(target)}"
        for module, targets in import_graph().items()
        if _short(module).startswith("utils")
        for target in sorted(targets)
        if not _short(target).startswith("utils")
    ]
    assert not bad, "utils/ is the bottom layer:\n" + "\n".join(bad)


def test_the_checker_finds_a_circle_through_a_function_level_import_and_type_only_imports_when_asked():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    tree = ast.parse(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from x import T\nelse:\n    import y\n"
        "def f():\n    import z\n"
    )
    names = [a.name if isinstance(n, ast.Import) else n.module for n in _imports(tree) for a in n.names]
    assert names == ["typing", "y", "z"]
    names = [a.name if isinstance(n, ast.Import) else n.module for n in _imports(tree, True) for a in n.names]
    assert names == ["typing", "x", "y", "z"]


FEATURES = ("events", "faults", "health", "nvrx_straggler", "fault_tolerance", "inprocess_restart")
"""The feature packages and modules of ``training/`` (each a component, or the upstream-path facade of one)."""
FEATURE_EDGES = {
    # Megatron-Bridge's ft.simulate_fault is armed in the one fault registry.
    ("fault_tolerance", "faults.injection"),
    # fault_tolerance.py is the upstream-path facade of hang detection; its rank monitor client is health's.
    ("fault_tolerance", "health.rank_monitor_client"),
    # in-process restart's CUDA health check runs where the device helper says the GPU is.
    ("inprocess_restart", "health.device"),
}
"""The only imports from one feature into another, each with its reason; the event stream is everyone's."""
EVERYONES = ("training.events.stream", "training.events.reader")
"""The event stream's writer and its reader: any feature may write events and read them back."""


def test_features_do_not_import_each_other():
    def feature(module: str) -> str:
        rest = _short(module).removeprefix("training.")
        return rest.split(".")[0] if _short(module).startswith("training.") and rest.split(".")[0] in FEATURES else ""

    found = {
        (_short(module).removeprefix("training."), _short(target).removeprefix("training."))
        for module, targets in import_graph().items()
        for target in targets
        if feature(module)
        and feature(target)
        and feature(module) != feature(target)
        and _short(target) not in EVERYONES
    }
    assert found == FEATURE_EDGES, f"new: {sorted(found - FEATURE_EDGES)}; gone: {sorted(FEATURE_EDGES - found)}"
