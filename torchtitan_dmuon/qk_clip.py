"""``QKClip``: what ``Muon(..., qk_clip=...)`` needs to run QK-clip (Kimi K2's MuonClip).

Each forward, a pre-hook on every watched attention module records, per query head, the
largest pre-softmax logit of this rank's batch from the query and key that module
receives (after RoPE, with its softmax scale and mask; see
:func:`~torchtitan_dmuon.optim.qk_clip.head_max_logits`), under no_grad and skipped during
activation-checkpointing recomputes, which see the same values. ``Muon.step`` MAX-reduces
the maxima over the data-parallel ranks (one collective, started before Newton-Schulz and
waited after it) and the owner of each query and key projection rescales its heads' rows
after the update, in the master dtype, before the new values are broadcast. Maxima can
also be handed in with :meth:`QKClip.record` (a fused attention kernel that computes them).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from torchtitan_dmuon.optim.qk_clip import (
    CHUNK_ELEMENTS,
    HeadRows,
    clip_factors,
    head_max_logits,
    scale_head_rows,
)

__all__ = ["ClippedAttention", "QKClip"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ClippedAttention:
    """One attention layer QK-clip watches, and the weights it rescales.

    Attributes:
        module: Fully qualified name of the module that receives ``(query, key, value)``
            as its first three arguments, shaped ``(batch, heads, seq, dim)``, with the
            softmax scale as keyword ``scale`` (default ``1 / sqrt(dim)``) and either a
            FlexAttention ``block_mask`` keyword or ``is_causal`` (default True).
        query_heads: The query heads that module receives on this rank (under tensor
            parallelism, this rank's share).
        weights: The layout of its query and key projections (:class:`HeadRows`).
    """

    module: str
    query_heads: int
    weights: tuple[HeadRows, ...]


class QKClip:
    """The per-head maxima of a model's attention logits, and the clip's settings.

    Args:
        model: The model (or pipeline stage) whose attention layers are watched; the
            weights named in ``attentions`` must be its Muon matrices.
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
        self.chunk_elements = chunk_elements
        self.attentions = list(attentions)
        self._by_module = {a.module: a for a in self.attentions}
        self.max_logit: torch.Tensor | None = None
        self.clipped_heads: torch.Tensor | None = None
        self._maxima: dict[str, torch.Tensor] = {}
        params = dict(model.named_parameters())
        for attention in self.attentions:
            for rows in attention.weights:
                if rows.name not in params:
                    raise ValueError(f"qk_clip: {rows.name} is not a parameter of the model")
        self._handles = [
            model.get_submodule(a.module).register_forward_pre_hook(
                self._observer(a), with_kwargs=True
            )
            for a in self.attentions
        ]

    @property
    def weight_names(self) -> list[str]:
        """The query and key weights it rescales, by name."""
        return [rows.name for a in self.attentions for rows in a.weights]

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

    def _observer(self, attention: ClippedAttention):
        def observe(module, args, kwargs) -> None:
            # Eval passes run without grad; recomputes in backward see the forward's values
            # (a compiled block recomputes inside its compiled backward, without the hook).
            if not torch.is_grad_enabled():
                return
            if not torch.compiler.is_compiling() and torch._C._current_graph_task_id() != -1:
                return
            query, key = args[0], args[1]
            block_mask = kwargs.get("block_mask")
            maxima = head_max_logits(
                query,
                key,
                scale=kwargs.get("scale"),
                causal=kwargs.get("is_causal", True),
                mask_mod=block_mask.mask_mod if block_mask is not None else None,
                chunk_elements=self.chunk_elements,
            )
            self.record(attention.module, maxima)

        return observe

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
        max_logits = max_logits.detach().float()
        previous = self._maxima.get(module)
        self._maxima[module] = (
            max_logits if previous is None else torch.maximum(previous, max_logits)
        )

    def maxima(self, device: torch.device) -> torch.Tensor:
        """Every watched layer's maxima since the last step, in order, as one flat fp32
        tensor (``-inf`` for a layer that recorded nothing): what the data-parallel ranks
        MAX-reduce, the same size on every rank."""
        return torch.cat(
            [
                self._maxima[a.module].to(device)
                if a.module in self._maxima
                else torch.full((a.query_heads,), -math.inf, device=device)
                for a in self.attentions
            ]
        )

    def reset(self) -> None:
        """Drop the maxima recorded since the last step."""
        self._maxima.clear()

    def clip(self, reduced: torch.Tensor, masters: dict[str, torch.Tensor]) -> None:
        """Rescale the heads of ``masters`` (the weights this rank writes, by name) whose
        reduced maximum exceeds the threshold; record the step's metrics and reset.

        Args:
            reduced: :meth:`maxima` MAX-reduced over the data-parallel ranks.
            masters: The weights this rank owns among :attr:`weight_names` (whole, or its
                tensor-parallel rows), in the master dtype.
        """
        factors = clip_factors(reduced, self.threshold)
        for attention, layer in zip(
            self.attentions, factors.split([a.query_heads for a in self.attentions]), strict=True
        ):
            for rows in attention.weights:
                if rows.name in masters:
                    scale_head_rows(masters[rows.name], layer, rows, self.alpha)
        self.max_logit = reduced.max()
        self.clipped_heads = (reduced > self.threshold).sum()
        self.reset()

    def remove(self) -> None:
        """Remove the forward hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
