"""The peer Muon optimizers of benchmarks/peers.py train the tiny model on 2 gloo ranks.

Does not import torchtitan_dmuon (which patches FSDP2 globally): the peers must see stock
FSDP2.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest

from tests.support.dist import run_distributed
from tests.support.models import batch, loss_fn, make_model, proj_predicate

PEERS_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "peers.py"
WORLD = 2
STEPS = 3


def _load_peers():
    # benchmarks/ is not a package; load peers.py from its path (once per process).
    mod = sys.modules.get("_bench_peers")
    if mod is None:
        spec = importlib.util.spec_from_file_location("_bench_peers", PEERS_PATH)
        mod = importlib.util.module_from_spec(spec)
        sys.modules["_bench_peers"] = mod
        spec.loader.exec_module(mod)
    return mod


def _train_peer(rank: int, world: int, name: str, lr: float, adamw_lr: float) -> list[float]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    peers = _load_peers()
    mesh = init_device_mesh("cpu", (world,))
    model = make_model(seed=0)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = peers.PEERS[name](model, mesh, lr, 0.95, adamw_lr, proj_predicate)
    inputs, targets = batch(seed=rank)  # one fixed batch per rank, repeated every step
    losses = []
    for _ in range(STEPS):
        loss = loss_fn(model, inputs, targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


# Muon LRs on each peer's own scale: muon-fsdp2 scales updates to AdamW RMS (rms_scale),
# dtensor-muon uses the original Muon scale.
CASES = {"muon-fsdp2": (0.01, 0.01), "dtensor-muon": (0.05, 0.01)}


@pytest.mark.parametrize("name", sorted(CASES))
def test_peer_trains_on_gloo(name: str) -> None:
    peers = _load_peers()
    reason = peers.peer_status(name, "cpu")
    if reason is not None:
        pytest.skip(reason)
    lr, adamw_lr = CASES[name]
    results = run_distributed(_train_peer, WORLD, name, lr, adamw_lr)
    for rank, losses in enumerate(results):
        assert len(losses) == STEPS
        assert all(math.isfinite(x) for x in losses), (rank, losses)
        assert losses[-1] < losses[0], (rank, losses)


def test_registry_and_status() -> None:
    peers = _load_peers()
    assert set(peers.PEERS) == {"muon-fsdp2", "dtensor-muon"}
    assert "unknown peer" in peers.peer_status("nope")
    for name in peers.PEERS:
        reason = peers.peer_status(name, "cpu")
        assert reason is None or isinstance(reason, str) and reason


def test_builders_reject_without_collectives() -> None:
    """One-process checks that need no process group."""
    peers = _load_peers()
    if peers.peer_status("muon-fsdp2", "cpu") is not None:
        pytest.skip(peers.peer_status("muon-fsdp2", "cpu"))

    class _FakeMesh:
        def __init__(self, ndim: int, size: int) -> None:
            self.ndim, self._size = ndim, size

        def size(self) -> int:
            return self._size

    build = peers.build_muon_fsdp2
    with pytest.raises(ValueError, match="1-D"):
        build(make_model(), _FakeMesh(2, 4), 0.02, 0.95, 1e-3, proj_predicate)
    with pytest.raises(ValueError, match="divisible"):
        build(make_model(), _FakeMesh(1, 3), 0.02, 0.95, 1e-3, proj_predicate)
