"""A llama3-style decoder for the step benchmark, sized by its Newton-Schulz to compute ratio.

Per matrix ``m x n`` (``m <= n``) and step, Newton-Schulz costs ``k (4 m^2 n + 2 m^3)`` FLOPs
and forward+backward ``6 m n T`` for ``T`` tokens per rank: for square ``d x d`` layers the
ratio is about ``5 d / T``. Llama-3 8B at seq 4096 (one sequence per rank) has
``d = 4096`` and ``T = 4096``, so a benchmark that keeps ``d / T`` keeps the balance between
the work Muon adds and the work the model does, at a size 2 CPU cores can run.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from torchtitan_dmuon import ClippedAttention
from torchtitan_dmuon.optim.newton_schulz import ns_flops
from torchtitan_dmuon.optim.qk_clip import HeadRows

__all__ = ["BenchTransformer", "matrix_predicate", "ns_to_compute_ratio", "qk_clip_attentions"]


class CausalSDPA(nn.Module):
    """Causal grouped-query SDPA as a module of its own (as TorchTitan's inner attention):
    what QK-clip watches."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.inner_attention = CausalSDPA()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        out = self.inner_attention(q, k, v)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, hidden: int) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(dim)
        self.attention = Attention(dim, heads, kv_heads)
        self.ffn_norm = nn.RMSNorm(dim)
        self.feed_forward = FeedForward(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class BenchTransformer(nn.Module):
    """Llama-3 proportions: GQA with 4x fewer KV heads, SwiGLU hidden = 3.5 x dim."""

    def __init__(self, vocab: int, dim: int, layers: int, heads: int) -> None:
        super().__init__()
        hidden = int(3.5 * dim)
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(
            Block(dim, heads, max(heads // 4, 1), hidden) for _ in range(layers)
        )
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


def matrix_predicate(name: str, param: nn.Parameter) -> bool:
    """The attention and feed-forward projections (what Muon takes)."""
    return param.ndim == 2 and (".attention.w" in name or ".feed_forward.w" in name)


def ns_to_compute_ratio(model: nn.Module, tokens_per_rank: int, ns_steps: int = 5) -> float:
    """Newton-Schulz FLOPs of all Muon matrices over forward+backward FLOPs of the model."""
    ns = fb = 0
    for name, p in model.named_parameters():
        if matrix_predicate(name, p):
            ns += ns_flops(p.shape, ns_steps)
        if p.ndim == 2 and not name.startswith("tok_embeddings"):
            fb += 6 * p.numel() * tokens_per_rank
    return ns / fb


def qk_clip_attentions(model: BenchTransformer) -> list[ClippedAttention]:
    """Every layer's attention as QK-clip sees it: each head's rows of wq and wk."""
    attentions = []
    for i, layer in enumerate(model.layers):
        name, attention = f"layers.{i}.attention", layer.attention
        head = attention.head_dim
        rows = (
            HeadRows(f"{name}.wq.weight", head, ((0, head, "query"),)),
            HeadRows(f"{name}.wk.weight", head, ((0, head, "key"),)),
        )
        attentions.append(ClippedAttention(f"{name}.inner_attention", attention.heads, rows))
    return attentions
