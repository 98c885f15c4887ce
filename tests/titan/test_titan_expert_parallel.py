"""Expert parallelism with DMuon through ./run_train.sh on 2 and 4 CPU ranks.

Routed experts sharded over the ``ep`` mesh are dedicated over the ranks that hold the
same experts (``efsdp``, and the replicate group under HSDP), the dense matrices over the
whole data-parallel layout. Runs of different expert-parallel degrees start from one seed
checkpoint (an expert-parallel stack initializes otherwise than a whole one) and must
follow the same curve: the math does not depend on the layout.
"""

from __future__ import annotations

import re

import pytest

from tests.titan.test_titan_integration import run_train, shared_run
from tests.titan.test_titan_pipeline import from_seed, resume_from

LLAMA4 = "train_configs/llama4_debug_moe.toml"
# Layouts are compared over 6 steps (the resumed runs from the step-3 checkpoint).
STEPS = range(1, 7)
SAVED_AT = 3
AFTER_SAVE = range(4, 7)
DEEPSEEK = "train_configs/deepseek_v3_debug_moe.toml"
HSDP_2X2 = [
    "--parallelism.data_parallel_replicate_degree", "2",
    "--parallelism.data_parallel_shard_degree", "2",
    "--dmuon.replicate_async",
]  # fmt: skip
TP2 = ["--parallelism.tensor_parallel_degree", "2"]
ETP2 = [*TP2, "--parallelism.expert_tensor_parallel_degree", "2"]
BALANCE = re.compile(
    r"per-rank Newton-Schulz cost max/mean (\S+), held dedicated bytes "
    r"\(values \+ masters \+ momentum\) max/mean (\S+)"
)


def ep(degree: int, *more: str) -> list[str]:
    return ["--parallelism.expert_parallel_degree", str(degree), *more]


def _ep_runs(
    factory: pytest.TempPathFactory,
    config: str,
    *layouts: list[str],
    ngpu: int = 4,
    log_rank: int = 0,
):
    """``STEPS`` from the config's seed checkpoint on ``ngpu`` ranks, per layout (shared);
    ``log_rank`` logs the loss (under PP: a rank of the last stage)."""
    common = from_seed(factory, config, len(STEPS))
    runs = [shared_run([*common, *layout], ngpu, factory, config, log_rank) for layout in layouts]
    for run in runs:
        assert run.returncode == 0, run.output[-4000:]
    return runs


def _losses(run, steps) -> list[float]:
    return [run.losses[s] for s in steps]


def test_llama4_expert_parallel_follows_ep1(tmp_path_factory):
    """llama4 debug MoE: EP 2 (efsdp 2) and HSDP 2 x 2 with EP 2 (efsdp 1, the replicate
    group as the experts' second stage) follow EP 1 within rtol 1e-4 over 6 steps;
    the two dedication domains are balanced together."""
    ep1, ep2, hsdp = _ep_runs(tmp_path_factory, LLAMA4, ep(1), ep(2), ep(2, *HSDP_2X2))
    for run in (ep2, hsdp):
        assert _losses(run, STEPS) == pytest.approx(_losses(ep1, STEPS), rel=1e-4)
    assert ep1.losses[6] < ep1.losses[1] - 0.2
    assert "local experts dedicated over 1 x 2 ranks (replicate x efsdp)" in ep2.output
    assert "local experts dedicated over 2 x 1 ranks (replicate x efsdp)" in hsdp.output
    assert "expert parallelism" not in ep1.output
    # 42 matrices + 3 MoE layers x 3 stacks of 8 experts, counted alike under EP.
    for run in (ep1, ep2):
        assert "dedicate_params: 51 parameters (114 matrices)" in run.output
    ns_cost, held = map(float, BALANCE.search(ep2.output).groups())
    assert ns_cost <= 1.10 and held <= 1.25, (ns_cost, held)


def _fsdp2_and_tensor_parallel(factory: pytest.TempPathFactory):
    """FSDP 2 with EP 1 (2 ranks), and on 4 ranks FSDP 2 x TP 2 with EP 1 (TorchTitan
    splits each expert's matrices over the TP ranks) and with EP 2, with expert tensor
    parallelism 1 and 2: the same data-parallel degree, so the same batches."""
    (fsdp,) = _ep_runs(factory, LLAMA4, ep(1), ngpu=2)
    tensor_parallel, etp1, etp2 = _ep_runs(factory, LLAMA4, ep(1, *TP2), ep(2, *TP2), ep(2, *ETP2))
    return fsdp, tensor_parallel, etp1, etp2


def test_llama4_expert_parallel_with_tensor_parallel(tmp_path_factory):
    """FSDP 2 x TP 2 follows FSDP 2 (EP 1) over 6 steps, with EP 1 (each expert's
    matrices split over the TP ranks, every rank holding every expert: pieces dedicated
    over the FSDP ranks, each in TP shards that the owner column's TP ranks orthogonalize
    together) within rtol 1e-4, and with EP 2: expert tensor parallelism 1 (the ep mesh
    borrows the TP ranks; each rank's routed experts stay whole while the other matrices
    are split) and 2 (each expert's matrices split over the TP ranks too). EP 2 within
    5e-4: its token split over the TP ranks changes the rounding, which a top-1 router
    amplifies (over 10 steps by hand, etp 1 came within 2.8e-4, at steps 7-8); FSDP2 +
    AdamW differs more in the same comparison (1.2e-3 at step 10, from the same seed)."""
    fsdp, tensor_parallel, etp1, etp2 = _fsdp2_and_tensor_parallel(tmp_path_factory)
    expected = _losses(fsdp, STEPS)
    assert _losses(tensor_parallel, STEPS) == pytest.approx(expected, rel=1e-4)
    for run in (etp1, etp2):
        assert _losses(run, STEPS) == pytest.approx(expected, rel=5e-4)
    for run in (tensor_parallel, etp1):
        assert "local experts dedicated over 1 x 2 ranks" in run.output
    assert "local experts dedicated over 1 x 1 ranks" in etp2.output
    # The routed experts' 3-D stacks (3 MoE layers x 3) counted as 8 matrices each.
    assert "dedicate_params: 51 parameters (114 matrices)" in tensor_parallel.output
    for run in (tensor_parallel, etp2):
        assert "tensor-parallel Newton-Schulz of (256, 256)" in run.output


def test_llama4_checkpoints_resume_across_expert_parallel_degrees(tmp_path_factory, tmp_path):
    """A checkpoint saved at EP 2 resumes at EP 1 (4 ranks); one saved at EP 1 (FSDP 2)
    resumes at EP 2 with expert tensor parallelism 2 (FSDP 2 x TP 2, each expert's piece
    in TP shards); one saved under FSDP 2 x TP 2 with EP 1 (pieces in TP shards) resumes
    at FSDP 2 without TP: values and momentum of each expert, saved once by its owner;
    the curve continues (rtol 1e-4; 5e-4 into EP 2 under TP, see above)."""
    _, ep2 = _ep_runs(tmp_path_factory, LLAMA4, ep(1), ep(2))
    fsdp, tensor_parallel, _, _ = _fsdp2_and_tensor_parallel(tmp_path_factory)
    common = from_seed(tmp_path_factory, LLAMA4, len(STEPS))
    resumes = (
        (ep2, ep(1), 4, ep2, 1e-4),
        (fsdp, ep(2, *ETP2), 4, fsdp, 5e-4),
        (tensor_parallel, ep(1), 2, fsdp, 1e-4),
    )
    for i, (saved, layout, ngpu, reference, rtol) in enumerate(resumes):
        resumed = run_train(
            [*resume_from(saved.dump / "checkpoint" / f"step-{SAVED_AT}", common), *layout],
            ngpu,
            tmp_path / f"resume{i}",
            LLAMA4,
        )
        assert resumed.returncode == 0, resumed.output[-4000:]
        assert sorted(resumed.losses) == list(AFTER_SAVE)
        expected = _losses(reference, AFTER_SAVE)
        assert _losses(resumed, AFTER_SAVE) == pytest.approx(expected, rel=rtol)


def test_deepseek_v3_expert_parallel_follows_ep1(tmp_path_factory):
    """deepseek_v3 debug MoE (multi-head latent attention, 8 routed experts top-3 and 2
    shared) through its own train spec: the matrices the config names are dedicated (6
    layers x 4 attention projections, one dense FFN, 5 MoE layers x 3 shared-expert
    matrices and 3 stacks of 8 routed experts). On 2 ranks, EP 2 under Z2 follows EP 1
    under Z3 within rtol 1e-4 over 6 steps; FSDP 2 x TP 2 with EP 2 and expert tensor
    parallelism 2 (4 ranks; TorchTitan replicates wkv_a over the TP ranks, which the
    engine dedicates whole) within 5e-4 (TP rounding, as for llama4; 2e-4 at step 6 in a
    manual run)."""
    ep1, ep2 = _ep_runs(
        tmp_path_factory,
        DEEPSEEK,
        ep(1),
        ep(2, "--dmuon.reshard_after_forward", "False"),
        ngpu=2,
    )
    (tensor_parallel,) = _ep_runs(tmp_path_factory, DEEPSEEK, ep(2, *ETP2))
    assert _losses(ep2, STEPS) == pytest.approx(_losses(ep1, STEPS), rel=1e-4)
    assert _losses(tensor_parallel, STEPS) == pytest.approx(_losses(ep1, STEPS), rel=5e-4)
    assert ep1.losses[6] < ep1.losses[1] - 0.2
    for run in (ep1, ep2, tensor_parallel):
        assert "dedicate_params: 57 parameters (162 matrices)" in run.output
    assert re.search(r"dedicate_params: .* Z3", ep1.output)
    assert re.search(r"dedicate_params: .* Z2", ep2.output)
    assert "local experts dedicated over 1 x 1 ranks (replicate x efsdp)" in ep2.output


PP2 = [
    "--parallelism.pipeline_parallel_degree", "2",
    "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B",
]  # fmt: skip


@pytest.mark.slow
def test_llama4_pipeline_with_expert_parallel_follows_no_pipeline(tmp_path_factory, tmp_path):
    """PP 2 (Interleaved1F1B: 4 stages, as TorchTitan's MoE pipeline cases) x FSDP 2 with
    EP 2 (4 ranks) follows FSDP 2 without PP within rtol 1e-4 over 6 steps; with TP 2 and
    expert TP 1 or 2 (8 ranks) it follows the same layout without PP (FSDP 2 x TP 2 x EP 2)
    within 1e-4. Each stage dedicates its own experts over its efsdp ranks. The PP x EP
    step-3 checkpoint resumes without PP or EP (FSDP 2) and continues within 1e-4."""
    fsdp, _, etp1, etp2 = _fsdp2_and_tensor_parallel(tmp_path_factory)
    common = from_seed(tmp_path_factory, LLAMA4, len(STEPS))
    # The last stage logs the loss: on the second half of the ranks (pp is outermost).
    (pp_ep,) = _ep_runs(tmp_path_factory, LLAMA4, [*PP2, *ep(2)], log_rank=2)
    pp_etp = _ep_runs(
        tmp_path_factory, LLAMA4, [*PP2, *ep(2, *TP2)], [*PP2, *ep(2, *ETP2)], ngpu=8, log_rank=4
    )
    for run in (pp_ep, *pp_etp):
        assert "dedicate_params: " in run.output
    assert _losses(pp_ep, STEPS) == pytest.approx(_losses(fsdp, STEPS), rel=1e-4)
    for run, reference in zip(pp_etp, (etp1, etp2), strict=True):
        assert _losses(run, STEPS) == pytest.approx(_losses(reference, STEPS), rel=1e-4)
    resumed = run_train(
        [*resume_from(pp_ep.dump / "checkpoint" / f"step-{SAVED_AT}", common), *ep(1)],
        2,
        tmp_path / "resumed",
        LLAMA4,
    )
    assert resumed.returncode == 0, resumed.output[-4000:]
    assert sorted(resumed.losses) == list(AFTER_SAVE)
    assert _losses(resumed, AFTER_SAVE) == pytest.approx(_losses(fsdp, AFTER_SAVE), rel=1e-4)
