"""QK-clip as a step of its own, after Muon's update and after AdamW's.

:class:`QKClipStep` binds a :class:`~torchtitan_dmuon.optim.qk_clip.QKClip` to the matrix
set ``Muon`` steps: it checks at construction that the clipped projections are Muon
matrices whose heads it can place, locates the clipped biases' entries among their heads'
rows, and in each step starts the MAX of the per-head maxima before Newton-Schulz (one
collective, overlapping it), rescales the weights' rows after the update and the biases
after AdamW's. ``Muon`` calls it at those three points and knows nothing else of it.

This module does not import ``torch.distributed``: where a bias's entries lie is the
matrix set's layout, given as ``bias_entries``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn
from torch.profiler import record_function

from torchtitan_dmuon.optim.matrices import MatrixSet, local_view
from torchtitan_dmuon.optim.qk_clip import HeadRows, QKClip

__all__ = ["BiasEntries", "QKClipStep"]

logger = logging.getLogger(__name__)

BiasEntries = Callable[[torch.Tensor, torch.Tensor, HeadRows, int], "torch.Tensor | None"]
"""``(weight, bias, rows, local_rows)``: the row of each entry of ``bias`` held here among
the ``local_rows`` rows of ``weight`` held here (None: the whole bias, in order); raises a
ValueError naming the bias where they cannot be located."""


class QKClipStep:
    """One model's QK-clip, run by ``Muon`` around and after its update.

    Args:
        qk_clip: What to clip.
        model: The model whose biases are located.
        matrices: The Muon matrix set (the clipped weights must be among them).
        bias_entries: Where a bias's entries lie among its projection's rows here.

    Raises:
        TypeError / ValueError: ``qk_clip`` is not a QKClip, clips a weight Muon does not
            step, one owned in blocks of its rows, or a bias whose entries cannot be
            located (on every rank alike: the errors are gathered over the matrix set's
            ranks, one small all-gather).
    """

    def __init__(
        self,
        qk_clip: QKClip,
        model: nn.Module,
        matrices: MatrixSet,
        bias_entries: BiasEntries,
    ) -> None:
        if not isinstance(qk_clip, QKClip):
            raise TypeError(f"qk_clip must be a QKClip, got {type(qk_clip).__name__}")
        self.qk_clip = qk_clip
        self.matrices = matrices
        self._check_weights()
        self._biases = self._locate_biases(model, bias_entries)
        self._maxima: Callable[[], torch.Tensor] | None = None  # the MAX under way
        self._reduced: torch.Tensor | None = None  # its result, this step's
        logger.info(
            "Muon: QK-clip on %d attention layers (threshold %g, alpha %g)",
            len(qk_clip.attentions),
            qk_clip.threshold,
            qk_clip.alpha,
        )

    def _check_weights(self) -> None:
        qk_clip, matrices = self.qk_clip, self.matrices
        names = set(matrices.names)
        outside = [name for name in qk_clip.weight_names if name not in names]
        if outside:
            raise ValueError(
                f"qk_clip: {outside[0]} is not a Muon matrix of this model (QK-clip "
                "rescales the query and key projections on their owner after Muon's "
                "update); select it for Muon or leave it out of the clipped attentions"
            )
        blocked = sorted(set(qk_clip.weight_names) & matrices.row_blocked())
        if blocked:
            raise ValueError(
                f"qk_clip: {blocked[0]} has more rows than columns and is owned by an owner "
                "group in blocks of its rows, whose heads QK-clip cannot place yet; pass "
                "owner_group_size=1 to dedicate_params ([dmuon] owner_group_size = 1)"
            )
        qk_clip.check_rows(matrices.local_rows())

    def _locate_biases(
        self, model: nn.Module, bias_entries: BiasEntries
    ) -> dict[str, tuple[nn.Parameter, torch.Tensor | None, int]]:
        """Each clipped bias, the row of each of its entries here among its weight's rows
        here (None: all, in order) and their count; a layout refused on one rank is
        refused on every rank alike, before the first step."""
        if not self.qk_clip.bias_rows:
            return {}
        local_rows = self.matrices.local_rows()
        located, error = {}, None
        for rows in self.qk_clip.bias_rows:
            bias = model.get_parameter(rows.bias)
            weight = model.get_parameter(rows.name)
            try:
                index = bias_entries(weight, bias, rows, local_rows[rows.name])
            except ValueError as e:
                error = error or str(e)
                continue
            located[rows.bias] = (bias, index, local_rows[rows.name])
        if self.matrices.gather is not None:
            errors = [e for e in self.matrices.gather(error) if e is not None]
            error = errors[0] if errors else None
        if error is not None:
            raise ValueError(error)
        return located

    def begin(self) -> None:
        """At the step's start: the MAX of the per-head maxima over the data-parallel
        ranks starts (it overlaps Newton-Schulz)."""
        self._maxima = self.matrices.reduce_max(self.qk_clip.maxima(self.matrices.device))

    def wait(self) -> None:
        """Before the update's writes (also when computing it failed)."""
        maxima, self._maxima = self._maxima, None
        self._reduced = maxima() if maxima is not None else None

    def clip_weights(self, skip: torch.Tensor | None) -> None:
        """After Muon's update: the query and key rows of the heads over the threshold
        (none where the 0-dim ``skip`` is nonzero, decided on the device)."""
        with record_function("muon::qk_clip"):
            self.matrices.clip_qk(self.qk_clip, self._reduced, skip)

    def clip_biases(self) -> None:
        """After AdamW's update of the biases, as the weights' after Muon's."""
        if not self._biases:
            return
        with record_function("muon::qk_clip_biases"):
            self.qk_clip.clip_biases(
                {
                    name: (local_view(bias), index, rows)
                    for name, (bias, index, rows) in self._biases.items()
                }
            )

    def reset(self) -> None:
        """A new accumulation (``zero_grad``): the old passes' maxima go."""
        self.qk_clip.reset()
