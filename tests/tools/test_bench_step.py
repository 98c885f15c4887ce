"""Smoke test of the step benchmark: it runs, and its counted figures (not its timings)
are what the design says."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.ns_verdict
def test_bench_step_counts(tmp_path):
    cmd = [
        sys.executable, "benchmarks/bench_step.py", "--nproc", "2", "--dim", "64",
        "--layers", "2", "--heads", "4", "--vocab", "256", "--seq", "16", "--rounds", "1",
        "--steps-per-round", "1", "--breakdown-steps", "1", "--out", str(tmp_path),
        "--modes", "adamw_fused", "naive_muon", "dmuon_z3", "dmuon_z2", "dmuon_z3_normuon",
        "dmuon_z3_qkclip",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "results.json").read_text())
    rows = result["rows"]
    assert (tmp_path / "step_time.png").stat().st_size > 0
    # Naive Muon orthogonalizes every matrix on every rank; DMuon splits them over owners.
    assert rows["naive_muon"]["ns_flops_balance"] == 1.0
    assert rows["dmuon_z3"]["ns_gflops_per_rank_max"] < rows["naive_muon"]["ns_gflops_per_rank_max"]
    # No optimizer all-gather: Z2 moves fewer bytes than FSDP2+AdamW, Z3 as many (plus one
    # 4-byte has-gradient flag per matrix); naive Muon gathers every matrix once more.
    adamw = rows["adamw_fused"]["total_bytes_per_rank"]
    assert rows["dmuon_z2"]["total_bytes_per_rank"] < adamw
    assert rows["dmuon_z3"]["total_bytes_per_rank"] <= adamw + 4 * 14

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_model import BenchTransformer, matrix_predicate

    model = BenchTransformer(vocab=256, dim=64, layers=2, heads=4)
    matrix_bytes = sum(4 * p.numel() for n, p in model.named_parameters() if matrix_predicate(n, p))
    assert rows["naive_muon"]["total_bytes_per_rank"] == adamw + matrix_bytes
    # Same math: DMuon Z2, Z3 and naive Muon end on the same loss.
    assert rows["dmuon_z3"]["final_loss"] == rows["dmuon_z2"]["final_loss"]
    assert abs(rows["dmuon_z3"]["final_loss"] - rows["naive_muon"]["final_loss"]) < 1e-4
    # Each DMuon mode's floor: the fused-AdamW step plus its busiest rank's profiled NS.
    for mode in ("dmuon_z3", "dmuon_z2"):
        ns = max(r["newton_schulz"] for r in rows[mode]["step_breakdown"]["per_rank_ms"])
        assert ns > 0
        assert rows[mode]["floor_ms"] == rows["adamw_fused"]["step_ms"] + ns
        assert rows[mode]["ratio_to_floor"] == rows[mode]["step_ms"] / rows[mode]["floor_ms"]
    # NorMuon: the same ownership and bytes, its normalization profiled on every owner.
    normuon = rows["dmuon_z3_normuon"]
    assert normuon["total_bytes_per_rank"] == rows["dmuon_z3"]["total_bytes_per_rank"]
    assert all(r["normuon"] > 0 for r in normuon["step_breakdown"]["per_rank_ms"])
    assert all(r["normuon"] == 0 for r in rows["dmuon_z3"]["step_breakdown"]["per_rank_ms"])
    assert normuon["final_loss"] != rows["dmuon_z3"]["final_loss"]
    # QK-clip: the max-logit pass profiled in every rank's forward, one MAX all-reduce of
    # 2 layers x 4 heads fp32 maxima per step more; at threshold 100 nothing clips.
    qk_clip = rows["dmuon_z3_qkclip"]
    assert all(r["qk max logits"] > 0 for r in qk_clip["step_breakdown"]["per_rank_ms"])
    assert qk_clip["total_bytes_per_rank"] == rows["dmuon_z3"]["total_bytes_per_rank"] + 2 * 4 * 4
    assert qk_clip["final_loss"] == rows["dmuon_z3"]["final_loss"]
    assert rows["adamw_fused"]["ratio_to_adamw_fused"] == 1.0
    assert result["ns_dtype"] in ("float32", "bfloat16")
    assert torch.backends.cpu.get_cpu_capability() in result["machine"]
    assert "[PASS]" in proc.stdout or "[MISS]" in proc.stdout
