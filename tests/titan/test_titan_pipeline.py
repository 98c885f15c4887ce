"""Pipeline parallelism with DMuon through ./run_train.sh: TorchTitan's own pipeline cases
(tests/integration_tests/features.py of v0.2.2, with their overrides), each schedule with
data parallelism added, equality across pipeline degrees, and checkpoints across them."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from tests.titan.test_titan_integration import OverrideDefinitions, run_case, run_train, shared_run

STEPS4 = ["--training.steps", "4", "--metrics.log_freq", "1"]
GRAD_NORM = re.compile(r"grad_norm:\s*(\S+)")
FP32_NS = ["--dmuon.ns_dtype", "float32", "--dmuon.ns_backend", "torch"]
CONFIG = "train_configs/debug_cpu.toml"


def pp(degree: int, schedule: str, *more: str) -> list[str]:
    return [
        "--parallelism.pipeline_parallel_degree",
        str(degree),
        "--parallelism.pipeline_parallel_schedule",
        schedule,
        *more,
    ]


DP1 = ["--parallelism.data_parallel_shard_degree", "1"]
DP2 = ["--parallelism.data_parallel_shard_degree", "2"]
# Data parallelism without FSDP (DMuon's DDP-style sync): what split-backward schedules
# need, as DMuon refuses them with FSDP (torch 2.13's weight pass breaks FSDP's gradients).
REPLICATE2 = ["--parallelism.data_parallel_replicate_degree", "2", *DP1]
CSV = ["--parallelism.pipeline_parallel_schedule_csv", "./tests/assets/pp_schedule_4mb.csv"]

# TorchTitan's cases, with its overrides (its CSV has 8 micro-batches, our debug config 4:
# tests/assets/pp_schedule_4mb.csv is the same kind of split-backward looped schedule), and
# the same schedules with 2 data-parallel ranks added (FSDP; the split-backward ones
# DDP-style, REPLICATE2). log_rank: a rank holding the last stage, the only one that logs
# the loss.
# TorchTitan's pp_dp_1f1b_layers_per_stage (1F1B, 4 layers per stage, PP 2 x DP 2) is the
# 1F1B run of test_pipeline_equals_data_parallel_and_checkpoints_cross_pp, checked there,
# and so is ZBV with replicate 2 (its zero-bubble run).
CASES = {
    "pp_gpipe": OverrideDefinitions([pp(2, "GPipe", *DP1)], "PP 1D GPipe", "pp_gpipe", log_rank=1),
    "pp_1f1b": OverrideDefinitions([pp(2, "1F1B", *DP1)], "PP 1D 1F1B", "pp_1f1b", log_rank=1),
    "pp_zbv": OverrideDefinitions([pp(2, "ZBVZeroBubble")], "PP ZBV", "pp_zbv", log_rank=0),
    "pp_custom_csv": OverrideDefinitions(
        [pp(2, "PipelineScheduleMulti", *CSV)], "PP CSV schedule", "pp_custom_csv", log_rank=1
    ),
    # 8 stages for 6 layers: the first holds only the embeddings, the last only the norm
    # and the output, so those two parts are AdamW alone.
    "pp_looped_1f1b": OverrideDefinitions(
        [pp(4, "Interleaved1F1B")], "PP looped 1F1B", "pp_looped_1f1b", ngpu=4, log_rank=3
    ),
    "pp_looped_1f1b_layers_per_stage": OverrideDefinitions(
        [pp(4, "Interleaved1F1B", "--parallelism.pipeline_parallel_layers_per_stage", "1")],
        "PP looped 1F1B, one layer per stage",
        "pp_looped_1f1b_layers_per_stage",
        ngpu=4,
        log_rank=3,
    ),
    "pp_looped_zero_bubble": OverrideDefinitions(
        [pp(4, "InterleavedZeroBubble")],
        "PP looped zero bubble",
        "pp_looped_zero_bubble",
        ngpu=4,
        log_rank=3,
    ),
    "looped_1f1b_dp2": OverrideDefinitions(
        [pp(2, "Interleaved1F1B", *DP2)],
        "PP looped 1F1B + DP 2",
        "looped_1f1b_dp2",
        ngpu=4,
        log_rank=2,
    ),
    "looped_zero_bubble_replicate2": OverrideDefinitions(
        [pp(2, "InterleavedZeroBubble", *REPLICATE2)],
        "PP looped zero bubble + replicate 2",
        "looped_zero_bubble_replicate2",
        ngpu=4,
        log_rank=2,
    ),
    "custom_csv_replicate2": OverrideDefinitions(
        [pp(2, "PipelineScheduleMulti", *CSV, *REPLICATE2)],
        "PP CSV schedule + replicate 2",
        "custom_csv_replicate2",
        ngpu=4,
        log_rank=2,
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_pipeline_case_trains(name, tmp_path):
    """Each case trains with DMuon: 4 steps, a finite falling loss on the last stage."""
    case = CASES[name]
    (run,) = run_case(
        OverrideDefinitions(
            [[*STEPS4, *case.override_args[0]]],
            case.test_descr,
            name,
            ngpu=case.ngpu,
            log_rank=case.log_rank,
        ),
        tmp_path,
    )
    assert sorted(run.losses) == [1, 2, 3, 4], run.output[-3000:]
    assert run.losses[4] < run.losses[1]
    assert "dmuon: optimizer step" in run.output
    if "DP 2" in case.test_descr:
        # Z2 by default under PP: one broadcast per unit per step.
        assert re.search(r"dedicate_params: .* Z2", run.output), run.output[-3000:]


def seed_checkpoint(factory: pytest.TempPathFactory, config_file: str = CONFIG) -> Path:
    """One rank's initial weights: pipeline stages seed their initialization per stage, and
    an expert-parallel stack initializes otherwise than a whole one, so runs of different
    pipeline or expert-parallel degrees start equal only from a seed checkpoint (as
    TorchTitan's own PP tests do). Created once per session and config (the TP tests
    start from the default config's too)."""
    run = shared_run(
        [
            *STEPS4[:2],
            "--checkpoint.enable",
            "--checkpoint.create_seed_checkpoint",
            "--training.steps",
            "1",
            *DP1,
            "--parallelism.expert_parallel_degree",
            "1",
        ],
        1,
        factory,
        config_file,
    )
    assert run.returncode == 0, run.output[-3000:]
    return run.dump / "checkpoint" / "step-0"


# The runs compared from a seed checkpoint: their steps, and the step whose checkpoint
# the resumed runs start from.
SEED_STEPS = range(1, 7)
SAVED_AT = 3
AFTER_SAVE = range(SAVED_AT + 1, SEED_STEPS[-1] + 1)


def from_seed(
    factory: pytest.TempPathFactory, config_file: str = CONFIG, steps: int = SEED_STEPS[-1]
) -> list[str]:
    """The arguments of the runs compared from the seed checkpoint (``steps`` of them):
    fp32 Newton-Schulz, the loss logged every step, a checkpoint every ``steps // 2``
    steps (``SAVED_AT`` by default)."""
    return [
        "--training.steps", str(steps), "--metrics.log_freq", "1", *FP32_NS,
        "--checkpoint.enable", "--checkpoint.interval", str(steps // 2),
        "--checkpoint.initial_load_path", str(seed_checkpoint(factory, config_file)),
        "--checkpoint.initial_load_model_only",
    ]  # fmt: skip


def resume_from(checkpoint: Path, common: list[str]) -> list[str]:
    """``common`` (:func:`from_seed`'s), resuming from ``checkpoint`` with its optimizer."""
    return [
        *common[: common.index("--checkpoint.initial_load_path")],
        "--checkpoint.initial_load_path",
        str(checkpoint),
        "--checkpoint.no-initial_load_model_only",
    ]


def data_parallel_reference(factory: pytest.TempPathFactory):
    """DMuon FSDP 2 without PP or TP (2 ranks) over ``SEED_STEPS`` from the seed checkpoint: the
    reference of the PP and the TP equality tests, launched once per session."""
    return shared_run([*from_seed(factory), *DP2], 2, factory)


def test_pipeline_equals_data_parallel_and_checkpoints_cross_pp(tmp_path, tmp_path_factory):
    """DMuon PP 2 x DP 2 (GPipe and 1F1B with FSDP, ZBV zero bubble with DDP-style data
    parallelism; 4 ranks) equals DMuon PP 1 x DP 2 (2 ranks, same data) within 1e-4 over
    6 steps; a checkpoint saved at PP 2 resumes bit-exact at PP 2
    and continues within 1e-4 at PP 1.

    The 1F1B run is TorchTitan's pp_dp_1f1b_layers_per_stage case (4 layers per stage:
    the same two stages as the default split): its loss falls, DMuon steps, Z2 by default.

    Equal gradients need DMuon's trainer: TorchTitan 0.2.2 back-propagates a pipeline's
    summed loss, not divided by the global token count as without PP, which DMuon undoes
    before clipping (the grad norms logged by the runs agree too).
    """
    common = from_seed(tmp_path_factory)
    config = "train_configs/debug_cpu.toml"
    reference = data_parallel_reference(tmp_path_factory)
    gpipe = run_train([*common, *pp(2, "GPipe", *DP2)], 4, tmp_path / "gpipe", config, 2)
    layers_per_stage = ["--parallelism.pipeline_parallel_layers_per_stage", "4"]
    one_f_one_b = run_train(
        [*common, *pp(2, "1F1B", *layers_per_stage, *DP2)], 4, tmp_path / "1f1b", config, 2
    )
    # Zero bubble with DMuon's DDP-style data parallelism (FSDP2's own parameters get
    # wrong gradients from torch's zero-bubble weight pass; TorchTitan refuses its DDP).
    zbv = run_train([*common, *pp(2, "ZBVZeroBubble", *REPLICATE2)], 4, tmp_path / "zbv", config)
    steps = list(SEED_STEPS)
    for run in (reference, gpipe, one_f_one_b, zbv):
        assert run.returncode == 0, run.output[-3000:]
        assert sorted(run.losses) == steps and all(map(math.isfinite, run.losses.values()))
    expected = [reference.losses[s] for s in steps]
    assert [gpipe.losses[s] for s in steps] == pytest.approx(expected, rel=1e-4)
    assert [one_f_one_b.losses[s] for s in steps] == pytest.approx(expected, rel=1e-4)
    assert [zbv.losses[s] for s in steps] == pytest.approx(expected, rel=1e-4)
    assert one_f_one_b.losses[steps[-1]] < one_f_one_b.losses[1]
    assert "dmuon: optimizer step" in one_f_one_b.output
    # Z2 by default under PP: one broadcast per unit per step.
    assert re.search(r"dedicate_params: .* Z2", one_f_one_b.output), one_f_one_b.output[-3000:]
    norms = [float(n) for n in GRAD_NORM.findall(reference.output)]
    assert len(norms) == len(steps)
    assert [float(n) for n in GRAD_NORM.findall(gpipe.output)] == pytest.approx(norms, rel=1e-3)

    saved = tmp_path / "1f1b" / "checkpoint" / f"step-{SAVED_AT}"
    assert saved.is_dir()
    resume = resume_from(saved, common)
    # Resumed with TorchTitan's default split (the same two stages).
    same = run_train([*resume, *pp(2, "1F1B", *DP2)], 4, tmp_path / "resume_pp2", config, 2)
    flat = run_train([*resume, *DP2], 2, tmp_path / "resume_pp1", config)
    later = list(AFTER_SAVE)
    for run in (same, flat):
        assert run.returncode == 0, run.output[-3000:]
        assert sorted(run.losses) == later, run.output[-3000:]
    assert [same.losses[s] for s in later] == [one_f_one_b.losses[s] for s in later]
    assert [flat.losses[s] for s in later] == pytest.approx(
        [one_f_one_b.losses[s] for s in later], rel=1e-4
    )
