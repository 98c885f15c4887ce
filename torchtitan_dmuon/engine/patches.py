"""Every change the engine makes to code outside it, installed and removed in one place.

One patch today: FSDP2 collects the parameters a ``fully_shard`` (or FSDP-based
``replicate``) call manages in ``_fsdp_init._get_managed_states``, reached through a
module-global lookup. Wrapping it there (rather than the public ``fully_shard`` name) works
however the caller imported ``fully_shard``, and changes nothing else in FSDP2: a dedicated
parameter is simply left out, as if passed in ``ignored_params``.

Which parameters are dedicated is marked on their *modules*, by parameter name. A mark on
the tensor would be lost when ``Module.to_empty`` or a conversion swaps the parameter
object (``torch.utils.swap_tensors``), and a weak reference to it makes that swap fail.

:func:`install` runs on ``import torchtitan_dmuon``; :func:`uninstall` is the opt-out.
"""

from __future__ import annotations

import functools

from torch import nn
from torch.distributed.fsdp._fully_shard import _fsdp_init

__all__ = ["install", "is_installed", "mark_dedicated", "dedicated_names", "unmark_dedicated"]

_MARK = "_dmuon_dedicated_params"


def mark_dedicated(model: nn.Module, names: list[str]) -> None:
    """Mark the parameters ``names`` of ``model`` as owned by the ownership engine (on
    their modules, by name: ``to_empty`` and ``swap_tensors`` keep the mark)."""
    for name in names:
        module_name, _, param_name = name.rpartition(".")
        module = model.get_submodule(module_name)
        module.__dict__.setdefault(_MARK, set()).add(param_name)


def unmark_dedicated(model: nn.Module) -> None:
    """Drop every mark in ``model``."""
    for module in model.modules():
        module.__dict__.pop(_MARK, None)


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


def install() -> None:
    """Route FSDP2's parameter collection through the dedicated-parameter filter."""
    _fsdp_init._get_managed_states = _get_managed_states_skipping_dedicated


def uninstall() -> None:
    """Restore FSDP2's own function (dedicated parameters would then be sharded)."""
    _fsdp_init._get_managed_states = _original


def is_installed() -> bool:
    return _fsdp_init._get_managed_states is _get_managed_states_skipping_dedicated
