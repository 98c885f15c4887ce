"""Muon's variants through ./run_train.sh: NorMuon (``--dmuon.variant normuon``) on the
llama4 debug MoE, trained under FSDP 2 x TP 2 x EP 2 with expert tensor parallelism 2
(every kind of layout its second moments take: whole, rows split, columns split, expert
pieces split either way), and its checkpoints across layouts."""

from __future__ import annotations

import pytest

from tests.test_titan_expert_parallel import AFTER_SAVE, ETP2, LLAMA4, SAVED_AT, STEPS, ep
from tests.test_titan_integration import run_train, shared_run
from tests.test_titan_pipeline import from_seed, resume_from

NORMUON = ["--dmuon.variant", "normuon"]


@pytest.mark.slow
def test_normuon_trains_under_expert_tensor_parallelism_and_checkpoints_cross(
    tmp_path_factory, tmp_path
):
    """NorMuon at FSDP 2 x TP 2 x EP 2 x ETP 2 (4 ranks) trains and differs from Muon; its
    step-3 checkpoint (momentum and second moments: the column-split experts' rows saved
    once) resumes at FSDP 2 without TP or EP (2 ranks) within 1e-4 of the run it came from,
    and in the same layout bitwise: every TP rank of a
    column-split expert gets the rows only one of them loaded."""
    # Before from_seed's: resume_from keeps the arguments up to the seed's path.
    common = [*NORMUON, *from_seed(tmp_path_factory, LLAMA4, len(STEPS))]
    etp = run_train([*common, *ep(2, *ETP2)], 4, tmp_path / "etp", LLAMA4)
    assert etp.returncode == 0, etp.output[-4000:]
    assert sorted(etp.losses) == list(STEPS)
    assert etp.losses[6] < etp.losses[1] - 0.2
    assert "Muon: NorMuon, each update normalized per row (second-moment beta2 0.95)" in etp.output
    muon = shared_run(
        [*from_seed(tmp_path_factory, LLAMA4, len(STEPS)), *ep(2, *ETP2)], 4, tmp_path_factory,
        LLAMA4,
    )  # fmt: skip
    assert muon.returncode == 0, muon.output[-4000:]
    assert abs(muon.losses[6] - etp.losses[6]) > 1e-3

    checkpoint = etp.dump / "checkpoint" / f"step-{SAVED_AT}"
    resume = resume_from(checkpoint, common)
    fsdp = run_train([*resume, *ep(1)], 2, tmp_path / "fsdp", LLAMA4)
    same = run_train([*resume, *ep(2, *ETP2)], 4, tmp_path / "same", LLAMA4)
    for run in (fsdp, same):
        assert run.returncode == 0, run.output[-4000:]
        assert sorted(run.losses) == list(AFTER_SAVE)
        assert "Muon: NorMuon" in run.output
    expected = [etp.losses[s] for s in AFTER_SAVE]
    assert [fsdp.losses[s] for s in AFTER_SAVE] == pytest.approx(expected, rel=1e-4)
    assert [same.losses[s] for s in AFTER_SAVE] == expected
