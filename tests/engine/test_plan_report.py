"""The plan report (``engine/report.py``) against what a step measures.

Every figure is counted from the plan before a step runs; here it meets what the ranks then
hold (their live buffers, masters and optimizer state, ``tests/support/held.py``),
orthogonalize (``Muon.ns_matrices``) and move (every
``torch.distributed`` collective of a steady-state step, counted by ``CollectiveCounter``),
and, for the AdamW column, what an FSDP2 + AdamW run of the same model and mesh moves.
"""

from __future__ import annotations

import gc
from collections import Counter

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from tests.support.collectives import CollectiveCounter
from tests.support.dist import run_distributed
from tests.support.models import ExpertBlock, loss_fn, make_model, proj_or_experts_predicate
from tests.support.workers import ADAMW_KW, data_for, train_configs

# torch.distributed functions (as CollectiveCounter names them) by what they do.
KINDS = {
    "broadcast": "broadcast",
    "reduce": "reduce",
    "all_gather_single": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "reduce_scatter_single": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "all_reduce": "all_reduce",
    "all_to_all_single": None,  # expert parallelism's tokens: activations, not counted
}
STEPS = 2
BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
FP32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)


def by_kind(counted: dict[str, int]) -> dict[str, int]:
    out = Counter()
    for function, size in counted.items():
        if KINDS[function] is not None:
            out[KINDS[function]] += size
    return dict(+out)


def train_fsdp_adamw(rank, world, *, hsdp_shape=None, mp_policy=None, accum=1):
    """The same model on the same mesh, sharded as ``train_dmuon`` shards it (blocks, then
    the root, FSDP2's defaults) but FSDP2 taking every parameter, and AdamW: the
    collectives of each step."""
    if hsdp_shape is None:
        mesh = init_device_mesh("cpu", (world,))
    else:
        mesh = init_device_mesh("cpu", hsdp_shape, mesh_dim_names=("replicate", "shard"))
    model = make_model(seed=0)
    kwargs = dict(mesh=mesh) if mp_policy is None else dict(mesh=mesh, mp_policy=mp_policy)
    for layer in model.layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW_KW)
    per_step = []
    for step in range(STEPS):
        with CollectiveCounter() as counter:
            opt.zero_grad()
            for micro in range(accum):
                inputs, targets = data_for(step * accum + micro, rank, world, False)
                (loss_fn(model, inputs, targets) / accum).backward()
            opt.step()
        per_step.append(dict(counter.bytes))
    del opt, model
    gc.collect()
    dist.barrier()
    return per_step


LAYOUTS = {
    "z3": dict(z3=True),
    "z2": dict(z3=False),
    "z3_bf16_accum": dict(z3=True, mp_policy=BF16, accum=2),
    "hsdp": dict(z3=True, hsdp_shape=(2, 2)),
    "hsdp_async_z2": dict(z3=False, hsdp_shape=(2, 2), replicate_async=True),
}


def _check(by_rank, adamw_by_rank, world, kinds=None):
    """Each rank's report row against its step (and, given ``adamw_by_rank``, the FSDP2 +
    AdamW run's step); ``kinds``: compare the bytes of these kinds only."""
    for rank, (result,) in enumerate(by_rank):
        mine = result["report"][rank]
        # Every rank computed the same report.
        assert all(r[0]["report"] == result["report"] for r in by_rank)
        measured = by_kind(result["collectives"][1]["bytes"])  # a steady-state step
        predicted = mine["dmuon_bytes"]
        if kinds is not None:
            measured = {k: measured[k] for k in kinds}
            predicted = {k: predicted[k] for k in kinds}
        assert predicted == measured
        if adamw_by_rank is not None:
            assert mine["adamw_bytes"] == by_kind(adamw_by_rank[rank][1])
        # The plan's formula (the report's and the dedication's) against the live tensors.
        live = result["memory"]
        assert {k: v for k, v in mine["held"].items() if v} == {k: v for k, v in live.items() if v}
        assert result["held_bytes"][rank] == sum(v for k, v in live.items() if k != "normuon")
        assert mine["owned"] * STEPS == result["ns_matrices"]
        assert mine["ns_flops"] > 0
    assert len(by_rank[0][0]["report"]) == world


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_report_counts_what_a_step_moves_and_holds(layout):
    config = dict(LAYOUTS[layout], fsdp=True, steps=STEPS)
    by_rank = run_distributed(train_configs, 4, [config])
    fsdp_only = {k: config[k] for k in ("hsdp_shape", "mp_policy", "accum") if k in config}
    adamw = run_distributed(_adamw_worker, 4, fsdp_only)
    _check(by_rank, adamw, 4)


@pytest.mark.parametrize("variant", ["muon", "normuon"])
def test_held_bytes_of_the_plan_are_the_live_bytes_under_per_block_precision(variant):
    """FSDP2's mixed precision is per fully_shard call: the first block's values in bf16
    (a float32 master beside them), the second's in float32 (none). Each rank's bytes
    kept between steps, by kind, as the one formula (Plan.held) counts them from each
    boundary's dtypes, equal the storage of its live buffers, masters and optimizer state
    (the dedication's log used to take the first unit's dtypes for all)."""
    config = dict(z3=True, mp_policy=[BF16, FP32], variant=variant, fsdp=True, steps=STEPS)
    by_rank = run_distributed(train_configs, 4, [config])
    _check(by_rank, None, 4)
    kinds = {k for (result,) in by_rank for k, v in result["memory"].items() if v}
    assert kinds >= {"params", "masters", "momentum"}


def _adamw_worker(rank, world, kwargs):
    return train_fsdp_adamw(rank, world, **kwargs)


def test_report_counts_the_experts_domain():
    """Expert parallelism (ep 2 of 4 ranks): the split stacks' pieces move over the 2-rank
    efsdp groups, the dense matrices over all 4; each rank holds and orthogonalizes what
    its report row says."""
    config = dict(
        model_kwargs=dict(block=ExpertBlock),
        predicate=proj_or_experts_predicate,
        ep=2,
        fsdp=True,
        z3=True,
        steps=STEPS,
    )
    by_rank = run_distributed(train_configs, 4, [config])
    # The toy's experts are a DTensor on the ep mesh whose forward gathers through DTensor's
    # own collectives (activations' traffic): the engine's broadcasts and reduces only.
    _check(by_rank, None, 4, kinds=("broadcast", "reduce"))
    assert by_rank[0][0]["report"][0]["owned"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("hsdp_shape", [None, (2, 4)], ids=["fsdp", "hsdp"])
def test_report_counts_what_a_step_moves_at_8_ranks(hsdp_shape):
    config = dict(fsdp=True, z3=True, steps=STEPS, hsdp_shape=hsdp_shape)
    by_rank = run_distributed(train_configs, 8, [config])
    adamw = run_distributed(_adamw_worker, 8, dict(hsdp_shape=hsdp_shape))
    _check(by_rank, adamw, 8)
