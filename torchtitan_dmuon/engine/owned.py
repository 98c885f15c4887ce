"""``OwnedMatrices``: the engine's implementation of ``Muon``'s
:class:`~torchtitan_dmuon.optim.matrices.MatrixSet`.

A rank steps only the matrices it is the primary owner of (the only ones whose reduced
gradient it holds), into their masters; the new values reach the other ranks by the
dedication's broadcasts. Everything a step decides is decided by every rank of the
dedication alike: the Newton-Schulz choice through :func:`gather_over`, a failed first
phase through :func:`failed_ranks` (every rank raises :class:`MuonStepError` before any
writes), QK-clip's maxima by MAX all-reduces over the data-parallel groups.
"""

from __future__ import annotations

from collections.abc import Callable
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
from torchtitan_dmuon.optim.muon import MatrixGroup, NSFunction
from torchtitan_dmuon.optim.ns_choice import NSChoice
from torchtitan_dmuon.optim.qk_clip import QKClip

__all__ = ["MuonStepError", "OwnedMatrices", "failed_ranks", "gather_over"]

T = TypeVar("T")


class MuonStepError(RuntimeError):
    """``Muon.step`` failed on some rank of the dedication; no rank changed any state."""


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


def failed_ranks(dedication: Dedication, failed: bool, device: torch.device) -> list[int]:
    """The global ranks of ``dedication`` on which something ``failed``, known to all of
    them: one MAX all-reduce of a flag per rank over each of its agreement groups
    (:meth:`~Dedication.agreement_groups`: its reduce, replicate and tensor-parallel
    ranks). The flags are in host memory, read without waiting for the device (``device``
    only under a dry run's fake backend). A collective: every rank of the dedication
    calls it."""
    groups = dedication.agreement_groups()
    on_host = all(comm.host_device(group) is not None for group in groups)
    flags = torch.zeros(
        dist.get_world_size(), dtype=torch.int32, device="cpu" if on_host else device
    )
    flags[dist.get_rank()] = int(failed)
    for group in groups:
        comm.all_reduce(flags, group, dedication.stats, "step_agreement", dist.ReduceOp.MAX).wait()
    if on_host:  # numpy() reads host memory only: it refuses a device tensor
        return flags.numpy().nonzero()[0].tolist()
    return flags.nonzero().flatten().tolist()


class OwnedMatrices:
    """The dedicated matrices of one model, as this rank steps them.

    Args:
        dedication: What :func:`~torchtitan_dmuon.dedicate_params` attached to the model.
        config: The optimizer's settings (``replicate_async`` switches the dedication's on).

    Raises:
        ValueError: ``replicate_async`` without a replicate mesh.
    """

    def __init__(self, dedication: Dedication, config: MuonConfig) -> None:
        if config.replicate_async and dedication.exchange.replicas is None:
            raise ValueError(
                "replicate_async=True needs dedicate_params(..., replicate_mesh=...) (HSDP)"
            )
        self.dedication = dedication
        dedication.bind_params()
        self.params: list[nn.Parameter] = list(dedication.params)
        self.names = [d.name for d in dedication.plan.params]
        self.device = mesh_device(dedication.mesh)
        self._replicate_async = config.replicate_async

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
        return self.dedication.ns_workload(backend, dtype, steps)

    def divide_grads(self, divisor: torch.Tensor | float) -> None:
        self.dedication.divide_owned_grads(divisor)

    def begin_step(self) -> None:
        self.dedication.before_step()

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
        # Two phases on every rank of a TP job, owning shards or not: each is agreed on.
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
            return MatrixGroup(keys, masters, grads, bound, stepped=stepped)
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

    def agreed(self, compute: Callable[[], T]) -> T:
        error, result = None, None
        try:
            result = compute()
        except Exception as e:  # every rank must hear of it before any rank writes
            error = e
        failed = failed_ranks(self.dedication, error is not None, self.device)
        if failed:
            raise MuonStepError(
                f"Muon.step failed on rank(s) {failed} before any state changed; "
                "parameters, momentum and AdamW state are unchanged on every rank"
                + (f": {type(error).__name__}: {error}" if error is not None else "")
            ) from error
        return result

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
        self.dedication.after_step()

    def zero_grad(self) -> None:
        self.dedication.zero_grad()
