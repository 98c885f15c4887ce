"""The engine's public functions: ``dedicate_params`` and the readers around it.

``dedicate_params`` gives each selected matrix parameter one owner rank. The owner keeps
the full parameter and (through the optimizer) its momentum, receives the SUM-reduced
gradient, orthogonalizes it alone and updates the parameter in place; the other ranks
receive the value by broadcast right before they need it and free it again.

Three decisions are kept apart: WHO owns a matrix (one global LPT partition over the NS
cost, over all R x G ranks under HSDP: ``plan.py``), WHERE the hooks attach (the hook
*boundary* module; all its matrices with the same owner form one *unit*, moved by one
collective: ``unit.py``, ``hooks.py``) and WHETHER a rank steps a matrix (only the primary
owner holds its reduced gradient: ``Dedication.owned_grads``).
"""

from __future__ import annotations

import dataclasses
import logging

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Replicate, Shard

from torchtitan_dmuon.engine import comm
from torchtitan_dmuon.engine.dedication import Dedication, get_dedication
from torchtitan_dmuon.engine.plan import (
    BoundaryPredicate,
    build_plan,
    expert_parallel_coordinates,
    expert_tensor_parallel_dim,
    is_expert_parallel,
)
from torchtitan_dmuon.engine.recovery import reset_fsdp_state
from torchtitan_dmuon.engine.selection import Predicate, select_matrices
from torchtitan_dmuon.engine.settings import DedicationSettings
from torchtitan_dmuon.engine.verification import (
    Intent,
    agree_on_intent,
    model_tensor_parallel_mesh,
    selection_hash,
)
from torchtitan_dmuon.optim.newton_schulz import matrix_count

__all__ = [
    "dedicate_params",
    "get_full_param",
    "reset_iter_state",
    "set_requires_gradient_sync",
    "verify_plan",
]

logger = logging.getLogger(__name__)


@torch.no_grad()
def get_full_param(model: nn.Module, name: str) -> torch.Tensor:
    """The current full value of dedicated parameter ``name`` on every rank, in the master
    precision, for evaluation, export and tests. A collective: every rank must call it, in
    the same order."""
    dedication = get_dedication(model)
    if dedication is None:
        raise ValueError("model was not prepared by dedicate_params")
    found = [(u, d) for u in dedication.units for d in u.params if d.name == name]
    found.sort(key=lambda entry: entry[1].experts or (0, 0))  # a split stack's pieces
    if not found:
        raise KeyError(f"{name!r} is not a dedicated parameter")
    if not dedication.initialized:
        return found[0][1].param.detach().clone()
    # A split stack: its pieces in expert order, each from its owner (the same order
    # on every rank, so the broadcasts match).
    pieces = [_read_entry(dedication, unit, d) for unit, d in found]
    value = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
    param = found[0][1].param
    if is_expert_parallel(param) and expert_parallel_coordinates(param)[1] > 1:
        # Every ep rank's local experts, in order.
        placements = [Shard(0)] + [Replicate()] * (param.device_mesh.ndim - 1)
        value = DTensor.from_local(value, param.device_mesh, placements, run_check=False)
        value = value.full_tensor()
    return value


def _read_entry(dedication: Dedication, unit, d) -> torch.Tensor:
    """The current value of one matrix or piece, on every rank."""
    if unit.primary:
        value = unit.master_view(d).clone()
    else:
        value = torch.empty(d.local_shape, dtype=unit.master_dtype, device=unit.device)
    replicas = dedication.replicas
    if replicas is not None and unit.holds:
        replicas.wait(unit)
        comm.broadcast(value, unit.primary_replica, replicas.group, dedication.stats, "read").wait()
    shard_group = dedication.domain_of(unit).shard_group
    comm.broadcast(value, unit.column, shard_group, dedication.stats, "read").wait()
    if d.split_dim is not None:  # tensor parallelism: the shards, side by side
        value = torch.cat(dedication.gather_shards(value), dim=d.split_dim)
    return value


def set_requires_gradient_sync(model: nn.Module, requires_gradient_sync: bool) -> None:
    """Turn gradient reduction on or off for the dedicated parameters and, like
    ``FSDPModule.set_requires_gradient_sync``, for every FSDP module in ``model``.

    Use it for gradient accumulation without a reduce per micro-batch: off for all but
    the last micro-batch. Every rank must set the same value.
    """
    dedication = get_dedication(model)
    if dedication is not None:
        dedication.requires_gradient_sync = requires_gradient_sync
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_requires_gradient_sync(requires_gradient_sync, recurse=False)


def reset_iter_state(model: nn.Module) -> None:
    """Recover from a forward or backward that raised half-way, as
    ``FSDPModule.reset_iter_state`` does for FSDP2; the failed pass's gradients are lost.

    Rarely needed: ``Muon.zero_grad()`` (and the next root forward, for the engine's own
    state) does it after a failed pass. For a loop that clears gradients another way,
    call it on every rank after catching the exception.
    """
    dedication = get_dedication(model)
    if dedication is not None:
        dedication.recover()
    else:
        reset_fsdp_state(model)


def verify_plan(dedication: Dedication) -> None:
    """Check that every data-parallel rank holds the same plan and sits where the
    (replicate, shard) layout says: one small all-gather over the shard group, one over
    the replicate group (HSDP), and under expert parallelism first one over the experts'
    shard group and last one over the tensor-parallel group (if any). The same gathers
    tell each rank the global rank of every owner slot (``Dedication.slot_ranks`` and
    ``expert_owner_ranks``, which checkpoints of split stacks name).

    All gathers run before anything is judged, and each later one carries the verdicts
    of the earlier groups, so every rank of the data-parallel groups raises alike and a
    mismatch cannot reach a later collective. Ranks outside them (other pipeline stages)
    are not involved: a stage's plan is its own.
    """
    device = mesh_device(dedication.mesh)
    fingerprint = dedication.plan.fingerprint(dedication.settings.reshard_after_forward)
    coordinates = [fingerprint, dedication.replicate_rank]
    error, expert_rank, ep_rank, etp_rank = None, 0, 0, 0
    if len(dedication.domains) == 2:
        experts = dedication.domains[1]
        expert_rank, ep_rank, etp_rank = experts.rank, dedication.ep_rank, dedication.etp_rank
        rows = _all_gather_rows(coordinates + [expert_rank], experts.shard_group, device)
        error = _layout_error(rows, "efsdp")
    mine = coordinates + [dedication.shard_rank, dist.get_rank(), error is None]
    shard_table = _all_gather_rows(
        mine + [expert_rank, ep_rank, etp_rank], dedication.shard_group, device
    )
    error = error or _layout_error([row[:3] for row in shard_table], "shard")
    if error is None and not all(row[4] for row in shard_table):
        error = RuntimeError(
            "the ranks of another efsdp group disagree about the dedication plan or "
            "layout (see the error on those ranks)"
        )
    # (global rank, experts' column, ep rank, etp rank) of this replica's columns, in order.
    columns = [x for row in sorted(shard_table, key=lambda row: row[2]) for x in row[3:4] + row[5:]]
    tables = [columns]
    if dedication.replicas is not None:
        rows = _all_gather_rows(
            mine[:4] + [error is None] + columns, dedication.replicas.group, device
        )
        error = error or _layout_error([row[:3] for row in rows], "replicate")
        if error is None and not all(row[4] for row in rows):
            error = RuntimeError(
                "the ranks of another replica's shard group disagree about the dedication "
                "plan or layout (see the error on those ranks)"
            )
        tables = [row[5:] for row in sorted(rows, key=lambda row: row[1])]
    ranks = [table[i : i + 4] for table in tables for i in range(0, len(table), 4)]
    # (replica, global rank, experts' column, ep rank, etp rank) of each data-parallel rank.
    entries = [(slot // dedication.shard_size, *row) for slot, row in enumerate(ranks)]
    if len(dedication.domains) == 2 and dedication.tp_group is not None:
        # The ep groups may span the tensor-parallel ranks (TorchTitan's ep borrows them):
        # their owners too. Carrying the verdicts, since these groups cross shard groups.
        flat = [error is None] + [x for entry in entries for x in entry]
        rows = _all_gather_rows(flat, dedication.tp_group, device)
        if error is None and not all(row[0] for row in rows):
            error = RuntimeError(
                "the ranks of another tensor-parallel position disagree about the "
                "dedication plan or layout (see the error on those ranks)"
            )
        entries = [tuple(row[i : i + 5]) for row in rows for i in range(1, len(row), 5)]
    if error is not None:
        raise error
    dedication.slot_ranks = [row[0] for row in ranks]
    if len(dedication.domains) == 2:
        per_replica = dedication.domains[1].size
        dedication.expert_owner_ranks = {
            (ep, replica * per_replica + column, etp): rank
            for replica, rank, column, ep, etp in entries
        }


def mesh_device(mesh: DeviceMesh) -> torch.device:
    """The device a mesh's collectives (and the Newton-Schulz of its owners) run on."""
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    return torch.device(mesh.device_type, torch.accelerator.current_device_index())


def _all_gather_rows(row: list[int], group: dist.ProcessGroup, device) -> list[list[int]]:
    mine = torch.tensor(row, dtype=torch.int64, device=device)
    everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    return [[int(x) for x in t.tolist()] for t in everyone]


def _layout_error(table: list[list[int]], dim: str) -> Exception | None:
    """What is wrong with the rows ``(fingerprint, replicate rank, shard rank)`` gathered
    over one group, if anything."""
    fingerprints = [row[0] for row in table]
    if len(set(fingerprints)) != 1:
        return RuntimeError(
            "ranks disagree about the dedication plan (different model, predicate, "
            f"hook boundaries or mesh per rank); plan fingerprints by {dim}-group rank: "
            f"{fingerprints}"
        )
    own, other = (1, 2) if dim == "replicate" else (2, 1)
    if len({row[own] for row in table}) != len(table) or len({row[other] for row in table}) != 1:
        return ValueError(
            "replicate_mesh does not line up with mesh: the (replicate, shard) "
            f"coordinates of the {dim} group's ranks are {[(row[1], row[2]) for row in table]}"
        )
    return None


def _check_orthogonal(mesh: DeviceMesh, tp_mesh: DeviceMesh | None) -> None:
    """The data-parallel ``mesh`` and the tensor-parallel one share this rank only.

    Raises:
        ValueError: ``mesh`` holds other ranks of the TP mesh (the TP mesh was passed).
    """
    if tp_mesh is None:
        return
    shared = set(mesh.mesh.flatten().tolist()) & set(tp_mesh.mesh.flatten().tolist())
    if len(shared) > 1:
        raise ValueError(
            f"mesh: ranks {sorted(shared)} of it are also the tensor-parallel mesh of the "
            "selected DTensors; pass the data-parallel mesh (e.g. world_mesh['dp']): "
            "dedicate_params finds the tensor-parallel mesh from the DTensors"
        )


def _tensor_parallel_mesh(selected: list[tuple[str, nn.Parameter]]) -> DeviceMesh | None:
    """The one 1-D mesh the tensor-parallel (DTensor) matrices are sharded over, or None.

    Each such matrix must be a 2-D DTensor split evenly along one of its dims (TorchTitan's
    Colwise: rows, Rowwise: columns) over that mesh, or replicated over a 1-D mesh
    (TorchTitan's NoParallel: dedicated whole).

    Raises:
        ValueError: a layout the engine cannot handle, naming the parameter.
    """
    meshes = []
    for name, p in selected:
        if is_expert_parallel(p):
            if expert_tensor_parallel_dim(p) is not None:  # split over the TP ranks too
                meshes.append((name, _etp_mesh(name, p)))
            continue
        if not isinstance(p, DTensor):
            continue
        placements, shape = p.placements, tuple(p.shape)
        if p.ndim == 2 and p.device_mesh.ndim == 1 and isinstance(placements[0], Replicate):
            continue  # whole on every TP rank (TorchTitan's NoParallel): no TP collective
        ok = (
            p.ndim == 2
            and p.device_mesh.ndim == 1
            and isinstance(placements[0], Shard)
            and shape[placements[0].dim] % p.device_mesh.size() == 0
        )
        if not ok:
            raise ValueError(
                f"{name!r}: a tensor-parallel matrix must be a 2-D DTensor split evenly "
                f"along one dim over a 1-D mesh; got shape {shape}, placements {placements} "
                f"over a {p.device_mesh.ndim}-D mesh of {p.device_mesh.size()} ranks"
            )
        meshes.append((name, p.device_mesh))
    if len({tuple(m.mesh.flatten().tolist()) for _, m in meshes}) > 1:
        raise ValueError(
            "the tensor-parallel matrices are sharded over different meshes: "
            f"{[(name, m.mesh.tolist()) for name, m in meshes]}"
        )
    return meshes[0][1] if meshes else None


def _etp_mesh(name: str, stack: DTensor) -> DeviceMesh:
    """The mesh an expert stack's matrices are split over (a dim of its mesh)."""
    mesh, etp = stack.device_mesh, expert_tensor_parallel_dim(stack)
    split = stack.placements[etp].dim
    if stack.shape[split] % mesh.size(etp) != 0 or (mesh.ndim > 1 and not mesh.mesh_dim_names):
        raise ValueError(
            f"{name!r}: an expert-tensor-parallel stack must be split evenly over a named "
            f"mesh dim; got shape {tuple(stack.shape)} over mesh dims {mesh.mesh_dim_names}"
        )
    return mesh if mesh.ndim == 1 else mesh[mesh.mesh_dim_names[etp]]


def _expert_domain_mesh(
    selected: list[tuple[str, nn.Parameter]],
    mesh: DeviceMesh,
    expert_mesh: DeviceMesh | None,
    tp_mesh: DeviceMesh | None,
) -> DeviceMesh | None:
    """The shard mesh of the experts' domain, once the stacks' layout is checked: the
    ranks that hold the same experts (``expert_mesh``; ``mesh`` itself when the stacks
    are split over the TP ranks only, every rank holding every expert), or None when no
    expert stack is selected.

    Raises:
        ValueError: expert-parallel stacks without ``expert_mesh``, over different
            meshes or unevenly, or an ``expert_mesh`` that does not make up the shard
            mesh (times the tensor-parallel mesh, whose ranks ``ep`` may borrow)
            together with the ``ep`` mesh.
    """
    stacks = [(name, p) for name, p in selected if is_expert_parallel(p)]
    if not stacks:
        return None
    _, ep_size, _, etp_size = expert_parallel_coordinates(stacks[0][1])
    if expert_mesh is None and ep_size == 1:
        expert_mesh = mesh
    if expert_mesh is None:
        raise ValueError(
            f"{stacks[0][0]!r} is sharded over an expert-parallel mesh: pass expert_mesh "
            "(the mesh of the ranks that hold the same experts, TorchTitan's efsdp)"
        )
    ep_meshes = {tuple(p.device_mesh.mesh.flatten().tolist()) for _, p in stacks}
    if len(ep_meshes) > 1:
        raise ValueError(
            f"the expert stacks are sharded over different meshes: {sorted(ep_meshes)}"
        )
    for name, p in stacks:
        if p.shape[0] % ep_size != 0:
            raise ValueError(
                f"{name!r}: {p.shape[0]} experts do not split evenly over {ep_size} "
                "expert-parallel ranks"
            )
    tp_size = tp_mesh.size() if tp_mesh is not None else 1
    if expert_mesh.size() * ep_size * etp_size != mesh.size() * tp_size:
        raise ValueError(
            f"expert_mesh ({expert_mesh.size()} ranks) x the ep mesh ({ep_size} ranks) x "
            f"the etp mesh ({etp_size} ranks) must make up mesh ({mesh.size()} ranks) x "
            f"the tensor-parallel mesh ({tp_size} ranks)"
        )
    return expert_mesh


def _validate_meshes(
    mesh: DeviceMesh, replicate_mesh: DeviceMesh | None, expert_mesh: DeviceMesh | None
) -> None:
    if not dist.is_initialized():
        raise RuntimeError("dedicate_params needs an initialized default process group")
    for arg, m in (
        ("mesh", mesh),
        ("replicate_mesh", replicate_mesh),
        ("expert_mesh", expert_mesh),
    ):
        if m is None:
            continue
        if not isinstance(m, DeviceMesh):
            raise TypeError(f"{arg} must be a DeviceMesh, got {type(m).__name__}")
        if m.ndim != 1:
            raise ValueError(
                f"{arg} must be 1-D, got a {m.ndim}-D mesh; for HSDP pass hsdp['shard'] as "
                "mesh and hsdp['replicate'] as replicate_mesh"
            )
    # The meshes need not span the world: under pipeline parallelism they are the
    # data-parallel ranks of one stage.
    if replicate_mesh is None:
        return
    shard_ranks = set(mesh.mesh.flatten().tolist())
    replicate_ranks = set(replicate_mesh.mesh.flatten().tolist())
    if shard_ranks & replicate_ranks != {dist.get_rank()}:
        raise ValueError(
            "replicate_mesh does not line up with mesh: expected the shard group "
            f"({sorted(shard_ranks)}) and the replicate group ({sorted(replicate_ranks)}) "
            "to meet in this rank only; use hsdp['shard'] and hsdp['replicate'] of one "
            "2-D mesh"
        )


@torch.no_grad()
def dedicate_params(
    model: nn.Module,
    mesh: DeviceMesh,
    predicate: Predicate,
    *,
    replicate_mesh: DeviceMesh | None = None,
    hook_boundary_predicate: BoundaryPredicate | None = None,
    reshard_after_forward: bool = True,
    replicate_async: bool = False,
    gradient_divide_factor: float | None = None,
    expert_mesh: DeviceMesh | None = None,
) -> Dedication:
    """Give every matrix parameter selected by ``predicate`` one owner rank.

    Call it on every rank, before ``fully_shard``; ``fully_shard`` then skips the dedicated
    parameters. Build :class:`torchtitan_dmuon.Muon` on the same model afterwards.

    Args:
        model: The model (not yet sharded).
        mesh: 1-D shard mesh (FSDP2's mesh, or the DDP group); with ``replicate_mesh``, the
            shard dimension of the HSDP mesh.
        predicate: ``predicate(name, param)`` selects the matrices to dedicate.
        replicate_mesh: HSDP replicate dimension (``hsdp["replicate"]``): owners are spread
            over all R x G ranks and gradients are reduced in two stages.
        hook_boundary_predicate: ``pred(module_name, module)`` picks the modules whose hooks
            move the dedicated parameters under them (innermost match wins). Default: the
            modules held in an ``nn.ModuleList``/``nn.ModuleDict`` (transformer blocks),
            else the root.
        reshard_after_forward: True (Z3) or False (Z2); see :class:`DedicationSettings`.
        replicate_async: HSDP: hide the replicate broadcast behind the next forward
            (``Muon(replicate_async=True)`` switches it on too, through
            ``Dedication.set_replicate_async``).
        gradient_divide_factor: See :class:`DedicationSettings`.
        expert_mesh: Under expert parallelism, the 1-D mesh of the ranks that hold the
            same experts (TorchTitan's ``efsdp``; ``mesh`` is it times the ``ep`` mesh).
            The selected stacks sharded along dim 0 over the ``ep`` mesh are dedicated
            over it (and ``replicate_mesh``), their gradients reduced over it only.
            Stacks split over the tensor-parallel ranks alone (TorchTitan's TP of
            routed experts without expert parallelism) default it to ``mesh``.

    Returns:
        The :class:`Dedication` (also reachable through :func:`get_dedication`).

    Raises:
        ValueError / TypeError / RuntimeError: bad input, before any collective of the
            engine. What depends on each rank's selection (the predicate, the tensor- and
            expert-parallel layouts) is judged on every rank alike after one small
            all-gather over the given meshes' groups, so a rank-dependent predicate or
            layout raises the same error everywhere instead of hanging.
    """
    _validate_meshes(mesh, replicate_mesh, expert_mesh)
    if any(isinstance(m, FSDPModule) for m in model.modules()):
        raise RuntimeError(
            "dedicate_params must be called before fully_shard: the model already has "
            "FSDP-wrapped modules"
        )
    if get_dedication(model) is not None:
        raise RuntimeError("dedicate_params was already applied to this model")
    if replicate_async and replicate_mesh is None:
        raise ValueError("replicate_async=True needs replicate_mesh (HSDP)")
    settings = DedicationSettings(reshard_after_forward, replicate_async, gradient_divide_factor)
    # The checks that depend on what this rank selected: their verdict is agreed with every
    # rank of the dedication before anything rank-dependent runs (engine/verification.py).
    selected, tp_mesh, error = [], None, None
    try:
        selected = select_matrices(model, predicate)
        if not selected:
            raise ValueError("predicate selected no trainable 2-D or 3-D parameter")
        tp_mesh = _tensor_parallel_mesh(selected)
        _check_orthogonal(mesh, tp_mesh)
        expert_mesh = _expert_domain_mesh(selected, mesh, expert_mesh, tp_mesh)
    except (ValueError, TypeError) as e:
        error = str(e)
    groups = (replicate_mesh is not None, tp_mesh is not None, expert_mesh is not None)
    intent = Intent(
        names=tuple(name for name, _ in selected),
        selection=selection_hash(selected),
        settings=dataclasses.astuple(settings),
        groups=groups if error is None else (),
        error=error,
    )
    # Over the model's TP mesh, which does not depend on the selection.
    agree_on_intent(intent, mesh, replicate_mesh, model_tensor_parallel_mesh(model))
    expert_columns = None
    if expert_mesh is not None:
        # Which experts' column each shard-group rank is (the two domains are balanced
        # together): the one collective of planning, after every check.
        device = mesh_device(mesh)
        rows = _all_gather_rows([expert_mesh.get_local_rank()], mesh.get_group(), device)
        expert_columns = [row[0] for row in rows]
    plan = build_plan(
        model,
        selected,
        shard_size=mesh.size(),
        replicate_size=replicate_mesh.size() if replicate_mesh is not None else 1,
        hook_boundary_predicate=hook_boundary_predicate,
        expert_shard_size=expert_mesh.size() if expert_columns is not None else None,
        expert_columns=expert_columns,
    )
    dedication = Dedication(model, plan, settings, mesh, replicate_mesh, tp_mesh, expert_mesh)
    logger.info(
        "dedicate_params: %d parameters (%d matrices), %d boundaries, %d units over "
        "%d x %d ranks, NS balance %.3f, %s",
        len(dedication.params),
        # Every ep rank's experts, as without expert parallelism.
        sum(
            matrix_count(d.shape)
            * (expert_parallel_coordinates(d.param)[1] if is_expert_parallel(d.param) else 1)
            for d in plan.params
        ),
        len(plan.boundaries),
        len(plan.units),
        plan.replicate_size,
        plan.shard_size,
        plan.balance(),
        "Z3" if reshard_after_forward else "Z2",
    )
    return dedication
