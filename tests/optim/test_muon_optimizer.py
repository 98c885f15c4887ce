"""The Muon optimizer in one process, against torch.optim.Muon + torch.optim.AdamW."""

import copy
import functools
import weakref

import pytest
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from tests.support.models import (
    ExpertBlock,
    SplitExpertBlock,
    batch,
    loss_fn,
    make_model,
    proj_or_experts_predicate,
    proj_predicate,
)
from tests.support.workers import ADAMW_KW, REFERENCE_ADAMW_KW, as_muon_adamw_kwargs
from torchtitan_dmuon import Muon
from torchtitan_dmuon.optim import muon as muon_functional
from torchtitan_dmuon.optim.newton_schulz import newton_schulz, resolve_ns_schedule


def _reference_optimizers(model, predicate, muon_kwargs, adamw_kwargs):
    muon = [p for n, p in model.named_parameters() if predicate(n, p)]
    muon_ids = {id(p) for p in muon}
    rest = [p for p in model.parameters() if id(p) not in muon_ids]
    return [torch.optim.Muon(muon, **muon_kwargs), torch.optim.AdamW(rest, **adamw_kwargs)]


def _train(model, optimizers, steps, seed0=100):
    losses = []
    for step in range(steps):
        loss = loss_fn(model, *batch(seed0 + step))
        for opt in optimizers:
            opt.zero_grad()
        loss.backward()
        for opt in optimizers:
            opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("adjust_lr_fn", [None, "original", "match_rms_adamw"])
@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_bit_equal_to_torch_muon_and_adamw(adjust_lr_fn, nesterov, weight_decay):
    ours_model = make_model()
    ref_model = copy.deepcopy(ours_model)
    common = dict(
        lr=0.02,
        momentum=0.95,
        nesterov=nesterov,
        weight_decay=weight_decay,
        adjust_lr_fn=adjust_lr_fn,
    )
    ours = Muon(
        ours_model,
        **common,
        **as_muon_adamw_kwargs(ADAMW_KW),
        ns_coefficients="quintic",
        ns_dtype=torch.bfloat16,  # torch.optim.Muon's
        predicate=proj_predicate,
    )
    ref = _reference_optimizers(
        ref_model, proj_predicate, dict(common, ns_steps=5), REFERENCE_ADAMW_KW
    )
    ours_losses = _train(ours_model, [ours], 10)
    ref_losses = _train(ref_model, ref, 10)
    assert ours_losses == ref_losses
    for (name, p), q in zip(ours_model.named_parameters(), ref_model.parameters(), strict=True):
        assert torch.equal(p, q), name
    assert ours.ns_matrices == 10 * 12  # 6 proj matrices x 2 layers, once per step


@pytest.mark.parametrize("adjust_lr_fn", [None, "match_rms_adamw"])
def test_stacked_experts_step_like_one_torch_muon_matrix_per_expert(adjust_lr_fn):
    """A 3-D parameter is a stack of matrices: each is orthogonalized alone (batched with
    the other same-shape matrices), exactly as torch.optim.Muon steps one 2-D parameter
    per expert."""
    ours_model = make_model(block=ExpertBlock)
    ref_model = make_model(block=SplitExpertBlock)
    common = dict(lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.1)
    ours = Muon(
        ours_model,
        **common,
        **as_muon_adamw_kwargs(ADAMW_KW),
        adjust_lr_fn=adjust_lr_fn,
        ns_dtype=torch.bfloat16,  # torch.optim.Muon's
        predicate=proj_or_experts_predicate,
    )
    ref = _reference_optimizers(
        ref_model, proj_predicate, dict(common, adjust_lr_fn=adjust_lr_fn), REFERENCE_ADAMW_KW
    )
    assert _train(ours_model, [ours], 6) == _train(ref_model, ref, 6)
    for ours_layer, ref_layer in zip(ours_model.layers, ref_model.layers, strict=True):
        assert torch.equal(ours_layer.experts_proj, ref_layer.stacked_experts())
        assert torch.equal(ours_layer.router.weight, ref_layer.router.weight)
    # 6 projections + 3 experts per layer, 2 layers, 6 steps.
    assert ours.ns_matrices == 6 * 2 * (6 + ExpertBlock.experts)


def test_default_predicate_takes_every_matrix():
    model = make_model()
    opt = Muon(model)
    matrices = [p for p in model.parameters() if p.ndim == 2]
    assert opt.param_groups[0]["params"] == matrices
    assert all(p.ndim != 2 for p in opt.param_groups[1]["params"])


def test_lr_scheduler_drives_both_groups():
    model = make_model()
    opt = Muon(model, lr=0.02, adamw_lr=1e-3, predicate=proj_predicate)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5**step)
    _train(model, [opt], 1)
    sched.step()
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.02 * 0.25)
    assert opt.param_groups[1]["lr"] == pytest.approx(1e-3 * 0.25)
    # The inner AdamW sees the scheduled lr (shared group dict).
    assert opt._adamw.param_groups[0]["lr"] == opt.param_groups[1]["lr"]


def test_state_dict_round_trip_continues_identically():
    model = make_model()
    opt = Muon(model, predicate=proj_predicate)
    _train(model, [opt], 3)
    saved_model = copy.deepcopy(model.state_dict())
    saved_opt = copy.deepcopy(opt.state_dict())
    expected = _train(model, [opt], 4, seed0=200)

    model2 = make_model(seed=7)
    model2.load_state_dict(saved_model)
    opt2 = Muon(model2, predicate=proj_predicate)
    opt2.load_state_dict(saved_opt)
    assert _train(model2, [opt2], 4, seed0=200) == expected
    states = opt2.state_dict()["state"]
    assert sum("momentum_buffer" in s for s in states.values()) == 12
    assert sum("exp_avg_sq" in s for s in states.values()) == len(opt2.param_groups[1]["params"])


def test_step_hooks_run():
    model = make_model()
    opt = Muon(model, predicate=proj_predicate)
    calls = []
    opt.register_step_pre_hook(lambda o, a, k: calls.append("pre"))
    opt.register_step_post_hook(lambda o, a, k: calls.append("post"))
    _train(model, [opt], 1)
    assert calls == ["pre", "post"]


def test_polar_express_and_spectral_train():
    model = make_model()
    opt = Muon(
        model,
        ns_coefficients="polar_express",
        adjust_lr_fn="spectral",
        ns_dtype=torch.float32,
        predicate=proj_predicate,
    )
    inputs, targets = batch(0)
    losses = []
    for _ in range(15):
        opt.zero_grad()
        loss = loss_fn(model, inputs, targets)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    # Memorizing one batch: the loss must fall well below its start.
    assert losses[-1] < losses[0] * 0.7


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(lr=-1.0), "lr must be"),
        (dict(momentum=1.0), "momentum must be"),
        (dict(momentum=-0.1), "momentum must be"),
        (dict(ns_steps=0), "ns_steps"),
        (dict(ns_coefficients="cubic"), "ns_coefficients must be one of"),
        (dict(adjust_lr_fn="rms"), "adjust_lr_fn"),
        (dict(adamw_lr=-1e-3), "adamw_lr"),
        (dict(ns_dtype=torch.int32), "ns_dtype"),
        (dict(ns_backend="cuda_magic"), "ns_backend"),
        (dict(replicate_async=True), "replicate_async"),
        (dict(predicate=lambda n, p: "norm" in n), "'layers.0.norm.weight'"),
    ],
)
def test_bad_arguments_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Muon(make_model(), **kwargs)


class _LiveBytes(TorchDispatchMode):
    """The peak bytes of storages that ops create inside the mode and that are alive at
    once (a storage counts until its last tensor or view is gone)."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._tracked: set[int] = set()

    def _freed(self, key: int, nbytes: int) -> None:
        self._tracked.discard(key)
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        leaves = pytree.tree_leaves((args, kwargs))
        inputs = {id(t.untyped_storage()) for t in leaves if isinstance(t, torch.Tensor)}
        for tensor in pytree.tree_leaves(out):
            if not isinstance(tensor, torch.Tensor):
                continue
            storage = tensor.untyped_storage()
            key = id(storage)
            if key in inputs or key in self._tracked:  # in place, a view, or counted
                continue
            self._tracked.add(key)
            self.live += storage.nbytes()
            weakref.finalize(storage, self._freed, key, storage.nbytes())
        self.peak = max(self.peak, self.live)
        return out


def test_first_phase_holds_the_updates_and_a_few_batches(monkeypatch):
    """muon_update formed the new momentum and the Nesterov look-ahead of every matrix,
    then concatenated each whole same-shape bucket and ran Newton-Schulz on it: 5.5
    copies of all the matrices a rank steps at its peak, 2 kept to the second phase
    (Llama-3.1 8B's dry run at 8 ranks, 21 matrices a rank, was killed at 24 GB). Only the
    updates outlive a batch now (the second phase advances the momentum in place, bitwise
    as the first formed it), and batches are at most NS_BATCH_ELEMENTS; the updates equal
    each matrix's own Newton-Schulz."""
    rows, cols, count = 64, 256, 8
    monkeypatch.setattr(muon_functional, "NS_BATCH_ELEMENTS", 2 * rows * cols)
    gen = torch.Generator().manual_seed(0)
    params, grads, buffers = (
        [torch.randn(rows, cols, generator=gen) for _ in range(count)] for _ in range(3)
    )
    before = [b.clone() for b in buffers]
    ns = functools.partial(
        newton_schulz, schedule=resolve_ns_schedule("quintic", 5), dtype=torch.float32
    )
    with _LiveBytes() as live:
        update = muon_functional.muon_update(
            params, grads, buffers, momentum=0.95, nesterov=True, ns=ns
        )
    matrix = rows * cols * 4
    assert live.live == count * matrix  # the updates
    assert live.peak <= count * matrix + 4 * 2 * matrix  # + four batches of two
    assert all(torch.equal(b, old) for b, old in zip(buffers, before, strict=True))
    for g, b, o in zip(grads, buffers, update.orthogonal, strict=True):
        torch.testing.assert_close(o, ns(g.lerp(b.lerp(g, 0.05), 0.95)), rtol=1e-5, atol=1e-6)
    assert update.matrices == count
    muon_functional.apply_muon_update(
        params, grads, buffers, update, lr=0.0, weight_decay=0.0, adjust_lr_fn=None
    )
    for g, b, old in zip(grads, buffers, before, strict=True):
        assert torch.equal(b, old.lerp(g, 0.05))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_one_update_road_steps_flagged_matrices_as_torch_and_keeps_the_others(dtype, weight_decay):
    """The second phase's flags enter its arithmetic (a lerp weight, factors): a flagged
    matrix gets torch.optim.Muon's in-place operations bitwise, in every dtype (a tensor
    lerp weight is rounded to a bf16 buffer's dtype where the scalar is not), an
    unflagged one keeps its value and momentum, with the flags on the device."""
    gen = torch.Generator().manual_seed(1)
    params, grads, buffers = (
        [torch.randn(32, 48, generator=gen).to(dtype) for _ in range(4)] for _ in range(3)
    )
    ns = functools.partial(
        newton_schulz, schedule=resolve_ns_schedule("quintic", 5), dtype=torch.float32
    )
    flags = [torch.tensor(f) for f in (True, False, True, False)]
    expected = []
    for p, g, b, f in zip(params, grads, buffers, flags, strict=True):
        p, b = p.clone(), b.clone()
        if f:
            b.lerp_(g, 1 - 0.9)
            p.mul_(1 - 0.02 * weight_decay)
            p.add_(ns(g.lerp(b, 0.9)), alpha=-muon_functional.adjusted_lr(0.02, None, p.shape))
        expected.append((p, b))
    update = muon_functional.muon_update(params, grads, buffers, momentum=0.9, nesterov=True, ns=ns)
    muon_functional.apply_muon_update(
        params,
        grads,
        buffers,
        update,
        lr=0.02,
        weight_decay=weight_decay,
        adjust_lr_fn=None,
        stepped=flags,
    )
    for (p, b), (want_p, want_b) in zip(zip(params, buffers, strict=True), expected, strict=True):
        assert torch.equal(b, want_b)
        assert torch.equal(p, want_p)
