"""A DMuon trainer of TorchTitan 0.3 that records what a one-process reference needs to
replay its run: each rank's batches, the full initial and final parameters, the losses.

``--module tests.support.titan03_recording --config recording_debug_cpu --record_to DIR``
(from the repository root) trains ``llama3_debug_cpu`` through 0.3's own entry point and
writes ``DIR/initial.pt``, ``DIR/final.pt`` (rank 0: every parameter, full),
``DIR/batch_r{rank}_s{step}.pt`` and ``DIR/losses.pt`` (rank 0: step -> the logged global
average loss, unrounded); ``--record_steps 3 ...`` adds ``DIR/after_{step}.pt`` and, per rank,
the Muon momenta its optimizer state dict holds (``momentum_after_{step}_r{rank}.pt``),
and ``DIR/start.pt`` / ``momentum_start_r{rank}.pt`` are what the run's first step starts
from (after a checkpoint load). :func:`train_recorded` launches it. Used by
``tests/titan03/test_titan03_train.py`` and ``test_titan03_checkpoint.py``.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from tests.support.launcher import free_port
from tests.support.workers import full_params
from torchtitan_dmuon import get_dedication
from torchtitan_dmuon.titan03.config_registry import llama3_debug_cpu
from torchtitan_dmuon.titan03.trainer import DMuonTrainer


def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's full value, on every rank (collectives: every rank calls it)."""
    dedication = get_dedication(model)
    return full_params(model, {d.name for d in dedication.plan.params} if dedication else set())


class RecordingTrainer(DMuonTrainer):
    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(DMuonTrainer.Config):
        record_to: str = ""
        """Folder of the recording."""

        record_steps: list[int] = dataclasses.field(default_factory=list)
        """Steps after which the full values and the momenta are recorded."""

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self._rank = dist.get_rank()
        self._losses: dict[int, float] = {}
        self._started = False
        self._save("initial.pt", full_state(self.model_parts[0]))
        log = self.metrics_processor.log

        def log_and_record(step, global_avg_loss, *args, **kwargs):
            self._losses[step] = float(global_avg_loss)
            return log(step, global_avg_loss, *args, **kwargs)

        self.metrics_processor.log = log_and_record

    def _save(self, name: str, value) -> None:
        if self._rank == 0:
            torch.save(value, os.path.join(self.config.record_to, name))

    def _record_state(self, name: str) -> None:
        self._save(f"{name}.pt", full_state(self.model_parts[0]))
        momenta = {
            key: value.detach().clone()
            for key, value in self.optimizers.state_dict().items()
            if key.endswith(".momentum_buffer")
        }
        path = os.path.join(self.config.record_to, f"momentum_{name}_r{self._rank}.pt")
        torch.save(momenta, path)

    def train_step(self, data_iterator) -> None:
        if not self._started:
            self._started = True
            self._record_state("start")
        super().train_step(data_iterator)
        if self.step in self.config.record_steps:
            self._record_state(f"after_{self.step}")

    def forward_backward_step(self, *, input_dict, labels, global_valid_tokens):
        batch = {k: v.detach().cpu().clone() for k, v in input_dict.items()}
        torch.save(
            {"input_dict": batch, "labels": labels.detach().cpu().clone()},
            os.path.join(self.config.record_to, f"batch_r{self._rank}_s{self.step}.pt"),
        )
        return super().forward_backward_step(
            input_dict=input_dict, labels=labels, global_valid_tokens=global_valid_tokens
        )

    def train(self) -> None:
        super().train()
        self._save("final.pt", full_state(self.model_parts[0]))
        self._save("losses.pt", self._losses)


def recording_debug_cpu() -> RecordingTrainer.Config:
    config = llama3_debug_cpu()
    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    return RecordingTrainer.Config(**values)


ROOT = Path(__file__).resolve().parents[2]


def run_titan03(ngpu: int, module: str, config: str, *flags: str) -> subprocess.CompletedProcess:
    """0.3's ``torchtitan.train --module module --config config`` on ``ngpu`` gloo
    processes, rank 0's output captured."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("TRITON_INTERPRET", None)
    command = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ngpu}",
        "--rdzv_backend", "c10d", "--rdzv_endpoint", f"localhost:{free_port()}",
        "--local-ranks-filter", "0", "-m", "torchtitan.train",
        "--module", module, "--config", config, "--metrics.log_freq", "1", *flags,
    ]  # fmt: skip
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def train_recorded(record_to: Path, ngpu: int, *flags: str) -> subprocess.CompletedProcess:
    """``recording_debug_cpu`` through 0.3's ``torchtitan.train`` on ``ngpu`` gloo processes,
    recording into ``record_to`` (its dump folder ``record_to/dump``)."""
    return run_titan03(
        ngpu, "tests.support.titan03_recording", "recording_debug_cpu",
        "--record_to", str(record_to), "--dump_folder", str(record_to / "dump"), *flags,
    )  # fmt: skip
