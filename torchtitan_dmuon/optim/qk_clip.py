"""QK-clip (Kimi K2's MuonClip): rescale the query and key projections of the attention
heads whose largest pre-softmax logit exceeded a threshold.

For head ``h`` with largest logit ``m_h`` over the step's batch (``q_i . k_j * scale``
where the mask lets ``i`` see ``j``), ``gamma_h = min(1, tau / m_h)``, and after the
optimizer's update::

    W_q[head h rows] *= gamma_h ** alpha
    W_k[head h rows] *= gamma_h ** (1 - alpha)

so the head's next logits shrink by ``gamma_h`` (the logit is bilinear in the two). A
projection with a bias (Qwen2.5's q/k/v) computes ``q = W_q x + b_q``: the bias entries of
a head's rows take the rows' factor, else the logit's bias terms would not shrink.
Multi-head latent attention (DeepSeek-V3's MLA) splits a head's query and key into a
head-specific part without RoPE (``q_nope``, ``k_nope``: scaled as above) and a RoPE part
whose key ``k_pe`` is shared by every head: that key is left alone and the head's ``q_pe``
takes the whole ``gamma_h`` (Kimi K2's rule). Under grouped-query attention a key head
serves several query heads; it takes the smallest ``gamma`` of its group, so no head of the
group keeps a logit above the threshold.

The rows a weight holds for one head, and which part of the logit each row range makes,
is a :class:`HeadRows`.

:class:`QKClip` is what ``Muon(..., qk_clip=...)`` runs. Each forward, a pre-hook on every
watched attention module records, per query head, the largest pre-softmax logit of this
rank's batch from the query and key that module receives (:func:`head_max_logits`), under
no_grad and skipped during activation-checkpointing recomputes, which see the same values.
It raises a per-layer tensor in place, so TorchTitan's per-block ``torch.compile``
(fullgraph, with or without activation checkpointing) traces it into one graph that serves
every block and microbatch. ``Muon.step`` MAX-reduces the maxima over the data-parallel
ranks (one collective, started before Newton-Schulz and waited after it) and the owner of
each query and key projection rescales its heads' rows after the update, in the master
dtype, before the new values are broadcast; after the AdamW step every rank scales the
bias entries it holds (a data-parallel shard's) by the same factors, which every
data-parallel rank computed from the same reduced maxima. Maxima can also be handed in with
:meth:`QKClip.record` (a fused attention kernel that computes them). This module does not
import ``torch.distributed``: the optimizer reduces the maxima over its data-parallel ranks.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.profiler import record_function

__all__ = [
    "CHUNK_ELEMENTS",
    "ROLES",
    "ClippedAttention",
    "HeadRows",
    "QKClip",
    "clip_factors",
    "dense_mask_mod",
    "discard_records",
    "head_max_logits",
    "head_row_factors",
    "scale_bias_entries",
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
        bias: The fully qualified name of the projection's bias (one entry per row,
            scaled with its row after the bias's AdamW update), or None.
    """

    name: str
    rows_per_head: int
    parts: tuple[tuple[int, int, str], ...]
    bias: str | None = None

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


def dense_mask_mod(mask: torch.Tensor) -> MaskMod:
    """A dense boolean attention mask (True: the query sees the key), shaped ``(batch or 1,
    query heads or 1, q_len, kv_len or more)`` as sdpa takes it, as a ``mask_mod``.

    Raises:
        ValueError: The mask is not boolean (an additive float mask).
    """
    if mask.dtype != torch.bool:
        raise ValueError(f"qk_clip: the attention mask is {mask.dtype}; QK-clip reads boolean ones")

    def mask_mod(b, h, q_idx, kv_idx):
        # A dimension of size 1 is broadcast over batches or heads.
        return mask[b if mask.shape[0] > 1 else 0, h if mask.shape[1] > 1 else 0, q_idx, kv_idx]

    return mask_mod


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


def head_row_factors(
    factors: torch.Tensor, rows: HeadRows, alpha: float, local_rows: int
) -> torch.Tensor:
    """The factor of each of a weight's ``local_rows`` rows (those :func:`scale_head_rows`
    scales, 1 for rows in no part), in fp32.

    Args:
        factors: :func:`clip_factors` of the query heads these rows serve (as in
            :func:`scale_head_rows`).
        rows: The weight's layout per head.
        alpha: The query's share of the exponent, in ``[0, 1]``.
        local_rows: The weight's rows the factors cover (its tensor-parallel shard's).
    """
    heads = rows.heads(local_rows, factors.numel())
    per_head = factors.float().view(heads, -1).amin(dim=1)
    out = torch.ones(heads, rows.rows_per_head, device=factors.device)
    for start, stop, role in rows.parts:
        out[:, start:stop] = per_head.pow(rows.exponent(role, alpha))[:, None]
    return out.flatten()


@torch.no_grad()
def scale_bias_entries(
    bias: torch.Tensor,
    factors: torch.Tensor,
    rows: HeadRows,
    alpha: float,
    local_rows: int,
    index: torch.Tensor | None = None,
) -> None:
    """Scale a projection's bias entries in place by their rows' factors: the logit is
    bilinear in ``W_q x + b_q`` and ``W_k x + b_k``, so the bias goes with its rows.

    Args:
        bias: The bias entries this rank holds (a data-parallel shard's may start and
            end inside a head).
        factors: :func:`clip_factors` of the query heads the weight's rows serve.
        rows: The weight's layout per head.
        alpha: The query's share of the exponent, in ``[0, 1]``.
        local_rows: The weight's rows the factors cover (its tensor-parallel shard's).
        index: The row, among those ``local_rows``, of each entry of ``bias``; None:
            ``bias`` holds one entry per row, in order.
    """
    per_row = head_row_factors(factors, rows, alpha, local_rows).to(bias.device, bias.dtype)
    bias.mul_(per_row if index is None else per_row[index.to(bias.device)])


@dataclass(frozen=True)
class ClippedAttention:
    """One attention layer QK-clip watches, and the weights it rescales.

    Attributes:
        module: Fully qualified name of the module that receives ``(query, key, value)``
            as its first three arguments, shaped ``(batch, heads, seq, dim)``, with the
            softmax scale as keyword ``scale`` (default ``1 / sqrt(dim)``) and either a
            FlexAttention ``block_mask`` keyword, a boolean ``attn_mask``
            (:func:`dense_mask_mod`) or ``is_causal`` (default True).
        query_heads: The query heads that module receives on this rank (under tensor
            parallelism, this rank's share).
        weights: The layout of its query and key projections (:class:`HeadRows`, each
            naming its bias if it has one).
    """

    module: str
    query_heads: int
    weights: tuple[HeadRows, ...]


class QKClip:
    """The per-head maxima of a model's attention logits, and the clip's settings.

    Args:
        model: The model (or pipeline stage) whose attention layers are watched, on the
            device it trains on (the maxima are kept there); the weights named in
            ``attentions`` must be its Muon matrices, their biases any of its parameters
            (the optimizer scales them after their AdamW update).
        attentions: The layers to watch and clip.
        threshold: ``tau``: heads whose largest logit exceeds it are rescaled.
        alpha: The query's share of the rescaling, in ``[0, 1]`` (Kimi K2: 0.5).
        chunk_elements: Scores computed at once per layer (memory bound of the pass).

    Attributes:
        max_logit: After a step, the largest reduced logit of the heads this rank clips
            for (all heads of the model part, or its tensor-parallel share), or None.
        clipped_heads: After a step, how many of those heads were rescaled.
    """

    def __init__(
        self,
        model: nn.Module,
        attentions: Sequence[ClippedAttention],
        threshold: float,
        alpha: float = 0.5,
        chunk_elements: int = CHUNK_ELEMENTS,
    ) -> None:
        if not math.isfinite(threshold) or threshold <= 0:
            raise ValueError(f"qk_clip threshold must be a positive number, got {threshold!r}")
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"qk_clip alpha must be in [0, 1], got {alpha!r}")
        if not attentions:
            raise ValueError("qk_clip: no attention layer to watch")
        self.threshold = float(threshold)
        self.alpha = float(alpha)
        self.attentions = list(attentions)
        self._by_module = {a.module: a for a in self.attentions}
        self.max_logit: torch.Tensor | None = None
        self.clipped_heads: torch.Tensor | None = None
        # The step's factors, kept from the weights' clip to the biases' (after AdamW).
        self._factors: torch.Tensor | None = None
        params = dict(model.named_parameters())
        for attention in self.attentions:
            for rows in attention.weights:
                for name in (rows.name, rows.bias):
                    if name is not None and name not in params:
                        raise ValueError(f"qk_clip: {name} is not a parameter of the model")
                if rows.bias is not None and params[rows.bias].ndim != 1:
                    raise ValueError(
                        f"qk_clip: {rows.bias} has {params[rows.bias].ndim} dims; the bias "
                        f"of {rows.name} must hold one entry per row"
                    )
        # One running maximum per layer, written in place on the device of the layer's
        # weights: the hooks then differ between layers only in which tensor they write,
        # which torch.compile takes as a graph input, so one compiled block serves every
        # layer and microbatch (a per-layer name or a dict it writes would be guarded on).
        self._recorded = {
            a.module: torch.full(
                (a.query_heads,), -math.inf, device=params[a.weights[0].name].device
            )
            for a in self.attentions
        }
        _WATCHERS.setdefault(model, []).append(self)
        self._model = weakref.ref(model)
        self._handles = [
            model.get_submodule(a.module).register_forward_pre_hook(
                _observer(self._recorded[a.module], chunk_elements), with_kwargs=True
            )
            for a in self.attentions
        ]

    @property
    def weight_names(self) -> list[str]:
        """The query and key weights it rescales, by name."""
        return [rows.name for a in self.attentions for rows in a.weights]

    @property
    def bias_rows(self) -> list[HeadRows]:
        """The layouts of the query and key weights that have a bias."""
        return [rows for a in self.attentions for rows in a.weights if rows.bias is not None]

    def check_rows(self, local_rows: dict[str, int]) -> None:
        """Check that each weight's rows on this rank (``local_rows`` by name: its
        tensor-parallel shard's) are whole heads serving whole groups of the attention's
        query heads, before a step could fail half-way on one rank.

        Raises:
            ValueError: Naming the weight and its layout.
        """
        for attention in self.attentions:
            for rows in attention.weights:
                rows.heads(local_rows[rows.name], attention.query_heads)

    def record(self, module: str, max_logits: torch.Tensor) -> None:
        """Take per-head maxima of one layer's logits for the coming step (the largest
        of all recorded since the last step counts).

        Raises:
            ValueError: ``module`` is not watched, or the maxima are not one per head.
        """
        attention = self._by_module.get(module)
        if attention is None:
            raise ValueError(f"qk_clip: {module} is not a watched attention module")
        if max_logits.shape != (attention.query_heads,):
            raise ValueError(
                f"qk_clip: {module} received {tuple(max_logits.shape)} per-head maxima; "
                f"it has {attention.query_heads} query heads on this rank"
            )
        recorded = self._recorded[module]
        torch.maximum(recorded, max_logits.detach().to(recorded), out=recorded)

    def maxima(self, device: torch.device) -> torch.Tensor:
        """Every watched layer's maxima since the last step, in order, as one flat fp32
        tensor (``-inf`` for a layer that recorded nothing): what the data-parallel ranks
        MAX-reduce, the same size on every rank."""
        return torch.cat([self._recorded[a.module].to(device) for a in self.attentions])

    def reset(self) -> None:
        """Drop the maxima recorded since the last step."""
        for recorded in self._recorded.values():
            recorded.fill_(-math.inf)

    def clip(
        self,
        reduced: torch.Tensor,
        masters: dict[str, torch.Tensor],
        skip: torch.Tensor | None = None,
    ) -> None:
        """Rescale the heads of ``masters`` (the weights this rank writes, by name) whose
        reduced maximum exceeds the threshold; record the step's metrics and reset.

        Args:
            reduced: :meth:`maxima` MAX-reduced over the data-parallel ranks.
            masters: The weights this rank owns among :attr:`weight_names` (whole, or its
                tensor-parallel rows), in the master dtype.
            skip: A 0-dim tensor, nonzero on a skipped step: every factor is then 1 (the
                weights and, at :meth:`clip_biases`, the biases keep their values
                bitwise), decided on the device.
        """
        factors = clip_factors(reduced, self.threshold)
        if skip is not None:
            factors = torch.where(skip != 0, torch.ones_like(factors), factors)
        self._factors = factors if self.bias_rows else None
        for attention, layer in zip(
            self.attentions, factors.split([a.query_heads for a in self.attentions]), strict=True
        ):
            for rows in attention.weights:
                if rows.name in masters:
                    scale_head_rows(masters[rows.name], layer, rows, self.alpha)
        self.max_logit = reduced.max()
        self.clipped_heads = (reduced > self.threshold).sum()
        self.reset()

    def clip_biases(
        self, entries: dict[str, tuple[torch.Tensor, torch.Tensor | None, int]]
    ) -> None:
        """Rescale the biases of the weights :meth:`clip` rescaled this step, with the same
        factors: after the biases' own (AdamW) update, as the weights after theirs.

        Args:
            entries: By bias name, every bias of :attr:`bias_rows`: the entries this rank
                holds (in place), the row of each among its weight's rows the factors
                cover (None: all of them, in order) and that count of rows (the weight's
                tensor-parallel shard's).

        Raises:
            RuntimeError: :meth:`clip` has not run since the last call.
        """
        if self._factors is None:
            raise RuntimeError("qk_clip: clip_biases before clip (no factors for this step)")
        for attention, layer in zip(
            self.attentions,
            self._factors.split([a.query_heads for a in self.attentions]),
            strict=True,
        ):
            for rows in attention.weights:
                if rows.bias is not None:
                    bias, index, local_rows = entries[rows.bias]
                    scale_bias_entries(bias, layer, rows, self.alpha, local_rows, index)
        self._factors = None

    def remove(self) -> None:
        """Remove the forward hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        model = self._model()
        if model is not None and self in _WATCHERS.get(model, ()):
            _WATCHERS[model].remove(self)


def _observer(recorded: torch.Tensor, chunk_elements: int):
    """The forward pre-hook that raises ``recorded`` to the per-head maxima of the
    ``(query, key)`` its attention module receives."""

    def observe(module, args, kwargs) -> None:
        # Eval passes run without grad; recomputes in backward see the forward's values
        # (a compiled block recomputes inside its compiled backward, without the hook).
        if not torch.is_grad_enabled():
            return
        if not torch.compiler.is_compiling() and torch._C._current_graph_task_id() != -1:
            return
        block_mask, attn_mask = kwargs.get("block_mask"), kwargs.get("attn_mask")
        mask_mod = None
        if block_mask is not None:
            mask_mod = block_mask.mask_mod
        elif attn_mask is not None:
            mask_mod = dense_mask_mod(attn_mask)
        # A profiler range only in eager: Dynamo in torch 2.11 cannot trace one (a
        # per-block compile runs this hook inside the block's graph).
        if torch.compiler.is_compiling():
            profiled = contextlib.nullcontext()
        else:
            profiled = record_function("muon::qk_max_logits")
        with profiled:
            maxima = head_max_logits(
                args[0],
                args[1],
                scale=kwargs.get("scale"),
                causal=kwargs.get("is_causal", True),
                mask_mod=mask_mod,
                chunk_elements=chunk_elements,
            )
        torch.maximum(recorded, maxima, out=recorded)

    return observe


_WATCHERS: weakref.WeakKeyDictionary[nn.Module, list[QKClip]] = weakref.WeakKeyDictionary()
"""The :class:`QKClip` objects watching each model (or pipeline stage)."""


def discard_records(model: nn.Module) -> None:
    """Drop what every :class:`QKClip` watching ``model`` recorded since its last step: for
    a forward that was not training (a pipeline stage infers its tensors' metadata with one
    forward on uninitialized inputs before its first step)."""
    for clip in _WATCHERS.get(model, ()):
        clip.reset()
