"""TorchTitan features beside plain training: config parsing, profiling, HF export,
optimizer implementation, non-finite gradient norms, resuming across optimizers, float8
all-gather. Runs go through ``tests/test_titan_integration.py``'s helpers."""

from __future__ import annotations

import fnmatch
import json
import re

import pytest
import safetensors.torch
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torchtitan.config import ConfigManager
from torchtitan.protocols.train_spec import get_train_spec

from tests.test_titan_integration import ROOT, SHORT, OverrideDefinitions, run_case

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


PROFILE = [
    "--profiling.enable_profiling",
    "--profiling.profile_freq",
    "2",
    "--profiling.profiler_warmup",
    "0",
    "--profiling.profiler_active",
    "1",
]
MODEL_ONLY_AT_STEP_3 = [
    *SHORT[2:],
    "--training.steps",
    "3",
    "--checkpoint.enable",
    "--checkpoint.last_save_model_only",
]


def test_cpu_profiling_and_hf_export_of_dedicated_matrices(tmp_path):
    """One run profiles steps 1-2 on CPU and exports HF safetensors at step 3; a second,
    identical run saves a DCP checkpoint at step 3. The export holds every weight (the
    dedicated ones, which only their owner saves, included) exactly as DCP has it."""
    exported, saved = run_case(
        OverrideDefinitions(
            [
                [*MODEL_ONLY_AT_STEP_3, *PROFILE, "--checkpoint.last_save_in_hf"],
                MODEL_ONLY_AT_STEP_3,
            ],
            "CPU profiler traces and an HF export beside a DCP checkpoint",
            "profile_hf_export",
        ),
        tmp_path,
    )
    assert exported.losses == saved.losses

    for rank in (0, 1):
        trace = tmp_path / f"run0/profile_traces/iteration_2/rank{rank}_trace.json"
        events = json.loads(trace.read_text())["traceEvents"]
        assert any(e.get("name", "").startswith("ProfilerStep#") for e in events), trace
        assert any(e.get("name") == "Optimizer.step#Muon.step" for e in events), trace

    hf_dir = tmp_path / "run0/checkpoint/step-3"
    hf = {}
    for path in sorted(hf_dir.glob("*.safetensors")):
        hf.update(safetensors.torch.load_file(path))
    spec = get_train_spec("llama3")
    adapter = spec.state_dict_adapter(spec.model_args["debugmodel"], None)
    from_hf = adapter.from_hf(hf)

    dcp_file = tmp_path / "dcp.pt"
    dcp_to_torch_save(tmp_path / "run1/checkpoint/step-3", dcp_file)
    dcp = torch.load(dcp_file, weights_only=True)
    assert sorted(from_hf) == sorted(dcp)
    dedicated = [k for k in dcp if fnmatch.fnmatch(k, "layers.*.attention.w?.weight")]
    assert len(dedicated) == 24
    for key, value in dcp.items():
        assert value.abs().sum() > 0, key
        assert torch.equal(from_hf[key], value), key
