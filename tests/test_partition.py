"""Owner assignment (pure Python, no process group)."""

import pytest

from torchtitan_dmuon.engine.partition import PartitionItem, assign_owners, load_balance
from torchtitan_dmuon.optim.newton_schulz import ns_flops


def _llama_like(layers=4, d=64, hidden=176):
    shapes = [(d, d)] * 4 + [(hidden, d), (hidden, d), (d, hidden)]
    return [PartitionItem(ns_flops(s, 5), layer) for layer in range(layers) for s in shapes]


def test_each_block_spreads_over_distinct_owners_and_balances():
    items = _llama_like()
    owners = assign_owners(items, 8)
    for layer in range(4):
        block = [o for o, it in zip(owners, items, strict=True) if it.boundary == layer]
        assert len(set(block)) == len(block) == 7
    assert load_balance(items, owners, 8) < 1.15
    assert load_balance(items, assign_owners(items, 4), 4) < 1.05


def test_deterministic_and_lpt_order():
    items = _llama_like()
    assert assign_owners(items, 4) == assign_owners(list(items), 4)
    # The largest matrices go first, to different ranks.
    costs = [PartitionItem(c, 0) for c in (5, 9, 7, 1)]
    assert assign_owners(costs, 2) == [1, 0, 1, 0]


def test_more_ranks_than_matrices_leaves_ranks_empty():
    items = [PartitionItem(10, 0), PartitionItem(20, 0)]
    owners = assign_owners(items, 4)
    assert sorted(owners) == [0, 1]
    assert load_balance(items, owners, 4) == pytest.approx(20 / (30 / 4))


def test_rejects_no_ranks():
    with pytest.raises(ValueError, match="num_ranks"):
        assign_owners([PartitionItem(1, 0)], 0)
