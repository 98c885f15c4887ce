"""TorchTitan's ``[dmuon]`` section: a ``MuonConfig`` parsed from TOML, its recipe (lr and
weight decay following ``adjust_lr_fn``) and the decay warning against TorchTitan's lr
schedule."""

import dataclasses

import pytest
import torch
from torchtitan.components.lr_scheduler import build_lr_schedulers
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.config.job_config import LRScheduler
from torchtitan.config.manager import ConfigManager

from tests.support.models import make_model, proj_predicate
from torchtitan_dmuon import Muon, MuonConfig
from torchtitan_dmuon.titan.config import (
    DECAY_KEPT_BOUND,
    ORIGINAL_LR,
    ORIGINAL_WEIGHT_DECAY,
    DMuon,
    muon_recipe,
)
from torchtitan_dmuon.titan.optimizer import decay_kept, log_decay, schedule_factors


def test_unset_lr_and_weight_decay_follow_adjust_lr_fn(caplog):
    """What [dmuon] leaves unset: original and spectral take Muon's own lr and weight decay
    whatever [optimizer] says (a weight decay means 67x more at Muon's lr 0.02 than at
    AdamW's 3e-4), match_rms_adamw takes [optimizer]'s lr and weight decay (the drop-in);
    a value set in [dmuon] wins. The startup line gives each group's decay per step at the
    peak lr and what decay alone leaves of it over the run's lr schedule, and warns, naming
    the group, where that is less than the convergence benchmark measured."""
    for fn in ("original", "spectral"):  # [optimizer]'s 0.05 is not what they take
        recipe = muon_recipe(DMuon(adjust_lr_fn=fn), 3e-4, 0.05)
        assert (recipe.lr, recipe.weight_decay) == (ORIGINAL_LR, ORIGINAL_WEIGHT_DECAY)
        assert recipe.weight_decay_from == f"unset: the default of adjust_lr_fn '{fn}'"
    dropin = muon_recipe(DMuon(adjust_lr_fn="match_rms_adamw"), 3e-4, 0.1)
    assert (dropin.lr, dropin.weight_decay) == (3e-4, 0.1)
    assert dropin.lr_from == "unset: [optimizer]'s, as match_rms_adamw carries AdamW's over"
    given = muon_recipe(DMuon(lr=0.04, weight_decay=0.0, adjust_lr_fn="match_rms_adamw"), 3e-4, 0.1)
    assert (given.lr, given.weight_decay) == (0.04, 0.0)
    assert (given.lr_from, given.weight_decay_from) == ("[dmuon] lr", "[dmuon] weight_decay")

    caplog.set_level("INFO", logger="torchtitan_dmuon.titan.container")
    warmup_then_flat = [0.5] * 10 + [1.0] * 90  # 95 steps at the peak lr, over 100
    log_decay(muon_recipe(DMuon(), 3e-4, 0.1), 3e-4, 0.1, warmup_then_flat)
    decay = ORIGINAL_LR * ORIGINAL_WEIGHT_DECAY
    kept = (1 - decay / 2) ** 10 * (1 - decay) ** 90
    assert caplog.messages == [
        f"DMuon recipe: the Muon matrices: lr {ORIGINAL_LR:g}, weight decay "
        f"{ORIGINAL_WEIGHT_DECAY:g} (lr unset: the default of adjust_lr_fn 'original'; "
        f"weight_decay unset: the default of adjust_lr_fn 'original'): {decay:.2g} a step at "
        f"the peak lr, {kept:.2f} of their values left by decay alone after the 100 steps; the "
        f"AdamW parameters: lr 0.0003, weight decay 0.1 ([optimizer]): 3e-05 a step at the "
        f"peak lr, {(1 - 1.5e-5) ** 10 * (1 - 3e-5) ** 90:.2f} of their values left by decay "
        "alone after the 100 steps"
    ]
    # The same weight decay over a run 40x as long leaves less than was measured.
    caplog.clear()
    heavy = 0.1
    log_decay(muon_recipe(DMuon(weight_decay=heavy), 3e-4, 0.1), 3e-4, 0.1, [1.0] * 4000)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    kept = (1 - ORIGINAL_LR * heavy) ** 4000
    assert kept < DECAY_KEPT_BOUND
    assert warnings == [
        f"DMuon: weight decay alone leaves the Muon matrices {kept:.2f} of their values after "
        f"the 4000 steps (lr {ORIGINAL_LR:g} x weight_decay 0.1 over the lr schedule), less "
        f"than {DECAY_KEPT_BOUND:g}, the least the convergence benchmark measured "
        "(docs/benchmarks.md#the-recipe): the recipe is unmeasured there"
    ]
    assert decay_kept(ORIGINAL_LR, heavy, [1.0] * 100) > DECAY_KEPT_BOUND  # 100 steps: none


def test_the_longest_measured_run_is_not_warned():
    """The benchmark's 1800-step run at the default (lr 0.02, weight decay 0.1, TorchTitan's
    warmup of 10 then linear decay) left 0.165 of the matrices' values and ended lower than
    a third of that weight decay did (docs/benchmarks.md#the-recipe): it is within the bound."""
    model = torch.nn.Linear(2, 2)
    optimizers = OptimizersContainer([model], torch.optim.SGD, {"lr": 1.0})
    schedule = build_lr_schedulers(optimizers, LRScheduler(warmup_steps=10), 1800)
    kept = decay_kept(ORIGINAL_LR, ORIGINAL_WEIGHT_DECAY, schedule_factors(schedule, 1800))
    assert kept == pytest.approx(0.1648, abs=1e-4)
    assert kept >= DECAY_KEPT_BOUND


def test_the_dmuon_section_is_a_muon_config_and_declares_none_of_its_fields():
    """A setting is declared once: the [dmuon] section inherits every MuonConfig field
    (type, default, docstring, check) and adds only what the trainer alone reads; the two
    it redeclares are lr and weight_decay, unset there (``muon_recipe``'s rule fills them)."""
    muon_fields = {f.name for f in dataclasses.fields(MuonConfig)}
    assert issubclass(DMuon, MuonConfig)
    assert muon_fields <= {f.name for f in dataclasses.fields(DMuon)}
    redeclared = muon_fields & set(DMuon.__dict__.get("__annotations__", {}))
    assert redeclared == {"lr", "weight_decay"}
    assert DMuon().weight_decay is None and MuonConfig().weight_decay == 0.0
    assert DMuon().lr is None and MuonConfig().lr == 0.02
    with pytest.raises(ValueError, match=r"^\[dmuon\] lr must be >= 0.0"):
        DMuon(lr=-0.1)
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
        "momentum = 0.9\nweight_decay = 0.05\nlr = 0.01\n"
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
        lr=0.01, momentum=0.9, weight_decay=0.05, eps=1e-6, ns_dtype="float32",
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
        ('lr = "0.02"', "[dmuon] lr must be a float or None, got '0.02'"),
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
