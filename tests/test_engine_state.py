"""The engine off the paths of a plain training loop: a pass that fails half-way, FSDP2's
default mixed precision, swapped parameters, partial fully_shard, embeddings given to Muon."""

import logging

import pytest
import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

from tests.dist import run_distributed
from tests.models import make_model, proj_predicate
from tests.workers import train_configs, train_reference
from torchtitan_dmuon import Muon

STEPS = 8


def _assert_matches(result, reference, rtol=1e-4):
    assert result["losses"] == pytest.approx(reference["losses"], rel=rtol)
    for name, expected in reference["params"].items():
        torch.testing.assert_close(result["params"][name], expected, rtol=rtol, atol=1e-5)


def _assert_step_failure(by_rank, failing_rank) -> None:
    """Every rank raised the same MuonStepError naming the failing rank, and its state
    (parameters, masters, momentum, AdamW) is bitwise what it was before the step."""
    failures = [result["step_failure"] for result in by_rank]
    for failure in failures:
        assert failure["unchanged"], failure
        assert failure["tensors"] > 0
        assert f"failed on rank(s) [{failing_rank}]" in failure["message"], failure
    assert "injected Newton-Schulz failure" in failures[failing_rank]["message"]


def test_backward_failing_half_way_then_training_goes_on():
    """Every rank's backward raises after the last block reduced and before the first
    did; the loop catches it, calls zero_grad and goes on. The failed pass leaves nothing
    behind: the next steps equal the reference that never saw it (FSDP2 and DDP-style, Z3
    and Z2). The FSDP2 runs' step 3 also fails on rank 1 in the middle of its
    Newton-Schulz: every rank raises, nothing changed, and the retried step goes on."""
    common = dict(ns_dtype=torch.float32, steps=STEPS, fail_before_step=1)
    failing_step = dict(fail_step_at=(3, 1))
    configs = [
        dict(common, fsdp=True, z3=True, **failing_step),
        dict(common, fsdp=True, z3=False, **failing_step),
        dict(common, fsdp=False, z3=True),
        dict(common, fsdp=False, z3=False),
    ]
    by_rank = run_distributed(train_configs, 2, configs)
    reference = train_reference(2, steps=STEPS, ns_dtype=torch.float32)
    for results in by_rank:
        for result in results:
            _assert_matches(result, reference)
    for config in range(2):
        _assert_step_failure([results[config] for results in by_rank], failing_rank=1)


def test_backward_failing_half_way_hsdp_async():
    """HSDP with async replicate broadcasts: the failed backward before step 1, and a
    Muon.step failing on rank 2 (another replica than rank 0's) at step 2."""
    config = dict(
        hsdp_shape=(2, 2),
        replicate_async=True,
        ns_dtype=torch.float32,
        steps=STEPS,
        fail_before_step=1,
        fail_step_at=(2, 2),
    )
    by_rank = run_distributed(train_configs, 4, [config])
    reference = train_reference(4, steps=STEPS, ns_dtype=torch.float32)
    for (result,) in by_rank:
        _assert_matches(result, reference)
    _assert_step_failure([result for (result,) in by_rank], failing_rank=2)


@pytest.mark.parametrize("world", [2, 4])
def test_mixed_precision_reduce_dtype_default_bf16_and_fp32(world):
    """FSDP2's default MixedPrecisionPolicy(param_dtype=bf16) reduces in bf16 (reduce_dtype
    None); the owner accumulates in its fp32 master dtype whatever the reduce dtype."""
    policies = {
        "default": MixedPrecisionPolicy(param_dtype=torch.bfloat16),
        "bf16": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16),
        "fp32": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
    }
    common = dict(fsdp=True, steps=3, ns_dtype=torch.float32)
    configs = [dict(common, z3=True)]
    for policy in policies.values():
        configs += [dict(common, z3=z3, mp_policy=policy) for z3 in (True, False)]
    full, *mixed = run_distributed(train_configs, world, configs)[0]
    numel = sum(p.numel() for n, p in make_model().named_parameters() if proj_predicate(n, p))
    for i, kind in enumerate(policies):
        z3, z2 = mixed[2 * i], mixed[2 * i + 1]
        assert z3["losses"] == z2["losses"], kind
        for name in z3["params"]:
            assert torch.equal(z3["params"][name], z2["params"][name]), (kind, name)
        assert z3["losses"] == pytest.approx(full["losses"], rel=3e-2), kind
        assert z3["params"]["layers.0.q_proj.weight"].dtype == torch.float32
        reduce_itemsize = 4 if kind == "fp32" else 2
        assert z3["collectives"][1]["bytes"]["reduce"] == (numel + 12) * reduce_itemsize, kind


def test_swapped_parameters_and_partial_fully_shard():
    """``to_empty`` with ``swap_tensors`` (what tensor-subclass parameters such as float8
    all-gather weights force) keeps the dedicated marks and hooks; with the blocks alone
    sharded, the embedding, final norm and head are kept in sync by the engine."""
    common = dict(ns_dtype=torch.float32, steps=4)
    configs = [
        dict(common),
        dict(common, meta_init="swap"),
        dict(common, meta_init="swap", z3=False),
        dict(common, fsdp="blocks"),
    ]
    plain, swapped_z3, swapped_z2, blocks_only = run_distributed(train_configs, 2, configs)[0]
    for result in (swapped_z3, swapped_z2):
        assert result["losses"] == plain["losses"]
        for name, value in plain["params"].items():
            assert torch.equal(result["params"][name], value), name
    _assert_matches(blocks_only, train_reference(2, steps=4, ns_dtype=torch.float32))


def test_embedding_and_head_given_to_muon_are_named_in_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="torchtitan_dmuon"):
        Muon(make_model(), predicate=lambda name, p: p.ndim == 2)
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert "'embed.weight'" in warned and "an embedding" in warned
    assert "'head.weight'" in warned and "an output head" in warned
    assert "q_proj" not in warned
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="torchtitan_dmuon"):
        Muon(make_model(), predicate=proj_predicate)
    assert not caplog.records
