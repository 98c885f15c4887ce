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
from collections.abc import Iterator
from dataclasses import dataclass, field

from torch import nn

from torchtitan_dmuon.engine.param_layout import ParamLayout
from torchtitan_dmuon.engine.partition import max_over_mean
from torchtitan_dmuon.optim.newton_schulz import ns_flops

__all__ = [
    "Boundary",
    "DedicatedParam",
    "Domain",
    "Plan",
    "UnitPlan",
]


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
        return sum(d.numel for d in self.params if not d.layout.is_piece)


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
                    key = (i, b.name, d.name, tuple(d.param.shape), d.layout.experts)
                    key += (u.domain, u.column, u.primary_replica)
                    h.update(repr(key).encode())
        return int.from_bytes(h.digest()[:7], "little")

    def ns_loads(self, domain: int | None = None) -> list[int]:
        """Newton-Schulz cost per data-parallel rank (of one domain's units, or all)."""
        load = [0] * self.slots
        for unit in self.units:
            if domain is None or unit.domain == domain:
                cost = sum(ns_flops(d.layout.shape, 1) for d in unit.params)
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
