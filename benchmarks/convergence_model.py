"""The larger model of ``bench_convergence.py``: TorchTitan's llama3 at dim 512 and 8 layers.

Registered as TorchTitan documents a model of one's own: ``--experimental.custom_import
benchmarks.convergence_model --model.name llama3_bench --model.flavor dim512_l8`` (the
trainer imports this module, which calls ``register_train_spec``). Everything but the
sizes is llama3's own spec: its blocks, tokenizer, data loader and validator. DMuon gives
a model without a selection of its own the 2-D weights of the ``nn.Linear`` layers in its
blocks, which for llama3 are the attention and feed-forward matrices, as for ``llama3``.

``debugmodel`` (dim 256, 6 layers, 16 heads, vocabulary 2048) has 6.2M parameters;
``dim512_l8`` (16 heads: head dimension 32, feed-forward 1536) has 29.4M, 4.8x.
"""

from __future__ import annotations

import dataclasses

from torchtitan.models.llama3 import TransformerModelArgs, get_train_spec
from torchtitan.protocols.train_spec import register_train_spec

NAME = "llama3_bench"
FLAVORS = {
    "dim512_l8": TransformerModelArgs(
        dim=512, n_layers=8, n_heads=16, vocab_size=2048, rope_theta=500000
    ),
}

register_train_spec(NAME, dataclasses.replace(get_train_spec(), model_args=FLAVORS))
