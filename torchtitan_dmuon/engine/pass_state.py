"""The per-pass state of a dedication's hooks, and what they drive.

Collectives must be issued in the same order on every rank, even when a branch is unused
on some ranks. So each kind of collective follows one fixed sequence over the boundaries
(forward order for forward gathers, reverse order for backward gathers and reduces): a
trigger issues everything up to its own boundary, and the end of forward / backward
issues the rest. When a trigger fires depends on the rank, so sequences that run in the
same pass never share a process group: gathers use the shard group, reduces the reduce
group, and neither is FSDP2's.

A pass that raises (an out-of-memory error, a bad op) leaves its state behind; the next
root pre-forward finds the driver not idle, waits for what the failed pass issued, drops
its partial gradients and starts clean, as FSDP2 resets its per-pass state there.
"""

from __future__ import annotations

from enum import Enum, auto
from typing import TYPE_CHECKING, Protocol

import torch
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_flatten

if TYPE_CHECKING:
    from torchtitan_dmuon.engine.exchange import Exchange, PendingReduce
    from torchtitan_dmuon.engine.settings import DedicationSettings
    from torchtitan_dmuon.engine.unit import Unit

__all__ = ["CollectiveSequence", "DrivenDedication", "TrainingState", "register_pre_backward"]


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


class DrivenDedication(Protocol):
    """What the hooks drive (a :class:`~torchtitan_dmuon.engine.dedication.Dedication`):
    its units and collectives, its switches, its first-forward binding and the end of a
    reduced backward."""

    exchange: Exchange
    boundary_units: list[list[Unit]]
    settings: DedicationSettings
    requires_gradient_sync: bool
    reshard_after_backward: bool

    def lazy_init(self) -> None: ...

    def finish_reduces(self, reduces: list[PendingReduce]) -> None: ...
