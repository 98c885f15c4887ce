"""Step-time benchmark: DMuon beside FSDP2+AdamW, naive FSDP2+Muon and PyPI peers, one run.

    .venv/bin/python benchmarks/bench_step.py --nproc 4 --out outputs/bench_step

launches ``--nproc`` local processes (gloo on CPU, NCCL on GPU). Every mode trains its own
copy of the same model (same init, same data) and the modes take turns round by round, so
machine drift hits all alike. Per mode it reports the median and spread of the step time
(max over ranks), the optimizer-step time, the ratio to FSDP2 + fused AdamW, payload bytes
per rank per step by collective kind (counted by wrapping torch.distributed), Newton-Schulz
FLOPs per rank (max / mean), peak memory per rank (max over ranks: persistent state plus
the largest transient allocation during a profiled step) and the final loss.

FSDP2 + AdamW runs with the fused kernel (``adamw_fused``: TorchTitan's default
``[optimizer] implementation``, what DMuon's AdamW part uses, and the baseline of every
ratio and goal) and with torch's default kernels (``adamw``: a for-loop on CPU). DMuon runs
with the reference Newton-Schulz (``dmuon_z3``, ``dmuon_z2``: ``ns_backend = "torch"``) and
with the measured choice (``*_auto``: ``ns_backend = "auto"``), and as NorMuon
(``dmuon_z3_normuon``: ``variant = "normuon"``, its normalization the ``normuon`` phase) and
with QK-clip at Kimi K2's threshold 100 (``dmuon_z3_qkclip``: its forward max-logit pass
the ``qk max logits`` phase, its rescaling ``qk clip``), in
``ns_dtype = "auto"`` unless ``--ns-dtype`` names one. For every DMuon mode a few more
steps run under ``torch.profiler`` and the engine's and optimizer's ranges give a per-rank
breakdown of the optimizer step (gradients unpacked, momentum, Newton-Schulz, NorMuon's
normalization, update, AdamW, values out after the step) and of the
end-of-backward wait for the reduces, in milliseconds per step. A DMuon
mode's floor is the fused-AdamW step plus the busiest rank's Newton-Schulz as the mode runs
it (batched, with its backend: the profiled range), the one thing DMuon adds that no overlap
can hide on one device; its goals are the gap above that floor. It prints two tables and
writes ``results.json`` and ``step_time.png`` (step time per mode against its floor, and
the breakdown per rank) into ``--out``.

``--side-by-side --reference-path DIR`` runs instead fused AdamW and, per layout (Z3, Z2,
HSDP 2 x N/2), DMuon beside the reference design (X-Square-Robot/dmuon, imported from
``DIR``, run on CPU by the patches of ``benchmarks/reference.py``) with the same math:
fp32 Newton-Schulz with the quintic coefficients, Nesterov, updates scaled by
``0.2 sqrt(max(rows, cols))`` at the AdamW learning rate, AdamW without decay for the
rest, and under HSDP the new values sent to the other replica behind the next forward
(the reference's default, DMuon's ``replicate_async``). After the timed rounds every
parameter of each pair is compared (the largest difference must stay below 1e-4), and a
third table gives each side's optimizer step, forward+backward and step, and DMuon's over
the reference's. Without the reference it
says why and runs nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # tests.support
from bench_model import (  # noqa: E402
    BenchTransformer,
    matrix_predicate,
    ns_to_compute_ratio,
    qk_clip_attentions,
)
from naive_muon import NaiveFSDPMuon  # noqa: E402
from peers import PEERS, peer_status  # noqa: E402
from reference import (  # noqa: E402
    REFERENCE_COMMIT,
    dedicate_reference,
    load_reference,
    reference_optimizer,
    reference_status,
)

import torchtitan_dmuon as dmuon  # noqa: E402
from tests.support.collectives import CollectiveCounter  # noqa: E402
from torchtitan_dmuon.optim.config import MuonConfig  # noqa: E402
from torchtitan_dmuon.optim.newton_schulz import ns_flops  # noqa: E402
from torchtitan_dmuon.optim.ns_cache import cpu_description  # noqa: E402
from torchtitan_dmuon.optim.ns_choice import choose_ns  # noqa: E402

BASELINE = "adamw_fused"
BASE_MODES = [
    BASELINE,
    "adamw",
    "naive_muon",
    "dmuon_z3",
    "dmuon_z2",
    "dmuon_z3_auto",
    "dmuon_z2_auto",
    "dmuon_z3_normuon",
    "dmuon_z3_qkclip",
]
HSDP_MODES = ["hsdp_sync", "hsdp_async"]
MUON_LR, ADAMW_LR, MOMENTUM = 0.02, 3e-3, 0.95
ADAMW_BETAS = (0.9, 0.95)
# The side by side with the reference design (--side-by-side): per layout, DMuon and the
# reference with the same math (benchmarks/reference.py): fp32 Newton-Schulz, the quintic
# coefficients, Nesterov, 0.2 sqrt(max(rows, cols)) scaling at the AdamW learning rate.
SIDE_LAYOUTS = ("z3", "z2", "hsdp")
SIDE_PAIRS = {layout: (f"dmuon_{layout}_as_ref", f"reference_{layout}") for layout in SIDE_LAYOUTS}
SIDE_NS_COEFFICIENTS = "quintic"
SIDE_ADJUST_LR_FN = "match_rms_adamw"
SIDE_TOLERANCE = 1e-4  # the largest |difference| of a trained parameter (values ~0.1)
QK_CLIP_THRESHOLD = 100.0  # Kimi K2's

# Profiler ranges of the breakdown: (phase, range name). The reduce wait ends backward and
# QK-clip's max logits are in forward; the others are inside the optimizer step.
PHASES = (
    ("reduce wait", "dmuon::finish_reduces"),
    ("unpack", "dmuon::owned_grads"),
    ("momentum", "muon::momentum"),
    ("newton_schulz", "muon::newton_schulz"),
    ("normuon", "muon::normuon"),
    ("qk max logits", "muon::qk_max_logits"),
    ("qk clip", "muon::qk_clip"),
    ("update", "muon::update"),
    ("adamw", "Optimizer.step#AdamW.step"),
    ("after step", "dmuon::after_step"),
)
STEP_RANGE = "Optimizer.step#Muon.step"


def _device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", dist.get_rank())))
    return torch.device("cpu")


def _side_layout(mode: str) -> str | None:
    """The layout of a side-by-side mode (``z3``, ``z2``, ``hsdp``), None for the others."""
    for layout, pair in SIDE_PAIRS.items():
        if mode in pair:
            return layout
    return None


def _build_side(mode: str, layout: str, model, world: int, device, reference):
    """A side-by-side mode: DMuon or the reference, dedicated, sharded and configured alike."""
    kwargs = {"reshard_after_forward": layout != "z2"}
    if layout == "hsdp":
        mesh = init_device_mesh(device.type, (2, world // 2), mesh_dim_names=("replicate", "shard"))
        dedicate_mesh, kwargs["replicate_mesh"] = mesh["shard"], mesh["replicate"]
    else:
        mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("shard",))
        dedicate_mesh = mesh
    is_reference = mode.startswith("reference")
    if is_reference:
        dedicate_reference(reference, model, dedicate_mesh, matrix_predicate, **kwargs)
    else:
        dmuon.dedicate_params(model, dedicate_mesh, matrix_predicate, **kwargs)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if is_reference:
        return model, reference_optimizer(
            reference,
            model,
            lr=ADAMW_LR,
            momentum=MOMENTUM,
            adamw_lr=ADAMW_LR,
            adamw_betas=ADAMW_BETAS,
            ns_coefficients=SIDE_NS_COEFFICIENTS,
        )
    return model, dmuon.Muon(
        model,
        lr=ADAMW_LR,
        momentum=MOMENTUM,
        nesterov=True,
        ns_dtype=torch.float32,
        ns_backend="torch",
        ns_coefficients=SIDE_NS_COEFFICIENTS,
        adjust_lr_fn=SIDE_ADJUST_LR_FN,
        adamw_lr=ADAMW_LR,
        adamw_betas=ADAMW_BETAS,
        # The reference's default (replicate_async=True): under HSDP both sides send the
        # new values to the other replica behind the next forward, not inside the step.
        replicate_async=layout == "hsdp",
    )


def _build(mode: str, args, world: int, device: torch.device, reference=None):
    """Model (sharded as the mode wants) and its optimizer."""
    torch.manual_seed(0)
    with torch.device(device):
        model = BenchTransformer(args.vocab, args.dim, args.layers, args.heads)
    layout = _side_layout(mode)
    if layout is not None:
        return _build_side(mode, layout, model, world, device, reference)
    if mode.startswith("hsdp"):
        mesh = init_device_mesh(device.type, (2, world // 2), mesh_dim_names=("replicate", "shard"))
        dmuon.dedicate_params(
            model, mesh["shard"], matrix_predicate, replicate_mesh=mesh["replicate"]
        )
    else:
        mesh = init_device_mesh(device.type, (world,))
        if mode.startswith("dmuon"):
            dmuon.dedicate_params(
                model, mesh, matrix_predicate, reshard_after_forward=mode.startswith("dmuon_z3")
            )
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    ns_dtype = getattr(torch, args.ns_dtype)
    if mode.startswith("adamw"):
        # "adamw_fused": the fused kernel, TorchTitan's default and DMuon's AdamW's (the
        # baseline); "adamw": torch's default kernels (a for-loop on CPU).
        opt = torch.optim.AdamW(
            model.parameters(), lr=ADAMW_LR, betas=ADAMW_BETAS, fused=mode == "adamw_fused" or None
        )
    elif mode == "naive_muon":
        opt = NaiveFSDPMuon(
            model,
            matrix_predicate,
            lr=MUON_LR,
            momentum=MOMENTUM,
            weight_decay=0.0,
            ns_dtype=ns_dtype,
            adamw_lr=ADAMW_LR,
        )
    elif mode in PEERS:
        opt = PEERS[mode](
            model,
            mesh,
            lr=MUON_LR,
            momentum=MOMENTUM,
            adamw_lr=ADAMW_LR,
            predicate=matrix_predicate,
        )
    else:
        opt = dmuon.Muon(
            model,
            lr=MUON_LR,
            momentum=MOMENTUM,
            ns_dtype=ns_dtype,
            ns_backend="auto" if mode.endswith("_auto") else "torch",
            adamw_lr=ADAMW_LR,
            replicate_async=mode == "hsdp_async",
            variant="normuon" if mode.endswith("_normuon") else "muon",
            qk_clip=dmuon.QKClip(model, qk_clip_attentions(model), QK_CLIP_THRESHOLD)
            if mode.endswith("_qkclip")
            else None,
        )
    return model, opt


def _batch(step: int, rank: int, args, device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g).to(device)
    return tokens[:, :-1], tokens[:, 1:]


def _loss(model, inputs, targets) -> torch.Tensor:
    logits = model(inputs)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _persistent_bytes(model, opt) -> int:
    """Bytes of the storages this rank holds between steps for the mode (parameters as
    stored here, gradients, optimizer state, owners' masters)."""
    tensors = [p for p in model.parameters()] + [p.grad for p in model.parameters()]
    optimizers = getattr(opt, "optimizers", None) or [getattr(opt, "adamw", None), opt]
    for o in optimizers:
        for state in getattr(o, "state", {}).values():
            tensors += [v for v in state.values() if torch.is_tensor(v)]
    tensors += list(getattr(opt, "buffers", {}).values())
    dedication = dmuon.get_dedication(model)
    if dedication is not None:
        tensors += [u.master for u in dedication.units if u.master is not None]
        tensors += [u.grad for u in dedication.units if u.grad is not None]
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        t = t.to_local() if isinstance(t, DTensor) else t
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen and storage.nbytes() > 0:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def _transient_peak(step_fn) -> int:
    """Largest net allocation during ``step_fn`` (CPU: profiler allocation events)."""
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        step_fn()
        return torch.cuda.max_memory_allocated() - before
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step_fn()
    running = peak = 0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        running += event.self_cpu_memory_usage
        peak = max(peak, running)
    return peak


def _step_breakdown(step_fn, steps: int) -> dict[str, float]:
    """Median milliseconds per step of each phase (and of the whole optimizer step), from
    the profiler ranges of ``steps`` profiled steps (host time: on a GPU, the time to
    issue the work)."""
    names = dict(PHASES) | {"optimizer": STEP_RANGE}
    samples = {phase: [] for phase in names}
    for _ in range(steps):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step_fn()
        totals = dict.fromkeys(names, 0.0)
        for event in prof.events():
            for phase, name in names.items():
                if event.name == name:
                    totals[phase] += event.cpu_time_total / 1e3
        for phase, value in totals.items():
            samples[phase].append(value)
    return {phase: statistics.median(values) for phase, values in samples.items()}


def worker(rank: int, world: int, args, store: str, result_path: str) -> None:
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world)
    device = _device()
    if args.ns_dtype == "auto":
        # What Muon(ns_dtype="auto") runs here, agreed by every rank through the same
        # decision, so that naive Muon runs it too on every rank.
        def gather(obj) -> list:
            everyone = [None] * world
            dist.all_gather_object(everyone, obj)
            return everyone

        choice = choose_ns(MuonConfig(), device, lambda dtype: {}, gather)
        args.ns_dtype = str(choice.dtype).removeprefix("torch.")
        args.ns_dtype_reason = choice.dtype_reason
    modes = list(args.modes)
    reference = (
        load_reference(args.reference_path)
        if any(m.startswith("reference") for m in modes)
        else None
    )
    runs = {m: _build(m, args, world, device, reference) for m in modes}
    step = {m: 0 for m in modes}
    times = {m: {"step": [], "fwd_bwd": [], "optimizer": []} for m in modes}
    collectives = {}
    losses = {m: [] for m in modes}

    def train_step(mode: str, record: bool) -> None:
        model, opt = runs[mode]
        inputs, targets = _batch(step[mode], rank, args, device)
        dist.barrier()
        _sync(device)
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = _loss(model, inputs, targets)
        loss.backward()
        _sync(device)
        t1 = time.perf_counter()
        opt.step()
        _sync(device)
        t2 = time.perf_counter()
        step[mode] += 1
        losses[mode].append(loss.item())
        if record:
            times[mode]["step"].append(t2 - t0)
            times[mode]["fwd_bwd"].append(t1 - t0)
            times[mode]["optimizer"].append(t2 - t1)

    for round_index in range(args.rounds + 1):  # round 0 warms up
        for mode in modes:
            for _ in range(args.steps_per_round):
                train_step(mode, record=round_index > 0)

    # Same math: each side-by-side pair's parameters after the same steps on the same data.
    side_diff = {
        layout: _max_difference(runs[ours][0], runs[theirs][0], reference)
        for layout, (ours, theirs) in SIDE_PAIRS.items()
        if ours in runs and theirs in runs
    }
    memory, ns_flops_rank, breakdown, final_loss = {}, {}, {}, {}
    for mode in modes:
        model, opt = runs[mode]
        with CollectiveCounter() as counter:
            train_step(mode, record=False)
        collectives[mode] = counter.snapshot()
        persistent = _persistent_bytes(model, opt)
        memory[mode] = persistent + _transient_peak(lambda m=mode: train_step(m, record=False))
        ns_flops_rank[mode] = _ns_flops_per_step(mode, model, opt)
        final_loss[mode] = losses[mode][-1]  # every mode after the same number of steps
        if dmuon.get_dedication(model) is not None:
            breakdown[mode] = _step_breakdown(
                lambda m=mode: train_step(m, record=False), args.breakdown_steps
            )

    # Compute-only reference: forward+backward of an unsharded copy, no communication.
    torch.manual_seed(0)
    with torch.device(device):
        local = BenchTransformer(args.vocab, args.dim, args.layers, args.heads)
    compute = []
    for i in range(max(args.rounds * args.steps_per_round // 2, 1) + 2):  # 2 warm-up
        inputs, targets = _batch(i, rank, args, device)
        _sync(device)
        t0 = time.perf_counter()
        _loss(local, inputs, targets).backward()
        _sync(device)
        compute.append(time.perf_counter() - t0)
    result = {
        "rank": rank,
        "times": times,
        "collectives": collectives,
        "memory": memory,
        "ns_flops": ns_flops_rank,
        "breakdown": breakdown,
        "final_loss": final_loss,
        "compute_fwd_bwd": statistics.median(compute[2:]),
        "side_diff": side_diff,
        "ns_dtype": args.ns_dtype,
        "ns_dtype_reason": getattr(args, "ns_dtype_reason", "named"),
    }
    gathered = [None] * world
    dist.all_gather_object(gathered, result)
    if rank == 0:
        Path(result_path).write_text(json.dumps(gathered))
    runs.clear()
    del local
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def _full_values(model, reference) -> dict[str, torch.Tensor]:
    """Every parameter's full value by name, on every rank (collective): through DMuon's
    ``get_full_param`` or, for a model the reference dedicated, its own state dict."""
    if reference is not None and dmuon.get_dedication(model) is None:
        return reference.get_model_state_dict(model, cpu_offload=False, rank0_only=False)
    dedication = dmuon.get_dedication(model)
    dedicated = {d.name for unit in dedication.units for d in unit.params}
    values = {}
    for name, p in model.named_parameters():
        if name in dedicated:
            values[name] = dmuon.get_full_param(model, name)
        else:
            values[name] = p.full_tensor() if isinstance(p, DTensor) else p.detach()
    return values


def _max_difference(ours, theirs, reference) -> dict:
    """The largest absolute difference between two trained models' parameters, and where."""
    a, b = _full_values(ours, None), _full_values(theirs, reference)
    if set(a) != set(b):
        raise RuntimeError(f"parameter names differ: {sorted(set(a) ^ set(b))}")
    diffs = {name: (a[name].float() - b[name].float()).abs().max().item() for name in a}
    worst = max(diffs, key=diffs.get)
    return {"max_abs": diffs[worst], "where": worst, "params": len(diffs)}


def _ns_flops_per_step(mode: str, model, opt) -> int | None:
    """Newton-Schulz FLOPs this rank runs per step (None: not instrumented, for peers)."""
    all_matrices = sum(
        ns_flops(p.shape, 5) for n, p in model.named_parameters() if matrix_predicate(n, p)
    )
    if mode.startswith("adamw"):
        return 0
    if mode == "naive_muon":
        return all_matrices
    if mode.startswith("reference"):  # the matrices this rank owns there
        return sum(ns_flops(dp.full_shape, 5) for dp in opt._dedicated_params)
    dedication = dmuon.get_dedication(model)
    if dedication is None:
        return None
    return sum(ns_flops(d.layout.shape, 5) for d, _ in dedication.primary_params())


def _median_of_max(per_rank: list[list[float]]) -> tuple[float, float, float]:
    """Median, 10th and 90th percentile over steps of the slowest rank's time."""
    slowest = [max(values) for values in zip(*per_rank, strict=True)]
    q = statistics.quantiles(slowest, n=10) if len(slowest) > 1 else [slowest[0]] * 9
    return statistics.median(slowest), q[0], q[-1]


def summarize(results: list[dict], modes: list[str]) -> dict:
    compute = statistics.median(r["compute_fwd_bwd"] for r in results)
    rows = {}
    for mode in modes:
        step, p10, p90 = _median_of_max([r["times"][mode]["step"] for r in results])
        fwd_bwd = _median_of_max([r["times"][mode]["fwd_bwd"] for r in results])[0]
        optimizer = _median_of_max([r["times"][mode]["optimizer"] for r in results])[0]
        kinds = sorted({k for r in results for k in r["collectives"][mode]["bytes"]})
        flops = [r["ns_flops"][mode] for r in results]
        rows[mode] = {
            "step_ms": 1e3 * step,
            "step_ms_p10": 1e3 * p10,
            "step_ms_p90": 1e3 * p90,
            "fwd_bwd_ms": 1e3 * fwd_bwd,
            "optimizer_ms": 1e3 * optimizer,
            "exposed_comm_ms": 1e3 * max(fwd_bwd - compute, 0.0),
            "bytes_per_rank": {
                k: max(r["collectives"][mode]["bytes"].get(k, 0) for r in results) for k in kinds
            },
            "ns_gflops_per_rank_max": None if None in flops else max(flops) / 1e9,
            "ns_flops_balance": None
            if None in flops or not any(flops)
            else max(flops) / (sum(flops) / len(flops)),
            "peak_memory_mb": max(r["memory"][mode] for r in results) / 2**20,
            "final_loss": statistics.mean(r["final_loss"][mode] for r in results),
        }
        if mode in results[0]["breakdown"]:
            rows[mode]["step_breakdown"] = _summarize_breakdown(
                [r["breakdown"][mode] for r in results]
            )
    side = {}
    for layout, (ours, theirs) in SIDE_PAIRS.items():
        if ours in rows and theirs in rows:
            diffs = [r["side_diff"][layout] for r in results]
            worst = max(diffs, key=lambda d: d["max_abs"])
            side[layout] = {
                "dmuon": ours,
                "reference": theirs,
                "optimizer_ratio": rows[ours]["optimizer_ms"] / rows[theirs]["optimizer_ms"],
                "fwd_bwd_ratio": rows[ours]["fwd_bwd_ms"] / rows[theirs]["fwd_bwd_ms"],
                "step_ratio": rows[ours]["step_ms"] / rows[theirs]["step_ms"],
                "max_abs_param_difference": worst["max_abs"],
                "where": worst["where"],
                "same_math": worst["max_abs"] <= SIDE_TOLERANCE,
            }
    baseline = rows[BASELINE]["step_ms"]
    for row in rows.values():
        row["ratio_to_adamw_fused"] = row["step_ms"] / baseline
        if "adamw" in rows:
            row["ratio_to_adamw"] = row["step_ms"] / rows["adamw"]["step_ms"]
        row["total_bytes_per_rank"] = sum(row["bytes_per_rank"].values())
        if "step_breakdown" in row:
            # The busiest rank's Newton-Schulz as this mode runs it, on top of the baseline.
            ns = max(b["newton_schulz"] for b in row["step_breakdown"]["per_rank_ms"])
            row["floor_ms"] = baseline + ns
            row["ratio_to_floor"] = row["step_ms"] / row["floor_ms"]
    return {
        "rows": rows,
        "side_by_side": side,
        "compute_fwd_bwd_ms": 1e3 * compute,
        "ns_dtype": results[0]["ns_dtype"],
        "ns_dtype_reason": results[0]["ns_dtype_reason"],
    }


def _summarize_breakdown(per_rank: list[dict[str, float]]) -> dict:
    """The per-rank phases, and the optimizer step of the slowest rank against its floor:
    the busiest rank's Newton-Schulz plus AdamW time (same profiled steps)."""
    floors = [b["newton_schulz"] + b["adamw"] for b in per_rank]
    floor = max(floors)
    optimizer = max(b["optimizer"] for b in per_rank)
    return {
        "per_rank_ms": per_rank,
        "optimizer_ms": optimizer,
        "floor_ms": floor,
        "busiest_rank": floors.index(floor),
        "ratio_to_floor": optimizer / floor if floor > 0 else None,
    }


def _bytes_goal(z2_bytes: int, adamw_bytes: int) -> tuple[str, bool | None, str]:
    name = "DMuon Z2 bytes/rank/step <= 1.05x FSDP2+fused AdamW's"
    if adamw_bytes == 0:
        return name, None, "one process: no collectives"
    return name, z2_bytes <= 1.05 * adamw_bytes, f"{z2_bytes / adamw_bytes:.3f}x"


def goals(summary: dict, skipped: dict[str, str]) -> list[tuple[str, bool | None, str]]:
    rows = summary["rows"]
    z3, z2, naive, adamw = rows["dmuon_z3"], rows["dmuon_z2"], rows["naive_muon"], rows[BASELINE]
    out = [
        (
            "DMuon optimizer step >= 3x faster than naive's",
            naive["optimizer_ms"] / z3["optimizer_ms"] >= 3,
            f"{naive['optimizer_ms'] / z3['optimizer_ms']:.2f}x",
        ),
        (
            "DMuon step well below naive's",
            z3["step_ms"] < naive["step_ms"],
            f"{z3['step_ms']:.1f} vs {naive['step_ms']:.1f} ms",
        ),
        _bytes_goal(z2["total_bytes_per_rank"], adamw["total_bytes_per_rank"]),
        (
            "DMuon Z3 peak memory/rank <= FSDP2+fused AdamW's",
            z3["peak_memory_mb"] <= adamw["peak_memory_mb"],
            f"{z3['peak_memory_mb']:.1f} vs {adamw['peak_memory_mb']:.1f} MiB",
        ),
    ]
    for mode in ("dmuon_z3", "dmuon_z3_auto"):
        breakdown = rows.get(mode, {}).get("step_breakdown")
        if breakdown is not None and breakdown["ratio_to_floor"] is not None:
            out.append(
                (
                    f"{mode} optimizer step <= 1.15x (busiest rank's NS + AdamW)",
                    breakdown["ratio_to_floor"] <= 1.15,
                    f"{breakdown['ratio_to_floor']:.3f}x of {breakdown['floor_ms']:.1f} ms",
                )
            )
    for mode in ("dmuon_z3_auto", "dmuon_z2_auto"):
        if "floor_ms" in rows.get(mode, {}):
            row = rows[mode]
            out.append(
                (
                    f"{mode} step <= 1.05x its floor (fused-AdamW step + busiest rank's NS)",
                    row["ratio_to_floor"] <= 1.05,
                    f"{row['ratio_to_floor']:.3f}x of {row['floor_ms']:.1f} ms "
                    f"({row['ratio_to_adamw_fused']:.3f}x fused AdamW)",
                )
            )
    variants = (
        ("dmuon_z3_normuon", "NorMuon", "its normalization, same ownership"),
        ("dmuon_z3_qkclip", "QK-clip", "its max-logit pass and the clip"),
    )
    for mode, name, why in variants:
        if mode in rows:
            step_ms = rows[mode]["step_ms"]
            out.append(
                (
                    f"{name} step <= 1.05x DMuon Z3's ({why})",
                    step_ms <= 1.05 * z3["step_ms"],
                    f"{step_ms / z3['step_ms']:.3f}x",
                )
            )
    for peer in PEERS:
        if peer in rows:
            out.append(
                (
                    f"DMuon ahead of {peer} on step time",
                    z3["step_ms"] < rows[peer]["step_ms"],
                    f"{z3['step_ms']:.1f} vs {rows[peer]['step_ms']:.1f} ms",
                )
            )
        else:
            out.append((f"DMuon ahead of {peer} on step time", None, skipped.get(peer, "")))
    return out


def print_table(summary: dict, skipped: dict[str, str], checks) -> None:
    rows = summary["rows"]
    header = (
        f"{'mode':<13} {'step ms':>8} {'p10-p90':>13} {'x fused':>8} {'x floor':>8} {'opt ms':>8} "
        f"{'comm ms':>8} {'MB/rank':>8} {'NS GF max':>9} {'NS bal':>6} "
        f"{'peak MiB':>9} {'loss':>7}"
    )
    print(header)
    print("-" * len(header))
    for mode, r in rows.items():
        flops = (
            "n/a" if r["ns_gflops_per_rank_max"] is None else f"{r['ns_gflops_per_rank_max']:.2f}"
        )
        balance = "-" if r["ns_flops_balance"] is None else f"{r['ns_flops_balance']:.2f}"
        floor = f"{r['ratio_to_floor']:.3f}" if "ratio_to_floor" in r else "-"
        print(
            f"{mode:<13} {r['step_ms']:8.1f} {r['step_ms_p10']:6.1f}-{r['step_ms_p90']:<6.1f} "
            f"{r['ratio_to_adamw_fused']:8.3f} {floor:>8} {r['optimizer_ms']:8.1f} "
            f"{r['exposed_comm_ms']:8.1f} "
            f"{r['total_bytes_per_rank'] / 2**20:8.2f} {flops:>9} {balance:>6} "
            f"{r['peak_memory_mb']:9.1f} {r['final_loss']:7.4f}"
        )
    print(
        f"baseline: FSDP2 + fused AdamW ({BASELINE}); floor of a DMuon mode: the baseline's "
        "step + its busiest rank's Newton-Schulz (profiled, batched, its backend); "
        f"compute-only fwd+bwd {summary['compute_fwd_bwd_ms']:.1f} ms; NS in "
        f"{summary['ns_dtype']} ({summary['ns_dtype_reason']})"
    )
    print_breakdown(rows)
    print_side_by_side(summary)
    for mode, reason in skipped.items():
        print(f"not run: {mode}: {reason}")
    for name, ok, detail in checks:
        verdict = "n/a " if ok is None else ("PASS" if ok else "MISS")
        print(f"[{verdict}] {name}: {detail}")


def print_side_by_side(summary: dict) -> None:
    """One line per layout: DMuon's and the reference's times, their ratio, and whether
    they trained the same parameters."""
    side = summary["side_by_side"]
    if not side:
        return
    rows = summary["rows"]
    print(
        f"\nside by side with the reference design (X-Square-Robot/dmuon {REFERENCE_COMMIT}), "
        "same math (fp32 NS); ms, slowest rank, median of the interleaved rounds; max |dp|: "
        "largest difference of a trained parameter"
    )
    header = (
        f"{'layout':<7} {'opt DMuon':>9} {'opt ref':>8} {'x opt':>6} {'f+b DMuon':>9} "
        f"{'f+b ref':>8} {'step DMuon':>10} {'step ref':>9} {'x step':>7} {'max |dp|':>9}"
    )
    print(header)
    print("-" * len(header))
    for layout, s in side.items():
        ours, theirs = rows[s["dmuon"]], rows[s["reference"]]
        verdict = "" if s["same_math"] else f" DIFFER ({s['where']})"
        print(
            f"{layout:<7} {ours['optimizer_ms']:9.1f} {theirs['optimizer_ms']:8.1f} "
            f"{s['optimizer_ratio']:6.3f} {ours['fwd_bwd_ms']:9.1f} {theirs['fwd_bwd_ms']:8.1f} "
            f"{ours['step_ms']:10.1f} {theirs['step_ms']:9.1f} {s['step_ratio']:7.3f} "
            f"{s['max_abs_param_difference']:9.2e}{verdict}"
        )


def print_breakdown(rows: dict) -> None:
    """One line per DMuon mode and rank: ms per step of each phase."""
    modes = [m for m in rows if "step_breakdown" in rows[m]]
    if not modes:
        return
    phases = [phase for phase, _ in PHASES]
    header = f"{'mode':<14} {'rank':>4} " + " ".join(f"{p:>13}" for p in phases)
    header += f" {'opt step':>9} {'x floor':>8}"
    print(
        "\noptimizer step breakdown (ms per step, profiled steps; "
        "floor = busiest rank's NS + AdamW)"
    )
    print(header)
    print("-" * len(header))
    for mode in modes:
        b = rows[mode]["step_breakdown"]
        for rank, values in enumerate(b["per_rank_ms"]):
            cells = " ".join(f"{values[p]:13.1f}" for p in phases)
            ratio = f"{b['ratio_to_floor']:.3f}" if rank == b["busiest_rank"] else ""
            print(f"{mode:<14} {rank:>4} {cells} {values['optimizer']:9.1f} {ratio:>8}")


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = summary["rows"]
    modes = list(rows)
    compute = [summary["compute_fwd_bwd_ms"]] * len(modes)
    comm = [rows[m]["fwd_bwd_ms"] - summary["compute_fwd_bwd_ms"] for m in modes]
    comm = [max(c, 0.0) for c in comm]
    opt = [rows[m]["optimizer_ms"] for m in modes]
    broken_down = [m for m in modes if "step_breakdown" in rows[m]]
    fig, axes = plt.subplots(
        1, 2 if broken_down else 1, figsize=(2.8 * len(modes) + 4, 4.8), squeeze=False
    )
    ax = axes[0][0]
    ax.bar(modes, compute, label="forward+backward compute")
    ax.bar(modes, comm, bottom=compute, label="exposed communication (fwd/bwd)")
    ax.bar(
        modes,
        opt,
        bottom=[a + b for a, b in zip(compute, comm, strict=True)],
        label="optimizer step",
    )
    floors = [(i, rows[m]["floor_ms"]) for i, m in enumerate(modes) if "floor_ms" in rows[m]]
    if floors:
        ax.scatter(
            *zip(*floors, strict=True), marker="_", s=900, color="k", zorder=3,
            label="floor: fused-AdamW step + busiest rank's NS",
        )  # fmt: skip
    ax.set_ylabel("ms per step (slowest rank, median)")
    ax.set_title("Step time per mode")
    ax.legend(fontsize=8)
    ax.tick_params(axis="x", rotation=20)
    if broken_down:
        ax = axes[0][1]
        labels = []
        for mode in broken_down:
            for rank in range(len(rows[mode]["step_breakdown"]["per_rank_ms"])):
                labels.append(f"{mode}\nr{rank}")
        bottoms = [0.0] * len(labels)
        for phase, _ in PHASES:
            heights = [
                values[phase]
                for mode in broken_down
                for values in rows[mode]["step_breakdown"]["per_rank_ms"]
            ]
            ax.bar(labels, heights, bottom=bottoms, label=phase)
            bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
        ax.set_ylabel("ms per step (profiled steps, median)")
        ax.set_title("Optimizer step breakdown per rank")
        ax.legend(fontsize=7)
        ax.tick_params(axis="x", labelsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--seq", type=int, default=120)
    parser.add_argument("--batch", type=int, default=2, help="sequences per rank")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps-per-round", type=int, default=3)
    parser.add_argument(
        "--breakdown-steps", type=int, default=5, help="profiled steps per DMuon mode"
    )
    parser.add_argument(
        "--ns-dtype", default="auto", help="auto (Muon's default), bfloat16, float32, ..."
    )
    parser.add_argument("--modes", nargs="*", default=None)
    parser.add_argument(
        "--reference-path",
        default=None,
        help="a checkout of X-Square-Robot/dmuon (the directory holding dmuon/), imported "
        "from there for its modes (reference_*)",
    )
    parser.add_argument(
        "--side-by-side",
        action="store_true",
        help="run only fused AdamW and, per layout (Z3, Z2, HSDP), DMuon beside the "
        "reference design with the same math (needs --reference-path)",
    )
    parser.add_argument("--out", type=Path, default=Path("outputs/bench_step"))
    args = parser.parse_args()
    world = args.nproc
    skipped = {}
    missing = reference_status(args.reference_path)
    if args.side_by_side:
        if missing is not None:
            print(f"not run: the side by side: {missing}")
            return
        layouts = [x for x in SIDE_LAYOUTS if x != "hsdp" or (world >= 4 and world % 2 == 0)]
        args.modes = [BASELINE] + [m for layout in layouts for m in SIDE_PAIRS[layout]]
    elif args.modes is None:
        args.modes = list(BASE_MODES)
        if world >= 4 and world % 2 == 0:
            args.modes += HSDP_MODES
        else:
            skipped.update(dict.fromkeys(HSDP_MODES, "HSDP needs an even world size >= 4"))
        for peer in PEERS:
            reason = peer_status(peer)
            if reason is None:
                args.modes.append(peer)
            else:
                skipped[peer] = reason
    if missing is not None:
        for mode in [m for m in args.modes if m.startswith("reference")]:
            args.modes.remove(mode)
            skipped[mode] = missing
    model = BenchTransformer(args.vocab, args.dim, args.layers, args.heads)
    ratio = ns_to_compute_ratio(model, args.batch * args.seq)
    params = sum(p.numel() for p in model.parameters())
    print(
        f"model: dim {args.dim}, {args.layers} layers, {params / 1e6:.1f}M params; "
        f"{args.batch}x{args.seq} tokens per rank; NS/compute ratio {ratio:.2f} (Llama-3 8B "
        f"at 4096 tokens per rank: {ns_to_compute_ratio_8b():.2f}); {world} processes; "
        f"{_machine()}"
    )
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        result_path = os.path.join(tmp, "results.json")
        mp.spawn(worker, args=(world, args, os.path.join(tmp, "store"), result_path), nprocs=world)
        results = json.loads(Path(result_path).read_text())
    summary = summarize(results, args.modes)
    checks = (
        goals(summary, skipped)
        if {"dmuon_z3", "dmuon_z2", "naive_muon", BASELINE} <= set(args.modes)
        else []
    )
    print_table(summary, skipped, checks)
    record = {
        "machine": _machine(),
        "command": " ".join(sys.argv),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "ns_to_compute_ratio": ratio,
        "skipped": skipped,
        "goals": [{"goal": n, "met": ok, "detail": d} for n, ok, d in checks],
        **summary,
    }
    (args.out / "results.json").write_text(json.dumps(record, indent=2))
    plot(summary, args.out / "step_time.png")
    print(f"wrote {args.out / 'results.json'} and {args.out / 'step_time.png'}")


def _machine() -> str:
    """The CPU (model, torch's capability string), cores, torch and any GPU."""
    machine = f"{cpu_description()}, {os.cpu_count()} cores, torch {torch.__version__}"
    if torch.cuda.is_available():
        machine += ", " + torch.cuda.get_device_name()
    return machine


def ns_to_compute_ratio_8b() -> float:
    """The same ratio for Llama-3 8B's shapes at 4096 tokens per rank (meta device)."""
    with torch.device("meta"):
        model = BenchTransformer(vocab=128256, dim=4096, layers=32, heads=32)
    return ns_to_compute_ratio(model, 4096)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
