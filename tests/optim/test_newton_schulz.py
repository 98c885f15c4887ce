"""Newton-Schulz torch backend: equality with torch.optim.Muon, preset bands, batching."""

import pytest
import torch
from torch.optim._muon import _zeropower_via_newtonschulz as torch_ns

from torchtitan_dmuon.optim.newton_schulz import (
    NS_PRESETS,
    newton_schulz,
    ns_flops,
    resolve_ns_schedule,
)

QUINTIC = (3.4445, -4.7750, 2.0315)


def _power_law(shape, seed, decay=2.0):
    """A matrix with singular values 1, 2^-decay, 3^-decay, ... (ill-conditioned)."""
    g = torch.Generator().manual_seed(seed)
    m, n = shape
    k = min(m, n)
    u, _ = torch.linalg.qr(torch.randn(m, k, generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(n, k, generator=g, dtype=torch.float64))
    s = torch.arange(1, k + 1, dtype=torch.float64) ** -decay
    return ((u * s) @ v.T).float()


@pytest.mark.parametrize("shape", [(64, 128), (128, 64), (96, 96), (1, 32)])
def test_quintic_bf16_bit_equal_to_torch(shape):
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    ours = newton_schulz(g, resolve_ns_schedule("quintic", 5))
    theirs = torch_ns(g, QUINTIC, 5, 1e-7)
    assert ours.dtype == torch.bfloat16
    assert torch.equal(ours, theirs)


def test_input_is_not_modified():
    g = torch.randn(32, 48, dtype=torch.bfloat16)
    before = g.clone()
    newton_schulz(g, resolve_ns_schedule("quintic", 5))
    assert torch.equal(g, before)


@pytest.mark.parametrize("shape", [(48, 80), (80, 48)])
def test_batched_equals_per_matrix(shape):
    stack = torch.randn(5, *shape, generator=torch.Generator().manual_seed(1))
    schedule = resolve_ns_schedule("polar_express", 5)
    batched = newton_schulz(stack, schedule, dtype=torch.float32)
    single = torch.stack([newton_schulz(x, schedule, dtype=torch.float32) for x in stack])
    assert batched.shape == stack.shape
    torch.testing.assert_close(batched, single, rtol=1e-5, atol=1e-6)


# Bands the presets reach after 5 steps (fp32), with a small margin for input variety.
BANDS = {"quintic": (0.67, 1.21), "polar_express": (0.85, 1.15)}


@pytest.mark.parametrize("preset", sorted(BANDS))
@pytest.mark.parametrize("shape", [(256, 256), (128, 512), (512, 128)])
@pytest.mark.parametrize("kind", ["gaussian", "power_law"])
def test_singular_values_in_preset_band(preset, shape, kind):
    if kind == "gaussian":
        g = torch.randn(*shape, generator=torch.Generator().manual_seed(2))
    else:
        g = _power_law(shape, seed=3, decay=1.0)
    out = newton_schulz(g, resolve_ns_schedule(preset, 5), dtype=torch.float32).double()
    low, high = BANDS[preset]
    assert torch.linalg.svdvals(out).max() <= high
    # Each singular direction of the input is mapped to (nearly) itself, scaled by a value
    # in the band, unless it is too small to be lifted in 5 steps: below 2e-3 of ||G||_F
    # (only square Gaussian matrices have such directions here).
    u, s, vh = torch.linalg.svd(g.double(), full_matrices=False)
    gain = torch.diagonal(u.T @ out @ vh.T)
    liftable = s / s.norm() >= 2e-3
    assert liftable.float().mean() > 0.95
    assert gain[liftable].min() >= low and gain[liftable].max() <= high, (gain.min(), gain.max())


def test_batched_singular_values_in_band():
    stack = torch.randn(4, 64, 192, generator=torch.Generator().manual_seed(4))
    out = newton_schulz(stack, resolve_ns_schedule("polar_express", 5), dtype=torch.float32)
    sv = torch.linalg.svdvals(out.double())
    assert sv.min() >= 0.85 and sv.max() <= 1.15


def test_polar_express_beats_quintic_on_gaussian():
    g = torch.randn(512, 1024, generator=torch.Generator().manual_seed(5))
    spread = {}
    for preset in BANDS:
        sv = torch.linalg.svdvals(
            newton_schulz(g, resolve_ns_schedule(preset, 5), dtype=torch.float32)
        )
        spread[preset] = (sv.max() - sv.min()).item()
    assert spread["polar_express"] < spread["quintic"]


def test_schedule_resolution():
    s = resolve_ns_schedule("polar_express", 7)
    pe = NS_PRESETS["polar_express"][0]
    assert s.steps == 7 and s.norm_scale == 1.02
    assert s.coefficients[:5] == pe and s.coefficients[5] == s.coefficients[6] == pe[-1]
    assert resolve_ns_schedule("polar_express", 2).coefficients == pe[:2]
    assert resolve_ns_schedule((1.5, -0.5, 0.0), 3).coefficients == ((1.5, -0.5, 0.0),) * 3
    listed = resolve_ns_schedule([(3.0, -3.0, 1.0), (2.0, -1.5, 0.5)], 2)
    assert listed.coefficients == ((3.0, -3.0, 1.0), (2.0, -1.5, 0.5))
    assert resolve_ns_schedule("quintic", 5).norm_scale == 1.0


def test_user_triple_matches_preset_values():
    g = torch.randn(40, 60, generator=torch.Generator().manual_seed(6))
    by_name = newton_schulz(g, resolve_ns_schedule("quintic", 5))
    by_value = newton_schulz(g, resolve_ns_schedule(QUINTIC, 5))
    assert torch.equal(by_name, by_value)


@pytest.mark.parametrize(
    "coefficients, steps, match",
    [
        ("cubic", 5, "unknown preset 'cubic'"),
        ((1.0, 2.0), 5, "3 values"),
        ([(1.0, 2.0, 3.0), (1.0,)], 5, "step 1"),
        ([], 5, "preset name"),
        ("quintic", 0, "ns_steps"),
        ("quintic", 2.5, "ns_steps"),
    ],
)
def test_bad_schedule_raises(coefficients, steps, match):
    with pytest.raises(ValueError, match=match):
        resolve_ns_schedule(coefficients, steps)


def test_rejects_non_matrix():
    with pytest.raises(ValueError, match="2-D matrix or a 3-D batch"):
        newton_schulz(torch.randn(8), resolve_ns_schedule("quintic", 5))


def test_ns_flops():
    assert ns_flops((4, 8), 5) == 5 * (4 * 16 * 8 + 2 * 64)
    assert ns_flops((8, 4), 5) == ns_flops((4, 8), 5)
    assert ns_flops((3, 4, 8), 1) == 3 * ns_flops((4, 8), 1)
