"""The layouts ``dedicate_params`` accepts, checked on one rank (no collective).

The meshes it is given, the tensor-parallel DTensors (a 2-D matrix split evenly along one
dim over one 1-D mesh, or replicated), the expert-parallel stacks and the mesh of the
ranks that hold the same experts. Each check names the argument or parameter; what
depends on the rank's selection is then agreed over every rank
(``verification.agree_on_intent``) before it raises.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from torchtitan_dmuon.engine.param_layout import (
    expert_parallel_coordinates,
    expert_tensor_parallel_dim,
    is_expert_parallel,
)

__all__ = ["check_orthogonal", "expert_domain_mesh", "tensor_parallel_mesh", "validate_meshes"]


def check_orthogonal(mesh: DeviceMesh, tp_mesh: DeviceMesh | None) -> None:
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


def tensor_parallel_mesh(selected: list[tuple[str, nn.Parameter]]) -> DeviceMesh | None:
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


def expert_domain_mesh(
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


def validate_meshes(
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
