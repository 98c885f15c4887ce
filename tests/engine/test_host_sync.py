"""No host sync in a DMuon step: no more than FSDP2 + fused AdamW (TorchTitan's default)."""

import copy
import functools

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from tests.support.dist import run_distributed
from tests.support.host_sync import HostSyncCounter
from tests.support.models import batch, loss_fn, make_model, proj_predicate
from tests.support.workers import (
    ADAMW_KW,
    MUON_KW,
    as_muon_adamw_kwargs,
    data_for,
    reference_muon,
    reference_setup,
    train_dmuon,
    train_reference,
)
from torchtitan_dmuon import Muon, dedicate_params
from torchtitan_dmuon.engine import comm
from torchtitan_dmuon.optim.muon import MatrixGroup, commit_group, compute_group
from torchtitan_dmuon.optim.newton_schulz import newton_schulz, resolve_ns_schedule

COUNTED_STEPS = 3


def count_host_syncs(rank, world, optimizer, hsdp_shape=None, replicate_async=False, fsdp=True):
    """Host syncs of forward, backward, ``step()`` and ``zero_grad()`` over
    ``COUNTED_STEPS`` steps after a warm-up step (FSDP2's lazy initialization, the first
    step's state), with ``optimizer`` ``"dmuon"`` or ``"adamw"`` (fused) over FSDP2
    (``fsdp=False``: none, the engine keeps the other parameters in sync DDP-style)."""
    if hsdp_shape is None:
        mesh = fsdp_mesh = init_device_mesh("cpu", (world,))
        replicate_mesh = None
    else:
        fsdp_mesh = init_device_mesh("cpu", hsdp_shape, mesh_dim_names=("replicate", "shard"))
        mesh, replicate_mesh = fsdp_mesh["shard"], fsdp_mesh["replicate"]
    model = make_model(seed=0)
    if optimizer == "dmuon":
        dedicate_params(model, mesh, proj_predicate, replicate_mesh=replicate_mesh)
    if fsdp:
        for layer in model.layers:
            fully_shard(layer, mesh=fsdp_mesh)
        fully_shard(model, mesh=fsdp_mesh)
    if optimizer == "dmuon":
        opt = Muon(
            model,
            **MUON_KW,
            **as_muon_adamw_kwargs(ADAMW_KW),
            ns_dtype=torch.float32,
            replicate_async=replicate_async,
        )
    else:
        opt = torch.optim.AdamW(model.parameters(), **ADAMW_KW, fused=True)
    counter = HostSyncCounter()
    for step in range(1 + COUNTED_STEPS):
        inputs, targets = data_for(step, rank, world, same_data=False)
        if step == 1:
            counter.__enter__()
        opt.zero_grad()
        loss_fn(model, inputs, targets).backward()
        opt.step()
    counter.__exit__(None, None, None)
    if replicate_async:
        opt.matrices.dedication.wait_replicas()
    return {"per_step": counter.total / COUNTED_STEPS, "where": counter.where}


@pytest.mark.parametrize(
    "world, layout",
    [(2, {}), (4, {"hsdp_shape": (2, 2), "replicate_async": True})],
    ids=["fsdp2_z3_2ranks", "hsdp_2x2_async_4ranks"],
)
def test_dmuon_step_syncs_no_more_than_fused_adamw(world, layout):
    adamw = run_distributed(count_host_syncs, world, "adamw", layout.get("hsdp_shape"))
    dmuon = run_distributed(count_host_syncs, world, "dmuon", *layout.values())
    baseline = max(r["per_step"] for r in adamw)
    assert baseline == 0, [r["where"] for r in adamw]
    for r in dmuon:
        assert r["per_step"] <= baseline, r["where"]


def test_ddp_style_step_syncs_nothing():
    """No FSDP: the engine all-reduces the other parameters' gradients with their
    has-gradient flags; a rank that computed every gradient reads no flag."""
    for r in run_distributed(count_host_syncs, 2, "dmuon", None, False, False):
        assert r["per_step"] == 0, r["where"]


# ---- what replaced the host reads: decisions on the device ----------------------------


def _matrices(seed: int, shapes, with_grad):
    """Parameters of ``shapes`` and their gradients (None where ``with_grad`` is False)."""
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]
    grads = [
        torch.randn(s, generator=g) if w else None for s, w in zip(shapes, with_grad, strict=True)
    ]
    return params, grads


@pytest.mark.parametrize("variant", ["muon", "normuon"])
def test_matrix_without_gradient_is_left_as_torch_muon_leaves_it(variant):
    """The engine hands every owned matrix to the step, a zero gradient and a False flag
    where no rank touched it (no host read): what torch.optim.Muon (NorMuon's reference)
    does with a parameter whose grad is None, over steps that flip which; the matrices
    left out keep value, momentum and second moment bitwise."""
    shapes = [(8, 4), (8, 4), (4, 6)]
    kw = dict(lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.1)
    ns = functools.partial(
        newton_schulz, schedule=resolve_ns_schedule("quintic", 5), dtype=torch.float32
    )
    ours, _ = _matrices(0, shapes, [True] * 3)
    ref = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    reference = reference_muon(ref, variant, **kw)
    state = {p: {} for p in ours}
    beta2 = 0.95 if variant == "normuon" else None
    for step, with_grad in enumerate([[True, False, True], [False, True, True], [True] * 3]):
        _, grads = _matrices(10 + step, shapes, with_grad)
        for p, g in zip(ref, grads, strict=True):
            p.grad = g
        with reference_setup(torch.float32):
            reference.step()
        before = copy.deepcopy((ours, state))
        zero = [g if g is not None else torch.zeros(s) for g, s in zip(grads, shapes, strict=True)]
        group = MatrixGroup(ours, ours, zero, ns, stepped=list(torch.tensor(with_grad)))
        pending = compute_group(
            group, state, momentum=kw["momentum"], nesterov=True, normuon_beta2=beta2
        )
        commit_group(pending, state, lr=kw["lr"], weight_decay=0.1, adjust_lr_fn=None)
        for i, (p, q) in enumerate(zip(ours, ref, strict=True)):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
            if with_grad[i]:
                continue
            assert torch.equal(p, before[0][i]), (step, i)
            for key, value in before[1][before[0][i]].items():
                assert torch.equal(state[p][key], value), (step, i, key)
            if not reference.state[q]:  # never stepped: zero state, torch's starting point
                assert not any(v.any() for v in state[p].values())


@pytest.mark.parametrize("variant", ["muon", "normuon"])
def test_found_inf_skips_the_whole_step_bitwise_on_the_device(variant):
    """Muon.step(found_inf=1) with non-finite gradients leaves parameters, momentum,
    NorMuon's second moments and the fused AdamW's state (its step count included)
    bitwise as they were; found_inf=0 steps exactly as step() does."""
    model = make_model(seed=0)
    kw = dict(**MUON_KW, **as_muon_adamw_kwargs(ADAMW_KW), variant=variant)
    opt = Muon(model, **kw, predicate=proj_predicate)
    twin = copy.deepcopy(model)
    twin_opt = Muon(twin, **kw, predicate=proj_predicate)
    assert opt._adamw.defaults["fused"]
    for m, o in ((model, opt), (twin, twin_opt)):  # a first step: every state exists
        o.zero_grad()
        loss_fn(m, *batch(100)).backward()
        o.step()
    before = copy.deepcopy((dict(model.named_parameters()), opt.state_dict()))
    opt.zero_grad()
    loss_fn(model, *batch(101)).backward()
    for p in model.parameters():
        p.grad[0].fill_(float("nan"))
        p.grad[-1].fill_(float("inf"))
    with HostSyncCounter() as counter:
        opt.step(found_inf=torch.ones(()))
    assert counter.total == 0, counter.where
    after = (dict(model.named_parameters()), opt.state_dict())
    for name, p in before[0].items():
        assert torch.equal(after[0][name], p), name
    for key, state in before[1]["state"].items():
        for field, value in state.items():
            assert torch.equal(after[1]["state"][key][field], value), (key, field)
    # A finite step with found_inf=0: as step() on the twin that never saw the bad one.
    for m, o, extra in ((model, opt, {"found_inf": torch.zeros(())}), (twin, twin_opt, {})):
        o.zero_grad()
        loss_fn(m, *batch(102)).backward()
        o.step(**extra)
    for (name, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q), name


def _verdict_on_device_groups(rank, world):
    """Training with rank 1's ``Muon.step`` failing at step 2, the engine's groups taken
    for NCCL-only ones (no CPU backend)."""
    original = comm.host_device

    def as_nccl_only(group):
        desc = group.group_desc if group is not None else ""
        return None if desc.startswith("dmuon_") and not desc.endswith("_host") else original(group)

    comm.host_device = as_nccl_only
    try:
        result = train_dmuon(rank, world, ns_dtype=torch.float32, steps=3, fail_step_at=(2, 1))
    finally:
        comm.host_device = original
    host_groups = [g.group_desc for g in dist.distributed_c10d._world.pg_map]
    return result, sorted(d for d in host_groups if d.endswith("_host"))


def test_step_failure_settled_on_the_device_groups_without_a_host_barrier():
    """The step's verdict rides on the engine's own (device) groups: no gloo group is
    created beside NCCL-only ones, each step all-reduces two int32s per group whatever the
    world size (before: a flag per rank over gloo twins, a host barrier), and a failed
    step still changes nothing and is raised on every rank."""
    by_rank = run_distributed(_verdict_on_device_groups, 2)
    reference = train_reference(2, steps=3, ns_dtype=torch.float32)
    for result, host_groups in by_rank:
        assert host_groups == []
        failure = result["step_failure"]
        assert failure["unchanged"] and "failed on rank(s) [1]" in failure["message"], failure
        assert result["losses"] == pytest.approx(reference["losses"], rel=1e-4)
        stats = result["stats"]
        # 3 steps and the failed one; the raising call settles nothing.
        assert stats["calls"]["step_verdict"] == 4
        assert stats["bytes"]["step_verdict"] == 4 * 8
