"""A VLM / VLA through TorchTitan 0.2.2's ``torchtitan.experiments.vlm`` with DMuon.

TorchTitan's experiment is a Llama 3 decoder, a SigLIP2 vision encoder (``encoder.layers.N``
with ``self_attn.{q,k,v,out}_proj`` and ``mlp.fc1/fc2``, all with biases) and a two-layer
projector, trained on image-text webdatasets with FSDP / HSDP / DDP. What this module adds
(the train spec registered under the same name, ``[model] name = "vlm"``):

* **modes**, set by the ``[vlm]`` section (``VLM`` in ``config.py``):

  - A, ``vision_tower = "frozen"``: the encoder's parameters do not require gradients;
    its matrices match the default selection's patterns but ``dedicate_params`` leaves
    frozen matches out, so they have no owner, no hook, no reduce or broadcast, and no
    optimizer state (AdamW creates state only for parameters with gradients);
  - B, ``vision_tower = "trainable"`` (default): the encoder's q/k/v/out_proj and
    fc1/fc2 weights are selected too (``MODEL_SELECTIONS["vlm"]``), their biases, the
    layer norms, the patch and position embeddings go to AdamW; the encoder layers
    (children of a ``ModuleDict``, as the decoder's) are hook boundaries of their own;
  - C, ``action_dim > 0`` (a VLA): an action head, a two-layer MLP on the final
    (normed) hidden state of each sequence's last text token, regresses continuous
    actions; its squared error is added to the LM loss (weights ``lm_loss_weight`` and
    ``action_loss_weight``; ``lm_loss_weight = 0`` trains on actions alone). The head is
    left to AdamW (it is in no default pattern), as the projector.

* **an SDPA path for FlexAttention flavors** (``[vlm] attention``): the experiment's
  encoder only runs FlexAttention, whose backward has no CPU kernel, and TorchTitan builds
  its masks with a compiled ``create_block_mask``. With ``sdpa`` (``auto`` on a machine
  without CUDA) the masks are built eagerly, the same mask functions (causal for the
  encoder, causal within documents for the decoder), and each attention runs
  ``scaled_dot_product_attention`` with the mask materialized as a boolean tensor.

* **offline data**: ``vlm_assets.py`` generates the image-caption-action shard and the
  tokenizer with the four image tokens; the dataset ``dmuon-vlm`` reads it
  (``assets/vlm/data``) and, for a VLA, carries each sample's action into the batch.

* **flavors**: ``debug`` is TorchTitan's ``debugmodel`` (6 decoder layers of 256, a
  4-layer encoder of 128) with the vocabulary of ``assets/vlm/tokenizer`` (2048 + 4).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "VLM_MODEL",
    "VLAOutput",
    "available",
    "build_vlm_dataloader",
    "build_vlm_loss",
    "build_vlm_tokenizer",
    "flavors",
    "model_class",
]

logger = logging.getLogger(__name__)

VLM_MODEL = "vlm"
"""The ``[model] name`` of TorchTitan's vlm experiment (the train spec DMuon wraps)."""

DATASET = "dmuon-vlm"
"""The dataset name of the generated image-caption-action shards (``vlm_assets.py``)."""

VOCAB_SIZE = 2052
"""The project's 2048 tokens and the four image tokens."""


def available() -> bool:
    """Whether the vlm experiment's dependencies (einops, PIL, datasets) are installed."""
    return all(importlib.util.find_spec(m) is not None for m in ("einops", "PIL", "datasets"))


class VLAOutput(NamedTuple):
    """What a VLA's forward returns: the LM logits and the action head's prediction, with
    the batch's action targets and which rows hold a real sample (the loss reads them)."""

    logits: torch.Tensor
    actions: torch.Tensor
    target_actions: torch.Tensor
    action_mask: torch.Tensor


def _use_sdpa(attention: str) -> bool:
    if attention not in ("auto", "flex", "sdpa"):
        raise ValueError(f"[vlm] attention must be auto, flex or sdpa, got {attention!r}")
    return attention == "sdpa" or (attention == "auto" and not torch.cuda.is_available())


class MaskedSDPA(nn.Module):
    """``scaled_dot_product_attention`` in place of TorchTitan's ``FlexAttentionWrapper``:
    the same call (``block_mask=`` a ``BlockMask``), the mask's ``mask_mod`` evaluated
    into a boolean tensor (once per mask: :func:`_dense` caches it on the mask)."""

    def forward(self, q, k, v, *, block_mask=None, scale=None, enable_gqa=False, **unused):
        if unused.get("score_mod") is not None or unused.get("return_lse"):
            raise NotImplementedError(
                "[vlm] attention = 'sdpa' supports block masks only (no score_mod, no lse); "
                "use --vlm.attention flex"
            )
        mask = None if block_mask is None else _dense(block_mask)
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa
        )


def _dense(block_mask) -> torch.Tensor:
    """The boolean ``[B or 1, 1, Q, KV]`` mask of a ``BlockMask`` (True: attend)."""
    dense = getattr(block_mask, "_dmuon_dense", None)
    if dense is None:
        from torch.nn.attention.flex_attention import create_mask

        batch, _, q_len, kv_len = block_mask.shape
        dense = create_mask(
            block_mask.mask_mod, batch, 1, q_len, kv_len, block_mask.kv_num_blocks.device
        )
        block_mask._dmuon_dense = dense
    return dense


def _eager_mask(mask_mods, batch: int, length: int, device):
    """A ``BlockMask`` built without ``torch.compile`` (TorchTitan compiles
    ``create_block_mask``: an Inductor build per shape on CPU), its dense form attached."""
    from torch.nn.attention.flex_attention import and_masks, create_block_mask

    mask_mod = and_masks(*mask_mods)
    block_mask = create_block_mask(mask_mod, batch, None, length, length, device=device)
    _dense(block_mask)
    return block_mask


class ActionHead(nn.Module):
    """The VLA's head: ``Linear(dim, hidden)``, SiLU, ``Linear(hidden, action_dim)``."""

    def __init__(self, dim: int, hidden: int, action_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden)
        self.w2 = nn.Linear(hidden, action_dim)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(h)))

    def init_weights(self) -> None:
        for linear in (self.w1, self.w2):
            nn.init.trunc_normal_(linear.weight, std=0.02)
            nn.init.zeros_(linear.bias)


def flavors() -> dict:
    """The model args of the vlm spec: TorchTitan's flavors and :data:`VOCAB_SIZE`'s
    ``debug``, each reading the ``[vlm]`` section in ``update_from_config``."""
    from torchtitan.experiments.vlm import llama3_siglip2_args
    from torchtitan.experiments.vlm.model.args import Llama3Siglip2ModelArgs

    @dataclasses.dataclass
    class DMuonVLMArgs(Llama3Siglip2ModelArgs):
        """TorchTitan's VLM args and the ``[vlm]`` settings the model is built with."""

        attention: str = "auto"
        vision_tower: str = "trainable"
        action_dim: int = 0
        action_hidden: int = 256

        def update_from_config(self, job_config, **kwargs) -> None:
            super().update_from_config(job_config, **kwargs)
            vlm = job_config.vlm
            self.attention = vlm.attention
            self.vision_tower = vlm.vision_tower
            self.action_dim = vlm.action_dim
            self.action_hidden = vlm.action_hidden
            logger.info(
                "VLM: vision tower %s, attention %s%s",
                self.vision_tower,
                "sdpa" if _use_sdpa(self.attention) else "flex",
                f", action head of {self.action_dim}" if self.action_dim else "",
            )

    def convert(args, **changes):
        values = {f.name: getattr(args, f.name) for f in dataclasses.fields(args)}
        return DMuonVLMArgs(**{**values, **changes})

    found = {name: convert(args) for name, args in llama3_siglip2_args.items()}
    found["debug"] = convert(llama3_siglip2_args["debugmodel"], vocab_size=VOCAB_SIZE)
    return found


def model_class():
    """TorchTitan's ``Llama3Siglip2Transformer`` with the modes and the SDPA path."""
    from torchtitan.experiments.vlm.model.model import (
        Llama3Siglip2Transformer,
        _scatter_img_tokens,
    )
    from torchtitan.models.attention import (
        FlexAttentionWrapper,
        get_causal_mask_mod,
        get_document_mask_mod,
    )

    class DMuonVLM(Llama3Siglip2Transformer):
        """The vlm experiment's model in one of the modes of ``[vlm]``."""

        def __init__(self, model_args) -> None:
            super().__init__(model_args)
            self.sdpa = _use_sdpa(model_args.attention)
            if self.sdpa:
                for module in self.modules():
                    if isinstance(getattr(module, "inner_attention", None), FlexAttentionWrapper):
                        module.inner_attention = MaskedSDPA()
            self.action_head = None
            if model_args.action_dim > 0:
                self.action_head = ActionHead(
                    model_args.dim, model_args.action_hidden, model_args.action_dim
                )
            if model_args.vision_tower == "frozen":
                # Before parallelizing: the selection leaves frozen matrices out.
                self.encoder.requires_grad_(False)
            elif model_args.vision_tower != "trainable":
                raise ValueError(
                    f"[vlm] vision_tower must be 'trainable' or 'frozen', got "
                    f"{model_args.vision_tower!r}"
                )

        def init_weights(self, buffer_device=None) -> None:
            super().init_weights(buffer_device=buffer_device)
            # TorchTitan 0.2.2's Siglip2 patch embedding, Attention and FeedForward
            # initialize their weights only: built on the meta device, their biases keep
            # what to_empty gave them (garbage on CPU: NaN from the first layer). Zero,
            # as the projector's.
            for module in self.encoder.modules():
                if isinstance(module, nn.Linear) and module.bias is not None:
                    nn.init.zeros_(module.bias)
            if self.action_head is not None:
                self.action_head.init_weights()

        def get_attention_masks(self, input_batch, tokenizer, extra_inputs=None):
            if not self.sdpa:
                return super().get_attention_masks(input_batch, tokenizer, extra_inputs)
            # The masks TorchTitan builds (llama3's and Siglip2's get_attention_masks),
            # without compiling.
            device = input_batch.device
            decoder = [get_causal_mask_mod()]
            batch = 1
            if self.model_args.attn_mask_type == "block_causal":
                decoder.append(get_document_mask_mod(input_batch, tokenizer.eos_id))
                batch = input_batch.shape[0]
            grid_hw = extra_inputs["grid_thw"][:, :, 1:]
            pixel_masks = (grid_hw != -1).all(dim=-1)
            encoder = [get_causal_mask_mod()]
            encoder_batch = 1
            if self.model_args.encoder.attn_mask_type == "block_causal":
                encoder.append(get_document_mask_mod(pixel_masks, tokenizer.eos_id))
                encoder_batch = pixel_masks.shape[0]
            return {
                "llama3_masks": _eager_mask(decoder, batch, input_batch.shape[1], device),
                "encoder_masks": _eager_mask(encoder, encoder_batch, pixel_masks.shape[1], device),
            }

        def forward(
            self,
            tokens,
            pixel_values,
            grid_thw,
            special_tokens,
            attention_masks=None,
            actions=None,
            action_mask=None,
        ):
            if self.action_head is None:
                return super().forward(
                    tokens, pixel_values, grid_thw, special_tokens, attention_masks
                )
            if actions is None:
                raise ValueError(
                    "[vlm] action_dim > 0 needs batches with actions: --training.dataset "
                    f"{DATASET} (generated by torchtitan_dmuon.titan.vlm_assets)"
                )
            # TorchTitan's forward (Llama3Siglip2Transformer.forward), keeping the final
            # normed hidden state for the action head.
            h = self.tok_embeddings(tokens)
            grid_hw = grid_thw[:, :, 1:]
            pixel_masks = (grid_hw != -1).all(dim=-1)
            images = self.encoder(
                pixel_values, pixel_masks, grid_hw, attention_masks["encoder_masks"]
            )
            images = self.projector(images)
            h = _scatter_img_tokens(h, tokens, images, pixel_masks, special_tokens.img_id)
            for layer in self.layers.values():
                h = layer(h, self.freqs_cis, attention_masks["llama3_masks"])
            h = self.norm(h)
            logits = self.output(h)
            # Each row's last text token (the end of text; the collator pads at the end).
            last = ((tokens != special_tokens.pad_id).sum(dim=1) - 1).clamp(min=0)
            pooled = h[torch.arange(h.shape[0], device=h.device), last]
            return VLAOutput(logits, self.action_head(pooled), actions, action_mask)

    return DMuonVLM


def build_vlm_loss(job_config, **kwargs):
    """TorchTitan's summed cross-entropy, plus for a VLA the action head's summed squared
    error: ``lm_loss_weight * CE_sum + action_loss_weight * SE_sum``. The trainer divides
    it by the global count of label tokens, so each sample's action error weighs as
    ``action_loss_weight`` tokens of cross-entropy."""
    from torchtitan.components.loss import build_cross_entropy_loss

    cross_entropy = build_cross_entropy_loss(job_config, **kwargs)
    lm_weight = job_config.vlm.lm_loss_weight
    action_weight = job_config.vlm.action_loss_weight

    def loss(pred, labels):
        if not isinstance(pred, VLAOutput):
            return cross_entropy(pred, labels)
        error = (pred.actions.float() - pred.target_actions.float()).square()
        error = (error * pred.action_mask.unsqueeze(-1)).sum()
        return lm_weight * cross_entropy(pred.logits, labels) + action_weight * error

    return loss


def _process_with_action(sample, **kwargs):
    """TorchTitan's cc12m sample processing, with the sample's ``json`` action kept."""
    from torchtitan.experiments.vlm.datasets.mm_datasets import _process_cc12_wd_sample

    processed = _process_cc12_wd_sample(sample, **kwargs)
    if processed is not None and isinstance(sample.get("json"), dict):
        action = sample["json"].get("action")
        if action is not None:
            processed["action"] = torch.tensor(action, dtype=torch.float32)
    return processed


def _register_dataset() -> None:
    from datasets import load_dataset
    from torchtitan.experiments.vlm.datasets.mm_datasets import MM_DATASETS
    from torchtitan.hf_datasets import DatasetConfig

    if DATASET in MM_DATASETS:
        return
    MM_DATASETS[DATASET] = DatasetConfig(
        path="assets/vlm/data",
        loader=lambda path: load_dataset(
            path, split="train", data_files={"train": "*.tar"}, streaming=True
        ),
        sample_processor=_process_with_action,
    )


class _WithActions:
    """TorchTitan's collator with the padding's labels ignored and, for a VLA
    (``action_dim > 0``), the kept samples' actions stacked into the input dict
    (``actions`` ``[B, action_dim]``, ``action_mask`` ``[B]``: 0 for padding rows)."""

    def __init__(self, collate, action_dim: int) -> None:
        self.collate = collate
        self.action_dim = action_dim

    def _collate(self, batch):
        input_dict, labels = self.collate(batch)
        # TorchTitan 0.2.2's pad_text_batch pads the labels with ones (torch.ones) and
        # then ignores only the pad id: the padding would train "predict token 1" (the
        # end of text here) at every padded position. A padded input has no label.
        labels = labels.masked_fill(input_dict["input"] == self.collate.special_tokens.pad_id, -100)
        return input_dict, labels

    def __call__(self, batch):
        batch = list(batch)
        input_dict, labels = self._collate(batch)  # drops samples from the end in place
        if self.action_dim == 0:
            return input_dict, labels
        rows = labels.shape[0]
        actions = torch.zeros(rows, self.action_dim)
        mask = torch.zeros(rows)
        for row, sample in enumerate(batch):
            if "action" not in sample:
                raise ValueError(
                    f"[vlm] action_dim = {self.action_dim} but a sample has no action: "
                    f"--training.dataset {DATASET} carries them"
                )
            if sample["action"].numel() != self.action_dim:
                raise ValueError(
                    f"[vlm] action_dim = {self.action_dim} but the data's actions have "
                    f"{sample['action'].numel()} numbers"
                )
            actions[row] = sample["action"]
            mask[row] = 1.0
        input_dict["actions"] = actions
        input_dict["action_mask"] = mask
        return input_dict, labels


_MAKE_ASSETS = (
    "./scripts/setup.sh (or python -m torchtitan_dmuon.titan.vlm_assets) generates them "
    "in assets/vlm"
)


def build_vlm_tokenizer(job_config):
    """TorchTitan's HF tokenizer, checked to hold the four image tokens.

    Raises:
        FileNotFoundError: ``[model] hf_assets_path`` has no ``tokenizer.json``.
        ValueError: The tokenizer lacks an image token, naming the flag.
    """
    from torchtitan.components.tokenizer import build_hf_tokenizer

    from torchtitan_dmuon.titan.vlm_assets import IMAGE_TOKENS

    path = job_config.model.hf_assets_path
    if not (Path(path) / "tokenizer.json").is_file():
        raise FileNotFoundError(
            f"--model.hf_assets_path {path}: no tokenizer.json there; the VLM's tokenizer "
            f"(the project's with the image tokens): {_MAKE_ASSETS}"
        )
    tokenizer = build_hf_tokenizer(job_config)
    added = {t.content for t in tokenizer.tokenizer.get_added_tokens_decoder().values()}
    missing = [t for t in IMAGE_TOKENS if t not in added]
    if missing:
        raise ValueError(
            f"--model.hf_assets_path {path}: the tokenizer lacks {missing}; one with them: "
            f"{_MAKE_ASSETS}"
        )
    return tokenizer


def build_vlm_dataloader(dp_world_size, dp_rank, tokenizer, job_config, infinite=True):
    """TorchTitan's multimodal loader; padded positions carry no label, and for a VLA the
    batches carry the actions.

    Raises:
        FileNotFoundError: The generated shard is missing, naming the flag.
    """
    from torchtitan.experiments.vlm.datasets.mm_datasets import build_mm_dataloader

    _register_dataset()
    if job_config.training.dataset == DATASET:
        path = Path(job_config.training.dataset_path or "assets/vlm/data")
        if not any(path.glob("*.tar")):
            raise FileNotFoundError(
                f"--training.dataset_path {path}: no .tar shard of the generated "
                f"image-caption-action set there: {_MAKE_ASSETS}"
            )
    dataloader = build_mm_dataloader(dp_world_size, dp_rank, tokenizer, job_config, infinite)
    dataloader.collate_fn = _WithActions(dataloader.collate_fn, job_config.vlm.action_dim)
    return dataloader
