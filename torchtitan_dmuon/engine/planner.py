"""Building the dedication plan: boundaries in forward order, owners from one LPT
partition per domain (see :mod:`~torchtitan_dmuon.engine.plan` for what a plan is)."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from torchtitan_dmuon.engine.param_layout import LayoutKind, ParamLayout, kind_of, local_tensor
from torchtitan_dmuon.engine.partition import (
    PartitionItem,
    assign_owners,
    expert_ranges,
    rank_loads,
)
from torchtitan_dmuon.engine.plan import Boundary, DedicatedParam, Domain, Plan, UnitPlan
from torchtitan_dmuon.engine.selection import (
    BoundaryPredicate,
    boundary_name,
    default_boundary_modules,
)
from torchtitan_dmuon.optim.newton_schulz import ns_flops

__all__ = ["build_plan"]


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

    names = {name: boundary_name(name, model, hook_boundary_predicate) for name, _ in selected}
    module_order = {module: i for i, module in enumerate(model.modules())}
    boundary_names = sorted(set(names.values()), key=lambda n: module_order[model.get_submodule(n)])
    index = {n: i for i, n in enumerate(boundary_names)}
    kinds = [kind_of(p) for _, p in selected]
    domains = [Domain(shard_size, replicate_size)]
    expert_parallel = LayoutKind.EXPERT_PIECE in kinds
    if expert_parallel:
        if expert_shard_size is None or expert_columns is None:
            raise ValueError(
                "expert-parallel stacks need the experts' layout (expert_shard_size and "
                "expert_columns)"
            )
        domains.append(Domain(expert_shard_size, replicate_size))
        expert_columns = list(expert_columns)
    entries: list[list[DedicatedParam]] = [[] for _ in domains]
    items: list[list[PartitionItem]] = [[] for _ in domains]
    for stack, ((name, p), kind) in enumerate(zip(selected, kinds, strict=True)):
        domain = 1 if kind is LayoutKind.EXPERT_PIECE else 0
        if kind in (LayoutKind.STACK_PIECE, LayoutKind.EXPERT_PIECE):
            experts = local_tensor(p).shape[0]
            for r in expert_ranges(experts, min(experts, domains[domain].slots)):
                layout = ParamLayout.of(p, r)
                entries[domain].append(DedicatedParam(name, p, layout))
                items[domain].append(
                    PartitionItem(ns_flops(layout.shape, 1), index[names[name]], stack)
                )
        else:
            entries[domain].append(DedicatedParam(name, p, ParamLayout.of(p)))
            items[domain].append(PartitionItem(ns_flops(p.shape, 1), index[names[name]]))
    slots: list[list[int]] = [[], []]
    initial_load = None
    if expert_parallel:
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
            unit.params.sort(key=lambda d: d.layout.is_piece)
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
    return Plan(boundaries, domains, expert_columns if expert_parallel else None)
