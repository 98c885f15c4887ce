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

from tests.dist import run_distributed  # noqa: E402
from tests.test_titan_integration import ROOT, SHORT, run_train, shared_run  # noqa: E402
from tests.workers import (  # noqa: E402
    ADAMW_KW,
    MUON_KW,
    REFERENCE_ADAMW_KW,
    as_muon_adamw_kwargs,
    full_params,
    reference_setup,
    train_one_process,
)

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
    # AdamW normalizes into steps of up to its lr. There the ranks and the one process
    # agree to within one lr step (measured: 8.5e-5 on values of about 0.07); elsewhere
    # to 1e-4, as every other parameter.
    model.zero_grad()
    _loss(model, *_batch(0, 8)).backward()
    noisy = {}
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
            torch.testing.assert_close(value, expected, rtol=1e-4, atol=1e-5, msg=name)
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


def test_qk_clip_refuses_the_backends_attention_by_name():
    """QK-clip watches TorchTitan's attention modules; on the HF backend's model (Qwen2.5's
    biased q/k included) it refuses by name before the first step instead of leaving the
    logits unclipped."""
    from types import SimpleNamespace

    from torchtitan_dmuon.titan.config import DMuon
    from torchtitan_dmuon.titan.qk_clip import build_qk_clip

    _, model = _meta_model("qwen2.5-debug")
    with pytest.raises(
        ValueError, match=r"not model\.model\.layers\.0\.self_attn \(Qwen2Attention\) and 1 more"
    ):
        build_qk_clip(model, DMuon(qk_clip_threshold=100.0), SimpleNamespace(cp=1, tp=1))
    assert build_qk_clip(model, DMuon(), SimpleNamespace(cp=1, tp=1)) is None  # off


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
