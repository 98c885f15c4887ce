"""Gram Newton-Schulz: equal to the standard loop, preset bands, composable pieces, training."""

import copy

import pytest
import torch

from tests.optim.test_newton_schulz import BANDS, _power_law
from tests.support.models import batch, loss_fn, make_model, proj_predicate
from torchtitan_dmuon import Muon
from torchtitan_dmuon.optim.kernels.gram_ns import (
    apply_factor,
    gram,
    gram_factor,
    gram_newton_schulz,
    gram_phases,
)
from torchtitan_dmuon.optim.newton_schulz import newton_schulz, resolve_ns_schedule
from torchtitan_dmuon.optim.ns_backends import get_ns_backend

# Aspect ratios 1, 4 and 8, wide and tall, plus a batch.
SHAPES = [(64, 64), (64, 256), (256, 64), (32, 256), (256, 32), (3, 48, 192), (3, 192, 48)]


def _randn(shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("preset", sorted(BANDS))
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype, atol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
def test_equals_standard_loop(preset, shape, dtype, atol):
    g = _randn(shape)
    schedule = resolve_ns_schedule(preset, 5)
    ours = gram_newton_schulz(g, schedule, dtype=dtype)
    assert ours.shape == g.shape and ours.dtype == dtype
    torch.testing.assert_close(ours, newton_schulz(g, schedule, dtype=dtype), rtol=0, atol=atol)


def test_restart_points_do_not_change_the_math():
    g = _randn((48, 160), seed=1)
    schedule = resolve_ns_schedule([(3.0, -3.2, 1.2), (2.0, -1.5, 0.5)], 6)
    expected = newton_schulz(g, schedule, dtype=torch.float64)
    for restarts in [(), (1,), (2,), (2, 4), (1, 2, 3, 4, 5)]:
        ours = gram_newton_schulz(g, schedule, dtype=torch.float64, restarts=restarts)
        torch.testing.assert_close(ours, expected, rtol=0, atol=1e-10)


def test_gram_phases():
    steps = tuple((float(i), 0.0, 0.0) for i in range(5))
    assert gram_phases(steps) == [steps[:2], steps[2:]]
    assert gram_phases(steps, ()) == [steps]
    assert gram_phases(steps, (4, 2, 0, 9)) == [steps[:2], steps[2:4], steps[4:]]
    with pytest.raises(ValueError, match="at least one"):
        gram_factor(torch.eye(3), ())


# bf16 rounding moves gains by up to about 0.01 past the fp32 bands.
BF16_MARGIN = 0.01


@pytest.mark.parametrize("preset", sorted(BANDS))
@pytest.mark.parametrize("shape", [(256, 256), (128, 512), (512, 128), (64, 512)])
@pytest.mark.parametrize("kind", ["gaussian", "power_law"])
def test_bf16_stays_in_preset_band(preset, shape, kind):
    g = _randn(shape, seed=2) if kind == "gaussian" else _power_law(shape, seed=3, decay=1.0)
    out = gram_newton_schulz(g, resolve_ns_schedule(preset, 5), dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16
    out = out.double()
    low, high = BANDS[preset]
    # Gain of each input singular direction that 5 steps can lift (see test_newton_schulz).
    u, s, vh = torch.linalg.svd(g.double(), full_matrices=False)
    gain = torch.diagonal(u.T @ out @ vh.T)
    liftable = s / s.norm() >= 2e-3
    assert liftable.float().mean() > 0.95
    assert gain[liftable].min() >= low - BF16_MARGIN, gain.min()
    assert gain[liftable].max() <= high + BF16_MARGIN, gain.max()
    # Directions below bf16's resolution of R come out noisy: on square inputs, where such
    # directions exist, the spectral norm reaches about high + 0.1 (1.32 for the quintic).
    slack = BF16_MARGIN if shape[0] != shape[1] else 0.15
    assert torch.linalg.svdvals(out).max() <= high + slack


@pytest.mark.parametrize("restarts", [(), (2,)])
def test_pieces_compose_over_row_shards(restarts):
    """The tensor-parallel recipe of the module docstring, on 4 row shards of a tall matrix."""
    g = _randn((384, 96), seed=4).double()
    schedule = resolve_ns_schedule("polar_express", 5)
    shards = [s.mT for s in g.split([64, 128, 32, 160])]  # short side first: (96, m_i)

    r_full = gram(g.mT)
    torch.testing.assert_close(sum(gram(s) for s in shards), r_full, rtol=1e-12, atol=1e-10)

    # Normalize from the reduced Gram: ||G||_F^2 = trace(R).
    scale = schedule.norm_scale * r_full.diagonal().sum().sqrt()
    shards = [s / scale for s in shards]
    for phase in gram_phases(schedule.coefficients, restarts):
        q = gram_factor(sum(gram(s) for s in shards), phase)  # the all-reduce
        shards = [apply_factor(q, s) for s in shards]

    expected = newton_schulz(g, schedule, dtype=torch.float64)
    torch.testing.assert_close(torch.cat([s.mT for s in shards]), expected, rtol=0, atol=1e-10)
    rows = slice(64, 192)
    torch.testing.assert_close(shards[1].mT, expected[rows], rtol=0, atol=1e-10)


def test_registered_and_input_untouched():
    g = _randn((40, 24), seed=5).bfloat16()
    before = g.clone()
    out = get_ns_backend("gram")(g, resolve_ns_schedule("quintic", 5), dtype=torch.float32)
    assert torch.equal(g, before)
    assert out.shape == g.shape and out.dtype == torch.float32


def test_rejects_non_matrix():
    with pytest.raises(ValueError, match="2-D matrix or a 3-D batch"):
        gram_newton_schulz(torch.randn(8), resolve_ns_schedule("quintic", 5))


def _train(model, opt, steps=6):
    losses = []
    for step in range(steps):
        loss = loss_fn(model, *batch(100 + step))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_muon_trains_like_torch_backend():
    models = {"torch": make_model(), "gram": None}
    models["gram"] = copy.deepcopy(models["torch"])
    losses = {}
    for name, model in models.items():
        opt = Muon(
            model, ns_backend=name, ns_dtype=torch.float32, adamw_lr=3e-3, predicate=proj_predicate
        )
        losses[name] = _train(model, opt)
    torch.testing.assert_close(losses["gram"], losses["torch"], rtol=1e-4, atol=0)
    for (name, p), q in zip(
        models["gram"].named_parameters(), models["torch"].parameters(), strict=True
    ):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6, msg=name)
