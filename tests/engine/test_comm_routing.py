"""Every collective of the package goes through ``engine/comm.py``, which refuses a tensor
on a device its group has no backend for before any collective starts: the collectives,
barriers and point-to-point calls of ``torch.distributed`` and its functional
collectives. DTensor's implicit collectives (``full_tensor``, ``redistribute``) are
listed where they stay, each with why."""

import ast
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.support.dist import run_distributed
from torchtitan_dmuon.engine import comm

PACKAGE = Path(__file__).resolve().parents[2] / "torchtitan_dmuon"
COLLECTIVES = {
    "broadcast", "reduce", "all_reduce", "all_gather", "all_gather_into_tensor",
    "all_gather_coalesced", "all_gather_single", "reduce_scatter", "reduce_scatter_tensor",
    "reduce_scatter_single", "all_to_all", "all_to_all_single", "gather", "scatter",
    "broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list",
    "send_object_list", "recv_object_list", "all_reduce_coalesced", "barrier",
    "monitored_barrier", "send", "recv", "isend", "irecv", "batch_isend_irecv",
    # the functional collectives' own names
    "all_gather_tensor", "all_gather_tensor_autograd", "reduce_scatter_tensor_autograd",
    "all_to_all_single_autograd", "all_gather_into_tensor_coalesced",
    "reduce_scatter_tensor_coalesced", "permute_tensor",
}  # fmt: skip
IMPLICIT = {"full_tensor", "redistribute"}
"""DTensor methods that run a collective of DTensor's own (on the parameter's mesh)."""
DTENSOR_SITES = {
    ("engine/param_layout.py", "redistribute"): "a tensor-parallel gradient laid out "
    "otherwise than its parameter (an embedding's partial sums) made the parameter's shard, "
    "on the TP mesh, as DTensor defines it; no engine group takes part",
    ("engine/param_layout.py", "full_tensor"): "every expert-parallel rank's experts for "
    "checkpoint geometry and tests, outside any step",
    ("engine/grad_norm.py", "full_tensor"): "the norm of FSDP2's / TP's sharded gradients, "
    "one reduction per mesh, as torch's clip_grad_norm_ takes it",
}
"""Where DTensor's implicit collectives stay, and why."""
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
    however the module or the function was imported, and ``line: .method`` of each call
    of a DTensor method that runs one (:data:`IMPLICIT`)."""
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
        if isinstance(node.func, ast.Attribute) and node.func.attr in IMPLICIT:
            found.append(f"{node.lineno}: .{node.func.attr}")
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
        "dist.all_gather_object(rows, obj)\ndist.get_rank()\ndist.barrier()\n"
        "dist.batch_isend_irecv(ops)\nx.full_tensor()\ng.redistribute(m, p).to_local()\n"
        "funcol.wait_tensor(t)\n"
    )
    assert [f.split(": ")[1] for f in direct_collectives(source)] == [
        "dist.all_reduce",
        "torch.distributed.broadcast",
        "ar",
        "funcol.all_gather_tensor",
        "funcol.all_reduce",
        "dist.all_gather_object",
        "dist.barrier",
        "dist.batch_isend_irecv",
        ".full_tensor",
        ".redistribute",
    ]


def test_only_comm_calls_collectives():
    """Nothing but ``engine/comm.py`` calls ``torch.distributed``'s collectives, and
    DTensor's implicit ones stay where :data:`DTENSOR_SITES` says why (each still there)."""
    direct, implicit = {}, set()
    for path in sorted(PACKAGE.rglob("*.py")):
        module = path.relative_to(PACKAGE).as_posix()
        if module == "engine/comm.py":
            continue
        for call in direct_collectives(path.read_text()):
            name = call.split(": ")[1]
            if name.startswith(".") and (module, name[1:]) in DTENSOR_SITES:
                implicit.add((module, name[1:]))
            else:
                direct.setdefault(module, []).append(call)
    assert not direct, f"route these through engine/comm.py: {direct}"
    assert implicit == set(DTENSOR_SITES)


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
