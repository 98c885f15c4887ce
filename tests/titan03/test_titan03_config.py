"""DMuon's configuration on TorchTitan 0.3: ``with_dmuon`` over any ``Trainer.Config``, the
``[dmuon]`` settings as ``--dmuon.*`` flags through 0.3's own parser, fused QKV marked in
0.3's layout, and what the adapter does not take refused by name before any collective."""

from __future__ import annotations

import fnmatch
import importlib
import types

import pytest
import torch
from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig
from torchtitan.config import ConfigManager, TrainingConfig
from torchtitan.models.common.attention import FusedQKVLinear
from torchtitan.models.common.linear import Linear
from torchtitan.models.llama3 import model_registry
from torchtitan.models.llama3.config_registry import llama3_debugmodel
from torchtitan.models.llama3.parallelize import parallelize_llama

from torchtitan_dmuon.optim.fused_rows import FusedRows, fused_rows_of
from torchtitan_dmuon.titan.config import DMuon
from torchtitan_dmuon.titan03.optimizer import DMuonOptimizersContainer
from torchtitan_dmuon.titan03.parallelize import (
    default_selection,
    mark_fused_qkv,
    with_dedication,
)
from torchtitan_dmuon.titan03.trainer import DMuonTrainer, with_dmuon


def _parse(*args: str):
    return ConfigManager().parse_args(["--module", "torchtitan_dmuon.titan03", *args])


def test_with_dmuon_keeps_the_config_and_takes_its_adamw():
    titan = llama3_debugmodel()
    config = with_dmuon(titan, ns_steps=4)
    assert type(config) is DMuonTrainer.Config
    assert config.dmuon == DMuon(ns_steps=4)
    adamw = config.optimizer
    assert isinstance(adamw, DMuonOptimizersContainer.Config)
    # default_adamw(lr=8e-4): betas (0.9, 0.95), eps 1e-8, weight decay 0.1.
    assert (adamw.lr, adamw.beta1, adamw.beta2, adamw.eps, adamw.weight_decay) == (
        8e-4, 0.9, 0.95, 1e-8, 0.1,
    )  # fmt: skip
    assert config.training.disable_cuda_graphs and not titan.training.disable_cuda_graphs
    for section in ("model_spec", "dataloader", "lr_scheduler", "parallelism", "checkpoint"):
        assert getattr(config, section) is getattr(titan, section), section
    assert with_dmuon(config, lr=0.01).dmuon == DMuon(ns_steps=4, lr=0.01)


def test_with_dmuon_refuses_optimizers_it_cannot_read_adamw_from():
    titan = llama3_debugmodel()
    titan.optimizer = OptimizersContainer.Config(
        param_groups=[
            ParamGroupConfig(pattern=r"norm", optimizer_name="Adam", optimizer_kwargs={"lr": 1}),
            ParamGroupConfig(pattern=r".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 2}),
        ]
    )
    with pytest.raises(ValueError, match="one catch-all AdamW group.*--optimizer.lr"):
        with_dmuon(titan)


def test_dmuon_flags_reach_the_config_through_torchtitans_parser():
    config = _parse(
        "--config", "llama3_debug_cpu",
        "--dmuon.ns_steps", "4", "--dmuon.lr", "0.01", "--dmuon.adjust_lr_fn", "match_rms_adamw",
        "--optimizer.lr", "1e-3", "--training.steps", "7",
    )  # fmt: skip
    assert type(config) is DMuonTrainer.Config
    assert (config.dmuon.ns_steps, config.dmuon.lr, config.dmuon.adjust_lr_fn) == (
        4, 0.01, "match_rms_adamw",
    )  # fmt: skip
    assert (config.optimizer.lr, config.training.steps) == (1e-3, 7)
    with pytest.raises(SystemExit):  # tyro: a bad choice, by the flag
        _parse("--config", "llama3_debug_cpu", "--dmuon.adjust_lr_fn", "bogus")


def test_any_torchtitan_config_function_comes_with_dmuon():
    config = _parse("--config", "llama3_debugmodel")
    assert type(config) is DMuonTrainer.Config and config.model_spec.name == "llama3"
    with pytest.raises(ValueError, match="Config function 'no_such_config' not found"):
        _parse("--config", "no_such_config")


def test_fused_qkv_is_marked_in_torchtitans_layout():
    """The marked layout's matrices are 0.3's own split (its state-dict hook's wq, wk, wv),
    here with grouped-query attention (4 query heads per key-value head)."""
    config = FusedQKVLinear.Config(
        head_dim=8,
        n_heads=8,
        n_kv_heads=2,
        wqkv=Linear.Config(in_features=32, out_features=(8 + 2 * 2) * 8),
    )
    model = torch.nn.ModuleDict({"attention": config.build()})
    torch.nn.init.normal_(model["attention"].wqkv.weight)
    assert mark_fused_qkv(model) == ["attention.wqkv.weight"]
    layout = fused_rows_of(model, "attention.wqkv.weight")
    assert layout == FusedRows(2, (4, 1, 1), 8)
    split = model.state_dict()  # 0.3's _split_qkv_on_save
    ours = layout.matrices(model["attention"].wqkv.weight.detach())
    for name, matrix in zip(("wq", "wk", "wv"), ours, strict=True):
        assert torch.equal(split[f"attention.{name}.weight"], matrix), name
    with torch.device("meta"):
        llama = model_registry("debugmodel").model.build()
    assert len(mark_fused_qkv(llama)) == 6


def _stub_dims(**enabled):
    flags = {f"{k}_enabled": False for k in ("tp", "pp", "ep")}
    return types.SimpleNamespace(**{**flags, **enabled})


@pytest.mark.parametrize(
    "dims, training, flag",
    [
        (_stub_dims(), TrainingConfig(disable_cuda_graphs=False), "training.disable_cuda_graphs"),
        (
            _stub_dims(tp_enabled=True),
            TrainingConfig(disable_cuda_graphs=True),
            "--parallelism.tensor_parallel_degree",
        ),
        (
            _stub_dims(pp_enabled=True),
            TrainingConfig(disable_cuda_graphs=True),
            "--parallelism.pipeline_parallel_degree",
        ),
    ],  # fmt: skip
)
def test_what_the_adapter_does_not_take_is_refused_before_parallelizing(dims, training, flag):
    """Before TorchTitan's parallelize function runs (no collective, no FSDP)."""
    parallelize = with_dedication(parallelize_llama, DMuon(), "llama3")
    with torch.device("meta"):
        model = model_registry("debugmodel").model.build()
    with pytest.raises(ValueError, match=flag):
        parallelize(model, parallel_dims=dims, training=training)
    assert fused_rows_of(model, "layers.0.attention.qkv_linear.wqkv.weight") is None


def test_the_trainer_refuses_what_it_does_not_take_before_distributed_starts():
    config = _parse("--config", "llama3_debug_cpu", "--dmuon.qk_clip_threshold", "100")
    with pytest.raises(ValueError, match="--dmuon.qk_clip_threshold"):
        DMuonTrainer(config)
    assert not torch.distributed.is_initialized()


def _meta_model(module: str, function: str) -> torch.nn.Module:
    registry = importlib.import_module(f"torchtitan.models.{module}.config_registry")
    with torch.device("meta"):
        return getattr(registry, function)().model_spec.model.build()


@pytest.mark.parametrize(
    ("module", "function"),
    [("qwen3", "qwen3_moe_debug"), ("deepseek_v3", "deepseek_v3_debugmodel_mtp")],
)
def test_moe_models_select_what_a_muon_user_would(module, function):
    """The default selection of 0.3's MoE models: every matrix of the blocks (and of
    deepseek_v3's multi-token-prediction layers) and the routed experts' stacks, not the
    router (AdamW's, as in 0.2.2's selections); the MoE and expert modules are hook
    boundaries."""
    model = _meta_model(module, function)
    selection = default_selection(model)
    names = [n for n, _ in model.named_parameters()]
    chosen = {n for n in names if any(fnmatch.fnmatchcase(n, p) for p in selection.params)}
    assert not [n for n in chosen if ".router." in n]
    stacks = {n for n, p in model.named_parameters() if p.ndim == 3}
    assert stacks and stacks <= chosen
    assert {n for n, p in model.named_parameters() if p.ndim == 1}.isdisjoint(chosen)
    assert "tok_embeddings.weight" not in chosen and "lm_head.weight" not in chosen
    assert selection.hook_boundaries[0] == "layers.*.moe"
    assert "layers.*.moe.routed_experts.inner_experts" in selection.hook_boundaries
    if function.endswith("_mtp"):
        assert "mtp_layers.0.eh_proj.weight" in chosen


def test_a_dense_model_selects_the_linear_weights_of_its_blocks():
    model = _meta_model("llama3", "llama3_debugmodel")
    selection = default_selection(model)
    assert selection.hook_boundaries == ()
    assert "layers.*.attention.qkv_linear.wqkv.weight" in selection.params
