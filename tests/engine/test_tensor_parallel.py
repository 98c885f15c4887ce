"""Tensor parallelism with dedicated matrices, on the engine: Megatron MLP blocks (up
Colwise: rows split, down Rowwise: columns split) on a (dp, tp) = (2, 2) gloo mesh. The
owner column's two TP ranks keep their shards, receive their shards' reduced gradients
and run Newton-Schulz together over the TP group without gathering a matrix; the result
equals one-process torch.optim.Muon + AdamW on the whole batch."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from tests.support.dist import run_distributed
from tests.support.models import TokenModel, batch, loss_fn, proj_predicate
from tests.support.workers import (
    ADAMW_KW,
    MUON_KW,
    as_muon_adamw_kwargs,
    failing_pass,
    failing_step,
    full_params,
    reference_setup,
    train_one_process,
)
from torchtitan_dmuon import Muon, dedicate_params

STEPS, SAMPLES, SEQ, VOCAB = 4, 4, 8, 64
DP, TP = 2, 2


def _model() -> TokenModel:
    torch.manual_seed(0)
    return TokenModel(VOCAB)


def tp_worker(
    rank,
    world,
    ns_backend,
    fail_before_step=None,
    tp_blocks=(0, 1, 2),
    fail_step_at=None,
    variant="muon",
):
    """``tp_blocks``: the blocks split over TP (the others' matrices are whole on every TP
    rank); ``fail_step_at=(step, rank)``: that rank's first Newton-Schulz call of that
    step raises (then the step is retried); ``variant``: Muon's."""
    mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
    dp = mesh["dp"].get_local_rank()
    model = _model()
    for block in (model.layers[i] for i in tp_blocks):
        parallelize_module(
            block, mesh["tp"], {"up_proj": ColwiseParallel(), "down_proj": RowwiseParallel()}
        )
    # DDP-style data parallelism for the rest: the engine keeps it in sync over dp.
    dedication = dedicate_params(model, mesh["dp"], proj_predicate)
    opt = Muon(
        model,
        ns_dtype=torch.float32,
        ns_backend=ns_backend,
        variant=variant,
        **MUON_KW,
        **as_muon_adamw_kwargs(ADAMW_KW),
    )
    losses = []
    per = SAMPLES // DP
    for step in range(STEPS):
        if step == fail_before_step:
            bad = batch(999, SAMPLES, SEQ, VOCAB)
            failing_pass(
                opt.zero_grad, model.layers[0], lambda bad=bad: loss_fn(model, *bad).backward()
            )
        inputs, targets = batch(100 + step, SAMPLES, SEQ, VOCAB)
        opt.zero_grad()
        loss = loss_fn(model, inputs[dp * per : (dp + 1) * per], targets[dp * per : (dp + 1) * per])
        loss.backward()
        if fail_step_at is not None and step == fail_step_at[0]:
            step_failure = failing_step(opt, dedication, rank == fail_step_at[1], call=1)
        opt.step()
        losses.append(loss.item())
    if fail_step_at is not None:
        return {"losses": losses, "params": full_params(model, names_of(model)), **step_failure}
    stats = dedication.stats.snapshot()  # before the reads below gather shards
    return {
        "losses": losses,
        "params": full_params(model, names_of(model)),
        "stats": stats,
        "ns_matrices": opt.ns_matrices,
        "owned": len(dedication.primary_params()),
        "owned_names": [entry.name for entry, _ in dedication.primary_params()],
        "layout_error": _layout_error(mesh),
        "tp_mesh_error": _tp_mesh_error(mesh),
    }


def names_of(model) -> set[str]:
    return {n for n, p in model.named_parameters() if proj_predicate(n, p)}


def _tp_mesh_error(mesh) -> str:
    """The TP mesh passed where the data-parallel mesh belongs: refused before any
    collective, saying which mesh to pass."""
    model = _model()
    for block in model.layers:
        parallelize_module(
            block, mesh["tp"], {"up_proj": ColwiseParallel(), "down_proj": RowwiseParallel()}
        )
    try:
        dedicate_params(model, mesh["tp"], proj_predicate)
    except ValueError as e:
        return str(e)
    return ""


def _layout_error(mesh) -> str:
    """A selected matrix laid out over a 2-D mesh: refused, naming it."""
    model = _model()
    weight = model.layers[0].up_proj.weight
    model.layers[0].up_proj.weight = torch.nn.Parameter(
        distribute_tensor(weight.detach(), mesh, [Shard(0), Replicate()])
    )
    try:
        dedicate_params(model, mesh["dp"], proj_predicate)
    except ValueError as e:
        return str(e)
    return ""


def assert_equals_one_process(by_rank, variant="muon", params_rtol=1e-4) -> None:
    """Losses (rtol 1e-5) and every rank's full matrices (``params_rtol``) equal
    one-process torch.optim.Muon (NorMuon for ``variant`` "normuon") + AdamW on the whole
    batch."""
    with reference_setup(torch.float32):
        model = _model()
        expected = train_one_process(
            model,
            STEPS,
            lambda m, step: loss_fn(m, *batch(100 + step, SAMPLES, SEQ, VOCAB)),
            variant=variant,
        )
    losses = [sum(step) / DP for step in zip(*(r["losses"] for r in by_rank[::TP]), strict=True)]
    torch.testing.assert_close(losses, expected, rtol=1e-5, atol=1e-6)
    reference = dict(model.named_parameters())
    for r in by_rank:
        for name, value in r["params"].items():
            torch.testing.assert_close(
                value, reference[name].detach(), rtol=params_rtol, atol=params_rtol / 10
            )


@pytest.mark.parametrize("ns_backend", ["gram", "torch"])
def test_tensor_parallel_matches_one_process(ns_backend):
    """The Gram path for ns_backend "gram" (the all-reduced Grams only), the gathered
    matrix for "torch" (which has no sharded form); both equal one process. The "gram" run
    also survives a backward that raises half-way before step 1 (caught, ``zero_grad``,
    nothing else): it leaves nothing behind."""
    fail_before_step = 1 if ns_backend == "gram" else None
    by_rank = run_distributed(tp_worker, DP * TP, ns_backend, fail_before_step, timeout=240)
    assert_equals_one_process(by_rank)

    # 6 matrices (3 blocks x up/down), each owned by one dp column: both of its TP ranks
    # step their shards, so over the 4 ranks every matrix is counted twice per step.
    assert sum(r["owned"] for r in by_rank) == 6 * TP
    assert sum(r["ns_matrices"] for r in by_rank) == 6 * TP * STEPS
    for r in by_rank:
        if ns_backend == "gram":
            # The 32x64 / 64x32 matrices split on their 64 side: a 32^2 Gram per phase (2
            # phases), all-reduced over TP; nothing gathered.
            per_matrix = 2 * 32 * 32 * 4
            assert r["stats"]["bytes"]["tp_all_reduce"] == per_matrix * r["owned"] * STEPS
            assert "tp_gather" not in r["stats"]["bytes"]
        else:
            # Each TP rank gathers the whole 32x64 matrix (its own shard included).
            assert r["stats"]["bytes"]["tp_gather"] == 32 * 64 * 4 * r["owned"] * STEPS
            assert "tp_all_reduce" not in r["stats"]["bytes"]
        assert "layers.0.up_proj.weight" in r["layout_error"]
        assert "over a 1-D mesh" in r["layout_error"]
        assert r["tp_mesh_error"].startswith("mesh: ranks ")
        assert "pass the data-parallel mesh" in r["tp_mesh_error"]


def test_step_failure_before_tensor_parallel_collectives():
    """Rank 1 fails in Newton-Schulz of a whole matrix (blocks 0 and 1: no TP) while its TP
    peer would go on to the sharded Newton-Schulz of block 2: the TP ranks agree on it
    before any TP collective, so neither starts it, the step changes nothing on any rank,
    all 4 ranks raise ``MuonStepError`` at the next step with their state bitwise
    unchanged, and the retried steps equal one process. Before, the failing rank's
    agreement met its peer's TP gather on the same group (a hang or a crash)."""
    by_rank = run_distributed(tp_worker, DP * TP, "torch", None, (2,), (1, 1), timeout=180)
    for rank, r in enumerate(by_rank):
        assert "failed on rank(s) [1]; it changed nothing on any rank" in r["message"]
        assert ("injected Newton-Schulz failure" in r["message"]) == (rank == 1)
        assert r["unchanged"] and r["tensors"] > 0
    assert_equals_one_process(by_rank)
