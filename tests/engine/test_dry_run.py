"""The engine under a dry run's fake backend (TorchTitan's ``--comm.mode fake_backend``: one
process stands for every rank, nothing is communicated): what costs the dry run time is
what the rank holds, not the whole model. The start initializes only what the rank keeps
(the matrices it does not hold on the meta device), and a fake broadcast's receiver fills
its buffer from a fixed number of draws; both were a random draw per element of the
whole model (minutes at 70B on a CPU)."""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from tests.engine.test_meta_init import _parallelized
from tests.support.models import batch, loss_fn
from torchtitan_dmuon import get_dedication, materialize
from torchtitan_dmuon.engine import comm
from torchtitan_dmuon.engine.meta_init import unheld_names

WORLD = 16
_RANDOM = {
    torch.ops.aten.normal_,
    torch.ops.aten.uniform_,
    torch.ops.aten.random_,
    torch.ops.aten.bernoulli_,
    torch.ops.aten.exponential_,
}


class _Draws(TorchDispatchMode):
    """Counts the elements random operators fill on a real (not meta) device, this rank's
    (a DTensor's local ones)."""

    def __init__(self) -> None:
        super().__init__()
        self.drawn = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in _RANDOM and args[0].device.type != "meta":
            self.drawn += _local_numel(args[0])
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _fake_world(world: int):
    dist.init_process_group("fake", rank=0, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _local_numel(param) -> int:
    return (param.to_local() if isinstance(param, DTensor) else param).numel()


@torch.no_grad()
def _init_weights(model) -> None:
    """One normal draw per element of every matrix (a count known in advance)."""
    for p in model.parameters():
        if p.ndim >= 2:
            p.normal_(0.0, 0.02)
        else:
            p.fill_(1.0)


def test_a_dry_run_starts_at_what_the_rank_holds_and_trains():
    with _fake_world(WORLD):
        model = _parallelized("z3", WORLD)
        dedication = get_dedication(model)
        dedicated = {d.name for d in dedication.plan.params}
        unheld = set(unheld_names(dedication))
        held = [n for n in dedicated if n not in unheld]
        keeps = sum(
            _local_numel(p) for n, p in model.named_parameters() if n not in unheld and p.ndim > 1
        )
        whole = sum(model.get_parameter(n).numel() for n in dedicated)
        draws = _Draws()
        with draws:
            materialize(model, "cpu", functools.partial(_init_weights, model))
        # Drawn: the held matrices and FSDP2's shards, none of the others.
        assert held and unheld
        assert draws.drawn == keeps < whole, (draws.drawn, keeps, whole)
        for name in held:
            assert model.get_parameter(name).std() > 0, name  # initialized, not left empty
        loss = loss_fn(model, *batch(0))  # the fake broadcasts' receivers hold weights
        loss.backward()
        assert torch.isfinite(loss)
        del model, dedication, loss


def test_a_fake_broadcast_receives_init_scale_weights_from_a_fixed_number_of_draws():
    numel = 3 * 2**18 + 5
    with _fake_world(WORLD):
        group = dist.group.WORLD
        received = []
        for _ in range(2):
            buffer = torch.full((numel,), float("nan"))
            draws = _Draws()
            with draws:
                comm.broadcast(buffer, 1, group, comm.CommStats()).wait()
            assert draws.drawn <= comm.FAKE_RECEIVE_DRAWS < numel
            received.append(buffer)
    assert torch.equal(received[0], received[1])  # the same in every run
    assert torch.isfinite(received[0]).all()
    assert abs(received[0].std().item() - 0.02) < 0.002
