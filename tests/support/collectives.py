"""Counting every ``torch.distributed`` collective a rank issues, whoever issues it."""

from __future__ import annotations

from collections import Counter

import torch.distributed as dist

__all__ = ["CollectiveCounter"]


class CollectiveCounter:
    """Counts the payload bytes every ``torch.distributed`` collective gets on this rank,
    by kind, while active (a context manager).

    It wraps the ``torch.distributed`` functions themselves, so it sees FSDP2's, the
    engine's and anyone else's collectives alike, independently of :class:`CommStats`.
    The payload of a gather is its output and of a scatter its input (what crosses the
    network per rank, up to the algorithm's constant).
    """

    _PAYLOAD = {
        "broadcast": ("tensor", 0),
        "reduce": ("tensor", 0),
        "all_reduce": ("tensor", 0),
        "all_gather_single": ("output", 0),
        "all_gather_into_tensor": ("output_tensor", 0),
        "reduce_scatter_single": ("input", 1),
        "reduce_scatter_tensor": ("input", 1),
        "all_to_all_single": ("output", 0),
    }

    # DTensor redistributions (e.g. ``full_tensor()``) go through the functional
    # collectives; a gather's payload is then its result.
    _FUNCTIONAL = {
        "all_gather_single": "result",
        "reduce_scatter_single": "input",
        "all_reduce": "input",
    }

    def __init__(self) -> None:
        self.bytes = Counter()
        self.calls = Counter()
        # Bytes of the torch.distributed (not functional) collectives by (kind, size of
        # the group they ran on).
        self.group_bytes: Counter = Counter()
        # The torch.distributed collectives in issue order: (kind, group description).
        self.order: list[tuple[str, str]] = []
        self._originals: list[tuple[object, str, object]] = []

    def _wrap(self, module, kind: str, payload) -> None:
        original = getattr(module, kind, None)
        if original is None:  # not in this torch (``*_single``: new in 2.13)
            return
        self._originals.append((module, kind, original))

        def counted(*args, **kwargs):
            result = original(*args, **kwargs)
            tensor = payload(args, kwargs, result)
            size = tensor.numel() * tensor.element_size()
            self.bytes[kind] += size
            self.calls[kind] += 1
            if module is dist:
                group = kwargs.get("group")
                self.group_bytes[kind, dist.get_world_size(group)] += size
                self.order.append((kind, group.group_desc if group is not None else "default"))
            return result

        setattr(module, kind, counted)

    def __enter__(self) -> CollectiveCounter:
        from torch.distributed import _functional_collectives as funcol

        for kind, (keyword, position) in self._PAYLOAD.items():
            self._wrap(
                dist, kind, lambda a, kw, r, k=keyword, i=position: kw[k] if k in kw else a[i]
            )
        for kind, which in self._FUNCTIONAL.items():
            self._wrap(funcol, kind, lambda a, kw, r, w=which: r if w == "result" else a[0])
        return self

    def __exit__(self, *exc) -> None:
        for module, kind, original in reversed(self._originals):
            setattr(module, kind, original)
        self._originals.clear()

    def snapshot(self) -> dict[str, dict[str, int]]:
        return {"bytes": dict(self.bytes), "calls": dict(self.calls)}
