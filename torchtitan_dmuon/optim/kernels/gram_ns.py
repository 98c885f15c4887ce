"""Gram Newton-Schulz: the Newton-Schulz loop run on the small Gram matrix.

With ``X0`` the normalized input (short side first, ``n x m``, ``n <= m``) and
``R = X0 X0^T`` (``n x n``), every Newton-Schulz iterate is ``Q X0`` with ``Q`` a
polynomial in ``R``. One step with ``A = X X^T`` and ``Z = a I + b A + c A^2`` maps
``Q -> Z Q`` and ``A -> Z A Z``, so the loop needs only ``n x n`` products and ``X0`` is
multiplied once at the end. In exact arithmetic the result equals the standard loop's.
For wide matrices (aspect ratio ``m / n`` of about 2 or more) this takes fewer FLOPs.

Low precision drifts as ``Q`` accumulates, so the loop restarts after step 2 (by default):
``X = Q X0``, recompute ``R`` from ``X``, start a new ``Q`` (Zhang, Amsel, Chen, Dao 2026).

Precision: within a phase ``Q`` maps the top singular directions to about 1 while its
entries grow to about the product of the ``a`` coefficients (about 12 for two quintic
steps), so rounding ``Q`` costs that factor in relative accuracy. In bf16 the result is
2-4x further from the exact one than the standard loop's (relative Frobenius distance,
measured on CPU), yet the presets' singular-value bands hold; in fp16 it is closer than the
standard loop in bf16.

Tensor parallelism. The pieces are public so that a matrix split along its long side
never has to be gathered. For a rank holding the column shard ``X_i`` (``n x m_i``; pass
``shard.mT`` for a row shard of a tall matrix), each phase of :func:`gram_phases` is::

    r = gram(x_i)                        # local n x n
    all_reduce(r)                        # sum of shard Grams == Gram of the full matrix
    q = gram_factor(r, phase)            # identical on every rank
    x_i = apply_factor(q, x_i)           # this shard of the full result, no communication

The normalization also needs no gather: ``||X||_F^2 = trace(R)`` of the first phase's
reduced Gram, so divide ``x_i`` by ``norm_scale * sqrt(trace(R))`` (clamped at ``eps``) and
``R`` by its square before the first factor.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from torchtitan_dmuon.optim.newton_schulz import EPS, Coefficients, NSSchedule, prepare_ns_input

__all__ = [
    "RESTARTS",
    "apply_factor",
    "gram",
    "gram_factor",
    "gram_newton_schulz",
    "gram_phases",
]

RESTARTS: tuple[int, ...] = (2,)
"""Default steps after which the Gram loop restarts from ``X = Q X0``."""


def gram(x: torch.Tensor) -> torch.Tensor:
    """``X X^T`` of a ``(n, k)`` matrix or ``(batch, n, k)`` stack (``n`` the short side).

    For a shard that holds some of the columns, this is the shard's share of the full Gram
    matrix: the sum over shards equals the Gram matrix of the concatenation.
    """
    return x @ x.mT


def gram_factor(r: torch.Tensor, coefficients: Sequence[Coefficients]) -> torch.Tensor:
    """The polynomial ``Q(R)`` such that ``Q X`` is ``len(coefficients)`` Newton-Schulz steps.

    Args:
        r: ``X X^T`` of the (normalized) iterate ``X``, ``(n, n)`` or ``(batch, n, n)``.
        coefficients: One ``(a, b, c)`` triple per step.

    Returns:
        ``Q``, same shape and dtype as ``r``.

    Raises:
        ValueError: ``coefficients`` is empty.
    """
    if not coefficients:
        raise ValueError("gram_factor needs at least one (a, b, c) step")
    addmm = torch.addmm if r.ndim == 2 else torch.baddbmm
    gram_k, q = r, None
    for step, (a, b, c) in enumerate(coefficients):
        z = addmm(gram_k, gram_k, gram_k, beta=b, alpha=c)
        z.diagonal(dim1=-2, dim2=-1).add_(a)
        q = z if q is None else z @ q
        if step + 1 < len(coefficients):  # the last step's Gram is never used
            gram_k = z @ gram_k @ z
    return q


def apply_factor(q: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``Q X``: a factor from :func:`gram_factor` applied to the iterate, or to a column shard."""
    return q @ x


def gram_phases(
    coefficients: Sequence[Coefficients], restarts: Sequence[int] = RESTARTS
) -> list[tuple[Coefficients, ...]]:
    """Split per-step coefficients into the phases between restarts.

    ``restarts`` lists step counts after which to restart; those outside ``(0, steps)``
    are ignored, so ``()`` gives one phase.
    """
    steps = len(coefficients)
    cuts = sorted({r for r in restarts if 0 < r < steps})
    bounds = [0, *cuts, steps]
    return [tuple(coefficients[lo:hi]) for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)]


def gram_newton_schulz(
    grad: torch.Tensor,
    schedule: NSSchedule,
    *,
    eps: float = EPS,
    dtype: torch.dtype = torch.bfloat16,
    restarts: Sequence[int] = RESTARTS,
) -> torch.Tensor:
    """Orthogonalize a matrix, or a batch of same-shape matrices, by Gram Newton-Schulz.

    Same contract as :func:`torchtitan_dmuon.optim.newton_schulz.newton_schulz`.

    Args:
        grad: A ``(m, n)`` matrix or a ``(batch, m, n)`` stack. Not modified.
        schedule: Coefficients per step and normalization.
        eps: Floor of the normalizing norm.
        dtype: Compute dtype.
        restarts: Steps after which to restart from ``X = Q X0`` (see :func:`gram_phases`).

    Returns:
        The orthogonalized tensor, same shape as ``grad``, in ``dtype``.
    """
    x, transposed = prepare_ns_input(grad, schedule, eps=eps, dtype=dtype)
    for phase in gram_phases(schedule.coefficients, restarts):
        x = apply_factor(gram_factor(gram(x), phase), x)
    return x.mT if transposed else x
