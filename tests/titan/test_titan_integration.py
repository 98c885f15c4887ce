"""TorchTitan integration tests, in TorchTitan's style: a table of cases, each one or more
real training runs on CPU (gloo), asserting on the logged losses. The runs go through
tests/support/launcher.py (ranks forked from a process that imported the trainer once, in
torchrun's environment); the tests of ./run_train.sh itself (its default, the config
named last, several nodes) launch it.
"""

from __future__ import annotations

import copy
import dataclasses
import fnmatch
import math
import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.support.launcher import Launcher
from torchtitan_dmuon.titan.parallelize import resolve_selection

ROOT = Path(__file__).resolve().parents[2]
LOSS = re.compile(r"step:\s*(\d+)\s+loss:\s*(\S+)")
# Six steps logged every step, fp32 Newton-Schulz so that runs compare to tight tolerances,
# by the reference backend: "auto" (the config's) may pick another one from run to run.
SHORT = [
    "--training.steps", "6", "--metrics.log_freq", "1",
    "--dmuon.ns_dtype", "float32", "--dmuon.ns_backend", "torch",
]  # fmt: skip


@dataclass
class OverrideDefinitions:
    """One integration case: ``override_args`` holds one argument list per run (runs in
    order, sharing ``dump_folder``-relative checkpoints through ``{dump}``)."""

    override_args: list[list[str]]
    test_descr: str
    test_name: str
    ngpu: int | list[int] = 2
    config_file: str = "train_configs/debug_cpu.toml"
    log_rank: int = 0
    """The rank whose log is read (under pipeline parallelism: one holding the last stage,
    the only one that logs the loss)."""
    via: str = "launcher"
    """How its runs start: "launcher" (tests/support/launcher.py) or "run_train.sh"."""
    shared: tuple[int, ...] = ()
    """Runs (by index) that other tests launch with the same arguments too: launched once
    per session through :func:`shared_run`, and linked as ``run{i}`` into this case's
    folder, so ``{dump}/run{i}/checkpoint`` reaches their checkpoints."""


@dataclass
class Run:
    returncode: int
    output: str
    losses: dict[int, float]
    dump: Path | None = None
    """The run's ``--job.dump_folder`` (its checkpoints are under ``checkpoint/``)."""


def train_env(ngpu: int, dump: Path, log_rank: int = 0, **extra: str) -> dict[str, str]:
    """The environment of one ``./run_train.sh`` launch into ``dump`` (``extra``: more
    variables, e.g. a node's ``NODE_RANK``)."""
    env = dict(os.environ, NGPU=str(ngpu), LOG_RANK=str(log_rank), **extra)
    # As a user runs it: conftest's Triton interpreter would hide Triton-only paths.
    env.pop("TRITON_INTERPRET", None)
    # An Inductor cache of its own: torch 2.13's FX graph cache can hand one rank's
    # compiled code, with its tensor-parallel group's name baked in, to the ranks of
    # another group ("Could not resolve the process group registered under the name").
    env["TORCHINDUCTOR_CACHE_DIR"] = str(dump) + "_inductor"
    # Each rank's output in files of its own (torchrun's --log-dir), with the Python stack
    # of a rank that dies of a signal: the console shows LOG_RANK's output only.
    logs = Path(str(dump) + "_logs")
    env["PET_LOG_DIR"] = str(logs)
    env["PYTHONFAULTHANDLER"] = "1"
    return env


def train_command(args: list[str], dump: Path, config_file: str) -> list[str]:
    cmd = ["./run_train.sh", "--job.config_file", config_file, "--job.dump_folder", str(dump)]
    return [*cmd, *[a.replace("{dump}", str(dump.parent)) for a in args]]


def finished_run(returncode: int, output: str, dump: Path) -> Run:
    """A :class:`Run` from a launch's exit code and output (with the stacks of ranks that
    died of a signal, when it failed)."""
    losses = {int(s): float(v) for s, v in LOSS.findall(output)}
    if returncode != 0:
        output += _fatal_errors(Path(str(dump) + "_logs"))
    return Run(returncode, output, losses, dump)


_LAUNCHER = Launcher()


def run_train(
    args: list[str],
    ngpu: int,
    dump: Path,
    config_file: str,
    log_rank: int = 0,
    via: str = "launcher",
) -> Run:
    """One training run into ``dump``, through tests/support/launcher.py or, with ``via`` set to
    "run_train.sh", as a user starts it."""
    env = train_env(ngpu, dump, log_rank)
    if via == "launcher":
        command = train_command(args, dump, config_file)[1:]
        code, output = _LAUNCHER.launch(command, ngpu, env, Path(env["PET_LOG_DIR"]), 900)
        return finished_run(code, output, dump)
    if via != "run_train.sh":
        raise ValueError(f"via must be 'launcher' or 'run_train.sh', got {via!r}")
    proc = subprocess.run(
        train_command(args, dump, config_file),
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    return finished_run(proc.returncode, proc.stdout + proc.stderr, dump)


def _fatal_errors(logs: Path) -> str:
    """What faulthandler wrote for the ranks that died of a signal (their stacks)."""
    found = []
    for path in sorted(logs.rglob("stderr.log")):
        text = path.read_text(errors="replace")
        if "Fatal Python error" in text:
            found.append(f"\n--- {path}:\n{text[text.index('Fatal Python error') :][:3000]}")
    return "".join(found)


_SHARED_RUNS: dict[tuple, Run] = {}


def shared_run(
    args: list[str],
    ngpu: int,
    factory: pytest.TempPathFactory,
    config_file: str = "train_configs/debug_cpu.toml",
    log_rank: int = 0,
    via: str = "launcher",
) -> Run:
    """:func:`run_train` for a run that several tests assert on (each launch costs 20-40 s
    of start-up on CPU): launched once per session, by the first test that asks for these
    arguments, into a folder of the session's; later tests get the same :class:`Run`."""
    assert not any("{dump}" in a for a in args), "a shared run has no case folder"
    key = (tuple(args), ngpu, config_file, log_rank, via)
    if key not in _SHARED_RUNS:
        dump = factory.mktemp("shared") / "run"
        _SHARED_RUNS[key] = run_train(list(args), ngpu, dump, config_file, log_rank, via)
    return _SHARED_RUNS[key]


def run_case(
    case: OverrideDefinitions, tmp_path: Path, factory: pytest.TempPathFactory | None = None
) -> list[Run]:
    """Each run of ``case`` in order (``factory``: for its ``shared`` runs)."""
    ngpus = case.ngpu if isinstance(case.ngpu, list) else [case.ngpu] * len(case.override_args)
    runs = []
    for i, (args, ngpu) in enumerate(zip(case.override_args, ngpus, strict=True)):
        if i in case.shared:
            run = shared_run(args, ngpu, factory, case.config_file, case.log_rank, case.via)
            (tmp_path / f"run{i}").symlink_to(run.dump, target_is_directory=True)
        else:
            dump = tmp_path / f"run{i}"
            run = run_train(args, ngpu, dump, case.config_file, case.log_rank, case.via)
        assert run.returncode == 0, f"{case.test_name} run {i} failed:\n{run.output[-4000:]}"
        assert run.losses and all(math.isfinite(v) for v in run.losses.values()), run.output[-2000:]
        runs.append(run)
    return runs


CHECKPOINT = ["--checkpoint.enable", "--checkpoint.interval", "3"]
RESUME = [
    "--checkpoint.enable",
    "--checkpoint.initial_load_path",
    "{dump}/run0/checkpoint/step-3",
    "--checkpoint.no-initial_load_model_only",
]
HSDP = ["--parallelism.data_parallel_replicate_degree", "2"]
# The plain 2-rank FSDP2 (Z3) run, saving at steps 3 and 6: the reference of several cases
# here and in tests/titan/test_titan_features.py, launched once (``shared``).
PLAIN = [*SHORT, *CHECKPOINT]
PROFILE = [
    "--profiling.enable_profiling",
    "--profiling.profile_freq",
    "2",
    "--profiling.profiler_warmup",
    "0",
    "--profiling.profiler_active",
    "1",
]
HF_EXPORT = ["--checkpoint.last_save_model_only", "--checkpoint.last_save_in_hf"]
# FSDP2 Z2, otherwise the plain run, profiled on CPU and saving its last step (6) as HF
# safetensors: the fsdp_z3_z2 case's Z2 run and the export of
# test_cpu_profiling_and_hf_export_of_dedicated_matrices, launched once.
Z2_PROFILED_HF = [*PLAIN, "--dmuon.reshard_after_forward", "False", *PROFILE, *HF_EXPORT]
# AdamW alone (DMuon off), saving at steps 3 and 6: the AdamW baseline case here and the
# first run of test_resume_across_adamw_and_dmuon, launched once.
ADAMW = [*SHORT, "--optimizer.name", "AdamW", *CHECKPOINT]
# The moe case's config, named after the debug_cpu.toml that run_train names first: its
# first run is also test_config_file_named_last_is_used's.
LLAMA4_NAMED_LAST = ["--job.config_file", "train_configs/llama4_debug_moe.toml"]
MOE_SAVING = [*LLAMA4_NAMED_LAST, *SHORT, *CHECKPOINT]

CASES = {
    "fsdp_z3_z2": OverrideDefinitions(
        [PLAIN, Z2_PROFILED_HF],
        "FSDP-Z3 and FSDP-Z2 (profiled, exporting HF at the end): bit-identical losses",
        "fsdp_z3_z2",
        shared=(0, 1),
    ),
    "checkpoint_resume": OverrideDefinitions(
        [PLAIN, SHORT + RESUME],
        "Checkpoint at step 3, resume on the same topology: bit-exact losses",
        "checkpoint_resume",
        shared=(0,),
    ),
    "checkpoint_reshard": OverrideDefinitions(
        [SHORT + CHECKPOINT, SHORT + RESUME + HSDP],
        "Saved by 4 ranks FSDP-Z3, loaded by 2x2 HSDP",
        "checkpoint_reshard",
        ngpu=4,
    ),
    "compile": OverrideDefinitions(
        [PLAIN, [*SHORT, "--compile.enable", "--compile.components", "model"]],
        "Per-block torch.compile with DMuon",
        "compile",
        shared=(0,),
    ),
    "float8": OverrideDefinitions(
        [
            PLAIN,
            [
                *SHORT,
                "--model.converters",
                "quantize.linear.float8",
                "--quantize.linear.float8.emulate",
            ],
        ],
        "float8 linear layers (torchao, emulated on CPU) with DMuon",
        "float8",
        shared=(0,),
    ),
    "gradient_accumulation": OverrideDefinitions(
        [
            [*SHORT, "--training.local_batch_size", "8"],
            [*SHORT, "--training.local_batch_size", "4", "--training.global_batch_size", "16"],
        ],
        "Gradient accumulation (2 micro-batches of 4) equals one batch of 8",
        "gradient_accumulation",
    ),
    "moe": OverrideDefinitions(
        [MOE_SAVING, [*LLAMA4_NAMED_LAST, *SHORT, *RESUME]],
        "llama4 debug MoE with the stacked routed experts dedicated, MoE and experts "
        "modules as hook boundaries; checkpoint at step 3 and resume bit-exact",
        "moe",
        shared=(0,),
        via="run_train.sh",  # its first run is test_config_file_named_last_is_used's
    ),
    "adamw_baseline": OverrideDefinitions(
        [ADAMW],
        "AdamW baseline through the same train specs (DMuon off)",
        "adamw_baseline",
        shared=(0,),
    ),
}


def _values(run: Run, steps) -> list[float]:
    return [run.losses[s] for s in steps]


@pytest.mark.parametrize("name", sorted(CASES))
def test_integration(name, tmp_path, tmp_path_factory):
    case = CASES[name]
    runs = run_case(case, tmp_path, tmp_path_factory)
    steps = range(1, 7)
    if name == "fsdp_z3_z2":
        assert _values(runs[0], steps) == _values(runs[1], steps)
        # TorchTitan's comm.train_timeout_seconds (100) reaches the engine's groups too.
        assert "the engine's process groups now time out after 0:01:40" in runs[0].output
    elif name == "checkpoint_resume":
        assert sorted(runs[1].losses) == [4, 5, 6]
        assert _values(runs[1], [4, 5, 6]) == _values(runs[0], [4, 5, 6])
    elif name == "checkpoint_reshard":
        saved, hsdp = runs
        # 2x2 HSDP reads the same data as the 4 saving ranks: the curve continues.
        assert _values(hsdp, [4, 5, 6]) == pytest.approx(_values(saved, [4, 5, 6]), rel=1e-4)
    elif name == "compile":
        assert _values(runs[1], steps) == pytest.approx(_values(runs[0], steps), rel=1e-3)
    elif name == "float8":
        assert _values(runs[1], steps) == pytest.approx(_values(runs[0], steps), rel=2e-2)
    elif name == "gradient_accumulation":
        assert _values(runs[1], steps) == pytest.approx(_values(runs[0], steps), rel=1e-4)
    elif name == "moe":
        # 42 matrices + 3 MoE layers x 3 stacked weights of 8 experts each.
        assert "dedicate_params: 51 parameters (114 matrices), 12 boundaries" in runs[0].output
        assert runs[0].losses[6] < runs[0].losses[1]
        assert _values(runs[1], [4, 5, 6]) == _values(runs[0], [4, 5, 6])
    elif name == "adamw_baseline":
        assert "dmuon:" not in runs[0].output
        assert runs[0].losses[6] < runs[0].losses[1]


def test_default_config_loss_falls(tmp_path):
    """./run_train.sh with no argument: the embedded default trains and its loss falls."""
    run = run_train([], 2, tmp_path / "default", "train_configs/debug_cpu.toml", via="run_train.sh")
    assert run.returncode == 0, run.output[-4000:]
    steps = sorted(run.losses)
    assert steps[-1] == 60
    first, last = run.losses[steps[0]], run.losses[steps[-1]]
    assert last < first - 1.0, run.losses
    assert "dmuon: optimizer step" in run.output and "owner balance" in run.output


BAD_INPUT = [
    (["--dmuon.bogus", "1"], 2, "Unrecognized options"),
    (["--dmuon.params", "layers.*.nonexistent.weight"], 2, "matches no parameter"),
    (["--dmuon.params", "layers.*.attention_norm.weight"], 2, "only 2-D matrices"),
    (["--parallelism.expert_parallel_degree", "2"], 2, "needs a MoE model"),
    # llama4_debug_moe.toml runs with expert parallelism 2.
    ([*LLAMA4_NAMED_LAST, "--dmuon.params", "layers.*.moe.experts.w9"], 2, "matches no parameter"),
    # A split-backward (zero-bubble) schedule with FSDP: refused, naming the workaround.
    (
        [
            "--parallelism.pipeline_parallel_degree",
            "2",
            "--parallelism.pipeline_parallel_schedule",
            "ZBVZeroBubble",
            "--parallelism.data_parallel_shard_degree",
            "2",
        ],
        4,
        "--parallelism.data_parallel_replicate_degree N",
    ),  # fmt: skip
]


@pytest.mark.parametrize("args, ngpu, message", BAD_INPUT)
def test_bad_input_fails_before_training(args, ngpu, message, tmp_path):
    run = run_train([*SHORT[:2], *args], ngpu, tmp_path / "bad", "train_configs/debug_cpu.toml")
    assert run.returncode != 0
    assert message in run.output
    assert not run.losses


def test_unknown_dmuon_key_in_toml(tmp_path):
    config = (ROOT / "train_configs/debug_cpu.toml").read_text()
    bad = tmp_path / "bad.toml"
    bad.write_text(config.replace("[dmuon]\n", "[dmuon]\nns_stepz = 3\n"))
    run = run_train([], 2, tmp_path / "bad", str(bad))
    assert run.returncode != 0 and "Invalid field names" in run.output and "ns_stepz" in run.output


def test_train_configs_parse():
    """Every shipped config parses with the [dmuon] section (GPU ones are not run here),
    with no flag but the file: each names its ``[job] custom_config_module``, so any
    launcher runs it. In this process: the parser is the one the trainer runs, and
    TorchTitan is already imported here (a subprocess would spend seconds importing it)."""
    from torchtitan.config import ConfigManager

    lines = []
    for path in sorted((ROOT / "train_configs").glob("*.toml")):
        cfg = ConfigManager().parse_args(["--job.config_file", str(path)])
        assert cfg.job.custom_config_module == "torchtitan_dmuon.titan.config", path
        assert cfg.optimizer.name == "DMuon", path
        lines.append(
            f"{path.relative_to(ROOT)} {cfg.model.name} {cfg.model.flavor} "
            f"{cfg.dmuon.reshard_after_forward} {cfg.parallelism.data_parallel_replicate_degree} "
            f"{cfg.parallelism.expert_parallel_degree}"
        )
    assert len(lines) == len(list((ROOT / "train_configs").glob("*.toml")))
    assert any("llama3_8b_hsdp_z3.toml llama3 8B True 2 1" in line for line in lines)
    assert any("qwen3_8b_fsdp_z2.toml qwen3 8B False 1 1" in line for line in lines)
    assert any("qwen3_30b_a3b_ep8.toml qwen3 30B-A3B True 1 8" in line for line in lines)
    assert any("deepseek_v3_16b_ep8.toml deepseek_v3 16B True 1 8" in line for line in lines)
    assert any("qwen3_debug_moe.toml qwen3 debugmodel_moe True 1 2" in line for line in lines)


@pytest.mark.slow
def test_torchrun_alone_trains_a_shipped_config(tmp_path, tmp_path_factory):
    """A shipped config started by torchrun directly (as cluster launchers and
    TorchTitan's own script do: no run_train.sh, no flag naming the [dmuon] config
    module) trains, with the plain run's losses (through the project's launcher) bitwise."""
    plain = shared_run(PLAIN, 2, tmp_path_factory)
    dump = tmp_path / "torchrun"
    command = [
        str(ROOT / ".venv/bin/torchrun"), "--nproc_per_node=2", "--rdzv_backend", "c10d",
        "--rdzv_endpoint", "localhost:0", "--local-ranks-filter", "0", "--role", "rank",
        "--tee", "3", "-m", "torchtitan_dmuon.titan.train",
        "--job.config_file", "train_configs/debug_cpu.toml", "--job.dump_folder", str(dump),
        *PLAIN,
    ]  # fmt: skip
    proc = subprocess.run(
        command, cwd=ROOT, env=train_env(2, dump), capture_output=True, text=True, timeout=900
    )
    run = finished_run(proc.returncode, proc.stdout + proc.stderr, dump)
    assert run.returncode == 0, run.output[-4000:]
    assert plain.returncode == 0, plain.output[-4000:]
    assert sorted(run.losses) == [1, 2, 3, 4, 5, 6]
    assert run.losses == plain.losses


def test_config_file_named_last_is_used(tmp_path_factory):
    """TorchTitan's parser keeps the first --job.config_file; run_train.sh the last: the moe
    case's first run names debug_cpu.toml, then llama4_debug_moe.toml, and trains llama4."""
    run = shared_run(MOE_SAVING, 2, tmp_path_factory, via="run_train.sh")
    assert run.returncode == 0, run.output[-3000:]
    assert "Building llama4 debugmodel" in run.output and "Building llama3" not in run.output


# Per MoE config: (2-D matrices, 3-D expert stacks) its [dmuon] params select.
MOE_SELECTIONS = {
    "llama4_debug_moe.toml": (42, 9),
    "deepseek_v3_debug_moe.toml": (42, 15),
    "qwen3_debug_moe.toml": (32, 24),
    "qwen3_30b_a3b_ep8.toml": (48 * 4, 48 * 3),
    "deepseek_v3_16b_ep8.toml": (27 * 4 + 3 + 26 * 3, 26 * 3),
    "gpt_oss_20b_ep8.toml": (24 * 4, 24 * 2),
}


@pytest.mark.parametrize("config_name", sorted(MOE_SELECTIONS))
def test_moe_configs_select_what_a_muon_user_would(config_name):
    """Each MoE config's [dmuon] params, on its model built on the meta device (GPU
    models included): every pattern matches, the selection is the attention and FFN /
    expert weight matrices and the routed-expert stacks, and never a bias, an attention
    sink, a norm, the router gate, the embeddings or the output head."""

    from torchtitan_dmuon.engine.plan import select_matrices
    from torchtitan_dmuon.titan.parallelize import muon_predicate

    cfg, model = _meta_model("--job.config_file", str(ROOT / "train_configs" / config_name))
    selected = select_matrices(model, muon_predicate(cfg.dmuon))
    names = [name for name, _ in selected]
    for pattern in cfg.dmuon.params:
        assert any(fnmatch.fnmatchcase(n, pattern) for n in names), pattern
    kept_on_adamw = ("bias", "sinks", "norm", "router", "embeddings", "output")
    assert not [n for n in names if any(word in n for word in kept_on_adamw)]
    stacks = [n for n, p in selected if p.ndim == 3]
    assert all(".moe.experts." in n for n in stacks)
    assert (len(selected) - len(stacks), len(stacks)) == MOE_SELECTIONS[config_name]
    # The model's default selection ([dmuon] params and hook_boundaries unset) is the same.
    unset = copy.deepcopy(cfg)
    unset.dmuon = dataclasses.replace(cfg.dmuon, params=[], hook_boundaries=[])
    default = resolve_selection(model, unset)
    assert [n for n, _ in select_matrices(model, muon_predicate(default))] == names
    assert default.hook_boundaries == cfg.dmuon.hook_boundaries
    assert unset.dmuon is default  # one selection for every part and the optimizer


def test_named_params_keep_the_models_hook_boundaries(caplog):
    """``[dmuon] params`` named and ``hook_boundaries`` left empty (qwen3's MoE debug
    config without its hook_boundaries line): the model's own boundaries (its MoE and
    expert modules) still apply, and the log says so; they were dropped (the blocks
    only) before."""
    cfg, model = _meta_model("--job.config_file", str(ROOT / "train_configs/qwen3_debug_moe.toml"))
    named = copy.deepcopy(cfg)
    named.dmuon = dataclasses.replace(cfg.dmuon, hook_boundaries=[])
    with caplog.at_level("INFO", logger="torchtitan_dmuon.titan.parallelize"):
        resolved = resolve_selection(model, named)
    assert resolved.params == cfg.dmuon.params
    assert resolved.hook_boundaries == ["layers.*.moe", "layers.*.moe.experts"]
    assert named.dmuon is resolved
    assert "[dmuon] hook_boundaries unset: model qwen3 (debugmodel_moe)'s own" in caplog.text


def _meta_model(*args: str):
    """TorchTitan's JobConfig from ``args`` (with [dmuon]) and its model on meta."""
    from torchtitan.config import ConfigManager
    from torchtitan.protocols.train_spec import get_train_spec

    cfg = ConfigManager().parse_args(
        [*args, "--job.custom_config_module", "torchtitan_dmuon.titan.config"]
    )
    spec = get_train_spec(cfg.model.name)
    model_args = copy.deepcopy(spec.model_args[cfg.model.flavor])
    model_args.update_from_config(cfg)  # as the trainer does
    with torch.device("meta"):
        model = spec.model_cls(model_args)
    return cfg, model


# (model, flavor): (2-D matrices, 3-D expert stacks) of its default selection.
DEFAULT_SELECTIONS = {
    ("llama3", "debugmodel"): (42, 0),
    ("llama3", "8B"): (32 * 7, 0),
    ("qwen3", "debugmodel"): (56, 0),
    ("qwen3", "debugmodel_moe"): (32, 24),
    ("llama4", "debugmodel"): (42, 9),
    ("deepseek_v3", "debugmodel"): (42, 15),
    ("deepseek_v3", "671B"): (61 * 5 + 3 * 3 + 58 * 3, 58 * 3),  # wq_a and wq_b: query LoRA
    ("gpt_oss", "debugmodel"): (16, 8),
}


@pytest.mark.parametrize("model_flavor", sorted(DEFAULT_SELECTIONS))
def test_each_model_has_a_default_selection(model_flavor):
    """With the default config (llama3's patterns left out, [dmuon] params unset) each
    model DMuon wraps selects its attention, FFN and expert matrices; a pattern that
    matches nothing names the model and its default selection."""
    from torchtitan_dmuon.engine.plan import select_matrices
    from torchtitan_dmuon.titan.parallelize import muon_predicate

    name, flavor = model_flavor
    cfg, model = _meta_model("--model.name", name, "--model.flavor", flavor)
    cfg.dmuon = dataclasses.replace(cfg.dmuon, params=[])
    selected = select_matrices(model, muon_predicate(resolve_selection(model, cfg)))
    stacks = [n for n, p in selected if p.ndim == 3]
    assert (len(selected) - len(stacks), len(stacks)) == DEFAULT_SELECTIONS[model_flavor]
    kept_on_adamw = ("bias", "sinks", "norm", "router", "embeddings", "output")
    assert not [n for n, _ in selected if any(word in n for word in kept_on_adamw)]

    cfg.dmuon = dataclasses.replace(cfg.dmuon, params=["layers.*.nonexistent.weight"])
    with pytest.raises(ValueError) as error:
        resolve_selection(model, cfg)
    message = str(error.value)
    assert f"matches no parameter of model {name} ({flavor})" in message
    assert "its default selection (leave [dmuon] params empty) is ['layers.*.attention" in message
