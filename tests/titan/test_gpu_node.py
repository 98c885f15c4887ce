"""A checkout set up on a node without GPUs (CPU torch), launched on a node with NVIDIA
GPUs: setup and the trainer stop with the fix instead of training on the CPUs, and
``run_train.sh`` sizes the job from the GPUs it may use. The GPU node is a stand-in
``nvidia-smi`` on PATH (listing GPUs and their MIG slices as the real tool does)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch

from torchtitan_dmuon.titan import cpu
from torchtitan_dmuon.titan.patches import PatchRegistry

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(
    torch.cuda.is_available() or "+cpu" not in torch.__version__,
    reason="the case of a CPU build of torch on a GPU node",
)
NVIDIA_SMI_L = """GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)
  MIG 3g.40gb     Device  0: (UUID: MIG-0)
  MIG 3g.40gb     Device  1: (UUID: MIG-1)
GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-1)
GPU 2: NVIDIA H100 80GB HBM3 (UUID: GPU-2)
GPU 3: NVIDIA H100 80GB HBM3 (UUID: GPU-3)
"""


@pytest.fixture
def gpu_node(tmp_path, monkeypatch) -> dict[str, str]:
    """This machine's environment with a stand-in ``nvidia-smi`` first on PATH."""
    tool = tmp_path / "bin" / "nvidia-smi"
    tool.parent.mkdir()
    tool.write_text(f"#!/bin/sh\ncat <<'LIST'\n{NVIDIA_SMI_L}LIST\n")
    tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tool.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("DMUON_ALLOW_CPU", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("NGPU", raising=False)
    return dict(os.environ)


def _run_train(env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["./run_train.sh", "--training.steps", "1"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def test_run_train_sizes_the_job_from_the_gpus_and_setup_stops_on_cpu_torch(gpu_node):
    """Four GPUs (one split into MIG slices, which are not counted), then two of them
    through CUDA_VISIBLE_DEVICES: run_train.sh prints the command it launches with 4, then
    2 processes and TorchTitan's allocator setting; setup finds the venv's CPU torch and
    stops (exit 1) naming the fix, before anything is launched."""
    everything = _run_train(gpu_node)
    two = _run_train(dict(gpu_node, CUDA_VISIBLE_DEVICES="1,3"))
    for run, processes in ((everything, 4), (two, 2)):
        assert run.returncode == 1, run.stderr[-3000:]
        launched = [line for line in run.stderr.splitlines() if line.startswith("run_train.sh:")]
        assert len(launched) == 1, run.stderr[-3000:]
        assert "PYTORCH_ALLOC_CONF=expandable_segments:True" in launched[0]
        assert f"--nproc_per_node={processes} " in launched[0]
        assert "-m torchtitan_dmuon.titan.train" in launched[0]
        assert "[setup] this node has NVIDIA GPUs (nvidia-smi -L) but" in run.stderr
        assert "+cpu of torch" in run.stderr and "DMUON_TORCH_INDEX_URL" in run.stderr
        assert "DMUON_ALLOW_CPU=1" in run.stderr
        assert "Starting job" not in run.stdout + run.stderr


def test_trainer_refuses_the_cpus_beside_gpus_torch_cannot_use(gpu_node, monkeypatch):
    """Launched without setup (any launcher), the trainer's CPU layer counts the GPUs
    nvidia-smi lists (4, not the MIG slices) and refuses to switch on, naming the fix;
    DMUON_ALLOW_CPU=1 lets it."""
    assert cpu._unused_nvidia_gpus() == 4
    with PatchRegistry() as patches, pytest.raises(RuntimeError) as refused:
        cpu.enable_cpu_support(patches)
    assert "this machine has 4 NVIDIA GPU(s) (nvidia-smi -L), but torch" in str(refused.value)
    assert "./scripts/setup.sh" in str(refused.value) and "DMUON_ALLOW_CPU=1" in str(refused.value)
    monkeypatch.setenv("DMUON_ALLOW_CPU", "1")
    with PatchRegistry() as patches:
        assert cpu.enable_cpu_support(patches)
