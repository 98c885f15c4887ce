"""Hugging Face model families through TorchTitan 0.2.2's ``transformers_modeling_backend``.

TorchTitan's backend builds a ``transformers`` model (``*ForCausalLM``) from the config of
``[hf_transformers] model`` (a hub id or a local folder), but its flavors then overwrite
the config's sizes with TorchTitan's own (``debugmodel``: 2 layers of dim 256 and 16
heads; ``full``: llama3-8B-like), drop biases (``attention_bias = False``) and recompute
the FFN size from ``multiple_of``. The flavors registered here keep a family's numbers:
each names a folder with a ``config.json`` (``hf_configs/<flavor>/``, written from the
published architectures, no weights: random init) and takes every size from it, or from
``[hf_transformers] model`` when that is set.

Parameter names are the ``transformers`` ones under the backend's wrapper,
``model.model.layers.N.self_attn.q_proj.weight``; the default ``[dmuon]`` selection
(``MODEL_SELECTIONS["transformers_modeling_backend"]`` in ``config.py``) takes the
attention and MLP matrices, AdamW the biases, norms, embeddings and ``lm_head`` (tied or
not). QK-clip watches the ``self_attn`` modules (``titan/qk_clip.py``).

Needs ``transformers`` (``pip install -e .[hf]``; ``scripts/setup.sh --dev`` installs it):
:func:`available` says whether it is installed, and nothing here is imported without it.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

__all__ = ["CONFIGS", "FLAVORS", "HF_MODEL", "available", "family_flavors"]

logger = logging.getLogger(__name__)

HF_MODEL = "transformers_modeling_backend"
"""The ``[model] name`` of TorchTitan's HF backend (the train spec DMuon wraps)."""

CONFIGS = Path(__file__).resolve().parent / "hf_configs"
"""One folder per flavor, each holding the ``config.json`` the flavor builds."""

FLAVORS = {
    # Published sizes (no weights; the models start from TorchTitan's random init).
    "qwen2.5-1.5B": "Qwen2.5-1.5B: q/k/v biases, tied embeddings",
    "qwen2.5-7B": "Qwen2.5-7B: q/k/v biases, untied embeddings",
    "mistral-7B-v0.3": "Mistral-7B-v0.3: untied embeddings",
    "llama3.2-3B": "Llama-3.2-3B: tied embeddings, llama3 RoPE scaling",
    # The same architectures at a size for CPU tests (vocabulary of the project's tokenizer).
    "qwen2.5-debug": "Qwen2.5 debug: 2 layers of 256, q/k/v biases, tied embeddings",
    "mistral-debug": "Mistral debug: 2 layers of 256, untied embeddings",
    "llama3.2-debug": "Llama-3.2 debug: 2 layers of 256, tied embeddings",
}
"""The flavors :func:`family_flavors` adds to the backend's, with what each is."""


def available() -> bool:
    """Whether ``transformers`` is installed (the backend imports it)."""
    return importlib.util.find_spec("transformers") is not None


def family_flavors() -> dict:
    """The model args of :data:`FLAVORS`, one per config folder.

    Returns:
        ``{flavor: args}``, args a subclass of the backend's ``HFTransformerModelArgs``
        whose ``update_from_config`` keeps the config's numbers.
    """
    from torchtitan.experiments.transformers_modeling_backend.model.args import (
        HFTransformerModelArgs,
        TitanDenseModelArgs,
    )
    from transformers import AutoConfig

    class HFFamilyModelArgs(HFTransformerModelArgs):
        """The backend's model args with every size from the family's ``config.json``."""

        def __init__(self, config_path: str, **kwargs) -> None:
            super().__init__(titan_dense_args=TitanDenseModelArgs(), **kwargs)
            self.hf_config_path = config_path

        def update_from_config(self, job_config):
            """The HF config of ``[hf_transformers] model``, or else the flavor's folder,
            as it is; TorchTitan's training settings only."""
            source = job_config.hf_transformers.model or self.hf_config_path
            config = AutoConfig.from_pretrained(
                source, attn_implementation=self.attn_implementation, trust_remote_code=True
            )
            for key, value in config.to_dict().items():
                setattr(self, key, value)
            # The backend's forward builds position ids of this length.
            self.max_seq_len = job_config.training.seq_len
            self.deterministic = job_config.debug.deterministic
            self.use_cache = False
            # As the backend: the untied embedding starts as TorchTitan's (std 1).
            self.initializer_range = 1.0
            self.head_dim = getattr(config, "head_dim", None) or (
                self.hidden_size // self.num_attention_heads
            )
            logger.info(
                "HF model %s from %s: %d layers of %d, %d heads (%d key-value), FFN %d, "
                "vocabulary %d, tied embeddings %s",
                config.architectures[0],
                source,
                self.num_hidden_layers,
                self.hidden_size,
                self.num_attention_heads,
                self.num_key_value_heads,
                self.intermediate_size,
                self.vocab_size,
                self.tie_word_embeddings,
            )
            return self

    return {name: HFFamilyModelArgs(str(CONFIGS / name)) for name in FLAVORS}


def _tied_embeddings(model) -> bool:
    """Whether ``lm_head`` shares ``embed_tokens``'s weight (Qwen2.5-1.5B, Llama-3.2-3B)."""
    try:
        return model.output.weight is model.tok_embeddings.weight
    except AttributeError:  # a pipeline stage holds one of them at most
        return False


def with_tied_embeddings(parallelize_fn):
    """Wrap the backend's parallelize function so that tied embeddings train under FSDP2.

    The backend's ``apply_fsdp`` shards ``embed_tokens`` alone and ``[norm, lm_head]``
    together: a tied weight then belongs to two FSDP groups, which FSDP2 refuses at the
    first forward ("shared with a parameter already managed by another FSDP group").
    With tied embeddings the two calls are left out for the duration of the call, so the
    root group holds the embedding, the final norm and the head (FSDP2 keeps one tied
    parameter per group), and after tensor parallelism the head shares the embedding's
    weight again; untied models are parallelized as the backend does.

    Args:
        parallelize_fn: ``parallelize_hf_transformers``, possibly wrapped by
            :func:`~torchtitan_dmuon.titan.parallelize.with_dedication` (which swaps
            ``apply_fsdp`` in the same module).

    Returns:
        The wrapped function.
    """
    import functools

    from torchtitan.experiments.transformers_modeling_backend.infra import parallelize

    namespace = vars(parallelize)

    @functools.wraps(parallelize_fn)
    def parallelize_tied(model, parallel_dims, job_config):
        if not _tied_embeddings(model):
            if getattr(model.model.config, "tie_word_embeddings", False):
                # A pipeline stage: the backend ties the head only where one stage holds
                # both (init_weights), so each is a parameter of its own stage.
                logger.warning(
                    "tied embeddings under pipeline parallelism: embed_tokens and lm_head "
                    "are in different stages, each its own parameter: the model trains untied"
                )
            return parallelize_fn(model, parallel_dims, job_config)
        fully_shard, apply_tp = namespace["fully_shard"], namespace["apply_non_moe_tp"]
        separate = [model.tok_embeddings, model.output]

        def fully_shard_tied(module, *args, **kwargs):
            modules = module if isinstance(module, list) else [module]
            if any(m is s for m in modules for s in separate):
                return module  # left to the root group, with the embedding it shares
            return fully_shard(module, *args, **kwargs)

        def apply_tp_tied(model_, *args, **kwargs):
            # The TP plan distributes embed_tokens (row-wise) and lm_head (column-wise)
            # one module at a time, which unties them; both shard the [vocab, dim]
            # weight on dim 0, so the head takes the embedding's DTensor back.
            apply_tp(model_, *args, **kwargs)
            model_.output.weight = model_.tok_embeddings.weight

        namespace.update(fully_shard=fully_shard_tied, apply_non_moe_tp=apply_tp_tied)
        try:
            model = parallelize_fn(model, parallel_dims, job_config)
        finally:
            namespace.update(fully_shard=fully_shard, apply_non_moe_tp=apply_tp)
        if not _tied_embeddings(model):
            raise RuntimeError("parallelizing the model untied lm_head from embed_tokens")
        logger.info("tied embeddings: lm_head and embed_tokens are one parameter, in FSDP's root")
        return model

    return parallelize_tied


def model_class():
    """The backend's ``HFTransformerModel`` with its RoPE buffer initialized.

    TorchTitan builds the model on the meta device, then ``to_empty`` and
    ``init_weights``: the backend's ``init_weights`` initializes the parameters only, and
    the rotary embedding's ``inv_freq`` (a buffer ``transformers`` computes in its
    constructor) keeps whatever memory ``to_empty`` gave it (garbage on CPU: NaN losses).
    It is computed again here, as ``transformers`` does.
    """
    import torch
    from torchtitan.experiments.transformers_modeling_backend.model.model import (
        HFTransformerModel,
    )

    class HFFamilyModel(HFTransformerModel):
        def init_weights(self, *args, buffer_device=None, **kwargs):
            super().init_weights(*args, **kwargs)
            rotary = self.rotary_emb
            if isinstance(rotary, torch.nn.Identity):  # a pipeline stage without it
                return
            device = buffer_device or rotary.inv_freq.device
            with torch.no_grad():
                inv_freq, rotary.attention_scaling = rotary.rope_init_fn(rotary.config, device)
                rotary.inv_freq = inv_freq.to(rotary.inv_freq.dtype)
                rotary.original_inv_freq = rotary.inv_freq

    return HFFamilyModel
