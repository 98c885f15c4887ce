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

import hashlib
from dataclasses import dataclass

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from torchtitan_dmuon.engine.plan import is_expert_parallel

__all__ = ["Intent", "agree_on_intent", "model_tensor_parallel_mesh"]


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


def model_tensor_parallel_mesh(model: nn.Module) -> DeviceMesh | None:
    """The 1-D mesh of the model's first tensor-parallel DTensor parameter (not an expert
    stack), whatever the predicate selects, or None."""
    for p in model.parameters():
        if isinstance(p, DTensor) and p.device_mesh.ndim == 1 and not is_expert_parallel(p):
            return p.device_mesh
    return None


def selection_hash(selected: list[tuple[str, nn.Parameter]]) -> str:
    h = hashlib.sha256()
    for name, p in selected:
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
    known = {dist.get_rank(): intent}
    for m in (mesh, replicate_mesh, tp_mesh):
        if m is None or m.size() == 1:
            continue
        rows = [None] * m.size()
        dist.all_gather_object(rows, known, group=m.get_group())
        for row in rows:
            known.update(row)
    error = _verdict(known)
    if error is not None:
        raise ValueError(error)


def _verdict(intents: dict[int, Intent]) -> str | None:
    ranks = sorted(intents)
    failed = [rank for rank in ranks if intents[rank].error is not None]
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
