"""The package's import graph, read from the sources: no circle, and the layers import only downwards.

Every ``import`` counts, function-level ones included (they run too, only later); an import under
``if TYPE_CHECKING:`` does not (it never runs: annotations only).
"""

import ast
from pathlib import Path

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


def _imports(tree: ast.AST) -> list[ast.stmt]:
    """Every import statement in ``tree`` outside ``if TYPE_CHECKING:`` blocks (at any depth)."""
    found: list[ast.stmt] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
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


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of this package it imports."""
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in _imports(ast.parse(path.read_text(), str(path))):
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


def test_the_package_has_no_import_circle():
    found = cycles(import_graph())
    assert not found, "import circles:\n" + "\n".join(" -> ".join(map(_short, c)) for c in found)


def test_models_and_data_import_from_training_only_its_config():
    allowed = {f"{PACKAGE}.training", f"{PACKAGE}.training.config"}
    bad = [
        f"{_short(module)} imports {_short(target)}"
        for module, targets in import_graph().items()
        if _short(module).split(".")[0] in ("models", "data")
        for target in sorted(targets)
        if _short(target).split(".")[0] == "training" and target not in allowed
    ]
    assert not bad, "models/ and data/ may import training.config and utils only:\n" + "\n".join(bad)


def test_utils_import_only_utils():
    bad = [
        f"{_short(module)} imports {_short(target)}"
        for module, targets in import_graph().items()
        if _short(module).startswith("utils")
        for target in sorted(targets)
        if not _short(target).startswith("utils")
    ]
    assert not bad, "utils/ is the bottom layer:\n" + "\n".join(bad)


def test_the_checker_finds_a_circle_through_a_function_level_import_and_ignores_type_checking_imports(tmp_path):
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
