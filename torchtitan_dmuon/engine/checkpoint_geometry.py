"""Where the pieces of a split dedicated stack lie in the whole stack, and which global
rank saves each: what a checkpoint of split stacks (``titan/checkpoint.py``) writes and
reads. Per piece the layout knows its own shards (``ParamLayout.piece_shards``); this adds
the owners' global ranks, known once ``verify_plan`` (``Muon``'s constructor) gathered
them."""

from __future__ import annotations

import functools

from torchtitan_dmuon.engine.dedication import Dedication
from torchtitan_dmuon.engine.param_layout import PieceShard

__all__ = ["piece_shards"]


def piece_shards(dedication: Dedication, name: str) -> list[PieceShard]:
    """``(offsets, sizes, global rank of the primary owner)`` of every piece of the split
    stack ``name`` in the whole stack: under expert parallelism the pieces of every ``ep``
    rank's local experts, and under expert tensor parallelism each piece's shards.

    Raises:
        RuntimeError: The owners' global ranks are not known yet (no ``Muon`` built), or
            not at all (the fake backend of a dry run).
    """
    if dedication.slot_ranks is None:
        raise RuntimeError(
            "the owners' global ranks are not known yet: build the Muon optimizer on "
            "the model first (it verifies the plan across ranks)"
        )
    plan, shards = dedication.plan, []
    for u in plan.units:
        domain = plan.domains[u.domain]
        slot = u.primary_replica * domain.shard_size + u.column
        owner = functools.partial(_owner_rank, dedication, u.domain, slot)
        for d in u.params:
            if d.name == name:
                shards += d.layout.piece_shards(owner)
    return sorted(shards)


def _owner_rank(dedication: Dedication, domain: int, slot: int, ep_rank: int, etp_rank: int) -> int:
    """The global rank of the owner in ``slot`` of a plan domain (the experts': of the
    local experts of ``ep_rank``, expert tensor-parallel shard ``etp_rank``)."""
    if domain == 0:
        return dedication.slot_ranks[slot]
    if dedication.expert_owner_ranks is None:
        raise RuntimeError(
            "the split expert stacks' owners are not known under the fake backend (a "
            "dry run gathers nothing): their checkpoints need a real process group"
        )
    return dedication.expert_owner_ranks[ep_rank, slot, etp_rank]
