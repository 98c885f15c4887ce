"""The ownership engine: partition, dedication, communication and hooks.

Depends on torch and torch.distributed only (not on TorchTitan).
"""

from torchtitan_dmuon.engine.dedication import (
    Dedication,
    dedicate_params,
    get_dedication,
    get_full_param,
    set_requires_gradient_sync,
)
from torchtitan_dmuon.engine.grad_norm import clip_grad_norm_

__all__ = [
    "Dedication",
    "clip_grad_norm_",
    "dedicate_params",
    "get_dedication",
    "get_full_param",
    "set_requires_gradient_sync",
]
