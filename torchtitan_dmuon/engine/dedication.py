"""``Dedication``: the ownership plan of one model and the runtime that carries it out.

It composes the layers: the :class:`~torchtitan_dmuon.engine.plan.Plan` (who owns what),
one :class:`~torchtitan_dmuon.engine.unit.Unit` per (boundary, owner slot) (storage and
gradients), the :class:`~torchtitan_dmuon.engine.hooks.HookDriver` (the per-pass state),
:class:`~torchtitan_dmuon.engine.replicas.Replicas` (HSDP's second stage) and
:class:`~torchtitan_dmuon.engine.others.OtherParams` (DDP-style sync of what no FSDP module
covers), on process groups of the engine's own. The optimizer talks to it through the step
protocol: :meth:`owned_grads`, :meth:`before_step`, :meth:`after_step`, :meth:`zero_grad`.
"""

from __future__ import annotations

import dataclasses
import logging
import weakref

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.profiler import record_function

from torchtitan_dmuon.engine import comm, patches
from torchtitan_dmuon.engine.comm import PendingReduce, ShardGroups
from torchtitan_dmuon.engine.geometry import log_balance
from torchtitan_dmuon.engine.hooks import HookDriver
from torchtitan_dmuon.engine.others import OtherParams
from torchtitan_dmuon.engine.plan import (
    DedicatedParam,
    Plan,
    UnitPlan,
    expert_parallel_coordinates,
    is_expert_parallel,
)
from torchtitan_dmuon.engine.recovery import reset_fsdp_state
from torchtitan_dmuon.engine.replicas import Replicas
from torchtitan_dmuon.engine.settings import DedicationSettings
from torchtitan_dmuon.engine.tensor_parallel import TensorParallelNS
from torchtitan_dmuon.engine.unit import RefilledParam, Unit, refills
from torchtitan_dmuon.optim.newton_schulz import matrix_count
from torchtitan_dmuon.optim.sharded_ns import sharded_ns_method

__all__ = ["Dedication", "get_dedication"]

logger = logging.getLogger(__name__)

_DEDICATIONS: weakref.WeakKeyDictionary[nn.Module, Dedication] = weakref.WeakKeyDictionary()


def get_dedication(model: nn.Module) -> Dedication | None:
    """The :class:`Dedication` that ``dedicate_params`` attached to ``model``, if any."""
    return _DEDICATIONS.get(model)


class Dedication:
    """The ownership plan of one model and the state that carries it out.

    Built by :func:`~torchtitan_dmuon.engine.api.dedicate_params`.

    Attributes:
        plan: Boundaries, units and owners (pure).
        settings: Z2/Z3, async replicas, gradient division.
        units: This rank's runtime units, in boundary order.
        shard_rank / shard_size: This rank's place in the shard group.
        replicas: HSDP's replicate layer, or None.
        stats: Bytes and calls of the engine's collectives on this rank.
        requires_gradient_sync: False skips the reduces (gradient accumulation).
        reshard_after_backward: False keeps the gathered values after a backward without
            sync, until the reduce (a pipeline stage's micro-batches: one gather per
            step under Z2).
        pipeline_stage: The index of the pipeline stage that drives it, if any.
        synced_backwards: Backwards that reduced gradients since the last step.
        slot_ranks: The global rank of each owner slot (set by ``verify_plan``).
        domains: The shard groups of the dense domain and, under expert parallelism,
            of the experts' (``shard_group``/``reduce_group``/``shard_rank``/
            ``shard_size`` are the dense domain's).
        ep_rank / ep_size / etp_rank / etp_size: Under expert parallelism, this rank's
            place in the mesh the expert stacks are sharded over (etp: 0 / 1 without
            expert tensor parallelism).
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
        replicate_rank = replicate_mesh.get_local_rank() if replicate_mesh is not None else 0
        self.replicate_rank = replicate_rank
        # Gathers and stage-1 reduces each run on a group of their own: in backward a
        # boundary's reduce starts when its gradients are complete, which rank-dependent
        # branches make differ between ranks, so on one group the two sequences could
        # interleave differently (a hang). Each sequence alone has a fixed order.
        self.domains = [ShardGroups(mesh, "")]
        self.shard_group = self.domains[0].shard_group
        self.reduce_group = self.domains[0].reduce_group
        self.shard_rank = self.domains[0].rank
        self.shard_size = self.domains[0].size
        self.replicas = None
        if replicate_mesh is not None:
            group = comm.engine_group(replicate_mesh.get_group(), "dmuon_replicate")
            self.replicas = Replicas(group, replicate_rank, replicate_mesh.size(), self.stats)
        # Expert parallelism: the experts' own shard mesh (efsdp), and where this rank
        # sits in the mesh the stacks are sharded over (which experts are its own).
        self.ep_rank, self.ep_size, self.etp_rank, self.etp_size = 0, 1, 0, 1
        if len(plan.domains) == 2:
            self.domains.append(ShardGroups(expert_mesh, "expert_"))
            stack = next(u.params[0].param for u in plan.units if u.domain == 1)
            coordinates = expert_parallel_coordinates(stack)
            self.ep_rank, self.ep_size, self.etp_rank, self.etp_size = coordinates
        self.boundary_units: list[list[Unit]] = [
            [self._unit(u) for u in b.units] for b in plan.boundaries
        ]
        self.units: list[Unit] = [u for units in self.boundary_units for u in units]
        # Tensor parallelism: the owner column's TP ranks orthogonalize together.
        self.tp_group = None
        self.tensor_parallel: TensorParallelNS | None = None
        if tp_mesh is not None:
            self.tp_group = comm.engine_group(tp_mesh.get_group(), "dmuon_tp")
            self.tensor_parallel = TensorParallelNS(self.tp_group, self.stats)
        self.others: OtherParams | None = None
        self.requires_gradient_sync = True
        self.reshard_after_backward = True
        self.pipeline_stage: int | None = None
        self.synced_backwards = 0
        self.slot_ranks: list[int] | None = None
        self.expert_owner_ranks: dict[tuple[int, int, int], int] | None = None
        self.initialized = False
        self._on_remove: list = []
        for d in plan.params:
            module_name, _, param_name = d.name.rpartition(".")
            patches.mark_dedicated(model.get_submodule(module_name), param_name)
        self.driver = HookDriver(self)
        self.driver.register(model)
        self.bind_params()
        _DEDICATIONS[model] = self

    def _unit(self, plan: UnitPlan) -> Unit:
        holds = plan.column == self.domains[plan.domain].rank
        primary = holds and plan.primary_replica == self.replicate_rank
        return Unit(plan, holds=holds, primary=primary)

    def domain_of(self, unit: Unit) -> ShardGroups:
        """The shard and reduce groups ``unit`` moves over."""
        return self.domains[unit.plan.domain]

    def set_replicate_async(self, enabled: bool) -> None:
        """Switch HSDP's asynchronous replicate broadcast on or off (every rank alike);
        the broadcasts in flight land first."""
        if enabled and self.replicas is None:
            raise ValueError("replicate_async=True needs dedicate_params(..., replicate_mesh=...)")
        self.wait_replicas()
        self.settings = dataclasses.replace(self.settings, replicate_async=enabled)

    @property
    def replicate_size(self) -> int:
        return self.replicas.size if self.replicas is not None else 1

    @property
    def params(self) -> list[nn.Parameter]:
        """The dedicated parameters, each once."""
        return [p for b in self.plan.boundaries for p in b.parameters]

    def process_groups(self) -> list[dist.ProcessGroup]:
        """The engine's own groups: shard (broadcasts), reduce (stage-1 reduces, the same
        ranks), under HSDP replicate, the experts' shard and reduce groups under expert
        parallelism, and the tensor-parallel group."""
        groups = [self.shard_group, self.reduce_group]
        groups += [self.replicas.group] if self.replicas is not None else []
        groups += [
            g for domain in self.domains[1:] for g in (domain.shard_group, domain.reduce_group)
        ]
        return groups + ([self.tp_group] if self.tp_group is not None else [])

    def data_parallel_groups(self) -> list[dist.ProcessGroup]:
        """Groups whose successive SUM all-reduces sum over every data-parallel rank: the
        reduce group, then the replicate group under HSDP (both idle outside backward)."""
        return [self.reduce_group] + ([self.replicas.group] if self.replicas is not None else [])

    # ---- binding -----------------------------------------------------------------------
    def bind_params(self) -> None:
        """Point the plan at the model's current parameter objects, found by name
        (``Module.to_empty`` registers new ones), and hook each new one."""
        for d in self.plan.params:
            d.param = self.model.get_parameter(d.name)
        self._split_dims = {id(d.param): d.split_dim for d in self.plan.params}
        self._per_tp_rank = {
            id(d.param)
            for d in self.plan.params
            if d.split_dim is not None or is_expert_parallel(d.param)
        }
        self.driver.bind_params()

    def lazy_init(self) -> None:
        """Bind each unit's parameters to one flat buffer, at the first forward.

        Lazily, so that meta-device initialization (``to_empty`` then ``init_weights``),
        checkpoint loading and ``fully_shard`` can all happen in between. The column's
        values win (the primary's, under HSDP).
        """
        if self.initialized:
            return
        self.bind_params()
        for boundary, units in zip(self.plan.boundaries, self.boundary_units, strict=True):
            param_dtype, reduce_dtype = _mixed_precision_of(self.model, boundary.name)
            for unit in units:
                unit.bind(param_dtype, reduce_dtype)
            # After the units read their values: storage of their own for split stacks
            # and tensor-parallel shards.
            own = {d.name: d.param for d in boundary.params if refills(d)}
            refilled = {
                name: RefilledParam(param, param_dtype or param.dtype)
                for name, param in own.items()
            }
            for unit in units:
                unit.refilled = {d.name: refilled[d.name] for d in unit.params if refills(d)}
        log_balance(self)
        names = {d.name for d in self.plan.params}
        self.others = OtherParams(self.model, names, self.data_parallel_groups())
        self.others.broadcast_from_rank0(self.model)
        if self.replicas is not None:
            self.replicas.broadcast(self.units, async_op=False)
        self.initialized = True

    # ---- what the hooks call -----------------------------------------------------------------
    def gather(self, unit: Unit) -> list[dist.Work]:
        """Materialize ``unit`` in this shard group: a broadcast of each of its buffers
        from its column, once the column has the latest values from the primary replica
        (:meth:`Unit.refill` follows once they land)."""
        if self.replicas is not None:
            self.replicas.wait(unit)
        unit.allocate()
        domain = self.domain_of(unit)
        return [
            comm.broadcast(
                buffer, unit.column, domain.shard_group, self.stats, domain.kind("broadcast")
            )
            for buffer in unit.buffers
        ]

    def replicas_landed(self, boundary: int) -> bool:
        return self.replicas is None or self.replicas.landed(self.boundary_units[boundary])

    def reduce_to_column(self, unit: Unit) -> PendingReduce:
        """Stage 1: pack the local gradients, free the values outside the column and SUM
        the bucket onto the unit's column inside its domain's shard group (an expert
        unit's: the ranks holding the same experts, which together saw every token
        routed to them)."""
        bucket = unit.pack_grads()
        unit.free()  # the caller drops the gradients
        domain = self.domain_of(unit)
        work = comm.reduce_sum(
            bucket, unit.column, domain.reduce_group, self.stats, domain.kind("reduce")
        )
        return PendingReduce(unit, bucket, work)

    def start_second_stages(self, reduces: list[PendingReduce], wait: bool) -> None:
        """HSDP: start stage 2 (across replicas, onto the primary) of the column's units
        whose stage 1 has landed, in issue order; with ``wait``, of all of them.

        Called as backward issues more reduces, so stage 2 overlaps the rest of backward.
        Stopping at the first unit still in stage 1 keeps the order of the replicate
        group's reduces the same on every replica, whenever each one is issued.
        """
        if self.replicas is None:
            return
        for pending in reduces:
            if not pending.unit.holds or pending.to_primary is not None:
                continue
            if not wait and not pending.to_column.is_completed():
                return
            pending.to_column.wait()
            pending.to_primary = self.replicas.reduce_to_primary(pending.unit, pending.bucket)

    def finish_reduces(self, reduces: list[PendingReduce]) -> None:
        """End of a reduced backward: the remaining second stages (HSDP), then the
        primaries accumulate their gradients; DDP-style sync of the rest."""
        self.start_second_stages(reduces, wait=True)
        # Experts too: their gradients sum every data-parallel rank's tokens.
        divide = self.settings.divide_factor(self.shard_size * self.replicate_size)
        for pending in reduces:
            pending.wait()
            if pending.unit.primary:
                pending.unit.accumulate_grads(pending.bucket, divide)
        self.others.sync_grads(self.settings, self.stats)
        self.synced_backwards += 1

    def reduce_grads(self) -> None:
        """Reduce to their owners, now, the gradients that backwards without sync
        (``requires_gradient_sync`` off) accumulated, and free the gathered values: what
        the end of a synced backward does. For pipeline schedules, which run a stage's
        backward piecewise (per micro-batch, input and weight passes apart) and reduce
        once after the last piece. Every data-parallel rank calls it."""
        self.driver.reduce_accumulated()

    @torch.no_grad()
    def divide_owned_grads(self, factor: float) -> None:
        """Divide the reduced gradients this rank holds (a schedule's gradient scaling,
        which ``p.grad`` alone would not reach)."""
        for unit in self.units:
            if unit.grad is not None:
                unit.grad.div_(factor)

    def discard_reduces(self, reduces: list[PendingReduce]) -> None:
        """A failed pass's reduces: let them land (their buffers are in use until then)
        and drop them.

        Every rank issued the same first stages; the second stages a replica started
        depended on timing, so all of them are started first: otherwise a replica would
        wait for a reduce the other never issues.
        """
        self.start_second_stages(reduces, wait=True)
        for pending in reduces:
            pending.wait()

    # ---- step protocol -------------------------------------------------------------------------
    def owned_grads(self) -> list[tuple[nn.Parameter, torch.Tensor, torch.Tensor]]:
        """``(param, master, grad)`` of each matrix whose reduced gradient this rank holds
        (it is the primary owner): the optimizer updates ``master`` (the parameter itself,
        or its full-precision copy under mixed precision) and keys its state by ``param``.

        One host sync: which matrices any rank touched since ``zero_grad``.
        """
        held = [(u, u.grads_held()) for u in self.units if u.primary]
        held = [(u, flags) for u, flags in held if flags is not None]
        if not held:
            return []
        flags = torch.cat([f for _, f in held]).tolist()
        out, i = [], 0
        for unit, _ in held:
            for d in unit.params:
                if flags[i]:
                    out.append((d.param, unit.master_view(d), unit.grad_view(d)))
                i += 1
        return out

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
        reset_fsdp_state(self.model)

    def before_step(self) -> None:
        if not self.initialized or self.synced_backwards == 0:
            if self.pipeline_stage is not None:
                raise RuntimeError(
                    f"Muon.step() was called but pipeline stage {self.pipeline_stage} has not "
                    "reduced its gradients since the last step: its schedule ran no backward "
                    "marked last_backward (the stage's last full or weight backward of the "
                    "step), which DMuon reduces after"
                )
            raise RuntimeError(
                "Muon.step() was called before any backward (with gradient sync enabled) "
                "since the last step: the dedicated gradients have not been reduced to "
                "their owners yet"
            )
        # A step without a forward since the last one: the previous broadcasts must land
        # before this step's values go out.
        self.wait_replicas()

    def after_step(self) -> None:
        """Primaries copy updated masters into the compute-dtype values; under HSDP the new
        values go to the other replicas (asynchronously with ``replicate_async``)."""
        with record_function("dmuon::after_step"):
            for unit in self.units:
                unit.masters_to_flat()
            if self.replicas is not None:
                self.replicas.broadcast(self.units, async_op=self.settings.replicate_async)
        self.driver.free_all()  # whatever a rank outside the owner column holds is stale now
        self.synced_backwards = 0

    @torch.no_grad()
    def refresh_from_masters(self) -> None:
        """After the primaries' masters were overwritten (a checkpoint load): recompute the
        compute-dtype values and, under HSDP, send them to the other replicas."""
        if not self.initialized:
            return
        self.driver.free_all()
        for unit in self.units:
            unit.masters_to_flat()
        if self.replicas is not None:
            self.replicas.wait_all()
            self.replicas.broadcast(self.units, async_op=False)

    def wait_replicas(self) -> None:
        """Wait for every in-flight replicate broadcast: call before reading dedicated
        values outside forward and before the process groups are destroyed."""
        if self.replicas is not None:
            self.replicas.wait_all()

    # ---- tensor parallelism -----------------------------------------------------------------
    def split_dim_of(self, param: nn.Parameter) -> int | None:
        """The dim a tensor-parallel dedicated matrix is split along, else None."""
        return self._split_dims.get(id(param))

    def differs_per_tp_rank(self, param: nn.Parameter) -> bool:
        """Whether each tensor-parallel rank owns other values of ``param``: a
        tensor-parallel shard, or expert-parallel experts (ep may borrow the TP ranks)."""
        return id(param) in self._per_tp_rank

    def ns_workload(
        self, backend: str, dtype: torch.dtype, steps: int
    ) -> dict[tuple[int, int], int]:
        """Matrices per ``(rows, cols)`` that ``backend`` orthogonalizes on this rank each
        step: those of which it is the primary owner, whole, and the tensor-parallel
        matrices its owner column gathers (the Gram path runs no backend)."""
        out: dict[tuple[int, int], int] = {}
        for unit in self.units:
            if not unit.primary:
                continue
            for d in unit.params:
                shape = d.shape  # the whole matrix's (a piece's, for split stacks)
                if d.split_dim is not None and self.tp_group is not None:
                    method = sharded_ns_method(
                        shape, d.split_dim, dtype.itemsize, steps, backend=backend
                    )
                    if method == "gram":
                        continue
                key = (int(shape[-2]), int(shape[-1]))
                out[key] = out.get(key, 0) + matrix_count(shape)
        return out

    # ---- reports and reads -----------------------------------------------------------------------
    def balance(self, domain: int | None = None) -> float:
        """Max over mean NS load over all data-parallel ranks (1.0 is perfect), of one
        domain's matrices or of all."""
        return self.plan.balance(domain)

    def held_bytes(self) -> list[int]:
        """Bytes each rank (slot order) keeps between steps for dedicated matrices (values,
        masters and momentum), from the plan and the bound dtypes."""
        unit = self.units[0]
        compute_dtype = unit.buffers[0].dtype
        mixed = compute_dtype != unit.master_dtype  # a master beside the momentum
        state_bytes = unit.master_dtype.itemsize * (2 if mixed else 1)
        return self.plan.held_bytes(compute_dtype.itemsize, state_bytes)

    def memory_bytes(self) -> dict[str, int]:
        """What this rank keeps between steps for dedicated matrices: ``params`` (values
        of the units it holds, compute dtype), ``masters`` (full-precision copies, primary
        under mixed precision) and ``momentum`` (the optimizer's buffers, primary only)."""
        total = {"params": 0, "masters": 0, "momentum": 0}
        for unit in self.units:
            for key, value in unit.memory_bytes().items():
                total[key] += value
        return total

    def on_remove(self, undo) -> None:
        """Call ``undo()`` in :meth:`remove` (what attached to the dedication from outside,
        such as a pipeline stage's methods, goes with it)."""
        self._on_remove.append(undo)

    def remove(self) -> None:
        """Undo :func:`dedicate_params`: the hooks, marks and a pipeline stage's methods go
        (the values stay where they are) and the engine's process groups are destroyed."""
        self.wait_replicas()
        while self._on_remove:
            self._on_remove.pop()()
        self.driver.remove()
        _DEDICATIONS.pop(self.model, None)
        for module in self.model.modules():
            patches.unmark_dedicated(module)
        for group in self.process_groups():
            dist.destroy_process_group(group)


def _mixed_precision_of(model: nn.Module, boundary_name: str) -> tuple:
    """``(param_dtype, reduce_dtype)`` of the innermost ``fully_shard`` call that covers
    the boundary (the boundary itself or an ancestor), or ``(None, None)``."""
    parts = boundary_name.split(".") if boundary_name else []
    for depth in range(len(parts), -1, -1):
        module = model.get_submodule(".".join(parts[:depth]))
        if isinstance(module, FSDPModule):
            policy = fully_shard.state(module)._mp_policy
            return policy.param_dtype, policy.reduce_dtype
    return None, None
