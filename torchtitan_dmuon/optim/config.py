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
from types import UnionType
from typing import ClassVar, Literal, Union, get_args, get_origin, get_type_hints

import torch

from torchtitan_dmuon.optim.newton_schulz import EPS, NSSchedule, resolve_ns_schedule

__all__ = ["AdamWConfig", "MuonConfig"]

NSDtypeName = Literal["auto", "bfloat16", "float16", "float32", "float64"]


def _matches(value, hint) -> bool:
    """Whether ``value`` is of type ``hint`` as a TOML file or a flag must give it: a bool
    is not a number and a string is neither a bool, a number nor a list."""
    origin, args = get_origin(hint), get_args(hint)
    if origin is Literal:
        return any(type(value) is type(choice) and value == choice for choice in args)
    if origin in (Union, UnionType):
        return any(_matches(value, arm) for arm in args)
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if origin is list:
        return isinstance(value, list) and all(_matches(v, args[0]) for v in value)
    if origin is tuple:
        if not isinstance(value, tuple):
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            return all(_matches(v, args[0]) for v in value)
        return len(value) == len(args) and all(map(_matches, value, args))
    return isinstance(value, hint)


def _describe(hint) -> str:
    """``hint`` in an error message."""
    origin, args = get_origin(hint), get_args(hint)
    if origin is Literal:
        return f"one of {args}"
    if origin in (Union, UnionType):
        return " or ".join(_describe(arm) for arm in args)
    if hint is type(None):
        return "None"
    if origin is list:
        return f"a list of {_describe(args[0]).removeprefix('a ').removeprefix('an ')}"
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return "(a, b, c) triples" if get_args(args[0]) == (float,) * 3 else "a tuple"
    if origin is tuple:
        return f"a tuple of {len(args)} {args[0].__name__}s"
    name = hint.__name__
    return f"an {name}" if name[0] in "aeiou" else f"a {name}"


def _check_types(config: object, where: str, prefix: str = "") -> None:
    """Every field of ``config`` holds a value of its type (a TOML value reaches a
    dataclass unchecked).

    Raises:
        ValueError: A string that is not one of a choice field's choices.
        TypeError: Any other value of the wrong type, naming the field (as ``prefix`` +
            its name) and the type it takes.
    """
    hints = get_type_hints(type(config))
    for f in fields(config):
        hint, value = hints[f.name], getattr(config, f.name)
        if _matches(value, hint):
            continue
        message = f"{where}{prefix}{f.name} must be {_describe(hint)}, got {value!r}"
        arms = get_args(hint) if get_origin(hint) in (Union, UnionType) else (hint,)
        if isinstance(value, str) and any(get_origin(arm) is Literal for arm in arms):
            raise ValueError(message)
        raise TypeError(message)


def _check_range(where: str, value: float | None, low: float, high: float | None = None) -> None:
    """``low <= value < high`` (``high`` None: no upper bound); ``value``'s type was
    checked (``_check_types``) before. None (a setting a subclass leaves unset, to be
    filled from elsewhere) passes."""
    if value is None:
        return
    ok = value >= low and (high is None or value < high)
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
    gram and auto may use the Gram all-reduce path; torch and triton gather the matrix.
    On CPU, whichever the backend, same-shape matrices that fit a core's cache run one at
    a time where that was timed faster than batched (timed at each start, not cached)."""

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
        if isinstance(coefficients, (list, tuple)):
            # One triple or a list of them, as float tuples: hashable, and a TOML array is a
            # list (what is not numbers is left for the type check to name).
            if coefficients and all(_matches(v, float) for v in coefficients):
                coefficients = (coefficients,)
            object.__setattr__(
                self,
                "ns_coefficients",
                tuple(
                    tuple(float(v) if _matches(v, float) else v for v in t)
                    if isinstance(t, (list, tuple))
                    else t
                    for t in coefficients
                ),
            )
        where = self.where
        _check_types(self, where)
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
        if isinstance(self.betas, list):
            object.__setattr__(self, "betas", tuple(self.betas))
        _check_types(self, "", prefix="adamw_")
        _check_range("adamw_lr", self.lr, 0.0)
        _check_range("adamw_betas[0]", self.betas[0], 0.0, 1.0)
        _check_range("adamw_betas[1]", self.betas[1], 0.0, 1.0)
        _check_range("adamw_eps", self.eps, 0.0)
        _check_range("adamw_weight_decay", self.weight_decay, 0.0)
