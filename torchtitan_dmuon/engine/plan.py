"""The dedication plan: which parameters, under which hook boundary, owned by which slot.

Pure bookkeeping, no collectives: every rank builds the same plan from the same model. In
order: which parameters Muon takes (one rule set for ``dedicate_params`` and one-process
Muon) and the modules whose hooks move them; the owner assignment; what a plan is; how it
is built; and the balance it reaches.

Owners are *slots* ``s`` in ``[0, R * G)`` for an ``R x G`` (replicate, shard) layout (R = 1
without HSDP). Slot ``s`` lives in shard-group *column* ``s % G`` of every replica, and its
*primary* replica is ``s // G``: the column rank of each replica holds the matrix (to serve
the broadcasts of its shard group), and the primary alone keeps the master and momentum
and runs Newton-Schulz.

Owners come from a greedy longest-processing-time (LPT) partition over the Newton-Schulz
cost, with one twist: a boundary's matrices go to different owners first, so that the
broadcasts that materialize one block come from several sources at once; and the pieces
of one 3-D stack (groups of MoE experts) go to different owners, so that one rank never
holds a whole layer's experts. Pure Python, deterministic.

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
import logging
import math
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from torchtitan_dmuon.engine.machine import DEFAULT_GPU, GPU
from torchtitan_dmuon.engine.param_layout import (
    LayoutKind,
    ParamLayout,
    dedication_domain,
    kind_of,
    local_tensor,
    split_among_owners,
)
from torchtitan_dmuon.optim.fused_rows import fused_rows_of
from torchtitan_dmuon.optim.newton_schulz import ns_flops, split_ns_flops
from torchtitan_dmuon.optim.normuon import second_moment_shape
from torchtitan_dmuon.optim.sharded_ns import split_ns_bytes

__all__ = [
    "VIEW_ALIGNMENT",
    "Boundary",
    "BoundaryPredicate",
    "DedicatedParam",
    "Domain",
    "HeldDtypes",
    "PartitionItem",
    "Plan",
    "Predicate",
    "UnitPlan",
    "assign_owners",
    "boundary_name",
    "build_plan",
    "default_boundary_modules",
    "expert_ranges",
    "plan_with_groups",
    "max_over_mean",
    "rank_loads",
    "select_matrices",
]

logger = logging.getLogger(__name__)

Predicate = Callable[[str, nn.Parameter], bool]
BoundaryPredicate = Callable[[str, nn.Module], bool]

VIEW_ALIGNMENT = 16
"""Every matrix and piece starts at a multiple of this many elements of its unit's
layout: 16 bytes in the narrowest dtype a unit's buffer can have (1-byte float8 values),
a multiple of 16 in the wider ones (bf16 values, fp32 masters and gradients), so every
view of a buffer is as aligned as the buffer (any allocation is). cuBLAS wants 16-byte
aligned operands and Inductor copies inputs that are not; a matrix whose size is not a
multiple of 8 elements would otherwise misalign every bf16 view after it. The padding is
zeros, and it travels with the buffers."""


def default_boundary_modules(model: nn.Module) -> set[nn.Module]:
    """Blocks: modules held in an ``nn.ModuleList``/``nn.ModuleDict`` (what
    ``fully_shard`` is applied to in TorchTitan and most training scripts)."""
    blocks = set()
    for module in model.modules():
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            blocks.update(module.children())
    return blocks


def boundary_name(param_name: str, model: nn.Module, accepts: BoundaryPredicate) -> str:
    """The innermost ancestor module of ``param_name`` that ``accepts`` ("" for the root
    when none does)."""
    parts = param_name.split(".")[:-1]
    for depth in range(len(parts), 0, -1):
        module_name = ".".join(parts[:depth])
        if accepts(module_name, model.get_submodule(module_name)):
            return module_name
    return ""


def _embedding_like(model: nn.Module) -> dict[int, str]:
    """Parameters that Muon should not take: token embeddings, and output heads (a linear
    layer outside the blocks that maps to a vocabulary an embedding also has)."""
    found: dict[int, str] = {}
    vocabularies = set()
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            found[id(module.weight)] = "an embedding"
            vocabularies.add(module.num_embeddings)
    in_blocks = {id(m) for block in default_boundary_modules(model) for m in block.modules()}
    for module in model.modules():
        if (
            isinstance(module, nn.Linear)
            and id(module) not in in_blocks
            and module.out_features in vocabularies
        ):
            found.setdefault(id(module.weight), "an output head")
    return found


def select_matrices(model: nn.Module, predicate: Predicate) -> list[tuple[str, nn.Parameter]]:
    """The trainable parameters ``predicate(name, param)`` selects, as ``(name, param)``.

    Every selected parameter must be a 2-D matrix or a 3-D stack of matrices (MoE
    experts) and have one name (tied weights cannot have one owner per use). Frozen
    matches are left out with a log line; embeddings and output heads are accepted with
    a warning (Muon is meant for hidden matrices).

    Raises:
        ValueError: a selected parameter is tied or not a matrix.
    """
    names_of: dict[int, list[str]] = {}
    params: dict[int, nn.Parameter] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(p), []).append(name)
        params[id(p)] = p
    embedding_like = _embedding_like(model)
    selected, frozen = [], []
    for key, names in names_of.items():
        name, p = names[0], params[key]
        if not predicate(name, p):
            continue
        if len(names) > 1:
            raise ValueError(
                f"parameter {name!r} is shared with {names[1:]} (tied weights) and cannot be "
                "given to Muon; exclude it in the predicate"
            )
        if p.ndim not in (2, 3):
            raise ValueError(
                f"predicate selected {name!r} of shape {tuple(p.shape)}; only 2-D matrices "
                "and 3-D stacks of matrices (MoE experts) can be given to Muon"
            )
        if not p.requires_grad:
            frozen.append(name)
            continue
        if key in embedding_like:
            logger.warning(
                "Muon was given %r, which looks like %s: Muon is meant for hidden matrices; "
                "embeddings and output heads usually train better with AdamW",
                name,
                embedding_like[key],
            )
        selected.append((name, p))
    if frozen:
        logger.info("Muon: %d frozen matrices left out: %s", len(frozen), frozen)
    return selected


# ---- owners ----------------------------------------------------------------------


@dataclass(frozen=True)
class PartitionItem:
    """One matrix to place.

    Attributes:
        cost: Its Newton-Schulz cost (FLOPs; only ratios matter).
        boundary: Index of the hook boundary it belongs to.
        stack: For a piece of a 3-D stack split among owners, an index shared by the
            stack's pieces only (no two of them get the same owner); None otherwise.
    """

    cost: int
    boundary: int
    stack: int | None = None


def expert_ranges(experts: int, pieces: int) -> list[tuple[int, int]]:
    """``[start, stop)`` of ``pieces`` contiguous groups of ``experts`` matrices whose
    sizes differ by at most one (larger first)."""
    if not 1 <= pieces <= experts:
        raise ValueError(f"cannot split {experts} experts into {pieces} pieces")
    size, extra = divmod(experts, pieces)
    ranges, start = [], 0
    for i in range(pieces):
        stop = start + size + (i < extra)
        ranges.append((start, stop))
        start = stop
    return ranges


def assign_owners(
    items: Sequence[PartitionItem],
    num_ranks: int,
    initial_load: Sequence[int] | None = None,
) -> list[int]:
    """Give each item an owner rank in ``[0, num_ranks)``.

    Items are taken by decreasing cost (ties: input order). Each goes to the rank that
    holds the fewest items of its boundary so far, and among those to the least loaded
    rank (ties: lowest rank); a stack's piece only to a rank without a piece of that
    stack. Spreading a boundary first leaves the busiest rank up to ~9% above a plain
    longest-first plan (4 ranks, Llama-3 proportions), so :func:`_swap_down` then swaps
    items of one boundary between the busiest rank and another while that lowers it:
    each rank keeps its count of every boundary's items. ``initial_load`` is each rank's
    cost before these items (what it already owns in another dedication domain).

    Raises:
        ValueError: a stack has more pieces than there are ranks.

    Returns:
        ``owners[i]`` for ``items[i]``.
    """
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
    load = list(initial_load) if initial_load is not None else [0] * num_ranks
    if len(load) != num_ranks:
        raise ValueError(f"initial_load has {len(load)} entries for {num_ranks} ranks")
    per_boundary: dict[int, list[int]] = defaultdict(lambda: [0] * num_ranks)
    per_stack: dict[int, set[int]] = defaultdict(set)
    owners = [0] * len(items)
    for i in sorted(range(len(items)), key=lambda i: (-items[i].cost, i)):
        item = items[i]
        held = per_boundary[item.boundary]
        taken = per_stack[item.stack] if item.stack is not None else set()
        candidates = [r for r in range(num_ranks) if r not in taken]
        if not candidates:
            raise ValueError(f"stack {item.stack} has more pieces than the {num_ranks} ranks")
        owner = min(candidates, key=lambda r: (held[r], load[r], r))
        owners[i] = owner
        taken.add(owner)
        held[owner] += 1
        load[owner] += items[i].cost
    _swap_down(items, owners, load)
    return owners


def _swap_down(items: Sequence[PartitionItem], owners: list[int], load: list[int]) -> None:
    """Swaps, in place, a costlier item of the busiest rank with a cheaper one of the same
    boundary on another rank, the swap leaving the pair's larger load lowest, until no
    swap lowers the busiest rank (each swap lowers the sorted loads, so this ends). A
    stack's piece moves only to a rank without a piece of that stack."""
    stacks: list[set[int]] = [set() for _ in load]
    by_boundary: dict[int, list[int]] = defaultdict(list)
    for index, (item, owner) in enumerate(zip(items, owners, strict=True)):
        by_boundary[item.boundary].append(index)
        if item.stack is not None:
            stacks[owner].add(item.stack)

    def movable(item: PartitionItem, other: PartitionItem, to: int) -> bool:
        return item.stack is None or item.stack == other.stack or item.stack not in stacks[to]

    while True:
        busiest = max(range(len(load)), key=lambda r: (load[r], -r))
        best = None
        for i, item in enumerate(items):
            if owners[i] != busiest:
                continue
            for j in by_boundary[item.boundary]:
                other, rank = items[j], owners[j]
                if rank == busiest or other.cost >= item.cost:
                    continue
                if not (movable(item, other, rank) and movable(other, item, busiest)):
                    continue
                moved = item.cost - other.cost
                peak = max(load[busiest] - moved, load[rank] + moved)
                if peak < load[busiest] and (best is None or peak < best[0]):
                    best = (peak, i, j)
        if best is None:
            return
        _, i, j = best
        busy, rank = owners[i], owners[j]
        moves = ((items[i].stack, busy, rank), (items[j].stack, rank, busy))
        for stack, away, _ in moves:
            stacks[away].discard(stack)
        for stack, _, to in moves:
            if stack is not None:
                stacks[to].add(stack)
        moved = items[i].cost - items[j].cost
        load[busy] -= moved
        load[rank] += moved
        owners[i], owners[j] = rank, busy


def rank_loads(items: Sequence[PartitionItem], owners: Sequence[int], num_ranks: int) -> list[int]:
    """The cost each rank owns."""
    load = [0] * num_ranks
    for item, owner in zip(items, owners, strict=True):
        load[owner] += item.cost
    return load


def max_over_mean(values: Sequence[float]) -> float:
    """Max over mean of per-rank figures (1.0 is perfect balance; 1.0 when all are 0)."""
    mean = sum(values) / len(values)
    return max(values) / mean if mean > 0 else 1.0


# ---- the plan --------------------------------------------------------------------


@dataclass(eq=False)
class DedicatedParam:
    """A matrix parameter, or a piece of a 3-D stack, with one owner slot.

    Attributes:
        name: Fully qualified name in the model.
        param: The module's current parameter object (re-bound by name when a
            conversion such as ``to_empty`` registers a new one).
        layout: How it lies over the ranks, computed once (see :class:`ParamLayout`).
        offset: Its offset in its unit's layout (see :class:`UnitPlan`).
    """

    name: str
    param: nn.Parameter
    layout: ParamLayout
    offset: int = 0

    @property
    def numel(self) -> int:
        return self.layout.numel

    @property
    def padded_numel(self) -> int:
        """Its room in its unit's layout: :attr:`numel` rounded up to a multiple of
        :data:`VIEW_ALIGNMENT`."""
        return -(-self.numel // VIEW_ALIGNMENT) * VIEW_ALIGNMENT


@dataclass(eq=False)
class UnitPlan:
    """The matrices of one boundary that share an owner slot: one collective each way.

    Its layout (of values, masters, gradients and reduce buckets) puts the whole matrices
    first, in model order, then the pieces of split stacks, each at an offset that is a
    multiple of :data:`VIEW_ALIGNMENT` (zeros between).

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
        """Elements of its layout, padding included: what its buffers hold and move."""
        return sum(d.padded_numel for d in self.params)

    @property
    def matrix_numel(self) -> int:
        """Elements of its matrices and pieces alone (their momentum's)."""
        return sum(d.numel for d in self.params)

    @property
    def whole_numel(self) -> int:
        """Elements of the layout's first part, its whole matrices (padding included):
        where the pieces begin."""
        return sum(d.padded_numel for d in self.params if not d.layout.is_piece)


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
        group_size: Ranks of an owner group (1: one owner per matrix): the dense plain
            matrices are split into that many blocks along their long side, owned by the
            consecutive shard ranks ``g * group_size ...`` of one replica, which run
            their Newton-Schulz together.
    """

    boundaries: list[Boundary]
    domains: list[Domain]
    expert_columns: list[int] | None = None
    group_size: int = 1

    @property
    def expert_parallel(self) -> bool:
        """Whether local experts are dedicated over a domain of their own."""
        return len(self.domains) == 2

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
                    # A piece's experts are part of what the ranks must agree on.
                    key = (i, b.name, d.name, tuple(d.param.shape), d.layout.experts)
                    key += (d.layout.block,)
                    key += (u.domain, u.column, u.primary_replica)
                    h.update(repr(key).encode())
        return int.from_bytes(h.digest()[:7], "little")

    def _primary_loads(
        self, cost: Callable[[ParamLayout], int], domain: int | None = None
    ) -> list[int]:
        """``cost`` of each unit's matrices summed on its primary owners, per data-parallel
        rank (of one domain's units, or all)."""
        load = [0] * self.slots
        for unit in self.units:
            if domain is None or unit.domain == domain:
                unit_cost = sum(cost(d.layout) for d in unit.params)
                for s in self.rank_slots(unit, primary=True):
                    load[s] += unit_cost
        return load

    def ns_loads(self, domain: int | None = None) -> list[int]:
        """Newton-Schulz cost per data-parallel rank (of one domain's units, or all)."""
        return self._primary_loads(lambda layout: layout.ns_cost(1), domain)

    def modeled_loads(self, gpu: GPU = DEFAULT_GPU) -> list[int]:
        """Newton-Schulz per data-parallel rank on ``gpu`` in FLOPs at its peak: the
        multiply-adds and, for an owner group's block, the wait on its Grams
        (:func:`group_cost`)."""

        def cost(layout: ParamLayout) -> int:
            if layout.block is None:
                return layout.ns_cost(1)
            return group_cost(layout.shape, layout.block[1], gpu)

        return self._primary_loads(cost)

    def balance(self, domain: int | None = None) -> float:
        """Max over mean Newton-Schulz load over all ranks (1.0 is perfect)."""
        return max_over_mean(self.ns_loads(domain))

    def held(
        self, dtypes: HeldDtypes | Callable[[Boundary], HeldDtypes], *, normuon: bool = False
    ) -> list[Counter]:
        """What each data-parallel rank (slot order) keeps between steps for the dedicated
        matrices, in bytes by kind: ``params`` (the flat values of every unit of its
        column, padding included), ``momentum`` (one tensor per matrix it is the primary
        owner of, no padding), ``masters`` (its flat full-precision copy of those units,
        where the values are kept in another dtype) and, with ``normuon``, NorMuon's
        second moments. The one formula: the plan report, the dedication's log, the
        scaling benchmarks and the test of the live tensors use it.

        Args:
            dtypes: Each boundary's :class:`HeldDtypes` (one for all, or per boundary:
                FSDP2's mixed precision is per ``fully_shard`` call).
            normuon: Count NorMuon's second moments.
        """
        held = [Counter() for _ in range(self.slots)]
        for boundary in self.boundaries:
            kept = dtypes if isinstance(dtypes, HeldDtypes) else dtypes(boundary)
            values, master = kept.values.itemsize, kept.master.itemsize
            for unit in boundary.units:
                for s in self.rank_slots(unit, primary=False):
                    held[s]["params"] += unit.numel * values
                for s in self.rank_slots(unit, primary=True):
                    held[s]["momentum"] += unit.matrix_numel * master
                    if kept.values != kept.master:
                        held[s]["masters"] += unit.numel * master
                    if normuon:
                        held[s]["normuon"] += master * sum(
                            math.prod(second_moment_shape(d.layout.local_shape))
                            for d in unit.params
                        )
        return held

    def held_bytes(
        self, dtypes: HeldDtypes | Callable[[Boundary], HeldDtypes], *, normuon: bool = False
    ) -> list[int]:
        """Each data-parallel rank's total of :meth:`held`."""
        return [sum(kinds.values()) for kinds in self.held(dtypes, normuon=normuon)]

    def summary(self, held: list[int]) -> list[str]:
        """What a dedication logs of its plan at start: the Newton-Schulz and held-bytes
        balance (``held``: :meth:`held_bytes` for the dtypes the units bound), the split
        stacks, the owner groups, the idle ranks and, under expert parallelism, each
        domain's balance."""
        pieces = [d for d in self.params if d.layout.experts is not None]  # stacks'
        grouped = {d.name for d in self.params if d.layout.block is not None}
        loads = self.ns_loads()
        lines = [
            f"dmuon: per-rank Newton-Schulz cost max/mean {self.balance():.3f}, held "
            f"dedicated bytes (values + masters + momentum) max/mean "
            f"{max_over_mean(held):.3f} (max {max(held) / 2**20:.1f} MiB), "
            f"{len({d.name for d in pieces})} stacks split into {len(pieces)} pieces, "
            f"{len(grouped)} matrices owned by groups of {self.group_size}, "
            f"{sum(load == 0 for load in loads)} of {len(loads)} ranks run no Newton-Schulz"
        ]
        if self.expert_parallel:
            experts = self.domains[1]
            lines.append(
                f"dmuon: expert parallelism: local experts dedicated over "
                f"{experts.replicate_size} x {experts.shard_size} ranks (replicate x efsdp), "
                f"dense matrices over {self.replicate_size} x {self.shard_size}; per-rank "
                f"Newton-Schulz cost max/mean: experts {self.balance(1):.3f}, dense "
                f"{self.balance(0):.3f}, together {self.balance():.3f}"
            )
        return lines


@dataclass(frozen=True)
class HeldDtypes:
    """The dtypes one boundary's dedicated matrices are kept in between steps.

    Attributes:
        values: What every holder of a unit keeps and forward uses: FSDP2's
            ``param_dtype`` for the boundary, else the parameters' dtype.
        master: The parameters' dtype: the owner's momentum, NorMuon's second moments and,
            where ``values`` differs, its master copy.
    """

    values: torch.dtype
    master: torch.dtype


# ---- building it -----------------------------------------------------------------


def build_plan(
    model: nn.Module,
    selected: list[tuple[str, nn.Parameter]],
    *,
    shard_size: int,
    replicate_size: int,
    hook_boundary_predicate: BoundaryPredicate | None,
    expert_shard_size: int | None = None,
    expert_columns: Sequence[int] | None = None,
    group_size: int = 1,
    gpu: GPU = DEFAULT_GPU,
) -> Plan:
    """Group the selected matrices by boundary and owner slot.

    Boundaries come in module (forward) order, so that collectives follow one fixed
    sequence on every rank; slots come from one LPT partition per domain over its
    ``replicate_size * shard_size`` slots, in which each 3-D stack (not tensor-parallel)
    takes part as ``min(stack size, slots)`` pieces of contiguous experts on different
    slots. Under expert parallelism (``expert_shard_size``, ``expert_columns``: see
    :class:`Plan`) the local experts are placed first and the dense matrices then start
    from the load each rank already has. With ``group_size`` > 1 every dense plain matrix
    whose long side splits evenly is owned by an owner group (see :class:`Plan`): the
    groups are partitioned by LPT first (each member's share of the cost on ``gpu``:
    :func:`group_cost`), then the other dense matrices over the slots.

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
    param_domains = [dedication_domain(p) for _, p in selected]
    domains = [Domain(shard_size, replicate_size)]
    expert_parallel = 1 in param_domains
    if expert_parallel:
        if expert_shard_size is None or expert_columns is None:
            raise ValueError(
                "expert-parallel stacks need the experts' layout (expert_shard_size and "
                "expert_columns)"
            )
        domains.append(Domain(expert_shard_size, replicate_size))
        expert_columns = list(expert_columns)
    if group_size < 1 or shard_size % group_size != 0:
        raise ValueError(
            f"owner_group_size {group_size} must be >= 1 and divide the shard size {shard_size}"
        )
    entries: list[list[DedicatedParam]] = [[] for _ in domains]
    items: list[list[PartitionItem]] = [[] for _ in domains]
    # An owner group's matrix: its first block's entry, its cost per member, its boundary.
    grouped: list[tuple[int, PartitionItem]] = []
    for stack, ((name, p), domain) in enumerate(zip(selected, param_domains, strict=True)):
        if split_among_owners(p):
            experts = local_tensor(p).shape[0]
            for r in expert_ranges(experts, min(experts, domains[domain].slots)):
                layout = ParamLayout.of(p, r)
                entries[domain].append(DedicatedParam(name, p, layout))
                items[domain].append(
                    PartitionItem(ns_flops(layout.shape, 1), index[names[name]], stack)
                )
        elif (
            group_size > 1
            and domain == 0
            and _groupable(p, group_size)
            # A fused parameter's matrices each need their whole rows: one owner.
            and fused_rows_of(model, name) is None
        ):
            item = PartitionItem(group_cost(p.shape, group_size, gpu), index[names[name]])
            grouped.append((len(entries[0]), item))
            for block in range(group_size):
                entries[0].append(
                    DedicatedParam(name, p, ParamLayout.of_block(p, block, group_size))
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
    slots[0] = _assign_dense(items[0], grouped, domains[0].slots, group_size, initial_load)

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
        for unit in boundary.units:
            # Whole matrices first (stable: model order), then the pieces: the unit's layout.
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
                offset += d.padded_numel
    return Plan(boundaries, domains, expert_columns if expert_parallel else None, group_size)


def group_cost(shape: Sequence[int], group_size: int, gpu: GPU = DEFAULT_GPU) -> int:
    """A member's share of one Newton-Schulz step of an owner group's matrix on ``gpu``, in
    FLOPs at its peak: its multiply-adds (:func:`split_ns_flops`) and the all-reduce of the
    step's Gram over the group, which the next product waits for."""
    seconds = gpu.all_reduce_seconds(split_ns_bytes(shape, gpu.ns_bytes, 1), group_size)
    return split_ns_flops(shape, 1, group_size) + gpu.as_flops(seconds)


def _groupable(param: nn.Parameter, group_size: int) -> bool:
    """A plain matrix whose long side splits into ``group_size`` equal blocks."""
    return (
        kind_of(param) is LayoutKind.WHOLE
        and param.ndim == 2
        and (not isinstance(param, DTensor) and max(param.shape) % group_size == 0)
    )


def _assign_dense(
    items: list[PartitionItem],
    grouped: list[tuple[int, PartitionItem]],
    slots: int,
    group_size: int,
    initial_load: Sequence[int] | None,
) -> list[int]:
    """The slot of each dense entry, in entry order: the owner groups' blocks (block ``b``
    of a matrix on member ``b`` of its group) by LPT over the groups, then the other
    matrices by LPT over the slots, from the load the groups left."""
    load = list(initial_load) if initial_load is not None else [0] * slots
    groups = slots // group_size
    group_load = [max(load[g * group_size : (g + 1) * group_size]) for g in range(groups)]
    owner_groups = assign_owners([item for _, item in grouped], groups, group_load)
    placed: dict[int, int] = {}
    for (first, item), g in zip(grouped, owner_groups, strict=True):
        for block in range(group_size):
            placed[first + block] = g * group_size + block
            load[g * group_size + block] += item.cost
    singles = iter(assign_owners(items, slots, load))
    total = len(items) + group_size * len(grouped)
    return [placed[i] if i in placed else next(singles) for i in range(total)]


GROUP_MARGIN = 0.02
"""How much less modeled busiest-rank Newton-Schulz a larger owner group must bring to be
chosen."""


def plan_with_groups(build: Callable[[int], Plan], shard_size: int, gpu: GPU = DEFAULT_GPU) -> Plan:
    """The plan whose busiest rank spends the least modeled time on Newton-Schulz on
    ``gpu`` (:meth:`Plan.modeled_loads`: the step waits for it) over owner-group sizes 1,
    2, 4, ... dividing ``shard_size``; a larger size only when it saves more than
    :data:`GROUP_MARGIN`. ``build(group_size)`` builds one.

    A group divides its matrices' products among its members but all-reduces a
    ``(short side)^2`` Gram every step, at NVLink speed within a node and at the network's
    beyond: where one owner per matrix is balanced already (8B at 128 ranks) it stays, and
    groups rarely reach past a node.
    """
    best = build(1)
    best_cost = max(best.modeled_loads(gpu))
    size = 2
    while size <= shard_size and shard_size % size == 0:
        plan = build(size)
        if not any(d.layout.block for d in plan.params):
            break  # nothing splits this evenly: larger groups would not either
        cost = max(plan.modeled_loads(gpu))
        if cost < best_cost * (1 - GROUP_MARGIN):
            best, best_cost = plan, cost
        elif cost > 2 * best_cost:
            break  # the Grams' all-reduces dominate from here on
        size *= 2
    return best
