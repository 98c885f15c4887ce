"""torchtitan-dmuon: dedicated-ownership Muon for PyTorch FSDP2 / HSDP and TorchTitan.

Each selected matrix parameter gets ONE owner rank, which keeps the full parameter and
the momentum, receives the reduced gradient, runs Newton-Schulz alone and broadcasts the
new value. While a model is dedicated, ``fully_shard`` skips its dedicated parameters
(``engine/fsdp.py``).

Layout: ``optim`` (the math and the settings, no torch.distributed: ``MuonConfig``,
Newton-Schulz and its choice, the functional Muon update, the ``Muon`` optimizer over a
matrix set, NorMuon, QK-clip, the one-process matrix set), ``engine`` (ownership:
partition, dedication, communication, hooks, the owned matrix set; no TorchTitan),
``optimizer`` (``torchtitan_dmuon.Muon``: optim's, given its model's matrix set), ``titan``
(the TorchTitan adapter).
"""

from torchtitan_dmuon.engine import (
    PassDivergedError,
    attach_pipeline_stage,
    clip_grad_norm_,
    dedicate_params,
    get_dedication,
    get_full_param,
    materialize,
    reset_iter_state,
    set_requires_gradient_sync,
)
from torchtitan_dmuon.optim.config import AdamWConfig, MuonConfig
from torchtitan_dmuon.optim.qk_clip import ClippedAttention, QKClip
from torchtitan_dmuon.optimizer import Muon, MuonStepError

__all__ = [
    "AdamWConfig",
    "ClippedAttention",
    "Muon",
    "MuonConfig",
    "MuonStepError",
    "PassDivergedError",
    "QKClip",
    "attach_pipeline_stage",
    "clip_grad_norm_",
    "dedicate_params",
    "get_dedication",
    "get_full_param",
    "materialize",
    "reset_iter_state",
    "set_requires_gradient_sync",
]
__version__ = "0.1.0"
