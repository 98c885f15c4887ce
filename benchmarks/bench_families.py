"""Loss curves per model family, DMuon beside AdamW, on the debug sizes through TorchTitan.

    .venv/bin/python benchmarks/bench_families.py --steps 60 --out benchmarks/results/families

Trains each family's debug config (llama3 through TorchTitan's own model; Qwen2.5, Mistral
and Llama-3.2 through its HF backend, which needs ``transformers``: ``setup.sh --dev``)
with ``./run_train.sh`` at ``--nproc`` ranks (FSDP), once with DMuon (the config's
optimizer, fp32 Newton-Schulz so that the run does not depend on the CPU) and once with
``--optimizer.name AdamW`` (the config's AdamW settings for every parameter), the same
seed, data and schedule. Reads the loss of every step from TorchTitan's log, prints a
table (first, middle and last step) and writes ``results.json`` and ``loss_curves.png``
into ``--out``. A benchmark, not a test: the figures depend on the step count and the
learning rates of the configs, which are not tuned per family.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from titan_cases import LOSS, ROOT, this_machine  # noqa: E402

FAMILIES = {
    "llama3": "train_configs/debug_cpu.toml",
    "qwen2.5": "train_configs/hf_qwen2.5_debug.toml",
    "mistral": "train_configs/hf_mistral_debug.toml",
    "llama3.2": "train_configs/hf_llama3.2_debug.toml",
}
OPTIMIZERS = {
    "dmuon": ["--dmuon.ns_dtype", "float32"],
    "adamw": ["--optimizer.name", "AdamW"],
}


def losses(config: str, optimizer: str, args, dump: Path) -> dict[int, float]:
    """Every step's loss of one run (rank 0's log)."""
    cmd = [
        "./run_train.sh",
        "--job.config_file", config,
        "--job.dump_folder", str(dump),
        "--training.steps", str(args.steps),
        "--metrics.log_freq", "1",
        "--metrics.no-enable_tensorboard",
        "--checkpoint.no-enable",
        *OPTIMIZERS[optimizer],
    ]  # fmt: skip
    env = dict(os.environ, NGPU=str(args.nproc))
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"{config} {optimizer} failed:\n{(out.stdout + out.stderr)[-3000:]}")
    return {int(s): float(v) for s, v in LOSS.findall(out.stdout + out.stderr)}


def plot(curves: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(curves), figsize=(4 * len(curves), 3.5), squeeze=False)
    for ax, (family, by_optimizer) in zip(axes[0], curves.items(), strict=True):
        for optimizer, steps in by_optimizer.items():
            ax.plot(list(steps), list(steps.values()), label=optimizer)
        ax.set_title(family)
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", choices=list(FAMILIES), default=list(FAMILIES))
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60)
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
            for steps in by_optimizer.values()
        ]
        print(f"| {family} | {FAMILIES[family]} | {cells[0]} | {cells[1]} |")
    args.out.mkdir(parents=True, exist_ok=True)
    settings = dict(nproc=args.nproc, steps=args.steps, configs=FAMILIES, overrides=OPTIMIZERS)
    (args.out / "results.json").write_text(
        json.dumps(dict(machine=machine, settings=settings, curves=curves), indent=2)
    )
    plot(curves, args.out / "loss_curves.png")
    print(f"wrote {args.out / 'results.json'} and {args.out / 'loss_curves.png'}")


if __name__ == "__main__":
    main()
