"""TorchTitan v0.2.2's model-level and 8-rank integration cases, with DMuon and with AdamW.

    .venv/bin/python benchmarks/titan_cases.py --out benchmarks/results/titan_cases
    .venv/bin/python benchmarks/titan_cases.py --cases hsdp+tp pp_dp_tp --optimizers dmuon
    .venv/bin/python benchmarks/titan_cases.py --gpu-only --out out/cases   # 4-8 GPUs

Each case is launched through ``./run_train.sh`` on ``train_configs/debug_cpu.toml`` (the
CPU counterpart of TorchTitan's ``tests/integration_tests/base_config.toml``: llama3
debugmodel) with TorchTitan's own overrides unchanged, as its ``run_tests.py`` does, once
with DMuon (the config's optimizer) and once with ``--optimizer.name AdamW``. A case with
several commands (save, then resume) runs them in order into one dump folder. The
``balance_*`` rows are not TorchTitan's: each MoE model at EP 2 x FSDP 2 on 4 ranks, for
the Newton-Schulz and held-bytes balance of DMuon's startup line.

Prints a table and writes ``results.json``, ``table.md`` and ``final_loss.png`` into
``--out``; each run's folder (with its ``output.log``) goes under ``--dumps``.
``--gpu-only`` runs the cases no CPU can run (:data:`GPU_ONLY`) that fit the GPUs torch
sees, and names the others as skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
LOSS = re.compile(r"step:\s*(\d+)\s+loss:\s*([0-9.]+)")
BALANCE = re.compile(
    r"Newton-Schulz cost max/mean ([0-9.]+), held dedicated bytes .*?max/mean ([0-9.]+)"
)
EXPERT_BALANCE = re.compile(r"experts ([0-9.]+), dense ([0-9.]+), together ([0-9.]+)")
SHORT = ["--training.steps", "10", "--metrics.log_freq", "1", "--metrics.no-enable_tensorboard"]


@dataclass(frozen=True)
class Case:
    """One TorchTitan integration case: its commands' overrides, in order."""

    name: str
    suite: str
    ngpu: int
    commands: tuple[tuple[str, ...], ...]


def _case(name: str, suite: str, ngpu: int, *commands: str) -> Case:
    return Case(name, suite, ngpu, tuple(tuple(c.split()) for c in commands))


PP2, EP = "--parallelism.pipeline_parallel_degree 2", "--parallelism.expert_parallel_degree"
I1F1B = "--parallelism.pipeline_parallel_schedule Interleaved1F1B"
DP, TP = "--parallelism.data_parallel_shard_degree", "--parallelism.tensor_parallel_degree"
ETP = "--parallelism.expert_tensor_parallel_degree"
# Verbatim from TorchTitan v0.2.2 tests/integration_tests/models.py and the features.py
# cases with ngpu 8 (the shell's quotes removed).
CASES = [
    _case(
        "deepseek_v3_fsdp+ep+compile", "models", 4,
        f"--model.name deepseek_v3 {DP} 4 {EP} 2 --compile.enable",
    ),
    _case(
        "pp_dualpipev", "models", 4,
        f"--model.name deepseek_v3 {PP2} {EP} 2 "
        "--parallelism.pipeline_parallel_schedule DualPipeV --activation_checkpoint.mode none",
    ),
    _case(
        "deepseek_v3_pp+fsdp+tp+ep", "models", 8,
        f"--model.name deepseek_v3 {PP2} {I1F1B} {DP} 2 {TP} 2 {EP} 4 {ETP} 1",
    ),
    _case(
        "deepseek_v3_pp+fsdp+tp+ep+etp", "models", 8,
        f"--model.name deepseek_v3 {PP2} {I1F1B} {DP} 2 {TP} 2 {EP} 2 {ETP} 2",
    ),
    _case(
        "deepseek_v3_flex+pp+fsdp+ep+sacop", "models", 8,
        f"--model.name deepseek_v3 --model.flavor debugmodel_flex_attn {DP} 4 {PP2} {I1F1B} "
        f"{EP} 4 --activation_checkpoint.mode selective "
        "--activation_checkpoint.selective_ac_option op",
    ),
    _case("qwen3_fsdp+tp", "models", 4, f"--model.name qwen3 {DP} 2 {TP} 2"),
    _case(
        "qwen3_fsdp+tp+ep+etp", "models", 4,
        f"--model.name qwen3 --model.flavor debugmodel_moe {DP} 2 {TP} 2 {EP} 2 {ETP} 2",
    ),
    _case(
        "llama4_pp+fsdp+tp+ep+compile", "models", 8,
        f"--model.name llama4 {PP2} {I1F1B} {DP} 2 {TP} 2 {EP} 4 {ETP} 1 --compile.enable",
    ),
    _case(
        "gpt_oss_fsdp+tp+ep+compile", "models", 8,
        f"--model.name gpt_oss {DP} 4 {TP} 2 {EP} 4 {ETP} 1 --compile.enable",
    ),
    _case(
        "pp_dp_tp", "features", 8,
        f"--checkpoint.enable {PP2} {DP} 2 {TP} 2",
        f"--training.steps 20 --checkpoint.enable {PP2} {DP} 2 {TP} 2",
    ),
    _case("3d_compile", "features", 8, f"{PP2} {DP} 2 {TP} 2 --compile.enable"),
    _case(
        "hsdp+tp", "features", 8,
        f"{DP}=2 --parallelism.data_parallel_replicate_degree=2 {TP}=2",
    ),
    _case(
        "hsdp+cp_with_dp_shard", "features", 8,
        f"{DP}=2 --parallelism.data_parallel_replicate_degree=2 "
        "--parallelism.context_parallel_degree=2",
    ),
    _case(
        "fsdp+tp+cp", "features", 8,
        f"{DP}=2 {TP}=2 --parallelism.context_parallel_degree=2",
    ),
    _case(
        "cpu_offload+opt_in_bwd+TP+DP+CP", "features", 8,
        f"--checkpoint.enable {TP}=2 --parallelism.context_parallel_degree=2 "
        "--training.enable_cpu_offload --optimizer.early_step_in_backward",
        f"{TP}=2 --parallelism.context_parallel_degree=2 "
        "--parallelism.data_parallel_replicate_degree=2 --training.enable_cpu_offload "
        "--optimizer.early_step_in_backward",
    ),
    _case(
        "validation_tp_cp_pp", "features", 8,
        f"--validation.enable --validation.dataset c4_test {TP}=2 "
        f"--parallelism.context_parallel_degree=2 --parallelism.pipeline_parallel_degree=2 "
        f"{I1F1B}",
    ),
    _case("balance_deepseek_v3", "balance", 4, f"--model.name deepseek_v3 {DP} 4 {EP} 2"),
    _case(
        "balance_qwen3_moe", "balance", 4,
        f"--model.name qwen3 --model.flavor debugmodel_moe {DP} 4 {EP} 2",
    ),
    _case("balance_llama4", "balance", 4, f"--model.name llama4 {DP} 4 {EP} 2"),
]  # fmt: skip
OPTIMIZERS = {"dmuon": [], "adamw": ["--optimizer.name", "AdamW"]}
GPU_ONLY = (
    "deepseek_v3_flex+pp+fsdp+ep+sacop", "gpt_oss_fsdp+tp+ep+compile", "qwen3_fsdp+tp",
    "qwen3_fsdp+tp+ep+etp", "hsdp+cp_with_dp_shard", "pp_dualpipev", "fsdp+tp+cp",
    "cpu_offload+opt_in_bwd+TP+DP+CP", "validation_tp_cp_pp",
)  # fmt: skip
"""The cases that cannot run on CPU for any optimizer: FlexAttention has no CPU backward;
SDPA's CPU kernels have no DTensor rule under TP or CP; DualPipeV needs an accelerator."""


def this_machine() -> dict:
    """The CPU model and capability (which picks the Newton-Schulz dtype), cores, torch."""
    cpu = [line for line in Path("/proc/cpuinfo").read_text().splitlines() if "model name" in line]
    return {
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu": cpu[0].split(":", 1)[1].strip() if cpu else platform.processor(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
    }


def run_command(cmd: list[str], env: dict, timeout: int) -> tuple[int, str]:
    """Run ``cmd`` in the project root: its exit status and output. Past ``timeout``
    seconds its process group is stopped, SIGTERM first (torchrun passes it on to its
    ranks, which run in sessions of their own), and the status is 124."""
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        output = proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            output = proc.communicate(timeout=60)[0]
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output = proc.communicate()[0]
        return 124, output + f"\nTimeoutError: no end after {timeout} s"
    return proc.returncode, output


def failure_reason(output: str) -> str:
    """The last error line a failed run printed (its exception, as the launcher logs it)."""
    errors = [
        line.strip()
        for line in output.splitlines()
        if re.search(r"\b\w*(Error|Exception)\b:", line) and "Traceback" not in line
    ]
    return (errors[-1] if errors else output.strip().splitlines()[-1])[:300]


def run_case(case: Case, optimizer: str, dump: Path, timeout: int) -> dict:
    # An Inductor cache of its own per run: a cached graph names the process groups it was
    # compiled with but its key does not, so an AdamW run loaded the DMuon run's graph
    # (which has the engine's groups too) and failed ("Could not resolve the process group").
    env = dict(
        os.environ,
        NGPU=str(case.ngpu),
        LOG_RANK=",".join(map(str, range(case.ngpu))),
        TORCHINDUCTOR_CACHE_DIR=str(dump / "inductor_cache"),
    )
    shutil.rmtree(dump, ignore_errors=True)  # a stale checkpoint would be resumed
    dump.mkdir(parents=True)
    started, output, rc = time.monotonic(), "", 0
    for overrides in case.commands:
        cmd = ["./run_train.sh", "--job.dump_folder", str(dump), *SHORT]
        cmd += [*OPTIMIZERS[optimizer], *overrides]
        rc, more = run_command(cmd, env, timeout)
        output += more
        if rc != 0:
            break
    losses = {int(s): float(v) for s, v in LOSS.findall(output)}
    row = {
        "case": case.name,
        "suite": case.suite,
        "ngpu": case.ngpu,
        "optimizer": optimizer,
        "passed": rc == 0 and bool(losses),
        "returncode": rc,
        "seconds": round(time.monotonic() - started, 1),
        "steps": max(losses) if losses else 0,
        "first_loss": losses[min(losses)] if losses else None,
        "final_loss": losses[max(losses)] if losses else None,
        "reason": None if rc == 0 and losses else failure_reason(output),
        "command": " ".join(
            f"NGPU={case.ngpu} ./run_train.sh {' '.join(SHORT)} "
            f"{' '.join(OPTIMIZERS[optimizer] + list(c))}"
            for c in case.commands
        ),
    }
    if optimizer == "dmuon" and (found := BALANCE.search(output)):
        row["ns_balance"], row["held_balance"] = map(float, found.groups())
        if experts := EXPERT_BALANCE.search(output):
            row["ns_balance_experts"], row["ns_balance_dense"], _ = map(float, experts.groups())
    (dump / "output.log").write_text(output)
    return row


def _cell(row: dict | None) -> str:
    if row is None:
        return "not run"
    if row["passed"]:
        return f"PASS ({row['first_loss']:.3f} -> {row['final_loss']:.3f})"
    return f"FAIL: {row['reason']}"


def table(rows: list[dict]) -> str:
    by = {(r["case"], r["optimizer"]): r for r in rows}
    lines = [
        "| case | ranks | DMuon | AdamW |",
        "|---|---|---|---|",
    ]
    for name in dict.fromkeys(r["case"] for r in rows):
        case = next(r for r in rows if r["case"] == name)
        dmuon, adamw = by.get((name, "dmuon")), by.get((name, "adamw"))
        cells = [_cell(dmuon), _cell(adamw)]
        if dmuon is not None and "ns_balance" in dmuon:
            cells[0] += f"; NS balance {dmuon['ns_balance']:.3f}, held {dmuon['held_balance']:.3f}"
        lines.append(f"| {name} ({case['suite']}) | {case['ngpu']} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in rows if r["passed"]]
    names = list(dict.fromkeys(r["case"] for r in done))
    fig, ax = plt.subplots(figsize=(max(6, len(names) * 0.8), 4))
    for k, optimizer in enumerate(OPTIMIZERS):
        values = {r["case"]: r["final_loss"] for r in done if r["optimizer"] == optimizer}
        xs = [i + 0.4 * k for i, n in enumerate(names) if n in values]
        ax.bar(xs, [values[n] for n in names if n in values], width=0.4, label=optimizer)
    ax.set_xticks([i + 0.2 for i in range(len(names))], names, rotation=60, ha="right")
    ax.set_ylabel("loss after 10 steps")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", choices=[c.name for c in CASES])
    parser.add_argument("--optimizers", nargs="+", choices=list(OPTIMIZERS), default=None)
    parser.add_argument(
        "--gpu-only", action="store_true", help="the GPU-only cases that fit this machine's GPUs"
    )
    parser.add_argument("--timeout", type=int, default=1500, help="seconds per command")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/titan_cases"))
    parser.add_argument(
        "--dumps", type=Path, default=Path("outputs/titan_cases"), help="runs' folders and logs"
    )
    args = parser.parse_args()
    cases = [c for c in CASES if args.cases is None or c.name in args.cases]
    if args.gpu_only:
        gpus = torch.cuda.device_count()
        for case in cases:
            if case.name in GPU_ONLY and case.ngpu > gpus:
                print(f"skipped {case.name}: needs {case.ngpu} GPUs, this machine has {gpus}")
        cases = [c for c in cases if c.name in GPU_ONLY and c.ngpu <= gpus]
        if not cases:
            print(f"no GPU-only case fits {gpus} GPU(s)")
            return
    args.out.mkdir(parents=True, exist_ok=True)
    results = args.out / "results.json"
    rows = json.loads(results.read_text())["rows"] if results.exists() else []
    machine = this_machine()
    print(f"machine: {machine}")
    for case in cases:
        for optimizer in args.optimizers or (["dmuon"] if case.suite == "balance" else OPTIMIZERS):
            dump = (args.dumps / f"{case.name}-{optimizer}").resolve()
            row = run_case(case, optimizer, dump, args.timeout)
            rows = [r for r in rows if (r["case"], r["optimizer"]) != (case.name, optimizer)]
            rows.append(row)
            print(
                f"{case.name:<36} {optimizer:<6} {row['seconds']:7.0f} s  {_cell(row)}", flush=True
            )
            results.write_text(json.dumps({"machine": machine, "rows": rows}, indent=2))
    order = {c.name: i for i, c in enumerate(CASES)}
    rows.sort(key=lambda r: (order[r["case"]], r["optimizer"]))
    results.write_text(json.dumps({"machine": machine, "rows": rows}, indent=2))
    text = table(rows)
    (args.out / "table.md").write_text(text + "\n")
    print(text)
    plot(rows, args.out / "final_loss.png")
    print(f"wrote {results}, {args.out / 'table.md'}, {args.out / 'final_loss.png'}")


if __name__ == "__main__":
    main()
