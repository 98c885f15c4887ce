"""Start a model at the size of its plan: a rank allocates only what it will hold.

A model built on the meta device is materialized with ``Module.to_empty`` and initialized
in place (TorchTitan's ``init_weights``). FSDP2's parameters are DTensors of this rank's
shard, so ``to_empty`` allocates shards; a dedicated matrix is a full tensor on every rank,
so ``to_empty`` alone would allocate the whole model's matrices on each rank, although only
the owner column keeps them (the others receive them by gather right before each use).

:func:`to_empty` leaves the dedicated matrices this rank does not hold on the meta device
and :func:`initializing` runs the model's initialization with those matrices backed by a
scratch tensor, one matrix at a time: every random initializer draws from the generator
as it would on the full matrix, so what this rank does keep (the held matrices, FSDP2's
shards, buffers) gets the same values as after a full ``to_empty`` and initialization.
Then each of those matrices becomes a parameter of the same shape whose storage is freed,
as the engine keeps it between uses. A parameter split among owners (a stack of experts in
pieces, an owner group's matrix in blocks) is never held whole: it is initialized on a
scratch too, and this rank keeps a copy of its own pieces of it (``Dedication.start_pieces``,
what binding reads). :func:`materialize` runs both.

One scratch at a time means an initialization must finish with a matrix before it turns
to the next (every model's ``init_weights`` does); one that comes back to an earlier
matrix raises on every rank alike, naming both, since its values could be lost.

Under a dry run's fake backend (one process standing for every rank, nothing communicated)
no rank reads what it does not hold, so the initialization of those matrices runs on the
meta device: no draw, no memory, and the start costs what the rank holds, not the whole
model (minutes at 70B on a CPU). The generator then skips their draws, so what the rank
keeps is initialized, but not to the values a full initialization would give; a real run
draws every matrix, as above.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from torchtitan_dmuon.engine import comm
from torchtitan_dmuon.engine.dedication import Dedication, dedication_of, piece_key
from torchtitan_dmuon.engine.param_layout import like_param, local_tensor
from torchtitan_dmuon.engine.plan import DedicatedParam
from torchtitan_dmuon.engine.unit import freed_tensor

__all__ = ["initializing", "materialize", "split_names", "to_empty", "unheld_names"]

logger = logging.getLogger(__name__)


def _held_names(dedication: Dedication) -> set[str]:
    """The dedicated parameters of which this rank holds something (a unit of theirs is in
    its column): whole, or pieces of them."""
    return {d.name for u in dedication.units if u.holds for d in u.params}


def unheld_names(dedication: Dedication) -> list[str]:
    """The dedicated parameters of which this rank holds nothing between steps (no unit of
    theirs is in its column): it never reads their values, only gathers them."""
    held = _held_names(dedication)
    names = dict.fromkeys(d.name for d in dedication.plan.params)  # a split stack's once
    return [name for name in names if name not in held]


def split_names(dedication: Dedication) -> list[str]:
    """The dedicated parameters split among owners (stacks of experts in pieces, an owner
    group's matrices in blocks): no rank holds one whole between steps."""
    return list(dict.fromkeys(d.name for d in dedication.plan.params if d.layout.is_piece))


def _held_pieces(dedication: Dedication, name: str) -> list[DedicatedParam]:
    """This rank's pieces of the split parameter ``name`` (of the units it holds)."""
    return [d for u in dedication.units if u.holds for d in u.params if d.name == name]


def _module_and_leaf(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    prefix, _, leaf = name.rpartition(".")
    return model.get_submodule(prefix), leaf


@torch.no_grad()
def to_empty(model: nn.Module, *, device: torch.device | str) -> None:
    """``model.to_empty(device=device)``, except the dedicated matrices this rank does not
    hold, which stay where they are (on the meta device) until :func:`initializing`.

    Call it on every rank after ``dedicate_params`` and ``fully_shard``, then initialize
    the model inside :func:`initializing`.
    """
    dedication = dedication_of(model)
    if dedication.initialized:
        raise RuntimeError("to_empty: the dedicated model has run a forward already")
    # Those not held here, and the split ones (this rank keeps its pieces only).
    names = dict.fromkeys([*unheld_names(dedication), *split_names(dedication)])
    unheld = {name: model.get_parameter(name) for name in names}
    slots = [(*_module_and_leaf(model, name), param) for name, param in unheld.items()]
    try:
        for module, leaf, _ in slots:
            module._parameters[leaf] = None  # skipped by to_empty; keeps its place in order
        nn.Module.to_empty(model, device=device)
    finally:
        for module, leaf, param in slots:
            module._parameters[leaf] = param
    dedication.bind_params()
    dedication.awaiting_init = (torch.device(device), unheld)


# Questions a meta tensor answers as its scratch would: they neither need the scratch nor
# start on a matrix (a model reads shapes of matrices it is not initializing). Not
# ``is_meta`` or ``device``: initializers branch on them before drawing.
_SHAPE_QUERIES = {
    torch.Tensor.shape.__get__,
    torch.Tensor.ndim.__get__,
    torch.Tensor.dtype.__get__,
    torch.Tensor.requires_grad.__get__,
    torch.Tensor.size,
    torch.Tensor.dim,
    torch.Tensor.numel,
    torch.Tensor.nelement,
    torch.Tensor.stride,
    torch.Tensor.is_floating_point,
}


class _ScratchMode(TorchFunctionMode):
    """Runs every call that reads or writes an unheld matrix on a scratch tensor of its
    shape, dtype and layout; one scratch lives at a time.

    Every dedicated parameter is followed (held or not: the order of the model's
    initialization is the same on every rank), so returning to a matrix after another
    raises everywhere alike. The scratch of a matrix in ``on_meta`` is on the meta device.
    """

    def __init__(
        self,
        unheld: dict[str, nn.Parameter],
        dedicated: dict[int, str],
        device,
        finished: Callable[[str, torch.Tensor], None],
        on_meta: set[str],
    ):
        super().__init__()
        self.finished = finished
        self._unheld = {id(p) for p in unheld.values()}
        self._dedicated = dedicated
        self._device = device
        self._on_meta = on_meta
        self._current: str | None = None
        self._finished: set[str] = set()
        self._param: torch.Tensor | None = None
        self._scratch: torch.Tensor | None = None

    def _follow(self, tensor: torch.Tensor) -> None:
        name = self._dedicated[id(tensor)]
        if name == self._current:
            return
        if name in self._finished:
            raise RuntimeError(
                f"the model's initialization came back to dedicated parameter {name!r} after "
                f"{self._current!r}: DMuon initializes the matrices a rank does not hold one "
                "at a time, on a scratch tensor, and would lose what it wrote first. "
                "Initialize each matrix in one go, or materialize the model with "
                "Module.to_empty and initialize it outside torchtitan_dmuon's initializing()"
            )
        self.finish()
        self._current = name
        self._param = self._scratch = None  # the previous matrix's scratch goes now
        if id(tensor) in self._unheld:
            self._param = tensor
            device = "meta" if name in self._on_meta else self._device
            self._scratch = like_param(
                torch.empty(local_tensor(tensor).shape, dtype=tensor.dtype, device=device),
                tensor,
            )

    def finish(self) -> None:
        """Done with the current matrix: hand its scratch to ``finished``."""
        if self._current is None:
            return
        self._finished.add(self._current)
        if self._scratch is not None:
            self.finished(self._current, self._scratch)

    def _substitute(self, value):
        if isinstance(value, torch.Tensor) and id(value) in self._dedicated:
            self._follow(value)
            if value is self._param:
                return self._scratch
        return value

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _SHAPE_QUERIES:
            return func(*args, **kwargs)
        args, kwargs = tree_map(self._substitute, (args, kwargs))
        out = func(*args, **kwargs)
        if self._scratch is not None and out is self._scratch:
            return self._param  # an in-place initializer returns its target: the parameter
        return out


@contextlib.contextmanager
def initializing(model: nn.Module) -> Iterator[None]:
    """Run the model's initialization (e.g. ``model.init_weights()``) in this context
    after :func:`to_empty`: see the module's docstring. On leaving it, the unheld
    matrices are parameters on the device whose storage is freed."""
    dedication = dedication_of(model)
    if dedication.awaiting_init is None:
        raise RuntimeError(
            "initializing: materialize the model with torchtitan_dmuon.engine.meta_init's "
            "to_empty(model, device=...) first"
        )
    device, unheld = dedication.awaiting_init
    dedicated = {id(model.get_parameter(d.name)): d.name for d in dedication.plan.params}

    def keep_pieces(name: str, scratch: torch.Tensor) -> None:
        for d in _held_pieces(dedication, name):
            piece = d.layout.select(local_tensor(scratch))
            dedication.start_pieces[piece_key(d)] = piece.clone()

    # A dry run initializes on the meta device what no rank here reads (see the module).
    dry_run = comm.is_fake(dedication.exchange.shard_group)
    held_names = _held_names(dedication)
    on_meta = set(unheld) - held_names if dry_run else set()
    mode = _ScratchMode(unheld, dedicated, device, keep_pieces, on_meta)
    with mode:
        yield
    mode.finish()
    for name in split_names(dedication):  # not initialized: as uninitialized as to_empty's
        for d in _held_pieces(dedication, name):
            empty = torch.empty(d.layout.local_shape, dtype=d.param.dtype, device=device)
            dedication.start_pieces.setdefault(piece_key(d), empty)
    for name, param in unheld.items():
        module, leaf = _module_and_leaf(model, name)
        local = local_tensor(param)
        storage = freed_tensor(local.shape, param.dtype, device)
        module._parameters[leaf] = nn.Parameter(
            like_param(storage, param), requires_grad=param.requires_grad
        )
    dedication.awaiting_init = None
    dedication.bind_params()
    sizes = {d.name: local_tensor(d.param).nbytes for d in dedication.plan.params}
    held = sum(size for name, size in sizes.items() if name not in unheld)
    held += sum(piece.nbytes for piece in dedication.start_pieces.values())
    logger.info(
        "dmuon: started at the plan's size: %d of %d dedicated parameters held here (%d "
        "of them in pieces), %.1f of %.1f MiB",
        len(held_names), len(sizes), len(held_names & set(unheld)), held / 2**20,
        sum(sizes.values()) / 2**20,
    )  # fmt: skip


def materialize(
    model: nn.Module, device: torch.device | str, init_weights: Callable[[], None]
) -> None:
    """``model.to_empty(device=device)`` then ``init_weights()``, at the size of the plan:
    this rank allocates its held dedicated matrices in full and FSDP2's shards of the
    rest (see the module's docstring). Call it on every rank after ``dedicate_params`` and
    ``fully_shard``; ``init_weights`` runs without gradients."""
    to_empty(model, device=device)
    with initializing(model), torch.no_grad():
        init_weights()
