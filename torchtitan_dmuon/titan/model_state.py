"""The model's state for either TorchTitan's DCP checkpointer, read anew at each call.

The model's own ``state_dict`` holds each dedicated matrix once, its primary owner's
full-precision master under its parameter name (a stack split among owners as a
``ShardedTensor`` of the owners' pieces), and FSDP2's parameters as DTensors: the engine's
state-dict hooks (``register_state_dict_hooks``, ``engine/checkpoint_geometry.py``) make it
so on save and load alike, so a checkpoint does not depend on the topology that wrote it.
TorchTitan's ``ModelWrapper`` caches the state dict (0.2.2 at construction, where the
engine re-binds parameters into flat buffers at the first forward after; 0.3 compares each
value's storage with the cached one's, which a ``ShardedTensor`` does not support):
:class:`ModelState` reads it anew at each call instead.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

__all__ = ["ModelState"]


class ModelState(Stateful):
    """The state of ``model`` (one module or a pipeline stage's parts) for a checkpointer.

    By default through ``torch.distributed.checkpoint``'s ``get_model_state_dict`` and
    ``set_model_state_dict``, whose keys drop the prefixes of compiled and checkpoint-wrapped
    modules (TorchTitan 0.2.2 wraps blocks so). ``module_keys=True`` reads the modules' own
    ``state_dict``: TorchTitan 0.3 keeps its keys canonical, and its fused-QKV hooks save
    keys (``wq``, ``wk``, ``wv``) that name no module ``get_model_state_dict`` could map.
    """

    def __init__(self, model: nn.Module | list[nn.Module], *, module_keys: bool = False):
        self.model = [model] if isinstance(model, nn.Module) else model
        self.module_keys = module_keys

    def state_dict(self) -> dict:
        read = nn.Module.state_dict if self.module_keys else get_model_state_dict
        return {k: v for model in self.model for k, v in read(model).items()}

    def load_state_dict(self, state_dict: dict) -> None:
        # A flattened checkpoint mixes the model's keys with the other states': not strict.
        for model in self.model:
            if self.module_keys:
                model.load_state_dict(state_dict, strict=False)
            else:
                set_model_state_dict(model, state_dict, options=StateDictOptions(strict=False))
