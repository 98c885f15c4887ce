"""Muon's variants through ./run_train.sh: NorMuon (``--dmuon.variant normuon``) on the
llama4 debug MoE, trained under FSDP 2 x TP 2 x EP 2 with expert tensor parallelism 2
(every kind of layout its second moments take: whole, rows split, columns split, expert
pieces split either way), and its checkpoints across layouts; QK-clip
(``--dmuon.qk_clip_threshold``) on the debug llama3, eager and compiled, and on the
deepseek_v3 debug MoE (MLA)."""

from __future__ import annotations

import re

import pytest
import torch

from tests.titan.test_titan_expert_parallel import (
    AFTER_SAVE,
    DEEPSEEK,
    ETP2,
    LLAMA4,
    SAVED_AT,
    STEPS,
    ep,
)
from tests.titan.test_titan_integration import PLAIN, SHORT, run_train, shared_run
from tests.titan.test_titan_pipeline import DP2, from_seed, pp, resume_from
from torchtitan_dmuon.titan.config import ORIGINAL_WEIGHT_DECAY
from torchtitan_dmuon.titan.optimizer import decay_kept

NORMUON = ["--dmuon.variant", "normuon"]
# TorchTitan's debug models start with logits of about 0.6 (weights of std 0.02): every
# head clips at step 1.
QK_CLIP = ["--dmuon.qk_clip_threshold", "0.3"]
# TorchTitan's per-op selective AC, and each rank's 4 samples as 2 microbatches of 2 (the
# same samples per step as one batch of 4, so the same maxima).
COMPILED_AC_ACCUMULATION = [
    "--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option",
    "op", "--training.local_batch_size", "2", "--training.global_batch_size", "8",
]  # fmt: skip
QK_LINE = re.compile(r"qk max logit (\S+) clipped heads (\d+)")


def _qk_metrics(output: str) -> list[tuple[float, int]]:
    return [(float(m), int(n)) for m, n in QK_LINE.findall(output)]


@pytest.mark.slow
def test_qk_clip_trains_llama3_eager_and_compiled_and_deepseek_mla(tmp_path_factory, tmp_path):
    """The debug llama3 (2 ranks, FSDP Z3) with QK-clip at 0.3 clips all 96 heads at step
    1 (largest logit 0.64) and the logged maximum falls toward the threshold at step 2 (to
    less than 3/4 of it: new batches and Muon's updates keep it above 0.3), heads clip at
    every step; step 1's loss is bitwise the plain run's (the clip follows the update),
    the later ones differ. Compiled per block (6 blocks) with per-op selective AC and 2
    microbatches per step (12 block forwards a step, past Dynamo's 8 recompiles had each
    layer or microbatch needed its own graph) it records the same maxima (to the logged 2
    decimals) and clips the same heads at step 1, within 2 later; as pipeline stages
    (PP 2 x DP 2) the logged figures are the whole model's. The deepseek_v3 debug
    MoE (MLA: q_nope, q_pe and k_nope rows rescaled) trains with QK-clip at 0.5, clipping
    heads; with [optimizer] weight_decay 0.1 and [dmuon] weight_decay unset, the Muon
    matrices take adjust_lr_fn original's own decay, not AdamW's (logged)."""
    plain = shared_run(PLAIN, 2, tmp_path_factory)
    eager = run_train([*PLAIN, *QK_CLIP], 2, tmp_path / "eager", "train_configs/debug_cpu.toml")
    compiled = run_train(
        [*PLAIN, *QK_CLIP, "--compile.enable", "--compile.components", "model",
         *COMPILED_AC_ACCUMULATION],
        2, tmp_path / "compiled", "train_configs/debug_cpu.toml",
    )  # fmt: skip
    for run in (plain, eager, compiled):
        assert run.returncode == 0, run.output[-4000:]
        assert sorted(run.losses) == list(STEPS)
    assert "Muon: QK-clip on 6 attention layers (threshold 0.3, alpha 0.5)" in eager.output
    metrics = _qk_metrics(eager.output)
    assert len(metrics) == len(STEPS)
    assert metrics[0][1] == 6 * 16 and metrics[0][0] > 0.6
    assert metrics[1][0] < 0.75 * metrics[0][0]
    assert all(heads > 0 for _, heads in metrics), metrics
    assert eager.losses[1] == plain.losses[1]
    assert all(eager.losses[s] != plain.losses[s] for s in STEPS if s > 1)
    compiled_metrics = _qk_metrics(compiled.output)
    assert compiled_metrics[0][1] == metrics[0][1]
    assert all(abs(a[1] - b[1]) <= 2 for a, b in zip(compiled_metrics, metrics, strict=True))
    assert [m for m, _ in compiled_metrics] == pytest.approx([m for m, _ in metrics], abs=0.011)

    # Pipeline stages (PP 2 x DP 2, 3 layers each; the stages initialize their own layers,
    # so the weights differ from the eager run's): the logged figures are the whole
    # model's, all 96 heads at step 1 (the logging stage alone has 48, and counted the
    # uninitialized tensors of its metadata forward: NaN and 24 heads).
    staged = run_train(
        [*SHORT[2:], *QK_CLIP, "--training.steps", "2", *pp(2, "1F1B", *DP2)],
        4, tmp_path / "pp", "train_configs/debug_cpu.toml", log_rank=2,
    )  # fmt: skip
    assert staged.returncode == 0, staged.output[-4000:]
    staged_metrics = _qk_metrics(staged.output)
    assert len(staged_metrics) == 2 and staged_metrics[0][1] == 6 * 16, staged_metrics
    assert 0.6 < staged_metrics[0][0] < 1.0 and staged_metrics[1][0] < 0.75 * staged_metrics[0][0]

    # Also: [dmuon] lr and weight_decay unset take adjust_lr_fn original's, whatever
    # [optimizer] weight_decay is.
    deepseek = run_train(
        ["--training.steps", "3", "--metrics.log_freq", "1", "--dmuon.qk_clip_threshold", "0.5",
         "--optimizer.weight_decay", "0.05"],
        2, tmp_path / "deepseek", DEEPSEEK,
    )  # fmt: skip
    assert deepseek.returncode == 0, deepseek.output[-4000:]
    assert (
        f"DMuon recipe: the Muon matrices: lr 0.02, weight decay {ORIGINAL_WEIGHT_DECAY:g} (lr "
        "[dmuon] lr; weight_decay unset: the default of adjust_lr_fn 'original')" in deepseek.output
    )
    assert "the AdamW parameters: lr 0.003, weight decay 0.05 ([optimizer])" in deepseek.output
    # Over the run's own 3 steps of its lr schedule (TorchTitan cuts warmup 5 to the 3).
    kept = decay_kept(0.02, ORIGINAL_WEIGHT_DECAY, [1 / 3, 2 / 3, 1.0])
    assert f"{kept:.2f} of their values left by decay alone after the 3 steps" in deepseek.output
    assert deepseek.losses[3] < deepseek.losses[1]
    ds_metrics = _qk_metrics(deepseek.output)
    assert len(ds_metrics) == 3 and all(heads > 0 for _, heads in ds_metrics), ds_metrics


@pytest.mark.slow
def test_normuon_trains_under_expert_tensor_parallelism_and_checkpoints_cross(
    tmp_path_factory, tmp_path
):
    """NorMuon at FSDP 2 x TP 2 x EP 2 x ETP 2 (4 ranks) trains and differs from Muon; its
    step-3 checkpoint (momentum and second moments: the column-split experts' rows saved
    once) resumes at FSDP 2 without TP or EP (2 ranks) within 1e-4 of the run it came from,
    and in the same layout bitwise: every TP rank of a
    column-split expert gets the rows only one of them loaded."""
    # Before from_seed's: resume_from keeps the arguments up to the seed's path.
    common = [*NORMUON, *from_seed(tmp_path_factory, LLAMA4, len(STEPS))]
    etp = run_train([*common, *ep(2, *ETP2)], 4, tmp_path / "etp", LLAMA4)
    assert etp.returncode == 0, etp.output[-4000:]
    assert sorted(etp.losses) == list(STEPS)
    assert etp.losses[6] < etp.losses[1] - 0.2
    assert "Muon: NorMuon, each update normalized per row (second-moment beta2 0.95)" in etp.output
    muon = shared_run(
        [*from_seed(tmp_path_factory, LLAMA4, len(STEPS)), *ep(2, *ETP2)], 4, tmp_path_factory,
        LLAMA4,
    )  # fmt: skip
    assert muon.returncode == 0, muon.output[-4000:]
    assert abs(muon.losses[6] - etp.losses[6]) > 1e-3

    checkpoint = etp.dump / "checkpoint" / f"step-{SAVED_AT}"
    resume = resume_from(checkpoint, common)
    fsdp = run_train([*resume, *ep(1)], 2, tmp_path / "fsdp", LLAMA4)
    same = run_train([*resume, *ep(2, *ETP2)], 4, tmp_path / "same", LLAMA4)
    for run in (fsdp, same):
        assert run.returncode == 0, run.output[-4000:]
        assert sorted(run.losses) == list(AFTER_SAVE)
        assert "Muon: NorMuon" in run.output
    expected = [etp.losses[s] for s in AFTER_SAVE]
    assert [fsdp.losses[s] for s in AFTER_SAVE] == pytest.approx(expected, rel=1e-4)
    assert [same.losses[s] for s in AFTER_SAVE] == expected


@pytest.mark.slow
def test_normuon_switched_on_at_a_resume_starts_its_second_moments_at_zero(
    tmp_path_factory, tmp_path
):
    """Resuming the plain Muon run's step-3 checkpoint (2 ranks, FSDP Z3) with
    ``--dmuon.variant normuon``: the checkpoint has Muon's momentum but no second moments;
    they start at zero, saying so once, and the run goes on: step 4's loss is the Muon
    run's bitwise (same weights and data), steps 5 and 6 differ (NorMuon's updates), and
    its step-6 checkpoint holds every matrix's second moment, positive (two NorMuon steps
    from zero)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    plain = shared_run(PLAIN, 2, tmp_path_factory)
    assert plain.returncode == 0, plain.output[-4000:]
    resumed = run_train(
        [*SHORT, *NORMUON, "--checkpoint.enable", "--checkpoint.interval", "3",
         "--checkpoint.initial_load_path", str(plain.dump / "checkpoint" / "step-3"),
         "--checkpoint.no-initial_load_model_only"],
        2, tmp_path / "normuon", "train_configs/debug_cpu.toml",
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.output[-4000:]
    matrices = 6 * 7  # the debug llama3's attention and feed-forward matrices
    assert (
        f"NorMuon: the checkpoint holds no second moments for the {matrices} Muon matrices "
        "(it was written without NorMuon); they start at zero"
    ) in resumed.output
    assert sorted(resumed.losses) == [4, 5, 6]
    assert resumed.losses[4] == plain.losses[4]
    assert all(abs(resumed.losses[s] - plain.losses[s]) > 1e-5 for s in (5, 6))

    dcp_to_torch_save(resumed.dump / "checkpoint" / "step-6", tmp_path / "step-6.pt")
    saved = torch.load(tmp_path / "step-6.pt", weights_only=False)
    moments = {k: v for k, v in saved["optimizer"].items() if k.endswith(".second_moment")}
    assert len(moments) == matrices
    for name, moment in moments.items():
        assert moment.shape[-1] == 1 and bool((moment > 0).all()), name
