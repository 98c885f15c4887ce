"""Newton-Schulz of a matrix split over ranks (tensor parallelism), never gathered.

A TP plan splits a matrix along one dim: Colwise its rows, Rowwise its columns. Each rank
holds one shard. Newton-Schulz needs the Gram matrix over the dim that is NOT split, and
that Gram is a sum of per-shard Grams: for ``X`` split along columns,
``X X^T = sum_t X_t X_t^T``; split along rows, ``X^T X = sum_t X_t^T X_t``. So each phase
of Gram Newton-Schulz (:mod:`.kernels.gram_ns`) costs one SUM all-reduce of a
``(unsplit dim)^2`` matrix, the polynomial factor is computed identically on every rank
and applied to each shard locally; the Frobenius norm is the square root of the first
reduced Gram's trace. The alternative, gather-NS-scatter, moves the matrix itself; which
one moves fewer bytes depends on the shape and the split (:func:`sharded_ns_method`). The
Gram path is the ``"gram"`` backend's algorithm; a matrix under another named backend
(``"torch"``, ``"triton"``) is gathered and orthogonalized by that backend.

The collectives are passed in as functions, so this module stays pure math: it does not
import ``torch.distributed``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Literal

import torch

from torchtitan_dmuon.optim.kernels.gram_ns import (
    RESTARTS,
    apply_factor,
    gram,
    gram_factor,
    gram_phases,
)
from torchtitan_dmuon.optim.newton_schulz import EPS, NSSchedule

__all__ = [
    "SHARDED_BACKENDS",
    "ShardedNSMethod",
    "gathered_newton_schulz",
    "sharded_newton_schulz",
    "sharded_ns_bytes",
    "sharded_ns_method",
    "split_newton_schulz",
    "split_ns_bytes",
]

ShardedNSMethod = Literal["gram", "gather"]

SHARDED_BACKENDS = ("gram", "auto")
"""The ``ns_backend`` values whose Newton-Schulz may run as the sharded Gram path."""

AllReduce = Callable[[torch.Tensor], None]
"""SUM-all-reduce a tensor in place over the ranks that hold the shards."""

AllGather = Callable[[torch.Tensor], list[torch.Tensor]]
"""Every rank's shard, in rank order (the shards of one matrix all have one shape)."""


def _unsplit_dim(shape: Sequence[int], split_dim: int) -> int:
    if split_dim not in (-2, -1, len(shape) - 2, len(shape) - 1):
        raise ValueError(
            f"split_dim must be one of the last two dims of a {len(shape)}-D shard, got {split_dim}"
        )
    return shape[-1] if split_dim % len(shape) == len(shape) - 2 else shape[-2]


def sharded_newton_schulz(
    shard: torch.Tensor,
    split_dim: int,
    all_reduce: AllReduce,
    schedule: NSSchedule,
    *,
    eps: float = EPS,
    dtype: torch.dtype = torch.float32,
    restarts: Sequence[int] = RESTARTS,
) -> torch.Tensor:
    """This rank's shard of the Newton-Schulz result of the whole (split) matrix.

    Every rank holding a shard calls it with the same arguments but its own shard. One
    SUM all-reduce of a ``(unsplit dim)^2`` Gram per phase (:func:`gram_phases`).

    Args:
        shard: This rank's ``(rows, cols)`` piece (or a ``(batch, rows, cols)`` stack of
            pieces of same-shape matrices), split along ``split_dim``.
        split_dim: The dim the matrix is split along (-2: rows, -1: columns).
        all_reduce: SUM-all-reduces a tensor in place over the shard holders.
        schedule: Coefficients per step and normalization.
        eps: Floor of the normalizing norm.
        dtype: Compute dtype.
        restarts: Steps after which the Gram loop restarts (see :func:`gram_phases`).

    Returns:
        This rank's shard of the result, same shape as ``shard``, in ``dtype``.
    """
    _unsplit_dim(shard.shape, split_dim)
    rows_split = split_dim % shard.ndim == shard.ndim - 2
    # Orient so that the split dim is the columns: the Gram is over the rows.
    x = shard.to(dtype, copy=True)
    x = x.mT if rows_split else x
    for i, phase in enumerate(gram_phases(schedule.coefficients, restarts)):
        r = gram(x)
        all_reduce(r)
        if i == 0:
            # ||X||_F^2 = trace(X X^T): normalize both the shard and its Gram.
            trace = r.diagonal(dim1=-2, dim2=-1).sum(-1)
            norm = (trace.sqrt() * schedule.norm_scale).clamp(min=eps)
            norm = norm.reshape(*norm.shape, 1, 1)
            x = x / norm
            r = r / (norm * norm)
        x = apply_factor(gram_factor(r, phase), x)
    return x.mT if rows_split else x


def split_newton_schulz(
    block: torch.Tensor,
    split_dim: int,
    all_reduce: AllReduce,
    schedule: NSSchedule,
    *,
    eps: float = EPS,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """This rank's block of :func:`~torchtitan_dmuon.optim.newton_schulz.newton_schulz` of
    a whole matrix split into equal blocks along its long side (an owner group's matrix):
    every iteration ``X <- a X + (b A + c A^2) X`` with ``A = X X^T`` a SUM over the blocks
    (one all-reduce of a ``(short side)^2`` matrix per step, and one of the squared norm
    first).

    Each member applies the polynomial to its own ``m x w`` block. When the block is
    narrower than the short side ``m`` (``w < m``), ``a X + A (b X + c A X)`` is cheaper
    than forming ``A^2`` (``3 m^2 w`` against ``2 m^2 w + m^3`` multiply-adds): a member's
    work then falls with the group size instead of stopping at the ``m^3`` every member
    would compute whole (:func:`~torchtitan_dmuon.optim.newton_schulz.split_ns_flops`).
    Both are the same polynomial; in fp32 they agree with the torch backend to rounding.

    Args:
        block: This rank's ``(rows, cols)`` block (or a ``(batch, rows, cols)`` stack of
            blocks of same-shape matrices).
        split_dim: The dim the whole matrix is split along (-2: rows, -1: columns): its
            long side (columns when square).
        all_reduce: SUM-all-reduces a tensor in place over the block holders.
        schedule: Coefficients per step and normalization.
        eps: Floor of the normalizing norm.
        dtype: Compute dtype.

    Returns:
        This rank's block of the result, same shape as ``block``, in ``dtype``.
    """
    _unsplit_dim(block.shape, split_dim)
    rows_split = split_dim % block.ndim == block.ndim - 2
    # Oriented as newton_schulz orients the whole matrix: short side first, so the split
    # (long) side is the columns and X X^T a sum of the blocks' own.
    x = block.to(dtype, copy=True)
    x = x.mT if rows_split else x
    squares = x.square().sum(dim=(-2, -1))
    all_reduce(squares)
    norm = (squares.sqrt() * schedule.norm_scale).clamp(min=eps)
    x = x / norm.reshape(*norm.shape, 1, 1)
    mm = torch.addmm if x.ndim == 2 else torch.baddbmm
    narrow = x.shape[-1] < x.shape[-2]
    for a, b, c in schedule.coefficients:
        gram = x @ x.mT
        all_reduce(gram)
        if narrow:
            x = mm(x, gram, mm(x, gram, x, beta=b, alpha=c), beta=a)
        else:
            x = mm(x, mm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.mT if rows_split else x


def split_ns_bytes(shape: Sequence[int], element_size: int, steps: int) -> int:
    """Payload bytes per rank of :func:`split_newton_schulz` for one whole matrix (or
    stack) of ``shape`` in ``element_size``-byte elements: a short-side Gram per step and
    the squared norm."""
    batch = math.prod(shape[:-2])
    short = min(shape[-2:])
    return batch * (steps * short * short + 1) * element_size


def gathered_newton_schulz(
    shard: torch.Tensor,
    split_dim: int,
    rank: int,
    all_gather: AllGather,
    ns: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """This rank's shard of ``ns`` of the whole matrix, gathered from its shards.

    Every rank gathers the matrix (one all-gather of its size) and runs ``ns`` on it,
    then keeps its own piece (``rank``: its place among the shards); the duplicated
    Newton-Schulz replaces a scatter.
    """
    _unsplit_dim(shard.shape, split_dim)
    full = ns(torch.cat(all_gather(shard), dim=split_dim))
    size = shard.size(split_dim)
    return full.narrow(split_dim, rank * size, size)


def sharded_ns_bytes(
    shape: Sequence[int],
    split_dim: int,
    element_size: int,
    steps: int,
    restarts: Sequence[int] = RESTARTS,
) -> dict[ShardedNSMethod, int]:
    """Payload bytes per rank of each method for one whole matrix (or stack) of ``shape``
    split along ``split_dim``: the all-reduced Grams (one per phase) or the gathered
    matrix."""
    unsplit = _unsplit_dim(shape, split_dim)
    batch = math.prod(shape[:-2])
    phases = 1 + len({r for r in restarts if 0 < r < steps})
    rows, cols = shape[-2:]
    return {
        "gram": batch * phases * unsplit * unsplit * element_size,
        "gather": batch * rows * cols * element_size,
    }


def sharded_ns_method(
    shape: Sequence[int],
    split_dim: int,
    element_size: int,
    steps: int,
    restarts: Sequence[int] = RESTARTS,
    backend: str = "gram",
) -> ShardedNSMethod:
    """``"gram"`` unless gathering the matrix moves fewer bytes (a matrix whose unsplit
    dim is its long one, e.g. a 1024 x 4096 K/V projection split on its rows) or
    ``backend`` has no sharded form (not in :data:`SHARDED_BACKENDS`): then ``"gather"``."""
    if backend not in SHARDED_BACKENDS:
        return "gather"
    cost = sharded_ns_bytes(shape, split_dim, element_size, steps, restarts)
    return "gram" if cost["gram"] <= cost["gather"] else "gather"
