"""The ownership engine: who owns each matrix, and the hooks and collectives that move it.

Layers, one file each (none imports TorchTitan):

* ``selection.py``: which parameters Muon takes and the default hook boundaries;
  ``layouts.py``: the meshes and the tensor- and expert-parallel layouts it accepts;
* ``param_layout.py``: each dedicated matrix's frozen ``ParamLayout`` (the only reader
  of DTensor placements);
* ``partition.py``, ``planner.py``, ``plan.py``: owners, boundaries and units (pure);
* ``unit.py``: a unit's flat buffer, its gradients and reduce buckets;
* ``hooks.py``, ``pass_state.py``: the forward/backward hooks and the per-pass state;
* ``exchange.py``: the engine's process groups and the collectives over them;
  ``replicas.py``: HSDP's second stage; ``others.py``: DDP-style sync of the rest;
* ``tensor_parallel.py``: the Newton-Schulz an owner column's TP ranks run together;
* ``comm.py``: the collectives, counted;
* ``verification.py``: the cross-rank verdicts (what each rank dedicates, the plan);
  ``agreement.py``: the per-device choices every rank shares (``auto`` NS dtype, backends);
* ``dedication.py``: the runtime that composes them; ``api.py``: ``dedicate_params``;
* ``geometry.py``: checkpoint geometry, the NS workload and the balance report;
* ``fsdp_state.py``: what the engine reads from and resets in FSDP2's state;
* ``settings.py``: one frozen settings object per dedication; ``patches.py``: the FSDP2
  patch;
* ``grad_norm.py``: gradient clipping over dedicated and FSDP parameters;
* ``pipeline.py``: pipeline stages (``torch.distributed.pipelining``) over dedicated parts.
"""

from torchtitan_dmuon.engine.api import (
    dedicate_params,
    get_full_param,
    reset_iter_state,
    set_requires_gradient_sync,
)
from torchtitan_dmuon.engine.dedication import Dedication, get_dedication
from torchtitan_dmuon.engine.grad_norm import clip_grad_norm_
from torchtitan_dmuon.engine.pipeline import attach_pipeline_stage
from torchtitan_dmuon.engine.settings import DedicationSettings
from torchtitan_dmuon.engine.verification import verify_plan

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
