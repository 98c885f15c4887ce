"""Functional core of the Muon update, following torch.optim.Muon's conventions.

For each matrix parameter ``p`` with gradient ``g`` and momentum buffer ``buf``::

    buf.lerp_(g, 1 - momentum)                        # EMA momentum
    u = g.lerp(buf, momentum) if nesterov else buf    # Nesterov look-ahead
    o = newton_schulz(u)                              # orthogonalize
    p.mul_(1 - lr * weight_decay)                     # decoupled weight decay (skipped at 0)
    p.add_(o, alpha=-adjusted_lr(lr, p.shape))

A 3-D parameter is a stack of independent matrices (MoE experts stored as one
``(experts, rows, cols)`` tensor): each matrix of the stack is orthogonalized on its own, as
if it were a separate parameter. Matrices of the same shape, from any parameters, run as
one batch. This module does not import ``torch.distributed``: the ownership engine decides
which matrices a rank steps.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Sequence

import torch
from torch.profiler import record_function

from torchtitan_dmuon.optim.newton_schulz import matrix_count

__all__ = ["ADJUST_LR_FNS", "adjusted_lr", "muon_step", "NSFunction"]

ADJUST_LR_FNS = (None, "original", "match_rms_adamw", "spectral")
"""Accepted values of ``adjust_lr_fn``."""

NSFunction = Callable[[torch.Tensor], torch.Tensor]
"""Orthogonalizes a 2-D matrix or a 3-D batch (see ``newton_schulz``)."""


def adjusted_lr(lr: float, adjust_lr_fn: str | None, shape: Sequence[int]) -> float:
    """Scale the learning rate for an ``A x B`` matrix (the last two dims of ``shape``).

    ``None``/``"original"``: ``sqrt(max(1, A/B))`` (Keller Jordan's Muon);
    ``"match_rms_adamw"``: ``0.2 * sqrt(max(A, B))`` (Moonshot, reuses AdamW's lr);
    ``"spectral"``: ``sqrt(A/B)`` (spectral-norm scaling).
    """
    rows, cols = shape[-2], shape[-1]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        ratio = math.sqrt(max(1, rows / cols))
    elif adjust_lr_fn == "match_rms_adamw":
        ratio = 0.2 * math.sqrt(max(rows, cols))
    elif adjust_lr_fn == "spectral":
        ratio = math.sqrt(rows / cols)
    else:
        raise ValueError(f"adjust_lr_fn must be one of {ADJUST_LR_FNS}, got {adjust_lr_fn!r}")
    return lr * ratio


@torch.no_grad()
def muon_step(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    momentum_buffers: Sequence[torch.Tensor],
    *,
    lr: float,
    weight_decay: float,
    momentum: float,
    nesterov: bool,
    adjust_lr_fn: str | None,
    ns: NSFunction,
    shapes: Sequence[Sequence[int]] | None = None,
) -> int:
    """Apply one Muon update to each matrix in ``params`` (in place).

    Momentum and update run as foreach ops over all matrices; matrices of the same shape,
    dtype and device are orthogonalized as one batch. Each phase is a profiler range
    (``muon::momentum``, ``muon::newton_schulz``, ``muon::update``).

    Args:
        params: Matrices (2-D) or stacks of matrices (3-D) to update.
        grads: Their gradients (same order).
        momentum_buffers: Their momentum buffers, updated in place.
        lr: Learning rate before the shape adjustment.
        weight_decay: Decoupled weight decay coefficient.
        momentum: EMA momentum factor in ``[0, 1)``.
        nesterov: Use the Nesterov look-ahead.
        adjust_lr_fn: See :func:`adjusted_lr` (per matrix: the last two dims).
        ns: The orthogonalization to use (a backend with its schedule bound).
        shapes: The whole matrices' shapes, for the learning-rate adjustment, when
            ``params`` are tensor-parallel shards (default: their own shapes).

    Returns:
        The number of matrices orthogonalized (a 3-D stack counts each of its matrices).

    Raises:
        ValueError: a parameter is neither 2-D nor 3-D.
    """
    buckets: dict[tuple, list[int]] = defaultdict(list)
    for i, p in enumerate(params):
        if p.ndim not in (2, 3):
            raise ValueError(
                f"Muon updates 2-D matrices or 3-D stacks of matrices, got shape {tuple(p.shape)}"
            )
        buckets[(tuple(p.shape[-2:]), p.dtype, p.device)].append(i)
    if not params:
        return 0

    with record_function("muon::momentum"):
        torch._foreach_lerp_(momentum_buffers, grads, 1 - momentum)
        updates = (
            torch._foreach_lerp(grads, momentum_buffers, momentum)
            if nesterov
            else list(momentum_buffers)
        )

    matrices = 0
    for indices in buckets.values():
        bucket_updates = [updates[i] for i in indices]
        with record_function("muon::newton_schulz"):
            if len(indices) == 1:
                orthogonal = [ns(bucket_updates[0])]
            else:
                batch = torch.cat([u.reshape(-1, *u.shape[-2:]) for u in bucket_updates])
                counts = [matrix_count(u.shape) for u in bucket_updates]
                orthogonal = [
                    o.view(u.shape)
                    for o, u in zip(ns(batch).split(counts), bucket_updates, strict=True)
                ]
        with record_function("muon::update"):
            bucket_params = [params[i] for i in indices]
            if weight_decay != 0:
                torch._foreach_mul_(bucket_params, 1 - lr * weight_decay)
            # One learning rate per bucket: every matrix in it has the same shape.
            shape = shapes[indices[0]] if shapes is not None else bucket_params[0].shape
            alpha = -adjusted_lr(lr, adjust_lr_fn, shape)
            torch._foreach_add_(bucket_params, orthogonal, alpha=alpha)
        matrices += sum(matrix_count(p.shape) for p in bucket_params)
    return matrices
