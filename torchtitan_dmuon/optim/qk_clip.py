"""QK-clip (Kimi K2's MuonClip): rescale the query and key projections of the attention
heads whose largest pre-softmax logit exceeded a threshold.

For head ``h`` with largest logit ``m_h`` over the step's batch (``q_i . k_j * scale``
where the mask lets ``i`` see ``j``), ``gamma_h = min(1, tau / m_h)``, and after the
optimizer's update::

    W_q[head h rows] *= gamma_h ** alpha
    W_k[head h rows] *= gamma_h ** (1 - alpha)

so the head's next logits shrink by ``gamma_h`` (the logit is bilinear in the two).
Multi-head latent attention (DeepSeek-V3's MLA) splits a head's query and key into a
head-specific part without RoPE (``q_nope``, ``k_nope``: scaled as above) and a RoPE part
whose key ``k_pe`` is shared by every head: that key is left alone and the head's ``q_pe``
takes the whole ``gamma_h`` (Kimi K2's rule). Under grouped-query attention a key head
serves several query heads; it takes the smallest ``gamma`` of its group, so no head of the
group keeps a logit above the threshold.

The rows a weight holds for one head, and which part of the logit each row range makes,
is a :class:`HeadRows`. This module does not import ``torch.distributed``: the caller
reduces the maxima over its data-parallel ranks.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.profiler import record_function

__all__ = [
    "CHUNK_ELEMENTS",
    "ROLES",
    "HeadRows",
    "clip_factors",
    "head_max_logits",
    "scale_head_rows",
]

ROLES = ("query", "key", "query_of_shared_key")
"""What a row range of a head makes: its query (scaled by ``gamma ** alpha``), its key
(``gamma ** (1 - alpha)``), or the query part whose key every head shares (``gamma``)."""

CHUNK_ELEMENTS = 1 << 20
"""Scores computed at once by :func:`head_max_logits`: 4 MiB in fp32, the pass's extra
memory. The pass is memory bound; a chunk that stays in a last-level cache helps (on a
2-core AVX2 CPU at seq_len 2048: 2^20 and 2^22 equal, 2^24 2.7x slower, 2^16 4x)."""

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""FlexAttention's ``mask_mod(batch, head, q_idx, kv_idx) -> bool``, on broadcast indices."""


@dataclass(frozen=True)
class HeadRows:
    """How one projection weight lays out its rows per attention head.

    Attributes:
        name: The weight's fully qualified name in the model.
        rows_per_head: Consecutive rows of one head (its query or key dim, with MLA's
            value rows where the weight computes both).
        parts: ``(start, stop, role)`` row ranges within a head and their role in
            :data:`ROLES`; rows in no part (MLA's value rows) are not scaled.
    """

    name: str
    rows_per_head: int
    parts: tuple[tuple[int, int, str], ...]

    def __post_init__(self) -> None:
        for start, stop, role in self.parts:
            if role not in ROLES:
                raise ValueError(f"HeadRows {self.name}: role must be one of {ROLES}, got {role!r}")
            if not 0 <= start < stop <= self.rows_per_head:
                raise ValueError(
                    f"HeadRows {self.name}: part ({start}, {stop}) is outside a head's "
                    f"{self.rows_per_head} rows"
                )

    def heads(self, local_rows: int, query_heads: int) -> int:
        """The heads ``local_rows`` rows of this weight hold (its tensor-parallel shard's),
        serving ``query_heads`` query heads.

        Raises:
            ValueError: The rows are not whole heads, or the query heads not whole groups
                of them.
        """
        heads, rest = divmod(local_rows, self.rows_per_head)
        if rest or heads == 0 or query_heads % heads:
            raise ValueError(
                f"qk_clip: {self.name} has {local_rows} rows here, not whole heads of "
                f"{self.rows_per_head} rows serving {query_heads} query heads"
            )
        return heads

    def exponent(self, role: str, alpha: float) -> float:
        return {"query": alpha, "key": 1.0 - alpha, "query_of_shared_key": 1.0}[role]


@torch.no_grad()
@record_function("muon::qk_max_logits")
def head_max_logits(
    query: torch.Tensor,
    key: torch.Tensor,
    *,
    scale: float | None = None,
    causal: bool = True,
    mask_mod: MaskMod | None = None,
    chunk_elements: int = CHUNK_ELEMENTS,
) -> torch.Tensor:
    """The largest pre-softmax logit of each query head, in fp32, computed over chunks of
    query positions so the whole score matrix never exists at once.

    Args:
        query: ``(batch, query heads, q_len, dim)``, as attention receives it (after RoPE).
        key: ``(batch, key heads, kv_len, dim)``; the query heads are a multiple of its
            heads, ``query heads / key heads`` consecutive query heads per key head.
        scale: The softmax scale; None: ``1 / sqrt(dim)``.
        causal: Query ``i`` sees keys ``j <= i`` (ignored with ``mask_mod``).
        mask_mod: FlexAttention's mask function (called on broadcast index tensors).
        chunk_elements: Scores per chunk.

    Returns:
        ``(query heads,)``; ``-inf`` for a head no query of which sees any key.
    """
    batch, heads, q_len, dim = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    if heads % kv_heads:
        raise ValueError(f"head_max_logits: {heads} query heads over {kv_heads} key heads")
    group = heads // kv_heads
    scale = 1.0 / math.sqrt(dim) if scale is None else scale
    # The scale on the queries and no masked copy of the scores where every key is
    # visible: the scores are written once and read once (memory bound at long sequences).
    q = query.detach().float().mul(scale).view(batch, kv_heads, group, q_len, dim)
    k_t = key.detach().float().transpose(-2, -1).unsqueeze(2)  # (b, kv, 1, dim, kv_len)
    rows = max(1, chunk_elements // (batch * heads * kv_len))
    kv_idx = torch.arange(kv_len, device=query.device).view(1, 1, 1, 1, -1)
    b_idx = torch.arange(batch, device=query.device).view(batch, 1, 1, 1, 1)
    h_idx = torch.arange(heads, device=query.device).view(1, kv_heads, group, 1, 1)
    maxima = torch.full((kv_heads, group), -math.inf, device=query.device)
    for start in range(0, q_len, rows):
        stop = min(start + rows, q_len)
        q_idx = torch.arange(start, stop, device=query.device).view(1, 1, 1, -1, 1)
        if mask_mod is not None:
            scores = q[:, :, :, start:stop] @ k_t
            scores.masked_fill_(~mask_mod(b_idx, h_idx, q_idx, kv_idx), -math.inf)
        elif causal:
            # The chunk's queries see every key before ``start``, part of the next
            # ``stop - start`` and nothing after.
            seen = min(stop, kv_len)
            scores = q[:, :, :, start:stop] @ k_t[..., :seen]
            diagonal = scores[..., start:seen]
            diagonal.masked_fill_(q_idx < kv_idx[..., start:seen], -math.inf)
        else:
            scores = q[:, :, :, start:stop] @ k_t
        maxima = torch.maximum(maxima, scores.amax(dim=(0, 3, 4)))
    return maxima.reshape(heads)


def clip_factors(max_logits: torch.Tensor, threshold: float) -> torch.Tensor:
    """``gamma`` per head: ``threshold / max`` where the maximum exceeds the threshold, else
    1 (fp32)."""
    max_logits = max_logits.float()
    return torch.where(max_logits > threshold, threshold / max_logits, torch.ones_like(max_logits))


@torch.no_grad()
def scale_head_rows(
    weight: torch.Tensor, factors: torch.Tensor, rows: HeadRows, alpha: float
) -> None:
    """Scale ``weight``'s rows in place by its heads' factors (see the module docstring).

    Args:
        weight: The projection's rows for the heads of ``factors`` (the whole weight, or a
            tensor-parallel shard holding whole heads), in the master dtype.
        factors: :func:`clip_factors` of the query heads these rows serve: one per head of
            ``weight``, or a whole number of query heads per key head (grouped-query
            attention), the group taking its smallest factor.
        rows: The weight's layout per head.
        alpha: The query's share of the exponent, in ``[0, 1]``.
    """
    heads = rows.heads(weight.shape[0], factors.numel())
    per_head = factors.view(heads, -1).amin(dim=1).to(weight.dtype)
    view = weight.view(heads, rows.rows_per_head, -1)
    for start, stop, role in rows.parts:
        view[:, start:stop].mul_(per_head.pow(rows.exponent(role, alpha))[:, None, None])
