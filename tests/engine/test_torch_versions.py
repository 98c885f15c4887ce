"""What the engine reads of FSDP2 differs between the torch versions it supports (2.11 to
2.14): each difference is read through one helper, tested here with 2.11's shapes."""

from types import SimpleNamespace

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from tests.support.dist import run_distributed
from tests.support.models import make_model
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
