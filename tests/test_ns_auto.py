"""The "auto" Newton-Schulz backend: measured choice per shape, dtype and device."""

import logging

import pytest
import torch

from torchtitan_dmuon.optim import ns_backends
from torchtitan_dmuon.optim.newton_schulz import newton_schulz, resolve_ns_schedule
from torchtitan_dmuon.optim.ns_backends import (
    AUTO_MIN_SIDE_CPU,
    choose_ns_backend,
    get_ns_backend,
)


@pytest.fixture(autouse=True)
def _fresh_choices(monkeypatch):
    monkeypatch.setattr(ns_backends, "_auto_choices", {})


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_auto_keeps_torch_for_small_matrices_and_other_dtypes():
    schedule = resolve_ns_schedule("quintic", 5)
    small = _randn(AUTO_MIN_SIDE_CPU - 1, 4 * AUTO_MIN_SIDE_CPU, seed=1)
    assert choose_ns_backend(small, schedule, dtype=torch.float32) == "torch"
    assert torch.equal(
        get_ns_backend("auto")(small, schedule, dtype=torch.float32),
        newton_schulz(small, schedule, dtype=torch.float32),
    )
    wide = _randn(AUTO_MIN_SIDE_CPU, 4 * AUTO_MIN_SIDE_CPU, seed=2)
    assert choose_ns_backend(wide, schedule, dtype=torch.float64) == "torch"
    assert ns_backends._auto_choices == {}


@pytest.mark.parametrize("shape", [(96, 384), (384, 96), (2, 64, 256)])
def test_auto_on_cpu_measures_once_and_returns_its_pick(shape, caplog):
    """On CPU "auto" times torch against gram, logs and caches the pick, and returns the
    picked backend's result exactly, within the tolerance of torch's."""
    schedule = resolve_ns_schedule("quintic", 5)
    g = _randn(*shape, seed=3)
    with caplog.at_level(logging.INFO, logger=ns_backends.__name__):
        out = get_ns_backend("auto")(g, schedule, dtype=torch.float32)
        again = get_ns_backend("auto")(g, schedule, dtype=torch.float32)
    picks = [r for r in caplog.records if "picked" in r.getMessage()]
    assert len(picks) == 1 and "on cpu" in picks[0].getMessage()
    (key,) = ns_backends._auto_choices
    picked = ns_backends._auto_choices[key]
    assert picked in ("torch", "gram")
    assert key == (g.device, tuple(g.shape), torch.float32, 5)
    expected = get_ns_backend(picked)(g, schedule, dtype=torch.float32)
    assert torch.equal(out, expected) and torch.equal(again, expected)
    reference = newton_schulz(g, schedule, dtype=torch.float32)
    assert ((out - reference).norm() / reference.norm()).item() < 1e-4


def _fake_timings(monkeypatch, timings, broken=None):
    """Make each backend's timing ``timings[name]`` and ``broken``'s result wrong."""
    last = []

    def tracked(name, real):
        def backend(grad, *args, **kwargs):
            last.append(name)
            out = real(grad, *args, **kwargs)
            return torch.zeros_like(out) if name == broken else out

        return backend

    for name in timings:
        monkeypatch.setitem(
            ns_backends.NS_BACKENDS, name, tracked(name, ns_backends.NS_BACKENDS[name])
        )
    monkeypatch.setattr(ns_backends, "_elapsed_ms", lambda fn, device: (fn(), timings[last[-1]])[1])


@pytest.mark.parametrize(
    "timings, broken, expected",
    [
        ({"torch": 10.0, "triton": 6.0, "gram": 5.0}, None, "gram"),
        ({"torch": 10.0, "triton": 6.0, "gram": 5.0}, "gram", "triton"),
        ({"torch": 10.0, "triton": 9.8, "gram": 12.0}, None, "torch"),  # within the margin
    ],
)
def test_auto_picks_the_fastest_correct_backend(monkeypatch, timings, broken, expected):
    """The selection logic, as on CUDA (triton and gram candidates), with fake timings."""
    _fake_timings(monkeypatch, timings, broken)
    monkeypatch.setattr(ns_backends, "_candidates", lambda device: ("triton", "gram"))
    schedule = resolve_ns_schedule("quintic", 2)
    g = _randn(24, 40, seed=9)
    picked = ns_backends._measure_fastest(g, schedule, eps=1e-7, dtype=torch.float32)
    assert picked == expected


@pytest.mark.parametrize(
    "timings, expected",
    [({"torch": 10.0, "gram": 5.0}, "gram"), ({"torch": 5.0, "gram": 10.0}, "torch")],
)
def test_auto_on_cpu_times_gram_against_torch(monkeypatch, timings, expected):
    _fake_timings(monkeypatch, timings)
    schedule = resolve_ns_schedule("quintic", 5)
    g = _randn(AUTO_MIN_SIDE_CPU, 4 * AUTO_MIN_SIDE_CPU, seed=4)
    assert choose_ns_backend(g, schedule, dtype=torch.float32) == expected
