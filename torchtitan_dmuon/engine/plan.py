"""The dedication plan: which matrices, under which hook boundary, owned by which slot.

Pure bookkeeping, no collectives: every rank builds the same plan from the same model.

Owners are *slots* ``s`` in ``[0, R * G)`` for an ``R x G`` (replicate, shard) layout (R = 1
without HSDP). Slot ``s`` lives in shard-group *column* ``s % G`` of every replica, and its
*primary* replica is ``s // G``: the column rank of each replica holds the matrix (to serve
the broadcasts of its shard group), and the primary alone keeps the master and momentum
and runs Newton-Schulz.

A 3-D stack of matrices (a layer's MoE experts) is split along dim 0 into up to one
contiguous group of experts per slot, each group a *piece* with an owner of its own; the
model still sees one stacked parameter.

Under expert parallelism one plan has two *domains*: the dense matrices are dedicated over
the whole data-parallel layout (domain 0), and each rank's local experts (a stack sharded
along dim 0 over the ``ep`` mesh) over the ranks that hold the same experts (domain 1: the
``efsdp`` group, and the replicate group under HSDP). Every ``ep`` group has the same
expert layout, so one plan describes them all; the owners of both domains are balanced
together, per data-parallel rank. Stacks split over the tensor-parallel ranks (expert
tensor parallelism, or TP without expert parallelism) are dedicated the same way, each
piece in TP shards; without expert parallelism the experts' domain spans the dense one's
ranks.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from torchtitan_dmuon.engine.partition import (
    PartitionItem,
    assign_owners,
    expert_ranges,
    max_over_mean,
    rank_loads,
)
from torchtitan_dmuon.optim.newton_schulz import ns_flops

__all__ = [
    "Boundary",
    "BoundaryPredicate",
    "DedicatedParam",
    "Domain",
    "Plan",
    "UnitPlan",
    "build_plan",
    "default_boundary_modules",
    "expert_parallel_coordinates",
    "expert_tensor_parallel_dim",
    "is_expert_parallel",
    "local_tensor",
]

BoundaryPredicate = Callable[[str, nn.Module], bool]


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (a tensor-parallel matrix), else ``tensor`` itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _expert_mesh_dims(tensor: torch.Tensor) -> tuple[int | None, int | None] | None:
    """``(ep, etp)``: the mesh dims of a stack of routed experts laid out as TorchTitan's
    MoE styles do (None where it has no such dim), or None for any other tensor.

    ``ExpertParallel`` shards the experts (dim 0) over ``ep``; expert tensor parallelism
    also splits each expert's matrix along its rows or columns over ``etp``; without
    expert parallelism TorchTitan's ``TensorParallel`` splits them over the TP mesh alone
    (every rank holds every expert, in TP shards).
    """
    if not isinstance(tensor, DTensor) or tensor.ndim != 3:
        return None
    placements = tuple(tensor.placements)
    split = (Shard(1), Shard(2))
    if placements == (Shard(0),):
        return 0, None
    if len(placements) == 1 and placements[0] in split:
        return None, 0
    if len(placements) == 2 and placements[0] == Shard(0) and placements[1] in split:
        return 0, 1
    return None


def is_expert_parallel(tensor: torch.Tensor) -> bool:
    """A stack of routed experts sharded over an ``ep`` mesh, an ``etp`` mesh or both (see
    :func:`expert_parallel_coordinates`): dedicated in pieces of this rank's local
    experts over the ranks that hold the same experts."""
    return _expert_mesh_dims(tensor) is not None


def expert_parallel_coordinates(tensor: DTensor) -> tuple[int, int, int, int]:
    """``(ep rank, ep size, etp rank, etp size)`` of an expert stack (0, 1 for a mesh dim
    it does not have: ep without expert parallelism, etp without tensor parallelism)."""
    mesh = tensor.device_mesh

    def coordinates(dim: int | None) -> tuple[int, int]:
        return (0, 1) if dim is None else (mesh.get_local_rank(dim), mesh.size(dim))

    ep, etp = _expert_mesh_dims(tensor)
    return (*coordinates(ep), *coordinates(etp))


def expert_tensor_parallel_dim(tensor: DTensor) -> int | None:
    """The mesh dim an expert stack's matrices are split over (``etp``, or the TP mesh
    without expert parallelism), or None when they are whole."""
    return _expert_mesh_dims(tensor)[1]


@dataclass(eq=False)
class DedicatedParam:
    """A matrix parameter, or a piece of a 3-D stack, with one owner slot.

    Under tensor parallelism the parameter is a DTensor sharded along one of its two
    dims over a 1-D tensor-parallel mesh; the engine moves and stores its local shard,
    and the owner column's tensor-parallel ranks orthogonalize it together. One
    replicated over that mesh is whole on every TP rank (each steps it alike). Under expert
    parallelism it is a stack sharded along dim 0 over the ``ep`` mesh, always dedicated
    in pieces of this rank's local experts.

    Attributes:
        name: Fully qualified name in the model.
        param: The module's current parameter object (re-bound by name when a
            conversion such as ``to_empty`` registers a new one).
        experts: For a piece of a stack split among owners, its ``[start, stop)`` along
            dim 0 of the local stack; None for a whole parameter.
        offset: Its offset in its unit's layout (see :class:`UnitPlan`).
    """

    name: str
    param: nn.Parameter
    experts: tuple[int, int] | None = None
    offset: int = 0

    @property
    def shape(self) -> torch.Size:
        """The shape of what this entry dedicates (a piece's, for a split stack)."""
        if self.experts is None:
            return self.param.shape
        start, stop = self.experts
        return torch.Size((stop - start, *self.param.shape[1:]))

    @property
    def local_shape(self) -> torch.Size:
        """The shape this rank stores (its shard's under tensor parallelism)."""
        local = local_tensor(self.param).shape
        if self.experts is None:
            return local
        start, stop = self.experts
        return torch.Size((stop - start, *local[1:]))

    @property
    def numel(self) -> int:
        return math.prod(self.local_shape)

    @property
    def split_dim(self) -> int | None:
        """Under tensor parallelism, the dim it is split along (-2 rows, -1 columns)."""
        if not isinstance(self.param, DTensor):
            return None
        if is_expert_parallel(self.param):  # split only under (expert) tensor parallelism
            etp = expert_tensor_parallel_dim(self.param)
            return None if etp is None else self.param.placements[etp].dim - 3
        placement = self.param.placements[0]
        # Replicated over the tensor-parallel ranks (TorchTitan's NoParallel): whole.
        return placement.dim - self.param.ndim if isinstance(placement, Shard) else None

    def experts_of(self, ep_rank: int) -> tuple[int, int]:
        """A piece's ``[start, stop)`` in the whole stack as ``ep_rank`` holds it (after
        the experts of the lower ``ep`` ranks; ``experts`` itself without expert
        parallelism)."""
        first = ep_rank * local_tensor(self.param).shape[0]
        return self.experts[0] + first, self.experts[1] + first

    @property
    def global_experts(self) -> tuple[int, int] | None:
        """This rank's piece's ``[start, stop)`` in the whole stack."""
        if self.experts is None or not is_expert_parallel(self.param):
            return self.experts
        return self.experts_of(expert_parallel_coordinates(self.param)[0])


@dataclass(eq=False)
class UnitPlan:
    """The matrices of one boundary that share an owner slot: one collective each way.

    Its layout (of masters, gradients and reduce buckets) puts the whole matrices first,
    in model order, then the pieces of split stacks.

    Attributes:
        boundary: Index of its boundary (forward order).
        column: Shard-group rank that holds the unit in every replica.
        primary_replica: Replicate-group rank of the primary owner.
        params: Its matrices and pieces, in layout order, with their offsets.
        domain: Its dedication domain (0: dense, 1: the local experts under expert
            parallelism); ``column`` and ``primary_replica`` are that domain's.
    """

    boundary: int
    column: int
    primary_replica: int
    params: list[DedicatedParam]
    domain: int = 0

    @property
    def numel(self) -> int:
        return sum(d.numel for d in self.params)

    @property
    def whole_numel(self) -> int:
        """Elements of its whole matrices (the layout's first part)."""
        return sum(d.numel for d in self.params if d.experts is None)


@dataclass(eq=False)
class Boundary:
    """A module whose hooks move the dedicated parameters beneath it.

    Attributes:
        name: Module name in the model ("" for the root).
        module: The module.
        units: One unit per owner slot among its matrices, in slot order.
    """

    name: str
    module: nn.Module
    units: list[UnitPlan] = field(default_factory=list)

    @property
    def params(self) -> Iterator[DedicatedParam]:
        for unit in self.units:
            yield from unit.params

    @property
    def parameters(self) -> list[nn.Parameter]:
        """Its parameters, each once (a split stack has a piece in several units)."""
        return list({id(d.param): d.param for d in self.params}.values())


@dataclass(frozen=True)
class Domain:
    """The ``replicate_size x shard_size`` layout one kind of matrix is dedicated over
    (owner slots ``s = replica * shard_size + column``)."""

    shard_size: int
    replicate_size: int

    @property
    def slots(self) -> int:
        return self.shard_size * self.replicate_size


@dataclass(eq=False)
class Plan:
    """Boundaries in forward order over one or two domains.

    Attributes:
        boundaries: The hook boundaries, in forward order.
        domains: The dense domain, then (under expert parallelism) the experts'.
        expert_columns: Under expert parallelism, the experts' column (``efsdp`` rank)
            of each dense column (shard-group rank).
    """

    boundaries: list[Boundary]
    domains: list[Domain]
    expert_columns: list[int] | None = None

    @property
    def shard_size(self) -> int:
        return self.domains[0].shard_size

    @property
    def replicate_size(self) -> int:
        return self.domains[0].replicate_size

    @property
    def units(self) -> list[UnitPlan]:
        return [u for b in self.boundaries for u in b.units]

    @property
    def params(self) -> list[DedicatedParam]:
        return [d for b in self.boundaries for d in b.params]

    @property
    def slots(self) -> int:
        """Data-parallel ranks (the dense domain's slots)."""
        return self.domains[0].slots

    def rank_slots(self, unit: UnitPlan, primary: bool) -> list[int]:
        """The data-parallel ranks (dense slots) that hold ``unit`` (its column in every
        replica) or, with ``primary``, are its primary owner. An expert unit has one such
        rank per ``ep`` group: each holds the same piece of its own local experts."""
        if unit.domain == 0:
            columns = [unit.column]
        else:
            columns = [f for f, e in enumerate(self.expert_columns) if e == unit.column]
        replicas = [unit.primary_replica] if primary else range(self.replicate_size)
        return [r * self.shard_size + f for r in replicas for f in columns]

    def fingerprint(self, *extra) -> int:
        """A hash of the plan (and of ``extra`` settings); equal on every rank iff they
        agree on it."""
        h = hashlib.sha256(repr((self.domains, self.expert_columns, extra)).encode())
        for i, b in enumerate(self.boundaries):
            for u in b.units:
                for d in u.params:
                    key = (i, b.name, d.name, tuple(d.param.shape), d.experts)
                    key += (u.domain, u.column, u.primary_replica)
                    h.update(repr(key).encode())
        return int.from_bytes(h.digest()[:7], "little")

    def ns_loads(self, domain: int | None = None) -> list[int]:
        """Newton-Schulz cost per data-parallel rank (of one domain's units, or all)."""
        load = [0] * self.slots
        for unit in self.units:
            if domain is None or unit.domain == domain:
                cost = sum(ns_flops(d.shape, 1) for d in unit.params)
                for s in self.rank_slots(unit, primary=True):
                    load[s] += cost
        return load

    def balance(self, domain: int | None = None) -> float:
        """Max over mean Newton-Schulz load over all ranks (1.0 is perfect)."""
        return max_over_mean(self.ns_loads(domain))

    def held_bytes(self, value_bytes: int, state_bytes: int) -> list[int]:
        """Bytes each data-parallel rank (slot order) keeps between steps for dedicated
        matrices: the values of every unit of its column (``value_bytes`` per element)
        and the state of the units it is the primary of (``state_bytes`` per element:
        momentum, and a master under mixed precision)."""
        held = [0] * self.slots
        for unit in self.units:
            for s in self.rank_slots(unit, primary=False):
                held[s] += unit.numel * value_bytes
            for s in self.rank_slots(unit, primary=True):
                held[s] += unit.numel * state_bytes
        return held


def default_boundary_modules(model: nn.Module) -> set[nn.Module]:
    """Blocks: modules held in an ``nn.ModuleList``/``nn.ModuleDict`` (what
    ``fully_shard`` is applied to in TorchTitan and most training scripts)."""
    blocks = set()
    for module in model.modules():
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            blocks.update(module.children())
    return blocks


def _boundary_name(param_name: str, model: nn.Module, accepts: BoundaryPredicate) -> str:
    """The innermost ancestor module of ``param_name`` that ``accepts`` ("" for the root
    when none does)."""
    parts = param_name.split(".")[:-1]
    for depth in range(len(parts), 0, -1):
        module_name = ".".join(parts[:depth])
        if accepts(module_name, model.get_submodule(module_name)):
            return module_name
    return ""


def build_plan(
    model: nn.Module,
    selected: list[tuple[str, nn.Parameter]],
    *,
    shard_size: int,
    replicate_size: int,
    hook_boundary_predicate: BoundaryPredicate | None,
    expert_shard_size: int | None = None,
    expert_columns: Sequence[int] | None = None,
) -> Plan:
    """Group the selected matrices by boundary and owner slot.

    Boundaries come in module (forward) order, so that collectives follow one fixed
    sequence on every rank; slots come from one LPT partition per domain over its
    ``replicate_size * shard_size`` slots, in which each 3-D stack (not tensor-parallel)
    takes part as ``min(stack size, slots)`` pieces of contiguous experts on different
    slots. Under expert parallelism (``expert_shard_size``, ``expert_columns``: see
    :class:`Plan`) the local experts are placed first and the dense matrices then start
    from the load each rank already has.

    Raises:
        ValueError: one boundary's matrices mix dtypes or devices (one flat buffer
            each), or expert-parallel stacks come without the experts' layout.
    """
    if hook_boundary_predicate is None:
        blocks = default_boundary_modules(model)

        def hook_boundary_predicate(name: str, module: nn.Module) -> bool:
            return module in blocks

    names = {name: _boundary_name(name, model, hook_boundary_predicate) for name, _ in selected}
    module_order = {module: i for i, module in enumerate(model.modules())}
    boundary_names = sorted(set(names.values()), key=lambda n: module_order[model.get_submodule(n)])
    index = {n: i for i, n in enumerate(boundary_names)}
    domains = [Domain(shard_size, replicate_size)]
    if any(is_expert_parallel(p) for _, p in selected):
        if expert_shard_size is None or expert_columns is None:
            raise ValueError(
                "expert-parallel stacks need the experts' layout (expert_shard_size and "
                "expert_columns)"
            )
        domains.append(Domain(expert_shard_size, replicate_size))
        expert_columns = list(expert_columns)
    entries: list[list[DedicatedParam]] = [[] for _ in domains]
    items: list[list[PartitionItem]] = [[] for _ in domains]
    for stack, (name, p) in enumerate(selected):
        domain = 1 if is_expert_parallel(p) else 0
        experts = local_tensor(p).shape[0] if p.ndim == 3 else 0
        if domain == 1 or (p.ndim == 3 and not isinstance(p, DTensor) and experts > 1):
            ranges = expert_ranges(experts, min(experts, domains[domain].slots))
            entries[domain] += [DedicatedParam(name=name, param=p, experts=r) for r in ranges]
            items[domain] += [
                PartitionItem(ns_flops((stop - start, *p.shape[1:]), 1), index[names[name]], stack)
                for start, stop in ranges
            ]
        else:
            entries[domain].append(DedicatedParam(name=name, param=p))
            items[domain].append(PartitionItem(ns_flops(p.shape, 1), index[names[name]]))
    slots: list[list[int]] = [[], []]
    initial_load = None
    if len(domains) == 2:
        slots[1] = assign_owners(items[1], domains[1].slots)
        expert_load = rank_loads(items[1], slots[1], domains[1].slots)
        initial_load = [
            expert_load[(s // shard_size) * expert_shard_size + expert_columns[s % shard_size]]
            for s in range(domains[0].slots)
        ]
    slots[0] = assign_owners(items[0], domains[0].slots, initial_load)

    boundaries = [Boundary(name=n, module=model.get_submodule(n)) for n in boundary_names]
    for domain, layout in enumerate(domains):
        for entry, slot in zip(entries[domain], slots[domain], strict=True):
            bname = names[entry.name]
            boundary = boundaries[index[bname]]
            key = (domain, slot // layout.shard_size, slot % layout.shard_size)
            unit = next(
                (u for u in boundary.units if (u.domain, u.primary_replica, u.column) == key),
                None,
            )
            if unit is None:
                unit = UnitPlan(index[bname], key[2], key[1], params=[], domain=domain)
                boundary.units.append(unit)
            unit.params.append(entry)
    for boundary in boundaries:
        boundary.units.sort(key=lambda u: (u.domain, u.primary_replica, u.column))
        for unit in boundary.units:  # whole matrices first (stable: model order)
            unit.params.sort(key=lambda d: d.experts is not None)
        kinds = {(d.param.dtype, d.param.device.type) for d in boundary.params}
        if len(kinds) > 1:
            raise ValueError(
                f"dedicated parameters under boundary {boundary.name!r} mix dtypes/devices "
                f"{sorted(map(str, kinds))}"
            )
        for unit in boundary.units:
            offset = 0
            for d in unit.params:
                d.offset = offset
                offset += d.numel
    return Plan(boundaries, domains, expert_columns if len(domains) == 2 else None)
