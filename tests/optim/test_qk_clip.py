"""QK-clip (``Muon(qk_clip=QKClip(...))``, Kimi K2's MuonClip): the chunked per-head
maxima and the rescaling rules, one process and under dedicated ownership (FSDP Z3 on 2
and 4 gloo ranks, HSDP 2 x 2, TP 2 x DP 2), against a one-process reference written here
from the definition: the whole score matrix of the whole batch, each head's largest
logit, its query rows times ``gamma ** alpha`` and its key rows times
``gamma ** (1 - alpha)`` after torch.optim.Muon's update."""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from tests.support.dist import run_distributed
from tests.support.models import HeadsBlock, batch, loss_fn, make_model, proj_predicate
from tests.support.workers import (
    ADAMW_KW,
    MUON_KW,
    REFERENCE_ADAMW_KW,
    as_muon_adamw_kwargs,
    full_params,
    reference_setup,
)
from torchtitan_dmuon import (
    ClippedAttention,
    Muon,
    QKClip,
    dedicate_params,
    get_dedication,
    get_full_param,
)
from torchtitan_dmuon.optim.qk_clip import HeadRows, head_max_logits, scale_head_rows

STEPS = 6
THRESHOLD = 15.0
ALPHA = 0.5
HEAD_DIM = HeadsBlock.head_dim
QUERY_HEADS, KEY_HEADS = 4, 2  # dim 32 in heads of 8; two query heads per key head
LAYERS = 2
WEIGHTS = [f"layers.{i}.{p}_proj.weight" for i in range(LAYERS) for p in ("q", "k")]


def attentions(tp: int = 1, layers: int = LAYERS) -> list[ClippedAttention]:
    """The test model's attention layers as QK-clip sees them (``tp``: their TP degree)."""
    return [
        ClippedAttention(
            f"layers.{i}.attend",
            QUERY_HEADS // tp,
            (
                HeadRows(f"layers.{i}.q_proj.weight", HEAD_DIM, ((0, HEAD_DIM, "query"),)),
                HeadRows(f"layers.{i}.k_proj.weight", HEAD_DIM, ((0, HEAD_DIM, "key"),)),
            ),
        )
        for i in range(layers)
    ]


def heads_model(layers: int = LAYERS):
    return make_model(seed=0, block=HeadsBlock, layers=layers)


# ---- the reference, from the definition ---------------------------------------------------


def _full_score_maxima(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Each query head's largest causal logit, from the whole score matrix."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    seq = q.shape[2]
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    return scores.masked_fill(~causal, -math.inf).amax(dim=(0, 2, 3))


def _reference_clip(model, maxima: dict[int, torch.Tensor], threshold: float) -> None:
    """Kimi K2's rescaling; a key head shared by two query heads takes the smaller gamma."""
    with torch.no_grad():
        for i, m in maxima.items():
            gamma = torch.where(m > threshold, threshold / m, torch.ones_like(m))
            block = model.layers[i]
            q = block.q_proj.weight.view(QUERY_HEADS, HEAD_DIM, -1)
            q.mul_(gamma.pow(ALPHA)[:, None, None])
            key_gamma = gamma.view(KEY_HEADS, -1).amin(dim=1)
            k = block.k_proj.weight.view(KEY_HEADS, HEAD_DIM, -1)
            k.mul_(key_gamma.pow(1 - ALPHA)[:, None, None])


def reference(samples: int, threshold: float, steps: int = STEPS, lr_scale: float = 1.0,
              same_batch: bool = False) -> dict:  # fmt: skip
    """One process on the whole batch: torch.optim.Muon on the projections, AdamW on the
    rest, then the clip; the q/k weights and the per-step maxima after each step."""
    with reference_setup(torch.float32):
        model = heads_model()
        muon = [p for n, p in model.named_parameters() if proj_predicate(n, p)]
        rest = [p for n, p in model.named_parameters() if not proj_predicate(n, p)]
        opts = [
            torch.optim.Muon(muon, **dict(MUON_KW, lr=MUON_KW["lr"] * lr_scale)),
            torch.optim.AdamW(rest, **dict(REFERENCE_ADAMW_KW, lr=ADAMW_KW["lr"] * lr_scale)),
        ]
        seen: dict[int, torch.Tensor] = {}
        for i, block in enumerate(model.layers):
            block.attend.register_forward_pre_hook(
                lambda m, args, i=i: seen.__setitem__(i, _full_score_maxima(*args[:2]).detach())
            )
        losses, weights, maxima, clipped = [], [], [], []
        for step in range(steps):
            for o in opts:
                o.zero_grad()
            loss = loss_fn(model, *batch(100 + (0 if same_batch else step), samples))
            loss.backward()
            for o in opts:
                o.step()
            _reference_clip(model, seen, threshold)
            losses.append(loss.item())
            maxima.append(max(m.max().item() for m in seen.values()))
            clipped.append(sum(int((m > threshold).sum()) for m in seen.values()))
            params = dict(model.named_parameters())
            weights.append({n: params[n].detach().clone() for n in WEIGHTS})
    return {"losses": losses, "weights": weights, "maxima": maxima, "clipped": clipped}


# ---- the math -------------------------------------------------------------------------------


def test_chunked_maxima_equal_the_whole_score_matrix():
    """Causal, non-causal and a FlexAttention-style document mask, over chunks of two query
    rows: the same per-head maxima as the whole score matrix, with GQA heads."""
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, 9, 8, generator=g), torch.randn(2, 2, 9, 8, generator=g)
    chunk = 2 * 4 * 2 * 9  # two query rows per chunk
    torch.testing.assert_close(
        head_max_logits(q, k, chunk_elements=chunk), _full_score_maxima(q, k), rtol=1e-6, atol=0
    )
    full = q @ k.repeat_interleave(2, dim=1).transpose(-2, -1) * 0.3
    got = head_max_logits(q, k, scale=0.3, causal=False, chunk_elements=chunk)
    torch.testing.assert_close(got, full.amax(dim=(0, 2, 3)), rtol=1e-6, atol=0)
    documents = torch.tensor([[0] * 4 + [1] * 5, [0] * 9])

    def mask_mod(b, h, q_idx, kv_idx):
        return (documents[b, q_idx] == documents[b, kv_idx]) & (q_idx >= kv_idx)

    visible = torch.tensor(
        [[[mask_mod(b, 0, i, j) for j in range(9)] for i in range(9)] for b in range(2)]
    )[:, None]
    expected = full.masked_fill(~visible, -math.inf).amax(dim=(0, 2, 3))
    got = head_max_logits(q, k, scale=0.3, mask_mod=mask_mod, chunk_elements=chunk)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=0)


def test_scaling_follows_kimi_k2_for_mla_and_gqa():
    """MLA (DeepSeek-V3): q_nope rows by gamma^alpha, q_pe rows by gamma, k_nope rows of
    wkv_b by gamma^(1-alpha), its value rows untouched. GQA: a key head takes its query
    group's smallest gamma."""
    gamma = torch.tensor([0.25, 1.0, 0.5])
    nope, rope, value = 4, 2, 3
    wq, wkv_b = torch.randn(3 * (nope + rope), 5), torch.randn(3 * (nope + value), 5)
    q_parts = ((0, nope, "query"), (nope, nope + rope, "query_of_shared_key"))
    q_rows = HeadRows("wq", nope + rope, q_parts)
    kv_rows = HeadRows("wkv_b", nope + value, ((0, nope, "key"),))
    alpha = 0.3
    expected_q = wq.clone().view(3, nope + rope, 5)
    expected_q[:, :nope] *= gamma.pow(alpha)[:, None, None]
    expected_q[:, nope:] *= gamma[:, None, None]
    expected_kv = wkv_b.clone().view(3, nope + value, 5)
    expected_kv[:, :nope] *= gamma.pow(1 - alpha)[:, None, None]
    scale_head_rows(wq, gamma, q_rows, alpha)
    scale_head_rows(wkv_b, gamma, kv_rows, alpha)
    torch.testing.assert_close(wq, expected_q.view_as(wq), rtol=1e-6, atol=0)
    torch.testing.assert_close(wkv_b, expected_kv.view_as(wkv_b), rtol=1e-6, atol=0)

    wk = torch.randn(2 * 8, 5)
    expected_k = wk.clone().view(2, 8, 5) * torch.tensor([0.25, 0.5]).sqrt()[:, None, None]
    group_gammas = torch.tensor([0.25, 1.0, 1.0, 0.5])
    scale_head_rows(wk, group_gammas, HeadRows("wk", 8, ((0, 8, "key"),)), 0.5)
    torch.testing.assert_close(wk, expected_k.view_as(wk), rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match="not whole heads"):
        scale_head_rows(torch.randn(10, 5), gamma, HeadRows("w", 4, ((0, 4, "key"),)), 0.5)


def _one_process_muon(model, qk_clip, lr_scale=1.0):
    return Muon(
        model,
        predicate=proj_predicate,
        ns_dtype=torch.float32,
        qk_clip=qk_clip,
        **dict(MUON_KW, lr=MUON_KW["lr"] * lr_scale),
        **as_muon_adamw_kwargs(dict(ADAMW_KW, lr=ADAMW_KW["lr"] * lr_scale)),
    )


def test_one_process_equals_reference():
    """6 steps on 8 samples: losses and the q/k weights after each step equal the
    reference (rtol 1e-5), and so do the logged maximum and the count of clipped heads (some
    at most steps, never all); the run differs from plain Muon (so the comparison can
    fail)."""
    expected = reference(8, THRESHOLD)
    with reference_setup(torch.float32):
        model = heads_model()
        clip = QKClip(model, attentions(), THRESHOLD, ALPHA)
        opt = _one_process_muon(model, clip)
        losses, clipped = [], []
        for step in range(STEPS):
            opt.zero_grad()
            loss = loss_fn(model, *batch(100 + step, 8))
            loss.backward()
            opt.step()
            losses.append(loss.item())
            clipped.append(int(clip.clipped_heads))
            params = dict(model.named_parameters())
            for name in WEIGHTS:
                torch.testing.assert_close(
                    params[name], expected["weights"][step][name], rtol=1e-5, atol=1e-6,
                    msg=lambda m, n=name, s=step: f"step {s} {n}: {m}",
                )  # fmt: skip
            assert clip.max_logit.item() == pytest.approx(expected["maxima"][step], rel=1e-5)
    torch.testing.assert_close(losses, expected["losses"], rtol=1e-5, atol=0)
    assert clipped == expected["clipped"]
    assert sum(c > 0 for c in clipped) >= STEPS // 2 and max(clipped) < LAYERS * QUERY_HEADS
    unclipped = reference(8, threshold=math.inf)
    assert not torch.allclose(
        unclipped["weights"][-1][WEIGHTS[0]], expected["weights"][-1][WEIGHTS[0]], rtol=1e-3
    )


def test_maximum_falls_to_the_threshold_at_the_next_step():
    """One attention layer, every learning rate 0 and the same batch: only the clip changes
    the model: in each key head's group of query heads that had a logit above the
    threshold, the largest logit of the next step is the threshold (its head's logits
    scaled by exactly gamma, its partner's by at most its own gamma); other groups stay."""
    with reference_setup(torch.float32):
        model = heads_model(layers=1)
        clip = QKClip(model, attentions(layers=1), THRESHOLD, ALPHA)
        opt = _one_process_muon(model, clip, lr_scale=0.0)
        seen = []
        for _ in range(2):
            opt.zero_grad()
            loss_fn(model, *batch(100, 8)).backward()
            seen.append(clip.maxima(torch.device("cpu")).view(KEY_HEADS, -1))
            opt.step()
    before, after = seen
    assert before.max() > 1.2 * THRESHOLD
    over = (before > THRESHOLD).any(dim=1)
    assert over.any()
    torch.testing.assert_close(after[over].amax(dim=1), torch.full((int(over.sum()),), THRESHOLD))
    assert torch.all(after[over] <= THRESHOLD * (1 + 1e-6))
    torch.testing.assert_close(after[~over], before[~over], rtol=1e-6, atol=0)


def test_invalid_settings_name_the_argument():
    """Bad settings and layouts raise in the constructors, naming what is wrong."""
    model = heads_model()
    QUERY = ((0, 8, "query"),)
    with pytest.raises(ValueError, match="threshold must be a positive number"):
        QKClip(model, attentions(), 0.0)
    with pytest.raises(ValueError, match=r"alpha must be in \[0, 1\]"):
        QKClip(model, attentions(), 1.0, alpha=1.5)
    with pytest.raises(ValueError, match="layers.0.q_proj.weight is not a Muon matrix"):
        Muon(model, predicate=lambda n, p: "up" in n, qk_clip=QKClip(model, attentions(), 1.0))
    twelve_rows = [
        ClippedAttention(a.module, a.query_heads, (HeadRows(a.weights[0].name, 12, QUERY),))
        for a in attentions()
    ]
    with pytest.raises(ValueError, match="layers.0.q_proj.weight has 32 rows here, not whole"):
        Muon(model, predicate=proj_predicate, qk_clip=QKClip(model, twelve_rows, 1.0))
    clip = QKClip(model, attentions(), 1.0)
    with pytest.raises(ValueError, match="4 query heads on this rank"):
        clip.record("layers.0.attend", torch.zeros(3))


# ---- under dedicated ownership ---------------------------------------------------------------


def _worker(rank, world, layouts, threshold=THRESHOLD):
    """One run per layout ("z3": FSDP2 + DMuon Z3; "hsdp": 2 replicas x 2 shards; "tp":
    TP 2 x DP 2, DDP-style data parallelism; "groups": Z3 with owner groups of 2, whose
    members each clip their block's columns of the heads' rows), each rank its part of
    the batch."""
    runs = []
    for layout in layouts:
        torch.manual_seed(0)
        model = heads_model()
        tp = 1
        if layout == "tp":
            mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
            tp, dp_mesh = 2, mesh["dp"]
            plan = {"q_proj": ColwiseParallel(), "k_proj": ColwiseParallel(),
                    "v_proj": ColwiseParallel(), "o_proj": RowwiseParallel(),
                    "up_proj": ColwiseParallel(), "down_proj": RowwiseParallel()}  # fmt: skip
            for block in model.layers:
                parallelize_module(block, mesh["tp"], plan)
            dedicate_params(model, dp_mesh, proj_predicate)
            dp, dp_world = dp_mesh.get_local_rank(), dp_mesh.size()
        else:
            if layout == "hsdp":
                fsdp_mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("r", "s"))
                mesh, replicate = fsdp_mesh["s"], fsdp_mesh["r"]
            else:
                fsdp_mesh = mesh = init_device_mesh("cpu", (world,))
                replicate = None
            dedicate_params(model, mesh, proj_predicate, replicate_mesh=replicate,
                            reshard_after_forward=True,
                            owner_group_size=2 if layout == "groups" else 1)  # fmt: skip
            for block in model.layers:
                fully_shard(block, mesh=fsdp_mesh)
            fully_shard(model, mesh=fsdp_mesh)
            dp, dp_world = rank, world
        clip = QKClip(model, attentions(tp), threshold, ALPHA) if threshold else None
        opt = Muon(model, ns_dtype=torch.float32, qk_clip=clip, **MUON_KW,
                   **as_muon_adamw_kwargs(ADAMW_KW))  # fmt: skip
        losses, weights, maxima, clipped = [], [], [], []
        per = 2
        for step in range(STEPS):
            inputs, targets = batch(100 + step, per * dp_world)
            opt.zero_grad()
            mine = slice(dp * per, (dp + 1) * per)
            loss = loss_fn(model, inputs[mine], targets[mine])
            loss.backward()
            opt.step()
            losses.append(loss.item())
            weights.append({n: get_full_param(model, n) for n in WEIGHTS})
            if clip is not None:
                maxima.append(clip.max_logit.item())
                clipped.append(int(clip.clipped_heads))
        stats = get_dedication(model).stats.snapshot()
        names = {n for n, p in model.named_parameters() if proj_predicate(n, p)}
        runs.append({"layout": layout, "dp_world": dp_world, "losses": losses,
                     "weights": weights, "maxima": maxima, "clipped": clipped, "stats": stats,
                     "params": full_params(model, names)})  # fmt: skip
        get_dedication(model).wait_replicas()
        del opt, model
    return runs


def _assert_equal_to_reference(run, expected):
    for step in range(STEPS):
        for name in WEIGHTS:
            torch.testing.assert_close(
                run["weights"][step][name], expected["weights"][step][name], rtol=1e-5,
                atol=1e-6, msg=lambda m, n=name, s=step: f"{run['layout']} step {s} {n}: {m}",
            )  # fmt: skip
    assert run["maxima"] == pytest.approx(expected["maxima"], rel=1e-5)


@pytest.mark.parametrize("world", [2, 4])
def test_dedicated_layouts_equal_one_process(world):
    """FSDP2 Z3 on 2 and 4 ranks, and on 4 HSDP (2 x 2), TP 2 x DP 2 and owner groups of
    2: after each of 6
    steps the q/k weights equal the one-process reference on the whole batch (rtol 1e-5),
    and so does every rank's logged maximum (under TP, over both TP ranks' heads); the
    losses too; one MAX all-reduce of the maxima per step and data-parallel group."""
    layouts = ["z3"] if world == 2 else ["z3", "hsdp", "tp", "groups"]
    by_rank = run_distributed(_worker, world, layouts, timeout=300)
    expected = {dp: reference(2 * dp, THRESHOLD) for dp in {world, world // 2}}
    for runs in by_rank:
        for run in runs:
            ref = expected[run["dp_world"]]
            _assert_equal_to_reference(run, ref)
            assert run["clipped"] == ref["clipped"]
            heads = LAYERS * QUERY_HEADS // (2 if run["layout"] == "tp" else 1)
            groups = 2 if run["layout"] == "hsdp" else 1
            assert run["stats"]["calls"]["qk_clip_all_reduce"] == STEPS * groups
            assert run["stats"]["bytes"]["qk_clip_all_reduce"] == STEPS * groups * 4 * heads
    for layout in layouts:
        runs = [r for rank_runs in by_rank for r in rank_runs if r["layout"] == layout]
        dp = runs[0]["dp_world"]
        step_losses = [sum(s) / len(runs) for s in zip(*(r["losses"] for r in runs), strict=True)]
        torch.testing.assert_close(step_losses, expected[dp]["losses"], rtol=1e-5, atol=1e-6)


def test_off_is_bitwise_unchanged():
    """FSDP2 Z3 on 2 ranks: watching with a threshold no logit reaches changes no bit of
    any parameter against the same run with QK-clip off."""
    on = run_distributed(_worker, 2, ["z3"], 1e30)
    off = run_distributed(_worker, 2, ["z3"], None)
    for a, b in zip(on, off, strict=True):
        assert a[0]["clipped"] == [0] * STEPS
        for name, value in a[0]["params"].items():
            assert torch.equal(value, b[0]["params"][name]), name
        assert a[0]["losses"] == b[0]["losses"]


def test_recompute_in_backward_records_nothing(monkeypatch):
    """Under activation checkpointing the backward's recompute of a block sees the values
    its forward saw: the maxima are computed once per forward, not again."""
    import torchtitan_dmuon.optim.qk_clip as qk_clip_module

    calls = []
    original = qk_clip_module.head_max_logits
    monkeypatch.setattr(
        qk_clip_module, "head_max_logits", lambda *a, **k: calls.append(1) or original(*a, **k)
    )
    model = heads_model()
    clip = QKClip(model, attentions(), THRESHOLD)
    inputs, targets = batch(100, 4)
    x = model.embed(inputs)
    for block in model.layers:
        x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
    logits = model.head(model.norm(x))
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
    loss.backward()
    assert len(calls) == LAYERS
    assert model.layers[0].q_proj.weight.grad is not None
    with torch.no_grad():  # an evaluation pass
        model(inputs)
    assert len(calls) == LAYERS
    assert clip.maxima(torch.device("cpu")).isfinite().all()


# ---- TorchTitan's models ----------------------------------------------------------------------


def test_discard_records_drops_what_a_models_watchers_recorded():
    """A forward that was not training (a pipeline stage's metadata inference on
    uninitialized tensors) leaves nothing behind once discarded: only the watchers of that
    model lose their records, and a removed QKClip is no longer one of them."""
    from torchtitan_dmuon.optim.qk_clip import discard_records

    model, other = heads_model(), heads_model()
    clip, other_clip = QKClip(model, attentions(), THRESHOLD), QKClip(other, attentions(), 1.0)
    inputs, _ = batch(100, 4)
    model(inputs)
    other(inputs)
    cpu = torch.device("cpu")
    assert clip.maxima(cpu).isfinite().all() and other_clip.maxima(cpu).isfinite().all()
    discard_records(model)
    assert torch.equal(clip.maxima(cpu), torch.full((LAYERS * QUERY_HEADS,), -math.inf))
    assert other_clip.maxima(cpu).isfinite().all()
    clip.remove()
    model(inputs)  # no hook any more
    discard_records(model)
    assert torch.equal(clip.maxima(cpu), torch.full((LAYERS * QUERY_HEADS,), -math.inf))
