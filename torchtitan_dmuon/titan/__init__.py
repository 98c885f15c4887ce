"""The TorchTitan adapter: thin glue between TorchTitan 0.2.2 and the ownership engine.

* ``config.py``: the ``[dmuon]`` TOML section;
* ``parallelize.py``: runs ``dedicate_params`` right before TorchTitan's FSDP, and lets
  pipeline stages drive their parts' dedications;
* ``optimizer.py``: the optimizer container and builder;
* ``checkpoint.py``: topology-independent model state for DCP;
* ``cpu.py``: the CPU (gloo) layer;
* ``patches.py``: the registry every replacement of a torch or TorchTitan name goes
  through, undone when the trainer ends;
* ``train.py``: the training entry point (``run_train.sh`` runs it).

A new model goes in :data:`MODELS` below, if its parallelize function applies FSDP through
a module-level ``apply_fsdp`` as TorchTitan's do. TorchTitan's HF backend
(``transformers_modeling_backend``, ``hf.py``) is wrapped too where ``transformers`` is
installed, with the flavors of ``hf.py`` (Qwen2.5, Mistral, Llama-3.2) added to its own,
and TorchTitan's vlm experiment (``vlm``, ``vlm.py``: frozen or trainable vision tower, a
VLA's action head, an SDPA path for CPU).
"""

from __future__ import annotations

import dataclasses
import logging

from torchtitan.protocols.train_spec import get_train_spec, register_train_spec

__all__ = ["MODELS", "register"]

logger = logging.getLogger(__name__)

MODELS = ("llama3", "qwen3", "llama4", "deepseek_v3", "gpt_oss")
"""TorchTitan models whose train specs DMuon wraps (same names: selecting ``[optimizer]
name = "DMuon"`` is the only change a config needs)."""

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

    return build


def _wrapped_spec(name: str):
    """TorchTitan's train spec ``name`` with DMuon's parallelize, pipelining and optimizer
    functions (and, for the HF backend and the vlm experiment, this package's flavors)."""
    from torchtitan_dmuon.titan import hf, vlm
    from torchtitan_dmuon.titan.parallelize import with_dedication, with_pipeline_stages

    spec = get_train_spec(name)
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
    """Register DMuon-aware train specs for :data:`MODELS`. Idempotent. (The CPU layer is
    the trainer's: ``DMuonTrainer`` installs it and undoes it.)"""
    global _registered
    if _registered:
        return
    from torchtitan_dmuon.titan import hf, vlm

    names = [*MODELS, hf.HF_MODEL] if hf.available() else [*MODELS]
    if vlm.available():
        names.append(vlm.VLM_MODEL)
    for name in names:
        try:
            spec = _wrapped_spec(name)
        except Exception as error:
            if name in MODELS:
                raise
            # An optional backend whose packages are there in a version TorchTitan 0.2.2's
            # code cannot use (a GPU image's transformers, say): the other models train.
            logger.warning("dmuon: %s is not registered: %s: %s", name, type(error).__name__, error)
            continue
        register_train_spec(name, spec)
    _registered = True
