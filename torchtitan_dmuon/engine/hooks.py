"""Forward and backward hooks that drive a dedication, with an explicit state per pass.

Per boundary (in the manner of FSDP2):

* pre-forward: gather (broadcast from the owners) the boundary's units, prefetching the next
  boundary's;
* post-forward: Z3 frees non-owned units, except the last boundary's, which backward needs
  first (as TorchTitan leaves its last block unsharded); a grad hook on the outputs is the
  pre-backward trigger (Z3 gathers again there, prefetching the next boundary in backward
  order);
* post-accumulate-grad: when every dedicated matrix of the boundary has its gradient, its
  units' gradients are packed and SUM-reduced to their owners asynchronously (overlapping
  the rest of backward), and non-owners free both gradient and parameter;
* end of backward (an autograd final callback): boundaries whose trigger did not fire are
  reduced too, every reduce is awaited and owners accumulate the reduced gradients.

Collectives must be issued in the same order on every rank, even when a branch is unused
on some ranks. So each kind of collective follows one fixed sequence over the boundaries
(forward order for forward gathers, reverse order for backward gathers and reduces): a
trigger issues everything up to its own boundary, and the end of forward / backward
issues the rest. When a trigger fires depends on the rank, so sequences that run in the
same pass never share a process group: gathers use the shard group, reduces the reduce
group, and neither is FSDP2's.

A pass that raises (an out-of-memory error, a bad op) leaves its state behind; the next
root pre-forward (or ``zero_grad``) finds the driver not idle, waits for what the failed
pass issued, drops its partial gradients and starts clean, as FSDP2 resets its per-pass
state there. That is sound only if every data-parallel rank's pass raised at the same
point, so first the failed ranks agree on it over groups of their own; a peer whose pass
did not raise never joins and waits in that pass's collectives instead. Both sides then
raise :class:`PassDivergedError` within the groups' timeout, never a hang or a collective
matched with the wrong one. What
the hooks drive is a :class:`DrivenDedication` (the runtime in ``dedication.py``, above
this file).
"""

from __future__ import annotations

import logging
from enum import Enum, auto
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.graph import register_multi_grad_hook
from torch.profiler import record_function
from torch.utils._pytree import tree_flatten

from torchtitan_dmuon.engine.exchange import Exchange, PendingReduce
from torchtitan_dmuon.engine.plan import Boundary
from torchtitan_dmuon.engine.unit import Unit

__all__ = [
    "CollectiveSequence",
    "DrivenDedication",
    "HookDriver",
    "PassDivergedError",
    "PassSettings",
    "TrainingState",
    "register_pre_backward",
]

logger = logging.getLogger(__name__)


class TrainingState(Enum):
    """Where the current pass is."""

    IDLE = auto()
    """No pass, or a forward without grad finished."""
    FORWARD = auto()
    """Inside the root forward."""
    AWAITING_BACKWARD = auto()
    """A forward with grad finished; its backward may or may not come."""
    BACKWARD = auto()
    """Inside backward (a pre-forward now is an activation-checkpoint recompute)."""
    DIVERGED = auto()
    """A pass failed on some ranks and not on the others: every later pass or step raises
    :class:`PassDivergedError`."""


class PassDivergedError(RuntimeError):
    """A forward or backward pass failed on some data-parallel ranks and not on the
    others, or at different points: their collectives no longer line up, so no rank can
    go on. End the job and resume from the last checkpoint."""


class CollectiveSequence:
    """Issues one collective per boundary, in a fixed order, at most once per pass."""

    def __init__(self, order: list[int], issue) -> None:
        self.order = order
        self.position = {b: i for i, b in enumerate(order)}
        self.issue = issue
        self.next = 0

    def reset(self) -> None:
        self.next = 0

    def upcoming(self) -> int | None:
        return self.order[self.next] if self.next < len(self.order) else None

    def through(self, boundary: int) -> None:
        """Issue every boundary up to and including ``boundary`` not issued yet."""
        while self.next <= self.position[boundary]:
            self.issue(self.order[self.next])
            self.next += 1

    def finish(self) -> None:
        if self.next < len(self.order):
            self.through(self.order[-1])


def register_pre_backward(output, fn) -> None:
    """Call ``fn`` when the first gradient of ``output``'s tensors arrives (the
    pre-backward trigger), when grad is enabled."""
    if not torch.is_grad_enabled():
        return
    tensors = [t for t in tree_flatten(output)[0] if torch.is_tensor(t) and t.requires_grad]
    if tensors:
        register_multi_grad_hook(tensors, fn, mode="any")


class PassSettings(Protocol):
    """What the hooks read of a dedication's settings (its ``DedicationSettings``)."""

    reshard_after_forward: bool


class DrivenDedication(Protocol):
    """What the hooks drive (a :class:`~torchtitan_dmuon.engine.dedication.Dedication`):
    its units and collectives, its switches, its first-forward binding and the end of a
    reduced backward."""

    exchange: Exchange
    boundary_units: list[list[Unit]]
    settings: PassSettings
    requires_gradient_sync: bool
    reshard_after_backward: bool

    def lazy_init(self) -> None: ...

    def finish_reduces(self, reduces: list[PendingReduce]) -> None: ...


class HookDriver:
    """The hooks of one dedication and the state of the current pass."""

    def __init__(self, dedication: DrivenDedication, boundaries: list[Boundary]) -> None:
        self.d = dedication
        self.exchange = dedication.exchange
        self.boundaries = boundaries
        forward_order = list(range(len(boundaries)))
        backward_order = forward_order[::-1]
        self.state = TrainingState.IDLE
        self._diverged = ""  # why, once DIVERGED
        self._gathers: dict[int, list[dist.Work]] = {}
        # Boundaries whose values are here and current: a gather of one sends nothing
        # (Z3 keeps the last after forward; a pipeline stage keeps all of them between its
        # micro-batches, ``reshard_after_backward`` off).
        self._resident: set[int] = set()
        self._reduces: list = []  # PendingReduce, in issue order
        self._last_issued = 0  # units of the boundary reduced last
        self.forward_gathers = CollectiveSequence(forward_order, self._issue_gather)
        self.backward_gathers = CollectiveSequence(backward_order, self._issue_gather)
        self.reduce_sequence = CollectiveSequence(backward_order, self._issue_reduce)
        self._expected = [len(b.parameters) for b in boundaries]
        self._grad_counts = [0] * len(boundaries)
        self._reduce_ready = [False] * len(boundaries)
        self._handles: list = []
        self._param_hooks: dict[str, tuple[nn.Parameter, object]] = {}

    # ---- registration ------------------------------------------------------------------
    def register(self, model: nn.Module) -> None:
        """Attach the module hooks (the parameter hooks follow in :meth:`bind_params`)."""
        handles = [
            model.register_forward_pre_hook(self._root_pre_forward, prepend=True, with_kwargs=True)
        ]
        for b, boundary in enumerate(self.boundaries):
            handles.append(
                boundary.module.register_forward_pre_hook(self._pre_forward(b), with_kwargs=True)
            )
            handles.append(
                boundary.module.register_forward_hook(self._post_forward(b), with_kwargs=True)
            )
        handles.append(model.register_forward_hook(self._root_post_forward, with_kwargs=True))
        self._handles = handles

    def bind_params(self) -> None:
        """Give each current parameter object its post-accumulate-grad hook, once: checked
        by the hook's handle, not by ``id`` (``to_empty`` registers new objects, an old id
        can come back; ``swap_tensors`` moves an object's hooks with its contents)."""
        for b, boundary in enumerate(self.boundaries):
            for dp in boundary.params:
                hooked = self._param_hooks.get(dp.name)
                if hooked is not None and hooked[0] is dp.param:
                    hooks = dp.param._post_accumulate_grad_hooks
                    if hooks is not None and hooked[1].id in hooks:
                        continue
                    hooked[1].remove()
                handle = dp.param.register_post_accumulate_grad_hook(self._post_accumulate_grad(b))
                self._param_hooks[dp.name] = (dp.param, handle)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        for _, handle in self._param_hooks.values():
            handle.remove()
        self._handles, self._param_hooks = [], {}

    # ---- collectives ---------------------------------------------------------------------
    def _issue_gather(self, b: int) -> None:
        if b in self._resident:
            return
        self._resident.add(b)
        with record_function(f"dmuon::gather b{b}"):
            self._gathers[b] = [
                w for u in self.d.boundary_units[b] for w in self.exchange.gather(u)
            ]

    def _wait_gather(self, b: int) -> None:
        works = self._gathers.pop(b, None)
        if works is None:
            return
        with record_function(f"dmuon::wait_gather b{b}"):
            for work in works:
                work.wait()
            for unit in self.d.boundary_units[b]:
                unit.refill()

    def _issue_reduce(self, b: int) -> None:
        with record_function(f"dmuon::reduce b{b}"):
            # The reduces before the last boundary's land now (two boundaries in flight).
            self.exchange.release_reduces(self._reduces[: len(self._reduces) - self._last_issued])
            self._last_issued = len(self.d.boundary_units[b])
            for unit in self.d.boundary_units[b]:
                self._reduces.append(self.exchange.reduce_to_column(unit))
            for param in self.boundaries[b].parameters:
                param.grad = None  # packed (a stack's pieces by several units)
            self._resident.discard(b)  # reduce_to_column freed the values
            self.exchange.start_second_stages(self._reduces, wait=False)

    def _free_boundary(self, b: int) -> None:
        self._resident.discard(b)
        for unit in self.d.boundary_units[b]:
            unit.free()

    def free_all(self) -> None:
        """Free every boundary's values outside the owner columns: after a step or a
        load changed the values, whatever a rank still holds is stale."""
        for b in range(len(self._expected)):
            self._free_boundary(b)

    def _prefetch(self, sequence: CollectiveSequence) -> None:
        """Start gathering the next boundary in ``sequence`` now, unless its values are
        still arriving from the primary replica (then it is gathered when needed). That
        depends on timing, so on the rank: it moves *when* a gather is issued, never the
        order of the gathers, which have a group of their own."""
        upcoming = sequence.upcoming()
        if upcoming is not None and self.exchange.replicas_landed(self.d.boundary_units[upcoming]):
            sequence.through(upcoming)

    # ---- forward ---------------------------------------------------------------------------
    def _root_pre_forward(self, module: nn.Module, args, kwargs):
        self.reset_iter_state()
        self.d.lazy_init()
        self.state = TrainingState.FORWARD
        self.forward_gathers.reset()
        return None

    def _root_post_forward(self, module: nn.Module, args, kwargs, output):
        self.forward_gathers.finish()
        for b in list(self._gathers):
            self._wait_gather(b)
        # Which values stay must not depend on the blocks this rank ran (a skipped one
        # missed its post-forward), or the next gathers would differ between ranks.
        if not torch.is_grad_enabled():
            self.free_all()
        elif self.d.settings.reshard_after_forward:
            for b in range(len(self._expected) - 1):
                self._free_boundary(b)
        if torch.is_grad_enabled():
            self.state = TrainingState.AWAITING_BACKWARD
            register_pre_backward(output, lambda grad: self._start_backward())
        else:
            self.state = TrainingState.IDLE
        return None

    def _pre_forward(self, b: int):
        def hook(module, args, kwargs):
            if self.state is TrainingState.BACKWARD:
                # Activation-checkpoint recompute: the values must be here (Z3 gathers them
                # in backward order, as its pre-backward would), and nothing else happens.
                if self.d.settings.reshard_after_forward:
                    self.backward_gathers.through(b)
                    self._wait_gather(b)
                return None
            with record_function(f"dmuon::pre_forward b{b}"):
                self.forward_gathers.through(b)
                self._wait_gather(b)
                self._prefetch(self.forward_gathers)
            return None

        return hook

    def _post_forward(self, b: int):
        def hook(module, args, kwargs, output):
            if self.state is TrainingState.BACKWARD:  # recompute: backward needs the values
                return None
            if not torch.is_grad_enabled():
                self._free_boundary(b)
            elif self.d.settings.reshard_after_forward and b != len(self._expected) - 1:
                # The last boundary stays (on every rank alike, so the backward gather
                # sequences agree): backward needs it first.
                self._free_boundary(b)
            register_pre_backward(output, lambda grad: self._pre_backward(b))
            return None

        return hook

    # ---- backward --------------------------------------------------------------------------
    def _start_backward(self) -> None:
        if self.state is TrainingState.BACKWARD:
            return
        self.state = TrainingState.BACKWARD
        self.backward_gathers.reset()
        self.reduce_sequence.reset()
        self._grad_counts = [0] * len(self._grad_counts)
        self._reduce_ready = [False] * len(self._reduce_ready)
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _pre_backward(self, b: int) -> None:
        self._start_backward()
        if not self.d.settings.reshard_after_forward:
            return
        self.backward_gathers.through(b)
        self._wait_gather(b)
        self._prefetch(self.backward_gathers)

    def _post_accumulate_grad(self, b: int):
        def hook(param: torch.Tensor) -> None:
            self._start_backward()
            self._grad_counts[b] += 1
            if self._grad_counts[b] == self._expected[b] and self.d.requires_gradient_sync:
                self._reduce_ready[b] = True
                self._issue_ready_reduces()

        return hook

    def _issue_ready_reduces(self) -> None:
        sequence = self.reduce_sequence
        while sequence.upcoming() is not None and self._reduce_ready[sequence.upcoming()]:
            sequence.through(sequence.upcoming())

    def _end_backward(self) -> None:
        if self.d.settings.reshard_after_forward:
            self.backward_gathers.finish()
            for b in list(self._gathers):
                self._wait_gather(b)
        if self.d.requires_gradient_sync:
            self.reduce_sequence.finish()
            reduces, self._reduces = self._reduces, []
            try:
                with record_function("dmuon::finish_reduces"):
                    self.d.finish_reduces(reduces)
            except RuntimeError as error:
                raise self._diverge(
                    "a gradient reduce of this backward did not complete: a data-parallel "
                    "peer did not join it within the process group's timeout (its pass "
                    "raised, or it died)"
                ) from error
        if self.d.reshard_after_backward:
            self.free_all()
        self.state = TrainingState.IDLE

    def reduce_accumulated(self) -> None:
        """Reduce the gradients that backwards without sync accumulated in ``p.grad`` now,
        as the end of a synced backward would, then free the values (a pipeline stage,
        after its last backward of the step)."""
        if self.state in (TrainingState.FORWARD, TrainingState.BACKWARD):
            raise RuntimeError(
                f"gradients were reduced inside a {self.state.name.lower()} pass; reduce "
                "after the last backward of the step"
            )
        self.reduce_sequence.reset()
        self.reduce_sequence.finish()
        reduces, self._reduces = self._reduces, []
        with record_function("dmuon::finish_reduces"):
            self.d.finish_reduces(reduces)
        self.free_all()

    # ---- failure -------------------------------------------------------------------------
    def pass_unfinished(self) -> bool:
        """Whether the last forward or backward raised half-way."""
        return self.state in (TrainingState.FORWARD, TrainingState.BACKWARD)

    def reset_iter_state(self) -> None:
        """If the last pass raised half-way (the state is not idle): agree with the other
        data-parallel ranks that theirs raised at the same point, then wait for the
        collectives it issued, drop its partial reduces and free what it gathered.

        Raises:
            PassDivergedError: Some peer's pass did not raise (it waits in a collective
                of that pass until the group's timeout, then raises this too), or raised
                at another point; or an earlier pass diverged.
        """
        self.raise_if_diverged()
        if not self.pass_unfinished():
            return
        failed = self.state.name.lower()
        agreed = self.exchange.agree_on_failed_pass(len(self._reduces))
        if agreed is None:
            raise self._diverge(
                f"the last {failed} pass raised on this rank, and some data-parallel peer "
                "did not report a failed pass within the process group's timeout (it waits "
                "in a collective of that pass, or died)"
            )
        if agreed[0] != agreed[1]:
            raise self._diverge(
                f"the last {failed} pass raised on every data-parallel rank, but after "
                f"different numbers of gradient reduces ({agreed[0]} to {agreed[1]})"
            )
        logger.warning(
            "dmuon: the previous %s pass did not finish; discarding its state (its "
            "dedicated gradients are dropped)",
            self.state.name.lower(),
        )
        for b in list(self._gathers):
            self._wait_gather(b)
        reduces, self._reduces = self._reduces, []
        self.exchange.discard_reduces(reduces)
        self.free_all()
        self.state = TrainingState.IDLE

    def raise_if_diverged(self) -> None:
        """Raise :class:`PassDivergedError` if a pass diverged between the ranks."""
        if self.state is TrainingState.DIVERGED:
            raise PassDivergedError(self._diverged)

    def _diverge(self, reason: str) -> PassDivergedError:
        self.state = TrainingState.DIVERGED
        self._diverged = (
            f"dmuon: {reason}. The ranks' collectives no longer line up and cannot be "
            "brought back in step: end the job and resume from the last checkpoint"
        )
        return PassDivergedError(self._diverged)
