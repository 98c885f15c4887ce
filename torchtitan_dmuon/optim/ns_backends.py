"""Registry of Newton-Schulz backends, selected by the optimizer's ``ns_backend``.

A backend is a function ``(grad, schedule, *, eps, dtype) -> Tensor`` with the contract of
:func:`torchtitan_dmuon.optim.newton_schulz.newton_schulz`: 2-D or batched 3-D input, output
in ``dtype`` and the input's shape. Registered backends:

* ``"torch"``: the reference loop (bit-equal to torch.optim.Muon).
* ``"triton"``: symmetric Triton kernels (CUDA; ``optim.kernels.triton_ns``), imported on
  first use so that this package imports without Triton.
* ``"gram"``: Gram Newton-Schulz (``optim.kernels.gram_ns``), fewer FLOPs on wide matrices.
* ``"auto"``: the fastest of them that is correct for the input, measured once per shape
  on whatever device the input is on (see :func:`choose_ns_backend`). The pick can differ
  between machines, ranks and runs, and the backends round differently: name a backend
  explicitly for bit-reproducible runs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from torchtitan_dmuon.optim.kernels.gram_ns import gram_newton_schulz
from torchtitan_dmuon.optim.newton_schulz import EPS, NSSchedule, newton_schulz

__all__ = [
    "AUTO_MIN_SIDE",
    "AUTO_MIN_SIDE_CPU",
    "NS_BACKENDS",
    "NSBackend",
    "auto_newton_schulz",
    "bind_ns",
    "choose_ns_backend",
    "get_ns_backend",
]

logger = logging.getLogger(__name__)

NSBackend = Callable[..., torch.Tensor]

AUTO_MIN_SIDE = 1024
"""On accelerators, below this short side ``"auto"`` keeps ``"torch"`` without measuring:
launch overhead dominates there, and published symmetric kernels lose to cuBLAS below
about 1024."""

AUTO_MIN_SIDE_CPU = 64
"""On CPU, below this short side ``"auto"`` keeps ``"torch"`` without measuring: one
Newton-Schulz takes well under a millisecond there, less than timing noise."""

# A candidate must beat torch by this factor, so that timing noise never picks a slower one.
_AUTO_MARGIN = 0.97
_AUTO_REPS = 3
# Largest accepted relative Frobenius distance from the torch backend's result per dtype
# (a guard against a broken kernel, not a precision test); other dtypes stay on torch.
_AUTO_TOLERANCE = {torch.bfloat16: 5e-2, torch.float16: 5e-2, torch.float32: 1e-2}
_auto_choices: dict[tuple, str] = {}


def _triton_newton_schulz(
    grad: torch.Tensor,
    schedule: NSSchedule,
    *,
    eps: float = EPS,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """The ``"triton"`` backend; imports Triton on first call."""
    try:
        from torchtitan_dmuon.optim.kernels.triton_ns import triton_newton_schulz
    except ImportError as err:
        raise ImportError(f"ns_backend='triton' needs the triton package: {err}") from err
    return triton_newton_schulz(grad, schedule, eps=eps, dtype=dtype)


def _elapsed_ms(fn: Callable[[], torch.Tensor], device: torch.device) -> float:
    """Fastest of a few runs of ``fn`` in milliseconds (already warmed up). The minimum,
    because other processes sharing the machine only ever make a run slower."""
    samples = []
    for _ in range(_AUTO_REPS):
        if device.type != "cpu":
            torch.accelerator.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type != "cpu":
            torch.accelerator.synchronize(device)
        samples.append(1e3 * (time.perf_counter() - start))
    return min(samples)


def _candidates(device: torch.device) -> tuple[str, ...]:
    # The triton kernels need CUDA (the interpreter is far too slow to be a candidate).
    return ("triton", "gram") if device.type == "cuda" else ("gram",)


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def _measure_fastest(
    grad: torch.Tensor, schedule: NSSchedule, *, eps: float, dtype: torch.dtype
) -> str:
    """Time every backend on ``grad``; the fastest correct one, torch unless one beats it."""

    def run(name: str) -> torch.Tensor:
        return NS_BACKENDS[name](grad, schedule, eps=eps, dtype=dtype)

    reference = run("torch")  # also the warm-up
    timings = {"torch": _elapsed_ms(lambda: run("torch"), grad.device)}
    best, best_ms = "torch", timings["torch"] * _AUTO_MARGIN
    for name in _candidates(grad.device):
        try:
            # The first call compiles and autotunes; it must not be timed.
            out = run(name)
        except Exception:  # auto must work wherever torch does, e.g. a GPU Triton cannot use
            logger.warning("ns_backend='auto': %r failed, skipping it", name, exc_info=True)
            continue
        error = ((out.float() - reference.float()).norm() / reference.float().norm()).item()
        if not error <= _AUTO_TOLERANCE[dtype]:
            logger.warning("ns_backend='auto': %r is off by %.3g, skipping it", name, error)
            continue
        timings[name] = _elapsed_ms(lambda name=name: run(name), grad.device)
        if timings[name] < best_ms:
            best, best_ms = name, timings[name]
    logger.info(
        "ns_backend='auto' picked %r for %s %s on %s (ms: %s)",
        best,
        tuple(grad.shape),
        dtype,
        _device_name(grad.device),
        {k: round(v, 3) for k, v in timings.items()},
    )
    return best


def choose_ns_backend(
    grad: torch.Tensor,
    schedule: NSSchedule,
    *,
    eps: float = EPS,
    dtype: torch.dtype = torch.bfloat16,
) -> str:
    """The backend that ``"auto"`` runs for this input.

    ``"torch"`` for dtypes other than bf16/fp16/fp32 and for short sides below
    :data:`AUTO_MIN_SIDE_CPU` on CPU, :data:`AUTO_MIN_SIDE` elsewhere. Otherwise every
    backend the device can run (triton and gram on CUDA, gram elsewhere) runs on ``grad``
    and is timed; the fastest one whose result is close to torch's wins, and another
    backend replaces torch only if it is at least 3% faster. The pick is cached per
    device, shape, dtype and number of steps, so each shape is measured once per process,
    and logged.
    """
    min_side = AUTO_MIN_SIDE_CPU if grad.device.type == "cpu" else AUTO_MIN_SIDE
    if dtype not in _AUTO_TOLERANCE or min(grad.shape[-2:]) < min_side:
        return "torch"
    key = (grad.device, tuple(grad.shape), dtype, schedule.steps)
    if key not in _auto_choices:
        _auto_choices[key] = _measure_fastest(grad, schedule, eps=eps, dtype=dtype)
    return _auto_choices[key]


def auto_newton_schulz(
    grad: torch.Tensor,
    schedule: NSSchedule,
    *,
    eps: float = EPS,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """The ``"auto"`` backend: runs :func:`choose_ns_backend`'s pick."""
    name = choose_ns_backend(grad, schedule, eps=eps, dtype=dtype)
    return NS_BACKENDS[name](grad, schedule, eps=eps, dtype=dtype)


NS_BACKENDS: dict[str, NSBackend] = {
    "torch": newton_schulz,
    "triton": _triton_newton_schulz,
    "gram": gram_newton_schulz,
    "auto": auto_newton_schulz,
}


def get_ns_backend(name: str) -> NSBackend:
    """Look up a backend by name.

    Raises:
        ValueError: ``name`` is not a registered backend.
    """
    if name not in NS_BACKENDS:
        raise ValueError(f"ns_backend must be one of {sorted(NS_BACKENDS)}, got {name!r}")
    return NS_BACKENDS[name]


def bind_ns(name: str, schedule: NSSchedule, *, eps: float, dtype: torch.dtype):
    """A one-argument orthogonalization: backend ``name`` with schedule, eps and dtype bound."""
    backend = get_ns_backend(name)

    def ns(x: torch.Tensor) -> torch.Tensor:
        return backend(x, schedule, eps=eps, dtype=dtype)

    return ns
