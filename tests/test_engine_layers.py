"""The engine's files import each other without a circle, counting every import: module
level, under ``TYPE_CHECKING`` and inside functions (engine/__init__.py lists the layers)."""

import ast
from pathlib import Path

ENGINE = Path(__file__).resolve().parents[1] / "torchtitan_dmuon" / "engine"


def _imports() -> dict[str, set[str]]:
    files = {p.stem: p for p in ENGINE.glob("*.py") if p.stem != "__init__"}
    graph = {}
    for name, path in files.items():
        named = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "torchtitan_dmuon.engine":
                named |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                named.add(node.module.removeprefix("torchtitan_dmuon.engine."))
            elif isinstance(node, ast.Import):
                named |= {a.name.removeprefix("torchtitan_dmuon.engine.") for a in node.names}
        graph[name] = (named & files.keys()) - {name}
    return graph


def test_engine_imports_have_no_circle():
    graph, order, visiting = _imports(), [], set()

    def visit(name: str, path: list[str]) -> None:
        if name in order:
            return
        assert name not in visiting, f"import circle: {' -> '.join(path + [name])}"
        visiting.add(name)
        for dep in sorted(graph[name]):
            visit(dep, path + [name])
        visiting.discard(name)
        order.append(name)

    for name in sorted(graph):
        visit(name, [])
