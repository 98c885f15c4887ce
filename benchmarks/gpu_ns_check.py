"""The ``ns`` step of ``benchmarks/gpu_lease.sh``: the Newton-Schulz backends on a GPU. Run
through the lease's one entry:

    python benchmarks/gpu_lease.py ns --out DIR                         # Llama-3 8B's shapes
    python benchmarks/gpu_lease.py ns --shapes 4096x4096 4096x14336 --reps 5 --out DIR
    python benchmarks/gpu_lease.py ns --suite correctness --out DIR     # odd shapes, presets
    TRITON_INTERPRET=1 python benchmarks/gpu_lease.py ns --device cpu --shapes 64x128 --reps 1

For each shape (default: Llama-3 8B's, :data:`LLAMA3_8B_SHAPES`), in bf16 and in fp32 with
TF32 products (set through torch's one ``fp32_precision`` API, :func:`fp32_products`): the
time of each backend (torch, triton, gram, auto; the median of ``--reps`` runs after one
untimed run, ``bench_ns.time_ms``) and of its first call (Triton compiles and autotunes
there), its speed against torch, and its relative distance from the fp64 result. A backend
passes within the mode's tolerance, the triton one only at most twice torch's own distance
(Gram Newton-Schulz is less precise in bf16 by design), and in bf16 within the preset's
singular-value band on the liftable directions (tests/optim/test_newton_schulz.py); plus the exact
symmetry of the Triton Gram kernel. ``--suite correctness`` checks odd shapes, a batch and
both presets instead, without timing. Writes ``ns.json`` under ``--out``, rewritten after
each shape (a timeout keeps what ran); exits 1 when a check failed.

``--device cpu`` (with ``TRITON_INTERPRET=1``) runs the same code on small shapes, to check
this script without a GPU. Where Triton's interpreter cannot run the kernels (triton 3.6
with numpy 2.4: ``tests/support/interpreter.py``) the Triton cases are recorded as unsupported, not
failed (the GPU compiles them; tests/tools/test_triton_sm90.py compiles them for sm_90 on the CPU).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_ns  # noqa: E402

from tests.support.interpreter import interpreter_unsupported  # noqa: E402
from torchtitan_dmuon.optim.newton_schulz import (  # noqa: E402
    newton_schulz,
    ns_flops,
    resolve_ns_schedule,
)
from torchtitan_dmuon.optim.ns_backends import choose_ns_backend, get_ns_backend  # noqa: E402

BACKENDS = ("torch", "triton", "gram", "auto")
# mode: (dtype, TF32 products, largest relative distance from the fp64 result)
MODES = {"bf16": (torch.bfloat16, False, 5e-2), "tf32": (torch.float32, True, 2e-2)}
LLAMA3_8B_SHAPES = [(4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336)]
"""Llama-3 8B's matrices: wq / wo, wk / wv, w1 / w3 (14336 x 4096) and w2."""
CORRECTNESS = {
    "quintic": [(1024, 1024), (1000, 3000), (4096, 1024), (8, 512, 1536), (2048, 8192)],
    "polar_express": [(1000, 3000), (2048, 8192)],
}
"""``--suite correctness``: odd sizes, a transposed view, a batch; both presets."""
BANDS = {"quintic": (0.67, 1.21), "polar_express": (0.85, 1.15)}
BAND_MARGIN = 0.01
BAND_MAX_SIDE = 2048
"""The singular-value band needs an fp64 SVD of the input: above this short side it is
left out (seconds per matrix on a GPU)."""


def parse_shape(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.lower().split("x"))


@contextlib.contextmanager
def fp32_products(tf32: bool):
    """fp32 matmuls in TF32 (or full fp32) inside, through ``fp32_precision`` alone: once a
    job sets it, reading the legacy ``allow_tf32`` raises (torch 2.13)."""
    saved = torch.backends.cuda.matmul.fp32_precision
    torch.backends.cuda.matmul.fp32_precision = "tf32" if tf32 else "ieee"
    try:
        yield
    finally:
        torch.backends.cuda.matmul.fp32_precision = saved


def first(t: torch.Tensor) -> torch.Tensor:
    """The first matrix of a batch (or the matrix), in fp64."""
    return t.reshape(-1, *t.shape[-2:])[0].double()


def gains(svd, out: torch.Tensor) -> tuple[float, float]:
    """Min and max gain of the input's liftable singular directions (first matrix)."""
    u, s, vh = svd
    gain = torch.diagonal(u.T @ first(out) @ vh.T)[s / s.norm() >= 2e-3]
    return gain.min().item(), gain.max().item()


def check_shape(
    preset: str,
    shape: tuple[int, ...],
    device: torch.device,
    reps: int | None,
    unsupported: str | None,
) -> list[dict]:
    """One record per mode and backend for a random input of ``shape``: its distance from
    the fp64 result and the verdict, and with ``reps`` its times."""
    schedule = resolve_ns_schedule(preset, 5)
    g = torch.randn(*shape, device=device, generator=torch.Generator(device).manual_seed(0))
    exact = newton_schulz(g.double(), schedule, dtype=torch.float64)
    svd = None
    if min(shape[-2:]) <= BAND_MAX_SIDE:
        svd = torch.linalg.svd(first(g), full_matrices=False)
    flops = ns_flops(shape, schedule.steps)
    records = []
    for mode, (dtype, tf32, tol) in MODES.items():
        torch_err = torch_ms = None
        for name in BACKENDS:
            record = dict(preset=preset, shape=list(shape), mode=mode, backend=name)
            records.append(record)
            if name == "triton" and unsupported:
                record.update(ok=None, unsupported=unsupported)
                print(f"{_label(record)} unsupported here: {unsupported}", flush=True)
                continue
            try:
                with fp32_products(tf32):
                    fn = partial(get_ns_backend(name), g, schedule, dtype=dtype)
                    if reps is not None:
                        record["first_call_s"] = round(first_call_s(fn, device), 3)
                        ms = bench_ns.time_ms(fn, device, reps)
                        torch_ms = ms if name == "torch" else torch_ms
                        record.update(
                            ms=round(ms, 4),
                            tflops=round(bench_ns.tflops(flops, ms), 2),
                            speedup_vs_torch=round(torch_ms / ms, 3) if torch_ms else None,
                        )
                    out = fn()
                    if name == "auto":
                        record["picked"] = choose_ns_backend(g, schedule, dtype=dtype)
            except Exception as error:  # noqa: BLE001 - one backend's failure is a record
                record.update(ok=False, error=f"{type(error).__name__}: {error}"[:500])
                print(f"{_label(record)} FAILED {record['error']}", flush=True)
                continue
            err = ((out.double() - exact).norm() / exact.norm()).item()
            torch_err = err if name == "torch" else torch_err
            ok = out.shape == g.shape and out.dtype == dtype and err <= tol
            if name == "triton" and torch_err is not None:
                ok = ok and err <= 2 * torch_err
            if mode == "bf16" and svd is not None:
                low, high = BANDS[preset]
                record["gains"] = gains(svd, out)
                ok = ok and low - BAND_MARGIN <= record["gains"][0]
                ok = ok and record["gains"][1] <= high + BAND_MARGIN
            record.update(rel_err=err, ok=ok)
            timing = (
                f"first {record['first_call_s']:6.2f} s {record['ms']:9.3f} ms "
                f"{record['tflops']:7.1f} TF/s x{record['speedup_vs_torch'] or 0:.2f}  "
                if "ms" in record
                else ""
            )
            notes = {k: v for k, v in record.items() if k in ("picked", "gains")}
            print(
                f"{_label(record)} {timing}rel.err {err:.2e} {'ok' if ok else 'FAIL'} "
                f"{notes or ''}",
                flush=True,
            )
    return records


def _label(record: dict) -> str:
    shape = "x".join(map(str, record["shape"]))
    return f"{record['preset']:>13} {shape:>12} {record['mode']:>5} {record['backend']:>7}"


def first_call_s(fn, device: torch.device) -> float:
    """Seconds of one call, synchronized (the first one: compiles, autotunes, measures)."""
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def check_symmetry(shape: tuple[int, ...], device: torch.device) -> dict:
    """The Triton Gram kernel's result is exactly symmetric and close to torch's."""
    from torchtitan_dmuon.optim.kernels.triton_ns import sym_gram

    x = torch.randn(*shape, device=device, dtype=torch.bfloat16)
    gram = sym_gram(x)
    symmetric = torch.equal(gram, gram.mT)
    err = ((gram.float() - (x @ x.mT).float()).norm() / gram.float().norm()).item()
    print(f"sym_gram {shape}: exactly symmetric {symmetric}, rel.err {err:.2e}", flush=True)
    return dict(check="sym_gram", shape=list(shape), rel_err=err, ok=symmetric and err < 1e-2)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="gpu_lease.py ns", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="outputs/gpu_ns_check")
    parser.add_argument("--device", default="cuda", help="cpu: a check of this script")
    parser.add_argument("--suite", choices=["speed", "correctness"], default="speed")
    parser.add_argument("--shapes", nargs="+", type=parse_shape, help="MxN (default: Llama-3 8B's)")
    parser.add_argument("--reps", type=int, default=10, help="timed runs per case (median)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing to check", file=sys.stderr)
        return 1
    if args.suite == "correctness":
        cases = [(p, s) for p, shapes in CORRECTNESS.items() for s in args.shapes or shapes]
        reps = None
    else:
        cases = [("quintic", s) for s in args.shapes or LLAMA3_8B_SHAPES]
        reps = args.reps
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    unsupported = interpreter_unsupported() if triton_version else "triton is not installed"
    print(f"{name}, torch {torch.__version__}, triton {triton_version}", flush=True)
    result = {
        "device": name,
        "torch": torch.__version__,
        "triton": triton_version,
        "suite": args.suite,
        "reps": reps,
        "triton_unsupported": unsupported,
        "records": [],
    }

    def save() -> int:
        """ns.json as it stands (a timeout keeps what ran)."""
        result["failures"] = sum(r["ok"] is False for r in result["records"])
        result["unsupported"] = sum(r["ok"] is None for r in result["records"])
        os.makedirs(args.out, exist_ok=True)
        Path(args.out, "ns.json").write_text(json.dumps(result, indent=1))
        return result["failures"]

    for preset, shape in cases:
        result["records"] += check_shape(preset, shape, device, reps, unsupported)
        save()
    if unsupported is None:
        square = max((s for _, s in cases if s[0] == s[1]), default=cases[0][1])
        try:
            result["records"].append(check_symmetry(square, device))
        except Exception as error:  # noqa: BLE001
            result["records"].append(
                dict(check="sym_gram", ok=False, error=f"{type(error).__name__}: {error}")
            )
    failures = save()
    print(
        f"{failures} failure(s), {result['unsupported']} unsupported of "
        f"{len(result['records'])} records; wrote {args.out}/ns.json"
    )
    return 1 if failures else 0
