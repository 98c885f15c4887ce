"""The Newton-Schulz of tensor-parallel matrices, run together by an owner column's TP
ranks.

A tensor-parallel matrix is split along one dim over the TP group; its owner column's TP
ranks each keep their shard, receive its reduced gradient and orthogonalize the matrix
together: by the Gram path (one all-reduce of the unsplit dim's Gram per phase, never
gathering the matrix) where that moves fewer bytes and the backend has a sharded form,
else on the gathered matrix. The math is in ``optim/sharded_ns.py``; this holds the group,
counts the bytes and logs each shape's method once.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from torchtitan_dmuon.engine.comm import CommStats
from torchtitan_dmuon.optim.sharded_ns import (
    SHARDED_BACKENDS,
    gathered_newton_schulz,
    sharded_newton_schulz,
    sharded_ns_bytes,
    sharded_ns_method,
)

__all__ = ["TensorParallelNS"]

logger = logging.getLogger(__name__)


class TensorParallelNS:
    """Newton-Schulz over one tensor-parallel group.

    Attributes:
        group: The engine's tensor-parallel group.
        stats: Where its collectives are counted (``tp_gather``, ``tp_all_reduce``).
    """

    def __init__(self, group: dist.ProcessGroup, stats: CommStats) -> None:
        self.group = group
        self.stats = stats
        self._ns_methods: dict[tuple, str] = {}

    def gather_shards(self, shard: torch.Tensor) -> list[torch.Tensor]:
        """Every tensor-parallel rank's shard (same shapes), in rank order."""
        size = dist.get_world_size(self.group)
        out = shard.new_empty((size * shard.shape[0], *shard.shape[1:]))
        self.stats.record("tp_gather", out)
        dist.all_gather_into_tensor(out, shard.contiguous(), group=self.group)
        return list(out.chunk(size))

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """SUM-all-reduce ``tensor`` in place over the TP ranks (``tp_all_reduce``)."""
        self.stats.record("tp_all_reduce", tensor)
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)

    def sharded_ns(
        self, split_dim: int, ns, schedule, *, eps: float, dtype: torch.dtype, backend: str
    ):
        """Newton-Schulz of tensor-parallel shards split along ``split_dim``, run together
        by the owner column's TP ranks: the Gram path (one all-reduce of the unsplit dim's
        Gram per phase) unless gathering the matrix moves fewer bytes or ``backend`` has
        no sharded form (then ``ns`` on the gathered matrix). Logged once per shape."""
        size = dist.get_world_size(self.group)
        rank = dist.get_rank(self.group)

        def orthogonalize(shards: torch.Tensor) -> torch.Tensor:
            full = list(shards.shape)
            full[split_dim] *= size
            method = sharded_ns_method(
                full, split_dim, dtype.itemsize, schedule.steps, backend=backend
            )
            key = (tuple(full[-2:]), split_dim)
            if key not in self._ns_methods:
                self._ns_methods[key] = method
                bytes_per_matrix = sharded_ns_bytes(
                    full[-2:], split_dim, dtype.itemsize, schedule.steps
                )
                why = (
                    f"ns_backend={backend!r} has no sharded form"
                    if backend not in SHARDED_BACKENDS
                    else "by bytes"
                )
                logger.info(
                    "dmuon: tensor-parallel Newton-Schulz of %s split along dim %d over %d "
                    "ranks: %s (%s; bytes per matrix: %s)",
                    key[0], split_dim, size, method, why, bytes_per_matrix,
                )  # fmt: skip
            if method == "gram":
                return sharded_newton_schulz(
                    shards, split_dim, self.all_reduce, schedule, eps=eps, dtype=dtype
                )
            return gathered_newton_schulz(shards, split_dim, rank, self.gather_shards, ns)

        return orthogonalize
