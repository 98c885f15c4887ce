"""Forward and backward hooks that drive a dedication, with an explicit state per pass.

Per boundary (in the manner of FSDP2):

* pre-forward: gather (broadcast from the owners) the boundary's units, prefetching the next
  boundary's;
* post-forward: Z3 frees non-owned units, except the last boundary's, which backward needs
  first (as TorchTitan leaves its last block unsharded); a grad hook on the outputs is the
  pre-backward trigger (Z3 gathers again there, prefetching the next boundary in backward
  order);
* post-backward (an identity ``autograd.Function`` over the boundary's inputs that need a
  gradient, applied at pre-forward, as FSDP2's ``RegisterPostBackwardFunction``): once it
  ran for every call of the boundary in the pass, the boundary's backward is over; its
  units' gradients are packed and SUM-reduced to their owners asynchronously (overlapping
  the rest of backward), non-owners free both gradient and parameter, and the DDP-style
  buckets of the parameters inside the boundary follow;
* end of backward (an autograd final callback): boundaries whose trigger did not fire are
  reduced too, every reduce is awaited and owners accumulate the reduced gradients.

Collectives must be issued in the same order on every rank, even when a branch is unused
on some ranks. So each kind of collective follows one fixed sequence over the boundaries
(forward order for forward gathers, reverse order for backward gathers and reduces): a
gather trigger issues every gather up to its own boundary, a reduce goes out only when
it and every reduce before it in the sequence are due (never forced: a gradient may
still be coming), and the end of forward / backward issues the rest. Gathers use the
shard group, reduces the reduce group, the DDP-style buckets a group of their own, and
none is FSDP2's.

Across those groups the order is the order in which autograd runs the boundaries'
pre- and post-backward hooks, each a node of the graph: the engine runs a device's nodes
in decreasing creation order, so the interleaving of gathers, reduces and buckets is a
function of the module-level graph, the same on ranks whose forwards called the same
boundaries (what FSDP2's own order rests on). A parameter's gradient alone never moves
a collective (an unused matrix, an expert without tokens): a boundary whose inputs need
no gradient (no post-backward: the root, a first block after a frozen embedding) reduces
at the end of backward, and a gradient that arrives after its boundary's reduce raises,
naming the parameter.

Which stream waits for what is the business of each boundary's
:class:`~torchtitan_dmuon.engine.boundary.BoundaryState` and of the exchange: no host
poll of a collective's completion decides what is issued here, so the issue order is a
function of the pass alone.

A pass that raises (an out-of-memory error, a bad op) leaves its state behind; the next
root pre-forward (or ``zero_grad``) finds the driver not idle, waits for what the failed
pass issued, drops its partial gradients and starts clean, as FSDP2 resets its per-pass
state there. That is sound only if every data-parallel rank's pass raised at the same
point, so first the failed ranks agree on it over groups of their own; a peer whose pass
did not raise never joins and waits in that pass's collectives instead. On gloo both
sides then raise :class:`PassDivergedError` within the groups' timeout. On NCCL a
collective's wait does not block the host: the failed ranks wait for their agreement
on the host, with the group's timeout, and raise :class:`PassDivergedError`; the peer
that did not fail stays queued behind the missing collective until NCCL's watchdog ends
its process at the same timeout (TorchTitan sets ``TORCH_NCCL_ASYNC_ERROR_HANDLING=3``).
Never a hang, never a collective matched with the wrong one. What the hooks drive is a
:class:`DrivenDedication` (the runtime in ``dedication.py``, above this file).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from enum import Enum, auto
from typing import Protocol

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook
from torch.profiler import record_function
from torch.utils._pytree import tree_flatten, tree_unflatten

from torchtitan_dmuon.engine.boundary import BoundaryState, late_gradient, weak_grad_hook
from torchtitan_dmuon.engine.exchange import Exchange, PendingReduce
from torchtitan_dmuon.engine.others import OtherParams
from torchtitan_dmuon.engine.reduce import BackwardReduce

__all__ = [
    "CollectiveSequence",
    "DrivenDedication",
    "HookDriver",
    "PassDivergedError",
    "PassSettings",
    "TrainingState",
    "register_post_backward",
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


class _PostBackward(torch.autograd.Function):
    """Identity on a boundary's inputs: its backward runs once their gradients are
    computed, i.e. after the boundary's own backward (FSDP2's
    ``RegisterPostBackwardFunction``)."""

    @staticmethod
    def forward(ctx, hook, *inputs):
        ctx.hook = hook
        return inputs

    @staticmethod
    def backward(ctx, *grads):
        ctx.hook()
        return (None, *grads)


def register_post_backward(args, kwargs, fn):
    """``(args, kwargs)`` with the tensors that need a gradient passed through
    :class:`_PostBackward`, which calls ``fn`` in backward; None if none needs one."""
    flat, spec = tree_flatten((args, kwargs))
    positions = [i for i, t in enumerate(flat) if torch.is_tensor(t) and t.requires_grad]
    if not positions:
        return None
    outputs = _PostBackward.apply(fn, *(flat[i] for i in positions))
    for i, tensor in zip(positions, outputs, strict=True):
        flat[i] = tensor
    return tree_unflatten(flat, spec)


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
    its collectives, its switches and its first-forward binding."""

    exchange: Exchange
    others: OtherParams | None
    settings: PassSettings
    requires_gradient_sync: bool
    reshard_after_backward: bool

    def lazy_init(self) -> None: ...


class HookDriver:
    """The hooks of one dedication, the state of the current pass and the order in which
    its boundaries (:class:`BoundaryState`) issue their collectives: when, not how (a
    backward's reduces are one :class:`~torchtitan_dmuon.engine.reduce.BackwardReduce`,
    made by ``backward_reduce`` at its first).

    Attributes:
        synced_backwards: Backwards whose reduces finished since the count was last reset.
    """

    def __init__(
        self,
        dedication: DrivenDedication,
        states: list[BoundaryState],
        backward_reduce: Callable[[], BackwardReduce],
    ) -> None:
        self.d = dedication
        self.exchange = dedication.exchange
        self.states = states
        self._backward_reduce = backward_reduce
        self._reduce: BackwardReduce | None = None  # this backward's, once it issued
        self.synced_backwards = 0
        forward_order = list(range(len(states)))
        backward_order = forward_order[::-1]
        self.state = TrainingState.IDLE
        self._diverged = ""  # why, once DIVERGED
        # Calls of each boundary with a post-backward in the forwards since the driver was
        # last idle (reset by the root pre-forward), and how many of those post-backwards
        # ran in this backward.
        self._calls = [0] * len(states)
        self._post_backwards = [0] * len(states)
        self.forward_gathers = CollectiveSequence(forward_order, self._issue_gather)
        self.backward_gathers = CollectiveSequence(backward_order, self._issue_gather)
        self.reduce_sequence = CollectiveSequence(backward_order, self._issue_reduce)
        self._handles: list = []
        self._param_hooks: dict[str, tuple[nn.Parameter, object]] = {}

    # ---- registration ------------------------------------------------------------------
    def register(self, model: nn.Module) -> None:
        """Attach the module hooks (the parameter hooks follow in :meth:`bind_params`)."""
        handles = [
            model.register_forward_pre_hook(self._root_pre_forward, prepend=True, with_kwargs=True)
        ]
        for b, state in enumerate(self.states):
            module = state.boundary.module
            handles.append(module.register_forward_pre_hook(self._pre_forward(b), with_kwargs=True))
            handles.append(module.register_forward_hook(self._post_forward(b), with_kwargs=True))
        handles.append(model.register_forward_hook(self._root_post_forward, with_kwargs=True))
        self._handles = handles

    def bind_params(self) -> None:
        """Give each current parameter object its post-accumulate-grad hook, once: checked
        by the hook's handle, not by ``id`` (``to_empty`` registers new objects, an old id
        can come back; ``swap_tensors`` moves an object's hooks with its contents)."""
        for b, state in enumerate(self.states):
            for dp in state.boundary.params:
                hooked = self._param_hooks.get(dp.name)
                if hooked is not None and hooked[0] is dp.param:
                    hooks = dp.param._post_accumulate_grad_hooks
                    if hooks is not None and hooked[1].id in hooks:
                        continue
                    hooked[1].remove()
                handle = dp.param.register_post_accumulate_grad_hook(
                    weak_grad_hook(self._grad_accumulated, b, dp.name)
                )
                self._param_hooks[dp.name] = (dp.param, handle)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        for _, handle in self._param_hooks.values():
            handle.remove()
        self._handles, self._param_hooks = [], {}

    # ---- collectives ---------------------------------------------------------------------
    def _issue_gather(self, b: int) -> None:
        self.states[b].issue_gather()

    def _wait_gathers(self) -> None:
        for state in self.states:
            state.wait_gather()

    def _issue_reduce(self, b: int) -> None:
        if self._reduce is None:
            self._reduce = self._backward_reduce()
        self._reduce.issue(self.states[b])

    def pending_reduces(self) -> list[PendingReduce]:
        """The reduces issued in this backward, in issue order."""
        return self._reduce.pending if self._reduce is not None else []

    def _finish_reduce(self) -> None:
        """End this backward's reduce: the owners hold their reduced gradients."""
        self._take_reduce().finish()
        self.synced_backwards += 1

    def _take_reduce(self) -> BackwardReduce:
        """This backward's reduce (a new one where none issued: its end still syncs the
        DDP-style parameters)."""
        reduce, self._reduce = self._reduce, None
        return reduce if reduce is not None else self._backward_reduce()

    def free_all(self) -> None:
        """Free every boundary's values outside the owner columns: after a step or a
        load changed the values, whatever a rank still holds is stale."""
        for state in self.states:
            state.free()

    def _prefetch(self, sequence: CollectiveSequence) -> None:
        """Start gathering the next boundary in ``sequence`` now: its broadcast waits for
        the unit's replicate broadcast on the gather stream, never on the compute stream."""
        upcoming = sequence.upcoming()
        if upcoming is not None:
            sequence.through(upcoming)

    # ---- forward ---------------------------------------------------------------------------
    def _root_pre_forward(self, module: nn.Module, args, kwargs):
        self.reset_iter_state()
        self.d.lazy_init()
        if self.state is TrainingState.IDLE:  # else a backward is due for earlier forwards
            self._calls = [0] * len(self.states)
        self.state = TrainingState.FORWARD
        self.forward_gathers.reset()
        return None

    def _root_post_forward(self, module: nn.Module, args, kwargs, output):
        self.forward_gathers.finish()
        self._wait_gathers()
        # Which values stay must not depend on the blocks this rank ran (a skipped one
        # missed its post-forward), or the next gathers would differ between ranks.
        if not torch.is_grad_enabled():
            self.free_all()
        elif self.d.settings.reshard_after_forward:
            for state in self.states[:-1]:
                state.free()
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
                    self.states[b].wait_gather()
                return None
            with record_function(f"dmuon::pre_forward b{b}"):
                self.forward_gathers.through(b)
                self.states[b].wait_gather()
                self._prefetch(self.forward_gathers)
            if not torch.is_grad_enabled():
                return None
            inputs = register_post_backward(args, kwargs, functools.partial(self._post_backward, b))
            if inputs is not None:
                self._calls[b] += 1
            return inputs

        return hook

    def _post_forward(self, b: int):
        def hook(module, args, kwargs, output):
            if self.state is TrainingState.BACKWARD:  # recompute: backward needs the values
                return None
            if not torch.is_grad_enabled():
                self.states[b].free()
            elif self.d.settings.reshard_after_forward and b != len(self.states) - 1:
                # The last boundary stays (on every rank alike, so the backward gather
                # sequences agree): backward needs it first.
                self.states[b].free()
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
        self._post_backwards = [0] * len(self.states)
        for state in self.states:
            state.start_backward()
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _pre_backward(self, b: int) -> None:
        self._start_backward()
        if not self.d.settings.reshard_after_forward:
            return
        self.backward_gathers.through(b)
        self.states[b].wait_gather()
        self._prefetch(self.backward_gathers)

    def _post_backward(self, b: int) -> None:
        """A call of boundary ``b`` finished its backward: after its last call's, the
        boundary is due to reduce."""
        self._start_backward()
        self._post_backwards[b] += 1
        if self._post_backwards[b] == self._calls[b]:
            self.states[b].reduce_due = True
            if self.d.requires_gradient_sync:
                self._issue_due_reduces()

    def _grad_accumulated(self, b: int, name: str) -> None:
        self._start_backward()
        state = self.states[b]
        if state.reduce_issued:
            raise late_gradient(
                name,
                f"its hook boundary {state.boundary.name!r} finished its backward and was reduced",
            )

    def _issue_due_reduces(self) -> None:
        sequence = self.reduce_sequence
        while sequence.upcoming() is not None and self.states[sequence.upcoming()].reduce_due:
            sequence.through(sequence.upcoming())

    def _end_backward(self) -> None:
        if self.d.settings.reshard_after_forward:
            self.backward_gathers.finish()
            self._wait_gathers()
        if self.d.requires_gradient_sync:
            self.reduce_sequence.finish()
            try:
                self._finish_reduce()
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
        self._finish_reduce()
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
            PassDivergedError: Some peer's pass did not raise (on gloo it waits in a
                collective of that pass until the group's timeout, then raises this too),
                or raised at another point; or an earlier pass diverged.
        """
        self.raise_if_diverged()
        if not self.pass_unfinished():
            return
        failed = self.state.name.lower()
        others = self.d.others
        # The dedicated reduces and the DDP-style buckets issued, as one number.
        buckets = len(others.buckets) if others is not None else 0
        issued = len(self.pending_reduces()) * (buckets + 1)
        issued += others.issued if others is not None else 0
        agreed = self.exchange.agree_on_failed_pass(issued)
        if agreed is None:
            raise self._diverge(
                f"the last {failed} pass raised on this rank, and some data-parallel peer "
                "did not report a failed pass within the process group's timeout (it waits "
                "in a collective of that pass, or died)"
            )
        if agreed[0] != agreed[1]:
            raise self._diverge(
                f"the last {failed} pass raised on every data-parallel rank, but after "
                "different numbers of gradient reduces"
            )
        logger.warning(
            "dmuon: the previous %s pass did not finish; discarding its state (its "
            "dedicated gradients are dropped)",
            failed,
        )
        self._wait_gathers()
        self._take_reduce().discard()
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
