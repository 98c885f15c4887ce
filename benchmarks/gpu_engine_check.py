"""The ``engine`` and ``syncs`` steps of ``benchmarks/gpu_lease.sh``: the engine on one GPU, and
its host syncs. Run through the lease's one entry:

    python benchmarks/gpu_lease.py engine --out engine.json
    python benchmarks/gpu_lease.py syncs --out syncs.json
    python benchmarks/gpu_lease.py engine --device cpu --out e.json   # a check without a GPU

``engine``: the tests' tiny transformer trained 4 steps with DMuon by
``tests.support.workers.train_dmuon`` (the CPU suite's training loop) on CUDA tensors, each run
compared with one-process ``torch.optim.Muon`` + ``torch.optim.AdamW`` on the same GPU
(``tests.support.workers.train_reference``; losses and every trained parameter within the CPU
suite's tolerances, ``loss_tolerance`` and ``trained_tolerance``):

* over NCCL at world size 1, every collective path of the engine: FSDP2 Z3 and Z2, no
  FSDP, HSDP 1x1 with asynchronous replicate broadcasts, gradient accumulation with sync on
  the last micro-batch only, clipping, meta-device init at the plan's size, full
  activation checkpointing, a backward that raised half-way (caught, then ``zero_grad``:
  the engine's and FSDP2's recovery), a ``Muon.step`` that raised (state unchanged, then
  retried), fp32 Newton-Schulz, blocks compiled with ``torch.compile`` (dedicated weights
  in compiled code, as TorchTitan's per-block compile with DMuon on several GPUs);
* several processes sharing the GPU over gloo with CUDA tensors (NCCL refuses two ranks
  on one GPU): the engine without FSDP, FSDP Z3 and Z2 on 2 ranks, HSDP 2x2 with
  asynchronous replicate broadcasts on 4. Gloo implements only some collectives for CUDA
  tensors: a case it refuses fails with gloo's message, the others go on.

``syncs``: host synchronizations per training step, counted with
``torch.cuda.set_sync_debug_mode("warn")`` (one warning per synchronizing call) over
forward, backward, ``optimizer.step()`` and ``zero_grad()`` separately, after warm-up
steps, at world size 1 over NCCL: DMuon (Z3 and Z2) against FSDP2 + fused AdamW, with the
source lines that synchronize.

``--device cpu`` runs the same code on gloo CPU ranks (no sync to count there): a check of
this script without a GPU.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile
import time
import traceback
import types
import warnings
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import tests.support.workers as workers  # noqa: E402
import torchtitan_dmuon as dmuon  # noqa: E402
from tests.support.dist import run_distributed  # noqa: E402
from tests.support.models import loss_fn, make_model, proj_predicate  # noqa: E402

STEPS = 4
# World size 1 over NCCL: one process, every path (configs of tests.support.workers.train_dmuon).
SOLO_CASES = {
    "fsdp_z3": {},
    "fsdp_z2": {"z3": False},
    "no_fsdp": {"fsdp": False},
    "hsdp_1x1_async": {"hsdp_shape": (1, 1), "replicate_async": True},
    "accum2_sync_last": {"accum": 2, "sync_last_micro_batch_only": True},
    "clip": {"clip": 0.5},
    "meta_init_plan": {"meta_init": "plan"},
    "checkpoint_full": {"checkpoint_blocks": "full"},
    "failed_backward_recovery": {"fail_before_step": 2},
    "failed_step": {"fail_step_at": (1, 0)},
    "ns_fp32": {"ns_dtype": torch.float32},
}
# World size 1 in a process of its own (Inductor compiles for a while).
COMPILED_CASES = {"compiled_blocks": {"compile_blocks": True}}
# Several ranks on one GPU over gloo: (world size, config).
SHARED_CASES = {
    "gloo2_no_fsdp": (2, {"fsdp": False}),
    "gloo2_fsdp_z3": (2, {}),
    "gloo2_fsdp_z2": (2, {"z3": False}),
    "gloo4_hsdp_2x2_async": (4, {"hsdp_shape": (2, 2), "replicate_async": True}),
}
REFERENCE_KEYS = ("steps", "same_data", "ns_dtype", "accum", "clip", "model_kwargs")


def _error(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"[:600]


def _plan_report_kept(errors: list[str]):
    """``plan_report`` for ``train_dmuon`` that records a failure instead of raising: the
    report reads FSDP2's internal state, which torch versions lay out differently, and
    the training paths are checked all the same."""
    original = workers.plan_report

    def plan_report(model, counts):
        try:
            return original(model, counts)
        except Exception as error:  # noqa: BLE001
            errors.append(_error(error))
            return types.SimpleNamespace(ranks=[])

    return plan_report


def _train(rank: int, world: int, device: str, config: dict) -> dict:
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    report_errors: list[str] = []
    workers.plan_report = _plan_report_kept(report_errors)
    started = time.monotonic()
    result = workers.train_dmuon(rank, world, steps=STEPS, device=device, **config)
    return {
        "seconds": round(time.monotonic() - started, 2),
        "losses": result["losses"],
        "norms": result["norms"],
        # Checkpoint-wrapped and compiled blocks' parameters under the plain model's names.
        "params": {
            k.replace("._checkpoint_wrapped_module", "").replace("._orig_mod", ""): v.cpu()
            for k, v in result["params"].items()
        },
        "owned": result["owned"],
        "step_failure": result["step_failure"],
        "stats": result["stats"],
        "collectives": {k: v for k, v in result["collectives"][-1].items() if k != "group_bytes"},
        "plan_report_errors": report_errors,
    }


def solo_job(rank: int, world: int, device: str, cases: dict) -> dict:
    """Every world-size-1 case in one process; a failing case is recorded, the next runs."""
    out = {}
    for name, config in cases.items():
        try:
            out[name] = _train(rank, world, device, config)
        except Exception as error:  # noqa: BLE001
            out[name] = {"error": _error(error), "traceback": traceback.format_exc()[-3000:]}
    return out


def shared_job(rank: int, world: int, device: str, config: dict) -> dict:
    """One multi-rank case (a rank that raises ends the run at once: its peers would
    wait in a collective)."""
    return _train(rank, world, device, config)


def compare(result: dict, config: dict, world: int, device: str) -> dict:
    """``result`` against one-process torch.optim.Muon + AdamW on the same device."""
    kwargs = {k: v for k, v in config.items() if k in REFERENCE_KEYS}
    reference = workers.train_reference(world, steps=STEPS, device=device, **kwargs)
    ns_dtype = config.get("ns_dtype", torch.bfloat16)
    expected = {k: v.detach().cpu() for k, v in reference["params"].items()}
    lr = max(
        workers.MUON_KW["lr"] * max(1.0, p.shape[0] / p.shape[1]) ** 0.5
        for n, p in expected.items()
        if proj_predicate(n, p)
    )
    tolerance = workers.trained_tolerance(ns_dtype, lr=lr, steps=STEPS)
    row = {
        "loss_diff": max(
            abs(a - b) for a, b in zip(result["losses"], reference["losses"], strict=True)
        ),
        "param_max_abs_diff": max(
            (result["params"][k] - expected[k]).abs().max().item() for k in expected
        ),
        "param_atol": tolerance["atol"],
    }
    problems = []
    try:
        torch.testing.assert_close(
            result["losses"], reference["losses"], **workers.loss_tolerance(ns_dtype)
        )
    except AssertionError as error:
        problems.append(f"losses: {str(error).splitlines()[0]}")
    for name, value in expected.items():
        try:
            torch.testing.assert_close(result["params"][name], value, **tolerance)
        except AssertionError as error:
            problems.append(f"{name}: {str(error).splitlines()[0]}")
    failure = result.get("step_failure")
    if "fail_step_at" in config and not (failure and failure["unchanged"]):
        problems.append(f"failed step left state changed: {failure}")
    row["ok"] = not problems
    row["problems"] = problems[:5]
    return row


def engine(args: argparse.Namespace) -> dict:
    """Every case, the JSON rewritten after each (a step stopped by its timeout keeps
    what ran)."""
    device = args.device
    solo_backend = "nccl" if device == "cuda" else "gloo"
    started = time.monotonic()
    result = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "cases": [],
    }

    def record(row: dict) -> None:
        result["cases"].append(row)
        result["seconds"] = round(time.monotonic() - started, 1)
        result["passed"] = sum(r["ok"] is True for r in result["cases"])
        result["failed"] = sum(r["ok"] is False for r in result["cases"])
        result["unsupported"] = sum(r["ok"] is None for r in result["cases"])
        _write(args.out, result)
        if row["ok"] is None:
            verdict = f"unsupported here: {row['unsupported']}"
        else:
            verdict = "ok" if row["ok"] else f"FAIL {row.get('error') or row.get('problems')}"
        print(f"{row['case']:<34} world {row['world']}  {verdict}", flush=True)

    unsupported = _unsupported_cases()
    for name, reason in unsupported.items():
        record({"case": f"{solo_backend}1_{name}", "world": 1, "ok": None, "unsupported": reason})
    for cases in (SOLO_CASES, COMPILED_CASES):
        cases = {name: config for name, config in cases.items() if name not in unsupported}
        try:
            solo = run_distributed(
                solo_job, 1, device, cases, timeout=args.timeout, backend=solo_backend
            )[0]
        except Exception as error:  # noqa: BLE001 - the process itself failed
            solo = {name: {"error": _first_error(str(error))} for name in cases}
        for name, config in cases.items():
            record(_row(f"{solo_backend}1_{name}", 1, config, solo[name], device))
    for name, (world, config) in SHARED_CASES.items():
        try:
            by_rank = run_distributed(
                shared_job, world, device, config, timeout=args.timeout / 2, pg_timeout=30
            )
            outcome = by_rank[0]
        except Exception as error:  # noqa: BLE001 - gloo refused a CUDA collective, say
            outcome = {"error": _first_error(str(error))}
        record(_row(name, world, config, outcome, device))
    return result


def _unsupported_cases() -> dict[str, str]:
    """The cases this torch cannot run, with why: recovery from a backward that raised
    half-way needs FSDP2's ``reset_iter_state`` (torch 2.13; the engine refuses it before,
    naming the version)."""
    from torch.distributed.fsdp import FSDPModule

    if hasattr(FSDPModule, "reset_iter_state"):
        return {}
    reason = f"FSDP2 in torch {torch.__version__} has no FSDPModule.reset_iter_state (2.13)"
    return {name: reason for name, config in SOLO_CASES.items() if "fail_before_step" in config}


def _write(path: Path, result: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, default=str))


def _first_error(text: str) -> str:
    """The exception line of the first failing rank in ``run_distributed``'s message."""
    lines = [line.strip() for line in text.splitlines()]
    found = [line for line in lines if line and ("Error" in line or "Exception" in line)]
    errors = [line for line in found if not line.startswith(("Traceback", "File "))]
    return (errors[-1] if errors else lines[0] if lines else text)[:600]


def _row(case: str, world: int, config: dict, result: dict, device: str) -> dict:
    row = {"case": case, "world": world, "config": {k: str(v) for k, v in config.items()}}
    if "error" in result:
        row.update(ok=False, error=result["error"])
        if "traceback" in result:
            row["traceback"] = result["traceback"]
        return row
    row.update(
        seconds=result["seconds"],
        losses=[round(x, 6) for x in result["losses"]],
        owned=len(result["owned"]),
        stats=result["stats"],
        collectives=result["collectives"],
        plan_report_errors=result["plan_report_errors"],
    )
    if result["step_failure"]:
        row["step_failure"] = result["step_failure"]
    try:
        row.update(compare(result, config, world, device))
    except Exception as error:  # noqa: BLE001
        row.update(ok=False, error=f"reference: {_error(error)}")
    return row


# ---- host syncs -------------------------------------------------------------------


class SyncCounter:
    """Host synchronizations of CUDA calls, counted per phase through
    ``torch.cuda.set_sync_debug_mode("warn")``'s warnings, with where they come from."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.counts: Counter[str] = Counter()
        self.where: dict[str, Counter[str]] = {}

    def run(self, phase: str, fn):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if self.cuda:
                torch.cuda.set_sync_debug_mode("warn")
            try:
                value = fn()
            finally:
                if self.cuda:
                    torch.cuda.set_sync_debug_mode(0)
        syncs = [w for w in caught if "synchroniz" in str(w.message).lower()]
        self.counts[phase] += len(syncs)
        where = self.where.setdefault(phase, Counter())
        for w in syncs:
            where[f"{os.path.relpath(w.filename, ROOT)}:{w.lineno}"] += 1
        if self.cuda:
            torch.cuda.synchronize()
        return value


def _sync_model(mode: str, mesh, device: torch.device):
    from torch.distributed.fsdp import fully_shard

    model = make_model(seed=0, layers=4).to(device)
    if mode.startswith("dmuon"):
        dmuon.dedicate_params(model, mesh, proj_predicate, reshard_after_forward=mode == "dmuon_z3")
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if mode.startswith("dmuon"):
        opt = dmuon.Muon(
            model,
            **workers.MUON_KW,
            **workers.as_muon_adamw_kwargs(workers.ADAMW_KW),
            ns_dtype=torch.bfloat16,
        )
    else:
        opt = torch.optim.AdamW(model.parameters(), **workers.REFERENCE_ADAMW_KW)
    return model, opt


def count_syncs(mode: str, mesh, device: torch.device, warmup: int, steps: int) -> dict:
    model, opt = _sync_model(mode, mesh, device)
    counter = SyncCounter(device)
    for step in range(warmup + steps):
        if step == warmup:
            counter = SyncCounter(device)  # the steady state only
        inputs, targets = (t.to(device) for t in workers.data_for(step, 0, 1, False))
        loss = counter.run("forward", functools.partial(loss_fn, model, inputs, targets))
        counter.run("backward", loss.backward)
        counter.run("step", opt.step)
        counter.run("zero_grad", opt.zero_grad)
    dedication = dmuon.get_dedication(model)
    if dedication is not None:
        dedication.wait_replicas()
    return {
        "per_step": {phase: counter.counts[phase] / steps for phase in counter.where},
        "total_per_step": sum(counter.counts.values()) / steps,
        "where": {phase: dict(c.most_common(8)) for phase, c in counter.where.items()},
    }


def syncs(args: argparse.Namespace) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    device = torch.device(args.device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(0)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group(backend, init_method=f"file://{tmp}/store", rank=0, world_size=1)
        try:
            mesh = init_device_mesh(device.type, (1,))
            modes = {}
            for mode in ("dmuon_z3", "dmuon_z2", "fsdp_adamw_fused"):
                try:
                    modes[mode] = count_syncs(mode, mesh, device, args.warmup, args.steps)
                except Exception as error:  # noqa: BLE001
                    modes[mode] = {"error": _error(error), "traceback": traceback.format_exc()}
                print(f"{mode:<18} {modes[mode].get('per_step') or modes[mode]}", flush=True)
        finally:
            dist.destroy_process_group()
    return {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "counted": device.type == "cuda",
        "warmup_steps": args.warmup,
        "steps": args.steps,
        "modes": modes,
    }


def main(argv: list[str]) -> int:
    """``argv``: ``engine`` or ``syncs``, then that step's arguments."""
    parser = argparse.ArgumentParser(prog="gpu_lease.py", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, helptext in (("engine", "the engine"), ("syncs", "host syncs")):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("--out", type=Path, required=True, help="the JSON to write")
        p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
        if name == "engine":
            p.add_argument(
                "--timeout",
                type=float,
                default=90,
                help="seconds per world-size-1 process (half that for each multi-rank case)",
            )
        else:
            p.add_argument("--warmup", type=int, default=2)
            p.add_argument("--steps", type=int, default=3)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing to check", file=sys.stderr)
        return 1
    result = engine(args) if args.command == "engine" else syncs(args)
    _write(args.out, result)
    print(f"wrote {args.out}")
    return 1 if result.get("failed") else 0  # unsupported cases are not failures
