"""Pipeline parallelism over dedicated model parts: torch.distributed.pipelining schedules
(single-stage, looped, zero-bubble, V-shaped) on a (pp, dp) = (2, 2) gloo mesh, 8
micro-batches per step, against one-process torch.optim.Muon + AdamW on the whole batch."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)

from tests.support.dist import run_distributed
from tests.support.models import Block, make_model, proj_predicate
from tests.support.workers import (
    ADAMW_KW,
    MUON_KW,
    as_muon_adamw_kwargs,
    data_for,
    failing_pass,
    full_params,
    train_reference,
)
from torchtitan_dmuon import Muon, attach_pipeline_stage, dedicate_params, get_dedication

LAYERS = 4
MICRO_BATCHES = 8
STEPS = 3
PP, DP = 2, 2

# name: (schedule class, how a pipeline rank's stages are chosen, FSDP2 for the rest).
# Zero-bubble schedules run DDP-style (the engine syncs the other parameters): with FSDP2
# their weight pass gives FSDP's own parameters wrong gradients in torch 2.13, with AdamW
# alone too (losses off by 1e-3 from the second step), which no optimizer can fix.
SCHEDULES = {
    "GPipe": (ScheduleGPipe, "single", True),
    "1F1B": (Schedule1F1B, "single", True),
    "Interleaved1F1B": (ScheduleInterleaved1F1B, "looped", True),
    "InterleavedZeroBubble": (ScheduleInterleavedZeroBubble, "looped", False),
    "ZBVZeroBubble": (ScheduleZBVZeroBubble, "v", False),
}


class PipelineBlock(Block):
    """A block whose every parameter is used once: torch's zero-bubble weight pass
    (``stage_backward_weight``) cannot split a graph in which one norm feeds two
    branches, whatever the optimizer (FSDP2 + AdamW fails the same way)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__(dim, hidden)
        self.ffn_norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        q, k, v = self.q_proj(h), self.k_proj(h), self.v_proj(h)
        att = torch.softmax(q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5, dim=-1)
        x = x + self.o_proj(att @ v)
        return x + self.down_proj(torch.relu(self.up_proj(self.ffn_norm(x))))


MODEL = {"layers": LAYERS, "block": PipelineBlock}


class Part(nn.Module):
    """Some blocks of a TinyTransformer under the whole model's names, with the embedding
    on the first stage and the final norm and head on the last."""

    def __init__(self, full: nn.Module, layer_ids: list[int], first: bool, last: bool) -> None:
        super().__init__()
        self.embed = full.embed if first else None
        self.layers = nn.ModuleDict({str(i): full.layers[i] for i in layer_ids})
        self.norm = full.norm if last else None
        self.head = full.head if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for layer in self.layers.values():
            x = layer(x)
        if self.head is not None:
            x = self.head(self.norm(x))
        return x


def _stages_of(layout: str, pp_rank: int) -> tuple[list[int], int]:
    """``(stage indices of this pipeline rank, number of stages)``."""
    if layout == "single":
        return [pp_rank], PP
    if layout == "looped":
        return [pp_rank, pp_rank + PP], 2 * PP
    return [pp_rank, 2 * PP - 1 - pp_rank], 2 * PP  # V: 0 and 3, 1 and 2


def _cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _calls(dedications, kind: str) -> list[int]:
    return [d.stats.calls[kind] for d in dedications]


def _train(name: str, z3: bool, fail: bool, mesh) -> dict:
    schedule_class, layout, fsdp = SCHEDULES[name]
    pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    dp_mesh = mesh["dp"]
    full = make_model(seed=0, **MODEL)
    stage_ids, num_stages = _stages_of(layout, pp_rank)
    per_stage = LAYERS // num_stages
    parts, stages, optimizers = [], [], []
    for s in stage_ids:
        layer_ids = list(range(s * per_stage, (s + 1) * per_stage))
        part = Part(full, layer_ids, first=s == 0, last=s == num_stages - 1)
        dedicate_params(part, dp_mesh, proj_predicate, reshard_after_forward=z3)
        if fsdp:
            for layer in part.layers.values():
                fully_shard(layer, mesh=dp_mesh)
            fully_shard(part, mesh=dp_mesh)
        optimizers.append(
            Muon(part, ns_dtype=torch.float32, **MUON_KW, **as_muon_adamw_kwargs(ADAMW_KW))
        )
        pp_group = mesh["pp"].get_group()
        stage = PipelineStage(part, s, num_stages, torch.device("cpu"), group=pp_group)
        attach_pipeline_stage(stage)
        parts.append(part)
        stages.append(stage)
    schedule = schedule_class(
        stages if layout != "single" else stages[0],
        n_microbatches=MICRO_BATCHES,
        loss_fn=_cross_entropy,
    )
    has_first, has_last = 0 in stage_ids, num_stages - 1 in stage_ids
    dedications = [get_dedication(p) for p in parts]
    losses, reduces, broadcasts = [], [], []

    def zero_grad() -> None:
        for opt in optimizers:
            opt.zero_grad()

    def run_schedule(inputs, targets, micro_losses=None) -> None:
        schedule.step(
            *([inputs] if has_first else []),
            target=targets if has_last else None,
            losses=micro_losses if has_last else None,
        )

    for step in range(STEPS):
        if fail and step == 1:
            # The first stage's backward of the last micro-batch raises there, after the
            # last stage finished its part of the step (which then discards it too).
            block = parts[0].layers["0"] if has_first else None
            bad = data_for(999, dp_rank, DP, False, batch_size=MICRO_BATCHES)
            failing_pass(zero_grad, block, lambda bad=bad: run_schedule(*bad), MICRO_BATCHES - 1)
        inputs, targets = data_for(step, dp_rank, DP, False, batch_size=MICRO_BATCHES)
        zero_grad()
        before = {kind: _calls(dedications, kind) for kind in ("reduce", "broadcast")}
        micro_losses: list[torch.Tensor] = []
        run_schedule(inputs, targets, micro_losses)
        for kind, out in (("reduce", reduces), ("broadcast", broadcasts)):
            now = _calls(dedications, kind)
            out.append([n - b for n, b in zip(now, before[kind], strict=True)])
        for opt in optimizers:
            opt.step()
        if has_last:
            losses.append(torch.stack(micro_losses).mean().item())
    params = {}
    for part in parts:
        names = {n for n, _ in part.named_parameters() if proj_predicate(n, _)}
        params.update(full_params(part, names))
    return {
        "losses": losses,
        "params": params if dp_rank == 0 else {},
        "units": [len(d.units) for d in dedications],
        "reduces": reduces,
        "broadcasts": broadcasts,
        "ns_matrices": sum(opt.ns_matrices for opt in optimizers),
    }


def pipeline_worker(rank, world, cases):
    mesh = init_device_mesh("cpu", (PP, DP), mesh_dim_names=("pp", "dp"))
    results = {}
    for name, z3, fail in cases:
        results[(name, z3, fail)] = _train(name, z3, fail, mesh)
        dist.barrier()
    return results


# What an older torch cannot run is left out, so the other cases (one distributed run)
# still run there: torch 2.11's pipelining over gloo fails ZBVZeroBubble's first step with
# two plain nn.Linear stages per rank and no DMuon alike ("Pair is not connected" in the
# stages' shape exchange), and FSDP2 resets its per-pass state after a failed pass from
# torch 2.13 (FSDPModule.reset_iter_state; the engine refuses recovery before).
NEW_TORCH = torch.torch_version.TorchVersion(torch.__version__) >= (2, 13)
RECOVERS = hasattr(FSDPModule, "reset_iter_state")

# (schedule, Z3, a backward raising half-way before step 1: caught, zero_grad, no other call)
CASES = [(name, False, False) for name in SCHEDULES if NEW_TORCH or name != "ZBVZeroBubble"]
CASES += [("1F1B", True, RECOVERS), ("InterleavedZeroBubble", True, False)]


@pytest.fixture(scope="module")
def pipeline_runs():
    return run_distributed(pipeline_worker, PP * DP, CASES, timeout=600)


@pytest.fixture(scope="module")
def reference():
    return train_reference(
        MICRO_BATCHES * DP // 2, steps=STEPS, ns_dtype=torch.float32, model_kwargs=MODEL
    )


@pytest.mark.parametrize(
    "case", CASES, ids=[f"{n}-{'z3' if z else 'z2'}{'-failed-pass' * f}" for n, z, f in CASES]
)
def test_schedule_matches_one_process_muon(case, pipeline_runs, reference):
    """Each schedule trains like one process on the whole batch (losses and every final
    parameter within 1e-4), reduces each unit once per step whatever the number of
    micro-batches, and orthogonalizes each matrix once per step across the job."""
    by_rank = [r[case] for r in pipeline_runs]
    last_stage_losses = [r["losses"] for r in by_rank if r["losses"]]
    assert len(last_stage_losses) == DP
    losses = [sum(step) / DP for step in zip(*last_stage_losses, strict=True)]
    torch.testing.assert_close(losses, reference["losses"], rtol=1e-4, atol=1e-6)

    params = {}
    for r in by_rank:
        params.update(r["params"])
    assert params.keys() == reference["params"].keys()
    for name, value in params.items():
        torch.testing.assert_close(value, reference["params"][name], rtol=1e-4, atol=1e-5, msg=name)

    for r in by_rank:
        for step in range(STEPS):
            assert r["reduces"][step] == r["units"]  # one reduce per unit per step
            if not case[1]:  # Z2: one gather per unit per step, kept over the micro-batches
                # (torch < 2.13 infers the stages' shapes with a no-grad forward of their
                # own at the first step, after which the values are freed: one more)
                gathers = 1 if step or NEW_TORCH else 2
                assert r["broadcasts"][step] == [gathers * u for u in r["units"]]
    matrices = sum(1 for n, p in make_model(**MODEL).named_parameters() if proj_predicate(n, p))
    assert sum(r["ns_matrices"] for r in by_rank) == matrices * STEPS


def misuse_worker(rank, world):
    """A schedule that never marks a last backward, a stage attached twice, a non-stage, a
    stage whose module was not dedicated: clear errors on every rank, and the group still
    usable; ``remove()`` restores the stage's methods."""
    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("pp", "dp"))
    model = make_model(seed=0, **MODEL)
    dedicate_params(model, mesh["dp"], proj_predicate)
    opt = Muon(model, ns_dtype=torch.float32)
    stage = PipelineStage(model, 0, 1, torch.device("cpu"), group=mesh["pp"].get_group())
    attach_pipeline_stage(stage)
    undedicated = PipelineStage(
        make_model(seed=0, **MODEL), 0, 1, torch.device("cpu"), group=mesh["pp"].get_group()
    )
    raised = {}
    for name, misuse in {
        "twice": lambda: attach_pipeline_stage(stage),
        "not_a_stage": lambda: attach_pipeline_stage(model),
        "undedicated": lambda: attach_pipeline_stage(undedicated),
    }.items():
        try:
            misuse()
        except (RuntimeError, TypeError, ValueError) as e:
            raised[name] = str(e)

    inputs, targets = data_for(0, rank, world, False)

    def backward(last: bool) -> None:
        loss = _cross_entropy(model(inputs), targets)
        kwargs = {"stage_output": loss, "output_grads": None, "input_values": []}
        stage.backward_maybe_with_nosync("full", kwargs, last_backward=last)

    backward(last=False)
    try:
        opt.step()
    except RuntimeError as e:
        raised["no_last_backward"] = str(e)
    backward(last=True)  # the accumulated gradients of both backwards go to the owners
    opt.step()
    ok = torch.ones(1)
    dist.all_reduce(ok)
    # remove() takes the stage's patched methods with it: the class's again.
    get_dedication(model).remove()
    restored = all(
        name not in vars(stage) for name in ("backward_maybe_with_nosync", "scale_grads")
    )
    return raised, ok.item() == world, restored


def test_stage_misuse_raises_clear_errors():
    for raised, alive, restored in run_distributed(misuse_worker, 2, timeout=120):
        assert alive
        assert restored
        assert "already attached" in raised["twice"]
        assert "must be a pipeline stage" in raised["not_a_stage"]
        assert "pipeline stage 0's module has no dedication" in raised["undedicated"]
        assert "pipeline stage 0 has not reduced" in raised["no_last_backward"]
        assert "last_backward" in raised["no_last_backward"]
