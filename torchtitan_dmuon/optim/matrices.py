"""Which matrices ``Muon`` steps, and where: the protocol between the optimizer and its
two implementations.

``Muon`` is one ``torch.optim.Optimizer`` over a :class:`MatrixSet`: :class:`LocalMatrices`
(one process: every selected matrix, stepped in place; here) or the engine's
``OwnedMatrices`` (distributed: only the matrices this rank owns, a failure on any rank
skipping the step on every rank; :mod:`torchtitan_dmuon.engine.owned`). Everything that
differs between a one-process and a distributed step is a method of the protocol; the math
is the same
(:func:`~torchtitan_dmuon.optim.muon.compute_group`,
:func:`~torchtitan_dmuon.optim.muon.commit_group`).

This module does not import ``torch.distributed``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol, TypeVar

import torch
from torch import nn

from torchtitan_dmuon.optim.config import MuonConfig
from torchtitan_dmuon.optim.fused_rows import FusedRows
from torchtitan_dmuon.optim.muon import MatrixGroup
from torchtitan_dmuon.optim.newton_schulz import matrix_count
from torchtitan_dmuon.optim.ns_choice import Gather, NSChoice
from torchtitan_dmuon.optim.qk_clip import QKClip

__all__ = ["LocalMatrices", "MatrixSet", "MuonStepError", "local_view"]

T = TypeVar("T")


class MuonStepError(RuntimeError):
    """A ``Muon.step`` failed on some rank of the matrix set; it changed nothing on any
    rank. Raised by every rank at its next ``step()`` (:meth:`MatrixSet.begin_step`)."""


def local_view(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard, a plain tensor itself. Duck-typed on ``to_local``: this
    module does not import ``torch.distributed``."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


class MatrixSet(Protocol):
    """The Muon matrices of one model as one rank steps them.

    Attributes:
        params: Every Muon matrix of the model (``Muon.param_groups[0]``).
        names: Their names.
        fused: Per parameter, the matrices it holds fused along its rows
            (:class:`~torchtitan_dmuon.optim.fused_rows.FusedRows`), or None.
        device: Where their Newton-Schulz runs.
        gather: The all-ranks gather the Newton-Schulz choice agrees through; None in
            one process.
    """

    params: list[nn.Parameter]
    names: list[str]
    fused: list[FusedRows | None]
    device: torch.device
    gather: Gather | None

    def prepare(self) -> None:
        """Once the optimizer's own checks passed: ready the matrices for stepping (the
        engine verifies its plan across ranks, a collective: the optimizer's first)."""
        ...

    def local_rows(self) -> dict[str, int]:
        """Rows of each matrix on this rank (a tensor-parallel shard's), by name."""
        ...

    def row_blocked(self) -> set[str]:
        """The matrices whose owners each hold a block of their rows (an owner group's
        blocks along the rows), by name."""
        ...

    def ns_workload(self, backend: str, dtype: torch.dtype, steps: int) -> dict:
        """Per ``(rows, cols)``, the matrices of each parameter (1, or a stack's count)
        that ``backend`` orthogonalizes here each step, in the order the step batches them."""
        ...

    def divide_grads(self, divisor: torch.Tensor | float) -> None:
        """Divide the gradients the step reads that are not a ``param.grad`` (the
        owners' reduced gradients) by ``divisor``."""
        ...

    def begin_step(self) -> None:
        """Before the step reads any gradient (the engine raises here a failure of the
        previous step that its ranks settled on the device)."""
        ...

    def step_phases(self, ns: NSChoice) -> list[list[MatrixGroup]]:
        """What this rank steps, in phases computed one after the other."""
        ...

    def computed(
        self,
        phases: list[list[MatrixGroup]],
        compute: Callable[[MatrixGroup], T],
        found_inf: torch.Tensor | None,
    ) -> tuple[list[T], torch.Tensor | None]:
        """``compute`` of every group of ``phases``, changing nothing, and the step's
        ``skip``: a 0-dim device tensor, nonzero where the step must change nothing
        (``found_inf``, or a failure on some rank), decided on the device; None where
        nothing can skip it. What ``compute`` raised is raised here in one process; on
        several ranks every rank raises it alike at its next ``begin_step``."""
        ...

    def reduce_max(self, maxima: torch.Tensor) -> Callable[[], torch.Tensor]:
        """Start the MAX of ``maxima`` over the data-parallel ranks; the returned call
        waits and returns it."""
        ...

    def clip_qk(
        self, qk_clip: QKClip, maxima: torch.Tensor, skip: torch.Tensor | None = None
    ) -> None:
        """QK-clip's rescaling of the query and key rows this rank writes (none where the
        0-dim ``skip`` is nonzero, decided on the device)."""
        ...

    def end_step(self) -> None:
        """After the parameters changed."""
        ...

    def zero_grad(self) -> None:
        """Drop what a backward left beside ``param.grad``."""
        ...


class LocalMatrices:
    """One process: the selected matrices, stepped in place from ``param.grad``.
    Parameters that are DTensors (tensor parallelism without data parallelism) step
    through DTensor's own operators.

    Args:
        selected: ``(name, parameter)`` of every Muon matrix (the caller's selection).
        config: The optimizer's settings.
        fused: The layouts of the selected parameters that hold several matrices fused
            along their rows, by name.

    Raises:
        ValueError: ``config`` asks for what needs a dedication (``replicate_async``).
    """

    gather = None

    def __init__(
        self,
        selected: list[tuple[str, nn.Parameter]],
        config: MuonConfig,
        fused: Mapping[str, FusedRows] | None = None,
    ) -> None:
        if config.replicate_async:
            raise ValueError(
                "replicate_async=True needs dedicate_params(..., replicate_mesh=...) (HSDP)"
            )
        self.names = [name for name, _ in selected]
        self.params = [p for _, p in selected]
        self.fused = [(fused or {}).get(name) for name in self.names]
        self.device = self.params[0].device if self.params else torch.device("cpu")

    def prepare(self) -> None:
        pass

    def local_rows(self) -> dict[str, int]:
        return {n: local_view(p).shape[0] for n, p in zip(self.names, self.params, strict=True)}

    def row_blocked(self) -> set[str]:
        return set()

    def ns_workload(self, backend: str, dtype: torch.dtype, steps: int) -> dict:
        workload: dict[tuple[int, int], list[int]] = {}
        for p, layout in zip(self.params, self.fused, strict=True):  # as step_phases steps them
            if layout is not None:
                for shape in layout.shapes(p.shape[-1]):
                    workload.setdefault(shape, []).append(1)
                continue
            shape = (p.shape[-2], p.shape[-1])
            workload.setdefault(shape, []).append(matrix_count(p.shape))
        return workload

    def divide_grads(self, divisor: torch.Tensor | float) -> None:
        pass  # every gradient is a param.grad

    def begin_step(self) -> None:
        pass

    def step_phases(self, ns: NSChoice) -> list[list[MatrixGroup]]:
        chosen = [i for i, p in enumerate(self.params) if p.grad is not None]
        stepped = [self.params[i] for i in chosen]
        grads = [p.grad for p in stepped]
        if not stepped:
            return [[]]
        fused = [self.fused[i] for i in chosen]
        group = MatrixGroup(
            stepped,
            stepped,
            grads,
            ns.bind(),
            unbatched=ns.unbatched,
            fused=fused if any(fused) else None,
        )
        return [[group]]

    def computed(
        self,
        phases: list[list[MatrixGroup]],
        compute: Callable[[MatrixGroup], T],
        found_inf: torch.Tensor | None,
    ) -> tuple[list[T], torch.Tensor | None]:
        return [compute(group) for phase in phases for group in phase], found_inf

    def reduce_max(self, maxima: torch.Tensor) -> Callable[[], torch.Tensor]:
        return lambda: maxima

    def clip_qk(
        self, qk_clip: QKClip, maxima: torch.Tensor, skip: torch.Tensor | None = None
    ) -> None:
        names = set(qk_clip.weight_names)
        masters = {
            n: local_view(p) for n, p in zip(self.names, self.params, strict=True) if n in names
        }
        qk_clip.clip(maxima, masters, skip)

    def end_step(self) -> None:
        pass

    def zero_grad(self) -> None:
        pass
