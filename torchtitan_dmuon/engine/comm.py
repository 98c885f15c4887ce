"""Collectives of the ownership engine, with byte accounting.

Every collective the engine issues goes through here, so that the per-step figures a user
sees (bytes broadcast and reduced, collective counts) are counted where they happen.
``torch.distributed`` functions are looked up at call time, so a test can wrap them.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

__all__ = ["CommStats", "broadcast", "reduce_sum", "all_reduce_sum"]


@dataclass
class CommStats:
    """Running totals of what the engine sent through collectives on this rank.

    Attributes:
        bytes: Payload bytes per collective kind (``"broadcast"`` and ``"reduce"`` inside
            the shard group, ``"replicate_broadcast"`` and ``"replicate_reduce"`` across
            HSDP replicas, ``"all_reduce"``), counted once per collective on each rank.
        calls: Number of collectives per kind.
    """

    bytes: Counter = field(default_factory=Counter)
    calls: Counter = field(default_factory=Counter)

    def record(self, kind: str, tensor: torch.Tensor) -> None:
        self.bytes[kind] += tensor.numel() * tensor.element_size()
        self.calls[kind] += 1

    def snapshot(self) -> dict[str, dict[str, int]]:
        return {"bytes": dict(self.bytes), "calls": dict(self.calls)}


def broadcast(
    tensor: torch.Tensor,
    group_src: int,
    group: dist.ProcessGroup,
    stats: CommStats,
    kind: str = "broadcast",
) -> dist.Work:
    """Asynchronously broadcast ``tensor`` from group rank ``group_src``; counted as
    ``kind``."""
    stats.record(kind, tensor)
    return dist.broadcast(tensor, group=group, group_src=group_src, async_op=True)


def reduce_sum(
    tensor: torch.Tensor,
    group_dst: int,
    group: dist.ProcessGroup,
    stats: CommStats,
    kind: str = "reduce",
) -> dist.Work:
    """Asynchronously SUM-reduce ``tensor`` onto group rank ``group_dst``; counted as
    ``kind``.

    SUM, not AVG: gloo has neither AVG nor PREMUL_SUM, so the owner divides once.
    """
    stats.record(kind, tensor)
    return dist.reduce(
        tensor, group=group, group_dst=group_dst, op=dist.ReduceOp.SUM, async_op=True
    )


def all_reduce_sum(
    tensor: torch.Tensor, group: dist.ProcessGroup | None, stats: CommStats
) -> dist.Work:
    """Asynchronously SUM-all-reduce ``tensor`` (``group=None``: the default group)."""
    stats.record("all_reduce", tensor)
    return dist.all_reduce(tensor, group=group, op=dist.ReduceOp.SUM, async_op=True)
