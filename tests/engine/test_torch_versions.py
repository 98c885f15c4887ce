"""What the engine reads of FSDP2 differs between the torch versions it supports (2.11 to
2.15): each difference is read through one helper, tested here with 2.11's shapes, and
each FSDP2 rule that 2.15 changed is checked against the FSDP2 of the torch running it."""

from types import SimpleNamespace

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from tests.support.dist import run_distributed
from tests.support.models import batch, loss_fn, make_model
from torchtitan_dmuon.engine import fsdp


def _sharded_model(world):
    mesh = init_device_mesh("cpu", (world,))
    model = make_model(seed=0)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def param_groups_worker(rank, world):
    model = _sharded_model(world)
    block = model.layers[0]
    return [len(g.fsdp_params) for g in fsdp.param_groups(block)], len(list(block.parameters()))


def test_param_groups_reads_the_list_and_2_11s_single_group(monkeypatch):
    for sizes, params in run_distributed(param_groups_worker, 1):
        assert sizes == [params]
    # torch 2.11's state: one group or None under another name, no list.
    group = object()
    states = {
        "one": SimpleNamespace(_fsdp_param_group=group),
        "none": SimpleNamespace(_fsdp_param_group=None),
        "list": SimpleNamespace(_fsdp_param_groups=[group, group]),
    }
    monkeypatch.setattr(fully_shard, "state", states.__getitem__)
    assert fsdp.param_groups("one") == [group]
    assert fsdp.param_groups("none") == []
    assert fsdp.param_groups("list") == [group, group]


def no_reset_worker(rank, world):
    model = _sharded_model(world)
    reset = getattr(FSDPModule, "reset_iter_state", None)  # torch 2.11 has none
    if reset is not None:
        del FSDPModule.reset_iter_state
    try:
        fsdp.reset_fsdp_state(model)
    except RuntimeError as error:
        return str(error)
    finally:
        if reset is not None:
            FSDPModule.reset_iter_state = reset
    return None


def test_recovery_without_fsdp_reset_iter_state_says_why():
    for message in run_distributed(no_reset_worker, 1):
        assert message is not None
        assert "FSDPModule.reset_iter_state" in message and torch.__version__ in message
        assert "resume from the last checkpoint" in message


@pytest.fixture(autouse=True)
def _restores_fsdp():
    had = hasattr(FSDPModule, "reset_iter_state")  # torch 2.11 has none
    yield
    assert hasattr(FSDPModule, "reset_iter_state") == had


def test_collective_counter_wraps_only_what_this_torch_has(monkeypatch):
    """torch 2.11 has neither ``all_gather_single`` nor ``reduce_scatter_single`` (new in
    2.13), in ``torch.distributed`` or in its functional collectives: the counter counts
    what exists and puts back exactly what it wrapped."""
    import torch.distributed as dist
    from torch.distributed import _functional_collectives as funcol

    from tests.support.collectives import CollectiveCounter

    for module in (dist, funcol):
        for name in ("all_gather_single", "reduce_scatter_single"):
            monkeypatch.delattr(module, name, raising=False)
    before = {m: dict(vars(m)) for m in (dist, funcol)}
    with CollectiveCounter() as counter:
        assert dist.broadcast is not before[dist]["broadcast"]  # still counted
        assert not hasattr(dist, "all_gather_single")
        assert not hasattr(funcol, "reduce_scatter_single")
    assert counter.snapshot() == {"bytes": {}, "calls": {}}
    for module, names in before.items():
        assert dict(vars(module)) == names


# ---- FSDP2's rules that torch 2.15 changed: each test checks the rule the engine
# encodes against the FSDP2 of the torch running it (2.13 and 2.14 here; 2.15 through
# scripts/torch_check.sh 2.15.0).


def reduce_dtype_worker(rank, world):
    import torch.distributed as dist

    from torchtitan_dmuon.engine.unit import unit_dtypes

    mesh = init_device_mesh("cpu", (world,))
    model = make_model(seed=0)  # fp32 parameters
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)  # reduce_dtype None
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    seen = []
    names = [n for n in ("reduce_scatter_single", "reduce_scatter_tensor") if hasattr(dist, n)]
    originals = {n: getattr(dist, n) for n in names}

    def recording(name):
        def reduce_scatter(output, input, *args, **kwargs):
            seen.append(input.dtype)
            return originals[name](output, input, *args, **kwargs)

        return reduce_scatter

    for name in names:
        setattr(dist, name, recording(name))
    try:
        inputs, targets = batch(0)
        loss_fn(model, inputs, targets).backward()
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
    return sorted({str(d) for d in seen}), str(unit_dtypes(torch.float32, torch.bfloat16, None)[1])


def test_the_reduce_dtype_of_reduce_dtype_none_is_this_torchs_fsdp2_rule():
    """fp32 parameters under param_dtype=bf16 and reduce_dtype None: FSDP2 reduces in bf16
    up to torch 2.14 and in fp32 from 2.15; the engine reduces the dedicated gradients as
    FSDP2 reduces its own (unit_dtypes)."""
    for seen, engine in run_distributed(reduce_dtype_worker, 2):
        assert seen == [engine]
        assert engine == str(torch.float32 if fsdp.REDUCES_IN_PARAM_DTYPE else torch.bfloat16)


def reset_worker(rank, world):
    from tests.support.workers import inject_backward_failure

    model = _sharded_model(world)
    handle = inject_backward_failure(model.layers[-1])  # the head and norm reduce first
    inputs, targets = batch(0)
    try:
        loss_fn(model, inputs, targets).backward()
    except RuntimeError as error:
        assert "injected backward failure" in str(error)
    handle.remove()

    def unsharded_grads() -> int:
        return sum(
            getattr(p, "_unsharded_param", None) is not None and p._unsharded_param.grad is not None
            for m in model.modules()
            if isinstance(m, FSDPModule)
            for g in fsdp.param_groups(m)
            for p in g.fsdp_params
        )

    kept = unsharded_grads()
    model.reset_iter_state()  # FSDP2's own
    after_fsdp = unsharded_grads()
    fsdp.reset_fsdp_state(model)  # the engine's
    return kept, after_fsdp, unsharded_grads()


def test_reset_iter_state_keeps_or_drops_the_unsharded_grads_by_this_torchs_rule():
    """A backward that raised in the last block, after the root's norm and head computed
    their gradients: FSDP2's reset_iter_state keeps those unsharded gradients up to torch
    2.14 and drops them from 2.15 (RESET_CLEARS_GRADS); after the engine's reset none is
    left on either."""
    for kept, after_fsdp, after_engine in run_distributed(reset_worker, 2):
        assert kept > 0
        assert (after_fsdp == 0) is fsdp.RESET_CLEARS_GRADS
        assert after_engine == 0
