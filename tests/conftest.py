"""Test-session setup shared by all test modules.

Without a GPU, the Triton kernels run under Triton's CPU interpreter. ``triton.jit`` reads
``TRITON_INTERPRET`` when it decorates a kernel, so it is set here, before any test module
imports the kernels. ``ns_backend="auto"`` timings go to a cache folder of the session's
(inherited by the ranks and TorchTitan runs it starts), not the user's.
"""

import atexit
import os
import shutil
import tempfile

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if "TORCHTITAN_DMUON_CACHE_DIR" not in os.environ:
    cache = tempfile.mkdtemp(prefix="torchtitan-dmuon-test-cache-")
    os.environ["TORCHTITAN_DMUON_CACHE_DIR"] = cache
    atexit.register(shutil.rmtree, cache, ignore_errors=True)
