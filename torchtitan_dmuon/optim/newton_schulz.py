"""Newton-Schulz orthogonalization (torch backend) and its coefficient presets.

The iteration maps a matrix ``G = U S V^T`` to approximately ``U V^T``: after
normalizing by the Frobenius norm, each step applies the odd polynomial
``X <- a X + (b A + c A^2) X`` with ``A = X X^T``. It runs on the short side (the
input is transposed when it has more rows than columns) and accepts a batch of
same-shape matrices as a 3-D tensor, which runs as one batched computation.

This module is pure math: it does not import ``torch.distributed``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "EPS",
    "NS_PRESETS",
    "NSSchedule",
    "resolve_ns_schedule",
    "newton_schulz",
    "matrix_count",
    "ns_flops",
    "split_ns_flops",
    "prepare_ns_input",
]

EPS = 1e-7
"""Floor of the normalizing Frobenius norm (torch.optim.Muon's ``eps``)."""

Coefficients = tuple[float, float, float]


@dataclass(frozen=True)
class NSSchedule:
    """The per-step coefficients of one Newton-Schulz run.

    Attributes:
        coefficients: One ``(a, b, c)`` triple per iteration step.
        norm_scale: The input is divided by ``norm_scale * ||X||_F`` (clamped at eps);
            a value above 1 keeps the spectral norm safely below 1 for aggressive presets.
    """

    coefficients: tuple[Coefficients, ...]
    norm_scale: float = 1.0

    @property
    def steps(self) -> int:
        return len(self.coefficients)


_QUINTIC: Coefficients = (3.4445, -4.7750, 2.0315)

# Polar Express (Amsel et al. 2025): per-step optimal odd polynomials, used with a
# 1.02 safety factor on the normalization.
_POLAR_EXPRESS: tuple[Coefficients, ...] = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)

NS_PRESETS: dict[str, tuple[tuple[Coefficients, ...], float]] = {
    "quintic": ((_QUINTIC,), 1.0),
    "polar_express": (_POLAR_EXPRESS, 1.02),
}
"""Named presets: (per-step triples, norm_scale). A shorter list than ns_steps repeats its
last triple."""


def _as_triple(value: Sequence[float], where: str) -> Coefficients:
    if len(value) != 3:
        raise ValueError(f"ns_coefficients: {where} must have 3 values (a, b, c), got {value!r}")
    return (float(value[0]), float(value[1]), float(value[2]))


def resolve_ns_schedule(
    ns_coefficients: str | Sequence[float] | Sequence[Sequence[float]], ns_steps: int
) -> NSSchedule:
    """Turn a preset name, one ``(a, b, c)`` triple or a list of triples into a schedule.

    A list shorter than ``ns_steps`` repeats its last triple; a longer one is cut to
    ``ns_steps``.

    Raises:
        ValueError: unknown preset, malformed coefficients, or ``ns_steps < 1``.
    """
    if isinstance(ns_steps, bool) or not isinstance(ns_steps, int) or ns_steps < 1:
        raise ValueError(f"ns_steps must be an integer >= 1, got {ns_steps!r}")
    norm_scale = 1.0
    if isinstance(ns_coefficients, str):
        if ns_coefficients not in NS_PRESETS:
            raise ValueError(
                f"ns_coefficients: unknown preset {ns_coefficients!r}; "
                f"known presets are {sorted(NS_PRESETS)}"
            )
        triples, norm_scale = NS_PRESETS[ns_coefficients]
    elif len(ns_coefficients) > 0 and all(isinstance(v, (int, float)) for v in ns_coefficients):
        triples = (_as_triple(ns_coefficients, "the triple"),)  # type: ignore[arg-type]
    elif len(ns_coefficients) > 0:
        triples = tuple(
            _as_triple(t, f"step {i}")  # type: ignore[arg-type]
            for i, t in enumerate(ns_coefficients)
        )
    else:
        raise ValueError("ns_coefficients must be a preset name, a triple or a list of triples")
    per_step = tuple(triples[min(i, len(triples) - 1)] for i in range(ns_steps))
    return NSSchedule(coefficients=per_step, norm_scale=norm_scale)


def prepare_ns_input(
    grad: torch.Tensor, schedule: NSSchedule, *, eps: float, dtype: torch.dtype
) -> tuple[torch.Tensor, bool]:
    """The normalized first iterate of Newton-Schulz, short side first (every backend's
    prologue).

    Casts ``grad`` to ``dtype``, transposes it when it has more rows than columns and
    divides each matrix by ``schedule.norm_scale`` times its Frobenius norm, clamped at
    ``eps`` (for 2-D input with the same operations as torch.optim.Muon), into a new
    tensor: ``grad`` is never modified.

    Returns:
        ``(x, transposed)``: ``x`` has rows <= cols (a transposed view when ``transposed``);
        the caller returns ``result.mT`` when ``transposed``.

    Raises:
        ValueError: ``grad`` is neither 2-D nor 3-D.
    """
    if grad.ndim not in (2, 3):
        raise ValueError(f"newton_schulz expects a 2-D matrix or a 3-D batch, got {grad.ndim}-D")
    x = grad.to(dtype)
    cast = x is not grad  # a new tensor, divided in place; else the division makes one
    transposed = x.size(-2) > x.size(-1)
    if transposed:
        x = x.mT
    norm = x.norm() if x.ndim == 2 else x.norm(dim=(-2, -1), keepdim=True)
    if schedule.norm_scale != 1.0:
        norm = norm * schedule.norm_scale
    norm = norm.clamp(min=eps)
    return (x.div_(norm) if cast else x / norm), transposed


def newton_schulz(
    grad: torch.Tensor,
    schedule: NSSchedule,
    *,
    eps: float = EPS,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Orthogonalize a matrix, or a batch of same-shape matrices, by Newton-Schulz.

    With the ``"quintic"`` preset and bf16 this reproduces torch.optim.Muon's
    iteration operation by operation (transpose, norm, addmm), so results are
    bit-identical for 2-D input.

    Args:
        grad: A ``(m, n)`` matrix or a ``(batch, m, n)`` stack. Not modified.
        schedule: Coefficients per step (see :func:`resolve_ns_schedule`).
        eps: Floor of the normalizing norm.
        dtype: Compute dtype (bf16 by default; fp32/fp64 for exact testing).

    Returns:
        The orthogonalized tensor, same shape as ``grad``, in ``dtype``.
    """
    x, transposed = prepare_ns_input(grad, schedule, eps=eps, dtype=dtype)
    mm = torch.addmm if x.ndim == 2 else torch.baddbmm
    for a, b, c in schedule.coefficients:
        gram = x @ x.mT
        poly = mm(gram, gram, gram, beta=b, alpha=c)
        x = mm(x, poly, x, beta=a)
    return x.mT if transposed else x


def matrix_count(shape: Sequence[int]) -> int:
    """How many matrices a tensor of ``shape`` holds: 1 for a matrix, the product of the
    leading dims for a stack (MoE experts, a batch)."""
    return math.prod(shape[:-2])


def ns_flops(shape: Sequence[int], steps: int) -> int:
    """Multiply-add FLOPs of ``steps`` Newton-Schulz iterations on one ``(m, n)`` matrix.

    ``steps * (4 m^2 n + 2 m^3)`` with ``m <= n`` (the short side), per matrix of the batch.
    """
    rows, cols = shape[-2:]
    m, n = min(rows, cols), max(rows, cols)
    return matrix_count(shape) * steps * (4 * m * m * n + 2 * m * m * m)


def split_ns_flops(shape: Sequence[int], steps: int, parts: int) -> int:
    """Multiply-add FLOPs of ``steps`` Newton-Schulz iterations on one of ``parts`` equal
    blocks of an ``(m, n)`` matrix split along its long side, run together
    (:func:`~torchtitan_dmuon.optim.sharded_ns.split_newton_schulz`): per step the block's
    ``X X^T`` and, for a block ``w = n / parts`` at least ``m`` wide, the whole ``m^3``
    polynomial and its product with the block (``4 m^2 w + 2 m^3``), for a narrower one
    two products of ``A`` with the block (``6 m^2 w``).
    """
    rows, cols = shape[-2:]
    m, n = min(rows, cols), max(rows, cols)
    w = n // parts
    per_step = 6 * m * m * w if w < m else 4 * m * m * w + 2 * m * m * m
    return matrix_count(shape) * steps * per_step
