"""Owner balance of MoE models: one owner per expert stack vs per-expert pieces.

    .venv/bin/python benchmarks/bench_moe_balance.py --ranks 4 8 --out outputs/bench_moe_balance

Builds TorchTitan's MoE models on the meta device (no memory, no process group), selects
the matrices a DMuon config selects (attention, dense / shared-expert / routed-expert FFN
matrices; not the router gate, norms or embeddings) with the MoE and experts modules as
hook boundaries, and plans their owners over each rank count in two ways:

* ``per_expert``: the engine's plan (``build_plan``): each routed-expert stack split into
  up to one piece of contiguous experts per rank, balanced with the dense matrices;
* ``per_stack``: the same LPT rule over whole parameters, one owner per stack (the
  engine before per-expert ownership).

For each it reports the max/mean per-rank Newton-Schulz cost and per-rank bytes held
between steps (``Plan.held_bytes``: values in ``--values-dtype``, masters and momentum in
``--master-dtype``: TorchTitan's bf16 compute with fp32 master and momentum by default),
prints a table and writes ``results.json`` and ``moe_balance.png`` into ``--out``.
"""

from __future__ import annotations

import argparse
import copy
import fnmatch
import json
from pathlib import Path

import torch
from torch import nn
from torchtitan.protocols.train_spec import get_train_spec

from torchtitan_dmuon.engine.plan import (
    HeldDtypes,
    PartitionItem,
    Plan,
    assign_owners,
    build_plan,
    default_boundary_modules,
)
from torchtitan_dmuon.optim.newton_schulz import ns_flops

MODELS = [
    ("llama4", "debugmodel"),
    ("qwen3", "debugmodel_moe"),
    ("deepseek_v3", "debugmodel"),
    ("qwen3", "30B-A3B"),
    ("deepseek_v3", "16B"),
]
# train_configs/llama4_debug_moe.toml and deepseek_v3_debug_moe.toml together.
PARAMS = [
    "layers.*.attention.w[qkvo].weight",
    "layers.*.attention.wq_[ab].weight",
    "layers.*.attention.wkv_[ab].weight",
    "layers.*.feed_forward.w[123].weight",
    "layers.*.moe.shared_experts.w[123].weight",
    "layers.*.moe.experts.w[123]",
]
HOOK_BOUNDARIES = ["layers.*.moe", "layers.*.moe.experts"]


def build_meta_model(name: str, flavor: str) -> nn.Module:
    spec = get_train_spec(name)
    args = copy.copy(spec.model_args[flavor])
    # Set from [parallelism] by update_from_config in a run; the default backend here.
    args.moe_impl = "standard"
    with torch.device("meta"):
        return spec.model_cls(args)


def plan_for(model: nn.Module, ranks: int) -> Plan:
    selected = [
        (n, p)
        for n, p in model.named_parameters()
        if any(fnmatch.fnmatchcase(n, pattern) for pattern in PARAMS)
    ]
    blocks = default_boundary_modules(model)

    def boundary(name: str, module: nn.Module) -> bool:
        return module in blocks or any(fnmatch.fnmatchcase(name, p) for p in HOOK_BOUNDARIES)

    return build_plan(
        model, selected, shard_size=ranks, replicate_size=1, hook_boundary_predicate=boundary
    )


def ratio(loads: list[int]) -> float:
    return max(loads) / (sum(loads) / len(loads))


def per_expert_loads(plan: Plan, dtypes: HeldDtypes):
    ns = [0] * plan.slots
    for unit in plan.units:
        ns[unit.column] += sum(ns_flops(d.layout.shape, 1) for d in unit.params)
    return ns, plan.held_bytes(dtypes)


def per_stack_loads(plan: Plan, dtypes: HeldDtypes):
    params = [(b, p) for b, boundary in enumerate(plan.boundaries) for p in boundary.parameters]
    items = [PartitionItem(ns_flops(p.shape, 1), b) for b, p in params]
    owners = assign_owners(items, plan.slots)
    ns, held = [0] * plan.slots, [0] * plan.slots
    # Plan.held's terms for a whole stack owned alone (no padding): values, momentum and
    # a master where the values are kept in another dtype.
    master = dtypes.master.itemsize * (2 if dtypes.values != dtypes.master else 1)
    for item, (_, p), owner in zip(items, params, owners, strict=True):
        ns[owner] += item.cost
        held[owner] += p.numel() * (dtypes.values.itemsize + master)
    return ns, held


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['model']} {r['flavor']}\n{r['ranks']} ranks" for r in rows]
    x = range(len(rows))
    fig, axes = plt.subplots(1, 2, figsize=(max(8, 1.6 * len(rows)), 4.5))
    for ax, key, title in zip(
        axes, ("ns", "held"), ("Newton-Schulz cost", "bytes held"), strict=True
    ):
        ax.bar([i - 0.2 for i in x], [r[f"per_stack_{key}"] for r in rows], 0.4, label="per stack")
        ax.bar(
            [i + 0.2 for i in x], [r[f"per_expert_{key}"] for r in rows], 0.4, label="per expert"
        )
        ax.axhline(1.0, color="gray", linewidth=0.8)
        ax.set_xticks(list(x), labels, fontsize=7)
        ax.set_title(f"max/mean per-rank {title}")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--values-dtype", default="bfloat16")
    parser.add_argument("--master-dtype", default="float32")
    parser.add_argument("--out", type=Path, default=Path("outputs/bench_moe_balance"))
    args = parser.parse_args()
    dtypes = HeldDtypes(getattr(torch, args.values_dtype), getattr(torch, args.master_dtype))
    import torchtitan_dmuon.titan  # noqa: F401 - registers the DMuon train specs

    rows = []
    for name, flavor in MODELS:
        model = build_meta_model(name, flavor)
        for ranks in args.ranks:
            plan = plan_for(model, ranks)
            expert_ns, expert_held = per_expert_loads(plan, dtypes)
            stack_ns, stack_held = per_stack_loads(plan, dtypes)
            rows.append(
                dict(
                    model=name,
                    flavor=flavor,
                    ranks=ranks,
                    per_stack_ns=ratio(stack_ns),
                    per_expert_ns=ratio(expert_ns),
                    per_stack_held=ratio(stack_held),
                    per_expert_held=ratio(expert_held),
                    per_stack_max_held_gib=max(stack_held) / 2**30,
                    per_expert_max_held_gib=max(expert_held) / 2**30,
                )
            )
    header = (
        f"{'model':<28}{'ranks':>6}  {'NS max/mean':>19}  {'held max/mean':>19}  "
        f"{'max held GiB':>21}"
    )
    kinds = f"{'stack':>9}{'expert':>10}"
    print(header)
    print(f"{'':<34}  {kinds}  {kinds}  {'stack':>10}{'expert':>11}")
    for r in rows:
        print(
            f"{r['model'] + ' ' + r['flavor']:<28}{r['ranks']:>6}  "
            f"{r['per_stack_ns']:>9.3f}{r['per_expert_ns']:>10.3f}  "
            f"{r['per_stack_held']:>9.3f}{r['per_expert_held']:>10.3f}  "
            f"{r['per_stack_max_held_gib']:>10.3f}{r['per_expert_max_held_gib']:>11.3f}"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    meta = dict(values_dtype=args.values_dtype, master_dtype=args.master_dtype, params=PARAMS)
    (args.out / "results.json").write_text(json.dumps(dict(settings=meta, rows=rows), indent=2))
    plot(rows, args.out / "moe_balance.png")
    print(f"wrote {args.out / 'results.json'} and {args.out / 'moe_balance.png'}")


if __name__ == "__main__":
    main()
