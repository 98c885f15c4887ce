"""One verdict on the inputs of ``dedicate_params``, agreed before its first collective.

What ``dedicate_params`` does next depends on what each rank selected: the experts'
all-gather and process groups exist only where expert stacks are selected, the
tensor-parallel group only where a selected matrix is a DTensor, and the plan is built
from the selection. A predicate that selects differently on some ranks (a rank-dependent
pattern, an expert pattern that matches on some ranks only, TP peers that differ) would
make the ranks issue different collectives: a hang, or Grams of different matrices summed
without a word. So first every rank describes what it is about to do (its selection, its
settings, its coordinates, or the error its own checks raised) and the descriptions go to
every rank of the dedication over groups that exist before the engine makes any: the shard
mesh's, the replicate mesh's and the tensor-parallel mesh's (found from the model's
parameters, not from the selection). Each rank then judges the same table, so all of them
raise the same error, or none does.
"""

from __future__ import annotations

import functools
import hashlib
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from torchtitan_dmuon.engine.comm import all_gather_rows, gather_over_groups, is_fake, mesh_device

if TYPE_CHECKING:
    from torchtitan_dmuon.engine.dedication import Dedication

logger = logging.getLogger(__name__)

__all__ = [
    "Intent",
    "agree_on_intent",
    "selection_hash",
    "verify_plan",
]


@dataclass(frozen=True)
class Intent:
    """What one rank is about to dedicate.

    Attributes:
        names: The selected parameters' names.
        selection: A hash of the selected names, shapes and placements.
        settings: The dedication's settings.
        groups: Which engine groups it will create (replicate, tensor-, expert-parallel).
        error: The message of the check that failed on this rank, or None.
    """

    names: tuple[str, ...]
    selection: str
    settings: tuple
    groups: tuple
    error: str | None


def selection_hash(selected: list[tuple[str, nn.Parameter]]) -> str:
    h = hashlib.sha256()
    for name, p in selected:
        # The layout is part of what the ranks must agree on.
        placements = p.placements if isinstance(p, DTensor) else None
        h.update(repr((name, tuple(p.shape), placements)).encode())
    return h.hexdigest()[:16]


def agree_on_intent(
    intent: Intent,
    mesh: DeviceMesh,
    replicate_mesh: DeviceMesh | None,
    tp_mesh: DeviceMesh | None,
) -> None:
    """All-gather ``intent`` over the shard, replicate and tensor-parallel groups (each
    gather carrying the earlier ones') and raise, on every rank alike, if any rank's
    check failed or the ranks do not agree on what to dedicate.

    Raises:
        ValueError: A rank's own check failed (its message, naming the rank), or the ranks
            selected different matrices, settings or engine groups.
    """
    meshes = (mesh, replicate_mesh, tp_mesh)
    known = gather_over_groups([m.get_group() if m is not None else None for m in meshes], intent)
    error = _verdict(known)
    if error is not None:
        raise ValueError(error)


def _verdict(intents: dict[int, Intent]) -> str | None:
    ranks = sorted(intents)
    failed = [rank for rank in ranks if intents[rank].error is not None]
    if failed == ranks and len({intents[rank].error for rank in ranks}) == 1:
        return intents[ranks[0]].error  # the same on every rank: as it was raised
    if failed:
        return (
            f"dedicate_params failed on rank(s) {failed}; rank {failed[0]}: "
            f"{intents[failed[0]].error}"
        )
    first = intents[ranks[0]]
    for rank in ranks[1:]:
        other = intents[rank]
        if other.selection != first.selection:
            only = sorted(set(first.names) ^ set(other.names))
            return (
                f"ranks {ranks[0]} and {rank} selected different matrices (a predicate that "
                f"depends on the rank?); selected on one of them only: {only or 'none'} "
                "(or the same names with other shapes or placements)"
            )
        for field, what in (("settings", "settings"), ("groups", "engine groups")):
            if getattr(other, field) != getattr(first, field):
                return (
                    f"ranks {ranks[0]} and {rank} disagree about the dedication's {what}: "
                    f"{getattr(first, field)} and {getattr(other, field)}"
                )
    return None


def verify_plan(dedication: Dedication) -> None:
    """Check that every data-parallel rank holds the same plan and sits where the
    (replicate, shard) layout says: one small all-gather over the shard group, one over
    the replicate group (HSDP), and under expert parallelism first one over the experts'
    shard group and last one over the tensor-parallel group (if any). The same gathers
    tell each rank the global rank of every owner slot (``Dedication.slot_ranks`` and
    ``expert_owner_ranks``, which checkpoints of split stacks name).

    All gathers run before anything is judged, and each later one carries the verdicts
    of the earlier groups, so every rank of the data-parallel groups raises alike and a
    mismatch cannot reach a later collective. Ranks outside them (other pipeline stages)
    are not involved: a stage's plan is its own.
    """
    exchange, expert_parallel = dedication.exchange, dedication.plan.expert_parallel
    if is_fake(exchange.shard_group):
        _note_fake_backend()
        dedication.slot_ranks = _slot_ranks_of_the_mesh(dedication)
        return
    device = mesh_device(dedication.mesh)
    fingerprint = dedication.plan.fingerprint(dedication.settings.reshard_after_forward)
    coordinates = [fingerprint, dedication.replicate_rank]
    error, expert_rank, ep_rank, etp_rank = None, 0, 0, 0
    if expert_parallel:
        experts = exchange.domains[1]
        layout = next(d.layout for u in dedication.plan.units if u.domain == 1 for d in u.params)
        expert_rank, ep_rank, etp_rank = experts.rank, layout.ep_rank, layout.etp_rank
        rows = all_gather_rows(coordinates + [expert_rank], experts.shard_group, device)
        error = _layout_error(rows, "efsdp")
    mine = coordinates + [dedication.shard_rank, dist.get_rank(), error is None]
    shard_table = all_gather_rows(
        mine + [expert_rank, ep_rank, etp_rank], exchange.shard_group, device
    )
    error = error or _layout_error([row[:3] for row in shard_table], "shard")
    if error is None and not all(row[4] for row in shard_table):
        error = RuntimeError(
            "the ranks of another efsdp group disagree about the dedication plan or "
            "layout (see the error on those ranks)"
        )
    # (global rank, experts' column, ep rank, etp rank) of this replica's columns, in order.
    columns = [x for row in sorted(shard_table, key=lambda row: row[2]) for x in row[3:4] + row[5:]]
    tables = [columns]
    if exchange.replicas is not None:
        rows = all_gather_rows(
            mine[:4] + [error is None] + columns, exchange.replicate_group, device
        )
        error = error or _layout_error([row[:3] for row in rows], "replicate")
        if error is None and not all(row[4] for row in rows):
            error = RuntimeError(
                "the ranks of another replica's shard group disagree about the dedication "
                "plan or layout (see the error on those ranks)"
            )
        tables = [row[5:] for row in sorted(rows, key=lambda row: row[1])]
    ranks = [table[i : i + 4] for table in tables for i in range(0, len(table), 4)]
    # (replica, global rank, experts' column, ep rank, etp rank) of each data-parallel rank.
    entries = [(slot // dedication.shard_size, *row) for slot, row in enumerate(ranks)]
    if expert_parallel and exchange.tp_group is not None:
        # The ep groups may span the tensor-parallel ranks (TorchTitan's ep borrows them):
        # their owners too. Carrying the verdicts, since these groups cross shard groups.
        flat = [error is None] + [x for entry in entries for x in entry]
        rows = all_gather_rows(flat, exchange.tp_group, device)
        if error is None and not all(row[0] for row in rows):
            error = RuntimeError(
                "the ranks of another tensor-parallel position disagree about the "
                "dedication plan or layout (see the error on those ranks)"
            )
        entries = [tuple(row[i : i + 5]) for row in rows for i in range(1, len(row), 5)]
    if error is not None:
        raise error
    dedication.slot_ranks = [row[0] for row in ranks]
    if expert_parallel:
        per_replica = exchange.domains[1].size
        dedication.expert_owner_ranks = {
            (ep, replica * per_replica + column, etp): rank
            for replica, rank, column, ep, etp in entries
        }


@functools.cache
def _note_fake_backend() -> None:
    logger.info(
        "dmuon: fake backend (a dry run): every gather returns this rank's value, so the "
        "plan is not compared across ranks (each rank computes it from the same model, "
        "predicate and mesh) and the owners' ranks follow from the mesh; the split expert "
        "stacks' owners are unknown (no checkpoint of them)"
    )


def _slot_ranks_of_the_mesh(dedication: Dedication) -> list[int]:
    """The global rank of each owner slot (replica-major), from the group members alone:
    a DeviceMesh places ranks affinely, so the rank at (replica r, shard s) is
    ``replicate_ranks[r] + shard_ranks[s] - this rank``."""
    exchange = dedication.exchange
    shard = dist.get_process_group_ranks(exchange.shard_group)
    if exchange.replicas is None:
        return shard
    me = dist.get_rank()
    replicate = dist.get_process_group_ranks(exchange.replicate_group)
    return [r + s - me for r in replicate for s in shard]


def _layout_error(table: list[list[int]], dim: str) -> Exception | None:
    """What is wrong with the rows ``(fingerprint, replicate rank, shard rank)`` gathered
    over one group, if anything."""
    fingerprints = [row[0] for row in table]
    if len(set(fingerprints)) != 1:
        return RuntimeError(
            "ranks disagree about the dedication plan (different model, predicate, "
            f"hook boundaries or mesh per rank); plan fingerprints by {dim}-group rank: "
            f"{fingerprints}"
        )
    own, other = (1, 2) if dim == "replicate" else (2, 1)
    if len({row[own] for row in table}) != len(table) or len({row[other] for row in table}) != 1:
        return ValueError(
            "replicate_mesh does not line up with mesh: the (replicate, shard) "
            f"coordinates of the {dim} group's ranks are {[(row[1], row[2]) for row in table]}"
        )
    return None
