"""What QK-clip costs a training step: TorchTitan's debug llama3 (the default config's model:
6 layers, dim 256, 16 heads, vocab 2048) trained by ``torchtitan_dmuon.Muon`` in one
process, with and without ``qk_clip``, at the default config's sequence length (128) and at
2048, the same batch of ``--batch`` sequences.

    .venv/bin/python benchmarks/bench_qk_clip.py --out outputs/bench_qk_clip

The two modes take turns step by step after a warm-up, so drift hits both alike. Per
sequence length it reports the median step time (forward, backward, Muon + AdamW step) of
each mode, their ratio, and the time inside QK-clip's own ranges (``muon::qk_max_logits``:
the per-head maxima in forward; ``muon::qk_clip``: the rescaling in the step) from a
profiled step. The max-logit pass computes every visible score again, in fp32 and
without the attention kernel's fusion: its cost grows with ``seq_len ** 2`` like
attention's, while the rest of the step grows with ``seq_len``. Prints a table and writes
``results.json`` and ``qk_clip.png`` into ``--out``. The data-parallel MAX all-reduce
(one per step, heads x layers floats, overlapping Newton-Schulz) is not in a one-process
figure; bench_step's counters show it is a few hundred bytes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from torchtitan.models.llama3 import Transformer, llama3_args

from torchtitan_dmuon import Muon
from torchtitan_dmuon.optim.ns_cache import cpu_description
from torchtitan_dmuon.titan.config import DEFAULT_PARAM_PATTERNS, DMuon
from torchtitan_dmuon.titan.parallelize import muon_predicate
from torchtitan_dmuon.titan.qk_clip import build_qk_clip

RANGES = ("muon::qk_max_logits", "muon::qk_clip")


class _OneProcess:
    cp = 1
    tp = 1


def _trainer(seq_len: int, batch: int, threshold: float | None):
    torch.manual_seed(0)
    args = llama3_args["debugmodel"]
    model = Transformer(args)
    with torch.no_grad():
        model.init_weights()
    settings = DMuon(params=list(DEFAULT_PARAM_PATTERNS), qk_clip_threshold=threshold or 0.0)
    opt = Muon(
        model,
        predicate=muon_predicate(settings),
        ns_dtype="auto",
        qk_clip=build_qk_clip(model, settings, _OneProcess()),
    )
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, args.vocab_size, (batch, seq_len + 1), generator=g)

    def step() -> float:
        start = time.perf_counter()
        opt.zero_grad()
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        opt.step()
        return time.perf_counter() - start

    return step


def _range_ms(step) -> dict[str, float]:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    totals = dict.fromkeys(RANGES, 0.0)
    for event in prof.events():
        if event.name in totals:
            totals[event.name] += event.cpu_time_total / 1e3
    return totals


def measure(seq_len: int, args: argparse.Namespace) -> dict:
    modes = {
        "muon": _trainer(seq_len, args.batch, None),
        "qk_clip": _trainer(seq_len, args.batch, args.threshold),
    }
    times: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(args.warmup):
        for step in modes.values():
            step()
    for _ in range(args.steps):
        for mode, step in modes.items():
            times[mode].append(step())
    ranges = _range_ms(modes["qk_clip"])
    medians = {m: statistics.median(t) for m, t in times.items()}
    return {
        "seq_len": seq_len,
        "step_ms": {m: 1e3 * v for m, v in medians.items()},
        "spread_ms": {m: 1e3 * (max(t) - min(t)) for m, t in times.items()},
        "ratio": medians["qk_clip"] / medians["muon"],
        "range_ms": ranges,
        "max_logit_share": ranges["muon::qk_max_logits"] / (1e3 * medians["qk_clip"]),
    }


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    labels = [str(r["seq_len"]) for r in results]
    x = range(len(results))
    ax.bar([i - 0.2 for i in x], [r["step_ms"]["muon"] for r in results], 0.4, label="Muon")
    ratios = "/".join(f"{r['ratio']:.3f}" for r in results)
    ax.bar([i + 0.2 for i in x], [r["step_ms"]["qk_clip"] for r in results], 0.4,
           label=f"Muon + QK-clip (x{ratios})")  # fmt: skip
    ax.set_xticks(list(x), labels)
    ax.set_xlabel("seq_len")
    ax.set_ylabel("step time (ms, median)")
    ax.set_title("debug llama3, one process")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    args = _parse()
    results = [measure(s, args) for s in args.seq_lens]
    machine = f"{cpu_description()}, torch {torch.__version__}, {torch.get_num_threads()} threads"
    print(f"QK-clip (threshold {args.threshold}), debug llama3, batch {args.batch}; {machine}")
    print("| seq_len | Muon step ms | + QK-clip ms | ratio | max-logit pass ms | clip ms |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in results:
        print(
            f"| {r['seq_len']} | {r['step_ms']['muon']:.1f} | {r['step_ms']['qk_clip']:.1f} | "
            f"{r['ratio']:.3f} | {r['range_ms']['muon::qk_max_logits']:.1f} | "
            f"{r['range_ms']['muon::qk_clip']:.2f} |"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    record = {"machine": machine, "batch": args.batch, "threshold": args.threshold,
              "steps": args.steps, "results": results}  # fmt: skip
    (args.out / "results.json").write_text(json.dumps(record, indent=2))
    plot(results, args.out / "qk_clip.png")
    print(f"wrote {args.out / 'results.json'} and {args.out / 'qk_clip.png'}")


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[128, 2048])
    parser.add_argument("--batch", type=int, default=4, help="the default config's local batch")
    parser.add_argument("--threshold", type=float, default=100.0, help="Kimi K2's tau")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per mode")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("outputs/bench_qk_clip"))
    return parser.parse_args()


if __name__ == "__main__":
    main()
