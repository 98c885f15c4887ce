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
one batch (on CPU, where measured faster, one parameter at a time: ``unbatched``). A
matrix can be left out of a step on the device, without the host reading
anything: its ``stepped`` flag (a 0-dim bool tensor) enters the update's arithmetic (a
``lerp`` weight 0, factors 1 and 0), which leaves its value and momentum exactly what
``torch.optim.Muon`` keeps for a parameter whose gradient is None (a whole step is skipped
so, on a non-finite gradient norm); every caller, one process or distributed, takes this
one road. A step runs in two phases: :func:`muon_update` computes the orthogonalized
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
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import torch
from torch.profiler import record_function

from torchtitan_dmuon.optim.fused_rows import FusedRows
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
    unbatched: Collection[tuple[int, int]] = (),
    fused: Sequence[FusedRows | None] | None = None,
) -> MuonUpdate:
    """Momentum and Newton-Schulz of each matrix, out of place: nothing it reads changes,
    so a step that fails here (on any rank) can be abandoned as if it never ran.

    Matrices of the same shape, dtype and device are orthogonalized as one batch of at
    most :data:`NS_BATCH_ELEMENTS` elements (those of a shape in ``unbatched`` one parameter
    at a time), whose new momentum and Nesterov look-ahead are
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
        unbatched: ``(rows, cols)`` shapes whose parameters are orthogonalized one at a
            time (:attr:`~torchtitan_dmuon.optim.ns_choice.NSChoice.unbatched`).
        fused: Per parameter, the matrices it holds fused along its rows (each one
            orthogonalized on its own, one at a time), or None; None: none is fused.

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
    fused = fused or [None] * len(params)
    plain = [i for i, layout in enumerate(fused) if layout is None]
    for indices in _batches(params, unbatched, among=plain):
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
    for i, layout in enumerate(fused):
        if layout is not None:
            orthogonal[i] = _fused_update(
                grads[i], momentum_buffers[i], layout, momentum=momentum, nesterov=nesterov, ns=ns
            )
    matrices = sum(
        matrix_count(p.shape) if layout is None else len(layout.parts)
        for p, layout in zip(params, fused, strict=True)
    )
    return MuonUpdate(orthogonal, momentum, matrices)


def _fused_update(
    grad: torch.Tensor,
    momentum_buffer: torch.Tensor,
    layout: FusedRows,
    *,
    momentum: float,
    nesterov: bool,
    ns: NSFunction,
) -> torch.Tensor:
    """The orthogonalized update of one parameter holding fused matrices: its momentum and
    look-ahead formed whole (element-wise, as for each matrix alone), then each matrix's
    Newton-Schulz written back into its rows."""
    with record_function("muon::momentum"):
        update = momentum_buffer.lerp(grad, 1 - momentum)
        if nesterov:
            update = grad.lerp(update, momentum)
    with record_function("muon::newton_schulz"):
        result = torch.empty_like(update)
        for matrix, block in zip(layout.matrices(update), layout.blocks(result), strict=True):
            block.copy_(ns(matrix).view(block.shape))
    return result


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
    nonfinite_skipped: bool = False,
    fused: Sequence[FusedRows | None] | None = None,
) -> None:
    """The second phase, in place: ``momentum_buffers`` advanced from ``grads`` as
    :func:`muon_update` formed them, decoupled weight decay, then each orthogonalized
    update with its shape-adjusted learning rate (profiler range ``muon::update``).

    One road for every caller: a matrix's ``stepped`` flag enters the arithmetic (its
    momentum's ``lerp`` weight, its decay factor, a factor 0 or 1 on its update), so a
    matrix that does not step keeps its value and momentum exactly, and one that steps
    costs what the unmasked ``torch.optim.Muon`` update costs, with the same operations
    and roundings. No select (``torch.where``) runs over the matrices: on a CPU it is
    several times an in-place ``lerp``.

    Args:
        params: The matrices :func:`muon_update` was given.
        grads: Their gradients, as :func:`muon_update` read them.
        momentum_buffers: Their momentum buffers, advanced in place.
        update: What :func:`muon_update` returned for them (its updates are consumed).
        lr: Learning rate before the shape adjustment.
        weight_decay: Decoupled weight decay coefficient.
        adjust_lr_fn: See :func:`adjusted_lr` (per matrix: the last two dims).
        shapes: The whole matrices' shapes, for the learning-rate adjustment, when
            ``params`` are tensor-parallel shards (default: their own shapes).
        stepped: Per matrix, a 0-dim bool tensor on its device: False leaves its value
            and momentum unchanged; None: every matrix steps. A matrix that does not step
            must have finite inputs (a gradient of zeros, as the engine keeps for one no
            rank touched) unless ``nonfinite_skipped``.
        nonfinite_skipped: Every step with a non-finite gradient has its ``stepped``
            flags False (``found_inf``): non-finite gradient entries and updates are
            read as 0, which changes nothing a step that is taken sees, and keeps a
            skipped one's writes exact.
        fused: Per parameter, the matrices it holds fused along its rows (each written
            with its own shape's learning rate), or None; None: none is fused.
    """
    if not params:
        return
    if stepped is None:
        stepped = _every_steps(params)
    with record_function("muon::update"):
        for indices in _batches(params):
            bucket = [params[i] for i in indices]
            flags = [stepped[i] for i in indices]
            batch_grads = [grads[i] for i in indices]
            orthogonal = [update.orthogonal[i] for i in indices]
            if nonfinite_skipped:
                batch_grads = [_finite(g) for g in batch_grads]
                for o in orthogonal:
                    o.nan_to_num_(0.0, 0.0, 0.0)
            _masked_lerp_(
                [momentum_buffers[i] for i in indices], batch_grads, 1 - update.momentum, flags
            )
            if weight_decay != 0:
                decay = 1 - lr * weight_decay
                factors = _flag_values(flags, decay, 1.0, bucket[0].dtype)
                torch._foreach_mul_(bucket, list(factors))
            torch._foreach_mul_(orthogonal, flags)  # exact: a factor 1 or 0
            # One learning rate per batch: every matrix in it has the same shape; a
            # parameter of fused matrices is written matrix by matrix, each with its own.
            layouts = [fused[i] for i in indices] if fused is not None else [None] * len(indices)
            whole = [k for k, layout in enumerate(layouts) if layout is None]
            if whole:
                shape = shapes[indices[whole[0]]] if shapes is not None else bucket[whole[0]].shape
                alpha = -adjusted_lr(lr, adjust_lr_fn, shape)
                torch._foreach_add_(
                    [bucket[k] for k in whole], [orthogonal[k] for k in whole], alpha=alpha
                )
            for param, update_, layout in zip(bucket, orthogonal, layouts, strict=True):
                if layout is None:
                    continue
                for target, block, shape in zip(
                    layout.blocks(param),
                    layout.blocks(update_),
                    layout.shapes(param.shape[-1]),
                    strict=True,
                ):
                    target.add_(block, alpha=-adjusted_lr(lr, adjust_lr_fn, shape))
            for i in indices:  # consumed: each batch's updates free as it is written
                update.orthogonal[i] = None


_REDUCED = (torch.bfloat16, torch.float16)


def _every_steps(params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The flags of matrices that all step (one set 0-dim tensor on their device)."""
    return [torch.ones((), dtype=torch.bool, device=params[0].device)] * len(params)


def _flag_values(
    flags: list[torch.Tensor], on: float, off: float, dtype: torch.dtype
) -> tuple[torch.Tensor, ...]:
    """Per 0-dim ``flag``, ``on`` where it is set, else ``off``: 0-dim tensors on the
    flags' device (three kernels for the list) that a tensor of ``dtype`` computes with
    as it would with the Python scalar: float64 for float64, else float32."""
    scalar_type = torch.float64 if dtype == torch.float64 else torch.float32
    value = torch.full((), on, dtype=scalar_type, device=flags[0].device)
    return torch.where(torch.stack(flags), value, off).unbind()


def _masked_lerp_(
    buffers: list[torch.Tensor], ends: list[torch.Tensor], weight: float, flags: list[torch.Tensor]
) -> None:
    """``buffer.lerp_(end, weight)`` where the flag is set, else ``buffer`` exactly (weight
    0: ``buffer + 0 * (end - buffer)`` for a finite ``end``). A tensor weight is cast to a
    reduced-precision buffer's dtype, where a scalar one is not: those run in float32, as
    the scalar kernel computes."""
    weights = _flag_values(flags, weight, 0.0, buffers[0].dtype)
    full = [k for k, b in enumerate(buffers) if b.dtype not in _REDUCED]
    if full:
        torch._foreach_lerp_(
            [buffers[k] for k in full], [ends[k] for k in full], [weights[k] for k in full]
        )
    for k, buffer in enumerate(buffers):
        if buffer.dtype in _REDUCED:
            buffer.copy_(buffer.float().lerp_(ends[k].float(), weights[k]))


def _finite(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` with its non-finite entries as 0 (a new tensor)."""
    return torch.nan_to_num(tensor, 0.0, 0.0, 0.0)


def _select(
    targets: Sequence[torch.Tensor], new: Sequence[torch.Tensor], stepped: Sequence[torch.Tensor]
) -> None:
    """``target = new if stepped else target``, in place, decided on the device (NorMuon's
    second moments: a row each, small)."""
    for target, value, flag in zip(targets, new, stepped, strict=True):
        torch.where(flag, value, target, out=target)


def _buckets(
    params: Sequence[torch.Tensor], among: Sequence[int] | None = None
) -> dict[tuple, list[int]]:
    """Indices of ``params`` (of those in ``among``; default all) by (matrix shape, dtype,
    device)."""
    buckets: dict[tuple, list[int]] = defaultdict(list)
    for i in range(len(params)) if among is None else among:
        p = params[i]
        buckets[(tuple(p.shape[-2:]), p.dtype, p.device)].append(i)
    return buckets


def _batches(
    params: Sequence[torch.Tensor],
    unbatched: Collection[tuple[int, int]] = (),
    among: Sequence[int] | None = None,
) -> list[list[int]]:
    """Indices of ``params`` (of those in ``among``; default all) to orthogonalize
    together: each bucket of :func:`_buckets` in consecutive runs of at most
    :data:`NS_BATCH_ELEMENTS` elements (a larger parameter alone: a stack of matrices is
    never split), each parameter alone where its matrix shape is in ``unbatched``."""
    batches = []
    for (shape, _, _), indices in _buckets(params, among).items():
        if shape in unbatched:
            batches += [[i] for i in indices]
            continue
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
        unbatched: Matrix shapes whose parameters ``ns`` orthogonalizes one at a time
            (see :func:`muon_update`).
        fused: Per parameter, the matrices it holds fused along its rows, or None
            (:mod:`~torchtitan_dmuon.optim.fused_rows`); None: none is fused.
    """

    keys: Sequence[torch.Tensor]
    params: Sequence[torch.Tensor]
    grads: Sequence[torch.Tensor]
    ns: NSFunction
    shapes: Sequence[Sequence[int]] | None = None
    split_dim: int | None = None
    all_reduce: AllReduce | None = None
    stepped: Sequence[torch.Tensor] | None = None
    unbatched: Collection[tuple[int, int]] = ()
    fused: Sequence[FusedRows | None] | None = None


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
        group.params,
        group.grads,
        bufs,
        momentum=momentum,
        nesterov=nesterov,
        ns=group.ns,
        unbatched=group.unbatched,
        fused=group.fused,
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
    nonfinite_skipped: bool = False,
) -> int:
    """The second phase: the momentum advanced and the second moments into ``state``,
    then the update into the group's ``params``; only the matrices the group steps
    (:attr:`MatrixGroup.stepped`), none where ``skip`` (a 0-dim device tensor, nonzero:
    skip the step: ``found_inf``, or a failure on some rank) is set, decided on the
    device. ``nonfinite_skipped``: ``skip`` includes a ``found_inf`` set on every
    non-finite gradient (see :func:`apply_muon_update`).

    Returns:
        The number of matrices orthogonalized.
    """
    group, update = pending.group, pending.update
    if not group.keys:
        return 0
    stepped = group.stepped if group.stepped is not None else _every_steps(group.params)
    if skip is not None:
        go = skip == 0
        stepped = [go & s for s in stepped]
    for key, buf in zip(group.keys, pending.momentum_buffers, strict=True):
        state[key]["momentum_buffer"] = buf
    if update.second_moments is not None:
        for key, moment, flag in zip(group.keys, update.second_moments, stepped, strict=True):
            # In place (DCP loads into the state's tensors); a matrix that does not step
            # keeps the old (or zero) one.
            if SECOND_MOMENT not in state[key]:
                state[key][SECOND_MOMENT] = torch.zeros_like(moment)
            _select([state[key][SECOND_MOMENT]], [moment], [flag])
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
        nonfinite_skipped=nonfinite_skipped,
        fused=group.fused,
    )
    return update.matrices
