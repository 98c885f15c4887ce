"""DDP-style synchronization of the parameters that no FSDP module covers.

With no ``fully_shard`` at all (DDP-style) or a partial one, some trainable parameters
that are not dedicated are plain tensors that nothing else keeps in sync. The engine starts
them from the first data-parallel rank's values (as DDP does) and all-reduces their
gradients at the end of each reduced backward, in one bucket, over the data-parallel groups
(the shard group, then the replicate group under HSDP): never over ranks of other pipeline
stages.
"""

from __future__ import annotations

import functools
import logging
import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from torchtitan_dmuon.engine import comm
from torchtitan_dmuon.engine.param_layout import like_param, local_grad, local_tensor
from torchtitan_dmuon.engine.settings import DedicationSettings

__all__ = ["OtherParams"]

logger = logging.getLogger(__name__)


def _fsdp_covered_modules(model: nn.Module) -> set[nn.Module]:
    """Modules whose own parameters some ``fully_shard`` manages: an FSDP module and its
    descendants. Decided by structure, not by parameter type: inside a forward FSDP2
    swaps its parameters for plain unsharded tensors."""
    covered: set[nn.Module] = set()
    for module in model.modules():
        if isinstance(module, FSDPModule):
            covered.update(module.modules())
    return covered


class OtherParams:
    """The non-dedicated trainable parameters left to the engine.

    Attributes:
        params: Trainable, not dedicated, not FSDP-managed (plain tensors); empty when
            there is one data-parallel rank.
    """

    def __init__(
        self, model: nn.Module, dedicated_names: set[str], groups: list[dist.ProcessGroup]
    ) -> None:
        self._groups = groups
        self._ranks = math.prod(dist.get_world_size(g) for g in groups)
        covered = _fsdp_covered_modules(model)
        named = [
            (name, p)
            for name, p in model.named_parameters()
            if p.requires_grad
            and name not in dedicated_names
            and model.get_submodule(name.rpartition(".")[0]) not in covered
        ]
        if self._ranks == 1:
            named = []
        self.params: list[nn.Parameter] = [p for _, p in named]
        self._fsdp_anywhere = bool(covered)
        if named and self._fsdp_anywhere:
            logger.info(
                "dedicate_params: %d parameters outside every fully_shard are kept in sync "
                "DDP-style by the engine: %s",
                len(named),
                [name for name, _ in named],
            )

    @torch.no_grad()
    def broadcast_from_rank0(self, model: nn.Module) -> None:
        """Start every replica from the values of the first data-parallel rank, as DDP
        does (with no FSDP at all, the buffers too): from shard rank 0 inside each shard
        group, then from replicate rank 0 across replicas."""
        if not self.params:
            return
        tensors = [local_tensor(p.detach()) for p in self.params]
        if not self._fsdp_anywhere:
            tensors += [b.data for b in model.buffers()]
        for group in self._groups:
            for tensor in tensors:
                dist.broadcast(tensor, group=group, group_src=0)

    @torch.no_grad()
    def sync_grads(self, settings: DedicationSettings, stats: comm.CommStats) -> None:
        """Average (or sum, per ``settings``) their gradients over all ranks, in one bucket.

        The bucket has a place and a has-gradient flag for every parameter, so a rank that
        skipped a module sends the same bucket as the others: a gradient no rank computed
        stays ``None``, one that some ranks computed counts the others as zeros (as DDP
        with ``find_unused_parameters``).
        """
        if not self.params:
            return
        dtype = functools.reduce(torch.promote_types, (p.dtype for p in self.params))
        bucket = comm.flagged_grad_bucket(
            [local_grad(p) for p in self.params],
            [local_tensor(p).numel() for p in self.params],
            dtype,
            self.params[0].device,
        )
        numel = bucket.numel() - len(self.params)
        for group in self._groups:
            comm.all_reduce_sum(bucket, group, stats).wait()
        bucket[:numel].div_(settings.divide_factor(self._ranks))
        offset = 0
        for p, has_grad in zip(self.params, bucket[numel:].tolist(), strict=True):
            numel = local_tensor(p).numel()
            mean = bucket[offset : offset + numel]
            offset += numel
            if not has_grad:
                continue
            if isinstance(p, DTensor):  # tensor parallelism: laid out as the parameter
                p.grad = like_param(mean.to(p.dtype, copy=True).view(local_tensor(p).shape), p)
            elif p.grad is None:
                p.grad = mean.to(p.dtype, copy=True)
            else:
                p.grad.copy_(mean.view_as(p.grad))
