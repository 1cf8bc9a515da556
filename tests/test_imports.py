"""The import graph of engine/, kernels/ and inspector/: no cycle, and the layers point one way.

Every import counts, a function's lazy one too: a lazy import that closes a cycle only hides it until
the function runs. Read from the sources (ast), so nothing is imported and the test takes milliseconds.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "kernels", "inspector")


def _modules() -> dict[str, Path]:
    modules = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _imported(path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of ours `path` imports, anywhere in it (a package's own __init__ left out)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                names.add(full if full in modules else node.module)
    found = set()
    for name in names:
        while name not in modules and "." in name:
            name = name.rsplit(".", 1)[0]
        if name in modules and name not in PACKAGES:
            found.add(name)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imported(path, modules) - {name} for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, components = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
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
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def test_no_package_has_an_import_cycle():
    assert _cycles(_graph()) == []


def test_the_cycle_finder_finds_one():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_layers_point_one_way():
    """inspector -> engine -> kernels: kernels imports neither, engine never imports inspector or textual."""
    graph = _graph()
    for module, targets in graph.items():
        if module.startswith("kernels"):
            assert not {t for t in targets if not t.startswith("kernels")}, module
        if module.startswith("engine"):
            assert not {t for t in targets if t.startswith("inspector")}, module
    for path in list((ROOT / "engine").rglob("*.py")) + list((ROOT / "kernels").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
        assert not {name for name in imported if name.split(".")[0] in ("textual", "plotext", "textual_plotext")}, path
