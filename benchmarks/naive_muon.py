"""Naive FSDP2 + Muon: what a user writes without dedicated ownership.

Momentum is kept on the local shard; at each step every rank all-gathers every matrix's
Nesterov update, orthogonalizes all of them (batched by shape, as a careful user would),
and keeps the rows of its own shard. Newton-Schulz work is repeated on every rank and each
matrix is all-gathered once more per step. The math equals Muon's (and DMuon's).
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from torchtitan_dmuon.optim.muon import adjusted_lr
from torchtitan_dmuon.optim.newton_schulz import newton_schulz, resolve_ns_schedule

__all__ = ["NaiveFSDPMuon"]


class NaiveFSDPMuon:
    """Muon on FSDP2-sharded matrices by gathering them on every rank, AdamW for the rest.

    Attributes:
        ns_matrices: Matrices this rank has orthogonalized (every matrix, every step).
    """

    def __init__(
        self,
        model: nn.Module,
        predicate,
        *,
        lr,
        momentum,
        weight_decay,
        ns_dtype,
        adamw_lr,
        adamw_betas=(0.9, 0.95),
        adamw_eps=1e-8,
        adamw_weight_decay=0.0,
    ):
        self.matrices = [p for n, p in model.named_parameters() if predicate(n, p)]
        ids = {id(p) for p in self.matrices}
        rest = [p for p in model.parameters() if id(p) not in ids]
        self.adamw = torch.optim.AdamW(
            rest, lr=adamw_lr, betas=adamw_betas, eps=adamw_eps, weight_decay=adamw_weight_decay
        )
        self.lr, self.momentum, self.weight_decay = lr, momentum, weight_decay
        self.ns_dtype = ns_dtype
        self.schedule = resolve_ns_schedule("quintic", 5)
        self.buffers = {p: torch.zeros_like(p.to_local()) for p in self.matrices}
        self.ns_matrices = 0

    def zero_grad(self) -> None:
        self.adamw.zero_grad()
        for p in self.matrices:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        by_shape: dict[tuple, list[tuple[DTensor, torch.Tensor]]] = defaultdict(list)
        for p in self.matrices:
            grad = p.grad.to_local()
            buf = self.buffers[p]
            buf.lerp_(grad, 1 - self.momentum)
            update = grad.lerp(buf, self.momentum)
            full = DTensor.from_local(update, p.device_mesh, p.placements).full_tensor()
            by_shape[tuple(full.shape)].append((p, full))
        for items in by_shape.values():
            stack = torch.stack([full for _, full in items])
            orthogonal = newton_schulz(stack, self.schedule, dtype=self.ns_dtype)
            self.ns_matrices += len(items)
            for (p, _), o in zip(items, orthogonal, strict=True):
                local = p.to_local()
                rank = p.device_mesh.get_local_rank()
                chunks = torch.chunk(o, p.device_mesh.size(), dim=0)
                mine = chunks[rank] if rank < len(chunks) else o[:0]
                local.mul_(1 - self.lr * self.weight_decay)
                local.add_(mine, alpha=-adjusted_lr(self.lr, None, p.shape))
        self.adamw.step()
