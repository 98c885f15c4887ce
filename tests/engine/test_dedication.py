"""The ownership engine on gloo: agreement with one-process torch.optim.Muon + AdamW,
Z2 vs Z3, DDP-style vs FSDP2, collective counts, edge cases and errors."""

import math
from collections import Counter

import pytest
import torch

from tests.support.dist import run_distributed
from tests.support.models import (
    ExpertBlock,
    SplitExpertBlock,
    make_model,
    proj_or_experts_predicate,
    proj_predicate,
)
from tests.support.workers import train_configs, train_reference

STEPS = 10
PROJ_NAMES = tuple(f"{n}_proj.weight" for n in ("q", "k", "v", "o", "up", "down"))


def _padded_bytes(params, world):
    """Bytes FSDP2 moves to gather these parameters (dim 0 padded to the world size)."""
    total = 0
    for p in params:
        rows = math.ceil(p.shape[0] / world) * world
        total += rows * (p.numel() // p.shape[0]) * p.element_size()
    return total


def _assert_params_close(result, reference, rtol, atol):
    for name, expected in reference["params"].items():
        torch.testing.assert_close(
            result["params"][name],
            expected,
            rtol=rtol,
            atol=atol,
            msg=lambda m, name=name: f"{name}: {m}",
        )


def test_z2_z3_fsdp_ddp_agree_with_one_process_muon_on_same_data():
    configs = [
        dict(fsdp=True, z3=True, same_data=True, steps=STEPS),
        dict(fsdp=True, z3=False, same_data=True, steps=STEPS),
        dict(fsdp=False, z3=True, same_data=True, steps=STEPS),
        dict(fsdp=False, z3=False, same_data=True, steps=STEPS),
    ]
    by_rank = run_distributed(train_configs, 2, configs)
    reference = train_reference(2, steps=STEPS, same_data=True)
    fsdp_z3, fsdp_z2, ddp_z3, ddp_z2 = by_rank[0]
    # Z2 and Z3 differ only in when non-owners hold a matrix: bit-identical.
    assert fsdp_z3["losses"] == fsdp_z2["losses"]
    assert ddp_z3["losses"] == ddp_z2["losses"]
    for name in fsdp_z3["params"]:
        assert torch.equal(fsdp_z3["params"][name], fsdp_z2["params"][name]), name
        assert torch.equal(ddp_z3["params"][name], ddp_z2["params"][name]), name
    # DDP-style and FSDP2 agree, and both match torch.optim.Muon + AdamW in one process.
    for result in (fsdp_z3, ddp_z3):
        assert result["losses"] == pytest.approx(reference["losses"], rel=1e-6)
        _assert_params_close(result, reference, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fsdp_z3["losses"], ddp_z3["losses"], rtol=1e-6, atol=0)
    # Every rank sees the same full values.
    for name, value in by_rank[1][0]["params"].items():
        assert torch.equal(value, fsdp_z3["params"][name]), name


def test_four_ranks_different_data_match_concatenated_batch():
    configs = [
        dict(fsdp=True, z3=True, ns_dtype=torch.float32, steps=STEPS),
        dict(fsdp=False, z3=False, ns_dtype=torch.float32, steps=STEPS),
    ]
    by_rank = run_distributed(train_configs, 4, configs)
    reference = train_reference(4, steps=STEPS, ns_dtype=torch.float32)
    for config_index in range(2):
        result = by_rank[0][config_index]
        assert result["losses"] == pytest.approx(reference["losses"], rel=1e-4)
        _assert_params_close(result, reference, rtol=1e-4, atol=1e-5)

    # NS ran once per dedicated matrix per step, across the whole job, spread over owners.
    fsdp_runs = [r[0] for r in by_rank]
    assert sum(r["ns_matrices"] for r in fsdp_runs) == 12 * STEPS
    assert all(r["ns_matrices"] == len(r["owned"]) * STEPS for r in fsdp_runs)
    owned = [name for r in fsdp_runs for name in r["owned"]]
    assert len(owned) == len(set(owned)) == 12
    assert all(len(r["owned"]) == 3 for r in fsdp_runs)


@pytest.mark.parametrize("z3", [True, False])
def test_collective_bytes_per_step(z3):
    world = 2
    by_rank = run_distributed(train_configs, world, [dict(fsdp=True, z3=z3, steps=2)])
    model = make_model(seed=0)
    dedicated = [p for n, p in model.named_parameters() if proj_predicate(n, p)]
    others = [p for n, p in model.named_parameters() if not proj_predicate(n, p)]
    dedicated_bytes = sum(p.numel() * p.element_size() for p in dedicated)
    last_block = [p for n, p in model.layers[-1].named_parameters() if proj_predicate(n, p)]
    last_block_bytes = sum(p.numel() * p.element_size() for p in last_block)
    flag_bytes = len(dedicated) * 4  # one has-gradient flag per matrix in the reduce bucket
    for result in (r[0] for r in by_rank):
        step = result["collectives"][1]  # a steady-state step
        # One broadcast of every dedicated matrix in forward, and with Z3 one more in
        # backward of all but the last block's (forward leaves it for backward); one
        # reduce of each.
        assert step["bytes"]["broadcast"] == dedicated_bytes + (
            dedicated_bytes - last_block_bytes if z3 else 0
        )
        assert step["bytes"]["reduce"] == dedicated_bytes + flag_bytes
        # Units: 2 blocks x 2 owners, one collective each.
        assert step["calls"]["reduce"] == 4
        assert step["calls"]["broadcast"] == 4 + (2 if z3 else 0)
        # FSDP2 never gathers a dedicated matrix: at most a forward and a backward
        # all-gather of the other parameters, and one reduce-scatter of them.
        # (FSDP2 in torch 2.13 calls the *_single collectives, in 2.11 the *_tensor ones.)
        moved = step["bytes"]
        gathered = moved.get("all_gather_single", 0) + moved.get("all_gather_into_tensor", 0)
        scattered = moved.get("reduce_scatter_single", 0) + moved.get("reduce_scatter_tensor", 0)
        assert 0 < gathered <= 2 * _padded_bytes(others, world)
        assert 0 < scattered <= _padded_bytes(others, world)
        # The engine's own accounting agrees with the wrapper's.
        assert result["stats"]["calls"]["reduce"] == 2 * 4


def test_gradient_accumulation_and_clipping_match_reference():
    config = dict(fsdp=True, z3=True, ns_dtype=torch.float32, steps=3, accum=2, clip=0.05)
    by_rank = run_distributed(train_configs, 2, [config])
    reference = train_reference(2, steps=3, ns_dtype=torch.float32, accum=2, clip=0.05)
    result = by_rank[0][0]
    # The clip is active (the norm exceeds max_norm), so the norm feeds the update.
    assert min(reference["norms"]) > 0.05
    assert result["norms"] == pytest.approx(reference["norms"], rel=1e-5)
    assert by_rank[1][0]["norms"] == result["norms"]
    assert result["losses"] == pytest.approx(reference["losses"], rel=1e-4)
    _assert_params_close(result, reference, rtol=1e-4, atol=1e-5)


def only_two(name, p):
    return name in ("layers.0.q_proj.weight", "layers.1.up_proj.weight")


def test_rank_that_owns_nothing_still_trains():
    # One owner per matrix (the planner would give the two matrices groups of 2).
    config = dict(
        fsdp=True, z3=True, ns_dtype=torch.float32, steps=3, predicate=only_two, owner_group_size=1
    )
    by_rank = run_distributed(train_configs, 4, [config])
    reference = train_reference(4, steps=3, ns_dtype=torch.float32, predicate=only_two)
    owned = [r[0]["owned"] for r in by_rank]
    assert sum(1 for o in owned if not o) == 2
    for r in by_rank:
        assert r[0]["losses"] == pytest.approx(reference["losses"], rel=1e-4)
        _assert_params_close(r[0], reference, rtol=1e-4, atol=1e-5)


# Two ExpertBlocks (6 experts each) on 4 ranks, 6 steps, fp32 Newton-Schulz.
EXPERTS = dict(
    model_kwargs=dict(block=ExpertBlock),
    predicate=proj_or_experts_predicate,
    ns_dtype=torch.float32,
    steps=6,
)


def _per_expert_reference(variant: str = "muon") -> dict:
    """One-process torch.optim.Muon (or NorMuon) + AdamW on the ExpertBlock model with one
    2-D parameter per expert, its experts stacked back under the stack's name."""
    reference = train_reference(
        4,
        steps=6,
        ns_dtype=torch.float32,
        model_kwargs=dict(block=SplitExpertBlock),
        variant=variant,
    )
    params = reference["params"]
    for layer in range(2):
        prefix = f"layers.{layer}.experts_proj_split."
        split = [params.pop(f"{prefix}{e}") for e in range(ExpertBlock.experts)]
        params[f"layers.{layer}.experts_proj"] = torch.stack(split)
    return reference


def _assert_trains_like_per_expert_muon(runs, reference, pieces) -> None:
    """Each rank's losses and parameters equal the per-expert reference; every matrix and
    each of ``pieces`` (of each stack) has exactly one owner, and every expert matrix is
    orthogonalized once per step, on its owner only."""
    for result in runs:
        assert result["losses"] == pytest.approx(reference["losses"], rel=1e-4)
        _assert_params_close(result, reference, rtol=1e-4, atol=1e-5)
    owners = [name for r in runs for name in r["owned"]]
    assert sorted(owners) == sorted(
        [f"layers.{i}.{n}" for i in range(2) for n in PROJ_NAMES]
        + [f"layers.{i}.experts_proj{p}" for i in range(2) for p in pieces]
    )
    matrices_per_step = 2 * (len(PROJ_NAMES) + ExpertBlock.experts)
    assert sum(r["ns_matrices"] for r in runs) == 6 * matrices_per_step


def test_stacked_experts_are_owned_per_expert_and_match_muon_per_expert():
    """A 3-D experts weight (6 experts) is split into one piece of contiguous experts per
    rank (2, 2, 1, 1 experts on 4 ranks), each with its own owner, balanced with the
    dense matrices; it trains like torch.optim.Muon with one 2-D parameter per expert,
    each expert orthogonalized once per step across the job; between steps a rank holds
    the values of its column's units only, never a whole stack."""
    configs = [
        dict(EXPERTS, fsdp=True, z3=True),
        dict(EXPERTS, fsdp=True, z3=False),
        dict(EXPERTS, hsdp_shape=(2, 2), replicate_async=True),
    ]
    by_rank = run_distributed(train_configs, 4, configs)
    reference = _per_expert_reference()
    pieces = ["[0:2]", "[2:4]", "[4:5]", "[5:6]"]
    stack_numel = ExpertBlock.experts * 32 * 64
    dense_numel = 4 * 32 * 32 + 2 * 32 * 64
    for config, runs in zip(configs, zip(*by_rank, strict=True), strict=True):
        _assert_trains_like_per_expert_muon(runs, reference, pieces)
        for layer in range(2):  # each rank owns one piece of each stack
            stack = f"layers.{layer}.experts_proj["
            assert [sum(n.startswith(stack) for n in r["owned"]) for r in runs] == [1] * 4
        # Values held between steps: each unit once per replica, on its column.
        replicas = config.get("hsdp_shape", (1,))[0]
        held = [r["memory"]["params"] // 4 for r in runs]
        assert sum(held) == 2 * (dense_numel + stack_numel) * replicas
        assert max(held) < 2 * stack_numel


def test_expert_parallel_stacks_are_dedicated_over_efsdp_and_match_muon_per_expert():
    """Expert parallelism (each stack sharded over an ep mesh of 2, each rank holding 3 of
    the 6 experts): a rank's local experts are dedicated over the ranks that hold the
    same experts (efsdp 2; under HSDP 2 x 2 the replicate group, efsdp 1), the dense
    matrices over all data-parallel ranks. It trains like one-process torch.optim.Muon
    with one 2-D parameter per expert; each expert is orthogonalized once per step
    across the job, by one owner; the experts' reduce and broadcast run on the 2-rank
    groups only, the dense ones on the 4-rank group."""
    configs = [
        dict(EXPERTS, ep=2, fsdp=True, z3=True),
        dict(EXPERTS, ep=2, hsdp_shape=(2, 2), replicate_async=True),
    ]
    by_rank = run_distributed(train_configs, 4, configs)
    reference = _per_expert_reference()
    # Each ep rank's 3 local experts in 2 pieces (2 + 1).
    pieces = ["[0:2]", "[2:3]", "[3:5]", "[5:6]"]
    for config, runs in zip(configs, zip(*by_rank, strict=True), strict=True):
        _assert_trains_like_per_expert_muon(runs, reference, pieces)
        if "hsdp_shape" in config:
            continue
        for r in runs:
            dense_bytes, expert_bytes = r["bucket_bytes"]
            step = r["collectives"][2]  # a steady-state step
            # Engine's own accounting and the torch.distributed calls, by group size.
            assert r["stats"]["bytes"]["expert_reduce"] == 6 * expert_bytes
            assert r["stats"]["bytes"]["reduce"] == 6 * dense_bytes
            assert step["group_bytes"][("reduce", 2)] == expert_bytes
            assert step["group_bytes"][("reduce", 4)] == dense_bytes
            # 2 layers x 3 local experts of 32 x 64, plus one flag per unit.
            assert expert_bytes == 4 * (2 * 3 * 32 * 64 + 4)
            # Over the run: every expert gather on a 2-rank group, every dense one on the
            # 4-rank group.
            broadcast = Counter()
            for each in r["collectives"]:
                broadcast.update(
                    {k: v for k, v in each["group_bytes"].items() if k[0] == "broadcast"}
                )
            assert broadcast[("broadcast", 2)] == r["stats"]["bytes"]["expert_broadcast"] > 0
            assert broadcast[("broadcast", 4)] == r["stats"]["bytes"]["broadcast"] > 0
            assert set(broadcast) == {("broadcast", 2), ("broadcast", 4)}
