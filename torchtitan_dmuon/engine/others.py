""":class:`OtherParams`: the trainable parameters no ``fully_shard`` covers and that are not
dedicated, kept in sync DDP-style by the engine.

With no ``fully_shard`` at all (DDP-style) or a partial one, some trainable parameters are
plain tensors that nothing else keeps in sync. The engine starts them from the first
data-parallel rank's values (as DDP does) and all-reduces their gradients in buckets, as
DDP does: in reverse registration order (about the order backward produces them), each
bucket all-reduced over the shard group once every hook boundary holding one of its
parameters has finished its backward and reduced (the hooks call
:meth:`OtherParams.boundary_reduced`), so the reduces overlap the rest of backward; a
bucket with a parameter outside every boundary (an embedding, a head) waits for the end
of backward. Under HSDP each is all-reduced across replicas after backward. Buckets go
out in one fixed order on every rank (a bucket is issued only after the one before it),
at points fixed by the boundaries' backward, never by when a gradient arrives (a
parameter some rank did not use): the same collectives in the same place on every rank,
whatever each rank computed. They run on groups of their own, never over ranks of other
pipeline stages.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.profiler import record_function

from torchtitan_dmuon.engine import comm
from torchtitan_dmuon.engine.boundary import late_gradient, weak_grad_hook
from torchtitan_dmuon.engine.param_layout import like_param, local_grad, local_tensor

__all__ = ["BUCKET_BYTES", "OtherParams", "bucket_params"]

logger = logging.getLogger(__name__)

BUCKET_BYTES = 25 * 2**20
"""A bucket's gradient bytes at most (DDP's default ``bucket_cap_mb``); a larger
parameter gets a bucket of its own."""


def bucket_params(
    params: list[nn.Parameter], cap: int | None = None, holders: list[int | None] | None = None
) -> list[list[int]]:
    """Indices into ``params`` of each bucket, in issue order: by the hook boundary that
    holds them (``holders``, forward indices) in backward order, those outside every
    boundary last; within one, reverse registration order; a new bucket where the
    boundary or the dtype changes or the next gradient would pass ``cap`` bytes (default
    :data:`BUCKET_BYTES`)."""
    cap = BUCKET_BYTES if cap is None else cap
    holders = holders if holders is not None else [None] * len(params)

    def backward_position(i: int) -> tuple[int, int]:
        holder = holders[i]
        return (1, 0) if holder is None else (0, -holder)

    buckets: list[list[int]] = []
    size, key = 0, None
    for i in sorted(reversed(range(len(params))), key=backward_position):
        nbytes = local_tensor(params[i]).numel() * params[i].dtype.itemsize
        this = (holders[i], params[i].dtype)
        if not buckets or this != key or size + nbytes > cap:
            buckets.append([])
            size, key = 0, this
        buckets[-1].append(i)
        size += nbytes
    return buckets


def innermost_boundary(name: str, boundary_names: list[str]) -> int | None:
    """Index in ``boundary_names`` of the innermost hook boundary holding parameter
    ``name`` ("" is the root, which holds everything), or None."""
    best = None
    for b, boundary in enumerate(boundary_names):
        if boundary == "" or name.startswith(boundary + "."):
            if best is None or len(boundary) > len(boundary_names[best]):
                best = b
    return best


def _fsdp_covered_modules(model: nn.Module) -> set[nn.Module]:
    """Modules whose own parameters some ``fully_shard`` manages: an FSDP module and its
    descendants. Decided by structure, not by parameter type: inside a forward FSDP2
    swaps its parameters for plain unsharded tensors."""
    covered: set[nn.Module] = set()
    for module in model.modules():
        if isinstance(module, FSDPModule):
            covered.update(module.modules())
    return covered


@dataclass
class _Bucket:
    """One bucket's parameters and its all-reduce in the current backward."""

    indices: list[int]
    tensor: torch.Tensor | None = None
    work: dist.Work | None = None
    grads: list = field(default_factory=list)  # this rank's, when packed


class OtherParams:
    """The non-dedicated trainable parameters left to the engine.

    Attributes:
        params: Trainable, not dedicated, not FSDP-managed (plain tensors); empty when
            there is one data-parallel rank.
        buckets: Indices into ``params`` per bucket, in issue order.
    """

    def __init__(
        self,
        model: nn.Module,
        dedicated_names: set[str],
        groups: Callable[[], list[dist.ProcessGroup]],
        syncing: Callable[[], bool],
        stats: comm.CommStats,
        ranks: int,
        boundary_names: list[str],
    ) -> None:
        covered = _fsdp_covered_modules(model)
        named = [
            (name, p)
            for name, p in model.named_parameters()
            if p.requires_grad
            and name not in dedicated_names
            and model.get_submodule(name.rpartition(".")[0]) not in covered
        ]
        if ranks == 1:
            named = []
        self.params: list[nn.Parameter] = [p for _, p in named]
        self._ranks = ranks
        self._stats = stats
        self._syncing = syncing
        self._fsdp_anywhere = bool(covered)
        # The engine's own groups, created only where there is something to sync (every
        # rank alike: the selection is structural).
        self._groups = groups() if self.params else []
        holders = [innermost_boundary(name, boundary_names) for name, _ in named]
        self._buckets = [_Bucket(i) for i in bucket_params(self.params, holders=holders)]
        self.buckets = [b.indices for b in self._buckets]
        self._bucket_of = {i: b for b, bucket in enumerate(self._buckets) for i in bucket.indices}
        # The boundary each bucket waits for; None: outside every boundary (end of backward).
        self._due_after = [holders[b[0]] for b in self.buckets]
        self._names = [name for name, _ in named]
        self._reduced: set[int] = set()  # boundaries reduced in this backward
        self._next = 0  # the next bucket to issue
        self._hooks = [
            p.register_post_accumulate_grad_hook(weak_grad_hook(self._check_in_time, i))
            for i, p in enumerate(self.params)
        ]
        if named and self._fsdp_anywhere:
            logger.info(
                "dedicate_params: %d parameters outside every fully_shard are kept in sync "
                "DDP-style by the engine: %s",
                len(named),
                [name for name, _ in named],
            )

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    @torch.no_grad()
    def broadcast_from_rank0(self, model: nn.Module) -> None:
        """Start every replica from the values of the first data-parallel rank, as DDP
        does (with no FSDP at all, the buffers too): from shard rank 0 inside each shard
        group, then from replicate rank 0 across replicas."""
        if not self.params:
            return
        tensors = [local_tensor(p.detach()) for p in self.params]
        if not self._fsdp_anywhere:
            tensors += [b.data for b in model.buffers()]
        for group in self._groups:
            for tensor in tensors:
                comm.broadcast(tensor, 0, group, self._stats, kind="others_broadcast").wait()

    # ---- backward ------------------------------------------------------------------------
    def _check_in_time(self, i: int) -> None:
        if self._syncing() and self._bucket_of[i] < self._next:
            raise late_gradient(
                self._names[i],
                "its hook boundary finished its backward and its DDP-style bucket was reduced",
            )

    def boundary_reduced(self, boundary: int) -> None:
        """Boundary ``boundary`` reduced: issue the buckets now due, in order."""
        self._reduced.add(boundary)
        while self._next < len(self._buckets):
            if self._due_after[self._next] not in self._reduced:  # None: never
                break
            self._issue(self._buckets[self._next])

    def _issue(self, bucket: _Bucket) -> None:
        """Pack the bucket (has-gradient flags after the gradients) and start its
        all-reduce over the shard group."""
        self._next += 1
        with record_function("dmuon::others_all_reduce"):
            params = [self.params[i] for i in bucket.indices]
            bucket.grads = [local_grad(p) for p in params]
            bucket.tensor = comm.flagged_grad_bucket(
                bucket.grads,
                [local_tensor(p).numel() for p in params],
                params[0].dtype,
                params[0].device,
            )
            bucket.work = comm.all_reduce(
                bucket.tensor, self._groups[0], self._stats, "others_all_reduce"
            )

    @property
    def issued(self) -> int:
        """Buckets whose all-reduce this backward issued."""
        return self._next

    @torch.no_grad()
    def sync_grads(self, divide_factor: float) -> None:
        """End of a reduced backward: issue the buckets not issued yet, in order; then
        each bucket's all-reduce lands (across replicas too under HSDP) and its mean (or
        sum, per ``divide_factor``) becomes the gradients.

        The flags tell a gradient no rank computed (stays ``None``) from one some ranks
        computed (the others count as zeros, as DDP with ``find_unused_parameters``). A
        rank that computed a gradient knows some rank did: it reads a flag (a host sync)
        only where it computed none.
        """
        while self._next < len(self._buckets):
            self._issue(self._buckets[self._next])
        for bucket in self._buckets:
            bucket.work.wait()
            for group in self._groups[1:]:
                comm.all_reduce(bucket.tensor, group, self._stats, "others_all_reduce").wait()
            self._unpack(bucket, divide_factor)
        self._reset()

    def _unpack(self, bucket: _Bucket, divide_factor: float) -> None:
        params = [self.params[i] for i in bucket.indices]
        tensor = bucket.tensor
        numel = tensor.numel() - len(params)
        tensor[:numel].div_(divide_factor)
        absent = [k for k, grad in enumerate(bucket.grads) if grad is None]
        has_grad = [True] * len(params)
        if absent:
            for k, flag in zip(absent, tensor[numel:][absent].tolist(), strict=True):
                has_grad[k] = bool(flag)
        offset = 0
        for p, has in zip(params, has_grad, strict=True):
            size = local_tensor(p).numel()
            mean = tensor[offset : offset + size]
            offset += size
            if not has:
                continue
            if isinstance(p, DTensor):  # tensor parallelism: laid out as the parameter
                p.grad = like_param(mean.to(p.dtype, copy=True).view(local_tensor(p).shape), p)
            elif p.grad is None:
                p.grad = mean.to(p.dtype, copy=True)
            else:
                p.grad.copy_(mean.view_as(p.grad))

    def discard(self) -> None:
        """A failed pass's buckets: let the issued all-reduces land and drop them (every
        rank issued the same number: the ranks agreed on it)."""
        for bucket in self._buckets[: self._next]:
            bucket.work.wait()
        self._reset()

    def _reset(self) -> None:
        for bucket in self._buckets:
            bucket.tensor, bucket.work, bucket.grads = None, None, []
        self._reduced = set()
        self._next = 0
