"""The settings of one dedication, given once at ``dedicate_params`` and frozen."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DedicationSettings"]


@dataclass(frozen=True)
class DedicationSettings:
    """How the engine moves the dedicated matrices of one model; frozen: runtime switches
    go through :class:`~torchtitan_dmuon.engine.dedication.Dedication`'s setters.

    Attributes:
        reshard_after_forward: True (Z3): ranks outside a matrix's owner column free it
            after forward and receive it again before backward. False (Z2): they keep it
            until after backward, saving one broadcast per boundary per step.
        replicate_async: HSDP only: broadcast the primaries' new values to the other
            replicas asynchronously after the step; each unit's broadcast is waited on
            right before the unit is next read.
        gradient_divide_factor: Reduced gradients are divided by this. None: the number
            of data-parallel ranks (the mean); 1.0 keeps the sum, for a loss already
            normalized over the global batch (TorchTitan's).
    """

    reshard_after_forward: bool = True
    replicate_async: bool = False
    gradient_divide_factor: float | None = None

    def __post_init__(self) -> None:
        if self.gradient_divide_factor is not None and self.gradient_divide_factor <= 0:
            raise ValueError(
                f"gradient_divide_factor must be > 0, got {self.gradient_divide_factor}"
            )

    def divide_factor(self, ranks: int) -> float:
        return self.gradient_divide_factor if self.gradient_divide_factor else ranks
