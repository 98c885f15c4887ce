"""The side streams of one dedication, in the manner of FSDP2's all-gather and
reduce-scatter streams.

A ``Work.wait()`` makes the *current* stream wait for the collective (on CUDA it does not
block the host). So the engine waits a collective on the stream that needs its result:
the gather stream waits a unit's replicate broadcast before broadcasting the unit on in
its shard group, the reduce stream waits a stage-1 reduce before HSDP's stage 2 and before
a bucket is released, and the compute stream waits only for what it reads next (a
boundary's gathered values, the reduced gradients at the end of backward). No host poll
decides what is issued: issue orders stay fixed, the streams absorb the timing.

On CPU, ``torch.cpu``'s streams are no-ops and a gloo ``Work.wait()`` blocks the host: the
same code runs, with the host standing in for the streams.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

__all__ = ["EngineStreams"]


class EngineStreams:
    """A dedication's gather and reduce streams on ``device`` (high priority, as FSDP2's,
    so that communication kernels are not queued behind compute).

    Attributes:
        device: The device of the dedication's buffers and collectives.
        gather: Where a unit's broadcast is issued, after its replicate broadcast landed.
        reduce: Where HSDP's stage 2 is issued and released buckets are waited on.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._module = torch.get_device_module(device)
        if device.type == "cpu":
            self.gather, self.reduce = self._module.Stream(), self._module.Stream()
        else:
            self.gather = self._module.Stream(device=device, priority=-1)
            self.reduce = self._module.Stream(device=device, priority=-1)

    def current(self):
        return self._module.current_stream()

    @contextlib.contextmanager
    def on(self, stream):
        """Make ``stream`` current, after it waited for what the current stream queued
        so far (the values or gradients the collectives read were written there)."""
        stream.wait_stream(self.current())
        with self._module.stream(stream):
            yield

    def wait(self, works: list[dist.Work], stream) -> None:
        """Make ``stream`` wait for ``works`` (the host, on CPU)."""
        with self._module.stream(stream):
            for work in works:
                work.wait()

    def keep_until_done(self, tensor: torch.Tensor, stream) -> None:
        """Let the caching allocator reuse ``tensor``'s memory only once ``stream`` has
        passed its current point (``tensor`` was allocated on another stream and a
        collective on ``stream`` reads or writes it). On CPU memory is freed when its
        last reference goes, after the host waited."""
        if self.device.type != "cpu":
            tensor.record_stream(stream)
