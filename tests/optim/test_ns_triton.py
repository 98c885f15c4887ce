"""Triton Newton-Schulz kernels and the "triton" backend.

Without a GPU the kernels run under the Triton interpreter (see conftest.py), which is slow:
shapes stay small. Shapes are not block multiples, so edge masks are exercised.
"""

import copy

import pytest
import torch

from tests.support.models import batch, loss_fn, make_model, proj_predicate
from torchtitan_dmuon import Muon
from torchtitan_dmuon.optim.newton_schulz import newton_schulz, resolve_ns_schedule
from torchtitan_dmuon.optim.ns_backends import get_ns_backend

triton_ns = pytest.importorskip("torchtitan_dmuon.optim.kernels.triton_ns")

from tests.support.interpreter import interpreter_unsupported  # noqa: E402

pytestmark = pytest.mark.skipif(
    interpreter_unsupported() is not None, reason=str(interpreter_unsupported())
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP32 = dict(rtol=1e-4, atol=1e-5)
SMALL = triton_ns.BlockSizes(m=16, n=16, k=16)


@pytest.fixture(autouse=True)
def _ieee_fp32():
    """fp32 comparisons need full-precision products from torch and from the kernels."""
    if DEVICE == "cpu":
        yield
        return
    saved = torch.backends.cuda.matmul.fp32_precision
    torch.backends.cuda.matmul.fp32_precision = "ieee"
    yield
    torch.backends.cuda.matmul.fp32_precision = saved


def _randn(*shape, seed=0, dtype=torch.float32):
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
    return g.to(device=DEVICE, dtype=dtype)


@pytest.mark.parametrize("shape", [(100, 300), (2, 40, 70)])
@pytest.mark.parametrize("blocks", [None, SMALL], ids=["default", "small"])
def test_sym_gram_exactly_symmetric(shape, blocks):
    x = _randn(*shape)
    a_mat = triton_ns.sym_gram(x, blocks=blocks)
    assert torch.equal(a_mat, a_mat.mT)
    torch.testing.assert_close(a_mat, x @ x.mT, **FP32)


def test_sym_gram_of_transposed_view():
    x = _randn(90, 40)
    torch.testing.assert_close(triton_ns.sym_gram(x.mT), x.mT @ x, **FP32)


@pytest.mark.parametrize("blocks", [None, SMALL], ids=["default", "small"])
def test_sym_poly_exactly_symmetric(blocks):
    x = _randn(2, 70, 90, seed=1) / 10
    a_mat = x @ x.mT
    a_mat = (a_mat + a_mat.mT) / 2  # torch's product is not exactly symmetric
    poly = triton_ns.sym_poly(a_mat, -4.775, 2.0315, blocks=blocks)
    assert torch.equal(poly, poly.mT)
    torch.testing.assert_close(poly, -4.775 * a_mat + 2.0315 * a_mat @ a_mat, **FP32)


@pytest.mark.parametrize("blocks", [None, SMALL], ids=["default", "small"])
def test_poly_apply(blocks):
    p, x = _randn(70, 70, seed=2), _randn(70, 150, seed=3)
    out = triton_ns.poly_apply(p, x, 3.4445, blocks=blocks)
    torch.testing.assert_close(out, 3.4445 * x + p @ x, **FP32)


@pytest.mark.parametrize("preset", ["quintic", "polar_express"])
@pytest.mark.parametrize("shape", [(100, 300), (300, 100), (3, 40, 72), (72, 72)])
def test_matches_torch_backend_fp32(preset, shape):
    g = _randn(*shape, seed=4)
    schedule = resolve_ns_schedule(preset, 5)
    ours = triton_ns.triton_newton_schulz(g, schedule, dtype=torch.float32)
    assert ours.shape == g.shape and ours.dtype == torch.float32
    torch.testing.assert_close(ours, newton_schulz(g, schedule, dtype=torch.float32), **FP32)


@pytest.fixture
def _restore_fp32_precision():
    saved = torch.backends.fp32_precision, torch.backends.cuda.matmul.fp32_precision
    yield
    torch.backends.fp32_precision, torch.backends.cuda.matmul.fp32_precision = saved


@pytest.mark.usefixtures("_restore_fp32_precision")
@pytest.mark.parametrize(
    ("generic", "matmul", "expected"),
    [
        ("none", "none", "ieee"),  # torch's default: full fp32 products
        ("none", "tf32", "tf32"),
        ("none", "ieee", "ieee"),
        ("tf32", "none", "tf32"),  # the matmul setting inherits the generic one
        ("tf32", "ieee", "ieee"),
        ("ieee", "tf32", "tf32"),
    ],
)
def test_fp32_kernels_follow_the_fp32_precision_api(generic, matmul, expected):
    """Once a job sets ``fp32_precision``, torch raises on reads of the legacy ``allow_tf32``;
    the kernels read the new API and take torch's fp32 matmul precision from it."""
    torch.backends.fp32_precision = generic
    torch.backends.cuda.matmul.fp32_precision = matmul
    assert triton_ns.torch_fp32_matmul_precision() == expected
    g = _randn(20, 12, seed=8)
    schedule = resolve_ns_schedule("quintic", 2)
    ours = triton_ns.triton_newton_schulz(g, schedule, dtype=torch.float32, blocks=SMALL)
    # tf32 products round inputs to 10 mantissa bits on a GPU; the interpreter ignores it.
    tol = dict(rtol=1e-2, atol=1e-2) if expected == "tf32" and DEVICE == "cuda" else FP32
    torch.testing.assert_close(ours, newton_schulz(g, schedule, dtype=torch.float32), **tol)


def test_small_blocks_and_per_step_coefficients():
    g = _randn(37, 20, seed=5)
    schedule = resolve_ns_schedule([(3.0, -3.2, 1.2), (2.0, -1.5, 0.5)], 3)
    ours = triton_ns.triton_newton_schulz(g, schedule, dtype=torch.float32, blocks=SMALL)
    torch.testing.assert_close(ours, newton_schulz(g, schedule, dtype=torch.float32), **FP32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_close_to_torch(dtype):
    g = _randn(3, 48, 80, seed=6)
    schedule = resolve_ns_schedule("quintic", 5)
    ours = get_ns_backend("triton")(g, schedule, dtype=dtype)
    assert ours.dtype == dtype and ours.shape == g.shape
    reference = newton_schulz(g, schedule, dtype=torch.float32)
    error = (ours.float() - reference).norm() / reference.norm()
    # torch's bf16 loop is off by 1.5% here. The interpreter truncates fp32 -> bf16 where
    # GPUs round to nearest, which costs it another 0.6%.
    assert error < 2.5e-2


def test_input_is_not_modified():
    g = _randn(40, 24, seed=7, dtype=torch.bfloat16)
    before = g.clone()
    triton_ns.triton_newton_schulz(g, resolve_ns_schedule("quintic", 2))
    assert torch.equal(g, before)


def test_bad_arguments():
    schedule = resolve_ns_schedule("quintic", 1)
    with pytest.raises(ValueError, match="2-D matrix or a 3-D batch"):
        triton_ns.triton_newton_schulz(_randn(8), schedule)
    with pytest.raises(ValueError, match="not supported"):
        triton_ns.triton_newton_schulz(_randn(8, 8), schedule, dtype=torch.float64)
    with pytest.raises(ValueError, match="square"):
        triton_ns.sym_poly(_randn(8, 16), 1.0, 1.0)
    with pytest.raises(ValueError, match="one 8 x 8 matrix"):
        triton_ns.poly_apply(_randn(8, 16), _randn(8, 16), 1.0)
    with pytest.raises(ValueError, match="power of two >= 16"):
        triton_ns.BlockSizes(m=8)
    with pytest.raises(ValueError, match="power of two >= 16"):
        triton_ns.BlockSizes(k=48)


def test_cpu_tensor_needs_the_interpreter(monkeypatch):
    monkeypatch.setattr(triton_ns, "INTERPRET", False)
    with pytest.raises(RuntimeError, match="needs CUDA tensors.*TRITON_INTERPRET=1"):
        triton_ns.triton_newton_schulz(torch.randn(8, 8), resolve_ns_schedule("quintic", 1))


def test_muon_trains_like_torch_backend():
    models = {"torch": make_model()}
    models["triton"] = copy.deepcopy(models["torch"])
    losses = {}
    for name, model in models.items():
        model.to(DEVICE)
        opt = Muon(model, ns_backend=name, ns_dtype=torch.float32, predicate=proj_predicate)
        losses[name] = []
        for step in range(3):
            loss = loss_fn(model, *(t.to(DEVICE) for t in batch(100 + step)))
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses[name].append(loss.item())
    torch.testing.assert_close(losses["triton"], losses["torch"], rtol=1e-4, atol=0)
    for p, q in zip(models["triton"].parameters(), models["torch"].parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6)


def test_muon_refuses_triton_where_it_cannot_run(monkeypatch):
    """Without CUDA (and without the interpreter) ``ns_backend="triton"`` is refused by the
    constructor, naming the flag, instead of failing in the first step on the owners."""
    if torch.cuda.is_available():
        pytest.skip("CUDA runs the kernels")
    monkeypatch.setattr(triton_ns, "INTERPRET", False)
    with pytest.raises(ValueError, match="ns_backend='triton' needs CUDA.*'torch', 'gram'"):
        Muon(make_model(), ns_backend="triton", predicate=proj_predicate)
