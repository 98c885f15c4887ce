"""TorchTitan's vlm experiment (Llama 3 decoder + SigLIP2 encoder + projector) with DMuon
(``torchtitan_dmuon/titan/vlm.py``), on the generated image-caption-action shard of
``titan/vlm_assets.py``: the default selection per mode (trainable tower, frozen tower,
VLA) on the meta device; FSDP (2 ranks) and HSDP (2 x 2) training with DMuon and AdamW
through the test launcher; DMuon against one process of torch.optim.Muon + AdamW on the
same model and batches; the frozen tower's absence from the engine (bytes, boundaries,
optimizer groups, gradients)."""

from __future__ import annotations

import math
import types

import pytest
import torch

pytest.importorskip("einops", reason="TorchTitan's vlm experiment needs einops")
pytest.importorskip("PIL", reason="TorchTitan's vlm experiment needs Pillow")

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
from tests.titan.test_titan_integration import ROOT, SHORT, run_train  # noqa: E402

CONFIG = "train_configs/vlm_debug.toml"
STEPS = range(1, 7)
DECODER = [
    f"layers.{i}.{name}.weight"
    for i in range(6)
    for name in ("attention.wq", "attention.wk", "attention.wv", "attention.wo",
                 "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")
]  # fmt: skip
ENCODER = [
    f"encoder.layers.{i}.{name}.weight"
    for i in range(4)
    for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                 "self_attn.out_proj", "mlp.fc1", "mlp.fc2")
]  # fmt: skip
MODES = {
    "trainable": ["--vlm.vision_tower", "trainable"],
    "frozen": ["--vlm.vision_tower", "frozen"],
    "vla": ["--vlm.vision_tower", "trainable", "--vlm.action_dim", "3"],
}


@pytest.fixture(scope="module")
def vlm_assets(tmp_path_factory):
    """The generated shard (128 samples) and the tokenizer with the image tokens."""
    from torchtitan_dmuon.titan.vlm_assets import build

    out = tmp_path_factory.mktemp("vlm_assets")
    build(out, ROOT / "assets", samples=128)
    return out


def _job_config(mode: str, assets=None):
    from torchtitan.config import ConfigManager

    from torchtitan_dmuon.titan import register

    register()
    args = ["--job.config_file", str(ROOT / CONFIG), *MODES[mode]]
    if assets is not None:
        args += ["--model.hf_assets_path", str(assets / "tokenizer"),
                 "--training.dataset_path", str(assets / "data")]  # fmt: skip
    return ConfigManager().parse_args(args)


def _model(mode: str, device: str = "meta"):
    """The debug flavor in ``mode``, on meta, or initialized as TorchTitan does (meta,
    to_empty, init_weights) from seed 0 on the CPU."""
    import copy

    from torchtitan.protocols.train_spec import get_train_spec

    cfg = _job_config(mode)
    spec = get_train_spec("vlm")
    model_args = copy.deepcopy(spec.model_args["debug"])
    model_args.update_from_config(cfg)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = spec.model_cls(model_args)
    if device != "meta":
        model.to_empty(device=device)
        with torch.no_grad():
            model.init_weights(buffer_device=torch.device(device))
    return cfg, model


def _selected(mode: str) -> list[str]:
    from torchtitan_dmuon.engine.plan import select_matrices
    from torchtitan_dmuon.titan.parallelize import muon_predicate, resolve_selection

    cfg, model = _model(mode)
    return [n for n, _ in select_matrices(model, muon_predicate(resolve_selection(model, cfg)))]


def test_each_mode_selects_its_matrices():
    """Trainable tower (and the VLA): the decoder's 42 attention / feed-forward matrices
    and the encoder's 24 q/k/v/out_proj and fc1/fc2 weights, in model order; frozen
    tower: the decoder's 42 alone, every encoder parameter frozen. Biases, norms, the
    patch and position embeddings, the projector, tok_embeddings, output and the action
    head are never selected."""
    assert _selected("trainable") == DECODER + ENCODER
    assert _selected("vla") == DECODER + ENCODER
    assert _selected("frozen") == DECODER
    _, model = _model("frozen")
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    assert frozen == [n for n, _ in model.named_parameters() if n.startswith("encoder.")]
    _, vla = _model("vla")
    head = [n for n, _ in vla.named_parameters() if n.startswith("action_head.")]
    assert head == ["action_head.w1.weight", "action_head.w1.bias",
                    "action_head.w2.weight", "action_head.w2.bias"]  # fmt: skip


def test_qk_clip_clips_the_decoder_and_refuses_a_trained_tower():
    """QK-clip reads the decoder's (TorchTitan's llama3) attentions; a frozen tower's
    attentions need no clip, a trainable tower's (SigLIP2: q/k/v_proj) are refused by name
    before the first step rather than left unclipped."""
    from types import SimpleNamespace

    from torchtitan_dmuon.titan.config import DMuon
    from torchtitan_dmuon.titan.qk_clip import build_qk_clip

    on, layout = DMuon(qk_clip_threshold=100.0), SimpleNamespace(cp=1, tp=1)
    clip = build_qk_clip(_model("frozen")[1], on, layout)
    assert [a.module for a in clip.attentions] == [
        f"layers.{i}.attention.inner_attention" for i in range(6)
    ]
    with pytest.raises(ValueError, match=r"not encoder\.\S+ \(Attention\) and 3 more"):
        build_qk_clip(_model("trainable")[1], on, layout)


@pytest.mark.parametrize("document", [False, True], ids=["causal", "block_causal"])
def test_sdpa_path_equals_flex_attention(document):
    """The SDPA path's attention (masks built eagerly, as dense booleans) equals torch's
    FlexAttention (eager forward, which runs on CPU) with the same block mask: the
    encoder's causal mask (one mask for the batch) and the decoder's causal mask within
    documents (three documents in the second row, split by the end-of-text id)."""
    from torch.nn.attention.flex_attention import flex_attention
    from torchtitan.models.attention import get_causal_mask_mod, get_document_mask_mod

    from torchtitan_dmuon.titan.vlm import MaskedSDPA, _eager_mask

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(2, 50, (2, 64), generator=g)
    tokens[0, 20], tokens[1, 40], tokens[1, 50] = 1, 1, 1
    mods = [get_causal_mask_mod()]
    if document:
        mods.append(get_document_mask_mod(tokens, 1))
    block_mask = _eager_mask(mods, 2 if document else 1, 64, "cpu")
    q, k, v = (torch.randn(2, 4, 64, 16, generator=g) for _ in range(3))
    expected = flex_attention(q, k, v, block_mask=block_mask)
    torch.testing.assert_close(MaskedSDPA()(q, k, v, block_mask=block_mask), expected)
    if document:  # the masks differ: a query after an end of text sees only its document
        plain = _eager_mask(mods[:1], 1, 64, "cpu")
        assert not torch.allclose(MaskedSDPA()(q, k, v, block_mask=plain), expected)


def test_missing_assets_are_named_by_their_flag(tmp_path, vlm_assets):
    """A missing tokenizer, one without the image tokens and a missing shard each raise
    before training, naming the flag and how to generate the assets."""
    from torchtitan_dmuon.titan import vlm

    cfg = _job_config("trainable")
    cfg.model.hf_assets_path = str(tmp_path)
    with pytest.raises(FileNotFoundError, match="--model.hf_assets_path .*vlm_assets"):
        vlm.build_vlm_tokenizer(cfg)
    cfg.model.hf_assets_path = str(ROOT / "assets" / "tokenizer")  # the project's: no images
    with pytest.raises(ValueError, match=r"lacks \['<\|image\|>'"):
        vlm.build_vlm_tokenizer(cfg)
    cfg.model.hf_assets_path = str(vlm_assets / "tokenizer")
    tokenizer = vlm.build_vlm_tokenizer(cfg)
    cfg.training.dataset_path = str(tmp_path)
    with pytest.raises(FileNotFoundError, match="--training.dataset_path .*vlm_assets"):
        vlm.build_vlm_dataloader(1, 0, tokenizer, cfg)


def _data_args(assets) -> list[str]:
    return ["--model.hf_assets_path", str(assets / "tokenizer"),
            "--training.dataset_path", str(assets / "data")]  # fmt: skip


HSDP = ["--parallelism.data_parallel_replicate_degree", "2"]


@pytest.mark.slow
@pytest.mark.parametrize(("layout", "ngpu"), [("fsdp", 2), ("hsdp", 4)])
def test_modes_train_with_dmuon_and_adamw(layout, ngpu, vlm_assets, tmp_path):
    """FSDP2 at 2 ranks and HSDP 2 x 2, every mode (the VLA from vla_debug.toml): DMuon
    and AdamW each train 6 steps, losses finite and falling;
    DMuon dedicates 66 matrices with the trainable tower and 42 with the frozen one (whose
    frozen encoder matches are left out), and its per-step reduce is exactly those
    matrices' fp32 bytes (21.5 MiB, 19.5 MiB: the frozen tower moves nothing), under HSDP
    plus the owned half across the replicas."""
    modes = ("trainable", "frozen", "vla")
    runs = {}
    for mode in modes:
        for optimizer in ("DMuon", "AdamW"):
            args = [*SHORT, *_data_args(vlm_assets), *MODES[mode], "--optimizer.name", optimizer]
            if layout == "hsdp":
                args += HSDP
            config = "train_configs/vla_debug.toml" if mode == "vla" else CONFIG
            runs[mode, optimizer] = run_train(args, ngpu, tmp_path / f"{mode}_{optimizer}", config)
    for (mode, optimizer), run in runs.items():
        assert run.returncode == 0, f"{mode} {optimizer}:\n{run.output[-4000:]}"
        assert sorted(run.losses) == list(STEPS), (mode, optimizer, run.output[-3000:])
        assert all(math.isfinite(v) for v in run.losses.values()), run.losses
        assert run.losses[6] < run.losses[1] - 0.3, (mode, optimizer, run.losses)
        assert ("dmuon:" in run.output) == (optimizer == "DMuon")
    decoder_mib = 6 * (4 * 256 * 256 + 3 * 256 * 768) * 4 / 2**20
    encoder_mib = 4 * (4 * 128 * 128 + 2 * 128 * 256) * 4 / 2**20
    for mode in modes:
        out = runs[mode, "DMuon"].output
        count = 42 if mode == "frozen" else 66
        assert f"dedicate_params: {count} parameters ({count} matrices)" in out
        reduce_mib = decoder_mib + (0 if mode == "frozen" else encoder_mib)
        if layout == "hsdp":  # and the half it owns across the 2 replicas
            reduce_mib *= 1.5
        assert f"reduce {reduce_mib:.2f} MB/step" in out, (mode, out[-3000:])
    if layout == "hsdp":
        assert "Applied HSDP to the model" in runs[modes[0], "DMuon"].output


# The equality tests: DMuon in gloo ranks against one process, on batches of the shard.
ROWS = 2  # per rank


def _batches(assets, world: int, steps: int, action_dim: int) -> list:
    """``steps`` global batches (``ROWS`` per rank) made by TorchTitan's dataset and
    collator from the shard, as the trainer's loader with the project's collate."""
    from torchtitan.components.tokenizer import HuggingFaceTokenizer
    from torchtitan.experiments.vlm.datasets.mm_collator_nld import MultiModalCollatorNLD
    from torchtitan.experiments.vlm.datasets.mm_datasets import HuggingFaceMultiModalDataset
    from torchtitan.experiments.vlm.model.args import SpecialTokens

    from torchtitan_dmuon.titan import vlm

    vlm._register_dataset()
    tokenizer = HuggingFaceTokenizer(str(assets / "tokenizer"))
    special = SpecialTokens.from_tokenizer(tokenizer)
    size = ROWS * world
    dataset = HuggingFaceMultiModalDataset(
        vlm.DATASET, str(assets / "data"), tokenizer, batch_size=size, seq_len=64,
        patch_size=16, spatial_merge_size=1, max_patches_per_image=16,
        max_images_per_batch=size, packing_buffer_size=0, special_tokens=special,
    )  # fmt: skip
    collate = vlm._WithActions(MultiModalCollatorNLD(size, 64, 16, size, 16, special), action_dim)
    samples, batches = iter(dataset), []
    for _ in range(steps):
        batches.append(collate([next(samples) for _ in range(size)]))
    return batches


def _rows(batch, lo: int, hi: int):
    """Rows ``lo:hi`` of a global batch (one image per sample: image rows = text rows)."""
    input_dict, labels = batch
    part = {k: (v[lo:hi] if torch.is_tensor(v) else v) for k, v in input_dict.items()}
    return part, labels[lo:hi]


def _loss_sum(model, loss_fn, input_dict, labels):
    extra = {k: v for k, v in input_dict.items() if k != "input"}
    masks = model.get_attention_masks(input_dict["input"], types.SimpleNamespace(eos_id=1), extra)
    pred = model(input_dict["input"], **extra, attention_masks=masks)
    return loss_fn(pred, labels)


def _predicate(mode: str):
    from torchtitan_dmuon.titan.parallelize import _matches

    patterns = DECODER + ([] if mode == "frozen" else ENCODER)
    return lambda name, param: _matches(name, patterns)


def _train_vlm_dmuon(rank: int, world: int, mode: str, batches: list, replicate: int = 1) -> dict:
    """DMuon (fp32 Newton-Schulz) on the debug VLM: the selected matrices dedicated, the
    rest under FSDP2 as the vlm experiment's apply_fsdp shards it (tok_embeddings, each
    encoder and decoder layer, [norm, output], the root), HSDP with ``replicate`` > 1;
    each rank ``ROWS`` rows of each global batch, its loss sum over the global count of
    label tokens."""
    import gc

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from torchtitan_dmuon import Muon, dedicate_params
    from torchtitan_dmuon.titan import vlm

    cfg, model = _model(mode, "cpu")
    loss_fn = vlm.build_vlm_loss(cfg)
    if replicate > 1:
        mesh = init_device_mesh(
            "cpu", (replicate, world // replicate), mesh_dim_names=("replicate", "shard")
        )
        dedication = dedicate_params(
            model, mesh["shard"], _predicate(mode), replicate_mesh=mesh["replicate"]
        )
    else:
        mesh = init_device_mesh("cpu", (world,))
        dedication = dedicate_params(model, mesh, _predicate(mode))
    fully_shard(model.tok_embeddings, mesh=mesh)
    for layer in [*model.encoder.layers.values(), *model.layers.values()]:
        fully_shard(layer, mesh=mesh)
    fully_shard([model.norm, model.output], mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = Muon(model, **MUON_KW, **as_muon_adamw_kwargs(ADAMW_KW), ns_dtype=torch.float32)
    losses = []
    for batch in batches:
        opt.zero_grad()
        tokens = (batch[1] != -100).sum()
        input_dict, labels = _rows(batch, ROWS * rank, ROWS * rank + ROWS)
        # Gradients are averaged over the ranks (FSDP2's and the engine's default): each
        # rank's share of the global mean, times the ranks.
        loss = _loss_sum(model, loss_fn, input_dict, labels) / tokens
        (loss * world).backward()
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)  # gloo has no AVG: the shares' SUM is the global mean
        losses.append(total.item())
    names = {d.name for u in dedication.units for d in u.params}
    params = full_params(model, names)
    dedication.wait_replicas()
    in_groups = {id(p) for g in opt.param_groups for p in g["params"]}
    result = {
        "losses": losses,
        "params": params,
        "dedicated": sorted(names),
        "bytes": dict(dedication.stats.bytes),
        "boundaries": [b.name for b in dedication.plan.boundaries],
        "encoder_in_optimizer": [
            n
            for n, p in model.named_parameters()
            if n.startswith("encoder.") and id(p) in in_groups
        ],
        "encoder_grads": [
            n
            for n, p in model.named_parameters()
            if n.startswith("encoder.") and p.grad is not None
        ],
    }
    del opt, model, dedication
    gc.collect()
    dist.barrier()
    return result


def _reference(mode: str, batches: list) -> tuple[list[float], dict]:
    """torch.optim.Muon on the selected matrices (trainable ones) + AdamW on the rest, one
    process, on the whole global batches."""
    from torchtitan_dmuon.titan import vlm

    with reference_setup(torch.float32):
        cfg, model = _model(mode, "cpu")
        loss_fn = vlm.build_vlm_loss(cfg)
        predicate = _predicate(mode)

        def step_loss(model_, step):
            input_dict, labels = batches[step]
            return _loss_sum(model_, loss_fn, input_dict, labels) / (labels != -100).sum()

        def trainable(name, param):
            return param.requires_grad and predicate(name, param)

        losses = train_one_process(
            model, len(batches), step_loss, trainable, MUON_KW, REFERENCE_ADAMW_KW
        )
    return losses, {n: p.detach() for n, p in model.named_parameters()}


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["trainable", "frozen", "vla"])
def test_dmuon_at_two_ranks_equals_one_process_muon_and_adamw(mode, vlm_assets):
    """2 ranks, 3 steps on batches of the shard: DMuon's losses and every parameter equal
    torch.optim.Muon + AdamW in one process (fp32 Newton-Schulz; rtol 1e-4). The frozen
    tower is not in the engine: no boundary of its layers, 0 bytes for its matrices (the
    reduces are exactly the decoder matrices' gradients and flags), no optimizer
    group holds an encoder parameter, none has a gradient, and its values are still their
    initial ones; with the tower trainable the engine's bytes add exactly its matrices'."""
    steps = 3
    action_dim = 3 if mode == "vla" else 0
    batches = _batches(vlm_assets, 2, steps, action_dim)
    by_rank = run_distributed(_train_vlm_dmuon, 2, mode, batches)
    result = by_rank[0]
    expected_losses, reference = _reference(mode, batches)
    assert result["losses"] == pytest.approx(expected_losses, rel=1e-4)
    assert expected_losses[-1] < expected_losses[0]
    assert sorted(result["params"]) == sorted(reference)
    for name, value in result["params"].items():
        torch.testing.assert_close(value, reference[name], rtol=1e-4, atol=1e-5, msg=name)
    for name, value in by_rank[1]["params"].items():
        assert torch.equal(value, result["params"][name]), name

    _, initial = _model(mode, "cpu")
    sizes = {n: p.numel() * 4 for n, p in initial.named_parameters()}
    selected = DECODER + ([] if mode == "frozen" else ENCODER)
    assert result["dedicated"] == sorted(selected)
    # A reduce carries each matrix's fp32 gradient and its has-gradient flag (4 bytes).
    # Z3 broadcasts a value before forward and again before backward, but not where the
    # backward follows the boundary's own forward at once: between one and two of them.
    selected_bytes = sum(sizes[n] for n in selected)
    assert result["bytes"]["reduce"] == steps * (selected_bytes + 4 * len(selected))
    assert steps * selected_bytes < result["bytes"]["broadcast"] <= 2 * steps * selected_bytes
    encoder_boundaries = [b for b in result["boundaries"] if b.startswith("encoder.")]
    if mode == "frozen":
        assert encoder_boundaries == []
        assert result["encoder_in_optimizer"] == []
        assert result["encoder_grads"] == []
        for name, value in initial.named_parameters():
            if name.startswith("encoder."):
                assert torch.equal(result["params"][name], value.detach()), name
    else:
        assert encoder_boundaries == [f"encoder.layers.{i}" for i in range(4)]
        adamw = [n for n in sizes if n.startswith("encoder.") and n not in ENCODER]
        assert set(adamw) <= set(result["encoder_in_optimizer"])


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["trainable", "frozen", "vla"])
def test_hsdp_dmuon_at_four_ranks_equals_one_process_muon_and_adamw(mode, vlm_assets):
    """HSDP 2 x 2 (two-stage reduce: shard group, then replicas), every mode, 2 steps:
    DMuon's losses and every parameter equal torch.optim.Muon + AdamW in one process on
    the 4 ranks' rows (fp32 Newton-Schulz; rtol 1e-4), every rank holding the same
    values."""
    steps = 2
    batches = _batches(vlm_assets, 4, steps, 3 if mode == "vla" else 0)
    by_rank = run_distributed(_train_vlm_dmuon, 4, mode, batches, 2)
    expected_losses, reference = _reference(mode, batches)
    assert by_rank[0]["losses"] == pytest.approx(expected_losses, rel=1e-4)
    assert expected_losses[-1] < expected_losses[0]
    assert by_rank[0]["dedicated"] == sorted(DECODER + ([] if mode == "frozen" else ENCODER))
    for name, value in by_rank[0]["params"].items():
        torch.testing.assert_close(value, reference[name], rtol=1e-4, atol=1e-5, msg=name)
    for other in by_rank[1:]:
        for name, value in other["params"].items():
            assert torch.equal(value, by_rank[0]["params"][name]), name
