"""How the owner plan scales with the number of ranks: Llama-3.1 8B and 70B, 8 to 1024 ranks.

    .venv/bin/python benchmarks/bench_plan_scaling.py --out benchmarks/results/plan_scaling

Builds TorchTitan's llama3 8B and 70B on the meta device (no memory, no process group),
selects what DMuon selects by default (each block's attention and feed-forward matrices)
and plans their owners with the engine's own planner for FSDP (1 x N) and HSDP (N/8
replicas x 8 ranks, one node of 8 GPUs per replica), N = 8 ... 1024, twice: one owner
per matrix (``build_plan`` with ``group_size=1``: LPT by Newton-Schulz FLOPs, one unit
per boundary and owner) and the planner's own choice (``plan_with_groups``: the owner-group
size whose busiest rank spends the least modeled time on Newton-Schulz on an H100, its
products and its groups' Gram all-reduces, what ``dedicate_params`` does by default).

Per layout it reports, over the data-parallel ranks: the max/mean Newton-Schulz FLOPs
(``ns_flops``), how many ranks own nothing, the max/mean bytes held between steps for
the dedicated matrices (``Plan.held_bytes``, the engine's one formula: values in
``--values-dtype``, masters and momentum in ``--master-dtype``; TorchTitan's bf16 compute
with fp32 master and momentum by default) and the busiest rank's held bytes, NS FLOPs per step and
modeled NS time on an H100 (``engine/machine.py``: peak bf16 FLOP/s, Grams at NVLink
speed within a node); prints a markdown table and writes ``results.json`` and
``plan_scaling.png`` into ``--out``.
Counted from the plan, not measured: no step runs.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_moe_balance import build_meta_model  # noqa: E402

from torchtitan_dmuon.engine.machine import DEFAULT_GPU  # noqa: E402
from torchtitan_dmuon.engine.plan import (  # noqa: E402
    HeldDtypes,
    build_plan,
    max_over_mean,
    plan_with_groups,
)
from torchtitan_dmuon.titan.config import MODEL_SELECTIONS  # noqa: E402

MODELS = [("llama3", "8B"), ("llama3", "70B")]
RANKS = [8, 16, 32, 64, 128, 256, 512, 1024]
GPUS_PER_NODE = 8
NS_STEPS = 5  # torch.optim.Muon's default


def plan_rows(name: str, flavor: str, ranks: list[int], dtypes: HeldDtypes):
    model = build_meta_model(name, flavor)
    patterns = MODEL_SELECTIONS[name].params
    selected = [
        (n, p)
        for n, p in model.named_parameters()
        if any(fnmatch.fnmatchcase(n, pattern) for pattern in patterns)
    ]
    for n in ranks:
        for layout, replicate in (("FSDP", 1), ("HSDP", max(1, n // GPUS_PER_NODE))):
            if layout == "HSDP" and replicate == 1:
                continue
            shard = n // replicate

            def build(size, shard=shard, replicate=replicate):
                return build_plan(
                    model, selected, shard_size=shard, replicate_size=replicate,
                    hook_boundary_predicate=None, group_size=size,
                )  # fmt: skip

            for owners, plan in (("one", build(1)), ("planner", plan_with_groups(build, shard))):
                ns = plan.ns_loads()
                held = plan.held_bytes(dtypes)
                yield dict(
                    model=f"{name} {flavor}",
                    layout=f"{layout} {replicate}x{shard}",
                    owners=owners,
                    group_size=plan.group_size,
                    ranks=n,
                    matrices=len(selected),
                    ns_max_over_mean=max_over_mean(ns),
                    idle_ranks=sum(load == 0 for load in ns),
                    held_max_over_mean=max_over_mean(held),
                    held_max_gib=max(held) / 2**30,
                    ns_max_tflop=max(ns) * NS_STEPS / 1e12,
                    ns_modeled_ms=max(plan.modeled_loads(DEFAULT_GPU))
                    * NS_STEPS
                    / (DEFAULT_GPU.peak_tflops * 1e9),
                )


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    series = sorted({(r["model"], r["layout"].split()[0], r["owners"]) for r in rows})
    for model, layout, owners in series:
        mine = [
            r
            for r in rows
            if r["model"] == model and r["layout"].startswith(layout) and r["owners"] == owners
        ]
        x = [r["ranks"] for r in mine]
        style = "--" if owners == "one" else "-"
        for ax, key in zip(
            axes, ("ns_max_over_mean", "held_max_over_mean", "idle_ranks"), strict=True
        ):
            label = f"{model} {layout}, " + ("one owner" if owners == "one" else "planner")
            ax.plot(x, [r[key] for r in mine], style, marker="o", label=label)
    for ax, title in zip(
        axes,
        ("Newton-Schulz FLOPs, max/mean", "held bytes, max/mean", "ranks owning nothing"),
        strict=True,
    ):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("data-parallel ranks")
        ax.set_title(title)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=RANKS)
    parser.add_argument("--values-dtype", default="bfloat16")
    parser.add_argument("--master-dtype", default="float32")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/plan_scaling"))
    args = parser.parse_args()
    dtypes = HeldDtypes(getattr(torch, args.values_dtype), getattr(torch, args.master_dtype))
    rows = [row for name, flavor in MODELS for row in plan_rows(name, flavor, args.ranks, dtypes)]
    print(f"plan only (no step runs); torch {torch.__version__}")
    print(
        "| model | layout | owners | group size | ranks | matrices | NS max/mean | "
        "ranks owning nothing | held max/mean | busiest rank held GiB | "
        "busiest rank NS, 10^12 multiply-adds/step | busiest rank NS on an H100, ms "
        "(modeled) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['model']} | {r['layout']} | {r['owners']} | {r['group_size']} | "
            f"{r['ranks']} | {r['matrices']} | "
            f"{r['ns_max_over_mean']:.2f} | {r['idle_ranks']} | {r['held_max_over_mean']:.2f} | "
            f"{r['held_max_gib']:.2f} | {r['ns_max_tflop']:.2f} | {r['ns_modeled_ms']:.2f} |"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    settings = dict(values_dtype=args.values_dtype, master_dtype=args.master_dtype)
    (args.out / "results.json").write_text(json.dumps(dict(settings=settings, rows=rows), indent=2))
    plot(rows, args.out / "plan_scaling.png")
    print(f"wrote {args.out / 'results.json'} and {args.out / 'plan_scaling.png'}")


if __name__ == "__main__":
    main()
