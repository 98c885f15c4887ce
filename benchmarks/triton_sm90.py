"""Compile the Triton Newton-Schulz kernels for an H100 (sm_90) without a GPU.

Every autotuning configuration of ``torchtitan_dmuon.optim.kernels.triton_ns`` is compiled
ahead of time for each dtype the kernels are called with, specialized as the JIT would for
``4096 x 4096`` contiguous operands (16-divisible pointers and sizes, unit strides as
constants). The table gives the shared memory each one needs (the autotuner prunes at launch
those above the 227 KiB an H100/H200 block may opt in to), and the registers per thread and
spills read from the cubin with the wheel's ``cuobjdump``: ``REG`` and per-thread local memory
(``STACK + LOCAL``) / 4, what Triton's launcher reports as ``n_regs`` and ``n_spills``.

Run it without ``TRITON_INTERPRET`` (the module then lists one fixed interpreter config)::

    python benchmarks/triton_sm90.py --out /tmp/sm90   # all kernels and dtypes, ~2 min
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget

from torchtitan_dmuon.optim.kernels import triton_ns

TARGET = GPUTarget("cuda", 90, 32)
SHARED_LIMIT = 232448  # bytes: H100/H200 opt-in shared memory per block (227 KiB)
SIZE = 4096

# dtype label -> (pointer element type, INPUT_PRECISION), as _kernel_flags sets it on GPU.
DTYPES = {
    "bf16": ("bf16", None),
    "fp16": ("fp16", None),
    "fp32-tf32": ("fp32", "tf32"),
    "fp32-ieee": ("fp32", "ieee"),
}


def _syrk_args(ty: str, has_c: bool) -> dict[str, object]:
    m = k = SIZE
    ptr = f"*{ty}"
    return dict(
        x_ptr=ptr, c_ptr=ptr, out_ptr=ptr, M=m, K=k,
        stride_xb=m * k, stride_xm=k, stride_xk=1,
        stride_cb=m * m, stride_cm=m, stride_cn=1,
        stride_ob=m * m, stride_om=m, stride_on=1,
        alpha=1.0, beta=0.5, HAS_C=has_c,
    )  # fmt: skip


def _gemm_args(ty: str) -> dict[str, object]:
    m = n = SIZE
    ptr = f"*{ty}"
    return dict(
        p_ptr=ptr, x_ptr=ptr, out_ptr=ptr, M=m, N=n,
        stride_pb=m * m, stride_pm=m, stride_pk=1,
        stride_xb=m * n, stride_xm=n, stride_xn=1,
        stride_ob=m * n, stride_om=n, stride_on=1,
        a=2.0,
    )  # fmt: skip


# Public function -> (kernel, its autotuning configs, example arguments per element type).
KERNELS = {
    "sym_gram": (triton_ns._syrk_kernel, triton_ns._SYRK_CONFIGS, lambda t: _syrk_args(t, False)),
    "sym_poly": (triton_ns._syrk_kernel, triton_ns._SYRK_CONFIGS, lambda t: _syrk_args(t, True)),
    "poly_apply": (triton_ns._gemm_axpy_kernel, triton_ns._GEMM_CONFIGS, _gemm_args),
}


def _source(fn, args: dict[str, object]) -> triton.compiler.ASTSource:
    """``ASTSource`` specialized as ``JITFunction.run`` would for these argument values."""
    signature, constexprs, attrs = {}, {}, {}
    for i, param in enumerate(fn.params):
        value = args.get(param.name, param.default)
        if param.is_constexpr or (type(value) is int and value == 1):
            signature[param.name] = "constexpr"
            constexprs[param.name] = value
            attrs[(i,)] = []
        elif isinstance(value, str):  # pointer, 16-byte aligned
            signature[param.name] = value
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[param.name] = "fp32"
        else:
            signature[param.name] = "i32"
            attrs[(i,)] = [["tt.divisibility", 16]] if value % 16 == 0 else []
    return triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)


def _resources(cubin: bytes) -> tuple[int, int]:
    """``(registers, spills)`` of a cubin's only function, as Triton's launcher reports them.

    The launcher divides the driver's per-thread local memory by 4; Triton kernels use local
    memory only for spilled registers, which ``cuobjdump`` lists as ``STACK``.
    """
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        cmd = [triton.knobs.nvidia.cuobjdump.path, "--dump-resource-usage", f.name]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    regs, stack, local = map(int, re.search(r"REG:(\d+) STACK:(\d+) \S+ LOCAL:(\d+)", out).groups())
    return regs, (stack + local) // 4


def config_name(config: triton.Config) -> str:
    blocks = " ".join(f"{k[len('BLOCK_') :]}={v}" for k, v in config.kwargs.items())
    return f"{blocks} w={config.num_warps} s={config.num_stages}"


def compile_table(
    kernels: tuple[str, ...] = tuple(KERNELS), dtypes: tuple[str, ...] = tuple(DTYPES)
) -> list[dict[str, object]]:
    """One row per kernel x config x dtype: shared memory, fit, registers, spills."""
    if triton_ns.INTERPRET:
        raise RuntimeError("unset TRITON_INTERPRET: the interpreter lists one fixed config")
    rows = []
    for name in kernels:
        fn, configs, make_args = KERNELS[name]
        for dtype in dtypes:
            ty, precision = DTYPES[dtype]
            for config in configs:
                args = dict(make_args(ty), UPCAST=False, INPUT_PRECISION=precision)
                options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
                src = _source(fn, {**args, **config.kwargs})
                kernel = triton.compile(src, target=TARGET, options=options)
                regs, spills = _resources(kernel.asm["cubin"])
                shared = kernel.metadata.shared
                rows.append(
                    dict(
                        kernel=name,
                        config=config_name(config),
                        dtype=dtype,
                        shared=shared,
                        fits=shared <= SHARED_LIMIT,
                        regs=regs,
                        spills=spills,
                    )
                )
    return rows


def markdown(rows: list[dict[str, object]]) -> str:
    lines = [
        "| kernel | config | dtype | shared (B) | fits 227 KiB | regs | spills |",
        "|---|---|---|---:|:---:|---:|---:|",
    ]
    for r in rows:
        fits = "yes" if r["fits"] else "NO"
        lines.append(
            f"| {r['kernel']} | {r['config']} | {r['dtype']} | {r['shared']} | {fits} "
            f"| {r['regs']} | {r['spills']} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kernels", nargs="+", choices=list(KERNELS), default=list(KERNELS))
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    parser.add_argument("--out", help="folder for triton_sm90.md and triton_sm90.json")
    args = parser.parse_args()
    rows = compile_table(tuple(args.kernels), tuple(args.dtypes))
    table = markdown(rows)
    print(table)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "triton_sm90.md"), "w") as f:
            f.write(table + "\n")
        with open(os.path.join(args.out, "triton_sm90.json"), "w") as f:
            json.dump({"target": "sm_90", "shared_limit": SHARED_LIMIT, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
