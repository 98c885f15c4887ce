"""QK-clip on TorchTitan's models: which head rows ``build_qk_clip`` names (llama3, llama4,
deepseek_v3's MLA, biases), what it refuses, and TorchTitan's per-block compile with
activation checkpointing."""

import copy

import pytest
import torch
from torch import nn

from torchtitan_dmuon import Muon
from torchtitan_dmuon.optim.qk_clip import HeadRows


def _titan_model(name: str, flavor: str = "debugmodel"):
    import importlib

    package = importlib.import_module(f"torchtitan.models.{name}")
    args = getattr(package, {"deepseek_v3": "deepseekv3_args"}.get(name, f"{name}_args"))[flavor]
    if name == "deepseek_v3":  # what update_from_config sets from [parallelism]
        args = copy.copy(args)
        args.moe_impl = "standard"
    cls = {"llama3": "Transformer", "llama4": "Transformer", "qwen3": "Qwen3Model",
           "deepseek_v3": "DeepSeekV3Model"}[name]  # fmt: skip
    with torch.device("meta"):
        return getattr(package, cls)(args)


def _layout(cp=1, tp=1):
    from types import SimpleNamespace

    return SimpleNamespace(cp=cp, tp=tp)


def test_titan_models_clip_the_heads_rows_they_own():
    """llama3 / llama4: each head's wq and wk rows (local heads under TP); deepseek_v3
    (MLA): wq's q_nope rows by the query's share, its q_pe rows by the whole factor,
    wkv_b's k_nope rows by the key's share; qwen3 (QK-norm), context parallelism and a
    threshold of 0 (off) say so."""
    from torchtitan_dmuon.titan.config import DMuon
    from torchtitan_dmuon.titan.qk_clip import build_qk_clip

    on = DMuon(qk_clip_threshold=100.0)
    llama3 = build_qk_clip(_titan_model("llama3"), on, _layout(tp=2))
    first = llama3.attentions[0]
    assert len(llama3.attentions) == 6 and first.module == "layers.0.attention.inner_attention"
    assert first.query_heads == 16 // 2
    assert first.weights == (
        HeadRows("layers.0.attention.wq.weight", 16, ((0, 16, "query"),)),
        HeadRows("layers.0.attention.wk.weight", 16, ((0, 16, "key"),)),
    )
    assert len(build_qk_clip(_titan_model("llama4"), on, _layout()).attentions) == 6
    mla = build_qk_clip(_titan_model("deepseek_v3"), on, _layout()).attentions[0]
    assert mla.query_heads == 16
    assert mla.weights == (
        HeadRows(
            "layers.0.attention.wq.weight",
            192,
            ((0, 128, "query"), (128, 192, "query_of_shared_key")),
        ),  # fmt: skip
        HeadRows("layers.0.attention.wkv_b.weight", 256, ((0, 128, "key"),)),
    )
    assert build_qk_clip(_titan_model("llama3"), DMuon(), _layout()) is None
    with pytest.raises(ValueError, match="qk_norm"):
        build_qk_clip(_titan_model("qwen3"), on, _layout())
    with pytest.raises(ValueError, match="context parallelism is not supported"):
        build_qk_clip(_titan_model("llama3"), on, _layout(cp=2))
    with pytest.raises(ValueError, match=r"qk_clip_threshold must be >= 0"):
        DMuon(qk_clip_threshold=-1.0)
    with pytest.raises(ValueError, match=r"qk_clip_alpha must be in \[0, 1\]"):
        DMuon(qk_clip_alpha=2.0)


def _compiled_titan_llama3(ac: str | None, compiled: bool, counter, layers: int = 12):
    """The debug llama3 at ``layers`` layers, initialized from seed 0, with TorchTitan's
    activation checkpointing (``"full"`` or per-op ``"selective"``) and its per-block
    ``torch.compile(block, fullgraph=True)`` (on ``counter``'s backend) applied as its
    parallelize function does."""
    from types import SimpleNamespace

    from torchtitan.distributed.activation_checkpoint import apply_ac
    from torchtitan.models.llama3 import Transformer, llama3_args

    args = copy.copy(llama3_args["debugmodel"])
    args.n_layers = layers
    torch.manual_seed(0)
    model = Transformer(args)
    with torch.no_grad():
        model.init_weights()
    if ac is not None:
        ac_config = SimpleNamespace(
            mode=ac, selective_ac_option="op", preserve_rng_state=False,
            determinism_check="default", early_stop=False, debug=False,
            per_op_sac_force_recompute_mm_shapes_by_fqns=[],
        )  # fmt: skip
        apply_ac(model, ac_config, model_compile_enabled=compiled,
                 op_sac_save_list={torch.ops.aten.mm.default})  # fmt: skip
    if compiled:
        for layer_id, block in model.layers.named_children():
            model.layers.register_module(
                layer_id, torch.compile(block, backend=counter, fullgraph=True)
            )
    return model, args


@pytest.mark.parametrize("ac", [None, "full", "selective"])
def test_titan_llama3_compiled_per_block_with_ac_compiles_once(ac):
    """TorchTitan's per-block compile (fullgraph) of a 12-layer llama3 with QK-clip, two
    microbatches of gradient accumulation per step, without AC and with full or per-op
    selective AC: Dynamo compiles the block once for all 12 blocks, 2 microbatches and 2
    steps (the hook reads no per-layer Python value), and the maxima and the clipped wq /
    wk after each Muon step equal the eager model's."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from torchtitan_dmuon.titan.config import DMuon
    from torchtitan_dmuon.titan.qk_clip import build_qk_clip

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    runs = {}
    for compiled in (False, True):
        model, args = _compiled_titan_llama3(ac, compiled, counter)
        settings = DMuon(qk_clip_threshold=0.4)
        clip = build_qk_clip(model, settings, _layout())
        optimizer = Muon(
            model, lr=0.02, qk_clip=clip, predicate=lambda n, p: p.ndim == 2 and ".attention." in n
        )
        # 2 steps of 2 microbatches of 2 sequences of 32 tokens.
        generator = torch.Generator().manual_seed(1)
        tokens = torch.randint(0, args.vocab_size, (2, 2, 2, 32), generator=generator)
        maxima, weights = [], []
        for step in range(2):
            for micro in tokens[step]:
                model(micro).float().logsumexp(-1).mean().backward()
            maxima.append(clip.maxima(torch.device("cpu")))
            optimizer.step()
            optimizer.zero_grad()
            names = ("wq.weight", "wk.weight")
            weights.append(
                [p.detach().clone() for n, p in model.named_parameters() if n.endswith(names)]
            )
        runs[compiled] = maxima, weights, clip.clipped_heads
    assert counter.frame_count == 1
    eager_maxima, eager_weights, eager_clipped = runs[False]
    maxima, weights, clipped = runs[True]
    assert int(eager_clipped) > 0 and int(clipped) == int(eager_clipped)
    for a, b in zip(maxima, eager_maxima, strict=True):
        assert a.shape == (12 * 16,) and a.isfinite().all()
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for step_weights, step_eager in zip(weights, eager_weights, strict=True):
        assert len(step_weights) == 24
        for a, b in zip(step_weights, step_eager, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_titan_attention_with_biases_names_them():
    """TorchTitan's llama3 with biases on wq, wk and wv (Qwen2.5's layout): each head's
    wq and wk rows come with their bias (wv's, outside the logit, is left alone); without
    biases none is named."""
    from torchtitan_dmuon.titan.config import DMuon
    from torchtitan_dmuon.titan.qk_clip import build_qk_clip

    on = DMuon(qk_clip_threshold=100.0)
    model = _titan_model("llama3")
    with torch.device("meta"):
        for block in model.layers.values():
            attention = block.attention
            for name in ("wq", "wk", "wv"):
                linear = getattr(attention, name)
                setattr(attention, name, nn.Linear(linear.in_features, linear.out_features))
    first = build_qk_clip(model, on, _layout(tp=2)).attentions[0]
    assert first.weights == (
        HeadRows("layers.0.attention.wq.weight", 16, ((0, 16, "query"),),
                 "layers.0.attention.wq.bias"),
        HeadRows("layers.0.attention.wk.weight", 16, ((0, 16, "key"),),
                 "layers.0.attention.wk.bias"),
    )  # fmt: skip
    plain = build_qk_clip(_titan_model("llama3"), on, _layout()).attentions[0]
    assert [rows.bias for rows in plain.weights] == [None, None]
