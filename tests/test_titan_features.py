"""TorchTitan features beside plain training: config parsing, profiling, HF export,
optimizer implementation, non-finite gradient norms, resuming across optimizers, float8
all-gather. Runs go through ``tests/test_titan_integration.py``'s helpers."""

from __future__ import annotations

import re

import pytest
from torchtitan.config import ConfigManager

from tests.test_titan_integration import ROOT

CONFIG_MODULE = ["--job.custom_config_module", "torchtitan_dmuon.titan.config"]


def parse(*args: str):
    return ConfigManager().parse_args([*CONFIG_MODULE, *args])


@pytest.mark.parametrize(
    "field, value",
    [
        ("ns_coefficients", "cubic"),
        ("ns_backend", "cuda"),
        ("ns_dtype", "int8"),
        ("adjust_lr_fn", "sqrt"),
    ],
)
def test_bad_choice_rejected_at_parse_time(field, value, tmp_path, capsys):
    """A [dmuon] choice outside its Literal fails while parsing, from the command line
    (tyro's message names the flag) and from a TOML file (ours names the key)."""
    with pytest.raises(SystemExit) as exit_info:
        parse(f"--dmuon.{field}", value)
    assert exit_info.value.code != 0
    stderr = capsys.readouterr().err
    assert f"invalid choice '{value}'" in stderr
    assert f"--dmuon.{field.replace('_', '-')}" in stderr

    config = (ROOT / "train_configs/debug_cpu.toml").read_text()
    config = re.sub(rf"^{field} = .*\n", "", config, flags=re.M)
    bad = tmp_path / "bad.toml"
    bad.write_text(config.replace("[dmuon]\n", f'[dmuon]\n{field} = "{value}"\n'))
    with pytest.raises(ValueError, match=rf"\[dmuon\] {field} must be one of .*got '{value}'"):
        parse("--job.config_file", str(bad))
