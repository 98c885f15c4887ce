"""A TorchTitan 0.2.2 TOML job on TorchTitan 0.3: each key goes where 0.3 keeps it, one 0.3
does not have is refused by name before anything runs, and
``TORCHTITAN_VERSION=0.3.0 ./run_train.sh --job.config_file`` trains from the file."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
import tomli

from tests.support.launcher import free_port
from torchtitan_dmuon.titan.config import DMuon
from torchtitan_dmuon.titan03.config_registry import llama3_debug_cpu
from torchtitan_dmuon.titan03.toml import translate
from torchtitan_dmuon.titan03.trainer import DMuonTrainer

ROOT = Path(__file__).resolve().parents[2]
DEBUG_CPU = ROOT / "train_configs" / "debug_cpu.toml"


def _toml() -> dict:
    return tomli.loads(DEBUG_CPU.read_text())


def test_the_default_toml_is_the_default_python_config():
    """train_configs/debug_cpu.toml translated equals llama3_debug_cpu, the Python config
    of the same run, in every setting the run reads (the folders aside)."""
    ours, python = translate(_toml()), llama3_debug_cpu()
    assert type(ours) is DMuonTrainer.Config
    assert ours.model_spec.name == "llama3" and ours.model_spec.flavor == "debugmodel"
    for section in ("training", "optimizer", "dataloader", "lr_scheduler", "parallelism"):
        assert getattr(ours, section) == getattr(python, section), section
    assert ours.dmuon == dataclass_replace(python.dmuon, adjust_lr_fn="original")
    assert ours.hf_assets_path == "./assets/tokenizer" and ours.debug.seed == 42
    assert ours.activation_checkpoint is None and not ours.checkpoint.enable
    assert ours.validator.dataloader.dataset_path == "./assets/heldout"
    assert (ours.metrics.log_freq, ours.metrics.enable_tensorboard) == (5, True)


def dataclass_replace(section: DMuon, **changes) -> DMuon:
    import dataclasses

    return dataclasses.replace(section, **changes)


@pytest.mark.parametrize(
    "section, key, value, message",
    [
        ("training", "bogus", 1, r"\[training\] bogus: .* has no training.bogus"),
        ("dmuon", "bogus", 1, r"\[dmuon\] bogus: DMuon has no such setting"),
        ("hf_transformers", "attn_implementation", "sdpa", r"\[hf_transformers\]: .* section"),
        ("model", "converters", [], r"\[model\] converters: TorchTitan 0.3 has no model option"),
        ("optimizer", "name", "AdamW", r"\[optimizer\] name: .* trains with DMuon"),
        ("activation_checkpoint", "mode", "op", r"\[activation_checkpoint\] mode"),
        ("model", "flavor", "nope", r"\[model\] flavor = 'nope'"),
    ],
)  # fmt: skip
def test_a_key_torchtitan_0_3_does_not_have_is_refused_by_name(section, key, value, message):
    toml = _toml()
    toml.setdefault(section, {})[key] = value
    with pytest.raises(ValueError, match=message):
        translate(toml)


def test_run_train_trains_a_toml_job_on_torchtitan_0_3(tmp_path):
    env = dict(os.environ, TORCHTITAN_VERSION="0.3.0", NGPU="2", MASTER_PORT=str(free_port()))
    env.pop("TRITON_INTERPRET", None)
    env.pop("DMUON_VENV", None)
    run = subprocess.run(
        ["./run_train.sh", "--job.config_file", str(DEBUG_CPU), "--training.steps", "3",
         "--metrics.log_freq", "1",
         "--dump_folder", str(tmp_path / "dump")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-5000:]
    assert "--module torchtitan_dmuon.titan03 --config from_toml" in output
    assert "(TOML, translated onto TorchTitan 0.3)" in output
    steps = [int(s) for s in re.findall(r"step:\s+(\d+)\s+loss", output)]
    assert steps[-1] == 3  # the flag after the file applies over it
