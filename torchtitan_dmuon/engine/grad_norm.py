"""Gradient-norm clipping over dedicated, FSDP-sharded and replicated parameters together.

After backward a dedicated matrix's reduced gradient lives only on its owner (held by the
engine), an FSDP2 parameter's gradient is a sharded DTensor, and (DDP-style) the other
gradients are identical plain tensors on every rank. The global norm counts each exactly once.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from torchtitan_dmuon.engine.dedication import get_dedication

__all__ = ["clip_grad_norm_"]


@torch.no_grad()
def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Clip the gradients of ``model`` to a global ``norm_type``-norm of ``max_norm``.

    A collective when ``model`` was prepared by ``dedicate_params``: call it on every rank.

    Returns:
        The total norm before clipping (a plain tensor, equal on every rank).
    """
    if norm_type != 2.0:
        raise ValueError(f"norm_type: only the 2-norm is supported, got {norm_type}")
    dedication = get_dedication(model)
    owned = [grad for _, _, grad in dedication.owned_grads()] if dedication is not None else []
    sharded, replicated = [], []
    for p in model.parameters():
        if p.grad is None:
            continue
        if isinstance(p.grad, DTensor):
            sharded.append(p.grad)
        else:
            replicated.append(p.grad)

    p0 = next(model.parameters())
    device = p0.to_local().device if isinstance(p0, DTensor) else p0.device
    total_sq = torch.zeros((), dtype=torch.float32, device=device)
    for g in replicated:
        total_sq += g.float().pow(2).sum()
    for g in sharded:
        # A DTensor norm reduces over its mesh and comes back replicated.
        total_sq += torch.linalg.vector_norm(g.float()).full_tensor().pow(2)
    if dedication is not None:
        owned_sq = torch.zeros((), dtype=torch.float32, device=device)
        for g in owned:
            owned_sq += g.float().pow(2).sum()
        dist.all_reduce(owned_sq, op=dist.ReduceOp.SUM)
        total_sq += owned_sq
    total = total_sq.sqrt()
    scale = float((max_norm / (total + 1e-6)).clamp(max=1.0))
    if scale < 1.0:
        for g in owned + sharded + replicated:
            g.mul_(scale)
    return total
