"""HSDP: a (replicate, shard) mesh, two-stage reduce, async replicate broadcast."""

import pytest
import torch

from tests.support.dist import run_distributed
from tests.support.models import make_model, proj_predicate
from tests.support.workers import train_configs, train_reference

STEPS = 10
DEDICATED = [p for n, p in make_model().named_parameters() if proj_predicate(n, p)]
DEDICATED_BYTES = sum(p.numel() * 4 for p in DEDICATED)
FLAG_BYTES = 4 * len(DEDICATED)


def _assert_matches_reference(result, reference):
    assert result["losses"] == pytest.approx(reference["losses"], rel=1e-4)
    for name, expected in reference["params"].items():
        torch.testing.assert_close(result["params"][name], expected, rtol=1e-4, atol=1e-5)


def test_hsdp_2x2_async_equals_sync_and_one_process_muon():
    common = dict(hsdp_shape=(2, 2), ns_dtype=torch.float32, steps=STEPS, snapshot_at=4)
    configs = [
        dict(common, replicate_async=False),
        dict(common, replicate_async=True, record_events_at=6),
        dict(common, replicate_async=True, z3=False),
    ]
    by_rank = run_distributed(train_configs, 4, configs)
    reference = train_reference(4, steps=STEPS, ns_dtype=torch.float32)
    for rank_results in by_rank:
        sync, *async_runs = rank_results
        # Async (Z3 and Z2) and sync are bit-identical, including the values read midway
        # (a checkpoint save while broadcasts are in flight must wait for them).
        for other in async_runs:
            assert other["losses"] == sync["losses"]
            for name in sync["params"]:
                assert torch.equal(other["params"][name], sync["params"][name]), name
            for name in sync["snapshot"]:
                assert torch.equal(other["snapshot"][name], sync["snapshot"][name]), name
        _assert_matches_reference(sync, reference)

    sync_runs = [r[0] for r in by_rank]
    # Newton-Schulz once per matrix per step over all R x G ranks, balanced over all 4.
    assert sum(r["ns_matrices"] for r in sync_runs) == len(DEDICATED) * STEPS
    assert sorted(len(r["owned"]) for r in sync_runs) == [3, 3, 3, 3]
    owned = [n for r in sync_runs for n in r["owned"]]
    assert len(set(owned)) == len(owned) == len(DEDICATED)
    # The replicate stage moves each gradient once and each new value once per step
    # (counted on both ranks of each replicate group); plus one initial broadcast.
    replicas = 2
    reduce_bytes = sum(r["stats"]["bytes"]["replicate_reduce"] for r in sync_runs)
    assert reduce_bytes == STEPS * replicas * (DEDICATED_BYTES + FLAG_BYTES)
    bcast_bytes = sum(r["stats"]["bytes"]["replicate_broadcast"] for r in sync_runs)
    assert bcast_bytes == (STEPS + 1) * replicas * DEDICATED_BYTES
    # Inside each shard group: stage-1 reduce once, Z3 broadcasts twice.
    step = sync_runs[0]["collectives"][3]["bytes"]
    assert step["reduce"] == DEDICATED_BYTES + FLAG_BYTES + (
        sync_runs[0]["stats"]["bytes"]["replicate_reduce"] // STEPS
    )
    # Memory: momentum once in the world; values held by the owner column of each replica.
    memory = [r["memory"] for r in sync_runs]
    assert sum(m["momentum"] for m in memory) == DEDICATED_BYTES
    assert sum(m["params"] for m in memory) == replicas * DEDICATED_BYTES
    assert all(m["masters"] == 0 for m in memory)


def test_async_replicate_broadcast_overlaps_next_forward():
    config = dict(hsdp_shape=(2, 2), steps=4, replicate_async=True, record_events_at=1)
    by_rank = run_distributed(train_configs, 4, [config])
    for result in (r[0] for r in by_rank):
        events = result["events"]
        start = next(i for i, e in enumerate(events) if e[0] == "launch")
        rest = events[start:]
        while rest[0][0] == "launch":
            rest = rest[1:]
        # Launching does not wait: the next thing that happens is the next forward.
        assert rest[0] == ("forward", 0), events
        # The first boundary waits for its own values there (it cannot hide them) ...
        assert ("wait", 0) in rest
        # ... and boundary 1's values are awaited only after boundary 0's forward began:
        # they were in flight while it ran.
        assert rest.index(("wait", 1)) > rest.index(("forward", 0)), events


def test_degenerate_meshes_match_reference():
    configs = [
        dict(hsdp_shape=(1, 2), ns_dtype=torch.float32, steps=4, replicate_async=True),
        dict(hsdp_shape=(2, 1), ns_dtype=torch.float32, steps=4, replicate_async=True),
    ]
    by_rank = run_distributed(train_configs, 2, configs)
    reference = train_reference(2, steps=4, ns_dtype=torch.float32)
    for rank_results in by_rank:
        for result in rank_results:
            _assert_matches_reference(result, reference)


@pytest.mark.slow
def test_hsdp_2x4_eight_ranks():
    config = dict(hsdp_shape=(2, 4), ns_dtype=torch.float32, steps=4, replicate_async=True)
    by_rank = run_distributed(train_configs, 8, [config], timeout=600)
    reference = train_reference(8, steps=4, ns_dtype=torch.float32)
    for result in (r[0] for r in by_rank):
        _assert_matches_reference(result, reference)
    assert sum(r[0]["ns_matrices"] for r in by_rank) == len(DEDICATED) * 4
