"""Training loops run inside spawned ranks, and their one-process references."""

from __future__ import annotations

import contextlib
import copy
import functools
from unittest import mock

import torch
import torch.distributed as dist
import torch.optim._muon as muon_module
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.utils.checkpoint import set_checkpoint_early_stop

import torchtitan_dmuon.engine.exchange as exchange_module
import torchtitan_dmuon.engine.hooks as hooks_module
import torchtitan_dmuon.optim.ns_choice as ns_choice_module
from tests.support.collectives import CollectiveCounter
from tests.support.held import live_held_bytes
from tests.support.models import batch, loss_fn, make_model, proj_predicate, shard_experts
from torchtitan_dmuon import (
    Muon,
    MuonStepError,
    clip_grad_norm_,
    dedicate_params,
    get_full_param,
    materialize,
    set_requires_gradient_sync,
)
from torchtitan_dmuon.engine.checkpoint_geometry import as_saved
from torchtitan_dmuon.engine.report import StepCounts, plan_report
from torchtitan_dmuon.engine.unit import Unit, held_bytes
from torchtitan_dmuon.optim.newton_schulz import newton_schulz, resolve_ns_schedule
from torchtitan_dmuon.optim.normuon import second_moment_shape

MUON_KW = dict(lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.01)
ADAMW_KW = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
# The references' AdamW: the fused kernel, which Muon's AdamW runs by default on CPU.
REFERENCE_ADAMW_KW = dict(ADAMW_KW, fused=True)


def as_muon_adamw_kwargs(adamw_kwargs: dict) -> dict:
    """torch.optim.AdamW's keyword arguments as Muon's ``adamw_*`` ones."""
    return {f"adamw_{key}": value for key, value in adamw_kwargs.items()}


def data_for(step: int, rank: int, world: int, same_data: bool, batch_size: int = 2):
    """This rank's micro-batch; the concatenation over ranks is the reference batch."""
    if same_data:
        return batch(100 + step, batch_size)
    inputs, targets = batch(100 + step, batch_size * world)
    sl = slice(rank * batch_size, (rank + 1) * batch_size)
    return inputs[sl], targets[sl]


def saved_optimizer_state(dedication, opt) -> dict[str, tuple]:
    """Each owned matrix's, piece's and block's momentum and second moment as a checkpoint
    holds them (zeros where no step made them): ``{key: (entry, state key, saved)}``."""
    out = {}
    for entry, master in dedication.primary_params():
        state = opt.state[entry.param]
        state.setdefault("momentum_buffer", torch.zeros_like(master))
        state.setdefault("second_moment", master.new_zeros(second_moment_shape(master.shape)))
        for key in ("momentum_buffer", "second_moment"):
            saved = as_saved(dedication, entry, state[key], per_row=key == "second_moment")
            out[f"{key}.{entry.name}"] = (entry, key, saved)
    return out


def full_params(model, dedication_names) -> dict[str, torch.Tensor]:
    """Every parameter's full value, on every rank (collective)."""
    out = {}
    for name, p in model.named_parameters():
        if name in dedication_names:
            out[name] = get_full_param(model, name)
        elif isinstance(p, DTensor):
            out[name] = p.full_tensor().detach().clone()
        else:
            out[name] = p.detach().clone()
    return out


def _inner_block(name, module):
    return name.endswith("._checkpoint_wrapped_module")


@torch.no_grad()
def _copy_init_values(model, source):
    """Give ``model`` (sharded or not) the values of the plain module ``source``."""
    for p, full in zip(model.parameters(), source.parameters(), strict=True):
        if isinstance(p, DTensor):
            p.copy_(distribute_tensor(full, p.device_mesh, p.placements))
        else:
            p.copy_(full)


def train_dmuon(
    rank,
    world,
    *,
    fsdp=True,
    z3=True,
    steps=4,
    same_data=False,
    ns_dtype=torch.bfloat16,
    accum=1,
    clip=None,
    predicate=proj_predicate,
    model_kwargs=None,
    mp_policy=None,
    sync_last_micro_batch_only=False,
    hook_boundary_predicate=None,
    hsdp_shape=None,
    replicate_async=False,
    snapshot_at=None,
    record_events_at=None,
    meta_init=False,
    checkpoint_blocks=False,
    fail_before_step=None,
    fail_step_at=None,
    ep=1,
    variant="muon",
    owner_group_size=None,
    device="cpu",
    compile_blocks=False,
):
    """Train the tiny transformer with DMuon; return losses, full params and counters.

    ``hsdp_shape=(R, G)`` trains on a (replicate, shard) mesh; ``snapshot_at`` reads every
    dedicated value after that step (as a checkpoint save would); ``record_events_at``
    records the replicate-broadcast events from that step's optimizer step through the
    next forward. ``fsdp="blocks"`` shards the blocks only (embedding, norm and head
    under no FSDP module); ``meta_init="swap"`` materializes with ``swap_tensors`` (as
    tensor-subclass parameters force), ``meta_init="plan"`` with ``materialize`` (at the
    plan's size); ``fail_before_step`` runs one pass whose backward
    raises half-way on every rank before that step, caught as a training loop would;
    ``fail_step_at=(step, rank)`` makes that step's ``Muon.step`` raise on that rank in its
    second Newton-Schulz call (every rank's next ``step()`` raises, then it is retried),
    reported as ``"step_failure"``.
    ``ep`` > 1 shards the ExpertBlocks' stacks over an ``ep`` mesh (TorchTitan's sparse
    layout: replicate x efsdp x ep, ep innermost) and dedicates them over ``efsdp``.
    ``variant``: Muon's (``"normuon"``: NorMuon). ``owner_group_size``: ``dedicate_params``'s
    (None: the planner's choice). ``device``: where the model, the data and the meshes live
    (``"cuda"``: the GPU check, ``benchmarks/gpu_engine_check.py``; the data is drawn on the
    CPU and moved, so it is the same on every device). ``compile_blocks``: each block
    ``torch.compile``d before dedication and FSDP, as TorchTitan's per-block compile (its
    parameters' names then hold ``_orig_mod``).
    """
    device = torch.device(device)
    if hsdp_shape is None:
        mesh = fsdp_mesh = init_device_mesh(device.type, (world,))
        replicate_mesh = None
    else:
        fsdp_mesh = init_device_mesh(device.type, hsdp_shape, mesh_dim_names=("replicate", "shard"))
        mesh, replicate_mesh = fsdp_mesh["shard"], fsdp_mesh["replicate"]
    if meta_init:
        with torch.device("meta"):
            model = make_model(seed=0, **(model_kwargs or {}))
    else:
        model = make_model(seed=0, **(model_kwargs or {})).to(device)
    expert_mesh = None
    if ep > 1:
        replicas, shards = hsdp_shape or (1, world)
        sparse = init_device_mesh(
            device.type, (replicas, shards // ep, ep), mesh_dim_names=("replicate", "efsdp", "ep")
        )
        shard_experts(model, sparse["ep"])
        expert_mesh = sparse["efsdp"]
    if checkpoint_blocks:
        # Activation checkpointing around each block; the hook boundaries are the blocks
        # inside the wrappers, so their hooks run again during the backward recompute.
        for i, block in enumerate(model.layers):
            model.layers[i] = checkpoint_wrapper(block)
        hook_boundary_predicate = _inner_block
    if compile_blocks:
        for i, block in enumerate(model.layers):
            model.layers[i] = torch.compile(block)
    dedication = dedicate_params(
        model,
        mesh,
        predicate,
        replicate_mesh=replicate_mesh,
        reshard_after_forward=z3,
        hook_boundary_predicate=hook_boundary_predicate,
        expert_mesh=expert_mesh,
        owner_group_size=owner_group_size,
    )
    if fsdp:
        # One policy for all, or one per block (FSDP2's policy is per fully_shard call;
        # the root then keeps its parameters' dtype).
        per_block = isinstance(mp_policy, (list, tuple))
        policies = mp_policy if per_block else [mp_policy] * len(model.layers)
        for layer, policy in zip(model.layers, policies, strict=True):
            fully_shard(layer, mesh=fsdp_mesh, **({"mp_policy": policy} if policy else {}))
        if fsdp != "blocks":
            root_policy = None if per_block else mp_policy
            fully_shard(
                model, mesh=fsdp_mesh, **({"mp_policy": root_policy} if root_policy else {})
            )
    # Counted before any value exists, as TorchTitan's plan report does on the meta device.
    ns_bytes = ns_dtype.itemsize if isinstance(ns_dtype, torch.dtype) else 2
    counts = StepCounts(micro_batches=accum, normuon=variant == "normuon", ns_bytes=ns_bytes)
    report = plan_report(model, counts)
    if meta_init == "plan":
        # Materialized at the plan's size: this rank allocates only what it holds.
        source = make_model(seed=0, **(model_kwargs or {})).to(device)
        materialize(model, device, functools.partial(_copy_init_values, model, source))
    elif meta_init:
        # As TorchTitan does: materialize after fully_shard, then initialize in place.
        swap = torch.__future__.get_swap_module_params_on_conversion()
        torch.__future__.set_swap_module_params_on_conversion(meta_init == "swap")
        model.to_empty(device=device)
        torch.__future__.set_swap_module_params_on_conversion(swap)
        _copy_init_values(model, make_model(seed=0, **(model_kwargs or {})).to(device))
    compute_dtypes = set()
    model.layers[0].register_forward_pre_hook(
        lambda m, args: compute_dtypes.add(m.q_proj.weight.dtype)
    )
    opt = Muon(
        model,
        **MUON_KW,
        **as_muon_adamw_kwargs(ADAMW_KW),
        ns_dtype=ns_dtype,
        replicate_async=replicate_async,
        variant=variant,
    )
    losses, norms, per_step, snapshot, events = [], [], [], None, None
    step_failure = None
    names = {d.name for u in dedication.units for d in u.params}
    recorder = None
    for step in range(steps):
        if step == fail_before_step:
            _failing_pass(model, opt, rank, world, device)
        if step == record_events_at:
            recorder = EngineRanges()
            recorder.__enter__()
        elif recorder is not None and step == record_events_at + 2:
            recorder.__exit__(None, None, None)
            events = recorder.events
            recorder = None
        total = torch.zeros((), device=device)
        with CollectiveCounter() as counter:
            opt.zero_grad()
            for micro in range(accum):
                if sync_last_micro_batch_only:
                    set_requires_gradient_sync(model, micro == accum - 1)
                inputs, targets = data_for(step * accum + micro, rank, world, same_data)
                inputs, targets = inputs.to(device), targets.to(device)
                # "full": recompute whole blocks (their post-forward hooks run in backward).
                with set_checkpoint_early_stop(checkpoint_blocks != "full"):
                    loss = loss_fn(model, inputs, targets) / accum
                    loss.backward()
                total += loss.detach()
            if clip is not None:
                norms.append(clip_grad_norm_(model, clip).item())
            if fail_step_at is not None and step == fail_step_at[0]:
                step_failure = failing_step(opt, dedication, rank == fail_step_at[1])
            opt.step()
        per_step.append({**counter.snapshot(), "group_bytes": dict(counter.group_bytes)})
        dist.all_reduce(total)
        losses.append(total.item() / world)
        if step == snapshot_at:
            snapshot = {name: get_full_param(model, name) for name in sorted(names)}
    result = {
        "losses": losses,
        "norms": norms,
        "params": full_params(model, names),
        "ns_matrices": opt.ns_matrices,
        # A piece of a split stack as "name[start:stop]" (experts of the whole stack).
        # An owner group's block as "name#index/count".
        "owned": sorted(
            d.name
            if not d.layout.is_piece
            else f"{d.name}#{d.layout.block[0]}/{d.layout.block[1]}"
            if d.layout.block is not None
            else "{}[{}:{}]".format(d.name, *d.layout.experts_of(d.layout.ep_rank))
            for u in dedication.units
            if u.primary
            for d in u.params
        ),
        # Reduce-bucket bytes (values and one flag per matrix) of the plan's units, by
        # domain: what each rank sends to the owners per synced backward.
        "bucket_bytes": [
            sum(4 * (u.numel + len(u.params)) for u in dedication.plan.units if u.domain == k)
            for k in range(len(dedication.plan.domains))
        ],
        "memory": live_held_bytes(dedication, opt),
        "held_bytes": held_bytes(dedication.plan, dedication.boundary_units),
        "misaligned": misaligned_views(dedication, opt),
        "snapshot": snapshot,
        "events": events,
        "coordinates": (dedication.replicate_rank, dedication.shard_rank),
        "primary_units": [(u.column, u.primary_replica) for u in dedication.units if u.primary],
        "stats": dedication.stats.snapshot(),
        "collectives": per_step,
        "compute_dtypes": compute_dtypes,
        "boundaries": [b.name for b in dedication.plan.boundaries],
        "step_failure": step_failure,
        "report": [r.as_dict() for r in report.ranks],
    }
    dedication.wait_replicas()  # the last step's async broadcasts, before teardown
    del opt, model
    return result


def misaligned_views(dedication, opt) -> list[str]:
    """The views of this rank's unit buffers (values, masters, reduced gradients, a packed
    reduce bucket and its has-gradient flags) and the momentum buffers whose address is
    not a multiple of 16 bytes (what cuBLAS and Inductor want)."""
    views = []
    for unit in dedication.units:
        bucket = unit.pack_grads()
        views.append(("flags", bucket[unit.numel :]))
        for d in unit.params:
            views.append((f"{d.name} bucket", Unit.view(bucket, d)))
            if unit.holds:
                views.append((f"{d.name} value", unit.value_view(d)))
            if unit.primary:
                views.append((f"{d.name} master", unit.master_view(d)))
                if unit.grad is not None:
                    views.append((f"{d.name} grad", unit.grad_view(d)))
                if "momentum_buffer" in opt.state[d.param]:
                    views.append((f"{d.name} momentum", opt.state[d.param]["momentum_buffer"]))
    return [name for name, view in views if view.data_ptr() % 16]


def _failing_pass(model, opt, rank, world, device) -> None:
    inputs, targets = (t.to(device) for t in data_for(999, rank, world, same_data=False))
    failing_pass(opt.zero_grad, model.layers[0], lambda: loss_fn(model, inputs, targets).backward())


def inject_backward_failure(block, fail_at: int = 0):
    """Make the backward of ``block``'s call number ``fail_at`` (micro-batch) raise
    "injected backward failure" (after the blocks above it reduced, before it and those
    below). Returns the forward hook's handle."""
    calls = []

    def raise_in_backward(module, args, output):
        calls.append(None)
        if len(calls) - 1 == fail_at:

            def fail(grad):
                raise RuntimeError("injected backward failure")

            output.register_hook(fail)

    return block.register_forward_hook(raise_in_backward)


def failing_pass(zero_grad, block, backward, fail_at: int = 0) -> bool:
    """A pass whose backward raises in ``block``'s backward (:func:`inject_backward_failure`),
    caught like a training loop skipping a bad batch, which then calls the optimizers'
    ``zero_grad`` and nothing else: recovering the engine's state and FSDP2's is the
    engine's job. Returns whether it raised here (under pipeline parallelism only the ranks
    of ``block``'s stage do)."""
    handle = inject_backward_failure(block, fail_at) if block is not None else None
    zero_grad()
    raised = False
    try:
        backward()
    except RuntimeError as error:
        chain = [error]  # a pipeline stage re-raises it as its cause
        while chain[-1].__cause__ is not None:
            chain.append(chain[-1].__cause__)
        assert any("injected backward failure" in str(e) for e in chain), error
        raised = True
    finally:
        if handle is not None:
            handle.remove()
    if block is not None and not raised:
        raise AssertionError("the failing pass did not fail")
    zero_grad()
    return raised


def failing_step(opt, dedication, fails_here: bool, call: int = 2) -> dict:
    """``opt.step()`` with this rank's ``call``-th Newton-Schulz call raising if
    ``fails_here``: it raises on no rank (the failure is settled on the device), and the
    next ``opt.step()`` raises on every rank before it changes anything. Returns what that
    raised and whether the parameters, masters, momentum and AdamW state are bitwise what
    they were before the failed step, after it and after the raise."""
    before = _optimizer_snapshot(opt, dedication)
    original = ns_choice_module.bind_ns

    def failing_bind(*args, **kwargs):
        ns, calls = original(*args, **kwargs), []

        def run(x):
            calls.append(None)
            if len(calls) == call:
                raise RuntimeError("injected Newton-Schulz failure")
            return ns(x)

        return run

    if fails_here:
        ns_choice_module.bind_ns = failing_bind
    try:
        opt.step()
    finally:
        ns_choice_module.bind_ns = original
    after_step = _optimizer_snapshot(opt, dedication)
    try:
        opt.step()
    except MuonStepError as error:
        message = str(error)
    else:
        raise AssertionError("the step after a failed Muon.step did not raise")
    after = _optimizer_snapshot(opt, dedication)
    unchanged = all(
        before.keys() == snapshot.keys()
        and all(torch.equal(before[k], snapshot[k]) for k in before)
        for snapshot in (after_step, after)
    )
    return {"message": message, "unchanged": unchanged, "tensors": len(before)}


def _optimizer_snapshot(opt, dedication) -> dict[str, torch.Tensor]:
    out = {}
    for i, (_, master) in enumerate(dedication.primary_params()):
        out[f"master{i}"] = master.clone()
    dedicated = {d.name for d in dedication.plan.params}  # freed outside their owners
    for name, p in dedication.model.named_parameters():
        if name not in dedicated:
            out[name] = (p.to_local() if isinstance(p, DTensor) else p).detach().clone()
    for i, state in enumerate(opt.state.values()):
        for key, value in state.items():
            value = value.to_local() if isinstance(value, DTensor) else value
            out[f"state{i}.{key}"] = torch.as_tensor(value).clone()
    return out


class EngineRanges(contextlib.AbstractContextManager):
    """The engine's replicate-broadcast ranges and pre-forwards, in the order they begin, as
    ``("launch" | "forward" | "wait", boundary)``: read from the ``record_function`` names the
    engine gives them, recorded as they are entered. (Not through torch.profiler: parsing its
    kineto trace of a 4-rank gloo run failed once in CI with ``std::bad_alloc``.)"""

    _KINDS = {
        "dmuon::replicate_broadcast": "launch",
        "dmuon::pre_forward": "forward",
        "dmuon::replicate_wait": "wait",
    }
    _MODULES = (exchange_module, hooks_module)
    _REAL = staticmethod(torch.profiler.record_function)

    def __init__(self):
        self.events: list[tuple[str, int | None]] = []
        self._patches = contextlib.ExitStack()

    def _record_function(self, name, *args, **kwargs):
        label, _, boundary = name.partition(" b")
        if label in self._KINDS:
            self.events.append((self._KINDS[label], int(boundary) if boundary else None))
        return self._REAL(name, *args, **kwargs)

    def __enter__(self):
        for module in self._MODULES:
            self._patches.enter_context(
                mock.patch.object(module, "record_function", self._record_function)
            )
        return self

    def __exit__(self, *exc):
        self._patches.close()
        return None


class NorMuonReference(torch.optim.Optimizer):
    """One-process NorMuon of 2-D matrices, from its definition (the authors'
    ``normuon.py``), on torch.optim.Muon's momentum, Newton-Schulz (as
    :func:`reference_setup` sets it) and learning-rate adjustment: each row of the
    orthogonalized update divided by the root of an EMA of its mean square, the matrix
    rescaled to the Frobenius norm it had before."""

    def __init__(self, params, lr, momentum, nesterov, weight_decay, beta2=0.95):
        defaults = dict(
            lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay, beta2=beta2
        )
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self):
        coefficients = (muon_module.DEFAULT_A, muon_module.DEFAULT_B, muon_module.DEFAULT_C)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                    state["second_moment"] = torch.zeros_like(p[:, :1])
                buf, moment = state["momentum_buffer"], state["second_moment"]
                buf.lerp_(p.grad, 1 - group["momentum"])
                update = p.grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf
                o = muon_module._zeropower_via_newtonschulz(
                    update, coefficients, muon_module.DEFAULT_NS_STEPS, muon_module.EPS
                )
                norm = o.norm()
                moment.lerp_((o * o).mean(dim=1, keepdim=True), 1 - group["beta2"])
                o = o / (moment.sqrt() + 1e-10)
                o = o * (norm / (o.norm() + 1e-10))
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(o, alpha=-muon_module._adjust_lr(group["lr"], None, p.shape))


def reference_muon(params, variant: str = "muon", **muon_kw) -> torch.optim.Optimizer:
    """The one-process reference of ``Muon(variant=...)``'s matrices."""
    return (NorMuonReference if variant == "normuon" else torch.optim.Muon)(params, **muon_kw)


@contextlib.contextmanager
def reference_setup(ns_dtype=torch.bfloat16):
    """How one-process references run: single-threaded like the ranks (same reduction
    order), and torch.optim.Muon's bf16 Newton-Schulz swapped for ours in ``ns_dtype``
    when that is not bf16."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    original = muon_module._zeropower_via_newtonschulz
    if ns_dtype != torch.bfloat16:

        def ns(grad, coefficients, steps, eps):
            return newton_schulz(
                grad, resolve_ns_schedule(coefficients, steps), eps=eps, dtype=ns_dtype
            )

        muon_module._zeropower_via_newtonschulz = ns
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        muon_module._zeropower_via_newtonschulz = original


EXACT_RTOL, EXACT_ATOL = 1e-4, 1e-5
"""What separates two fp32 runs that differ only in the order gradients are summed (a
rank's share first, then the ranks'), after Newton-Schulz amplifies it."""
NS_ULPS = {"torch": 8, "gram": 16}
"""Units in the last place of the Newton-Schulz dtype by which one element of an
orthogonalized update may differ from the one-process reference's (torch.optim.Muon's
loop in the same dtype), by backend. Each iteration rounds its products to that dtype,
and inputs that differ in their last fp32 bits may round either way; Gram NS iterates on
X X^T, whose rounding the square of X's condition amplifies (why it restarts). torch: 8,
as an AVX2 CPU's emulated bf16 products moved one element of 2048 by 5.6 ulps."""


def trained_tolerance(
    ns_dtype: torch.dtype, *, lr: float, steps: int, ns_backend: str = "torch"
) -> dict:
    """``torch.testing.assert_close`` tolerances for Muon matrices after ``steps`` steps of
    (shape-adjusted) learning rate at most ``lr`` with Newton-Schulz in ``ns_dtype`` by
    ``ns_backend``, against the one-process reference in the same dtype:
    :data:`EXACT_ATOL` plus :data:`NS_ULPS` ulps of ``ns_dtype`` of every step's update
    (whose elements are at most about 1: Newton-Schulz leaves no singular value far above
    1)."""
    ulp = torch.finfo(ns_dtype).eps
    return dict(rtol=EXACT_RTOL, atol=EXACT_ATOL + NS_ULPS[ns_backend] * ulp * lr * steps)


def loss_tolerance(ns_dtype: torch.dtype) -> dict:
    """Tolerances of losses computed (in fp32) from matrices within
    :func:`trained_tolerance`: the exact ones, or one ulp of ``ns_dtype`` relative where
    that is coarser."""
    return dict(rtol=max(EXACT_RTOL, torch.finfo(ns_dtype).eps), atol=1e-6)


def train_one_process(
    model,
    steps: int,
    step_loss,
    predicate=proj_predicate,
    muon_kw=MUON_KW,
    adamw_kw=REFERENCE_ADAMW_KW,
    variant="muon",
) -> list[float]:
    """One process, in place: torch.optim.Muon (``muon_kw``; NorMuon for ``variant``
    "normuon") on the ``predicate``'s matrices and torch.optim.AdamW (``adamw_kw``) on the
    rest; ``step_loss(model, step)`` gives each step's loss. Run it inside
    :func:`reference_setup`. Returns the losses."""
    muon = [p for n, p in model.named_parameters() if predicate(n, p)]
    rest = [p for n, p in model.named_parameters() if not predicate(n, p)]
    opts = [reference_muon(muon, variant, **muon_kw), torch.optim.AdamW(rest, **adamw_kw)]
    losses = []
    for step in range(steps):
        for o in opts:
            o.zero_grad()
        loss = step_loss(model, step)
        loss.backward()
        for o in opts:
            o.step()
        losses.append(loss.item())
    return losses


def train_reference(
    world,
    *,
    steps=4,
    same_data=False,
    ns_dtype=torch.bfloat16,
    accum=1,
    clip=None,
    predicate=proj_predicate,
    model_kwargs=None,
    variant="muon",
    device="cpu",
):
    """One process: torch.optim.Muon (NorMuon for ``variant`` "normuon") on the dedicated
    matrices, torch.optim.AdamW on the rest, on the concatenation of every rank's batch
    (on ``device``, with the data of :func:`train_dmuon` there)."""
    with reference_setup(ns_dtype):
        model = make_model(seed=0, **(model_kwargs or {})).to(device)
        muon = [p for n, p in model.named_parameters() if predicate(n, p)]
        ids = {id(p) for p in muon}
        rest = [p for p in model.parameters() if id(p) not in ids]
        opts = [
            reference_muon(muon, variant, **MUON_KW),
            torch.optim.AdamW(rest, **REFERENCE_ADAMW_KW),
        ]
        losses, norms = [], []
        for step in range(steps):
            for o in opts:
                o.zero_grad()
            total = 0.0
            for micro in range(accum):
                if same_data:
                    inputs, targets = data_for(step * accum + micro, 0, world, True)
                else:
                    inputs, targets = batch(100 + step * accum + micro, 2 * world)
                inputs, targets = inputs.to(device), targets.to(device)
                loss = loss_fn(model, inputs, targets) / accum
                loss.backward()
                total += loss.item()
            if clip is not None:
                norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
            for o in opts:
                o.step()
            losses.append(total)
    return {
        "losses": losses,
        "norms": norms,
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "model": copy.deepcopy(model),
    }


def train_configs(rank, world, configs):
    """Several DMuon trainings in one spawned job (spawning costs more than training)."""
    return [train_dmuon(rank, world, **config) for config in configs]
