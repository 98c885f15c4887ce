"""Optimizer math: Newton-Schulz, its backends, the functional Muon update, NorMuon's
normalization and QK-clip's per-head maxima and rescaling (``qk_clip``).

Nothing here imports ``torch.distributed``.
"""

from torchtitan_dmuon.optim.muon import adjusted_lr
from torchtitan_dmuon.optim.newton_schulz import (
    NS_PRESETS,
    NSSchedule,
    newton_schulz,
    ns_flops,
    resolve_ns_schedule,
)
from torchtitan_dmuon.optim.normuon import normuon_normalize
from torchtitan_dmuon.optim.ns_backends import NS_BACKENDS, get_ns_backend

__all__ = [
    "NS_BACKENDS",
    "NS_PRESETS",
    "NSSchedule",
    "adjusted_lr",
    "get_ns_backend",
    "newton_schulz",
    "normuon_normalize",
    "ns_flops",
    "resolve_ns_schedule",
]
