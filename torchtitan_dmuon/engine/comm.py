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

__all__ = ["CollectiveCounter", "CommStats", "all_reduce_sum", "broadcast", "reduce_sum"]


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


class CollectiveCounter:
    """Counts the payload bytes every ``torch.distributed`` collective gets on this rank,
    by kind, while active (a context manager).

    It wraps the ``torch.distributed`` functions themselves, so it sees FSDP2's, the
    engine's and anyone else's collectives alike, independently of :class:`CommStats`.
    The payload of a gather is its output and of a scatter its input (what crosses the
    network per rank, up to the algorithm's constant).
    """

    _PAYLOAD = {
        "broadcast": ("tensor", 0),
        "reduce": ("tensor", 0),
        "all_reduce": ("tensor", 0),
        "all_gather_single": ("output", 0),
        "all_gather_into_tensor": ("output_tensor", 0),
        "reduce_scatter_single": ("input", 1),
        "reduce_scatter_tensor": ("input", 1),
        "all_to_all_single": ("output", 0),
    }

    def __init__(self) -> None:
        self.bytes = Counter()
        self.calls = Counter()
        self._originals: dict[str, object] = {}

    def __enter__(self) -> CollectiveCounter:
        for kind, (keyword, position) in self._PAYLOAD.items():
            original = getattr(dist, kind)
            self._originals[kind] = original

            def counted(*args, _kind=kind, _kw=keyword, _pos=position, _f=original, **kwargs):
                tensor = kwargs[_kw] if _kw in kwargs else args[_pos]
                self.bytes[_kind] += tensor.numel() * tensor.element_size()
                self.calls[_kind] += 1
                return _f(*args, **kwargs)

            setattr(dist, kind, counted)
        return self

    def __exit__(self, *exc) -> None:
        for kind, original in self._originals.items():
            setattr(dist, kind, original)
        self._originals.clear()

    def snapshot(self) -> dict[str, dict[str, int]]:
        return {"bytes": dict(self.bytes), "calls": dict(self.calls)}
