"""``torchtitan_dmuon.Muon``: the optimizer of :mod:`torchtitan_dmuon.optim.optimizer` given
the matrix set of its model.

The one place that tells a dedicated model from a one-process one: a model
:func:`torchtitan_dmuon.dedicate_params` prepared gets the engine's ``OwnedMatrices``
(each rank steps only the matrices it owns) and the engine's bias layout for QK-clip; any
other gets ``LocalMatrices`` over the matrices ``predicate`` selects.
"""

from __future__ import annotations

from torch import nn

from torchtitan_dmuon.engine import get_dedication
from torchtitan_dmuon.engine.owned import OwnedMatrices
from torchtitan_dmuon.engine.param_layout import bias_entries
from torchtitan_dmuon.engine.plan import Predicate, select_matrices
from torchtitan_dmuon.optim import optimizer
from torchtitan_dmuon.optim.config import AdamWConfig, MuonConfig
from torchtitan_dmuon.optim.fused_rows import fused_rows_of
from torchtitan_dmuon.optim.matrices import LocalMatrices, MatrixSet, MuonStepError
from torchtitan_dmuon.optim.qk_clip import QKClip

__all__ = ["Muon", "MuonStepError"]


class Muon(optimizer.Muon):
    """Muon for matrix parameters and AdamW for all others, on one model.

    Args:
        model: The model to optimize. If :func:`dedicate_params` was applied to it, the
            dedicated parameters are the Muon parameters and each rank steps only those it
            owns; otherwise ``predicate`` selects them.
        config: Muon's settings (:class:`MuonConfig`); default: its defaults.
        adamw: The inner AdamW's settings (:class:`AdamWConfig`); default: its defaults.
        qk_clip: QK-clip (see :class:`torchtitan_dmuon.optim.optimizer.Muon`). None: off.
        predicate: One-process selection of Muon parameters, ``predicate(name, param)``;
            defaults to every trainable 2-D parameter. Not allowed together with
            :func:`dedicate_params`, whose own predicate decides.
        **settings: Any :class:`MuonConfig` field (``lr=0.02``, ``ns_steps=5``, ...) or
            :class:`AdamWConfig` field as ``adamw_<field>`` (``adamw_lr=1e-3``), applied
            over ``config`` and ``adamw``.

    Attributes and errors: those of :class:`torchtitan_dmuon.optim.optimizer.Muon`.
    """

    def __init__(
        self,
        model: nn.Module,
        config: MuonConfig | None = None,
        *,
        adamw: AdamWConfig | None = None,
        qk_clip: QKClip | None = None,
        predicate: Predicate | None = None,
        **settings,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        config, adamw = optimizer.muon_configs(config, adamw, settings)
        matrices = _matrix_set(model, config, predicate)
        super().__init__(model, matrices, config, adamw, qk_clip=qk_clip, bias_entries=bias_entries)


def _matrix_set(model: nn.Module, config: MuonConfig, predicate: Predicate | None) -> MatrixSet:
    dedication = get_dedication(model)
    if dedication is None:
        selected = select_matrices(model, predicate or (lambda n, p: p.ndim == 2))
        return LocalMatrices(selected, config, _fused(model, [n for n, _ in selected]))
    if predicate is not None:
        raise ValueError(
            "predicate: the model was prepared by dedicate_params, whose predicate "
            "selects the Muon parameters; do not pass one to Muon as well"
        )
    names = [d.name for d in dedication.plan.params]
    return OwnedMatrices(dedication, config, _fused(model, names))


def _fused(model: nn.Module, names: list[str]) -> dict:
    """The fused-rows layouts (``mark_fused_rows``) of the parameters ``names``."""
    layouts = {name: fused_rows_of(model, name) for name in names}
    return {name: layout for name, layout in layouts.items() if layout is not None}
