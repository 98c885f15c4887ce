"""What the engine reads from FSDP2's state, and resets in it.

Recovery from a forward or backward that raised half-way needs FSDP2's part reset too; the
engine's own part (waiting for what the failed pass issued, dropping its partial
reduces) is :meth:`HookDriver.reset_iter_state`; :meth:`Dedication.recover` runs both, so
that ``zero_grad()`` after a caught failure is all a training loop needs to call.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard

__all__ = ["mixed_precision_of", "reset_fsdp_state"]


def reset_fsdp_state(model: nn.Module) -> None:
    """``FSDPModule.reset_iter_state`` on each top-most FSDP module of ``model`` (FSDP2
    accepts it on roots only), and the unsharded gradients it keeps dropped."""
    for name, module in model.named_modules():
        if isinstance(module, FSDPModule) and not any(
            isinstance(model.get_submodule(ancestor), FSDPModule) for ancestor in _ancestors(name)
        ):
            module.reset_iter_state()
            _drop_unsharded_grads(module)


def _drop_unsharded_grads(root: FSDPModule) -> None:
    """FSDP2's ``reset_iter_state`` (torch 2.13) keeps the unsharded gradients that
    parameter groups whose reduce-scatter never ran had accumulated (the root's norm and
    output head, when backward fails in a block); the next backward would add to them."""
    for module in root.modules():
        if not isinstance(module, FSDPModule):
            continue
        for group in fully_shard.state(module)._fsdp_param_groups:
            for fsdp_param in group.fsdp_params:
                unsharded = getattr(fsdp_param, "_unsharded_param", None)
                if unsharded is not None:
                    unsharded.grad = None


def _ancestors(name: str) -> list[str]:
    parts = name.split(".") if name else []
    return [".".join(parts[:depth]) for depth in range(len(parts))]


def mixed_precision_of(model: nn.Module, boundary_name: str) -> tuple:
    """``(param_dtype, reduce_dtype)`` of the innermost ``fully_shard`` call that covers
    the boundary (the boundary itself or an ancestor), or ``(None, None)``."""
    parts = boundary_name.split(".") if boundary_name else []
    for depth in range(len(parts), -1, -1):
        module = model.get_submodule(".".join(parts[:depth]))
        if isinstance(module, FSDPModule):
            policy = fully_shard.state(module)._mp_policy
            return policy.param_dtype, policy.reduce_dtype
    return None, None
