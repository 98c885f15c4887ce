"""Run ``dedicate_params`` inside TorchTitan's parallelize functions, right before FSDP.

TorchTitan's parallelize functions apply TP, CP, activation checkpointing and compile,
then FSDP/HSDP (``apply_fsdp``) or DDP (``apply_ddp``). :func:`with_dedication` wraps one
(any model's: TorchTitan's, or a user's whose function calls ``fully_shard`` itself) so
that, when ``[optimizer] name = "DMuon"``, the wrapped function's own ``apply_fsdp``, or
else its first ``fully_shard``, first dedicates the selected matrices on the FSDP mesh
(HSDP: its ``fsdp`` dim as shard mesh and ``dp_replicate`` as replicate mesh), and
``apply_ddp`` is replaced by DMuon's DDP-style synchronization; a function that applies
data parallelism otherwise is refused, naming it, before any collective. With one
data-parallel rank neither runs: the part gets plain Muon + AdamW, with no collective of
the engine. :func:`with_pipeline_stages` wraps a pipelining function (TorchTitan's
``pipeline_llm`` calls the parallelize function once per model part) so that each stage
drives its part's dedication. The names are swapped in the function's module only for the
duration of the call. Everything else is TorchTitan's code, unchanged.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import fnmatch
import functools
import inspect
import logging
import re
import weakref
from collections.abc import Callable

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining.schedules import BACKWARD_WEIGHT

from torchtitan_dmuon.engine import (
    attach_pipeline_stage,
    dedicate_params,
    get_dedication,
    meta_init,
)
from torchtitan_dmuon.engine.plan import default_boundary_modules
from torchtitan_dmuon.optim.qk_clip import discard_records
from torchtitan_dmuon.titan.config import MODEL_SELECTIONS, DMuon, ModelSelection

logger = logging.getLogger(__name__)

__all__ = [
    "DMUON",
    "block_pattern",
    "clean_fqn",
    "dedicate_part",
    "dmuon_settings",
    "keep_settings",
    "linear_selection",
    "muon_predicate",
    "resolve_selection",
    "with_dedication",
    "with_pipeline_stages",
]

DMUON = "DMuon"
"""The ``[optimizer] name`` that turns DMuon on."""

_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.")

_SETTINGS: weakref.WeakKeyDictionary[nn.Module, DMuon] = weakref.WeakKeyDictionary()


def dmuon_settings(model: nn.Module) -> DMuon:
    """The ``[dmuon]`` section a model part was dedicated with."""
    if model not in _SETTINGS:
        raise RuntimeError(
            "[optimizer] name = 'DMuon' needs a model parallelized by a DMuon train spec "
            "(DMuonTrainer wraps every spec it looks up: torchtitan_dmuon.titan.train_spec); "
            "this model part was not dedicated"
        )
    return _SETTINGS[model]


def keep_settings(model: nn.Module, settings: DMuon) -> None:
    """Record the ``[dmuon]`` section of a model part that no dedication holds (one
    data-parallel rank: plain Muon + AdamW), for :func:`dmuon_settings`."""
    _SETTINGS[model] = settings


def clean_fqn(name: str) -> str:
    """A parameter or module name without activation-checkpoint / compile wrapper parts
    (the names TorchTitan's checkpoints use)."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def _check_expert_parallel(model: nn.Module, parallel_dims) -> None:
    """Expert parallelism needs routed experts (3-D stacked weights) to shard."""
    if parallel_dims.ep_enabled and not any(p.ndim == 3 for p in model.parameters()):
        raise ValueError(
            f"parallelism.expert_parallel_degree = {parallel_dims.ep} needs a MoE model: "
            f"{type(model).__name__} has no routed experts (3-D stacked weights) to shard"
        )


def _matches(name: str, patterns: list[str]) -> bool:
    return any(fnmatch.fnmatchcase(clean_fqn(name), p) for p in patterns)


def _matching(patterns, names: list[str]) -> list[str]:
    return [p for p in patterns if any(_matches(n, [p]) for n in names)]


def _glob_literal(text: str) -> str:
    """``text`` as an fnmatch pattern that matches it alone."""
    return re.sub(r"([*?[])", r"[\1]", text)


def block_pattern(name: str) -> str:
    """``name`` as an fnmatch pattern with each block index a wildcard (``layers.*.moe``),
    its other parts literal."""
    return ".".join("*" if p.isdigit() else _glob_literal(p) for p in clean_fqn(name).split("."))


def linear_selection(model: nn.Module) -> list[str]:
    """The default selection of a model without one of its own (not in
    ``MODEL_SELECTIONS``): the 2-D weights of the ``nn.Linear`` layers inside its blocks
    (modules held in an ``nn.ModuleList`` or ``nn.ModuleDict``, which is where Muon's
    hidden matrices are; embeddings and the output head are outside them), tied ones left
    out. As patterns, a block's index a wildcard wherever that matches these weights
    alone (``layers.*.mlp.w_in.weight``), else the weight's own name."""
    in_blocks = {id(m) for block in default_boundary_modules(model) for m in block.modules()}
    uses = collections.Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    names = [
        clean_fqn(f"{name}.weight")
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear)
        and id(module) in in_blocks
        and module.weight.ndim == 2
        and uses[id(module.weight)] == 1
    ]
    chosen, others = set(names), [clean_fqn(n) for n, _ in model.named_parameters()]
    patterns: list[str] = []
    for name in names:
        pattern = block_pattern(name)
        if any(fnmatch.fnmatchcase(n, pattern) for n in others if n not in chosen):
            pattern = _glob_literal(name)
        if pattern not in patterns:
            patterns.append(pattern)
    return patterns


def resolve_selection(model: nn.Module, job_config, selections=MODEL_SELECTIONS) -> DMuon:
    """``job_config.dmuon`` with the model's default selection filled in where ``params``
    is empty (its ``MODEL_SELECTIONS`` entry, else :func:`linear_selection`, logged),
    checked on the whole model (a pipeline stage holds only a part of it, so there this
    runs before the split): every given pattern must match something.
    ``job_config.dmuon`` becomes the resolved section, so each part and the optimizer
    read one selection. ``selections``: the models' own selections (TorchTitan 0.2.2's
    names; the 0.3 adapter's models take the default).

    Raises:
        ValueError: A pattern matches nothing, naming the model and its default selection,
            or ``params`` is empty and the model's default selects nothing.
    """
    settings = job_config.dmuon
    params = [name for name, _ in model.named_parameters()]
    modules = [name for name, _ in model.named_modules()]
    model_name = f"{job_config.model.name} ({job_config.model.flavor})"
    default = selections.get(job_config.model.name)
    own = default is not None
    if not own:
        default = ModelSelection(tuple(linear_selection(model)))
    if not settings.params:
        selected = _matching(default.params, params)
        if not selected:
            what = (
                "has no default selection that matches its parameters"
                if own
                else "has no selection of its own (MODEL_SELECTIONS in "
                "torchtitan_dmuon/titan/config.py) and no nn.Linear weight inside its blocks "
                "(modules held in an nn.ModuleList or nn.ModuleDict)"
            )
            raise ValueError(
                f"[dmuon] params is empty and model {model_name} {what}: name the matrices "
                "DMuon should take ([dmuon] params, --dmuon.params)"
            )
        if not own:
            count = sum(_matches(name, selected) for name in params)
            logger.info(
                "[dmuon] params unset and model %s has no selection of its own "
                "(MODEL_SELECTIONS): DMuon takes the 2-D weights of the nn.Linear layers "
                "inside its blocks, %d matrices: %s; AdamW the rest. Set [dmuon] params to "
                "choose others",
                model_name,
                count,
                selected,
            )
        settings = dataclasses.replace(settings, params=selected)
    if not settings.hook_boundaries and own:
        boundaries = _matching(default.hook_boundaries, modules)
        if boundaries:
            if job_config.dmuon.params:  # the user's own selection keeps the model's boundaries
                logger.info(
                    "[dmuon] hook_boundaries unset: model %s's own, %s, besides its blocks",
                    model_name,
                    boundaries,
                )
            settings = dataclasses.replace(settings, hook_boundaries=boundaries)
    if settings is not job_config.dmuon:
        job_config.dmuon = settings
    for key, names, what in (
        ("params", params, "parameter"),
        ("hook_boundaries", modules, "module"),
    ):
        for pattern in getattr(settings, key):
            if not _matching([pattern], names):
                hint = ""
                if own or getattr(default, key):
                    hint = (
                        f"; its default selection (leave [dmuon] {key} empty) is "
                        f"{list(getattr(default, key)) or 'the blocks only'}"
                    )
                raise ValueError(
                    f"[dmuon] {key}: pattern {pattern!r} matches no {what} of model "
                    f"{model_name}{hint}"
                )
    return settings


def muon_predicate(settings: DMuon):
    """``predicate(name, param)``: the parameters ``[dmuon] params`` selects."""

    def predicate(name: str, param: nn.Parameter) -> bool:
        return _matches(name, settings.params)

    return predicate


def _boundary_predicate(model: nn.Module, settings: DMuon):
    boundary_predicate = None
    if settings.hook_boundaries:
        blocks = default_boundary_modules(model)

        def boundary_predicate(name: str, module: nn.Module) -> bool:
            return module in blocks or _matches(name, settings.hook_boundaries)

    return boundary_predicate


def _reshard_after_forward(settings: DMuon, parallel_dims, job_config) -> bool:
    """``[dmuon] reshard_after_forward``, or FSDP2's choice under TorchTitan's policy."""
    if settings.reshard_after_forward is not None:
        return settings.reshard_after_forward
    policy = job_config.parallelism.fsdp_reshard_after_forward
    return policy == "always" or (policy == "default" and not parallel_dims.pp_enabled)


def _dedicate(
    model: nn.Module,
    mesh: DeviceMesh,
    settings: DMuon,
    z3: bool,
    expert_mesh: DeviceMesh | None = None,
) -> None:
    if mesh.ndim == 2:
        shard_mesh, replicate_mesh = mesh["fsdp"], mesh["dp_replicate"]
    else:
        shard_mesh, replicate_mesh = mesh, None
    dedicate_part(model, shard_mesh, replicate_mesh, settings, z3, expert_mesh)


def dedicate_part(
    model: nn.Module,
    shard_mesh: DeviceMesh,
    replicate_mesh: DeviceMesh | None,
    settings: DMuon,
    z3: bool,
    expert_mesh: DeviceMesh | None = None,
) -> None:
    """``dedicate_params`` on a model part as either TorchTitan trains it (gradients summed
    over ranks, the loss divided by the global token count), sized to the plan at
    materialization, its ``[dmuon]`` settings kept for :func:`dmuon_settings`."""
    dedicate_params(
        model,
        shard_mesh,
        muon_predicate(settings),
        replicate_mesh=replicate_mesh,
        expert_mesh=expert_mesh,
        hook_boundary_predicate=_boundary_predicate(model, settings),
        reshard_after_forward=z3,
        replicate_async=settings.replicate_async,
        # TorchTitan divides the loss by the global token count and turns off FSDP's
        # gradient division: gradients are sums over ranks, and so are the dedicated ones.
        gradient_divide_factor=1.0,
        owner_group_size=settings.owner_group_size,
    )
    _start_at_plan_size(model)
    _SETTINGS[model] = settings


def _start_at_plan_size(model: nn.Module) -> None:
    """TorchTitan's trainer materializes each model part with ``to_empty`` and then
    ``init_weights``: both run at the size of the plan (``engine/meta_init.py``), so a
    rank allocates only the dedicated matrices it holds. Instance attributes, so they go
    with the model."""
    init_weights = model.init_weights

    def to_empty(*, device, recurse: bool = True) -> nn.Module:
        meta_init.to_empty(model, device=device)
        return model

    def init_weights_at_plan_size(*args, **kwargs):
        with meta_init.initializing(model):
            return init_weights(*args, **kwargs)

    model.to_empty = to_empty
    model.init_weights = init_weights_at_plan_size


@contextlib.contextmanager
def _swapped(namespace: dict, **replacements):
    originals = {name: namespace[name] for name in replacements if name in namespace}
    namespace.update({k: v for k, v in replacements.items() if k in namespace})
    try:
        yield originals
    finally:
        namespace.update(originals)


_HOOKED = ("apply_fsdp", "fully_shard", "apply_ddp")
"""The names :func:`with_dedication` replaces in a parallelize function's module."""


def _unwrappable(parallelize_fn: Callable, job_config, what: str) -> ValueError:
    module = getattr(parallelize_fn, "__module__", None)
    where = f"{module}.{getattr(parallelize_fn, '__qualname__', type(parallelize_fn).__name__)}"
    return ValueError(
        f"[optimizer] name = 'DMuon' cannot train model {job_config.model.name}: its "
        f"parallelize function {where} {what}. DMuon dedicates the selected matrices right "
        "before FSDP by replacing, for the call, the names apply_fsdp(model, dp_mesh, ...) "
        "(TorchTitan's), fully_shard(module, mesh=...) and apply_ddp(model, dp_mesh, ...) in "
        f"that function's module ({module}): apply data parallelism "
        "through one of them, imported there (e.g. from torch.distributed.fsdp import "
        "fully_shard), or choose another [optimizer] name"
    )


def _fully_shard_mesh(mesh, parallelize_fn: Callable, job_config) -> DeviceMesh:
    """The mesh a parallelize function gave ``fully_shard``, which DMuon dedicates over:
    1-D (FSDP) or TorchTitan's 2-D ``("dp_replicate", "fsdp")`` (HSDP)."""
    if mesh is None:
        raise _unwrappable(
            parallelize_fn,
            job_config,
            "calls fully_shard without mesh=, so DMuon does not know the data-parallel mesh "
            "(pass mesh=parallel_dims.get_mesh('fsdp'), or ['dp_replicate', 'fsdp'] for HSDP)",
        )
    if mesh.ndim == 1 or (
        mesh.ndim == 2 and set(mesh.mesh_dim_names or ()) == {"dp_replicate", "fsdp"}
    ):
        return mesh
    raise _unwrappable(
        parallelize_fn,
        job_config,
        f"calls fully_shard with a mesh of dims {mesh.mesh_dim_names}, where DMuon needs a "
        "1-D data-parallel mesh or TorchTitan's ('dp_replicate', 'fsdp') (HSDP)",
    )


def with_dedication(parallelize_fn: Callable) -> Callable:
    """Wrap a parallelize function so that DMuon dedicates right before FSDP.

    The function's module must name what applies data parallelism: ``apply_fsdp(model,
    dp_mesh, ...)`` (TorchTitan's; its expert mesh too), ``fully_shard(module, mesh=...)``
    called by the function itself (DMuon dedicates the whole model part at the first
    call), or ``apply_ddp(model, dp_mesh, ...)`` (replaced by DMuon's DDP-style sync).
    With data parallelism on and none of them there, or none of them called, the wrapped
    function raises a ValueError naming the function and what to change, on every rank
    alike, before any collective (checked before the call, and right after it: FSDP2's
    ``fully_shard`` communicates nothing).
    """
    target = inspect.unwrap(parallelize_fn)
    namespace = getattr(target, "__globals__", {})

    @functools.wraps(parallelize_fn)
    def parallelize(model: nn.Module, parallel_dims, job_config):
        if job_config.optimizer.name != DMUON:
            return parallelize_fn(model, parallel_dims, job_config)
        ddp_beside_others = (
            parallel_dims.dp_replicate_enabled
            and not parallel_dims.fsdp_enabled
            and parallel_dims.world_size != parallel_dims.dp_replicate
        )
        if parallel_dims.dp_enabled and not ddp_beside_others:
            if not any(name in namespace for name in _HOOKED):
                raise _unwrappable(target, job_config, "has none of these names in its module")
        settings = job_config.dmuon
        if not parallel_dims.pp_enabled:  # else resolved on the whole model, before the split
            _check_expert_parallel(model, parallel_dims)
            settings = resolve_selection(model, job_config)
        # A pipeline stage may hold no selected matrix (only the embeddings, or the final
        # norm and output): it is then AdamW alone, on TorchTitan's own data parallelism.
        selects = any(_matches(name, settings.params) for name, _ in model.named_parameters())
        z3 = _reshard_after_forward(settings, parallel_dims, job_config)
        part = model

        def dedicate(model_, mesh, expert_mesh=None):
            if model_ in _SETTINGS:  # by an earlier fully_shard or apply_fsdp of the call
                return
            if selects:
                _dedicate(model_, mesh, settings, z3, expert_mesh)
            _SETTINGS[model_] = settings

        def apply_fsdp(model_, dp_mesh, *args, **kwargs):
            # Expert parallelism: the routed experts (sharded over ep) are dedicated
            # over efsdp, as FSDP would shard them; the dense matrices over fsdp.
            edp_mesh = kwargs.get("edp_mesh") if kwargs.get("ep_degree", 1) > 1 else None
            dedicate(model_, dp_mesh, edp_mesh["efsdp"] if edp_mesh is not None else None)
            return originals["apply_fsdp"](model_, dp_mesh, *args, **kwargs)

        def fully_shard(module, *args, **kwargs):
            # Called by the function itself (TorchTitan's apply_fsdp, hooked above, calls
            # it after dedicating): the whole part is dedicated before its first unit.
            if part not in _SETTINGS:
                dedicate(part, _fully_shard_mesh(kwargs.get("mesh"), target, job_config))
            return originals["fully_shard"](module, *args, **kwargs)

        def apply_ddp(model_, dp_mesh, *args, **kwargs):
            if not selects:
                _SETTINGS[model_] = settings
                return originals["apply_ddp"](model_, dp_mesh, *args, **kwargs)
            # DDP-style: DMuon owns the matrices and keeps every other parameter in sync.
            _dedicate(model_, dp_mesh, settings, z3)

        titan_dims = parallel_dims
        if ddp_beside_others:
            # TorchTitan 0.2.2 refuses DDP with TP or PP ("DDP has not supported > 1D
            # parallelism"); DMuon's DDP-style sync runs on the dp_replicate mesh alone, so
            # TorchTitan sees no replication and DMuon dedicates afterwards.
            titan_dims = copy.copy(parallel_dims)
            titan_dims.dp_replicate = 1
        hooks = dict(apply_fsdp=apply_fsdp, fully_shard=fully_shard, apply_ddp=apply_ddp)
        with _swapped(namespace, **hooks) as originals:
            model = parallelize_fn(model, titan_dims, job_config)
        if ddp_beside_others and model not in _SETTINGS:
            apply_ddp(model, parallel_dims.get_mesh("dp_replicate"))
        if model not in _SETTINGS:
            if parallel_dims.dp_enabled:
                raise _unwrappable(
                    target,
                    job_config,
                    "applied data parallelism without calling any of these names (FSDP "
                    "reached through another module or an attribute, such as "
                    "torch.distributed.fsdp.fully_shard(...), or none applied)",
                )
            if parallel_dims.tp_enabled and selects:
                # One data-parallel rank under TP: the TP ranks own every matrix together
                # and the engine runs the tensor-parallel Newton-Schulz (a 1-rank mesh:
                # TorchTitan builds its fsdp dim even at size 1, but keeps it private).
                _dedicate(model, parallel_dims._meshes["fsdp"], settings, z3)
            # Without TP: this rank owns every matrix; plain Muon + AdamW, no engine.
            _SETTINGS[model] = settings
        return model

    return parallelize


def _splits_backward(schedule) -> bool:
    """Whether ``schedule`` runs weight passes apart from input passes (zero bubble, DualPipeV,
    a CSV schedule with ``W`` actions): every rank holds the whole pipeline order."""
    for order in (getattr(schedule, "pipeline_order", None) or {}).values():
        if any(a is not None and a.computation_type == BACKWARD_WEIGHT for a in order):
            return True
    return False


def _check_split_backward(schedule, parallel_dims, job_config) -> None:
    if not (parallel_dims.fsdp_enabled and _splits_backward(schedule)):
        return
    if job_config.dmuon.split_backward_with_fsdp:
        return
    name = job_config.parallelism.pipeline_parallel_schedule
    raise ValueError(
        f"--parallelism.pipeline_parallel_schedule {name}: this schedule splits backward "
        "into input and weight passes, and torch 2.13's weight pass gives FSDP's own "
        "parameters (norms, embeddings, the output head) wrong gradients, with any "
        "optimizer. Use data parallelism without FSDP, which DMuon keeps in sync itself: "
        "--parallelism.data_parallel_replicate_degree N "
        "--parallelism.data_parallel_shard_degree 1, or a schedule with full backwards "
        "(GPipe, 1F1B, Interleaved1F1B); --dmuon.split_backward_with_fsdp runs it anyway"
    )


def _discard_metadata_forward(stage) -> None:
    """Before its first step a torch 2.13 pipeline stage infers its tensors' metadata with
    one forward on uninitialized inputs (``empty_strided``): QK-clip must not count the
    logits of that forward (garbage, NaN among them), so its records are dropped after."""
    infer = getattr(stage, "_forward_metadata_inference", None)
    if infer is None:  # a torch that infers otherwise (e.g. on meta tensors)
        return

    @functools.wraps(infer)
    def inferred(*args, **kwargs):
        try:
            return infer(*args, **kwargs)
        finally:
            discard_records(stage.submod)

    stage._forward_metadata_inference = inferred


def with_pipeline_stages(pipelining_fn: Callable) -> Callable:
    """Wrap a TorchTitan pipelining function so that, with DMuon, the ``[dmuon]`` patterns
    are checked on the whole model and each pipeline stage drives its part's dedication
    (micro-batch gradients accumulated, one reduce after the stage's last backward)."""

    @functools.wraps(pipelining_fn)
    def pipeline(model: nn.Module, parallel_dims, job_config, *args, **kwargs):
        if job_config.optimizer.name != DMUON:
            return pipelining_fn(model, parallel_dims, job_config, *args, **kwargs)
        _check_expert_parallel(model, parallel_dims)
        resolve_selection(model, job_config)

        def build_pipeline_schedule(job_config_, stages, loss_fn):
            for stage in stages:
                _discard_metadata_forward(stage)
                if get_dedication(stage.submod) is not None:  # else AdamW alone
                    attach_pipeline_stage(stage)
            schedule = originals["build_pipeline_schedule"](job_config_, stages, loss_fn)
            _check_split_backward(schedule, parallel_dims, job_config_)  # before any step
            return schedule

        namespace = pipelining_fn.__globals__
        with _swapped(namespace, build_pipeline_schedule=build_pipeline_schedule) as originals:
            return pipelining_fn(model, parallel_dims, job_config, *args, **kwargs)

    return pipeline
