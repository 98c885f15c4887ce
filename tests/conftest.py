"""Test-session setup shared by all test modules.

Without a GPU, the Triton kernels run under Triton's CPU interpreter. ``triton.jit`` reads
``TRITON_INTERPRET`` when it decorates a kernel, so it is set here, before any test module
imports the kernels.

Nothing a test runs writes into the user's home: ``ns_backend="auto"``'s timing cache and
the datasets library's cache (TorchTitan's loader) live in a folder of the session's.
Every test gets an empty timing cache of its own (inherited by the ranks and TorchTitan
runs it starts), so that no test reads what an earlier test or the user measured; the
session's folder serves what runs before a test's own fixtures (module-scoped ones).
"""

import atexit
import importlib.metadata
import os
import shutil
import tempfile

import pytest
import torch

# Before anything imports triton (torchtitan_dmuon does): triton.jit decorates triton's own
# helpers (tl.cdiv, tl.sum, ...) in compiled mode otherwise, and an interpreted kernel
# calling them fails ("Cannot call @triton.jit'd outside of the scope of a kernel").
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from torchtitan_dmuon.titan.version import adapter_for  # noqa: E402


def _adapter() -> str | None:
    """The adapter of the installed TorchTitan (None: none installed, or unsupported)."""
    try:
        return adapter_for(importlib.metadata.version("torchtitan"))
    except importlib.metadata.PackageNotFoundError:
        return None


# Each adapter's tests run beside its TorchTitan: tests/titan (and the tools', which run the
# 0.2.2 trainer) beside 0.2.2, tests/titan03 beside 0.3.0 (TORCHTITAN_VERSION=0.3.0
# ./run_tests.sh); tests/engine and tests/optim import no TorchTitan and run beside either,
# but for two that save through the 0.2.2 adapter's DCP wrapper (tests/tools/test_layers.py).
if _adapter() == "torchtitan_dmuon.titan03":
    collect_ignore = [
        "titan",
        "tools",
        "engine/test_expert_checkpoint.py",
        "engine/test_owner_groups.py",
    ]
else:
    collect_ignore = ["titan03"]

_SESSION_DIR = tempfile.mkdtemp(prefix="torchtitan-dmuon-tests-")
atexit.register(shutil.rmtree, _SESSION_DIR, ignore_errors=True)
os.environ["TORCHTITAN_DMUON_CACHE_DIR"] = os.path.join(_SESSION_DIR, "auto_cache")
os.environ["HF_DATASETS_CACHE"] = os.path.join(_SESSION_DIR, "hf_datasets")


@pytest.fixture(autouse=True)
def _own_auto_cache(monkeypatch, tmp_path_factory):
    monkeypatch.setenv("TORCHTITAN_DMUON_CACHE_DIR", str(tmp_path_factory.mktemp("auto_cache")))
