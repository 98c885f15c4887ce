"""A model with a fused projection (TorchTitan 0.3's fused QKV layout) and its unfused
twin, for the fused-rows tests of the optimizer and the engine."""

from __future__ import annotations

import torch
from torch import nn

from tests.support.workers import REFERENCE_ADAMW_KW
from torchtitan_dmuon.optim.fused_rows import FusedRows

# Two key-value heads, three query heads each, head dim 8: (2 * (3 + 2) * 8) = 80 rows.
LAYOUT = FusedRows(groups=2, parts=(3, 1, 1), part_rows=8)
DIM = 32
# match_rms_adamw: the query matrix (48 x 32) and the key and value ones (16 x 32) get
# different learning rates (0.2 sqrt(max(rows, cols))).
MUON_KW = dict(
    lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.1, adjust_lr_fn="match_rms_adamw"
)


def fuse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """TorchTitan 0.3's fused QKV layout: rows grouped per key-value head."""
    groups, hd = LAYOUT.groups, LAYOUT.part_rows
    parts = [t.reshape(groups, -1, hd, t.shape[-1]) for t in (q, k, v)]
    return torch.cat(parts, dim=1).reshape(-1, q.shape[-1])


class Fused(nn.Module):
    """A fused projection, a second matrix and a vector (AdamW's)."""

    def __init__(self) -> None:
        super().__init__()
        block = dict(
            qkv=nn.Linear(DIM, LAYOUT.rows, bias=False),
            out=nn.Linear(LAYOUT.rows, DIM, bias=False),
        )
        self.blocks = nn.ModuleList([nn.ModuleDict(block)])
        self.scale = nn.Parameter(torch.ones(DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        block = self.blocks[0]
        return block["out"](torch.tanh(block["qkv"](x))) * self.scale


class Unfused(nn.Module):
    """The same function with the query, key and value matrices as parameters of their own."""

    def __init__(self, fused: Fused) -> None:
        super().__init__()
        weight = fused.blocks[0]["qkv"].weight.detach()
        q, k, v = LAYOUT.matrices(weight)
        self.q, self.k, self.v = (nn.Parameter(t.clone()) for t in (q, k, v))
        self.out = nn.Parameter(fused.blocks[0]["out"].weight.detach().clone())
        self.scale = nn.Parameter(fused.scale.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(x @ fuse(self.q, self.k, self.v).T)
        return (h @ self.out.T) * self.scale


def data(step: int, rows: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(rows, DIM, generator=g), torch.randn(rows, DIM, generator=g)


def reference_step(model: Unfused, optimizers, x, y) -> None:
    for opt in optimizers:
        opt.zero_grad()
    ((model(x) - y) ** 2).sum().backward()
    for opt in optimizers:
        opt.step()


def reference(model: Unfused):
    return [
        torch.optim.Muon([model.q, model.k, model.v, model.out], **MUON_KW, ns_steps=5),
        torch.optim.AdamW([model.scale], **REFERENCE_ADAMW_KW),
    ]
