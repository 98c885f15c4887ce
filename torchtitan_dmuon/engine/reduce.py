"""``BackwardReduce``: one backward's reduce of the dedicated gradients, from each
boundary's first stage to the owners' accumulated gradients, the engine's counterpart of
FSDP2's ``foreach_reduce`` with its reduce-scatter states.

A gradient's road: the boundary's post-backward makes it due; the hook driver decides
*when* it issues (:mod:`~torchtitan_dmuon.engine.hooks`); :meth:`BackwardReduce.issue`
packs the boundary's units and SUMs each bucket onto its owner column inside its shard
group (stage 1, :meth:`Exchange.reduce_to_column`); as the next boundary issues, the
buckets of all but the last boundary are released where they landed on a non-owner and,
under HSDP, the last one's SUM across replicas onto the primary (stage 2) starts on the
reduce stream; :meth:`BackwardReduce.finish`, at the end of backward, starts the
remaining second stages, makes the compute stream wait for every reduce and has the
primary owners accumulate their gradients, divided by the divisor given at construction,
then syncs the DDP-style parameters with the same divisor. Every stream wait of a reduce
is here.
"""

from __future__ import annotations

from torch.profiler import record_function

from torchtitan_dmuon.engine.boundary import BoundaryState
from torchtitan_dmuon.engine.exchange import Exchange, PendingReduce
from torchtitan_dmuon.engine.others import OtherParams

__all__ = ["BackwardReduce"]


class BackwardReduce:
    """The reduces of one backward (or of the accumulated gradients of backwards without
    sync, reduced at once), in issue order.

    Args:
        exchange: The groups and streams.
        divide_factor: What the reduced sums are divided by (the data-parallel size by
            default, ``set_gradient_divide_factor``'s otherwise).
        others: The DDP-style parameters, whose buckets follow each boundary's reduce and
            which are synced at :meth:`finish`; None before the first forward bound them.
    """

    def __init__(self, exchange: Exchange, divide_factor: float, others: OtherParams | None):
        self.exchange = exchange
        self.divide_factor = divide_factor
        self.others = others
        self._boundaries: list[list[PendingReduce]] = []  # per boundary, in issue order

    @property
    def pending(self) -> list[PendingReduce]:
        """The reduces issued, in issue order."""
        return [p for reduces in self._boundaries for p in reduces]

    def issue(self, state: BoundaryState) -> None:
        """Stage 1 of boundary ``state``'s reduces. Before it, the boundaries reduced
        earlier but the last are released (two boundaries of buckets in flight at most,
        as FSDP2 keeps one reduce-scatter in flight) and, under HSDP, the last one's stage
        2 starts: one boundary behind, in issue order on every replica, on the reduce
        stream (so the compute stream never waits for it). The boundary's DDP-style
        buckets follow."""
        if self._boundaries:
            *released, last = self._boundaries
            self._release([p for reduces in released for p in reduces])
            self._start_second_stages(last)
        self._boundaries.append(state.issue_reduce())
        if self.others is not None:
            self.others.boundary_reduced(state.index)

    def finish(self) -> None:
        """The remaining second stages; the compute stream waits for every reduce, the
        primary owners accumulate their gradients (experts' too: they sum every
        data-parallel rank's tokens), then the DDP-style sync of the rest."""
        with record_function("dmuon::finish_reduces"):
            reduces = self.pending
            self._start_second_stages(reduces)
            for pending in reduces:
                pending.wait()
                if pending.unit.primary:
                    pending.unit.accumulate_grads(pending.bucket, self.divide_factor)
            if self.others is not None:
                self.others.sync_grads(self.divide_factor)
            self._boundaries = []

    def discard(self) -> None:
        """A failed pass's reduces: let them land (their buffers are in use until then)
        and drop them, and the DDP-style buckets issued. Every rank issued the same first
        stages (the ranks agreed on their number) and so the same second stages, once
        those not started yet are."""
        reduces = self.pending
        self._start_second_stages(reduces)
        for pending in reduces:
            pending.wait()
        if self.others is not None:
            self.others.discard()
        self._boundaries = []

    def _start_second_stages(self, reduces: list[PendingReduce]) -> None:
        """HSDP: stage 2 (across replicas, onto the primary) of the column's units in
        ``reduces`` not started yet, in issue order, on the reduce stream: it waits for
        stage 1 there, so the compute stream does not."""
        replicas, streams = self.exchange.replicas, self.exchange.streams
        if replicas is None:
            return
        started = [p for p in reduces if p.unit.holds and p.to_primary is None]
        if not started:
            return
        with streams.on(streams.reduce):
            for pending in started:
                pending.to_column.wait()
                pending.to_primary = replicas.reduce_to_primary(pending.unit, pending.bucket)

    def _release(self, reduces: list[PendingReduce]) -> None:
        """Drop the buckets of ``reduces`` outside the primary owners (whose bucket is the
        reduced gradient, accumulated at :meth:`finish`) once they landed: else every
        rank would hold the gradients of every dedicated matrix until the end of
        backward. The reduce stream waits for them, not the compute stream; the allocator
        reuses a bucket's memory only once the reduce stream has passed that wait."""
        self._start_second_stages(reduces)
        released = [p for p in reduces if p.bucket is not None and not p.unit.primary]
        if not released:
            return
        streams = self.exchange.streams
        streams.wait([w for p in released for w in p.works()], streams.reduce)
        for pending in released:
            streams.keep_until_done(pending.bucket, streams.reduce)
            pending.bucket = None
