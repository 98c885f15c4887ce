"""Model and LR-scheduler state for TorchTitan's CheckpointManager.

:class:`DMuonModelWrapper` saves the dedicated matrices once; :class:`LRSchedulersWrapper`
lets a run resume from a checkpoint of the other optimizer (AdamW <-> DMuon).

TorchTitan's ``ModelWrapper`` caches ``get_model_state_dict`` once, at construction. With
DMuon that would hold stale tensors (the engine re-binds parameters into flat buffers at
the first forward) and every rank's copy of each dedicated matrix, most of them freed. This
wrapper recomputes the state dict on each call: FSDP parameters as TorchTitan gives them
(DTensors, resharded by DCP on load), and each dedicated matrix only on its primary owner,
as one whole full-precision tensor under its parameter name. A stack split among owners
(MoE experts) is saved under its name too, as a ``ShardedTensor`` whose shards are the
owners' pieces (each expert once). Save and load use the same rule, so a checkpoint does
not depend on the topology that wrote it: DCP reads each new owner's matrix or piece from
whatever the old topology wrote, and the engine distributes it.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import (
    ShardedTensorMetadata,
    TensorProperties,
)
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor, Replicate
from torchtitan.components.checkpoint import ModelWrapper
from torchtitan.components.lr_scheduler import LRSchedulersContainer

from torchtitan_dmuon.engine import Dedication, get_dedication
from torchtitan_dmuon.engine.geometry import piece_shards
from torchtitan_dmuon.engine.plan import DedicatedParam
from torchtitan_dmuon.optim.normuon import second_moment_shape
from torchtitan_dmuon.titan.parallelize import clean_fqn

logger = logging.getLogger(__name__)

__all__ = [
    "DMuonModelWrapper",
    "LRSchedulersWrapper",
    "as_saved",
    "load_into",
    "load_state_into",
]


def _dedicated(model: nn.Module):
    """``(fqns of all dedicated matrices, {fqn: (saved, local)} of those this rank owns)``:
    ``saved`` is what the checkpoint holds, ``local`` the master it stands for."""
    dedication = get_dedication(model)
    if dedication is None:  # one data-parallel rank: every value is here, in place
        return set(), {}
    fqns = {id(p): clean_fqn(n) for n, p in model.named_parameters()}
    every = {clean_fqn(d.name) for unit in dedication.units for d in unit.params}
    owned = {
        fqns[id(entry.param)]: (as_saved(dedication, entry, master), master)
        for entry, master in dedication.primary_params()
    }
    return every, owned


def as_saved(
    dedication: Dedication, entry: DedicatedParam, local: torch.Tensor, per_row: bool = False
) -> torch.Tensor:
    """What a checkpoint holds for a dedicated matrix's value or state (``local``, this
    owner's tensor; DCP loads into it in place through what this returns):

    * a whole matrix (also one replicated over the tensor-parallel ranks): ``local``;
    * under tensor parallelism: this rank's shard as a DTensor laid out like the
      parameter (DCP reassembles and reshards it);
    * a piece of a split stack: a ``ShardedTensor`` of the stack's shape whose local shard
      is ``local`` and whose other shards are the other owners' pieces (under expert
      parallelism, of every ``ep`` rank's experts: the whole stack, as without).

    ``per_row``: ``local`` holds one value per row of the parameter's matrices (NorMuon's
    second moment, ``(..., rows, 1)``): the same layout with the last dim collapsed. A split
    of the columns leaves every tensor-parallel rank a copy of the same rows: replicated in
    the DTensor; in a stack's piece each expert tensor-parallel rank saves and loads a
    block of the rows of its copy (DCP wants disjoint shards), and
    :func:`load_state_into` hands each block to the others after a load.
    """
    param = entry.param
    shape = second_moment_shape(param.shape) if per_row else param.shape
    if entry.layout.is_piece:
        shards = _piece_metadata(dedication, entry, local, per_row)
        # A rank owns at most one piece (or piece's shard) of each stack.
        mine = [md for md in shards if md.placement.rank() == dist.get_rank()]
        if per_row and entry.layout.splits_columns:
            # Saved from a copy, loaded into one: load_state_into puts it in place.
            start, stop = _row_block(entry.layout.local_shape[-2], entry)
            local = local.narrow(-2, start, stop - start).contiguous()
        metadata = ShardedTensorMetadata(
            shards, torch.Size(shape), TensorProperties(dtype=local.dtype, layout=torch.strided)
        )
        return ShardedTensor._init_from_local_shards_and_global_metadata(
            [Shard(local, md) for md in mine], metadata
        )
    if isinstance(local, DTensor) or entry.layout.split_dim is None:
        return local  # whole (a replicated DTensor's local tensor is the whole matrix)
    placements, stride = param.placements, param.stride()
    if per_row:
        # The one Shard of the (1-D) TP mesh is the split; columns split: every rank
        # holds the same rows.
        if entry.layout.splits_columns:
            placements = [Replicate() if pl.is_shard() else pl for pl in placements]
        stride = _contiguous_strides(shape)
    return DTensor.from_local(
        local, param.device_mesh, placements, run_check=False,
        shape=torch.Size(shape), stride=stride,
    )  # fmt: skip


def load_state_into(
    dedication: Dedication,
    entry: DedicatedParam,
    target: torch.Tensor,
    loaded: torch.Tensor,
    per_row: bool = False,
) -> None:
    """Put what DCP loaded for a dedicated matrix's state (through :func:`as_saved`'s
    result) into ``target``. For the per-row state of a piece split along its columns
    over the expert tensor-parallel ranks, each of them loaded one block of the rows:
    one broadcast per block over the engine's TP group gives every rank all of them (a
    collective, run by the piece's ranks for the same entries in the same order)."""
    if not (per_row and entry.layout.is_piece and entry.layout.splits_columns):
        load_into(target, loaded)
        return
    mine = loaded.local_shards()[0].tensor
    first_expert = entry.layout.experts_of(entry.layout.ep_rank)[0]
    owners = {
        offsets[-1] // sizes[-1]: rank
        for offsets, sizes, rank in piece_shards(dedication, entry.name)
        if offsets[0] == first_expert
    }
    for etp_rank in range(entry.layout.etp_size):
        start, stop = _row_block(target.shape[-2], entry, etp_rank)
        block = (
            mine
            if etp_rank == entry.layout.etp_rank
            else target.new_empty((*target.shape[:-2], stop - start, 1))
        )
        dist.broadcast(block, src=owners[etp_rank], group=dedication.exchange.tp_group)
        target.narrow(-2, start, stop - start).copy_(block)


def _row_block(rows: int, entry: DedicatedParam, etp_rank: int | None = None) -> tuple[int, int]:
    """The rows of a column-split piece's per-row state that expert tensor-parallel rank
    ``etp_rank`` (default: this rank's) saves and loads."""
    etp_rank = entry.layout.etp_rank if etp_rank is None else etp_rank
    size = entry.layout.etp_size
    return rows * etp_rank // size, rows * (etp_rank + 1) // size


def _contiguous_strides(shape) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def _piece_metadata(
    dedication: Dedication, entry: DedicatedParam, local: torch.Tensor, per_row: bool
) -> list[ShardMetadata]:
    """The shards of a split stack's pieces (of their per-row state: the last dim
    collapsed; where the columns are split, each rank's block of the rows)."""
    shards = []
    for offsets, sizes, rank in piece_shards(dedication, entry.name):
        if per_row:
            rows, row_offset = sizes[-2], offsets[-2]
            if entry.layout.splits_columns:
                start, stop = _row_block(rows, entry, offsets[-1] // sizes[-1])
                rows, row_offset = stop - start, row_offset + start
            offsets = [*offsets[:-2], row_offset, 0]
            sizes = [*sizes[:-2], rows, 1]
        shards.append(ShardMetadata(offsets, sizes, placement=f"rank:{rank}/{local.device}"))
    return shards


def load_into(target: torch.Tensor, loaded: torch.Tensor) -> None:
    """Copy a loaded value into a dedicated matrix's local tensor, unless DCP already
    loaded it in place (into the tensor or a view of it)."""
    if isinstance(loaded, ShardedTensor):
        loaded = loaded.local_shards()[0].tensor
    elif isinstance(loaded, DTensor):
        loaded = loaded.to_local()
    if isinstance(target, DTensor):
        target = target.to_local()
    if loaded.untyped_storage().data_ptr() != target.untyped_storage().data_ptr():
        target.copy_(loaded)


class DMuonModelWrapper(ModelWrapper):
    """``ModelWrapper`` whose state dict holds each dedicated matrix once, on its owner."""

    def __init__(self, model: nn.Module | list[nn.Module]) -> None:
        self.model = [model] if isinstance(model, nn.Module) else model

    def state_dict(self) -> dict:
        sd = {}
        for model in self.model:
            every, owned = _dedicated(model)
            part = get_model_state_dict(model)
            sd.update({k: v for k, v in part.items() if k not in every})
            sd.update({fqn: saved for fqn, (saved, _) in owned.items()})
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        for model in self.model:
            every, owned = _dedicated(model)
            for fqn, (_, master) in owned.items():
                load_into(master, state_dict[fqn])
            if get_dedication(model) is not None:
                get_dedication(model).refresh_from_masters()
            rest = {k: v for k, v in state_dict.items() if k not in every}
            set_model_state_dict(model, rest, options=StateDictOptions(strict=False))


class LRSchedulersWrapper(Stateful):
    """TorchTitan's LR schedulers, loadable from a checkpoint of another optimizer.

    A ``LambdaLR`` state holds one base LR, last LR and lambda state per param group:
    DMuon has two groups (Muon, AdamW), TorchTitan's AdamW one. Resuming one optimizer
    from the other's checkpoint (``--checkpoint.exclude_from_loading optimizer``) would
    restore a state of the wrong length, which fails at the end of the first step. When
    the lengths differ, this run keeps its own base LRs and lambdas, takes the schedule's
    position (``last_epoch``, ``_step_count``) from the checkpoint and sets each group's
    LR to the schedule's value there, as loading the optimizer's state would have. Same
    length: TorchTitan's load, unchanged.
    """

    def __init__(self, lr_schedulers: LRSchedulersContainer) -> None:
        self.lr_schedulers = lr_schedulers

    def state_dict(self) -> dict[str, Any]:
        return self.lr_schedulers.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        scheduler = self.lr_schedulers.schedulers[0]
        saved_groups, groups = len(state_dict["base_lrs"]), len(scheduler.base_lrs)
        if saved_groups == groups:
            self.lr_schedulers.load_state_dict(state_dict)
            return
        step = state_dict["last_epoch"]
        logger.info(
            "lr_scheduler: the checkpoint's schedule is for %d param group(s), this optimizer "
            "has %d: continuing it at step %d with this run's base learning rates",
            saved_groups,
            groups,
            step,
        )
        own = scheduler.state_dict()
        own["last_epoch"], own["_step_count"] = step, state_dict["_step_count"]
        own["_last_lr"] = [
            base * lr_lambda(step)
            for base, lr_lambda in zip(scheduler.base_lrs, scheduler.lr_lambdas, strict=True)
        ]
        self.lr_schedulers.load_state_dict(own)
        for each in self.lr_schedulers:
            for group, lr in zip(each.optimizer.param_groups, each.get_last_lr(), strict=True):
                group["lr"] = lr
