"""``DMuonTrainer``: TorchTitan 0.3's ``Trainer`` with DMuon, and :func:`with_dmuon`.

0.3's ``train.py`` builds whatever trainer the config's class names (``config.build()``),
so a :class:`DMuonTrainer.Config` returned by a config function runs DMuon through
TorchTitan's own entry point. The trainer, before TorchTitan's ``__init__``:

* applies the CPU layer where there is no GPU (``cpu.py``);
* wraps the model spec's ``parallelize_fn`` (``parallelize.py``), which dedicates the
  ``dmuon`` section's matrices right before FSDP;

and after it clips gradients with DMuon's norm (correct over dedicated and FSDP
parameters; TorchTitan's clipping function is reached through its module, replaced
through the :class:`~torchtitan_dmuon.titan.patches.PatchRegistry` that ``close()`` undoes)
and logs the recipe. 0.3's DCP checkpointer saves and loads it with the model's state read
anew at each save (``checkpoint.py``; the engine's state-dict hooks hold each dedicated
matrix on its owner). Not taken yet, refused by name before any collective: QK-clip
(``--dmuon.qk_clip_threshold``).
"""

from __future__ import annotations

import dataclasses
import gc
import logging
from dataclasses import dataclass, field

import torch.distributed as dist
import torchtitan.distributed.utils as dist_utils
from torchtitan.trainer import Trainer

from torchtitan_dmuon.engine import comm, get_dedication
from torchtitan_dmuon.titan.config import DMuon
from torchtitan_dmuon.titan.container import log_recipe
from torchtitan_dmuon.titan.patches import PatchRegistry
from torchtitan_dmuon.titan03.checkpoint import with_model_state
from torchtitan_dmuon.titan03.cpu import enable_cpu_support
from torchtitan_dmuon.titan03.optimizer import DMuonOptimizersContainer
from torchtitan_dmuon.titan03.parallelize import with_dedication

logger = logging.getLogger(__name__)

__all__ = ["DMuonTrainer", "with_dmuon"]

_ADAMW = ("AdamW", "Adam")


class DMuonTrainer(Trainer):
    """TorchTitan 0.3's ``Trainer`` with DMuon (see the module's docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        dmuon: DMuon = field(default_factory=DMuon)
        """Dedicated-ownership Muon: the ``[dmuon]`` settings (``--dmuon.*``)."""

        optimizer: DMuonOptimizersContainer.Config = field(
            default_factory=DMuonOptimizersContainer.Config
        )

    def __init__(self, config: Config) -> None:
        self.patches = PatchRegistry()
        try:
            _refuse_unsupported(config)
            config.checkpoint = with_model_state(config.checkpoint)
            enable_cpu_support(self.patches, config)
            spec = config.model_spec
            config.model_spec = dataclasses.replace(
                spec,
                parallelize_fn=with_dedication(
                    spec.parallelize_fn, config.dmuon, spec.name, spec.flavor
                ),
            )
            super().__init__(config)
            self._adapt()
        except BaseException:
            self.patches.restore()
            raise

    def init_distributed(self):
        parallel_dims = super().init_distributed()
        self.config.optimizer.parallel_dims = parallel_dims
        return parallel_dims

    def _adapt(self) -> None:
        config = self.config
        log_recipe(self.model_parts[0], config.optimizer, self.lr_schedulers, config.training.steps)
        self.dedications = [d for d in map(get_dedication, self.model_parts) if d is not None]
        # The train step clips through this module attribute; TorchTitan's own cannot see
        # gradients held by owners.
        self.patches.setattr(dist_utils, "clip_grad_norm_", self._clip_grad_norm)

    def _clip_grad_norm(self, parameters, max_norm, pp_mesh=None, **unused):
        pp_group = pp_mesh.get_group() if pp_mesh is not None else None
        return self.optimizers.clip_grad_norm_(max_norm, self.step, pp_group)

    def train(self) -> None:
        super().train()
        # A completed run: the last step's async replicate broadcasts land, and the ranks
        # leave together (gloo aborts now and then when one tears its groups down while a
        # peer still holds the connections).
        for dedication in self.dedications:
            dedication.wait_replicas()
        self.optimizers.log_skipped_steps()
        gc.collect()
        if dist.is_initialized():
            comm.barrier()

    def close(self) -> None:
        try:
            super().close()
        finally:
            self.patches.restore()


def _refuse_unsupported(config) -> None:
    if config.dmuon.qk_clip_threshold > 0:
        raise ValueError(
            "--dmuon.qk_clip_threshold > 0: QK-clip on TorchTitan 0.3 (its fused QKV rows) is "
            "not built yet; train without it, or with TorchTitan 0.2.2's adapter"
        )


def _adamw_settings(optimizer) -> dict:
    """AdamW's settings in a 0.3 optimizer config: its one AdamW group's (the catch-all
    ``default_adamw`` makes), as the DMuon container's fields."""
    if isinstance(optimizer, DMuonOptimizersContainer.Config):
        return {}
    groups = [g for g in optimizer.param_groups if g.optimizer_name in _ADAMW]
    if len(groups) != 1 or len(optimizer.param_groups) != 1:
        names = [(g.pattern, g.optimizer_name) for g in optimizer.param_groups]
        raise ValueError(
            f"with_dmuon: the config's optimizer has param groups {names}; DMuon takes its "
            "AdamW settings from one catch-all AdamW group (default_adamw): give it one, or "
            "set them with --optimizer.lr, --optimizer.weight_decay, ..."
        )
    kwargs = groups[0].optimizer_kwargs
    betas = kwargs.get("betas", (0.9, 0.95))
    settings = dict(lr=kwargs["lr"], beta1=betas[0], beta2=betas[1])
    settings.update({k: kwargs[k] for k in ("eps", "weight_decay") if k in kwargs})
    return dict(settings, implementation=optimizer.implementation)


def with_dmuon(
    config: Trainer.Config, dmuon: DMuon | None = None, **settings
) -> DMuonTrainer.Config:
    """``config`` (any TorchTitan 0.3 ``Trainer.Config``) trained with DMuon: the same
    sections, ``dmuon`` (``settings`` as its fields, over ``dmuon``), AdamW's settings from
    the config's AdamW group, and ``training.disable_cuda_graphs`` set (see
    ``parallelize.py``).

    Raises:
        ValueError: the config's optimizer is not one catch-all AdamW group.
    """
    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(Trainer.Config)}
    if isinstance(config, DMuonTrainer.Config):
        values["dmuon"] = config.dmuon
    values["optimizer"] = DMuonOptimizersContainer.Config(**_adamw_settings(config.optimizer))
    if isinstance(config.optimizer, DMuonOptimizersContainer.Config):
        values["optimizer"] = config.optimizer
    section = dmuon if dmuon is not None else values.get("dmuon", DMuon())
    values["dmuon"] = dataclasses.replace(section, **settings)
    values["training"] = dataclasses.replace(config.training, disable_cuda_graphs=True)
    return DMuonTrainer.Config(**values)
