"""The engine off the paths of a plain training loop: a pass that fails half-way, FSDP2's
default mixed precision, swapped parameters, partial fully_shard, embeddings given to Muon."""

import logging
import re

import pytest
import torch
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy

from tests.support.dist import run_distributed
from tests.support.models import make_model, proj_predicate
from tests.support.workers import train_configs, train_reference
from torchtitan_dmuon import Muon
from torchtitan_dmuon.engine import fsdp

STEPS = 8
# FSDP2's recovery after a pass that raised half-way (torch >= 2.13; the engine refuses it
# before, naming the version: tests/engine/test_torch_versions.py).
needs_fsdp_reset = pytest.mark.skipif(
    not hasattr(FSDPModule, "reset_iter_state"),
    reason=f"FSDP2 in torch {torch.__version__} has no FSDPModule.reset_iter_state",
)


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


@needs_fsdp_reset
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


@needs_fsdp_reset
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
    """FSDP2's default MixedPrecisionPolicy(param_dtype=bf16) (reduce_dtype None) reduces in
    bf16 up to torch 2.14 and in the parameters' fp32 from 2.15, and so do the dedicated
    gradients; the owner accumulates in its fp32 master dtype whatever the reduce dtype."""
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
        fp32 = kind == "fp32" or (kind == "default" and fsdp.REDUCES_IN_PARAM_DTYPE)
        reduce_itemsize = 4 if fp32 else 2
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


def _one_rank_raises_in_backward(rank, world, fsdp):
    """One good step, then a backward that raises in the first block on rank 1 only,
    caught as a loop skipping a bad batch would (``zero_grad``, go on). Returns what each
    rank saw: the errors of that backward, of its ``zero_grad`` and of the next forward."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from tests.support.models import loss_fn
    from tests.support.workers import data_for, inject_backward_failure
    from torchtitan_dmuon import dedicate_params

    mesh = init_device_mesh("cpu", (world,))
    model = make_model(seed=0)
    dedicate_params(model, mesh, proj_predicate)
    if fsdp:
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optimizer = Muon(model, lr=0.02, ns_dtype=torch.float32)
    seen = {}
    for step, call in enumerate(("step", "backward", "zero_grad", "forward")):
        inputs, targets = data_for(step, rank, world, same_data=False)
        if step == 1 and rank == 1:
            inject_backward_failure(model.layers[0])
        try:
            if call == "zero_grad":
                optimizer.zero_grad()
            loss_fn(model, inputs, targets).backward()
            optimizer.step()
            optimizer.zero_grad()
        except RuntimeError as error:
            seen[step] = (call, type(error).__name__, str(error))
    return seen


@pytest.mark.parametrize("fsdp", [True, False], ids=["fsdp", "ddp_style"])
def test_one_rank_raising_in_backward_raises_on_every_rank(fsdp):
    """One rank's backward raises (rank 1, in its first block; a loop catches it, calls
    zero_grad and goes on): rank 1's zero_grad finds its peer never reports a failed
    pass and raises PassDivergedError within the process group's timeout (here 10 s,
    ``init_process_group(timeout=...)``); rank 0, waiting in the reduce rank 1 never
    joins, raises too (FSDP2's reduce-scatter's timeout, or DDP-style the engine's reduce
    as PassDivergedError: its group inherits that timeout, it waited gloo's default 30
    minutes before); every later forward raises PassDivergedError at once. No hang, no
    collective matched with another."""
    seen = run_distributed(
        _one_rank_raises_in_backward, 2, fsdp, timeout=120, pg_timeout=10, leave_together=False
    )
    divergence = "PassDivergedError"
    assert 0 not in seen[0] and 0 not in seen[1]  # the first step trained
    assert seen[1][1][2] == "injected backward failure"
    assert seen[1][2][:2] == ("zero_grad", divergence), seen[1]
    if fsdp:  # FSDP2's reduce-scatter times out first
        assert re.search("Timed out|timeout", seen[0][1][2]), seen[0]
    else:
        assert seen[0][1][1] == divergence
        assert "a gradient reduce of this backward did not complete" in seen[0][1][2]
        # rank 0 never joined rank 1's agreement
        assert "some data-parallel peer did not report a failed pass" in seen[1][2][2]
    for rank in seen:
        assert rank[3][:2] == ("forward", divergence), rank
        assert "end the job and resume from the last checkpoint" in rank[3][2]
