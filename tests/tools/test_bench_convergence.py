"""``benchmarks/bench_convergence.py``: the sweep's choices from finished runs, its cache, its
timing, and its quick mode end to end (the sweep itself is a benchmark, not a test)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest
import torch

from tests.titan.test_titan_integration import ROOT
from torchtitan_dmuon.titan.optimizer import decay_kept

sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_convergence as bench  # noqa: E402


def _args(**kw) -> argparse.Namespace:
    defaults = dict(
        adamw_lrs=[3e-3, 1e-3, 1e-2], adamw_wds=[0.0, 0.1], muon_lrs=[0.02, 0.01, 0.04],
        muon_wds=[0.0, 0.01, 0.1], qk_clip_threshold=10.0, timing_rounds=2,
    )  # fmt: skip
    return argparse.Namespace(**{**defaults, **kw})


def _record(spec: bench.RunSpec, final: float) -> dict:
    return {
        "name": spec.name, "kind": spec.kind, "optimizer": spec.optimizer, "group": spec.group,
        "seed": spec.seed, "lr": spec.lr, "weight_decay": spec.weight_decay,
        "flags": list(spec.flags), "final_val_loss": final,
    }  # fmt: skip


def test_dependent_runs_follow_the_finished_sweep():
    """The drop-in takes the best AdamW run's lr and weight decay for every parameter;
    NorMuon the best DMuon settings of the sweep and the drop-in; the second seed the best
    AdamW, the best original DMuon and the drop-in. Nothing is chosen from an incomplete
    sweep."""
    args = _args()
    sweep = bench.sweep_specs(args)
    assert len(sweep) == 6 + 9 and len({s.name for s in sweep}) == 15
    finals = {s.name: 5.0 for s in sweep}
    finals["adamw_lr0.001_wd0.1_s42"] = 4.5
    finals["dmuon_lr0.04_wd0.01_s42"] = 4.2
    results = [_record(s, finals[s.name]) for s in sweep]
    assert bench.dependent_specs(args, results[1:], "dropin") == []
    assert bench.dependent_specs(args, results, "normuon") == []  # the drop-in first
    (dropin,) = bench.dependent_specs(args, results, "dropin")
    assert dropin.name == "dropin_lr0.001_wd0.1_s42"
    assert dropin.flags == (
        "--optimizer.lr", "0.001", "--optimizer.weight_decay", "0.1",
        "--dmuon.adjust_lr_fn", "match_rms_adamw", "--dmuon.lr", "0.001",
        "--dmuon.weight_decay", "0.1",
    )  # fmt: skip
    results.append(_record(dropin, 4.1))  # the drop-in wins: NorMuon runs on its settings
    (normuon,) = bench.dependent_specs(args, results, "normuon")
    assert normuon.name == "normuon_dropin_lr0.001_wd0.1_s42"
    assert normuon.flags == (*dropin.flags, "--dmuon.variant", "normuon")
    seeds = bench.dependent_specs(args, results, "seed2")
    assert [s.name for s in seeds] == [
        "adamw_lr0.001_wd0.1_s1", "dmuon_lr0.04_wd0.01_s1", "dropin_lr0.001_wd0.1_s1",
    ]  # fmt: skip
    assert seeds[1].flags == ("--dmuon.lr", "0.04", "--dmuon.weight_decay", "0.01")
    # Timing: the same three, interleaved in 2 rounds, without evaluation.
    timing = bench.dependent_specs(args, results, "timing")
    assert [s.name for s in timing] == [
        f"timing{n}_{name}_s42" for n in (1, 2)
        for name in ("adamw_lr0.001_wd0.1", "dmuon_lr0.04_wd0.01", "dropin_lr0.001_wd0.1")
    ]  # fmt: skip
    quiet = bench.Settings("large", steps=60, eval_every=50, val_batches=0)
    overrides = timing[1].overrides(quiet)
    assert overrides[:4] == ["--training.steps", "60", "--debug.seed", "42"]
    assert "--model.flavor" in overrides and "--validation.enable" not in overrides


def test_step_time_and_steps_to_reach():
    """The step time leaves evaluations out; the crossing step is interpolated between
    evaluations; a target never reached is None."""
    train = [{"step": s, "time": t} for s, t in ((1, 0.0), (5, 4.0), (10, 12.0), (15, 17.0))]
    # The evaluation at step 5 took 3 s of the interval 5-10: 1 s a step there too.
    assert bench.step_seconds(train, {1: 0.0, 5: 3.0}) == 1.0
    run = {"val": [{"step": 0, "loss": 8.0}, {"step": 50, "loss": 6.0}, {"step": 100, "loss": 5.0}]}
    assert bench.steps_to_reach(run, 5.5) == 75.0
    assert bench.steps_to_reach(run, 8.0) == 0.0
    assert bench.steps_to_reach(run, 4.9) is None


def test_the_larger_model_has_at_least_4x_the_parameters():
    """``--size large`` is llama3 at dim 512 and 8 layers: 4.76x debugmodel's parameters."""
    import convergence_model
    from torchtitan.models.llama3 import Transformer, llama3_args

    def count(args) -> int:
        with torch.device("meta"):
            return sum(p.numel() for p in Transformer(args).parameters())

    small, large = count(llama3_args["debugmodel"]), count(convergence_model.FLAVORS["dim512_l8"])
    assert (small, large) == (6_163_712, 29_368_832)
    assert large / small > 4


def test_the_grid_reads_in_ascending_lr_and_weight_decay():
    """The report's sweep table lists lr and weight decay in ascending order, whatever order
    the sweep ran them in (centre first), bolds the lowest final loss and says which cells
    have not run."""
    args = _args()
    results = [
        _record(spec, 4.0 + spec.lr + spec.weight_decay)
        for spec in bench.sweep_specs(args)
        if spec.kind == "dmuon" and spec.weight_decay != 0.01
    ]
    assert bench._grid(results, "dmuon", args.muon_lrs, [0.1, 0.0, 0.01]) == [
        "| lr \\ weight decay | 0 | 0.01 | 0.1 |",
        "| --- | --- | --- | --- |",
        "| 0.01 | **4.0100** | not run | 4.1100 |",
        "| 0.02 | 4.0200 | not run | 4.1200 |",
        "| 0.04 | 4.0400 | not run | 4.1400 |",
    ]


@pytest.mark.slow
def test_quick_mode_trains_caches_and_reports(tmp_path):
    """``--quick``: one AdamW and one DMuon run through ./run_train.sh, 10 steps evaluated
    at 1, 5 and 10 on the held-out set; their records, the report and the chart. The DMuon
    run logs its recipe (lr and weight decay given in [dmuon]). Run again, both come from
    the cache; with other TorchTitan overrides the cache is refused, naming the record."""
    command = [sys.executable, "benchmarks/bench_convergence.py", "--quick",
               "--out", str(tmp_path), "--work", str(tmp_path / "work")]  # fmt: skip
    first = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    runs = {p.stem: json.loads(p.read_text()) for p in (tmp_path / "debug/runs").glob("*.json")}
    assert sorted(runs) == ["adamw_lr0.003_wd0.1_s42", "dmuon_lr0.02_wd0.01_s42"]
    for record in runs.values():
        assert [e["step"] for e in record["val"]] == [1, 5, 10]
        assert record["val"][-1]["loss"] < record["val"][0]["loss"] < 9
        assert record["step_s"] > 0 and record["machine"]["cpu_capability"]
    log = (tmp_path / "work/debug/logs/dmuon_lr0.02_wd0.01_s42.log").read_text()
    kept = decay_kept(0.02, 0.01, [(step + 1) / 10 for step in range(10)])  # warmup 10
    assert (
        "DMuon recipe: the Muon matrices: lr 0.02, weight decay 0.01 (lr [dmuon] lr; "
        f"weight_decay [dmuon] weight_decay): 0.0002 a step at the peak lr, {kept:.2f} of their "
        "values left by decay alone after the 10 steps; the AdamW parameters: lr 0.003, weight "
        "decay 0 ([optimizer])"
    ) in log
    table = (tmp_path / "debug/table.md").read_text()
    adamw = f"{runs['adamw_lr0.003_wd0.1_s42']['final_val_loss']:.4f}"
    assert f"| 0.003 | not run | **{adamw}** |" in table
    assert (tmp_path / "debug/convergence.png").stat().st_size > 10_000
    again = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and again.stderr.count("done before, skipped") == 2
    other = subprocess.run(
        [*command, "--extra", "--training.max_norm", "0.5"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert other.returncode == 2
    assert "adamw_lr0.003_wd0.1_s42.json ran with" in other.stderr
    assert "give another --out" in other.stderr
