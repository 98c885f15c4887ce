"""What a dedication's placement means to its readers: checkpoint geometry and the balance
report. Functions of a :class:`~torchtitan_dmuon.engine.dedication.Dedication` that only
read it (no collective)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from torchtitan_dmuon.engine.partition import max_over_mean

if TYPE_CHECKING:
    from torchtitan_dmuon.engine.dedication import Dedication

__all__ = ["log_balance", "piece_shards"]

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
            if d.name != name or d.experts is None:
                continue
            start, stop = d.experts
            sizes = [stop - start, *d.local_shape[1:]]
            if u.domain == 0:
                shards.append(([start, 0, 0], sizes, dedication.slot_ranks[slot]))
                continue
            split = d.split_dim  # the dim expert tensor parallelism splits, or None
            for ep_rank in range(dedication.ep_size):
                for etp_rank in range(dedication.etp_size):
                    offsets = [d.experts_of(ep_rank)[0], 0, 0]
                    if split is not None:
                        offsets[split] = etp_rank * sizes[split]
                    owner = dedication.expert_owner_ranks[ep_rank, slot, etp_rank]
                    shards.append((offsets, sizes, owner))
    return sorted(shards)


def log_balance(dedication: Dedication) -> None:
    held = dedication.held_bytes()
    logger.info(
        "dmuon: per-rank Newton-Schulz cost max/mean %.3f, held dedicated bytes "
        "(values + masters + momentum) max/mean %.3f (max %.1f MiB), %d stacks split "
        "into %d pieces",
        dedication.balance(),
        max_over_mean(held),
        max(held) / 2**20,
        len({d.name for d in dedication.plan.params if d.experts is not None}),
        sum(1 for d in dedication.plan.params if d.experts is not None),
    )
    if len(dedication.plan.domains) == 2:
        layout = dedication.plan.domains[1]
        logger.info(
            "dmuon: expert parallelism: local experts dedicated over %d x %d ranks "
            "(replicate x efsdp), dense matrices over %d x %d; per-rank Newton-Schulz "
            "cost max/mean: experts %.3f, dense %.3f, together %.3f",
            layout.replicate_size, layout.shard_size,
            dedication.plan.replicate_size, dedication.plan.shard_size,
            dedication.balance(1), dedication.balance(0), dedication.balance(),
        )  # fmt: skip
