"""Peer Muon implementations for FSDP2, built the way their own READMEs document.

The benchmark compares DMuon against two PyPI packages (installed through this project's
extras, ``pip install -e .[peer-muon-fsdp2]`` / ``.[peer-dtensor-muon]``):

* ``muon-fsdp2==0.3.0`` (module ``muon_fsdp2``): gather-to-owner. Matrix ``i`` of the
  Muon group is owned by rank ``i % world``: every rank ``gather``s its local gradient
  shard to the owner, the owner concatenates the full matrix on dim 0, runs Newton-Schulz
  (``torch.compile``d, bf16) and ``scatter``s the shards back. Non-Muon parameters use its
  own Adam (in the same optimizer, ``use_muon=False`` group). 1-D mesh only.
* ``dtensor-muon==0.1.0`` (module ``dtensor_muon``): its documented ``Muon`` class is
  redundant NS: ``full_tensor()`` (all-gather) of each matrix on every rank, every rank
  orthogonalizes every matrix, then keeps its own shard. Non-Muon parameters use its own
  fused Adam/AdamW (``"algorithm": "adamw"`` group). Its orthogonalization always calls a
  Triton Gram kernel that asserts CUDA tensors, so it cannot run on CPU.

Both return one ``torch.optim.Optimizer`` whose ``step()`` runs collectives: call it on
every rank of the mesh, every step.

The peer packages are imported lazily, so this module imports without them.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["PEERS", "PEER_INFO", "build_dtensor_muon", "build_muon_fsdp2", "peer_status"]

Predicate = Callable[[str, nn.Parameter], bool]

# peer name -> (import name, pinned version, pyproject extra)
PEER_INFO: dict[str, tuple[str, str, str]] = {
    "muon-fsdp2": ("muon_fsdp2", "0.3.0", "peer-muon-fsdp2"),
    "dtensor-muon": ("dtensor_muon", "0.1.0", "peer-dtensor-muon"),
}


def _split(model: nn.Module, predicate: Predicate) -> tuple[list, list]:
    """Trainable parameters split into (Muon matrices, the rest), in model order."""
    muon, other = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (muon if predicate(name, p) else other).append(p)
    return muon, other


def build_muon_fsdp2(
    model: nn.Module,
    mesh: DeviceMesh,
    lr: float,
    momentum: float,
    adamw_lr: float,
    predicate: Predicate,
    *,
    weight_decay: float = 0.0,
    adamw_weight_decay: float = 0.0,
    rms_scale: bool = True,
) -> torch.optim.Optimizer:
    """``muon_fsdp2.Muon`` with a ``use_muon=True`` group (the predicate's matrices) and a
    ``use_muon=False`` group (its built-in Adam, decoupled decay) for everything else.

    ``rms_scale=True`` is the peer's default: the orthogonalized update is scaled by
    ``0.2 * sqrt(max(rows, cols))`` (Moonlight, AdamW-matched RMS), so its ``lr`` is on the
    AdamW scale, not the ``0.02`` scale of the original Muon (``rms_scale=False`` gives the
    original ``sqrt(max(1, rows / cols))``). Nesterov and 5 NS steps are its defaults.
    """
    from muon_fsdp2 import Muon

    if mesh.ndim != 1:
        raise ValueError(
            f"muon-fsdp2 supports only a 1-D FSDP mesh (its 2-D work classes raise "
            f"NotImplementedError); got a {mesh.ndim}-D mesh"
        )
    muon, other = _split(model, predicate)
    world = mesh.size()
    for p in muon:
        if p.ndim != 2:
            raise ValueError(f"muon-fsdp2 Muon params must be 2-D, got shape {tuple(p.shape)}")
        if p.shape[0] % world:
            # The peer gathers equal-size shards and cats/chunks them on dim 0.
            raise ValueError(
                f"muon-fsdp2 needs dim 0 divisible by the mesh size {world}; "
                f"got shape {tuple(p.shape)}"
            )
    groups = []
    if muon:
        groups.append(
            dict(
                params=muon,
                lr=lr,
                momentum=momentum,
                weight_decay=weight_decay,
                rms_scale=rms_scale,
                use_muon=True,
            )
        )
    if other:
        groups.append(
            dict(params=other, lr=adamw_lr, weight_decay=adamw_weight_decay, use_muon=False)
        )
    return Muon(groups)


def build_dtensor_muon(
    model: nn.Module,
    mesh: DeviceMesh,
    lr: float,
    momentum: float,
    adamw_lr: float,
    predicate: Predicate,
    *,
    weight_decay: float = 0.0,
    adamw_weight_decay: float = 0.0,
    variant: str = "Muon",
) -> torch.optim.Optimizer:
    """``dtensor_muon.Muon`` (the README's usage) with a default (Muon) group and an
    ``"algorithm": "adamw"`` group (its fused AdamW) for everything else.

    Peer defaults kept: Polar Express orthogonalization, 5 steps, Nesterov, cautious weight
    decay, Keller's ``sqrt(max(1, rows / cols))`` LR scale (``lr`` on the ``0.02`` scale).
    The README example uses ``wd=0.1``; here decay defaults to 0 like DMuon's.
    ``variant="MuonForeach"`` selects the batched variant (stacks same-shape matrices and
    shards the stack across ranks: all-to-all style; it moves tensors to ``"cuda"``).
    """
    import dtensor_muon

    if variant not in ("Muon", "MuonForeach"):
        raise ValueError(f"variant must be 'Muon' or 'MuonForeach', got {variant!r}")
    cls = getattr(dtensor_muon, variant)
    muon, other = _split(model, predicate)
    groups = []
    if muon:
        groups.append({"params": muon})
    if other:
        groups.append(
            {"params": other, "algorithm": "adamw", "lr": adamw_lr, "wd": adamw_weight_decay}
        )
    return cls(groups, lr=lr, wd=weight_decay, momentum=momentum)


PEERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "muon-fsdp2": build_muon_fsdp2,
    "dtensor-muon": build_dtensor_muon,
}


def _import_problem(name: str) -> str | None:
    module, version, extra = PEER_INFO[name]
    try:
        installed = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return f"{name} is not installed: pip install -e '.[{extra}]'"
    if installed != version:
        return f"{name}=={installed} is installed, the benchmark pins {version} (extra {extra})"
    try:
        importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 - any import failure makes the peer unusable
        return f"{name} fails to import: {type(e).__name__}: {e}"
    return None


def peer_status(name: str, device_type: str | None = None) -> str | None:
    """``None`` if peer ``name`` can run here on ``device_type`` (default: ``"cuda"`` if
    available, else ``"cpu"``), otherwise a short reason why not."""
    if name not in PEER_INFO:
        return f"unknown peer {name!r}; known: {sorted(PEER_INFO)}"
    problem = _import_problem(name)
    if problem is not None:
        return problem
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "dtensor-muon" and device_type != "cuda":
        return (
            "dtensor-muon needs CUDA: Muon.muon (optim/optim.py:360) calls zeropower() with its "
            "default use_triton=True, so both strategies run the Triton Gram kernel, whose "
            "dtensor_muon/kernels/gram.py:114 `assert d_in.is_cuda and d_out.is_cuda` fails "
            "on CPU (under torch.compile: torch._dynamo.exc.Unsupported: Observed exception "
            "... AssertionError); MuonForeach moves tensors to torch.device('cuda') "
            "(optim/optim_foreach.py:146: 'Torch not compiled with CUDA enabled')"
        )
    if name == "muon-fsdp2" and device_type == "cpu":
        # Its Newton-Schulz loop is torch.compile(fullgraph=True)d; Inductor on CPU needs a
        # C++ compiler.
        try:
            from torch._inductor.cpp_builder import get_cpp_compiler
        except ImportError:
            return None
        try:
            get_cpp_compiler()
        except Exception as e:  # noqa: BLE001
            return f"muon-fsdp2 on CPU needs a C++ compiler for torch.compile (Inductor): {e}"
    return None
