"""DMuon's shard and replicate meshes on TorchTitan 0.3, found by name on the mesh its
parallelize functions give FSDP: under the default ``spmd_types`` backend (and
``full_dtensor``) the multi-axis storage mesh and its ``DataParallelMeshDims``, under
``partial_dtensor`` 0.2.2's ``fsdp`` / ``dp_replicate`` mesh. Checked on 4 gloo ranks
against the ranks each layout puts together."""

from __future__ import annotations

import torch.distributed as dist

from tests.support.dist import run_distributed

LAYOUTS = {
    # FSDP over the 4 ranks.
    "fsdp": (dict(data_parallel_shard_degree=-1), [[0, 1, 2, 3]] * 4, [None] * 4),
    # HSDP 2 x 2: shard groups {0, 1}, {2, 3}; replicas {0, 2}, {1, 3}.
    "hsdp": (
        dict(data_parallel_replicate_degree=2, data_parallel_shard_degree=2),
        [[0, 1], [0, 1], [2, 3], [2, 3]],
        [[0, 2], [1, 3], [0, 2], [1, 3]],
    ),
    # Context parallelism: FSDP shards over dp_shard x cp, one group of 4.
    "cp": (
        dict(data_parallel_shard_degree=2, context_parallel_degree=2),
        [[0, 1, 2, 3]] * 4,
        [None] * 4,
    ),
}
BACKENDS = ("spmd_types", "full_dtensor", "partial_dtensor")


def _meshes(rank: int, world: int, cases: list[tuple[str, dict]]) -> list[dict]:
    import torchtitan.distributed.parallel_dims as parallel_dims_module
    from torchtitan.config import ParallelismConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed.full_dtensor import resolve_fsdp_mesh

    from torchtitan_dmuon.titan03.parallelize import data_parallel_meshes

    parallel_dims_module.device_type = "cpu"  # as the CPU layer sets it

    def ranks(mesh):
        return None if mesh is None else dist.get_process_group_ranks(mesh.get_group())

    found = []
    for backend, degrees in cases:
        dims = ParallelDims.from_config(ParallelismConfig(spmd_backend=backend, **degrees), world)
        dims.build_mesh()
        if backend == "partial_dtensor":
            names = ["dp_replicate", "fsdp"] if dims.dp_replicate_enabled else ["fsdp"]
            dp_mesh, dp_mesh_dims = dims.get_mesh(names), None
        else:
            dp_mesh, dp_mesh_dims = resolve_fsdp_mesh(dims)
        shard, replicate = data_parallel_meshes(dp_mesh, dp_mesh_dims)
        found.append({"shard": ranks(shard), "replicate": ranks(replicate)})
    return found


def test_data_parallel_axes_are_found_by_name():
    """Every layout under every backend, in one run of 4 ranks."""
    cases = [(backend, name) for backend in BACKENDS for name in LAYOUTS]
    by_rank = run_distributed(_meshes, 4, [(b, LAYOUTS[n][0]) for b, n in cases])
    for index, (backend, name) in enumerate(cases):
        _, shard, replicate = LAYOUTS[name]
        assert [r[index]["shard"] for r in by_rank] == shard, (backend, name)
        assert [r[index]["replicate"] for r in by_rank] == replicate, (backend, name)


def test_one_data_parallel_rank_dedicates_nothing():
    """Under spmd_types a size-1 storage mesh comes without DataParallelMeshDims: no
    dedication (plain Muon + AdamW on the one rank)."""
    by_rank = run_distributed(_meshes, 1, [("spmd_types", dict(data_parallel_shard_degree=-1))])
    assert by_rank == [[{"shard": None, "replicate": None}]]
