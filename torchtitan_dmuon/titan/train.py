"""Training entry point: TorchTitan's trainer with DMuon registered.

``python -m torchtitan_dmuon.titan.train --job.config_file X.toml [--section.key value ...]``
(what ``run_train.sh`` launches under torchrun) is ``python -m torchtitan.train`` plus:

* the ``[dmuon]`` section, when ``--job.custom_config_module torchtitan_dmuon.titan.config``
  is given (``run_train.sh`` adds it) or ``[job] custom_config_module`` names it;
* every train spec it looks up (TorchTitan's models and experiments, and one registered by
  the module ``[experimental] custom_import`` names) wrapped by ``titan.train_spec``, whose
  parallelize and optimizer functions use DMuon when ``[optimizer] name = "DMuon"`` (and
  are the spec's own otherwise);
* the CPU layer (``titan/cpu.py``) where there is no GPU;
* every replacement of a torch or TorchTitan name made through one
  :class:`~torchtitan_dmuon.titan.patches.PatchRegistry`, undone when the trainer closes
  (after training or an error);
* with DMuon on: DMuon's gradient clipping (correct over dedicated and FSDP parameters,
  and over pipeline stages) and its ``[dmuon] nonfinite_grad_norm`` policy; under pipeline
  parallelism gradients divided by the global token count as without it,
  topology-independent checkpoints of the dedicated matrices, and DMuon's figures (NS
  time, bytes reduced and broadcast, owner balance) in the metrics line and TensorBoard;
* LR-scheduler state that loads across AdamW and DMuon checkpoints (their optimizers
  have different numbers of param groups); NorMuon resuming a checkpoint written without
  it (its second moments start at zero);
* the ranks leave training together (a barrier after a completed run).
"""

from __future__ import annotations

import gc
import logging
import math

import torch
import torch.distributed as dist

import torchtitan_dmuon.titan.checked  # noqa: F401 - before TorchTitan: refuses another release

# isort: split

import torchtitan.distributed.utils as dist_utils
import torchtitan.protocols.train_spec as train_spec_module
from torchtitan.components.checkpoint import LR_SCHEDULER, MODEL, OPTIMIZER
from torchtitan.train import Trainer, main

from torchtitan_dmuon.engine import comm, get_dedication
from torchtitan_dmuon.engine.report import plan_report
from torchtitan_dmuon.titan import train_spec
from torchtitan_dmuon.titan.checkpoint import (
    LRSchedulersWrapper,
    claim_checkpoint_folder,
    optimizer_state_to_load,
)
from torchtitan_dmuon.titan.container import log_recipe
from torchtitan_dmuon.titan.cpu import enable_cpu_support
from torchtitan_dmuon.titan.model_state import ModelState
from torchtitan_dmuon.titan.parallelize import DMUON
from torchtitan_dmuon.titan.patches import PatchRegistry
from torchtitan_dmuon.titan.plan_report import step_counts

logger = logging.getLogger(__name__)

_torchtitan_set_pg_timeouts = dist_utils.set_pg_timeouts


class DMuonTrainer(Trainer):
    """TorchTitan's ``Trainer`` with DMuon's clipping, checkpoint state and metrics."""

    def __init__(self, job_config) -> None:
        # Every replacement of a torch or TorchTitan name, undone by close() (TorchTitan's
        # main calls it after training and after an error) or here if building fails.
        claim_checkpoint_folder(job_config)
        self.patches = PatchRegistry()
        try:
            enable_cpu_support(self.patches)
            # TorchTitan's __init__ imports [experimental] custom_import (which may register
            # a spec) and then looks the model's spec up: any spec registered by then is
            # DMuon's.
            self.patches.setattr(train_spec_module, "get_train_spec", train_spec)
            # DCP warns on every ShardedTensor it plans; the split stacks' pieces have no
            # DTensor layout (an owner's piece is not a mesh shard).
            self.patches.filter_warnings(
                "ignore", message="Please use DTensor instead and we are deprecating ShardedTensor"
            )
            super().__init__(job_config)
            self._adapt(job_config)
        except BaseException:
            self.patches.restore()
            raise

    def close(self) -> None:
        try:
            super().close()
        finally:
            self.patches.restore()

    def _adapt(self, job_config) -> None:
        self.dedications = []
        # Either optimizer resumes from the other's checkpoint (different param groups).
        self.checkpointer.states[LR_SCHEDULER] = LRSchedulersWrapper(self.lr_schedulers)
        if job_config.optimizer.name != DMUON:
            return
        log_recipe(
            self.model_parts[0], job_config.optimizer, self.lr_schedulers, job_config.training.steps
        )
        # None for a part with one data-parallel rank (plain Muon + AdamW).
        self.dedications = [d for d in map(get_dedication, self.model_parts) if d is not None]
        for index, (part, optimizer) in enumerate(
            zip(self.model_parts, self.optimizers.optimizers, strict=True)
        ):
            dedication = get_dedication(part)
            counts = step_counts(job_config, self.parallel_dims, optimizer.ns.dtype)
            if dedication is not None:  # the plan report's figures, for this rank
                rank = dedication.replicate_rank * dedication.shard_size + dedication.shard_rank
                logger.info(
                    "dmuon: plan report of model part %d: %s",
                    index,
                    plan_report(part, counts).line(rank),
                )
        self.checkpointer.states[MODEL] = ModelState(self.model_parts)
        dcp_load = self.checkpointer.dcp_load

        def dcp_load_normuon_from_muon(state_dict, checkpoint_id, from_hf, from_quantized):
            if OPTIMIZER in state_dict and not from_hf:
                state_dict = dict(state_dict)
                state_dict[OPTIMIZER] = optimizer_state_to_load(
                    state_dict[OPTIMIZER], checkpoint_id
                )
            dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)

        self.patches.setattr(self.checkpointer, "dcp_load", dcp_load_normuon_from_muon)
        # The train step clips through this module attribute; TorchTitan's own cannot see
        # gradients held by owners and fails on a mix of DTensor and plain gradients.
        self.patches.setattr(dist_utils, "clip_grad_norm_", self._clip_grad_norm)
        self.patches.setattr(dist_utils, "set_pg_timeouts", self._set_pg_timeouts)
        self._last_bytes: dict[str, int] = {}
        self._last_step_seconds = 0.0
        self._last_step = 0
        # QK-clip's logged figures cover every stage: a MAX and a SUM over the pipeline.
        self._qk_pp_group = None
        self._metrics_stats = comm.CommStats()  # the logged figures' own collectives
        if job_config.dmuon.qk_clip_threshold > 0 and self.parallel_dims.pp_enabled:
            self._qk_pp_group = self.parallel_dims.get_mesh("pp").get_group()
        log = self.metrics_processor.log

        def log_with_dmuon(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None):
            # The warnings of the steps skipped since the last logging step.
            self.optimizers.log_skipped_steps()
            extra = dict(extra_metrics or {})
            extra.update(self._dmuon_metrics(step))
            qk = ""
            if "dmuon/qk_max_logit" in extra:
                qk = (
                    f"  qk max logit {extra['dmuon/qk_max_logit']:.2f} "
                    f"clipped heads {extra['dmuon/qk_clipped_heads']:d}"
                )
            logger.info(
                "dmuon: optimizer step %.1f ms  reduce %.2f MB/step  broadcast %.2f MB/step  "
                "owner balance %.3f%s",
                extra["dmuon/optimizer_ms"],
                extra["dmuon/reduce_mb"],
                extra["dmuon/broadcast_mb"],
                extra["dmuon/owner_balance"],
                qk,
            )
            return log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=extra)

        self.patches.setattr(self.metrics_processor, "log", log_with_dmuon)

    def train(self) -> None:
        super().train()
        # TorchTitan's rank 0 sleeps 2 s after the last step while the others go on to
        # destroy their process groups; on gloo a rank that tears down its groups while a
        # peer still holds the connections aborts now and then. Leave together. Only after
        # a completed run: after an error a barrier could wait for a rank that is gone.
        # The last step's async replicate broadcasts must land before the groups go.
        for dedication in self.dedications:
            dedication.wait_replicas()
        if self.dedications:  # the steps skipped after the last logging step
            self.optimizers.log_skipped_steps()
        gc.collect()
        if dist.is_initialized():
            comm.barrier()

    def _set_pg_timeouts(self, timeout, parallel_dims) -> None:
        # After the first step TorchTitan shortens its groups' timeout to
        # comm.train_timeout_seconds (hang detection); the engine's own groups follow.
        _torchtitan_set_pg_timeouts(timeout, parallel_dims)
        groups = [
            g
            for d in self.dedications
            for g in d.exchange.process_groups() + [d.phase_group()]
            if g is not None
        ]
        if groups and comm.is_fake(groups[0]):
            return  # a dry run: the fake backend has no timeout to set
        for group in groups:
            dist.distributed_c10d._set_pg_timeout(timeout, group)
        logger.info("dmuon: the engine's process groups now time out after %s", timeout)

    def forward_backward_step(self, *, input_dict, labels, global_valid_tokens) -> torch.Tensor:
        self._global_valid_tokens = global_valid_tokens
        return super().forward_backward_step(
            input_dict=input_dict, labels=labels, global_valid_tokens=global_valid_tokens
        )

    def _clip_grad_norm(self, parameters, max_norm, pp_mesh=None, **unused) -> torch.Tensor:
        # TorchTitan's train step passes foreach, pp_mesh and ep_enabled: the 2-norm.
        pp_group = None
        if pp_mesh is not None:
            pp_group = pp_mesh.get_group()
            # TorchTitan 0.2.2 back-propagates a pipeline's summed loss, where without PP
            # (and in later TorchTitan with PP too) it divides by the global token count:
            # gradients would be that many times larger, always clipped, and optimizer
            # state would not carry over between PP and non-PP runs. Divide them here,
            # after the step's last backward, before clipping.
            self.optimizers.divide_grads(self._global_valid_tokens)
        return self.optimizers.clip_grad_norm_(max_norm, self.step, pp_group)

    def _dmuon_metrics(self, step: int) -> dict[str, float]:
        """Per-step averages since the last logged step, this rank's view."""
        steps = max(step - self._last_step, 1)
        totals: dict[str, int] = {}
        for dedication in self.dedications:
            for kind, value in dedication.stats.bytes.items():
                totals[kind] = totals.get(kind, 0) + value
        delta = {k: v - self._last_bytes.get(k, 0) for k, v in totals.items()}
        step_seconds = self.optimizers.step_seconds

        def mb(collective: str) -> float:  # over the shard, experts' and replicate groups
            kinds = (collective, f"expert_{collective}", f"replicate_{collective}")
            return sum(delta.get(kind, 0) for kind in kinds) / steps / 2**20

        metrics = {
            "dmuon/optimizer_ms": 1e3 * (step_seconds - self._last_step_seconds) / steps,
            "dmuon/reduce_mb": mb("reduce"),
            "dmuon/broadcast_mb": mb("broadcast"),
            "dmuon/owner_balance": max((d.plan.balance() for d in self.dedications), default=1.0),
        }
        clips = [
            o.qk_clip
            for o in self.optimizers.optimizers
            if o.qk_clip is not None and o.qk_clip.max_logit is not None
        ]
        if clips or self._qk_pp_group is not None:
            # The last step's, over this rank's stages (and all their TP ranks' heads) and,
            # under pipeline parallelism, over every stage (a rank whose stages hold no
            # attention joins with nothing).
            maximum = torch.tensor(
                [max((c.max_logit.item() for c in clips), default=-math.inf)], device=self.device
            )
            clipped = torch.tensor(
                [sum(int(c.clipped_heads) for c in clips)], dtype=torch.float64, device=self.device
            )
            if self._qk_pp_group is not None:
                group, stats = self._qk_pp_group, self._metrics_stats
                comm.all_reduce(maximum, group, stats, "qk_metrics", op=dist.ReduceOp.MAX).wait()
                comm.all_reduce(clipped, group, stats, "qk_metrics").wait()
            metrics["dmuon/qk_max_logit"] = maximum.item()
            metrics["dmuon/qk_clipped_heads"] = int(clipped.item())
        self._last_bytes, self._last_step_seconds, self._last_step = totals, step_seconds, step
        return metrics


if __name__ == "__main__":
    main(DMuonTrainer)
