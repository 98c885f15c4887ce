"""Owner assignment: which rank orthogonalizes (and stores) each dedicated matrix.

Greedy longest-processing-time (LPT) over the Newton-Schulz cost, with one twist: a
boundary's matrices go to different owners first, so that the broadcasts that
materialize one block come from several sources at once; and the pieces of one 3-D
stack (groups of MoE experts) go to different owners, so that one rank never holds a
whole layer's experts. Pure Python, deterministic: every rank computes the same plan
from the same inputs.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "PartitionItem",
    "assign_owners",
    "expert_ranges",
    "load_balance",
    "max_over_mean",
    "rank_loads",
]


@dataclass(frozen=True)
class PartitionItem:
    """One matrix to place.

    Attributes:
        cost: Its Newton-Schulz cost (FLOPs; only ratios matter).
        boundary: Index of the hook boundary it belongs to.
        stack: For a piece of a 3-D stack split among owners, an index shared by the
            stack's pieces only (no two of them get the same owner); None otherwise.
    """

    cost: int
    boundary: int
    stack: int | None = None


def expert_ranges(experts: int, pieces: int) -> list[tuple[int, int]]:
    """``[start, stop)`` of ``pieces`` contiguous groups of ``experts`` matrices whose
    sizes differ by at most one (larger first)."""
    if not 1 <= pieces <= experts:
        raise ValueError(f"cannot split {experts} experts into {pieces} pieces")
    size, extra = divmod(experts, pieces)
    ranges, start = [], 0
    for i in range(pieces):
        stop = start + size + (i < extra)
        ranges.append((start, stop))
        start = stop
    return ranges


def assign_owners(
    items: Sequence[PartitionItem],
    num_ranks: int,
    initial_load: Sequence[int] | None = None,
) -> list[int]:
    """Give each item an owner rank in ``[0, num_ranks)``.

    Items are taken by decreasing cost (ties: input order). Each goes to the rank that
    holds the fewest items of its boundary so far, and among those to the least loaded
    rank (ties: lowest rank); a stack's piece only to a rank without a piece of that
    stack. ``initial_load`` is each rank's cost before these items (what it already owns
    in another dedication domain).

    Raises:
        ValueError: a stack has more pieces than there are ranks.

    Returns:
        ``owners[i]`` for ``items[i]``.
    """
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
    load = list(initial_load) if initial_load is not None else [0] * num_ranks
    if len(load) != num_ranks:
        raise ValueError(f"initial_load has {len(load)} entries for {num_ranks} ranks")
    per_boundary: dict[int, list[int]] = defaultdict(lambda: [0] * num_ranks)
    per_stack: dict[int, set[int]] = defaultdict(set)
    owners = [0] * len(items)
    for i in sorted(range(len(items)), key=lambda i: (-items[i].cost, i)):
        item = items[i]
        held = per_boundary[item.boundary]
        taken = per_stack[item.stack] if item.stack is not None else set()
        candidates = [r for r in range(num_ranks) if r not in taken]
        if not candidates:
            raise ValueError(f"stack {item.stack} has more pieces than the {num_ranks} ranks")
        owner = min(candidates, key=lambda r: (held[r], load[r], r))
        owners[i] = owner
        taken.add(owner)
        held[owner] += 1
        load[owner] += items[i].cost
    return owners


def rank_loads(items: Sequence[PartitionItem], owners: Sequence[int], num_ranks: int) -> list[int]:
    """The cost each rank owns."""
    load = [0] * num_ranks
    for item, owner in zip(items, owners, strict=True):
        load[owner] += item.cost
    return load


def max_over_mean(values: Sequence[float]) -> float:
    """Max over mean of per-rank figures (1.0 is perfect balance; 1.0 when all are 0)."""
    mean = sum(values) / len(values)
    return max(values) / mean if mean > 0 else 1.0


def load_balance(items: Sequence[PartitionItem], owners: Sequence[int], num_ranks: int) -> float:
    """Max over mean of the per-rank cost (1.0 is perfect balance)."""
    return max_over_mean(rank_loads(items, owners, num_ranks))
