"""Registry of Newton-Schulz backends, selected by the optimizer's ``ns_backend``.

A backend is a function ``(grad, schedule, *, eps, dtype) -> Tensor`` with the contract of
:func:`torchtitan_dmuon.optim.newton_schulz.newton_schulz`: 2-D or batched 3-D input, output
in ``dtype`` and the input's shape. Registered backends:

* ``"torch"``: the reference loop (bit-equal to torch.optim.Muon).
* ``"triton"``: symmetric Triton kernels (CUDA; ``optim.kernels.triton_ns``), imported on
  first use so that this package imports without Triton.
* ``"gram"``: Gram Newton-Schulz (``optim.kernels.gram_ns``), fewer FLOPs on wide matrices.
* ``"auto"``: per matrix shape, the fastest of them that is correct on this device. The
  picks are made before training: :func:`measure_backends` times each backend on the
  batch of each shape that a rank orthogonalizes per step (or the timings come from the
  disk cache, :mod:`.ns_cache`), :func:`pick_backend` merges the timings of every rank
  that runs a shape, and :func:`set_auto_choices` installs the result, the same on every
  rank (the engine does that for a distributed job). A shape nobody picked for is
  measured in this process at its first use. The backends round differently: name one
  for bit-reproducible runs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence

import torch

from torchtitan_dmuon.optim import ns_cache
from torchtitan_dmuon.optim.kernels.gram_ns import gram_newton_schulz
from torchtitan_dmuon.optim.newton_schulz import EPS, NSSchedule, newton_schulz

__all__ = [
    "AUTO_MIN_SIDE",
    "AUTO_MIN_SIDE_CPU",
    "NS_BACKENDS",
    "NSBackend",
    "auto_key",
    "auto_newton_schulz",
    "bind_ns",
    "check_ns_backend",
    "choose_ns_backend",
    "get_ns_backend",
    "measure_backends",
    "needs_choice",
    "pick_backend",
    "set_auto_choices",
    "timings_for",
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
# The pick per auto_key, agreed by the job's ranks or measured in this process.
_auto_choices: dict[tuple, str] = {}

AutoKey = tuple[str, tuple[int, int], torch.dtype, NSSchedule, float]
Timings = ns_cache.Timings


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


def auto_key(
    device: torch.device, shape: Sequence[int], dtype: torch.dtype, schedule: NSSchedule, eps: float
) -> AutoKey:
    """What an ``"auto"`` pick is per: device type, ``(rows, cols)``, dtype, schedule, eps
    (a backend is checked against torch's result for those)."""
    return (device.type, (int(shape[-2]), int(shape[-1])), dtype, schedule, eps)


def needs_choice(device: torch.device, shape: Sequence[int], dtype: torch.dtype) -> bool:
    """Whether ``"auto"`` measures this shape: a bf16/fp16/fp32 matrix whose short side is
    at least :data:`AUTO_MIN_SIDE_CPU` on CPU, :data:`AUTO_MIN_SIDE` elsewhere (smaller
    ones, and other dtypes, run ``"torch"``)."""
    min_side = AUTO_MIN_SIDE_CPU if device.type == "cpu" else AUTO_MIN_SIDE
    return dtype in _AUTO_TOLERANCE and min(shape[-2:]) >= min_side


def measure_backends(
    shape: Sequence[int],
    schedule: NSSchedule,
    *,
    eps: float,
    dtype: torch.dtype,
    device: torch.device,
) -> Timings:
    """Milliseconds of one Newton-Schulz of a random ``shape`` (a ``(rows, cols)`` matrix
    or a ``(batch, rows, cols)`` stack, as the optimizer batches same-shape matrices) per
    backend that runs here and is correct (within a loose tolerance of torch's result);
    torch is always among them."""
    generator = torch.Generator(device=device).manual_seed(0)
    grad = torch.randn(*shape, generator=generator, device=device)

    def run(name: str) -> torch.Tensor:
        return NS_BACKENDS[name](grad, schedule, eps=eps, dtype=dtype)

    reference = run("torch")  # also the warm-up
    timings = {"torch": _elapsed_ms(lambda: run("torch"), device)}
    for name in _candidates(device):
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
        timings[name] = _elapsed_ms(lambda name=name: run(name), device)
    return timings


def timings_for(
    shapes: Iterable[tuple[int, ...]],
    schedule: NSSchedule,
    *,
    eps: float,
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[dict[tuple[int, ...], Timings], int]:
    """The timings of each (batched) shape, read from the disk cache or measured (and then
    saved).

    Returns:
        The timings per shape, and how many shapes were measured (not in the cache).
    """
    where = ns_cache.device_key(device)
    keys = {shape: ns_cache.timing_key(where, shape, dtype, schedule, eps) for shape in shapes}
    cached = ns_cache.load_timings()
    out = {shape: cached[key] for shape, key in keys.items() if key in cached}
    measured = {}
    for shape, key in keys.items():
        if shape not in out:
            out[shape] = measured[key] = measure_backends(
                shape, schedule, eps=eps, dtype=dtype, device=device
            )
    ns_cache.save_timings(measured)
    return out, len(measured)


def pick_backend(measurements: Sequence[tuple[int, Timings]]) -> str:
    """The backend for one shape from the timings of every rank that runs it.

    Each measurement is ``(weight, timings)``: one rank's timings of its batches of the
    shape in a step, summed, with weight 1, or of one matrix with the number of matrices
    that rank runs. A backend
    is a candidate if every measurement has it, and its cost is the weighted sum over the
    ranks. ``"torch"`` unless a candidate costs less than 97% of it; ties go to the name,
    so every rank merging the same measurements agrees.
    """
    names = set.intersection(*(set(timings) for _, timings in measurements))
    cost = {name: sum(count * t[name] for count, t in measurements) for name in names}
    best = min(sorted(names - {"torch"}), key=cost.__getitem__, default="torch")
    return best if cost.get(best, 0.0) < _AUTO_MARGIN * cost["torch"] else "torch"


def set_auto_choices(picks: dict[AutoKey, str]) -> None:
    """Install picks (from :func:`pick_backend`) for this process's ``"auto"`` runs."""
    _auto_choices.update(picks)


def choose_ns_backend(
    grad: torch.Tensor,
    schedule: NSSchedule,
    *,
    eps: float = EPS,
    dtype: torch.dtype = torch.bfloat16,
) -> str:
    """The backend that ``"auto"`` runs for this input: ``"torch"`` where
    :func:`needs_choice` says no, else the installed pick for its matrix shape; a shape
    without one is measured here (through the disk cache), picked and logged."""
    if not needs_choice(grad.device, grad.shape, dtype):
        return "torch"
    key = auto_key(grad.device, grad.shape, dtype, schedule, eps)
    if key not in _auto_choices:
        shape = tuple(grad.shape)
        timings, _ = timings_for([shape], schedule, eps=eps, dtype=dtype, device=grad.device)
        _auto_choices[key] = pick_backend([(1, timings[shape])])
        logger.info(
            "ns_backend='auto' picked %r for %s %s on %s in this process (ms: %s)",
            _auto_choices[key],
            shape,
            dtype,
            ns_cache.device_key(grad.device),
            {k: round(v, 3) for k, v in timings[shape].items()},
        )
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


def check_ns_backend(name: str, device: torch.device) -> None:
    """Refuse a backend that cannot run on ``device``, before any step: ``"triton"`` needs
    the triton package, and CUDA tensors unless its interpreter is on.

    Raises:
        ValueError: ``name`` is unknown or cannot run here.
    """
    get_ns_backend(name)
    if name != "triton":
        return
    try:
        from torchtitan_dmuon.optim.kernels import triton_ns
    except ImportError as err:
        raise ValueError(f"ns_backend='triton' needs the triton package: {err}") from err
    if device.type != "cuda" and not triton_ns.INTERPRET:
        raise ValueError(
            f"ns_backend='triton' needs CUDA, and the Newton-Schulz runs on {device.type} "
            "here: choose 'torch', 'gram' or 'auto' (or set TRITON_INTERPRET=1 before "
            "importing torchtitan_dmuon to run the kernels, slowly, in Triton's interpreter)"
        )


def bind_ns(name: str, schedule: NSSchedule, *, eps: float, dtype: torch.dtype):
    """A one-argument orthogonalization: backend ``name`` with schedule, eps and dtype bound."""
    backend = get_ns_backend(name)

    def ns(x: torch.Tensor) -> torch.Tensor:
        return backend(x, schedule, eps=eps, dtype=dtype)

    return ns
