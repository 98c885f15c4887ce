"""Correctness of every Newton-Schulz backend on CUDA at realistic sizes.

For each shape, preset, mode (bf16; fp32 with TF32 products) and backend it measures the
relative Frobenius distance from an fp64 torch reference. A backend passes when that
distance is within the mode's tolerance, and the triton one when it is also at most twice
the torch backend's own (Gram Newton-Schulz is less precise in bf16 by design). In bf16
it also checks the preset's singular-value band on the liftable directions (see
tests/test_newton_schulz.py), the exact symmetry of the Triton Gram kernel, and records
which backend ``"auto"`` picked. Writes ``check_ns_cuda.json`` under ``--out``; exits 1 on
any failure. ``--shapes llama3-8b`` checks Llama-3 8B's matrix shapes instead, every mode
(what ``benchmarks/gpu_ns_check.py``, step 1 of ``benchmarks/gpu_lease.sh``, runs).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from torchtitan_dmuon.optim.kernels.triton_ns import sym_gram
from torchtitan_dmuon.optim.newton_schulz import newton_schulz, resolve_ns_schedule
from torchtitan_dmuon.optim.ns_backends import choose_ns_backend, get_ns_backend

SHAPES = [(1024, 1024), (1000, 3000), (4096, 1024), (8, 512, 1536), (2048, 8192)]
PRESETS = {"quintic": SHAPES, "polar_express": [(1000, 3000), (2048, 8192)]}
DEVICE = "cuda"
BACKENDS = ["torch", "triton", "gram", "auto"]
# mode: (dtype, TF32 products, largest relative distance from the fp64 result)
MODES = {"bf16": (torch.bfloat16, False, 5e-2), "tf32": (torch.float32, True, 2e-2)}
# TF32 on the shapes that need their own kernel specializations only (odd sizes, a
# transposed view, a batch): each one costs a compile per autotuning candidate.
TF32_SHAPES = {(1000, 3000), (4096, 1024), (8, 512, 1536)}
BANDS = {"quintic": (0.67, 1.21), "polar_express": (0.85, 1.15)}
BAND_MARGIN = 0.01
LLAMA3_8B_SHAPES = [(4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336)]
"""Llama-3 8B's matrices: wq / wo, wk / wv, w1 / w3 (14336 x 4096) and w2."""
BAND_MAX_SIDE = 2048
"""The singular-value band needs an fp64 SVD of the input: above this short side it is
left out (seconds per matrix on a GPU), unless asked for."""


def first(t: torch.Tensor) -> torch.Tensor:
    """The first matrix of a batch (or the matrix), in fp64."""
    return t.reshape(-1, *t.shape[-2:])[0].double()


def gains(svd, out: torch.Tensor) -> tuple[float, float]:
    """Min and max gain of the input's liftable singular directions (first matrix)."""
    u, s, vh = svd
    gain = torch.diagonal(u.T @ first(out) @ vh.T)[s / s.norm() >= 2e-3]
    return gain.min().item(), gain.max().item()


def check_backends(
    preset: str,
    shape: tuple[int, ...],
    *,
    modes: tuple[str, ...] | None = None,
    bands: bool | None = None,
) -> list[dict]:
    """One record per mode and backend for a random input of ``shape``: ``modes`` (default:
    bf16 everywhere, TF32 on :data:`TF32_SHAPES`), with the bf16 singular-value band where
    ``bands`` (default: a short side of at most :data:`BAND_MAX_SIDE`)."""
    schedule = resolve_ns_schedule(preset, 5)
    g = torch.randn(*shape, device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(0))
    exact = newton_schulz(g.double(), schedule, dtype=torch.float64)
    if bands is None:
        bands = min(shape[-2:]) <= BAND_MAX_SIDE
    svd = torch.linalg.svd(first(g), full_matrices=False) if bands else None
    records = []
    for mode, (dtype, tf32, tol) in MODES.items():
        if modes is not None and mode not in modes:
            continue
        if modes is None and tf32 and shape not in TF32_SHAPES:
            continue
        torch.backends.cuda.matmul.fp32_precision = "tf32" if tf32 else "ieee"
        torch_err = None
        for name in BACKENDS:
            out = get_ns_backend(name)(g, schedule, dtype=dtype)
            err = ((out.double() - exact).norm() / exact.norm()).item()
            torch_err = err if torch_err is None else torch_err  # "torch" runs first
            record = dict(preset=preset, shape=list(shape), mode=mode, backend=name, rel_err=err)
            ok = out.shape == g.shape and out.dtype == dtype and err <= tol
            if name == "triton":
                ok = ok and err <= 2 * torch_err
            if name == "auto":
                record["picked"] = choose_ns_backend(g, schedule, dtype=dtype)
            if mode == "bf16" and svd is not None:
                low, high = BANDS[preset]
                record["gains"] = gains(svd, out)
                ok = ok and low - BAND_MARGIN <= record["gains"][0]
                ok = ok and record["gains"][1] <= high + BAND_MARGIN
            record["ok"] = ok
            records.append(record)
            notes = {k: v for k, v in record.items() if k in ("picked", "gains")}
            print(
                f"{preset:>14} {'x'.join(map(str, shape)):>14} {mode:>5} {name:>7} "
                f"{err:>9.2e}  {'ok' if ok else 'FAIL'} {notes or ''}",
                flush=True,
            )
    torch.backends.cuda.matmul.fp32_precision = "ieee"
    return records


def check_symmetry(shape: tuple[int, ...]) -> dict:
    """The Triton Gram kernel's result is exactly symmetric and close to torch's."""
    x = torch.randn(*shape, device=DEVICE, dtype=torch.bfloat16)
    gram = sym_gram(x)
    symmetric = torch.equal(gram, gram.mT)
    err = ((gram.float() - (x @ x.mT).float()).norm() / gram.float().norm()).item()
    print(f"sym_gram {shape}: exactly symmetric {symmetric}, rel.err {err:.2e}", flush=True)
    return dict(check="sym_gram", shape=list(shape), rel_err=err, ok=symmetric and err < 1e-2)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="outputs/check_ns_cuda")
    parser.add_argument(
        "--shapes",
        choices=["default", "llama3-8b"],
        default="default",
        help="llama3-8b: Llama-3 8B's matrix shapes, quintic, every mode",
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check", file=sys.stderr)
        return 1
    print(f"{'preset':>14} {'shape':>14} {'mode':>5} {'backend':>7} {'rel.err':>9}  notes")
    if args.shapes == "llama3-8b":
        records = [
            r for s in LLAMA3_8B_SHAPES for r in check_backends("quintic", s, modes=tuple(MODES))
        ]
    else:
        records = [
            r
            for preset, shapes in PRESETS.items()
            for s in shapes
            for r in check_backends(preset, s)
        ]
    records += [check_symmetry(shape) for shape in [(4096, 4096), (3, 1000, 3000)]]
    failures = sum(not r["ok"] for r in records)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "check_ns_cuda.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "records": records}, f, indent=1)
    print(f"{failures} failure(s) of {len(records)} checks")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
