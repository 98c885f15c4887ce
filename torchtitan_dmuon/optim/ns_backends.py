"""Registry of Newton-Schulz backends, selected by the optimizer's ``ns_backend``.

A backend is a function ``(grad, schedule, *, eps, dtype) -> Tensor`` with the contract of
:func:`torchtitan_dmuon.optim.newton_schulz.newton_schulz`: 2-D or batched 3-D input, output
in ``dtype`` and the input's shape. New backends (kernels) register here.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from torchtitan_dmuon.optim.newton_schulz import NSSchedule, newton_schulz

__all__ = ["NS_BACKENDS", "NSBackend", "get_ns_backend"]

NSBackend = Callable[..., torch.Tensor]

NS_BACKENDS: dict[str, NSBackend] = {"torch": newton_schulz}


def get_ns_backend(name: str) -> NSBackend:
    """Look up a backend by name.

    Raises:
        ValueError: ``name`` is not a registered backend.
    """
    if name not in NS_BACKENDS:
        raise ValueError(f"ns_backend must be one of {sorted(NS_BACKENDS)}, got {name!r}")
    return NS_BACKENDS[name]


def bind_ns(name: str, schedule: NSSchedule, *, eps: float, dtype: torch.dtype):
    """A one-argument orthogonalization: backend ``name`` with schedule, eps and dtype bound."""
    backend = get_ns_backend(name)

    def ns(x: torch.Tensor) -> torch.Tensor:
        return backend(x, schedule, eps=eps, dtype=dtype)

    return ns
