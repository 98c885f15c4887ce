"""Run ``dedicate_params`` inside TorchTitan's parallelize functions, right before FSDP.

TorchTitan's parallelize functions apply TP, CP, activation checkpointing and compile,
then FSDP/HSDP (``apply_fsdp``) or DDP (``apply_ddp``). :func:`with_dedication` wraps one
so that, when ``[optimizer] name = "DMuon"``, the wrapped function's own ``apply_fsdp``
first dedicates the selected matrices on the FSDP mesh (HSDP: its ``fsdp`` dim as shard
mesh and ``dp_replicate`` as replicate mesh), and ``apply_ddp`` is replaced by DMuon's
DDP-style synchronization. The names are swapped in the function's module only for the
duration of the call. Everything else is TorchTitan's code, unchanged.
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import weakref
from collections.abc import Callable

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from torchtitan_dmuon.engine import dedicate_params
from torchtitan_dmuon.engine.plan import default_boundary_modules
from torchtitan_dmuon.titan.config import DMuon

__all__ = ["DMUON", "clean_fqn", "dmuon_settings", "with_dedication"]

DMUON = "DMuon"
"""The ``[optimizer] name`` that turns DMuon on."""

_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.")

_SETTINGS: weakref.WeakKeyDictionary[nn.Module, DMuon] = weakref.WeakKeyDictionary()


def dmuon_settings(model: nn.Module) -> DMuon:
    """The ``[dmuon]`` section a model part was dedicated with."""
    if model not in _SETTINGS:
        raise RuntimeError(
            "[optimizer] name = 'DMuon' needs a model parallelized by a DMuon train spec "
            "(torchtitan_dmuon.titan registers llama3, qwen3 and llama4); this model part "
            "was not dedicated"
        )
    return _SETTINGS[model]


def clean_fqn(name: str) -> str:
    """A parameter or module name without activation-checkpoint / compile wrapper parts
    (the names TorchTitan's checkpoints use)."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def _unsupported(parallel_dims) -> list[str]:
    checks = {
        "pipeline parallel (parallelism.pipeline_parallel_degree)": parallel_dims.pp_enabled,
        "tensor parallel (parallelism.tensor_parallel_degree)": parallel_dims.tp_enabled,
        "context parallel (parallelism.context_parallel_degree)": parallel_dims.cp_enabled,
        "expert parallel (parallelism.expert_parallel_degree)": parallel_dims.ep_enabled,
    }
    return [what for what, enabled in checks.items() if enabled]


def _matches(name: str, patterns: list[str]) -> bool:
    return any(fnmatch.fnmatchcase(clean_fqn(name), p) for p in patterns)


def _check_each_matches(patterns: list[str], names: list[str], key: str, what: str) -> None:
    for pattern in patterns:
        if not any(_matches(n, [pattern]) for n in names):
            raise ValueError(f"[dmuon] {key}: pattern {pattern!r} matches no {what}")


def _predicates(model: nn.Module, settings: DMuon):
    names = [name for name, _ in model.named_parameters()]
    _check_each_matches(settings.params, names, "params", "parameter")

    def predicate(name: str, param: nn.Parameter) -> bool:
        return _matches(name, settings.params)

    boundary_predicate = None
    if settings.hook_boundaries:
        modules = [name for name, _ in model.named_modules()]
        _check_each_matches(settings.hook_boundaries, modules, "hook_boundaries", "module")
        blocks = default_boundary_modules(model)

        def boundary_predicate(name: str, module: nn.Module) -> bool:
            return module in blocks or _matches(name, settings.hook_boundaries)

    return predicate, boundary_predicate


def _dedicate(model: nn.Module, mesh: DeviceMesh, settings: DMuon) -> None:
    if mesh.ndim == 2:
        shard_mesh, replicate_mesh = mesh["fsdp"], mesh["dp_replicate"]
    else:
        shard_mesh, replicate_mesh = mesh, None
    predicate, boundary_predicate = _predicates(model, settings)
    dedicate_params(
        model,
        shard_mesh,
        predicate,
        replicate_mesh=replicate_mesh,
        hook_boundary_predicate=boundary_predicate,
        reshard_after_forward=settings.reshard_after_forward,
        replicate_async=settings.replicate_async,
        # TorchTitan divides the loss by the global token count and turns off FSDP's
        # gradient division: gradients are sums over ranks, and so are the dedicated ones.
        gradient_divide_factor=1.0,
    )
    _SETTINGS[model] = settings


@contextlib.contextmanager
def _swapped(namespace: dict, **replacements):
    originals = {name: namespace[name] for name in replacements if name in namespace}
    namespace.update({k: v for k, v in replacements.items() if k in namespace})
    try:
        yield originals
    finally:
        namespace.update(originals)


def with_dedication(parallelize_fn: Callable) -> Callable:
    """Wrap a TorchTitan parallelize function so that DMuon dedicates right before FSDP."""

    @functools.wraps(parallelize_fn)
    def parallelize(model: nn.Module, parallel_dims, job_config):
        if job_config.optimizer.name != DMUON:
            return parallelize_fn(model, parallel_dims, job_config)
        unsupported = _unsupported(parallel_dims)
        if unsupported:
            raise ValueError(
                f"[optimizer] name = 'DMuon' does not support {', '.join(unsupported)} yet; "
                "use data parallelism (FSDP, HSDP or DDP) only"
            )
        settings = job_config.dmuon
        namespace = parallelize_fn.__globals__

        def apply_fsdp(model_, dp_mesh, *args, **kwargs):
            _dedicate(model_, dp_mesh, settings)
            return originals["apply_fsdp"](model_, dp_mesh, *args, **kwargs)

        def apply_ddp(model_, dp_mesh, *args, **kwargs):
            # DDP-style: DMuon owns the matrices and keeps every other parameter in sync.
            _dedicate(model_, dp_mesh, settings)

        with _swapped(namespace, apply_fsdp=apply_fsdp, apply_ddp=apply_ddp) as originals:
            model = parallelize_fn(model, parallel_dims, job_config)
        if model not in _SETTINGS:
            raise ValueError(
                "[optimizer] name = 'DMuon' needs data parallelism over more than one rank "
                "(data_parallel_shard_degree or data_parallel_replicate_degree > 1)"
            )
        return model

    return parallelize
