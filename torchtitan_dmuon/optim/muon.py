"""Functional core of the Muon update, following torch.optim.Muon's conventions.

For each matrix parameter ``p`` with gradient ``g`` and momentum buffer ``buf``::

    buf = buf.lerp(g, 1 - momentum)                   # EMA momentum
    u = g.lerp(buf, momentum) if nesterov else buf    # Nesterov look-ahead
    o = newton_schulz(u)                              # orthogonalize
    p.mul_(1 - lr * weight_decay)                     # decoupled weight decay (skipped at 0)
    p.add_(o, alpha=-adjusted_lr(lr, p.shape))

A 3-D parameter is a stack of independent matrices (MoE experts stored as one
``(experts, rows, cols)`` tensor): each matrix of the stack is orthogonalized on its own, as
if it were a separate parameter. Matrices of the same shape, from any parameters, run as
one batch. A matrix can be left out of a step on the device, without the host reading
anything: its ``stepped`` flag (a 0-dim bool tensor) selects, element by element, the old
value, momentum and second moment, bitwise what ``torch.optim.Muon`` keeps for a
parameter whose gradient is None (a whole step is skipped so, on a non-finite gradient
norm). A step runs in two phases: :func:`muon_update` computes the orthogonalized
updates without changing anything, :func:`apply_muon_update` advances the momentum and
writes them, so a distributed step can agree that every rank's first phase succeeded
before any rank changes its state. :func:`compute_group` and :func:`commit_group` run those two
phases on a :class:`MatrixGroup` with the optimizer's per-parameter state (momentum, and
NorMuon's second moment). This module does not import ``torch.distributed``: the ownership
engine decides which matrices a rank steps.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch.profiler import record_function

from torchtitan_dmuon.optim.newton_schulz import matrix_count
from torchtitan_dmuon.optim.normuon import AllReduce, normuon_normalize, second_moment_shape

__all__ = [
    "ADJUST_LR_FNS",
    "SECOND_MOMENT",
    "MatrixGroup",
    "MuonUpdate",
    "NSFunction",
    "NS_BATCH_ELEMENTS",
    "PendingGroup",
    "adjusted_lr",
    "apply_muon_update",
    "commit_group",
    "compute_group",
    "muon_update",
]

ADJUST_LR_FNS = (None, "original", "match_rms_adamw", "spectral")
"""Accepted values of ``adjust_lr_fn``."""

NSFunction = Callable[[torch.Tensor], torch.Tensor]
"""Orthogonalizes a 2-D matrix or a 3-D batch (see ``newton_schulz``)."""

NS_BATCH_ELEMENTS = 1 << 26
"""The most elements (of same-shape matrices) orthogonalized as one batch: small matrices
still share a kernel launch, while the step's transient memory (the batch, its look-ahead
and Newton-Schulz's iterates) stays a few times this (256 MiB in fp32), however many
matrices a rank owns (Llama-3.1 8B over 8 ranks: 21 matrices, 3.2 GiB, a rank)."""

SECOND_MOMENT = "second_moment"
"""NorMuon's state key: one EMA of the mean square per row of each matrix."""


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


@dataclass
class MuonUpdate:
    """The first phase of a Muon step, computed without touching its inputs.

    The new momentum is not kept: :func:`apply_muon_update` advances the buffers in place
    with the same ``lerp``, bitwise what this phase formed, so the phase holds one copy of
    the matrices (the updates) rather than two.

    Attributes:
        orthogonal: The orthogonalized updates, one per matrix parameter.
        momentum: The EMA momentum factor the updates were formed with.
        matrices: How many matrices were orthogonalized (a 3-D stack counts each).
        second_moments: NorMuon's new second moments (``orthogonal`` then holds the
            normalized updates); None for Muon.
    """

    orthogonal: list[torch.Tensor]
    momentum: float
    matrices: int
    second_moments: list[torch.Tensor] | None = None


@torch.no_grad()
def muon_update(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    momentum_buffers: Sequence[torch.Tensor],
    *,
    momentum: float,
    nesterov: bool,
    ns: NSFunction,
) -> MuonUpdate:
    """Momentum and Newton-Schulz of each matrix, out of place: nothing it reads changes,
    so a step that fails here (on any rank) can be abandoned as if it never ran.

    Matrices of the same shape, dtype and device are orthogonalized as one batch of at
    most :data:`NS_BATCH_ELEMENTS` elements, whose new momentum and Nesterov look-ahead are
    formed (foreach ops) just before it (profiler ranges ``muon::momentum`` and
    ``muon::newton_schulz``). Only the orthogonalized updates outlive their batch: the
    phase holds one copy of the matrices the rank steps and a few batches.

    Args:
        params: Matrices (2-D) or stacks of matrices (3-D) to update (read for shapes).
        grads: Their gradients (same order).
        momentum_buffers: Their momentum buffers (read only).
        momentum: EMA momentum factor in ``[0, 1)``.
        nesterov: Use the Nesterov look-ahead.
        ns: The orthogonalization to use (a backend with its schedule bound).

    Raises:
        ValueError: a parameter is neither 2-D nor 3-D.
    """
    for p in params:
        if p.ndim not in (2, 3):
            raise ValueError(
                f"Muon updates 2-D matrices or 3-D stacks of matrices, got shape {tuple(p.shape)}"
            )
    if not params:
        return MuonUpdate([], momentum, 0)
    orthogonal: list[torch.Tensor | None] = [None] * len(params)
    for indices in _batches(params):
        with record_function("muon::momentum"):
            batch_grads = [grads[i] for i in indices]
            bucket = torch._foreach_lerp(
                [momentum_buffers[i] for i in indices], batch_grads, 1 - momentum
            )
            if nesterov:
                bucket = torch._foreach_lerp(batch_grads, bucket, momentum)
        with record_function("muon::newton_schulz"):
            if len(indices) == 1:
                results = [ns(bucket[0])]
            else:
                batch = torch.cat([u.reshape(-1, *u.shape[-2:]) for u in bucket])
                counts = [matrix_count(u.shape) for u in bucket]
                results = [
                    o.view(u.shape) for o, u in zip(ns(batch).split(counts), bucket, strict=True)
                ]
        for i, result in zip(indices, results, strict=True):
            orthogonal[i] = result
    matrices = sum(matrix_count(p.shape) for p in params)
    return MuonUpdate(orthogonal, momentum, matrices)


@torch.no_grad()
def apply_muon_update(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    momentum_buffers: Sequence[torch.Tensor],
    update: MuonUpdate,
    *,
    lr: float,
    weight_decay: float,
    adjust_lr_fn: str | None,
    shapes: Sequence[Sequence[int]] | None = None,
    stepped: Sequence[torch.Tensor] | None = None,
) -> None:
    """The second phase, in place: ``momentum_buffers`` advanced from ``grads`` as
    :func:`muon_update` formed them, decoupled weight decay, then each orthogonalized
    update with its shape-adjusted learning rate (profiler range ``muon::update``).

    Args:
        params: The matrices :func:`muon_update` was given.
        grads: Their gradients, as :func:`muon_update` read them.
        momentum_buffers: Their momentum buffers, advanced in place.
        update: What :func:`muon_update` returned for them.
        lr: Learning rate before the shape adjustment.
        weight_decay: Decoupled weight decay coefficient.
        adjust_lr_fn: See :func:`adjusted_lr` (per matrix: the last two dims).
        shapes: The whole matrices' shapes, for the learning-rate adjustment, when
            ``params`` are tensor-parallel shards (default: their own shapes).
        stepped: Per matrix, a 0-dim bool tensor: False leaves its value and momentum
            unchanged (bitwise); None: every matrix steps.
    """
    if not params:
        return
    with record_function("muon::update"):
        if stepped is not None:
            args = (update, stepped, lr, weight_decay, adjust_lr_fn, shapes)
            _apply_masked(params, grads, momentum_buffers, *args)
            return
        torch._foreach_lerp_(list(momentum_buffers), list(grads), 1 - update.momentum)
        for indices in _buckets(params).values():
            bucket = [params[i] for i in indices]
            if weight_decay != 0:
                torch._foreach_mul_(bucket, 1 - lr * weight_decay)
            # One learning rate per bucket: every matrix in it has the same shape.
            shape = shapes[indices[0]] if shapes is not None else bucket[0].shape
            alpha = -adjusted_lr(lr, adjust_lr_fn, shape)
            torch._foreach_add_(bucket, [update.orthogonal[i] for i in indices], alpha=alpha)


def _apply_masked(
    params, grads, momentum_buffers, update, stepped, lr, weight_decay, adjust_lr_fn, shapes
) -> None:
    """:func:`apply_muon_update` where only the matrices whose ``stepped`` flag is set
    change: each batch's new values are formed out of place by the same operations, then
    selected per matrix on the device (transient memory: one batch of
    :func:`_batches`)."""
    for indices in _batches(params):
        bufs = [momentum_buffers[i] for i in indices]
        new_bufs = torch._foreach_lerp(bufs, [grads[i] for i in indices], 1 - update.momentum)
        _select(bufs, new_bufs, [stepped[i] for i in indices])
        del new_bufs  # one batch's new values alive at a time
        bucket = [params[i] for i in indices]
        shape = shapes[indices[0]] if shapes is not None else bucket[0].shape
        alpha = -adjusted_lr(lr, adjust_lr_fn, shape)
        if weight_decay != 0:
            new = torch._foreach_mul(bucket, 1 - lr * weight_decay)
            torch._foreach_add_(new, [update.orthogonal[i] for i in indices], alpha=alpha)
        else:
            new = torch._foreach_add(bucket, [update.orthogonal[i] for i in indices], alpha=alpha)
        _select(bucket, new, [stepped[i] for i in indices])


def _select(
    targets: Sequence[torch.Tensor], new: Sequence[torch.Tensor], stepped: Sequence[torch.Tensor]
) -> None:
    """``target = new if stepped else target``, in place, decided on the device."""
    for target, value, flag in zip(targets, new, stepped, strict=True):
        torch.where(flag, value, target, out=target)


def _buckets(params: Sequence[torch.Tensor]) -> dict[tuple, list[int]]:
    """Indices of ``params`` by (matrix shape, dtype, device)."""
    buckets: dict[tuple, list[int]] = defaultdict(list)
    for i, p in enumerate(params):
        buckets[(tuple(p.shape[-2:]), p.dtype, p.device)].append(i)
    return buckets


def _batches(params: Sequence[torch.Tensor]) -> list[list[int]]:
    """Indices of ``params`` to orthogonalize together: each bucket of :func:`_buckets` in
    consecutive runs of at most :data:`NS_BATCH_ELEMENTS` elements (a larger parameter
    alone: a stack of matrices is never split)."""
    batches = []
    for indices in _buckets(params).values():
        batch, elements = [], 0
        for i in indices:
            if batch and elements + params[i].numel() > NS_BATCH_ELEMENTS:
                batches.append(batch)
                batch, elements = [], 0
            batch.append(i)
            elements += params[i].numel()
        batches.append(batch)
    return batches


@dataclass
class MatrixGroup:
    """Matrices one rank steps together with one orthogonalization.

    Attributes:
        keys: The parameters, as the optimizer's state is keyed.
        params: What the update writes, in the same order: the parameters, or (an owner's)
            master copies of them.
        grads: Their gradients.
        ns: Their orthogonalization (under tensor parallelism, one the TP ranks run
            together on their shards).
        shapes: The whole matrices' shapes when ``params`` are tensor-parallel shards,
            for the learning-rate adjustment and NorMuon's row statistics; None: their own.
        split_dim: The dim the shards split (tensor parallelism), or None.
        all_reduce: NorMuon's sum of row statistics over the tensor-parallel ranks, or None.
        stepped: Per matrix, a 0-dim bool device tensor: whether it has a gradient (one
            without keeps its value and state, as ``torch.optim.Muon`` skips a parameter
            whose gradient is None); None: all have.
    """

    keys: Sequence[torch.Tensor]
    params: Sequence[torch.Tensor]
    grads: Sequence[torch.Tensor]
    ns: NSFunction
    shapes: Sequence[Sequence[int]] | None = None
    split_dim: int | None = None
    all_reduce: AllReduce | None = None
    stepped: Sequence[torch.Tensor] | None = None


@dataclass
class PendingGroup:
    """What :func:`compute_group` computed for one group, for :func:`commit_group`."""

    group: MatrixGroup
    momentum_buffers: list[torch.Tensor]
    update: MuonUpdate


@torch.no_grad()
def compute_group(
    group: MatrixGroup,
    state: dict,
    *,
    momentum: float,
    nesterov: bool,
    normuon_beta2: float | None,
) -> PendingGroup:
    """The first phase of a step of ``group``: its orthogonalized updates (and, with
    ``normuon_beta2``, NorMuon's second moments and normalized updates) from ``state``,
    which it only reads: a first step's buffers start at zero and join the state at
    :func:`commit_group`."""
    bufs = [state[key].get("momentum_buffer") for key in group.keys]
    bufs = [
        b if b is not None else torch.zeros_like(p) for b, p in zip(bufs, group.params, strict=True)
    ]
    update = muon_update(
        group.params, group.grads, bufs, momentum=momentum, nesterov=nesterov, ns=group.ns
    )
    if normuon_beta2 is not None:
        moments = [
            state[key][SECOND_MOMENT]
            if SECOND_MOMENT in state[key]
            else p.new_zeros(second_moment_shape(p.shape))
            for key, p in zip(group.keys, group.params, strict=True)
        ]
        update.second_moments, update.orthogonal = normuon_normalize(
            update.orthogonal,
            moments,
            beta2=normuon_beta2,
            columns=[key.shape[-1] for key in group.keys],  # whole, for a TP shard
            split_dim=group.split_dim,
            all_reduce=group.all_reduce,
        )
    return PendingGroup(group, bufs, update)


@torch.no_grad()
def commit_group(
    pending: PendingGroup,
    state: dict,
    *,
    lr: float,
    weight_decay: float,
    adjust_lr_fn: str | None,
    skip: torch.Tensor | None = None,
) -> int:
    """The second phase: the momentum advanced and the second moments into ``state``,
    then the update into the group's ``params``; only the matrices the group steps
    (:attr:`MatrixGroup.stepped`), none where ``skip`` (a 0-dim device tensor, nonzero:
    skip the step, as ``found_inf``) is set, decided on the device.

    Returns:
        The number of matrices orthogonalized.
    """
    group, update = pending.group, pending.update
    stepped = group.stepped
    if skip is not None:
        go = skip == 0
        stepped = [go & s for s in stepped] if stepped is not None else [go] * len(group.keys)
    for key, buf in zip(group.keys, pending.momentum_buffers, strict=True):
        state[key]["momentum_buffer"] = buf
    if update.second_moments is not None:
        for i, (key, moment) in enumerate(zip(group.keys, update.second_moments, strict=True)):
            if stepped is not None:  # a matrix that does not step keeps the old (or zero)
                if SECOND_MOMENT not in state[key]:
                    state[key][SECOND_MOMENT] = torch.zeros_like(moment)
                _select([state[key][SECOND_MOMENT]], [moment], [stepped[i]])
                continue
            old = state[key].setdefault(SECOND_MOMENT, moment)
            if old is not moment:  # in place: DCP loads into the state's tensors
                old.copy_(moment)
    apply_muon_update(
        group.params,
        group.grads,
        pending.momentum_buffers,
        update,
        lr=lr,
        weight_decay=weight_decay,
        adjust_lr_fn=adjust_lr_fn,
        shapes=group.shapes,
        stepped=stepped,
    )
    return update.matrices
