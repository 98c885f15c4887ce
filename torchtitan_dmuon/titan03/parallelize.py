"""Dedicate right before TorchTitan 0.3's FSDP, on the data-parallel axes found by name.

Every 0.3 decoder (llama3, qwen3, ...) applies FSDP through
``apply_fsdp_to_decoder(model, dp_mesh, ..., dp_mesh_dims=...)`` imported into its
parallelize module (deepseek_v3 through ``apply_fsdp_to_mtp_decoder``, which adds its
multi-token-prediction layers to the blocks for it). :func:`with_dedication` wraps a model
spec's ``parallelize_fn`` so that, for the call, that name dedicates the selected matrices
first and then applies TorchTitan's FSDP, which skips them. The mesh it receives is,
under the default ``spmd_types`` backend, the multi-axis storage mesh (``dp_replicate,
dp_shard, cp, tp``) with ``DataParallelMeshDims`` naming the data-parallel axes: DMuon's
shard mesh is the ``shard`` axis (``dp_shard``, flattened with ``cp`` under context
parallelism), its replicate mesh the ``replicate`` axis (HSDP); under ``partial_dtensor``
the names are 0.2.2's (``fsdp``, ``dp_replicate``). Fused QKV projections
(``FusedQKVLinear``, 0.3's default) are marked, so each of their query, key and value
matrices gets its own Newton-Schulz (``optim/fused_rows.py``). What DMuon takes by
default: :func:`default_selection`.

What this step of the adapter does not take yet is refused by name before any collective:
tensor and pipeline parallelism, expert parallelism, CUDA graphs (their captured replay
would skip the hooks' Python: ``--training.disable_cuda_graphs``).
"""

from __future__ import annotations

import fnmatch
import functools
import inspect
import logging
import sys
import types
from collections.abc import Callable

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torchtitan.models.common.attention import FusedQKVLinear
from torchtitan.models.common.moe import GroupedExperts, MoE, TokenChoiceTopKRouter

from torchtitan_dmuon.engine import get_dedication
from torchtitan_dmuon.optim.fused_rows import FusedRows, mark_fused_rows
from torchtitan_dmuon.titan.config import DMuon, ModelSelection
from torchtitan_dmuon.titan.parallelize import (
    block_pattern,
    clean_fqn,
    dedicate_part,
    keep_settings,
    linear_selection,
    resolve_selection,
)
from torchtitan_dmuon.titan.patches import PatchRegistry

logger = logging.getLogger(__name__)

__all__ = ["data_parallel_meshes", "mark_fused_qkv", "with_dedication"]

_HOOKED = ("apply_fsdp_to_decoder", "apply_fsdp_to_mtp_decoder")
"""The names through which 0.3's parallelize functions apply FSDP."""


def data_parallel_meshes(
    dp_mesh: DeviceMesh, dp_mesh_dims
) -> tuple[DeviceMesh | None, DeviceMesh | None]:
    """``(shard mesh, replicate mesh)`` of the mesh TorchTitan 0.3 gives FSDP: the axes
    ``dp_mesh_dims`` (``DataParallelMeshDims``) names, or, without it, 0.2.2's names
    (``fsdp``, ``dp_replicate``). ``(None, None)`` where one rank holds the data."""
    names = tuple(dp_mesh.mesh_dim_names or ())
    if dp_mesh_dims is None:
        if dp_mesh.size() == 1:
            return None, None
        shard = dp_mesh["fsdp"] if "fsdp" in names else dp_mesh
        replicate = dp_mesh["dp_replicate"] if "dp_replicate" in names else None
        return shard, replicate
    shard_axes = dp_mesh_dims.shard
    if isinstance(shard_axes, str):
        shard = dp_mesh[shard_axes]
    else:  # dp_shard and cp: one FSDP shard dim, as FSDP flattens them
        shard = dp_mesh[tuple(shard_axes)]._flatten("_".join(shard_axes))
    replicate = dp_mesh[dp_mesh_dims.replicate] if dp_mesh_dims.replicate else None
    return shard, replicate


def default_selection(model: nn.Module) -> ModelSelection:
    """What DMuon takes of a 0.3 model when ``[dmuon] params`` is empty: the 2-D weights of
    the ``nn.Linear`` layers inside its blocks but a MoE router's (a router stays on AdamW,
    as 0.2.2's model selections keep it) and its routed experts' stacks
    (``GroupedExperts``: each expert its own matrix, the stacks split among owners); with
    experts, the hook boundaries are each MoE module and its experts' module, as 0.2.2's
    MoE models have them."""
    modules = dict(model.named_modules())
    routers = [
        clean_fqn(f"{name}.{weight}")
        for name, module in modules.items()
        if isinstance(module, TokenChoiceTopKRouter)
        for weight, _ in module.named_parameters()
    ]
    params = [
        pattern
        for pattern in linear_selection(model)
        if not any(fnmatch.fnmatchcase(router, pattern) for router in routers)
    ]
    experts = [n for n, m in modules.items() if isinstance(m, GroupedExperts)]
    stacks = [f"{n}.{w}" for n in experts for w, p in modules[n].named_parameters() if p.ndim == 3]
    boundaries = [n for n, m in modules.items() if isinstance(m, MoE)] + experts
    return ModelSelection(
        tuple(dict.fromkeys(params + [block_pattern(n) for n in stacks])),
        tuple(dict.fromkeys(block_pattern(n) for n in boundaries)),
    )


def mark_fused_qkv(model: nn.Module) -> list[str]:
    """Mark the weight of every ``FusedQKVLinear`` of ``model`` as its query, key and value
    matrices fused (rows ``[n_kv_heads, heads_per_kv + 2, head_dim]``). Returns their names."""
    marked = []
    for name, module in model.named_modules():
        if not isinstance(module, FusedQKVLinear):
            continue
        n_kv = module.wqkv.weight.shape[0] // (module.r_dim * module.head_dim)
        layout = FusedRows(n_kv, (module.heads_per_kv, 1, 1), module.head_dim)
        weight = f"{name}.wqkv.weight"
        mark_fused_rows(model, weight, layout)
        marked.append(clean_fqn(weight))
    return marked


def _refuse_unsupported(parallel_dims, training) -> None:
    """What this adapter does not take yet, by flag, before any collective."""
    refused = [
        (parallel_dims.tp_enabled, "--parallelism.tensor_parallel_degree"),
        (parallel_dims.pp_enabled, "--parallelism.pipeline_parallel_degree"),
        (parallel_dims.ep_enabled, "--parallelism.expert_parallel_degree"),
    ]
    for on, flag in refused:
        if on:
            raise ValueError(
                f"{flag} > 1: DMuon on TorchTitan 0.3 takes data parallelism (FSDP, HSDP, "
                "DDP-style) and context parallelism so far; set it to 1, or train with "
                "TorchTitan 0.2.2's adapter (torchtitan_dmuon.titan), which takes it"
            )
    if not training.disable_cuda_graphs:
        raise ValueError(
            "training.disable_cuda_graphs = False: TorchTitan 0.3 captures forward and "
            "backward in a CUDA graph and replays it, and the replay runs none of the Python "
            "of DMuon's hooks (the gathers and reduces of the dedicated matrices): pass "
            "--training.disable_cuda_graphs (with_dmuon sets it)"
        )


def with_dedication(
    parallelize_fn: Callable, settings: DMuon, model_name: str, flavor: str = ""
) -> Callable:
    """``parallelize_fn`` (a 0.3 model spec's) with DMuon's dedication right before its
    FSDP, with ``settings`` (``params`` empty: :func:`default_selection`). The names in
    ``_HOOKED`` that its module holds (each of 0.3's parallelize functions applies FSDP
    through one of them: ``apply_fsdp_to_mtp_decoder`` adds deepseek_v3's
    multi-token-prediction layers to the blocks for ``apply_fsdp_to_decoder``) dedicate
    first, once, for the call.

    Raises:
        ValueError: the function's module holds none of those names (naming it); a
            refused setting (see the module's docstring). On every rank alike, before any
            collective.
    """
    target = inspect.unwrap(parallelize_fn)
    module = sys.modules.get(getattr(target, "__module__", ""))
    hooked = [name for name in _HOOKED if hasattr(module, name)]

    @functools.wraps(parallelize_fn)
    def parallelize(model: nn.Module, *, parallel_dims, training, **kwargs):
        _refuse_unsupported(parallel_dims, training)
        if not hooked:
            raise ValueError(
                f"DMuon cannot train {model_name}: its parallelize function "
                f"{target.__module__}.{target.__qualname__} does not apply FSDP through "
                f"{' or '.join(_HOOKED)}, the names DMuon hooks to dedicate right before FSDP"
            )
        fused = mark_fused_qkv(model)
        job = types.SimpleNamespace(
            dmuon=settings, model=types.SimpleNamespace(name=model_name, flavor=flavor)
        )
        own = {model_name: default_selection(model)}
        resolved = resolve_selection(model, job, selections=own)
        if fused:
            logger.info(
                "dmuon: %d fused QKV projections, each matrix its own Newton-Schulz", len(fused)
            )

        def dedicating(original: Callable) -> Callable:
            @functools.wraps(original)
            def apply_fsdp(model_, dp_mesh, *args, dp_mesh_dims=None, **fsdp_kwargs):
                shard_mesh, replicate_mesh = data_parallel_meshes(dp_mesh, dp_mesh_dims)
                if shard_mesh is None:
                    keep_settings(model_, resolved)
                elif get_dedication(model_) is None:
                    z3 = _reshard_after_forward(resolved, fsdp_kwargs, parallel_dims)
                    dedicate_part(model_, shard_mesh, replicate_mesh, resolved, z3)
                return original(model_, dp_mesh, *args, dp_mesh_dims=dp_mesh_dims, **fsdp_kwargs)

            return apply_fsdp

        with PatchRegistry() as patches:
            for name in hooked:
                patches.setattr(module, name, dedicating(getattr(module, name)))
            return parallelize_fn(model, parallel_dims=parallel_dims, training=training, **kwargs)

    return parallelize


def _reshard_after_forward(settings: DMuon, fsdp_kwargs: dict, parallel_dims) -> bool:
    """``[dmuon] reshard_after_forward``, or FSDP2's choice under TorchTitan's policy."""
    if settings.reshard_after_forward is not None:
        return settings.reshard_after_forward
    policy = fsdp_kwargs.get("reshard_after_forward_policy", "default")
    return policy == "always" or (policy == "default" and not parallel_dims.pp_enabled)
