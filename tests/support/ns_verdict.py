"""The other kind of CPU's Newton-Schulz dtype verdict, for running the verdict's tests as
that CPU would (``run_tests.sh``)."""

from __future__ import annotations

import torch

from torchtitan_dmuon.optim.ns_choice import local_ns_dtype

__all__ = ["other_verdict"]


def other_verdict(device: torch.device) -> str:
    """The name of the dtype ``"auto"`` does NOT pick on ``device`` (the probe's verdict,
    or ``VERDICT_ENV``'s): the value of ``VERDICT_ENV`` that makes this machine choose as
    the other kind does."""
    return "float32" if local_ns_dtype(device).dtype == torch.bfloat16 else "bfloat16"
