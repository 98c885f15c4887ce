"""The one registry through which the TorchTitan layer replaces torch or TorchTitan names.

TorchTitan 0.2.2 offers no hook for what the CPU layer and DMuon's trainer change (a
device module copied at import, ``torch.histc``, ``torch.profiler.profile``, the clipping
function its train step calls, ...), so they are replaced by assignment. Every such
assignment goes through a :class:`PatchRegistry` that ``DMuonTrainer`` opens when it
starts and closes when it ends (also when it fails), which puts back every original: a
process that trains and then goes on (a notebook, a test, an evaluation) sees torch and
TorchTitan as they were.
"""

from __future__ import annotations

import warnings

__all__ = ["PatchRegistry"]


class PatchRegistry:
    """Replacements of attributes (and warning filters), undone together, newest first."""

    MISSING = object()
    """The original of a name that did not exist (an instance attribute shadowing its
    class's): restoring deletes it."""

    def __init__(self) -> None:
        self._undo: list[tuple[object, str, object]] = []
        self._warnings: warnings.catch_warnings | None = None

    def __enter__(self) -> PatchRegistry:
        return self

    def __exit__(self, *exc_info) -> None:
        self.restore()

    def setattr(self, target: object, name: str, value: object) -> None:
        """``setattr(target, name, value)``, remembering what was there."""
        self._undo.append((target, name, getattr(target, name, self.MISSING)))
        setattr(target, name, value)

    def filter_warnings(self, action: str, **kwargs) -> None:
        """``warnings.filterwarnings(action, **kwargs)`` until :meth:`restore`."""
        if self._warnings is None:
            self._warnings = warnings.catch_warnings()
            self._warnings.__enter__()
        warnings.filterwarnings(action, **kwargs)

    def restore(self) -> None:
        """Put every original back (idempotent)."""
        while self._undo:
            target, name, original = self._undo.pop()
            if original is self.MISSING:
                delattr(target, name)
            else:
                setattr(target, name, original)
        if self._warnings is not None:
            self._warnings.__exit__(None, None, None)
            self._warnings = None
