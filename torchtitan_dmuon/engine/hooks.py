"""Forward and backward hooks that drive a :class:`Dedication`.

Per boundary (in the manner of FSDP2):

* pre-forward: gather (broadcast from the owners) the boundary's units, prefetching the next
  boundary's;
* post-forward: Z3 frees non-owned units; a grad hook on the outputs is the pre-backward
  trigger (Z3 gathers again there, prefetching the next boundary in backward order);
* post-backward: when every dedicated matrix of the boundary has its gradient, its units'
  gradients are packed, SUM-reduced to their owners asynchronously (overlapping the rest
  of backward) and non-owners free both gradient and parameter;
* end of backward (an autograd final callback): boundaries whose trigger did not fire are
  reduced too, every reduce is awaited and owners turn sums into means.

Collectives must be issued in the same order on every rank, even when a branch is unused
on some ranks. So each kind of collective follows one fixed sequence over the boundaries
(forward order for forward gathers, reverse order for backward gathers and reduces): a
trigger issues everything up to its own boundary, and the end of forward / backward
issues the rest. Every rank therefore issues each collective exactly once per pass. When
a trigger fires depends on the rank (its branches, its timing), so sequences that run in
the same pass never share a process group: gathers use the shard group, reduces the
reduce group, and neither is FSDP2's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_flatten

from torchtitan_dmuon.engine.dedication import Dedication

__all__ = ["register_hooks", "HookDriver"]


class _Sequence:
    """Issues one collective per boundary, in a fixed order, at most once per pass."""

    def __init__(self, order: list[int], issue) -> None:
        self.order = order
        self.position = {b: i for i, b in enumerate(order)}
        self.issue = issue
        self.next = 0

    def reset(self) -> None:
        self.next = 0

    def through(self, boundary: int) -> None:
        """Issue every boundary up to and including ``boundary`` not issued yet."""
        while self.next <= self.position[boundary]:
            self.issue(self.order[self.next])
            self.next += 1

    def finish(self) -> None:
        if self.next < len(self.order):
            self.through(self.order[-1])


class HookDriver:
    """The per-pass state of a dedication's hooks."""

    def __init__(self, dedication: Dedication) -> None:
        self.d = dedication
        n = len(dedication.boundaries)
        forward_order = list(range(n))
        backward_order = forward_order[::-1]
        self._gather_works: dict[int, list[dist.Work]] = {}
        self.forward_gathers = _Sequence(forward_order, self._issue_gather)
        self.backward_gathers = _Sequence(backward_order, self._issue_gather)
        self.reduces = _Sequence(backward_order, self._issue_reduce)
        self._pending_reduces: list[tuple[int, int, dist.Work, torch.Tensor]] = []
        self._grad_counts = [0] * n
        self._expected = [sum(1 for _ in b.params) for b in dedication.boundaries]
        self._reduce_ready = [False] * n
        self._in_backward = False

    # ---- collectives ---------------------------------------------------------------------
    def _issue_gather(self, b: int) -> None:
        self._gather_works[b] = [self.d.gather_async(u) for u in self.d.boundaries[b].units]

    def _wait_gather(self, b: int) -> None:
        for work in self._gather_works.pop(b, ()):
            work.wait()

    def _issue_reduce(self, b: int) -> None:
        for i, unit in enumerate(self.d.boundaries[b].units):
            bucket = self.d.pack_grads(unit)
            self.d.free(unit)
            work = self.d.reduce_to_column(unit, bucket)
            self._pending_reduces.append((b, i, work, bucket))

    def _free_boundary(self, b: int) -> None:
        for unit in self.d.boundaries[b].units:
            self.d.free(unit)

    # ---- forward ---------------------------------------------------------------------------
    def root_pre_forward(self, module: nn.Module, args, kwargs):
        self.d.lazy_init()
        self.forward_gathers.reset()
        return None

    def root_post_forward(self, module: nn.Module, args, kwargs, output):
        self.forward_gathers.finish()
        for b in list(self._gather_works):
            self._wait_gather(b)
            if not torch.is_grad_enabled():
                self._free_boundary(b)
        self._register_pre_backward(output, self._root_pre_backward)
        return None

    def pre_forward(self, b: int):
        def hook(module, args, kwargs):
            if self._in_backward:
                # Activation-checkpoint recompute: the values must be here (Z3 gathers them
                # in backward order, as its pre-backward would), and nothing else happens.
                if self.d.reshard_after_forward:
                    self.backward_gathers.through(b)
                    self._wait_gather(b)
                return None
            self.d.record("forward", boundary=b)
            self.forward_gathers.through(b)
            self._wait_gather(b)
            self._prefetch(self.forward_gathers)
            return None

        return hook

    def post_forward(self, b: int):
        def hook(module, args, kwargs, output):
            if self._in_backward:  # recompute: backward still needs the values
                return None
            if self.d.reshard_after_forward or not torch.is_grad_enabled():
                self._free_boundary(b)
            self._register_pre_backward(output, lambda grad: self._pre_backward(b))
            return None

        return hook

    @staticmethod
    def _register_pre_backward(output, fn) -> None:
        if not torch.is_grad_enabled():
            return
        tensors = [t for t in tree_flatten(output)[0] if torch.is_tensor(t) and t.requires_grad]
        if tensors:
            register_multi_grad_hook(tensors, fn, mode="any")

    # ---- backward --------------------------------------------------------------------------
    def _start_backward(self) -> None:
        if self._in_backward:
            return
        self._in_backward = True
        self.backward_gathers.reset()
        self.reduces.reset()
        self._grad_counts = [0] * len(self._grad_counts)
        self._reduce_ready = [False] * len(self._reduce_ready)
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _root_pre_backward(self, grad) -> None:
        self._start_backward()

    def _pre_backward(self, b: int) -> None:
        self._start_backward()
        if not self.d.reshard_after_forward:
            return
        self.backward_gathers.through(b)
        self._wait_gather(b)
        self._prefetch(self.backward_gathers)

    def _prefetch(self, sequence: _Sequence) -> None:
        """Start gathering the next boundary in ``sequence`` now, unless its values are
        still arriving from the primary replica (then it is gathered when needed, and the
        replicate broadcast keeps overlapping the current boundary's compute).

        That choice depends on timing, so it differs between ranks. It only moves *when*
        a gather is issued, never the order of the gathers, and the gathers have a group
        of their own.
        """
        if sequence.next < len(sequence.order):
            upcoming = sequence.order[sequence.next]
            if self.d.replicas_landed(upcoming):
                sequence.through(upcoming)

    def register_param_hook(self, param: torch.Tensor, b: int) -> None:
        param.register_post_accumulate_grad_hook(self.post_accumulate_grad(b))

    def post_accumulate_grad(self, b: int):
        def hook(param: torch.Tensor) -> None:
            self._start_backward()
            self._grad_counts[b] += 1
            if self._grad_counts[b] == self._expected[b] and self.d.requires_gradient_sync:
                self._reduce_ready[b] = True
                self._issue_ready_reduces()

        return hook

    def _issue_ready_reduces(self) -> None:
        order = self.reduces.order
        while self.reduces.next < len(order) and self._reduce_ready[order[self.reduces.next]]:
            self.reduces.through(order[self.reduces.next])

    def _end_backward(self) -> None:
        if self.d.reshard_after_forward:
            self.backward_gathers.finish()
            for b in list(self._gather_works):
                self._wait_gather(b)
        if self.d.requires_gradient_sync:
            self.reduces.finish()
            # Stage 2 (HSDP) starts per unit as soon as its stage-1 reduce has landed.
            second_stage = []
            for b, i, work, bucket in self._pending_reduces:
                work.wait()
                unit = self.d.boundaries[b].units[i]
                second_stage.append((unit, self.d.reduce_to_primary(unit, bucket), bucket))
            self._pending_reduces.clear()
            for unit, work, bucket in second_stage:
                if work is not None:
                    work.wait()
                self.d.unpack_grads(unit, bucket)
            if self.d.syncs_other_grads:
                self.d.sync_other_grads()
            self.d.synced_backwards += 1
        for b in range(len(self.d.boundaries)):
            self._free_boundary(b)
        self._in_backward = False


def register_hooks(dedication: Dedication) -> HookDriver:
    """Attach the hooks of ``dedication`` to its model, boundaries and parameters."""
    driver = HookDriver(dedication)
    model = dedication.model
    model.register_forward_pre_hook(driver.root_pre_forward, prepend=True, with_kwargs=True)
    for b, boundary in enumerate(dedication.boundaries):
        boundary.module.register_forward_pre_hook(driver.pre_forward(b), with_kwargs=True)
        boundary.module.register_forward_hook(driver.post_forward(b), with_kwargs=True)
    model.register_forward_hook(driver.root_post_forward, with_kwargs=True)
    dedication.driver = driver
    dedication.bind_params()
    return driver
