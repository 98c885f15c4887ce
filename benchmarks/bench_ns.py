"""Time the Newton-Schulz backends (torch, triton on CUDA, gram, auto) over matrix shapes.

Shapes are ``(s, aspect * s)`` for each short side ``s`` and aspect ratio, skipping those
above ``--max-elems``, plus batches of ``--batch`` matrices at the smallest sizes. Prints a
table and writes ``bench_ns.json`` (ms, TFLOP/s from ``ns_flops``, speedup over torch) and
``bench_ns.txt`` (the table) under ``--out``. Off CUDA only torch and gram run (the triton
kernels need a GPU; the interpreter is far too slow to time).

Examples::

    python benchmarks/bench_ns.py --quick              # CPU: about a minute on 2 cores
    python benchmarks/bench_ns.py --out /tmp/bench     # GPU: 1024..8192, aspects 1..8
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterator
from functools import partial

import torch

from torchtitan_dmuon.optim.newton_schulz import ns_flops, resolve_ns_schedule
from torchtitan_dmuon.optim.ns_backends import get_ns_backend

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def time_ms(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    """Median milliseconds of ``fn`` over ``reps`` runs, after one untimed warm-up run."""
    fn()  # compiles, autotunes, lets "auto" measure
    samples = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
        else:
            start_s = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - start_s) * 1e3)
    return statistics.median(samples)


def tflops(flops: int, ms: float) -> float:
    return flops / ms / 1e9


def shapes(
    sizes: list[int], aspects: list[int], batch: int, max_elems: int
) -> Iterator[tuple[int, ...]]:
    """The benchmarked shapes: single matrices, then batches of the two smallest squares."""
    for s in sizes:
        for aspect in aspects:
            if s * s * aspect <= max_elems:
                yield (s, s * aspect)
    if batch > 1:
        for s in sizes[:2]:
            for aspect in (1, max(aspects)):
                if batch * s * s * aspect <= max_elems:
                    yield (batch, s, s * aspect)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (256..1024) for a CPU")
    parser.add_argument("--out", default="outputs/bench_ns", help="folder for the JSON and table")
    parser.add_argument("--sizes", type=int, nargs="+", help="short sides")
    parser.add_argument("--aspects", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--batch", type=int, default=8, help="matrices per batched case")
    parser.add_argument("--max-elems", type=int, help="skip shapes with more elements")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--preset", default="quintic")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--reps", type=int, help="timed runs per case (median)")
    parser.add_argument("--backends", nargs="+", help="default: torch triton gram auto on CUDA")
    parser.add_argument("--threads", type=int, help="CPU threads for torch (a shared CPU: 1)")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    if args.sizes is None:
        args.sizes = [256, 512, 1024] if args.quick else [1024, 2048, 4096, 8192]
    if args.quick:
        args.aspects = [a for a in args.aspects if a in (1, 4, 8)]
        args.batch = min(args.batch, 4)
    if args.max_elems is None:
        args.max_elems = 2**22 if args.quick else 2**27
    if args.reps is None:
        args.reps = 10 if cuda else 3
    if args.backends is None:
        args.backends = ["torch", "triton", "gram", "auto"] if cuda else ["torch", "gram", "auto"]
    # torch is the baseline of every speedup.
    args.backends = ["torch"] + [b for b in args.backends if b != "torch"]
    return args


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = DTYPES[args.dtype]
    schedule = resolve_ns_schedule(args.preset, args.steps)
    if device.type == "cuda":
        device_name = torch.cuda.get_device_name(device)
    else:
        cores = f"{os.cpu_count()} cores, {torch.get_num_threads()} threads"
        device_name = f"{platform.processor() or platform.machine()}, {cores}"
    others = [b for b in args.backends if b != "torch"]

    results = []
    header = f"{'shape':>20} {'torch ms':>10} {'TF/s':>6}" + "".join(
        f" | {name + ' ms':>10} {'TF/s':>6} {'x':>5}" for name in others
    )
    lines = [
        f"Newton-Schulz {args.preset} x{args.steps}, {args.dtype}, {device_name}, "
        f"torch {torch.__version__}",
        header,
        "-" * len(header),
    ]
    print("\n".join(lines), flush=True)
    for shape in shapes(args.sizes, args.aspects, args.batch, args.max_elems):
        g = torch.randn(*shape, device=device, dtype=dtype)
        flops = ns_flops(shape, schedule.steps)
        row = {}
        for name in args.backends:
            backend = get_ns_backend(name)
            ms = time_ms(partial(backend, g, schedule, dtype=dtype), device, args.reps)
            row[name] = ms
            results.append(
                {
                    "backend": name,
                    "shape": list(shape),
                    "dtype": args.dtype,
                    "ms": round(ms, 4),
                    "tflops": round(tflops(flops, ms), 4),
                }
            )
        for record in results[-len(args.backends) :]:
            record["speedup_vs_torch"] = round(row["torch"] / record["ms"], 3)
        base = row["torch"]
        line = f"{'x'.join(map(str, shape)):>20} {base:>10.2f} {tflops(flops, base):>6.2f}"
        for name in others:
            ms = row[name]
            line += f" | {ms:>10.2f} {tflops(flops, ms):>6.2f} {base / ms:>5.2f}"
        lines.append(line)
        print(line, flush=True)

    os.makedirs(args.out, exist_ok=True)
    meta = {
        "device": device_name,
        "torch": torch.__version__,
        "dtype": args.dtype,
        "preset": args.preset,
        "steps": args.steps,
        "reps": args.reps,
        "results": results,
    }
    with open(os.path.join(args.out, "bench_ns.json"), "w") as f:
        json.dump(meta, f, indent=1)
    with open(os.path.join(args.out, "bench_ns.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {args.out}/bench_ns.json and bench_ns.txt")


if __name__ == "__main__":
    main()
