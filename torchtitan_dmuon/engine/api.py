"""The engine's public functions: ``dedicate_params``, the readers around it and
``attach_pipeline_stage``.

``dedicate_params`` gives each selected matrix parameter one owner rank. The owner keeps
the full parameter and (through the optimizer) its momentum, receives the SUM-reduced
gradient, orthogonalizes it alone and updates the parameter in place; the other ranks
receive the value by broadcast right before they need it and free it again.

Three decisions are kept apart: WHO owns a matrix (one global LPT partition over the NS
cost, over all R x G ranks under HSDP: ``plan.py``), WHERE the hooks attach (the hook
*boundary* module; all its matrices with the same owner form one *unit*, moved by one
collective: ``unit.py``, ``hooks.py``) and WHETHER a rank steps a matrix (only the primary
owner holds its reduced gradient: ``Dedication.owned_grads``).

Pipeline stages (``torch.distributed.pipelining``) over dedicated model parts: a pipeline
schedule runs many forwards and backwards of one stage per step, interleaved with other
stages' and, in zero-bubble schedules, with each backward split into an input pass and a
weight pass (``torch.autograd.grad``, which fires no post-accumulate-grad hook
and accumulates ``p.grad`` by hand). FSDP2 follows it through the stage: no gradient sync
and no resharding after the micro-batch backwards, one reduce after the last. The stage
knows nothing of the engine, so :func:`attach_pipeline_stage` gives the stage the same
protocol for its dedicated part: its backwards (the micro-batches', and the forward and
backward the stage runs at its first step to infer shapes) run without sync and keep the
gathered values (one gather per step under Z2); the backward the schedule marks as the
stage's last of the step reduces the accumulated gradients to their owners once and frees
the values; the schedule's gradient scaling reaches the owners' reduced gradients too.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining.stage import _PipelineStageBase

from torchtitan_dmuon.engine import comm
from torchtitan_dmuon.engine.checkpoint_geometry import register_state_dict_hooks
from torchtitan_dmuon.engine.comm import all_gather_rows, mesh_device
from torchtitan_dmuon.engine.dedication import (
    Dedication,
    DedicationSettings,
    dedication_of,
    get_dedication,
)
from torchtitan_dmuon.engine.fsdp import reset_fsdp_state
from torchtitan_dmuon.engine.param_layout import (
    check_orthogonal,
    expert_domain_mesh,
    model_tensor_parallel_mesh,
    tensor_parallel_mesh,
    validate_meshes,
)
from torchtitan_dmuon.engine.plan import (
    BoundaryPredicate,
    Predicate,
    build_plan,
    plan_with_groups,
    select_matrices,
)
from torchtitan_dmuon.engine.verification import (
    Intent,
    agree_on_intent,
    selection_hash,
)

__all__ = [
    "attach_pipeline_stage",
    "dedicate_params",
    "get_full_param",
    "reset_iter_state",
    "set_requires_gradient_sync",
]

logger = logging.getLogger(__name__)


@torch.no_grad()
def get_full_param(model: nn.Module, name: str) -> torch.Tensor:
    """The current full value of dedicated parameter ``name`` on every rank, in the master
    precision, for evaluation, export and tests. A collective: every rank must call it, in
    the same order."""
    dedication = dedication_of(model)
    found = [(u, d) for u in dedication.units for d in u.params if d.name == name]
    # A split stack's pieces, an owner group's blocks: in order.
    found.sort(
        key=lambda entry: (entry[1].layout.experts or (0, 0), entry[1].layout.block or (0, 0))
    )
    if not found:
        raise KeyError(f"{name!r} is not a dedicated parameter")
    # Before the first forward only the owner column has the values.
    dedication.lazy_init()
    # A split stack: its pieces in expert order, each from its owner (the same order
    # on every rank, so the broadcasts match).
    pieces = [_read_entry(dedication, unit, d) for unit, d in found]
    value = pieces[0] if len(pieces) == 1 else torch.cat(pieces, found[0][1].layout.block_dim or 0)
    return found[0][1].layout.all_experts(value, found[0][1].param)


def _read_entry(dedication: Dedication, unit, d) -> torch.Tensor:
    """The current value of one matrix or piece, on every rank."""
    if unit.primary:
        value = unit.master_view(d).clone()
    else:
        value = torch.empty(d.layout.local_shape, dtype=unit.master_dtype, device=unit.device)
    exchange = dedication.exchange
    if exchange.replicas is not None and unit.holds:
        exchange.replicas.wait(unit)
        group = exchange.replicas.group
        comm.broadcast(value, unit.primary_replica, group, dedication.stats, "read").wait()
    shard_group = exchange.domain_of(unit).shard_group
    comm.broadcast(value, unit.column, shard_group, dedication.stats, "read").wait()
    # Looked up when called: without tensor parallelism there is no TensorParallelNS.
    return d.layout.unsplit(value, lambda shard: exchange.tensor_parallel.gather_shards(shard))


def set_requires_gradient_sync(model: nn.Module, requires_gradient_sync: bool) -> None:
    """Turn gradient reduction on or off for the dedicated parameters and, like
    ``FSDPModule.set_requires_gradient_sync``, for every FSDP module in ``model``.

    Use it for gradient accumulation without a reduce per micro-batch: off for all but
    the last micro-batch. Every rank must set the same value.
    """
    dedication = get_dedication(model)
    if dedication is not None:
        dedication.set_requires_gradient_sync(requires_gradient_sync)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_requires_gradient_sync(requires_gradient_sync, recurse=False)


def reset_iter_state(model: nn.Module) -> None:
    """Recover from a forward or backward that raised half-way, as
    ``FSDPModule.reset_iter_state`` does for FSDP2; the failed pass's gradients are lost.

    Rarely needed: ``Muon.zero_grad()`` (and the next root forward, for the engine's own
    state) does it after a failed pass. For a loop that clears gradients another way,
    call it on every rank after catching the exception.

    Raises:
        PassDivergedError: The pass did not raise on every data-parallel rank at the same
            point (raised within the process group's timeout, on every rank involved).
    """
    dedication = get_dedication(model)
    if dedication is not None:
        dedication.recover()
    else:
        reset_fsdp_state(model)


@torch.no_grad()
def dedicate_params(
    model: nn.Module,
    mesh: DeviceMesh,
    predicate: Predicate,
    *,
    replicate_mesh: DeviceMesh | None = None,
    hook_boundary_predicate: BoundaryPredicate | None = None,
    reshard_after_forward: bool = True,
    replicate_async: bool = False,
    gradient_divide_factor: float | None = None,
    expert_mesh: DeviceMesh | None = None,
    owner_group_size: int | None = None,
) -> Dedication:
    """Give every matrix parameter selected by ``predicate`` one owner rank.

    Call it on every rank, before ``fully_shard``; ``fully_shard`` then skips the dedicated
    parameters. Build :class:`torchtitan_dmuon.Muon` on the same model afterwards.

    Args:
        model: The model (not yet sharded).
        mesh: 1-D shard mesh (FSDP2's mesh, or the DDP group); with ``replicate_mesh``, the
            shard dimension of the HSDP mesh.
        predicate: ``predicate(name, param)`` selects the matrices to dedicate.
        replicate_mesh: HSDP replicate dimension (``hsdp["replicate"]``): owners are spread
            over all R x G ranks and gradients are reduced in two stages.
        hook_boundary_predicate: ``pred(module_name, module)`` picks the modules whose hooks
            move the dedicated parameters under them (innermost match wins). Default: the
            modules held in an ``nn.ModuleList``/``nn.ModuleDict`` (transformer blocks),
            else the root.
        reshard_after_forward: True (Z3) or False (Z2); see :class:`DedicationSettings`.
        replicate_async: HSDP: hide the replicate broadcast behind the next forward
            (``Muon(replicate_async=True)`` switches it on too, through
            ``Dedication.set_replicate_async``).
        gradient_divide_factor: See :class:`DedicationSettings`.
        expert_mesh: Under expert parallelism, the 1-D mesh of the ranks that hold the
            same experts (TorchTitan's ``efsdp``; ``mesh`` is it times the ``ep`` mesh).
            The selected stacks sharded along dim 0 over the ``ep`` mesh are dedicated
            over it (and ``replicate_mesh``), their gradients reduced over it only.
            Stacks split over the tensor-parallel ranks alone (TorchTitan's TP of
            routed experts without expert parallelism) default it to ``mesh``.
        owner_group_size: Ranks that own each plain dense matrix together, each a block
            of it along its long side, running its Newton-Schulz together (it must divide
            the shard size); 1: one owner per matrix; None (the default): the size whose
            busiest rank spends the least modeled time on Newton-Schulz on an H100
            (``plan.plan_with_groups``): 1 wherever one owner per matrix is balanced or
            the matrices are too small for a group to pay, and under tensor parallelism.

    Returns:
        The :class:`Dedication` (also reachable through :func:`get_dedication`).

    Raises:
        ValueError / TypeError / RuntimeError: bad input, before any collective of the
            engine. What depends on each rank's selection (the predicate, the tensor- and
            expert-parallel layouts) is judged on every rank alike after one small
            all-gather over the given meshes' groups, so a rank-dependent predicate or
            layout raises the same error everywhere instead of hanging.
    """
    validate_meshes(mesh, replicate_mesh, expert_mesh)
    if any(isinstance(m, FSDPModule) for m in model.modules()):
        raise RuntimeError(
            "dedicate_params must be called before fully_shard: the model already has "
            "FSDP-wrapped modules"
        )
    if get_dedication(model) is not None:
        raise RuntimeError("dedicate_params was already applied to this model")
    if replicate_async and replicate_mesh is None:
        raise ValueError("replicate_async=True needs replicate_mesh (HSDP)")
    settings = DedicationSettings(
        reshard_after_forward, replicate_async, gradient_divide_factor, owner_group_size
    )
    if owner_group_size is not None and mesh.size() % owner_group_size != 0:
        raise ValueError(
            f"owner_group_size {owner_group_size} does not divide the shard mesh's "
            f"{mesh.size()} ranks"
        )
    # The checks that depend on what this rank selected: their verdict is agreed with every
    # rank of the dedication before anything rank-dependent runs (engine/verification.py).
    selected, tp_mesh, error = [], None, None
    try:
        selected = select_matrices(model, predicate)
        if not selected:
            raise ValueError("predicate selected no trainable 2-D or 3-D parameter")
        tp_mesh = tensor_parallel_mesh(selected)
        check_orthogonal(mesh, tp_mesh)
        if tp_mesh is not None and (owner_group_size or 1) > 1:
            raise ValueError(
                f"owner_group_size {owner_group_size}: owner groups take plain matrices; "
                "under tensor parallelism the TP ranks already share each matrix"
            )
        expert_mesh = expert_domain_mesh(selected, mesh, expert_mesh, tp_mesh)
    except (ValueError, TypeError) as e:
        error = str(e)
    groups = (replicate_mesh is not None, tp_mesh is not None, expert_mesh is not None)
    intent = Intent(
        names=tuple(name for name, _ in selected),
        selection=selection_hash(selected),
        settings=dataclasses.astuple(settings),
        groups=groups if error is None else (),
        error=error,
    )
    # Over the model's TP mesh, which does not depend on the selection.
    agree_on_intent(intent, mesh, replicate_mesh, model_tensor_parallel_mesh(model))
    expert_columns = None
    if expert_mesh is not None:
        # Which experts' column each shard-group rank is (the two domains are balanced
        # together): the one collective of planning, after every check.
        device = mesh_device(mesh)
        rows = all_gather_rows([expert_mesh.get_local_rank()], mesh.get_group(), device)
        expert_columns = [row[0] for row in rows]
    build = functools.partial(
        build_plan,
        model,
        selected,
        shard_size=mesh.size(),
        replicate_size=replicate_mesh.size() if replicate_mesh is not None else 1,
        hook_boundary_predicate=hook_boundary_predicate,
        expert_shard_size=expert_mesh.size() if expert_columns is not None else None,
        expert_columns=expert_columns,
    )
    if owner_group_size is None and tp_mesh is None:
        plan = plan_with_groups(lambda size: build(group_size=size), mesh.size())
    else:
        plan = build(group_size=owner_group_size or 1)
    dedication = Dedication(model, plan, settings, mesh, replicate_mesh, tp_mesh, expert_mesh)
    handles = register_state_dict_hooks(dedication)
    dedication.on_remove(lambda: [handle.remove() for handle in handles])
    logger.info(
        "dedicate_params: %d parameters (%d matrices), %d boundaries, %d units over "
        "%d x %d ranks, NS balance %.3f, %s, owner groups of %d",
        len(dedication.params),
        # Every ep rank's experts, as without expert parallelism.
        sum(d.layout.matrices for d in plan.params),
        len(plan.boundaries),
        len(plan.units),
        plan.replicate_size,
        plan.shard_size,
        plan.balance(),
        "Z3" if reshard_after_forward else "Z2",
        plan.group_size,
    )
    return dedication


def attach_pipeline_stage(stage: _PipelineStageBase) -> None:
    """Make ``stage`` drive the dedication of its module (``stage.submod``).

    Call it on every rank, once per stage, after ``dedicate_params`` (and ``fully_shard``)
    on the stage's module and before the schedule's first step. A stage whose module holds
    no selected matrix needs no call (it has no dedication: plain FSDP2 and AdamW).

    Raises:
        TypeError: ``stage`` is not a pipeline stage.
        ValueError: the stage's module has no dedication.
        RuntimeError: the stage was attached already.
    """
    if not isinstance(stage, _PipelineStageBase):
        raise TypeError(f"stage must be a pipeline stage, got {type(stage).__name__}")
    dedication = get_dedication(stage.submod)
    if dedication is None:
        raise ValueError(
            f"stage: pipeline stage {stage.stage_index}'s module has no dedication; call "
            "dedicate_params on it (before fully_shard) first, or leave a stage without "
            "selected matrices unattached"
        )
    if dedication.pipeline_stage is not None:
        raise RuntimeError(f"pipeline stage {stage.stage_index} is already attached to DMuon")
    backward = stage.backward_maybe_with_nosync
    scale_grads = stage.scale_grads
    # The stage decides when gradients are reduced, not the end of each backward.
    dedication.set_pipeline_stage(stage.stage_index)

    def backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward=False):
        result = backward(backward_type, bwd_kwargs, last_backward=last_backward)
        if last_backward:
            # Every schedule marks the stage's last full or weight backward of the step:
            # the gradients of all its micro-batches are in p.grad now; reduce them to
            # their owners, as the end of a synced backward would (every DP rank does).
            dedication.driver.reduce_accumulated()
        return result

    def scale(grad_scale_factor: int) -> None:
        scale_grads(grad_scale_factor)  # p.grad: FSDP's and the other parameters'
        if grad_scale_factor != 1:
            dedication.divide_owned_grads(grad_scale_factor)

    stage.backward_maybe_with_nosync = backward_maybe_with_nosync
    stage.scale_grads = scale

    def detach() -> None:
        # The instance attributes shadow the class's methods: deleting them restores those.
        del stage.backward_maybe_with_nosync, stage.scale_grads
        dedication.set_pipeline_stage(None)

    dedication.on_remove(detach)
