"""TorchTitan features beside plain training: config parsing, profiling, HF export,
optimizer implementation, non-finite gradient norms, resuming across optimizers, float8
all-gather. Runs go through ``tests/titan/test_titan_integration.py``'s helpers."""

from __future__ import annotations

import fnmatch
import json
import math
import os
import re

import pytest
import safetensors.torch
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.tensor import DTensor
from torchtitan.config import ConfigManager
from torchtitan.distributed import ParallelDims
from torchtitan.protocols.train_spec import get_train_spec

from tests.support.dist import run_distributed
from tests.titan.test_titan_integration import (
    ADAMW,
    PLAIN,
    ROOT,
    SHORT,
    Z2_PROFILED_HF,
    OverrideDefinitions,
    run_case,
)
from torchtitan_dmuon.optim import ns_choice
from torchtitan_dmuon.titan import register
from torchtitan_dmuon.titan.config import DEFAULT_PARAM_PATTERNS
from torchtitan_dmuon.titan.cpu import enable_cpu_support
from torchtitan_dmuon.titan.model_state import ModelState
from torchtitan_dmuon.titan.patches import PatchRegistry

CONFIG_MODULE = ["--job.custom_config_module", "torchtitan_dmuon.titan.config"]


def parse(*args: str):
    """TorchTitan's JobConfig with the [dmuon] section, from command-line arguments."""
    return ConfigManager().parse_args([*CONFIG_MODULE, *args])


@pytest.mark.parametrize(
    "field, value",
    [
        ("ns_coefficients", "cubic"),
        ("ns_backend", "cuda"),
        ("ns_dtype", "int8"),
        ("adjust_lr_fn", "sqrt"),
        ("nonfinite_grad_norm", "ignore"),
    ],
)
def test_bad_choice_rejected_at_parse_time(field, value, tmp_path, capsys):
    """A [dmuon] choice outside its Literal fails while parsing, from the command line
    (tyro's message names the flag) and from a TOML file (ours names the key)."""
    with pytest.raises(SystemExit) as exit_info:
        parse(f"--dmuon.{field}", value)
    assert exit_info.value.code != 0
    stderr = capsys.readouterr().err
    # ns_coefficients also takes (a, b, c) triples: tyro lists why each form refused it.
    refused = "does not match choices" if field == "ns_coefficients" else "invalid choice"
    assert refused in stderr and value in stderr
    assert f"--dmuon.{field.replace('_', '-')}" in stderr

    config = (ROOT / "train_configs/debug_cpu.toml").read_text()
    config = re.sub(rf"^{field} = .*\n", "", config, flags=re.M)
    bad = tmp_path / "bad.toml"
    bad.write_text(config.replace("[dmuon]\n", f'[dmuon]\n{field} = "{value}"\n'))
    with pytest.raises(ValueError, match=rf"\[dmuon\] {field} must be one of .*got '{value}'"):
        parse("--job.config_file", str(bad))


# The states of a full DCP checkpoint beside the model's weights.
NOT_MODEL = {"optimizer", "lr_scheduler", "dataloader", "train_state"}


def test_cpu_profiling_and_hf_export_of_dedicated_matrices(tmp_path, tmp_path_factory):
    """The FSDP-Z2 run of test_titan_integration.py's fsdp_z3_z2 case profiles every
    second step on CPU and exports HF safetensors at its last step (6); the plain (Z3) run,
    bit-identical to it, saves a full DCP checkpoint there. The export holds every weight
    (the dedicated ones, which only their owner saves, included) exactly as DCP has it."""
    exported, saved = run_case(
        OverrideDefinitions(
            [Z2_PROFILED_HF, PLAIN],
            "CPU profiler traces and an HF export beside a DCP checkpoint",
            "profile_hf_export",
            shared=(0, 1),
        ),
        tmp_path,
        tmp_path_factory,
    )
    assert exported.losses == saved.losses
    assert sorted(exported.losses) == [1, 2, 3, 4, 5, 6]

    for rank in (0, 1):
        trace = tmp_path / f"run0/profile_traces/iteration_2/rank{rank}_trace.json"
        events = json.loads(trace.read_text())["traceEvents"]
        assert any(e.get("name", "").startswith("ProfilerStep#") for e in events), trace
        assert any(e.get("name") == "Optimizer.step#Muon.step" for e in events), trace

    hf_dir = tmp_path / "run0/checkpoint/step-6"
    hf = {}
    for path in sorted(hf_dir.glob("*.safetensors")):
        hf.update(safetensors.torch.load_file(path))
    spec = get_train_spec("llama3")
    adapter = spec.state_dict_adapter(spec.model_args["debugmodel"], None)
    from_hf = adapter.from_hf(hf)

    dcp_file = tmp_path / "dcp.pt"
    dcp_to_torch_save(tmp_path / "run1/checkpoint/step-6", dcp_file)
    full = torch.load(dcp_file, weights_only=True)
    assert NOT_MODEL <= set(full)
    dcp = {k: v for k, v in full.items() if k not in NOT_MODEL}
    assert sorted(from_hf) == sorted(dcp)
    dedicated = [k for k in dcp if any(fnmatch.fnmatch(k, p) for p in DEFAULT_PARAM_PATTERNS)]
    assert len(dedicated) == 42  # 6 layers x (4 attention + 3 feed-forward matrices)
    for key, value in dcp.items():
        assert value.abs().sum() > 0, key
        assert torch.equal(from_hf[key], value), key


# A fresh run (step 1, LR warmup, new optimizer state) starting from trained weights, as
# TorchTitan 0.2.2 offers it: from HF safetensors or from a DCP checkpoint's model.
START = ["--training.steps", "3", "--checkpoint.enable", "--checkpoint.initial_load_path"]
FROM_HF = ["--checkpoint.initial_load_in_hf", "--checkpoint.initial_load_model_only"]
FROM_DCP = ["--checkpoint.initial_load_model_only"]


def test_start_from_hf_weights(tmp_path, tmp_path_factory):
    """Run A starts from the HF export of test_cpu_profiling_and_hf_export_of_dedicated_matrices
    (step 6 of the Z2 run), run B from the model of the bit-identical plain run's DCP
    checkpoint at step 6: each dedicated matrix reaches its owner from either, so their
    losses are bit-identical, and well below a fresh model's (the plain run's step 1, the
    same batch). The equality is what sees the dedicated matrices: with the HF load made
    to skip them (the rest loaded), A logged 7.00614 at step 1, B 7.00068."""
    hf_dir, dcp_dir = "{dump}/run0/checkpoint/step-6", "{dump}/run1/checkpoint/step-6"
    _, plain, from_hf, from_dcp = run_case(
        OverrideDefinitions(
            [
                Z2_PROFILED_HF,
                PLAIN,
                [*SHORT, *START, hf_dir, *FROM_HF],
                [*SHORT, *START, dcp_dir, *FROM_DCP],
            ],
            "A fresh DMuon run from HF safetensors equals one from the DCP checkpoint",
            "start_from_hf_weights",
            shared=(0, 1),
        ),
        tmp_path,
        tmp_path_factory,
    )
    assert "loading from HF safetensors from --checkpoint.initial_load_path" in from_hf.output
    assert f"Loading the checkpoint from {tmp_path}/run1/checkpoint/step-6" in from_dcp.output
    assert sorted(from_hf.losses) == sorted(from_dcp.losses) == [1, 2, 3]
    assert from_hf.losses == from_dcp.losses
    assert from_hf.losses[1] < plain.losses[1] - 0.5


NAN_STEP = 2
STEPS = 4
POLICIES = ("skip", "stop", "continue")


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _snapshot(model, optimizers) -> dict[str, torch.Tensor]:
    """This rank's copy of the model state (dedicated matrices on their owner) and of the
    optimizer state (momentum, AdamW moments and steps), as local tensors."""
    state = {f"model.{k}": v for k, v in ModelState([model]).state_dict().items()}
    state.update({k: v for k, v in optimizers.state_dict().items() if k.startswith("state.")})
    return {k: _local(v).detach().clone() for k, v in state.items()}


def nonfinite_grad_norm_worker(rank: int, world: int) -> dict[str, dict]:
    """:func:`train_with_a_nan` under each ``[dmuon] nonfinite_grad_norm`` policy."""
    register()
    with PatchRegistry() as patches:  # what DMuonTrainer installs: the CPU layer
        enable_cpu_support(patches)
        return {policy: train_with_a_nan(rank, world, policy) for policy in POLICIES}


def build_debug_llama3(rank: int, world: int, *flags: str):
    """TorchTitan's debug llama3 with DMuon on ``world`` gloo ranks, built as TorchTitan's
    trainer builds it (meta init, the DMuon train spec's parallelize and optimizer
    builders, LR schedulers over ``STEPS`` steps), and one fixed batch of this rank.

    Returns:
        ``(model, optimizers, lr_schedulers, tokens, job_config)``.
    """
    job_config = parse(
        "--optimizer.name",
        "DMuon",
        "--dmuon.ns_dtype",
        "float32",
        "--training.seq_len",
        "32",
        "--training.mixed_precision_param",
        "float32",
        "--lr_scheduler.warmup_steps",
        "1",
        *flags,
    )
    parallel_dims = ParallelDims(
        dp_replicate=1, dp_shard=world, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=world
    )
    spec = get_train_spec("llama3")
    model_args = spec.model_args["debugmodel"]
    model_args.update_from_config(job_config)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = spec.model_cls(model_args)
    model = spec.parallelize_fn(model, parallel_dims, job_config)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights()
    optimizers = spec.build_optimizers_fn([model], job_config.optimizer, parallel_dims)
    lr_schedulers = spec.build_lr_schedulers_fn(optimizers, job_config.lr_scheduler, STEPS)
    tokens = torch.randint(
        0, model_args.vocab_size, (2, 33), generator=torch.Generator().manual_seed(rank)
    )
    return model, optimizers, lr_schedulers, tokens, job_config


def forward_backward(model, tokens: torch.Tensor) -> float:
    """One forward and backward on next-token prediction; the loss."""
    logits = model(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    return loss.item()


def train_with_a_nan(rank: int, world: int, policy: str) -> dict:
    """Train on one fixed batch (the loss falls from step to step), with a NaN put into
    rank 1's shard of one gradient at step ``NAN_STEP``."""
    model, optimizers, lr_schedulers, tokens, job_config = build_debug_llama3(
        rank, world, "--dmuon.nonfinite_grad_norm", policy
    )
    result = {"losses": {}, "lr_steps": []}
    for step in range(1, STEPS + 1):
        optimizers.zero_grad()
        result["losses"][step] = forward_backward(model, tokens)
        if step == NAN_STEP:
            if rank == 1:
                _local(model.norm.weight.grad)[0] = float("nan")
            before = _snapshot(model, optimizers)
        try:
            optimizers.clip_grad_norm_(job_config.training.max_norm, step)
        except RuntimeError as error:
            result["error"] = str(error)
            return result
        optimizers.step()
        lr_schedulers.step()
        result["lr_steps"].append(lr_schedulers.schedulers[0].last_epoch)
        if step == NAN_STEP:
            after = _snapshot(model, optimizers)
            result["unchanged"] = sorted(k for k in before if torch.equal(before[k], after[k]))
            result["keys"] = sorted(before)
    # Skipped on the device: the warning waits for the trainer's next logging step.
    result["warned"] = optimizers.log_skipped_steps()
    return result


def test_nonfinite_grad_norm_skip_stop_continue(in_process_by_rank):
    """A NaN on one rank makes the global norm NaN on both. skip: that step leaves every
    parameter and optimizer state bit-identical (decided on the device; its warning comes
    when the trainer next logs), and training goes on with finite losses;
    stop: both ranks raise naming the step and the option; continue: the NaN reaches the
    weights."""
    for by_worker in in_process_by_rank:
        result = by_worker["nonfinite_grad_norm"]
        skip, stop, go_on = (result[policy] for policy in POLICIES)
        assert skip["unchanged"] == skip["keys"]
        assert any(k.startswith("model.layers.") for k in skip["keys"])
        assert any(k.endswith(".momentum_buffer") for k in skip["keys"])
        assert any(k.endswith(".exp_avg_sq") for k in skip["keys"])
        assert skip["warned"] == [NAN_STEP]
        assert go_on["warned"] == []
        assert skip["lr_steps"] == [1, 2, 3, 4]  # the scheduler advanced through the skip
        losses = skip["losses"]
        assert all(math.isfinite(v) for v in losses.values())
        assert losses[NAN_STEP + 1] == losses[NAN_STEP]  # the same weights and batch
        assert losses[STEPS] < losses[NAN_STEP + 1] < losses[1]

        assert stop["error"] == (
            f"step {NAN_STEP}: the global gradient norm is nan; stopping, as "
            "[dmuon] nonfinite_grad_norm = 'stop' asks ('skip' skips such steps)"
        )
        assert sorted(stop["losses"]) == [1, NAN_STEP]

        assert not math.isfinite(go_on["losses"][NAN_STEP + 1])


IMPLEMENTATIONS = ("for-loop", "foreach", "fused")


def implementation_worker(rank: int, world: int) -> dict[str, dict]:
    """One step under each ``[optimizer] implementation``: the AdamW group's flags and
    this rank's AdamW state and weights after it."""
    register()
    result = {}
    with PatchRegistry() as patches:
        enable_cpu_support(patches)
        for implementation in IMPLEMENTATIONS:
            result[implementation] = _one_step(rank, world, implementation)
    return result


def _one_step(rank: int, world: int, implementation: str) -> dict:
    model, optimizers, _, tokens, job_config = build_debug_llama3(
        rank, world, "--optimizer.implementation", implementation
    )
    forward_backward(model, tokens)
    optimizers.clip_grad_norm_(job_config.training.max_norm, 1)
    optimizers.step()
    (muon,) = optimizers.optimizers
    adamw_group = muon.param_groups[1]
    return {
        "flags": (adamw_group["foreach"], adamw_group["fused"]),
        "state": _snapshot(model, optimizers),
    }


def in_process_worker(rank: int, world: int) -> dict[str, dict]:
    """:func:`nonfinite_grad_norm_worker` and :func:`implementation_worker` on the same
    ranks, one after the other (each model and optimizer is built afresh)."""
    return {
        "nonfinite_grad_norm": nonfinite_grad_norm_worker(rank, world),
        "implementation": implementation_worker(rank, world),
    }


@pytest.fixture(scope="module")
def in_process_by_rank() -> list[dict[str, dict]]:
    """The in-process checks' results by rank: one spawn of 2 gloo ranks (each start
    imports torch and TorchTitan) serves both tests."""
    return run_distributed(in_process_worker, 2)


def test_optimizer_implementation_reaches_adamw(in_process_by_rank):
    """[optimizer] implementation picks DMuon's AdamW kernels as it picks TorchTitan's
    AdamW ones (fused is TorchTitan's default; torch 2.13 has a fused CPU AdamW): the
    three agree on the step."""
    for by_worker in in_process_by_rank:
        result = by_worker["implementation"]
        assert result["for-loop"]["flags"] == (False, False)
        assert result["foreach"]["flags"] == (True, False)
        assert result["fused"]["flags"] == (False, True)
        reference = result["for-loop"]["state"]
        assert any(k.endswith(".exp_avg") for k in reference)
        for implementation in ("foreach", "fused"):
            state = result[implementation]["state"]
            assert sorted(state) == sorted(reference)
            for key, value in reference.items():
                torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-7, msg=key)


def _resume_from(run: str, step: int) -> list[str]:
    return [
        "--checkpoint.enable",
        "--checkpoint.interval",
        "3",
        "--checkpoint.initial_load_path",
        f"{{dump}}/{run}/checkpoint/step-{step}",
        "--checkpoint.no-initial_load_model_only",
        "--checkpoint.exclude_from_loading",
        "optimizer",
    ]


def test_resume_across_adamw_and_dmuon(tmp_path, tmp_path_factory):
    """AdamW saves at step 3 (the AdamW baseline run of test_titan_integration.py), DMuon
    resumes from it (without the optimizer state) and saves at step 6, AdamW resumes from
    that: the LR schedule carries on across the different numbers of param groups (AdamW
    one, DMuon two), from the trained weights."""
    adamw = ["--optimizer.name", "AdamW"]
    steps = "--training.steps"
    saved, dmuon, back = run_case(
        OverrideDefinitions(
            [
                ADAMW,
                [*SHORT, *_resume_from("run0", 3)],
                [*SHORT, steps, "9", *adamw, *_resume_from("run1", 6)],
            ],
            "AdamW -> DMuon -> AdamW through checkpoints without optimizer state",
            "resume_across_optimizers",
            shared=(0,),
        ),
        tmp_path,
        tmp_path_factory,
    )
    assert sorted(dmuon.losses) == [4, 5, 6] and sorted(back.losses) == [7, 8, 9]
    assert dmuon.losses[4] < saved.losses[1] - 0.1
    assert back.losses[7] < dmuon.losses[4]
    for run, saved_groups, groups, step in ((dmuon, 1, 2, 3), (back, 2, 1, 6)):
        assert (
            f"lr_scheduler: the checkpoint's schedule is for {saved_groups} param group(s), "
            f"this optimizer has {groups}: continuing it at step {step} with this run's "
            "base learning rates"
        ) in run.output


FLOAT8 = ["--model.converters", "quantize.linear.float8", "--quantize.linear.float8.emulate"]
FLOAT8_FSDP = [
    "--quantize.linear.float8.enable_fsdp_float8_all_gather",
    "--quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp",
]


def test_float8_fsdp_all_gather(tmp_path, tmp_path_factory):
    """float8 linears (emulated on CPU) with FSDP's float8 all-gather and precomputed
    scales: the dedicated matrices train beside them, close to the run without float8."""
    plain, float8 = run_case(
        OverrideDefinitions(
            [PLAIN, [*SHORT, *FLOAT8, *FLOAT8_FSDP]],
            "float8 with FSDP float8 all-gather and precomputed scales, with DMuon",
            "float8_fsdp_all_gather",
            shared=(0,),
        ),
        tmp_path,
        tmp_path_factory,
    )
    assert "Swapped to Float8Linear layers with enable_fsdp_float8_all_gather=True" in (
        float8.output
    )
    steps = range(1, 7)
    assert [float8.losses[s] for s in steps] == pytest.approx(
        [plain.losses[s] for s in steps], rel=2e-2
    )


@pytest.mark.ns_verdict
def test_default_config_chooses_ns_dtype_and_backend_once_and_caches(tmp_path):
    """The default config's ``ns_dtype = "auto"`` and ``ns_backend = "auto"``: the log names
    the dtype and why (fp32 on a CPU without native bf16), agreed by both ranks; the
    backends are picked before step 1 (each of the 3 shapes measured once), and a second
    run finds every timing in the disk cache and measures nothing. (How long the
    measurement takes is a benchmark's figure, not a test's: it varies with the load.)"""
    short = ["--training.steps", "2", "--metrics.log_freq", "1"]
    case = OverrideDefinitions([short, short], "defaults", "defaults")
    first, second = run_case(case, tmp_path)
    chose = re.search(r"ns_dtype='auto' chose torch\.(\w+): (.*); agreed by 2 ranks", first.output)
    assert chose, first.output[-3000:]
    capability = torch.backends.cpu.get_cpu_capability()
    assert capability in chose.group(2)
    forced = os.environ.get(ns_choice.VERDICT_ENV)
    if forced:
        assert chose.group(1) == forced and f"{ns_choice.VERDICT_ENV}={forced}" in chose.group(2)
    elif not ns_choice._native_cpu_bf16():
        assert chose.group(1) == "float32" and "no native bf16" in chose.group(2)
    picked = re.compile(
        r"ns_backend='auto' for torch\.\w+ on 2 rank\(s\): (.*) \(each backend checked "
        r"against torch's result on this device for the shape, coefficients, dtype and eps; "
        r"this rank: (\d+) shapes measured, (\d+) from the cache, ([\d.]+) s\)"
    )
    (pick1, measured1, cached1, seconds1), (pick2, measured2, cached2, _) = (
        picked.search(run.output).groups() for run in (first, second)
    )
    # debug llama3: wq/wk/wv/wo 256x256, w1/w3 768x256, w2 256x768, each run by rank 0.
    # The second run's picks come from one rank's cached timings (both ranks time the same
    # batches, the last one saved wins), so a near tie may pick otherwise: same shapes.
    shapes = ["256x256", "256x768", "768x256"]
    assert [p.split()[0] for p in pick1.split(", ")] == shapes
    assert [p.split()[0] for p in pick2.split(", ")] == shapes
    assert (int(measured1), int(cached1)) == (3, 0) and float(seconds1) > 0
    assert (int(measured2), int(cached2)) == (0, 3)
