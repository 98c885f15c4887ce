"""Context parallelism with dedicated matrices, on the engine.

Context parallelism adds ranks to the data-parallel mesh: TorchTitan's ``fsdp`` mesh is
dp_shard x cp flattened, the ranks of one cp group hold different sequence chunks of the
same samples, and gradients are summed over all of them. The engine dedicates over that
flattened mesh. TorchTitan's CP itself cannot run on CPU (its attention needs SDPA's flash
kernel), so this uses a token-wise model, which needs no ring attention across chunks:
trained on (dp_shard, cp) = (2, 2) gloo ranks, it equals one process on the whole batch.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from tests.support.dist import run_distributed
from tests.support.models import TokenModel, batch, proj_predicate
from tests.support.workers import (
    ADAMW_KW,
    MUON_KW,
    as_muon_adamw_kwargs,
    full_params,
    reference_setup,
    train_one_process,
)
from torchtitan_dmuon import Muon, dedicate_params

STEPS, SAMPLES, SEQ, VOCAB = 4, 4, 8, 64
DP_SHARD, CP = 2, 2


def _model() -> TokenModel:
    torch.manual_seed(0)
    return TokenModel(VOCAB)


def _summed_loss(model, inputs, targets) -> torch.Tensor:
    logits = model(inputs)
    return nn.functional.cross_entropy(
        logits.reshape(-1, VOCAB), targets.reshape(-1), reduction="sum"
    )


def cp_worker(rank, world):
    mesh = init_device_mesh("cpu", (DP_SHARD, CP), mesh_dim_names=("dp_shard", "cp"))
    fsdp_mesh = mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
    dp, cp = mesh["dp_shard"].get_local_rank(), mesh["cp"].get_local_rank()
    model = _model()
    dedicate_params(model, fsdp_mesh, proj_predicate)
    for layer in model.layers:
        fully_shard(layer, mesh=fsdp_mesh)
    fully_shard(model, mesh=fsdp_mesh)
    opt = Muon(model, ns_dtype=torch.float32, **MUON_KW, **as_muon_adamw_kwargs(ADAMW_KW))
    samples, chunk = SAMPLES // DP_SHARD, SEQ // CP
    losses = []
    for step in range(STEPS):
        inputs, targets = batch(100 + step, SAMPLES, SEQ, VOCAB)
        rows, cols = slice(dp * samples, (dp + 1) * samples), slice(cp * chunk, (cp + 1) * chunk)
        opt.zero_grad()
        share = _summed_loss(model, inputs[rows, cols], targets[rows, cols]) / (SAMPLES * SEQ)
        # FSDP2 and the engine average over the mesh (gloo has no PREMUL_SUM for a sum):
        # the mean of world x share is the sum of the shares, the whole batch's loss.
        (share * world).backward()
        opt.step()
        losses.append(share.item())
    names = {n for n, p in model.named_parameters() if proj_predicate(n, p)}
    return losses, full_params(model, names)


def test_context_parallel_mesh_equals_one_process():
    """(dp_shard, cp) = (2, 2): the four ranks' loss shares add up to the one-process loss
    and every parameter equals one-process torch.optim.Muon + AdamW within 1e-5."""
    by_rank = run_distributed(cp_worker, DP_SHARD * CP, timeout=240)
    with reference_setup(torch.float32):
        model = _model()
        expected = train_one_process(
            model,
            STEPS,
            lambda m, step: (
                _summed_loss(m, *batch(100 + step, SAMPLES, SEQ, VOCAB)) / (SAMPLES * SEQ)
            ),
        )
    losses = [sum(step) for step in zip(*(r[0] for r in by_rank), strict=True)]
    torch.testing.assert_close(losses, expected, rtol=1e-5, atol=1e-6)
    for name, value in by_rank[0][1].items():
        reference = dict(model.named_parameters())[name].detach()
        torch.testing.assert_close(value, reference, rtol=1e-5, atol=1e-6, msg=name)
