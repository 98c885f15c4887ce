"""What a rank keeps between steps for the dedicated matrices, measured on the live
tensors: the storage bytes of its units' buffers and masters and of the optimizer's
per-matrix state. The test of the engine's one formula (``Plan.held``) reads it."""

from __future__ import annotations

from collections import Counter

import torch

from torchtitan_dmuon.engine.dedication import Dedication
from torchtitan_dmuon.optim.muon import SECOND_MOMENT

__all__ = ["KINDS", "live_held_bytes"]

KINDS = ("params", "masters", "momentum", "normuon")


def live_held_bytes(dedication: Dedication, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes by kind (``params``, ``masters``, ``momentum``, ``normuon``), each storage
    counted once, a freed one (storage resized to 0) as 0."""
    seen: set[int] = set()
    held: Counter = Counter()

    def count(kind: str, tensor: torch.Tensor | None) -> None:
        if tensor is None:
            return
        storage = tensor.untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            held[kind] += storage.nbytes()

    for unit in dedication.units:
        for buffer in unit.buffers:
            count("params", buffer)
        count("masters", unit.master)
    dedicated = {id(d.param) for d in dedication.plan.params}
    for param, state in optimizer.state.items():
        if id(param) in dedicated:
            count("momentum", state.get("momentum_buffer"))
            count("normuon", state.get(SECOND_MOMENT))
    return {kind: held[kind] for kind in KINDS}
