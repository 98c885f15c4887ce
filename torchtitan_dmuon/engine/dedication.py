"""``Dedication``: the ownership plan of one model and the runtime that carries it out.

It composes the layers: the :class:`~torchtitan_dmuon.engine.plan.Plan` (who owns what),
one :class:`~torchtitan_dmuon.engine.unit.Unit` per (boundary, owner slot) (storage and
gradients), the :class:`~torchtitan_dmuon.engine.hooks.HookDriver` (the per-pass state),
the :class:`~torchtitan_dmuon.engine.exchange.Exchange` (the engine's own process groups and
the collectives over them) and the :class:`~torchtitan_dmuon.engine.others.OtherParams`
(what no ``fully_shard`` covers, kept in sync DDP-style). The step protocol around it is
``engine/owned.py``'s (``OwnedMatrices``, which reads :meth:`owned_grads`); the
checkpoint's geometry of split stacks is ``engine/checkpoint_geometry.py``'s; starting at
the plan's size is ``engine/meta_init.py``'s. Its :class:`DedicationSettings` are given
once at ``dedicate_params`` and frozen.

"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from torchtitan_dmuon.engine import comm, fsdp
from torchtitan_dmuon.engine.boundary import BoundaryState
from torchtitan_dmuon.engine.exchange import Exchange
from torchtitan_dmuon.engine.hooks import HookDriver
from torchtitan_dmuon.engine.others import OtherParams
from torchtitan_dmuon.engine.param_layout import (
    ParamLayout,
)
from torchtitan_dmuon.engine.plan import (
    DedicatedParam,
    Plan,
    UnitPlan,
)
from torchtitan_dmuon.engine.reduce import BackwardReduce
from torchtitan_dmuon.engine.unit import Unit, bind_boundary, held_bytes

__all__ = [
    "Dedication",
    "DedicationSettings",
    "dedication_of",
    "get_dedication",
    "piece_key",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DedicationSettings:
    """How the engine moves the dedicated matrices of one model; frozen: runtime switches
    go through :class:`~torchtitan_dmuon.engine.dedication.Dedication`'s setters.

    Attributes:
        reshard_after_forward: True (Z3): ranks outside a matrix's owner column free it
            after forward and receive it again before backward. False (Z2): they keep it
            until after backward, saving one broadcast per boundary per step.
        replicate_async: HSDP only: broadcast the primaries' new values to the other
            replicas asynchronously after the step; each unit's broadcast is waited on
            right before the unit is next read.
        gradient_divide_factor: Reduced gradients are divided by this. None: the number
            of data-parallel ranks (the mean); 1.0 keeps the sum, for a loss already
            normalized over the global batch (TorchTitan's).
        owner_group_size: Ranks that own each dense plain matrix together, in blocks
            (see :class:`~torchtitan_dmuon.engine.plan.Plan`); 1: one owner per matrix;
            None: chosen by the planner (:func:`~torchtitan_dmuon.engine.plan.plan_with_groups`).
    """

    reshard_after_forward: bool = True
    replicate_async: bool = False
    gradient_divide_factor: float | None = None
    owner_group_size: int | None = None

    def __post_init__(self) -> None:
        if self.owner_group_size is not None and (
            isinstance(self.owner_group_size, bool)
            or not isinstance(self.owner_group_size, int)
            or self.owner_group_size < 1
        ):
            raise ValueError(
                f"owner_group_size must be an integer >= 1 or None (chosen by the planner), "
                f"got {self.owner_group_size!r}"
            )
        if self.gradient_divide_factor is not None and self.gradient_divide_factor <= 0:
            raise ValueError(
                f"gradient_divide_factor must be > 0, got {self.gradient_divide_factor}"
            )

    def divide_factor(self, ranks: int) -> float:
        return self.gradient_divide_factor if self.gradient_divide_factor else ranks


_DEDICATIONS: weakref.WeakKeyDictionary[nn.Module, weakref.ref[Dedication]] = (
    weakref.WeakKeyDictionary()
)
# A weak value too: the dedication refers to its model, so a strong one would keep every
# dedicated model alive. The model's hooks keep its dedication alive.


def get_dedication(model: nn.Module) -> Dedication | None:
    """The :class:`Dedication` that ``dedicate_params`` attached to ``model``, if any."""
    ref = _DEDICATIONS.get(model)
    return ref() if ref is not None else None


def dedication_of(model: nn.Module) -> Dedication:
    """``model``'s :class:`Dedication`; a ValueError where it has none."""
    dedication = get_dedication(model)
    if dedication is None:
        raise ValueError("model was not prepared by dedicate_params")
    return dedication


def piece_key(d: DedicatedParam) -> tuple:
    """What tells one matrix or piece of a dedicated parameter from the others."""
    return d.name, d.layout.experts, d.layout.block


class Dedication:
    """The ownership plan of one model and the state that carries it out.

    Built by :func:`~torchtitan_dmuon.engine.api.dedicate_params`.

    Attributes:
        plan: Boundaries, units and owners (pure).
        settings: Z2/Z3, async replicas, gradient division.
        units: This rank's runtime units, in boundary order.
        exchange: The engine's process groups and the collectives over them.
        shard_rank / shard_size: This rank's place in the (dense) shard group.
        replicate_rank / replicate_size: Its place in the replicate group (HSDP).
        stats: Bytes and calls of the engine's collectives on this rank.
        requires_gradient_sync: False skips the reduces (gradient accumulation).
        reshard_after_backward: False keeps the gathered values after a backward without
            sync, until the reduce (a pipeline stage's micro-batches: one gather per
            step under Z2).
        pipeline_stage: The index of the pipeline stage that drives it, if any.
        synced_backwards: Backwards that reduced gradients since the last step.
        slot_ranks: The global rank of each owner slot (set by ``verify_plan``).
        expert_owner_ranks: Under expert parallelism, the global rank of each experts'
            owner, by ``(ep rank, experts' slot, etp rank)`` (set by ``verify_plan``).
    """

    def __init__(
        self,
        model: nn.Module,
        plan: Plan,
        settings: DedicationSettings,
        mesh: DeviceMesh,
        replicate_mesh: DeviceMesh | None,
        tp_mesh: DeviceMesh | None = None,
        expert_mesh: DeviceMesh | None = None,
    ) -> None:
        self.model = model
        self.plan = plan
        self.settings = settings
        self.mesh = mesh
        self.stats = comm.CommStats()
        expert_mesh = expert_mesh if plan.expert_parallel else None
        self.exchange = Exchange(
            mesh, replicate_mesh, tp_mesh, expert_mesh, self.stats, plan.group_size
        )
        dense = self.exchange.domains[0]  # where this rank sits: its column, its replica
        self.shard_rank, self.shard_size = dense.rank, dense.size
        self.replicate_rank = replicate_mesh.get_local_rank() if replicate_mesh is not None else 0
        self.replicate_size = replicate_mesh.size() if replicate_mesh is not None else 1
        self.boundary_units: list[list[Unit]] = [
            [self._unit(u) for u in b.units] for b in plan.boundaries
        ]
        self.units: list[Unit] = [u for units in self.boundary_units for u in units]
        self.others: OtherParams | None = None
        self.set_pipeline_stage(None)
        self.slot_ranks: list[int] | None = None
        self.expert_owner_ranks: dict[tuple[int, int, int], int] | None = None
        self.initialized = False
        # Between ``materialize.to_empty`` and the end of ``materialize.initializing``:
        # (device, the unheld matrices left on the meta device, by name).
        self.awaiting_init: tuple[torch.device, dict[str, nn.Parameter]] | None = None
        # Started at the plan's size: the values of this rank's pieces of split parameters
        # (stacks, owner groups' matrices), which are not allocated whole, until binding.
        self.start_pieces: dict[tuple, torch.Tensor] = {}
        self._on_remove: list = []
        self._phase_group: dist.ProcessGroup | None = None
        fsdp.mark_dedicated(model, [d.name for d in plan.params])
        pairs = enumerate(zip(plan.boundaries, self.boundary_units, strict=True))
        states = [
            BoundaryState(b, boundary, units, self.exchange) for b, (boundary, units) in pairs
        ]
        self.driver = HookDriver(self, states, self._backward_reduce)
        self.driver.register(model)
        self.bind_params()
        _DEDICATIONS[model] = weakref.ref(self)

    def _unit(self, plan: UnitPlan) -> Unit:
        holds = plan.column == self.exchange.domains[plan.domain].rank
        primary = holds and plan.primary_replica == self.replicate_rank
        return Unit(plan, holds=holds, primary=primary)

    def set_replicate_async(self, enabled: bool) -> None:
        """Switch HSDP's asynchronous replicate broadcast on or off (every rank alike);
        the broadcasts in flight land first."""
        if enabled and self.exchange.replicas is None:
            raise ValueError("replicate_async=True needs dedicate_params(..., replicate_mesh=...)")
        self.wait_replicas()
        self.settings = dataclasses.replace(self.settings, replicate_async=enabled)

    def set_requires_gradient_sync(self, enabled: bool) -> None:
        """Reduce the gradients at the end of each backward, or let them accumulate."""
        self.requires_gradient_sync = enabled

    def set_pipeline_stage(self, stage_index: int | None) -> None:
        """Driven by pipeline stage ``stage_index`` (None: by each backward), which reduces
        after its last backward of the step and keeps the values over its micro-batches."""
        self.pipeline_stage: int | None = stage_index
        self.requires_gradient_sync = self.reshard_after_backward = stage_index is None

    @property
    def params(self) -> list[nn.Parameter]:
        """The dedicated parameters, each once."""
        return [p for b in self.plan.boundaries for p in b.parameters]

    # ---- binding -----------------------------------------------------------------------
    def bind_params(self) -> None:
        """Point the plan at the model's current parameter objects, found by name
        (``Module.to_empty`` registers new ones), and hook each new one."""
        for d in self.plan.params:
            d.param = self.model.get_parameter(d.name)
        self._layouts = {id(d.param): d.layout for d in self.plan.params}
        self.driver.bind_params()

    def _start_value(self, d: DedicatedParam) -> torch.Tensor:
        kept = self.start_pieces.pop(piece_key(d), None)
        return kept if kept is not None else d.layout.value(d.param)

    def lazy_init(self) -> None:
        """Bind each unit's parameters to one flat buffer, at the first forward.

        Lazily, so that meta-device initialization (``to_empty`` then ``init_weights``),
        checkpoint loading and ``fully_shard`` can all happen in between. The column's
        values win (the primary's, under HSDP).
        """
        if self.initialized:
            return
        if self.awaiting_init is not None:
            raise RuntimeError(
                "the dedicated model was materialized by torchtitan_dmuon's to_empty but not "
                "initialized: run its initialization inside initializing(model) first"
            )
        self.bind_params()
        for boundary, units in zip(self.plan.boundaries, self.boundary_units, strict=True):
            dtypes = fsdp.mixed_precision_of(self.model, boundary.name)
            bind_boundary(units, *dtypes, self._start_value)
        for line in self.plan.summary(held_bytes(self.plan, self.boundary_units)):
            logger.info(line)
        names = {d.name for d in self.plan.params}
        self.others = OtherParams(
            self.model,
            names,
            self.exchange.others_groups,
            lambda: self.requires_gradient_sync,
            self.stats,
            self.shard_size * self.replicate_size,
            [boundary.name for boundary in self.plan.boundaries],
        )
        self.others.broadcast_from_rank0(self.model)
        if self.exchange.replicas is not None:
            self.exchange.replicas.broadcast(self.units, async_op=False)
        self.initialized = True

    # ---- what the hooks call -----------------------------------------------------------------
    def _backward_reduce(self) -> BackwardReduce:
        """A backward's reduce, with the divisor in force (``set_gradient_divide_factor``,
        else the data-parallel size) and the DDP-style parameters."""
        divide = self.settings.divide_factor(self.shard_size * self.replicate_size)
        return BackwardReduce(self.exchange, divide, self.others)

    @property
    def synced_backwards(self) -> int:
        """Backwards that reduced gradients since the last step."""
        return self.driver.synced_backwards

    @synced_backwards.setter
    def synced_backwards(self, count: int) -> None:
        self.driver.synced_backwards = count

    @torch.no_grad()
    def divide_owned_grads(self, factor: float) -> None:
        """Divide the reduced gradients this rank holds (a schedule's gradient scaling,
        which ``p.grad`` alone would not reach)."""
        for unit in self.units:
            if unit.grad is not None:
                unit.grad.div_(factor)

    # ---- step protocol -------------------------------------------------------------------------
    def owned_grads(self) -> list[tuple[nn.Parameter, torch.Tensor, torch.Tensor, torch.Tensor]]:
        """``(param, master, grad, has_grad)`` of each matrix whose reduced gradient this
        rank holds (it is the primary owner): the optimizer updates ``master`` (the
        parameter itself, or its full-precision copy under mixed precision) and keys its
        state by ``param``. ``has_grad``, a 0-dim bool device tensor, says whether any rank
        touched the matrix since ``zero_grad`` (else ``grad`` is zeros): decided on the
        device by the step, which leaves such a matrix as it is; no host sync."""
        return [
            (d.param, u.master_view(d), u.grad_view(d), flag)
            for u in self.units
            if u.primary and u.grads_held() is not None
            for d, flag in zip(u.params, u.grads_held(), strict=True)
        ]

    def phase_group(self) -> dist.ProcessGroup | None:
        """The group whose members run a step's second phase's collectives together (an
        owner group's members, else the tensor-parallel ranks; None without either), able
        to all-reduce host memory: one without a CPU backend (NCCL alone) is joined by a
        gloo one over the same ranks, at most a node's. Its members agree there, on the
        host, whether one of them failed before that phase. Created at the first call, a
        collective of every rank of the dedication (``Muon``'s constructor)."""
        if self._phase_group is None:
            exchange = self.exchange
            if exchange.owner_group is not None:
                group = exchange.owner_group.group
            else:
                group = exchange.tp_group
            if group is None or comm.host_device(group) is not None or comm.is_fake(group):
                self._phase_group = group
            else:
                desc = f"{group.group_desc}_host"
                self._phase_group = comm.engine_group(
                    group, desc, torch.device("cpu"), backend="gloo"
                )
        return self._phase_group

    def primary_params(self) -> list[tuple[DedicatedParam, torch.Tensor]]:
        """``(entry, master)`` of every matrix and piece this rank is the primary owner
        of: what a checkpoint saves from this rank (and loads into it). A rank owns at
        most one piece of each stack."""
        return [(d, u.master_view(d)) for u in self.units if u.primary for d in u.params]

    def zero_grad(self) -> None:
        """Drop the reduced gradients; after a pass that raised half-way, first recover
        (:meth:`recover`), so that a loop catching the error needs no other call."""
        if self.driver.pass_unfinished():
            self.recover()
        for unit in self.units:
            unit.zero_grad()

    def recover(self) -> None:
        """Discard what a failed forward or backward left: the engine's per-pass state
        and FSDP2's (whose next backward would otherwise add to gradients it kept)."""
        self.driver.reset_iter_state()
        fsdp.reset_fsdp_state(self.model)

    @torch.no_grad()
    def refresh_from_masters(self) -> None:
        """After the primaries' masters were overwritten (a checkpoint load): recompute the
        compute-dtype values and, under HSDP, send them to the other replicas."""
        if not self.initialized:
            return
        self.driver.free_all()
        for unit in self.units:
            unit.masters_to_flat()
        if self.exchange.replicas is not None:
            self.exchange.replicas.wait_all()
            self.exchange.replicas.broadcast(self.units, async_op=False)

    def wait_replicas(self) -> None:
        """Wait for every in-flight replicate broadcast: call before reading dedicated
        values outside forward and before the process groups are destroyed."""
        self.exchange.wait_replicas()

    # ---- layouts and reports -----------------------------------------------------------------
    def layout_of(self, param: nn.Parameter) -> ParamLayout | None:
        """The layout of a dedicated parameter (of its pieces: they share the split dim
        and the per-TP-rank-ness), else None."""
        return self._layouts.get(id(param))

    def on_remove(self, undo) -> None:
        """Call ``undo()`` in :meth:`remove` (what attached to the dedication from outside,
        such as a pipeline stage's methods, goes with it)."""
        self._on_remove.append(undo)

    def remove(self) -> None:
        """Undo :func:`dedicate_params`: the hooks, marks and a pipeline stage's methods go
        (the values stay where they are); the engine's process groups are kept for the
        next dedication over the same ranks (see :func:`comm.retire_groups`)."""
        self.wait_replicas()
        while self._on_remove:
            self._on_remove.pop()()
        self.driver.remove()
        if self.others is not None:
            self.others.remove()
        _DEDICATIONS.pop(self.model, None)
        fsdp.unmark_dedicated(self.model)
        groups = self.exchange.process_groups()
        groups += [g for g in [self._phase_group] if g is not None and g not in groups]
        comm.retire_groups(groups)
