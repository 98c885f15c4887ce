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

TorchTitan's HF backend (``transformers_modeling_backend``: Qwen2.5, Mistral, Llama-3.2)
runs ``transformers``' attention modules (``self_attn``: ``q_proj`` and ``k_proj`` of
``head_dim`` rows per head, grouped-query), which hand the query and key after RoPE to the
attention function registered as their config's ``attn_implementation``: the backend's
``"sdpa_torchtitan"``, ``transformers``' ``sdpa_attention_forward``. With QK-clip on, each
such module gets an ``inner_attention`` (:class:`_HFSdpa`) that makes that same call, and
the model's config names :data:`HF_ATTENTION`, whose function routes the call through it:
the watched call, traced by the per-block compile as TorchTitan's own. The backend builds
no mask for its implementation (``transformers``' mask functions skip names they do not
know), so sdpa attends causally over the whole sequence, also in a layer whose config sets
a sliding window (the call ignores ``sliding_window``): the maxima are of the logits it
computes. A boolean 4-D mask handed to the model's forward reaches the call and is read.
"""

from __future__ import annotations

from torch import nn

from torchtitan_dmuon.optim.qk_clip import ClippedAttention, HeadRows, QKClip
from torchtitan_dmuon.titan.config import DMuon

__all__ = ["HF_ATTENTION", "build_qk_clip"]

HF_BACKEND_ATTENTION = "sdpa_torchtitan"
"""The ``attn_implementation`` TorchTitan's HF backend registers (``transformers``' sdpa)."""

HF_ATTENTION = "sdpa_torchtitan_qk_clip"
"""The ``attn_implementation`` of an HF backend model QK-clip watches: the backend's sdpa
call, made through each attention module's ``inner_attention``."""


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


def _refuse_qk_norm(name: str, module: nn.Module) -> None:
    if getattr(module, "q_norm", None) is not None:
        raise ValueError(
            f"[dmuon] qk_clip_threshold: {name} normalizes its queries and keys per head "
            "(qk_norm), which undoes any rescaling of its query and key projections: QK-norm "
            "already bounds the logits, QK-clip does not apply to it"
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
        _refuse_qk_norm(name, module)
        head = module.head_dim
        weights = (
            _rows(name, module, "wq", head, ((0, head, "query"),)),
            _rows(name, module, "wk", head, ((0, head, "key"),)),
        )
    return ClippedAttention(f"{name}.inner_attention", module.n_heads // tp, weights)


class _HFSdpa(nn.Module):
    """The HF backend's attention call as a module QK-clip watches: ``(query, key, value)``
    of shape ``(batch, heads, seq, dim)`` after RoPE, the softmax scale as ``scale``,
    ``is_causal`` and the mask (if any) as ``attn_mask``.

    Args:
        attend: The function the backend registered (``transformers``'
            ``sdpa_attention_forward``), called as the attention module would.
        num_key_value_groups: The attention module's query heads per key head (the
            function repeats the keys and values by it, or runs sdpa's GQA).
    """

    def __init__(self, attend, num_key_value_groups: int) -> None:
        super().__init__()
        self.attend = attend
        self.num_key_value_groups = num_key_value_groups

    def forward(self, query, key, value, *, scale, is_causal, attn_mask=None, **kwargs):
        return self.attend(
            self, query, key, value, attn_mask, scaling=scale, is_causal=is_causal, **kwargs
        )


def _hf_sdpa_through_inner_attention(
    module, query, key, value, attention_mask, scaling=None, is_causal=None, **kwargs
):
    """The attention function of :data:`HF_ATTENTION`: ``module.inner_attention`` makes the
    backend's sdpa call. ``is_causal`` is decided here by ``sdpa_attention_forward``'s own
    rule, so that the watched call says which keys each query sees."""
    if is_causal is None:
        is_causal = (
            query.shape[2] > 1 and attention_mask is None and getattr(module, "is_causal", True)
        )
    return module.inner_attention(
        query, key, value, scale=scaling, is_causal=is_causal, attn_mask=attention_mask, **kwargs
    )


def _is_hf_attention(module: nn.Module) -> bool:
    """Whether ``module`` is a ``transformers`` attention of the llama layout (``q_proj``,
    ``k_proj``, ``head_dim``, grouped-query heads, a config)."""
    return type(module).__module__.startswith("transformers.") and all(
        hasattr(module, attr)
        for attr in ("q_proj", "k_proj", "head_dim", "num_key_value_groups", "config")
    )


def _hf_attention(name: str, module: nn.Module, tp: int) -> ClippedAttention:
    """``module`` (a :func:`_is_hf_attention`) as QK-clip sees it, once
    :func:`_watch_hf_attention` has routed its call through ``inner_attention``.

    Raises:
        ValueError: It does not run the backend's sdpa, normalizes its queries and keys,
            or its heads do not split over tensor parallelism.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    implementation = module.config._attn_implementation
    if implementation not in (HF_BACKEND_ATTENTION, HF_ATTENTION) or (
        ALL_ATTENTION_FUNCTIONS._global_mapping.get(HF_BACKEND_ATTENTION)
        is not sdpa_attention_forward
    ):
        raise ValueError(
            f"[dmuon] qk_clip_threshold: {name} runs attn_implementation {implementation!r}; "
            f"QK-clip reads the HF backend's {HF_BACKEND_ATTENTION!r} (transformers' sdpa) only"
        )
    _refuse_qk_norm(name, module)
    config = module.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    if heads % tp or kv_heads % tp:
        raise ValueError(
            f"[dmuon] qk_clip_threshold: {name} has {heads} query and {kv_heads} key heads "
            f"over TP {tp}"
        )
    head = module.head_dim
    weights = (
        _rows(name, module, "q_proj", head, ((0, head, "query"),)),
        _rows(name, module, "k_proj", head, ((0, head, "key"),)),
    )
    return ClippedAttention(f"{name}.inner_attention", heads // tp, weights)


def _watch_hf_attention(module: nn.Module) -> None:
    """Route ``module``'s attention call through an ``inner_attention`` (:class:`_HFSdpa`)
    making the backend's sdpa call, and name :data:`HF_ATTENTION` in its config (shared by
    the model's layers)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

    if HF_ATTENTION not in ALL_ATTENTION_FUNCTIONS._global_mapping:
        AttentionInterface.register(HF_ATTENTION, _hf_sdpa_through_inner_attention)
    if not isinstance(getattr(module, "inner_attention", None), _HFSdpa):
        attend = ALL_ATTENTION_FUNCTIONS[HF_BACKEND_ATTENTION]
        module.inner_attention = _HFSdpa(attend, module.num_key_value_groups)
    module.config._attn_implementation = HF_ATTENTION


def build_qk_clip(model: nn.Module, settings: DMuon, parallel_dims) -> QKClip | None:
    """The :class:`QKClip` of one model part for ``[dmuon] qk_clip_threshold``; None when it
    is 0 (off) or the part (a pipeline stage) holds no attention. An HF backend model's
    attention calls are routed through modules it watches (see the module docstring):
    before the first forward, which the per-block compile traces.

    Raises:
        ValueError: QK-clip cannot run on this model or layout, naming why: among others a
            trained attention it cannot read (SigLIP2's in the vlm experiment, an HF
            attention on another ``attn_implementation`` than the backend's sdpa), whose
            logits would go unclipped.
    """
    if settings.qk_clip_threshold == 0:
        return None
    if parallel_dims.cp > 1:
        raise ValueError(
            "[dmuon] qk_clip_threshold: context parallelism is not supported (each rank's "
            "attention sees a slice of the keys, so its maxima are not the heads' maxima)"
        )
    attentions, unread, hf_modules = [], [], []
    for name, module in model.named_modules():
        attention = _attention(name, module, parallel_dims.tp)
        if attention is None and _is_hf_attention(module):
            attention = _hf_attention(name, module, parallel_dims.tp)
            hf_modules.append(module)
        if attention is not None:
            attentions.append(attention)
        elif type(module).__name__.endswith("Attention") and any(
            p.requires_grad for p in module.parameters()
        ):
            unread.append(f"{name} ({type(module).__name__})")
    if unread:
        raise ValueError(
            f"[dmuon] qk_clip_threshold: QK-clip reads TorchTitan's attention modules (their "
            f"inner_attention) and the HF backend's (q_proj, k_proj), not {unread[0]}"
            + (f" and {len(unread) - 1} more" if len(unread) > 1 else "")
            + ": their logits would go unclipped; unset it for this model"
        )
    if not attentions:
        return None
    # Only once nothing is refused: the model then runs as before unless it is clipped.
    for module in hf_modules:
        _watch_hf_attention(module)
    return QKClip(model, attentions, settings.qk_clip_threshold, settings.qk_clip_alpha)
