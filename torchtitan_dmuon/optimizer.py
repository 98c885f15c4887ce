"""``Muon``: the user-facing optimizer, Muon for matrices and torch's AdamW for the rest.

A thin :class:`torch.optim.Optimizer` over the functional core in
:mod:`torchtitan_dmuon.optim.muon`. It takes the model, not a parameter list, because
which parameters go to Muon is a property of the model: either the plan that
:func:`torchtitan_dmuon.dedicate_params` attached to it (distributed: only the owner of
a matrix steps it) or, in one process, an optional ``predicate(name, param)``.

Two param groups: ``param_groups[0]`` holds the Muon matrices and ``param_groups[1]`` every
other trainable parameter, stepped by an inner :class:`torch.optim.AdamW` that shares
the group dict and the state, so LR schedulers, ``state_dict`` and ``load_state_dict``
see one ordinary optimizer.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.profiler import record_function
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

from torchtitan_dmuon.engine import get_dedication, verify_plan
from torchtitan_dmuon.engine.agreement import (
    NSBackendReport,
    agree_ns_backends,
    failed_ranks,
    job_ns_dtype,
)
from torchtitan_dmuon.engine.comm import mesh_device
from torchtitan_dmuon.engine.param_layout import local_tensor
from torchtitan_dmuon.engine.plan import select_matrices
from torchtitan_dmuon.optim.muon import ADJUST_LR_FNS, apply_muon_update, muon_update
from torchtitan_dmuon.optim.newton_schulz import EPS, matrix_count, resolve_ns_schedule
from torchtitan_dmuon.optim.normuon import normuon_normalize, second_moment_shape
from torchtitan_dmuon.optim.ns_backends import bind_ns, check_ns_backend
from torchtitan_dmuon.optim.ns_dtype import NSDtypeVerdict, parse_ns_dtype
from torchtitan_dmuon.qk_clip import QKClip

__all__ = ["Muon", "MuonStepError"]

logger = logging.getLogger(__name__)

Predicate = Callable[[str, nn.Parameter], bool]

VARIANTS = ("muon", "normuon")
"""Accepted values of ``variant``."""

SECOND_MOMENT = "second_moment"
"""NorMuon's state key: one EMA of the mean square per row of each matrix."""


def _check_range(name: str, value: float, low: float, high: float | None = None) -> None:
    ok = value >= low and (high is None or value < high)
    if not ok:
        bound = f"[{low}, {high})" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be {bound}, got {value!r}")


class Muon(torch.optim.Optimizer):
    """Muon for matrix parameters and AdamW for all others, on one model.

    Args:
        model: The model to optimize. If :func:`dedicate_params` was applied to it, the
            dedicated parameters are the Muon parameters and each rank steps only those it
            owns; otherwise ``predicate`` selects them.
        lr: Muon learning rate (before ``adjust_lr_fn``).
        momentum: Muon EMA momentum, in ``[0, 1)``.
        nesterov: Use the Nesterov look-ahead.
        weight_decay: Decoupled weight decay for Muon parameters.
        ns_steps: Newton-Schulz iterations.
        ns_coefficients: ``"quintic"``, ``"polar_express"``, one ``(a, b, c)`` triple or a
            list of per-step triples.
        ns_dtype: Newton-Schulz compute dtype, or ``"auto"`` (the default): bf16 where
            the device multiplies bf16 natively and fast (CUDA, CPUs with AVX512-BF16 or
            AMX), fp32 elsewhere (see ``optim.ns_dtype``), probed once per process and,
            after :func:`dedicate_params`, agreed by every rank of the dedication (small
            all-gathers over its groups, in this constructor). ``chosen_ns_dtype`` says
            why.
        ns_backend: Newton-Schulz implementation (see ``optim.ns_backends``). With
            ``"auto"`` the backend of every matrix shape is picked in this constructor,
            from timings read from the disk cache or measured, and after
            :func:`dedicate_params` merged over every rank of the dedication, so each
            shape runs one backend on all of them. Under tensor parallelism the Gram all-reduce
            path runs for ``"gram"`` and ``"auto"`` (where it moves fewer bytes); other
            backends orthogonalize the gathered matrix.
        adjust_lr_fn: ``None``/``"original"``, ``"match_rms_adamw"`` or ``"spectral"``.
        variant: ``"muon"``, or ``"normuon"``: each orthogonalized update normalized per
            row by an EMA of its rows' mean squares, then rescaled to its own Frobenius
            norm (NorMuon, see ``optim.normuon``); the owner keeps the second moment
            (state ``"second_moment"``, one value per row) beside the momentum.
        normuon_beta2: NorMuon's second-moment EMA factor, in ``[0, 1)``.
        qk_clip: QK-clip (Kimi K2's MuonClip, see :class:`~torchtitan_dmuon.QKClip`):
            after each update the query and key projections of the heads whose largest
            logit exceeded its threshold are rescaled, on their owner, before the
            broadcast; the per-head maxima are MAX-reduced over the data-parallel ranks
            (one collective per step, overlapping Newton-Schulz). Its weights must be Muon
            matrices. None: off.
        eps: Floor of the Newton-Schulz normalizing norm.
        adamw_lr: AdamW learning rate for the non-Muon parameters.
        adamw_betas: AdamW betas.
        adamw_eps: AdamW epsilon.
        adamw_weight_decay: AdamW decoupled weight decay.
        adamw_foreach: ``foreach`` of the inner ``torch.optim.AdamW``; None: torch's
            default.
        adamw_fused: ``fused`` of the inner ``torch.optim.AdamW``; None: fused (as
            TorchTitan's default ``[optimizer] implementation``) when torch has a fused
            kernel for the parameters' devices (CPU and CUDA among them), every AdamW
            parameter is floating point, they are all DTensors or all plain tensors and
            ``adamw_foreach`` is not True; torch's default otherwise. The fused kernel
            rounds differently from torch's default.
        replicate_async: Under HSDP, broadcast new values across replicas asynchronously
            (requires ``dedicate_params(..., replicate_mesh=...)``).
        predicate: One-process selection of Muon parameters, ``predicate(name, param)``;
            defaults to every trainable 2-D parameter. Not allowed together with
            :func:`dedicate_params`, whose own predicate decides.
    """

    def __init__(
        self,
        model: nn.Module,
        lr: float = 0.02,
        momentum: float = 0.95,
        nesterov: bool = True,
        weight_decay: float = 0.0,
        ns_steps: int = 5,
        ns_coefficients="quintic",
        ns_dtype: torch.dtype | str = "auto",
        ns_backend: str = "torch",
        adjust_lr_fn: str | None = None,
        variant: str = "muon",
        normuon_beta2: float = 0.95,
        qk_clip: QKClip | None = None,
        eps: float = EPS,
        adamw_lr: float = 1e-3,
        adamw_betas: tuple[float, float] = (0.9, 0.95),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float = 0.0,
        adamw_foreach: bool | None = None,
        adamw_fused: bool | None = None,
        replicate_async: bool = False,
        predicate: Predicate | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        _check_range("lr", lr, 0.0)
        _check_range("momentum", momentum, 0.0, 1.0)
        _check_range("weight_decay", weight_decay, 0.0)
        _check_range("adamw_lr", adamw_lr, 0.0)
        _check_range("adamw_betas[0]", adamw_betas[0], 0.0, 1.0)
        _check_range("adamw_betas[1]", adamw_betas[1], 0.0, 1.0)
        _check_range("adamw_eps", adamw_eps, 0.0)
        _check_range("adamw_weight_decay", adamw_weight_decay, 0.0)
        _check_range("eps", eps, 0.0)
        _check_range("normuon_beta2", normuon_beta2, 0.0, 1.0)
        if variant not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
        if adjust_lr_fn not in ADJUST_LR_FNS:
            raise ValueError(f"adjust_lr_fn must be one of {ADJUST_LR_FNS}, got {adjust_lr_fn!r}")
        ns_dtype = parse_ns_dtype(ns_dtype)
        schedule = resolve_ns_schedule(ns_coefficients, ns_steps)  # validates both

        self.dedication = get_dedication(model)
        if self.dedication is not None:
            if predicate is not None:
                raise ValueError(
                    "predicate: the model was prepared by dedicate_params, whose predicate "
                    "selects the Muon parameters; do not pass one to Muon as well"
                )
            self.dedication.bind_params()
            muon_params = list(self.dedication.params)
            muon_names = {d.name for d in self.dedication.plan.params}
            self._named_params = {}
        else:
            selected = select_matrices(model, predicate or (lambda n, p: p.ndim == 2))
            muon_params = [p for _, p in selected]
            muon_names = {name for name, _ in selected}
            self._named_params = dict(selected)
        if qk_clip is not None:
            if not isinstance(qk_clip, QKClip):
                raise TypeError(f"qk_clip must be a QKClip, got {type(qk_clip).__name__}")
            outside = [name for name in qk_clip.weight_names if name not in muon_names]
            if outside:
                raise ValueError(
                    f"qk_clip: {outside[0]} is not a Muon matrix of this model (QK-clip "
                    "rescales the query and key projections on their owner after Muon's "
                    "update); select it for Muon or leave it out of the clipped attentions"
                )
            if self.dedication is not None:
                local = {d.name: d.layout.local_shape[0] for d in self.dedication.plan.params}
            else:
                local = {n: local_tensor(p).shape[0] for n, p in selected}
            qk_clip.check_rows(local)
        if replicate_async and (
            self.dedication is None or self.dedication.exchange.replicas is None
        ):
            raise ValueError(
                "replicate_async=True needs dedicate_params(..., replicate_mesh=...) (HSDP)"
            )
        # Before the first collective: every rank refuses alike (one device type per job).
        check_ns_backend(ns_backend, self._ns_device(muon_params))
        muon_ids = {id(p) for p in muon_params}
        adamw_params = [p for p in model.parameters() if p.requires_grad and id(p) not in muon_ids]

        self.ns_backend = ns_backend
        self.eps = eps
        self.qk_clip = qk_clip
        self.ns_matrices = 0
        """Matrices this rank has orthogonalized so far (accounting and tests)."""

        muon_group = {
            "params": muon_params,
            "use_muon": True,
            "lr": lr,
            "momentum": momentum,
            "nesterov": nesterov,
            "weight_decay": weight_decay,
            "ns_steps": ns_steps,
            "ns_coefficients": ns_coefficients,
            "adjust_lr_fn": adjust_lr_fn,
            "variant": variant,
            "normuon_beta2": normuon_beta2,
        }
        adamw_group = {
            "params": adamw_params,
            "use_muon": False,
            "lr": adamw_lr,
            "betas": adamw_betas,
            "eps": adamw_eps,
            "weight_decay": adamw_weight_decay,
        }
        if not muon_params and not adamw_params:
            raise ValueError("model has no trainable parameters")
        super().__init__([muon_group, adamw_group], {"lr": lr})
        self._adamw = self._make_adamw(adamw_params, adamw_foreach, adamw_fused)
        if self.dedication is not None:
            verify_plan(self.dedication)
        self.chosen_ns_dtype = self._choose_ns_dtype(ns_dtype, muon_params)
        self.ns_dtype = self.chosen_ns_dtype.dtype
        self.ns_backend_report = None
        """What ``ns_backend="auto"`` measured and picked (None for a named backend)."""
        if ns_backend == "auto":
            self.ns_backend_report = self._choose_ns_backends(schedule, muon_params)
        if replicate_async:
            self.dedication.set_replicate_async(True)
        if variant == "normuon":
            logger.info(
                "Muon: NorMuon, each update normalized per row (second-moment beta2 %g)",
                normuon_beta2,
            )
        if qk_clip is not None:
            logger.info(
                "Muon: QK-clip on %d attention layers (threshold %g, alpha %g)",
                len(qk_clip.attentions),
                qk_clip.threshold,
                qk_clip.alpha,
            )

    def _ns_device(self, muon_params: list[nn.Parameter]) -> torch.device:
        if self.dedication is not None:
            return mesh_device(self.dedication.mesh)
        return muon_params[0].device if muon_params else torch.device("cpu")

    def _choose_ns_dtype(
        self, ns_dtype: torch.dtype | str, muon_params: list[nn.Parameter]
    ) -> NSDtypeVerdict:
        if ns_dtype != "auto":
            return NSDtypeVerdict(ns_dtype, "named")
        device = self._ns_device(muon_params)
        return job_ns_dtype(device, self.dedication)

    def _choose_ns_backends(self, schedule, muon_params: list[nn.Parameter]) -> NSBackendReport:
        if self.dedication is not None:
            workload = self.dedication.ns_workload("auto", self.ns_dtype, schedule.steps)
        else:
            workload = {}
            for p in muon_params:
                shape = (p.shape[-2], p.shape[-1])
                workload[shape] = workload.get(shape, 0) + matrix_count(p.shape)
        return agree_ns_backends(
            workload,
            schedule,
            eps=self.eps,
            dtype=self.ns_dtype,
            device=self._ns_device(muon_params),
            dedication=self.dedication,
        )

    def _make_adamw(
        self, adamw_params: list[nn.Parameter], foreach: bool | None, fused: bool | None
    ) -> torch.optim.AdamW | None:
        """An AdamW over ``param_groups[1]`` that shares its dict and our state."""
        if not adamw_params:
            return None
        group = self.param_groups[1]
        device_types = {p.device.type for p in adamw_params}
        if (
            fused is None
            and not foreach
            and device_types <= set(_get_fused_kernels_supported_devices())
            and all(p.dtype.is_floating_point for p in adamw_params)
            # The fused kernel takes DTensors or plain tensors, not both in one call.
            and len({isinstance(p, DTensor) for p in adamw_params}) == 1
        ):
            fused = True
        adamw = torch.optim.AdamW(
            [{"params": group["params"]}],
            lr=group["lr"],
            betas=group["betas"],
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            foreach=foreach,
            fused=fused,
        )
        for key, value in adamw.param_groups[0].items():
            group.setdefault(key, value)
        adamw.param_groups = [group]
        adamw.state = self.state
        return adamw

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        if self.dedication is not None:
            self.dedication.zero_grad()
        if self.qk_clip is not None:  # a new accumulation: the old passes' maxima go
            self.qk_clip.reset()

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        # The base class rebuilt the group dicts and the state: share them again.
        if self._adamw is not None:
            self._adamw.param_groups = [self.param_groups[1]]
            self._adamw.state = self.state

    @torch.no_grad()
    def step(self, closure=None):
        """Perform one optimization step.

        Distributed, each rank orthogonalizes only the matrices it owns (those whose
        reduced gradient it holds); the new values reach the other ranks by broadcast.

        Transactional: every rank first computes its new momentum and orthogonalized
        updates without changing anything, then the ranks of the dedication agree (one
        small all-reduce per group) that all of them succeeded; only then does any rank
        write its parameters, momentum and AdamW state. If one rank fails in the first
        phase, every rank raises :class:`MuonStepError` and all state is as before the
        call (the reduced gradients are kept: ``step()`` may be called again, or
        ``zero_grad()`` to drop them). Under tensor parallelism the matrices stepped alone
        go first and are agreed on before the owner columns' TP ranks start their sharded
        Newton-Schulz, which is agreed on in turn; a failure on one TP rank *between* the
        collectives of one sharded Newton-Schulz leaves its peers waiting in the next one
        (until the process group's timeout).

        Raises:
            MuonStepError: The first phase raised on some rank of the dedication.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.dedication is not None:
            self.dedication.before_step()
        local, sharded = self._grouped_targets()
        qk_maxima = self._start_qk_reduce()
        try:
            # Whatever needs no collective first, and the ranks agree on it before the
            # owner columns' TP ranks start their sharded Newton-Schulz (a rank that
            # failed before would meet its TP peer's collective with its agreement).
            pending = self._compute_agreed(local)
            if self.dedication is not None and self.dedication.exchange.tp_group is not None:
                pending += self._compute_agreed(sharded)
        finally:
            if qk_maxima is not None:
                qk_maxima = self._finish_qk_reduce(*qk_maxima)
        self._apply_updates(pending)
        if qk_maxima is not None:
            self._clip_qk(qk_maxima)
        if self._adamw is not None:
            self._adamw.step()
        if self.dedication is not None:
            self.dedication.after_step()
        return loss

    def _start_qk_reduce(self) -> tuple[torch.Tensor, dist.Work | None] | None:
        """QK-clip's per-head maxima and the MAX all-reduce over the first data-parallel
        group that starts on them (None: QK-clip is off)."""
        if self.qk_clip is None:
            return None
        if self.dedication is None:
            return self.qk_clip.maxima(self._ns_device(self.param_groups[0]["params"])), None
        maxima = self.qk_clip.maxima(mesh_device(self.dedication.mesh))
        group = self.dedication.exchange.data_parallel_groups()[0]
        self.dedication.stats.record("qk_clip_all_reduce", maxima)
        return maxima, dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=group, async_op=True)

    def _finish_qk_reduce(self, maxima: torch.Tensor, work: dist.Work | None) -> torch.Tensor:
        """The maxima over every data-parallel rank (under HSDP, the replicate group's
        MAX follows the shard group's)."""
        if work is None:
            return maxima
        work.wait()
        for group in self.dedication.exchange.data_parallel_groups()[1:]:
            self.dedication.stats.record("qk_clip_all_reduce", maxima)
            dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=group)
        return maxima

    def _clip_qk(self, maxima: torch.Tensor) -> None:
        """QK-clip after the update: each rank rescales the query and key weights it
        writes (an owner's master, or its tensor-parallel rows); under tensor
        parallelism the step's metrics then cover every TP rank's heads."""
        names = set(self.qk_clip.weight_names)
        if self.dedication is not None:
            owned = self.dedication.primary_params()
            masters = {entry.name: master for entry, master in owned if entry.name in names}
        else:
            masters = {
                name: local_tensor(p) for name, p in self._named_params.items() if name in names
            }
        with record_function("muon::qk_clip"):
            self.qk_clip.clip(maxima, masters)
        tp_group = self.dedication.exchange.tp_group if self.dedication is not None else None
        if tp_group is not None:
            clip = self.qk_clip
            clip.clipped_heads = clip.clipped_heads.float()
            dist.all_reduce(clip.clipped_heads, op=dist.ReduceOp.SUM, group=tp_group)
            dist.all_reduce(clip.max_logit, op=dist.ReduceOp.MAX, group=tp_group)

    def _grouped_targets(self) -> tuple[list[tuple], list[tuple]]:
        """``(split dim, keys, params, grads)`` per group of the matrices this rank steps:
        those stepped alone (split dim None), then the tensor-parallel shards by split dim
        (their owner column's TP ranks run the Newton-Schulz together)."""
        if self.dedication is not None:
            # Only the owner holds a matrix's reduced gradient: it alone steps it.
            with record_function("dmuon::owned_grads"):
                targets = self.dedication.owned_grads()
        else:
            targets = [(p, p, p.grad) for p in self.param_groups[0]["params"] if p.grad is not None]
        by_split: dict[int | None, list[tuple]] = {None: []}
        for target in targets:
            layout = self.dedication.layout_of(target[0]) if self.dedication is not None else None
            split = layout.split_dim if layout is not None else None
            by_split.setdefault(split, []).append(target)
        groups = [(split, *zip(*ts, strict=True)) for split, ts in by_split.items() if ts]
        return [g for g in groups if g[0] is None], [g for g in groups if g[0] is not None]

    def _compute_agreed(self, groups: list[tuple]) -> list[tuple]:
        """:meth:`_compute_updates` of ``groups``; then, distributed, every rank of the
        dedication learns whether any failed (one flag all-reduce per group) and all raise
        :class:`MuonStepError` alike, before any state changed."""
        error, pending = None, []
        try:
            pending = self._compute_updates(groups)
        except Exception as e:  # every rank must hear of it before any rank writes
            error = e
        if self.dedication is None:
            if error is not None:
                raise error
            return pending
        failed = failed_ranks(self.dedication, error is not None, mesh_device(self.dedication.mesh))
        if failed:
            raise MuonStepError(
                f"Muon.step failed on rank(s) {failed} before any state changed; "
                "parameters, momentum and AdamW state are unchanged on every rank"
                + (f": {type(error).__name__}: {error}" if error is not None else "")
            ) from error
        return pending

    def _compute_updates(self, groups: list[tuple]) -> list[tuple]:
        """The first phase of :meth:`step`: per group of matrices (see
        :meth:`_grouped_targets`), ``(params, keys, momentum buffers, update, whole
        shapes)``; nothing changes."""
        group = self.param_groups[0]
        schedule = resolve_ns_schedule(group["ns_coefficients"], group["ns_steps"])
        ns = bind_ns(self.ns_backend, schedule, eps=self.eps, dtype=self.ns_dtype)
        pending = []
        for split, keys, params, grads in groups:
            # A first step's buffers join the state only once the step commits.
            bufs = [self.state[key].get("momentum_buffer", None) for key in keys]
            bufs = [
                b if b is not None else torch.zeros_like(p)
                for b, p in zip(bufs, params, strict=True)
            ]
            shapes, group_ns, tensor_parallel = None, ns, None
            if split is not None:
                shapes = [key.shape for key in keys]
                tensor_parallel = self.dedication.exchange.tensor_parallel
                group_ns = tensor_parallel.sharded_ns(
                    split, ns, schedule, eps=self.eps, dtype=self.ns_dtype, backend=self.ns_backend
                )
            update = muon_update(
                list(params),
                list(grads),
                bufs,
                momentum=group["momentum"],
                nesterov=group["nesterov"],
                ns=group_ns,
            )
            if group["variant"] == "normuon":
                update = self._normalized(update, keys, params, split, tensor_parallel)
            pending.append((list(params), list(keys), bufs, update, shapes))
        return pending

    def _normalized(self, update, keys, params, split, tensor_parallel):
        """NorMuon: ``update`` with its orthogonalized matrices normalized per row and the
        new second moments (a first step's start at zero, joining the state at commit)."""
        moments = [
            self.state[key][SECOND_MOMENT]
            if SECOND_MOMENT in self.state[key]
            else p.new_zeros(second_moment_shape(p.shape))
            for key, p in zip(keys, params, strict=True)
        ]
        new_moments, normalized = normuon_normalize(
            update.orthogonal,
            moments,
            beta2=self.param_groups[0]["normuon_beta2"],
            columns=[key.shape[-1] for key in keys],
            split_dim=split,
            all_reduce=tensor_parallel.all_reduce if tensor_parallel is not None else None,
        )
        return dataclasses.replace(update, orthogonal=normalized, second_moments=new_moments)

    def _apply_updates(self, pending: list[tuple]) -> None:
        """The second phase of :meth:`step`: write what :meth:`_compute_updates` computed."""
        group = self.param_groups[0]
        for params, keys, bufs, update, shapes in pending:
            for key, buf in zip(keys, bufs, strict=True):
                self.state[key]["momentum_buffer"] = buf
            if update.second_moments is not None:
                for key, moment in zip(keys, update.second_moments, strict=True):
                    old = self.state[key].setdefault(SECOND_MOMENT, moment)
                    if old is not moment:  # in place: DCP loads into the state's tensors
                        old.copy_(moment)
            apply_muon_update(
                params,
                bufs,
                update,
                lr=group["lr"],
                weight_decay=group["weight_decay"],
                adjust_lr_fn=group["adjust_lr_fn"],
                shapes=shapes,
            )
            self.ns_matrices += update.matrices


class MuonStepError(RuntimeError):
    """``Muon.step`` failed on some rank of the dedication; no rank changed any state."""
