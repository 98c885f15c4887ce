"""The DDP-style sync of the parameters no ``fully_shard`` covers: buckets all-reduced
right after the backward of the block that holds them, overlapping the rest of backward,
as DDP's."""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from tests.support.dist import run_distributed
from tests.support.models import loss_fn, make_model, proj_predicate
from tests.support.workers import data_for
from torchtitan_dmuon import Muon, dedicate_params
from torchtitan_dmuon.engine import others

STEPS = 3


def bucket_worker(rank, world, bucket_bytes):
    others.BUCKET_BYTES = bucket_bytes
    mesh = init_device_mesh("cpu", (world,))
    model = make_model(seed=0)
    dedication = dedicate_params(model, mesh, proj_predicate)  # no fully_shard: DDP-style
    opt = Muon(model, lr=0.02, ns_dtype=torch.float32)
    phase = ["forward"]
    end_backward = dedication.driver._end_backward

    def marked_end_backward():
        phase[0] = "end_of_backward"
        end_backward()

    dedication.driver._end_backward = marked_end_backward  # queued as an autograd callback
    all_reduce, issued = dist.all_reduce, []

    def recorded(tensor, *args, group=None, **kwargs):
        if group is not None and group.group_desc == "dmuon_others":
            issued.append(phase[0])
        return all_reduce(tensor, *args, group=group, **kwargs)

    dist.all_reduce = recorded
    try:
        for step in range(STEPS):
            opt.zero_grad()
            phase[0] = "backward"
            loss_fn(model, *data_for(step, rank, world, same_data=False)).backward()
            phase[0] = "step"
            opt.step()
    finally:
        dist.all_reduce = all_reduce
    # The DDP-style parameters (a non-owner's dedicated matrices hold no storage now).
    others_params = dedication.others.params
    synced = {id(p) for p in others_params}
    names = {id(p): n for n, p in model.named_parameters()}
    in_blocks = [
        all(names[id(others_params[i])].startswith("layers.") for i in bucket)
        for bucket in dedication.others.buckets
    ]
    params = {n: p.detach().clone() for n, p in model.named_parameters() if id(p) in synced}
    return issued, in_blocks, params


def test_buckets_go_after_their_blocks_backward():
    """The blocks' norms and biases travel in buckets of their block, all-reduced inside
    backward right after that block's reduce; the embedding, final norm and head (outside
    every block) at the end of backward. Small buckets give the same values bitwise as
    one bucket per block."""
    small = run_distributed(bucket_worker, 2, 4096)
    whole = run_distributed(bucket_worker, 2, 2**30)
    layers = len(make_model(seed=0).layers)
    for (issued, in_blocks, params), (one_issued, one_in_blocks, one_params) in zip(
        small, whole, strict=True
    ):
        assert one_in_blocks == [True] * layers + [False]
        assert one_issued == (["backward"] * layers + ["end_of_backward"]) * STEPS
        assert len(in_blocks) > layers + 1 and in_blocks == sorted(in_blocks, reverse=True)
        step = ["backward" if inside else "end_of_backward" for inside in in_blocks]
        assert issued == step * STEPS, issued
        assert len(one_params) > 2
        for name, value in one_params.items():
            assert torch.equal(params[name], value), name
