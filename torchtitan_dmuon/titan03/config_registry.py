"""Config functions for ``--module torchtitan_dmuon.titan03``: TorchTitan 0.3's own, with DMuon.

``--module torchtitan_dmuon.titan03 --config <name>`` is TorchTitan's config function
``<name>`` of any of its models (``llama3_debugmodel``, ``qwen3_debugmodel``, ...) turned
by :func:`~torchtitan_dmuon.titan03.trainer.with_dmuon`; ``llama3_debug_cpu`` is the run
``TORCHTITAN_VERSION=0.3.0 ./run_train.sh`` makes: the debug llama3 on the offline corpus
``scripts/setup.sh`` builds, as ``train_configs/debug_cpu.toml`` for 0.2.2; ``from_toml``
a TOML job (``titan03/toml.py``).
"""

from __future__ import annotations

import importlib

from torchtitan.components.optimizer import LRSchedulersContainer
from torchtitan.config import ParallelismConfig, TrainingConfig
from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader
from torchtitan.models import _supported_models
from torchtitan.models.llama3 import config_registry as llama3_registry

from torchtitan_dmuon.titan.config import DMuon
from torchtitan_dmuon.titan03.toml import from_toml
from torchtitan_dmuon.titan03.trainer import DMuonTrainer, with_dmuon

__all__ = ["from_toml", "llama3_debug_cpu"]


def llama3_debug_cpu() -> DMuonTrainer.Config:
    """The debug llama3 trained with DMuon (FSDP2, Z3) on ``./assets`` (``scripts/setup.sh``):
    on CPU 2 gloo processes, a couple of minutes; the settings of
    ``train_configs/debug_cpu.toml``."""
    config = with_dmuon(
        llama3_registry.llama3_debugmodel(),
        DMuon(lr=0.02, momentum=0.95, ns_steps=5, ns_backend="auto", ns_dtype="auto"),
    )
    config.hf_assets_path = "./assets/tokenizer"
    config.dump_folder = "./outputs/debug_cpu_030"
    config.dataloader = HuggingFaceTextDataLoader.Config(
        dataset="c4_test", dataset_path="./assets/corpus"
    )
    config.optimizer.lr, config.optimizer.eps, config.optimizer.weight_decay = 3e-3, 1e-8, 0.0
    config.lr_scheduler = LRSchedulersContainer.Config(warmup_steps=10)
    config.training = TrainingConfig(
        local_batch_size=4,
        seq_len=128,
        steps=60,
        max_norm=1.0,
        mixed_precision_param="float32",
        disable_cuda_graphs=True,
    )
    config.parallelism = ParallelismConfig(data_parallel_shard_degree=-1)
    config.activation_checkpoint = None
    config.checkpoint.enable = False
    config.validator.enable = False
    config.metrics.log_freq = 5
    config.metrics.disable_color_printing = True
    config.debug.seed = 42
    return config


def __getattr__(name: str):
    # Any TorchTitan config function, with DMuon (ConfigManager looks the name up here;
    # no name of this module's own shadows one of TorchTitan's).
    for model in sorted(_supported_models):
        try:
            registry = importlib.import_module(f"torchtitan.models.{model}.config_registry")
        except ImportError:
            continue
        function = getattr(registry, name, None)
        if callable(function) and not name.startswith("_"):

            def config(function=function) -> DMuonTrainer.Config:
                return with_dmuon(function())

            config.__name__ = config.__qualname__ = name
            config.__doc__ = f"TorchTitan's {model} config {name}, trained with DMuon."
            return config
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
