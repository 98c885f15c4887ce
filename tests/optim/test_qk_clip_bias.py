"""QK-clip on attention whose query and key projections have biases (Qwen2.5's layout):
``q = W_q x + b_q``, so the bias entries of a head's rows take the rows' factor, after the
biases' AdamW update. The math on bias shards that start inside a head; one process: the
next step's largest logit is at most the threshold, where scaling only the weights leaves
it above; FSDP2 Z3 and TP on 2 gloo ranks against a one-process reference written here
from the definition (weights and biases after torch.optim.Muon and AdamW, then the
clip); a bias whose entries a rank cannot place among its heads is refused."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from tests.optim.test_qk_clip import HEAD_DIM, KEY_HEADS, QUERY_HEADS, _full_score_maxima
from tests.support.dist import run_distributed
from tests.support.models import BiasHeadsBlock, batch, loss_fn, make_model, proj_predicate
from tests.support.workers import (
    ADAMW_KW,
    MUON_KW,
    REFERENCE_ADAMW_KW,
    as_muon_adamw_kwargs,
    reference_setup,
)
from torchtitan_dmuon import ClippedAttention, Muon, QKClip, dedicate_params, get_full_param
from torchtitan_dmuon.optim.qk_clip import HeadRows, scale_bias_entries, scale_head_rows

STEPS = 4
THRESHOLD = 27.0
ALPHA = 0.5
LAYERS = 2
WEIGHTS = [f"layers.{i}.{p}_proj.weight" for i in range(LAYERS) for p in ("q", "k")]
BIASES = [f"layers.{i}.{p}_proj.bias" for i in range(LAYERS) for p in ("q", "k")]


def attentions(layers: int = LAYERS, biases: bool = True, tp: int = 1) -> list[ClippedAttention]:
    """The biased model's attention layers (``tp``: their TP degree); ``biases=False``:
    the biases left out (the clip before biases were supported: weights only)."""

    def rows(i: int, p: str, role: str) -> HeadRows:
        bias = f"layers.{i}.{p}_proj.bias" if biases else None
        return HeadRows(f"layers.{i}.{p}_proj.weight", HEAD_DIM, ((0, HEAD_DIM, role),), bias)

    return [
        ClippedAttention(
            f"layers.{i}.attend",
            QUERY_HEADS // tp,
            (rows(i, "q", "query"), rows(i, "k", "key")),
        )
        for i in range(layers)
    ]


def biased_model(layers: int = LAYERS):
    return make_model(seed=0, block=BiasHeadsBlock, layers=layers)


# ---- the math -------------------------------------------------------------------------------


def test_bias_entries_take_their_rows_factors():
    """A bias scales as one more column of its weight (GQA: a key head takes its group's
    smallest factor; MLA's value rows stay), whole or as shards that start and end inside
    a head, in any order."""
    gamma = torch.tensor([0.5, 1.0, 0.25, 0.8])
    layouts = [
        HeadRows("k", 4, ((0, 4, "key"),)),  # 2 key heads for 4 query heads
        HeadRows("kv", 6, ((0, 2, "key"),)),  # 4 heads of 2 key rows and 4 value rows
        HeadRows("q", 3, ((0, 2, "query"), (2, 3, "query_of_shared_key"))),
    ]
    for rows in layouts:
        n = rows.rows_per_head * (2 if rows.name == "k" else 4)
        weight = torch.randn(n, 5)
        whole = torch.cat([weight, torch.randn(n, 1)], dim=1)
        expected = whole.clone()
        scale_head_rows(expected, gamma, rows, 0.3)
        bias = whole[:, -1].clone()
        scale_bias_entries(bias, gamma, rows, 0.3, n)
        torch.testing.assert_close(bias, expected[:, -1], rtol=0, atol=0)
        assert not torch.equal(bias, whole[:, -1])
        for index in (torch.arange(3, n - 2), torch.tensor([n - 1, 0, 4])):
            shard = whole[index, -1].clone()
            scale_bias_entries(shard, gamma, rows, 0.3, n, index)
            torch.testing.assert_close(shard, expected[index, -1], rtol=0, atol=0)


def test_a_bias_that_is_not_its_projections_is_refused():
    """A bias of another size than its weight's rows, or not 1-D, is named."""
    model = biased_model()
    wrong = [
        ClippedAttention(
            a.module,
            a.query_heads,
            (HeadRows(a.weights[0].name, HEAD_DIM, a.weights[0].parts, "layers.0.k_proj.bias"),),
        )
        for a in attentions()
    ]
    with pytest.raises(ValueError, match="layers.0.k_proj.bias has 16 entries, layers.0.q_proj"):
        Muon(model, predicate=proj_predicate, qk_clip=QKClip(model, wrong, 1.0))
    two_dims = [
        ClippedAttention(
            a.module,
            a.query_heads,
            (HeadRows(a.weights[0].name, HEAD_DIM, a.weights[0].parts, "layers.0.o_proj.weight"),),
        )
        for a in attentions()
    ]
    with pytest.raises(ValueError, match="layers.0.o_proj.weight has 2 dims"):
        QKClip(model, two_dims, 1.0)


# ---- one process ----------------------------------------------------------------------------


def _muon(model, qk_clip, lr_scale=1.0):
    return Muon(
        model,
        predicate=proj_predicate,
        ns_dtype=torch.float32,
        qk_clip=qk_clip,
        **dict(MUON_KW, lr=MUON_KW["lr"] * lr_scale),
        **as_muon_adamw_kwargs(dict(ADAMW_KW, lr=ADAMW_KW["lr"] * lr_scale)),
    )


def _maxima_after_one_clip(biases: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One biased attention layer, every learning rate 0 and one batch: each head's
    largest logit (recomputed from the whole score matrix) before and after a clipped
    step, grouped by key head."""
    with reference_setup(torch.float32):
        model = biased_model(layers=1)
        seen = []
        model.layers[0].attend.register_forward_pre_hook(
            lambda m, args: seen.append(_full_score_maxima(*args[:2]).detach())
        )
        opt = _muon(model, QKClip(model, attentions(1, biases), THRESHOLD, ALPHA), lr_scale=0.0)
        for _ in range(2):
            opt.zero_grad()
            loss_fn(model, *batch(100, 8)).backward()
            opt.step()
    return seen[0].view(KEY_HEADS, -1), seen[1].view(KEY_HEADS, -1)


def test_clipped_max_logit_is_at_most_the_threshold_with_biases():
    """With the biases clipped with their rows, every group of query heads that had a
    logit above the threshold has the threshold as its largest logit at the next step
    (the logit is bilinear in the scaled ``W x + b``), the others are unchanged; a clip of
    the weights alone leaves logits above the threshold (the biases make most of them)."""
    before, after = _maxima_after_one_clip(biases=True)
    assert before.max() > 1.2 * THRESHOLD
    over = (before > THRESHOLD).any(dim=1)
    assert over.any()
    torch.testing.assert_close(after[over].amax(dim=1), torch.full((int(over.sum()),), THRESHOLD))
    assert torch.all(after <= THRESHOLD * (1 + 1e-6))
    torch.testing.assert_close(after[~over], before[~over], rtol=1e-6, atol=0)
    weights_only_before, weights_only_after = _maxima_after_one_clip(biases=False)
    torch.testing.assert_close(weights_only_before, before, rtol=0, atol=0)
    assert weights_only_after.max() > 1.1 * THRESHOLD


# ---- against a reference, one process and under dedicated ownership ------------------------


def _reference_clip(model, maxima: dict[int, torch.Tensor], biases: bool) -> None:
    """Kimi K2's rescaling of each head's query and key rows, and their bias entries."""
    with torch.no_grad():
        for i, m in maxima.items():
            gamma = torch.where(m > THRESHOLD, THRESHOLD / m, torch.ones_like(m))
            key_gamma = gamma.view(KEY_HEADS, -1).amin(dim=1)
            block = model.layers[i]
            scaled = ((block.q_proj, gamma, ALPHA), (block.k_proj, key_gamma, 1 - ALPHA))
            for proj, g, exponent in scaled:
                factor = g.pow(exponent)
                proj.weight.view(len(g), HEAD_DIM, -1).mul_(factor[:, None, None])
                if biases:
                    proj.bias.view(len(g), HEAD_DIM).mul_(factor[:, None])


def reference(samples: int, biases: bool = True) -> dict:
    """One process on the whole batch: torch.optim.Muon on the projections, AdamW on the
    rest (the biases among them), then the clip; the q/k weights and biases after each
    step."""
    with reference_setup(torch.float32):
        model = biased_model()
        muon = [p for n, p in model.named_parameters() if proj_predicate(n, p)]
        rest = [p for n, p in model.named_parameters() if not proj_predicate(n, p)]
        opts = [
            torch.optim.Muon(muon, **MUON_KW),
            torch.optim.AdamW(rest, **REFERENCE_ADAMW_KW),
        ]
        seen: dict[int, torch.Tensor] = {}
        for i, block in enumerate(model.layers):
            block.attend.register_forward_pre_hook(
                lambda m, args, i=i: seen.__setitem__(i, _full_score_maxima(*args[:2]).detach())
            )
        losses, values, clipped = [], [], []
        for step in range(STEPS):
            for o in opts:
                o.zero_grad()
            loss = loss_fn(model, *batch(100 + step, samples))
            loss.backward()
            for o in opts:
                o.step()
            _reference_clip(model, seen, biases)
            losses.append(loss.item())
            clipped.append(sum(int((m > THRESHOLD).sum()) for m in seen.values()))
            params = dict(model.named_parameters())
            values.append({n: params[n].detach().clone() for n in WEIGHTS + BIASES})
    return {"losses": losses, "values": values, "clipped": clipped}


def _assert_equal(values: list[dict], expected: dict, label: str) -> None:
    for step in range(STEPS):
        for name in WEIGHTS + BIASES:
            torch.testing.assert_close(
                values[step][name], expected["values"][step][name], rtol=1e-5, atol=1e-6,
                msg=lambda m, n=name, s=step: f"{label} step {s} {n}: {m}",
            )  # fmt: skip


def test_one_process_equals_reference():
    """4 steps on 8 samples: the q/k weights and biases after each step equal the
    reference (rtol 1e-5), the clipped counts too (some heads at most steps, never all);
    the reference's biases differ from a weights-only clip's (so the comparison can
    fail)."""
    expected = reference(8)
    with reference_setup(torch.float32):
        model = biased_model()
        clip = QKClip(model, attentions(), THRESHOLD, ALPHA)
        opt = _muon(model, clip)
        values, clipped = [], []
        for step in range(STEPS):
            opt.zero_grad()
            loss_fn(model, *batch(100 + step, 8)).backward()
            opt.step()
            clipped.append(int(clip.clipped_heads))
            params = dict(model.named_parameters())
            values.append({n: params[n].detach().clone() for n in WEIGHTS + BIASES})
    _assert_equal(values, expected, "one process")
    assert clipped == expected["clipped"]
    assert sum(c > 0 for c in clipped) >= STEPS // 2 and max(clipped) < LAYERS * QUERY_HEADS
    weights_only = reference(8, biases=False)
    assert not torch.allclose(
        weights_only["values"][-1][BIASES[0]], expected["values"][-1][BIASES[0]], rtol=1e-3
    )


def _parallel_model(layout: str, world: int):
    """The biased model on ``world`` ranks: ``"z3"``: FSDP2 + DMuon Z3 (the biases
    sharded along dim 0 over the ranks); ``"tp"``: TP over the ``world`` ranks (q, k, v
    Colwise: each bias's entries of the rank's heads; o Rowwise); ``"tp_whole_bias"``:
    the same with q's bias replicated, so a rank holds entries of heads it does not clip.
    Returns the model and its TP degree."""
    torch.manual_seed(0)
    model = biased_model()
    if layout == "z3":
        mesh = init_device_mesh("cpu", (world,))
        dedicate_params(model, mesh, proj_predicate, reshard_after_forward=True)
        for block in model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, 1
    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))
    plan = {"q_proj": ColwiseParallel(), "k_proj": ColwiseParallel(),
            "v_proj": ColwiseParallel(), "o_proj": RowwiseParallel()}  # fmt: skip
    for block in model.layers:
        parallelize_module(block, mesh["tp"], plan)
        block.k_proj.bias.requires_grad_(False)  # distributing it made it trainable
        if layout == "tp_whole_bias":
            whole = block.q_proj.bias.detach().full_tensor()
            block.q_proj.bias = nn.Parameter(distribute_tensor(whole, mesh["tp"], [Replicate()]))
    dedicate_params(model, mesh["dp"], proj_predicate)
    return model, world


def _worker(rank, world, layouts):
    """Each layout of :func:`_parallel_model`: the q/k weights and biases after each step
    and the clipped counts; each data-parallel rank its part of the batch. A refused
    layout: its error."""
    runs = {}
    for layout in layouts:
        model, tp = _parallel_model(layout, world)
        sharded = [n for n in BIASES if isinstance(model.get_parameter(n), DTensor)]
        clip = QKClip(model, attentions(tp=tp), THRESHOLD, ALPHA)
        try:
            opt = Muon(model, ns_dtype=torch.float32, qk_clip=clip, **MUON_KW,
                       **as_muon_adamw_kwargs(ADAMW_KW))  # fmt: skip
        except ValueError as e:
            runs[layout] = {"error": str(e)}
            continue
        dp, dp_world = (rank, world) if tp == 1 else (0, 1)
        values, clipped, per = [], [], 4 // dp_world
        for step in range(STEPS):
            inputs, targets = batch(100 + step, 4)
            opt.zero_grad()
            mine = slice(dp * per, (dp + 1) * per)
            loss_fn(model, inputs[mine], targets[mine]).backward()
            opt.step()
            clipped.append(int(clip.clipped_heads))
            step_values = {n: get_full_param(model, n) for n in WEIGHTS}
            step_values.update({n: model.get_parameter(n).full_tensor() for n in sharded})
            values.append(step_values)
        runs[layout] = {"values": values, "clipped": clipped, "sharded": sharded}
        del opt, model
    return runs


def test_fsdp_z3_and_tp_equal_one_process():
    """On 2 ranks, FSDP2 Z3 (each bias sharded, half its heads a rank) and TP 2 (each
    rank its heads' rows and bias entries): after each of 4 steps the q/k weights and
    biases on every rank equal the one-process reference on the whole batch (rtol 1e-5),
    and so do the clipped counts. A q bias replicated over TP while its rows are split
    is refused on every rank, naming it, before the first step."""
    by_rank = run_distributed(_worker, 2, ["z3", "tp", "tp_whole_bias"], timeout=240)
    expected = reference(4)
    for rank, runs in enumerate(by_rank):
        for layout in ("z3", "tp"):
            run = runs[layout]
            assert run["sharded"] == BIASES
            _assert_equal(run["values"], expected, f"{layout} rank {rank}")
            assert run["clipped"] == expected["clipped"]
        assert "layers.0.q_proj.bias (" in runs["tp_whole_bias"]["error"]
        assert "clip factors are not known here" in runs["tp_whole_bias"]["error"]


def _rows_worker(rank, world):
    """A Colwise linear with a bias on TP 2, then FSDP2 over DP 2 (TorchTitan's 2-D
    layout: the bias's shard strided over TP): where its entries on this rank lie, found
    without reading the weight's storage."""
    from torchtitan_dmuon.engine.param_layout import bias_entries, held_rows

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    linear = nn.Linear(4, 32)
    whole = linear.bias.detach().clone()
    parallelize_module(linear, mesh["tp"], ColwiseParallel())
    weight = linear.weight  # TP rows only, as a dedicated matrix keeps them
    fully_shard(linear, mesh=mesh["dp"])
    weight.to_local().untyped_storage().resize_(0)  # as the engine frees an unheld matrix
    rows = HeadRows("w", 8, ((0, 8, "query"),), "b")
    index = bias_entries(weight, linear.bias, rows, 16)
    return {
        "placements": str(linear.bias.placements),
        "here": held_rows(linear.bias).tolist(),
        "local": linear.bias.to_local().detach().clone(),
        "whole": whole,
        "index": index.tolist(),
    }


def test_bias_entries_located_under_fsdp_over_tp():
    """FSDP2 over TP (4 ranks, DP 2 x TP 2): each rank's bias entries are the whole
    bias's at the indices found, a quarter each, at their place among the TP rank's
    rows (rank (dp, tp) holds rows 16 tp + 8 dp ..., index 8 dp ...)."""
    by_rank = run_distributed(_rows_worker, 4, timeout=120)
    for rank, run in enumerate(by_rank):
        dp, tp = divmod(rank, 2)
        assert run["placements"] == "(_StridedShard(dim=0, sf=2), Shard(dim=0))"
        assert run["here"] == list(range(16 * tp + 8 * dp, 16 * tp + 8 * dp + 8))
        torch.testing.assert_close(run["local"], run["whole"][run["here"]], rtol=0, atol=0)
        assert run["index"] == list(range(8 * dp, 8 * dp + 8))
