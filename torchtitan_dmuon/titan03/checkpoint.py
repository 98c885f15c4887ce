"""TorchTitan 0.3's DCP checkpointer with the model's state read anew at each save.

The model's own ``state_dict`` holds each dedicated matrix once, on its primary owner
(the engine's state-dict hooks, ``register_state_dict_hooks``), and a stack of experts
split among owners as a ``ShardedTensor`` of its owners' pieces. 0.3's ``ModelWrapper``
caches the state dict and, at each save, compares the storage of every new value with
the cached one's, which a ``ShardedTensor`` does not support (its ``untyped_storage``
raises). :class:`DMuonCheckpointManager` is 0.3's ``CheckpointManager`` (its config
subclassed, as 0.3 builds a manager from its config's class) whose model state is
``ModelState`` (``titan/model_state.py``): the same state dict, not cached.
``DMuonTrainer`` gives it to any config whose checkpointer is 0.3's ``CheckpointManager``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from torch import nn
from torchtitan.components.checkpoint import MODEL, CheckpointManager

from torchtitan_dmuon.titan.model_state import ModelState

__all__ = ["DMuonCheckpointManager", "with_model_state"]


class DMuonCheckpointManager(CheckpointManager):
    """0.3's ``CheckpointManager`` whose model state is ``ModelState`` (the modules' own
    state dicts, read anew at each call)."""

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        pass

    def __init__(self, config: Config, *, model_parts: list[nn.Module], **kwargs) -> None:
        super().__init__(config, model_parts=model_parts, **kwargs)
        if self.enable:
            self.states[MODEL] = ModelState(model_parts, module_keys=True)


def with_model_state(checkpoint):
    """``checkpoint`` (a trainer config's) as :class:`DMuonCheckpointManager`'s config where
    it is 0.3's ``CheckpointManager``'s, with the same fields; any other kept as it is."""
    if type(checkpoint) is not CheckpointManager.Config:
        return checkpoint
    fields = {f.name: getattr(checkpoint, f.name) for f in dataclasses.fields(checkpoint)}
    return DMuonCheckpointManager.Config(**fields)
