"""Parameters that hold several Muon matrices fused along their rows.

TorchTitan 0.3's fused QKV projection keeps ``wq``, ``wk`` and ``wv`` as one weight whose
rows are grouped per key-value head: viewed as ``(n_kv_heads, heads_per_kv + 2, head_dim,
dim)``, the query matrix is the first ``heads_per_kv`` parts of every group, the key and
the value the next one each. Muon of the fused weight as one matrix is not Muon of the
three: Newton-Schulz must run on each of them, with each one's learning-rate adjustment.
:class:`FusedRows` describes such a layout; :func:`mark_fused_rows` records it on the
module that holds the parameter (by name, so it survives ``to_empty`` and parameter
swaps), and the optimizer steps the matrices it names, on the same elements, with the
same roundings, as ``torch.optim.Muon`` steps the separate ones.

This module does not import ``torch.distributed``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["FusedRows", "fused_rows_of", "mark_fused_rows"]

_ATTRIBUTE = "_muon_fused_rows"


@dataclass(frozen=True)
class FusedRows:
    """A ``(groups * sum(parts) * part_rows, cols)`` matrix whose rows are ``len(parts)``
    matrices: viewed as ``(groups, sum(parts), part_rows, cols)``, matrix ``j`` is the
    ``parts[j]`` consecutive parts of every group, ``(groups * parts[j] * part_rows, cols)``
    in group order.

    Attributes:
        groups: Row groups (fused QKV: the key-value heads).
        parts: Parts of each matrix in a group (fused QKV: ``(heads_per_kv, 1, 1)``).
        part_rows: Rows of one part (fused QKV: the head dim).
    """

    groups: int
    parts: tuple[int, ...]
    part_rows: int

    def __post_init__(self) -> None:
        if self.groups < 1 or self.part_rows < 1 or not self.parts or min(self.parts) < 1:
            raise ValueError(f"FusedRows needs positive sizes, got {self}")

    @property
    def rows(self) -> int:
        return self.groups * sum(self.parts) * self.part_rows

    def shapes(self, cols: int) -> list[tuple[int, int]]:
        """The ``(rows, cols)`` of each matrix."""
        return [(self.groups * n * self.part_rows, cols) for n in self.parts]

    def blocks(self, matrix: torch.Tensor) -> list[torch.Tensor]:
        """Views of each matrix's elements in ``matrix`` (4-D, strided: writes go through)."""
        if matrix.ndim != 2 or matrix.shape[0] != self.rows:
            raise ValueError(
                f"a matrix of {self.rows} rows is fused as {self}, got shape {tuple(matrix.shape)}"
            )
        grouped = matrix.view(self.groups, sum(self.parts), self.part_rows, matrix.shape[1])
        views, start = [], 0
        for count in self.parts:
            views.append(grouped[:, start : start + count])
            start += count
        return views

    def matrices(self, matrix: torch.Tensor) -> list[torch.Tensor]:
        """Each matrix, 2-D (a copy where its rows are not contiguous in ``matrix``)."""
        return [block.reshape(-1, matrix.shape[1]) for block in self.blocks(matrix)]


def mark_fused_rows(model: nn.Module, name: str, layout: FusedRows) -> None:
    """Record that parameter ``name`` of ``model`` holds the matrices ``layout`` names.

    Raises:
        ValueError: ``model`` has no 2-D parameter ``name`` with ``layout``'s rows.
    """
    module_name, _, param_name = name.rpartition(".")
    module = model.get_submodule(module_name)
    param = getattr(module, param_name, None)
    if not isinstance(param, torch.Tensor) or param.ndim != 2 or param.shape[0] != layout.rows:
        shape = tuple(param.shape) if isinstance(param, torch.Tensor) else None
        raise ValueError(
            f"{name}: fused rows {layout} need a 2-D parameter of {layout.rows} rows, got {shape}"
        )
    marks = dict(getattr(module, _ATTRIBUTE, {}))
    marks[param_name] = layout
    setattr(module, _ATTRIBUTE, marks)


def fused_rows_of(model: nn.Module, name: str) -> FusedRows | None:
    """The layout :func:`mark_fused_rows` recorded for parameter ``name`` of ``model``
    (wrapper prefixes such as activation checkpointing's are part of ``name``), or None."""
    module_name, _, param_name = name.rpartition(".")
    try:
        module = model.get_submodule(module_name)
    except AttributeError:
        return None
    return getattr(module, _ATTRIBUTE, {}).get(param_name)
