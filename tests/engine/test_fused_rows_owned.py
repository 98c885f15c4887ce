"""A dedicated parameter of fused matrices (TorchTitan 0.3's fused QKV) is owned whole: its
owner runs each matrix's Newton-Schulz, and training matches torch.optim.Muon of the
unfused matrices on the whole batch."""

from __future__ import annotations

import gc

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from tests.support.dist import run_distributed
from tests.support.fused import (
    LAYOUT,
    MUON_KW,
    Fused,
    Unfused,
    data,
    fuse,
    reference,
    reference_step,
)
from tests.support.workers import ADAMW_KW, as_muon_adamw_kwargs
from torchtitan_dmuon import Muon, dedicate_params, get_dedication, get_full_param
from torchtitan_dmuon.optim.fused_rows import mark_fused_rows

STEPS = 3
ROWS = 8  # a rank's batch


def _train(rank: int, world: int, marked: bool, owner_group_size: int, steps: int = STEPS) -> dict:
    torch.manual_seed(0)
    model = Fused()
    if marked:
        mark_fused_rows(model, "blocks.0.qkv.weight", LAYOUT)
    mesh = init_device_mesh("cpu", (world,))
    dedicate_params(
        model, mesh, lambda name, p: p.ndim == 2, gradient_divide_factor=1.0,
        owner_group_size=owner_group_size,
    )  # fmt: skip
    fully_shard(model, mesh=mesh)
    model.set_gradient_divide_factor(1.0)
    model.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    opt = Muon(model, **MUON_KW, **as_muon_adamw_kwargs(ADAMW_KW), ns_dtype=torch.bfloat16)
    mine = slice(rank * ROWS, (rank + 1) * ROWS)
    for step in range(steps):
        x, y = data(step, rows=ROWS * world)
        opt.zero_grad()
        ((model(x[mine]) - y[mine]) ** 2).sum().backward()
        opt.step()
    dedication = get_dedication(model)
    blocks = sorted({d.name for d in dedication.plan.params if d.layout.block is not None})
    result = {
        name: get_full_param(model, name) for name in ("blocks.0.qkv.weight", "blocks.0.out.weight")
    }
    result["split"] = blocks
    del opt, model
    gc.collect()
    dist.barrier()
    return result


def _reference(world: int, steps: int = STEPS) -> dict:
    torch.manual_seed(0)
    unfused = Unfused(Fused())
    optimizers = reference(unfused)
    for step in range(steps):
        reference_step(unfused, optimizers, *data(step, rows=ROWS * world))
    return {
        "blocks.0.qkv.weight": fuse(unfused.q, unfused.k, unfused.v).detach(),
        "blocks.0.out.weight": unfused.out.detach(),
    }


def _distance(result: dict, want: dict) -> float:
    return max((result[k] - want[k]).abs().max().item() for k in want)


def test_dedicated_fused_matrices_step_on_their_owner_as_torch_muon():
    """Two ranks, half of the batch each (the reduced gradient is the whole batch's sum, in
    another order: close, not bitwise); unmarked (the fused matrix's Newton-Schulz as one)
    the values are far off."""
    want = _reference(2)
    marked, unmarked = (run_distributed(_train, 2, m, 1)[0] for m in (True, False))
    assert _distance(marked, want) < 1e-4
    assert _distance(unmarked, want) > 100 * _distance(marked, want)


def test_owner_groups_leave_fused_matrices_whole():
    """Owner groups split the plain matrix into blocks (their Newton-Schulz, run by the
    group, is the owner-group tests' concern, and changes the later steps' gradients);
    the fused one stays whole, and its first step is torch.optim.Muon's."""
    by_rank = run_distributed(_train, 2, True, 2, 1)
    assert by_rank[0]["split"] == ["blocks.0.out.weight"]
    qkv = "blocks.0.qkv.weight"
    assert _distance({qkv: by_rank[0][qkv]}, {qkv: _reference(2, steps=1)[qkv]}) < 1e-5
