"""The TorchTitan 0.2.2 adapter: thin glue between TorchTitan 0.2.2 and the ownership engine.

* ``version.py``: the TorchTitan found, checked by each module below that imports it
  (0.3's is ``torchtitan_dmuon.titan03``; another release is refused by name);
* ``spec.py``: every train spec TorchTitan looks up, with DMuon (``train_spec``,
  ``register``, reachable here);
* ``config.py``: the ``[dmuon]`` TOML section;
* ``parallelize.py``: runs ``dedicate_params`` right before TorchTitan's FSDP, and lets
  pipeline stages drive their parts' dedications;
* ``optimizer.py``: the optimizer container and builder;
* ``checkpoint.py``: topology-independent model state for DCP;
* ``cpu.py``: the CPU (gloo) layer;
* ``patches.py``: the registry every replacement of a torch or TorchTitan name goes
  through, undone when the trainer ends;
* ``train.py``: the training entry point (``run_train.sh`` runs it).

This package's own import reads no TorchTitan: the TorchTitan-free parts (the ``[dmuon]``
section, the selection rules, the patch registry) serve the 0.3 adapter too.
"""

from __future__ import annotations

__all__ = ["register", "train_spec"]


def __getattr__(name: str):
    # The spec functions import TorchTitan 0.2.2: only when asked for.
    if name in __all__:
        from torchtitan_dmuon.titan import spec

        return getattr(spec, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
