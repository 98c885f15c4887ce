"""NorMuon: neuron-wise normalization of Muon's orthogonalized update.

NorMuon (Li et al., 2025, arXiv:2510.05491) keeps, per matrix, an EMA of the mean square
of each row of the orthogonalized update ``o`` (one value per output neuron), divides each
row by the root of it, and rescales the result to ``o``'s Frobenius norm, so Muon's
learning rate and its shape adjustment keep their meaning::

    v = v.lerp(mean(o * o, dim=-1), 1 - beta2)        # per row: (..., rows, 1)
    n = o / (sqrt(v) + eps)
    n = n * ||o||_F / (||n||_F + eps)                 # per matrix of a stack

(as the authors' ``normuon.py``). Every quantity is computed from the row sums of
``o * o``: a row's sum and the matrix's two norms (``||n||_F^2`` is the sum of each row's
sum times its scale squared), so a matrix split over tensor-parallel ranks needs one SUM
all-reduce of small tensors: of the row sums where its rows are split across columns
(split along the last dim), of the two norms where its rows are whole on each rank
(split along the rows). The collective is passed in: this module does not import
``torch.distributed``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch.profiler import record_function

__all__ = ["NORMUON_EPS", "normuon_normalize", "second_moment_shape"]

NORMUON_EPS = 1e-10
"""Added to the root of the second moment and to the normalized update's norm."""

AllReduce = Callable[[torch.Tensor], None]
"""SUM-all-reduce a tensor in place over the ranks that hold one matrix's shards."""


def second_moment_shape(shape: Sequence[int]) -> tuple[int, ...]:
    """The shape of the second moment of a parameter (or shard) of ``shape``: one value
    per row of each matrix."""
    return (*shape[:-1], 1)


@torch.no_grad()
@record_function("muon::normuon")
def normuon_normalize(
    orthogonal: Sequence[torch.Tensor],
    second_moments: Sequence[torch.Tensor],
    *,
    beta2: float,
    columns: Sequence[int] | None = None,
    split_dim: int | None = None,
    all_reduce: AllReduce | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """NorMuon's normalization of orthogonalized updates, out of place (nothing it reads
    changes, as the first phase of a step requires).

    Args:
        orthogonal: Newton-Schulz results, 2-D matrices or 3-D stacks (or their
            tensor-parallel shards).
        second_moments: Their second moments, ``second_moment_shape`` of each.
        beta2: EMA factor of the second moment, in ``[0, 1)``.
        columns: The whole matrices' column counts (default: the tensors' own).
        split_dim: The dim along which the tensors are tensor-parallel shards
            (``-1``/last: columns, ``-2``/second to last: rows); None: whole.
        all_reduce: SUM over the shards' ranks; required with ``split_dim``.

    Returns:
        ``(new second moments, normalized updates)``, in the updates' dtype.
    """
    if split_dim is not None and all_reduce is None:
        raise ValueError("normuon_normalize: split_dim needs all_reduce")
    if not orthogonal:
        return [], []
    columns_split = split_dim is not None and split_dim % orthogonal[0].ndim == (
        orthogonal[0].ndim - 1
    )
    row_sums = [o.float().square().sum(dim=-1, keepdim=True) for o in orthogonal]
    if columns_split:  # each rank held a part of every row: one all-reduce for all
        row_sums = _all_reduced(row_sums, all_reduce)
    moments, scales, norms = [], [], []
    for i, (sums, moment) in enumerate(zip(row_sums, second_moments, strict=True)):
        cols = columns[i] if columns is not None else orthogonal[i].shape[-1]
        moment = moment.lerp(sums.div(cols).to(moment.dtype), 1 - beta2)
        scale = 1.0 / (moment.float().sqrt() + NORMUON_EPS)
        moments.append(moment)
        scales.append(scale)
        norms.append(
            torch.stack([sums.sum(dim=(-2, -1)), (sums * scale.square()).sum(dim=(-2, -1))])
        )
    if split_dim is not None and not columns_split:  # each rank held some of the rows
        norms = _all_reduced(norms, all_reduce)
    normalized = []
    for o, scale, (before, after) in zip(orthogonal, scales, norms, strict=True):
        ratio = (before.sqrt() / (after.sqrt() + NORMUON_EPS))[..., None, None]
        normalized.append((o.float() * scale * ratio).to(o.dtype))
    return moments, normalized


def _all_reduced(tensors: list[torch.Tensor], all_reduce: AllReduce) -> list[torch.Tensor]:
    """``tensors`` SUM-reduced over the shards' ranks, in one collective."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    all_reduce(flat)
    return [
        part.view(t.shape)
        for part, t in zip(flat.split([t.numel() for t in tensors]), tensors, strict=True)
    ]
