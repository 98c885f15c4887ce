"""Test-session setup shared by all test modules.

Without a GPU, the Triton kernels run under Triton's CPU interpreter. ``triton.jit`` reads
``TRITON_INTERPRET`` when it decorates a kernel, so it is set here, before any test module
imports the kernels.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
