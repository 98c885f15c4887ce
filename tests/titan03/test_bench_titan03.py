"""``benchmarks/bench_titan03.py`` runs both sides through TorchTitan 0.3's trainer (DMuon
and 0.3's DistMuon, on the CPU) from the same initial values, on the same data, with the
same math: the first step's loss is the same, the next ones within bf16 Newton-Schulz
rounding of each other, and it records what its table reads."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _bench():
    spec = importlib.util.spec_from_file_location(
        "bench_titan03", ROOT / "benchmarks" / "bench_titan03.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("bench_titan03", module)
    spec.loader.exec_module(module)
    return module


def test_both_sides_train_the_same_model_from_the_same_values(tmp_path):
    bench = _bench()
    runs = {side: bench._run(side, 2, 3, tmp_path / side) for side in ("dmuon", "distmuon")}
    summaries = {side: bench._summary(run, warmup=1) for side, run in runs.items()}
    dmuon, distmuon = (summaries[s]["losses"] for s in ("dmuon", "distmuon"))
    assert len(dmuon) == len(distmuon) == 3
    assert dmuon[0] == distmuon[0]  # the same initial values and batch
    for ours, theirs in zip(dmuon[1:], distmuon[1:], strict=True):
        assert abs(float(ours) - float(theirs)) < 1e-3
    for summary in summaries.values():
        assert summary["step_ms"] > summary["optimizer_ms"] > 0
        assert summary["bytes_per_rank"] > 0 and summary["peak_rss_gib"] > 0
