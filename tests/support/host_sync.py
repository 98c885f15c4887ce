"""Counting host syncs: the points where the CPU would wait for the device.

A training step that never reads a device value lets the CPU queue the next kernels and
collectives while the device works. :class:`HostSyncCounter` counts what breaks that, by
the public API alone (it wraps nothing of the package): ``aten._local_scalar_dense``
(``.item()``, ``bool(t)``, ``int(t)``, ``float(t)``), ``Tensor.tolist()`` and copies of
a non-CPU tensor to the CPU (``.cpu()``, ``.to("cpu")``). On a CPU-only run every
tensor is on the host, so a count there is what the same code would sync on a GPU.
Reading host memory a step copied out asynchronously (``.numpy()`` of a CPU tensor) is
no sync and is not counted.
"""

from __future__ import annotations

import traceback
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["HostSyncCounter"]

_COPIES = (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default)


class HostSyncCounter(TorchDispatchMode):
    """Counts host syncs while active (a context manager, on this thread).

    Attributes:
        counts: Syncs by kind (``"item"`` for ``_local_scalar_dense``, ``"tolist"``,
            ``"to_cpu"``).
        where: For each sync, the innermost stack frames outside torch that caused it
            (``"file:line function"``), to say which code to fix.
    """

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter = Counter()
        self.where: list[str] = []
        self._tolist = None

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def _record(self, kind: str) -> None:
        self.counts[kind] += 1
        frames = [
            f"{f.filename}:{f.lineno} {f.name}"
            for f in traceback.extract_stack()[:-2]
            if "/torch/" not in f.filename and not f.filename.endswith(__file__)
        ]
        self.where.append(f"{kind} at {frames[-1] if frames else '?'}")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default:
            self._record("item")
        elif func in _COPIES and _device_to_host(func, args, kwargs):
            self._record("to_cpu")
        return func(*args, **kwargs)

    def __enter__(self) -> HostSyncCounter:
        # Tensor.tolist reads the storage directly, past the dispatcher.
        self._tolist = original = torch.Tensor.tolist

        def tolist(tensor, *args, **kwargs):
            self._record("tolist")
            return original(tensor, *args, **kwargs)

        torch.Tensor.tolist = tolist
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        torch.Tensor.tolist = self._tolist
        super().__exit__(*exc)


def _device_to_host(func, args, kwargs) -> bool:
    """Whether a copy op moves a device tensor into host memory."""
    if func is torch.ops.aten._to_copy.default:
        source, target = args[0], kwargs.get("device")
        return (
            target is not None
            and torch.device(target).type == "cpu"
            and (source.device.type != "cpu")
        )
    destination, source = args[0], args[1]
    # A non-blocking copy into (pinned) host memory is queued, not waited for.
    non_blocking = kwargs.get("non_blocking", args[2] if len(args) > 2 else False)
    return destination.device.type == "cpu" and source.device.type != "cpu" and not non_blocking
