"""``dedicate_params``: give each selected matrix parameter one owner rank.

The owner keeps the full parameter and (through the optimizer) its momentum, receives
the SUM-reduced gradient, orthogonalizes it alone and updates the parameter in place; the
other ranks receive the value by broadcast right before they need it and free it again.

Three decisions are kept apart:

* WHO owns a matrix: one global LPT partition over the NS cost (``partition.py``,
  ``plan.py``), over all R x G ranks under HSDP;
* WHERE the hooks attach: the hook *boundary* module; all matrices under one boundary with
  the same owner form one *unit*, moved by one collective (``hooks.py``);
* WHETHER a rank steps a matrix: only the primary owner holds its reduced gradient
  (:meth:`Dedication.owned_grads`), which is what the optimizer steps.

Under HSDP, a (replicate, shard) = R x G layout, gradients are reduced in two stages
(to the owner column inside each shard group, then across the replicate group to the
primary owner) and the primary's new value is broadcast to the owner column of the other
replicas after the step, asynchronously if asked: each unit's broadcast is waited on
right before the unit is next read.

This module does not import TorchTitan.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import weakref
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from torchtitan_dmuon.engine import comm
from torchtitan_dmuon.engine.fsdp_patch import mark_dedicated
from torchtitan_dmuon.engine.partition import PartitionItem, load_balance
from torchtitan_dmuon.engine.plan import Boundary, BoundaryPredicate, Unit, build_plan
from torchtitan_dmuon.optim.newton_schulz import matrix_count, ns_flops

__all__ = [
    "Dedication",
    "dedicate_params",
    "get_dedication",
    "get_full_param",
    "set_requires_gradient_sync",
]

logger = logging.getLogger(__name__)

Predicate = Callable[[str, nn.Parameter], bool]

_DEDICATIONS: weakref.WeakKeyDictionary[nn.Module, Dedication] = weakref.WeakKeyDictionary()


def get_dedication(model: nn.Module) -> Dedication | None:
    """The :class:`Dedication` that :func:`dedicate_params` attached to ``model``, if any."""
    return _DEDICATIONS.get(model)


def get_full_param(model: nn.Module, name: str) -> torch.Tensor:
    """The full value of dedicated parameter ``name`` on every rank (a collective), for
    evaluation, export and tests."""
    dedication = get_dedication(model)
    if dedication is None:
        raise ValueError("model was not prepared by dedicate_params")
    return dedication.full_param(name)


def set_requires_gradient_sync(model: nn.Module, requires_gradient_sync: bool) -> None:
    """Turn gradient reduction on or off for the dedicated parameters and, like
    ``FSDPModule.set_requires_gradient_sync``, for every FSDP module in ``model``.

    Use it for gradient accumulation without a reduce per micro-batch: off for all but
    the last micro-batch. Every rank must set the same value.
    """
    dedication = get_dedication(model)
    if dedication is not None:
        dedication.requires_gradient_sync = requires_gradient_sync
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_requires_gradient_sync(requires_gradient_sync, recurse=False)


class Dedication:
    """The ownership plan of one model and the state that carries it out.

    Built by :func:`dedicate_params`; the hooks of :mod:`torchtitan_dmuon.engine.hooks`
    drive it during forward and backward, and :class:`torchtitan_dmuon.Muon` asks it which
    matrices this rank steps.
    """

    def __init__(
        self,
        model: nn.Module,
        mesh: DeviceMesh,
        replicate_mesh: DeviceMesh | None,
        boundaries: list[Boundary],
        reshard_after_forward: bool,
    ) -> None:
        self.model = model
        self.mesh = mesh
        # Gathers and stage-1 reduces each run on a group of their own: in backward a
        # boundary's reduce starts when its gradients are complete, which rank-dependent
        # branches make differ between ranks, so on one group the two sequences could
        # interleave differently (a hang). Each sequence alone has a fixed order.
        self.shard_group = comm.engine_group(mesh.get_group(), "dmuon_shard")
        self.reduce_group = comm.engine_group(mesh.get_group(), "dmuon_shard_reduce")
        self.shard_rank = mesh.get_local_rank()
        self.shard_size = mesh.size()
        self.replicate_mesh = replicate_mesh
        self.has_replicas = replicate_mesh is not None
        self.replicate_group = (
            comm.engine_group(replicate_mesh.get_group(), "dmuon_replicate")
            if self.has_replicas
            else None
        )
        self.replicate_rank = replicate_mesh.get_local_rank() if self.has_replicas else 0
        self.replicate_size = replicate_mesh.size() if self.has_replicas else 1
        self.boundaries = boundaries
        self.reshard_after_forward = reshard_after_forward
        self.units: list[Unit] = [u for b in boundaries for u in b.units]
        self.params: list[nn.Parameter] = [d.param for b in boundaries for d in b.params]
        self.gradient_divide_factor: float | None = None
        """Reduced gradients are divided by this (default: the number of ranks, i.e. the
        mean; 1.0 keeps the sum, for a loss already normalized over the global batch)."""
        self._hooked_params: set[int] = set()
        self.stats = comm.CommStats()
        self.replicate_async = False
        self.initialized = False
        self.syncs_other_grads = False
        """DDP-style: no FSDP in the model, so the engine all-reduces the other gradients."""
        self.requires_gradient_sync = True
        self.synced_backwards = 0
        """Backwards that reduced gradients since the last optimizer step."""
        self.reduced_grads: dict[nn.Parameter, torch.Tensor] = {}
        """Primary owner only: the mean gradient of each matrix, accumulated over backwards."""
        self.events: list[tuple[str, int]] | None = None
        """Set to a list to record ``(event, boundary)`` tuples of the replicate broadcasts
        (``"launch"``, ``"forward"``, ``"wait"``): how a user sees that they overlap."""
        self.driver = None
        """The :class:`~torchtitan_dmuon.engine.hooks.HookDriver` set by ``register_hooks``."""
        self._boundary_of_unit = {id(u): i for i, b in enumerate(boundaries) for u in b.units}

    def process_groups(self) -> list[dist.ProcessGroup]:
        """The engine's own groups (see :func:`comm.engine_group`): the shard group (its
        broadcasts), the reduce group (the same ranks, its stage-1 reduces) and, under
        HSDP, the replicate group."""
        groups = [self.shard_group, self.reduce_group, self.replicate_group]
        return [g for g in groups if g is not None]

    # ---- parameters -------------------------------------------------------------------
    def bind_params(self) -> None:
        """Point the plan at the model's current parameter objects, found by name.

        ``Module.to_empty`` (meta-device initialization, as TorchTitan does after
        ``fully_shard``) registers new Parameter objects; the plan follows them, and each
        new object gets the dedicated mark and the post-accumulate-grad hook.
        """
        for b, boundary in enumerate(self.boundaries):
            for d in boundary.params:
                current = self.model.get_parameter(d.name)
                if current is not d.param:
                    d.param = current
                if id(current) not in self._hooked_params:
                    mark_dedicated(current)
                    self.driver.register_param_hook(current, b)
                    self._hooked_params.add(id(current))
        self.params = [d.param for b in self.boundaries for d in b.params]

    def set_gradient_divide_factor(self, factor: float | None) -> None:
        """Like ``FSDPModule.set_gradient_divide_factor``: divide reduced gradients by
        ``factor`` (None: the number of ranks)."""
        if factor is not None and factor <= 0:
            raise ValueError(f"gradient divide factor must be > 0, got {factor}")
        self.gradient_divide_factor = factor

    def _divide_factor(self, ranks: int) -> float:
        return self.gradient_divide_factor if self.gradient_divide_factor else ranks

    # ---- roles -------------------------------------------------------------------------
    def holds(self, unit: Unit) -> bool:
        """This rank is the unit's column: it keeps the values between steps."""
        return unit.column == self.shard_rank

    def is_primary(self, unit: Unit) -> bool:
        """This rank is the unit's primary owner: master, momentum and Newton-Schulz."""
        return self.holds(unit) and unit.replica == self.replicate_rank

    def balance(self) -> float:
        """Max over mean NS load over all ranks (1.0 is perfect)."""
        items, owners = [], []
        for unit in self.units:
            for d in unit.params:
                items.append(PartitionItem(ns_flops(d.param.shape, 1), 0))
                owners.append(unit.replica * self.shard_size + unit.column)
        return load_balance(items, owners, self.shard_size * self.replicate_size)

    def memory_bytes(self) -> dict[str, int]:
        """What this rank keeps between steps for dedicated matrices: ``params`` (values
        of the units it holds, compute dtype), ``masters`` (full-precision copies, primary
        under mixed precision) and ``momentum`` (the optimizer's buffers, primary only)."""
        params = masters = momentum = 0
        for unit in self.units:
            if not self.holds(unit):
                continue
            params += unit.numel * unit.flat.element_size() if unit.flat is not None else 0
            if unit.master is not None:
                masters += unit.master.numel() * unit.master.element_size()
            if self.is_primary(unit):
                momentum += unit.numel * (unit.master_dtype or unit.params[0].param.dtype).itemsize
        return {"params": params, "masters": masters, "momentum": momentum}

    # ---- plan agreement ------------------------------------------------------------------
    def fingerprint(self) -> int:
        """A hash of the plan; equal on every rank iff they agree on it."""
        h = hashlib.sha256()
        h.update(repr((self.reshard_after_forward, self.shard_size, self.replicate_size)).encode())
        for i, b in enumerate(self.boundaries):
            for u in b.units:
                for d in u.params:
                    key = (i, b.name, d.name, tuple(d.param.shape), u.column, u.replica)
                    h.update(repr(key).encode())
        return int.from_bytes(h.digest()[:7], "little")

    def verify_consistent(self) -> None:
        """Check with one small all-gather that every rank holds the same plan and sits
        where the (replicate, shard) layout says.

        Every rank sees every rank's answer and raises alike, so a mismatch cannot reach a
        later collective.
        """
        world = dist.get_world_size()
        mine = torch.tensor(
            [self.fingerprint(), self.replicate_rank, self.shard_rank],
            dtype=torch.int64,
            device=self._comm_device(),
        )
        everyone = [torch.zeros_like(mine) for _ in range(world)]
        dist.all_gather(everyone, mine)
        table = [[int(x) for x in t.tolist()] for t in everyone]
        fingerprints = [row[0] for row in table]
        if len(set(fingerprints)) != 1:
            raise RuntimeError(
                "ranks disagree about the dedication plan (different model, predicate, "
                f"hook boundaries or mesh per rank); plan fingerprints by rank: {fingerprints}"
            )
        coordinates = [(row[1], row[2]) for row in table]
        if len(set(coordinates)) != world:
            raise ValueError(
                "replicate_mesh does not line up with mesh: the (replicate, shard) "
                f"coordinates of the ranks are not all distinct: {coordinates}"
            )

    def _comm_device(self) -> torch.device:
        if self.mesh.device_type == "cpu":
            return torch.device("cpu")
        return torch.device(self.mesh.device_type, torch.accelerator.current_device_index())

    # ---- storage -----------------------------------------------------------------------
    def lazy_init(self) -> None:
        """Bind each unit's parameters to one flat buffer, at the first forward.

        Done lazily so that meta-device initialization (``to_empty`` then
        ``init_weights``), checkpoint loading and ``fully_shard`` can all happen in between.
        The primary owner's values win. Under an FSDP2 ``MixedPrecisionPolicy`` the flat
        buffer (what forward uses and what is broadcast) is in ``param_dtype`` and the
        primary keeps a full-precision master beside it.
        """
        if self.initialized:
            return
        self.bind_params()
        self.syncs_other_grads = dist.get_world_size() > 1 and not any(
            isinstance(m, FSDPModule) for m in self.model.modules()
        )
        for boundary in self.boundaries:
            param_dtype, reduce_dtype = _mixed_precision_of(self.model, boundary.name)
            for unit in boundary.units:
                dtype = unit.params[0].param.dtype
                compute_dtype = param_dtype or dtype
                unit.master_dtype = dtype
                unit.reduce_dtype = reduce_dtype or compute_dtype
                values = torch.cat([d.param.detach().reshape(-1) for d in unit.params])
                if self.is_primary(unit) and compute_dtype != dtype:
                    unit.master = values
                unit.flat = values.to(compute_dtype)
                offset = 0
                for d in unit.params:
                    d.offset = offset
                    d.param.data = unit.view(unit.flat, d)
                    offset += d.param.numel()
                self.free(unit)
        if self.syncs_other_grads:
            self._broadcast_others_from_rank0()
        if self.has_replicas:
            # Replicas of an owner column start from the primary's values.
            self.broadcast_replicas(async_op=False)
        self.initialized = True

    def _broadcast_others_from_rank0(self) -> None:
        """DDP-style: start every replica from rank 0's values, as DDP does."""
        with torch.no_grad():
            for p in self.other_params():
                dist.broadcast(p.data, src=0)
            for b in self.model.buffers():
                dist.broadcast(b.data, src=0)

    def other_params(self) -> list[nn.Parameter]:
        dedicated = set(map(id, self.params))
        return [p for p in self.model.parameters() if p.requires_grad and id(p) not in dedicated]

    def allocate(self, unit: Unit) -> None:
        storage = unit.flat.untyped_storage()
        if storage.size() == 0:
            storage.resize_(unit.numel * unit.flat.element_size())

    def free(self, unit: Unit) -> None:
        """Drop the copy of a rank outside the unit's column (the parameters keep their
        shape, not their data)."""
        if not self.holds(unit):
            unit.flat.untyped_storage().resize_(0)

    def gather_async(self, unit: Unit) -> dist.Work:
        """Materialize ``unit`` in this shard group by a broadcast from its column, once the
        column has the latest values from the primary replica."""
        self.wait_replica(unit)
        self.allocate(unit)
        return comm.broadcast(unit.flat, unit.column, self.shard_group, self.stats)

    # ---- replicas ------------------------------------------------------------------------
    def broadcast_replicas(self, async_op: bool) -> None:
        """Send each primary's values to its column in the other replicas."""
        for unit in self.units:
            if not self.holds(unit):
                continue
            work = comm.broadcast(
                unit.flat, unit.replica, self.replicate_group, self.stats, "replicate_broadcast"
            )
            if async_op:
                unit.replica_work = work
                self.record("launch", unit)
            else:
                work.wait()

    def replicas_landed(self, boundary: int) -> bool:
        """No replicate broadcast into this boundary's units is still in flight."""
        works = [u.replica_work for u in self.boundaries[boundary].units]
        return all(w is None or w.is_completed() for w in works)

    def wait_replica(self, unit: Unit) -> None:
        if unit.replica_work is not None:
            unit.replica_work.wait()
            unit.replica_work = None
            self.record("wait", unit)

    def wait_replicas(self) -> None:
        """Wait for every in-flight replicate broadcast: call before reading dedicated
        values outside forward (evaluation helpers, checkpoint save) and at the end of
        training, before the process groups are destroyed."""
        for unit in self.units:
            self.wait_replica(unit)

    def record(self, event: str, unit: Unit | None = None, boundary: int | None = None) -> None:
        if self.events is not None:
            self.events.append((event, self._boundary_of_unit[id(unit)] if unit else boundary))

    # ---- gradients ---------------------------------------------------------------------
    def pack_grads(self, unit: Unit) -> torch.Tensor:
        """A reduce bucket in the reduce dtype: every matrix's local gradient (zeros where
        it has none) and, after them, one has-gradient flag per matrix, so that the owner
        can tell a matrix no rank touched (skipped, as torch.optim.Muon skips a ``None``
        gradient) from one whose sum is zero. Consumes the local gradients."""
        params = [d.param for d in unit.params]
        bucket = _flagged_grad_bucket(params, unit.reduce_dtype, unit.flat.device)
        for p in params:
            p.grad = None
        return bucket

    def reduce_to_column(self, unit: Unit, bucket: torch.Tensor) -> dist.Work:
        """Stage 1: SUM the bucket onto the unit's column inside this shard group."""
        return comm.reduce_sum(bucket, unit.column, self.reduce_group, self.stats)

    def reduce_to_primary(self, unit: Unit, bucket: torch.Tensor) -> dist.Work | None:
        """Stage 2 (HSDP, column ranks only): SUM across replicas onto the primary."""
        if not (self.has_replicas and self.holds(unit)):
            return None
        return comm.reduce_sum(
            bucket, unit.replica, self.replicate_group, self.stats, "replicate_reduce"
        )

    def unpack_grads(self, unit: Unit, bucket: torch.Tensor) -> None:
        """On the primary: add the mean gradients (one divide) to the reduced gradients,
        which accumulate over micro-batches until ``zero_grad``."""
        if not self.is_primary(unit):
            return
        bucket.div_(self._divide_factor(self.shard_size * self.replicate_size))
        for i, d in enumerate(unit.params):
            if bucket[unit.numel + i] == 0:
                continue
            grad = unit.view(bucket, d)
            if d.param in self.reduced_grads:
                self.reduced_grads[d.param] += grad
            else:
                self.reduced_grads[d.param] = grad

    def sync_other_grads(self) -> None:
        """DDP-style: average the non-dedicated gradients over all ranks, in one bucket.

        The bucket has a place for every parameter plus a has-gradient flag each, so a
        rank that skipped a module sends the same bucket as the others: a gradient no rank
        computed stays ``None``, one that some ranks computed counts the others as zeros
        (as DDP with ``find_unused_parameters``).
        """
        params = self.other_params()
        if not params:
            return
        dtype = functools.reduce(torch.promote_types, (p.dtype for p in params))
        bucket = _flagged_grad_bucket(params, dtype, params[0].device)
        numel = bucket.numel() - len(params)
        comm.all_reduce_sum(bucket, None, self.stats).wait()
        bucket[:numel].div_(self._divide_factor(dist.get_world_size()))
        offset = 0
        for p, has_grad in zip(params, bucket[numel:].tolist(), strict=True):
            mean = bucket[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
            if not has_grad:
                continue
            if p.grad is None:
                p.grad = mean.to(p.dtype, copy=True)
            else:
                p.grad.copy_(mean)

    def zero_grad(self) -> None:
        self.reduced_grads.clear()

    # ---- optimizer step ------------------------------------------------------------------
    def owned_grads(self) -> list[tuple[nn.Parameter, torch.Tensor, torch.Tensor]]:
        """``(param, master, grad)`` for each matrix whose reduced gradient this rank holds
        (it is the primary owner): the optimizer updates ``master`` (the parameter itself,
        or its full-precision copy under mixed precision) and keys its state by ``param``."""
        return [
            (d.param, unit.master_view(d), self.reduced_grads[d.param])
            for unit in self.units
            for d in unit.params
            if d.param in self.reduced_grads
        ]

    def primary_params(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """``(param, master)`` of every matrix this rank is the primary owner of: what a
        checkpoint saves from this rank (and loads into it)."""
        return [
            (d.param, unit.master_view(d))
            for unit in self.units
            if self.is_primary(unit)
            for d in unit.params
        ]

    @torch.no_grad()
    def refresh_from_masters(self) -> None:
        """After the primaries' masters were overwritten (a checkpoint load): recompute the
        compute-dtype values and, under HSDP, send them to the other replicas."""
        if not self.initialized:
            return
        self._masters_to_flats()
        if self.has_replicas:
            self.wait_replicas()
            self.broadcast_replicas(async_op=False)

    def _masters_to_flats(self) -> None:
        for unit in self.units:
            if unit.master is not None:
                unit.flat.copy_(unit.master)

    def before_step(self) -> None:
        if not self.initialized or self.synced_backwards == 0:
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
        self._masters_to_flats()
        if self.has_replicas:
            self.broadcast_replicas(async_op=self.replicate_async)
        self.synced_backwards = 0

    # ---- full values -----------------------------------------------------------------------
    @torch.no_grad()
    def full_param(self, name: str) -> torch.Tensor:
        """The current full value of dedicated parameter ``name`` on every rank, in the
        master precision.

        A collective: every rank must call it, in the same order.
        """
        found = [(u, d) for u in self.units for d in u.params if d.name == name]
        if not found:
            raise KeyError(f"{name!r} is not a dedicated parameter")
        unit, d = found[0]
        if not self.initialized:
            return d.param.detach().clone()
        if self.is_primary(unit):
            value = unit.master_view(d).clone()
        else:
            value = torch.empty(d.param.shape, dtype=unit.master_dtype, device=unit.flat.device)
        if self.has_replicas and self.holds(unit):
            comm.broadcast(value, unit.replica, self.replicate_group, self.stats, "read").wait()
        comm.broadcast(value, unit.column, self.shard_group, self.stats, "read").wait()
        return value


def _flagged_grad_bucket(
    params: list[nn.Parameter], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """Every parameter's gradient back to back (zeros where it has none), then one
    has-gradient flag per parameter: a bucket of the same size on every rank, whatever
    gradients each rank computed."""
    numel = sum(p.numel() for p in params)
    bucket = torch.zeros(numel + len(params), dtype=dtype, device=device)
    offset = 0
    for i, p in enumerate(params):
        if p.grad is not None:
            bucket[offset : offset + p.numel()].copy_(p.grad.reshape(-1))
            bucket[numel + i] = 1
        offset += p.numel()
    return bucket


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


def _validate_meshes(mesh: DeviceMesh, replicate_mesh: DeviceMesh | None) -> None:
    if not dist.is_initialized():
        raise RuntimeError("dedicate_params needs an initialized default process group")
    for arg, m in (("mesh", mesh), ("replicate_mesh", replicate_mesh)):
        if m is None:
            continue
        if not isinstance(m, DeviceMesh):
            raise TypeError(f"{arg} must be a DeviceMesh, got {type(m).__name__}")
        if m.ndim != 1:
            raise ValueError(
                f"{arg} must be 1-D, got a {m.ndim}-D mesh; for HSDP pass hsdp['shard'] as "
                "mesh and hsdp['replicate'] as replicate_mesh"
            )
    world = dist.get_world_size()
    if replicate_mesh is None:
        if mesh.size() != world:
            raise ValueError(
                f"mesh has {mesh.size()} ranks but the process group has {world}; without "
                "replicate_mesh a 1-D mesh must span every rank"
            )
        return
    shard_ranks = set(mesh.mesh.flatten().tolist())
    replicate_ranks = set(replicate_mesh.mesh.flatten().tolist())
    if mesh.size() * replicate_mesh.size() != world or shard_ranks & replicate_ranks != {
        dist.get_rank()
    }:
        raise ValueError(
            "replicate_mesh does not line up with mesh: expected the shard group "
            f"({sorted(shard_ranks)}) and the replicate group ({sorted(replicate_ranks)}) "
            f"to meet in this rank only and to multiply to the world size ({world}); use "
            "hsdp['shard'] and hsdp['replicate'] of one 2-D mesh"
        )


def _select(model: nn.Module, predicate: Predicate) -> list[tuple[str, nn.Parameter]]:
    names_of: dict[int, list[str]] = {}
    params: dict[int, nn.Parameter] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(p), []).append(name)
        params[id(p)] = p
    selected, frozen = [], []
    for key, names in names_of.items():
        name, p = names[0], params[key]
        if not predicate(name, p):
            continue
        if len(names) > 1:
            raise ValueError(
                f"parameter {name!r} is shared with {names[1:]} (tied weights) and cannot be "
                "dedicated; exclude it in the predicate"
            )
        if p.ndim not in (2, 3):
            raise ValueError(
                f"predicate selected {name!r} of shape {tuple(p.shape)}; only 2-D matrices "
                "and 3-D stacks of matrices (MoE experts) can be dedicated"
            )
        if not p.requires_grad:
            frozen.append(name)
            continue
        selected.append((name, p))
    if frozen:
        logger.info("dedicate_params: %d frozen matrices stay out of Muon: %s", len(frozen), frozen)
    if not selected:
        raise ValueError("predicate selected no trainable 2-D or 3-D parameter")
    return selected


@torch.no_grad()
def dedicate_params(
    model: nn.Module,
    mesh: DeviceMesh,
    predicate: Predicate,
    *,
    replicate_mesh: DeviceMesh | None = None,
    hook_boundary_predicate: BoundaryPredicate | None = None,
    reshard_after_forward: bool = True,
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
        reshard_after_forward: True (Z3): ranks outside a matrix's owner column free it after
            forward and receive it again before backward. False (Z2): they keep it until
            after backward, saving one broadcast per boundary per step.

    Returns:
        The :class:`Dedication` (also reachable through :func:`get_dedication`).

    Raises:
        ValueError / TypeError / RuntimeError: bad input, always before any collective.
    """
    _validate_meshes(mesh, replicate_mesh)
    if any(isinstance(m, FSDPModule) for m in model.modules()):
        raise RuntimeError(
            "dedicate_params must be called before fully_shard: the model already has "
            "FSDP-wrapped modules"
        )
    if model in _DEDICATIONS:
        raise RuntimeError("dedicate_params was already applied to this model")
    selected = _select(model, predicate)
    boundaries = build_plan(
        model,
        selected,
        shard_size=mesh.size(),
        replicate_size=replicate_mesh.size() if replicate_mesh is not None else 1,
        hook_boundary_predicate=hook_boundary_predicate,
    )
    dedication = Dedication(model, mesh, replicate_mesh, boundaries, reshard_after_forward)
    _DEDICATIONS[model] = dedication

    from torchtitan_dmuon.engine.hooks import register_hooks

    register_hooks(dedication)
    logger.info(
        "dedicate_params: %d parameters (%d matrices), %d boundaries, %d units over "
        "%d x %d ranks, NS balance %.3f, %s",
        len(dedication.params),
        sum(matrix_count(p.shape) for p in dedication.params),
        len(boundaries),
        len(dedication.units),
        dedication.replicate_size,
        dedication.shard_size,
        dedication.balance(),
        "Z3" if reshard_after_forward else "Z2",
    )
    return dedication
