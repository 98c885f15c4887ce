"""The engine's process groups and the collectives that move units over them.

Gathers and stage-1 reduces each run on a group of their own: in backward a boundary's
reduce starts when its gradients are complete, which rank-dependent branches make differ
between ranks, so on one group the two sequences could interleave differently (a hang).
Each sequence alone has a fixed order (see :mod:`~torchtitan_dmuon.engine.hooks`).

Under HSDP (``Replicas``) each owner column exists once per replica: gradients already
summed inside each shard group are summed once more across the replicate group onto the
primary replica, and after the step the primary's new values are broadcast to its column
in the other replicas, synchronously or (``replicate_async``) in the background, each
unit's broadcast waited on by the gather stream right before the unit is next gathered.
Which stream waits for which collective is in :mod:`~torchtitan_dmuon.engine.streams`.

Under tensor parallelism (``TensorParallelNS``) a matrix is split along one dim over the TP
group; its owner column's TP ranks each keep their shard, receive its reduced gradient and
orthogonalize the matrix together: by the Gram path (one all-reduce of the unsplit dim's
Gram per phase, never gathering the matrix) where that moves fewer bytes and the backend
has a sharded form, else on the gathered matrix. The math is in ``optim/sharded_ns.py``;
this holds the group, counts the bytes and logs each shape's method once.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.profiler import record_function

from torchtitan_dmuon.engine import comm
from torchtitan_dmuon.engine.comm import CommStats, ShardGroups
from torchtitan_dmuon.engine.streams import EngineStreams
from torchtitan_dmuon.engine.unit import Unit
from torchtitan_dmuon.optim.sharded_ns import (
    SHARDED_BACKENDS,
    gathered_newton_schulz,
    sharded_newton_schulz,
    sharded_ns_bytes,
    sharded_ns_method,
    split_newton_schulz,
)

__all__ = [
    "Exchange",
    "OwnerGroup",
    "PendingReduce",
    "Replicas",
    "TensorParallelNS",
]

logger = logging.getLogger(__name__)


@dataclass
class PendingReduce:
    """A unit's gradient bucket on its way to the primary owner.

    Attributes:
        unit: Whose gradients.
        bucket: The packed gradients (and has-gradient flags), reduced in place; None
            once it landed on a rank that is not the unit's primary owner.
        to_column: Stage 1, inside the shard group.
        to_primary: Stage 2 under HSDP, across replicas, once started (column ranks only).
    """

    unit: Unit
    bucket: torch.Tensor | None
    to_column: dist.Work
    to_primary: dist.Work | None = None

    def works(self) -> list[dist.Work]:
        return [self.to_column] + ([self.to_primary] if self.to_primary is not None else [])

    def wait(self) -> None:
        """Make the current stream wait for both stages."""
        for work in self.works():
            work.wait()


class Exchange:
    """One dedication's groups: per domain a shard and a reduce group (dense, then the
    experts' ``efsdp`` under expert parallelism), the replicate group under HSDP
    (:class:`Replicas`) and the tensor-parallel group with its Newton-Schulz.

    Attributes:
        domains: The :class:`ShardGroups` of each plan domain.
        replicas: HSDP's second stage, or None.
        tp_group: The owner column's tensor-parallel ranks, or None.
        tensor_parallel: Their Newton-Schulz (:class:`TensorParallelNS`), or None.
        owner_group: The owner group this rank is a member of (:class:`OwnerGroup`),
            or None with one owner per matrix.
        stats: Bytes and calls per collective kind.
        device: Where the dedication's buffers live and every tensor handed to its
            collectives is made.
        streams: The gather and reduce streams on ``device``.
    """

    def __init__(
        self,
        mesh: DeviceMesh,
        replicate_mesh: DeviceMesh | None,
        tp_mesh: DeviceMesh | None,
        expert_mesh: DeviceMesh | None,
        stats: CommStats,
        group_size: int = 1,
    ) -> None:
        self.stats = stats
        self.device = comm.mesh_device(mesh)
        self.streams = EngineStreams(self.device)
        # Created in one order on every rank (dense shard and reduce, replicate, the
        # experts', TP), as engine_group's local synchronization needs.
        self.domains = [ShardGroups(mesh, "")]
        self.replicas: Replicas | None = None
        if replicate_mesh is not None:
            group = comm.engine_group(replicate_mesh.get_group(), "dmuon_replicate", self.device)
            self.replicas = Replicas(
                group, replicate_mesh.get_local_rank(), replicate_mesh.size(), stats
            )
        if expert_mesh is not None:
            self.domains.append(ShardGroups(expert_mesh, "expert_"))
        self.tp_group: dist.ProcessGroup | None = None
        self.tensor_parallel: TensorParallelNS | None = None
        if tp_mesh is not None:
            self.tp_group = comm.engine_group(tp_mesh.get_group(), "dmuon_tp", self.device)
            self.tensor_parallel = TensorParallelNS(self.tp_group, stats)
        self.owner_group: OwnerGroup | None = None
        if group_size > 1:
            # The consecutive shard ranks of this rank's group (only they create it).
            first = self.domains[0].rank // group_size * group_size
            members = slice(first, first + group_size)
            group = comm.engine_group(mesh.get_group(), "dmuon_owner_group", self.device, members)
            self.owner_group = OwnerGroup(group, stats)
        # Idle but for the ranks of a failed pass, which meet here while their peers may
        # still wait in that pass's gathers and reduces (see agree_on_failed_pass).
        self.recovery_groups = [comm.engine_group(mesh.get_group(), "dmuon_recovery", self.device)]
        if replicate_mesh is not None:
            self.recovery_groups.append(
                comm.engine_group(
                    replicate_mesh.get_group(), "dmuon_replicate_recovery", self.device
                )
            )
        self._meshes = (mesh, replicate_mesh)
        self._others_groups: list[dist.ProcessGroup] | None = None

    @property
    def shard_group(self) -> dist.ProcessGroup:
        return self.domains[0].shard_group

    @property
    def replicate_group(self) -> dist.ProcessGroup | None:
        return self.replicas.group if self.replicas is not None else None

    def domain_of(self, unit: Unit) -> ShardGroups:
        """The shard and reduce groups ``unit`` moves over."""
        return self.domains[unit.plan.domain]

    def process_groups(self) -> list[dist.ProcessGroup]:
        """Every group of its own: shard, reduce (the same ranks), replicate, the experts'
        shard and reduce groups, the tensor-parallel group, the recovery groups and the
        DDP-style sync's."""
        groups = [self.domains[0].shard_group, self.domains[0].reduce_group]
        groups += [self.replicas.group] if self.replicas is not None else []
        groups += [
            g for domain in self.domains[1:] for g in (domain.shard_group, domain.reduce_group)
        ]
        groups += [self.tp_group] if self.tp_group is not None else []
        groups += [self.owner_group.group] if self.owner_group is not None else []
        return groups + self.recovery_groups + (self._others_groups or [])

    def column_holders(self, layout) -> dist.ProcessGroup | None:
        """The group over the holders of a column-split piece's parts: an owner group's
        members for its blocks, else the tensor-parallel ranks."""
        if layout.block is not None:
            return self.owner_group.group
        return self.tp_group

    def others_groups(self) -> list[dist.ProcessGroup]:
        """Groups for the DDP-style sync of the parameters no ``fully_shard`` covers, over
        the same ranks as :meth:`data_parallel_groups`: its buckets go out while the
        dedicated reduces do, at other times on each rank, so they cannot share a group.
        Created at the first call, by every rank of the dedication alike."""
        if self._others_groups is None:
            mesh, replicate_mesh = self._meshes
            self._others_groups = [comm.engine_group(mesh.get_group(), "dmuon_others", self.device)]
            if replicate_mesh is not None:
                group = comm.engine_group(
                    replicate_mesh.get_group(), "dmuon_replicate_others", self.device
                )
                self._others_groups.append(group)
        return self._others_groups

    def data_parallel_groups(self) -> list[dist.ProcessGroup]:
        """Groups whose successive SUM all-reduces sum over every data-parallel rank: the
        reduce group, then the replicate group under HSDP (both idle outside backward)."""
        replicate = [self.replicas.group] if self.replicas is not None else []
        return [self.domains[0].reduce_group] + replicate

    def gather(self, units: list[Unit]) -> tuple[list[dist.Work], list[dist.Work]]:
        """Materialize ``units`` in this shard group: a broadcast of each of their buffers
        from its column, issued on the gather stream once that stream has waited for the
        units' replicate broadcasts in flight (the compute stream waits only for the
        broadcasts returned; :meth:`Unit.refill` follows once they land).

        Returns:
            The shard-group broadcasts, and the replicate broadcasts they waited on.
        """
        replicate = self.replicas.take(units) if self.replicas is not None else []
        for unit in units:
            unit.allocate()  # on the compute stream, which frees it again
        works = []
        with self.streams.on(self.streams.gather):
            if replicate:
                with record_function(f"dmuon::replicate_wait b{units[0].plan.boundary}"):
                    for work in replicate:
                        work.wait()
            for unit in units:
                domain = self.domain_of(unit)
                works += [
                    comm.broadcast(
                        buffer,
                        unit.column,
                        domain.shard_group,
                        self.stats,
                        domain.kind("broadcast"),
                    )  # fmt: skip
                    for buffer in unit.buffers
                ]
        return works, replicate

    def note_replicate_hidden(self, replicate: list[dist.Work], boundary: int) -> None:
        """Called as the compute stream is about to wait for a boundary's values: whether
        the replicate broadcasts into them had landed (hidden behind compute), logged
        when they had not. A host query for the log alone: it decides nothing."""
        if replicate and self.replicas is not None:
            self.replicas.note_hidden(all(work.is_completed() for work in replicate), boundary)

    def reduce_to_column(self, unit: Unit) -> PendingReduce:
        """Stage 1: pack the local gradients, free the values outside the column and SUM
        the bucket onto the unit's column inside its domain's shard group (an expert
        unit's: the ranks holding the same experts, which together saw every token
        routed to them). The rest of the road: :mod:`~torchtitan_dmuon.engine.reduce`."""
        bucket = unit.pack_grads()
        unit.free()  # the caller drops the gradients
        domain = self.domain_of(unit)
        work = comm.reduce_sum(
            bucket, unit.column, domain.reduce_group, self.stats, domain.kind("reduce")
        )
        return PendingReduce(unit, bucket, work)

    def agree_on_failed_pass(self, reduces_issued: int) -> tuple[int, int] | None:
        """Called by a rank whose last pass raised half-way, before it waits on anything
        that pass issued: MAX-reduce ``(reduces_issued, -reduces_issued)`` over the
        recovery groups (every data-parallel rank of the dedication, as the shard, then
        the replicate group), on the dedication's device (an NCCL group has no CPU
        backend), waited for on the host with each group's timeout: recovery, not a step,
        so the host may wait here.

        Returns the fewest and the most reduces any rank issued, or None when some rank
        did not join within the groups' timeout: its pass did not fail (it waits in a
        collective this rank never issues) or it died.
        """
        counts = torch.tensor(
            [reduces_issued, -reduces_issued], dtype=torch.int64, device=self.device
        )
        try:
            for group in self.recovery_groups:
                work = comm.all_reduce(
                    counts, group, self.stats, kind="recovery", op=dist.ReduceOp.MAX
                )
                timeout = comm.group_timeout(group)
                if timeout is None:
                    work.wait()
                else:
                    work.wait(timeout)
            most, fewest = counts.tolist()  # on NCCL: blocks until the reduce landed
        except RuntimeError:  # timed out, or the peer closed
            return None
        return -fewest, most

    def wait_replicas(self) -> None:
        """Wait for every in-flight replicate broadcast."""
        if self.replicas is not None:
            self.replicas.wait_all()


class Replicas:
    """The replicate group of one dedication and its in-flight broadcasts.

    Attributes:
        group: The engine's own group over the replicate dimension.
        rank: This rank's replicate-group rank (its replica).
        size: Number of replicas.
    """

    def __init__(self, group: dist.ProcessGroup, rank: int, size: int, stats: comm.CommStats):
        self.group = group
        self.rank = rank
        self.size = size
        self._stats = stats
        self._in_flight: dict[Unit, list[dist.Work]] = {}
        self.unhidden = 0  # boundaries whose replicate broadcast compute had to wait for
        self._warned = False

    def reduce_to_primary(self, unit: Unit, bucket: torch.Tensor) -> dist.Work:
        """SUM a column's bucket across replicas onto the primary replica."""
        return comm.reduce_sum(
            bucket, unit.primary_replica, self.group, self._stats, "replicate_reduce"
        )

    def broadcast(self, units: list[Unit], async_op: bool) -> None:
        """Send each held unit's values from its primary to its column in the other
        replicas."""
        with record_function("dmuon::replicate_broadcast"):
            for unit in units:
                if not unit.holds:
                    continue
                works = [
                    comm.broadcast(
                        buffer,
                        unit.primary_replica,
                        self.group,
                        self._stats,
                        "replicate_broadcast",
                    )  # fmt: skip
                    for buffer in unit.buffers
                ]
                if async_op:
                    self._in_flight[unit] = works
                else:
                    for work in works:
                        work.wait()

    def take(self, units: list[Unit]) -> list[dist.Work]:
        """The broadcasts into ``units`` still in flight, for the caller to wait on."""
        return [w for unit in units for w in self._in_flight.pop(unit, ())]

    def wait(self, unit: Unit) -> None:
        works = self._in_flight.pop(unit, None)
        if works is not None:
            with record_function(f"dmuon::replicate_wait b{unit.plan.boundary}"):
                for work in works:
                    work.wait()

    def note_hidden(self, hidden: bool, boundary: int) -> None:
        """Count a boundary whose replicate broadcast had not landed when compute needed
        its values, with a warning the first time: the broadcast cannot hide behind the
        forward there (a short forward, or a slow replicate link) and costs its time."""
        if hidden:
            return
        self.unhidden += 1
        if not self._warned:
            self._warned = True
            logger.warning(
                "dmuon: the asynchronous replicate broadcast into boundary %d had not landed "
                "when the forward needed it: it cannot hide behind the forward there, and "
                "the forward waits for it (counted in Dedication.exchange.replicas.unhidden)",
                boundary,
            )

    def wait_all(self) -> None:
        for unit in list(self._in_flight):
            self.wait(unit)


class OwnerGroup:
    """The ranks that own matrices together, each a block of each, and their Newton-Schulz.

    Attributes:
        group: The engine's group over the members.
        stats: Where its collectives are counted (``owner_group_all_reduce``).
    """

    def __init__(self, group: dist.ProcessGroup, stats: CommStats) -> None:
        self.group = group
        self.stats = stats

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """SUM-all-reduce ``tensor`` in place over the members."""
        comm.all_reduce(tensor, self.group, self.stats, "owner_group_all_reduce").wait()

    def split_ns(self, block_dim: int, schedule, *, eps: float, dtype: torch.dtype):
        """Newton-Schulz of the members' blocks split along ``block_dim`` (0: rows, 1:
        columns), run together: every iteration of the torch backend's, its ``X X^T``
        summed over the blocks (``optim/sharded_ns.split_newton_schulz``)."""
        split_dim = block_dim - 2

        def orthogonalize(blocks: torch.Tensor) -> torch.Tensor:
            return split_newton_schulz(
                blocks, split_dim, self.all_reduce, schedule, eps=eps, dtype=dtype
            )

        return orthogonalize


class TensorParallelNS:
    """Newton-Schulz over one tensor-parallel group.

    Attributes:
        group: The engine's tensor-parallel group.
        stats: Where its collectives are counted (``tp_gather``, ``tp_all_reduce``).
    """

    def __init__(self, group: dist.ProcessGroup, stats: CommStats) -> None:
        self.group = group
        self.stats = stats
        self._ns_methods: dict[tuple, str] = {}

    def gather_shards(self, shard: torch.Tensor) -> list[torch.Tensor]:
        """Every tensor-parallel rank's shard (same shapes), in rank order."""
        size = dist.get_world_size(self.group)
        out = shard.new_empty((size * shard.shape[0], *shard.shape[1:]))
        comm.all_gather_into(out, shard.contiguous(), self.group, self.stats, "tp_gather").wait()
        return list(out.chunk(size))

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """SUM-all-reduce ``tensor`` in place over the TP ranks (``tp_all_reduce``)."""
        comm.all_reduce(tensor, self.group, self.stats, "tp_all_reduce").wait()

    def sharded_ns(
        self, split_dim: int, ns, schedule, *, eps: float, dtype: torch.dtype, backend: str
    ):
        """Newton-Schulz of tensor-parallel shards split along ``split_dim``, run together
        by the owner column's TP ranks: the Gram path (one all-reduce of the unsplit dim's
        Gram per phase) unless gathering the matrix moves fewer bytes or ``backend`` has
        no sharded form (then ``ns`` on the gathered matrix). Logged once per shape."""
        size = dist.get_world_size(self.group)
        rank = dist.get_rank(self.group)

        def orthogonalize(shards: torch.Tensor) -> torch.Tensor:
            full = list(shards.shape)
            full[split_dim] *= size
            method = sharded_ns_method(
                full, split_dim, dtype.itemsize, schedule.steps, backend=backend
            )
            key = (tuple(full[-2:]), split_dim)
            if key not in self._ns_methods:
                self._ns_methods[key] = method
                bytes_per_matrix = sharded_ns_bytes(
                    full[-2:], split_dim, dtype.itemsize, schedule.steps
                )
                why = (
                    f"ns_backend={backend!r} has no sharded form"
                    if backend not in SHARDED_BACKENDS
                    else "by bytes"
                )
                logger.info(
                    "dmuon: tensor-parallel Newton-Schulz of %s split along dim %d over %d "
                    "ranks: %s (%s; bytes per matrix: %s)",
                    key[0], split_dim, size, method, why, bytes_per_matrix,
                )  # fmt: skip
            if method == "gram":
                return sharded_newton_schulz(
                    shards, split_dim, self.all_reduce, schedule, eps=eps, dtype=dtype
                )
            return gathered_newton_schulz(shards, split_dim, rank, self.gather_shards, ns)

        return orthogonalize
