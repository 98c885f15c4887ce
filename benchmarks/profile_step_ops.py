"""Where the optimizer step's time goes, per operator: DMuon beside the reference design.

    .venv/bin/python benchmarks/profile_step_ops.py --reference-path /tmp/xsr_dmuon

builds the side-by-side modes of ``bench_step.py`` (default: Z3, both sides; the same
model, data and math), runs a few warm-up steps of each in turn, then profiles one
``opt.step()`` of each (``torch.profiler``, CPU) and prints, for the ranks asked, the
Newton-Schulz FLOPs the rank owns, the profiled step's total self time and event count,
and its operators by self time (the matrix products are Newton-Schulz's; what is left is
the fixed cost around it).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_step  # noqa: E402


def worker(rank: int, world: int, args, store: str) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    device = torch.device("cpu")
    reference = bench_step.load_reference(args.reference_path)
    runs = {m: bench_step._build(m, args, world, device, reference) for m in args.modes}
    profiles = {}

    def step(mode: str, profiled: bool) -> None:
        model, opt = runs[mode]
        inputs, targets = bench_step._batch(0, rank, args, device)
        opt.zero_grad()
        bench_step._loss(model, inputs, targets).backward()
        dist.barrier()
        if not profiled:
            opt.step()
            return
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            opt.step()
        profiles[mode] = prof.key_averages()

    for _ in range(args.warmup):
        for mode in args.modes:
            step(mode, profiled=False)
    for mode in args.modes:
        step(mode, profiled=True)
    for r in range(world):
        if r == rank and rank in args.ranks:
            for mode in args.modes:
                events = profiles[mode]
                flops = bench_step._ns_flops_per_step(mode, *runs[mode])
                total = sum(e.self_cpu_time_total for e in events) / 1e3
                print(
                    f"rank {rank} {mode}: NS {flops / 1e9:.2f} GFLOP owned; step self time "
                    f"{total:.1f} ms, {sum(e.count for e in events)} events"
                )
                for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[: args.top]:
                    print(f"  {e.key[:56]:<56} {e.count:5d} {e.self_cpu_time_total / 1e3:8.2f} ms")
        dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reference-path", required=True)
    side_modes = [mode for pair in bench_step.SIDE_PAIRS.values() for mode in pair]
    parser.add_argument(
        "--modes", nargs="*", default=list(bench_step.SIDE_PAIRS["z3"]), choices=side_modes
    )
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--ranks", nargs="*", type=int, default=[0])
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--seq", type=int, default=120)
    parser.add_argument("--batch", type=int, default=2)
    args = parser.parse_args()
    missing = bench_step.reference_status(args.reference_path)
    if missing is not None:
        print(f"not run: {missing}")
        return
    print(bench_step._machine())
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(args.nproc, args, os.path.join(tmp, "store")), nprocs=args.nproc)


if __name__ == "__main__":
    main()
