"""The ownership engine: who owns each matrix, and the hooks and collectives that move it.

Grouped by concern, as FSDP2's ``_fully_shard/`` (none imports TorchTitan). Listed from the
bottom up: a file imports only files above it, never one below (no import circle, not even
for annotations).

* ``param_layout.py``: each dedicated matrix's frozen ``ParamLayout`` (the only reader of
  DTensor placements, as ``FSDPParam`` owns how a parameter is sharded, saved and loaded):
  the layouts ``dedicate_params`` accepts, the checkpoint views and piece shards, the full
  value, the tensor-parallel Newton-Schulz method;
* ``comm.py``: the collectives, counted;
* ``fsdp.py``: what the engine reads from and resets in FSDP2's state, and the
  ``fully_shard`` patch, in force while a model is dedicated;
* ``plan.py``: which parameters Muon takes, the hook boundaries, owners (LPT), the plan
  and its balance (pure: no collectives);
* ``unit.py``: a unit's flat buffer, its gradients and reduce buckets;
* ``exchange.py``: the engine's process groups and the collectives over them (HSDP's second
  stage, the tensor-parallel Newton-Schulz);
* ``hooks.py``: the forward/backward hooks and the per-pass state;
* ``dedication.py``: the runtime that composes them (``Dedication``, its
  ``DedicationSettings``, DDP-style sync of the other parameters, the balance report and
  the NS workload);
* ``meta_init.py``: a meta model materialized and initialized at the size of its plan
  (a rank allocates only the dedicated matrices it holds);
* ``report.py``: what a dedication costs each data-parallel rank, counted from its plan and
  FSDP2's groups before any step (the plan report);
* ``verification.py``: the cross-rank verdicts (what each rank dedicates, the plan);
* ``owned.py``: ``OwnedMatrices``, what ``Muon`` steps on a dedicated model (the owners'
  matrices, every failure agreed by all ranks, the gather the Newton-Schulz choice agrees
  through);
* ``grad_norm.py``: gradient clipping over dedicated and FSDP parameters;
* ``api.py``: ``dedicate_params``, the readers around it and pipeline stages
  (``attach_pipeline_stage``).
"""

from torchtitan_dmuon.engine.api import (
    attach_pipeline_stage,
    dedicate_params,
    get_full_param,
    reset_iter_state,
    set_requires_gradient_sync,
)
from torchtitan_dmuon.engine.dedication import Dedication, DedicationSettings, get_dedication
from torchtitan_dmuon.engine.grad_norm import clip_grad_norm_
from torchtitan_dmuon.engine.hooks import PassDivergedError
from torchtitan_dmuon.engine.meta_init import materialize
from torchtitan_dmuon.engine.verification import verify_plan

__all__ = [
    "Dedication",
    "DedicationSettings",
    "PassDivergedError",
    "attach_pipeline_stage",
    "clip_grad_norm_",
    "dedicate_params",
    "get_dedication",
    "get_full_param",
    "materialize",
    "reset_iter_state",
    "set_requires_gradient_sync",
    "verify_plan",
]
