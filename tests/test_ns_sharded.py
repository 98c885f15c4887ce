"""Newton-Schulz of a matrix split over ranks (tensor parallelism): the Gram path equals NS
of the whole matrix and moves only the all-reduced Grams; the gather path equals it too
and moves the matrix; the choice between them follows the bytes."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.dist import run_distributed
from torchtitan_dmuon.engine.comm import CollectiveCounter
from torchtitan_dmuon.optim.newton_schulz import newton_schulz, resolve_ns_schedule
from torchtitan_dmuon.optim.sharded_ns import (
    gathered_newton_schulz,
    sharded_newton_schulz,
    sharded_ns_bytes,
    sharded_ns_method,
)

SHAPES = [(256, 1024), (1024, 256), (512, 512), (2, 128, 256)]
SCHEDULE = resolve_ns_schedule("quintic", 5)
PHASES = 2  # the default restart after step 2


def _matrix(shape) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape)))


def _all_reduce(t: torch.Tensor) -> None:
    dist.all_reduce(t, op=dist.ReduceOp.SUM)


def _all_gather(t: torch.Tensor) -> list[torch.Tensor]:
    world = dist.get_world_size()
    out = t.new_empty((world * t.shape[0], *t.shape[1:]))
    dist.all_gather_into_tensor(out, t.contiguous())
    return list(out.chunk(world))


def sharded_worker(rank, world):
    results = []
    for shape in SHAPES:
        full = _matrix(shape)
        expected = newton_schulz(full, SCHEDULE, dtype=torch.float32)
        for split_dim in (-2, -1):
            shard = full.chunk(world, dim=split_dim)[rank]
            mine = expected.chunk(world, dim=split_dim)[rank]
            with CollectiveCounter() as gram_counter:
                by_gram = sharded_newton_schulz(shard, split_dim, _all_reduce, SCHEDULE)
            with CollectiveCounter() as gather_counter:
                by_gather = gathered_newton_schulz(
                    shard,
                    split_dim,
                    rank,
                    _all_gather,
                    lambda m: newton_schulz(m, SCHEDULE, dtype=torch.float32),
                )
            results.append(
                {
                    "shape": shape,
                    "split_dim": split_dim,
                    "gram_error": (by_gram - mine).abs().max().item(),
                    "gather_error": (by_gather - mine).abs().max().item(),
                    "gram_bytes": gram_counter.snapshot()["bytes"],
                    "gather_bytes": gather_counter.snapshot()["bytes"],
                }
            )
    return results


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_ns_equals_whole_matrix_ns(world):
    """256x1024, 1024x256, 512x512 and a stack of two 128x256, split over 2 and 4 ranks on
    rows and on columns: both paths equal NS of the whole matrix within 1e-5 (fp32); the
    Gram path all-reduces one (unsplit dim)^2 Gram per phase and gathers nothing."""
    for rank_results in run_distributed(sharded_worker, world, timeout=300):
        for r in rank_results:
            case = (r["shape"], r["split_dim"])
            assert r["gram_error"] < 1e-5, case
            assert r["gather_error"] < 1e-5, case
            expected = sharded_ns_bytes(r["shape"], r["split_dim"], 4, SCHEDULE.steps)
            assert r["gram_bytes"] == {"all_reduce": expected["gram"]}, case
            assert r["gather_bytes"] == {"all_gather_into_tensor": expected["gather"]}, case
            *batch, rows, cols = r["shape"]
            unsplit = cols if r["split_dim"] == -2 else rows
            assert expected["gram"] == (batch or [1])[0] * PHASES * unsplit * unsplit * 4


@pytest.mark.parametrize(
    "shape, split_dim, method",
    [
        ((1024, 4096), -2, "gather"),  # K/V projection, Colwise: the unsplit dim is 4096
        ((14336, 4096), -2, "gram"),  # FFN w1/w3, Colwise: a 4096^2 Gram per phase
        ((4096, 14336), -1, "gram"),  # FFN w2, Rowwise
        ((4096, 4096), -2, "gather"),  # square, two phases: the Grams are twice the matrix
    ],
)
def test_method_follows_the_bytes(shape, split_dim, method):
    assert sharded_ns_method(shape, split_dim, 2, SCHEDULE.steps) == method
    one_phase = sharded_ns_bytes(shape, split_dim, 2, SCHEDULE.steps, restarts=())
    assert (
        one_phase["gram"] * PHASES == sharded_ns_bytes(shape, split_dim, 2, SCHEDULE.steps)["gram"]
    )


def test_split_dim_must_be_a_matrix_dim():
    with pytest.raises(ValueError, match="split_dim"):
        sharded_newton_schulz(torch.randn(2, 4, 8), 0, _all_reduce, SCHEDULE)
