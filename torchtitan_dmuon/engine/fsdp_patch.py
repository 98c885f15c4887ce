"""Make ``fully_shard`` (and torch's FSDP-based ``replicate``) skip dedicated parameters.

FSDP2 collects the parameters a call manages in one function,
``_fsdp_init._get_managed_states``; both ``fully_shard`` and ``replicate`` reach it through
a module-global lookup. Wrapping it there (rather than the public ``fully_shard`` name)
works however the caller imported ``fully_shard``, and changes nothing else in FSDP2: a
dedicated parameter is simply left out, as if passed in ``ignored_params``.

:func:`install` runs on ``import torchtitan_dmuon``; :func:`uninstall` is the opt-out.
"""

from __future__ import annotations

import functools
import weakref

from torch import nn
from torch.distributed.fsdp._fully_shard import _fsdp_init

__all__ = ["mark_dedicated", "is_dedicated", "install", "uninstall", "is_installed"]

# Keyed by id: tensors compare elementwise, so a WeakSet of parameters cannot be used.
_DEDICATED: dict[int, weakref.ref] = {}


def mark_dedicated(param: nn.Parameter) -> None:
    """Register ``param`` as owned by the ownership engine; FSDP2 will leave it alone."""
    key = id(param)
    _DEDICATED[key] = weakref.ref(param, lambda _, key=key: _DEDICATED.pop(key, None))


def is_dedicated(param: nn.Parameter) -> bool:
    ref = _DEDICATED.get(id(param))
    return ref is not None and ref() is param


_original = _fsdp_init._get_managed_states


@functools.wraps(_original)
def _get_managed_states_skipping_dedicated(modules, ignored_params=None):
    skipped = {p for m in modules for p in m.parameters(recurse=False) if is_dedicated(p)}
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
