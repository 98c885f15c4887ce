"""Test-session setup shared by all test modules.

Without a GPU, the Triton kernels run under Triton's CPU interpreter. ``triton.jit`` reads
``TRITON_INTERPRET`` when it decorates a kernel, so it is set here, before any test module
imports the kernels.

``ns_backend="auto"`` keeps its timings in a cache folder: every test gets an empty one of
its own (inherited by the ranks and TorchTitan runs it starts), so that no test reads what
an earlier test or the user's own runs measured.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _own_auto_cache(monkeypatch, tmp_path_factory):
    monkeypatch.setenv("TORCHTITAN_DMUON_CACHE_DIR", str(tmp_path_factory.mktemp("auto_cache")))
