"""The package's three parts stay layered: ``optim`` (the math and the settings) imports
neither ``torch.distributed`` nor the engine nor TorchTitan; ``engine`` (ownership) does
not import TorchTitan or the adapter; and no module imports another that imports it back,
counting every import: module level, under ``TYPE_CHECKING`` and inside functions."""

import ast
import inspect
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "torchtitan_dmuon"


def _module(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(path: Path, modules) -> set[str]:
    """The modules (of anything) ``path`` imports anywhere in it; ``from P import name``
    counts ``P.name`` when that is one of ``modules``."""
    named = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            named.add(node.module)
            named |= {f"{node.module}.{a.name}" for a in node.names} & modules
        elif isinstance(node, ast.Import):
            named |= {a.name for a in node.names}
    return named


def _imports() -> dict[str, set[str]]:
    """Every module of the package and the modules it imports (:func:`_imported`)."""
    modules = {_module(p): p for p in PACKAGE.rglob("*.py")}
    return {name: _imported(path, modules.keys()) - {name} for name, path in modules.items()}


def _violations(part: str, forbidden: tuple[str, ...]) -> list[str]:
    return [
        f"{module} imports {target}"
        for module, targets in sorted(_imports().items())
        if module == f"torchtitan_dmuon.{part}" or module.startswith(f"torchtitan_dmuon.{part}.")
        for target in sorted(targets)
        if target.startswith(forbidden)
    ]


def test_the_math_imports_no_distributed_engine_or_torchtitan():
    forbidden = (
        "torch.distributed",
        "torchtitan.",
        "torchtitan_dmuon.engine",
        "torchtitan_dmuon.titan",
        "torchtitan_dmuon.optimizer",
    )
    assert _violations("optim", forbidden) == []


def test_the_engine_imports_no_torchtitan_or_adapter():
    forbidden = ("torchtitan.", "torchtitan_dmuon.titan", "torchtitan_dmuon.optimizer")
    assert _violations("engine", forbidden) == []


def test_the_0_3_adapter_reads_none_of_the_0_2_adapters_torchtitan_modules():
    """``titan03`` shares the TorchTitan-free modules of ``titan`` (the ``[dmuon]`` section,
    the selection rules, the container's methods, the patch registry) and reaches, at any
    depth, none of those that import TorchTitan 0.2.2 (each refuses 0.3 at its import)."""
    graph = _imports()
    only_0_2 = {
        f"torchtitan_dmuon.titan.{m}"
        for m in ("checked", "spec", "train", "optimizer", "checkpoint")
    }
    for module in only_0_2:
        assert "torchtitan_dmuon.titan.checked" in graph[module] | {module}, module
    adapter = [m for m in graph if m.startswith("torchtitan_dmuon.titan03")]
    assert len(adapter) >= 5
    # The package's own __init__ imports spec only when its names are asked for.
    lazy = "torchtitan_dmuon.titan"
    assert {m for m in graph[lazy] if m.startswith("torchtitan")} == {f"{lazy}.spec"}
    seen, todo = set(), list(adapter)
    while todo:
        module = todo.pop()
        for target in graph.get(module, ()) if module != lazy else ():
            if target not in seen:
                seen.add(target)
                todo.append(target)
    assert sorted(seen & only_0_2) == []


def test_no_module_imports_one_that_imports_it_back():
    graph = _imports()
    # A package's __init__ re-exports its modules: an import of the package is not a
    # dependency of the modules it holds on it.
    inside = {
        m: {t for t in ts if t in graph and not m.startswith(f"{t}.")} for m, ts in graph.items()
    }
    order, visiting = [], set()

    def visit(name: str, path: list[str]) -> None:
        if name in order:
            return
        assert name not in visiting, f"import circle: {' -> '.join(path + [name])}"
        visiting.add(name)
        for dep in sorted(inside[name]):
            visit(dep, path + [name])
        visiting.discard(name)
        order.append(name)

    for name in sorted(inside):
        visit(name, [])


def test_the_package_muon_only_picks_the_matrix_set():
    """``torchtitan_dmuon.Muon`` is the math's ``Muon`` given its model's matrix set: it
    adds a constructor and no step, state or QK-clip of its own (those are optim's)."""
    import torchtitan_dmuon
    from torchtitan_dmuon.optim import optimizer

    # Names the class holds that are not optim's: torch.optim.Optimizer wraps the step
    # of the class it builds for profiling (functools.wraps), on that class.
    own = {"__init__", "__doc__", "__module__", "__qualname__", "__firstlineno__"}
    added = {
        name
        for name, value in vars(torchtitan_dmuon.Muon).items()
        if name not in own | {"__static_attributes__"}
        and inspect.unwrap(value) is not inspect.unwrap(getattr(optimizer.Muon, name))
    }
    assert not added, added
    assert torchtitan_dmuon.Muon.__mro__[1] is optimizer.Muon


TESTS = PACKAGE.parent / "tests"
# Engine tests that read the adapter's model selections (MODEL_SELECTIONS) to plan real
# models' shapes.
_THROUGH_THE_ADAPTER = {"tests.engine.test_owner_groups"}


def test_the_engine_and_optimizer_tests_import_no_torchtitan():
    """So that they run beside any TorchTitan (or none): ``tests/engine`` and
    ``tests/optim``, and every ``tests`` module they import, at any depth and in any
    function, import neither TorchTitan nor the adapter nor the adapter's tests."""
    modules = {
        ".".join(p.relative_to(TESTS.parent).with_suffix("").parts): p for p in TESTS.rglob("*.py")
    }
    imported = {name: _imported(path, modules.keys()) for name, path in modules.items()}

    def reached(name: str) -> set[str]:
        seen, todo = set(), [name]
        while todo:
            for target in imported.get(todo.pop(), ()):
                if target not in seen:
                    seen.add(target)
                    if target in modules:
                        todo.append(target)
        return seen

    def forbidden(target: str) -> bool:
        return target == "torchtitan" or target.startswith(
            ("torchtitan.", "torchtitan_dmuon.titan", "tests.titan")
        )

    layer_tests = [n for n in modules if n.startswith(("tests.engine.", "tests.optim."))]
    assert len(layer_tests) > 20
    offending = {
        name: sorted(filter(forbidden, reached(name)))
        for name in sorted(layer_tests)
        if name not in _THROUGH_THE_ADAPTER
    }
    assert {name: found for name, found in offending.items() if found} == {}
    assert all(any(map(forbidden, reached(name))) for name in _THROUGH_THE_ADAPTER)
