"""Owner assignment: which rank orthogonalizes (and stores) each dedicated matrix.

Greedy longest-processing-time (LPT) over the Newton-Schulz cost, with one twist: a
boundary's matrices go to different owners first, so that the broadcasts that
materialize one block come from several sources at once. Pure Python, deterministic:
every rank computes the same plan from the same inputs.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["PartitionItem", "assign_owners", "load_balance"]


@dataclass(frozen=True)
class PartitionItem:
    """One matrix to place.

    Attributes:
        cost: Its Newton-Schulz cost (FLOPs; only ratios matter).
        boundary: Index of the hook boundary it belongs to.
    """

    cost: int
    boundary: int


def assign_owners(items: Sequence[PartitionItem], num_ranks: int) -> list[int]:
    """Give each item an owner rank in ``[0, num_ranks)``.

    Items are taken by decreasing cost (ties: input order). Each goes to the rank that
    holds the fewest items of its boundary so far, and among those to the least loaded
    rank (ties: lowest rank).

    Returns:
        ``owners[i]`` for ``items[i]``.
    """
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
    load = [0] * num_ranks
    per_boundary: dict[int, list[int]] = defaultdict(lambda: [0] * num_ranks)
    owners = [0] * len(items)
    for i in sorted(range(len(items)), key=lambda i: (-items[i].cost, i)):
        held = per_boundary[items[i].boundary]
        owner = min(range(num_ranks), key=lambda r: (held[r], load[r], r))
        owners[i] = owner
        held[owner] += 1
        load[owner] += items[i].cost
    return owners


def load_balance(items: Sequence[PartitionItem], owners: Sequence[int], num_ranks: int) -> float:
    """Max over mean of the per-rank cost (1.0 is perfect balance)."""
    load = [0] * num_ranks
    for item, owner in zip(items, owners, strict=True):
        load[owner] += item.cost
    mean = sum(load) / num_ranks
    return max(load) / mean if mean > 0 else 1.0
