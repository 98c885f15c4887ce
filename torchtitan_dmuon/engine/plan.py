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
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from torchtitan_dmuon.engine.partition import (
    PartitionItem,
    assign_owners,
    expert_ranges,
    load_balance,
)
from torchtitan_dmuon.optim.newton_schulz import ns_flops

__all__ = [
    "Boundary",
    "BoundaryPredicate",
    "DedicatedParam",
    "Plan",
    "UnitPlan",
    "build_plan",
    "default_boundary_modules",
    "local_tensor",
]

BoundaryPredicate = Callable[[str, nn.Module], bool]


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (a tensor-parallel matrix), else ``tensor`` itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


@dataclass(eq=False)
class DedicatedParam:
    """A matrix parameter, or a piece of a 3-D stack, with one owner slot.

    Under tensor parallelism the parameter is a DTensor sharded along one of its two
    dims over a 1-D tensor-parallel mesh; the engine moves and stores its local shard,
    and the owner column's tensor-parallel ranks orthogonalize it together.

    Attributes:
        name: Fully qualified name in the model.
        param: The module's current parameter object (re-bound by name when a
            conversion such as ``to_empty`` registers a new one).
        experts: For a piece of a stack split among owners, its ``[start, stop)`` along
            dim 0; None for a whole parameter.
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
        if self.experts is not None:
            return self.shape
        return local_tensor(self.param).shape

    @property
    def numel(self) -> int:
        return math.prod(self.local_shape)

    @property
    def split_dim(self) -> int | None:
        """Under tensor parallelism, the dim it is split along (-2 rows, -1 columns)."""
        if not isinstance(self.param, DTensor):
            return None
        return self.param.placements[0].dim - self.param.ndim


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
    """

    boundary: int
    column: int
    primary_replica: int
    params: list[DedicatedParam]

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


@dataclass(eq=False)
class Plan:
    """Boundaries in forward order over a ``replicate_size x shard_size`` layout."""

    boundaries: list[Boundary]
    shard_size: int
    replicate_size: int

    @property
    def units(self) -> list[UnitPlan]:
        return [u for b in self.boundaries for u in b.units]

    @property
    def params(self) -> list[DedicatedParam]:
        return [d for b in self.boundaries for d in b.params]

    @property
    def slots(self) -> int:
        return self.shard_size * self.replicate_size

    def fingerprint(self, *extra) -> int:
        """A hash of the plan (and of ``extra`` settings); equal on every rank iff they
        agree on it."""
        h = hashlib.sha256(repr((self.shard_size, self.replicate_size, extra)).encode())
        for i, b in enumerate(self.boundaries):
            for u in b.units:
                for d in u.params:
                    key = (i, b.name, d.name, tuple(d.param.shape), d.experts)
                    key += (u.column, u.primary_replica)
                    h.update(repr(key).encode())
        return int.from_bytes(h.digest()[:7], "little")

    def balance(self) -> float:
        """Max over mean Newton-Schulz load over all ranks (1.0 is perfect)."""
        items, owners = [], []
        for unit in self.units:
            for d in unit.params:
                items.append(PartitionItem(ns_flops(d.shape, 1), 0))
                owners.append(unit.primary_replica * self.shard_size + unit.column)
        return load_balance(items, owners, self.slots)

    def held_bytes(self, value_bytes: int, state_bytes: int) -> list[int]:
        """Bytes each rank (slot order) keeps between steps for dedicated matrices: the
        values of every unit of its column (``value_bytes`` per element) and the state of
        the units it is the primary of (``state_bytes`` per element: momentum, and a
        master under mixed precision)."""
        column = [0] * self.shard_size
        own = [0] * self.slots
        for unit in self.units:
            column[unit.column] += unit.numel
            own[unit.primary_replica * self.shard_size + unit.column] += unit.numel
        return [
            column[s % self.shard_size] * value_bytes + own[s] * state_bytes
            for s in range(self.slots)
        ]


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
) -> Plan:
    """Group the selected matrices by boundary and owner slot.

    Boundaries come in module (forward) order, so that collectives follow one fixed
    sequence on every rank; slots come from one global LPT partition over all
    ``replicate_size * shard_size`` ranks, in which each 3-D stack (not tensor-parallel)
    takes part as ``min(stack size, slots)`` pieces of contiguous experts on different
    slots.

    Raises:
        ValueError: one boundary's matrices mix dtypes or devices (one flat buffer each).
    """
    if hook_boundary_predicate is None:
        blocks = default_boundary_modules(model)

        def hook_boundary_predicate(name: str, module: nn.Module) -> bool:
            return module in blocks

    names = {name: _boundary_name(name, model, hook_boundary_predicate) for name, _ in selected}
    module_order = {module: i for i, module in enumerate(model.modules())}
    boundary_names = sorted(set(names.values()), key=lambda n: module_order[model.get_submodule(n)])
    index = {n: i for i, n in enumerate(boundary_names)}
    num_slots = shard_size * replicate_size
    entries, items = [], []
    for stack, (name, p) in enumerate(selected):
        if p.ndim == 3 and not isinstance(p, DTensor) and p.shape[0] > 1:
            ranges = expert_ranges(p.shape[0], min(p.shape[0], num_slots))
            entries += [DedicatedParam(name=name, param=p, experts=r) for r in ranges]
            items += [
                PartitionItem(ns_flops((stop - start, *p.shape[1:]), 1), index[names[name]], stack)
                for start, stop in ranges
            ]
        else:
            entries.append(DedicatedParam(name=name, param=p))
            items.append(PartitionItem(ns_flops(p.shape, 1), index[names[name]]))
    slots = assign_owners(items, num_slots)

    boundaries = [Boundary(name=n, module=model.get_submodule(n)) for n in boundary_names]
    for entry, slot in zip(entries, slots, strict=True):
        bname = names[entry.name]
        boundary = boundaries[index[bname]]
        column, replica = slot % shard_size, slot // shard_size
        unit = next(
            (u for u in boundary.units if (u.column, u.primary_replica) == (column, replica)),
            None,
        )
        if unit is None:
            unit = UnitPlan(index[bname], column, replica, params=[])
            boundary.units.append(unit)
        unit.params.append(entry)
    for boundary in boundaries:
        boundary.units.sort(key=lambda u: (u.primary_replica, u.column))
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
    return Plan(boundaries, shard_size, replicate_size)
