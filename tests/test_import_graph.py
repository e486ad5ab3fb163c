"""The import graph of ``codagen``: no circle, layers import downward only, no import inside a function.

Read from the source with ``ast`` (nothing is imported): an edge is an ``import`` or ``from`` statement
naming a ``codagen`` module (absolute or relative), wherever it stands (a function-local import closes a
circle as well). ``from package import name`` is an edge to the submodule when ``name`` is one, else to
the package. The implicit import of a module's parent package is not an edge.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "codagen"

#: the layers, lowest first; a module may import its own layer and the ones below
LAYERS = ("epilogue", "backends", "ops", "models")
#: modules below every layer (leaves that import nothing of codagen)
BASE = {"codagen._version"}

#: modules allowed to import codagen inside a function; an entry whose module has no such import fails.
#: The two package ``__getattr__``s load ``codagen.models.hf`` (FSDP, DTensor, Dynamo) on first use of
#: ``patch``/``unpatch``/``is_patched``, so ``import codagen`` leaves those out.
FUNCTION_IMPORT_ALLOWLIST: set[str] = {"codagen", "codagen.models"}


def _modules() -> dict[str, Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = ("codagen",) + path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _is_package(module: str) -> bool:
    return MODULES[module].name == "__init__.py"


def _imported(module: str, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The codagen modules an import statement of ``module`` names."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
        return [max((m for m in MODULES if name == m or name.startswith(m + ".")), key=len)
                for name in names if name == "codagen" or name.startswith("codagen.")]
    if node.level:
        package = module if _is_package(module) else module.rsplit(".", 1)[0]
        for _ in range(node.level - 1):
            package = package.rsplit(".", 1)[0]
        base = f"{package}.{node.module}" if node.module else package
    elif node.module == "codagen" or (node.module or "").startswith("codagen."):
        base = node.module
    else:
        return []
    return [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]


def _graph() -> dict[str, set[str]]:
    graph = {}
    for module, path in MODULES.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                edges.update(m for m in _imported(module, node) if m != module)
        graph[module] = edges
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, on_stack, stack, components = {}, {}, set(), [], []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return components


def _layer(module: str) -> int:
    """0 for the base modules, 1-4 for the layers, 5 for the rest of the package (its top)."""
    if module in BASE:
        return 0
    parts = module.split(".")
    return LAYERS.index(parts[1]) + 1 if len(parts) > 1 and parts[1] in LAYERS else len(LAYERS) + 1


def test_the_graph_is_read():
    graph = _graph()
    assert "codagen.epilogue.ir" in graph["codagen.epilogue.library"]
    assert "codagen.backends.triton.pingpong.plan" in graph["codagen.backends.triton.pingpong"]


def test_no_import_circle():
    assert _cycles(_graph()) == []


def test_layers_import_downward_only():
    upward = sorted(f"{module} -> {target}" for module, targets in _graph().items() for target in targets
                    if _layer(target) > _layer(module))
    assert upward == []


def test_no_codagen_import_inside_a_function():
    found = []
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text())
        for function in ast.walk(tree):
            if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            for node in ast.walk(function):
                if isinstance(node, (ast.Import, ast.ImportFrom)) and (
                        _imported(module, node) or (isinstance(node, ast.ImportFrom) and node.level)):
                    found.append(f"{module}:{node.lineno}")
    stray = sorted(f for f in found if f.split(":")[0] not in FUNCTION_IMPORT_ALLOWLIST)
    assert stray == []
    clean = FUNCTION_IMPORT_ALLOWLIST - {f.split(":")[0] for f in found}
    assert not clean, f"no import inside a function any more: remove {sorted(clean)} from the allowlist"


def test_a_circle_and_an_upward_import_are_found():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _layer("codagen.epilogue.ir") < _layer("codagen.backends.reference") < _layer("codagen.ops.block")
