"""NorMuon (``Muon(variant="normuon")``): its normalization of whole matrices, stacks and
tensor-parallel shards, one process and under dedicated ownership (FSDP Z3 on 2 and 4
gloo ranks, per-expert pieces), against a one-process reference written from the
definition (tests/support/workers.py: NorMuonReference)."""

from __future__ import annotations

import pytest
import torch

from tests.engine.test_dedication import EXPERTS, _assert_params_close, _per_expert_reference
from tests.engine.test_tensor_parallel import DP, TP, assert_equals_one_process, tp_worker
from tests.engine.test_tensor_parallel import STEPS as TP_STEPS
from tests.support.dist import run_distributed
from tests.support.models import batch, loss_fn, make_model, proj_predicate
from tests.support.workers import (
    ADAMW_KW,
    EXACT_ATOL,
    EXACT_RTOL,
    MUON_KW,
    as_muon_adamw_kwargs,
    reference_setup,
    train_configs,
    train_one_process,
    train_reference,
)
from torchtitan_dmuon import Muon
from torchtitan_dmuon.optim.normuon import normuon_normalize

STEPS = 6


def _definition(o: torch.Tensor, moment: torch.Tensor, beta2: float):
    """NorMuon's normalization of one matrix, as its authors write it."""
    norm = o.norm()
    moment = moment.lerp((o * o).mean(dim=-1, keepdim=True), 1 - beta2)
    n = o / (moment.sqrt() + 1e-10)
    return moment, n * (norm / (n.norm() + 1e-10))


def test_normalize_equals_definition_per_matrix_of_a_stack():
    """A 3-D stack is normalized matrix by matrix (one norm each), a 2-D matrix whole;
    the second moments follow the EMA; the inputs are left as they were."""
    g = torch.Generator().manual_seed(0)
    stack, matrix = torch.randn(3, 8, 5, generator=g), torch.randn(6, 4, generator=g)
    moments = [torch.rand(3, 8, 1, generator=g), torch.zeros(6, 1)]
    before = [t.clone() for t in (stack, matrix, *moments)]
    new_moments, normalized = normuon_normalize([stack, matrix], moments, beta2=0.9)
    for e in range(3):
        moment, n = _definition(stack[e], moments[0][e], 0.9)
        torch.testing.assert_close(new_moments[0][e], moment, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(normalized[0][e], n, rtol=1e-5, atol=1e-7)
    moment, n = _definition(matrix, moments[1], 0.9)
    torch.testing.assert_close(new_moments[1], moment, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(normalized[1], n, rtol=1e-5, atol=1e-7)
    for original, now in zip(before, (stack, matrix, *moments), strict=True):
        assert torch.equal(original, now)


def test_one_process_equals_reference():
    """``Muon(variant="normuon")`` in one process equals NorMuonReference + AdamW over 6
    steps: losses and every parameter within rtol 1e-5; the state holds one second moment
    per row of each matrix."""

    def step_loss(m, step):
        return loss_fn(m, *batch(100 + step, 4))

    with reference_setup(torch.float32):
        reference = make_model(seed=0)
        expected = train_one_process(reference, STEPS, step_loss, variant="normuon")
        model = make_model(seed=0)
        opt = Muon(
            model,
            predicate=proj_predicate,
            variant="normuon",
            ns_dtype=torch.float32,
            **MUON_KW,
            **as_muon_adamw_kwargs(ADAMW_KW),
        )
        losses = []
        for step in range(STEPS):
            opt.zero_grad()
            loss = step_loss(model, step)
            loss.backward()
            opt.step()
            losses.append(loss.item())
    torch.testing.assert_close(losses, expected, rtol=1e-5, atol=0)
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")
    weight = model.layers[0].q_proj.weight
    assert opt.state[weight]["second_moment"].shape == (weight.shape[0], 1)


def test_invalid_settings_name_the_argument():
    model = make_model(seed=0)
    with pytest.raises(ValueError, match="variant must be one of"):
        Muon(model, variant="adam")
    with pytest.raises(ValueError, match=r"normuon_beta2 must be \[0.0, 1.0\)"):
        Muon(model, variant="normuon", normuon_beta2=1.0)


@pytest.mark.parametrize("world", [2, 4])
def test_fsdp_z3_equals_one_process(world):
    """FSDP2 + DMuon Z3 with NorMuon, each rank its own data: losses and parameters equal
    the one-process reference on the concatenated batch (losses rtol 1e-5, parameters
    the suite's fp32 tolerance: AdamW's parameters differ by a few ulps of their
    gradients' summation order, which depends on the CPU's kernels); on 4 ranks also with
    per-expert ownership of stacked experts (6 experts in pieces over 4 owners, each owner
    normalizing its own experts), against one 2-D NorMuon matrix per expert."""
    configs = [dict(z3=True, ns_dtype=torch.float32, steps=STEPS, variant="normuon")]
    if world == 4:
        configs.append(dict(EXPERTS, variant="normuon"))
    by_rank = run_distributed(train_configs, world, configs)
    reference = train_reference(world, steps=STEPS, ns_dtype=torch.float32, variant="normuon")
    for runs in by_rank:
        assert runs[0]["losses"] == pytest.approx(reference["losses"], rel=1e-5)
        _assert_params_close(runs[0], reference, rtol=EXACT_RTOL, atol=EXACT_ATOL)
    if world == 4:
        experts = _per_expert_reference(variant="normuon")
        for runs in by_rank:
            assert runs[1]["losses"] == pytest.approx(experts["losses"], rel=1e-5)
            _assert_params_close(runs[1], experts, rtol=EXACT_RTOL, atol=EXACT_ATOL)


@pytest.mark.parametrize("ns_backend", ["gram", "torch"])
def test_tensor_parallel_equals_one_process(ns_backend):
    """TP 2 x DP 2 (up Colwise: rows split, the two norms all-reduced over TP; down
    Rowwise: every row split, its squares' sums all-reduced): losses and parameters equal
    the one-process reference (rtol 1e-4), with Gram (sharded) and gathered Newton-Schulz.
    Per step and owned matrix NorMuon adds one all-reduce of 2 values (rows split) or of
    one value per row (32: columns split) to Newton-Schulz's."""
    by_rank = run_distributed(tp_worker, DP * TP, ns_backend, None, (0, 1, 2), None, "normuon",
                              timeout=240)  # fmt: skip
    assert_equals_one_process(by_rank, variant="normuon", params_rtol=EXACT_RTOL)
    for r in by_rank:
        normuon = sum(2 if "up_proj" in n else 32 for n in r["owned_names"]) * 4 * TP_STEPS
        gram = 2 * 32 * 32 * 4 * r["owned"] * TP_STEPS if ns_backend == "gram" else 0
        assert r["stats"]["bytes"]["tp_all_reduce"] == normuon + gram
