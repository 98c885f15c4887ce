"""TorchTitan's dry run at cluster scale, DMuon beside AdamW: wall time, peak memory, start.

    .venv/bin/python benchmarks/bench_dry_run.py --case llama3_70b_2048   # both optimizers
    .venv/bin/python benchmarks/bench_dry_run.py --table                  # the table only

Each case runs ``NGPU=N COMM_MODE=fake_backend ./run_train.sh`` (one process standing for
N ranks on torch's fake process group, one step; nothing is communicated) with DMuon and
with AdamW under ``/usr/bin/time -v``, on the offline corpus and tokenizer, and records:
the wall time and maximum resident size of the process, TorchTitan's memory line, the
start (from "Applied FSDP" to "Training starts": materializing and initializing the model,
where DMuon starts at the plan's size), the step (from "Training starts" to step 1's
line), and DMuon's plan line (owner groups, NS balance) and plan report (held bytes,
max and mean over ranks). Results accumulate in ``docs/figures/dry_run/results.json``
(one entry per case and optimizer, with the machine and commit); the markdown table in
docs/scaling.md is printed from it.

    .venv/bin/python benchmarks/bench_dry_run.py --model-start   # a real run's start, modeled

A real run (not a dry run) draws every dedicated matrix on every rank, on a scratch, so
that what a rank keeps equals a full initialization's values (``engine/meta_init.py``).
``--model-start`` counts those elements for llama3 70B and 405B (DMuon's default
selection) and models the time on an H100: the bytes TorchTitan's initialization moves
per fp32 element (``trunc_normal_``, torch 2.13-2.14: ``normal_``, then two comparisons,
their ``or`` and an ``any`` over the result, unfused) at the HBM's data-sheet bandwidth.
"""

from __future__ import annotations

import argparse
import datetime
import fnmatch
import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_convergence import machine  # noqa: E402

RESULTS = ROOT / "docs" / "figures" / "dry_run" / "results.json"
COMMON = [
    "--model.hf_assets_path", "./assets/tokenizer", "--training.dataset", "c4_test",
    "--training.dataset_path", "./assets/corpus", "--training.seq_len", "128",
    "--compile.no-enable", "--activation_checkpoint.mode", "none", "--checkpoint.no-enable",
    "--metrics.no-enable_tensorboard", "--training.steps", "1",
]  # fmt: skip
# name: (ranks, config file, layout, extra flags)
CASES = {
    "llama3_8b_1024": (1024, "llama3_8b_fsdp_z3.toml", "FSDP Z3", ["--model.flavor", "8B"]),
    "llama3_70b_2048": (2048, "llama3_8b_fsdp_z3.toml", "FSDP Z3", ["--model.flavor", "70B"]),
    "llama3_70b_4096": (4096, "llama3_8b_fsdp_z3.toml", "FSDP Z3", ["--model.flavor", "70B"]),
    "llama3_405b_4096": (4096, "llama3_8b_fsdp_z3.toml", "FSDP Z3", ["--model.flavor", "405B"]),
    "llama3_405b_4096_hsdp": (
        4096,
        "llama3_8b_fsdp_z3.toml",
        "HSDP 512 x 8, Z3",
        [
            "--model.flavor",
            "405B",
            "--parallelism.data_parallel_replicate_degree",
            "512",
            "--parallelism.data_parallel_shard_degree",
            "8",
        ],
    ),  # fmt: skip
}
OPTIMIZERS = ("DMuon", "AdamW")
# A real run's start (--model-start): bytes per fp32 element of trunc_normal_'s unfused
# kernels (normal_ writes 4; two comparisons read 4 and write 1 each; their or reads 2 and
# writes 1; any reads 1) and H100 SXM's HBM3 bandwidth (data sheet).
INIT_BYTES_PER_ELEMENT = 4 + 2 * (4 + 1) + (2 + 1) + 1
HBM_BYTES_PER_S = 3.35e12
_STAMP = r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})"


def _seconds_between(output: str, first: str, second: str) -> float | None:
    """Seconds from the log line containing ``first`` to the next one containing ``second``."""
    times = {}
    for line in output.splitlines():
        match = re.search(_STAMP, line)
        for key in (first, second):
            if match and key in line and key not in times:
                times[key] = datetime.datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f")
    if first not in times or second not in times:
        return None
    return round((times[second] - times[first]).total_seconds(), 1)


def _found(pattern: str, text: str) -> str | None:
    match = re.search(pattern, text)
    return match.group(1) if match else None


def run_case(name: str, optimizer: str) -> dict:
    ranks, config, layout, extra = CASES[name]
    command = [
        "/usr/bin/time", "-v", "./run_train.sh", "--job.config_file", f"train_configs/{config}",
        *COMMON, *extra, "--optimizer.name", optimizer,
    ]  # fmt: skip
    env = dict(os.environ, NGPU=str(ranks), COMM_MODE="fake_backend")
    run = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    output = run.stdout + run.stderr
    wall = _found(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (\S+)", output)
    rss = _found(r"Maximum resident set size \(kbytes\): (\d+)", output)
    return {
        "case": name,
        "optimizer": optimizer,
        "ranks": ranks,
        "layout": layout,
        "command": f"NGPU={ranks} COMM_MODE=fake_backend " + " ".join(command[2:]),
        "exit": run.returncode,
        "wall": wall,
        "max_rss_gib": round(int(rss) / 2**20, 2) if rss else None,
        "torchtitan_memory_gib": _found(r"step:\s+1 .*memory:\s+([\d.]+)GiB", output),
        "start_s": _seconds_between(output, "Applied FSDP", "Training starts"),
        "step_s": _seconds_between(output, "Training starts", "step:  1"),
        "plan": _found(r"dedicate_params: (.*)", output),
        "started": _found(r"started at the plan's size: (.*)", output),
        "report": _found(r"plan report of model part 0: (.*)", output),
        "tail": output[-3000:] if run.returncode else "",
        "machine": machine(),
    }


def _ns_balance(entry: dict) -> str:
    return _found(r"NS balance ([\d.]+)", entry.get("plan") or "") or ""


def _held_balance(entry: dict) -> str:
    match = re.search(
        r"holds [\d.]+ MiB of them \(max ([\d.]+), mean ([\d.]+)\)", entry["report"] or ""
    )
    return f"{float(match.group(1)) / float(match.group(2)):.3f}" if match else ""


def table(results: list[dict]) -> str:
    header = [
        "model, ranks", "layout", "optimizer", "exit", "wall", "start s", "step s",
        "max RSS GiB", "TorchTitan GiB", "NS max/mean", "held max/mean", "commit",
    ]  # fmt: skip
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    for e in results:
        row = [
            f"{e['case']}", e["layout"], e["optimizer"], str(e["exit"]), e["wall"] or "",
            str(e["start_s"]), str(e["step_s"]), str(e["max_rss_gib"]),
            str(e["torchtitan_memory_gib"]), _ns_balance(e), _held_balance(e),
            e["machine"]["git_commit"][:7] + ("+" if e["machine"]["git_dirty"] else ""),
        ]  # fmt: skip
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def model_start() -> None:
    """Print the dedicated elements every rank draws at a real run's start, and their
    modeled time on an H100 (see the module)."""
    from bench_moe_balance import build_meta_model

    from torchtitan_dmuon.titan.config import MODEL_SELECTIONS

    patterns = MODEL_SELECTIONS["llama3"].params
    print("| llama3 | dedicated matrices | elements | largest matrix (scratch) | modeled s |")
    print("| --- | --- | --- | --- | --- |")
    for flavor in ("70B", "405B"):
        model = build_meta_model("llama3", flavor)
        matrices = [
            p
            for n, p in model.named_parameters()
            if any(fnmatch.fnmatchcase(n, pattern) for pattern in patterns)
        ]
        elements = sum(p.numel() for p in matrices)
        largest = max(p.numel() for p in matrices) * 4 / 2**30
        seconds = elements * INIT_BYTES_PER_ELEMENT / HBM_BYTES_PER_S
        print(
            f"| {flavor} | {len(matrices)} | {elements / 1e9:.1f}e9 | {largest:.2f} GiB fp32 "
            f"| {seconds:.2f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--case", choices=sorted(CASES), action="append", default=[])
    parser.add_argument("--optimizer", choices=OPTIMIZERS, action="append")
    parser.add_argument("--table", action="store_true", help="print the table and exit")
    parser.add_argument("--model-start", action="store_true", help="model a real run's start")
    args = parser.parse_args()
    if args.model_start:
        model_start()
        return
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else []
    for name in args.case:
        for optimizer in args.optimizer or OPTIMIZERS:
            entry = run_case(name, optimizer)
            results = [r for r in results if (r["case"], r["optimizer"]) != (name, optimizer)]
            results.append(entry)
            RESULTS.parent.mkdir(parents=True, exist_ok=True)
            RESULTS.write_text(json.dumps(results, indent=2) + "\n")
            print(f"{name} {optimizer}: exit {entry['exit']}, wall {entry['wall']}", flush=True)
    order = {name: i for i, name in enumerate(CASES)}
    results.sort(key=lambda r: (order.get(r["case"], len(order)), r["optimizer"]))
    m = results[0]["machine"] if results else machine()
    print(f"{m['cpu_model']}, {m['cpu_count']} cores, {m['cpu_capability']}, torch {m['torch']}")
    print(table(results))


if __name__ == "__main__":
    main()
