"""The dedication plan: which matrices, under which hook boundary, owned by which slot.

Pure bookkeeping, no collectives: every rank builds the same plan from the same model.

Owners are *slots* ``s`` in ``[0, R * G)`` for an ``R x G`` (replicate, shard) layout (R = 1
without HSDP). Slot ``s`` lives in shard-group *column* ``s % G`` of every replica, and its
*primary* replica is ``s // G``: the column rank of each replica holds the matrix (to serve
the broadcasts of its shard group), and the primary alone keeps the master and momentum
and runs Newton-Schulz.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from torchtitan_dmuon.engine.partition import PartitionItem, assign_owners, load_balance
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
    """A matrix parameter with one owner slot.

    Under tensor parallelism the parameter is a DTensor sharded along one of its two
    dims over a 1-D tensor-parallel mesh; the engine moves and stores its local shard,
    and the owner column's tensor-parallel ranks orthogonalize it together.

    Attributes:
        name: Fully qualified name in the model.
        param: The module's current parameter object (re-bound by name when a
            conversion such as ``to_empty`` registers a new one).
        offset: Its offset in its unit's flat buffer.
    """

    name: str
    param: nn.Parameter
    offset: int = 0

    @property
    def local_shape(self) -> torch.Size:
        """The shape this rank stores (its shard's under tensor parallelism)."""
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

    Attributes:
        boundary: Index of its boundary (forward order).
        column: Shard-group rank that holds the unit in every replica.
        primary_replica: Replicate-group rank of the primary owner.
        params: Its matrices, in model order, with their offsets in the flat buffer.
    """

    boundary: int
    column: int
    primary_replica: int
    params: list[DedicatedParam]

    @property
    def numel(self) -> int:
        return sum(d.numel for d in self.params)


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

    def fingerprint(self, *extra) -> int:
        """A hash of the plan (and of ``extra`` settings); equal on every rank iff they
        agree on it."""
        h = hashlib.sha256(repr((self.shard_size, self.replicate_size, extra)).encode())
        for i, b in enumerate(self.boundaries):
            for u in b.units:
                for d in u.params:
                    key = (i, b.name, d.name, tuple(d.param.shape), u.column, u.primary_replica)
                    h.update(repr(key).encode())
        return int.from_bytes(h.digest()[:7], "little")

    def balance(self) -> float:
        """Max over mean Newton-Schulz load over all ranks (1.0 is perfect)."""
        items, owners = [], []
        for unit in self.units:
            for d in unit.params:
                items.append(PartitionItem(ns_flops(d.param.shape, 1), 0))
                owners.append(unit.primary_replica * self.shard_size + unit.column)
        return load_balance(items, owners, self.shard_size * self.replicate_size)


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
    ``replicate_size * shard_size`` ranks.

    Raises:
        ValueError: one boundary's matrices mix dtypes or devices (one flat buffer each).
    """
    if hook_boundary_predicate is None:
        blocks = default_boundary_modules(model)

        def hook_boundary_predicate(name: str, module: nn.Module) -> bool:
            return module in blocks

    names = [_boundary_name(name, model, hook_boundary_predicate) for name, _ in selected]
    module_order = {module: i for i, module in enumerate(model.modules())}
    boundary_names = sorted(set(names), key=lambda n: module_order[model.get_submodule(n)])
    index = {n: i for i, n in enumerate(boundary_names)}
    items = [
        PartitionItem(ns_flops(p.shape, 1), index[b])
        for (_, p), b in zip(selected, names, strict=True)
    ]
    slots = assign_owners(items, shard_size * replicate_size)

    boundaries = [Boundary(name=n, module=model.get_submodule(n)) for n in boundary_names]
    for (name, p), bname, slot in zip(selected, names, slots, strict=True):
        boundary = boundaries[index[bname]]
        column, replica = slot % shard_size, slot // shard_size
        unit = next(
            (u for u in boundary.units if (u.column, u.primary_replica) == (column, replica)),
            None,
        )
        if unit is None:
            unit = UnitPlan(index[bname], column, replica, params=[])
            boundary.units.append(unit)
        unit.params.append(DedicatedParam(name=name, param=p))
    for boundary in boundaries:
        boundary.units.sort(key=lambda u: (u.primary_replica, u.column))
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
