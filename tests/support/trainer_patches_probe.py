"""Runs TorchTitan's ``main`` with ``DMuonTrainer`` in this process, twice (a completed run,
then one that fails while the trainer is built: ``ns_backend="triton"`` on a CPU),
and prints as JSON whether every name the trainer's patch registry replaced is the
original again after each. Started by ``tests/titan/test_titan_patches.py`` as a one-rank job
(no torchrun)."""

import json
import sys

import torch
from torchtitan.config import ConfigManager
from torchtitan.train import main

from torchtitan_dmuon.titan.patches import PatchRegistry
from torchtitan_dmuon.titan.train import DMuonTrainer

patched: list[tuple[object, str, object, object]] = []
"""Each name a patch registry replaced: target, name, original, patch."""

_registry_setattr = PatchRegistry.setattr


def _recording_setattr(self, target: object, name: str, value: object) -> None:
    patched.append((target, name, getattr(target, name, PatchRegistry.MISSING), value))
    _registry_setattr(self, target, name, value)


PatchRegistry.setattr = _recording_setattr  # this probe's process only


def restored() -> dict[str, bool]:
    """Per replaced name, whether it is its first original again (a name replaced twice
    recorded the first patch as the second's original)."""
    out, seen = {}, set()
    for target, name, original, _ in patched:
        if (id(target), name) in seen:
            continue
        seen.add((id(target), name))
        if original is PatchRegistry.MISSING:  # an instance attribute: gone again
            out[_label(target, name)] = name not in vars(target)
        else:
            # == : an instance's original method is a bound method, made anew per lookup
            out[_label(target, name)] = getattr(target, name) == original
    return out


def _label(target: object, name: str) -> str:
    return f"{getattr(target, '__name__', type(target).__name__)}.{name}"


def fail_building(args: list[str]) -> str | None:
    """Build the trainer as ``main`` does (its ``parse_args`` reads the command line it saw
    at import), from ``args``; the error it raises, as text."""
    try:
        DMuonTrainer(ConfigManager().parse_args(args))
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return None


if __name__ == "__main__":
    originals = {"torch.histc": torch.histc, "torch.profiler.profile": torch.profiler.profile}
    args = sys.argv[1:]
    main(DMuonTrainer)
    replaced = sorted({_label(target, name) for target, name, *_ in patched})
    after_completed = restored()
    failing_error = fail_building([*args, "--dmuon.ns_backend", "triton"])
    print(
        "PROBE "
        + json.dumps(
            {
                "replaced": replaced,
                "were_patched": all(patch is not orig for _, _, orig, patch in patched),
                "after_completed": after_completed,
                "failing_error": failing_error,
                "after_failing": restored(),
                "torch_originals": torch.histc is originals["torch.histc"]
                and torch.profiler.profile is originals["torch.profiler.profile"],
            }
        )
    )
