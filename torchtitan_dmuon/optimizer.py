"""``Muon``: the user-facing optimizer, Muon for matrices and torch's AdamW for the rest.

A thin :class:`torch.optim.Optimizer` over the functional core of
:mod:`torchtitan_dmuon.optim.muon` and one :class:`~torchtitan_dmuon.optim.matrices.MatrixSet`:
the engine's ``OwnedMatrices`` when :func:`torchtitan_dmuon.dedicate_params` prepared the
model (each rank steps only the matrices it owns), else ``LocalMatrices`` (one process,
the matrices an optional ``predicate(name, param)`` selects). Its settings are one
:class:`~torchtitan_dmuon.optim.config.MuonConfig` and one
:class:`~torchtitan_dmuon.optim.config.AdamWConfig`, given whole or built from keywords.

Two param groups: ``param_groups[0]`` holds the Muon matrices and ``param_groups[1]`` every
other trainable parameter, stepped by an inner :class:`torch.optim.AdamW` that shares
the group dict and the state, so LR schedulers, ``state_dict`` and ``load_state_dict``
see one ordinary optimizer.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.profiler import record_function
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

from torchtitan_dmuon.engine import get_dedication
from torchtitan_dmuon.engine.owned import MuonStepError, OwnedMatrices
from torchtitan_dmuon.engine.param_layout import bias_entries
from torchtitan_dmuon.engine.plan import Predicate, select_matrices
from torchtitan_dmuon.optim.config import AdamWConfig, MuonConfig
from torchtitan_dmuon.optim.matrices import LocalMatrices, MatrixSet
from torchtitan_dmuon.optim.muon import commit_group, compute_group
from torchtitan_dmuon.optim.ns_choice import NSChoice, check_ns, choose_ns
from torchtitan_dmuon.optim.qk_clip import QKClip

__all__ = ["Muon", "MuonStepError"]

logger = logging.getLogger(__name__)

_MUON_FIELDS = {f.name for f in dataclasses.fields(MuonConfig)}
_ADAMW_FIELDS = {f.name for f in dataclasses.fields(AdamWConfig)}


def _configs(
    config: MuonConfig | None, adamw: AdamWConfig | None, keywords: dict
) -> tuple[MuonConfig, AdamWConfig]:
    """``config`` and ``adamw`` (defaults when None) with ``keywords`` applied: a
    :class:`MuonConfig` field by its name, an :class:`AdamWConfig` field as
    ``adamw_<field>``."""
    muon_keywords, adamw_keywords = {}, {}
    for key, value in keywords.items():
        if key in _MUON_FIELDS:
            muon_keywords[key] = value
        elif key.startswith("adamw_") and key.removeprefix("adamw_") in _ADAMW_FIELDS:
            adamw_keywords[key.removeprefix("adamw_")] = value
        else:
            raise TypeError(f"Muon() got an unexpected keyword argument {key!r}")
    # The base fields only: TorchTitan's [dmuon] section is a MuonConfig with more.
    base = {f: getattr(config, f) for f in _MUON_FIELDS} if config is not None else {}
    return (
        MuonConfig(**{**base, **muon_keywords}),
        dataclasses.replace(adamw or AdamWConfig(), **adamw_keywords),
    )


class Muon(torch.optim.Optimizer):
    """Muon for matrix parameters and AdamW for all others, on one model.

    Args:
        model: The model to optimize. If :func:`dedicate_params` was applied to it, the
            dedicated parameters are the Muon parameters and each rank steps only those it
            owns; otherwise ``predicate`` selects them.
        config: Muon's settings (:class:`MuonConfig`); default: its defaults.
        adamw: The inner AdamW's settings (:class:`AdamWConfig`); default: its defaults.
        qk_clip: QK-clip (Kimi K2's MuonClip, see :class:`~torchtitan_dmuon.QKClip`):
            after each update the query and key projections of the heads whose largest
            logit exceeded its threshold are rescaled, on their owner, before the
            broadcast, and their biases (if any) with them after AdamW's update, by every
            rank on the entries it holds; the per-head maxima are MAX-reduced over the
            data-parallel ranks (one collective per step, overlapping Newton-Schulz). Its
            weights must be Muon matrices. None: off.
        predicate: One-process selection of Muon parameters, ``predicate(name, param)``;
            defaults to every trainable 2-D parameter. Not allowed together with
            :func:`dedicate_params`, whose own predicate decides.
        **settings: Any :class:`MuonConfig` field (``lr=0.02``, ``ns_steps=5``, ...) or
            :class:`AdamWConfig` field as ``adamw_<field>`` (``adamw_lr=1e-3``), applied
            over ``config`` and ``adamw``.

    Attributes:
        config: The Muon settings in force.
        ns: The Newton-Schulz every rank runs (:class:`~torchtitan_dmuon.optim.ns_choice.NSChoice`):
            dtype and why, backend and what ``"auto"`` picked. With ``"auto"`` dtype or
            backend, decided in this constructor, agreed by every rank of the dedication
            (small all-gathers over its groups).
        ns_matrices: Matrices this rank has orthogonalized so far.
        qk_clip: The ``qk_clip`` given.

    Raises:
        TypeError / ValueError: A bad setting, naming it, on every rank alike before the
            first collective (a QK-clip bias whose entries cannot be located among its
            heads: on every rank alike after one all-gather).
    """

    def __init__(
        self,
        model: nn.Module,
        config: MuonConfig | None = None,
        *,
        adamw: AdamWConfig | None = None,
        qk_clip: QKClip | None = None,
        predicate: Predicate | None = None,
        **settings,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        self.config, adamw = _configs(config, adamw, settings)
        self.matrices = self._matrix_set(model, predicate)
        self._qk_biases: dict[str, tuple[nn.Parameter, torch.Tensor | None, int]] = {}
        if qk_clip is not None:
            self._check_qk_clip(qk_clip)
            self._qk_biases = self._locate_qk_biases(model, qk_clip)
        check_ns(self.config, self.matrices.device)
        muon_ids = {id(p) for p in self.matrices.params}
        adamw_params = [p for p in model.parameters() if p.requires_grad and id(p) not in muon_ids]
        if not self.matrices.params and not adamw_params:
            raise ValueError("model has no trainable parameters")
        self.qk_clip = qk_clip
        self.ns_matrices = 0
        c = self.config
        muon_group = {
            "params": self.matrices.params,
            "use_muon": True,
            "lr": c.lr,
            "momentum": c.momentum,
            "nesterov": c.nesterov,
            "weight_decay": c.weight_decay,
            "ns_steps": c.ns_steps,
            "ns_coefficients": c.ns_coefficients,
            "adjust_lr_fn": c.adjust_lr_fn,
            "variant": c.variant,
            "normuon_beta2": c.normuon_beta2,
        }
        adamw_group = {
            "params": adamw_params,
            "use_muon": False,
            "lr": adamw.lr,
            "betas": adamw.betas,
            "eps": adamw.eps,
            "weight_decay": adamw.weight_decay,
        }
        super().__init__([muon_group, adamw_group], {"lr": c.lr})
        self._adamw = self._make_adamw(adamw_params, adamw)
        self.matrices.prepare()
        self.ns: NSChoice = choose_ns(
            c,
            self.matrices.device,
            lambda dtype: self.matrices.ns_workload(c.ns_backend, dtype, c.ns_steps),
            self.matrices.gather,
        )
        if c.variant == "normuon":
            logger.info(
                "Muon: NorMuon, each update normalized per row (second-moment beta2 %g)",
                c.normuon_beta2,
            )
        if qk_clip is not None:
            logger.info(
                "Muon: QK-clip on %d attention layers (threshold %g, alpha %g)",
                len(qk_clip.attentions),
                qk_clip.threshold,
                qk_clip.alpha,
            )

    def _matrix_set(self, model: nn.Module, predicate: Predicate | None) -> MatrixSet:
        """The one place that tells a dedicated model from a one-process one."""
        dedication = get_dedication(model)
        if dedication is None:
            selected = select_matrices(model, predicate or (lambda n, p: p.ndim == 2))
            return LocalMatrices(selected, self.config)
        if predicate is not None:
            raise ValueError(
                "predicate: the model was prepared by dedicate_params, whose predicate "
                "selects the Muon parameters; do not pass one to Muon as well"
            )
        return OwnedMatrices(dedication, self.config)

    def _check_qk_clip(self, qk_clip: QKClip) -> None:
        if not isinstance(qk_clip, QKClip):
            raise TypeError(f"qk_clip must be a QKClip, got {type(qk_clip).__name__}")
        names = set(self.matrices.names)
        outside = [name for name in qk_clip.weight_names if name not in names]
        if outside:
            raise ValueError(
                f"qk_clip: {outside[0]} is not a Muon matrix of this model (QK-clip "
                "rescales the query and key projections on their owner after Muon's "
                "update); select it for Muon or leave it out of the clipped attentions"
            )
        blocked = sorted(set(qk_clip.weight_names) & self.matrices.row_blocked())
        if blocked:
            raise ValueError(
                f"qk_clip: {blocked[0]} has more rows than columns and is owned by an owner "
                "group in blocks of its rows, whose heads QK-clip cannot place yet; pass "
                "owner_group_size=1 to dedicate_params ([dmuon] owner_group_size = 1)"
            )
        qk_clip.check_rows(self.matrices.local_rows())

    def _locate_qk_biases(
        self, model: nn.Module, qk_clip: QKClip
    ) -> dict[str, tuple[nn.Parameter, torch.Tensor | None, int]]:
        """Each clipped bias, the row of each of its entries here among its weight's rows
        here (None: all, in order) and their count; a layout refused on one rank is
        refused on every rank of the dedication alike (one small all-gather), before the
        first step.

        Raises:
            ValueError: A bias whose entries cannot be located, naming it and why.
        """
        if not qk_clip.bias_rows:
            return {}
        local_rows = self.matrices.local_rows()
        located, error = {}, None
        for rows in qk_clip.bias_rows:
            bias = model.get_parameter(rows.bias)
            try:
                index = bias_entries(
                    model.get_parameter(rows.name), bias, rows, local_rows[rows.name]
                )
            except ValueError as e:
                error = error or str(e)
                continue
            located[rows.bias] = (bias, index, local_rows[rows.name])
        if self.matrices.gather is not None:
            errors = [e for e in self.matrices.gather(error) if e is not None]
            error = errors[0] if errors else None
        if error is not None:
            raise ValueError(error)
        return located

    def _make_adamw(
        self, adamw_params: list[nn.Parameter], adamw: AdamWConfig
    ) -> torch.optim.AdamW | None:
        """An AdamW over ``param_groups[1]`` that shares its dict and our state."""
        if not adamw_params:
            return None
        group = self.param_groups[1]
        device_types = {p.device.type for p in adamw_params}
        fused = adamw.fused
        if (
            fused is None
            and not adamw.foreach
            and device_types <= set(_get_fused_kernels_supported_devices())
            and all(p.dtype.is_floating_point for p in adamw_params)
            # The fused kernel takes DTensors or plain tensors, not both in one call.
            and len({isinstance(p, DTensor) for p in adamw_params}) == 1
        ):
            fused = True
        inner = torch.optim.AdamW(
            [{"params": group["params"]}],
            lr=group["lr"],
            betas=group["betas"],
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            foreach=adamw.foreach,
            fused=fused,
        )
        for key, value in inner.param_groups[0].items():
            group.setdefault(key, value)
        inner.param_groups = [group]
        inner.state = self.state
        return inner

    def _adamw_step(self, found_inf: torch.Tensor | None) -> None:
        """The inner AdamW's step; ``found_inf`` skips it, its step counts included: on the
        device with the fused kernel (through the attribute ``GradScaler`` sets), read on
        the host with the others, which cannot."""
        if found_inf is None:
            self._adamw.step()
            return
        if not self._adamw.defaults["fused"]:
            if not found_inf.item():
                self._adamw.step()
            return
        self._adamw.found_inf = found_inf.float()
        try:
            self._adamw.step()
        finally:
            del self._adamw.found_inf

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        self.matrices.zero_grad()
        if self.qk_clip is not None:  # a new accumulation: the old passes' maxima go
            self.qk_clip.reset()

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        # The base class rebuilt the group dicts and the state: share them again.
        if self._adamw is not None:
            self._adamw.param_groups = [self.param_groups[1]]
            self._adamw.state = self.state

    @torch.no_grad()
    def step(self, closure=None, found_inf: torch.Tensor | None = None):
        """Perform one optimization step.

        Distributed, each rank orthogonalizes only the matrices it owns (those whose
        reduced gradient it holds); the new values reach the other ranks by broadcast.

        Transactional, without a host barrier: every rank first computes its
        orthogonalized updates without changing anything; the ranks then settle on the
        device whether any of them failed (one small all-reduce per group, queued behind
        the computation, as ``found_inf``), and every write (parameters, momentum, AdamW's
        state) is masked by that verdict. A step that failed on some rank changes nothing
        on any rank, and every rank raises :class:`MuonStepError` at its next call of
        ``step()``, before anything else (the host reads the verdict then, long after the
        device produced it); the reduced gradients of that next backward are kept, so
        ``step()`` may be called again, or ``zero_grad()`` to drop them. The rank that
        failed logs its error at once. Under tensor parallelism (and owner groups) the
        matrices stepped alone go first, and the holders that run the next phase's
        collectives together agree on the host before it (a group of at most a node's
        ranks), so a rank that failed never leaves its peers waiting in them; a failure on
        one of them *between* the collectives of one sharded Newton-Schulz still does
        (until the process group's timeout). A failed step's writes are exact for finite
        gradients (the masks enter the update's arithmetic); non-finite ones must come
        with ``found_inf``.

        Args:
            closure: Reevaluates the model and returns the loss (optional).
            found_inf: A 0-dim tensor on the device whose nonzero value skips the step,
                decided on the device (no host sync): parameters, momentum, NorMuon's
                second moments and AdamW's state stay bitwise as they were (QK-clip rescales
                nothing). AdamW's fused kernel takes it as under ``GradScaler``; the
                for-loop and foreach ones cannot, so with those it is read on the host
                (as is, distributed, the step's verdict: one host sync a step).

        Raises:
            MuonStepError: The previous step failed on some rank of the dedication (and
                changed nothing).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if found_inf is not None and self._adamw is not None and not self._adamw.defaults["fused"]:
            # One host sync: this AdamW cannot skip on the device. The step is then not
            # taken at all, as before device-side skipping existed.
            if found_inf.item():
                return loss
            found_inf = None
        group = self.param_groups[0]
        beta2 = group["normuon_beta2"] if group["variant"] == "normuon" else None
        self.matrices.begin_step()
        phases = self.matrices.step_phases(self.ns)
        qk_maxima = None
        if self.qk_clip is not None:
            qk_maxima = self.matrices.reduce_max(self.qk_clip.maxima(self.matrices.device))
        try:
            pending, skip = self.matrices.computed(
                phases,
                lambda g: compute_group(
                    g,
                    self.state,
                    momentum=group["momentum"],
                    nesterov=group["nesterov"],
                    normuon_beta2=beta2,
                ),
                found_inf,
            )
        finally:
            if qk_maxima is not None:
                qk_maxima = qk_maxima()
        for update in pending:
            self.ns_matrices += commit_group(
                update,
                self.state,
                lr=group["lr"],
                weight_decay=group["weight_decay"],
                adjust_lr_fn=group["adjust_lr_fn"],
                skip=skip,
                nonfinite_skipped=found_inf is not None,
            )
        if qk_maxima is not None:
            with record_function("muon::qk_clip"):
                self.matrices.clip_qk(self.qk_clip, qk_maxima, skip)
        if self._adamw is not None:
            self._adamw_step(skip)
        if self._qk_biases:
            # After the biases' AdamW update, as the weights' clip after Muon's.
            with record_function("muon::qk_clip_biases"):
                self.qk_clip.clip_biases(
                    {
                        name: (bias.to_local() if isinstance(bias, DTensor) else bias, i, n)
                        for name, (bias, i, n) in self._qk_biases.items()
                    }
                )
        self.matrices.end_step()
        return loss
