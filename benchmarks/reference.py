"""The reference design (X-Square-Robot/dmuon, commit f002f24), run on CPU beside DMuon.

The reference is imported from a checkout the user names (``--reference-path``); none of
its code is in this repository. It is written for CUDA and NCCL, so four patches, each
applied from here and none in its files, let it run on CPU with gloo and Newton-Schulz in
fp32:

1. ``torch.cuda`` as its modules see it (their global ``torch`` only; every other module,
   DMuon's included, keeps the real one) is a CPU stand-in: streams, events and stream
   contexts do nothing and ``current_device()`` is 0. Gloo collectives return when they
   are done, on the calling thread, so every event the reference waits on has already
   happened: the order of its work is what NCCL's streams would enforce, only serial.
2. ``Tensor.record_stream`` accepts that stand-in's stream and does nothing with it (it
   tells CUDA's caching allocator about a second stream; CPU memory has no streams).
3. Its Newton-Schulz casts the iterate to fp16 (``direct_newton_schulz``) or runs a Gram
   iteration in fp16 with restarts (``gram_newton_schulz``); its optimizer's ``_ns.local``
   is replaced by DMuon's torch Newton-Schulz in fp32 with the coefficients the reference
   was configured with: the same polynomial ``X <- a X + (b A + c A^2) X``, ``A = X X^T``,
   on the short side, after dividing by the Frobenius norm (``norm + 1e-7`` there,
   ``max(norm, 1e-7)`` here: the same for any gradient above 1e-7). Both sides then run
   the same Newton-Schulz, so the side by side measures what is around it.
4. ``torch.distributed`` as its modules see it (again their global ``dist`` only) runs
   what it batches in ``_coalescing_manager`` one collective at a time (gloo has no
   coalescing; NCCL's batch does the same collectives) and a ``ReduceOp.AVG`` reduction
   (gloo has none) as a SUM divided by the group's size, the order of operations of an
   average.

Patches 1 and 4 reach every module of the reference: all are imported first (those that
it imports lazily, inside functions, too). One setting of its own is changed:
``DMUON_NS_CUDA_GRAPH=0`` (its default replays Newton-Schulz as a CUDA graph, which CPU
does not have; off, it runs the same function eagerly, as it does for every shape whose
capture fails).

The remaining differences are conventions, configured alike by :func:`reference_optimizer`
(``nesterov`` on, momentum 0.95, 5 steps, ``match_rms_adamw`` on DMuon's side: the
reference scales every update by ``0.2 sqrt(max(rows, cols))``; AdamW without weight decay
and with the same betas and eps), or equivalent without configuration: the reference keeps
the momentum as ``buf = mu buf + g`` and looks ahead with ``g + mu buf``, DMuon (like
torch.optim.Muon) as an EMA, ``buf.lerp(g, 1 - mu)`` and ``g.lerp(buf, mu)``; the two
look-aheads differ by the factor ``1 / (1 - mu)`` at every step, which Newton-Schulz's
normalization removes.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import pkgutil
import sys
import types
from pathlib import Path

import torch

from torchtitan_dmuon.optim.newton_schulz import EPS, newton_schulz, resolve_ns_schedule

__all__ = [
    "REFERENCE_COMMIT",
    "dedicate_reference",
    "load_reference",
    "reference_optimizer",
    "reference_status",
]

logger = logging.getLogger(__name__)

REFERENCE_COMMIT = "f002f24"
"""The commit of X-Square-Robot/dmuon the patches were written against."""

_PACKAGE = "dmuon"


def reference_status(path: str | Path | None) -> str | None:
    """``None`` if the reference can be imported from ``path``, else why not."""
    if path is None:
        return (
            f"the reference design (X-Square-Robot/dmuon {REFERENCE_COMMIT}) needs "
            "--reference-path: a checkout of it (its directory holding dmuon/)"
        )
    if not (Path(path) / _PACKAGE / "__init__.py").is_file():
        return f"no {_PACKAGE}/__init__.py under --reference-path {path}"
    return None


class _Stream:
    """A CUDA stream's interface, doing nothing: work on CPU runs in program order."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        return event if event is not None else _Event()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class _Event:
    """A CUDA event's interface: always complete (gloo returns when the work is done)."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def record(self, stream=None) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, other) -> float:
        return 0.0


_STREAM = _Stream()


def _cpu_cuda() -> types.SimpleNamespace:
    """The ``torch.cuda`` the reference's modules see (patch 1)."""
    return types.SimpleNamespace(
        Stream=_Stream,
        Event=_Event,
        current_stream=lambda device=None: _STREAM,
        stream=lambda stream=None: contextlib.nullcontext(),
        current_device=lambda: 0,
        is_available=lambda: False,
        synchronize=lambda device=None: None,
    )


class _TorchSeenByReference(types.ModuleType):
    """``torch`` with :func:`_cpu_cuda` as ``torch.cuda``; everything else is torch's."""

    def __init__(self) -> None:
        super().__init__("torch")
        self.cuda = _cpu_cuda()

    def __getattr__(self, name: str):
        return getattr(torch, name)


class _DoneWork:
    """What an ``async_op=True`` collective returns once it has finished."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class _Coalesced:
    """``_coalescing_manager``'s handle: its collectives have each run already."""

    works: tuple = ()

    def wait(self) -> None:
        pass


@contextlib.contextmanager
def _one_at_a_time(group=None, device=None, async_ops=False):
    yield _Coalesced()


def _averaging(name: str, output_of):
    """``torch.distributed.<name>`` with ``op=ReduceOp.AVG`` run as SUM, then divided by the
    group's size where ``output_of(args, kwargs)`` says the result is (None: not on this
    rank). The collective is looked up at each call, so wrappers installed later (the
    benchmark's byte counter) see it."""
    dist = torch.distributed

    def run(*args, op=dist.ReduceOp.SUM, group=None, async_op=False, **kwargs):
        collective = getattr(dist, name)
        if op != dist.ReduceOp.AVG:
            return collective(*args, op=op, group=group, async_op=async_op, **kwargs)
        collective(*args, op=dist.ReduceOp.SUM, group=group, async_op=False, **kwargs)
        output = output_of(args, kwargs, group)
        if output is not None:
            output.div_(dist.get_world_size(group))
        return _DoneWork() if async_op else None

    return run


def _reduce_output(args, kwargs, group):
    dist = torch.distributed
    tensor = args[0] if args else kwargs["tensor"]
    dst = args[1] if len(args) > 1 else kwargs.get("dst")
    return tensor if dist.get_rank() == dst else None


def _first_output(keyword: str):
    """Where an all-reduce or a reduce-scatter leaves its result: its first argument."""
    return lambda args, kwargs, group: args[0] if args else kwargs[keyword]


def _dist_for_reference() -> types.ModuleType:
    """The ``torch.distributed`` the reference's modules see (patch 4)."""
    dist = torch.distributed

    class _Dist(types.ModuleType):
        def __getattr__(self, name: str):
            return getattr(dist, name)

    seen = _Dist("torch.distributed")
    seen._coalescing_manager = _one_at_a_time
    seen.reduce = _averaging("reduce", _reduce_output)
    seen.all_reduce = _averaging("all_reduce", _first_output("tensor"))
    seen.reduce_scatter_tensor = _averaging("reduce_scatter_tensor", _first_output("output"))
    return seen


def _patch_record_stream() -> None:
    """Patch 2: ``record_stream`` with the stand-in stream does nothing."""
    original = torch.Tensor.record_stream
    if getattr(original, "_reference_cpu", False):
        return

    def record_stream(tensor: torch.Tensor, stream) -> None:
        if isinstance(stream, _Stream):
            return
        original(tensor, stream)

    record_stream._reference_cpu = True
    torch.Tensor.record_stream = record_stream


def load_reference(path: str | Path) -> types.ModuleType:
    """Import the reference from ``path`` with the CPU patches 1 and 2 applied.

    Raises:
        ImportError: ``path`` holds no importable reference (see :func:`reference_status`).
    """
    reason = reference_status(path)
    if reason is not None:
        raise ImportError(reason)
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))
    os.environ["DMUON_NS_CUDA_GRAPH"] = "0"
    package = importlib.import_module(_PACKAGE)
    for module in pkgutil.walk_packages(package.__path__, _PACKAGE + "."):
        try:
            importlib.import_module(module.name)
        except ImportError as e:  # its CUDA kernels' modules need CUDA-only packages
            logger.debug("reference module %s not imported: %s", module.name, e)
    seen = {
        "torch": (torch, _TorchSeenByReference()),
        "dist": (torch.distributed, _dist_for_reference()),
    }
    for name, module in list(sys.modules.items()):
        if name != _PACKAGE and not name.startswith(_PACKAGE + "."):
            continue
        for attribute, (real, stand_in) in seen.items():
            if getattr(module, attribute, None) is real:
                setattr(module, attribute, stand_in)
    _patch_record_stream()
    return package


def dedicate_reference(reference, model, mesh, predicate, *, reshard_after_forward, **kwargs):
    """The reference's ``dedicate_params`` (call it before ``fully_shard``, as DMuon's)."""
    return reference.dedicate_params(
        model, mesh, predicate, reshard_after_forward=reshard_after_forward, **kwargs
    )


def reference_optimizer(
    reference,
    model,
    *,
    lr: float,
    momentum: float,
    adamw_lr: float,
    adamw_betas: tuple[float, float],
    ns_coefficients,
    ns_steps: int = 5,
    adamw_eps: float = 1e-8,
):
    """The reference's ``Muon`` configured as DMuon with ``adjust_lr_fn="match_rms_adamw"``,
    no weight decay and ``ns_dtype=float32`` is (see the module docstring), with its
    Newton-Schulz replaced by DMuon's in fp32 (patch 3).

    Args:
        reference: What :func:`load_reference` returned.
        model: The model, dedicated by :func:`dedicate_reference` and sharded.
        lr: Muon learning rate (on the AdamW scale: both scale by ``0.2 sqrt(max)``).
        momentum: Muon momentum.
        adamw_lr: AdamW learning rate of the other parameters.
        adamw_betas: AdamW betas.
        ns_coefficients: DMuon's ``ns_coefficients`` (a preset name or triples).
        ns_steps: Newton-Schulz iterations.
        adamw_eps: AdamW epsilon.
    """
    schedule = resolve_ns_schedule(ns_coefficients, ns_steps)
    if schedule.norm_scale != 1.0:
        raise ValueError(
            f"ns_coefficients {ns_coefficients!r} scale the normalizing norm by "
            f"{schedule.norm_scale}; the reference's Newton-Schulz divides by the norm alone"
        )
    ns = reference.NewtonSchulz("direct", coefficients=[list(t) for t in schedule.coefficients])
    opt = reference.Muon(
        model,
        lr=lr,
        momentum=momentum,
        weight_decay=0.0,
        ns_steps=ns_steps,
        adamw_lr=adamw_lr,
        adamw_betas=adamw_betas,
        adamw_weight_decay=0.0,
        adamw_eps=adamw_eps,
        ns_backend=ns,
        nesterov=True,
        first_step_progress_log=False,
    )

    configured = resolve_ns_schedule([tuple(t) for t in ns.coefficients], ns_steps)

    def local(matrix: torch.Tensor, steps: int) -> torch.Tensor:
        return newton_schulz(matrix, configured, eps=EPS, dtype=torch.float32)

    ns.local = local
    return opt
