"""The Newton-Schulz every rank of a job runs, decided once: :func:`choose_ns` returns the
one :class:`NSChoice` (schedule, dtype, backend, eps) that ``Muon`` reads everywhere.

``ns_dtype="auto"``: bf16 halves the bytes of every Newton-Schulz matmul and is what tensor
cores and CPUs with native bf16 (AVX512-BF16, AMX) multiply fastest; elsewhere, e.g. a CPU
with AVX2 only, a bf16 matmul is emulated and runs tens of times slower than fp32. So
``"auto"`` is bf16 where the device has native bf16 and one short probe confirms that bf16
is clearly faster than fp32 (by 10%: a near tie stays fp32, so noise does not flip the
verdict between runs), and fp32 everywhere else. :data:`VERDICT_ENV` replaces the probe:
``TORCHTITAN_DMUON_AUTO_NS_DTYPE=bfloat16`` makes this machine choose as one with native
bf16 does, ``=float32`` as an AVX2-only CPU does, so that either kind of machine can run
what the other would (the test suite runs its verdict-sensitive tests both ways).

``ns_backend="auto"``: per matrix shape, the fastest correct backend, from timings each
rank reads from the disk cache (:mod:`.ns_cache`) or measures
(:func:`~torchtitan_dmuon.optim.ns_backends.timings_for`), of exactly the batches its step
runs (the step's own batching, capped at :data:`~torchtitan_dmuon.optim.muon.NS_BATCH_ELEMENTS`).

Batching (every ``ns_backend``): the step orthogonalizes same-shape matrices of several
parameters as one batch, which on an accelerator saves a kernel launch per product. On a
CPU there is no launch to save, and one matrix's iterates staying in cache can beat the
batched kernels (fp32 on the CPUs measured here) or not (bf16 with AMX): on CPU, for each
cache-sized shape that the step batches, a short batch is timed against its matrices one
at a time (taking turns, at every start: a relative verdict that the machine's load at
the time weighs on alike), and the shapes where one at a time is clearly faster form
:attr:`NSChoice.unbatched`.

Processes measure differently (other CPUs, timing noise), and two ranks that orthogonalize
one shape with different backends or dtypes would round differently. So each rank's
verdicts go to every rank of the job through ``gather`` (a collective the engine provides,
over the dedication's groups) and all of them merge the same list the same way: bf16 only
if every rank's verdict is bf16; per shape the backend whose time summed over the ranks
that run it is least; a shape runs unbatched if one at a time costs less, summed over the
ranks, than batched. This module does not import ``torch.distributed``.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from torchtitan_dmuon.optim.config import MuonConfig
from torchtitan_dmuon.optim.muon import NSFunction, _batches
from torchtitan_dmuon.optim.newton_schulz import NSSchedule
from torchtitan_dmuon.optim.ns_backends import (
    auto_key,
    bind_ns,
    check_ns_backend,
    needs_choice,
    pick_backend,
    set_auto_choices,
    timings_for,
)
from torchtitan_dmuon.optim.ns_cache import cpu_description

__all__ = [
    "VERDICT_ENV",
    "NSBackendReport",
    "NSChoice",
    "NSDtypeVerdict",
    "check_ns",
    "choose_ns",
    "forced_ns_dtype",
    "local_ns_dtype",
    "step_batches",
]

logger = logging.getLogger(__name__)

Gather = Callable[[object], list]
"""``gather(obj)``: ``obj`` of every rank of the job, in rank order (a collective)."""

Workload = Callable[[torch.dtype], dict[tuple[int, int], list[int]]]
"""``workload(dtype)``: per ``(rows, cols)``, the matrices of each parameter (1, or a
stack's count) this rank orthogonalizes with the backend each step, in the order its step
batches them, in Newton-Schulz dtype ``dtype`` (under tensor parallelism the dtype decides
which matrices take the Gram all-reduce path instead)."""

VERDICT_ENV = "TORCHTITAN_DMUON_AUTO_NS_DTYPE"
"""Environment variable that, when set, is ``"auto"``'s verdict instead of the probe's:
``bfloat16`` or ``float32``."""
_VERDICTS = ("bfloat16", "float32")

_PROBE_SIDE = 256
_PROBE_REPEATS = 5
# bf16 must beat fp32 by this factor: a near tie, which timing noise could flip from one
# run to the next on the same machine, keeps the more precise fp32 (native bf16 wins by
# far more: AMX several times, AVX512-BF16 about twice).
_BF16_MARGIN = 0.9
# One parameter at a time must beat the batch by this factor (as a backend must beat torch).
_UNBATCHED_MARGIN = 0.97
# Batching is timed on this many matrices (the per-matrix cost of a longer batch is the
# same; the probe stays short however many matrices a rank owns), each way this many times.
_BATCH_PROBE = 4
_BATCHING_REPEATS = 3
# Larger matrices (1 MiB in fp32) do not fit a core's cache: their products stream from
# memory batched or not.
_UNBATCHED_MAX_ELEMENTS = 1 << 18
_X86 = {"x86_64", "amd64", "i386", "i686"}


@dataclass(frozen=True)
class NSDtypeVerdict:
    """A Newton-Schulz dtype and why it was chosen.

    Attributes:
        dtype: The compute dtype.
        reason: One line for the log, naming the device and what decided.
    """

    dtype: torch.dtype
    reason: str


def _device_description(device: torch.device) -> str:
    """What a verdict's reason names: the CPU's model and capability, else the device type."""
    return cpu_description() if device.type == "cpu" else device.type


def _matmul_ms(dtype: torch.dtype, device: torch.device) -> float:
    """The median of :data:`_PROBE_REPEATS` timed matmuls (one sample flips the verdict
    under load). Its own generator: the probe leaves the global RNG, and so a model
    initialized after it, as it found them."""
    generator = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(_PROBE_SIDE, _PROBE_SIDE, device=device, generator=generator).to(dtype)
    a @ a  # warm-up: kernel selection, first-touch
    samples = []
    for _ in range(_PROBE_REPEATS):
        start = time.perf_counter()
        a @ a
        if device.type != "cpu":
            torch.accelerator.synchronize(device)
        samples.append(1e3 * (time.perf_counter() - start))
    return statistics.median(samples)


def _native_cpu_bf16() -> bool:
    """Whether this CPU has bf16 instructions torch's kernels use. Only x86 can be asked;
    elsewhere (e.g. ARM's BF16 extension) the probe alone decides."""
    if platform.machine().lower() not in _X86:
        return True
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def forced_ns_dtype() -> torch.dtype | None:
    """The verdict :data:`VERDICT_ENV` sets, or None when it is unset or empty.

    Raises:
        ValueError: It is set to anything but ``bfloat16`` or ``float32``.
    """
    value = os.environ.get(VERDICT_ENV, "")
    if not value:
        return None
    if value not in _VERDICTS:
        raise ValueError(f"{VERDICT_ENV} must be one of {_VERDICTS} (or unset), got {value!r}")
    return getattr(torch, value)


def local_ns_dtype(device: torch.device) -> NSDtypeVerdict:
    """What ``"auto"`` picks on ``device`` in this process.

    :data:`VERDICT_ENV`, when set. Otherwise CUDA: bf16 where the GPU supports it
    natively. CPU: fp32 unless it has native bf16; then, and on other accelerators,
    256^3 matmuls in each dtype decide (bf16 if its median time is at most 0.9x fp32's).
    The probe runs once per process and device.

    Raises:
        ValueError: :data:`VERDICT_ENV` holds neither ``bfloat16`` nor ``float32``.
    """
    forced = forced_ns_dtype()
    if forced is not None:
        name = str(forced).removeprefix("torch.")
        return NSDtypeVerdict(
            forced, f"{_device_description(device)}: {VERDICT_ENV}={name} (the probe is skipped)"
        )
    return _probed_ns_dtype(device)


@functools.cache
def _probed_ns_dtype(device: torch.device) -> NSDtypeVerdict:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        if torch.cuda.is_bf16_supported(including_emulation=False):
            return NSDtypeVerdict(torch.bfloat16, f"{name} multiplies bf16 natively")
        return NSDtypeVerdict(torch.float32, f"{name} has no native bf16")
    where = _device_description(device)
    if device.type == "cpu" and not _native_cpu_bf16():
        return NSDtypeVerdict(
            torch.float32, f"{where} has no native bf16 (no AVX512-BF16 or AMX): fp32"
        )
    bf16_ms = _matmul_ms(torch.bfloat16, device)
    fp32_ms = _matmul_ms(torch.float32, device)
    probe = f"{_PROBE_SIDE}^3 matmul: bf16 {bf16_ms:.2f} ms, fp32 {fp32_ms:.2f} ms"
    if bf16_ms <= _BF16_MARGIN * fp32_ms:
        return NSDtypeVerdict(torch.bfloat16, f"{where}: {probe}")
    return NSDtypeVerdict(torch.float32, f"{where}: bf16 is not clearly faster ({probe})")


_logged: set[tuple] = set()


def _log_once(key: tuple, message: str, *args) -> None:
    if key not in _logged:
        _logged.add(key)
        logger.info(message, *args)


@dataclass(frozen=True)
class NSBackendReport:
    """What ``ns_backend="auto"`` measured and picked on this rank.

    Attributes:
        picks: The installed backend per ``(rows, cols)`` (every rank's shapes).
        measured: Batch shapes this rank measured (not found in the disk cache).
        cached: Batch shapes this rank read from the disk cache.
        seconds: Wall time of the whole decision on this rank.
    """

    picks: dict[tuple[int, int], str]
    measured: int
    cached: int
    seconds: float


@dataclass(frozen=True)
class NSChoice:
    """The Newton-Schulz of one optimizer, the same on every rank of its job.

    Attributes:
        schedule: The per-step coefficients.
        dtype: The compute dtype.
        dtype_reason: Why (one line for the log: the device and what decided, or
            ``"named"``).
        backend: The backend's name (``"auto"``: per shape, see ``backend_report``).
        eps: Floor of the normalizing norm.
        backend_report: What ``"auto"`` measured and picked; None for a named backend.
        unbatched: ``(rows, cols)`` shapes whose parameters the step orthogonalizes one at
            a time rather than batched (CPU only, measured; see the module docstring).
    """

    schedule: NSSchedule
    dtype: torch.dtype
    dtype_reason: str
    backend: str
    eps: float
    backend_report: NSBackendReport | None = None
    unbatched: frozenset[tuple[int, int]] = frozenset()

    def bind(self) -> NSFunction:
        """The orthogonalization of one matrix or batch, with everything here bound."""
        return bind_ns(self.backend, self.schedule, eps=self.eps, dtype=self.dtype)


def check_ns(config: MuonConfig, device: torch.device) -> None:
    """What :func:`choose_ns` would refuse, without any collective (so that every rank
    refuses alike, before the first).

    Raises:
        ValueError: ``config.ns_backend`` cannot run on ``device``, or :data:`VERDICT_ENV`
            holds a bad value.
    """
    check_ns_backend(config.ns_backend, device)
    if config.ns_dtype == "auto":
        forced_ns_dtype()


def choose_ns(
    config: MuonConfig, device: torch.device, workload: Workload, gather: Gather | None = None
) -> NSChoice:
    """Decide the Newton-Schulz of ``config`` for a job whose matrices run on ``device``.

    With ``gather`` (distributed), a collective when ``config`` says ``"auto"`` (dtype or
    backend): every rank of the job calls it, and all get the same choice; without it,
    this process decides alone.

    Raises:
        ValueError: The backend cannot run on ``device`` (checked before any gather, so
            every rank refuses alike), or :data:`VERDICT_ENV` holds a bad value.
    """
    check_ns(config, device)
    schedule = config.ns_schedule
    if config.ns_dtype == "auto":
        verdict = _job_ns_dtype(device, gather)
    else:
        verdict = NSDtypeVerdict(getattr(torch, config.ns_dtype), "named")
    # Read once, where a choice below needs it: "auto" backends, batching on CPU.
    work = workload(verdict.dtype) if config.ns_backend == "auto" or device.type == "cpu" else {}
    report = None
    if config.ns_backend == "auto":
        report = _agree_ns_backends(work, schedule, config.eps, verdict.dtype, device, gather)
    unbatched = frozenset()
    if device.type == "cpu":  # the same on every rank: all of them gather, or none
        unbatched = _agree_batching(
            work,
            # "auto" runs torch on the shapes it does not time
            lambda shape: report.picks.get(shape, "torch") if report else config.ns_backend,
            schedule,
            config.eps,
            verdict.dtype,
            device,
            gather,
        )
    return NSChoice(
        schedule, verdict.dtype, verdict.reason, config.ns_backend, config.eps, report, unbatched
    )


def _job_ns_dtype(device: torch.device, gather: Gather | None) -> NSDtypeVerdict:
    """This process's ``"auto"`` verdict, agreed with every rank ``gather`` reaches: bf16
    only if every rank's verdict is bf16. Logged once per process."""
    verdict = local_ns_dtype(device)
    if gather is not None:
        everyone = gather((verdict.dtype == torch.bfloat16, verdict.reason))
        slow = [reason for fast, reason in everyone if not fast]
        if slow and verdict.dtype == torch.bfloat16:
            verdict = NSDtypeVerdict(torch.float32, f"a peer rank: {slow[0]}")
        verdict = NSDtypeVerdict(
            verdict.dtype, f"{verdict.reason}; agreed by {len(everyone)} ranks"
        )
    _log_once(
        ("dtype", verdict), "dmuon: ns_dtype='auto' chose %s: %s", verdict.dtype, verdict.reason
    )
    return verdict


def _agree_ns_backends(
    workload: dict[tuple[int, int], int],
    schedule: NSSchedule,
    eps: float,
    dtype: torch.dtype,
    device: torch.device,
    gather: Gather | None,
) -> NSBackendReport:
    """Pick the ``"auto"`` backend of every matrix shape of the job and install the picks
    (:func:`~torchtitan_dmuon.optim.ns_backends.set_auto_choices`).

    Each rank times the batches it runs per step of each shape (:func:`step_batches`),
    through the disk cache; a shape's time on a rank is the sum over its batches. Every
    rank's times go to all ranks, and each shape's backend is the one whose time summed
    over the ranks that run it is least
    (:func:`~torchtitan_dmuon.optim.ns_backends.pick_backend`).
    """
    start = time.perf_counter()
    shapes = [s for s in sorted(workload) if needs_choice(device, s, dtype)]
    batches = {s: step_batches(s, workload[s]) for s in shapes}
    distinct = list(dict.fromkeys(b for s in shapes for b in batches[s]))
    timings, measured = timings_for(distinct, schedule, eps=eps, dtype=dtype, device=device)
    mine = {s: (1, _summed([timings[b] for b in batches[s]])) for s in shapes}
    everyone = gather(mine) if gather is not None else [mine]
    per_shape: dict[tuple[int, int], list] = {}
    for rows in everyone:
        for shape, measurement in rows.items():
            per_shape.setdefault(shape, []).append(measurement)
    picks = {shape: pick_backend(per_shape[shape]) for shape in sorted(per_shape)}
    set_auto_choices(
        {auto_key(device, shape, dtype, schedule, eps): name for shape, name in picks.items()}
    )
    report = NSBackendReport(picks, measured, len(distinct) - measured, time.perf_counter() - start)
    logger.info(
        "dmuon: ns_backend='auto' for %s on %d rank(s): %s (each backend checked against "
        "torch's result on this device for the shape, coefficients, dtype and eps; this "
        "rank: %d shapes measured, %d from the cache, %.2f s)",
        dtype, len(everyone),
        ", ".join(f"{r}x{c} {name}" for (r, c), name in picks.items()) or "no shape to pick",
        report.measured, report.cached, report.seconds,
    )  # fmt: skip
    return report


def _agree_batching(
    workload: dict[tuple[int, int], list[int]],
    backend_of: Callable[[tuple[int, int]], str],
    schedule: NSSchedule,
    eps: float,
    dtype: torch.dtype,
    device: torch.device,
    gather: Gather | None,
) -> frozenset[tuple[int, int]]:
    """The matrix shapes whose parameters run Newton-Schulz one at a time.

    For each shape of which its step batches several parameters, a rank times a batch of
    at most :data:`_BATCH_PROBE` matrices against the same matrices one at a time, with the
    shape's backend (``backend_of``; :func:`batching_ms`), and counts the matrices that
    batching would join; the costs go to every rank, and a shape runs unbatched where one
    at a time costs less than :data:`_UNBATCHED_MARGIN` times batched, summed over the
    ranks. Only shapes that ``"auto"`` times (:func:`needs_choice`) and whose matrix fits a
    core's cache (:data:`_UNBATCHED_MAX_ELEMENTS`) are measured: larger ones stream from
    memory either way and stay batched."""
    mine = {}
    for shape, counts in sorted(workload.items()):
        if not needs_choice(device, shape, dtype) or math.prod(shape) > _UNBATCHED_MAX_ELEMENTS:
            continue
        sizes = [
            sum(counts[i] for i in batch) for batch in _batches(_stand_ins(shape, counts))
            if len(batch) > 1
        ]  # fmt: skip
        if sizes:  # a probe no longer than the step's batches (NS_BATCH_ELEMENTS)
            ns = bind_ns(backend_of(shape), schedule, eps=eps, dtype=dtype)
            batched_ms, alone_ms = batching_ms(ns, (min(_BATCH_PROBE, max(sizes)), *shape), device)
            mine[shape] = (sum(sizes) * batched_ms, sum(sizes) * alone_ms)
    everyone = gather(mine) if gather is not None else [mine]
    summed: dict[tuple[int, int], list[float]] = {}
    for rows in everyone:
        for shape, costs in rows.items():
            total = summed.setdefault(shape, [0.0, 0.0])
            total[0] += costs[0]
            total[1] += costs[1]
    unbatched = frozenset(
        shape for shape, (batched_ms, alone_ms) in summed.items()
        if alone_ms < _UNBATCHED_MARGIN * batched_ms
    )  # fmt: skip
    if summed:
        _log_once(
            ("batching", dtype, tuple(sorted(unbatched)), len(everyone)),
            "dmuon: Newton-Schulz batching on %s, %s, over %d rank(s) (ms a step, batched / "
            "one parameter at a time): %s",
            _device_description(device),
            dtype,
            len(everyone),
            ", ".join(
                f"{r}x{c} {b:.1f} / {a:.1f} {'unbatched' if (r, c) in unbatched else 'batched'}"
                for (r, c), (b, a) in sorted(summed.items())
            ),
        )
    return unbatched


def batching_ms(ns: NSFunction, shape: tuple[int, int, int], device: torch.device):
    """Milliseconds a matrix of a ``(batch, rows, cols)`` stack takes, orthogonalized by
    ``ns`` as one batch and one matrix at a time: the fastest of
    :data:`_BATCHING_REPEATS` runs of each, the two taking turns so that a load on the
    machine weighs on both alike (CPU: nothing to synchronize). Its own generator (the
    global RNG is left alone)."""
    generator = torch.Generator(device=device).manual_seed(0)
    stack = torch.randn(*shape, generator=generator, device=device)
    runs = {"batched": lambda: ns(stack), "alone": lambda: [ns(m) for m in stack.unbind()]}
    samples: dict[str, list[float]] = {name: [] for name in runs}
    for repeat in range(_BATCHING_REPEATS + 1):  # the first is the warm-up
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            if repeat:
                samples[name].append(time.perf_counter() - start)
    return tuple(1e3 * min(samples[name]) / shape[0] for name in runs)


def _stand_ins(shape: tuple[int, int], counts: Sequence[int]) -> list[torch.Tensor]:
    """Meta tensors of the parameters ``counts`` describes (a matrix, or a stack of n)."""
    return [torch.empty((n, *shape) if n > 1 else shape, device="meta") for n in counts]


def step_batches(shape: tuple[int, int], counts: Sequence[int]) -> list[tuple[int, ...]]:
    """The shapes Newton-Schulz gets in one step for parameters of matrix shape ``shape``
    holding ``counts`` matrices each (in step order): the step's own batching
    (:func:`~torchtitan_dmuon.optim.muon.muon_update`), applied to shape-only stand-ins.

    A batch of one parameter runs as that parameter (a matrix, or a stack); a batch of
    several runs as one stack of all their matrices.
    """
    params = _stand_ins(shape, counts)
    return [
        tuple(params[batch[0]].shape)
        if len(batch) == 1
        else (sum(counts[i] for i in batch), *shape)
        for batch in _batches(params)
    ]


def _summed(timings: list[dict[str, float]]) -> dict[str, float]:
    """Milliseconds per backend over several batches, for the backends timed on all."""
    names = set.intersection(*(set(t) for t in timings))
    return {name: sum(t[name] for t in timings) for name in sorted(names)}
