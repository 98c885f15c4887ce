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
* a stack sharded along dim 0 over ``ep`` (``ExpertParallel``), along its matrices over
  ``etp`` (expert TP) or both, or over the TP mesh without expert parallelism
  (``TensorParallel`` of the experts): ``EXPERT_PIECE``, a piece of this rank's local
  experts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum, auto

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from torchtitan_dmuon.optim.newton_schulz import matrix_count

__all__ = [
    "LayoutKind",
    "ParamLayout",
    "expert_parallel_coordinates",
    "expert_tensor_parallel_dim",
    "is_expert_parallel",
    "kind_of",
    "local_grad",
    "local_tensor",
]


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (a tensor-parallel matrix), else ``tensor`` itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


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

    @property
    def is_piece(self) -> bool:
        """A piece of a stack split among owners (its pieces travel apart from whole
        matrices)."""
        return self.experts is not None

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
        """Matrices it stands for in the whole model (every ``ep`` rank's experts)."""
        return matrix_count(self.shape) * self.ep_size

    def experts_of(self, ep_rank: int) -> tuple[int, int]:
        """A piece's ``[start, stop)`` in the whole stack as ``ep_rank`` holds it (after
        the experts of the lower ``ep`` ranks)."""
        first = ep_rank * self.local_experts
        return self.experts[0] + first, self.experts[1] + first

    @property
    def global_experts(self) -> tuple[int, int] | None:
        """This rank's piece's ``[start, stop)`` in the whole stack (None for a matrix)."""
        return None if self.experts is None else self.experts_of(self.ep_rank)

    def select(self, value: torch.Tensor) -> torch.Tensor:
        """Its part of a local value of the whole parameter (a piece's experts)."""
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
