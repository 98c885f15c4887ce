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

from torchtitan_dmuon.engine.dedication import get_dedication

__all__ = ["clip_grad_norm_"]


def _sum_of_squares(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    norms = torch._foreach_norm([g.float() for g in grads])
    return torch.stack(norms).pow(2).sum()


@torch.no_grad()
def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Clip the gradients of ``model`` to a global ``norm_type``-norm of ``max_norm``.

    A collective when ``model`` was prepared by ``dedicate_params``: call it on every rank.

    Returns:
        The total norm before clipping (a plain tensor, equal on every rank; not finite
        when some gradient is not).
    """
    if norm_type != 2.0:
        raise ValueError(f"norm_type: only the 2-norm is supported, got {norm_type}")
    dedication = get_dedication(model)
    owned = [grad for _, _, grad in dedication.owned_grads()] if dedication is not None else []
    sharded, replicated = [], []
    for p in model.parameters():
        if p.grad is None:
            continue
        (sharded if isinstance(p.grad, DTensor) else replicated).append(p.grad)

    p0 = next(model.parameters())
    device = p0.to_local().device if isinstance(p0, DTensor) else p0.device
    total_sq = _sum_of_squares(replicated, device)
    by_mesh: dict[object, list[DTensor]] = {}
    for g in sharded:
        by_mesh.setdefault(g.device_mesh, []).append(g)
    for grads in by_mesh.values():
        # DTensor norms are partial over the shard dims: one reduction per mesh.
        norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
        total_sq = total_sq + norm.full_tensor().float().pow(2)
    if dedication is not None:
        owned_sq = _sum_of_squares(owned, device)
        dist.all_reduce(owned_sq, op=dist.ReduceOp.SUM)
        total_sq = total_sq + owned_sq
    total = total_sq.sqrt()
    coefficient = (max_norm / (total + 1e-6)).clamp(max=1.0)
    grads = owned + [g.to_local() for g in sharded] + replicated
    if grads:
        torch._foreach_mul_(grads, coefficient)
    return total
