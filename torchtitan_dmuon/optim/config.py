"""``MuonConfig`` and ``AdamWConfig``: every setting of the optimizer, declared once.

``Muon(model, lr=..., ...)`` builds them from its keywords, ``Muon(model, config)`` takes
them whole, and TorchTitan's ``[dmuon]`` TOML section *is* a ``MuonConfig`` (a subclass
adding what only the trainer reads), so a new setting is one field here, with its
docstring, its type and its check. Both are frozen (like FSDP2's
``MixedPrecisionPolicy``) and validated once, when built, with errors naming the field.

This module does not import ``torch.distributed``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import ClassVar, Literal, get_args, get_origin, get_type_hints

import torch

from torchtitan_dmuon.optim.newton_schulz import EPS, NS_PRESETS, NSSchedule, resolve_ns_schedule

__all__ = ["AdamWConfig", "MuonConfig"]

NSDtypeName = Literal["auto", "bfloat16", "float16", "float32", "float64"]


def _check_literals(config: object, where: str) -> None:
    """Every ``Literal`` field of ``config`` holds one of its choices (a TOML value reaches
    a dataclass unchecked)."""
    hints = get_type_hints(type(config))
    for f in fields(config):
        if get_origin(hints[f.name]) is not Literal:
            continue
        choices, value = get_args(hints[f.name]), getattr(config, f.name)
        if value not in choices:
            raise ValueError(f"{where}{f.name} must be one of {choices}, got {value!r}")


def _check_range(where: str, value: float, low: float, high: float | None = None) -> None:
    """``low <= value < high`` (``high`` None: no upper bound)."""
    ok = isinstance(value, (int, float)) and value >= low and (high is None or value < high)
    if not ok:
        bound = f"[{low}, {high})" if high is not None else f">= {low}"
        raise ValueError(f"{where} must be {bound}, got {value!r}")


@dataclass(frozen=True)
class MuonConfig:
    """How Muon steps the matrix parameters.

    Every field is also a key of TorchTitan's ``[dmuon]`` section (and a
    ``--dmuon.<field>`` flag), with this docstring as its help text.
    """

    where: ClassVar[str] = ""
    """What errors call a field: ``""`` in Python, ``"[dmuon] "`` in the TOML section."""

    lr: float = 0.02
    """Muon learning rate (before adjust_lr_fn); an LR scheduler scales it like AdamW's."""

    momentum: float = 0.95
    """Muon EMA momentum, in [0, 1)."""

    nesterov: bool = True
    """Nesterov look-ahead for Muon."""

    weight_decay: float = 0.0
    """Decoupled weight decay of the Muon matrices."""

    ns_steps: int = 5
    """Newton-Schulz iterations."""

    ns_coefficients: (
        Literal["quintic", "polar_express"] | tuple[tuple[float, float, float], ...]
    ) = "quintic"
    """Newton-Schulz coefficients: the preset quintic or polar_express, or (a, b, c)
    triples, one per step (a shorter list repeats its last triple)."""

    ns_dtype: NSDtypeName = "auto"
    """Newton-Schulz compute dtype: auto, bfloat16, float16, float32 or float64 (in Python
    also a torch.dtype). auto: bf16 where the device multiplies bf16 natively and fast
    (CUDA; CPUs with AVX512-BF16 or AMX, confirmed by a short probe), fp32 elsewhere (a CPU
    with AVX2 only multiplies bf16 tens of times slower); decided once per job, agreed by
    every rank, logged with the reason (see torchtitan_dmuon.optim.ns_choice)."""

    ns_backend: Literal["torch", "triton", "gram", "auto"] = "torch"
    """Newton-Schulz implementation: torch, triton, gram or auto (per matrix shape the
    fastest correct one, timed before step 1 by the ranks that run the shape and agreed by
    all; the timings are cached on disk, in $TORCHTITAN_DMUON_CACHE_DIR or
    ~/.cache/torchtitan_dmuon, so a second run measures nothing). Under tensor parallelism
    gram and auto may use the Gram all-reduce path; torch and triton gather the matrix."""

    adjust_lr_fn: Literal["original", "match_rms_adamw", "spectral"] = "original"
    """Per-shape learning-rate scaling: original (sqrt(max(1, rows/cols)), Keller Jordan's),
    match_rms_adamw (0.2 sqrt(max(rows, cols)), Moonshot's) or spectral (sqrt(rows/cols));
    None in Python means original."""

    variant: Literal["muon", "normuon"] = "muon"
    """muon, or normuon: NorMuon (arXiv:2510.05491), each orthogonalized update divided
    row by row by the root of an EMA of its rows' mean squares, then rescaled to its own
    Frobenius norm (so lr and adjust_lr_fn keep their meaning); each owner keeps that
    second moment (one value per row, state "second_moment") beside the momentum, saved
    and resharded in checkpoints like it."""

    normuon_beta2: float = 0.95
    """NorMuon's second-moment EMA factor, in [0, 1)."""

    eps: float = EPS
    """Floor of the Newton-Schulz normalizing norm."""

    replicate_async: bool = False
    """HSDP only: broadcast new values across replicas asynchronously after the step, hidden
    behind the next forward (needs dedicate_params(..., replicate_mesh=...))."""

    def __post_init__(self) -> None:
        """Normalize the Python spellings (a torch.dtype, None, lists) and check every field.

        Raises:
            ValueError: A field is out of its range or choices, naming it.
        """
        if isinstance(self.ns_dtype, torch.dtype):
            object.__setattr__(self, "ns_dtype", str(self.ns_dtype).removeprefix("torch."))
        if self.adjust_lr_fn is None:
            object.__setattr__(self, "adjust_lr_fn", "original")
        coefficients = self.ns_coefficients
        if not isinstance(coefficients, str):
            # One triple or a list of them, as tuples: hashable, and a TOML array is a list.
            if coefficients and all(isinstance(v, (int, float)) for v in coefficients):
                coefficients = (coefficients,)
            object.__setattr__(
                self, "ns_coefficients", tuple(tuple(float(v) for v in t) for t in coefficients)
            )
        where = self.where
        _check_literals(self, where)
        if isinstance(self.ns_coefficients, str) and self.ns_coefficients not in NS_PRESETS:
            raise ValueError(
                f"{where}ns_coefficients must be one of {tuple(NS_PRESETS)} or (a, b, c) "
                f"triples, got {self.ns_coefficients!r}"
            )
        try:
            resolve_ns_schedule(self.ns_coefficients, self.ns_steps)
        except ValueError as err:
            raise ValueError(f"{where}{err}") from None
        _check_range(f"{where}lr", self.lr, 0.0)
        _check_range(f"{where}momentum", self.momentum, 0.0, 1.0)
        _check_range(f"{where}weight_decay", self.weight_decay, 0.0)
        _check_range(f"{where}normuon_beta2", self.normuon_beta2, 0.0, 1.0)
        _check_range(f"{where}eps", self.eps, 0.0)

    @property
    def ns_schedule(self) -> NSSchedule:
        """The per-step Newton-Schulz coefficients of ``ns_coefficients`` and ``ns_steps``."""
        return resolve_ns_schedule(self.ns_coefficients, self.ns_steps)


@dataclass(frozen=True)
class AdamWConfig:
    """How the inner ``torch.optim.AdamW`` steps every trainable parameter Muon does not
    take. ``Muon(model, adamw_lr=...)`` sets ``lr`` (each keyword ``adamw_<field>``); in
    TorchTitan, ``[optimizer]`` lr, beta1, beta2, eps, weight_decay and implementation."""

    lr: float = 1e-3
    """AdamW learning rate."""

    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas, each in [0, 1)."""

    eps: float = 1e-8
    """AdamW epsilon."""

    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""

    foreach: bool | None = None
    """``foreach`` of torch.optim.AdamW; None: torch's default."""

    fused: bool | None = None
    """``fused`` of torch.optim.AdamW; None: fused (as TorchTitan's default ``[optimizer]
    implementation``) when torch has a fused kernel for the parameters' devices (CPU and
    CUDA among them), every AdamW parameter is floating point, they are all DTensors or all
    plain tensors and ``foreach`` is not True; torch's default otherwise. The fused kernel
    rounds differently from torch's default."""

    def __post_init__(self) -> None:
        """Check every field.

        Raises:
            ValueError: A field is out of its range, naming it (as the keyword
                ``adamw_<field>`` that sets it).
        """
        object.__setattr__(self, "betas", tuple(self.betas))
        if len(self.betas) != 2:
            raise ValueError(f"adamw_betas must be two numbers, got {self.betas!r}")
        _check_range("adamw_lr", self.lr, 0.0)
        _check_range("adamw_betas[0]", self.betas[0], 0.0, 1.0)
        _check_range("adamw_betas[1]", self.betas[1], 0.0, 1.0)
        _check_range("adamw_eps", self.eps, 0.0)
        _check_range("adamw_weight_decay", self.weight_decay, 0.0)
