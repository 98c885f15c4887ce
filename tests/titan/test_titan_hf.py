"""Qwen2.5, Mistral and Llama-3.2 through TorchTitan's HF backend
(``transformers_modeling_backend``, ``torchtitan_dmuon/titan/hf.py``): each family's
default selection on its real and debug sizes (meta device), FSDP training of the debug
sizes with DMuon and AdamW through the test launcher, checkpoint resume, HSDP and tensor
parallelism, and DMuon on 4 ranks against one process of torch.optim.Muon + AdamW on the
same HF model."""

from __future__ import annotations

import copy
import math
import types

import pytest
import torch

pytest.importorskip("transformers", reason="the HF families need transformers (.[hf])")

from tests.support.dist import run_distributed  # noqa: E402
from tests.support.workers import (  # noqa: E402
    ADAMW_KW,
    MUON_KW,
    REFERENCE_ADAMW_KW,
    as_muon_adamw_kwargs,
    full_params,
    reference_setup,
    train_one_process,
)
from tests.titan.test_titan_integration import ROOT, SHORT, run_train, shared_run  # noqa: E402
from tests.titan.test_titan_variants import _qk_metrics  # noqa: E402

HF = "transformers_modeling_backend"
FAMILIES = ("qwen2.5", "mistral", "llama3.2")
CONFIGS = {family: f"train_configs/hf_{family}_debug.toml" for family in FAMILIES}
CHECKPOINT = ["--checkpoint.enable", "--checkpoint.interval", "3"]
STEPS = range(1, 7)

# flavor: (layers, q/k/v biases, tied embeddings, parameters). The parameter counts are
# the published sizes (Qwen2.5-1.5B: 1.54B, 7B: 7.62B, Mistral-7B-v0.3: 7.25B,
# Llama-3.2-3B: 3.21B), here exact.
FLAVORS = {
    "qwen2.5-1.5B": (28, True, True, 1_543_714_304),
    "qwen2.5-7B": (28, True, False, 7_615_616_512),
    "mistral-7B-v0.3": (32, False, False, 7_248_023_552),
    "llama3.2-3B": (28, False, True, 3_212_749_824),
    "qwen2.5-debug": (2, True, True, 2_001_152),
    "mistral-debug": (2, False, False, 2_524_416),
    "llama3.2-debug": (2, False, True, 2_000_128),
}


def _meta_model(flavor: str):
    """The flavor's JobConfig (with [dmuon] and [hf_transformers]) and model on meta."""
    from torchtitan.config import ConfigManager
    from torchtitan.protocols.train_spec import get_train_spec

    from torchtitan_dmuon.titan import register

    register()
    cfg = ConfigManager().parse_args(
        ["--model.name", HF, "--model.flavor", flavor,
         "--job.custom_config_module", "torchtitan_dmuon.titan.config"]
    )  # fmt: skip
    spec = get_train_spec(HF)
    model_args = copy.deepcopy(spec.model_args[flavor])
    model_args.update_from_config(cfg)  # as the trainer does
    with torch.device("meta"):
        model = spec.model_cls(model_args)
    return cfg, model


@pytest.mark.parametrize("flavor", sorted(FLAVORS))
def test_each_family_selects_its_attention_and_mlp_matrices(flavor):
    """Each flavor keeps its config's sizes (the published parameter count) and its
    default selection is exactly every layer's q/k/v/o_proj and gate/up/down_proj weights;
    the q/k/v biases, the norms, embed_tokens and lm_head (tied: the same parameter, one
    name) go to AdamW, and select_matrices (which refuses tied parameters) accepts it."""
    from torchtitan_dmuon.engine.plan import select_matrices
    from torchtitan_dmuon.titan.parallelize import muon_predicate, resolve_selection

    layers, biases, tied, count = FLAVORS[flavor]
    cfg, model = _meta_model(flavor)
    assert sum(p.numel() for p in model.parameters()) == count
    assert (model.output.weight is model.tok_embeddings.weight) == tied
    selected = [n for n, _ in select_matrices(model, muon_predicate(resolve_selection(model, cfg)))]
    prefix = "model.model.layers"
    assert selected == [
        f"{prefix}.{i}.{name}.weight"
        for i in range(layers)
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                     "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
    ]  # fmt: skip
    rest = [n for n, _ in model.named_parameters() if n not in selected]
    per_layer = [f"self_attn.{x}_proj.bias" for x in "qkv"] if biases else []
    per_layer += ["input_layernorm.weight", "post_attention_layernorm.weight"]
    expected_rest = ["model.model.embed_tokens.weight"]
    expected_rest += [f"{prefix}.{i}.{name}" for i in range(layers) for name in per_layer]
    expected_rest += ["model.model.norm.weight"] + ([] if tied else ["model.lm_head.weight"])
    assert rest == expected_rest


def _plain(family: str) -> list[str]:
    return [*SHORT, *CHECKPOINT, "--job.config_file", CONFIGS[family]]


def _check_tied(checkpoint, tied: bool) -> None:
    """The saved embed_tokens and lm_head are equal (tied) or differ (untied)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    saved = checkpoint.parent / f"{checkpoint.name}.pt"
    dcp_to_torch_save(checkpoint, saved)
    state = torch.load(saved, weights_only=False)  # the model's entries at the top level
    embed, head = state["model.model.embed_tokens.weight"], state["model.lm_head.weight"]
    assert torch.equal(embed, head) == tied


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_fsdp_trains_each_family_with_dmuon_and_adamw_and_resumes_bitwise(
    family, tmp_path, tmp_path_factory
):
    """The debug size at 2 ranks, FSDP2 (Z3): DMuon (14 matrices dedicated, 7 per rank)
    and AdamW each train 6 steps with finite, falling losses; DMuon's step-3 checkpoint
    resumes with steps 4-6 bitwise those of the uninterrupted run; a tied family's head
    is the embedding's parameter after parallelizing (logged) and saved equal to it after
    6 steps, an untied one's differs."""
    dmuon = shared_run(_plain(family), 2, tmp_path_factory, CONFIGS[family])
    adamw = run_train([*SHORT, "--optimizer.name", "AdamW"], 2, tmp_path / "adamw", CONFIGS[family])
    for run in (dmuon, adamw):
        assert run.returncode == 0, run.output[-4000:]
        assert sorted(run.losses) == list(STEPS)
        assert all(math.isfinite(v) for v in run.losses.values()), run.losses
        assert run.losses[6] < run.losses[1] - 0.1, run.losses
    assert "dedicate_params: 14 parameters (14 matrices)" in dmuon.output
    assert "7 of 14 dedicated parameters held here" in dmuon.output
    assert "dmuon:" not in adamw.output
    tied = family != "mistral"
    for run in (dmuon, adamw):
        assert ("tied embeddings: lm_head and embed_tokens are one parameter" in run.output) == tied

    resumed = run_train(
        [*SHORT, "--checkpoint.enable", "--checkpoint.initial_load_path",
         str(dmuon.dump / "checkpoint" / "step-3"), "--checkpoint.no-initial_load_model_only"],
        2, tmp_path / "resumed", CONFIGS[family],
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.output[-4000:]
    assert sorted(resumed.losses) == [4, 5, 6]
    assert [resumed.losses[s] for s in (4, 5, 6)] == [dmuon.losses[s] for s in (4, 5, 6)]
    _check_tied(dmuon.dump / "checkpoint" / "step-6", tied)


HSDP = ["--parallelism.data_parallel_replicate_degree", "2"]
TP = ["--parallelism.tensor_parallel_degree", "2"]


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_hsdp_and_tensor_parallel_train_each_family_with_dmuon_and_adamw(family, tmp_path):
    """4 ranks, the debug size: HSDP 2 x 2 and FSDP 2 x TP 2 (DMuon: the engine's
    tensor-parallel Newton-Schulz; Qwen2.5's q/k/v biases split with their rows) each
    train 6 steps with DMuon and with AdamW, losses finite and falling; under TP a tied
    head is the embedding's parameter again after the TP plan (which distributes the two
    modules one at a time, each its own parameter), logged, and saved equal to it after 6
    steps."""
    runs = {}
    for layout, args in (("hsdp", HSDP), ("tp", TP)):
        for optimizer in ("DMuon", "AdamW"):
            extra = ["--checkpoint.enable", "--checkpoint.interval", "6"]
            if (layout, optimizer) != ("tp", "DMuon"):
                extra = []
            runs[layout, optimizer] = run_train(
                [*SHORT, *args, "--optimizer.name", optimizer, *extra],
                4, tmp_path / f"{layout}_{optimizer}", CONFIGS[family],
            )  # fmt: skip
    for (layout, optimizer), run in runs.items():
        assert run.returncode == 0, f"{layout} {optimizer}:\n{run.output[-4000:]}"
        assert sorted(run.losses) == list(STEPS)
        assert all(math.isfinite(v) for v in run.losses.values()), run.losses
        assert run.losses[6] < run.losses[1] - 0.05, (layout, optimizer, run.losses)
        assert ("dmuon:" in run.output) == (optimizer == "DMuon")
    assert "Applied HSDP to the model" in runs["hsdp", "DMuon"].output
    assert "Applied Tensor Parallelism to the model" in runs["tp", "DMuon"].output
    tied = family != "mistral"
    for run in runs.values():
        assert ("tied embeddings: lm_head and embed_tokens are one parameter" in run.output) == tied
    _check_tied(runs["tp", "DMuon"].dump / "checkpoint" / "step-6", tied)


@pytest.mark.slow
def test_pipeline_stages_train_a_tied_family_untied_and_say_so(tmp_path):
    """Qwen2.5 debug as 2 pipeline stages (1F1B) x FSDP 2, DMuon: each stage dedicates its
    own layer's 7 matrices and the run trains, losses finite and falling; embed_tokens
    (first stage) and lm_head (last) cannot be one parameter, which every rank warns
    about, and the start is an untied model's (step 1 near ln 2048, as Mistral's, not
    the 14.6 of the tied FSDP run)."""
    run = run_train(
        [*SHORT, "--parallelism.pipeline_parallel_degree", "2",
         "--parallelism.pipeline_parallel_schedule", "1F1B",
         "--parallelism.data_parallel_shard_degree", "2"],
        4, tmp_path / "pp", CONFIGS["qwen2.5"], log_rank=2,
    )  # fmt: skip
    assert run.returncode == 0, run.output[-4000:]
    assert sorted(run.losses) == list(STEPS)
    assert all(math.isfinite(v) for v in run.losses.values()), run.losses
    assert run.losses[6] < run.losses[1] - 0.5, run.losses
    assert abs(run.losses[1] - math.log(2048)) < 1.0
    assert "tied embeddings under pipeline parallelism" in run.output
    assert "dedicate_params: 7 parameters (7 matrices)" in run.output


SEQ = 32


def _hf_model(flavor: str):
    """The flavor's model, initialized as TorchTitan does (meta, to_empty, init_weights)
    from seed 0."""
    from torchtitan_dmuon.titan import hf

    model_args = hf.family_flavors()[flavor]
    job = types.SimpleNamespace(
        hf_transformers=types.SimpleNamespace(model=""),
        training=types.SimpleNamespace(seq_len=SEQ),
        debug=types.SimpleNamespace(deterministic=False),
    )
    model_args.update_from_config(job)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = hf.model_class()(model_args)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    return model


def _batch(step: int, size: int):
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, 2048, (size, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _loss(model, inputs, targets):
    logits = model(inputs)
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets.flatten()
    )


def _predicate(name, param) -> bool:
    from torchtitan_dmuon.titan.config import MODEL_SELECTIONS
    from torchtitan_dmuon.titan.parallelize import _matches

    return _matches(name, list(MODEL_SELECTIONS[HF].params))


def _train_hf_dmuon(rank: int, world: int, flavor: str, steps: int) -> dict:
    """DMuon (fp32 Newton-Schulz) on the HF model: the selected matrices dedicated, the
    blocks and the root (embedding, tied head, norm) under FSDP2, as the backend's
    apply_fsdp with tied embeddings; each rank 2 sequences of the global batch."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from torchtitan_dmuon import Muon, dedicate_params

    model = _hf_model(flavor)
    mesh = init_device_mesh("cpu", (world,))
    dedication = dedicate_params(model, mesh, _predicate)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = Muon(model, **MUON_KW, **as_muon_adamw_kwargs(ADAMW_KW), ns_dtype=torch.float32)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        inputs, targets = _batch(step, 2 * world)
        part = slice(2 * rank, 2 * rank + 2)
        loss = _loss(model, inputs[part], targets[part])
        loss.backward()
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    names = {d.name for u in dedication.units for d in u.params}
    params = full_params(model, names)
    dedication.wait_replicas()
    return {"losses": losses, "params": params, "dedicated": sorted(names)}


@pytest.mark.slow
def test_dmuon_on_four_ranks_equals_one_process_muon_and_adamw_on_qwen():
    """Qwen2.5 debug (q/k/v biases and tied embeddings: the head trains through both its
    uses) at 4 ranks, 3 steps: DMuon's losses and every parameter equal torch.optim.Muon on
    the 14 selected matrices + AdamW on the rest in one process on the 4 ranks' batch
    (fp32 Newton-Schulz; rtol 1e-4)."""
    steps = 3
    by_rank = run_distributed(_train_hf_dmuon, 4, "qwen2.5-debug", steps)
    result = by_rank[0]
    assert len(result["dedicated"]) == 14
    with reference_setup(torch.float32):
        model = _hf_model("qwen2.5-debug")
        # AdamW's first step is lr * g / (|g| + eps): about lr * sign(g) for any gradient
        # above eps, one of the size of rounding included, so where the first gradient is
        # that small the ranks and the one process agree to within one lr step, elsewhere
        # to 1e-4. Such entries: those of an AdamW parameter below 1e-5 of its largest
        # (fp32 sums over the batch; 15% of the tied embedding, rare tokens: on an Intel
        # Xeon with AMX one entry at 7e-7 of the largest ended 2.2e-5 apart).
        _loss(model, *_batch(0, 8)).backward()
        noisy = {
            name: p.grad.abs() < 1e-5 * p.grad.abs().max()
            for name, p in model.named_parameters()
            if not _predicate(name, p)
        }
        model.zero_grad(set_to_none=True)

        def step_loss(model_, step):
            return _loss(model_, *_batch(step, 8))

        expected = train_one_process(
            model, steps, step_loss, _predicate, MUON_KW, REFERENCE_ADAMW_KW
        )
    assert result["losses"] == pytest.approx(expected, rel=1e-4)
    assert expected[-1] < expected[0]
    reference = dict(model.named_parameters())
    assert sorted(result["params"]) == sorted(reference)
    # Under RoPE, a key bias's components of the slowest rotary frequencies are nearly the
    # same at every position, hence nearly shifts of a query's whole row of logits, which
    # softmax ignores: their gradients are about 1e-8, of the size of rounding, which
    # AdamW normalizes into steps of up to its lr. There too the ranks and the one process
    # agree to within one lr step (measured: 8.5e-5 on values of about 0.07).
    model.zero_grad()
    _loss(model, *_batch(0, 8)).backward()
    for i in range(2):
        bias = model.layers[str(i)].self_attn.k_proj.bias
        grad = bias.grad.abs()
        noisy[f"model.model.layers.{i}.self_attn.k_proj.bias"] = grad < 1e-3 * grad.max()
        assert grad.min() < 1e-4 * grad.max()
    for name, value in result["params"].items():
        expected = reference[name].detach()
        if name in noisy:
            mask = noisy[name]
            torch.testing.assert_close(value[~mask], expected[~mask], rtol=1e-4, atol=1e-5)
            atol = REFERENCE_ADAMW_KW["lr"]
            torch.testing.assert_close(value[mask], expected[mask], rtol=0, atol=atol)
        else:
            torch.testing.assert_close(value, expected, rtol=1e-4, atol=1e-5)
    # Every rank holds the same full values.
    for name, value in by_rank[3]["params"].items():
        assert torch.equal(value, result["params"][name]), name


# The real sizes' GPU configs (not trained here): config file: flavor.
GPU_CONFIGS = {
    "hf_qwen2.5_1.5b_fsdp.toml": "qwen2.5-1.5B",
    "hf_qwen2.5_7b_fsdp.toml": "qwen2.5-7B",
    "hf_mistral_7b_fsdp.toml": "mistral-7B-v0.3",
    "hf_llama3.2_3b_fsdp.toml": "llama3.2-3B",
}


def _reference_max_logits(model, inputs, visible):
    """Each layer's largest logit per query head, by hand: q_proj's and k_proj's outputs
    (captured in a no-grad forward with ``visible`` as the attention mask, None: causal)
    rotated by transformers' apply_rotary_pos_emb with the model's rotary_emb, the key
    heads repeated over their query groups, ``q k^T * scaling`` where ``visible``."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    outputs, handles = {}, []
    for i, layer in enumerate(model.layers):
        for projection in ("q_proj", "k_proj"):
            handles.append(
                layer.self_attn.get_submodule(projection).register_forward_hook(
                    lambda m, a, out, key=(i, projection): outputs.__setitem__(key, out)
                )
            )
    with torch.no_grad():
        model(inputs, **({} if visible is None else {"attention_mask": visible}))
    for handle in handles:
        handle.remove()
    batch, seq = inputs.shape
    if visible is None:
        visible = torch.ones(seq, seq, dtype=torch.bool).tril()
    cos, sin = model.rotary_emb(outputs[0, "q_proj"], torch.arange(seq)[None])
    maxima = []
    for i, layer in enumerate(model.layers):
        attention = layer.self_attn
        q, k = (
            outputs[i, p].view(batch, seq, -1, attention.head_dim).transpose(1, 2)
            for p in ("q_proj", "k_proj")
        )
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        k = k.repeat_interleave(attention.num_key_value_groups, dim=1)
        logits = (q @ k.transpose(-2, -1)) * attention.scaling
        maxima.append(logits.masked_fill(~visible, -math.inf).amax(dim=(0, 2, 3)))
    return torch.cat(maxima)


def _clip_hf(model, threshold, alpha=0.5):
    from torchtitan_dmuon.titan.config import DMuon
    from torchtitan_dmuon.titan.qk_clip import build_qk_clip

    settings = DMuon(qk_clip_threshold=threshold, qk_clip_alpha=alpha)
    return build_qk_clip(model, settings, types.SimpleNamespace(cp=1, tp=1))


@pytest.mark.parametrize("family", FAMILIES)
def test_qk_clip_watches_each_familys_attention_and_reads_its_logits(family):
    """On each debug family (4 query heads over 2 key heads, head_dim 64), build_qk_clip
    watches every layer's self_attn through an inner_attention, with q_proj's and
    k_proj's 64 rows per head (Qwen2.5's biases named); the forward with the watcher is
    bitwise the plain one, causal (as the backend runs it) and with a boolean 4-D mask (a
    window of 8 keys for one sequence); the recorded per-head maxima equal the logits
    computed by hand from q_proj's and k_proj's outputs (rtol 1e-5). Off, nothing changes."""
    from torchtitan_dmuon.optim.qk_clip import ClippedAttention, HeadRows

    model = _hf_model(f"{family}-debug")
    assert _clip_hf(model, 0.0) is None
    inputs, _ = _batch(0, 2)
    positions = torch.arange(SEQ)
    window = positions[None, :] > positions[:, None] - 4
    visible = torch.stack([torch.ones(SEQ, SEQ, dtype=torch.bool), window])
    visible = (visible & torch.ones(SEQ, SEQ, dtype=torch.bool).tril())[:, None]
    plain = [model(inputs), model(inputs, attention_mask=visible)]

    clip = _clip_hf(model, 100.0)
    expected = []
    for i in range(2):
        name = f"model.model.layers.{i}.self_attn"
        expected.append(
            ClippedAttention(
                f"{name}.inner_attention",
                4,
                tuple(
                    HeadRows(
                        f"{name}.{p}.weight",
                        64,
                        ((0, 64, role),),
                        f"{name}.{p}.bias" if family == "qwen2.5" else None,
                    )
                    for p, role in (("q_proj", "query"), ("k_proj", "key"))
                ),
            )
        )
    assert clip.attentions == expected
    recorded = []
    for mask, before in zip((None, visible), plain, strict=True):
        after = model(inputs, **({} if mask is None else {"attention_mask": mask}))
        assert torch.equal(after, before)
        recorded.append(clip.maxima(torch.device("cpu")))
        clip.reset()
        reference = _reference_max_logits(model, inputs, mask)
        torch.testing.assert_close(recorded[-1], reference, rtol=1e-5, atol=0)
    # The window changes the maxima (so the mask was read).
    assert not torch.equal(recorded[1], recorded[0])


def test_qk_clip_step_scales_qwens_heads_and_bounds_the_next_logits():
    """Qwen2.5 debug with q/k biases of std 1 (the largest logit 3.8), QK-clip at threshold
    2 and alpha 0.3, one process, every learning rate 0 and the same batch: only the clip
    changes the model. After one step each query head's q_proj rows and bias entries are
    scaled by gamma ** 0.3 and each key head's k_proj rows and bias entries by its group's
    smallest gamma ** 0.7, gamma = min(1, threshold / the hand-computed maximum) (rtol
    1e-6); every other parameter, and the rows of unclipped heads, are unchanged bitwise.
    At the next forward, in layer 0 (whose input no clip changes) the key group that had a
    logit above the threshold has its largest logit at the threshold, the other stays;
    layer 1's inputs moved with layer 0's output, and the model's largest logit is within
    1% of the threshold (measured: 2.0084)."""
    from torchtitan_dmuon import Muon

    threshold, alpha, group = 2.0, 0.3, 2
    model = _hf_model("qwen2.5-debug")
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in model.layers:
            for projection in ("q_proj", "k_proj"):
                bias = layer.self_attn.get_submodule(projection).bias
                bias.copy_(torch.randn(bias.shape, generator=g))
    inputs, targets = _batch(0, 2)
    maxima = _reference_max_logits(model, inputs, None)
    clip = _clip_hf(model, threshold, alpha)
    opt = Muon(
        model,
        predicate=_predicate,
        ns_dtype=torch.float32,
        qk_clip=clip,
        **dict(MUON_KW, lr=0.0),
        **as_muon_adamw_kwargs(dict(ADAMW_KW, lr=0.0)),
    )
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    _loss(model, inputs, targets).backward()
    opt.step()

    gamma = torch.where(maxima > threshold, threshold / maxima, torch.ones_like(maxima))
    assert (gamma[:4] < 1).any() and (gamma[:4] == 1).any()  # layer 0: some heads clipped
    factors = {}
    for i, layer_gamma in enumerate(gamma.view(2, 4)):
        name = f"model.model.layers.{i}.self_attn"
        key_gamma = layer_gamma.view(-1, group).amin(dim=1)
        for projection, per_head in (
            ("q_proj", layer_gamma**alpha),
            ("k_proj", key_gamma ** (1 - alpha)),
        ):
            rows = per_head.repeat_interleave(64)
            factors[f"{name}.{projection}.weight"] = rows[:, None]
            factors[f"{name}.{projection}.bias"] = rows
    for name, p in model.named_parameters():
        if name in factors:
            factor = factors[name].expand_as(p)
            torch.testing.assert_close(p.detach(), before[name] * factor, rtol=1e-6, atol=0)
            assert torch.equal(p.detach()[factor == 1], before[name][factor == 1]), name
        else:
            assert torch.equal(p.detach(), before[name]), name

    opt.zero_grad()
    _loss(model, inputs, targets).backward()
    after = clip.maxima(torch.device("cpu"))
    old, new = maxima[:4].view(-1, group), after[:4].view(-1, group)
    over = (old > threshold).any(dim=1)
    assert over.any() and not over.all()
    torch.testing.assert_close(new[over].amax(dim=1), torch.full((int(over.sum()),), threshold))
    torch.testing.assert_close(new[~over], old[~over], rtol=1e-6, atol=0)
    assert maxima.max() > 1.5 * threshold and after.max() <= 1.01 * threshold


def test_qk_clip_refuses_hf_attention_it_cannot_read_and_leaves_the_model_alone():
    """An HF attention on another attn_implementation than the backend's sdpa (eager here)
    and key heads that do not split over TP are refused by name before any step, and the
    refused model is left as it was (no inner_attention, its attn_implementation kept)."""
    from torchtitan_dmuon.titan.config import DMuon
    from torchtitan_dmuon.titan.qk_clip import build_qk_clip

    on = DMuon(qk_clip_threshold=100.0)
    _, model = _meta_model("mistral-debug")
    with pytest.raises(ValueError, match=r"4 query and 2 key heads over TP 4"):
        build_qk_clip(model, on, types.SimpleNamespace(cp=1, tp=4))
    assert model.model.config._attn_implementation == "sdpa_torchtitan"
    model.model.config._attn_implementation = "eager"
    with pytest.raises(
        ValueError, match=r"model\.model\.layers\.0\.self_attn runs attn_implementation 'eager'"
    ):
        build_qk_clip(model, on, types.SimpleNamespace(cp=1, tp=1))
    assert not any(name.endswith("inner_attention") for name, _ in model.named_modules())


@pytest.mark.slow
def test_qk_clip_trains_qwen_through_the_trainer(tmp_path, tmp_path_factory):
    """Qwen2.5 debug at 2 ranks (FSDP Z3) with QK-clip at 0.3 trains 6 steps through the
    trainer: step 1 clips all 8 heads (largest logit 0.49) and the logged maximum falls at
    step 2 (to 0.39); step 1's loss is bitwise the plain run's (the clip follows the
    update) and step 2's differs. Compiled per block it logged the same maxima (measured,
    not run here: 39 s)."""
    plain = shared_run(_plain("qwen2.5"), 2, tmp_path_factory, CONFIGS["qwen2.5"])
    clipped = run_train(
        [*SHORT, "--dmuon.qk_clip_threshold", "0.3"], 2, tmp_path / "qk", CONFIGS["qwen2.5"]
    )
    assert clipped.returncode == 0, clipped.output[-4000:]
    assert sorted(clipped.losses) == list(STEPS)
    assert all(math.isfinite(v) for v in clipped.losses.values()), clipped.losses
    assert clipped.losses[1] == plain.losses[1] and clipped.losses[2] != plain.losses[2]
    metrics = _qk_metrics(clipped.output)
    assert len(metrics) == 6 and metrics[0][1] == 8 and metrics[0][0] > 0.3, metrics
    assert metrics[1][0] < metrics[0][0], metrics


def test_hf_train_configs_name_their_flavors():
    """The HF TOMLs (debug and GPU) parse with [dmuon] and [hf_transformers] from one
    custom_config_module and name a flavor whose config folder holds their family's
    architecture."""
    from torchtitan.config import ConfigManager

    from torchtitan_dmuon.titan import hf

    architectures = {
        "qwen2.5": "Qwen2ForCausalLM",
        "mistral": "MistralForCausalLM",
        "llama3.2": "LlamaForCausalLM",
    }
    files = {path: f"{family}-debug" for family, path in CONFIGS.items()}
    files.update({f"train_configs/{name}": flavor for name, flavor in GPU_CONFIGS.items()})
    assert sorted(files) == sorted(
        str(p.relative_to(ROOT)) for p in (ROOT / "train_configs").glob("hf_*.toml")
    )
    for path, flavor in files.items():
        cfg = ConfigManager().parse_args(["--job.config_file", str(ROOT / path)])
        assert cfg.model.name == HF and cfg.model.flavor == flavor
        assert cfg.optimizer.name == "DMuon" and cfg.hf_transformers.model == ""
        family = flavor.rsplit("-", 1)[0].removesuffix("-7B")
        config = (hf.CONFIGS / flavor / "config.json").read_text()
        assert architectures[family] in config, (path, family)
