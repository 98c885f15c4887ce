"""A ``DMuonTrainer`` that counts the host syncs of TorchTitan's train step (run by
``tests/support/launcher.py`` with
``TEST_TRAINER=tests.support.titan_host_sync_probe:HostSyncTrainer``).

Each step after the first is counted from its start (``zero_grad``, the batch, forward
and backward, clipping, ``optimizers.step()``, the LR schedulers) up to TorchTitan's
question whether to log it: the logging that follows reads the loss and the norm by
design, and only on logging steps. At the end rank 0 prints ``HOST_SYNCS {json}``: the
syncs per counted step and where they happened.
"""

import json

import torch.distributed as dist

from tests.support.host_sync import HostSyncCounter
from torchtitan_dmuon.titan.train import DMuonTrainer


class HostSyncTrainer(DMuonTrainer):
    def __init__(self, job_config) -> None:
        super().__init__(job_config)
        self.counted_steps = 0
        self.counter = HostSyncCounter()
        self._counting = False
        should_log = self.metrics_processor.should_log

        def stop_counting(step: int) -> bool:
            self._stop()
            return should_log(step)

        self.metrics_processor.should_log = stop_counting

    def _stop(self) -> None:
        if self._counting:
            self.counter.__exit__(None, None, None)
            self._counting = False

    def train_step(self, data_iterator) -> None:
        if self.step > 1:
            self.counted_steps += 1
            self.counter.__enter__()
            self._counting = True
        try:
            super().train_step(data_iterator)
        finally:
            self._stop()

    def train(self) -> None:
        super().train()
        if _rank() == 0:
            per_step = self.counter.total / max(self.counted_steps, 1)
            print("HOST_SYNCS " + json.dumps({"per_step": per_step, "where": self.counter.where}))


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0
