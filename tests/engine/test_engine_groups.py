"""How the engine creates its process groups (``comm.engine_group``): on an accelerator
every group connects at creation and, on NCCL, runs its kernels on high-priority
streams; on the CPU (gloo) and under a dry run's fake backend ``new_group`` gets nothing
more. torch's CPU build has no NCCL, so an NCCL parent group is stood in for and the
keywords each group is created with are recorded."""

from __future__ import annotations

from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from tests.support.dist import run_distributed
from torchtitan_dmuon.engine import comm

TIMEOUT = timedelta(seconds=77)


class FakeNCCL:
    """Stands in for ``dist.ProcessGroupNCCL`` (absent from CPU builds)."""

    class Options:
        def __init__(self) -> None:
            self.is_high_priority_stream = False
            self._timeout = timedelta(minutes=10)


class FakeGloo:
    pass


def _parent(backend) -> SimpleNamespace:
    return SimpleNamespace(_get_backend=lambda device: backend, group_desc="mesh_shard")


@pytest.fixture
def created(monkeypatch):
    """The keywords of every ``dist.new_group`` call, with the parent's ranks [4, 5, 6, 7]."""
    calls = []
    monkeypatch.setattr(dist, "ProcessGroupNCCL", FakeNCCL, raising=False)
    monkeypatch.setattr(dist, "get_process_group_ranks", lambda group: [4, 5, 6, 7])
    monkeypatch.setattr(dist, "new_group", lambda ranks, **kw: calls.append((ranks, kw)))
    monkeypatch.setattr(comm, "group_timeout", lambda group: TIMEOUT)
    monkeypatch.setattr(comm, "is_fake", lambda group: False)
    return calls


CUDA3 = torch.device("cuda", 3)


def test_an_nccl_group_connects_at_creation_on_high_priority_streams(created):
    comm.engine_group(_parent(FakeNCCL()), "dmuon_shard", CUDA3)
    comm.engine_group(_parent(FakeNCCL()), "dmuon_owner_group", CUDA3, slice(2, 4))
    assert [ranks for ranks, _ in created] == [[4, 5, 6, 7], [6, 7]]
    for _, kw in created:
        assert kw["device_id"] == CUDA3
        assert kw["pg_options"].is_high_priority_stream is True
        assert kw["pg_options"]._timeout == kw["timeout"] == TIMEOUT
        assert kw["use_local_synchronization"] is True


def test_gloo_twin_of_an_accelerator_group_gets_no_device_options(created):
    """The agreement before a step's second phase (``Dedication.phase_group``) joins an NCCL
    TP or owner group with a gloo one over the same ranks: no device to bind, no NCCL
    options."""
    comm.engine_group(
        _parent(FakeNCCL()), "dmuon_shard_reduce_host", torch.device("cpu"), backend="gloo"
    )
    ((_, kw),) = created
    assert kw["backend"] == "gloo" and "device_id" not in kw and "pg_options" not in kw


def test_another_accelerator_backend_is_bound_but_keeps_its_options(created):
    comm.engine_group(_parent(FakeGloo()), "dmuon_shard", CUDA3)  # e.g. "cuda:gloo"
    ((_, kw),) = created
    assert kw["device_id"] == CUDA3 and "pg_options" not in kw


def test_cpu_groups_get_nothing_more(created):
    comm.engine_group(_parent(FakeGloo()), "dmuon_shard", torch.device("cpu"))
    ((_, kw),) = created
    assert "device_id" not in kw and "pg_options" not in kw


def engine_groups_worker(rank, world):
    """Every group a real HSDP dedication creates on gloo, with its keywords."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from tests.support.models import make_model, proj_predicate
    from torchtitan_dmuon import Muon, dedicate_params

    calls, new_group = [], dist.new_group

    def recorded(ranks, **kw):
        calls.append((kw["group_desc"], sorted(k for k in kw if k in ("device_id", "pg_options"))))
        return new_group(ranks, **kw)

    dist.new_group = recorded
    try:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        model = make_model(seed=0)
        dedicate_params(
            model, mesh["shard"], predicate=proj_predicate, replicate_mesh=mesh["replicate"]
        )
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = Muon(model, lr=0.02)
        del optimizer, model
    finally:
        dist.new_group = new_group
    return calls


def test_a_gloo_dedication_creates_its_groups_plainly():
    for calls in run_distributed(engine_groups_worker, 4):
        names = [name for name, _ in calls]
        assert {"dmuon_shard", "dmuon_shard_reduce", "dmuon_replicate", "dmuon_recovery"} <= set(
            names
        ), names
        assert all(keys == [] for _, keys in calls), calls
