"""Step 1 of ``benchmarks/gpu_lease.sh``: the Newton-Schulz backends at Llama-3 8B's shapes.

    python benchmarks/gpu_ns_check.py --out DIR            # a CUDA machine
    TRITON_INTERPRET=1 python benchmarks/gpu_ns_check.py --device cpu --shapes 64x128 --reps 1

For each of Llama-3 8B's matrix shapes (``check_ns_cuda.LLAMA3_8B_SHAPES``), in bf16 and in
fp32 with TF32 products: the time of each backend (torch, triton, gram, auto; the median of
``--reps`` runs after one untimed run, ``bench_ns.time_ms``) and of its first call (Triton
compiles and autotunes there), its speed against torch, and its distance from the fp64
result with the pass / fail of ``check_ns_cuda.check_backends`` (the same tolerances), plus
the exact symmetry of the Triton Gram kernel (``check_ns_cuda.check_symmetry``). Writes
``ns.json`` under ``--out``; exits 1 when a check failed. ``--device cpu`` (with
``TRITON_INTERPRET=1``) runs the same code on small shapes, to check this script without a
GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_ns  # noqa: E402
import check_ns_cuda  # noqa: E402

from torchtitan_dmuon.optim.newton_schulz import ns_flops, resolve_ns_schedule  # noqa: E402
from torchtitan_dmuon.optim.ns_backends import choose_ns_backend, get_ns_backend  # noqa: E402

BACKENDS = ("torch", "triton", "gram", "auto")
MODES = {"bf16": (torch.bfloat16, False), "tf32": (torch.float32, True)}


def parse_shape(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.lower().split("x"))


def first_call_s(fn, device: torch.device) -> float:
    """Seconds of one call, synchronized (the first one: compiles, autotunes, measures)."""
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def time_backends(shape: tuple[int, ...], device: torch.device, reps: int) -> list[dict]:
    """One record per mode and backend: first-call seconds, median ms, TFLOP/s, x torch."""
    schedule = resolve_ns_schedule("quintic", 5)
    flops = ns_flops(shape, schedule.steps)
    records = []
    for mode, (dtype, tf32) in MODES.items():
        torch.backends.cuda.matmul.allow_tf32 = tf32
        g = torch.randn(*shape, device=device, dtype=dtype)
        torch_ms = None
        for name in BACKENDS:
            record = dict(shape=list(shape), mode=mode, backend=name)
            try:
                fn = partial(get_ns_backend(name), g, schedule, dtype=dtype)
                record["first_call_s"] = round(first_call_s(fn, device), 3)
                ms = bench_ns.time_ms(fn, device, reps)
                torch_ms = ms if name == "torch" else torch_ms
                record.update(
                    ms=round(ms, 4),
                    tflops=round(bench_ns.tflops(flops, ms), 2),
                    speedup_vs_torch=round(torch_ms / ms, 3) if torch_ms else None,
                )
                if name == "auto":
                    record["picked"] = choose_ns_backend(g, schedule, dtype=dtype)
            except Exception as error:  # noqa: BLE001 - one backend's failure is a record
                record["error"] = f"{type(error).__name__}: {error}"[:500]
            records.append(record)
            print(
                f"{'x'.join(map(str, shape)):>12} {mode:>5} {name:>7} "
                + (
                    f"first {record['first_call_s']:7.2f} s  {record['ms']:9.3f} ms  "
                    f"{record['tflops']:7.1f} TF/s  x{record['speedup_vs_torch'] or 0:.2f}"
                    if "ms" in record
                    else f"FAILED {record['error']}"
                ),
                flush=True,
            )
    torch.backends.cuda.matmul.allow_tf32 = False
    return records


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="outputs/gpu_ns_check")
    parser.add_argument("--device", default="cuda", help="cpu: a check of this script")
    parser.add_argument(
        "--shapes",
        nargs="+",
        type=parse_shape,
        default=check_ns_cuda.LLAMA3_8B_SHAPES,
        help="MxN (default: Llama-3 8B's)",
    )
    parser.add_argument("--reps", type=int, default=10, help="timed runs per case (median)")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing to check", file=sys.stderr)
        return 1
    check_ns_cuda.DEVICE = device.type
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    print(f"{name}, torch {torch.__version__}, triton {triton_version}", flush=True)
    result = {
        "device": name,
        "torch": torch.__version__,
        "triton": triton_version,
        "reps": args.reps,
        "timings": [],
        "checks": [],
    }

    def save() -> int:
        """ns.json as it stands (rewritten after each shape: a timeout keeps what ran)."""
        failures = sum(not r["ok"] for r in result["checks"])
        failures += sum("error" in r for r in result["timings"])
        result["failures"] = failures
        os.makedirs(args.out, exist_ok=True)
        Path(args.out, "ns.json").write_text(json.dumps(result, indent=1))
        return failures

    for shape in args.shapes:
        result["timings"] += time_backends(shape, device, args.reps)
        print(f"{'preset':>14} {'shape':>14} {'mode':>5} {'backend':>7} {'rel.err':>9}  notes")
        try:
            result["checks"] += check_ns_cuda.check_backends("quintic", shape, modes=tuple(MODES))
        except Exception as error:  # noqa: BLE001 - record it, go on with the next shape
            result["checks"].append(
                dict(shape=list(shape), ok=False, error=f"{type(error).__name__}: {error}")
            )
        save()
    square = max((s for s in args.shapes if s[0] == s[1]), default=args.shapes[0])
    try:
        result["checks"].append(check_ns_cuda.check_symmetry(square))
    except Exception as error:  # noqa: BLE001
        result["checks"].append(
            dict(check="sym_gram", ok=False, error=f"{type(error).__name__}: {error}")
        )
    failures = save()
    records = len(result["checks"]) + len(result["timings"])
    print(f"{failures} failure(s) of {records} records; wrote {args.out}/ns.json")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
