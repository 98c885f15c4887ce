"""``ns_backend="auto"`` and ``ns_dtype="auto"``: measured choices, cached on disk, agreed
by every rank of a job."""

import copy
import json
import logging
import os
from pathlib import Path

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from tests.support.dist import run_distributed
from tests.support.interpreter import interpreter_unsupported
from tests.support.models import TokenModel, batch, loss_fn, make_model, proj_predicate
from tests.support.ns_verdict import other_verdict
from tests.support.workers import ADAMW_KW, REFERENCE_ADAMW_KW, as_muon_adamw_kwargs
from torchtitan_dmuon import Muon, MuonConfig, dedicate_params
from torchtitan_dmuon.optim import muon, ns_backends, ns_cache, ns_choice
from torchtitan_dmuon.optim.newton_schulz import newton_schulz, resolve_ns_schedule
from torchtitan_dmuon.optim.ns_backends import (
    AUTO_MIN_SIDE_CPU,
    choose_ns_backend,
    get_ns_backend,
    pick_backend,
    timings_for,
)

SCHEDULE = resolve_ns_schedule("quintic", 5)


@pytest.fixture(autouse=True)
def _fresh_choices(monkeypatch):
    """No choice made before the test is seen by it, none made in it outlives it: no
    backend picked, the dtype probe to run again (conftest gives it an empty cache)."""
    monkeypatch.setattr(ns_backends, "_auto_choices", {})
    monkeypatch.setattr(ns_choice, "_logged", set())  # each test sees its own log lines
    ns_choice._probed_ns_dtype.cache_clear()
    yield
    ns_choice._probed_ns_dtype.cache_clear()


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_auto_keeps_torch_for_small_matrices_and_other_dtypes():
    small = _randn(AUTO_MIN_SIDE_CPU - 1, 4 * AUTO_MIN_SIDE_CPU, seed=1)
    assert choose_ns_backend(small, SCHEDULE, dtype=torch.float32) == "torch"
    assert torch.equal(
        get_ns_backend("auto")(small, SCHEDULE, dtype=torch.float32),
        newton_schulz(small, SCHEDULE, dtype=torch.float32),
    )
    wide = _randn(AUTO_MIN_SIDE_CPU, 4 * AUTO_MIN_SIDE_CPU, seed=2)
    assert choose_ns_backend(wide, SCHEDULE, dtype=torch.float64) == "torch"
    assert ns_backends._auto_choices == {}


@pytest.mark.parametrize("shape", [(96, 384), (384, 96), (2, 64, 256)])
def test_auto_on_cpu_measures_once_and_returns_its_pick(shape, caplog):
    """Without an agreed pick, "auto" times torch against gram in this process, logs and
    keeps the pick per matrix shape, and returns the picked backend's result exactly."""
    g = _randn(*shape, seed=3)
    with caplog.at_level(logging.INFO, logger=ns_backends.__name__):
        out = get_ns_backend("auto")(g, SCHEDULE, dtype=torch.float32)
        again = get_ns_backend("auto")(g, SCHEDULE, dtype=torch.float32)
    picks = [r for r in caplog.records if "picked" in r.getMessage()]
    assert len(picks) == 1 and "in this process" in picks[0].getMessage()
    (key,) = ns_backends._auto_choices
    picked = ns_backends._auto_choices[key]
    assert picked in ("torch", "gram")
    assert key == ("cpu", tuple(shape[-2:]), torch.float32, SCHEDULE, 1e-7)
    expected = get_ns_backend(picked)(g, SCHEDULE, dtype=torch.float32)
    assert torch.equal(out, expected) and torch.equal(again, expected)
    reference = newton_schulz(g, SCHEDULE, dtype=torch.float32)
    assert ((out - reference).norm() / reference.norm()).item() < 1e-4


def _fake_timings(monkeypatch, timings, broken=None):
    """Make each backend's timing ``timings[name]`` and ``broken``'s result wrong."""
    last = []

    def tracked(name, real):
        def backend(grad, *args, **kwargs):
            last.append(name)
            out = real(grad, *args, **kwargs)
            return torch.zeros_like(out) if name == broken else out

        return backend

    for name in timings:
        monkeypatch.setitem(
            ns_backends.NS_BACKENDS, name, tracked(name, ns_backends.NS_BACKENDS[name])
        )
    monkeypatch.setattr(ns_backends, "_elapsed_ms", lambda fn, device: (fn(), timings[last[-1]])[1])


@pytest.mark.parametrize(
    "timings, broken, expected",
    [
        ({"torch": 10.0, "triton": 6.0, "gram": 5.0}, None, "gram"),
        ({"torch": 10.0, "triton": 6.0, "gram": 5.0}, "gram", "triton"),
        ({"torch": 10.0, "triton": 9.8, "gram": 12.0}, None, "torch"),  # within the margin
    ],
)
@pytest.mark.skipif(interpreter_unsupported() is not None, reason=str(interpreter_unsupported()))
def test_auto_picks_the_fastest_correct_backend(monkeypatch, timings, broken, expected):
    """The selection logic, as on CUDA (triton and gram candidates), with fake timings: a
    backend whose result is wrong is not among the measured ones."""
    _fake_timings(monkeypatch, timings, broken)
    monkeypatch.setattr(ns_backends, "_candidates", lambda device: ("triton", "gram"))
    schedule = resolve_ns_schedule("quintic", 2)
    measured = ns_backends.measure_backends(
        (24, 40), schedule, eps=1e-7, dtype=torch.float32, device=torch.device("cpu")
    )
    assert set(measured) == set(timings) - {broken}
    assert pick_backend([(1, measured)]) == expected


@pytest.mark.parametrize(
    "timings, expected",
    [({"torch": 10.0, "gram": 5.0}, "gram"), ({"torch": 5.0, "gram": 10.0}, "torch")],
)
def test_auto_on_cpu_times_gram_against_torch(monkeypatch, timings, expected):
    _fake_timings(monkeypatch, timings)
    g = _randn(AUTO_MIN_SIDE_CPU, 4 * AUTO_MIN_SIDE_CPU, seed=4)
    assert choose_ns_backend(g, SCHEDULE, dtype=torch.float32) == expected


def test_pick_merges_every_rank_by_work():
    """Costs are matrices x ms summed over the ranks, over the backends every rank could
    run; ties and near-ties stay on torch; the merge is independent of rank order."""
    fast_gram = {"torch": 10.0, "gram": 5.0}
    fast_torch = {"torch": 5.0, "gram": 15.0}
    assert pick_backend([(1, fast_gram), (1, fast_torch)]) == "torch"  # 15 vs 20
    assert pick_backend([(4, fast_gram), (1, fast_torch)]) == "gram"  # 45 vs 35
    assert pick_backend([(1, fast_torch), (4, fast_gram)]) == "gram"
    assert pick_backend([(1, {"torch": 10.0}), (1, fast_gram)]) == "torch"  # gram failed on one
    assert pick_backend([(1, {"torch": 10.0, "gram": 9.8})]) == "torch"


def test_timings_are_cached_on_disk_and_a_second_call_measures_nothing(monkeypatch, tmp_path):
    calls = []
    real = ns_backends.measure_backends
    monkeypatch.setattr(
        ns_backends, "measure_backends", lambda *a, **k: (calls.append(a[0]), real(*a, **k))[1]
    )
    shapes = [(64, 64), (64, 192)]
    cpu = torch.device("cpu")
    first, measured = timings_for(shapes, SCHEDULE, eps=1e-7, dtype=torch.float32, device=cpu)
    assert measured == 2 and calls == shapes
    second, measured = timings_for(shapes, SCHEDULE, eps=1e-7, dtype=torch.float32, device=cpu)
    assert measured == 0 and calls == shapes and second == first
    path = ns_cache.cache_path()
    assert path.parent == Path(os.environ["TORCHTITAN_DMUON_CACHE_DIR"])
    key = ns_cache.timing_key(ns_cache.device_key(cpu), (64, 192), torch.float32, SCHEDULE, 1e-7)
    assert torch.__version__ in key and torch.backends.cpu.get_cpu_capability() in key
    assert ns_cache.load_timings()[key] == first[(64, 192)]
    # Other steps or another dtype are other entries: measured again.
    _, measured = timings_for(shapes[:1], SCHEDULE, eps=1e-7, dtype=torch.bfloat16, device=cpu)
    assert measured == 1
    path.write_text("{not json")  # a corrupt cache is an empty one
    _, measured = timings_for(shapes[:1], SCHEDULE, eps=1e-7, dtype=torch.float32, device=cpu)
    assert measured == 1


def test_timings_of_other_coefficients_eps_or_triton_are_other_entries(monkeypatch):
    """An entry holds the backends whose result passed the check for its coefficients
    and eps (Gram NS in bf16 passes for quintic and is off by ~0.05 for polar_express on
    the same shapes): a job with other coefficients, another eps or another Triton
    measures (and checks) again; so do the in-process picks."""
    cpu, shapes = torch.device("cpu"), [(64, 64)]
    polar = resolve_ns_schedule("polar_express", 5)

    def measured(schedule, eps=1e-7):
        return timings_for(shapes, schedule, eps=eps, dtype=torch.float32, device=cpu)[1]

    assert measured(SCHEDULE) == 1 and measured(SCHEDULE) == 0
    assert measured(polar) == 1 and measured(polar) == 0
    assert measured(SCHEDULE, eps=1e-6) == 1
    monkeypatch.setattr(ns_cache, "_triton_version", lambda: "0.0-other")
    assert measured(SCHEDULE) == 1
    assert len(ns_cache.load_timings()) == 4
    quintic_key = ns_backends.auto_key(cpu, (64, 64), torch.float32, SCHEDULE, 1e-7)
    assert quintic_key != ns_backends.auto_key(cpu, (64, 64), torch.float32, polar, 1e-7)


@pytest.mark.parametrize(
    "entry",
    [{"gram": 1.0}, {"torch": None}, {"torch": -1.0}, {"torch": float("nan")}, "1.0", [1.0]],
    ids=["no-torch", "null", "negative", "nan", "string", "list"],
)
def test_a_malformed_entry_is_measured_again_with_a_warning(entry, caplog):
    """An entry that is not every backend's milliseconds, torch's among them, is not a
    timing: it is dropped with a warning and measured again (it raised KeyError or
    TypeError while the optimizer was built)."""
    cpu, shape = torch.device("cpu"), (64, 192)
    key = ns_cache.timing_key(ns_cache.device_key(cpu), shape, torch.float32, SCHEDULE, 1e-7)
    good = ns_cache.timing_key(ns_cache.device_key(cpu), (64, 64), torch.float32, SCHEDULE, 1e-7)
    ns_cache.cache_path().parent.mkdir(parents=True, exist_ok=True)
    ns_cache.cache_path().write_text(
        json.dumps({key: entry, good: {"torch": 2.0, "gram": 1.0}}, allow_nan=True)
    )
    with caplog.at_level(logging.WARNING, logger=ns_cache.__name__):
        timings, measured = timings_for(
            [shape, (64, 64)], SCHEDULE, eps=1e-7, dtype=torch.float32, device=cpu
        )
    assert measured == 1 and timings[(64, 64)] == {"torch": 2.0, "gram": 1.0}
    assert "torch" in timings[shape] and all(v > 0 for v in timings[shape].values())
    assert f"ignoring the malformed timing cache entry {key!r}" in caplog.text
    assert ns_cache.load_timings()[key] == timings[shape]  # rewritten


@pytest.mark.parametrize("order", ["first", "second"])
def test_each_test_has_an_empty_cache_of_its_own(order):
    """Whatever ran before (the other parametrization writes an entry) or the user keeps in
    their own cache, a test starts from an empty timing cache outside the user's home."""
    path = ns_cache.cache_path()
    assert not path.exists() and ns_cache.load_timings() == {}
    assert not path.is_relative_to(Path.home() / ".cache")
    timings_for([(64, 64)], SCHEDULE, eps=1e-7, dtype=torch.float32, device=torch.device("cpu"))
    assert len(ns_cache.load_timings()) == 1


def test_auto_dtype_is_fp32_without_native_bf16(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.delenv(ns_choice.VERDICT_ENV, raising=False)  # the probe itself
    monkeypatch.setattr(ns_choice, "_native_cpu_bf16", lambda: False)
    verdict = ns_choice.local_ns_dtype(cpu)
    assert verdict.dtype == torch.float32 and "no native bf16" in verdict.reason
    assert torch.backends.cpu.get_cpu_capability() in verdict.reason
    # With bf16 instructions the probe decides: bf16 only if it is clearly faster (a near
    # tie, which timing noise could flip from run to run, stays fp32).
    monkeypatch.setattr(ns_choice, "_native_cpu_bf16", lambda: True)
    for bf16_ms, expected in ((1.0, torch.bfloat16), (1.9, torch.float32), (9.0, torch.float32)):
        ns_choice._probed_ns_dtype.cache_clear()
        timings = {torch.bfloat16: bf16_ms, torch.float32: 2.0}
        monkeypatch.setattr(ns_choice, "_matmul_ms", lambda dtype, device, t=timings: t[dtype])
        assert ns_choice.local_ns_dtype(cpu).dtype == expected
    # Probed once per process: a second call measures nothing.
    monkeypatch.setattr(ns_choice, "_matmul_ms", lambda dtype, device: pytest.fail("probed again"))
    assert ns_choice.local_ns_dtype(cpu).dtype == torch.float32


def test_the_dtype_probe_leaves_the_global_rng_alone(monkeypatch):
    """Whether "auto" probes or the switch skips it, a model initialized after the
    optimizer's verdict starts from the same random numbers."""
    monkeypatch.delenv(ns_choice.VERDICT_ENV, raising=False)
    monkeypatch.setattr(ns_choice, "_native_cpu_bf16", lambda: True)  # probe on any CPU
    torch.manual_seed(7)
    ns_choice.local_ns_dtype(torch.device("cpu"))
    after_probe = torch.randn(4)
    torch.manual_seed(7)
    assert torch.equal(after_probe, torch.randn(4))


@pytest.mark.parametrize("forced", ["bfloat16", "float32"])
def test_verdict_switch_takes_the_other_kind_of_machines_verdict(monkeypatch, forced, caplog):
    """TORCHTITAN_DMUON_AUTO_NS_DTYPE is "auto"'s verdict, whatever this CPU would pick,
    named in the log line; a bad value is refused, naming the variable, when Muon is
    built (before any collective: the local verdict comes first)."""
    monkeypatch.setenv(ns_choice.VERDICT_ENV, forced)
    monkeypatch.setattr(ns_choice, "_matmul_ms", lambda dtype, device: pytest.fail("probed"))
    model = make_model()
    with caplog.at_level(logging.INFO, logger=ns_choice.__name__):
        chosen = Muon(model, predicate=proj_predicate).ns
    assert chosen.dtype == getattr(torch, forced)
    assert f"{ns_choice.VERDICT_ENV}={forced}" in chosen.dtype_reason
    assert ns_cache.cpu_description() in chosen.dtype_reason
    assert f"{ns_choice.VERDICT_ENV}={forced}" in caplog.text
    other = {"bfloat16": "float32", "float32": "bfloat16"}[forced]
    assert other_verdict(torch.device("cpu")) == other
    monkeypatch.setenv(ns_choice.VERDICT_ENV, "bf16")
    with pytest.raises(ValueError, match=f"{ns_choice.VERDICT_ENV} must be one of"):
        Muon(model, predicate=proj_predicate)


@pytest.mark.ns_verdict
def test_muon_names_a_dtype_or_takes_the_local_verdict():
    """A named dtype is used as named; "auto" takes this process's verdict (the probe's, or
    the switch's), one per process: the reason is the same line, not a second probe's."""
    model = make_model()
    assert Muon(model, ns_dtype=torch.bfloat16).ns.dtype == torch.bfloat16
    assert Muon(model, ns_dtype="float32").ns.dtype == torch.float32
    chosen = Muon(model).ns
    local = ns_choice.local_ns_dtype(torch.device("cpu"))
    assert (chosen.dtype, chosen.dtype_reason) == (local.dtype, local.reason)
    assert chosen.dtype_reason.startswith(ns_cache.cpu_description())
    with pytest.raises(ValueError, match="ns_dtype must be one of"):
        Muon(model, ns_dtype="int8")


# ---- agreement over ranks ----------------------------------------------------------------
DISAGREEING = [{"torch": 10.0, "gram": 5.0}, {"torch": 5.0, "gram": 15.0}]
"""Fake timings: even ranks find gram twice as fast, odd ranks torch three times."""


def _record_backends(used: set):
    for name in ("torch", "gram"):
        real = ns_backends.NS_BACKENDS[name]

        def backend(grad, *args, _name=name, _real=real, **kwargs):
            used.add((tuple(grad.shape[-2:]), _name))
            return _real(grad, *args, **kwargs)

        ns_backends.NS_BACKENDS[name] = backend


def disagreeing_worker(rank, world, cache_dir, layout):
    """``ns_backend="auto"`` with rank-dependent fake timings: the backends each rank then
    runs per shape, and what it measured."""
    os.environ["TORCHTITAN_DMUON_CACHE_DIR"] = f"{cache_dir}/rank{rank}"
    fake = DISAGREEING[rank % 2]
    ns_backends.measure_backends = lambda shape, *a, **k: dict(fake)
    used: set = set()
    _record_backends(used)
    if layout == "tp":
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        torch.manual_seed(0)
        model = TokenModel(64, dim=64)
        for block in model.layers:
            parallelize_module(
                block, mesh["tp"], {"up_proj": ColwiseParallel(), "down_proj": RowwiseParallel()}
            )
        dedicate_params(model, mesh["dp"], proj_predicate)
        dp, dp_size = mesh["dp"].get_local_rank(), world // 2
    else:
        mesh = init_device_mesh("cpu", (world,))
        model = make_model(dim=64, hidden=128, layers=2)
        dedicate_params(model, mesh, proj_predicate)
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        dp, dp_size = rank, world
    opt = Muon(model, ns_backend="auto", ns_dtype=torch.float32)
    for step in range(2):
        inputs, targets = batch(100 + step, 2 * dp_size)
        opt.zero_grad()
        loss_fn(model, inputs[2 * dp : 2 * dp + 2], targets[2 * dp : 2 * dp + 2]).backward()
        opt.step()
    return {"used": used, "picks": opt.ns.backend_report.picks}


@pytest.mark.parametrize("world, layout", [(2, "fsdp"), (4, "fsdp"), (4, "tp")])
def test_ranks_with_disagreeing_timings_run_one_backend_per_shape(tmp_path, world, layout):
    """Each rank measures otherwise (even ranks: gram faster, odd ranks: torch), yet every
    rank installs the same picks and every shape runs one backend on all ranks; under
    TP 2 the two TP ranks of an owner column orthogonalize one gathered matrix each, with
    the same backend."""
    by_rank = run_distributed(disagreeing_worker, world, str(tmp_path), layout, timeout=240)
    picks = by_rank[0]["picks"]
    assert picks and all(r["picks"] == picks for r in by_rank)
    backends = {}
    for r in by_rank:
        for shape, name in r["used"]:
            backends.setdefault(shape, set()).add(name)
    assert backends and all(len(names) == 1 for names in backends.values()), backends
    assert {shape: names.pop() for shape, names in backends.items()} == {
        shape: picks[shape] for shape in backends
    }
    # The test means something: some shape ran on an even and an odd rank, which would
    # each have picked otherwise alone.
    runs = {
        shape: {i % 2 for i, r in enumerate(by_rank) if shape in dict(r["used"])}
        for shape in backends
    }
    assert any(parities == {0, 1} for parities in runs.values()), runs


def _fixed_timings(shape, *args, **kwargs):
    """Timings that do not vary from run to run: gram faster on wide matrices only."""
    return {"torch": 10.0, "gram": 5.0 if shape[-1] > shape[-2] else 20.0}


def cached_worker(rank, world, cache_dir):
    os.environ["TORCHTITAN_DMUON_CACHE_DIR"] = cache_dir
    # Ranks that own same-shape batches write one cache entry, the last writer's: with real
    # timings a near tie could pick otherwise in the second job, which is right.
    ns_backends.measure_backends = _fixed_timings
    mesh = init_device_mesh("cpu", (world,))
    reports = []
    for _ in range(2):
        ns_backends._auto_choices.clear()
        model = make_model(dim=64, hidden=128, layers=2)
        dedicate_params(model, mesh, proj_predicate)
        reports.append(Muon(model, ns_backend="auto", ns_dtype=torch.float32).ns.backend_report)
    return reports


def test_a_second_job_reads_the_cache_and_measures_nothing(tmp_path):
    """The first job's ranks measure their shapes (each the ones it owns) and save the
    timings; a second job on the same machine reads them all and measures nothing."""
    by_rank = run_distributed(cached_worker, 2, str(tmp_path), timeout=240)
    first, second = zip(*by_rank, strict=True)
    assert sum(r.measured for r in first) >= 3  # 64x64, 128x64, 64x128 among the ranks
    assert all(r.measured == 0 and r.cached > 0 for r in second)
    assert all(r.picks == first[0].picks for r in first + second)
    assert set(first[0].picks.values()) == {"torch", "gram"}


def uneven_parts_worker(rank, world):
    """Pipeline-like: on a (pp 2, dp 2) mesh, the ranks of pp row 0 build two dedicated
    parts, those of row 1 one (a stage that holds only embeddings has none); each part
    dedicated over its row's dp mesh, with both choices on "auto"."""
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("pp", "dp"))
    row, dp = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    picks = []
    for part in range(2 if row == 0 else 1):
        model = make_model(seed=part, dim=64, hidden=128, layers=1)
        dedicate_params(model, mesh["dp"], proj_predicate)
        opt = Muon(model, ns_backend="auto")
        inputs, targets = batch(100 + part, 4)
        loss_fn(model, inputs[2 * dp : 2 * dp + 2], targets[2 * dp : 2 * dp + 2]).backward()
        opt.step()
        picks.append((opt.ns.backend_report.picks, opt.ns.dtype))
    return row, picks


def test_ranks_with_more_dedicated_parts_than_others_agree_within_each_dedication():
    """Each dedication agrees over its own ranks only, so a rank that builds more dedicated
    parts than the ranks of another pipeline row neither hangs nor mixes their timings;
    the two ranks of each row hold the same picks and dtype for each of their parts."""
    by_rank = run_distributed(uneven_parts_worker, 4, timeout=120)
    rows = {}
    for row, picks in by_rank:
        rows.setdefault(row, []).append(picks)
    for row, members in rows.items():
        assert len(members) == 2 and members[0] == members[1], (row, members)
        assert len(members[0]) == (2 if row == 0 else 1)


def test_each_shape_is_timed_as_the_batch_it_runs(monkeypatch):
    """A batch of same-shape matrices times unlike one matrix (on CPU, batched gram lost
    to torch on 12 x 256x256 while gram won on one): each shape is timed as the whole
    batch this rank orthogonalizes per step."""
    measured = []
    monkeypatch.setattr(
        ns_backends,
        "measure_backends",
        lambda shape, *a, **k: (measured.append(tuple(shape)), {"torch": 2.0, "gram": 1.0})[1],
    )
    workload = {(64, 64): [1, 1, 1], (64, 128): [1], (8, 8): [5]}  # 8x8: too small to measure
    config = MuonConfig(ns_backend="auto", ns_dtype="float32")
    report = ns_choice.choose_ns(config, torch.device("cpu"), lambda dtype: workload).backend_report
    assert sorted(measured) == [(3, 64, 64), (64, 128)]
    assert report.picks == {(64, 64): "gram", (64, 128): "gram"} and report.measured == 2
    assert choose_ns_backend(_randn(3, 64, 64), SCHEDULE, dtype=torch.float32) == "gram"


def test_auto_times_exactly_the_capped_batches_the_step_runs(monkeypatch):
    """Batches are capped at ``NS_BATCH_ELEMENTS``: ``"auto"`` times the batches the step
    runs (never the whole owned batch of a shape, which no step runs and which would be
    allocated at start), and the step runs only batch shapes ``"auto"`` timed."""
    rows, cols = 64, 96
    matrix = rows * cols
    monkeypatch.setattr(muon, "NS_BATCH_ELEMENTS", 2 * matrix + 1)
    measured = []
    monkeypatch.setattr(
        ns_backends,
        "measure_backends",
        lambda shape, *a, **k: (measured.append(tuple(shape)), {"torch": 2.0, "gram": 1.0})[1],
    )
    model = torch.nn.Module()
    # One (rows, cols) bucket in this order: 2 + 1 matrices, a 3-stack (alone: a stack is
    # never split), 2 + 1; and one (cols, rows) matrix.
    shapes = {"a0": (rows, cols), "a1": (rows, cols), "a2": (rows, cols), "stack": (3, rows, cols)}
    shapes |= {"b0": (rows, cols), "b1": (rows, cols), "b2": (rows, cols), "t": (cols, rows)}
    for i, (name, shape) in enumerate(shapes.items()):
        model.register_parameter(name, torch.nn.Parameter(_randn(*shape, seed=i)))
    ran = []
    real_choose = ns_backends.choose_ns_backend

    def recording_choose(grad, *args, **kwargs):
        ran.append(tuple(grad.shape))
        return real_choose(grad, *args, **kwargs)

    monkeypatch.setattr(ns_backends, "choose_ns_backend", recording_choose)
    opt = Muon(model, ns_backend="auto", ns_dtype="float32", predicate=lambda n, p: True)
    expected = [(2, rows, cols), (rows, cols), (3, rows, cols), (2, rows, cols), (rows, cols)]
    expected.append((cols, rows))
    assert sorted(measured) == sorted(set(expected))
    # The largest transient "auto" allocates: one capped batch, or one stack alone.
    assert max(torch.Size(s).numel() for s in measured) == 3 * matrix
    for i, p in enumerate(model.parameters()):
        p.grad = _randn(*p.shape, seed=100 + i)
    opt.step()
    assert sorted(ran) == sorted(expected)
    assert opt.ns.backend_report.measured == 4 and opt.ns.backend_report.cached == 0


@pytest.mark.parametrize(
    "alone_ms, other_rank, expected",
    [
        (3.0, None, {(64, 96)}),  # alone 3 ms a matrix against 4 batched
        (3.95, None, set()),  # within the margin: batched
        (5.0, None, set()),
        (3.0, (12.0, 24.0), set()),  # a peer with more matrices finds batching faster
        (3.0, (12.0, 9.0), {(64, 96)}),
    ],
)
def test_cpu_batching_is_measured_per_cache_sized_shape_and_agreed(
    monkeypatch, alone_ms, other_rank, expected, caplog
):
    """On CPU a shape whose parameters the step batches runs one at a time where one
    matrix costs clearly less than a matrix of a short batch, summed over the ranks (each
    rank's cost weighted by the matrices it would batch); shapes too small to time, too
    large to sit in a core's cache, or never batched are not measured and stay batched."""
    measured = []

    def batching_ms(ns, shape, device):
        measured.append(shape)
        return 4.0, alone_ms

    monkeypatch.setattr(ns_choice, "batching_ms", batching_ms)
    big = (512, 1024)  # 512K elements: beyond the cache-sized cap
    workload = {(64, 96): [1, 2, 1], (96, 64): [1], (8, 8): [1, 1], big: [1, 1]}
    gathered = []

    def gather(mine):
        gathered.append(mine)
        others = [{(64, 96): other_rank}] if other_rank is not None else []
        return [mine, *others]

    config = MuonConfig(ns_dtype="float32")
    with caplog.at_level(logging.INFO, logger=ns_choice.__name__):
        choice = ns_choice.choose_ns(config, torch.device("cpu"), lambda dtype: workload, gather)
    assert measured == [(4, 64, 96)]
    assert gathered == [{(64, 96): (4 * 4.0, 4 * alone_ms)}]  # 4 matrices batched together
    assert choice.unbatched == expected
    (line,) = [r.getMessage() for r in caplog.records if "batching" in r.getMessage()]
    assert ("unbatched" in line) == bool(expected)
    assert f"over {1 if other_rank is None else 2} rank(s)" in line


def test_batching_is_timed_both_ways_on_the_same_matrices():
    """The probe runs the stack batched and its matrices one at a time, per matrix."""
    calls = []

    def ns(x):
        calls.append(tuple(x.shape))
        return x

    batched_ms, alone_ms = ns_choice.batching_ms(ns, (3, 64, 96), torch.device("cpu"))
    assert batched_ms > 0 and alone_ms > 0
    rounds = 1 + ns_choice._BATCHING_REPEATS
    assert calls == rounds * [(3, 64, 96), (64, 96), (64, 96), (64, 96)]


def test_no_measurement_or_gather_off_the_cpu(monkeypatch):
    """Elsewhere batching saves kernel launches: nothing is timed and no rank gathers."""
    monkeypatch.setattr(ns_choice, "batching_ms", lambda *a, **k: pytest.fail("timed"))
    choice = ns_choice.choose_ns(
        MuonConfig(ns_dtype="float32"),
        torch.device("meta"),
        lambda dtype: {(64, 96): [1, 1]},
        lambda mine: pytest.fail("gathered"),
    )
    assert choice.unbatched == frozenset()


def test_unbatched_shapes_step_one_matrix_at_a_time_bit_equal_to_torch_muon(monkeypatch):
    """Where one at a time was measured faster, each parameter of the shape runs its own
    Newton-Schulz (the calls torch.optim.Muon makes), and the training is bit-equal to
    torch.optim.Muon + AdamW; the equality tests of the batched road use matrices too small
    to measure."""
    monkeypatch.setattr(ns_choice, "batching_ms", lambda *a, **k: (100.0, 1.0))
    calls = []
    real = ns_backends.NS_BACKENDS["torch"]

    def recording(grad, *args, **kwargs):
        calls.append(tuple(grad.shape))
        return real(grad, *args, **kwargs)

    monkeypatch.setitem(ns_backends.NS_BACKENDS, "torch", recording)
    model = make_model(dim=64, hidden=128, layers=2)
    reference_model = copy.deepcopy(model)
    common = dict(lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.1)
    ours = Muon(
        model,
        **common,
        **as_muon_adamw_kwargs(ADAMW_KW),
        ns_dtype=torch.bfloat16,  # torch.optim.Muon's
        predicate=proj_predicate,
    )
    assert ours.ns.unbatched == {(64, 64), (128, 64), (64, 128)}
    muon_params = [p for n, p in reference_model.named_parameters() if proj_predicate(n, p)]
    ids = {id(p) for p in muon_params}
    reference = [
        torch.optim.Muon(muon_params, **common, ns_steps=5),
        torch.optim.AdamW(
            [p for p in reference_model.parameters() if id(p) not in ids], **REFERENCE_ADAMW_KW
        ),
    ]
    for step in range(3):
        for m, optimizers in ((model, [ours]), (reference_model, reference)):
            for opt in optimizers:
                opt.zero_grad()
            loss_fn(m, *batch(100 + step)).backward()
            for opt in optimizers:
                opt.step()
    assert calls and all(len(shape) == 2 for shape in calls)
    assert len(calls) == 3 * len(muon_params)
    for (name, p), q in zip(model.named_parameters(), reference_model.parameters(), strict=True):
        assert torch.equal(p, q), name
