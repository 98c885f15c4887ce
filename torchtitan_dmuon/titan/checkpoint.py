"""Model state for TorchTitan's CheckpointManager with dedicated matrices saved once.

TorchTitan's ``ModelWrapper`` caches ``get_model_state_dict`` once, at construction. With
DMuon that would hold stale tensors (the engine re-binds parameters into flat buffers at
the first forward) and every rank's copy of each dedicated matrix, most of them freed. This
wrapper recomputes the state dict on each call: FSDP parameters as TorchTitan gives them
(DTensors, resharded by DCP on load), and each dedicated matrix only on its primary owner,
as one whole full-precision tensor under its parameter name. Save and load use the same
rule, so a checkpoint does not depend on the topology that wrote it: a new topology's
owner reads the whole tensor and the engine distributes it.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torchtitan.components.checkpoint import ModelWrapper

from torchtitan_dmuon.engine import get_dedication
from torchtitan_dmuon.titan.parallelize import clean_fqn

__all__ = ["DMuonModelWrapper"]


def _dedicated(model: nn.Module):
    """``(fqns of all dedicated matrices, {fqn: master} of those this rank owns)``."""
    dedication = get_dedication(model)
    fqns = {id(p): clean_fqn(n) for n, p in model.named_parameters()}
    every = {clean_fqn(d.name) for unit in dedication.units for d in unit.params}
    owned = {fqns[id(param)]: master for param, master in dedication.primary_params()}
    return every, owned


class DMuonModelWrapper(ModelWrapper):
    """``ModelWrapper`` whose state dict holds each dedicated matrix once, on its owner."""

    def __init__(self, model: nn.Module | list[nn.Module]) -> None:
        self.model = [model] if isinstance(model, nn.Module) else model

    def state_dict(self) -> dict:
        sd = {}
        for model in self.model:
            every, owned = _dedicated(model)
            part = get_model_state_dict(model)
            sd.update({k: v for k, v in part.items() if k not in every})
            sd.update(owned)
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        for model in self.model:
            every, owned = _dedicated(model)
            for fqn, master in owned.items():
                loaded = state_dict[fqn]
                if loaded is not master:  # DCP loads in place; a plain dict is copied
                    master.copy_(loaded)
            get_dedication(model).refresh_from_masters()
            rest = {k: v for k, v in state_dict.items() if k not in every}
            set_model_state_dict(model, rest, options=StateDictOptions(strict=False))
