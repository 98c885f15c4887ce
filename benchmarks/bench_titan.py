"""TorchTitan debug model through ./run_train.sh: DMuon's throughput beside AdamW's.

    .venv/bin/python benchmarks/bench_titan.py --nproc 2 --rounds 2 --out outputs/bench_titan

Runs the default config (train_configs/debug_cpu.toml) once per mode per round (DMuon
with the reference Newton-Schulz and with ``ns_backend = "auto"``), modes interleaved,
and reads TorchTitan's own per-step tokens/s from the log (steps after the warm-up).
``--modes adamw_pp dmuon_pp`` compares them under pipeline parallelism (PP 2, 1F1B; the
other ranks data-parallel), each against its own AdamW row (``adamw_pp``). Prints a table
and writes ``results.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TPS = re.compile(r"step:\s*(\d+)\s+loss:\s*(\S+).*?tps:\s*([\d,]+)")
PP = [
    "--parallelism.pipeline_parallel_degree", "2",
    "--parallelism.pipeline_parallel_schedule", "1F1B",
]  # fmt: skip
MODES = {
    "adamw": ["--optimizer.name", "AdamW"],
    "adamw_pp": ["--optimizer.name", "AdamW", *PP],
    "dmuon_pp": ["--dmuon.ns_backend", "torch", *PP],
    "dmuon_z3": ["--dmuon.ns_backend", "torch"],
    "dmuon_z2": ["--dmuon.reshard_after_forward", "False", "--dmuon.ns_backend", "torch"],
    "dmuon_z3_auto": ["--dmuon.ns_backend", "auto"],
    "dmuon_z2_auto": ["--dmuon.reshard_after_forward", "False", "--dmuon.ns_backend", "auto"],
}


def run(mode: str, args, dump: Path) -> dict[int, tuple[float, float]]:
    cmd = [
        "./run_train.sh",
        "--job.dump_folder", str(dump),
        "--training.steps", str(args.steps),
        "--metrics.log_freq", "1",
        "--metrics.no-enable_tensorboard",
        *MODES[mode],
    ]  # fmt: skip
    # Under PP only the last stage logs the loss: the first rank of the second half.
    log_rank = args.nproc // 2 if mode.endswith("_pp") else 0
    env = dict(os.environ, NGPU=str(args.nproc), LOG_RANK=str(log_rank))
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    if out.returncode != 0:
        raise RuntimeError(f"{mode} failed:\n{(out.stdout + out.stderr)[-3000:]}")
    return {
        int(s): (float(loss), float(tps.replace(",", "")))
        for s, loss, tps in TPS.findall(out.stdout + out.stderr)
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("outputs/bench_titan"))
    parser.add_argument(
        "--modes", nargs="+", choices=list(MODES), default=[m for m in MODES if "_pp" not in m]
    )
    args = parser.parse_args()
    tps = {m: [] for m in args.modes}
    final_loss = {m: [] for m in args.modes}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for mode in args.modes:
                steps = run(mode, args, Path(tmp) / f"{mode}{r}")
                tps[mode] += [v[1] for s, v in steps.items() if s > args.warmup]
                final_loss[mode].append(steps[max(steps)][0])

    def baseline(mode: str) -> float:
        return statistics.median(tps["adamw_pp" if mode.endswith("_pp") else "adamw"])

    rows = {
        m: {
            "tps_median": statistics.median(v),
            "step_time_ratio_to_adamw": baseline(m) / statistics.median(v),
            "final_loss": statistics.mean(final_loss[m]),
        }
        for m, v in tps.items()
    }
    print(f"{'mode':<14} {'tokens/s':>9} {'step x AdamW':>13} {'final loss':>11}")
    for m, r in rows.items():
        print(
            f"{m:<14} {r['tps_median']:9.0f} {r['step_time_ratio_to_adamw']:13.2f} "
            f"{r['final_loss']:11.4f}"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    config = {k: str(v) for k, v in vars(args).items()}
    (args.out / "results.json").write_text(json.dumps({"config": config, "rows": rows}, indent=2))
    print(f"wrote {args.out / 'results.json'}")


if __name__ == "__main__":
    main()
