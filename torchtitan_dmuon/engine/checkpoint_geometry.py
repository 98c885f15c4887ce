"""What a checkpoint holds for a dedicated matrix and how a load goes back in: its value or
state whole, as a DTensor shard or as a ``ShardedTensor`` of a split stack's pieces
(:func:`as_saved`), and the loaded tensor put into the owner's (:func:`load_state_into`).
Where the pieces of a split stack lie in the whole stack, and which global rank saves
each (:func:`piece_shards`): per piece the layout knows its own shards
(``ParamLayout.piece_shards``); this adds the owners' global ranks, known once
``verify_plan`` (``Muon``'s constructor) gathered them. The TorchTitan layer's DCP
wrappers (``titan/checkpoint.py``) and any other checkpointer use these; no TorchTitan
here.

:func:`register_state_dict_hooks` makes the model's own ``state_dict`` and
``load_state_dict`` follow the same rule, through ``nn.Module``'s public hooks on each
module holding a dedicated matrix: a checkpointer that reads ``model.state_dict()`` (and
the model's own state-dict hooks, such as a fused projection's split into its
matrices) then saves each dedicated matrix once, from its primary owner, whatever the
topology."""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle

from torchtitan_dmuon.engine import comm
from torchtitan_dmuon.engine.dedication import Dedication
from torchtitan_dmuon.engine.param_layout import PieceShard
from torchtitan_dmuon.engine.plan import DedicatedParam
from torchtitan_dmuon.optim.normuon import second_moment_shape

__all__ = [
    "as_saved",
    "load_into",
    "load_state_into",
    "piece_shards",
    "register_state_dict_hooks",
]


def piece_shards(dedication: Dedication, name: str) -> list[PieceShard]:
    """``(offsets, sizes, global rank of the primary owner)`` of every piece of the split
    stack ``name`` in the whole stack: under expert parallelism the pieces of every ``ep``
    rank's local experts, and under expert tensor parallelism each piece's shards.

    Raises:
        RuntimeError: The owners' global ranks are not known yet (no ``Muon`` built), or
            not at all (the fake backend of a dry run).
    """
    if dedication.slot_ranks is None:
        raise RuntimeError(
            "the owners' global ranks are not known yet: build the Muon optimizer on "
            "the model first (it verifies the plan across ranks)"
        )
    plan, shards = dedication.plan, []
    for u in plan.units:
        domain = plan.domains[u.domain]
        slot = u.primary_replica * domain.shard_size + u.column
        owner = functools.partial(_owner_rank, dedication, u.domain, slot)
        for d in u.params:
            if d.name == name:
                shards += d.layout.piece_shards(owner)
    return sorted(shards)


def _owner_rank(dedication: Dedication, domain: int, slot: int, ep_rank: int, etp_rank: int) -> int:
    """The global rank of the owner in ``slot`` of a plan domain (the experts': of the
    local experts of ``ep_rank``, expert tensor-parallel shard ``etp_rank``)."""
    if domain == 0:
        return dedication.slot_ranks[slot]
    if dedication.expert_owner_ranks is None:
        raise RuntimeError(
            "the split expert stacks' owners are not known under the fake backend (a "
            "dry run gathers nothing): their checkpoints need a real process group"
        )
    return dedication.expert_owner_ranks[ep_rank, slot, etp_rank]


def as_saved(
    dedication: Dedication, entry: DedicatedParam, local: torch.Tensor, per_row: bool = False
) -> torch.Tensor:
    """What a checkpoint holds for a dedicated matrix's value or state (``local``, this
    owner's tensor; DCP loads into it in place through what this returns): whole, a
    DTensor shard or a ``ShardedTensor`` of a stack's pieces, as its layout says (see
    :meth:`~torchtitan_dmuon.engine.param_layout.ParamLayout.saved`).

    ``per_row``: ``local`` holds one value per row of the parameter's matrices (NorMuon's
    second moment, ``(..., rows, 1)``); where each expert tensor-parallel rank saves a
    block of the rows of its copy, :func:`load_state_into` hands each block to the others
    after a load.
    """
    param = entry.param
    shape = second_moment_shape(param.shape) if per_row else param.shape
    shards = functools.partial(piece_shards, dedication, entry.name)
    return entry.layout.saved(param, local, shape, shards, per_row)


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
    collective, run by the piece's ranks for the same entries in the same order); the
    same for an owner group's column blocks, over the group."""
    layout = entry.layout
    if not (per_row and layout.row_blocks):
        load_into(target, loaded)
        return
    mine = loaded.local_shards()[0].tensor
    owners = layout.row_block_owners(piece_shards(dedication, entry.name))
    for part, owner in enumerate(owners):
        start, stop = layout.row_block(target.shape[-2], part)
        block = (
            mine
            if part == layout.column_parts[0]
            else target.new_empty((*target.shape[:-2], stop - start, 1))
        )
        group = dedication.exchange.column_holders(layout)
        source = dist.get_group_rank(group, owner)
        comm.broadcast(block, source, group, dedication.stats, "checkpoint_broadcast").wait()
        target.narrow(-2, start, stop - start).copy_(block)


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


def register_state_dict_hooks(dedication: Dedication) -> list[RemovableHandle]:
    """Make ``dedication.model``'s ``state_dict`` hold each dedicated matrix once, on its
    primary owner, and its ``load_state_dict`` load it there (returns the hooks' handles).

    On each module holding a dedicated matrix (whose ``state_dict`` runs before its
    parent's hooks, which may rename or split the entry):

    * saving: the primary owner's entry becomes :func:`as_saved` of its full-precision
      master (a whole matrix: the master itself, which DCP loads into in place); every
      other rank's entry is removed (a freed or stale copy of compute values);
    * loading: an entry present is taken out of the module's own load (which would copy
      it into the compute values, freed between uses) and, on the primary owner, copied
      into the master; a matrix a rank does not own is not reported missing.

    After a load, the model's post-hook recomputes the compute values from the masters
    (under HSDP, and sends them to the other replicas): a collective, as every rank runs
    ``load_state_dict`` alike. Before a split stack's pieces are read the model binds
    them (``lazy_init``, a collective too, as in any ``state_dict``). Under a dry run's fake
    backend the masters are left as they are (no owner's global rank is known there).
    """
    hooks = _StateDictHooks(dedication)
    model = dedication.model
    # The model's own calls read this rank's owned matrices once, before any module's hook.
    handles = [
        model.register_state_dict_pre_hook(hooks.begin),
        model.register_load_state_dict_pre_hook(hooks.begin),
    ]
    for path, params in hooks.by_module.items():
        module = model.get_submodule(path)
        handles.append(module.register_state_dict_post_hook(functools.partial(hooks.save, params)))
        handles.append(
            module.register_load_state_dict_pre_hook(functools.partial(hooks.load, params))
        )
    # A partial: torch marks a state-dict post-hook with an attribute, which a method refuses.
    handles.append(model.register_state_dict_post_hook(functools.partial(hooks.saved)))
    handles.append(model.register_load_state_dict_post_hook(hooks.loaded))
    return handles


class _StateDictHooks:
    """:func:`register_state_dict_hooks`'s hooks over one dedication."""

    def __init__(self, dedication: Dedication) -> None:
        self.dedication = dedication
        # module path -> (attribute, parameter name) of its dedicated matrices
        self.by_module: dict[str, list[tuple[str, str]]] = {}
        for name in dict.fromkeys(d.name for d in dedication.plan.params):
            path, _, attr = name.rpartition(".")
            self.by_module.setdefault(path, []).append((attr, name))
        self.pieces = any(d.layout.is_piece for d in dedication.plan.params)
        # A dry run's fake backend gathers no owners' global ranks (a split stack's saved
        # form names them) and writes no checkpoint: its state dict holds the masters as
        # they are.
        self.dry_run = comm.is_fake(dedication.exchange.shard_group)
        # keys of the load under way that are not missing: taken here, or not this rank's
        self.not_missing: set[str] = set()
        # this rank's owned matrices during the model's own state_dict or load_state_dict
        self.owned: dict[str, tuple[DedicatedParam, torch.Tensor]] | None = None

    def _read_owned(self) -> dict[str, tuple[DedicatedParam, torch.Tensor]]:
        if self.pieces:
            self.dedication.lazy_init()
        return {entry.name: (entry, master) for entry, master in self.dedication.primary_params()}

    def _owned(self) -> dict[str, tuple[DedicatedParam, torch.Tensor]]:
        # A submodule's own state_dict call reads them itself.
        return self.owned if self.owned is not None else self._read_owned()

    def begin(self, *unused) -> None:
        self.owned = self._read_owned()

    def saved(self, *unused) -> None:
        self.owned = None

    def save(self, params, module, state_dict, prefix, local_metadata) -> None:
        owned = self._owned()
        for attr, name in params:
            key = prefix + attr
            if key not in state_dict:
                continue
            if name in owned:
                entry, master = owned[name]
                saved = master if self.dry_run else as_saved(self.dedication, entry, master)
                state_dict[key] = saved
            else:
                del state_dict[key]

    def load(self, params, module, state_dict, prefix, *unused) -> None:
        owned = self._owned()
        for attr, name in params:
            key = prefix + attr
            taken = state_dict.pop(key, None)
            if taken is not None and name in owned:
                load_into(owned[name][1], taken)
            if taken is not None or name not in owned:
                self.not_missing.add(key)

    def loaded(self, model, incompatible_keys) -> None:
        missing = incompatible_keys.missing_keys
        missing[:] = [key for key in missing if key not in self.not_missing]
        self.not_missing.clear()
        self.owned = None
        self.dedication.refresh_from_masters()
