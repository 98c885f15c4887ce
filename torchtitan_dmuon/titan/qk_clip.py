"""QK-clip for TorchTitan's models: which attention modules to watch and which rows of
which weights each head owns.

llama3, llama4 and qwen3 (without QK-norm) run multi-head or grouped-query attention:
a head's query rows of ``wq`` and key rows of ``wk`` (a key head shared by its group of
query heads). DeepSeek-V3 runs multi-head latent attention (MLA): a head's query rows of
``wq`` (or ``wq_b`` with a query LoRA) are its ``q_nope`` then its ``q_pe``, its rows of
``wkv_b`` its ``k_nope`` then its value; the RoPE key ``k_pe`` (rows of ``wkv_a``) is
shared by all heads and left alone, so ``q_pe`` takes the head's whole factor (Kimi K2's
rule). The maxima are recorded on each attention's ``inner_attention`` wrapper, which
receives the query and key after RoPE with the softmax scale and the mask. A query or key
projection with a bias (Qwen2.5's layout) has it scaled with its rows.
"""

from __future__ import annotations

from torch import nn

from torchtitan_dmuon.optim.qk_clip import ClippedAttention, HeadRows, QKClip
from torchtitan_dmuon.titan.config import DMuon

__all__ = ["build_qk_clip"]


def _bias(module: nn.Module, projection: str) -> str | None:
    """The name (under ``module``'s) of ``projection``'s bias, or None if it has none."""
    linear = module.get_submodule(projection)
    return f"{projection}.bias" if getattr(linear, "bias", None) is not None else None


def _rows(name: str, module: nn.Module, projection: str, rows_per_head: int, parts) -> HeadRows:
    bias = _bias(module, projection)
    return HeadRows(
        f"{name}.{projection}.weight",
        rows_per_head,
        parts,
        f"{name}.{bias}" if bias is not None else None,
    )


def _attention(name: str, module: nn.Module, tp: int) -> ClippedAttention | None:
    """``module`` as QK-clip sees it, or None if it is not a TorchTitan attention."""
    if not hasattr(module, "inner_attention") or not (
        hasattr(module, "wq") or hasattr(module, "wkv_b")
    ):
        return None  # e.g. SigLIP2's (q/k/v_proj, no n_heads) in the vlm experiment
    if getattr(module, "attn_type", "sdpa") == "varlen":
        raise ValueError(
            f"[dmuon] qk_clip_threshold: {name} runs varlen attention, whose per-document "
            "mask QK-clip does not read; use attn_type sdpa or flex"
        )
    if module.n_heads % tp:
        raise ValueError(
            f"[dmuon] qk_clip_threshold: {name} has {module.n_heads} heads over TP {tp}"
        )
    if hasattr(module, "wkv_b"):  # DeepSeek-V3's MLA
        nope, rope = module.qk_nope_head_dim, module.qk_rope_head_dim
        query = "wq" if module.q_lora_rank == 0 else "wq_b"
        weights = (
            _rows(
                name,
                module,
                query,
                nope + rope,
                ((0, nope, "query"), (nope, nope + rope, "query_of_shared_key")),
            ),
            _rows(name, module, "wkv_b", nope + module.v_head_dim, ((0, nope, "key"),)),
        )
    else:
        if getattr(module, "q_norm", None) is not None:
            raise ValueError(
                f"[dmuon] qk_clip_threshold: {name} normalizes its queries and keys per head "
                "(qk_norm), which undoes any rescaling of wq and wk: QK-norm already bounds "
                "the logits, QK-clip does not apply to it"
            )
        head = module.head_dim
        weights = (
            _rows(name, module, "wq", head, ((0, head, "query"),)),
            _rows(name, module, "wk", head, ((0, head, "key"),)),
        )
    return ClippedAttention(f"{name}.inner_attention", module.n_heads // tp, weights)


def build_qk_clip(model: nn.Module, settings: DMuon, parallel_dims) -> QKClip | None:
    """The :class:`QKClip` of one model part for ``[dmuon] qk_clip_threshold``; None when it
    is 0 (off) or the part (a pipeline stage) holds no attention.

    Raises:
        ValueError: QK-clip cannot run on this model or layout, naming why: among others a
            trained attention it cannot read (the HF backend's ``self_attn``, SigLIP2's),
            whose logits would go unclipped.
    """
    if settings.qk_clip_threshold == 0:
        return None
    if parallel_dims.cp > 1:
        raise ValueError(
            "[dmuon] qk_clip_threshold: context parallelism is not supported (each rank's "
            "attention sees a slice of the keys, so its maxima are not the heads' maxima)"
        )
    attentions, unread = [], []
    for name, module in model.named_modules():
        attention = _attention(name, module, parallel_dims.tp)
        if attention is not None:
            attentions.append(attention)
        elif type(module).__name__.endswith("Attention") and any(
            p.requires_grad for p in module.parameters()
        ):
            unread.append(f"{name} ({type(module).__name__})")
    if unread:
        raise ValueError(
            f"[dmuon] qk_clip_threshold: QK-clip reads TorchTitan's attention modules (their "
            f"inner_attention), not {unread[0]}"
            + (f" and {len(unread) - 1} more" if len(unread) > 1 else "")
            + ": their logits would go unclipped; unset it for this model"
        )
    if not attentions:
        return None
    return QKClip(model, attentions, settings.qk_clip_threshold, settings.qk_clip_alpha)
