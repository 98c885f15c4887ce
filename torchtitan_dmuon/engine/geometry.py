"""What a dedication's placement means to its readers: checkpoint geometry, the
Newton-Schulz workload and the balance report. Functions of a
:class:`~torchtitan_dmuon.engine.dedication.Dedication` that only read it (no collective)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from torchtitan_dmuon.engine.partition import max_over_mean
from torchtitan_dmuon.optim.newton_schulz import matrix_count
from torchtitan_dmuon.optim.sharded_ns import sharded_ns_method

if TYPE_CHECKING:
    from torchtitan_dmuon.engine.dedication import Dedication

__all__ = ["held_bytes", "log_balance", "ns_workload", "piece_shards"]

logger = logging.getLogger("torchtitan_dmuon.engine.dedication")


def piece_shards(dedication: Dedication, name: str) -> list[tuple[list[int], list[int], int]]:
    """``(offsets, sizes, global rank of the primary owner)`` of every piece of the
    split stack ``name`` in the whole stack: under expert parallelism the pieces of
    every ``ep`` rank's local experts, and under expert tensor parallelism each
    piece's shards (needs ``verify_plan``, which ``Muon`` runs)."""
    if dedication.slot_ranks is None:
        raise RuntimeError(
            "the owners' global ranks are not known yet: build the Muon optimizer on "
            "the model first (it verifies the plan across ranks)"
        )
    shards = []
    for u in dedication.plan.units:
        layout = dedication.plan.domains[u.domain]
        slot = u.primary_replica * layout.shard_size + u.column
        for d in u.params:
            if d.name != name or not d.layout.is_piece:
                continue
            start, stop = d.layout.experts
            sizes = list(d.layout.local_shape)
            if u.domain == 0:
                shards.append(([start, 0, 0], sizes, dedication.slot_ranks[slot]))
                continue
            split = d.layout.split_dim  # the dim expert tensor parallelism splits, or None
            for ep_rank in range(d.layout.ep_size):
                for etp_rank in range(d.layout.etp_size):
                    offsets = [d.layout.experts_of(ep_rank)[0], 0, 0]
                    if split is not None:
                        offsets[split] = etp_rank * sizes[split]
                    owner = dedication.expert_owner_ranks[ep_rank, slot, etp_rank]
                    shards.append((offsets, sizes, owner))
    return sorted(shards)


def ns_workload(
    dedication: Dedication, backend: str, dtype: torch.dtype, steps: int
) -> dict[tuple[int, int], int]:
    """Matrices per ``(rows, cols)`` that ``backend`` orthogonalizes on this rank each
    step: those of which it is the primary owner, whole, and the tensor-parallel matrices
    its owner column gathers (the Gram path runs no backend)."""
    out: dict[tuple[int, int], int] = {}
    tensor_parallel = dedication.exchange.tp_group is not None
    for unit in dedication.units:
        if not unit.primary:
            continue
        for d in unit.params:
            shape, split = d.layout.shape, d.layout.split_dim  # whole matrices (a piece's)
            if split is not None and tensor_parallel:
                if (
                    sharded_ns_method(shape, split, dtype.itemsize, steps, backend=backend)
                    == "gram"
                ):
                    continue
            key = (int(shape[-2]), int(shape[-1]))
            out[key] = out.get(key, 0) + matrix_count(shape)
    return out


def held_bytes(dedication: Dedication) -> list[int]:
    """Bytes each rank (slot order) keeps between steps for dedicated matrices (values,
    masters and momentum), from the plan and the bound dtypes."""
    unit = dedication.units[0]
    compute_dtype = unit.buffers[0].dtype
    mixed = compute_dtype != unit.master_dtype  # a master beside the momentum
    state_bytes = unit.master_dtype.itemsize * (2 if mixed else 1)
    return dedication.plan.held_bytes(compute_dtype.itemsize, state_bytes)


def log_balance(dedication: Dedication) -> None:
    held = held_bytes(dedication)
    logger.info(
        "dmuon: per-rank Newton-Schulz cost max/mean %.3f, held dedicated bytes "
        "(values + masters + momentum) max/mean %.3f (max %.1f MiB), %d stacks split "
        "into %d pieces",
        dedication.balance(),
        max_over_mean(held),
        max(held) / 2**20,
        len({d.name for d in dedication.plan.params if d.layout.is_piece}),
        sum(1 for d in dedication.plan.params if d.layout.is_piece),
    )
    if dedication.plan.expert_parallel:
        layout = dedication.plan.domains[1]
        logger.info(
            "dmuon: expert parallelism: local experts dedicated over %d x %d ranks "
            "(replicate x efsdp), dense matrices over %d x %d; per-rank Newton-Schulz "
            "cost max/mean: experts %.3f, dense %.3f, together %.3f",
            layout.replicate_size, layout.shard_size,
            dedication.plan.replicate_size, dedication.plan.shard_size,
            dedication.balance(1), dedication.balance(0), dedication.balance(),
        )  # fmt: skip
