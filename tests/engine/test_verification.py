"""Rank-dependent inputs to ``dedicate_params`` raise one clear error on every rank, before
any collective of the engine, instead of hanging: a predicate that differs on one rank,
tensor-parallel peers that select differently, an expert pattern that matches on some
ranks only (one spawn of 4 gloo ranks, each case with the run's hang timeout)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from tests.support.dist import run_distributed
from tests.support.models import (
    ExpertBlock,
    TokenModel,
    make_model,
    proj_or_experts_predicate,
    proj_predicate,
    shard_experts,
)
from torchtitan_dmuon import dedicate_params


def _error(fn) -> str:
    try:
        fn()
    except ValueError as e:
        return str(e)
    return ""


def misuse_worker(rank: int, world: int) -> dict[str, str]:
    errors = {}

    # Rank 3 leaves one matrix out.
    def rank_dependent(name, p):
        return proj_predicate(name, p) and not (rank == 3 and name == "layers.0.q_proj.weight")

    mesh = init_device_mesh("cpu", (world,))
    errors["predicate"] = _error(lambda: dedicate_params(make_model(), mesh, rank_dependent))

    # (dp 2, tp 2): the TP rank 1 peers also select the Rowwise down projections.
    tp_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp_rank = tp_mesh["tp"].get_local_rank()
    model = TokenModel(64)
    for block in model.layers:
        plan = {"up_proj": ColwiseParallel(), "down_proj": RowwiseParallel()}
        parallelize_module(block, tp_mesh["tp"], plan)

    def tp_dependent(name, p):
        return "up_proj" in name or (tp_rank == 1 and "down_proj" in name)

    errors["tp_peers"] = _error(lambda: dedicate_params(model, tp_mesh["dp"], tp_dependent))

    # Experts sharded over ep 2 (efsdp 2); rank 2 selects the dense matrices only.
    sparse = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("replicate", "efsdp", "ep"))
    model = make_model(block=ExpertBlock)
    shard_experts(model, sparse["ep"])
    predicate = proj_predicate if rank == 2 else proj_or_experts_predicate
    errors["experts"] = _error(
        lambda: dedicate_params(model, mesh, predicate, expert_mesh=sparse["efsdp"])
    )
    ok = torch.ones(1)
    dist.all_reduce(ok)  # the default group is still in step
    errors["alive"] = str(ok.item() == world)
    return errors


def test_rank_dependent_inputs_raise_alike_on_every_rank():
    by_rank = run_distributed(misuse_worker, 4, timeout=180)
    for case in ("predicate", "tp_peers", "experts"):
        messages = {r[case] for r in by_rank}
        assert len(messages) == 1, (case, messages)  # the same error on every rank
        assert messages.pop(), case
    first = by_rank[0]
    assert "ranks 0 and 3 selected different matrices" in first["predicate"]
    assert "layers.0.q_proj.weight" in first["predicate"]
    assert "ranks 0 and 1 selected different matrices" in first["tp_peers"]
    assert "down_proj" in first["tp_peers"]
    assert "selected different matrices" in first["experts"]
    assert "experts_proj" in first["experts"]
    assert all(r["alive"] == "True" for r in by_rank)
