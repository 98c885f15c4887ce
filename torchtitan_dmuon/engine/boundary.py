"""``BoundaryState``: the runtime of one hook boundary over a pass, the engine's counterpart
of FSDP2's ``FSDPParamGroup``.

It owns what happens to one boundary's units: the gather in flight (and the replicate
broadcasts it waited on), whether the values are here, whether its backward is over, and
issues its reduces' first stage. The hook driver
(:mod:`~torchtitan_dmuon.engine.hooks`) keeps only the pass state and decides *when* each
boundary issues; this decides *how*, on which stream, and what it waits for.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch.distributed as dist
from torch.profiler import record_function

from torchtitan_dmuon.engine.exchange import Exchange, PendingReduce
from torchtitan_dmuon.engine.plan import Boundary
from torchtitan_dmuon.engine.unit import Unit

__all__ = ["BoundaryState", "late_gradient", "weak_grad_hook"]


def weak_grad_hook(method: Callable, *args) -> Callable:
    """A post-accumulate-grad hook that calls the bound ``method(*args)`` while its object
    lives. Weakly: the hook lives on the parameter's C++ side, where the garbage collector
    cannot see it, so a strong reference would keep the model alive forever."""
    ref = weakref.WeakMethod(method)

    def hook(param) -> None:
        alive = ref()
        if alive is not None:
            alive(*args)

    return hook


def late_gradient(name: str, reduced: str) -> RuntimeError:
    """The error for a gradient of parameter ``name`` that arrived after ``reduced``."""
    return RuntimeError(
        f"dmuon: the gradient of {name} arrived after {reduced} (the parameter is used "
        "outside that module): choose a boundary that holds every use of it with "
        "dedicate_params(hook_boundary_predicate=...)"
    )


class BoundaryState:
    """One hook boundary's units and their state in the current pass.

    Attributes:
        index: The boundary's place in forward order.
        boundary: Its module and dedicated parameters (from the plan).
        units: This rank's units of the boundary, one per owner slot.
        resident: Its values are here and current: a gather sends nothing (Z3 keeps the
            last boundary after forward; a pipeline stage keeps every boundary over its
            micro-batches).
        reduce_due: Its backward is over (its post-backward ran for every call): it may
            reduce.
        reduce_issued: Its reduce went out in this backward; a later gradient is an error.
    """

    def __init__(
        self, index: int, boundary: Boundary, units: list[Unit], exchange: Exchange
    ) -> None:
        self.index = index
        self.boundary = boundary
        self.units = units
        self.exchange = exchange
        self.resident = False
        self.reduce_due = False
        self.reduce_issued = False
        self._gather: list[dist.Work] | None = None
        self._replicate: list[dist.Work] = []

    def start_backward(self) -> None:
        self.reduce_due = self.reduce_issued = False

    # ---- values --------------------------------------------------------------------------
    def issue_gather(self) -> None:
        """Start broadcasting the units from their owner columns (on the gather stream),
        unless the values are here."""
        if self.resident:
            return
        self.resident = True
        with record_function(f"dmuon::gather b{self.index}"):
            self._gather, self._replicate = self.exchange.gather(self.units)

    def wait_gather(self) -> None:
        """Make the compute stream wait for the gather issued, then refill the parameters
        that compute from storage of their own."""
        works, self._gather = self._gather, None
        if works is None:
            return
        with record_function(f"dmuon::wait_gather b{self.index}"):
            self.exchange.note_replicate_hidden(self._replicate, self.index)
            self._replicate = []
            for work in works:
                work.wait()
            for unit in self.units:
                unit.refill()

    def free(self) -> None:
        """Free the values outside the owner columns."""
        self.resident = False
        for unit in self.units:
            unit.free()

    # ---- gradients -----------------------------------------------------------------------
    def issue_reduce(self) -> list[PendingReduce]:
        """Stage 1 of every unit's reduce: pack, free the values outside the column and
        SUM onto the column; the parameters' gradients go (packed). Returns the reduces,
        for :class:`~torchtitan_dmuon.engine.reduce.BackwardReduce` to carry on."""
        with record_function(f"dmuon::reduce b{self.index}"):
            reduces = [self.exchange.reduce_to_column(unit) for unit in self.units]
            for param in self.boundary.parameters:
                param.grad = None  # packed (a stack's pieces by several units)
            self.resident = False  # reduce_to_column freed the values
            self.reduce_issued = True
        return reduces
