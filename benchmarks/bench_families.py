"""Loss curves per model family, DMuon beside AdamW, on the debug sizes through TorchTitan.

    .venv/bin/python benchmarks/bench_families.py --steps 60 --out benchmarks/results/families
    .venv/bin/python benchmarks/bench_families.py --families qwen2.5-1.5B --nproc 8 \
        --ns-dtype auto --steps 20   # the real sizes: GPUs (docs/gpu.md)

Trains each family's debug config (llama3 through TorchTitan's own model; Qwen2.5, Mistral
and Llama-3.2 through its HF backend, which needs ``transformers``: ``setup.sh --dev``)
with ``./run_train.sh`` at ``--nproc`` ranks (FSDP), once with DMuon (the config's
optimizer; ``--ns-dtype float32`` by default, so that a CPU run does not depend on the
CPU) and once with
``--optimizer.name AdamW`` (the config's AdamW settings for every parameter), the same
seed, data and schedule. Reads the loss of every step from TorchTitan's log, prints a
table (first, middle and last step) and writes ``results.json`` and ``loss_curves.png``
into ``--out``. A benchmark, not a test: the figures depend on the step count and the
learning rates of the configs, which are not tuned per family. A run that fails is kept
in the results with its last error line, and the others go on.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from titan_cases import LOSS, failure_reason, run_command, this_machine  # noqa: E402

DEBUG = {
    "llama3": "train_configs/debug_cpu.toml",
    "qwen2.5": "train_configs/hf_qwen2.5_debug.toml",
    "mistral": "train_configs/hf_mistral_debug.toml",
    "llama3.2": "train_configs/hf_llama3.2_debug.toml",
}
REAL = {  # the published sizes: GPUs only
    "qwen2.5-1.5B": "train_configs/hf_qwen2.5_1.5b_fsdp.toml",
    "qwen2.5-7B": "train_configs/hf_qwen2.5_7b_fsdp.toml",
    "mistral-7B": "train_configs/hf_mistral_7b_fsdp.toml",
    "llama3.2-3B": "train_configs/hf_llama3.2_3b_fsdp.toml",
}
FAMILIES = {**DEBUG, **REAL}
OPTIMIZERS = ("dmuon", "adamw")


def losses(config: str, optimizer: str, args, dump: Path) -> dict[int, float] | str:
    """Every step's loss of one run (rank 0's log), or its last error line."""
    cmd = [
        "./run_train.sh",
        "--job.config_file", config,
        "--job.dump_folder", str(dump),
        "--training.steps", str(args.steps),
        "--metrics.log_freq", "1",
        "--metrics.no-enable_tensorboard",
        "--checkpoint.no-enable",
    ]  # fmt: skip
    cmd += ["--dmuon.ns_dtype", args.ns_dtype] if optimizer == "dmuon" else []
    cmd += ["--optimizer.name", "AdamW"] if optimizer == "adamw" else []
    rc, output = run_command(cmd, dict(os.environ, NGPU=str(args.nproc)), args.timeout)
    if rc != 0:
        return failure_reason(output)
    return {int(s): float(v) for s, v in LOSS.findall(output)}


def plot(curves: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(curves), figsize=(4 * len(curves), 3.5), squeeze=False)
    for ax, (family, by_optimizer) in zip(axes[0], curves.items(), strict=True):
        for optimizer, steps in by_optimizer.items():
            if isinstance(steps, dict):  # not a failed run's error line
                ax.plot(list(steps), list(steps.values()), label=optimizer)
        ax.set_title(family)
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", choices=list(FAMILIES), default=list(DEBUG))
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--ns-dtype", default="float32", help="DMuon's [dmuon] ns_dtype")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per run")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/families"))
    args = parser.parse_args()
    machine = this_machine()
    print(f"machine: {machine}")
    curves: dict[str, dict[str, dict[int, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for family in args.families:
            curves[family] = {
                optimizer: losses(FAMILIES[family], optimizer, args, Path(tmp) / family / optimizer)
                for optimizer in OPTIMIZERS
            }
    middle = args.steps // 2
    print(f"| family | config | DMuon: step 1 / {middle} / {args.steps} | AdamW: step 1 / "
          f"{middle} / {args.steps} |")  # fmt: skip
    print("|---|---|---|---|")
    for family, by_optimizer in curves.items():
        cells = [
            " / ".join(f"{steps[s]:.3f}" for s in (1, middle, args.steps))
            if isinstance(steps, dict)
            else f"FAIL: {steps}"
            for steps in by_optimizer.values()
        ]
        print(f"| {family} | {FAMILIES[family]} | {cells[0]} | {cells[1]} |")
    args.out.mkdir(parents=True, exist_ok=True)
    settings = dict(
        nproc=args.nproc,
        steps=args.steps,
        ns_dtype=args.ns_dtype,
        configs={f: FAMILIES[f] for f in args.families},
    )
    (args.out / "results.json").write_text(
        json.dumps(dict(machine=machine, settings=settings, curves=curves), indent=2)
    )
    plot(curves, args.out / "loss_curves.png")
    print(f"wrote {args.out / 'results.json'} and {args.out / 'loss_curves.png'}")


if __name__ == "__main__":
    main()
