"""A unit's storage: one flat buffer per (boundary, owner slot) and its gradients.

The parameters of a unit are views of its flat buffer (in the compute dtype). Ranks outside
the unit's column free the buffer's storage between uses and re-grow the *same* storage
before the next use (as FSDP2 does with its unsharded parameters), so every view that
autograd saved in forward still sees the values in backward. The primary owner keeps a
full-precision master under mixed precision, and the reduced gradient in the master dtype,
accumulated over micro-batches until ``zero_grad``.

Reduce buckets are transient: each lives from its boundary's reduce to the end of
backward, and the owner's reduced gradient from the end of backward to ``zero_grad``
(FSDP2's ``set_to_none``), so between steps a rank keeps only its values, masters and
momentum.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from torchtitan_dmuon.engine.plan import DedicatedParam, UnitPlan, local_tensor

__all__ = ["Unit", "flagged_grad_bucket"]


def flagged_grad_bucket(
    params: list[nn.Parameter], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """Every parameter's gradient back to back (zeros where it has none), then one
    has-gradient flag per parameter: a bucket of the same size on every rank, whatever
    gradients each rank computed, so that a gradient no rank computed can be told from
    one whose sum is zero."""
    locals_ = [local_tensor(p) for p in params]  # tensor parallelism: this rank's shards
    numel = sum(p.numel() for p in locals_)
    bucket = torch.zeros(numel + len(params), dtype=dtype, device=device)
    offset = 0
    for i, (p, local) in enumerate(zip(params, locals_, strict=True)):
        if p.grad is not None:
            grad = p.grad
            if isinstance(grad, DTensor) and grad.placements != p.placements:
                # A tensor-parallel gradient laid out otherwise (e.g. partial sums of
                # an embedding's): this rank's shard, as the parameter is laid out.
                grad = grad.redistribute(p.device_mesh, p.placements)
            bucket[offset : offset + local.numel()].copy_(local_tensor(grad).reshape(-1))
            bucket[numel + i] = 1
        offset += local.numel()
    return bucket


class Unit:
    """The runtime side of a :class:`UnitPlan` on this rank.

    Attributes:
        plan: Its matrices and owner slot.
        holds: This rank is the unit's column: it keeps the values between steps.
        primary: This rank is the primary owner: master, momentum, reduced gradient and
            Newton-Schulz.
        flat: The buffer the parameters are views of (compute dtype).
        master: Primary only, under mixed precision: the full-precision values.
        grad: Primary only: the reduced (mean or sum) gradient, master dtype.
        grad_flags: Primary only: which matrices have a gradient since ``zero_grad``.
    """

    def __init__(self, plan: UnitPlan, *, holds: bool, primary: bool) -> None:
        self.plan = plan
        self.holds = holds
        self.primary = primary
        self.flat: torch.Tensor | None = None
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

    @staticmethod
    def view(buffer: torch.Tensor, d: DedicatedParam) -> torch.Tensor:
        """``d``'s slice of a buffer laid out like ``flat``."""
        return buffer[d.offset : d.offset + d.numel].view(d.local_shape)

    def master_view(self, d: DedicatedParam) -> torch.Tensor:
        """The full-precision value the optimizer updates (the parameter itself without
        mixed precision)."""
        if self.master is None:
            return local_tensor(d.param).detach()
        return self.view(self.master, d)

    # ---- storage ---------------------------------------------------------------------
    @torch.no_grad()
    def bind(self, param_dtype: torch.dtype | None, reduce_dtype: torch.dtype | None) -> None:
        """Make the parameters views of one flat buffer holding their current values.

        Under an FSDP2 ``MixedPrecisionPolicy`` the buffer (what forward uses and what is
        broadcast) is in ``param_dtype`` and the primary keeps a full-precision master;
        gradients are reduced in ``reduce_dtype`` (FSDP2's default: the compute dtype).
        """
        self.master_dtype = self.params[0].param.dtype
        compute_dtype = param_dtype or self.master_dtype
        self.reduce_dtype = reduce_dtype or compute_dtype
        values = torch.cat([local_tensor(d.param).detach().reshape(-1) for d in self.params])
        if self.primary and compute_dtype != self.master_dtype:
            self.master = values
        self.flat = values.to(compute_dtype)
        for d in self.params:
            # A DTensor (tensor parallelism) keeps its wrapper; its local shard is the view.
            target = d.param._local_tensor if isinstance(d.param, DTensor) else d.param
            target.data = self.view(self.flat, d)
        self.free()

    def allocate(self) -> None:
        storage = self.flat.untyped_storage()
        if storage.size() == 0:
            storage.resize_(self.numel * self.flat.element_size())

    def free(self) -> None:
        """Drop the copy of a rank outside the unit's column (the parameters keep their
        shape, not their data)."""
        if not self.holds:
            self.flat.untyped_storage().resize_(0)

    @torch.no_grad()
    def masters_to_flat(self) -> None:
        if self.master is not None:
            self.flat.copy_(self.master)

    # ---- gradients -------------------------------------------------------------------
    def pack_grads(self) -> torch.Tensor:
        """The reduce bucket (reduce dtype, a has-gradient flag per matrix after the
        values). Consumes the local gradients."""
        params = [d.param for d in self.params]
        bucket = flagged_grad_bucket(params, self.reduce_dtype, self.flat.device)
        for p in params:
            p.grad = None
        return bucket

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

    def memory_bytes(self) -> dict[str, int]:
        """What this rank keeps between steps for the unit (see
        :meth:`Dedication.memory_bytes`)."""
        held = {"params": 0, "masters": 0, "momentum": 0}
        if self.holds and self.flat is not None:
            held["params"] = self.numel * self.flat.element_size()
        if self.master is not None:
            held["masters"] = self.master.numel() * self.master.element_size()
        if self.primary:
            dtype = self.master_dtype or self.params[0].param.dtype
            held["momentum"] = self.numel * dtype.itemsize
        return held
