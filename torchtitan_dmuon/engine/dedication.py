"""``dedicate_params``: give each selected matrix parameter one owner rank.

The owner keeps the full parameter and (through the optimizer) its momentum, receives
the SUM-reduced gradient, orthogonalizes it alone and updates the parameter in place; the
other ranks receive the value by broadcast right before they need it and free it again.

Three decisions are kept apart, so that changing one does not change the others:

* WHO owns a matrix: one global LPT partition over the NS cost (``partition.py``);
* WHERE the hooks attach: the hook *boundary* module of each matrix; all matrices under one
  boundary with the same owner form one *unit*, moved by one collective (``hooks.py``);
* WHETHER a rank steps a matrix: the owner test the optimizer applies at step time.

This module does not import TorchTitan.
"""

from __future__ import annotations

import hashlib
import logging
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from torchtitan_dmuon.engine import comm
from torchtitan_dmuon.engine.fsdp_patch import mark_dedicated
from torchtitan_dmuon.engine.partition import PartitionItem, assign_owners, load_balance
from torchtitan_dmuon.optim.newton_schulz import ns_flops

__all__ = [
    "Boundary",
    "DedicatedParam",
    "Dedication",
    "Unit",
    "dedicate_params",
    "get_dedication",
    "get_full_param",
    "set_requires_gradient_sync",
]

logger = logging.getLogger(__name__)

Predicate = Callable[[str, nn.Parameter], bool]
BoundaryPredicate = Callable[[str, nn.Module], bool]

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


@dataclass(eq=False)
class DedicatedParam:
    """A matrix parameter with one owner.

    Attributes:
        name: Fully qualified name in the model.
        param: The module's parameter (the same object before and after dedication).
        owner: The owning rank, as a rank of the shard group.
        boundary: Index of its hook boundary in :attr:`Dedication.boundaries`.
    """

    name: str
    param: nn.Parameter
    owner: int
    boundary: int
    offset: int = 0
    """Offset of the parameter in its unit's flat buffer."""


@dataclass(eq=False)
class Unit:
    """The matrices of one boundary that share an owner: one broadcast, one reduce.

    Attributes:
        owner: Owning rank in the shard group.
        params: Its matrices, in model order.
        flat: One contiguous buffer the parameters are views of, in the compute dtype.
            Its storage is freed on non-owners between uses.
    """

    owner: int
    params: list[DedicatedParam]
    flat: torch.Tensor | None = None
    master: torch.Tensor | None = None
    """Owner only, under mixed precision: the full-precision values ``flat`` is cast from."""
    master_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None

    @property
    def numel(self) -> int:
        return sum(d.param.numel() for d in self.params)


@dataclass(eq=False)
class Boundary:
    """A module whose hooks move the dedicated parameters beneath it.

    Attributes:
        name: Module name in the model ("" for the root).
        module: The module.
        units: One unit per owner among its matrices, in owner order.
    """

    name: str
    module: nn.Module
    units: list[Unit] = field(default_factory=list)

    @property
    def params(self) -> Iterator[DedicatedParam]:
        for unit in self.units:
            yield from unit.params


def _default_boundaries(model: nn.Module) -> set[nn.Module]:
    """Blocks: modules held in an ``nn.ModuleList``/``nn.ModuleDict`` (what
    ``fully_shard`` is applied to in TorchTitan and most training scripts)."""
    blocks = set()
    for module in model.modules():
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            blocks.update(module.children())
    return blocks


def _boundary_of(name: str, model: nn.Module, candidates: Callable[[str, nn.Module], bool]) -> str:
    """Name of the innermost ancestor module of parameter ``name`` accepted by ``candidates``
    ("" for the root when none is)."""
    parts = name.split(".")[:-1]
    for depth in range(len(parts), 0, -1):
        module_name = ".".join(parts[:depth])
        if candidates(module_name, model.get_submodule(module_name)):
            return module_name
    return ""


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
        boundaries: list[Boundary],
        reshard_after_forward: bool,
    ) -> None:
        self.model = model
        self.mesh = mesh
        self.shard_group = mesh.get_group()
        self.shard_rank = mesh.get_local_rank()
        self.shard_size = mesh.size()
        self.boundaries = boundaries
        self.reshard_after_forward = reshard_after_forward
        self.params: list[nn.Parameter] = [d.param for b in boundaries for d in b.params]
        self.by_param: dict[nn.Parameter, DedicatedParam] = {
            d.param: d for b in boundaries for d in b.params
        }
        self.stats = comm.CommStats()
        self.has_replicas = False
        self.replicate_async = False
        self.initialized = False
        self.syncs_other_grads = False
        """DDP-style: no FSDP in the model, so the engine all-reduces the other gradients."""
        self.requires_gradient_sync = True
        self.synced_backwards = 0
        """Backwards that reduced gradients since the last optimizer step."""
        self.reduced_grads: dict[nn.Parameter, torch.Tensor] = {}
        """Owner only: the mean gradient of each owned matrix, accumulated over backwards."""
        self.driver = None
        """The :class:`~torchtitan_dmuon.engine.hooks.HookDriver` set by ``register_hooks``."""

    # ---- queries ---------------------------------------------------------------------
    def is_owner(self, param: nn.Parameter) -> bool:
        return self.by_param[param].owner == self.shard_rank

    def owned_params(self) -> list[nn.Parameter]:
        return [p for p in self.params if self.is_owner(p)]

    def owner_loads(self, ns_steps: int = 5) -> list[int]:
        """NS FLOPs per shard rank for one step."""
        load = [0] * self.shard_size
        for d in self.by_param.values():
            load[d.owner] += ns_flops(d.param.shape, ns_steps)
        return load

    def balance(self) -> float:
        """Max over mean NS load (1.0 is perfect)."""
        items = [
            PartitionItem(ns_flops(d.param.shape, 1), d.boundary) for d in self.by_param.values()
        ]
        owners = [d.owner for d in self.by_param.values()]
        return load_balance(items, owners, self.shard_size)

    def fingerprint(self) -> int:
        """A hash of the plan; equal on every rank iff they agree on it."""
        h = hashlib.sha256()
        h.update(repr((self.reshard_after_forward, self.shard_size, self.has_replicas)).encode())
        for i, b in enumerate(self.boundaries):
            for d in b.params:
                h.update(repr((i, b.name, d.name, tuple(d.param.shape), d.owner)).encode())
        return int.from_bytes(h.digest()[:7], "little")

    def verify_consistent(self) -> None:
        """Check with one small all-gather that every rank holds the same plan.

        Raises on every rank alike, so that a mismatch cannot reach a later collective.
        """
        mine = torch.tensor([self.fingerprint()], dtype=torch.int64, device=self._comm_device())
        everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, mine)
        values = [int(t.item()) for t in everyone]
        if len(set(values)) != 1:
            raise RuntimeError(
                "ranks disagree about the dedication plan (different model, predicate, "
                f"hook boundaries or mesh per rank); plan fingerprints by rank: {values}"
            )

    def set_replicate_async(self, enabled: bool) -> None:
        self.replicate_async = enabled

    def _comm_device(self) -> torch.device:
        if self.mesh.device_type == "cpu":
            return torch.device("cpu")
        return torch.device(self.mesh.device_type, torch.accelerator.current_device_index())

    # ---- storage -----------------------------------------------------------------------
    def lazy_init(self) -> None:
        """Bind each unit's parameters to one flat buffer, at the first forward.

        Done lazily so that meta-device initialization (``to_empty`` then
        ``init_weights``), checkpoint loading and ``fully_shard`` can all happen in between.
        The owner's values win; non-owners free their copy. Under an FSDP2
        ``MixedPrecisionPolicy`` the flat buffer (what forward uses and what is broadcast)
        is in ``param_dtype`` and the owner keeps a full-precision master beside it.
        """
        if self.initialized:
            return
        self.syncs_other_grads = dist.get_world_size() > 1 and not any(
            isinstance(m, FSDPModule) for m in self.model.modules()
        )
        for boundary in self.boundaries:
            param_dtype, reduce_dtype = _mixed_precision_of(self.model, boundary.name)
            for unit in boundary.units:
                first = unit.params[0].param
                compute_dtype = param_dtype or first.dtype
                unit.reduce_dtype = reduce_dtype or compute_dtype
                unit.master_dtype = first.dtype
                values = torch.cat([d.param.detach().reshape(-1) for d in unit.params])
                if self.shard_rank == unit.owner and compute_dtype != first.dtype:
                    unit.master = values
                unit.flat = values.to(compute_dtype)
                offset = 0
                for d in unit.params:
                    n = d.param.numel()
                    d.param.data = unit.flat[offset : offset + n].view(d.param.shape)
                    d.offset = offset
                    offset += n
                self.free(unit)
        if self.syncs_other_grads:
            self._broadcast_others_from_rank0()
        self.initialized = True

    def _broadcast_others_from_rank0(self) -> None:
        """DDP-style: start every replica from rank 0's values, as DDP does."""
        with torch.no_grad():
            for p in self.other_params():
                dist.broadcast(p.data, group_src=0, group=self.shard_group)
            for b in self.model.buffers():
                dist.broadcast(b.data, group_src=0, group=self.shard_group)

    def other_params(self) -> list[nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad and p not in self.by_param]

    def allocate(self, unit: Unit) -> None:
        storage = unit.flat.untyped_storage()
        if storage.size() == 0:
            storage.resize_(unit.numel * unit.flat.element_size())

    def free(self, unit: Unit) -> None:
        """Drop a non-owner's copy of ``unit`` (the parameters keep their shape, not data)."""
        if unit.owner != self.shard_rank:
            unit.flat.untyped_storage().resize_(0)

    def gather_async(self, unit: Unit) -> dist.Work:
        """Materialize ``unit`` on every rank by a broadcast from its owner."""
        self.allocate(unit)
        return comm.broadcast(unit.flat, unit.owner, self.shard_group, self.stats)

    # ---- gradients ---------------------------------------------------------------------
    def pack_grads(self, unit: Unit) -> torch.Tensor:
        """A reduce bucket in the reduce dtype: every matrix's local gradient (zeros where
        it has none) and, after them, one has-gradient flag per matrix, so that the owner
        can tell a matrix no rank touched (skipped, as torch.optim.Muon skips a ``None``
        gradient) from one whose sum is zero. Consumes the local gradients."""
        n = len(unit.params)
        bucket = torch.zeros(unit.numel + n, dtype=unit.reduce_dtype, device=unit.flat.device)
        for i, d in enumerate(unit.params):
            grad = d.param.grad
            if grad is not None:
                bucket[d.offset : d.offset + grad.numel()].copy_(grad.reshape(-1))
                bucket[unit.numel + i] = 1
            d.param.grad = None
        return bucket

    def reduce_async(self, unit: Unit, bucket: torch.Tensor) -> dist.Work:
        return comm.reduce_sum(bucket, unit.owner, self.shard_group, self.stats)

    def unpack_grads(self, unit: Unit, bucket: torch.Tensor) -> None:
        """On the owner: add the mean gradients (one divide) to the reduced gradients,
        which accumulate over micro-batches until ``zero_grad``."""
        if unit.owner != self.shard_rank:
            return
        bucket.div_(self.shard_size)
        for i, d in enumerate(unit.params):
            if bucket[unit.numel + i] == 0:
                continue
            grad = bucket[d.offset : d.offset + d.param.numel()].view(d.param.shape)
            if d.param in self.reduced_grads:
                self.reduced_grads[d.param] += grad
            else:
                self.reduced_grads[d.param] = grad

    def sync_other_grads(self) -> None:
        """DDP-style: average the non-dedicated gradients over the group (one bucket)."""
        params = [p for p in self.other_params() if p.grad is not None]
        if not params:
            return
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        comm.all_reduce_sum(flat, self.shard_group, self.stats).wait()
        flat.div_(self.shard_size)
        offset = 0
        for p in params:
            n = p.grad.numel()
            p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
            offset += n

    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        """Like FSDP2's: while False, backward keeps local gradients (no reduce), so that
        micro-batches accumulate locally and the last, synced backward reduces their sum."""
        self.requires_gradient_sync = requires_gradient_sync

    def zero_grad(self) -> None:
        self.reduced_grads.clear()

    # ---- optimizer step ------------------------------------------------------------------
    def owned_grads(self) -> list[tuple[nn.Parameter, torch.Tensor, torch.Tensor]]:
        """``(param, master, grad)`` for each owned matrix with a reduced gradient: the
        optimizer updates ``master`` (the parameter itself, or its full-precision copy
        under mixed precision) and keys its state by ``param``."""
        out = []
        for boundary in self.boundaries:
            for unit in boundary.units:
                for d in unit.params:
                    if d.param in self.reduced_grads:
                        out.append(
                            (d.param, self._master_view(unit, d), self.reduced_grads[d.param])
                        )
        return out

    @staticmethod
    def _master_view(unit: Unit, d: DedicatedParam) -> torch.Tensor:
        if unit.master is None:
            return d.param.data
        return unit.master[d.offset : d.offset + d.param.numel()].view(d.param.shape)

    def before_step(self) -> None:
        if not self.initialized or self.synced_backwards == 0:
            raise RuntimeError(
                "Muon.step() was called before any backward (with gradient sync enabled) "
                "since the last step: the dedicated gradients have not been reduced to "
                "their owners yet"
            )

    def after_step(self) -> None:
        """Owners copy updated masters into the compute-dtype parameters."""
        for boundary in self.boundaries:
            for unit in boundary.units:
                if unit.master is not None:
                    unit.flat.copy_(unit.master)
        self.synced_backwards = 0

    # ---- full values -----------------------------------------------------------------------
    @torch.no_grad()
    def full_param(self, name: str) -> torch.Tensor:
        """The current full value of dedicated parameter ``name`` on every rank, in the
        owner's master precision.

        A collective: every rank of the shard group must call it, in the same order.
        """
        found = [
            (u, d) for b in self.boundaries for u in b.units for d in u.params if d.name == name
        ]
        if not found:
            raise KeyError(f"{name!r} is not a dedicated parameter")
        unit, d = found[0]
        if not self.initialized:
            return d.param.detach().clone()
        if d.owner == self.shard_rank:
            value = self._master_view(unit, d).clone()
        else:
            value = torch.empty(d.param.shape, dtype=unit.master_dtype, device=unit.flat.device)
        comm.broadcast(value, d.owner, self.shard_group, self.stats).wait()
        return value


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


def _validate_mesh(mesh: DeviceMesh, replicate_mesh: DeviceMesh | None) -> None:
    if not dist.is_initialized():
        raise RuntimeError("dedicate_params needs an initialized default process group")
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a DeviceMesh, got {type(mesh).__name__}")
    if mesh.ndim != 1:
        raise ValueError(
            f"mesh must be 1-D (the shard dimension), got a {mesh.ndim}-D mesh; for HSDP pass "
            "hsdp['shard'] as mesh and hsdp['replicate'] as replicate_mesh"
        )
    if replicate_mesh is not None:
        raise NotImplementedError(
            "replicate_mesh (HSDP) is not supported yet; use a 1-D mesh over all ranks"
        )
    if mesh.size() != dist.get_world_size():
        raise ValueError(
            f"mesh has {mesh.size()} ranks but the process group has {dist.get_world_size()}; "
            "a 1-D mesh must span every rank"
        )


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
    """Give every matrix parameter selected by ``predicate`` one owner rank in ``mesh``.

    Call it on every rank, before ``fully_shard``; ``fully_shard`` then skips the dedicated
    parameters. Build :class:`torchtitan_dmuon.Muon` on the same model afterwards.

    Args:
        model: The model (not yet sharded).
        mesh: 1-D device mesh over which owners are spread (FSDP2's mesh, or the DDP group).
        predicate: ``predicate(name, param)`` selects the matrices to dedicate.
        replicate_mesh: HSDP replicate dimension (not supported yet).
        hook_boundary_predicate: ``pred(module_name, module)`` picks the modules whose hooks
            move the dedicated parameters under them (innermost match wins). Default: the
            modules held in an ``nn.ModuleList``/``nn.ModuleDict`` (transformer blocks),
            else the root.
        reshard_after_forward: True (Z3): non-owners free a matrix after forward and receive
            it again before backward. False (Z2): they keep it until after backward, saving
            one broadcast per boundary per step.

    Returns:
        The :class:`Dedication` (also reachable through :func:`get_dedication`).

    Raises:
        ValueError / TypeError / RuntimeError: bad input, always before any collective.
    """
    _validate_mesh(mesh, replicate_mesh)
    if any(isinstance(m, FSDPModule) for m in model.modules()):
        raise RuntimeError(
            "dedicate_params must be called before fully_shard: the model already has "
            "FSDP-wrapped modules"
        )
    if model in _DEDICATIONS:
        raise RuntimeError("dedicate_params was already applied to this model")

    names_of: dict[nn.Parameter, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(p, []).append(name)

    selected: list[tuple[str, nn.Parameter]] = []
    frozen: list[str] = []
    for p, names in names_of.items():
        name = names[0]
        if not predicate(name, p):
            continue
        if len(names) > 1:
            raise ValueError(
                f"parameter {name!r} is shared with {names[1:]} (tied weights) and cannot be "
                "dedicated; exclude it in the predicate"
            )
        if p.ndim != 2:
            raise ValueError(
                f"predicate selected {name!r} of shape {tuple(p.shape)}; only 2-D matrices "
                "can be dedicated"
            )
        if not p.requires_grad:
            frozen.append(name)
            continue
        selected.append((name, p))
    if frozen:
        logger.info("dedicate_params: %d frozen matrices stay out of Muon: %s", len(frozen), frozen)
    if not selected:
        raise ValueError("predicate selected no trainable 2-D parameter")

    if hook_boundary_predicate is None:
        blocks = _default_boundaries(model)

        def candidates(module_name: str, module: nn.Module) -> bool:  # noqa: E306
            return module in blocks
    else:
        candidates = hook_boundary_predicate
    boundary_names: list[str] = []
    boundary_index: dict[str, int] = {}
    per_param_boundary = []
    for name, _ in selected:
        bname = _boundary_of(name, model, candidates)
        if bname not in boundary_index:
            boundary_index[bname] = len(boundary_names)
            boundary_names.append(bname)
        per_param_boundary.append(boundary_index[bname])
    # Boundaries in module (forward) order, so collectives follow one fixed sequence.
    module_order = {m: i for i, m in enumerate(model.modules())}
    order = sorted(
        range(len(boundary_names)),
        key=lambda i: module_order[model.get_submodule(boundary_names[i])],
    )
    remap = {old: new for new, old in enumerate(order)}
    per_param_boundary = [remap[b] for b in per_param_boundary]
    boundary_names = [boundary_names[i] for i in order]

    items = [
        PartitionItem(ns_flops(p.shape, 1), b)
        for (_, p), b in zip(selected, per_param_boundary, strict=True)
    ]
    owners = assign_owners(items, mesh.size())

    boundaries = [Boundary(name=n, module=model.get_submodule(n)) for n in boundary_names]
    for (name, p), b, owner in zip(selected, per_param_boundary, owners, strict=True):
        boundary = boundaries[b]
        unit = next((u for u in boundary.units if u.owner == owner), None)
        if unit is None:
            unit = Unit(owner=owner, params=[])
            boundary.units.append(unit)
        unit.params.append(DedicatedParam(name=name, param=p, owner=owner, boundary=b))
    for boundary in boundaries:
        boundary.units.sort(key=lambda u: u.owner)
        dtypes = {(d.param.dtype, d.param.device) for d in boundary.params}
        if len(dtypes) > 1:
            raise ValueError(
                f"dedicated parameters under boundary {boundary.name!r} mix dtypes/devices {dtypes}"
            )

    dedication = Dedication(model, mesh, boundaries, reshard_after_forward)
    for p in dedication.params:
        mark_dedicated(p)
    _DEDICATIONS[model] = dedication

    from torchtitan_dmuon.engine.hooks import register_hooks

    register_hooks(dedication)
    logger.info(
        "dedicate_params: %d matrices over %d boundaries and %d owners, NS balance %.3f, %s",
        len(dedication.params),
        len(boundaries),
        mesh.size(),
        dedication.balance(),
        "Z3" if reshard_after_forward else "Z2",
    )
    return dedication
