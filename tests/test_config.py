"""One validated config: ``MuonConfig`` / ``AdamWConfig`` built from ``Muon``'s keywords,
given whole, or parsed as TorchTitan's ``[dmuon]`` section, which is a ``MuonConfig``."""

import dataclasses

import pytest
import torch
from torchtitan.config.manager import ConfigManager

from tests.models import batch, loss_fn, make_model, proj_predicate
from torchtitan_dmuon import AdamWConfig, Muon, MuonConfig
from torchtitan_dmuon.titan.config import DMuon


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


def test_the_dmuon_section_is_a_muon_config_and_declares_none_of_its_fields():
    """A setting is declared once: the [dmuon] section inherits every MuonConfig field
    (type, default, docstring, check) and adds only what the trainer alone reads; the one
    it redeclares is weight_decay, whose default there is unset (``[optimizer]``'s)."""
    muon_fields = {f.name for f in dataclasses.fields(MuonConfig)}
    assert issubclass(DMuon, MuonConfig)
    assert muon_fields <= {f.name for f in dataclasses.fields(DMuon)}
    assert muon_fields & set(DMuon.__dict__.get("__annotations__", {})) == {"weight_decay"}
    assert DMuon().weight_decay is None and MuonConfig().weight_decay == 0.0
    with pytest.raises(ValueError, match=r"^\[dmuon\] weight_decay must be >= 0.0"):
        DMuon(weight_decay=-0.1)
    with pytest.raises(ValueError, match=r"^\[dmuon\] momentum must be \[0.0, 1.0\)"):
        DMuon(momentum=1.0)


def test_the_toml_section_parses_to_the_config_muon_takes(tmp_path):
    """Flags and TOML keys of every MuonConfig field reach the section, triples included;
    the section is what ``Muon`` takes as its config."""
    toml = tmp_path / "job.toml"
    toml.write_text(
        '[job]\ncustom_config_module = "torchtitan_dmuon.titan.config"\n'
        "[dmuon]\nns_coefficients = [[3.0, -3.2, 1.2], [3.4445, -4.775, 2.0315]]\n"
        "momentum = 0.9\nweight_decay = 0.05\n"
    )
    job = ConfigManager().parse_args(
        ["--job.config_file", str(toml), "--dmuon.eps", "1e-6", "--dmuon.ns_dtype", "float32"]
    )
    section = job.dmuon
    assert isinstance(section, MuonConfig)
    assert section.ns_coefficients == ((3.0, -3.2, 1.2), (3.4445, -4.775, 2.0315))
    assert (section.momentum, section.eps, section.ns_dtype) == (0.9, 1e-6, "float32")
    optimizer = Muon(make_model(), section, predicate=proj_predicate)
    assert optimizer.config == MuonConfig(
        momentum=0.9, weight_decay=0.05, eps=1e-6, ns_dtype="float32",
        ns_coefficients=section.ns_coefficients,
    )  # fmt: skip
    assert optimizer.ns.schedule.coefficients[-1] == (3.4445, -4.775, 2.0315)
    assert optimizer.ns.eps == 1e-6 and optimizer.ns.dtype == torch.float32


@pytest.mark.parametrize(
    "line, message",
    [
        ('nesterov = "false"', "[dmuon] nesterov must be a bool, got 'false'"),
        ('reshard_after_forward = "false"', "[dmuon] reshard_after_forward must be a bool or None"),
        ('params = "layers.*.attention.wq.weight"', "[dmuon] params must be a list of str"),
        ('lr = "0.02"', "[dmuon] lr must be a float, got '0.02'"),
        ("ns_steps = 5.0", "[dmuon] ns_steps must be an int, got 5.0"),
        ("split_backward_with_fsdp = 1", "[dmuon] split_backward_with_fsdp must be a bool, got 1"),
        ("ns_coefficients = [[1, 2]]", "[dmuon] ns_coefficients must be one of"),
    ],
)
def test_a_toml_value_of_the_wrong_type_is_refused_while_parsing(tmp_path, line, message):
    """TorchTitan's TOML loader hands values to the section unchecked: a string must not
    stand in for a boolean, a number or a list (``"false"`` was true, a string was a list
    of characters, ``"0.02"`` failed after the model was built)."""
    toml = tmp_path / "job.toml"
    toml.write_text(
        f'[job]\ncustom_config_module = "torchtitan_dmuon.titan.config"\n[dmuon]\n{line}\n'
    )
    with pytest.raises(TypeError) as raised:
        ConfigManager().parse_args(["--job.config_file", str(toml)])
    assert str(raised.value).startswith(message), raised.value


def test_python_values_of_the_wrong_type_are_refused_naming_the_keyword():
    with pytest.raises(TypeError, match="^nesterov must be a bool, got 'no'"):
        MuonConfig(nesterov="no")
    with pytest.raises(TypeError, match=r"^adamw_betas must be a tuple of 2 floats"):
        Muon(make_model(), predicate=proj_predicate, adamw_betas=("0.9", 0.95))
    assert MuonConfig(lr=1).lr == 1  # an int is a float
