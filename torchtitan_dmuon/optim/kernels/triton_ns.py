"""Newton-Schulz with Triton kernels that exploit the symmetry of ``A = X X^T``.

One step ``X <- a X + (b A + c A^2) X`` runs as three kernels:

* :func:`sym_gram`: ``A = X X^T``. Only the blocks on and above the diagonal are computed;
  each is stored twice (at ``(i, j)`` and mirrored at ``(j, i)``), so ``A`` is exactly
  symmetric and costs about half of a general product.
* :func:`sym_poly`: ``b A + c A A^T`` for a symmetric ``A``, the same kernel with a fused
  epilogue; the result is exactly symmetric too.
* :func:`poly_apply`: ``a X + P X``, a general product with a fused epilogue.

Kernels accumulate in fp32 and take any strides, so the transposed view of a tall input
needs no copy. Block sizes are autotuned per shape and dtype on GPU. Under the Triton
interpreter (``TRITON_INTERPRET=1``, read when this module is imported) there is one fixed
configuration, and bf16/fp16 tiles are upcast to fp32 before ``tl.dot``, whose
low-precision result is wrong there. The interpreter also truncates fp32 -> bf16 casts
where GPUs round to nearest, so its bf16 results are a little less accurate.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from torchtitan_dmuon.optim.newton_schulz import EPS, NSSchedule, prepare_ns_input

__all__ = [
    "INTERPRET",
    "SUPPORTED_DTYPES",
    "BlockSizes",
    "poly_apply",
    "sym_gram",
    "sym_poly",
    "torch_fp32_matmul_precision",
    "triton_newton_schulz",
]

# triton.jit reads this knob (TRITON_INTERPRET) when it decorates a kernel, i.e. on import.
INTERPRET: bool = triton.knobs.runtime.interpret
"""Whether the kernels were decorated for the Triton interpreter (CPU tensors allowed)."""

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class BlockSizes:
    """A fixed kernel configuration, bypassing autotuning (tests and benchmarks).

    Attributes:
        m: Rows of an output tile (both sides of a square tile in the symmetric kernels).
        n: Columns of an output tile of :func:`poly_apply`.
        k: Depth of one reduction step.
        num_warps: Warps per program (ignored by the interpreter).
        num_stages: Software-pipelining stages (ignored by the interpreter).
    """

    m: int = 32
    n: int = 32
    k: int = 32
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self) -> None:
        for name in ("m", "n", "k"):
            size = getattr(self, name)
            # tl.dot needs tiles of at least 16 on every side, in powers of two.
            if size < 16 or size & (size - 1):
                raise ValueError(f"BlockSizes.{name} must be a power of two >= 16, got {size}")


def _configs(tiles: list[tuple[int, ...]], names: tuple[str, ...]) -> list[triton.Config]:
    """Autotuning candidates: ``(*block sizes, num_warps, num_stages)`` per tile."""
    return [
        triton.Config(
            dict(zip(names, tile[:-2], strict=True)), num_warps=tile[-2], num_stages=tile[-1]
        )
        for tile in tiles
    ]


# The interpreter cannot autotune over more than one configuration.
if INTERPRET:
    _SYRK_CONFIGS = _configs([(64, 64, 4, 2)], ("BLOCK_M", "BLOCK_K"))
    _GEMM_CONFIGS = _configs([(64, 64, 64, 4, 2)], ("BLOCK_M", "BLOCK_N", "BLOCK_K"))
else:
    # Few candidates: each one is compiled per specialization (dtype, divisibility by 16)
    # and timed per shape. Configurations that do not fit in shared memory are skipped.
    # Shared memory per config on sm_90: benchmarks/triton_sm90.py.
    _SYRK_CONFIGS = _configs(
        [
            (128, 64, 8, 3),
            (128, 64, 4, 4),  # fp32 (TF32) needs 256 KiB, over the H100's 227: skipped there
            (128, 32, 8, 4),
            (64, 64, 4, 4),
        ],
        ("BLOCK_M", "BLOCK_K"),
    )
    _GEMM_CONFIGS = _configs(
        [
            (128, 256, 64, 8, 3),  # fp32 (TF32) needs 288 KiB, over the H100's 227: skipped there
            (128, 128, 64, 8, 3),
            (128, 128, 64, 4, 4),  # fp32 (TF32) needs 256 KiB, over the H100's 227: skipped there
            (64, 128, 64, 4, 4),
        ],
        ("BLOCK_M", "BLOCK_N", "BLOCK_K"),
    )


@triton.jit
def _syrk_kernel(
    x_ptr,
    c_ptr,
    out_ptr,
    M,
    K,
    stride_xb,
    stride_xm,
    stride_xk,
    stride_cb,
    stride_cm,
    stride_cn,
    stride_ob,
    stride_om,
    stride_on,
    alpha,
    beta,
    HAS_C: tl.constexpr,
    UPCAST: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """``out = alpha X X^T (+ beta C)`` for ``X`` (M, K) and symmetric ``C`` (M, M).

    Program ``(pid, batch)`` owns tile ``(i, j) = divmod(pid, tiles)`` and exits if
    ``i > j``; the upper tile is stored at ``(i, j)`` and mirrored at ``(j, i)``.
    """
    tl.static_assert(BLOCK_M >= 16 and BLOCK_K >= 16, "tl.dot needs blocks >= 16")
    tiles = tl.cdiv(M, BLOCK_M)
    pid = tl.program_id(0)
    tile_i = pid // tiles
    tile_j = pid % tiles
    if tile_i > tile_j:
        return
    batch = tl.program_id(1).to(tl.int64)
    x_ptr += batch * stride_xb
    rows = tile_i * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tile_j * BLOCK_M + tl.arange(0, BLOCK_M)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_M), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_in = (k0 + ks) < K
        lhs = tl.load(
            x_ptr + rows[:, None] * stride_xm + (k0 + ks)[None, :] * stride_xk,
            mask=(rows[:, None] < M) & k_in[None, :],
            other=0.0,
        )
        rhs = tl.load(
            x_ptr + cols[:, None] * stride_xm + (k0 + ks)[None, :] * stride_xk,
            mask=(cols[:, None] < M) & k_in[None, :],
            other=0.0,
        )
        if UPCAST:
            lhs = lhs.to(tl.float32)
            rhs = rhs.to(tl.float32)
        acc = tl.dot(lhs, tl.trans(rhs), acc, input_precision=INPUT_PRECISION)
    acc = acc * alpha
    in_bounds = (rows[:, None] < M) & (cols[None, :] < M)
    if HAS_C:
        c_ptr += batch * stride_cb
        c = tl.load(
            c_ptr + rows[:, None] * stride_cm + cols[None, :] * stride_cn, mask=in_bounds, other=0.0
        )
        acc += beta * c.to(tl.float32)
    acc = acc.to(out_ptr.dtype.element_ty)
    out_ptr += batch * stride_ob
    # Entries with row <= col are the computed ones (all of them off the diagonal tile);
    # each goes to (row, col) and, strictly above the diagonal, to (col, row). Storing only
    # the upper half of a diagonal tile keeps A exactly symmetric.
    upper = rows[:, None] <= cols[None, :]
    tl.store(
        out_ptr + rows[:, None] * stride_om + cols[None, :] * stride_on,
        acc,
        mask=in_bounds & upper,
    )
    tl.store(
        out_ptr + cols[None, :] * stride_om + rows[:, None] * stride_on,
        acc,
        mask=in_bounds & (rows[:, None] < cols[None, :]),
    )


@triton.jit
def _gemm_axpy_kernel(
    p_ptr,
    x_ptr,
    out_ptr,
    M,
    N,
    stride_pb,
    stride_pm,
    stride_pk,
    stride_xb,
    stride_xm,
    stride_xn,
    stride_ob,
    stride_om,
    stride_on,
    a,
    UPCAST: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr = 8,
):
    """``out = a X + P X`` for ``P`` (M, M) and ``X`` (M, N)."""
    tl.static_assert(BLOCK_M >= 16 and BLOCK_N >= 16 and BLOCK_K >= 16, "blocks must be >= 16")
    # Grouped order: consecutive programs cover GROUP_M tile rows, column by column, so the
    # tiles of X they share are still in L2.
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    pid = tl.program_id(0)
    group = pid // (GROUP_M * tiles_n)
    first_m = group * GROUP_M
    group_size = tl.minimum(tiles_m - first_m, GROUP_M)
    tile_m = first_m + (pid % (GROUP_M * tiles_n)) % group_size
    tile_n = (pid % (GROUP_M * tiles_n)) // group_size
    batch = tl.program_id(1).to(tl.int64)
    p_ptr += batch * stride_pb
    x_ptr += batch * stride_xb
    rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, M, BLOCK_K):
        k_in = (k0 + ks) < M
        lhs = tl.load(
            p_ptr + rows[:, None] * stride_pm + (k0 + ks)[None, :] * stride_pk,
            mask=(rows[:, None] < M) & k_in[None, :],
            other=0.0,
        )
        rhs = tl.load(
            x_ptr + (k0 + ks)[:, None] * stride_xm + cols[None, :] * stride_xn,
            mask=k_in[:, None] & (cols[None, :] < N),
            other=0.0,
        )
        if UPCAST:
            lhs = lhs.to(tl.float32)
            rhs = rhs.to(tl.float32)
        acc = tl.dot(lhs, rhs, acc, input_precision=INPUT_PRECISION)
    in_bounds = (rows[:, None] < M) & (cols[None, :] < N)
    x = tl.load(
        x_ptr + rows[:, None] * stride_xm + cols[None, :] * stride_xn, mask=in_bounds, other=0.0
    )
    acc += a * x.to(tl.float32)
    out_ptr += batch * stride_ob
    tl.store(
        out_ptr + rows[:, None] * stride_om + cols[None, :] * stride_on,
        acc.to(out_ptr.dtype.element_ty),
        mask=in_bounds,
    )


_syrk_tuned = triton.autotune(configs=_SYRK_CONFIGS, key=["M", "K", "HAS_C"])(_syrk_kernel)
_gemm_tuned = triton.autotune(configs=_GEMM_CONFIGS, key=["M", "N"])(_gemm_axpy_kernel)


def torch_fp32_matmul_precision() -> str:
    """The precision torch's CUDA matmuls give fp32 inputs: ``"tf32"`` or ``"ieee"``.

    Read through the ``fp32_precision`` API: reading the legacy ``allow_tf32`` raises once a
    job has set the new one. The getter already resolves ``"none"`` (unset at the matmul
    level) to the setting inherited from ``torch.backends.fp32_precision``; ``"none"`` at
    every level is torch's default, full fp32.
    """
    return "tf32" if torch.backends.cuda.matmul.fp32_precision == "tf32" else "ieee"


def _kernel_flags(dtype: torch.dtype) -> dict[str, object]:
    """Compile-time flags shared by both kernels for inputs of ``dtype``."""
    if dtype == torch.float32:
        # Follow torch's matmul setting, so fp32 results compare with the torch backend.
        precision = torch_fp32_matmul_precision()
    else:
        precision = None
    upcast = INTERPRET and dtype in (torch.float16, torch.bfloat16)
    return {"UPCAST": upcast, "INPUT_PRECISION": precision}


def _as_batch(t: torch.Tensor) -> torch.Tensor:
    return t if t.ndim == 3 else t.unsqueeze(0)


def _check_operand(t: torch.Tensor, name: str) -> None:
    if t.ndim not in (2, 3):
        raise ValueError(f"{name} must be a 2-D matrix or a 3-D batch, got {t.ndim}-D")
    if t.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{name}: dtype {t.dtype} is not supported; use one of {SUPPORTED_DTYPES}")
    if not t.is_cuda and not INTERPRET:
        raise RuntimeError(
            f"the triton Newton-Schulz backend needs CUDA tensors, got {name} on {t.device}; "
            "set TRITON_INTERPRET=1 before importing torchtitan_dmuon to run its kernels on CPU "
            "(slow, for tests), or use ns_backend='torch'"
        )


def _syrk(
    x: torch.Tensor,
    c: torch.Tensor | None,
    alpha: float,
    beta: float,
    out: torch.Tensor | None,
    blocks: BlockSizes | None,
) -> torch.Tensor:
    _check_operand(x, "x")
    x3 = _as_batch(x)
    batch, m, k = x3.shape
    if out is None:
        out = x.new_empty(*x.shape[:-1], m)
    o3 = _as_batch(out)
    c3 = o3 if c is None else _as_batch(c)  # never read without HAS_C
    args = (x3, c3, o3, m, k, *x3.stride(), *c3.stride(), *o3.stride(), alpha, beta)
    flags = dict(_kernel_flags(x.dtype), HAS_C=c is not None)
    if blocks is None:

        def grid(meta):
            return (triton.cdiv(m, meta["BLOCK_M"]) ** 2, batch)

        _syrk_tuned[grid](*args, **flags)
    else:
        grid = (triton.cdiv(m, blocks.m) ** 2, batch)
        _syrk_kernel[grid](
            *args,
            **flags,
            BLOCK_M=blocks.m,
            BLOCK_K=blocks.k,
            num_warps=blocks.num_warps,
            num_stages=blocks.num_stages,
        )
    return out


def sym_gram(
    x: torch.Tensor, *, out: torch.Tensor | None = None, blocks: BlockSizes | None = None
) -> torch.Tensor:
    """``X X^T`` of a ``(m, k)`` matrix or ``(batch, m, k)`` stack, exactly symmetric.

    Args:
        x: The input, any strides.
        out: Optional ``(..., m, m)`` output buffer of ``x``'s dtype, not overlapping ``x``.
        blocks: Fixed block sizes instead of the autotuned ones.
    """
    return _syrk(x, None, 1.0, 0.0, out, blocks)


def sym_poly(
    a_mat: torch.Tensor,
    b: float,
    c: float,
    *,
    out: torch.Tensor | None = None,
    blocks: BlockSizes | None = None,
) -> torch.Tensor:
    """``b A + c A A^T`` for a symmetric ``A`` (``(m, m)`` or batched), exactly symmetric.

    The epilogue reads ``A`` on and above the diagonal only, so ``A`` must be symmetric;
    ``out`` must not overlap ``A``.
    """
    if a_mat.shape[-1] != a_mat.shape[-2]:
        raise ValueError(f"sym_poly needs square matrices, got {tuple(a_mat.shape)}")
    return _syrk(a_mat, a_mat, c, b, out, blocks)


def poly_apply(
    p: torch.Tensor,
    x: torch.Tensor,
    a: float,
    *,
    out: torch.Tensor | None = None,
    blocks: BlockSizes | None = None,
) -> torch.Tensor:
    """``a X + P X`` for ``P`` ``(m, m)`` and ``X`` ``(m, n)``, or batches of both.

    ``out`` must not overlap ``x``: tiles read all of ``x``'s rows.
    """
    _check_operand(p, "p")
    _check_operand(x, "x")
    p3, x3 = _as_batch(p), _as_batch(x)
    batch, m, n = x3.shape
    if p3.shape != (batch, m, m) or p.dtype != x.dtype:
        raise ValueError(
            f"p must hold one {m} x {m} matrix per matrix of x, in x's dtype {x.dtype}; "
            f"got {tuple(p.shape)} {p.dtype}"
        )
    if out is None:
        out = x.new_empty(x.shape)
    o3 = _as_batch(out)
    args = (p3, x3, o3, m, n, *p3.stride(), *x3.stride(), *o3.stride(), a)
    flags = _kernel_flags(x.dtype)
    if blocks is None:

        def grid(meta):
            return (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]), batch)

        _gemm_tuned[grid](*args, **flags)
    else:
        grid = (triton.cdiv(m, blocks.m) * triton.cdiv(n, blocks.n), batch)
        _gemm_axpy_kernel[grid](
            *args,
            **flags,
            BLOCK_M=blocks.m,
            BLOCK_N=blocks.n,
            BLOCK_K=blocks.k,
            num_warps=blocks.num_warps,
            num_stages=blocks.num_stages,
        )
    return out


def triton_newton_schulz(
    grad: torch.Tensor,
    schedule: NSSchedule,
    *,
    eps: float = EPS,
    dtype: torch.dtype = torch.bfloat16,
    blocks: BlockSizes | None = None,
) -> torch.Tensor:
    """Orthogonalize a matrix, or a batch of same-shape matrices, with the Triton kernels.

    Same contract as :func:`torchtitan_dmuon.optim.newton_schulz.newton_schulz`.

    Args:
        grad: A ``(m, n)`` matrix or a ``(batch, m, n)`` stack on CUDA (or CPU under
            ``TRITON_INTERPRET=1``). Not modified.
        schedule: Coefficients per step and normalization.
        eps: Floor of the normalizing norm.
        dtype: Compute dtype, one of :data:`SUPPORTED_DTYPES`.
        blocks: Fixed block sizes instead of the autotuned ones.

    Returns:
        The orthogonalized tensor, same shape as ``grad``, in ``dtype``.

    Raises:
        RuntimeError: ``grad`` is not on CUDA and the interpreter is off.
        ValueError: unsupported ``dtype`` or rank.
    """
    x, transposed = prepare_ns_input(grad, schedule, eps=eps, dtype=dtype)
    _check_operand(x, "grad")
    rows = x.shape[:-1]
    gram = x.new_empty(*rows, rows[-1])
    poly = torch.empty_like(gram)
    # Ping-pong between two buffers: poly_apply cannot write over the X it reads.
    buffers = (x.new_empty(x.shape), x.new_empty(x.shape))
    for step, (a, b, c) in enumerate(schedule.coefficients):
        sym_gram(x, out=gram, blocks=blocks)
        sym_poly(gram, b, c, out=poly, blocks=blocks)
        x = poly_apply(poly, x, a, out=buffers[step % 2], blocks=blocks)
    return x.mT if transposed else x
