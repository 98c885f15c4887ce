"""Every train spec TorchTitan 0.2.2 looks up, with DMuon.

``DMuonTrainer`` replaces TorchTitan's
``get_train_spec`` for its lifetime by :func:`train_spec`, which wraps whatever spec is
registered when the trainer starts: TorchTitan's own models and experiments, and one a
user registers with ``register_train_spec`` in a module named by ``[experimental]
custom_import`` (which TorchTitan's ``Trainer.__init__`` imports right before it looks the
spec up). A new model therefore needs no change here: its parallelize function must reach
FSDP through a module-level ``apply_fsdp(model, dp_mesh, ...)`` (TorchTitan's) or
``fully_shard(module, mesh=...)``, which ``parallelize.py`` replaces for the call, and
with ``[dmuon] params`` empty DMuon takes the 2-D weights of the ``nn.Linear`` layers
inside its blocks (``MODEL_SELECTIONS`` in ``config.py`` holds the selections of the
models that have their own). TorchTitan's HF backend (``transformers_modeling_backend``,
``hf.py``) gets the flavors of ``hf.py`` (Qwen2.5, Mistral, Llama-3.2) besides its own,
and TorchTitan's vlm experiment (``vlm``, ``vlm.py``) frozen or trainable vision tower
modes, a VLA's action head and an SDPA path for CPU.
"""

from __future__ import annotations

import dataclasses
import logging
import weakref

import torchtitan_dmuon.titan.checked  # noqa: F401 - before TorchTitan: refuses another release

# isort: split

import torchtitan.protocols.train_spec as train_spec_module
from torchtitan.protocols.train_spec import TrainSpec, register_train_spec

__all__ = ["register", "train_spec"]

logger = logging.getLogger(__name__)

_titan_get_train_spec = train_spec_module.get_train_spec
"""TorchTitan's lookup (``DMuonTrainer`` replaces the module's name by :func:`train_spec`)."""

_WRAPPED: weakref.WeakSet = weakref.WeakSet()
"""The optimizer builders of the specs :func:`train_spec` made (a spec is wrapped once)."""

_registered = False


def _wrap_optimizer_builder(build_optimizers_fn):
    """Build DMuon when asked, else TorchTitan's optimizers. A model's own builder (the MoE
    one adds a load-balancing step hook) runs with ``build_optimizers`` pointing at ours."""
    import torchtitan.components.optimizer as titan_optimizer

    from torchtitan_dmuon.titan.optimizer import build_dmuon_optimizers
    from torchtitan_dmuon.titan.parallelize import DMUON

    titan_builder = titan_optimizer.build_optimizers

    def build(model_parts, optimizer_config, parallel_dims, ft_manager=None):
        if optimizer_config.name != DMUON:
            return build_optimizers_fn(model_parts, optimizer_config, parallel_dims, ft_manager)
        if build_optimizers_fn is titan_builder:
            return build_dmuon_optimizers(model_parts, optimizer_config, parallel_dims, ft_manager)
        titan_optimizer.build_optimizers = build_dmuon_optimizers
        try:
            return build_optimizers_fn(model_parts, optimizer_config, parallel_dims, ft_manager)
        finally:
            titan_optimizer.build_optimizers = titan_builder

    _WRAPPED.add(build)
    return build


def train_spec(name: str) -> TrainSpec:
    """The train spec TorchTitan has for ``name`` (its own models and experiments, or one
    registered with ``register_train_spec``, e.g. by an ``[experimental] custom_import``
    module), with DMuon's parallelize, pipelining and optimizer functions (and, for the HF
    backend and the vlm experiment, this package's flavors). With another ``[optimizer]
    name`` those functions are the spec's own. A spec made here is returned as it is.

    Raises:
        ValueError: TorchTitan has no spec ``name``.
    """
    from torchtitan_dmuon.titan import hf, vlm
    from torchtitan_dmuon.titan.parallelize import with_dedication, with_pipeline_stages

    spec = _titan_get_train_spec(name)
    if spec.build_optimizers_fn in _WRAPPED:
        return spec
    pipelining_fn = spec.pipelining_fn
    parallelize_fn, extra = with_dedication(spec.parallelize_fn), {}
    if name == hf.HF_MODEL:  # the backend's flavors and the families' own
        parallelize_fn = hf.with_tied_embeddings(parallelize_fn)
        extra["model_args"] = {**spec.model_args, **hf.family_flavors()}
        extra["model_cls"] = hf.model_class()
    if name == vlm.VLM_MODEL:  # the modes, the SDPA path, the offline data
        extra["model_args"] = vlm.flavors()
        extra["model_cls"] = vlm.model_class()
        extra["build_dataloader_fn"] = vlm.build_vlm_dataloader
        extra["build_tokenizer_fn"] = vlm.build_vlm_tokenizer
        extra["build_loss_fn"] = vlm.build_vlm_loss
    return dataclasses.replace(
        spec,
        parallelize_fn=parallelize_fn,
        pipelining_fn=with_pipeline_stages(pipelining_fn) if pipelining_fn else None,
        build_optimizers_fn=_wrap_optimizer_builder(spec.build_optimizers_fn),
        **extra,
    )


def register() -> None:
    """Register the :func:`train_spec` of each model with a selection of its own
    (``MODEL_SELECTIONS`` in ``config.py``) under its name, for code that looks specs up
    with TorchTitan's ``get_train_spec`` outside ``DMuonTrainer`` (which wraps every spec
    it looks up, any model, and needs no registration). An optional backend that is not
    installed, or is in a version TorchTitan 0.2.2's code cannot use (a GPU image's
    transformers, say), is skipped with a warning. Idempotent."""
    global _registered
    if _registered:
        return
    from torchtitan_dmuon.titan import hf, vlm
    from torchtitan_dmuon.titan.config import MODEL_SELECTIONS

    optional = {hf.HF_MODEL: hf.available, vlm.VLM_MODEL: vlm.available}
    for name in MODEL_SELECTIONS:
        if name in optional and not optional[name]():
            continue
        try:
            spec = train_spec(name)
        except Exception as error:
            if name not in optional:
                raise
            logger.warning("dmuon: %s is not registered: %s: %s", name, type(error).__name__, error)
            continue
        register_train_spec(name, spec)
    _registered = True
