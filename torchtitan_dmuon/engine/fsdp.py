"""What the engine reads from and resets in FSDP2's state, and its one patch of FSDP2.

Recovery from a forward or backward that raised half-way needs FSDP2's part reset too; the
engine's own part (waiting for what the failed pass issued, dropping its partial
reduces) is :meth:`HookDriver.reset_iter_state`; :meth:`Dedication.recover` runs both, so
that ``zero_grad()`` after a caught failure is all a training loop needs to call.

One patch, in force only while some model is dedicated: FSDP2 collects the parameters a
``fully_shard`` (or FSDP-based ``replicate``) call manages in
``_fsdp_init._get_managed_states``, reached through a module-global lookup. Wrapping it
there (rather than the public ``fully_shard`` name, or its ``ignored_params``, which the
caller passes: TorchTitan's ``apply_fsdp`` does not) works however the caller imported
``fully_shard``, and changes nothing else in FSDP2: a dedicated parameter is simply left
out, as if passed in ``ignored_params``. The first :func:`mark_dedicated` installs it; it
goes when the last marked model is unmarked (``Dedication.remove``).

Which parameters are dedicated is marked on their *modules*, by parameter name. A mark on
the tensor would be lost when ``Module.to_empty`` or a conversion swaps the parameter
object (``torch.utils.swap_tensors``), and a weak reference to it makes that swap fail.

"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.fsdp._fully_shard import _fsdp_init

__all__ = [
    "REDUCES_IN_PARAM_DTYPE",
    "RESET_CLEARS_GRADS",
    "dedicated_names",
    "innermost_fsdp",
    "mark_dedicated",
    "mixed_precision_of",
    "param_groups",
    "reset_fsdp_state",
    "top_fsdp_modules",
    "unmark_dedicated",
]


_TORCH = torch.torch_version.TorchVersion(torch.__version__)

# FSDP2's rules that changed with torch 2.15 (each followed where the engine encodes it,
# and tested in tests/engine/test_torch_versions.py against the torch that runs it):
REDUCES_IN_PARAM_DTYPE = _TORCH >= "2.15"
"""``MixedPrecisionPolicy(reduce_dtype=None)`` reduces in the parameters' own dtype (their
gradients' accumulation dtype: fp32 for fp32 parameters under ``param_dtype=bf16``); up
to 2.14 it reduced in ``param_dtype``, the dtype gradients are computed in."""

RESET_CLEARS_GRADS = _TORCH >= "2.15"
"""``FSDPModule.reset_iter_state`` drops the sharded and unsharded gradients of the pass
it resets; 2.13 and 2.14 keep the unsharded ones (:func:`reset_fsdp_state` drops them)."""


def top_fsdp_modules(model: nn.Module) -> list[nn.Module]:
    """The ``fully_shard`` modules of ``model`` under no other (FSDP2's roots), in module
    order."""
    return [
        module
        for name, module in model.named_modules()
        if isinstance(module, FSDPModule)
        and not any(isinstance(model.get_submodule(a), FSDPModule) for a in _ancestors(name))
    ]


def param_groups(module: FSDPModule) -> list:
    """The ``FSDPParamGroup``s of one ``fully_shard`` module: a list since torch 2.12,
    one group or None before (torch 2.11)."""
    state = fully_shard.state(module)
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [group] if group is not None else []


def reset_fsdp_state(model: nn.Module) -> None:
    """``FSDPModule.reset_iter_state`` on each top-most FSDP module of ``model`` (FSDP2
    accepts it on roots only), and the unsharded gradients it keeps dropped.

    Raises:
        RuntimeError: This torch's FSDP2 has no ``reset_iter_state`` (before 2.13): its
            per-pass state cannot be reset after a pass that raised half-way.
    """
    for module in top_fsdp_modules(model):
        if not hasattr(module, "reset_iter_state"):
            raise RuntimeError(
                "dmuon: a forward or backward raised half-way, and FSDP2 in torch "
                f"{torch.__version__} has no FSDPModule.reset_iter_state (torch >= 2.13) to "
                "reset its per-pass state: end the job and resume from the last checkpoint, "
                "or use torch >= 2.13 to go on after a failed pass"
            )
        module.reset_iter_state()
        if not RESET_CLEARS_GRADS:
            _drop_unsharded_grads(module)


def _drop_unsharded_grads(root: FSDPModule) -> None:
    """FSDP2's ``reset_iter_state`` (torch 2.13, 2.14) keeps the unsharded gradients that
    parameter groups whose reduce-scatter never ran had accumulated (the root's norm and
    output head, when backward fails in a block); the next backward would add to them."""
    for module in root.modules():
        if not isinstance(module, FSDPModule):
            continue
        for group in param_groups(module):
            for fsdp_param in group.fsdp_params:
                unsharded = getattr(fsdp_param, "_unsharded_param", None)
                if unsharded is not None:
                    unsharded.grad = None


def _ancestors(name: str) -> list[str]:
    parts = name.split(".") if name else []
    return [".".join(parts[:depth]) for depth in range(len(parts))]


def innermost_fsdp(model: nn.Module, module_name: str) -> str | None:
    """The name of the innermost ``fully_shard`` module covering ``module_name`` (itself
    or an ancestor), or None."""
    parts = module_name.split(".") if module_name else []
    for depth in range(len(parts), -1, -1):
        name = ".".join(parts[:depth])
        if isinstance(model.get_submodule(name), FSDPModule):
            return name
    return None


def mixed_precision_of(model: nn.Module, boundary_name: str) -> tuple:
    """``(param_dtype, reduce_dtype)`` of the innermost ``fully_shard`` call that covers
    the boundary (the boundary itself or an ancestor), or ``(None, None)``."""
    name = innermost_fsdp(model, boundary_name)
    if name is None:
        return None, None
    policy = fully_shard.state(model.get_submodule(name))._mp_policy
    return policy.param_dtype, policy.reduce_dtype


# ---- the patch -------------------------------------------------------------------

_MARK = "_dmuon_dedicated_params"


_MARKED: set[int] = set()
"""The ids of the models with marks (a dedication keeps its model alive until removed)."""


def mark_dedicated(model: nn.Module, names: list[str]) -> None:
    """Mark the parameters ``names`` of ``model`` as owned by the ownership engine (on
    their modules, by name: ``to_empty`` and ``swap_tensors`` keep the mark)."""
    for name in names:
        module_name, _, param_name = name.rpartition(".")
        module = model.get_submodule(module_name)
        module.__dict__.setdefault(_MARK, set()).add(param_name)
    _MARKED.add(id(model))
    _fsdp_init._get_managed_states = _get_managed_states_skipping_dedicated


def unmark_dedicated(model: nn.Module) -> None:
    """Drop every mark in ``model``."""
    for module in model.modules():
        module.__dict__.pop(_MARK, None)
    _MARKED.discard(id(model))
    if not _MARKED:  # the last: FSDP2's own function is back
        _fsdp_init._get_managed_states = _original


def dedicated_names(module: nn.Module) -> frozenset[str]:
    """The names of ``module``'s own parameters that are dedicated."""
    return frozenset(module.__dict__.get(_MARK, ()))


_original = _fsdp_init._get_managed_states


@functools.wraps(_original)
def _get_managed_states_skipping_dedicated(modules, ignored_params=None):
    skipped = {
        p
        for m in modules
        for name, p in m.named_parameters(recurse=False)
        if name in dedicated_names(m)
    }
    if skipped:
        ignored_params = set(ignored_params or ()) | skipped
    return _original(modules, ignored_params)
