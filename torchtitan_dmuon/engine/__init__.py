"""The ownership engine: partition, dedication, communication and hooks.

Depends on torch and torch.distributed only (not on TorchTitan).
"""

from torchtitan_dmuon.engine.dedication import Dedication, dedicate_params, get_dedication
from torchtitan_dmuon.engine.grad_norm import clip_grad_norm_

__all__ = ["Dedication", "dedicate_params", "get_dedication", "clip_grad_norm_"]
