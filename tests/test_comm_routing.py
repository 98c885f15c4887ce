"""Every collective of the package goes through ``engine/comm.py``, which refuses a tensor
on a device its group has no backend for before any collective starts."""

import ast
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.dist import run_distributed
from torchtitan_dmuon.engine import comm

PACKAGE = Path(__file__).resolve().parents[1] / "torchtitan_dmuon"
COLLECTIVES = {
    "broadcast", "reduce", "all_reduce", "all_gather", "all_gather_into_tensor",
    "all_gather_coalesced", "all_gather_single", "reduce_scatter", "reduce_scatter_tensor",
    "reduce_scatter_single", "all_to_all", "all_to_all_single", "gather", "scatter",
    "broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list",
    "send_object_list", "recv_object_list",
}  # fmt: skip
DISTRIBUTED = ("torch.distributed", "torch.distributed._functional_collectives")


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base is not None else None
    return None


def direct_collectives(source: str) -> list[str]:
    """``line: name`` of each call of a ``torch.distributed`` collective in ``source``,
    however the module or the function was imported."""
    tree = ast.parse(source)
    modules = {"torch.distributed": "torch.distributed"}  # local name -> module
    functions = {}  # local name -> collective
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname and alias.name in DISTRIBUTED:
                    modules[alias.asname] = alias.name
        elif isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                if full in DISTRIBUTED:
                    modules[alias.asname or alias.name] = full
                elif node.module in DISTRIBUTED and alias.name in COLLECTIVES:
                    functions[alias.asname or alias.name] = alias.name
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = _dotted(node.func)
        if name is None:
            continue
        base, _, attr = name.rpartition(".")
        if (modules.get(base) in DISTRIBUTED and attr in COLLECTIVES) or name in functions:
            found.append(f"{node.lineno}: {name}")
    return found


def test_scan_finds_every_spelling():
    source = (
        "import torch\nimport torch.distributed as dist\n"
        "from torch.distributed import all_reduce as ar, _functional_collectives as funcol\n"
        "dist.all_reduce(t)\ntorch.distributed.broadcast(t, 0)\nar(t)\n"
        "funcol.all_gather_tensor(t, 0, g)\nfuncol.all_reduce(t, 'sum', g)\n"
        "dist.all_gather_object(rows, obj)\ndist.get_rank()\n"
    )
    assert [f.split(": ")[1] for f in direct_collectives(source)] == [
        "dist.all_reduce",
        "torch.distributed.broadcast",
        "ar",
        "funcol.all_reduce",
        "dist.all_gather_object",
    ]


def test_only_comm_calls_collectives():
    direct = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        module = path.relative_to(PACKAGE).as_posix()
        if module == "engine/comm.py":
            continue
        calls = direct_collectives(path.read_text())
        if calls:
            direct[module] = calls
    assert not direct, f"route these through engine/comm.py: {direct}"


def _refuse_cpu_tensor_on_cuda_only_group(rank, world):
    """A group whose only backend serves CUDA (gloo registered for "cuda" alone) is
    handed a CPU tensor: comm refuses it on every rank, naming the collective, before
    the collective starts (the default group then still works: nothing is half-run)."""
    group = dist.new_group(list(range(world)), backend="cuda:gloo")
    stats = comm.CommStats()
    errors = {}
    calls = {
        "all_reduce": lambda t: comm.all_reduce(t, group, stats),
        "all_gather_into_tensor": lambda t: comm.all_gather_into(
            t.new_zeros(world * t.numel()), t, group, stats, "all_gather"
        ),
        "broadcast": lambda t: comm.broadcast(t, 0, group, stats),
        "reduce": lambda t: comm.reduce_sum(t, 0, group, stats),
    }
    for name, call in calls.items():
        try:
            call(torch.ones(2))
        except ValueError as error:
            errors[name] = str(error)
    assert not stats.calls, "a refused collective was counted"
    ok = torch.ones(1)
    comm.all_reduce(ok, None, stats).wait()  # the default group serves the CPU
    return errors, ok.item()


def test_comm_refuses_a_tensor_its_group_has_no_backend_for():
    for errors, total in run_distributed(_refuse_cpu_tensor_on_cuda_only_group, 2):
        assert total == 2.0
        assert sorted(errors) == ["all_gather_into_tensor", "all_reduce", "broadcast", "reduce"]
        for name, message in errors.items():
            assert message.startswith(f"{name}: a tensor on cpu"), message
            assert "['cuda']" in message, message


@pytest.mark.parametrize(
    "op, expected", [(dist.ReduceOp.SUM, [3.0, 3.0]), (dist.ReduceOp.MAX, [2.0, 2.0])]
)
def test_all_reduce_and_all_gather_into_are_counted(op, expected):
    results = run_distributed(_reduce_and_gather, 2, op)
    for values, gathered, snapshot in results:
        assert values == expected
        assert gathered == [1.0, 2.0]
        assert snapshot == {
            "bytes": {"all_reduce": 8, "all_gather": 8},
            "calls": {"all_reduce": 1, "all_gather": 1},
        }


def _reduce_and_gather(rank, world, op):
    stats = comm.CommStats()
    tensor = torch.full((2,), float(rank + 1))
    comm.all_reduce(tensor, None, stats, op=op).wait()
    out = torch.zeros(world)
    comm.all_gather_into(out, torch.tensor([float(rank + 1)]), None, stats, "all_gather").wait()
    return tensor.tolist(), out.tolist(), stats.snapshot()
