"""One validated config: ``MuonConfig`` / ``AdamWConfig`` built from ``Muon``'s keywords or
given whole (TorchTitan's ``[dmuon]`` section, a ``MuonConfig``:
``tests/titan/test_titan_config.py``)."""

import dataclasses

import pytest
import torch

from tests.support.models import batch, loss_fn, make_model, proj_predicate
from torchtitan_dmuon import AdamWConfig, Muon, MuonConfig


def _trained(optimizer_of) -> dict[str, torch.Tensor]:
    model = make_model(seed=3)
    optimizer = optimizer_of(model)
    for step in range(2):
        inputs, targets = batch(10 + step, 4)
        optimizer.zero_grad()
        loss_fn(model, inputs, targets).backward()
        optimizer.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_keywords_and_a_config_train_alike():
    """``Muon(model, lr=..., adamw_lr=...)`` and ``Muon(model, MuonConfig(...),
    adamw=AdamWConfig(...))`` are one optimizer; keywords apply over a given config."""
    keywords = dict(lr=0.03, momentum=0.9, ns_dtype=torch.float32, adamw_lr=2e-3)
    by_keywords = _trained(lambda m: Muon(m, predicate=proj_predicate, **keywords))
    config = MuonConfig(lr=0.03, momentum=0.9, ns_dtype="float32")
    by_config = _trained(
        lambda m: Muon(m, config, adamw=AdamWConfig(lr=2e-3), predicate=proj_predicate)
    )
    over = _trained(
        lambda m: Muon(
            m, MuonConfig(lr=0.5, ns_dtype="float32"), predicate=proj_predicate,
            lr=0.03, momentum=0.9, adamw_lr=2e-3,
        )
    )  # fmt: skip
    default = _trained(lambda m: Muon(m, predicate=proj_predicate, ns_dtype=torch.float32))
    for name, value in by_keywords.items():
        assert torch.equal(value, by_config[name]) and torch.equal(value, over[name]), name
    assert any(not torch.equal(v, default[n]) for n, v in by_keywords.items())


def test_the_optimizer_reads_its_settings_from_the_config():
    model = make_model()
    optimizer = Muon(model, predicate=proj_predicate, lr=0.03, adjust_lr_fn=None, adamw_eps=1e-6)
    assert optimizer.config == MuonConfig(lr=0.03)
    assert optimizer.param_groups[0]["lr"] == 0.03
    assert optimizer.param_groups[0]["adjust_lr_fn"] == "original"  # None means original
    assert optimizer.param_groups[1]["eps"] == 1e-6


@pytest.mark.parametrize(
    "keywords, error, message",
    [
        (dict(lrr=0.1), TypeError, "unexpected keyword argument 'lrr'"),
        (dict(adamw_momentum=0.9), TypeError, "unexpected keyword argument 'adamw_momentum'"),
        (dict(momentum=1.0), ValueError, r"^momentum must be \[0.0, 1.0\), got 1.0"),
        (dict(lr=-1.0), ValueError, r"^lr must be >= 0.0"),
        (dict(ns_steps=0), ValueError, "ns_steps must be an integer >= 1"),
        (dict(ns_coefficients=((1.0, 2.0),)), TypeError, "ns_coefficients must be one of"),
        (dict(ns_dtype="int8"), ValueError, r"^ns_dtype must be one of"),
        (dict(ns_backend="cuda"), ValueError, r"^ns_backend must be one of"),
        (dict(adamw_betas=(0.9, 1.5)), ValueError, r"^adamw_betas\[1\] must be"),
        (dict(adamw_lr=-1.0), ValueError, r"^adamw_lr must be >= 0.0"),
        (dict(replicate_async=True), ValueError, "replicate_async=True needs dedicate_params"),
    ],
)
def test_a_bad_setting_is_refused_naming_it(keywords, error, message):
    with pytest.raises(error, match=message):
        Muon(make_model(), predicate=proj_predicate, **keywords)


def test_python_spellings_are_normalized_and_the_config_is_frozen():
    config = MuonConfig(ns_dtype=torch.bfloat16, ns_coefficients=[1, 2, 3], adjust_lr_fn=None)
    assert config.ns_dtype == "bfloat16" and config.adjust_lr_fn == "original"
    assert config.ns_coefficients == ((1.0, 2.0, 3.0),)
    assert config.ns_schedule.coefficients == ((1.0, 2.0, 3.0),) * 5
    assert hash(config) == hash(MuonConfig(ns_dtype="bfloat16", ns_coefficients=((1, 2, 3),)))
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.lr = 1.0


def test_python_values_of_the_wrong_type_are_refused_naming_the_keyword():
    with pytest.raises(TypeError, match="^nesterov must be a bool, got 'no'"):
        MuonConfig(nesterov="no")
    with pytest.raises(TypeError, match=r"^adamw_betas must be a tuple of 2 floats"):
        Muon(make_model(), predicate=proj_predicate, adamw_betas=("0.9", 0.95))
    assert MuonConfig(lr=1).lr == 1  # an int is a float
