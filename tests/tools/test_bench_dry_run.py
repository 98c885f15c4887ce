"""``benchmarks/bench_dry_run.py``: what it reads from a dry run's output (the start, the
step, the plan's balance and held bytes) and the table it prints (the runs themselves
are a benchmark, not a test)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_dry_run as bench  # noqa: E402

LOG = """\
[titan] 2026-12-07 15:39:35,390 - root - INFO - Applied FSDP to the model
[titan] 2026-12-07 15:39:36,618 - dmuon - INFO - dedicate_params: 560 parameters (560 \
matrices), 80 boundaries, 4480 units over 1 x 2048 ranks, NS balance 1.149, Z3, owner groups of 8
[titan] 2026-12-07 15:39:37,035 - root - INFO - Training starts at step 1
[titan] 2026-12-07 15:44:16,561 - root - INFO - step:  1  loss: 12.25 memory:  8.81GiB(37.43%)
[titan] 2026-12-07 15:44:17,000 - dmuon - INFO - plan report of model part 0: rank 0 of 2048 \
orthogonalizes 2 of 560 matrices, holds 60.0 MiB of them (max 90.0, mean 60.0), moves 1 MiB
"""


def test_the_start_step_and_balances_are_read_from_the_log():
    assert bench._seconds_between(LOG, "Applied FSDP", "Training starts") == 1.6
    assert bench._seconds_between(LOG, "Training starts", "step:  1") == 279.5
    assert bench._seconds_between(LOG, "Training starts", "never printed") is None
    entry = {
        "plan": bench._found(r"dedicate_params: (.*)", LOG),
        "report": bench._found(r"plan report of model part 0: (.*)", LOG),
    }
    assert bench._ns_balance(entry) == "1.149"
    assert bench._held_balance(entry) == "1.500"
    adamw = {"plan": None, "report": None}
    assert bench._ns_balance(adamw) == bench._held_balance(adamw) == ""


def test_the_table_has_a_row_per_run_with_its_commit():
    machine = {"git_commit": "0123456789", "git_dirty": False}
    runs = [
        dict(case="llama3_70b_2048", layout="FSDP Z3", optimizer=o, exit=0, wall="9:00",
             start_s=1.0, step_s=500.0, max_rss_gib=17.1, torchtitan_memory_gib="16.9",
             plan=None, report=None, machine=machine)
        for o in ("AdamW", "DMuon")
    ]  # fmt: skip
    lines = bench.table(runs).splitlines()
    assert len(lines) == 4 and lines[2].count("|") == lines[0].count("|")
    assert "| llama3_70b_2048 | FSDP Z3 | AdamW | 0 | 9:00 |" in lines[2]
    assert lines[3].endswith("| 0123456 |")
