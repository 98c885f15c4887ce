"""LR-scheduler and optimizer state for TorchTitan 0.2.2's CheckpointManager.

:class:`LRSchedulersWrapper` lets a run resume from a checkpoint of the other optimizer
(AdamW <-> DMuon); :func:`optimizer_state_to_load` lets NorMuon resume a checkpoint written
without it; :func:`claim_checkpoint_folder` keeps a run from resuming, by accident, the other
optimizer's checkpoint in a shared folder. The model's state is
:class:`~torchtitan_dmuon.titan.model_state.ModelState` (each dedicated matrix once, read
anew at each call), which both TorchTitan adapters use.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.stateful import Stateful

import torchtitan_dmuon.titan.checked  # noqa: F401 - before TorchTitan: refuses another release

# isort: split

from torchtitan.components.checkpoint import OPTIMIZER
from torchtitan.components.lr_scheduler import LRSchedulersContainer

from torchtitan_dmuon.optim.muon import SECOND_MOMENT

logger = logging.getLogger(__name__)

__all__ = [
    "LRSchedulersWrapper",
    "optimizer_state_to_load",
]


class LRSchedulersWrapper(Stateful):
    """TorchTitan's LR schedulers, loadable from a checkpoint of another optimizer.

    A ``LambdaLR`` state holds one base LR, last LR and lambda state per param group:
    DMuon has two groups (Muon, AdamW), TorchTitan's AdamW one. Resuming one optimizer
    from the other's checkpoint (``--checkpoint.exclude_from_loading optimizer``) would
    restore a state of the wrong length, which fails at the end of the first step. When
    the lengths differ, this run keeps its own base LRs and lambdas, takes the schedule's
    position (``last_epoch``, ``_step_count``) from the checkpoint and sets each group's
    LR to the schedule's value there, as loading the optimizer's state would have. Same
    length: TorchTitan's load, unchanged.
    """

    def __init__(self, lr_schedulers: LRSchedulersContainer) -> None:
        self.lr_schedulers = lr_schedulers

    def state_dict(self) -> dict[str, Any]:
        return self.lr_schedulers.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        scheduler = self.lr_schedulers.schedulers[0]
        saved_groups, groups = len(state_dict["base_lrs"]), len(scheduler.base_lrs)
        if saved_groups == groups:
            self.lr_schedulers.load_state_dict(state_dict)
            return
        step = state_dict["last_epoch"]
        logger.info(
            "lr_scheduler: the checkpoint's schedule is for %d param group(s), this optimizer "
            "has %d: continuing it at step %d with this run's base learning rates",
            saved_groups,
            groups,
            step,
        )
        own = scheduler.state_dict()
        own["last_epoch"], own["_step_count"] = step, state_dict["_step_count"]
        own["_last_lr"] = [
            base * lr_lambda(step)
            for base, lr_lambda in zip(scheduler.base_lrs, scheduler.lr_lambdas, strict=True)
        ]
        self.lr_schedulers.load_state_dict(own)
        for each in self.lr_schedulers:
            for group, lr in zip(each.optimizer.param_groups, each.get_last_lr(), strict=True):
                group["lr"] = lr


class _WithoutKeys(Stateful):
    """``optimizers`` with ``absent`` left out of what DCP loads: those entries keep the
    values the optimizers start them at."""

    def __init__(self, optimizers: Stateful, absent: set[str]) -> None:
        self.optimizers = optimizers
        self.absent = absent

    def state_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.optimizers.state_dict().items() if k not in self.absent}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizers.load_state_dict(state_dict)


def optimizer_state_to_load(optimizers: Stateful, checkpoint_id: str) -> Stateful:
    """What DCP loads the optimizers' state into from the checkpoint at ``checkpoint_id``.

    NorMuon switched on at a resume: the checkpoint, written by DMuon without NorMuon,
    holds each matrix's momentum but no second moment, which DCP would report as a missing
    key. The second moments and ``normuon_beta2`` are then left out of the load: they
    start where a fresh NorMuon starts them, at zero (logged), and the run's beta2 holds.
    Any other missing entry, or a checkpoint with some second moments and not others,
    still fails in DCP, naming the key.
    """
    normuon = {
        key
        for key in optimizers.state_dict()
        if key.endswith(f".{SECOND_MOMENT}") or key == "param_groups.muon.normuon_beta2"
    }
    if not normuon:
        return optimizers
    saved = FileSystemReader(checkpoint_id).read_metadata().state_dict_metadata
    prefix = f"{OPTIMIZER}.state."
    if any(key.startswith(prefix) and key.endswith(f".{SECOND_MOMENT}") for key in saved):
        return optimizers
    matrices = sum(key.startswith(prefix) and key.endswith(".momentum_buffer") for key in saved)
    logger.info(
        "NorMuon: the checkpoint holds no second moments for the %d Muon matrices (it was "
        "written without NorMuon); they start at zero",
        matrices,
    )
    return _WithoutKeys(optimizers, normuon)


def optimizer_mark(folder: Path) -> Path:
    """Beside a checkpoint folder (never in it: TorchTitan resumes from a folder that
    exists, and would then ignore ``initial_load_path``), the ``[optimizer] name`` of the
    run that last used it."""
    return folder.with_name(folder.name + ".optimizer")


def claim_checkpoint_folder(job_config) -> None:
    """Refuse a run that would resume another optimizer's checkpoint, then mark the folder
    as this run's (rank 0; before any collective, the same verdict on every rank).

    A comparison run (``--optimizer.name AdamW`` on a DMuon config) keeps the config's
    ``dump_folder``: with checkpointing on, TorchTitan would resume the DMuon run's last
    step, weights and all, and compare nothing. Resuming across optimizers on purpose
    leaves the optimizer state out (``--checkpoint.exclude_from_loading optimizer``), as
    :class:`LRSchedulersWrapper` supports.

    Raises:
        ValueError: The folder holds checkpoints that a run with another optimizer wrote
            last, and this one would load their optimizer state.
    """
    checkpoint = job_config.checkpoint
    if not checkpoint.enable:
        return
    folder = Path(job_config.job.dump_folder, checkpoint.folder)
    mark, name = optimizer_mark(folder), job_config.optimizer.name
    saved = mark.read_text().strip() if mark.is_file() else None
    steps = folder.is_dir() and any(re.fullmatch(r"step-\d+", p.name) for p in folder.iterdir())
    if saved not in (None, name) and steps and "optimizer" not in checkpoint.exclude_from_loading:
        raise ValueError(
            f"[optimizer] name = {name!r}, but the checkpoints in {folder} were written by a "
            f"run with {saved!r}: this run would resume that run's last step. Give it a "
            "folder of its own (--job.dump_folder DIR), or continue from those weights on "
            "purpose without their optimizer state (--checkpoint.exclude_from_loading "
            "optimizer)"
        )
    if int(os.environ.get("RANK", "0")) == 0:
        mark.parent.mkdir(parents=True, exist_ok=True)
        mark.write_text(name + "\n")
