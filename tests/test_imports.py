"""No import cycles among the modules of common/, plexus/ and llm/.

Every import counts, wherever it stands: at module level, inside a function (a lazy import
still ties the two modules together) or under ``TYPE_CHECKING``. An import of a package counts
as an edge to its ``__init__``; a module's own enclosing packages do not (Python initialises
them first). These are the rules of the ``import-cycles`` review tool.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("common", "plexus", "llm")


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of :data:`PACKAGES`."""
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def _imported_names(module: str, path: Path) -> set[str]:
    """Every dotted name ``module`` imports (relative imports resolved)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            names.add(base)  # the package or module itself, then what is taken from it
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of :data:`PACKAGES` it imports."""
    modules = _modules()

    def resolve(name: str) -> str | None:  # the longest prefix that is one of our modules
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        targets = {resolve(name) for name in _imported_names(module, path)}
        graph[module] = {t for t in targets
                         if t is not None and t != module and not module.startswith(t + ".")}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle ``[a, b, ..., a]``, or None (depth-first search, in name order)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_walk_sees_every_kind_of_import():
    graph = import_graph()
    assert {"common.grid", "common.comm_stats"} <= graph["common"]  # module level
    assert "common.dist" in graph["common.failure"]
    assert "common.spawn" in graph["common.perf.calibrate"]
    assert "plexus.data.writer" in graph["plexus.data.cache"]  # inside a function
    assert "plexus" not in graph["plexus.data.mapped"]  # its own package: not an edge


def test_find_cycle_names_the_modules_of_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set()}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])
