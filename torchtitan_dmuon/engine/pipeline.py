"""Pipeline stages (``torch.distributed.pipelining``) over dedicated model parts.

A pipeline schedule runs many forwards and backwards of one stage per step, interleaved
with other stages' and, in zero-bubble schedules, with each backward split into an input
pass and a weight pass (``torch.autograd.grad``, which fires no post-accumulate-grad hook
and accumulates ``p.grad`` by hand). FSDP2 follows it through the stage: no gradient sync
and no resharding after the micro-batch backwards, one reduce after the last. The stage
knows nothing of the engine, so :func:`attach_pipeline_stage` gives the stage the same
protocol for its dedicated part: its backwards (the micro-batches', and the forward and
backward the stage runs at its first step to infer shapes) run without sync and keep the
gathered values (one gather per step under Z2); the backward the schedule marks as the
stage's last of the step reduces the accumulated gradients to their owners once and frees
the values; the schedule's gradient scaling reaches the owners' reduced gradients too.
"""

from __future__ import annotations

from torch.distributed.pipelining.stage import _PipelineStageBase

from torchtitan_dmuon.engine.dedication import get_dedication

__all__ = ["attach_pipeline_stage"]


def attach_pipeline_stage(stage: _PipelineStageBase) -> None:
    """Make ``stage`` drive the dedication of its module (``stage.submod``).

    Call it on every rank, once per stage, after ``dedicate_params`` (and ``fully_shard``)
    on the stage's module and before the schedule's first step. A stage whose module holds
    no selected matrix needs no call (it has no dedication: plain FSDP2 and AdamW).

    Raises:
        TypeError: ``stage`` is not a pipeline stage.
        ValueError: the stage's module has no dedication.
        RuntimeError: the stage was attached already.
    """
    if not isinstance(stage, _PipelineStageBase):
        raise TypeError(f"stage must be a pipeline stage, got {type(stage).__name__}")
    dedication = get_dedication(stage.submod)
    if dedication is None:
        raise ValueError(
            f"stage: pipeline stage {stage.stage_index}'s module has no dedication; call "
            "dedicate_params on it (before fully_shard) first, or leave a stage without "
            "selected matrices unattached"
        )
    if dedication.pipeline_stage is not None:
        raise RuntimeError(f"pipeline stage {stage.stage_index} is already attached to DMuon")
    backward = stage.backward_maybe_with_nosync
    scale_grads = stage.scale_grads
    # The stage decides when gradients are reduced, not the end of each backward.
    dedication.set_pipeline_stage(stage.stage_index)

    def backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward=False):
        result = backward(backward_type, bwd_kwargs, last_backward=last_backward)
        if last_backward:
            # Every schedule marks the stage's last full or weight backward of the step:
            # the gradients of all its micro-batches are in p.grad now; reduce them to
            # their owners, as the end of a synced backward would (every DP rank does).
            dedication.driver.reduce_accumulated()
        return result

    def scale(grad_scale_factor: int) -> None:
        scale_grads(grad_scale_factor)  # p.grad: FSDP's and the other parameters'
        if grad_scale_factor != 1:
            dedication.divide_owned_grads(grad_scale_factor)

    stage.backward_maybe_with_nosync = backward_maybe_with_nosync
    stage.scale_grads = scale

    def detach() -> None:
        # The instance attributes shadow the class's methods: deleting them restores those.
        del stage.backward_maybe_with_nosync, stage.scale_grads
        dedication.set_pipeline_stage(None)

    dedication.on_remove(detach)
