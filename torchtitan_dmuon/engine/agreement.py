"""Choices every rank of a job shares, made once before the first step.

``ns_dtype="auto"`` and ``ns_backend="auto"`` are decided from what each process measures
on its own device, and processes measure differently (other CPUs, timing noise). Two ranks
that orthogonalize matrices of one shape with different backends, or TP peers that
orthogonalize one gathered matrix each with its own, would round differently. So each
rank's verdict goes to every rank (one small all-gather over the default process group,
which every rank of the job joins while it builds its optimizer) and all of them merge
the same list the same way.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from torchtitan_dmuon.optim.newton_schulz import NSSchedule
from torchtitan_dmuon.optim.ns_backends import (
    auto_key,
    needs_choice,
    pick_backend,
    set_auto_choices,
    timings_for,
)
from torchtitan_dmuon.optim.ns_dtype import NSDtypeVerdict, local_ns_dtype

__all__ = ["NSBackendReport", "agree_ns_backends", "job_ns_dtype"]

logger = logging.getLogger(__name__)

# One verdict per process and device type: "decided once per job". Keyed apart for a
# job-wide (agreed) and a one-process verdict, since only the first is collective.
_dtype_verdicts: dict[tuple[str, bool], NSDtypeVerdict] = {}


def _all_gather(obj) -> list:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def job_ns_dtype(device: torch.device, distributed: bool) -> NSDtypeVerdict:
    """The Newton-Schulz dtype of ``ns_dtype="auto"`` for this job, decided at the first
    call in this process and logged once.

    Args:
        device: Where the Newton-Schulz runs.
        distributed: Agree with every rank of the default process group (a collective:
            every rank calls it): bf16 only if every rank's verdict is bf16.
    """
    key = (device.type, distributed)
    if key in _dtype_verdicts:
        return _dtype_verdicts[key]
    verdict = local_ns_dtype(device)
    if distributed:
        everyone = _all_gather((verdict.dtype == torch.bfloat16, verdict.reason))
        slow = [(rank, reason) for rank, (fast, reason) in enumerate(everyone) if not fast]
        if slow and verdict.dtype == torch.bfloat16:
            rank, reason = slow[0]
            verdict = NSDtypeVerdict(torch.float32, f"rank {rank}: {reason}")
        verdict = NSDtypeVerdict(
            verdict.dtype, f"{verdict.reason}; agreed by {len(everyone)} ranks"
        )
    logger.info("dmuon: ns_dtype='auto' chose %s: %s", verdict.dtype, verdict.reason)
    _dtype_verdicts[key] = verdict
    return verdict


@dataclass(frozen=True)
class NSBackendReport:
    """What one :func:`agree_ns_backends` did on this rank.

    Attributes:
        picks: The installed backend per ``(rows, cols)`` (every rank's shapes).
        measured: Shapes this rank measured (not found in the disk cache).
        cached: Shapes this rank read from the disk cache.
        seconds: Wall time of the whole decision on this rank.
    """

    picks: dict[tuple[int, int], str]
    measured: int
    cached: int
    seconds: float


def agree_ns_backends(
    workload: dict[tuple[int, int], int],
    schedule: NSSchedule,
    *,
    eps: float,
    dtype: torch.dtype,
    device: torch.device,
    distributed: bool,
) -> NSBackendReport:
    """Pick the ``ns_backend="auto"`` backend of every matrix shape of the job and install
    the picks (:func:`~torchtitan_dmuon.optim.ns_backends.set_auto_choices`).

    Each rank times the shapes it orthogonalizes (``workload``: matrices per shape per
    step), through the disk cache; with ``distributed`` (a collective: every rank of the
    default process group calls it) every rank's timings go to all, and each shape's
    backend is merged from the timings of every rank that runs it, weighted by how many
    matrices it runs (:func:`~torchtitan_dmuon.optim.ns_backends.pick_backend`).
    """
    start = time.perf_counter()
    shapes = [s for s in sorted(workload) if needs_choice(device, s, dtype)]
    timings, measured = timings_for(shapes, schedule, eps=eps, dtype=dtype, device=device)
    mine = {shape: (workload[shape], timings[shape]) for shape in shapes}
    everyone = _all_gather(mine) if distributed else [mine]
    per_shape: dict[tuple[int, int], list] = {}
    for rows in everyone:
        for shape, measurement in rows.items():
            per_shape.setdefault(shape, []).append(measurement)
    picks = {shape: pick_backend(per_shape[shape]) for shape in sorted(per_shape)}
    set_auto_choices(
        {auto_key(device, shape, dtype, schedule.steps): name for shape, name in picks.items()}
    )
    report = NSBackendReport(picks, measured, len(shapes) - measured, time.perf_counter() - start)
    logger.info(
        "dmuon: ns_backend='auto' for %s on %d rank(s): %s (this rank: %d shapes measured, "
        "%d from the cache, %.2f s)",
        dtype, len(everyone),
        ", ".join(f"{r}x{c} {name}" for (r, c), name in picks.items()) or "no shape to pick",
        report.measured, report.cached, report.seconds,
    )  # fmt: skip
    return report
