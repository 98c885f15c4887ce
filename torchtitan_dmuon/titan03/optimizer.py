"""TorchTitan 0.3's optimizer container over ``torchtitan_dmuon.Muon``.

:class:`DMuonOptimizersContainer` puts :class:`~torchtitan_dmuon.titan.container.DMuonContainer`'s
methods (shared with the 0.2.2 adapter) before 0.3's ``OptimizersContainer``. Its config
holds AdamW's settings as 0.2.2's ``[optimizer]`` did (``--optimizer.lr`` ...), for every
parameter DMuon does not take; the ``[dmuon]`` section reaches it from the trainer's
``dmuon`` config. Its ``state_dict`` and ``load_state_dict`` are the topology-independent
ones of ``container.py``, which create a fresh optimizer's state without stepping: 0.3's
``init_optim_state`` (a zero-gradient, lr-0 ``step()`` on ranks whose state is empty, so
on some ranks only where only owners hold state) never runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import tyro
from torch import nn
from torchtitan.components.optimizer import OptimizersContainer

from torchtitan_dmuon.titan.container import DMuonContainer, build_muon

__all__ = ["DMuonOptimizersContainer"]


class DMuonOptimizersContainer(DMuonContainer, OptimizersContainer):
    """One :class:`~torchtitan_dmuon.Muon` per model part, in TorchTitan 0.3's container."""

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        """AdamW's settings, for every parameter DMuon does not take (Muon's are the
        trainer's ``dmuon`` section)."""

        lr: float = 8e-4
        """AdamW's learning rate."""

        beta1: float = 0.9
        """AdamW's first-moment factor."""

        beta2: float = 0.95
        """AdamW's second-moment factor."""

        eps: float = 1e-8
        """AdamW's epsilon."""

        weight_decay: float = 0.1
        """AdamW's decoupled weight decay."""

        parallel_dims: Annotated[object | None, tyro.conf.Suppress] = None
        """Set by ``DMuonTrainer`` (QK-clip reads the tensor-parallel layout)."""

    def __init__(self, config: Config, *, model_parts: list[nn.Module]) -> None:
        if config.implementation == "fused_opt_states_bf16":
            raise ValueError(
                "--optimizer.implementation fused_opt_states_bf16 is not supported with DMuon"
            )
        self.model_parts = model_parts
        self.optimizers = [build_muon(m, config, config.parallel_dims) for m in model_parts]
        self._start()
        all_params = [p for opt in self.optimizers for g in opt.param_groups for p in g["params"]]
        self._post_init(all_params)
