"""The step's failure verdict: its cost a step, measured on gloo ranks, modeled at scale.

    python benchmarks/bench_agreement.py --worlds 2 4 8 --out docs/figures/agreement

``Muon.step`` is transactional: whether any rank failed is settled before any write takes
effect. Since 2026-12-06 that is a verdict on the device (``engine/owned.py``
``OwnedMatrices.computed``: two int32s MAX-all-reduced over each of the dedication's
data-parallel and TP groups, queued behind the step's work; the host reads it a step
later); before, an agreement on the host (a flag per rank, MAX-all-reduced over gloo
groups, every rank's host waiting for the slowest). This measures the verdict alone
(``computed`` with nothing to compute, after warm-up, the ranks lined up by a barrier
before each call; the median and 90th percentile over ``--calls`` of the slowest rank) on
FSDP2 (one shard group of the world) and, from 4 ranks, HSDP (2 replicas), with the tests'
model. On CPU the device is the host, so the verdict's gloo all-reduce still blocks it,
and several processes share this machine's cores: the figures bound a loopback message's
latency from above, not a network's.

The model: gloo's all-reduce is a ring, 2 (n - 1) messages one after the other on a group
of n ranks, each costing at least a network message's latency (20 and 50 us: TCP between
hosts of one data centre, ``--latency-us``): what the host agreement cost a step at 8,
128 and 1024 ranks, FSDP over all and HSDP with shard groups of 8. The device verdict
costs the host one enqueue and no wait; on the device it is one NCCL all-reduce of 8 bytes
per group (a tree: about 2 log2(n) hops at ``--device-hop-us``, 5 us), which the step's
writes wait for. Writes ``agreement.json`` and ``agreement.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests.support.dist import run_distributed  # noqa: E402

MODELED_WORLDS = (8, 128, 1024)
SHARD = 8
"""HSDP's shard group in the model: one node of 8 GPUs."""


def agreement_worker(rank: int, world: int, hsdp: bool, calls: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from tests.support.models import make_model, proj_predicate
    from torchtitan_dmuon import Muon, dedicate_params

    if hsdp:
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        shard, replicate = mesh["shard"], mesh["replicate"]
    else:
        mesh = shard = init_device_mesh("cpu", (world,))
        replicate = None
    model = make_model(seed=0)
    dedicate_params(model, shard, predicate=proj_predicate, replicate_mesh=replicate)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = Muon(model, lr=0.02)
    matrices = optimizer.matrices
    groups = [dist.get_world_size(g) for g in matrices._verdict_groups]
    for _ in range(5):
        matrices.computed([], None, None)
    seconds = []
    for _ in range(calls):
        dist.barrier()
        started = time.perf_counter()
        matrices.computed([], None, None)
        seconds.append(time.perf_counter() - started)
    del optimizer, model, matrices
    return {"groups": groups, "seconds": seconds}


def device_ms(world: int, shard: int | None, hop_us: float) -> float:
    """The device verdict's NCCL all-reduces: a tree, 2 log2(n) hops per group of n."""
    sizes = [world] if shard is None else [shard, world // shard]
    return sum(2 * math.log2(n) for n in sizes if n > 1) * hop_us / 1e3


def modeled_ms(world: int, shard: int | None, latency_us: float) -> float:
    """The host agreement's ring messages on the groups of a layout, times ``latency_us``."""
    sizes = [world] if shard is None else [shard, world // shard]
    return sum(2 * (n - 1) for n in sizes if n > 1) * latency_us / 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--latency-us", type=float, nargs="+", default=[20.0, 50.0])
    parser.add_argument("--device-hop-us", type=float, default=5.0)
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "bench_agreement")
    args = parser.parse_args()
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    machine = f"{cpu}, {torch.backends.cpu.get_cpu_capability()}, torch {torch.__version__}"
    measured = []
    for world in args.worlds:
        for hsdp in (False, True) if world >= 4 else (False,):
            by_rank = run_distributed(agreement_worker, world, hsdp, args.calls)
            # A call ends when the slowest rank's does: the per-call maximum over ranks.
            seconds = [r["seconds"] for r in by_rank]
            per_call = [max(column) for column in zip(*seconds, strict=True)]
            row = {
                "world": world,
                "layout": f"HSDP 2 x {world // 2}" if hsdp else f"FSDP {world}",
                "groups": by_rank[0]["groups"],
                "median_ms": round(statistics.median(per_call) * 1e3, 3),
                "p90_ms": round(statistics.quantiles(per_call, n=10)[-1] * 1e3, 3),
            }
            measured.append(row)
            print(row, flush=True)
    modeled = [
        {
            "world": world,
            "layout": layout,
            **{
                f"{latency:g}us_ms": round(modeled_ms(world, shard, latency), 2)
                for latency in args.latency_us
            },
            "device_ms": round(device_ms(world, shard, args.device_hop_us), 3),
        }
        for world in MODELED_WORLDS
        for layout, shard in (("FSDP", None), (f"HSDP, shard {SHARD}", SHARD))
        if shard is None or world > shard
    ]
    result = {"machine": machine, "calls": args.calls, "measured": measured, "modeled": modeled}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "agreement.json").write_text(json.dumps(result, indent=1))
    lines = [
        f"Measured on {machine}, {args.calls} calls, gloo on one machine (the verdict's",
        "all-reduces, per call, the slowest rank):",
        "",
        "| ranks | layout | verdict groups (ranks) | median ms | p90 ms |",
        "| --- | --- | --- | --- | --- |",
    ]
    lines += [
        f"| {r['world']} | {r['layout']} | {r['groups']} | {r['median_ms']} | {r['p90_ms']} |"
        for r in measured
    ]
    latencies = " | ".join(f"{latency:g} us a message" for latency in args.latency_us)
    lines += [
        "",
        "Modeled, a step: the host agreement before (a ring, 2 (n - 1) messages per group of",
        "n, each rank's host waiting), the device verdict now (no host wait; NCCL's tree on",
        f"the device, 2 log2(n) hops of {args.device_hop_us:g} us per group):",
        "",
        f"| ranks | layout | host agreement, {latencies} | device verdict |",
        "| --- | --- |" + " --- |" * len(args.latency_us) + " --- |",
    ]
    lines += [
        f"| {m['world']} | {m['layout']} | "
        + " | ".join(f"{m[f'{latency:g}us_ms']} ms" for latency in args.latency_us)
        + f" | {m['device_ms']} ms |"
        for m in modeled
    ]
    (args.out / "agreement.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
