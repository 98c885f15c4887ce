"""The ownership engine: who owns each matrix, and the hooks and collectives that move it.

Layers, one file each (none imports TorchTitan):

* ``selection.py``: which parameters Muon takes;
* ``partition.py``, ``plan.py``: owners, boundaries and units (pure, no collectives);
* ``unit.py``: a unit's flat buffer, its gradients and reduce buckets;
* ``hooks.py``: the forward/backward hooks and the per-pass state;
* ``replicas.py``: HSDP's second stage; ``others.py``: DDP-style sync of the rest;
* ``comm.py``: the collectives, on the engine's own process groups, counted;
* ``dedication.py``: the runtime that composes them; ``api.py``: ``dedicate_params``;
* ``settings.py``: one settings object per dedication; ``patches.py``: the FSDP2 patch;
* ``grad_norm.py``: gradient clipping over dedicated and FSDP parameters;
* ``pipeline.py``: pipeline stages (``torch.distributed.pipelining``) over dedicated parts.
"""

from torchtitan_dmuon.engine.api import (
    dedicate_params,
    get_full_param,
    reset_iter_state,
    set_requires_gradient_sync,
    verify_plan,
)
from torchtitan_dmuon.engine.dedication import Dedication, get_dedication
from torchtitan_dmuon.engine.grad_norm import clip_grad_norm_
from torchtitan_dmuon.engine.pipeline import attach_pipeline_stage
from torchtitan_dmuon.engine.settings import DedicationSettings

__all__ = [
    "Dedication",
    "DedicationSettings",
    "attach_pipeline_stage",
    "clip_grad_norm_",
    "dedicate_params",
    "get_dedication",
    "get_full_param",
    "reset_iter_state",
    "set_requires_gradient_sync",
    "verify_plan",
]
