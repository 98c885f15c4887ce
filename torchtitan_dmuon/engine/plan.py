"""The dedication plan: which matrices, under which hook boundary, owned by which slot.

Pure bookkeeping (no collectives): every rank builds the same plan from the same model.

Owners are *slots* ``s`` in ``[0, R * G)`` for an ``R x G`` (replicate, shard) layout (R = 1
without HSDP). Slot ``s`` lives in shard-group *column* ``s % G`` of every replica, and its
*primary* replica is ``s // G``: the column rank of each replica holds the matrix (to serve
the broadcasts of its shard group), and the primary alone keeps the master and momentum
and runs Newton-Schulz.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from torchtitan_dmuon.engine.partition import PartitionItem, assign_owners
from torchtitan_dmuon.optim.newton_schulz import ns_flops

__all__ = ["Boundary", "DedicatedParam", "Unit", "build_plan", "default_boundary_modules"]

BoundaryPredicate = Callable[[str, nn.Module], bool]


@dataclass(eq=False)
class DedicatedParam:
    """A matrix parameter with one owner slot.

    Attributes:
        name: Fully qualified name in the model.
        param: The module's parameter (the same object before and after dedication).
        offset: Its offset in its unit's flat buffer.
    """

    name: str
    param: nn.Parameter
    offset: int = 0


@dataclass(eq=False)
class Unit:
    """The matrices of one boundary that share an owner slot: one collective each way.

    Attributes:
        column: Shard-group rank that holds the unit in every replica.
        replica: Replicate-group rank of the primary owner.
        params: Its matrices, in model order.
        flat: One contiguous buffer (compute dtype) that the parameters are views of; its
            storage is freed on ranks outside the column between uses.
        master: Primary only, under mixed precision: the full-precision values.
        master_dtype: Dtype of the master values (the parameters' own dtype).
        reduce_dtype: Dtype gradients are reduced in.
        replica_work: In-flight asynchronous broadcast of new values across replicas.
    """

    column: int
    replica: int
    params: list[DedicatedParam]
    flat: torch.Tensor | None = None
    master: torch.Tensor | None = None
    master_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    replica_work: object | None = None

    @property
    def numel(self) -> int:
        return sum(d.param.numel() for d in self.params)

    def view(self, buffer: torch.Tensor, d: DedicatedParam) -> torch.Tensor:
        """``d``'s slice of a buffer laid out like ``flat``."""
        return buffer[d.offset : d.offset + d.param.numel()].view(d.param.shape)

    def master_view(self, d: DedicatedParam) -> torch.Tensor:
        """The full-precision value the optimizer updates (the parameter itself without
        mixed precision)."""
        return d.param.data if self.master is None else self.view(self.master, d)


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
    units: list[Unit] = field(default_factory=list)

    @property
    def params(self) -> Iterator[DedicatedParam]:
        for unit in self.units:
            yield from unit.params


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
) -> list[Boundary]:
    """Group the selected matrices by boundary and owner slot.

    Boundaries come in module (forward) order, so that collectives follow one fixed
    sequence on every rank; slots come from one global LPT partition over all
    ``replicate_size * shard_size`` ranks.
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
        unit = next((u for u in boundary.units if (u.column, u.replica) == (column, replica)), None)
        if unit is None:
            unit = Unit(column=column, replica=replica, params=[])
            boundary.units.append(unit)
        unit.params.append(DedicatedParam(name=name, param=p))
    for boundary in boundaries:
        boundary.units.sort(key=lambda u: (u.replica, u.column))
        kinds = {(d.param.dtype, d.param.device.type) for d in boundary.params}
        if len(kinds) > 1:
            raise ValueError(
                f"dedicated parameters under boundary {boundary.name!r} mix dtypes/devices "
                f"{sorted(map(str, kinds))}"
            )
    return boundaries
