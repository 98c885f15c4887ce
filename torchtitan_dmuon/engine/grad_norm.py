"""Gradient-norm clipping over dedicated, FSDP-sharded and replicated parameters together.

After backward a dedicated matrix's reduced gradient lives only on its owner (held by the
engine), an FSDP2 parameter's gradient is a sharded DTensor, and (DDP-style) the other
gradients are identical plain tensors on every rank. The global norm counts each exactly
once. No host synchronization: the clip coefficient stays on the device.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from torchtitan_dmuon.engine import comm
from torchtitan_dmuon.engine.dedication import get_dedication

__all__ = ["clip_grad_norm_"]


def _sum_of_squares(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    norms = torch._foreach_norm([g.float() for g in grads])
    return torch.stack(norms).pow(2).sum()


@torch.no_grad()
def clip_grad_norm_(
    model: nn.Module | list[nn.Module],
    max_norm: float,
    norm_type: float = 2.0,
    pp_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Clip the gradients of ``model`` (or of every model part of this rank) to a global
    ``norm_type``-norm of ``max_norm``.

    A collective when the model was prepared by ``dedicate_params`` or ``pp_group`` is
    given: call it on every rank.

    Args:
        model: The model, or this rank's pipeline model parts (all dedicated over the
            same data-parallel ranks, or none of them).
        max_norm: The largest global norm.
        norm_type: Only 2.0.
        pp_group: Under pipeline parallelism the group over the stages, whose norms add
            up to the global one.

    Returns:
        The total norm before clipping (a plain tensor, equal on every rank; not finite
        when some gradient is not).
    """
    if norm_type != 2.0:
        raise ValueError(f"norm_type: only the 2-norm is supported, got {norm_type}")
    parts = [model] if isinstance(model, nn.Module) else list(model)
    dedications = [d for d in map(get_dedication, parts) if d is not None]
    # Whole matrices (the same on every TP rank); per TP rank: tensor-parallel shards and
    # expert-parallel experts (ep may borrow TP ranks: each holds other experts).
    owned, owned_per_tp_rank = [], []
    for d in dedications:
        # A matrix no rank touched has a zero gradient: it adds nothing, and no flag is read.
        for param, _, grad, _ in d.owned_grads():
            (owned_per_tp_rank if d.layout_of(param).differs_per_tp_rank else owned).append(grad)
    sharded, replicated = [], []
    for p in (p for part in parts for p in part.parameters()):
        if p.grad is None:
            continue
        (sharded if isinstance(p.grad, DTensor) else replicated).append(p.grad)

    p0 = next(parts[0].parameters())
    device = p0.to_local().device if isinstance(p0, DTensor) else p0.device
    total_sq = _sum_of_squares(replicated, device)
    by_mesh: dict[object, list[DTensor]] = {}
    for g in sharded:
        by_mesh.setdefault(g.device_mesh, []).append(g)
    for grads in by_mesh.values():
        # DTensor norms are partial over the shard dims: one reduction per mesh.
        norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
        total_sq = total_sq + norm.full_tensor().float().pow(2)
    if dedications:
        # Each dedicated matrix's gradient is on one rank of the data-parallel groups;
        # a tensor-parallel one in shards over the owner column's TP ranks.
        owned_sq = torch.stack(
            [_sum_of_squares(owned, device), _sum_of_squares(owned_per_tp_rank, device)]
        )
        exchange, stats = dedications[0].exchange, dedications[0].stats
        for group in exchange.data_parallel_groups():
            comm.all_reduce(owned_sq, group, stats, "grad_norm_all_reduce").wait()
        if exchange.tp_group is not None:  # the per-TP-rank part, in place
            comm.all_reduce(owned_sq[1:], exchange.tp_group, stats, "grad_norm_all_reduce").wait()
        total_sq = total_sq + owned_sq.sum()
    if pp_group is not None:
        stats = dedications[0].stats if dedications else comm.CommStats()
        comm.all_reduce(total_sq, pp_group, stats, "grad_norm_all_reduce").wait()
    total = total_sq.sqrt()
    coefficient = (max_norm / (total + 1e-6)).clamp(max=1.0)
    grads = owned + owned_per_tp_rank + [g.to_local() for g in sharded] + replicated
    if grads:
        torch._foreach_mul_(grads, coefficient)
    return total
