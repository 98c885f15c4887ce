"""Newton-Schulz of a matrix split over ranks (tensor parallelism): the Gram path equals NS
of the whole matrix and moves only the all-reduced Grams; the gather path equals it too
and moves the matrix; the choice between them follows the bytes."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist
from torch.utils.flop_counter import FlopCounterMode

from tests.support.collectives import CollectiveCounter
from tests.support.dist import run_distributed
from torchtitan_dmuon.optim.newton_schulz import (
    newton_schulz,
    resolve_ns_schedule,
    split_ns_flops,
)
from torchtitan_dmuon.optim.sharded_ns import (
    gathered_newton_schulz,
    sharded_newton_schulz,
    sharded_ns_bytes,
    sharded_ns_method,
    split_newton_schulz,
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


class _ThreadGroup:
    """SUM-all-reduce among threads, each standing for one member of an owner group."""

    def __init__(self, size: int) -> None:
        self.slots: list[torch.Tensor | None] = [None] * size
        self.barrier = threading.Barrier(size)

    def all_reduce(self, member: int, t: torch.Tensor) -> None:
        self.slots[member] = t
        self.barrier.wait()
        total = torch.stack(self.slots).sum(0)  # every member adds in member order
        self.barrier.wait()
        t.copy_(total)


def _split_run(full: torch.Tensor, split_dim: int, parts: int):
    """Each member's block of split_newton_schulz and the FLOPs it ran, members as threads."""
    group = _ThreadGroup(parts)
    blocks = full.chunk(parts, dim=split_dim)
    results: list = [None] * parts

    def member(i: int) -> None:
        with FlopCounterMode(display=False) as flops:
            out = split_newton_schulz(
                blocks[i], split_dim, lambda t: group.all_reduce(i, t), SCHEDULE
            )
        results[i] = (out, flops.get_total_flops())

    threads = [threading.Thread(target=member, args=(i,)) for i in range(parts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


@pytest.mark.parametrize(
    "shape, parts",
    [
        ((256, 1024), 2),  # blocks 256 x 512: wider than the short side, A^2 formed
        ((256, 1024), 8),  # blocks 256 x 128: narrower, two products with A instead
        ((1024, 256), 4),  # split on the rows (the long side)
        ((512, 512), 2),  # square: split on the columns, 512 x 256 blocks
        ((2, 128, 512), 8),  # a stack, 128 x 64 blocks
    ],
)
def test_split_ns_equals_whole_matrix_ns(shape, parts):
    """An owner group's Newton-Schulz: each member's block equals its block of NS of the
    whole matrix within 1e-5 (fp32), and each member runs the multiply-adds
    split_ns_flops counts (one fewer power of the short side once the blocks are narrow)."""
    full = _matrix(shape)
    split_dim = -2 if shape[-2] > shape[-1] else -1
    expected = newton_schulz(full, SCHEDULE, dtype=torch.float32).chunk(parts, dim=split_dim)
    for i, (out, flops) in enumerate(_split_run(full, split_dim, parts)):
        assert (out - expected[i]).abs().max().item() < 1e-5, i
        # FlopCounterMode counts the matrix products only (the norm is elementwise).
        assert flops == split_ns_flops(shape, SCHEDULE.steps, parts), i
