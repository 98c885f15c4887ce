"""Which stream waits for which collective (HSDP, async replicate).

On a GPU ``Work.wait()`` makes the *current* stream wait for the collective. The compute
stream must wait only for what it reads next: a boundary's gathered values in forward and
backward, and the reduced gradients at the end of backward. The replicate broadcast of the
last step and HSDP's stage-2 reduces are waited on by the engine's gather and reduce
streams. On CPU ``torch.cpu``'s streams are no-ops, but the current stream is still known,
so the same code shows on which stream each wait is queued.
"""

import logging

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from tests.support.dist import run_distributed
from tests.support.models import loss_fn, make_model, proj_predicate
from tests.support.workers import data_for
from torchtitan_dmuon import Muon, dedicate_params

STEPS = 3


def _record_waits(compute_stream, phase: list[str]):
    """Patch ``dist.Work.wait`` and the collectives the engine issues: every wait is
    recorded as ``(phase, group description, waited on the compute stream)``."""
    groups, waits, originals = {}, [], {}

    def tracked(name):
        original = originals[name] = getattr(dist, name)

        def collective(*args, **kwargs):
            work = original(*args, **kwargs)
            if work is not None:
                group = kwargs.get("group")
                groups[work] = group.group_desc if group is not None else "default"
            return work

        setattr(dist, name, collective)

    for name in ("broadcast", "reduce", "all_reduce"):
        tracked(name)
    wait = originals["wait"] = dist.Work.wait

    def recorded(work, *args, **kwargs):
        on_compute = torch.cpu.current_stream() is compute_stream
        waits.append((phase[0], groups.get(work, "other"), on_compute))
        return wait(work, *args, **kwargs)

    dist.Work.wait = recorded
    return waits, originals


def stream_waits_worker(rank, world):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = make_model(seed=0)
    dedication = dedicate_params(
        model, mesh["shard"], proj_predicate, replicate_mesh=mesh["replicate"]
    )
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = Muon(model, lr=0.02, ns_dtype=torch.float32, replicate_async=True)
    compute_stream = torch.cpu.current_stream()
    phase = ["setup"]
    driver = dedication.driver
    end_backward = driver._end_backward

    def marked_end_backward():
        phase[0] = "end_of_backward"
        end_backward()

    driver._end_backward = marked_end_backward  # queued as an autograd callback
    waits, originals = _record_waits(compute_stream, phase)
    losses = []
    try:
        for step in range(STEPS):
            opt.zero_grad()
            # The first forward's synchronous replicate broadcast (the start values) is no
            # step's: recorded from the second step on.
            phase[0] = "forward" if step else "first_forward"
            loss = loss_fn(model, *data_for(step, rank, world, same_data=False))
            phase[0] = "backward" if step else "first_backward"
            loss.backward()
            phase[0] = "step"
            opt.step()
            losses.append(loss.item())
    finally:
        dist.Work.wait = originals.pop("wait")
        for name, original in originals.items():
            setattr(dist, name, original)
    holds = any(u.holds for u in dedication.units)
    return waits, losses, holds


def test_compute_stream_waits_only_for_what_it_reads_next():
    """In forward and backward the compute stream waits only for its shard group's
    broadcasts (the values it reads next): the replicate broadcasts (async) and every
    reduce, stage 1 and stage 2, are waited on the engine's streams. At the end of
    backward it waits for the reduces (the step reads the reduced gradients)."""
    for waits, losses, holds in run_distributed(stream_waits_worker, 4):
        assert len(losses) == STEPS
        in_pass = [w for w in waits if w[0] in ("forward", "backward")]
        on_compute = {group for _, group, compute in in_pass if compute}
        assert on_compute == {"dmuon_shard"}, sorted(set(in_pass))
        # Something was waited on the side streams in the pass: the replicate broadcasts
        # into this rank's units, stage 2 on column ranks, released stage-1 buckets.
        off_compute = {group for _, group, compute in in_pass if not compute}
        assert "dmuon_shard_reduce" in off_compute
        if holds:
            assert {"dmuon_replicate"} <= off_compute
        finished = {group for phase, group, compute in waits if phase == "end_of_backward"}
        assert "dmuon_shard_reduce" in finished


def unhidden_worker(rank, world):
    """Async replicate where no broadcast has landed when the forward needs it (every
    replicate broadcast reports itself unfinished): counted and warned once."""
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
    model = make_model(seed=0)
    dedication = dedicate_params(
        model, mesh["shard"], proj_predicate, replicate_mesh=mesh["replicate"]
    )
    opt = Muon(model, lr=0.02, ns_dtype=torch.float32, replicate_async=True)
    replicas = dedication.exchange.replicas
    is_completed = dist.Work.is_completed
    replicate_works = set()
    broadcast = replicas.broadcast

    def tracked_broadcast(units, async_op):
        before = {w for works in replicas._in_flight.values() for w in works}
        broadcast(units, async_op)
        replicate_works.update(
            w for works in replicas._in_flight.values() for w in works if w not in before
        )

    replicas.broadcast = tracked_broadcast
    dist.Work.is_completed = lambda work: work not in replicate_works and is_completed(work)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("torchtitan_dmuon").addHandler(handler)
    try:
        for step in range(STEPS):
            opt.zero_grad()
            loss_fn(model, *data_for(step, rank, world, same_data=False)).backward()
            opt.step()
    finally:
        dist.Work.is_completed = is_completed
        logging.getLogger("torchtitan_dmuon").removeHandler(handler)
    warnings = [r.getMessage() for r in records if "cannot hide" in r.getMessage()]
    return replicas.unhidden, len(dedication.driver.states), warnings


@pytest.mark.parametrize("world", [2])
def test_replicate_broadcast_that_cannot_hide_is_counted_and_logged(world):
    for unhidden, boundaries, warnings in run_distributed(unhidden_worker, world):
        # Two forwards after an async step, each boundary waiting for its broadcast; the
        # primary replica's own units receive nothing.
        assert 0 < unhidden <= (STEPS - 1) * boundaries
        assert len(warnings) == 1, warnings
