"""Tensor parallelism with DMuon through ./run_train.sh: TorchTitan's 2d_eager case (FSDP 2
x TP 2) and replicate 2 x TP 2 equal FSDP 2 without TP, a checkpoint saved under TP 2
resumes without TP, TP alone equals one rank."""

from __future__ import annotations

import math

import pytest

from tests.test_titan_integration import run_train
from tests.test_titan_pipeline import FP32_NS, _seed_checkpoint

TP2 = ["--parallelism.tensor_parallel_degree", "2"]
DP2 = ["--parallelism.data_parallel_shard_degree", "2"]
CONFIG = "train_configs/debug_cpu.toml"


def test_fsdp_tp_equals_fsdp_and_checkpoint_crosses_tp(tmp_path):
    """From one seed checkpoint (TorchTitan initializes DTensors with other random
    values), FSDP 2 x TP 2 (4 ranks; each dedicated matrix's owner column runs the
    tensor-parallel Newton-Schulz) equals FSDP 2 (2 ranks, same data) within 1e-4 over 6
    steps; its step-3 checkpoint resumes at TP 1 and the curve continues within 1e-4.
    TP 2 alone (one data-parallel rank: the two TP ranks own every matrix together)
    equals one rank without TP."""
    init = _seed_checkpoint(tmp_path)
    common = [
        "--training.steps", "6", "--metrics.log_freq", "1", *FP32_NS,
        "--checkpoint.enable", "--checkpoint.interval", "3",
    ]  # fmt: skip
    start = ["--checkpoint.initial_load_path", str(init), "--checkpoint.initial_load_model_only"]
    tp = run_train([*common, *start, *TP2, *DP2], 4, tmp_path / "tp", CONFIG)
    replicate = ["--parallelism.data_parallel_replicate_degree", "2"]
    ddp_tp = run_train(
        [*common, *start, *TP2, *replicate, "--parallelism.data_parallel_shard_degree", "1"],
        4,
        tmp_path / "ddp_tp",
        CONFIG,
    )
    flat = run_train([*common, *start, *DP2], 2, tmp_path / "flat", CONFIG)
    resumed = run_train(
        [
            *common,
            "--checkpoint.initial_load_path",
            str(tmp_path / "tp" / "checkpoint" / "step-3"),
            "--checkpoint.no-initial_load_model_only",
            *DP2,
        ],
        2,
        tmp_path / "resumed",
        CONFIG,
    )
    dp1 = ["--parallelism.data_parallel_shard_degree", "1"]
    alone = run_train([*common, *start, *TP2, *dp1], 2, tmp_path / "alone", CONFIG)
    one = run_train([*common, *start, *dp1], 1, tmp_path / "one", CONFIG)
    for run in (tp, ddp_tp, flat, resumed, alone, one):
        assert run.returncode == 0, run.output[-3000:]
        assert all(map(math.isfinite, run.losses.values()))
    steps = list(range(1, 7))
    assert [tp.losses[s] for s in steps] == pytest.approx([flat.losses[s] for s in steps], rel=1e-4)
    # Replicate 2 x TP 2: DMuon's DDP-style sync beside TP (TorchTitan refuses its DDP there).
    assert [ddp_tp.losses[s] for s in steps] == pytest.approx(
        [flat.losses[s] for s in steps], rel=1e-4
    )
    assert "tensor-parallel Newton-Schulz of (768, 256) split along dim -2 over 2 ranks: gram" in (
        tp.output
    )
    assert sorted(resumed.losses) == [4, 5, 6]
    later = [4, 5, 6]
    assert [resumed.losses[s] for s in later] == pytest.approx(
        [tp.losses[s] for s in later], rel=1e-4
    )
    assert "dedicate_params: 42 parameters (42 matrices), 6 boundaries, 6 units over 1 x 1" in (
        alone.output
    )
    expected = [one.losses[s] for s in steps]
    assert [alone.losses[s] for s in steps] == pytest.approx(expected, rel=1e-4)
