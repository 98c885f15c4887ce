"""TorchTitan's dry run with DMuon: ``COMM_MODE=fake_backend ./run_train.sh`` (one process
standing for ``NGPU`` ranks on torch's fake process group, one step), as TorchTitan's own
script runs it. DMuon's cross-rank plan check cannot mean anything there (every gather
returns this rank's value): it says so once and takes the owners' ranks from the mesh;
the rest (plan, hooks, Newton-Schulz, the step) runs as in a real job. The plan report
command counts, without a step, what the run's rank logs at start."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys

import pytest

from tests.titan.test_titan_integration import LOSS, ROOT, train_env

PLAN = re.compile(r"dedicate_params: (\d+) parameters \((\d+) matrices\), (\d+) boundaries, "
                  r"(\d+) units over (\d+) x (\d+) ranks")  # fmt: skip
STARTED = re.compile(r"started at the plan's size: (\d+) of (\d+) dedicated parameters held here")
REPORT = re.compile(r"plan report of model part 0: (rank .*\))")
FAKE_NOTE = "dmuon: fake backend (a dry run): every gather returns this rank's value"


def dry_run(ngpu: int, tmp_path, *args: str, config: str = "train_configs/debug_cpu.toml"):
    dump = tmp_path / f"dry_{ngpu}"
    env = dict(train_env(1, dump), NGPU=str(ngpu), COMM_MODE="fake_backend")
    env.pop("RANK", None)
    proc = subprocess.run(
        ["./run_train.sh", "--job.config_file", config, "--job.dump_folder", str(dump), *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    assert f"run_train.sh: NGPU={ngpu} " in output
    assert "--comm.mode fake_backend --training.steps 1" in output
    assert output.count(FAKE_NOTE) == 1, output[-4000:]
    losses = {int(s): float(v) for s, v in LOSS.findall(output)}
    assert sorted(losses) == [1] and math.isfinite(losses[1]), output[-4000:]
    return tuple(int(x) for x in PLAN.search(output).groups()), losses[1], output


def plan_report(ngpu: int, tmp_path, *args: str) -> tuple[str, dict]:
    """The plan report command on the debug config: its line for rank 0, and its JSON."""
    out = tmp_path / f"report_{ngpu}.json"
    proc = subprocess.run(
        [sys.executable, "-m", "torchtitan_dmuon.titan.plan_report", "--ngpu",
         str(ngpu), "--job.config_file", "train_configs/debug_cpu.toml", "--out", str(out), *args],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return REPORT.search(proc.stdout).group(1), json.loads(out.read_text())


@pytest.mark.slow
def test_dry_run_from_8_to_1024_ranks(tmp_path):
    """The debug llama3 (42 matrices) at 8 and 1024 FSDP ranks, HSDP 8 x 8 and TP 2 x
    FSDP 8, and qwen3's MoE debug config (EP 2) at 8: each builds its plan over the
    simulated ranks, starts at its size (the simulated rank allocates only the matrices
    it holds) and trains its step to a finite loss. Two dry runs at 8 give the same
    loss: a receiver of a fake broadcast holds the same init-scale weights every time
    (the engine's uninitialized buffers steered it differently run to run, e.g. NaN)."""
    # One Newton-Schulz dtype for the run and the command (the run's "auto" depends on
    # the CPU; the command counts "auto" as a GPU's bf16).
    fp32 = ("--dmuon.ns_dtype", "float32")
    first = dry_run(8, tmp_path, *fp32)
    assert dry_run(8, tmp_path, *fp32)[:2] == first[:2]
    assert first[0] == (42, 42, 6, 42, 1, 8)
    held, total = map(int, STARTED.search(first[2]).groups())
    assert total == 42 and 1 <= held < 42  # its owned matrices, by the LPT plan
    # The plan report command prints the line the run logged at start, counted alike.
    line, report = plan_report(8, tmp_path, *fp32)
    assert REPORT.search(first[2]).group(1) == line
    assert report["parts"][0]["summary"]["idle"] == 0 and len(report["parts"][0]["ranks"]) == 8
    # Owner groups of 16 at 1024 ranks, forced (for 256-wide matrices the planner keeps
    # one owner each: test_owner_groups), each rank a block (42 x 16 units); the 42
    # matrices fill 42 of the 64 groups.
    groups = (*fp32, "--dmuon.owner_group_size", "16")
    plan, _, output = dry_run(1024, tmp_path, *groups)
    assert plan == (42, 42, 6, 42 * 16, 1, 1024)
    assert "Z3, owner groups of 16" in output
    assert "352 of 1024 ranks run no Newton-Schulz" in output
    line, report = plan_report(1024, tmp_path, *groups)
    assert REPORT.search(output).group(1) == line
    assert report["parts"][0]["summary"]["idle"] == 352
    assert sum(r["owned"] for r in report["parts"][0]["ranks"]) == 42 * 16
    # The simulated rank allocated at most its one owned matrix of the 42.
    held, total = map(int, STARTED.search(output).groups())
    assert total == 42 and held <= 1
    hsdp = dry_run(64, tmp_path, "--parallelism.data_parallel_replicate_degree", "8")
    assert hsdp[0] == (42, 42, 6, 42, 8, 8)  # the planner's: one owner per matrix
    tp = dry_run(16, tmp_path, "--parallelism.tensor_parallel_degree", "2")
    assert tp[0] == (42, 42, 6, 42, 1, 8)
    moe = dry_run(8, tmp_path, config="train_configs/qwen3_debug_moe.toml")[0]
    # 8 layers: 32 attention matrices and 24 expert stacks of 64 experts (1568 matrices).
    assert moe == (56, 1568, 16, 64, 1, 8)
