"""A dedicated matrix's layout across ranks, computed once when the plan is built.

As FSDP2's ``FSDPParam`` owns a parameter's sharding and TP spec, a :class:`ParamLayout`
holds everything the engine needs to know about how one dedicated matrix (or piece of a
stack) lies over the ranks: its kind, global and local shape, the dim tensor parallelism
splits, its experts, its expert-parallel coordinates and where its storage lives. The rest
of the engine asks the layout; only this module looks at DTensor placements.

TorchTitan's layouts, and the kind each becomes:

* a plain matrix, or a DTensor replicated over the TP mesh (``NoParallel``): ``WHOLE``;
* a 2-D DTensor split along rows (``Colwise``) or columns (``Rowwise``): ``TP_SHARD``;
* a plain 3-D stack of experts, split among owners: ``STACK_PIECE``;
* a plain matrix owned by a group of ranks: ``BLOCK``, one of its equal blocks along its
  long side per member;
* a stack sharded along dim 0 over ``ep`` (``ExpertParallel``), along its matrices over
  ``etp`` (expert TP) or both, or over the TP mesh without expert parallelism
  (``TensorParallel`` of the experts): ``EXPERT_PIECE``, a piece of this rank's local
  experts.

This module also checks, on one rank and with no collective, the layouts
``dedicate_params`` accepts: the meshes it is given, the tensor-parallel DTensors (a 2-D
matrix split evenly along one dim over one 1-D mesh, or replicated), the expert-parallel
stacks and the mesh of the ranks that hold the same experts. Each check names the argument
or parameter; what depends on the rank's selection is then agreed over every rank
(``verification.agree_on_intent``) before it raises. And it gives the views a checkpoint
saves and loads a layout through (whole, a DTensor shard, a ``ShardedTensor`` of a stack's
pieces), and the full value a reader gathers.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum, auto

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard as TensorShard
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import (
    ShardedTensorMetadata,
    TensorProperties,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from torchtitan_dmuon.optim.newton_schulz import matrix_count, ns_flops, split_ns_flops
from torchtitan_dmuon.optim.sharded_ns import sharded_ns_method

__all__ = [
    "LayoutKind",
    "ParamLayout",
    "PieceShard",
    "bias_entries",
    "check_orthogonal",
    "dedication_domain",
    "expert_domain_mesh",
    "expert_parallel_coordinates",
    "expert_tensor_parallel_dim",
    "held_rows",
    "is_expert_parallel",
    "kind_of",
    "like_param",
    "local_grad",
    "local_tensor",
    "model_tensor_parallel_mesh",
    "split_among_owners",
    "tensor_parallel_mesh",
    "validate_meshes",
]

# ``(offsets, sizes, global rank of its owner)`` of one shard of a split stack, in the
# whole stack.
PieceShard = tuple[list[int], list[int], int]


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (a tensor-parallel matrix), else ``tensor`` itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def like_param(local: torch.Tensor, param: nn.Parameter) -> torch.Tensor:
    """``local`` (this rank's values, shaped as ``param``'s local tensor) laid out as
    ``param``: a DTensor over its mesh and placements under tensor parallelism, else
    ``local`` itself."""
    if not isinstance(param, DTensor):
        return local
    return DTensor.from_local(
        local, param.device_mesh, param.placements, run_check=False,
        shape=param.shape, stride=param.stride(),
    )  # fmt: skip


def local_grad(param: nn.Parameter) -> torch.Tensor | None:
    """This rank's gradient of ``param``, laid out as its local tensor (None if none)."""
    grad = param.grad
    if isinstance(grad, DTensor):
        if grad.placements != param.placements:
            # Laid out otherwise (e.g. partial sums of an embedding's): this rank's shard,
            # as the parameter is laid out.
            grad = grad.redistribute(param.device_mesh, param.placements)
        grad = grad.to_local()
    return grad


def _expert_mesh_dims(tensor: torch.Tensor) -> tuple[int | None, int | None] | None:
    """``(ep, etp)``: the mesh dims of a stack of routed experts laid out as TorchTitan's
    MoE styles do (None where it has no such dim), or None for any other tensor."""
    if not isinstance(tensor, DTensor) or tensor.ndim != 3:
        return None
    placements = tuple(tensor.placements)
    split = (Shard(1), Shard(2))
    if placements == (Shard(0),):
        return 0, None
    if len(placements) == 1 and placements[0] in split:
        return None, 0
    if len(placements) == 2 and placements[0] == Shard(0) and placements[1] in split:
        return 0, 1
    return None


def is_expert_parallel(tensor: torch.Tensor) -> bool:
    """A stack of routed experts sharded over an ``ep`` mesh, an ``etp`` mesh or both:
    dedicated in pieces of this rank's local experts over the ranks that hold the same
    experts."""
    return _expert_mesh_dims(tensor) is not None


def expert_parallel_coordinates(tensor: DTensor) -> tuple[int, int, int, int]:
    """``(ep rank, ep size, etp rank, etp size)`` of an expert stack (0, 1 for a mesh dim
    it does not have: ep without expert parallelism, etp without tensor parallelism)."""
    mesh = tensor.device_mesh

    def coordinates(dim: int | None) -> tuple[int, int]:
        return (0, 1) if dim is None else (mesh.get_local_rank(dim), mesh.size(dim))

    ep, etp = _expert_mesh_dims(tensor)
    return (*coordinates(ep), *coordinates(etp))


def expert_tensor_parallel_dim(tensor: DTensor) -> int | None:
    """The mesh dim an expert stack's matrices are split over (``etp``, or the TP mesh
    without expert parallelism), or None when they are whole."""
    return _expert_mesh_dims(tensor)[1]


class LayoutKind(Enum):
    """How a dedicated matrix or piece lies over the ranks (see the module docstring)."""

    WHOLE = auto()
    TP_SHARD = auto()
    STACK_PIECE = auto()
    EXPERT_PIECE = auto()
    BLOCK = auto()


def kind_of(param: torch.Tensor) -> LayoutKind:
    """The kind a selected parameter is dedicated as (a stack's pieces share it)."""
    if is_expert_parallel(param):
        return LayoutKind.EXPERT_PIECE
    if isinstance(param, DTensor):
        placement = param.placements[0]
        return LayoutKind.TP_SHARD if isinstance(placement, Shard) else LayoutKind.WHOLE
    if param.ndim == 3 and param.shape[0] > 1:
        return LayoutKind.STACK_PIECE
    return LayoutKind.WHOLE


def dedication_domain(param: torch.Tensor) -> int:
    """The plan domain a selected parameter is dedicated in: 1, the experts' (a stack
    sharded over an ``ep`` or ``etp`` mesh), else 0 (the dense one)."""
    return 1 if is_expert_parallel(param) else 0


def split_among_owners(param: torch.Tensor) -> bool:
    """Whether a selected parameter is a stack dedicated in pieces of its local experts,
    each piece with an owner of its own."""
    return kind_of(param) in (LayoutKind.STACK_PIECE, LayoutKind.EXPERT_PIECE)


def _split_dim(param: torch.Tensor, kind: LayoutKind) -> int | None:
    if kind is LayoutKind.EXPERT_PIECE:
        etp = expert_tensor_parallel_dim(param)
        return None if etp is None else param.placements[etp].dim - 3
    if kind is LayoutKind.TP_SHARD:
        return param.placements[0].dim - param.ndim
    return None


@dataclass(frozen=True)
class ParamLayout:
    """One dedicated matrix or piece of a stack, as it lies over the ranks.

    Attributes:
        kind: Its :class:`LayoutKind`.
        shape: What it dedicates, with whole matrices (a piece's experts only).
        local_shape: What this rank stores of it (its shard under tensor parallelism).
        split_dim: Under (expert) tensor parallelism, the dim its matrices are split
            along (-2 rows, -1 columns); None when each rank has them whole.
        experts: A piece's ``[start, stop)`` along dim 0 of the local stack, else None.
        dtensor: The parameter is a DTensor: stored, moved and refilled as its local
            tensor.
        ep_rank / ep_size: This rank's coordinate on the ``ep`` mesh dim and its size (0
            and 1 without one); etp_rank / etp_size: the same of ``etp``.
        local_experts: Experts in this rank's local stack (0 for a matrix).
        block: A ``BLOCK``'s ``(index, count)`` among its matrix's blocks, else None.
        block_dim: The dim its matrix is split into blocks along (0 or 1), else None.
    """

    kind: LayoutKind
    shape: torch.Size
    local_shape: torch.Size
    split_dim: int | None
    experts: tuple[int, int] | None
    dtensor: bool
    ep_rank: int = 0
    ep_size: int = 1
    etp_rank: int = 0
    etp_size: int = 1
    local_experts: int = 0
    block: tuple[int, int] | None = None
    block_dim: int | None = None

    @classmethod
    def of(cls, param: torch.Tensor, experts: tuple[int, int] | None = None) -> ParamLayout:
        """The layout of ``param`` (of its piece ``experts`` of the local stack)."""
        kind = kind_of(param)
        if (experts is None) != (kind not in (LayoutKind.STACK_PIECE, LayoutKind.EXPERT_PIECE)):
            raise ValueError(f"a {kind.name} layout takes experts only for a piece, got {experts}")
        local = local_tensor(param).shape
        shape, local_shape, coordinates = param.shape, local, (0, 1, 0, 1)
        if experts is not None:
            count = experts[1] - experts[0]
            shape = torch.Size((count, *param.shape[1:]))
            local_shape = torch.Size((count, *local[1:]))
        if kind is LayoutKind.EXPERT_PIECE:
            coordinates = expert_parallel_coordinates(param)
        return cls(
            kind, shape, local_shape, _split_dim(param, kind), experts,
            isinstance(param, DTensor), *coordinates, local[0] if param.ndim == 3 else 0,
        )  # fmt: skip

    @classmethod
    def of_block(cls, param: torch.Tensor, index: int, count: int) -> ParamLayout:
        """Block ``index`` of ``count`` equal blocks of a plain matrix along its long side
        (columns when square), which an owner group orthogonalizes together.

        Raises:
            ValueError: ``param`` is not a plain matrix or its long side does not split
                evenly into ``count`` blocks.
        """
        if isinstance(param, DTensor) or param.ndim != 2:
            raise ValueError(
                f"an owner group takes plain 2-D matrices, got {type(param).__name__} of "
                f"shape {tuple(param.shape)}"
            )
        dim = 0 if param.shape[0] > param.shape[1] else 1
        if param.shape[dim] % count != 0 or not 0 <= index < count:
            raise ValueError(
                f"cannot split a {tuple(param.shape)} matrix into {count} blocks along dim {dim}"
            )
        local = list(param.shape)
        local[dim] //= count
        return cls(
            LayoutKind.BLOCK, param.shape, torch.Size(local), None, None, False,
            block=(index, count), block_dim=dim,
        )  # fmt: skip

    @property
    def is_piece(self) -> bool:
        """A piece of a stack split among owners, or a block of an owner group's matrix
        (pieces travel apart from whole matrices, and refill their parameter)."""
        return self.experts is not None or self.block is not None

    def ns_cost(self, steps: int) -> int:
        """Multiply-adds of its Newton-Schulz on its owner (a block's share of its owner
        group's: :func:`~torchtitan_dmuon.optim.newton_schulz.split_ns_flops`)."""
        if self.block is not None:
            return split_ns_flops(self.shape, steps, self.block[1])
        return ns_flops(self.shape, steps)

    @property
    def block_start(self) -> int:
        """A block's first row or column in its matrix."""
        return self.block[0] * self.local_shape[self.block_dim]

    @property
    def numel(self) -> int:
        return math.prod(self.local_shape)

    @property
    def refills(self) -> bool:
        """Whether its parameter computes from storage of its own, refilled after each
        gather, rather than from a view of its unit's flat buffer: a piece (the model
        sees one stack) or a DTensor's local tensor (a view Dynamo cannot trace)."""
        return self.is_piece or self.dtensor

    @property
    def differs_per_tp_rank(self) -> bool:
        """Whether each tensor-parallel rank owns other values of it: a tensor-parallel
        shard, or expert-parallel experts (``ep`` may borrow the TP ranks)."""
        return self.split_dim is not None or self.kind is LayoutKind.EXPERT_PIECE

    @property
    def splits_columns(self) -> bool:
        """Whether (expert) tensor parallelism splits its matrices' columns: each TP rank
        then holds a part of every row (Rowwise), else whole rows or none split."""
        return (
            self.split_dim is not None and self.split_dim % len(self.shape) == len(self.shape) - 1
        )

    @property
    def matrices(self) -> int:
        """Matrices it stands for in the whole model (every ``ep`` rank's experts; an
        owner group's matrix once, by its first block)."""
        if self.block is not None:
            return int(self.block[0] == 0)
        return matrix_count(self.shape) * self.ep_size

    def experts_of(self, ep_rank: int) -> tuple[int, int]:
        """A piece's ``[start, stop)`` in the whole stack as ``ep_rank`` holds it (after
        the experts of the lower ``ep`` ranks)."""
        first = ep_rank * self.local_experts
        return self.experts[0] + first, self.experts[1] + first

    def select(self, value: torch.Tensor) -> torch.Tensor:
        """Its part of a local value of the whole parameter (a piece's experts, a block's
        rows or columns)."""
        if self.block is not None:
            return value.narrow(self.block_dim, self.block_start, self.local_shape[self.block_dim])
        return value if self.experts is None else value[self.experts[0] : self.experts[1]]

    def value(self, param: nn.Parameter) -> torch.Tensor:
        """Its current local value in ``param``."""
        return self.select(local_tensor(param).detach())

    def storage(self, param: nn.Parameter) -> torch.Tensor:
        """The tensor whose ``.data`` holds ``param``'s local values."""
        return param._local_tensor if self.dtensor else param

    def local_grad(self, param: nn.Parameter) -> torch.Tensor | None:
        """This rank's gradient of its part of ``param``, laid out as the local value."""
        grad = local_grad(param)
        return None if grad is None else self.select(grad)

    # ---- tensor-parallel Newton-Schulz --------------------------------------------------
    def tp_ns_method(self, backend: str, dtype: torch.dtype, steps: int) -> str | None:
        """How its owner column's tensor-parallel ranks orthogonalize it (``"gram"`` or
        ``"gather"``, see ``optim/sharded_ns.py``), or None when each rank has its
        matrices whole."""
        if self.split_dim is None:
            return None
        return sharded_ns_method(self.shape, self.split_dim, dtype.itemsize, steps, backend=backend)

    # ---- full values --------------------------------------------------------------------
    def unsplit(
        self, value: torch.Tensor, gather_shards: Callable[[torch.Tensor], list[torch.Tensor]]
    ) -> torch.Tensor:
        """The whole matrices of this rank's shard ``value``: every tensor-parallel rank's
        shard (``gather_shards``, a collective over them) side by side along the split dim;
        ``value`` itself when each rank has them whole."""
        if self.split_dim is None:
            return value
        return torch.cat(gather_shards(value), dim=self.split_dim)

    def all_experts(self, value: torch.Tensor, param: DTensor) -> torch.Tensor:
        """Every ``ep`` rank's local experts, in order, from this rank's ``value`` of its
        local stack (a collective over the ``ep`` mesh); ``value`` itself without expert
        parallelism."""
        if self.ep_size <= 1:
            return value
        placements = [Shard(0)] + [Replicate()] * (param.device_mesh.ndim - 1)
        value = DTensor.from_local(value, param.device_mesh, placements, run_check=False)
        return value.full_tensor()

    # ---- checkpoint geometry ------------------------------------------------------------
    def piece_shards(self, owner: Callable[[int, int], int]) -> list[PieceShard]:
        """``(offsets, sizes, owner(ep rank, etp rank))`` of this piece in the whole stack,
        as each ``ep`` rank holds it (its local experts) and in each expert
        tensor-parallel shard; none for a whole matrix."""
        if self.block is not None:
            offsets = [0, 0]
            offsets[self.block_dim] = self.block_start
            return [(offsets, list(self.local_shape), owner(0, 0))]
        if self.experts is None:
            return []
        sizes = list(self.local_shape)
        shards = []
        for ep_rank in range(self.ep_size):
            for etp_rank in range(self.etp_size):
                offsets = [self.experts_of(ep_rank)[0], 0, 0]
                if self.split_dim is not None:
                    offsets[self.split_dim] = etp_rank * sizes[self.split_dim]
                shards.append((offsets, sizes, owner(ep_rank, etp_rank)))
        return shards

    @property
    def column_parts(self) -> tuple[int, int]:
        """``(this holder's index, holders)`` among the holders of a column-split piece's
        parts: expert tensor-parallel ranks, or an owner group's blocks."""
        return self.block if self.block is not None else (self.etp_rank, self.etp_size)

    @property
    def splits_piece_columns(self) -> bool:
        """A piece whose columns its holders split: every one of them holds all rows."""
        return self.is_piece and (self.splits_columns or self.block_dim == 1)

    @property
    def row_blocks(self) -> bool:
        """Whether its per-row state (NorMuon's second moment) is saved and loaded in
        blocks of rows, one per holder of a part of its columns (expert tensor-parallel
        ranks, an owner group's members): each holds a copy of the same rows, and DCP
        wants disjoint shards."""
        return self.splits_piece_columns

    def row_block(self, rows: int, part: int | None = None) -> tuple[int, int]:
        """The rows of a column-split piece's per-row state that its holder ``part``
        (default: this rank) saves and loads."""
        index, parts = self.column_parts
        part = index if part is None else part
        return rows * part // parts, rows * (part + 1) // parts

    def row_block_owners(self, shards: list[PieceShard]) -> list[int]:
        """The global rank that loads each holder's block of the rows of this rank's
        piece, in holder order, from the piece's ``shards``."""
        if self.block is not None:
            return [rank for _, _, rank in sorted(shards, key=lambda shard: shard[0][-1])]
        first_expert = self.experts_of(self.ep_rank)[0]
        owners = {
            offsets[-1] // sizes[-1]: rank
            for offsets, sizes, rank in shards
            if offsets[0] == first_expert
        }
        return [owners[etp_rank] for etp_rank in range(self.etp_size)]

    def saved(
        self,
        param: nn.Parameter,
        local: torch.Tensor,
        shape: torch.Size,
        shards: Callable[[], list[PieceShard]],
        per_row: bool = False,
    ) -> torch.Tensor:
        """What a checkpoint holds for a dedicated matrix's value or state of the global
        ``shape`` (``local``, this owner's tensor; DCP loads into it in place through what
        this returns):

        * a whole matrix (also one replicated over the tensor-parallel ranks): ``local``;
        * under tensor parallelism: this rank's shard as a DTensor laid out like the
          parameter (DCP reassembles and reshards it);
        * a piece of a split stack: a ``ShardedTensor`` of the stack's shape whose local
          shard is ``local`` and whose other shards are the other owners' pieces
          (``shards()``; under expert parallelism, of every ``ep`` rank's experts: the
          whole stack, as without).

        ``per_row``: ``local`` holds one value per row of the parameter's matrices
        (NorMuon's second moment, ``(..., rows, 1)``): the same layout with the last dim
        collapsed. A split of the columns leaves every tensor-parallel rank a copy of the
        same rows: replicated in the DTensor; in a stack's piece each expert
        tensor-parallel rank saves and loads a block of the rows of its copy
        (:attr:`row_blocks`).
        """
        if self.is_piece:
            metadata = self._piece_metadata(shards(), local, per_row)
            # A rank owns at most one piece (or piece's shard) of each stack.
            mine = [md for md in metadata if md.placement.rank() == dist.get_rank()]
            if per_row and self.splits_piece_columns:
                # Saved from a copy, loaded into one: the loader puts it in place.
                start, stop = self.row_block(self.local_shape[-2])
                local = local.narrow(-2, start, stop - start).contiguous()
            tensor_metadata = ShardedTensorMetadata(
                metadata,
                torch.Size(shape),
                TensorProperties(dtype=local.dtype, layout=torch.strided),
            )
            return ShardedTensor._init_from_local_shards_and_global_metadata(
                [TensorShard(local, md) for md in mine], tensor_metadata
            )
        if isinstance(local, DTensor) or self.split_dim is None:
            return local  # whole (a replicated DTensor's local tensor is the whole matrix)
        placements, stride = param.placements, param.stride()
        if per_row:
            # The one Shard of the (1-D) TP mesh is the split; columns split: every rank
            # holds the same rows.
            if self.splits_columns:
                placements = [Replicate() if pl.is_shard() else pl for pl in placements]
            stride = _contiguous_strides(shape)
        return DTensor.from_local(
            local, param.device_mesh, placements, run_check=False,
            shape=torch.Size(shape), stride=stride,
        )  # fmt: skip

    def _piece_metadata(
        self, shards: list[PieceShard], local: torch.Tensor, per_row: bool
    ) -> list[ShardMetadata]:
        """The shards of a split stack's pieces (of their per-row state: the last dim
        collapsed; where the columns are split, each rank's block of the rows)."""
        metadata = []
        for offsets, sizes, rank in shards:
            if per_row:
                rows, row_offset = sizes[-2], offsets[-2]
                if self.splits_piece_columns:
                    start, stop = self.row_block(rows, offsets[-1] // sizes[-1])
                    rows, row_offset = stop - start, row_offset + start
                offsets = [*offsets[:-2], row_offset, 0]
                sizes = [*sizes[:-2], rows, 1]
            metadata.append(ShardMetadata(offsets, sizes, placement=f"rank:{rank}/{local.device}"))
        return metadata


def _contiguous_strides(shape) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


# ---- the layouts dedicate_params accepts -------------------------------------------


def model_tensor_parallel_mesh(model: nn.Module) -> DeviceMesh | None:
    """The 1-D mesh of the model's first tensor-parallel DTensor parameter (not an expert
    stack), whatever the predicate selects, or None."""
    for p in model.parameters():
        if isinstance(p, DTensor) and p.device_mesh.ndim == 1 and not is_expert_parallel(p):
            return p.device_mesh
    return None


def check_orthogonal(mesh: DeviceMesh, tp_mesh: DeviceMesh | None) -> None:
    """The data-parallel ``mesh`` and the tensor-parallel one share this rank only.

    Raises:
        ValueError: ``mesh`` holds other ranks of the TP mesh (the TP mesh was passed).
    """
    if tp_mesh is None:
        return
    shared = set(mesh.mesh.flatten().tolist()) & set(tp_mesh.mesh.flatten().tolist())
    if len(shared) > 1:
        raise ValueError(
            f"mesh: ranks {sorted(shared)} of it are also the tensor-parallel mesh of the "
            "selected DTensors; pass the data-parallel mesh (e.g. world_mesh['dp']): "
            "dedicate_params finds the tensor-parallel mesh from the DTensors"
        )


def tensor_parallel_mesh(selected: list[tuple[str, nn.Parameter]]) -> DeviceMesh | None:
    """The one 1-D mesh the tensor-parallel (DTensor) matrices are sharded over, or None.

    Each such matrix must be a 2-D DTensor split evenly along one of its dims (TorchTitan's
    Colwise: rows, Rowwise: columns) over that mesh, or replicated over a 1-D mesh
    (TorchTitan's NoParallel: dedicated whole).

    Raises:
        ValueError: a layout the engine cannot handle, naming the parameter.
    """
    meshes = []
    for name, p in selected:
        if is_expert_parallel(p):
            if expert_tensor_parallel_dim(p) is not None:  # split over the TP ranks too
                meshes.append((name, _etp_mesh(name, p)))
            continue
        if not isinstance(p, DTensor):
            continue
        placements, shape = p.placements, tuple(p.shape)
        if p.ndim == 2 and p.device_mesh.ndim == 1 and isinstance(placements[0], Replicate):
            continue  # whole on every TP rank (TorchTitan's NoParallel): no TP collective
        ok = (
            p.ndim == 2
            and p.device_mesh.ndim == 1
            and isinstance(placements[0], Shard)
            and shape[placements[0].dim] % p.device_mesh.size() == 0
        )
        if not ok:
            raise ValueError(
                f"{name!r}: a tensor-parallel matrix must be a 2-D DTensor split evenly "
                f"along one dim over a 1-D mesh; got shape {shape}, placements {placements} "
                f"over a {p.device_mesh.ndim}-D mesh of {p.device_mesh.size()} ranks"
            )
        meshes.append((name, p.device_mesh))
    if len({tuple(m.mesh.flatten().tolist()) for _, m in meshes}) > 1:
        raise ValueError(
            "the tensor-parallel matrices are sharded over different meshes: "
            f"{[(name, m.mesh.tolist()) for name, m in meshes]}"
        )
    return meshes[0][1] if meshes else None


def _etp_mesh(name: str, stack: DTensor) -> DeviceMesh:
    """The mesh an expert stack's matrices are split over (a dim of its mesh)."""
    mesh, etp = stack.device_mesh, expert_tensor_parallel_dim(stack)
    split = stack.placements[etp].dim
    if stack.shape[split] % mesh.size(etp) != 0 or (mesh.ndim > 1 and not mesh.mesh_dim_names):
        raise ValueError(
            f"{name!r}: an expert-tensor-parallel stack must be split evenly over a named "
            f"mesh dim; got shape {tuple(stack.shape)} over mesh dims {mesh.mesh_dim_names}"
        )
    return mesh if mesh.ndim == 1 else mesh[mesh.mesh_dim_names[etp]]


def expert_domain_mesh(
    selected: list[tuple[str, nn.Parameter]],
    mesh: DeviceMesh,
    expert_mesh: DeviceMesh | None,
    tp_mesh: DeviceMesh | None,
) -> DeviceMesh | None:
    """The shard mesh of the experts' domain, once the stacks' layout is checked: the
    ranks that hold the same experts (``expert_mesh``; ``mesh`` itself when the stacks
    are split over the TP ranks only, every rank holding every expert), or None when no
    expert stack is selected.

    Raises:
        ValueError: expert-parallel stacks without ``expert_mesh``, over different
            meshes or unevenly, or an ``expert_mesh`` that does not make up the shard
            mesh (times the tensor-parallel mesh, whose ranks ``ep`` may borrow)
            together with the ``ep`` mesh.
    """
    stacks = [(name, p) for name, p in selected if is_expert_parallel(p)]
    if not stacks:
        return None
    _, ep_size, _, etp_size = expert_parallel_coordinates(stacks[0][1])
    if expert_mesh is None and ep_size == 1:
        expert_mesh = mesh
    if expert_mesh is None:
        raise ValueError(
            f"{stacks[0][0]!r} is sharded over an expert-parallel mesh: pass expert_mesh "
            "(the mesh of the ranks that hold the same experts, TorchTitan's efsdp)"
        )
    ep_meshes = {tuple(p.device_mesh.mesh.flatten().tolist()) for _, p in stacks}
    if len(ep_meshes) > 1:
        raise ValueError(
            f"the expert stacks are sharded over different meshes: {sorted(ep_meshes)}"
        )
    for name, p in stacks:
        if p.shape[0] % ep_size != 0:
            raise ValueError(
                f"{name!r}: {p.shape[0]} experts do not split evenly over {ep_size} "
                "expert-parallel ranks"
            )
    tp_size = tp_mesh.size() if tp_mesh is not None else 1
    if expert_mesh.size() * ep_size * etp_size != mesh.size() * tp_size:
        raise ValueError(
            f"expert_mesh ({expert_mesh.size()} ranks) x the ep mesh ({ep_size} ranks) x "
            f"the etp mesh ({etp_size} ranks) must make up mesh ({mesh.size()} ranks) x "
            f"the tensor-parallel mesh ({tp_size} ranks)"
        )
    return expert_mesh


def validate_meshes(
    mesh: DeviceMesh, replicate_mesh: DeviceMesh | None, expert_mesh: DeviceMesh | None
) -> None:
    if not dist.is_initialized():
        raise RuntimeError("dedicate_params needs an initialized default process group")
    for arg, m in (
        ("mesh", mesh),
        ("replicate_mesh", replicate_mesh),
        ("expert_mesh", expert_mesh),
    ):
        if m is None:
            continue
        if not isinstance(m, DeviceMesh):
            raise TypeError(f"{arg} must be a DeviceMesh, got {type(m).__name__}")
        if m.ndim != 1:
            raise ValueError(
                f"{arg} must be 1-D, got a {m.ndim}-D mesh; for HSDP pass hsdp['shard'] as "
                "mesh and hsdp['replicate'] as replicate_mesh"
            )
    # The meshes need not span the world: under pipeline parallelism they are the
    # data-parallel ranks of one stage.
    if replicate_mesh is None:
        return
    shard_ranks = set(mesh.mesh.flatten().tolist())
    replicate_ranks = set(replicate_mesh.mesh.flatten().tolist())
    if shard_ranks & replicate_ranks != {dist.get_rank()}:
        raise ValueError(
            "replicate_mesh does not line up with mesh: expected the shard group "
            f"({sorted(shard_ranks)}) and the replicate group ({sorted(replicate_ranks)}) "
            "to meet in this rank only; use hsdp['shard'] and hsdp['replicate'] of one "
            "2-D mesh"
        )


def held_rows(tensor: torch.Tensor) -> torch.Tensor:
    """The indices along dim 0 of the rows (a 1-D tensor's entries) this rank holds of
    ``tensor``: all of a plain tensor; a DTensor's as its placements split dim 0 (FSDP2's
    ``Shard(0)``, strided over tensor parallelism or not, TP's ``Shard(0)``), whatever the
    order, by distributing the indices themselves (no communication). On the CPU, from
    the shape and placements only: an unheld matrix's storage is freed."""
    if not isinstance(tensor, DTensor):
        return torch.arange(tensor.shape[0])
    mesh = tensor.device_mesh
    rows = torch.arange(tensor.shape[0], device=mesh.device_type)
    # Only what splits dim 0 moves rows; a split of the columns leaves each row here.
    placements = [p if getattr(p, "dim", None) == 0 else Replicate() for p in tensor.placements]
    return distribute_tensor(rows, mesh, placements, src_data_rank=None).to_local().cpu()


def bias_entries(
    weight: torch.Tensor, bias: torch.Tensor, rows, local_rows: int
) -> torch.Tensor | None:
    """The row of each entry of ``bias`` this rank holds among the ``local_rows`` rows of
    ``weight`` whose heads' factors this rank computes (None: the whole bias, in order);
    ``rows`` is QK-clip's ``HeadRows`` of the projection (its ``name`` and ``bias``).

    Raises:
        ValueError: Naming the bias, where its entries cannot be located among those rows.
    """
    if bias.shape[0] != weight.shape[0]:
        raise ValueError(
            f"qk_clip: {rows.bias} has {bias.shape[0]} entries, {rows.name} has "
            f"{weight.shape[0]} rows: it is not that projection's bias"
        )
    if not isinstance(weight, DTensor) and not isinstance(bias, DTensor):
        return None
    weight_rows = held_rows(weight)
    start = int(weight_rows[0]) if weight_rows.numel() else 0
    if weight_rows.numel() != local_rows or not torch.equal(
        weight_rows, torch.arange(start, start + local_rows)
    ):
        raise ValueError(
            f"qk_clip: {rows.name} ({getattr(weight, 'placements', 'plain')}) does not hold "
            f"{local_rows} consecutive rows here, so {rows.bias}'s entries cannot be located "
            "among its heads"
        )
    index = held_rows(bias) - start
    if index.numel() and (int(index.min()) < 0 or int(index.max()) >= local_rows):
        raise ValueError(
            f"qk_clip: {rows.bias} ({getattr(bias, 'placements', 'plain')}) holds entries "
            f"here outside the rows {start}..{start + local_rows - 1} of {rows.name} "
            f"({getattr(weight, 'placements', 'plain')}) whose heads' maxima this rank "
            "reduces: their clip factors are not known here; shard the bias like its rows"
        )
    return index.to(bias.device)
