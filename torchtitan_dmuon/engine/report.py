"""What a dedication costs each data-parallel rank, counted from its plan before any step.

Per rank: the matrices it orthogonalizes and their Newton-Schulz FLOPs, the bytes it keeps
between steps for the dedicated matrices (values, masters, momentum, NorMuon's second
moments), and the payload bytes of every collective of one training step, by kind
(``broadcast``, ``reduce``, ``all_gather``, ``reduce_scatter``, ``all_reduce``) as
``tests.support.collectives.CollectiveCounter`` counts them (a collective's
payload once on each rank that takes part): the engine's
broadcasts and reduces, and FSDP2's all-gathers, reduce-scatters and HSDP all-reduces of the
other parameters. Beside them, the bytes of the same step had the same layout kept every
parameter itself and trained it with AdamW (FSDP2 sharding the dedicated matrices too, or DDP
where the engine runs DDP-style).

Pure arithmetic over the plan and FSDP2's parameter groups: no collective and no value read,
so it runs on a meta-device model (TorchTitan's plan report, ``titan/plan_report.py``) as at
the start of a real run. Not counted: the norm all-reduces of gradient clipping and the
loss's (a few scalars each), QK-clip's maxima, the tensor-parallel Newton-Schulz's
collectives and the tensor-, expert- and pipeline-parallel activations' traffic (the same
for either optimizer). ``Muon.step``'s failure verdict (a flag per rank) is counted.
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard

from torchtitan_dmuon.engine import fsdp
from torchtitan_dmuon.engine.dedication import Dedication, dedication_of
from torchtitan_dmuon.engine.others import bucket_params
from torchtitan_dmuon.engine.param_layout import local_tensor
from torchtitan_dmuon.engine.plan import Boundary, HeldDtypes, max_over_mean
from torchtitan_dmuon.engine.unit import unit_dtypes
from torchtitan_dmuon.optim.newton_schulz import matrix_count
from torchtitan_dmuon.optim.sharded_ns import split_ns_bytes

__all__ = ["PlanReport", "RankReport", "StepCounts", "plan_report"]


@dataclass(frozen=True)
class StepCounts:
    """How a training step runs, as far as the counts depend on it.

    Attributes:
        micro_batches: Forward-backward passes per optimizer step (gradient accumulation),
            each gathering and reducing.
        ns_steps: Newton-Schulz iterations per matrix and step.
        normuon: NorMuon's per-row second moments are kept (``variant="normuon"``).
        ns_bytes: Bytes per element of the Newton-Schulz dtype (an owner group all-reduces
            its Grams in it).
    """

    micro_batches: int = 1
    ns_steps: int = 5
    normuon: bool = False
    ns_bytes: int = 2


@dataclass
class RankReport:
    """One data-parallel rank's figures (the same on each of its tensor-parallel ranks).

    Attributes:
        rank: Its data-parallel rank: ``replica * shard_size + shard rank``.
        owned: Matrices it orthogonalizes (each expert of a stack piece counts).
        ns_flops: FLOPs of their Newton-Schulz per optimizer step (2 per multiply-add).
        held: Bytes kept between steps for the dedicated matrices: ``params`` (the values
            of the units of its column), ``masters`` (primary, under mixed precision),
            ``momentum`` and ``normuon`` (primary); the units' buffers (values, masters)
            with their alignment padding (see ``plan.VIEW_ALIGNMENT``).
        dmuon_bytes: Collective payload bytes of one step by kind: ``broadcast``,
            ``reduce``, ``all_gather``, ``reduce_scatter``, ``all_reduce`` (the units'
            buffers with their padding).
        adamw_bytes: The same step's, had the layout kept every parameter (AdamW).
    """

    rank: int
    owned: int = 0
    ns_flops: int = 0
    held: Counter = field(default_factory=Counter)
    dmuon_bytes: Counter = field(default_factory=Counter)
    adamw_bytes: Counter = field(default_factory=Counter)

    @property
    def held_total(self) -> int:
        return sum(self.held.values())

    @property
    def dmuon_total(self) -> int:
        return sum(self.dmuon_bytes.values())

    @property
    def adamw_total(self) -> int:
        return sum(self.adamw_bytes.values())

    def as_dict(self) -> dict:
        return dict(
            rank=self.rank,
            owned=self.owned,
            ns_flops=self.ns_flops,
            held=dict(self.held),
            dmuon_bytes=dict(self.dmuon_bytes),
            adamw_bytes=dict(self.adamw_bytes),
        )


@dataclass
class PlanReport:
    """Every data-parallel rank's :class:`RankReport`, and the layout they come from.

    Attributes:
        ranks: In data-parallel rank order.
        replicate_size / shard_size: The dense domain's layout.
        matrices: Dedicated matrices (each expert counts).
        counts: The step the byte counts are of.
    """

    ranks: list[RankReport]
    replicate_size: int
    shard_size: int
    matrices: int
    counts: StepCounts

    FIGURES = ("owned", "ns_flops", "held_total", "dmuon_total", "adamw_total")

    def values(self, figure: str) -> list[int]:
        return [getattr(r, figure) for r in self.ranks]

    def busiest(self) -> RankReport:
        """The rank with the most Newton-Schulz FLOPs (ties: the most held bytes, then
        the lowest rank): the one a step waits for."""
        return max(self.ranks, key=lambda r: (r.ns_flops, r.held_total, -r.rank))

    def idle(self) -> int:
        """Ranks that run no Newton-Schulz."""
        return sum(r.ns_flops == 0 for r in self.ranks)

    def summary(self) -> dict:
        """Max, mean and max/mean of each figure, the busiest rank and the idle ranks."""
        out = {}
        for figure in self.FIGURES:
            values = self.values(figure)
            out[figure] = dict(
                max=max(values), mean=sum(values) / len(values), max_over_mean=max_over_mean(values)
            )
        return dict(figures=out, busiest=self.busiest().as_dict(), idle=self.idle())

    def line(self, rank: int) -> str:
        """One line on ``rank`` against the busiest rank and the mean (the startup log)."""
        mine, busiest = self.ranks[rank], self.busiest()
        held, moved = self.values("held_total"), self.values("dmuon_total")
        return (
            f"rank {rank} of {len(self.ranks)} orthogonalizes {mine.owned} of {self.matrices} "
            f"matrices, {_flop(mine.ns_flops)} a step (busiest: rank {busiest.rank}, "
            f"{_flop(busiest.ns_flops)}; {self.idle()} ranks none), holds "
            f"{mine.held_total / 2**20:.1f} MiB of them (max {max(held) / 2**20:.1f}, mean "
            f"{sum(held) / len(held) / 2**20:.1f}), moves {mine.dmuon_total / 2**20:.1f} MiB "
            f"in collectives a step (max {max(moved) / 2**20:.1f}; the same layout with AdamW: "
            f"{mine.adamw_total / 2**20:.1f})"
        )


def _flop(flops: int) -> str:
    return f"{flops / 1e12:.3f} TFLOP" if flops >= 1e11 else f"{flops / 1e9:.3f} GFLOP"


def plan_report(model: nn.Module, counts: StepCounts) -> PlanReport:
    """The report of ``model``'s dedication on its data-parallel ranks (after ``fully_shard``,
    before or after materialization).

    Raises:
        ValueError: ``model`` was not prepared by ``dedicate_params``.
    """
    dedication = dedication_of(model)
    plan = dedication.plan
    ranks = [RankReport(rank) for rank in range(plan.slots)]
    z3 = dedication.settings.reshard_after_forward
    last = len(plan.boundaries) - 1
    everyone = Counter()  # what every rank's shard groups move for the dedicated matrices
    held = plan.held(functools.partial(_held_dtypes, model), normuon=counts.normuon)
    for rank, kinds in zip(ranks, held, strict=True):
        rank.held.update(kinds)
    for index, boundary in enumerate(plan.boundaries):
        value_dtype, reduce_dtype = _boundary_dtypes(model, boundary)
        gathers = counts.micro_batches * (2 if z3 and index != last else 1)
        for unit in boundary.units:
            values = unit.numel * value_dtype.itemsize
            bucket = (unit.numel + len(unit.params)) * reduce_dtype.itemsize
            everyone["broadcast"] += gathers * values
            everyone["reduce"] += counts.micro_batches * bucket
            for slot in plan.rank_slots(unit, primary=False):
                if plan.replicate_size > 1:  # stage 2 onto the primary, then its values back
                    ranks[slot].dmuon_bytes["reduce"] += counts.micro_batches * bucket
                    ranks[slot].dmuon_bytes["broadcast"] += values
            for slot in plan.rank_slots(unit, primary=True):
                rank = ranks[slot]
                rank.owned += sum(matrix_count(d.layout.shape) for d in unit.params)
                rank.ns_flops += 2 * sum(d.layout.ns_cost(counts.ns_steps) for d in unit.params)
                for d in unit.params:
                    if d.layout.block is not None:
                        rank.dmuon_bytes["all_reduce"] += _owner_group_bytes(d.layout, counts)
    others = _other_params_traffic(model, dedication, counts) + _step_verdict(dedication)
    alone = _fsdp_traffic(model, dedication, counts, with_dedicated=False)
    together = _fsdp_traffic(model, dedication, counts, with_dedicated=True)
    for rank in ranks:
        rank.dmuon_bytes.update(everyone + alone + others)
        rank.adamw_bytes.update(together)
    return PlanReport(
        ranks,
        plan.replicate_size,
        plan.shard_size,
        sum(d.layout.matrices for d in plan.params),
        counts,
    )


def _boundary_dtypes(model: nn.Module, boundary: Boundary) -> tuple[torch.dtype, torch.dtype]:
    """``(values, reduce)`` dtypes of a boundary's units under the ``fully_shard`` call that
    covers it, as :meth:`Unit.bind` picks them."""
    master = boundary.units[0].params[0].param.dtype
    return unit_dtypes(master, *fsdp.mixed_precision_of(model, boundary.name))


def _held_dtypes(model: nn.Module, boundary: Boundary) -> HeldDtypes:
    """The dtypes a boundary's dedicated matrices will be kept in (see :meth:`Plan.held`),
    before its units bind (then a parameter is a view in the compute dtype)."""
    master = boundary.units[0].params[0].param.dtype
    return HeldDtypes(values=_boundary_dtypes(model, boundary)[0], master=master)


def _other_params_traffic(model: nn.Module, dedication: Dedication, counts: StepCounts) -> Counter:
    """The DDP-style sync of the parameters outside every ``fully_shard`` (the engine's one
    bucket, all-reduced over each data-parallel group once per backward)."""
    if any(isinstance(m, FSDPModule) for m in model.modules()):
        return Counter()  # the others (if any) are FSDP2's; a stray one is a few norms
    bucket = _ddp_bucket_bytes(model, {d.name for d in dedication.plan.params})
    return Counter(
        {"all_reduce": bucket * _data_parallel_groups(dedication) * counts.micro_batches}
    )


def _owner_group_bytes(layout, counts: StepCounts) -> int:
    """What a block's owner group all-reduces for it per step: the Grams of its
    Newton-Schulz and, under NorMuon, its row sums (fp32) where the blocks split the
    columns, else its two norms."""
    grams = split_ns_bytes(layout.shape, counts.ns_bytes, counts.ns_steps)
    if not counts.normuon:
        return grams
    return grams + 4 * (layout.local_shape[0] if layout.block_dim == 1 else 2)


def _step_verdict(dedication: Dedication) -> Counter:
    """``Muon.step``'s verdict on failure (``owned.StepVerdict``): two int32s, whatever the
    world size, MAX-all-reduced over each data-parallel group and the tensor-parallel
    group; before a second phase (owner groups' blocks, TP shards) a flag per member of
    the group that runs it."""
    exchange = dedication.exchange
    groups = exchange.data_parallel_groups() + [exchange.tp_group]
    joined = sum(g is not None and dist.get_world_size(g) > 1 for g in groups)
    phase = exchange.owner_group.group if exchange.owner_group is not None else exchange.tp_group
    members = dist.get_world_size(phase) if phase is not None else 0
    return Counter({"all_reduce": joined * 8 + members * 4})


def _ddp_bucket_bytes(model: nn.Module, excluded: set[str]) -> int:
    """The DDP-style buckets' bytes (gradients and has-gradient flags, as
    :class:`~torchtitan_dmuon.engine.others.OtherParams` packs them)."""
    params = [p for name, p in model.named_parameters() if p.requires_grad and name not in excluded]
    return sum(
        (sum(local_tensor(params[i]).numel() for i in bucket) + len(bucket))
        * params[bucket[0]].dtype.itemsize
        for bucket in bucket_params(params)
    )


def _data_parallel_groups(dedication: Dedication) -> int:
    return 1 + (dedication.plan.replicate_size > 1)


def _fsdp_traffic(
    model: nn.Module, dedication: Dedication, counts: StepCounts, *, with_dedicated: bool
) -> Counter:
    """FSDP2's collectives of one step over its parameter groups: per forward an all-gather
    (again in backward where the group reshards after forward; not the root's), per backward
    a reduce-scatter and, under HSDP, an all-reduce of its output. ``with_dedicated``: as if
    the dedicated matrices were in the group of their innermost ``fully_shard`` module (and,
    without FSDP, all-reduced DDP-style with the rest)."""
    out = Counter()
    if not any(isinstance(m, FSDPModule) for m in model.modules()):
        if with_dedicated:
            bucket = _ddp_bucket_bytes(model, set())
            groups = _data_parallel_groups(dedication)
            out["all_reduce"] += bucket * groups * counts.micro_batches
        return out
    # Each dedicated parameter once (a split stack whole), with the shard size of its domain.
    dedicated_under: dict[str, dict[str, tuple[torch.Tensor, int]]] = {}
    if with_dedicated:
        for unit in dedication.plan.units:
            shard_size = dedication.plan.domains[unit.domain].shard_size
            for d in unit.params:
                module = fsdp.innermost_fsdp(model, d.name.rpartition(".")[0])
                if module is None:
                    raise ValueError(
                        f"dedicated parameter {d.name!r} is under no fully_shard module"
                    )
                under = dedicated_under.setdefault(module, {})
                under[d.name] = (local_tensor(d.param), shard_size)
    roots = set(fsdp.top_fsdp_modules(model))
    for name, module in model.named_modules():
        if not isinstance(module, FSDPModule):
            continue
        state = fully_shard.state(module)
        # The module's policy (torch 2.15's groups keep none of their own).
        policy = state._mp_policy
        for group in fsdp.param_groups(module):
            info = group.mesh_info
            padded = sum(p.padded_sharded_param_size.numel() for p in group.fsdp_params)
            master = group.fsdp_params[0].sharded_param.dtype
            gather_dtype, reduce_dtype = unit_dtypes(
                master, policy.param_dtype, policy.reduce_dtype
            )
            for param, _ in dedicated_under.pop(name, {}).values():
                padded += _padded_shard_numel(param.shape, info.shard_mesh_size)
            regather = group.post_forward_mesh_info is not None and not (
                module in roots and state._auto_reshard_after_forward
            )
            _add_group(out, padded, info, gather_dtype, reduce_dtype, regather, counts)
    # Dedicated matrices under an FSDP module that manages no parameter of its own: FSDP2
    # would have made a group for them, on the dedication's own mesh.
    for name, params in dedicated_under.items():
        module = model.get_submodule(name)
        policy = fully_shard.state(module)._mp_policy
        master = next(iter(params.values()))[0].dtype
        gather_dtype, reduce_dtype = unit_dtypes(master, policy.param_dtype, policy.reduce_dtype)
        by_shard_size: Counter = Counter()
        for param, shard_size in params.values():
            by_shard_size[shard_size] += _padded_shard_numel(param.shape, shard_size)
        for shard_size, padded in by_shard_size.items():
            info = _MeshSizes(shard_size, dedication.plan.replicate_size)
            regather = dedication.settings.reshard_after_forward and module not in roots
            _add_group(out, padded, info, gather_dtype, reduce_dtype, regather, counts)
    return out


@dataclass(frozen=True)
class _MeshSizes:
    shard_mesh_size: int
    replicate_mesh_size: int


def _add_group(out, padded, info, gather_dtype, reduce_dtype, regather, counts) -> None:
    world = info.shard_mesh_size
    if world > 1:
        out["all_gather"] += (
            counts.micro_batches * (1 + regather) * padded * world * gather_dtype.itemsize
        )
        out["reduce_scatter"] += counts.micro_batches * padded * world * reduce_dtype.itemsize
    if getattr(info, "replicate_mesh_size", 1) > 1:  # HSDP
        out["all_reduce"] += counts.micro_batches * padded * reduce_dtype.itemsize


def _padded_shard_numel(shape, world: int) -> int:
    """FSDP2's shard of a parameter: dim 0 padded to a multiple of the mesh size."""
    rows = -(-shape[0] // world)
    return rows * math.prod(shape[1:])
