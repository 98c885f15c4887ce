"""Owner groups: a matrix owned by several ranks, each a block of it along its long side,
which run its Newton-Schulz together (``plan.Plan.group_size``).

The planner's choice for Llama-3.1 8B and 70B at 128 and 1024 ranks; the math against
one-process torch.optim.Muon + AdamW (fp32 Newton-Schulz) where groups of 2 and 4 are
forced, under Z3, Z2, HSDP (async), NorMuon; the bytes of a step against one owner per
matrix and the plan report; checkpoints across group sizes and world sizes.
"""

from __future__ import annotations

import fnmatch

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from tests.engine.test_dedication import _assert_params_close
from tests.engine.test_plan_report import by_kind
from tests.support.dist import run_distributed
from tests.support.models import loss_fn, make_model, proj_predicate
from tests.support.workers import (
    ADAMW_KW,
    MUON_KW,
    as_muon_adamw_kwargs,
    data_for,
    saved_optimizer_state,
    train_configs,
    train_reference,
)
from torchtitan_dmuon import Muon, dedicate_params, get_full_param
from torchtitan_dmuon.engine.checkpoint_geometry import load_state_into
from torchtitan_dmuon.engine.machine import DEFAULT_GPU
from torchtitan_dmuon.engine.plan import (
    HeldDtypes,
    build_plan,
    group_cost,
    max_over_mean,
    plan_with_groups,
)
from torchtitan_dmuon.optim.newton_schulz import ns_flops, split_ns_flops
from torchtitan_dmuon.titan.config import MODEL_SELECTIONS

STEPS = 4


def _llama3(flavor: str):
    from torchtitan.protocols.train_spec import get_train_spec

    spec = get_train_spec("llama3")
    with torch.device("meta"):
        model = spec.model_cls(spec.model_args[flavor])
    patterns = MODEL_SELECTIONS["llama3"].params
    selected = [
        (n, p)
        for n, p in model.named_parameters()
        if any(fnmatch.fnmatchcase(n, q) for q in patterns)
    ]
    return model, selected


def _build(model, selected, replicate: int, shard: int, size: int):
    return build_plan(
        model, selected, shard_size=shard, replicate_size=replicate,
        hook_boundary_predicate=None, group_size=size,
    )  # fmt: skip


def _plan(model, selected, replicate: int, shard: int):
    return plan_with_groups(lambda size: _build(model, selected, replicate, shard, size), shard)


@pytest.mark.parametrize("flavor", ["8B", "70B"])
def test_planner_balances_1024_ranks_and_keeps_128(flavor):
    """At 1024 ranks (FSDP 1 x 1024, HSDP 128 x 8) the planner's groups stay within a node
    (8 GPUs), leave no rank owning nothing, the busiest rank's Newton-Schulz below 0.5 of
    one owner per matrix's, its max/mean within 1.2 and the held bytes' within 1.3; the
    dense bytes moved are those of one owner per matrix. At 128 FSDP ranks one owner per
    matrix stays (groups would give the busiest rank more work)."""
    model, selected = _llama3(flavor)
    numel = sum(p.numel() for _, p in selected)
    for replicate, shard in ((1, 1024), (128, 8)):
        plan = _plan(model, selected, replicate, shard)
        loads = plan.ns_loads()
        one_owner = _build(model, selected, replicate, shard, 1)
        assert 1 < plan.group_size <= 8 and min(loads) > 0
        assert max(loads) < 0.5 * max(one_owner.ns_loads())
        assert max_over_mean(loads) <= 1.2
        assert max_over_mean(plan.held_bytes(HeldDtypes(torch.bfloat16, torch.float32))) <= 1.3
        # Every block is broadcast and reduced once, as its whole matrix was.
        assert sum(u.numel for u in plan.units) == numel
    assert _plan(model, selected, 1, 128).group_size == 1


def test_groups_do_not_pay_for_small_matrices():
    """The debug model's 256-wide matrices at 1024 ranks: a group's Gram all-reduce takes
    longer than the products it splits, so each matrix keeps one owner."""
    model, selected = _llama3("debugmodel")
    shape = (256, 256)
    assert group_cost(shape, 2) > ns_flops(shape, 1) > split_ns_flops(shape, 1, 2)
    assert _plan(model, selected, 1, 1024).group_size == 1


def test_a_group_crossing_a_node_pays_the_network():
    """A member's modeled step: its products plus the Gram's ring all-reduce, at NVLink
    speed up to 8 ranks and at the NIC's beyond (H100: 450 and 50 GB/s)."""
    shape = (4096, 14336)
    gram = 4096 * 4096 * DEFAULT_GPU.ns_bytes + DEFAULT_GPU.ns_bytes  # and the squared norm
    for size, bandwidth in ((2, 450e9), (8, 450e9), (16, 50e9)):
        wait = 2 * (size - 1) / size * gram / bandwidth
        expected = split_ns_flops(shape, 1, size) + round(wait * 989e12)
        assert group_cost(shape, size) == expected, size
    assert group_cost(shape, 16) > group_cost(shape, 8)


CONFIGS = {
    "z3_k1": dict(z3=True, owner_group_size=1),
    "z3_k2": dict(z3=True, owner_group_size=2),
    "z2_k4": dict(z3=False, owner_group_size=4),
    "hsdp_async_k2": dict(z3=True, hsdp_shape=(2, 2), replicate_async=True, owner_group_size=2),
    "normuon_k2": dict(z3=True, owner_group_size=2, variant="normuon"),
}


def test_groups_of_2_and_4_train_as_one_process_muon():
    """4 ranks, each its own data, fp32 Newton-Schulz: with groups of 2 (Z3, async HSDP
    2 x 2, NorMuon) and 4 (Z2) the losses and parameters equal one-process torch.optim.Muon
    (NorMuon's reference) + AdamW on the concatenated batch (rtol 1e-4); each rank
    orthogonalizes its blocks; a step moves the broadcast and reduce bytes of one owner
    per matrix (and a has-gradient flag per block), plus the owner group's Gram
    all-reduces, as the plan report counts."""
    configs = [dict(c, ns_dtype=torch.float32, steps=STEPS, fsdp=True) for c in CONFIGS.values()]
    by_rank = run_distributed(train_configs, 4, configs)
    references = {
        variant: train_reference(4, steps=STEPS, ns_dtype=torch.float32, variant=variant)
        for variant in ("muon", "normuon")
    }
    for runs in by_rank:
        for name, run in zip(CONFIGS, runs, strict=True):
            reference = references[CONFIGS[name].get("variant", "muon")]
            assert run["losses"] == pytest.approx(reference["losses"], rel=1e-4), name
            _assert_params_close(run, reference, rtol=1e-4, atol=1e-5)
        one_owner, groups_of_2 = runs[0], runs[1]
        # Blocks: "name#index/count", a block of every matrix its group owns.
        assert all("#" in owned and owned.endswith("/2") for owned in groups_of_2["owned"])
        assert all(owned.endswith("/4") for owned in runs[2]["owned"])
        assert len(runs[2]["owned"]) == 12  # a block of each of the 12 matrices
        single, grouped = (
            by_kind(r["collectives"][1]["bytes"]) for r in (one_owner, groups_of_2)
        )  # fmt: skip
        for kind in ("broadcast", "all_gather", "reduce_scatter"):
            assert grouped[kind] == single[kind], kind
        # The reduce buckets: the same values, and a has-gradient flag per block (12
        # matrices in 2 blocks: 12 flags more, of 4 bytes).
        assert grouped["reduce"] == single["reduce"] + 12 * 4
        assert grouped["all_reduce"] > single["all_reduce"]  # the Grams
        for name, run in zip(CONFIGS, runs, strict=True):
            replica, shard = run["coordinates"]
            shard_size = CONFIGS[name].get("hsdp_shape", (1, 4))[1]
            predicted = run["report"][replica * shard_size + shard]["dmuon_bytes"]
            assert predicted == by_kind(run["collectives"][1]["bytes"]), name


@pytest.mark.slow
def test_groups_at_8_ranks_train_as_one_process_muon():
    """8 ranks: groups of 4 (FSDP Z3) and of 2 (HSDP 2 x 4) equal one-process Muon."""
    configs = [
        dict(z3=True, owner_group_size=4, ns_dtype=torch.float32, steps=STEPS),
        dict(z3=True, owner_group_size=2, hsdp_shape=(2, 4), ns_dtype=torch.float32, steps=3),
    ]
    by_rank = run_distributed(train_configs, 8, configs)
    for steps, index in ((STEPS, 0), (3, 1)):
        reference = train_reference(8, steps=steps, ns_dtype=torch.float32)
        for runs in by_rank:
            _assert_params_close(runs[index], reference, rtol=1e-4, atol=1e-5)


def test_a_group_size_that_does_not_divide_the_shard_group_is_refused():
    with pytest.raises(ValueError, match="owner_group_size must be an integer >= 1"):
        from torchtitan_dmuon.engine import DedicationSettings

        DedicationSettings(owner_group_size=0)


# ---- checkpoints across group sizes ---------------------------------------------------


def _muon(world: int, group_size: int, seed: int):
    mesh = init_device_mesh("cpu", (world,))
    model = make_model(seed=seed)
    dedication = dedicate_params(model, mesh, proj_predicate, owner_group_size=group_size)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = Muon(model, **MUON_KW, **as_muon_adamw_kwargs(ADAMW_KW), ns_dtype=torch.float32,
               variant="normuon")  # fmt: skip
    return model, dedication, opt


def _step(model, opt, step, rank, world):
    opt.zero_grad()
    loss_fn(model, *data_for(step, rank, world, True)).backward()  # the same batch everywhere
    opt.step()


def _checkpoint_worker(rank, world, path, group_size, save):
    model, dedication, opt = _muon(world, group_size, seed=0 if save else 1)
    if save:
        for step in range(2):
            _step(model, opt, step, rank, world)
    state = get_model_state_dict(model)
    dedicated = saved_optimizer_state(dedication, opt)
    state.update({key: saved for key, (_, _, saved) in dedicated.items()})
    if save:
        dcp.save(state, checkpoint_id=path)
    else:
        dcp.load(state, checkpoint_id=path)
        set_model_state_dict(model, state, options=StateDictOptions(strict=False))
        for key, (entry, name, _) in dedicated.items():
            target = opt.state[entry.param][name]
            load_state_into(dedication, entry, target, state[key], name == "second_moment")
    _step(model, opt, 2, rank, world)
    names = sorted({d.name for d in dedication.plan.params})
    values = {name: get_full_param(model, name) for name in names}
    dist.barrier()
    del opt, model
    return values


@pytest.mark.parametrize(("world", "group_size"), [(4, 1), (2, 2)])
def test_checkpoint_across_group_sizes(tmp_path, world, group_size):
    """Saved by 4 ranks in groups of 2 after 2 NorMuon steps (momentum and second
    moments, column blocks among them), loaded by 4 ranks with one owner per matrix and
    by 2 ranks in one group of 2: the third step's values equal the saving run's third
    step (every rank the same batch)."""
    path = str(tmp_path / "checkpoint")
    saved = run_distributed(_checkpoint_worker, 4, path, 2, True)[0]
    loaded = run_distributed(_checkpoint_worker, world, path, group_size, False)[0]
    for name, value in saved.items():
        torch.testing.assert_close(loaded[name], value, rtol=1e-5, atol=1e-6, msg=name)
