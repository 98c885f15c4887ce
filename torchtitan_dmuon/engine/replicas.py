"""HSDP's second stage: gradients across replicas to the primary, new values back.

Under a (replicate, shard) = R x G layout each owner column exists once per replica.
Gradients already summed inside each shard group are summed once more across the
replicate group onto the primary replica; after the step the primary's new values are
broadcast to its column in the other replicas, synchronously or (``replicate_async``) in
the background, each unit's broadcast waited on right before the unit is next read.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.profiler import record_function

from torchtitan_dmuon.engine import comm
from torchtitan_dmuon.engine.unit import Unit

__all__ = ["Replicas"]


class Replicas:
    """The replicate group of one dedication and its in-flight broadcasts.

    Attributes:
        group: The engine's own group over the replicate dimension.
        rank: This rank's replicate-group rank (its replica).
        size: Number of replicas.
    """

    def __init__(self, group: dist.ProcessGroup, rank: int, size: int, stats: comm.CommStats):
        self.group = group
        self.rank = rank
        self.size = size
        self._stats = stats
        self._in_flight: dict[Unit, list[dist.Work]] = {}

    def reduce_to_primary(self, unit: Unit, bucket: torch.Tensor) -> dist.Work:
        """SUM a column's bucket across replicas onto the primary replica."""
        return comm.reduce_sum(
            bucket, unit.primary_replica, self.group, self._stats, "replicate_reduce"
        )

    def broadcast(self, units: list[Unit], async_op: bool) -> None:
        """Send each held unit's values from its primary to its column in the other
        replicas."""
        with record_function("dmuon::replicate_broadcast"):
            for unit in units:
                if not unit.holds:
                    continue
                works = [
                    comm.broadcast(
                        buffer,
                        unit.primary_replica,
                        self.group,
                        self._stats,
                        "replicate_broadcast",
                    )  # fmt: skip
                    for buffer in unit.buffers
                ]
                if async_op:
                    self._in_flight[unit] = works
                else:
                    for work in works:
                        work.wait()

    def landed(self, units: list[Unit]) -> bool:
        """No broadcast into these units is still in flight (a timing question: the
        answer may differ between ranks)."""
        return all(w.is_completed() for unit in units for w in self._in_flight.get(unit, ()))

    def wait(self, unit: Unit) -> None:
        works = self._in_flight.pop(unit, None)
        if works is not None:
            with record_function(f"dmuon::replicate_wait b{unit.plan.boundary}"):
                for work in works:
                    work.wait()

    def wait_all(self) -> None:
        for unit in list(self._in_flight):
            self.wait(unit)
