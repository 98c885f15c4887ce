"""The ``[dmuon]`` TOML section, merged into TorchTitan's JobConfig.

TorchTitan imports this module through ``[job] custom_config_module`` (the training entry
point ``torchtitan_dmuon.titan.train`` sets it), so every field below is a TOML key
(``[dmuon] ns_steps = 5``) and a flag (``--dmuon.ns_steps 5``) with this docstring as its
``--help`` text. DMuon is switched on by ``[optimizer] name = "DMuon"``; AdamW, which takes
every parameter DMuon does not, keeps TorchTitan's own ``[optimizer]`` lr, beta1, beta2,
eps and weight_decay. What the Muon matrices get when ``[dmuon]`` leaves their lr or
weight decay unset is :func:`muon_recipe`'s rule.

The section is a :class:`~torchtitan_dmuon.optim.config.MuonConfig`, the same object
``Muon`` takes in Python: a setting is declared once, there. Choice fields are
``Literal``: TorchTitan's parser (tyro) rejects a bad value given as a flag, and
``__post_init__`` one given in a TOML file (which tyro takes as a default and does not
check).
"""

from dataclasses import dataclass, field
from typing import ClassVar, Literal

from torchtitan_dmuon.optim.config import MuonConfig

DEFAULT_PARAM_PATTERNS = (
    "layers.*.attention.w[qkvo].weight",
    "layers.*.feed_forward.w[123].weight",
)
"""The attention and feed-forward projection matrices of TorchTitan's llama3/qwen3/llama4."""

_MOE_PATTERNS = ("layers.*.moe.shared_experts.w[123].weight", "layers.*.moe.experts.w[123]")
_MOE_BOUNDARIES = ("layers.*.moe", "layers.*.moe.experts")


@dataclass(frozen=True)
class ModelSelection:
    """What DMuon takes of a model when ``[dmuon] params`` is left empty: the patterns of
    it that match the model's flavor (a dense flavor has no experts), and likewise the
    hook boundaries when ``[dmuon] hook_boundaries`` is empty."""

    params: tuple[str, ...]
    hook_boundaries: tuple[str, ...] = ()


MODEL_SELECTIONS = {
    "llama3": ModelSelection(DEFAULT_PARAM_PATTERNS),
    "qwen3": ModelSelection(DEFAULT_PARAM_PATTERNS + _MOE_PATTERNS, _MOE_BOUNDARIES),
    "llama4": ModelSelection(DEFAULT_PARAM_PATTERNS + _MOE_PATTERNS, _MOE_BOUNDARIES),
    # MLA: the query (wq, or wq_a / wq_b with a query LoRA), the compressed key-value
    # projections and the output; kv_norm, the router gate and the norms stay on AdamW.
    "deepseek_v3": ModelSelection(
        (
            "layers.*.attention.wq.weight",
            "layers.*.attention.wq_[ab].weight",
            "layers.*.attention.wkv_[ab].weight",
            "layers.*.attention.wo.weight",
            "layers.*.feed_forward.w[123].weight",
            *_MOE_PATTERNS,
        ),
        _MOE_BOUNDARIES,
    ),
    # Attention and expert weights; every bias, the attention sinks and the router on AdamW.
    "gpt_oss": ModelSelection(
        ("layers.*.attention.w[qkvo].weight", "layers.*.moe.experts.mlp[12]_weight"),
        _MOE_BOUNDARIES,
    ),
    # TorchTitan's HF backend (Qwen2.5, Mistral, Llama-3.2: titan/hf.py), by the HF names:
    # the attention and MLP matrices; q/k/v biases, norms, embed_tokens and lm_head (tied
    # to embed_tokens or not) stay on AdamW.
    "transformers_modeling_backend": ModelSelection(
        (
            "model.model.layers.*.self_attn.[qkvo]_proj.weight",
            "model.model.layers.*.mlp.gate_proj.weight",
            "model.model.layers.*.mlp.up_proj.weight",
            "model.model.layers.*.mlp.down_proj.weight",
        )
    ),
    # TorchTitan's vlm experiment (titan/vlm.py): the Llama 3 decoder's matrices and the
    # SigLIP2 encoder's q/k/v/out_proj and fc1/fc2 weights; a frozen encoder's matches are
    # left out by dedicate_params (no owner, hook, collective or state). Biases, layer
    # norms, the patch and position embeddings, the projector and a VLA's action head stay
    # on AdamW. The encoder layers are hook boundaries as the decoder's (ModuleDict
    # children).
    "vlm": ModelSelection(
        (
            *DEFAULT_PARAM_PATTERNS,
            "encoder.layers.*.self_attn.[qkv]_proj.weight",
            "encoder.layers.*.self_attn.out_proj.weight",
            "encoder.layers.*.mlp.fc[12].weight",
        )
    ),
}
"""The default selection of each model that has one of its own: what a Muon user picks,
the matrices of attention and of the dense and expert FFNs. Any other model (a user's,
registered through ``[experimental] custom_import``) gets the 2-D weights of the
``nn.Linear`` layers inside its blocks (``parallelize.linear_selection``)."""


@dataclass(frozen=True)
class DMuon(MuonConfig):
    """Dedicated-ownership Muon, one owner rank per matrix ([optimizer] name = "DMuon"):
    every field of :class:`~torchtitan_dmuon.optim.config.MuonConfig` (the optimizer's
    settings, declared there once), and what only the trainer reads."""

    where: ClassVar[str] = "[dmuon] "

    lr: float | None = None
    """Muon learning rate (before adjust_lr_fn); an LR scheduler scales it like AdamW's.
    Unset: 0.02 (Keller Jordan's; the best of 0.01, 0.02, 0.04 at every weight decay at
    both sizes measured) with adjust_lr_fn original or spectral; [optimizer] lr
    with match_rms_adamw, whose per-shape scale is meant to carry AdamW's lr over (measured,
    it did at the debug size, not at 4.8x its parameters: docs/benchmarks.md#the-recipe)."""

    weight_decay: float | None = None
    """Decoupled weight decay of the Muon matrices (each step multiplies them by 1 - lr x
    weight_decay). Unset: 0.1 with adjust_lr_fn original or spectral (what won the
    convergence sweep at Muon's lr 0.02 at both sizes, docs/benchmarks.md#the-recipe),
    never read from [optimizer] weight_decay, which is AdamW's at AdamW's lr; [optimizer]
    weight_decay with match_rms_adamw, whose lr is AdamW's. The startup line ("DMuon
    recipe:") gives each group's lr x weight_decay (the fraction decayed per step at the
    peak lr) and what decay alone leaves of it over the run's lr schedule, and warns below
    0.16, the least the convergence benchmark measured (1800 steps at the default, which
    ended lower than a third of that weight decay did)."""

    params: list[str] = field(default_factory=list)
    """Glob patterns over parameter names (activation-checkpoint and compile wrapper
    prefixes removed) that select the matrices DMuon owns; each must match at least one
    parameter, and every match must be a 2-D matrix or a 3-D stack of matrices (MoE routed
    experts, e.g. "layers.*.moe.experts.w[123]": split among owners, each expert
    orthogonalized on its own). The rest goes to AdamW. Empty (the default): the model's
    own selection (MODEL_SELECTIONS in torchtitan_dmuon/titan/config.py: the attention,
    dense FFN and expert matrices), as far as its flavor has them; for a model without one
    the 2-D weights of the nn.Linear layers inside its blocks (logged at start)."""

    hook_boundaries: list[str] = field(default_factory=list)
    """Glob patterns over module names that become hook boundaries besides the transformer
    blocks (the innermost boundary of a matrix drives its broadcasts and reduce), e.g.
    ["layers.*.moe", "layers.*.moe.experts"] to align with MoE and expert modules. Empty:
    the model's own (its MoE and expert modules, where it has them; logged when params is
    set), else the blocks only (as fully_shard)."""

    reshard_after_forward: bool | None = None
    """True: Z3 (free non-owned matrices after forward, broadcast again before backward).
    False: Z2 (keep them until after backward: one broadcast per block per step less).
    None (the default): follow parallelism.fsdp_reshard_after_forward as FSDP2 does:
    "always" is Z3, "never" Z2, "default" Z3 without pipeline parallelism and Z2 with it
    (a stage then keeps its matrices over all its micro-batches: one broadcast per step)."""

    owner_group_size: int | None = None
    """Ranks that own each dense matrix together, each a block of it along its long side,
    running its Newton-Schulz together (it must divide the shard degree). 1: one owner per
    matrix. None (the default): the planner's choice, the size whose busiest rank spends
    the least modeled time on Newton-Schulz, its products and its groups' Gram
    all-reduces on an H100 (engine/machine.py): one owner per matrix wherever that is
    balanced already (Llama-3.1 8B at 128 ranks) or the matrices are too small to split
    (the debug models); always under tensor parallelism. The startup line names it."""

    split_backward_with_fsdp: bool = False
    """Run a pipeline schedule that splits backward into input and weight passes (zero
    bubble, DualPipeV, a CSV with W actions) with FSDP. Off: refused at startup, since
    torch 2.13's weight pass gives FSDP's own parameters wrong gradients (with any
    optimizer); data_parallel_replicate_degree instead of data_parallel_shard_degree runs
    such schedules with DMuon's DDP-style sync, correctly."""

    qk_clip_threshold: float = 0.0
    """QK-clip (Kimi K2's MuonClip) threshold tau; 0 (the default): off. Each step every
    rank records, per attention head, the largest pre-softmax logit of its batch (from the
    query and key the attention receives, after RoPE, with its softmax scale and mask),
    the maxima are MAX-reduced over the data-parallel ranks, and after Muon's update the
    owner of each head's query and key rows rescales them by (tau / max)^alpha and
    (tau / max)^(1 - alpha) where max > tau. What is clipped: llama3 and llama4: each
    head's rows of wq and wk (a grouped key head takes its query group's smallest factor);
    deepseek_v3 (MLA): q_nope rows of wq / wq_b and k_nope rows of wkv_b as above, and the
    head's q_pe rows by the whole factor, since its RoPE key k_pe is shared by all heads
    and stays as it is. Not available for qwen3 (its QK-norm undoes any rescaling of wq
    and wk, and already bounds the logits), varlen attention or context parallelism. Kimi
    K2 used 100. The largest logit and the count of clipped heads are logged (dmuon line,
    TensorBoard dmuon/qk_max_logit, dmuon/qk_clipped_heads)."""

    qk_clip_alpha: float = 0.5
    """The query's share of QK-clip's rescaling, in [0, 1]: the query rows are scaled by
    factor^alpha and the key rows by factor^(1 - alpha)."""

    nonfinite_grad_norm: Literal["skip", "stop", "continue"] = "skip"
    """What a step whose global gradient norm is NaN or infinite does (the norm is the
    one all ranks share, so all ranks act alike). "skip": no optimizer step (parameters,
    momentum and AdamW state stay as they were, the gradients are zeroed, a warning names
    the step); the LR scheduler still advances, as the schedule follows the step count,
    and the optimizer's step hooks (MoE load balancing, float8 scales) still run. "stop":
    raise an error naming the step. "continue": step anyway (one host sync per step less).
    """

    def __post_init__(self) -> None:
        """Check every field (TOML values reach here unchecked: tyro takes them as
        defaults).

        Raises:
            ValueError: A field is out of its choices or range, naming it.
        """
        super().__post_init__()
        if self.owner_group_size is not None and self.owner_group_size < 1:
            raise ValueError(
                f"[dmuon] owner_group_size must be >= 1 or unset (the planner's choice), got "
                f"{self.owner_group_size}"
            )
        if self.qk_clip_threshold < 0:
            raise ValueError(
                f"[dmuon] qk_clip_threshold must be >= 0 (0: off), got {self.qk_clip_threshold}"
            )
        if not 0.0 <= self.qk_clip_alpha <= 1.0:
            raise ValueError(f"[dmuon] qk_clip_alpha must be in [0, 1], got {self.qk_clip_alpha}")


ORIGINAL_LR = 0.02
"""The Muon matrices' lr under adjust_lr_fn original or spectral when [dmuon] lr is unset."""

ORIGINAL_WEIGHT_DECAY = 0.1
"""Their weight decay under adjust_lr_fn original or spectral when [dmuon] weight_decay is
unset: what won the convergence sweep at lr 0.02 at both model sizes, against 0.01 (the
Muon reference recipe's) and none (docs/benchmarks.md#the-recipe). Over 600 steps of
warmup and linear decay it leaves 0.55 of the matrices' values; over the GPU configs' 1000
steps 0.37; a run whose schedule leaves less than ``DECAY_KEPT_BOUND`` is warned."""

DECAY_KEPT_BOUND = 0.16
"""The least fraction of its values that weight decay alone left the matrices in a run of
the convergence benchmark that trained better than less decay (the debug size over 1800
steps at lr 0.02 x weight decay 0.1 left 0.165 and ended 0.13 below weight decay 0.0333,
which left 0.55); a run whose lr schedule and weight decay leave less gets a warning at
startup, as the recipe is unmeasured there."""


@dataclass(frozen=True)
class MuonRecipe:
    """The lr and weight decay the Muon matrices train with, and where each came from.

    Attributes:
        lr: Muon's lr (before adjust_lr_fn).
        weight_decay: Muon's decoupled weight decay.
        lr_from: What set ``lr``, for the startup line.
        weight_decay_from: What set ``weight_decay``.
    """

    lr: float
    weight_decay: float
    lr_from: str
    weight_decay_from: str


def muon_recipe(dmuon: DMuon, optimizer_lr: float, optimizer_weight_decay: float) -> MuonRecipe:
    """The rule for what ``[dmuon]`` leaves unset: per ``adjust_lr_fn``, never a setting
    multiplied by another's scale. ``match_rms_adamw`` scales each update to AdamW's RMS,
    so it takes AdamW's lr and weight decay as they are (Moonlight's drop-in recipe; it
    trailed AdamW at the larger size measured, as AdamW's best lr fell faster with width);
    ``original`` and ``spectral`` take Muon's own lr, 0.02, about 7-70x an AdamW lr, so
    they take their own weight decay too.

    Args:
        dmuon: The ``[dmuon]`` section.
        optimizer_lr: ``[optimizer] lr``.
        optimizer_weight_decay: ``[optimizer] weight_decay``.

    Returns:
        The Muon matrices' lr and weight decay.
    """
    if dmuon.adjust_lr_fn == "match_rms_adamw":
        defaults = (optimizer_lr, optimizer_weight_decay)
        why = "[optimizer]'s, as match_rms_adamw carries AdamW's over"
    else:
        defaults = (ORIGINAL_LR, ORIGINAL_WEIGHT_DECAY)
        why = f"the default of adjust_lr_fn {dmuon.adjust_lr_fn!r}"
    given = {"lr": dmuon.lr, "weight_decay": dmuon.weight_decay}
    values = [v if v is not None else d for v, d in zip(given.values(), defaults, strict=True)]
    sources = [f"[dmuon] {k}" if v is not None else f"unset: {why}" for k, v in given.items()]
    return MuonRecipe(*values, *sources)


@dataclass
class HFTransformers:
    """TorchTitan's HF backend section (``[model] name = "transformers_modeling_backend"``),
    as ``torchtitan.experiments.transformers_modeling_backend.job_config`` declares it:
    declared again here, since importing that module imports ``transformers``, which the
    other models do not need, and one ``custom_config_module`` must carry both sections."""

    model: str = ""
    """HF model id or local folder whose config.json the model is built from (no weights
    are loaded). Empty: the flavor's own folder (DMuon's flavors, e.g. "qwen2.5-7B":
    torchtitan_dmuon/titan/hf_configs/<flavor>/)."""


@dataclass
class VLM:
    """The modes of TorchTitan's vlm experiment under DMuon (``[model] name = "vlm"``,
    torchtitan_dmuon/titan/vlm.py)."""

    vision_tower: Literal["trainable", "frozen"] = "trainable"
    """"trainable": the encoder trains, its q/k/v/out_proj and fc1/fc2 weights under DMuon.
    "frozen": its parameters do not require gradients; DMuon leaves its matrices out (no
    owner, hook, collective or optimizer state) and AdamW holds no state for them."""

    attention: Literal["auto", "flex", "sdpa"] = "auto"
    """The attention kernel of FlexAttention flavors. "sdpa": the same masks (built
    without torch.compile) as dense tensors for scaled_dot_product_attention (FlexAttention
    has no CPU backward); "auto": sdpa without CUDA, flex with it."""

    action_dim: int = 0
    """> 0: a VLA, an action head regressing this many continuous numbers per sample from
    the final hidden state of its last text token (trained on AdamW); needs
    [training] dataset = "dmuon-vlm" (data with actions: torchtitan_dmuon.titan.vlm_assets)."""

    action_hidden: int = 256
    """Hidden width of the action head's two-layer MLP."""

    action_loss_weight: float = 1.0
    """Weight of the action head's summed squared error in the loss (a sample's error
    weighs as this many tokens of cross-entropy)."""

    lm_loss_weight: float = 1.0
    """Weight of the LM cross-entropy; 0 trains a VLA on its actions alone."""

    def __post_init__(self) -> None:
        """Check the numbers (TOML values reach here unchecked).

        Raises:
            ValueError: A field is out of range, naming it.
        """
        if self.action_dim < 0 or self.action_hidden < 1:
            raise ValueError(
                f"[vlm] action_dim must be >= 0 and action_hidden >= 1, got "
                f"{self.action_dim} and {self.action_hidden}"
            )
        if self.action_loss_weight < 0 or self.lm_loss_weight < 0:
            raise ValueError("[vlm] action_loss_weight and lm_loss_weight must be >= 0")


@dataclass
class Data:
    """The vlm experiment's ``[data]`` section, as ``torchtitan.experiments.vlm.job_config``
    declares it (declared again: importing that package imports its datasets)."""

    max_images_per_batch: int = 10
    """Vision encoder batch size (N)."""
    max_patches_per_image: int = 256
    """Vision encoder sequence length (L)."""
    patch_size: int = 16
    """Patch size of the vision encoder."""
    spatial_merge_size: int = 1
    """Spatially merge visual tokens after the encoder (1: no merging)."""
    packing_buffer_size: int = 0
    """> 0: sample packing with a buffer of this many samples."""


@dataclass
class JobConfig:
    """Adds the [dmuon] section, the HF backend's [hf_transformers] and the vlm
    experiment's [data] and [vlm] to TorchTitan's JobConfig."""

    dmuon: DMuon = field(default_factory=DMuon)
    hf_transformers: HFTransformers = field(default_factory=HFTransformers)
    vlm: VLM = field(default_factory=VLM)
    data: Data = field(default_factory=Data)
