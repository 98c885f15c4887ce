"""DCP checkpoints of DMuon through TorchTitan 0.3's own checkpointer: saved by 4 FSDP2
ranks (asynchronously), loaded by 2 x 2 HSDP (other owners) and by 2 ranks (another world
size).

What a load gives is exact: every parameter (fused QKV included, which 0.3 saves as its
``wq``/``wk``/``wv`` through its own state-dict hooks) and every Muon momentum, merged
over the ranks that hold them, bit-equal to the saving run's after the saved step; the
optimizer's state is created without a step on every rank alike (0.3's
``init_optim_state`` would step only where a rank's state is empty). The HSDP run, which
reads the same data as the 4 saving ranks, continues their losses and values.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from tests.support.titan03_recording import train_recorded

NS = ["--dmuon.ns_dtype", "float32", "--dmuon.ns_backend", "torch"]
SAVED_STEP, STEPS = 3, 5
HSDP = ["--parallelism.data_parallel_replicate_degree", "2",
        "--parallelism.data_parallel_shard_degree", "2"]  # fmt: skip


def _run(record: Path, ranks: int, steps: int, *flags: str) -> dict[int, float]:
    record.mkdir()
    run = train_recorded(record, ranks, "--training.steps", str(steps), *NS, *flags)
    assert run.returncode == 0, (run.stdout + run.stderr)[-6000:]
    return torch.load(record / "losses.pt")


def _momenta(record: Path, name: str, ranks: int) -> dict[str, torch.Tensor]:
    """Every Muon momentum the ranks' optimizer state dicts hold (each on its owner)."""
    merged: dict[str, torch.Tensor] = {}
    for rank in range(ranks):
        for key, value in torch.load(record / f"momentum_{name}_r{rank}.pt").items():
            assert key not in merged, f"{key} saved by two ranks"
            merged[key] = value
    return merged


def _assert_equal(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(actual[name], value, rtol=0, atol=0, msg=name)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, dict[int, float]]:
    """4 FSDP2 ranks, 5 steps, a checkpoint at step 3 (and the last), saved as 0.3's
    ``async_mode = "async"`` saves (staged, then written by a thread while training goes
    on; deepseek_v3's resume test saves synchronously)."""
    record = tmp_path_factory.mktemp("saved") / "run"
    losses = _run(
        record, 4, STEPS, "--checkpoint.enable", "--checkpoint.interval", str(SAVED_STEP),
        "--checkpoint.async_mode", "async", "--record_steps", str(SAVED_STEP),
    )  # fmt: skip
    return record, losses


def _resume(saved_record: Path, record: Path, ranks: int, steps: int, *flags: str):
    checkpoint = saved_record / "dump" / "checkpoint" / f"step-{SAVED_STEP}"
    return _run(
        record, ranks, steps, "--checkpoint.enable",
        "--checkpoint.initial_load_path", str(checkpoint),
        "--checkpoint.no-initial_load_model_only", *flags,
    )  # fmt: skip


def test_the_checkpoint_holds_each_matrix_once_by_its_name(saved):
    """TorchTitan's names: the fused projection as its three matrices; one momentum per
    Muon matrix (the fused weight's whole)."""
    record, _ = saved
    checkpoint = record / "dump" / "checkpoint" / f"step-{SAVED_STEP}"
    keys = set(FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata)
    layer = "layers.0.attention.qkv_linear"
    assert {f"{layer}.{w}.weight" for w in ("wq", "wk", "wv")} <= keys
    assert f"{layer}.wqkv.weight" not in keys
    assert f"optimizer.state.{layer}.wqkv.weight.momentum_buffer" in keys
    assert len(_momenta(record, f"after_{SAVED_STEP}", 4)) == 30


def test_hsdp_over_other_owners_loads_exactly_and_continues(saved, tmp_path):
    saved_record, saved_losses = saved
    losses = _resume(saved_record, tmp_path / "hsdp", 4, STEPS, *HSDP)
    record = tmp_path / "hsdp"
    _assert_equal(torch.load(record / "start.pt"), torch.load(saved_record / "after_3.pt"))
    # Under HSDP each momentum is in the state dict of its primary owner only (replica 0).
    _assert_equal(_momenta(record, "start", 4), _momenta(saved_record, "after_3", 4))
    assert sorted(losses) == [4, 5]
    assert [losses[s] for s in (4, 5)] == pytest.approx([saved_losses[s] for s in (4, 5)], rel=1e-5)
    final, expected = torch.load(record / "final.pt"), torch.load(saved_record / "final.pt")
    for name, value in expected.items():
        torch.testing.assert_close(final[name], value, rtol=1e-5, atol=1e-5, msg=name)


def test_another_world_size_loads_exactly(saved, tmp_path):
    saved_record, _ = saved
    # TorchTitan's dataloader state is per data-parallel rank: left out (its own rule).
    flags = ["--checkpoint.exclude_from_loading", "dataloader"]
    losses = _resume(saved_record, tmp_path / "two", 2, SAVED_STEP + 1, *flags)
    record = tmp_path / "two"
    _assert_equal(torch.load(record / "start.pt"), torch.load(saved_record / "after_3.pt"))
    _assert_equal(_momenta(record, "start", 2), _momenta(saved_record, "after_3", 4))
    assert sorted(losses) == [SAVED_STEP + 1]
