"""Parameters holding several matrices fused along their rows (TorchTitan 0.3's fused QKV):
each matrix steps as ``torch.optim.Muon`` steps it as a parameter of its own."""

from __future__ import annotations

import pytest
import torch

from tests.support.fused import (
    DIM,
    LAYOUT,
    MUON_KW,
    Fused,
    Unfused,
    data,
    fuse,
    reference,
    reference_step,
)
from tests.support.workers import ADAMW_KW, as_muon_adamw_kwargs
from torchtitan_dmuon import Muon
from torchtitan_dmuon.optim.fused_rows import FusedRows, fused_rows_of, mark_fused_rows


def test_layout_views_are_the_matrices_fused():
    q, k, v = (torch.randn(rows, DIM) for rows in (48, 16, 16))
    fused = fuse(q, k, v)
    for got, want in zip(LAYOUT.matrices(fused), (q, k, v), strict=True):
        assert torch.equal(got, want)
    assert LAYOUT.shapes(DIM) == [(48, DIM), (16, DIM), (16, DIM)]
    for block in LAYOUT.blocks(fused):  # views: writes reach the fused tensor
        block.zero_()
    assert not fused.any()
    with pytest.raises(ValueError, match="80 rows"):
        LAYOUT.blocks(torch.zeros(81, DIM))
    with pytest.raises(ValueError, match="positive"):
        FusedRows(groups=2, parts=(), part_rows=8)


@pytest.mark.parametrize("marked", [True, False])
def test_fused_matrices_step_as_torch_muon_of_each_one(marked):
    """Marked, the fused parameter trains bit-equal to torch.optim.Muon (+ AdamW) of the
    unfused model; unmarked (Newton-Schulz of the fused matrix as one), it does not."""
    torch.manual_seed(0)
    model = Fused()
    unfused = Unfused(model)
    if marked:
        mark_fused_rows(model, "blocks.0.qkv.weight", LAYOUT)
    ours = Muon(
        model,
        **MUON_KW,
        **as_muon_adamw_kwargs(ADAMW_KW),
        ns_dtype=torch.bfloat16,  # torch.optim.Muon's
        predicate=lambda name, p: p.ndim == 2,
    )
    references = reference(unfused)
    for step in range(3):
        x, y = data(step)
        ours.zero_grad()
        ((model(x) - y) ** 2).sum().backward()
        ours.step()
        reference_step(unfused, references, x, y)
    same = torch.equal(model.blocks[0]["qkv"].weight, fuse(unfused.q, unfused.k, unfused.v))
    assert same is marked
    assert torch.equal(model.blocks[0]["out"].weight, unfused.out) is marked
    assert torch.equal(model.scale, unfused.scale) is marked


def test_marks_are_checked_and_survive_to_empty():
    model = Fused()
    with pytest.raises(ValueError, match="80 rows"):
        mark_fused_rows(model, "blocks.0.out.weight", LAYOUT)
    mark_fused_rows(model, "blocks.0.qkv.weight", LAYOUT)
    model.to_empty(device="cpu")
    assert fused_rows_of(model, "blocks.0.qkv.weight") == LAYOUT
    assert fused_rows_of(model, "blocks.0.out.weight") is None
    assert fused_rows_of(model, "nothing.weight") is None


def test_normuon_refuses_fused_matrices():
    model = Fused()
    mark_fused_rows(model, "blocks.0.qkv.weight", LAYOUT)
    with pytest.raises(ValueError, match="variant='normuon'.*blocks.0.qkv.weight"):
        Muon(model, variant="normuon", predicate=lambda name, p: p.ndim == 2)
