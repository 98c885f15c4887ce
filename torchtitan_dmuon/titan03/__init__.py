"""The TorchTitan 0.3 adapter: DMuon through TorchTitan 0.3's public extension points.

TorchTitan 0.3 has no TOML, train-spec registry or custom import (``titan/version.py``
checks which TorchTitan is installed). A job is ``--module M --config F``, ``F`` returning
a ``Trainer.Config``; this adapter plugs in there:

* ``trainer.py``: :func:`with_dmuon` turns any ``Trainer.Config`` into a
  :class:`DMuonTrainer.Config`: the ``[dmuon]`` settings as its ``dmuon`` section
  (``--dmuon.*`` flags), AdamW's settings from the config's own AdamW group, the model
  spec's ``parallelize_fn`` wrapped;
* ``config_registry.py``: ``--module torchtitan_dmuon.titan03 --config <any TorchTitan
  config function>`` is that config with DMuon, and ``llama3_debug_cpu`` the default run
  of ``run_train.sh``;
* ``parallelize.py``: dedicates right before ``apply_fsdp_to_decoder`` (every 0.3 decoder's
  FSDP), on the data-parallel axes of the storage mesh found by name; marks fused QKV;
* ``optimizer.py``: the optimizer container (``titan/container.py``'s methods on 0.3's
  ``OptimizersContainer``);
* ``cpu.py``: the CPU (gloo) layer, through ``titan/patches.py``'s registry.
"""

from torchtitan_dmuon.titan.version import check_torchtitan

check_torchtitan("torchtitan_dmuon.titan03")  # before any TorchTitan import

from torchtitan_dmuon.titan03.trainer import DMuonTrainer, with_dmuon  # noqa: E402

__all__ = ["DMuonTrainer", "with_dmuon"]
