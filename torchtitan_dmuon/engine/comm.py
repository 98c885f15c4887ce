"""Collectives of the ownership engine, with byte accounting.

Every collective the package issues goes through here (tests/engine/test_comm_routing.py scans
the sources), so that the per-step figures a user sees (bytes broadcast and reduced,
collective counts) are counted where they happen, and so that each tensor is checked to
live on a device its group has a backend for before any rank starts the collective (an
NCCL-only group given a CPU tensor fails with "No backend type associated with device
type cpu"). ``torch.distributed`` functions are looked up at call time, so a test can
wrap them.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "CommStats",
    "ShardGroups",
    "all_gather_into",
    "all_gather_rows",
    "all_reduce",
    "barrier",
    "broadcast",
    "check_device",
    "connect_options",
    "engine_group",
    "flagged_grad_bucket",
    "gather_over_groups",
    "group_timeout",
    "host_device",
    "is_fake",
    "mesh_device",
    "reduce_sum",
    "retire_groups",
]


@dataclass
class CommStats:
    """Running totals of what the engine sent through collectives on this rank.

    Attributes:
        bytes: Payload bytes per collective kind (``"broadcast"`` and ``"reduce"`` inside
            the shard group, ``"replicate_broadcast"`` and ``"replicate_reduce"`` across
            HSDP replicas, ``"expert_broadcast"`` and ``"expert_reduce"`` inside the
            experts' shard group under expert parallelism, ``"all_reduce"``; outside the
            step's movement of matrices: ``"step_verdict"``, ``"phase_agreement"``,
            ``"qk_clip_all_reduce"``,
            ``"qk_clip_metrics"``, ``"grad_norm_all_reduce"``, ``"others_broadcast"``,
            ``"checkpoint_broadcast"``), counted once per collective on each rank.
        calls: Number of collectives per kind.
    """

    bytes: Counter = field(default_factory=Counter)
    calls: Counter = field(default_factory=Counter)

    def record(self, kind: str, tensor: torch.Tensor) -> None:
        self.bytes[kind] += tensor.numel() * tensor.element_size()
        self.calls[kind] += 1

    def snapshot(self) -> dict[str, dict[str, int]]:
        return {"bytes": dict(self.bytes), "calls": dict(self.calls)}


# The groups of removed dedications, by (ranks, description), for the next dedication
# over the same ranks. torch names a locally synchronized group after its ranks and the
# number of live groups, so after some were destroyed a new group can take a live one's
# name ("group name has already been created", or a hang in its rendezvous): the engine
# destroys none of its groups and reuses them instead (the default group's destruction
# ends them all).
_RETIRED: dict[tuple[tuple[int, ...], str], list[dist.ProcessGroup]] = {}


def engine_group(
    group: dist.ProcessGroup,
    description: str,
    device: torch.device,
    members: slice | None = None,
    backend: str | None = None,
) -> dist.ProcessGroup:
    """A process group over the ranks of ``group`` (those of group ranks ``members``),
    used by the engine alone for collectives on ``device``: a removed dedication's
    (:func:`retire_groups`) or a new one (on ``backend``; None: the default group's).

    FSDP2 issues its collectives on the mesh's groups. Sharing them would need the
    engine's and FSDP2's collectives to interleave identically on every rank, and they do
    not: whether the engine prefetches a unit depends on whether this rank's replicate
    broadcast has landed yet, a question of timing. On groups of its own only the
    engine's fixed per-pass order matters.

    Only the members call this (local synchronization). Every rank creates its groups in
    the same order (shard, reduce, replicate), so the overlapping creations cannot
    deadlock. On an accelerator the group is connected here (:func:`connect_options`), not
    at its first collective, whose place in backward differs between ranks. The group
    times out as ``group`` does (``new_group`` would take the backend's default, 30
    minutes on gloo): a rank that never joins a reduce then ends its peers' wait when the
    user's own groups would.
    """
    ranks = dist.get_process_group_ranks(group)
    if members is not None:
        ranks = ranks[members]
    timeout = group_timeout(group)
    retired = _RETIRED.get((tuple(ranks), description), [])
    while retired:  # every member removed the same dedications: each takes the same one
        reused = retired.pop()
        if reused in dist.distributed_c10d._world.pg_map:  # else gone with the default group
            if timeout is not None:
                dist.distributed_c10d._set_pg_timeout(timeout, reused)
            return reused
    return dist.new_group(
        ranks,
        timeout=timeout,
        backend=backend,
        use_local_synchronization=True,
        group_desc=description,
        **connect_options(group, device, backend, timeout),
    )


def connect_options(
    group: dist.ProcessGroup, device: torch.device, backend: str | None, timeout
) -> dict:
    """``new_group``'s keywords for an engine group over ``group``'s ranks whose
    collectives run on ``device``: none on the CPU (gloo) or a dry run's fake backend; on
    an accelerator ``device_id``, so that the communicator connects at creation, where
    every member creates it in the same order (without it NCCL connects inside the first
    collective, which blocks the host until every member joins: two groups first used in
    a rank-dependent order would deadlock); and for NCCL, options that run its kernels on
    high-priority streams, as FSDP2's own collectives run (issued with ``async_op=True``,
    they run on the group's streams, not on the engine's)."""
    if device.type == "cpu" or backend == "gloo" or is_fake(group):
        return {}
    options: dict = {"device_id": device}
    nccl = getattr(dist, "ProcessGroupNCCL", None)  # absent from CPU builds
    if backend in (None, "nccl") and nccl is not None:
        if isinstance(group._get_backend(device), nccl):
            pg_options = nccl.Options()
            pg_options.is_high_priority_stream = True
            if timeout is not None:  # else new_group warns that its timeout overrides it
                pg_options._timeout = timeout
            options["pg_options"] = pg_options
    return options


def retire_groups(groups: list[dist.ProcessGroup]) -> None:
    """Keep a removed dedication's groups for :func:`engine_group` to reuse."""
    for group in groups:
        key = (tuple(dist.get_process_group_ranks(group)), group.group_desc)
        _RETIRED.setdefault(key, []).append(group)


def group_timeout(group: dist.ProcessGroup):
    """``group``'s collective timeout, or None (the backend's default) where its backend
    does not say."""
    for device in group._device_types:
        options = getattr(group._get_backend(device), "options", None)
        if getattr(options, "_timeout", None) is not None:
            return options._timeout
    return None


def broadcast(
    tensor: torch.Tensor,
    group_src: int,
    group: dist.ProcessGroup,
    stats: CommStats,
    kind: str = "broadcast",
) -> dist.Work:
    """Asynchronously broadcast ``tensor`` from group rank ``group_src``; counted as
    ``kind``."""
    check_device("broadcast", tensor, group)
    stats.record(kind, tensor)
    if is_fake(group) and dist.get_rank(group) != group_src:
        _fake_receive(tensor)
    return dist.broadcast(tensor, group=group, group_src=group_src, async_op=True)


# The values a dry run's receiver draws; the rest of a buffer repeats them (a draw per
# element costs minutes a step at 70B, where every forward receives the whole model).
FAKE_RECEIVE_DRAWS = 1 << 16


def _fake_receive(tensor: torch.Tensor) -> None:
    """What a dry run's receiver holds: a fake broadcast moves nothing, and the engine's
    receive buffers are uninitialized (NaNs or garbage would steer the forward, e.g. a
    MoE router's choices, differently from run to run). Weights of an initialization's
    scale, the same in every run: ``FAKE_RECEIVE_DRAWS`` normal draws, copied over the
    rest of the buffer in doubling blocks (memory speed, not a generator's)."""
    if not tensor.is_floating_point():
        tensor.zero_()
        return
    flat = tensor.view(-1)  # the engine's flat buffers
    generator = torch.Generator(tensor.device).manual_seed(flat.numel())
    filled = min(flat.numel(), FAKE_RECEIVE_DRAWS)
    flat[:filled].normal_(0.0, 0.02, generator=generator)
    while filled < flat.numel():
        size = min(filled, flat.numel() - filled)
        flat[filled : filled + size].copy_(flat[:size])
        filled += size


def reduce_sum(
    tensor: torch.Tensor,
    group_dst: int,
    group: dist.ProcessGroup,
    stats: CommStats,
    kind: str = "reduce",
) -> dist.Work:
    """Asynchronously SUM-reduce ``tensor`` onto group rank ``group_dst``; counted as
    ``kind``.

    SUM, not AVG: gloo has neither AVG nor PREMUL_SUM, so the owner divides once.
    """
    check_device("reduce", tensor, group)
    stats.record(kind, tensor)
    return dist.reduce(
        tensor, group=group, group_dst=group_dst, op=dist.ReduceOp.SUM, async_op=True
    )


def all_reduce(
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None,
    stats: CommStats,
    kind: str = "all_reduce",
    op: dist.ReduceOp = dist.ReduceOp.SUM,
) -> dist.Work:
    """Asynchronously all-reduce ``tensor`` in place with ``op``; counted as ``kind``."""
    check_device("all_reduce", tensor, group)
    stats.record(kind, tensor)
    return dist.all_reduce(tensor, group=group, op=op, async_op=True)


def all_gather_into(
    out: torch.Tensor, tensor: torch.Tensor, group: dist.ProcessGroup, stats: CommStats, kind: str
) -> dist.Work:
    """Asynchronously gather every rank's ``tensor`` into ``out`` (rank-major); counted as
    ``kind`` by its output."""
    check_device("all_gather_into_tensor", tensor, group)
    check_device("all_gather_into_tensor", out, group)
    stats.record(kind, out)
    return dist.all_gather_into_tensor(out, tensor, group=group, async_op=True)


def check_device(collective: str, tensor: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """Refuse, before any rank starts it, a collective on a tensor whose device type
    ``group`` has no backend for.

    Raises:
        ValueError: Naming the collective, the group and the devices.
    """
    group = group if group is not None else dist.group.WORLD
    device_types = {d.type for d in group._device_types}
    if tensor.device.type in device_types or is_fake(group):
        return
    raise ValueError(
        f"{collective}: a tensor on {tensor.device} handed to process group "
        f"{group.group_desc!r}, whose backends serve only {sorted(device_types)}; the "
        "engine's collectives run on the device of its mesh"
    )


def host_device(group: dist.ProcessGroup | None) -> torch.device | None:
    """The CPU, where ``group`` has a backend for it (gloo): a flag all-reduced there is
    read from host memory, without waiting for the device; else None."""
    group = group if group is not None else dist.group.WORLD
    if any(d.type == "cpu" for d in group._device_types):
        return torch.device("cpu")
    return None


class ShardGroups:
    """The engine's groups over one domain's shard mesh: broadcasts (``shard_group``) and
    stage-1 reduces (``reduce_group``, the same ranks).

    Attributes:
        rank / size: This rank's place in the shard mesh.
        prefix: Put before the collective kinds in :class:`CommStats` ("" for the
            dense domain, "expert_" for the experts').
    """

    def __init__(self, mesh: DeviceMesh, prefix: str) -> None:
        self.rank = mesh.get_local_rank()
        self.size = mesh.size()
        self.prefix = prefix
        device = mesh_device(mesh)
        self.shard_group = engine_group(mesh.get_group(), f"dmuon_{prefix}shard", device)
        self.reduce_group = engine_group(mesh.get_group(), f"dmuon_{prefix}shard_reduce", device)

    def kind(self, collective: str) -> str:
        return self.prefix + collective


def is_fake(group: dist.ProcessGroup) -> bool:
    """Whether ``group`` runs on torch's fake backend (TorchTitan's ``--comm.mode
    fake_backend`` dry run: one process stands for every rank, its collectives move
    nothing and a gather returns this rank's value for every rank)."""
    return dist.get_backend(group) == "fake"


def mesh_device(mesh: DeviceMesh) -> torch.device:
    """The device a mesh's collectives (and the Newton-Schulz of its owners) run on."""
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    return torch.device(mesh.device_type, torch.accelerator.current_device_index())


def barrier(group: dist.ProcessGroup | None = None) -> None:
    """Wait until every rank of ``group`` (None: the default group) gets here, outside any
    step (not counted)."""
    dist.barrier(group=group)


def all_gather_rows(row: list[int], group: dist.ProcessGroup, device) -> list[list[int]]:
    """``row`` (integers, the same length on every rank) of every rank of ``group``, in
    group rank order: one all-gather, outside any step (not counted)."""
    mine = torch.tensor(row, dtype=torch.int64, device=device)
    check_device("all_gather", mine, group)
    everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    return [[int(x) for x in t.tolist()] for t in everyone]


def gather_over_groups(groups: list[dist.ProcessGroup | None], obj) -> dict[int, object]:
    """``{global rank: obj}`` of every rank the chained ``groups`` reach: one
    ``all_gather_object`` per group (None and 1-rank groups skipped), each carrying what
    the earlier ones gathered. A collective: every rank of those groups calls it with the
    same chain."""
    known = {dist.get_rank(): obj}
    for group in groups:
        if group is None or dist.get_world_size(group) == 1:
            continue
        rows = [None] * dist.get_world_size(group)
        dist.all_gather_object(rows, known, group=group)
        for row in rows:
            known.update(row)
    return known


def flagged_grad_bucket(
    grads: list[torch.Tensor | None], numels: list[int], dtype: torch.dtype, device
) -> torch.Tensor:
    """The gradients back to back, each at the start of a slot of ``numels`` elements
    (zeros where one is None, and past its end), then one has-gradient flag per gradient:
    a bucket of the same size on every rank, whatever gradients each rank computed, so
    that a gradient no rank computed can be told from one whose sum is zero."""
    total = sum(numels)
    # Each element written once: the gradients copied, only the rest zeroed.
    bucket = torch.empty(total + len(grads), dtype=dtype, device=device)
    bucket[total:].zero_()
    offset = 0
    for i, (grad, numel) in enumerate(zip(grads, numels, strict=True)):
        end = offset
        if grad is not None:
            end += grad.numel()
            bucket[offset:end].copy_(grad.reshape(-1))
            bucket[total + i] = 1
        if end < offset + numel:
            bucket[end : offset + numel].zero_()
        offset += numel
    return bucket
