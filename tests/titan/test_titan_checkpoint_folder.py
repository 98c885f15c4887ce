"""A run that would resume another optimizer's checkpoint is refused before it starts
(``titan.checkpoint.claim_checkpoint_folder``): the README's comparison run
(``--optimizer.name AdamW`` on a DMuon config with checkpointing on) keeps the config's
dump folder."""

from types import SimpleNamespace

import pytest

from torchtitan_dmuon.titan.checkpoint import claim_checkpoint_folder, optimizer_mark


def job(dump, name, enable=True, exclude=()):
    return SimpleNamespace(
        job=SimpleNamespace(dump_folder=str(dump)),
        checkpoint=SimpleNamespace(
            enable=enable, folder="checkpoint", exclude_from_loading=exclude
        ),
        optimizer=SimpleNamespace(name=name),
    )


def test_a_comparison_run_never_resumes_the_other_optimizers_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    claim_checkpoint_folder(job(tmp_path, "DMuon"))
    folder = tmp_path / "checkpoint"
    mark = optimizer_mark(folder)
    assert mark == tmp_path / "checkpoint.optimizer" and mark.read_text() == "DMuon\n"
    # Never the folder itself: TorchTitan resumes from one that exists, ignoring
    # --checkpoint.initial_load_path (a seed checkpoint).
    assert not folder.exists()
    claim_checkpoint_folder(job(tmp_path, "AdamW"))  # nothing saved yet: nothing to resume
    claim_checkpoint_folder(job(tmp_path, "DMuon"))
    (folder / "step-10").mkdir(parents=True)
    claim_checkpoint_folder(job(tmp_path, "DMuon"))  # its own run resumes
    with pytest.raises(ValueError) as refused:
        claim_checkpoint_folder(job(tmp_path, "AdamW"))
    message = str(refused.value)
    assert "'AdamW'" in message and "'DMuon'" in message and str(folder) in message
    assert "--job.dump_folder" in message and "--checkpoint.exclude_from_loading" in message
    assert mark.read_text() == "DMuon\n"  # a refused run marks nothing


def test_resuming_the_weights_without_optimizer_state_is_allowed(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    claim_checkpoint_folder(job(tmp_path, "DMuon"))
    (tmp_path / "checkpoint" / "step-3").mkdir(parents=True)
    claim_checkpoint_folder(job(tmp_path, "AdamW", exclude=["optimizer"]))
    assert optimizer_mark(tmp_path / "checkpoint").read_text() == "AdamW\n"


def test_only_rank_0_marks_and_nothing_without_checkpointing(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    claim_checkpoint_folder(job(tmp_path, "DMuon"))
    monkeypatch.setenv("RANK", "0")
    claim_checkpoint_folder(job(tmp_path, "DMuon", enable=False))
    assert list(tmp_path.iterdir()) == []
