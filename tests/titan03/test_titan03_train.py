"""DMuon through TorchTitan 0.3's own trainer (``torchtitan.train``, its config module, its
FSDP2 on the ``spmd_types`` storage mesh, fused QKV) on 2 gloo processes equals one process
of ``torch.optim.Muon`` (each fused projection's query, key and value matrices as
parameters of their own) + AdamW over the same batches: the trainer records each rank's
batches and the initial and final values (``tests/support/titan03_recording.py``), and the
reference replays them."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch
from torchtitan.components.loss import IGNORE_INDEX

from tests.support.titan03_recording import train_recorded
from tests.support.workers import reference_setup
from torchtitan_dmuon.optim.fused_rows import fused_rows_of
from torchtitan_dmuon.titan03.config_registry import llama3_debug_cpu
from torchtitan_dmuon.titan03.cpu import sdpa_attention
from torchtitan_dmuon.titan03.parallelize import mark_fused_qkv

STEPS = 5
# Newton-Schulz in fp32 on both sides (the reference's through reference_setup): bf16
# would round the ranks' and the reference's gradients (summed in another order) apart.
NS = ["--dmuon.ns_dtype", "float32", "--dmuon.ns_backend", "torch"]


def _train(tmp_path: Path, ngpu: int, *flags: str) -> subprocess.CompletedProcess:
    return train_recorded(tmp_path, ngpu, "--training.steps", str(STEPS), *NS, *flags)


def _replay(record: Path, ranks: int) -> tuple[dict[int, float], dict[str, torch.Tensor]]:
    with reference_setup(ns_dtype=torch.float32):
        return _replay_here(record, ranks)


def _replay_here(record: Path, ranks: int) -> tuple[dict[int, float], dict[str, torch.Tensor]]:
    """One process: the same model from the recorded initial values, each step the ranks'
    batches together (the trainer's loss: token sum over the global token count), the same
    clipping, torch.optim.Muon on the selected matrices (a fused QKV weight as its three
    matrices) and AdamW on the rest, the same lr schedule."""
    config = llama3_debug_cpu()
    sdpa_attention(config.model_spec.model)
    torch.manual_seed(0)
    model = config.model_spec.model.build()
    model.load_state_dict(torch.load(record / "initial.pt"))
    loss_fn = config.loss.build(compile_config=config.compile)
    loss_fn.set_lm_head(model.lm_head)
    model._skip_lm_head = True
    mark_fused_qkv(model)
    fused, muon, adamw = {}, [], []
    for name, param in model.named_parameters():
        layout = fused_rows_of(model, name)
        if layout is not None:
            fused[name] = (
                param,
                layout,
                [torch.nn.Parameter(m.clone()) for m in layout.matrices(param.detach())],
            )
            muon += fused[name][2]
        elif param.ndim == 2 and name.startswith("layers."):
            muon.append(param)
        else:
            adamw.append(param)
    adamw_config = config.optimizer
    optimizers = [
        torch.optim.Muon(muon, lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.1, ns_steps=5),
        torch.optim.AdamW(
            adamw, lr=adamw_config.lr, betas=(adamw_config.beta1, adamw_config.beta2),
            eps=adamw_config.eps, weight_decay=adamw_config.weight_decay, fused=True,
        ),
    ]  # fmt: skip
    schedulers = config.lr_scheduler.build(optimizers=optimizers, training_steps=STEPS)
    losses = {}
    for step in range(1, STEPS + 1):
        batches = [torch.load(record / f"batch_r{r}_s{step}.pt") for r in range(ranks)]
        tokens = sum(int((b["labels"] != IGNORE_INDEX).sum()) for b in batches)
        for param, layout, matrices in fused.values():
            with torch.no_grad():
                for block, matrix in zip(layout.blocks(param), matrices, strict=True):
                    block.copy_(matrix.view(block.shape))
        for opt in optimizers:
            opt.zero_grad()
        model.zero_grad()
        total = 0.0
        for b in batches:
            inputs = b["input_dict"]["input"]
            extra = {k: v for k, v in b["input_dict"].items() if k != "input"}
            loss, _ = loss_fn(model(inputs, **extra), b["labels"], torch.tensor(tokens), **(
                {"positions": extra["positions"]} if "positions" in extra else {}
            ))  # fmt: skip
            loss.backward()
            total += float(loss.detach())
        losses[step] = total
        for param, layout, matrices in fused.values():
            for matrix, grad in zip(matrices, layout.matrices(param.grad), strict=True):
                matrix.grad = grad.clone()
            param.grad = None
        params = [p for p in model.parameters() if p.grad is not None] + muon[:0]
        params += [m for _, _, ms in fused.values() for m in ms]
        torch.nn.utils.clip_grad_norm_(params, config.training.max_norm, foreach=True)
        for opt in optimizers:
            opt.step()
        schedulers.step()
    for param, layout, matrices in fused.values():
        with torch.no_grad():
            for block, matrix in zip(layout.blocks(param), matrices, strict=True):
                block.copy_(matrix.view(block.shape))
    return losses, {n: p.detach() for n, p in model.named_parameters()}


# The last step saved as a HuggingFace safetensors file (0.3's state-dict adapter), model only.
HF_EXPORT = ["--checkpoint.enable", "--checkpoint.interval", str(STEPS + 1),
             "--checkpoint.last_save_model_only", "--checkpoint.last_save_in_hf"]  # fmt: skip


def _hf_export(record: Path) -> dict[str, torch.Tensor]:
    """The run's HuggingFace export of its last step, read back into the model by 0.3's
    llama3 state-dict adapter (``from_hf``) and its fused QKV's load hooks."""
    from safetensors.torch import load_file

    config = llama3_debug_cpu()
    spec = config.model_spec
    adapter = spec.state_dict_adapter(spec.model, config.hf_assets_path)
    (exported,) = (record / "dump" / "checkpoint" / f"step-{STEPS}").glob("model-*.safetensors")
    sdpa_attention(spec.model)
    model = spec.model.build()
    model.load_state_dict(adapter.from_hf(load_file(exported)))
    return {n: p.detach() for n, p in model.named_parameters()}


LAYOUTS = {
    "fsdp": (2, HF_EXPORT),
    "hsdp": (4, ["--parallelism.data_parallel_replicate_degree", "2",
                 "--parallelism.data_parallel_shard_degree", "2"]),
}  # fmt: skip


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_dmuon_through_torchtitan_0_3_equals_one_process_muon_and_adamw(layout, tmp_path):
    """FSDP2 Z3 over 2 ranks, HSDP 2 x 2 (the storage mesh's dp_replicate and dp_shard
    axes): every parameter and loss as the reference's after 5 steps. The FSDP run's
    HuggingFace export of its last step holds its final values exactly (each dedicated
    matrix written once, from its owner)."""
    ranks, flags = LAYOUTS[layout]
    run = _train(tmp_path, ranks, *flags)
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-6000:]
    assert "dmuon: 6 fused QKV projections" in output
    replicas = 2 if layout == "hsdp" else 1  # the engine's R x G: found by axis name
    assert f"units over {replicas} x 2 ranks" in output
    losses = torch.load(tmp_path / "losses.pt")
    final = torch.load(tmp_path / "final.pt")
    reference_losses, reference = _replay(tmp_path, ranks)
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert [losses[s] for s in losses] == pytest.approx(
        [reference_losses[s] for s in losses], rel=1e-6
    )
    assert final.keys() == reference.keys()
    for name, value in reference.items():
        torch.testing.assert_close(final[name], value, rtol=1e-5, atol=1e-5, msg=name)
    if flags == HF_EXPORT:
        exported = _hf_export(tmp_path)
        assert exported.keys() == final.keys()
        for name, value in final.items():
            torch.testing.assert_close(exported[name], value, rtol=0, atol=0, msg=name)
