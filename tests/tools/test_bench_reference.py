"""The side by side with the reference design (``bench_step.py --side-by-side``): without
the reference it says why and runs nothing; with a checkout of it named in
``DMUON_REFERENCE_PATH`` (X-Square-Robot/dmuon, commit f002f24) its quick mode trains both
with the same math."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
QUICK = [
    sys.executable, "benchmarks/bench_step.py", "--nproc", "4", "--dim", "64", "--layers", "2",
    "--heads", "4", "--vocab", "256", "--seq", "16", "--rounds", "1", "--steps-per-round", "2",
    "--breakdown-steps", "1", "--side-by-side",
]  # fmt: skip


def _run(cmd: list[str], out: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*cmd, "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=900
    )


@pytest.mark.parametrize("where", [None, "missing"])
def test_side_by_side_without_the_reference_runs_nothing(tmp_path, where):
    cmd = QUICK if where is None else [*QUICK, "--reference-path", str(tmp_path / where)]
    proc = _run(cmd, tmp_path / "out")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "not run: the side by side:" in proc.stdout
    expected = "needs --reference-path" if where is None else "no dmuon/__init__.py"
    assert expected in proc.stdout
    assert not (tmp_path / "out" / "results.json").exists()


def test_side_by_side_same_math(tmp_path):
    path = os.environ.get("DMUON_REFERENCE_PATH")
    if not path:
        pytest.skip(
            "DMUON_REFERENCE_PATH is not set (a checkout of X-Square-Robot/dmuon f002f24, "
            "the directory holding dmuon/)"
        )
    proc = _run([*QUICK, "--reference-path", path], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    side = json.loads((tmp_path / "results.json").read_text())["side_by_side"]
    assert set(side) == {"z3", "z2", "hsdp"}
    for layout, row in side.items():
        assert row["same_math"], (layout, row)
        assert row["optimizer_ratio"] > 0
