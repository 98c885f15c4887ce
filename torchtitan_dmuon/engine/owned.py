"""``OwnedMatrices``: the engine's implementation of ``Muon``'s
:class:`~torchtitan_dmuon.optim.matrices.MatrixSet`.

A rank steps only the matrices it is the primary owner of (the only ones whose reduced
gradient it holds), into their masters; the new values reach the other ranks by the
dedication's broadcasts. Everything a step decides is decided by every rank of the
dedication alike: the Newton-Schulz choice through :func:`gather_over`, QK-clip's maxima by
MAX all-reduces over the data-parallel groups, and whether the step failed anywhere by a
verdict settled on the device (:class:`StepVerdict`): every write is masked by it, and the
host reads it at the next step, when the device has long produced it, so that no step
waits for every rank's host.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import record_function

from torchtitan_dmuon.engine import comm
from torchtitan_dmuon.engine.comm import gather_over_groups, mesh_device
from torchtitan_dmuon.engine.dedication import Dedication
from torchtitan_dmuon.engine.verification import verify_plan
from torchtitan_dmuon.optim.config import MuonConfig
from torchtitan_dmuon.optim.fused_rows import FusedRows
from torchtitan_dmuon.optim.matrices import MuonStepError
from torchtitan_dmuon.optim.muon import MatrixGroup, NSFunction
from torchtitan_dmuon.optim.newton_schulz import matrix_count
from torchtitan_dmuon.optim.ns_choice import NSChoice
from torchtitan_dmuon.optim.qk_clip import QKClip

__all__ = ["OwnedMatrices", "StepVerdict", "gather_over"]

T = TypeVar("T")
logger = logging.getLogger(__name__)


def gather_over(dedication: Dedication, obj) -> list:
    """``obj`` of every rank of ``dedication``, in global rank order: small all-gathers over
    its shard group, then its replicate group (HSDP), then its tensor-parallel group, each
    carrying what the earlier ones gathered (the experts' groups lie inside those).
    Exactly the ranks that build the dedication's ``Muon`` join, so a rank holding more
    dedicated parts than another (pipeline stages) cannot mismatch the collectives of a
    group it is not in. A collective: every rank of it calls it."""
    exchange = dedication.exchange
    known = gather_over_groups(
        [exchange.shard_group, exchange.replicate_group, exchange.tp_group], obj
    )
    return [known[rank] for rank in sorted(known)]


@dataclass
class StepVerdict:
    """Whether a step failed on some rank: ``[highest failed global rank + 1, world size -
    lowest failed global rank]``, zeros where none did (two MAX-reducible int32s, whatever
    the world size), on its way to the host.

    Attributes:
        flags: The two values, in host memory (pinned, copied from the device) once
            ``ready`` has passed.
        ready: The event after which ``flags`` holds them; None on the CPU.
        error: What this rank raised, if anything.
        synced_backwards: The reduced backwards the step read, given back when it failed
            (the gradients are still held: ``step()`` may be called again).
    """

    flags: torch.Tensor
    ready: object | None
    error: BaseException | None
    synced_backwards: int

    def failed(self) -> list[int] | None:
        """The lowest and highest failed global ranks (one where they are the same), or
        None; waits for ``ready`` (passed long ago by the next step)."""
        if self.ready is not None:
            self.ready.synchronize()
        highest, from_top = self.flags.numpy().tolist()  # host memory: no device read
        if not highest:
            return None
        lowest = dist.get_world_size() - from_top
        return [lowest] if lowest == highest - 1 else [lowest, highest - 1]


def failure_flags(failed: set[int], device: torch.device) -> torch.Tensor:
    """The :class:`StepVerdict` flags of the global ranks ``failed``, on ``device``."""
    world = dist.get_world_size()
    values = [max(failed) + 1, world - min(failed)] if failed else [0, 0]
    return torch.tensor(values, dtype=torch.int32, device=device)


class OwnedMatrices:
    """The dedicated matrices of one model, as this rank steps them.

    Args:
        dedication: What :func:`~torchtitan_dmuon.dedicate_params` attached to the model.
        config: The optimizer's settings (``replicate_async`` switches the dedication's on).
        fused: The layouts of the dedicated parameters that hold several matrices fused
            along their rows, by name (each owned whole: its owner runs every matrix's
            Newton-Schulz).

    Raises:
        ValueError: ``replicate_async`` without a replicate mesh; a fused parameter that
            the plan splits (owner-group blocks, tensor-parallel shards). The plan is the
            same on every rank, so every rank raises alike.
    """

    def __init__(
        self,
        dedication: Dedication,
        config: MuonConfig,
        fused: Mapping[str, FusedRows] | None = None,
    ) -> None:
        if config.replicate_async and dedication.exchange.replicas is None:
            raise ValueError(
                "replicate_async=True needs dedicate_params(..., replicate_mesh=...) (HSDP)"
            )
        fused = dict(fused or {})
        for d in dedication.plan.params:
            if d.name in fused and (d.layout.block is not None or d.layout.split_dim is not None):
                raise ValueError(
                    f"{d.name} holds fused matrices ({fused[d.name]}), which must be owned "
                    "whole: the plan splits it (owner groups or tensor parallelism); "
                    "owner_group_size=1, or no tensor parallelism, keeps it whole"
                )
        self.dedication = dedication
        dedication.bind_params()
        self.params: list[nn.Parameter] = list(dedication.params)
        self.names = [d.name for d in dedication.plan.params]
        self.fused = [fused.get(name) for name in self.names]
        self._fused_by_key = {
            id(d.param): fused[d.name] for d in dedication.plan.params if d.name in fused
        }
        self.device = mesh_device(dedication.mesh)
        self._replicate_async = config.replicate_async
        exchange = dedication.exchange
        # The step's verdict runs over every data-parallel rank and the TP ranks.
        self._verdict_groups = [
            g
            for g in exchange.data_parallel_groups() + [exchange.tp_group]
            if g is not None and dist.get_world_size(g) > 1
        ]
        # Created here, by every rank of the dedication alike (Muon's constructor).
        self._phase_group = dedication.phase_group()
        self._failed: set[int] = set()
        self._error: BaseException | None = None
        self._flags: torch.Tensor | None = None
        self._verdict: StepVerdict | None = None

    def prepare(self) -> None:
        verify_plan(self.dedication)
        if self._replicate_async:
            self.dedication.set_replicate_async(True)

    def gather(self, obj) -> list:
        return gather_over(self.dedication, obj)

    def local_rows(self) -> dict[str, int]:
        return {d.name: d.layout.local_shape[0] for d in self.dedication.plan.params}

    def row_blocked(self) -> set[str]:
        return {d.name for d in self.dedication.plan.params if d.layout.block_dim == 0}

    def ns_workload(self, backend: str, dtype: torch.dtype, steps: int) -> dict:
        """Per ``(rows, cols)``, the matrices of each parameter (1, or a stack's count)
        that ``backend`` orthogonalizes on this rank each step, in the order of
        ``owned_grads``: those of which it is the primary owner, whole, and the
        tensor-parallel matrices its owner column gathers (the Gram path runs no backend)."""
        out: dict[tuple[int, int], list[int]] = {}
        tensor_parallel = self.dedication.exchange.tp_group is not None
        for unit in self.dedication.units:
            if not unit.primary:
                continue
            for d in unit.params:
                if tensor_parallel and d.layout.tp_ns_method(backend, dtype, steps) == "gram":
                    continue
                if d.layout.block is not None:  # an owner group's own iteration
                    continue
                shape = d.layout.shape  # whole matrices (a piece's)
                layout = self._fused_by_key.get(id(d.param))
                if layout is not None:
                    for rows, cols in layout.shapes(int(shape[-1])):
                        out.setdefault((rows, cols), []).append(1)
                    continue
                out.setdefault((int(shape[-2]), int(shape[-1])), []).append(matrix_count(shape))
        return out

    def divide_grads(self, divisor: torch.Tensor | float) -> None:
        self.dedication.divide_owned_grads(divisor)

    def begin_step(self) -> None:
        verdict, self._verdict = self._verdict, None
        failed = verdict.failed() if verdict is not None else None
        if failed is not None:
            dedication = self.dedication
            dedication.synced_backwards = max(dedication.synced_backwards, verdict.synced_backwards)
            error = verdict.error
            raise MuonStepError(
                f"the previous Muon.step failed on rank(s) {failed}"
                + (" (and maybe ranks between)" if len(failed) > 1 else "")
                + "; it changed nothing on any rank (parameters, momentum and AdamW state are "
                "as before it); the reduced gradients are kept: call step() again to take "
                "this step, or zero_grad() to drop them"
                + (f": {type(error).__name__}: {error}" if error is not None else "")
            ) from error
        self._check_reduced()
        self.dedication.wait_replicas()  # a step without a forward since the last one

    def _check_reduced(self) -> None:
        """A step needs the gradients of a synced backward (or a pipeline stage's last)."""
        dedication = self.dedication
        dedication.driver.raise_if_diverged()
        if dedication.initialized and dedication.synced_backwards > 0:
            return
        if dedication.pipeline_stage is not None:
            raise RuntimeError(
                f"Muon.step() was called but pipeline stage {dedication.pipeline_stage} has "
                "not reduced its gradients since the last step: its schedule ran no backward "
                "marked last_backward (the stage's last full or weight backward of the "
                "step), which DMuon reduces after"
            )
        raise RuntimeError(
            "Muon.step() was called before any backward (with gradient sync enabled) "
            "since the last step: the dedicated gradients are not reduced to owners yet"
        )

    def step_phases(self, ns: NSChoice) -> list[list[MatrixGroup]]:
        """Those stepped alone first, then the blocks of owner groups' matrices by block
        dim, or the tensor-parallel shards by split dim, whose holders run the
        Newton-Schulz together: a rank that failed before would otherwise meet its peer's
        collective with its agreement."""
        with record_function("dmuon::owned_grads"):
            targets = self.dedication.owned_grads()
        by_split: dict[int | None, list[tuple]] = {None: []}
        by_block_dim: dict[int, list[tuple]] = {}
        for target in targets:
            layout = self.dedication.layout_of(target[0])
            if layout.block is not None:
                by_block_dim.setdefault(layout.block_dim, []).append(target)
            else:  # the shards one split dim cuts run one sharded Newton-Schulz together
                by_split.setdefault(layout.split_dim, []).append(target)
        alone_targets = by_split.pop(None)
        alone = [self._group(None, alone_targets, ns, ns.bind())] if alone_targets else []
        exchange = self.dedication.exchange
        if exchange.owner_group is not None:
            # Two phases on every rank of a job with owner groups, owning blocks or not.
            return [
                alone,
                [self._blocks(dim, by_block_dim[dim], ns) for dim in sorted(by_block_dim)],
            ]
        if exchange.tp_group is None:
            return [alone]
        # Two phases on every rank of a TP job, owning shards or not.
        bound = ns.bind()
        return [alone, [self._group(split, ts, ns, bound) for split, ts in by_split.items()]]

    def _blocks(self, block_dim: int, targets: list[tuple], ns: NSChoice) -> MatrixGroup:
        """An owner group's blocks split along ``block_dim``, orthogonalized by the
        members together; every member has the same matrices in the same order."""
        keys, masters, grads, stepped = (list(column) for column in zip(*targets, strict=True))
        owner_group = self.dedication.exchange.owner_group
        return MatrixGroup(
            keys,
            masters,
            grads,
            owner_group.split_ns(block_dim, ns.schedule, eps=ns.eps, dtype=ns.dtype),
            shapes=[key.shape for key in keys],
            split_dim=block_dim - 2,  # NorMuon's row statistics: which dim the blocks split
            all_reduce=owner_group.all_reduce,
            stepped=stepped,
        )

    def _group(
        self, split: int | None, targets: list[tuple], ns: NSChoice, bound: NSFunction
    ) -> MatrixGroup:
        keys, masters, grads, stepped = (list(column) for column in zip(*targets, strict=True))
        if split is None:
            fused = [self._fused_by_key.get(id(key)) for key in keys]
            return MatrixGroup(
                keys,
                masters,
                grads,
                bound,
                stepped=stepped,
                unbatched=ns.unbatched,
                fused=fused if any(fused) else None,
            )
        tensor_parallel = self.dedication.exchange.tensor_parallel
        sharded_ns = tensor_parallel.sharded_ns(
            split, bound, ns.schedule, eps=ns.eps, dtype=ns.dtype, backend=ns.backend
        )
        return MatrixGroup(
            keys,
            masters,
            grads,
            sharded_ns,
            shapes=[key.shape for key in keys],
            split_dim=split,  # NorMuon's row statistics: which dim the shards split
            all_reduce=tensor_parallel.all_reduce,
            stepped=stepped,
        )

    def computed(
        self,
        phases: list[list[MatrixGroup]],
        compute: Callable[[MatrixGroup], T],
        found_inf: torch.Tensor | None,
    ) -> tuple[list[T], torch.Tensor]:
        """Each phase's updates; what a phase raises is kept for the verdict, not raised.
        Before a later phase, whose holders run collectives together, they agree on the
        host (a group of at most a node's ranks) whether one of them failed: then none of
        them computes it, so none waits for a peer that will not come."""
        pending: list[T] = []
        self._failed, self._error = set(), None
        for index, phase in enumerate(phases):
            if index > 0 and self._phase_group is not None:
                self._failed |= self._phase_failures()
            if self._failed:
                break
            try:
                pending += [compute(group) for group in phase]
            except Exception as error:  # noqa: BLE001 - settled with every rank below
                self._error = error
                self._failed.add(dist.get_rank())
                logger.error(
                    "dmuon: Muon.step failed on this rank (%s: %s); the step changes nothing "
                    "on any rank, and every rank raises MuonStepError at its next step()",
                    type(error).__name__,
                    error,
                )
        with record_function("dmuon::step_verdict"):
            flags = failure_flags(self._failed, self.device)
            for group in self._verdict_groups:
                kind, op = "step_verdict", dist.ReduceOp.MAX
                comm.all_reduce(flags, group, self.dedication.stats, kind, op).wait()
        self._flags = flags
        skip = flags[0] > 0
        return pending, skip if found_inf is None else skip | (found_inf != 0)

    def _phase_failures(self) -> set[int]:
        """The global ranks of this rank's next-phase group that failed so far: one MAX
        all-reduce of a flag per member, in host memory."""
        group = self._phase_group
        members = dist.get_process_group_ranks(group)
        flags = torch.zeros(len(members), dtype=torch.int32)
        flags[dist.get_rank(group)] = int(dist.get_rank() in self._failed)
        stats, op = self.dedication.stats, dist.ReduceOp.MAX
        comm.all_reduce(flags, group, stats, "phase_agreement", op).wait()
        return {members[i] for i in flags.numpy().nonzero()[0]}  # numpy(): host memory only

    def reduce_max(self, maxima: torch.Tensor) -> Callable[[], torch.Tensor]:
        """The MAX over the first data-parallel group starts now; under HSDP the
        replicate group's follows it when waited."""
        groups = self.dedication.exchange.data_parallel_groups()
        stats, kind, op = self.dedication.stats, "qk_clip_all_reduce", dist.ReduceOp.MAX
        work = comm.all_reduce(maxima, groups[0], stats, kind, op)

        def wait() -> torch.Tensor:
            work.wait()
            for group in groups[1:]:
                comm.all_reduce(maxima, group, stats, kind, op).wait()
            return maxima

        return wait

    def clip_qk(
        self, qk_clip: QKClip, maxima: torch.Tensor, skip: torch.Tensor | None = None
    ) -> None:
        """Each rank rescales the masters it owns; under tensor parallelism the step's
        metrics then cover every TP rank's heads."""
        names = set(qk_clip.weight_names)
        owned = self.dedication.primary_params()
        owned = {entry.name: m for entry, m in owned if entry.name in names}
        qk_clip.clip(maxima, owned, skip)
        tp_group = self.dedication.exchange.tp_group
        if tp_group is not None:
            stats = self.dedication.stats
            qk_clip.clipped_heads = qk_clip.clipped_heads.float()
            comm.all_reduce(qk_clip.clipped_heads, tp_group, stats, "qk_clip_metrics").wait()
            comm.all_reduce(
                qk_clip.max_logit, tp_group, stats, "qk_clip_metrics", op=dist.ReduceOp.MAX
            ).wait()

    def end_step(self) -> None:
        """The primaries copy their updated masters into the compute-dtype values; under
        HSDP the new values go to the other replicas (asynchronously with
        ``replicate_async``); the step's verdict starts its way to the host."""
        dedication = self.dedication
        synced = dedication.synced_backwards
        with record_function("dmuon::after_step"):
            for unit in dedication.units:
                unit.masters_to_flat()
            replicas = dedication.exchange.replicas
            if replicas is not None:
                replicas.broadcast(dedication.units, async_op=dedication.settings.replicate_async)
        dedication.driver.free_all()  # whatever a rank outside the owner column holds is stale
        dedication.synced_backwards = 0
        flags, ready = self._flags, None
        if flags.device.type != "cpu":  # copied to the host behind the step's own work
            host = torch.empty(flags.shape, dtype=flags.dtype, pin_memory=True)
            flags = host.copy_(flags, non_blocking=True)
            ready = torch.get_device_module(self.device).Event()
            ready.record()
        self._verdict = StepVerdict(flags, ready, self._error, synced)
        self._flags, self._error = None, None

    def zero_grad(self) -> None:
        self.dedication.zero_grad()
