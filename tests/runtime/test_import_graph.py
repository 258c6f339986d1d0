"""The import graph of `runtime/` (issue 47): no two files import each other, directly or through others; packages
stand in layers, each importing only layers below it; and the bottom modules of the layering (error kinds, sampling
params, the vocabulary, parallel state, the request check) import nothing above them.

Every import counts, at module level or inside a function, except those under `if TYPE_CHECKING:` (they never run).
A function-local import still runs whenever its caller does, so a loop through one is a loop a reader has to hold in
their head, and one a refactor can turn into a circular-import crash. The graph is read from the source with `ast`;
nothing is imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

RUNTIME = Path(__file__).resolve().parents[2] / "runtime"
PREFIX = "braid.runtime"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(RUNTIME).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([PREFIX, *parts])


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imported_names(path: Path, module: str) -> set[str]:
    """Dotted names the file imports at run time: `import a.b` -> a.b; `from a import b` -> a and a.b."""
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    names: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for stmt in child.orelse:
                    visit_one(stmt)
                continue
            visit_one(child)

    def visit_one(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the file's package, one level up per extra dot
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            names.add(source)
            names.update(f"{source}.{alias.name}" for alias in node.names)
        visit(node)

    visit(ast.parse(path.read_text(), str(path)))
    return names


def import_graph() -> dict[str, set[str]]:
    """module -> the runtime modules it imports (a name resolves to the longest module it starts with: a package's
    `__init__` when it names something the package defines)."""
    files = {_module_name(p): p for p in RUNTIME.rglob("*.py")}
    graph = {}
    for module, path in files.items():
        edges = set()
        for name in _imported_names(path, module):
            if not name.startswith(PREFIX):
                continue
            parts = name.split(".")
            while parts and ".".join(parts) not in files:
                parts.pop()
            target = ".".join(parts)
            if target and target != module:
                edges.add(target)
        graph[module] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
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
    return found


def test_the_graph_sees_every_kind_of_import():
    graph = import_graph()
    # module level, function-local (SchedulerLoop.run imports the loop), relative (constrained's engines)
    assert "braid.runtime.ipc.messages" in graph["braid.runtime.processes.scheduler_process"]
    assert "braid.runtime.scheduler.scheduler" in graph["braid.runtime.processes.scheduler_process"]
    assert "braid.runtime.constrained.schema_prepare" in graph["braid.runtime.constrained.llguidance_engine"]
    # TYPE_CHECKING-only: core names the attention backend for annotations
    assert "braid.runtime.layers.attention.base" not in graph["braid.runtime.core"]


def test_cycles_finds_a_loop_through_three_files():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_loop_between_runtime_files():
    loops = cycles(import_graph())
    assert loops == [], "files of runtime/ that import each other (directly or through others): " + "; ".join(
        " <-> ".join(m.removeprefix(PREFIX + ".") for m in loop) for loop in loops)


# the bottom of the layering: what every package may import, importing back only each other
FLOOR = {"error_kind": set(), "sampling_params": set(), "distributed.parallel_state": set(),
         "core": {"error_kind", "sampling_params"}, "request_checks": {"core", "error_kind", "sampling_params"}}


@pytest.mark.parametrize("module", list(FLOOR))
def test_the_floor_imports_only_the_floor(module):
    imported = {m.removeprefix(PREFIX + ".") for m in import_graph()[f"{PREFIX}.{module}"]}
    assert imported <= FLOOR[module], f"{module} imports {sorted(imported - FLOOR[module])}"


# runtime's packages (and top-level modules) from the bottom up; a package imports only packages of lower layers
LAYERS = [
    {"error_kind", "sampling_params", "dtypes", "host_memory", "sglang_flags", "distributed"},
    {"core"},
    {"request_checks", "loader"},
    {"layers", "multimodal", "request_io"},
    {"constrained", "lora", "models", "ipc", "chat_format"},
    {"speculative", "mem_cache"},
    {"config"},
    {"model_executor"},
    {"scheduler"},
    {"processes"},
    {"server", "engine"},
    {"launch", "bench", ""},  # "": runtime/__init__.py
]


def _package(module: str) -> str:
    rest = module.removeprefix(PREFIX).removeprefix(".")
    return rest.split(".")[0]


def package_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for module, edges in import_graph().items():
        mine = _package(module)
        graph.setdefault(mine, set()).update(p for p in map(_package, edges) if p != mine)
    return graph


def test_every_package_has_a_layer():
    placed = set().union(*LAYERS)
    assert set(package_graph()) <= placed, f"packages with no layer in LAYERS: {sorted(set(package_graph()) - placed)}"


def test_packages_import_only_lower_layers():
    level = {p: i for i, layer in enumerate(LAYERS) for p in layer}
    graph = package_graph()
    upward = sorted(f"{p or 'runtime/__init__'} -> {q or 'runtime/__init__'}" for p, edges in graph.items()
                    for q in edges if level.get(q, len(LAYERS)) >= level.get(p, len(LAYERS)))
    assert upward == [], "imports that go sideways or up the layering: " + "; ".join(upward)
    assert cycles(graph) == []
