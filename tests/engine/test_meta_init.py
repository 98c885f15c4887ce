"""Starting at the size of the plan (``torchtitan_dmuon.materialize``): a rank allocates the
dedicated matrices it holds and FSDP2's shards, nothing else, and ends with exactly what a
full ``to_empty`` and initialization give it, bitwise, under FSDP (Z2, Z3), HSDP, tensor
and expert parallelism, at 4 and 8 gloo ranks; trained, it equals the full start."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from tests.support.dist import run_distributed
from tests.support.models import (
    ExpertBlock,
    TokenModel,
    make_model,
    proj_or_experts_predicate,
    proj_predicate,
    shard_experts,
)
from tests.support.workers import train_configs
from torchtitan_dmuon import dedicate_params, get_dedication, get_full_param, materialize
from torchtitan_dmuon.engine.meta_init import initializing, split_names, to_empty, unheld_names

SEED = 1234


@torch.no_grad()
def init_weights(model: nn.Module) -> None:
    """An initialization as models write them: the dedicated matrices first, each in one
    go through torch.nn.init or a tensor method (some initializers draw a value-dependent
    amount of random numbers), then the other parameters. Expert stacks and DTensors
    (tensor-parallel) after the plain matrices: on CPU, torch draws a DTensor's values
    shard by shard (no DTensor random stream), so only what comes before them can equal
    one process's values."""
    named = list(model.named_parameters())
    dedicated = [(n, p) for n, p in named if proj_or_experts_predicate(n, p)]
    dedicated.sort(key=lambda entry: isinstance(entry[1], DTensor) or entry[1].ndim == 3)
    for i, (_, p) in enumerate(dedicated):
        kind = i % 4
        if kind == 0:
            nn.init.trunc_normal_(p, std=0.02, a=-0.03, b=0.03)  # rejection sampling
        elif kind == 1:
            nn.init.kaiming_uniform_(p, a=math.sqrt(5))
        elif kind == 2 and not isinstance(p, DTensor) and p.ndim == 2:
            nn.init.orthogonal_(p)
        else:
            p.normal_(0.0, 0.02).mul_(0.5)
    for name, p in named:
        if proj_or_experts_predicate(name, p):
            continue
        if p.ndim == 1:
            nn.init.ones_(p)
        else:
            nn.init.normal_(p, std=0.02)


def _parallelized(layout: str, world: int) -> nn.Module:
    """A meta model with ``layout``'s parallelism applied and its matrices dedicated."""
    if layout == "tp":
        # (dp, tp) = (world / 2, 2): Megatron MLPs over TP, DDP-style data parallelism.
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        with torch.device("meta"):
            model = TokenModel()
        for block in model.layers:
            parallelize_module(
                block, mesh["tp"], {"up_proj": ColwiseParallel(), "down_proj": RowwiseParallel()}
            )
        dedicate_params(model, mesh["dp"], proj_predicate)
        return model
    replicas = 2 if layout == "hsdp" else 1
    mesh = init_device_mesh("cpu", (replicas, world // replicas), mesh_dim_names=("r", "s"))
    with torch.device("meta"):
        model = make_model(block=ExpertBlock) if layout == "ep" else make_model()
    expert_mesh = None
    if layout == "ep":
        sparse = init_device_mesh(
            "cpu", (1, world // 2, 2), mesh_dim_names=("replicate", "efsdp", "ep")
        )
        shard_experts(model, sparse["ep"])
        expert_mesh = sparse["efsdp"]
    dedicate_params(
        model,
        mesh["s"],
        proj_or_experts_predicate,
        replicate_mesh=mesh["r"] if replicas > 1 else None,
        reshard_after_forward=layout != "z2",
        expert_mesh=expert_mesh,
        owner_group_size=2 if layout == "groups" else 1,
    )
    fsdp_mesh = mesh if replicas > 1 else mesh["s"]
    for block in model.layers:
        fully_shard(block, mesh=fsdp_mesh)
    fully_shard(model, mesh=fsdp_mesh)
    return model


def _storage_bytes(param: nn.Parameter) -> int:
    local = param.to_local() if isinstance(param, DTensor) else param
    return local.untyped_storage().nbytes()


def _local_values(model: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's values of every parameter no dedication holds (FSDP2's shards, the
    DDP-style ones) and of every buffer."""
    dedicated = {d.name for d in get_dedication(model).plan.params}
    values = {
        name: (p.to_local() if isinstance(p, DTensor) else p).detach().clone()
        for name, p in model.named_parameters()
        if name not in dedicated
    }
    values.update({name: b.clone() for name, b in model.named_buffers()})
    return values


def start_worker(rank, world, layouts):
    results = {}
    for layout in layouts:
        full = _parallelized(layout, world)
        torch.manual_seed(SEED)
        full.to_empty(device="cpu")
        init_weights(full)
        full_rng = torch.get_rng_state()

        planned = _parallelized(layout, world)
        dedication = get_dedication(planned)
        torch.manual_seed(SEED)
        materialize(planned, "cpu", lambda planned=planned: init_weights(planned))
        planned_rng = torch.get_rng_state()
        unheld = set(unheld_names(dedication))
        split = set(split_names(dedication))
        params = {d.name: planned.get_parameter(d.name) for d in dedication.plan.params}
        storage = {name: _storage_bytes(p) for name, p in params.items()}
        local_bytes = {
            name: (p.to_local() if isinstance(p, DTensor) else p).nbytes
            for name, p in params.items()
        }
        others_equal = {
            name: torch.equal(value, _local_values(planned)[name])
            for name, value in _local_values(full).items()
        }
        names = sorted(storage)
        dedicated_equal = {
            name: torch.equal(get_full_param(full, name), get_full_param(planned, name))
            for name in names
        }
        values = {name: get_full_param(planned, name) for name in names}
        results[layout] = {
            "same_order": [n for n, _ in full.named_parameters()]
            == [n for n, _ in planned.named_parameters()],
            "rng_equal": torch.equal(full_rng, planned_rng),
            "unheld": unheld,
            "split": split,
            "storage": storage,
            "local_bytes": local_bytes,
            "others_equal": others_equal,
            "dedicated_equal": dedicated_equal,
            "values": values,
        }
        del full, planned
    return results


def one_process_values(layout: str) -> dict[str, torch.Tensor]:
    """The one-process initialization's values of the dedicated plain matrices."""
    with torch.device("meta"):
        model = make_model(block=ExpertBlock) if layout == "ep" else make_model()
    model.to_empty(device="cpu")
    torch.manual_seed(SEED)
    init_weights(model)
    return {n: p.detach() for n, p in model.named_parameters() if proj_or_experts_predicate(n, p)}


def _check(by_rank, layouts) -> None:
    for layout in layouts:
        runs = [r[layout] for r in by_rank]
        reference = one_process_values(layout) if layout != "tp" else {}
        for rank, run in enumerate(runs):
            where = f"{layout}, rank {rank}"
            # The random stream advanced exactly as in a full initialization.
            assert run["rng_equal"], where
            assert run["same_order"], where  # named_parameters (checkpoints, optimizers)
            assert all(run["others_equal"].values()), (where, run["others_equal"])
            assert all(run["dedicated_equal"].values()), (where, run["dedicated_equal"])
            # Allocated: the held matrices in full, nothing of the others nor of the split
            # ones (stacks in pieces, an owner group's matrices), whose pieces are kept apart.
            for name, nbytes in run["storage"].items():
                whole = name not in run["unheld"] and name not in run["split"]
                expected = run["local_bytes"][name] if whole else 0
                assert nbytes == expected, (where, name, nbytes)
            if layout in ("ep", "groups"):
                assert run["split"], where
            assert run["unheld"], where  # some matrices are not held here
            # Plain matrices (no DTensor random stream on CPU): one process's values.
            for name, value in reference.items():
                if "experts_proj" not in name:
                    assert torch.equal(run["values"][name], value), (where, name)
        # Every dedicated matrix is held somewhere, and with 2 or more columns none
        # everywhere: the peak at start is the plan's, not the model's.
        names = runs[0]["storage"].keys()
        for name in names:
            assert any(name not in r["unheld"] for r in runs), (layout, name)
        if layout in ("ep", "groups"):  # split: allocated whole nowhere
            assert all(r["storage"][name] == 0 for r in runs for name in runs[0]["split"])
        held = [sum(r["storage"].values()) for r in runs]
        full = sum(runs[0]["local_bytes"].values())
        assert max(held) < full, (layout, held, full)


@pytest.mark.parametrize(
    ("world", "layouts"),
    [(4, ("z3", "z2", "hsdp", "tp", "ep", "groups")), (8, ("z3", "hsdp", "tp", "ep"))],
)
def test_start_at_plan_size_equals_a_full_start(world, layouts):
    by_rank = run_distributed(start_worker, world, layouts, timeout=300)
    _check(by_rank, layouts)


def test_a_model_started_at_plan_size_trains_as_one_started_in_full():
    """Started at the plan's size, the values held on each rank train exactly as after a
    full start (and both as one-process Muon: the other tests): under FSDP Z3 and Z2,
    async HSDP, expert parallelism and owner groups of 2."""
    experts = dict(model_kwargs=dict(block=ExpertBlock), predicate=proj_or_experts_predicate)
    cases = [
        dict(steps=2),
        dict(steps=2, z3=False),
        dict(steps=2, hsdp_shape=(2, 2), replicate_async=True),
        dict(experts, steps=2, ep=2),
        dict(steps=2, owner_group_size=2),
    ]
    configs = [dict(case, meta_init=kind) for case in cases for kind in (True, "plan")]
    by_rank = run_distributed(train_configs, 4, configs, timeout=300)
    for rank, runs in enumerate(by_rank):
        for case, full, planned in zip(cases, runs[::2], runs[1::2], strict=True):
            assert planned["losses"] == full["losses"], (case, rank)
            for name, value in full["params"].items():
                assert torch.equal(planned["params"][name], value), (case, rank, name)
            assert planned["memory"] == full["memory"], (case, rank)


def coming_back_worker(rank, world):
    model = _parallelized("z3", world)
    to_empty(model, device="cpu")
    first = model.layers[0].q_proj.weight
    try:
        with initializing(model):
            nn.init.normal_(first)
            nn.init.normal_(model.layers[0].k_proj.weight)
            first.mul_(2.0)
    except RuntimeError as error:
        return str(error)
    return "no error"


def test_an_initialization_that_comes_back_to_a_matrix_raises_on_every_rank():
    """Its first values would be lost on the ranks that do not hold it: every rank
    raises alike (the order of initialization is the same everywhere), naming both."""
    for message in run_distributed(coming_back_worker, 2):
        assert "came back to dedicated parameter 'layers.0.q_proj.weight'" in message
        assert "after 'layers.0.k_proj.weight'" in message
