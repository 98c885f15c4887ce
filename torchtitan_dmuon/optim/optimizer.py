"""``Muon``: Muon for matrices and torch's AdamW for the rest, over a matrix set.

A thin :class:`torch.optim.Optimizer` over the functional core of
:mod:`torchtitan_dmuon.optim.muon` and the :class:`~torchtitan_dmuon.optim.matrices.MatrixSet`
it is given: ``LocalMatrices`` (one process) or the engine's ``OwnedMatrices`` (each rank
steps only the matrices it owns); the package's ``torchtitan_dmuon.Muon`` picks which.
QK-clip runs as a step of its own (:class:`~torchtitan_dmuon.optim.qk_clip_step.QKClipStep`).
Its settings are one :class:`~torchtitan_dmuon.optim.config.MuonConfig` and one
:class:`~torchtitan_dmuon.optim.config.AdamWConfig`, given whole or built from keywords.
This module does not import ``torch.distributed`` or the engine.

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
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

from torchtitan_dmuon.optim.config import AdamWConfig, MuonConfig
from torchtitan_dmuon.optim.matrices import MatrixSet, MuonStepError, local_view
from torchtitan_dmuon.optim.muon import commit_group, compute_group
from torchtitan_dmuon.optim.ns_choice import NSChoice, check_ns, choose_ns
from torchtitan_dmuon.optim.qk_clip import QKClip
from torchtitan_dmuon.optim.qk_clip_step import BiasEntries, QKClipStep

__all__ = ["Muon", "MuonStepError", "muon_configs"]

logger = logging.getLogger(__name__)

_MUON_FIELDS = {f.name for f in dataclasses.fields(MuonConfig)}
_ADAMW_FIELDS = {f.name for f in dataclasses.fields(AdamWConfig)}


def muon_configs(
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
    """Muon for the matrices of a matrix set and AdamW for every other trainable
    parameter of the model (``torchtitan_dmuon.Muon`` builds it from a model).

    Args:
        model: The model to optimize.
        matrices: Its Muon matrices as this rank steps them.
        config: Muon's settings.
        adamw: The inner AdamW's settings.
        qk_clip: QK-clip (Kimi K2's MuonClip, see :class:`~torchtitan_dmuon.QKClip`):
            after each update the query and key projections of the heads whose largest
            logit exceeded its threshold are rescaled, on their owner, before the
            broadcast, and their biases (if any) with them after AdamW's update, by every
            rank on the entries it holds; the per-head maxima are MAX-reduced over the
            data-parallel ranks (one collective per step, overlapping Newton-Schulz). Its
            weights must be Muon matrices. None: off.
        bias_entries: Where a clipped bias's entries lie among its heads' rows on this
            rank (the layout of ``matrices``); needed with ``qk_clip``.

    Attributes:
        config: The Muon settings in force.
        matrices: The matrix set given.
        ns: The Newton-Schulz every rank runs (:class:`~torchtitan_dmuon.optim.ns_choice.NSChoice`):
            dtype and why, backend and what ``"auto"`` picked. With ``"auto"`` dtype or
            backend, decided in this constructor, agreed by every rank of the matrix set
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
        matrices: MatrixSet,
        config: MuonConfig,
        adamw: AdamWConfig,
        *,
        qk_clip: QKClip | None = None,
        bias_entries: BiasEntries | None = None,
    ) -> None:
        self.config, self.matrices = config, matrices
        self._qk_step = None
        if qk_clip is not None:
            if bias_entries is None:
                raise ValueError("qk_clip needs bias_entries: the matrix set's bias layout")
            self._qk_step = QKClipStep(qk_clip, model, matrices, bias_entries)
        check_ns(self.config, self.matrices.device)
        fused = [n for n, f in zip(matrices.names, matrices.fused, strict=True) if f is not None]
        if config.variant == "normuon" and fused:
            raise ValueError(
                f"variant='normuon': NorMuon normalizes each matrix as a whole, and {fused[0]} "
                "holds fused matrices (mark_fused_rows): use variant='muon', or unfused "
                "parameters"
            )
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
            and len({local_view(p) is p for p in adamw_params}) == 1
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
        if self._qk_step is not None:
            self._qk_step.reset()

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
        if self._qk_step is not None:
            self._qk_step.begin()
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
            if self._qk_step is not None:
                self._qk_step.wait()
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
        if self._qk_step is not None:
            self._qk_step.clip_weights(skip)
        if self._adamw is not None:
            self._adamw_step(skip)
        if self._qk_step is not None:
            self._qk_step.clip_biases()
        self.matrices.end_step()
        return loss
