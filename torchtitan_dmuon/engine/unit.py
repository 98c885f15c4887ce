"""A unit's storage: one flat buffer per (boundary, owner slot) and its gradients.

The whole matrices of a unit are views of its flat buffer (in the compute dtype), each
at its plan offset: a multiple of ``VIEW_ALIGNMENT`` elements, so every view of every
buffer in the unit's layout (values, masters, gradients) is 16-byte aligned. Ranks
outside the unit's column free the buffer's storage between uses and re-grow the *same*
storage before the next use (as FSDP2 does with its unsharded parameters), so every view
that autograd saved in forward still sees the values in backward. The primary owner keeps
a full-precision master under mixed precision, and the reduced gradient in the master
dtype, accumulated over micro-batches until ``zero_grad``.

Two kinds of parameters compute from storage of their own (a :class:`RefilledParam`,
freed and re-grown like a flat buffer), refilled from the unit's values after each gather,
as FSDP2 copies its all-gather output into its unsharded parameters: a split 3-D stack
(groups of MoE experts), whose pieces travel in a second buffer of the unit (the model
sees one stacked parameter, each owner keeps its pieces only), and a tensor-parallel
shard (a DTensor whose local tensor views another buffer cannot be traced by Dynamo).

Reduce buckets are transient: each lives from its boundary's reduce to the end of
backward, and the owner's reduced gradient from the end of backward to ``zero_grad``
(FSDP2's ``set_to_none``), so between steps a rank keeps only its values, masters and
momentum.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from torchtitan_dmuon.engine import fsdp
from torchtitan_dmuon.engine.comm import flagged_grad_bucket
from torchtitan_dmuon.engine.param_layout import ParamLayout, local_tensor
from torchtitan_dmuon.engine.plan import DedicatedParam, HeldDtypes, Plan, UnitPlan

__all__ = ["RefilledParam", "Unit", "bind_boundary", "freed_tensor", "unit_dtypes"]


def unit_dtypes(
    master: torch.dtype, param_dtype: torch.dtype | None, reduce_dtype: torch.dtype | None
) -> tuple[torch.dtype, torch.dtype]:
    """``(values, reduce)`` dtypes of a unit of ``master``-dtype parameters under an FSDP2
    ``MixedPrecisionPolicy``: its buffers (what forward uses, what is broadcast) in
    ``param_dtype``, its gradients reduced in ``reduce_dtype``, by FSDP2's default where
    that is None (torch 2.15: the parameters' own dtype; up to 2.14: the compute dtype,
    :data:`~torchtitan_dmuon.engine.fsdp.REDUCES_IN_PARAM_DTYPE`); None: no such policy
    entry."""
    values = param_dtype or master
    return values, reduce_dtype or (master if fsdp.REDUCES_IN_PARAM_DTYPE else values)


def freed_tensor(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """A contiguous tensor of ``shape`` whose storage is freed: ``allocate`` grows it
    before use. (Allocated for a moment, as FSDP2's unsharded parameters: torch gives a
    tensor its shape only with the storage to hold it.)"""
    tensor = torch.empty(shape, dtype=dtype, device=device)
    tensor.untyped_storage().resize_(0)
    return tensor


class RefilledParam:
    """A dedicated parameter with storage of its own, on every rank: a split stack or a
    tensor-parallel shard (its local tensor).

    Its storage is freed between uses and re-grown (the same storage, so the views
    autograd saved stay valid) before the unit's values are copied into it.

    Attributes:
        tensor: Its value (the local shard under tensor parallelism), in the compute
            dtype; the parameter's data.
    """

    def __init__(self, param: nn.Parameter, layout: ParamLayout, dtype: torch.dtype) -> None:
        local = local_tensor(param)
        # No values: each use refills it after the gather.
        self.tensor = freed_tensor(local.shape, dtype, local.device)
        layout.storage(param).data = self.tensor

    def allocate(self) -> None:
        storage = self.tensor.untyped_storage()
        if storage.size() == 0:
            storage.resize_(self.tensor.numel() * self.tensor.element_size())

    def free(self) -> None:
        self.tensor.untyped_storage().resize_(0)


class Unit:
    """The runtime side of a :class:`UnitPlan` on this rank.

    Attributes:
        plan: Its matrices and owner slot.
        holds: This rank is the unit's column: it keeps the values between steps.
        primary: This rank is the primary owner: master, momentum, reduced gradient and
            Newton-Schulz.
        flat: The buffer its whole matrices are views of (compute dtype), or None.
        pieces: The values of its pieces of split stacks (compute dtype), or None.
        refilled: Its parameters with storage of their own, by name (see
            :class:`RefilledParam`).
        master: Primary only, under mixed precision: the full-precision values.
        grad: Primary only: the reduced (mean or sum) gradient, master dtype.
        grad_flags: Primary only: which matrices have a gradient since ``zero_grad``.
    """

    def __init__(self, plan: UnitPlan, *, holds: bool, primary: bool) -> None:
        self.plan = plan
        self.holds = holds
        self.primary = primary
        self.flat: torch.Tensor | None = None
        self.pieces: torch.Tensor | None = None
        self.refilled: dict[str, RefilledParam] = {}
        self.master: torch.Tensor | None = None
        self.master_dtype: torch.dtype | None = None
        self.reduce_dtype: torch.dtype | None = None
        self.grad: torch.Tensor | None = None
        self.grad_flags: torch.Tensor | None = None

    @property
    def column(self) -> int:
        return self.plan.column

    @property
    def primary_replica(self) -> int:
        return self.plan.primary_replica

    @property
    def params(self) -> list[DedicatedParam]:
        return self.plan.params

    @property
    def numel(self) -> int:
        return self.plan.numel

    @property
    def buffers(self) -> list[torch.Tensor]:
        """What its collectives move: the flat buffer and the pieces (those it has)."""
        return [b for b in (self.flat, self.pieces) if b is not None]

    @property
    def device(self) -> torch.device:
        return self.buffers[0].device

    @staticmethod
    def view(buffer: torch.Tensor, d: DedicatedParam) -> torch.Tensor:
        """``d``'s slice of a buffer in the unit's layout (masters, gradients)."""
        return buffer[d.offset : d.offset + d.numel].view(d.layout.local_shape)

    def value_view(self, d: DedicatedParam) -> torch.Tensor:
        """``d``'s compute-dtype value in ``flat`` or ``pieces``."""
        if not d.layout.is_piece:  # pieces travel in a buffer of their own
            return self.view(self.flat, d)
        start = d.offset - self.plan.whole_numel
        return self.pieces[start : start + d.numel].view(d.layout.local_shape)

    def master_view(self, d: DedicatedParam) -> torch.Tensor:
        """The full-precision value the optimizer updates (the value itself without
        mixed precision). Before :meth:`bind`, the parameter's (a checkpoint can load
        into it before the first forward)."""
        if self.master_dtype is None:
            return d.layout.value(d.param)
        if self.master is None:
            return self.value_view(d)
        return self.view(self.master, d)

    # ---- storage ---------------------------------------------------------------------
    @torch.no_grad()
    def bind(
        self,
        param_dtype: torch.dtype | None,
        reduce_dtype: torch.dtype | None,
        value_of: Callable[[DedicatedParam], torch.Tensor] | None = None,
    ) -> None:
        """Make the whole matrices views of one flat buffer holding their current values
        (tensor-parallel shards: copies, refilled later) and copy the pieces' values (from
        their stacks, not rebound yet) into ``pieces``.

        Under an FSDP2 ``MixedPrecisionPolicy`` the buffers (what forward uses and what
        is broadcast) are in ``param_dtype`` and the primary keeps a full-precision
        master; gradients are reduced in ``reduce_dtype`` (FSDP2's default: the compute
        dtype). ``value_of(d)``: where a matrix's or piece's current value is read
        (default: its part of the parameter; a model started at the plan's size keeps its
        pieces apart, see ``meta_init``).
        """
        value_of = value_of or (lambda d: d.layout.value(d.param))
        self.master_dtype = self.params[0].param.dtype
        compute_dtype, self.reduce_dtype = unit_dtypes(self.master_dtype, param_dtype, reduce_dtype)

        def values(ds: list[DedicatedParam]) -> torch.Tensor | None:
            if not ds:
                return None
            numel, start = sum(d.padded_numel for d in ds), ds[0].offset
            if not self.holds:  # the column's values arrive by gather: nothing to read here
                device = ds[0].param.device
                return torch.empty(numel, dtype=compute_dtype, device=device)  # freed below
            # Own storage (a master or the other buffer must not share it), zero padding.
            parts = [value_of(d) for d in ds]
            buffer = parts[0].new_zeros(numel)
            for d, part in zip(ds, parts, strict=True):
                buffer[d.offset - start : d.offset - start + d.numel].copy_(part.reshape(-1))
            return buffer

        whole = values([d for d in self.params if not d.layout.is_piece])  # into ``flat``
        pieces = values([d for d in self.params if d.layout.is_piece])  # into ``pieces``
        if self.primary and compute_dtype != self.master_dtype:
            self.master = torch.cat([t for t in (whole, pieces) if t is not None])
        if whole is not None:
            self.flat = whole.to(compute_dtype)
        if pieces is not None:
            self.pieces = pieces.to(compute_dtype)
        for d in self.params:
            if not d.layout.refills:
                d.param.data = self.view(self.flat, d)
        self.free()

    def allocate(self) -> None:
        for buffer in self.buffers:
            storage = buffer.untyped_storage()
            if storage.size() == 0:
                storage.resize_(buffer.numel() * buffer.element_size())
        for refilled in self.refilled.values():
            refilled.allocate()

    def free(self) -> None:
        """Drop the copy of a rank outside the unit's column (the parameters keep their
        shape, not their data) and, on every rank, the refilled parameters' storage."""
        if not self.holds:
            for buffer in self.buffers:
                buffer.untyped_storage().resize_(0)
        for refilled in self.refilled.values():
            refilled.free()

    @torch.no_grad()
    def refill(self) -> None:
        """Once the unit's values are here: copy them into the refilled parameters (a rank
        outside the column then drops its copy of the pieces)."""
        for d in self.params:
            if d.layout.is_piece:  # its part of the stack the model sees
                d.layout.select(self.refilled[d.name].tensor).copy_(self.value_view(d))
            elif d.name in self.refilled:
                self.refilled[d.name].tensor.copy_(self.value_view(d))
        if self.pieces is not None and not self.holds:
            self.pieces.untyped_storage().resize_(0)

    @torch.no_grad()
    def masters_to_flat(self) -> None:
        if self.master is None:
            return
        whole = self.plan.whole_numel
        if self.flat is not None:
            self.flat.copy_(self.master[:whole])
        if self.pieces is not None:
            self.pieces.copy_(self.master[whole:])

    # ---- gradients -------------------------------------------------------------------
    def pack_grads(self) -> torch.Tensor:
        """The reduce bucket (reduce dtype, in the unit's layout, a has-gradient flag per
        matrix or piece after the values). The caller drops the local gradients once every
        unit sharing them (a stack's pieces) is packed."""
        grads = [d.layout.local_grad(d.param) for d in self.params]
        numels = [d.padded_numel for d in self.params]
        return flagged_grad_bucket(grads, numels, self.reduce_dtype, self.device)

    @torch.no_grad()
    def accumulate_grads(self, bucket: torch.Tensor, divide_factor: float) -> None:
        """Primary: add the reduced bucket, divided once, to the reduced gradient (in the
        master dtype, whatever dtype the reduce ran in)."""
        values, flags = bucket[: self.numel], bucket[self.numel :]
        values.div_(divide_factor)
        if self.grad is None:
            # The bucket itself when it is in the master dtype: no copy.
            self.grad = values.to(self.master_dtype)
            self.grad_flags = flags != 0
        else:
            self.grad.add_(values)
            self.grad_flags |= flags != 0

    def zero_grad(self) -> None:
        self.grad = self.grad_flags = None

    def grads_held(self) -> torch.Tensor | None:
        """Primary, after a reduced backward: the has-gradient flags (a device tensor)."""
        return self.grad_flags

    def grad_view(self, d: DedicatedParam) -> torch.Tensor:
        return self.view(self.grad, d)


def held_bytes(plan: Plan, boundary_units: list[list[Unit]]) -> list[int]:
    """Bytes each rank (slot order) keeps between steps for the dedicated matrices
    (values, masters and momentum): the plan's one formula (:meth:`Plan.held_bytes`) for
    the dtypes each boundary's units bound."""
    dtypes = {
        boundary.name: HeldDtypes(values=units[0].buffers[0].dtype, master=units[0].master_dtype)
        for boundary, units in zip(plan.boundaries, boundary_units, strict=True)
    }
    return plan.held_bytes(lambda boundary: dtypes[boundary.name])


def bind_boundary(
    units: list[Unit],
    param_dtype: torch.dtype | None,
    reduce_dtype: torch.dtype | None,
    value_of: Callable[[DedicatedParam], torch.Tensor] | None = None,
) -> None:
    """Bind one boundary's units (see :meth:`Unit.bind`), then give the parameters that
    refill storage of their own (a stack's pieces share one, across units)."""
    for unit in units:
        unit.bind(param_dtype, reduce_dtype, value_of)
    refilled: dict[str, RefilledParam] = {}
    for unit in units:  # after the units read their values
        for d in unit.params:
            if d.layout.refills and d.name not in refilled:
                refilled[d.name] = RefilledParam(d.param, d.layout, param_dtype or d.param.dtype)
        unit.refilled = {d.name: refilled[d.name] for d in unit.params if d.layout.refills}
