"""CPU support for TorchTitan 0.3: what its trainer needs to run on gloo.

As ``titan/cpu.py`` does for 0.2.2 (whose helpers it uses): the ``"cpu"`` device and a
``device_module`` in every module that copied them at import (TorchTitan falls back to
``"cuda"``), FSDP2 reducing with plain SUM (TorchTitan turns FSDP's gradient division off,
which FSDP2 implements with ``PREMUL_SUM``, an op gloo lacks). And one change of the model
config: FlexAttention, the default of 0.3's language models, has no backward on CPU, so its
inner attention becomes ``ScaledDotProductAttention`` (causal, the same function where the
documents of a sequence are not masked apart, as ``c4_test``'s packed samples are not).
Applied only without a CUDA device, through the trainer's
:class:`~torchtitan_dmuon.titan.patches.PatchRegistry`, undone when the trainer ends.
"""

from __future__ import annotations

import logging

import torch
import torchtitan.components.metrics as metrics
import torchtitan.distributed.fsdp as titan_fsdp
import torchtitan.distributed.parallel_dims as parallel_dims
import torchtitan.distributed.utils as dist_utils
import torchtitan.models.common.token_dispatcher as token_dispatcher
import torchtitan.tools.profiler as profiler
import torchtitan.tools.utils as tools_utils
from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention

from torchtitan_dmuon.titan.cpu import (
    cpu_device_module,
    disable_fsdp_gradient_division_with_sum,
    refuse_unused_gpus,
)
from torchtitan_dmuon.titan.patches import PatchRegistry

logger = logging.getLogger(__name__)

__all__ = ["enable_cpu_support", "sdpa_attention"]


def sdpa_attention(model_config) -> int:
    """Make every FlexAttention of a 0.3 model config ``ScaledDotProductAttention`` (causal),
    in place. Returns how many."""
    replaced = 0
    for _, _, parent, attr in model_config.traverse(FlexAttention.Config):
        if isinstance(attr, int):
            parent[attr] = ScaledDotProductAttention.Config()
        else:
            setattr(parent, attr, ScaledDotProductAttention.Config())
        replaced += 1
    return replaced


def enable_cpu_support(patches: PatchRegistry, config) -> bool:
    """Apply the CPU layer through ``patches``, and the CPU attention to ``config``'s
    model, if there is no CUDA device. Returns whether it is active.

    Raises:
        RuntimeError: The machine has NVIDIA GPUs that this torch cannot use (see
            ``titan/cpu.py``).
    """
    if torch.cuda.is_available():
        return False
    refuse_unused_gpus()
    device_module = cpu_device_module()
    for module in (tools_utils, dist_utils, metrics, parallel_dims, token_dispatcher):
        patches.setattr(module, "device_type", "cpu")
    for module in (tools_utils, dist_utils, metrics, token_dispatcher, profiler):
        patches.setattr(module, "device_module", device_module)
    patches.setattr(
        titan_fsdp, "disable_fsdp_gradient_division", disable_fsdp_gradient_division_with_sum
    )
    replaced = sdpa_attention(config.model_spec.model)
    logger.info(
        "TorchTitan CPU support enabled: device cpu, gloo, SUM reductions%s",
        f", SDPA for the {replaced} FlexAttention layers (no CPU backward)" if replaced else "",
    )
    return True
