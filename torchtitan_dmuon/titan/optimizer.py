"""TorchTitan 0.2.2's optimizer container over ``torchtitan_dmuon.Muon``: the methods of
:class:`~torchtitan_dmuon.titan.container.DMuonContainer` (``container.py``, shared with
the 0.3 adapter) on TorchTitan 0.2.2's ``OptimizersContainer``, built by
``build_optimizers_fn`` for ``[optimizer] name = "DMuon"``.
"""

from __future__ import annotations

from torch import nn

import torchtitan_dmuon.titan.checked  # noqa: F401 - before TorchTitan: refuses another release

# isort: split

from torchtitan.components.optimizer import OptimizersContainer

from torchtitan_dmuon.titan.container import (
    DMuonContainer,
    build_muon,
    decay_kept,
    log_decay,
    schedule_factors,
)

__all__ = [
    "DMuonOptimizersContainer",
    "build_dmuon_optimizers",
    "decay_kept",
    "log_decay",
    "schedule_factors",
]


class DMuonOptimizersContainer(DMuonContainer, OptimizersContainer):
    """TorchTitan 0.2.2's optimizer container over one :class:`~torchtitan_dmuon.Muon` per
    part."""

    def __init__(self, model_parts: list[nn.Module], optimizer_config, parallel_dims) -> None:
        self.model_parts = model_parts
        self.optimizers = [build_muon(m, optimizer_config, parallel_dims) for m in model_parts]
        self._start()
        self._validate_length(len(model_parts))
        all_params = [p for opt in self.optimizers for g in opt.param_groups for p in g["params"]]
        self._post_init(all_params, {"lr": optimizer_config.lr})


def build_dmuon_optimizers(
    model_parts: list[nn.Module], optimizer_config, parallel_dims, ft_manager=None
) -> DMuonOptimizersContainer:
    """TorchTitan ``build_optimizers_fn`` for ``[optimizer] name = "DMuon"``."""
    if optimizer_config.early_step_in_backward:
        raise ValueError("[optimizer] early_step_in_backward is not supported with DMuon")
    if ft_manager is not None and ft_manager.enabled:
        raise ValueError("TorchFT is not supported with DMuon")
    return DMuonOptimizersContainer(model_parts, optimizer_config, parallel_dims)
