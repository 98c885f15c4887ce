"""Choices the ranks of a dedication share, made once before the first step.

``ns_dtype="auto"`` and ``ns_backend="auto"`` are decided from what each process measures
on its own device, and processes measure differently (other CPUs, timing noise). Two ranks
that orthogonalize matrices of one shape with different backends, or TP peers that
orthogonalize one gathered matrix each with its own, would round differently. So each
rank's verdict goes to every rank of the dedication and all of them merge the same list
the same way: small all-gathers over its shard group, then its replicate group (HSDP),
then its tensor-parallel group, each carrying what the earlier ones gathered (the
experts' groups lie inside those). Exactly the ranks that build the dedication's ``Muon``
join, so a rank holding more dedicated parts than another (pipeline stages) cannot
mismatch the collectives of a group it is not in.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from torchtitan_dmuon.engine.comm import gather_over_groups
from torchtitan_dmuon.engine.dedication import Dedication
from torchtitan_dmuon.optim.newton_schulz import NSSchedule
from torchtitan_dmuon.optim.ns_backends import (
    auto_key,
    needs_choice,
    pick_backend,
    set_auto_choices,
    timings_for,
)
from torchtitan_dmuon.optim.ns_dtype import NSDtypeVerdict, local_ns_dtype

__all__ = ["NSBackendReport", "agree_ns_backends", "failed_ranks", "gather_over", "job_ns_dtype"]

logger = logging.getLogger(__name__)

_logged: set[tuple] = set()


def gather_over(dedication: Dedication | None, obj) -> list:
    """``obj`` of every rank of ``dedication``, in global rank order (``[obj]`` without
    one). A collective over the dedication's groups: every rank of it calls it."""
    if dedication is None:
        return [obj]
    exchange = dedication.exchange
    known = gather_over_groups(
        [exchange.shard_group, exchange.replicate_group, exchange.tp_group], obj
    )
    return [known[rank] for rank in sorted(known)]


def failed_ranks(dedication: Dedication, failed: bool, device: torch.device) -> list[int]:
    """The global ranks of ``dedication`` on which something ``failed``, known to all of
    them: one MAX all-reduce of a flag per rank over its reduce, replicate and
    tensor-parallel groups (idle between backward and the next forward). A collective:
    every rank of the dedication calls it."""
    flags = torch.zeros(dist.get_world_size(), dtype=torch.int32, device=device)
    flags[dist.get_rank()] = int(failed)
    groups = dedication.exchange.data_parallel_groups() + [dedication.exchange.tp_group]
    for group in groups:
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    return flags.nonzero().flatten().tolist()


def _log_once(key: tuple, message: str, *args) -> None:
    if key not in _logged:
        _logged.add(key)
        logger.info(message, *args)


def job_ns_dtype(device: torch.device, dedication: Dedication | None) -> NSDtypeVerdict:
    """The Newton-Schulz dtype of ``ns_dtype="auto"``: this process's verdict
    (:func:`~torchtitan_dmuon.optim.ns_dtype.local_ns_dtype`), agreed with every rank of
    ``dedication`` when there is one (a collective: bf16 only if every rank's verdict is
    bf16; agreeing is per dedication, whose ranks differ from one to another). Logged
    once per process."""
    verdict = local_ns_dtype(device)
    everyone = gather_over(dedication, (verdict.dtype == torch.bfloat16, verdict.reason))
    if dedication is not None:
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
    dedication: Dedication | None,
) -> NSBackendReport:
    """Pick the ``ns_backend="auto"`` backend of every matrix shape of the job and install
    the picks (:func:`~torchtitan_dmuon.optim.ns_backends.set_auto_choices`).

    Each rank times the shapes it orthogonalizes, each as the batch it runs per step
    (``workload``: matrices per shape), through the disk cache; with a ``dedication`` (a
    collective: every rank of it calls it) every rank's timings go to all its ranks, and
    each shape's backend is the one whose time summed over the ranks that run it is least
    (:func:`~torchtitan_dmuon.optim.ns_backends.pick_backend`).
    """
    start = time.perf_counter()
    shapes = [s for s in sorted(workload) if needs_choice(device, s, dtype)]
    # Each shape's whole batch, as the optimizer runs it (a batch times unlike one matrix).
    batches = {s: (workload[s], *s) if workload[s] > 1 else s for s in shapes}
    timings, measured = timings_for(batches.values(), schedule, eps=eps, dtype=dtype, device=device)
    mine = {shape: (1, timings[batches[shape]]) for shape in shapes}
    everyone = gather_over(dedication, mine)
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
