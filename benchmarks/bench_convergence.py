"""Convergence of DMuon against FSDP2 + fused AdamW, on held-out loss, through TorchTitan.

Every run is ``./run_train.sh`` (TorchTitan 0.2.2's trainer as users run it, on the
default ``train_configs/debug_cpu.toml``: debug llama3, FSDP2 Z3, 2 processes) launched as
a subprocess; its rank-0 log is parsed. The runs:

* ``check``: AdamW at lr 0 (the model never changes) for 10 steps, evaluated at steps 1,
  5 and 10; the three held-out losses must be equal, which shows that every evaluation
  sees the same batches.
* ``sweep``: AdamW (``--optimizer.name AdamW``, TorchTitan's default fused implementation)
  at three ``--optimizer.lr``, and DMuon at three ``--dmuon.lr`` (everything else as the
  config, its AdamW lr 3e-3 for the non-matrix parameters included), seed 42.
* ``seed2``: the best sweep run of each optimizer (lowest held-out loss) again with a
  second ``--debug.seed``.
* ``rms``: DMuon with ``--dmuon.adjust_lr_fn match_rms_adamw --dmuon.lr <best AdamW lr>``.
* ``variants``: at the best DMuon lr and seed 42, NorMuon (``--dmuon.variant normuon``)
  and QK-clip (``--dmuon.qk_clip_threshold``, ``--qk-clip-threshold``; the largest logit
  and the clipped heads of each logged step go into the run's record).

Held-out loss: ``scripts/setup.sh`` builds ``assets/heldout/`` (5% of the documents,
never in the training corpus; see ``torchtitan_dmuon/titan/assets.py``), and TorchTitan's
own ``[validation]`` evaluates on it every ``--eval-every`` steps (and at step 1). TorchTitan
does not restart its validation data by itself: each evaluation goes on where the last
one stopped (a non-infinite dataset, ``--validation.steps -1``, is empty the second time,
and its two ranks hold different numbers of batches, so it would hang). With
``--validation.dataloader.num_workers 1`` the loader's worker process is started afresh
for each evaluation from a copy of the untouched dataset, so every evaluation reads the
same first ``--val-batches`` batches of each rank's share; ``check`` verifies it.

Outputs under ``--out``: ``runs/<name>.json`` per run (a run whose file exists is skipped,
so the benchmark resumes after a crash), ``logs/<name>.log``, ``convergence.json`` (all
runs and the summary), ``convergence.png`` and ``table.md`` (also printed).

Usage::

    .venv/bin/python benchmarks/bench_convergence.py                  # check, sweep, seed2
    .venv/bin/python benchmarks/bench_convergence.py --runs all       # and rms, variants
    .venv/bin/python benchmarks/bench_convergence.py --runs variants  # NorMuon, QK-clip
    .venv/bin/python benchmarks/bench_convergence.py --runs adamw_lr0.003_s42 --steps 20
    .venv/bin/python benchmarks/bench_convergence.py --report-only
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import logging
import math
import os
import pathlib
import platform
import re
import subprocess
import sys
import time

import torch

logger = logging.getLogger("bench_convergence")

ROOT = pathlib.Path(__file__).resolve().parent.parent
CONFIG = "train_configs/debug_cpu.toml"
NPROC = 2
# From the config: tokens per step are local_batch_size * seq_len * NPROC.
LOCAL_BATCH_SIZE, SEQ_LEN = 4, 128
LOG_FREQ = 5  # [metrics] log_freq of the config: the training loss is logged every 5 steps
SEED, SEED2 = 42, 1
GROUPS = ("check", "sweep", "seed2", "rms", "variants")
DEPENDENT = ("seed2", "rms", "variants")
_TIME = r"\[rank0\]:\[titan\] (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) - root - \w+ - "
_NUM = r"(-?[\d.]+|nan|inf|-inf)"
STEP_RE = re.compile(
    _TIME + r"step:\s*(\d+)\s+loss:\s*" + _NUM + r"\s+grad_norm:\s*" + _NUM + r".*?tps:\s*([\d,]+)"
)
VAL_RE = re.compile(_TIME + r"validate step:\s*(\d+)\s+loss:\s*" + _NUM)
START_RE = re.compile(_TIME + r"Training starts at step")
QK_RE = re.compile(r"qk max logit " + _NUM + r" clipped heads (\d+)")


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """One training run.

    Attributes:
        name: File stem of its outputs.
        optimizer: ``"AdamW"`` or ``"DMuon"``.
        lr: The swept learning rate: ``--optimizer.lr`` for AdamW, ``--dmuon.lr`` for DMuon.
        seed: ``--debug.seed``.
        group: One of ``GROUPS``.
        steps: ``--training.steps``.
        eval_every: ``--validation.freq``.
        extra: Further TorchTitan overrides.
    """

    name: str
    optimizer: str
    lr: float
    seed: int
    group: str
    steps: int
    eval_every: int
    extra: tuple[str, ...] = ()

    def overrides(self, val_batches: int) -> list[str]:
        """The TorchTitan overrides of this run.

        Args:
            val_batches: ``--validation.steps``: batches per rank at each evaluation.

        Returns:
            The arguments for ``./run_train.sh``.
        """
        args = ["--training.steps", str(self.steps), "--debug.seed", str(self.seed)]
        if self.optimizer == "AdamW":
            args += ["--optimizer.name", "AdamW", "--optimizer.lr", _fmt(self.lr)]
        else:
            args += ["--dmuon.lr", _fmt(self.lr)]
        args += [
            "--validation.enable",
            "--validation.dataset",
            "c4_test",
            "--validation.dataset_path",
            "./assets/heldout",
            "--validation.local_batch_size",
            str(LOCAL_BATCH_SIZE),
            "--validation.seq_len",
            str(SEQ_LEN),
            "--validation.freq",
            str(self.eval_every),
            "--validation.steps",
            str(val_batches),
            "--validation.dataloader.num_workers",
            "1",
        ]
        return args + list(self.extra)


def _fmt(lr: float) -> str:
    """A learning rate as it appears in run names and flags (``0.003``, ``0.02``)."""
    text = f"{lr:g}"
    return re.sub(r"e-0(\d)", r"e-\1", text)


def sweep_specs(args: argparse.Namespace) -> list[RunSpec]:
    """The six sweep runs (seed ``SEED``), AdamW first."""
    extra = tuple(args.extra)
    lrs = (("AdamW", "adamw", args.adamw_lrs), ("DMuon", "dmuon", args.muon_lrs))
    specs = [
        RunSpec(
            f"{prefix}_lr{_fmt(lr)}_s{SEED}",
            optimizer,
            lr,
            SEED,
            "sweep",
            args.steps,
            args.eval_every,
            extra,
        )
        for optimizer, prefix, values in lrs
        for lr in values
    ]
    return specs


def best_run(results: list[dict], optimizer: str, group: str = "sweep") -> dict | None:
    """The run of ``optimizer`` in ``group`` with the lowest held-out loss, or None."""
    runs = [r for r in results if r["optimizer"] == optimizer and r["group"] == group]
    return min(runs, key=lambda r: r["best_val_loss"], default=None)


def dependent_specs(args: argparse.Namespace, results: list[dict], group: str) -> list[RunSpec]:
    """The ``seed2``, ``rms`` or ``variants`` runs, which depend on the sweep's best runs.

    Args:
        args: The command line.
        results: The finished runs.
        group: ``"seed2"``, ``"rms"`` or ``"variants"``.

    Returns:
        The runs of ``group`` whose sweep is complete (a missing sweep is logged).
    """
    sweep = {s.name for s in sweep_specs(args)}
    done = {r["name"] for r in results}
    specs = []
    for optimizer, prefix in (("AdamW", "adamw"), ("DMuon", "dmuon")):
        wanted = {n for n in sweep if n.startswith(prefix)}
        if not wanted <= done:
            logger.warning(
                "%s sweep incomplete (%s missing): no %s run for it",
                optimizer,
                sorted(wanted - done),
                group,
            )
            continue
        best = best_run(results, optimizer)
        if group == "seed2":
            specs.append(
                RunSpec(
                    f"{prefix}_lr{_fmt(best['lr'])}_s{SEED2}",
                    optimizer,
                    best["lr"],
                    SEED2,
                    "seed2",
                    args.steps,
                    args.eval_every,
                    tuple(args.extra),
                )
            )
        elif group == "variants" and optimizer == "DMuon":
            variants = (
                ("normuon", ("--dmuon.variant", "normuon")),
                (
                    f"qkclip{_fmt(args.qk_clip_threshold)}",
                    ("--dmuon.qk_clip_threshold", _fmt(args.qk_clip_threshold)),
                ),
            )
            for name, flags in variants:
                specs.append(
                    RunSpec(
                        f"dmuon_{name}_lr{_fmt(best['lr'])}_s{SEED}",
                        "DMuon",
                        best["lr"],
                        SEED,
                        "variants",
                        args.steps,
                        args.eval_every,
                        (*flags, *args.extra),
                    )
                )
        elif group == "rms" and optimizer == "AdamW":
            extra = ("--dmuon.adjust_lr_fn", "match_rms_adamw", *args.extra)
            specs.append(
                RunSpec(
                    f"dmuon_rms_lr{_fmt(best['lr'])}_s{SEED}",
                    "DMuon",
                    best["lr"],
                    SEED,
                    "rms",
                    args.steps,
                    args.eval_every,
                    extra,
                )
            )
    return specs


def check_spec(args: argparse.Namespace) -> RunSpec:
    """AdamW at lr 0, 10 steps, evaluated at 1, 5 and 10: the held-out losses must be equal."""
    return RunSpec("check_fixed_eval", "AdamW", 0.0, SEED, "check", 10, 5, tuple(args.extra))


def parse_log(text: str) -> dict:
    """Training and validation entries of a rank-0 TorchTitan log.

    Args:
        text: The log.

    Returns:
        ``start`` (the "Training starts" time, seconds since the epoch), ``train`` (per
        logged step: step, time, loss, grad_norm, tps) and ``val`` (per evaluation: step,
        time, loss).
    """

    def when(stamp: str) -> float:
        return datetime.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()

    start = next((when(m.group(1)) for m in START_RE.finditer(text)), None)
    train = [
        {
            "step": int(m.group(2)),
            "time": when(m.group(1)),
            "loss": float(m.group(3)),
            "grad_norm": float(m.group(4)),
            "tps": int(m.group(5).replace(",", "")),
        }
        for m in STEP_RE.finditer(text)
    ]
    val = [
        {"step": int(m.group(2)), "time": when(m.group(1)), "loss": float(m.group(3))}
        for m in VAL_RE.finditer(text)
    ]
    # QK-clip's metrics come in the dmuon line just before each step's line.
    qk = [(float(m.group(1)), int(m.group(2))) for m in QK_RE.finditer(text)]
    for entry, (max_logit, heads) in zip(train, qk, strict=False):
        entry["qk_max_logit"], entry["qk_clipped_heads"] = max_logit, heads
    return {"start": start, "train": train, "val": val}


def summarize(spec: RunSpec, parsed: dict, wall_s: float, val_batches: int) -> dict:
    """The result record of a run from its parsed log.

    Wall-clock is training time only: seconds since "Training starts" at the step's log
    line, less the evaluations before it (an evaluation lasts from the log line of its
    step to its ``validate`` line; every evaluation step is a logged step).

    Args:
        spec: The run.
        parsed: :func:`parse_log`'s output.
        wall_s: Seconds the whole subprocess took.
        val_batches: Batches per rank at each evaluation.

    Returns:
        The JSON-ready record.
    """
    tokens_per_step = LOCAL_BATCH_SIZE * SEQ_LEN * NPROC
    step_time = {e["step"]: e["time"] for e in parsed["train"]}
    start = parsed["start"]
    evals, eval_seconds = [], 0.0
    for e in parsed["val"]:
        trained_at = step_time.get(e["step"], e["time"])
        train_s = trained_at - start - eval_seconds
        eval_seconds += e["time"] - trained_at
        evals.append(
            {
                "step": e["step"],
                "tokens": e["step"] * tokens_per_step,
                "wall_s": round(train_s, 3),
                "eval_s": round(e["time"] - trained_at, 3),
                "loss": e["loss"],
            }
        )
    train = [
        {
            "step": e["step"],
            "tokens": e["step"] * tokens_per_step,
            "loss": e["loss"],
            "grad_norm": e["grad_norm"],
            "tps_per_rank_torchtitan": e["tps"],
            **{k: e[k] for k in ("qk_max_logit", "qk_clipped_heads") if k in e},
        }
        for e in parsed["train"]
    ]
    last = parsed["train"][-1]
    # The evaluation at the last step comes after its log line.
    before_last = sum(e["eval_s"] for e in evals if e["step"] < last["step"])
    train_s = last["time"] - start - before_last
    losses = [e["loss"] for e in evals if math.isfinite(e["loss"])]
    return {
        "name": spec.name,
        "optimizer": spec.optimizer,
        "lr": spec.lr,
        "seed": spec.seed,
        "group": spec.group,
        "config": {
            "config_file": CONFIG,
            "nproc": NPROC,
            "steps": spec.steps,
            "eval_every": spec.eval_every,
            "val_batches_per_rank": val_batches,
            "val_tokens_per_eval": val_batches * LOCAL_BATCH_SIZE * SEQ_LEN * NPROC,
            "tokens_per_step": tokens_per_step,
            "overrides": spec.overrides(val_batches),
        },
        "steps_done": last["step"],
        "val": evals,
        "train": train,
        "final_val_loss": evals[-1]["loss"] if evals else float("nan"),
        "best_val_loss": min(losses) if losses else float("nan"),
        "train_wall_s": round(train_s, 3),
        "eval_wall_s": round(eval_seconds, 3),
        "process_wall_s": round(wall_s, 3),
        "tokens_per_s": round(last["step"] * tokens_per_step / train_s, 1),
    }


def run_one(spec: RunSpec, args: argparse.Namespace) -> dict | None:
    """Trains ``spec`` through ``./run_train.sh`` unless its result file exists.

    Args:
        spec: The run.
        args: The command line (``--out``, ``--val-batches``, ``--timeout``).

    Returns:
        The run's record, or None when it failed (its log stays in ``logs/``).
    """
    result_path = args.out / "runs" / f"{spec.name}.json"
    if result_path.exists():
        logger.info("%s: done before, skipped (%s)", spec.name, result_path)
        return json.loads(result_path.read_text())
    log_path = args.out / "logs" / f"{spec.name}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    dump = args.out / "dumps" / spec.name
    cmd = ["./run_train.sh", "--job.config_file", CONFIG, "--job.dump_folder", str(dump)]
    cmd += spec.overrides(args.val_batches)
    logger.info("%s: %s", spec.name, " ".join(cmd))
    env = dict(os.environ, NGPU=str(NPROC), LOG_RANK="0")
    load_start = os.getloadavg()  # the machine may be shared: wall-clock needs it
    begin = time.monotonic()
    with open(log_path, "w", encoding="utf-8") as log:
        try:
            proc = subprocess.run(
                cmd,
                cwd=ROOT,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                timeout=args.timeout,
                check=False,
            )
            returncode = proc.returncode
        except subprocess.TimeoutExpired:
            returncode = "timeout"
    wall_s = time.monotonic() - begin
    parsed = parse_log(log_path.read_text(encoding="utf-8", errors="replace"))
    steps = parsed["train"][-1]["step"] if parsed["train"] else 0
    if returncode != 0 or steps != spec.steps or parsed["start"] is None:
        logger.error(
            "%s: failed (return code %s, %d of %d steps); see %s",
            spec.name,
            returncode,
            steps,
            spec.steps,
            log_path,
        )
        return None
    result = summarize(spec, parsed, wall_s, args.val_batches)
    result["config"]["extra_overrides"] = list(spec.extra)
    result["loadavg_start"], result["loadavg_end"] = list(load_start), list(os.getloadavg())
    tmp = result_path.with_suffix(".json.tmp")
    result_path.parent.mkdir(parents=True, exist_ok=True)
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    os.replace(tmp, result_path)
    logger.info(
        "%s: final held-out loss %.4f (best %.4f), %.0f s training, %.0f tokens/s",
        spec.name,
        result["final_val_loss"],
        result["best_val_loss"],
        result["train_wall_s"],
        result["tokens_per_s"],
    )
    return result


def steps_to_reach(run: dict, target: float, key: str = "step") -> float | None:
    """The step (or ``key``: tokens, wall_s) at which ``run``'s held-out loss reaches ``target``.

    Linear interpolation between the two evaluations around the crossing; None when
    the run never reaches it.
    """
    previous = None
    for e in run["val"]:
        if e["loss"] <= target:
            if previous is None or previous["loss"] == e["loss"]:
                return float(e[key])
            frac = (previous["loss"] - target) / (previous["loss"] - e["loss"])
            return previous[key] + frac * (e[key] - previous[key])
        previous = e
    return None


def machine() -> dict:
    """The CPU model, torch's CPU capability and versions."""
    model = platform.processor() or "unknown"
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        commit = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "HEAD"],
            text=True,
            capture_output=True,
            check=False,
        ).stdout.strip()
        dirty = bool(
            subprocess.run(
                ["git", "-C", str(ROOT), "status", "--porcelain"],
                text=True,
                capture_output=True,
                check=False,
            ).stdout.strip()
        )
    except OSError:
        commit, dirty = "", None
    ns_dtype = None
    try:
        import tomllib

        ns_dtype = tomllib.loads((ROOT / CONFIG).read_text())["dmuon"].get("ns_dtype")
    except (ImportError, KeyError, OSError):
        pass
    return {
        "cpu_model": model,
        "cpu_count": os.cpu_count(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
        "git_commit": commit,
        "git_dirty": dirty,
        "config_ns_dtype": ns_dtype,
    }


def _table(rows: list[list[str]], header: list[str]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def _loss(value: float | None) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value:.4f}"


def report(results: list[dict], check: dict | None, meta: dict) -> tuple[str, dict]:
    """The markdown table and the summary.

    Args:
        results: The training runs (no ``check`` run).
        check: The ``check`` run, if done.
        meta: :func:`machine`'s output.

    Returns:
        The markdown text and the summary dict for the JSON.
    """
    lines = [
        f"## DMuon vs FSDP2 + fused AdamW: held-out loss ({CONFIG}, {NPROC} gloo ranks)",
        "",
        f"CPU: {meta['cpu_model']} ({meta['cpu_count']} cores), torch "
        f"{meta['torch']}, cpu capability {meta['cpu_capability']}; config ns_dtype "
        f"{meta['config_ns_dtype']}; git {meta['git_commit'][:10]}"
        f"{' (dirty tree)' if meta['git_dirty'] else ''}",
    ]
    summary: dict = {}
    if results:
        cfg = results[0]["config"]
        lines.append(
            f"{cfg['steps']} steps, {cfg['tokens_per_step']} tokens/step, held-out evaluation "
            f"every {cfg['eval_every']} steps on the same {cfg['val_tokens_per_eval']} tokens "
            f"({cfg['val_batches_per_rank']} batches per rank)"
        )
    if check:
        losses = [e["loss"] for e in check["val"]]
        same = len(set(losses)) == 1 and len(losses) >= 2
        summary["fixed_eval_check"] = {
            "losses": losses,
            "steps": [e["step"] for e in check["val"]],
            "same": same,
        }
        lines.append(
            f"Fixed-batch check (AdamW lr 0, unchanged model): held-out losses "
            f"{losses} at steps {[e['step'] for e in check['val']]}: "
            f"{'identical' if same else 'DIFFERENT'}"
        )
    lines.append("")
    best = {}
    rows = []
    for optimizer in ("AdamW", "DMuon"):
        b = best_run(results, optimizer)
        if b is None:
            continue
        best[optimizer] = b
        seeds = [
            r
            for r in results
            if r["optimizer"] == optimizer
            and r["lr"] == b["lr"]
            and r["group"] in ("sweep", "seed2")
        ]
        seeds.sort(key=lambda r: r["seed"] != SEED)
        mean = sum(r["best_val_loss"] for r in seeds) / len(seeds)
        per_seed = ", ".join(f"seed {r['seed']}: {_loss(r['best_val_loss'])}" for r in seeds)
        flag = "--optimizer.lr" if optimizer == "AdamW" else "--dmuon.lr"
        rows.append([optimizer, f"{flag} {_fmt(b['lr'])}", _loss(mean), str(len(seeds)), per_seed])
        summary[f"best_{optimizer.lower()}"] = {
            "lr": b["lr"],
            "mean_best_val_loss": mean,
            "per_seed": {str(r["seed"]): r["best_val_loss"] for r in seeds},
        }
    lines += _table(
        rows, ["optimizer", "best lr", "best held-out loss (mean)", "seeds", "per seed"]
    )
    lines.append("")
    if len(best) == 2:
        rows = []
        for a, b in (("AdamW", "DMuon"), ("DMuon", "AdamW")):
            target = best[b]["final_val_loss"]
            step = steps_to_reach(best[a], target)
            seconds = steps_to_reach(best[a], target, "wall_s")
            reached = "not reached" if step is None else f"{step:.1f}"
            reached_s = "not reached" if seconds is None else f"{seconds:.0f}"
            rows.append(
                [
                    f"best {a} ({best[a]['name']})",
                    f"best {b}'s final {_loss(target)}",
                    reached,
                    reached_s,
                    str(best[a]["steps_done"]),
                ]
            )
            summary[f"steps_{a.lower()}_to_{b.lower()}_final"] = step
            summary[f"wall_s_{a.lower()}_to_{b.lower()}_final"] = seconds
        header = [
            "run",
            "target held-out loss",
            "steps to reach",
            "train wall s to reach",
            "of steps",
        ]
        lines += _table(rows, header)
        lines.append("")
    base = next(
        (
            r
            for r in results
            if r["group"] == "sweep" and r["name"] == best.get("DMuon", {}).get("name")
        ),
        None,
    )
    variants = [r for r in results if r["group"] == "variants"]
    if base is not None and variants:
        rows = []
        for r in [base, *variants]:
            qk = [e for e in r["train"] if "qk_max_logit" in e]
            clipped = sum(e["qk_clipped_heads"] > 0 for e in qk)
            rows.append(
                [
                    r["name"],
                    _loss(r["final_val_loss"]),
                    f"{r['final_val_loss'] - base['final_val_loss']:+.3f}",
                    f"{r['tokens_per_s']:.0f}",
                    f"{max(e['qk_max_logit'] for e in qk):.2f}" if qk else "",
                    f"{clipped} of {len(qk)}" if qk else "",
                ]
            )
        summary["variants"] = {r[0]: {"final_val_loss": r[1], "vs_muon": r[2]} for r in rows}
        lines.append(f"Muon's variants at the best DMuon lr, seed {SEED}:")
        lines.append("")
        lines += _table(
            rows,
            ["run", "final held-out", "vs Muon", "tokens/s", "largest logit",
             "logged steps with clipped heads"],
        )  # fmt: skip
        lines.append("")
    rows = []
    for r in results:
        rows.append(
            [
                r["name"],
                r["optimizer"],
                _fmt(r["lr"]),
                str(r["seed"]),
                _loss(r["final_val_loss"]),
                _loss(r["best_val_loss"]),
                f"{r['train_wall_s']:.0f}",
                f"{r['tokens_per_s']:.0f}",
            ]
        )
    lines += _table(
        rows,
        [
            "run",
            "optimizer",
            "lr",
            "seed",
            "final held-out",
            "best held-out",
            "train wall s",
            "tokens/s",
        ],
    )
    return "\n".join(lines) + "\n", summary


def plot(results: list[dict], path: pathlib.Path, best_names: set[str]) -> None:
    """Held-out loss against tokens and against training wall-clock, one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 5), sharey=True)
    colors = {"AdamW": plt.cm.Blues, "DMuon": plt.cm.Oranges}
    for r in sorted(results, key=lambda r: (r["optimizer"], r["group"], r["lr"])):
        highlight = r["name"] in best_names or (r["group"] == "seed2")
        cmap = {"rms": plt.cm.Greens, "variants": plt.cm.Purples}.get(
            r["group"], colors[r["optimizer"]]
        )
        if "qkclip" in r["name"]:
            cmap = plt.cm.Reds
        lrs = sorted({x["lr"] for x in results if x["optimizer"] == r["optimizer"]})
        shade = 0.45 + 0.5 * (lrs.index(r["lr"]) + 1) / (len(lrs) + 1)
        style = {"seed2": "--", "rms": ":", "variants": "-."}.get(r["group"], "-")
        kw = {
            "color": cmap(shade),
            "linestyle": style,
            "marker": "o",
            "markersize": 3,
            "linewidth": 2.8 if highlight else 1.1,
            "alpha": 1.0 if highlight else 0.6,
            "label": f"{r['name']}{' (best)' if r['name'] in best_names else ''}",
        }
        for ax, key in zip(axes, ("tokens", "wall_s"), strict=True):
            ax.plot([e[key] for e in r["val"]], [e["loss"] for e in r["val"]], **kw)
    axes[0].set_xlabel("training tokens")
    axes[1].set_xlabel("training wall-clock (s, evaluations excluded)")
    axes[0].set_ylabel("held-out loss")
    for ax in axes:
        ax.grid(alpha=0.3)
    finite = [e["loss"] for r in results for e in r["val"] if math.isfinite(e["loss"])]
    if finite:
        low = min(finite)
        axes[0].set_ylim(low - 0.1, min(max(finite), low + 3.0))
    axes[1].legend(fontsize=7, loc="upper right")
    fig.suptitle("DMuon vs FSDP2 + fused AdamW, debug llama3 (TorchTitan), held-out loss")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _load_done(out: pathlib.Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((out / "runs").glob("*.json"))]


def reparse(out: pathlib.Path) -> None:
    """Rebuilds every ``runs/<name>.json`` from its log with this parser and summary."""
    for record in _load_done(out):
        cfg = record["config"]
        spec = RunSpec(
            record["name"],
            record["optimizer"],
            record["lr"],
            record["seed"],
            record["group"],
            cfg["steps"],
            cfg["eval_every"],
            tuple(cfg.get("extra_overrides", ())),
        )
        log = (out / "logs" / f"{spec.name}.log").read_text(encoding="utf-8", errors="replace")
        result = summarize(
            spec, parse_log(log), record["process_wall_s"], cfg["val_batches_per_rank"]
        )
        result["config"]["extra_overrides"] = list(spec.extra)
        for key in ("loadavg_start", "loadavg_end"):
            if key in record:
                result[key] = record[key]
        (out / "runs" / f"{spec.name}.json").write_text(json.dumps(result, indent=1) + "\n")
        logger.info("%s: rebuilt from its log", spec.name)


def main(argv: list[str] | None = None) -> int:
    """Runs the selected runs (skipping finished ones), then writes the report.

    Args:
        argv: The command line (``sys.argv[1:]`` when None).

    Returns:
        0, or 1 when a run failed.
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "benchmarks/results/convergence")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument(
        "--val-batches",
        type=int,
        default=10,
        help="held-out batches per rank at each evaluation (rank 1 of the "
        "2 holds 20 whole batches of 4 x 128 tokens)",
    )
    parser.add_argument(
        "--runs",
        default="check,sweep,seed2",
        help="comma-separated groups (check, sweep, seed2, rms, variants, all) and/or run "
        "names (see --list)",
    )
    parser.add_argument(
        "--qk-clip-threshold",
        type=float,
        default=10.0,
        help="the variants group's QK-clip threshold",
    )
    parser.add_argument("--adamw-lrs", type=float, nargs=3, default=[1e-3, 3e-3, 1e-2])
    parser.add_argument("--muon-lrs", type=float, nargs=3, default=[0.01, 0.02, 0.05])
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    parser.add_argument("--list", action="store_true", help="list the runs and exit")
    parser.add_argument("--report-only", action="store_true", help="run nothing, report")
    parser.add_argument(
        "--reparse",
        action="store_true",
        help="first rebuild every finished run's JSON from its log",
    )
    parser.add_argument(
        "--extra",
        nargs=argparse.REMAINDER,
        default=[],
        help="TorchTitan overrides for every run (last on the line)",
    )
    args = parser.parse_args(argv)
    args.out = args.out.resolve()
    if args.steps % args.eval_every or args.eval_every % LOG_FREQ:
        parser.error(
            f"--steps must be a multiple of --eval-every, and --eval-every of {LOG_FREQ}"
            " (the config's log_freq), so the last step is evaluated and timed"
        )
    wanted = set(args.runs.split(","))
    if "all" in wanted:
        wanted |= set(GROUPS)

    if args.reparse:
        reparse(args.out)
    failed = False
    if not args.report_only:
        queue = [check_spec(args)] + sweep_specs(args)
        selected = [s for s in queue if s.group in wanted or s.name in wanted]
        if args.list:
            done = [r for r in _load_done(args.out) if r["group"] != "check"]
            queue += [s for g in DEPENDENT for s in dependent_specs(args, done, g)]
            for s in queue:
                print(s.name, s.group)
            print("(seed2, rms and variants runs are known once their sweep is done)")
            return 0
        for spec in selected:
            failed |= run_one(spec, args) is None
        named = wanted - set(GROUPS) - {s.name for s in queue}
        for group in DEPENDENT:
            if group not in wanted and not named:
                continue
            done = [r for r in _load_done(args.out) if r["group"] != "check"]
            for spec in dependent_specs(args, done, group):
                if group in wanted or spec.name in wanted:
                    failed |= run_one(spec, args) is None

    everything = _load_done(args.out)
    check = next((r for r in everything if r["group"] == "check"), None)
    results = [r for r in everything if r["group"] != "check"]
    meta = machine()
    text, summary = report(results, check, meta)
    best_names = {b["name"] for b in (best_run(results, o) for o in ("AdamW", "DMuon")) if b}
    if results:
        plot(results, args.out / "convergence.png", best_names)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "table.md").write_text(text)
    payload = {
        "machine": meta,
        "summary": summary,
        "check": check,
        "runs": results,
        "command": [sys.executable, *sys.argv],
    }
    (args.out / "convergence.json").write_text(json.dumps(payload, indent=1) + "\n")
    print(text)
    logger.info(
        "wrote %s, %s and %s",
        args.out / "convergence.json",
        args.out / "convergence.png",
        args.out / "table.md",
    )
    return 1 if failed else 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="[bench_convergence] %(asctime)s %(message)s")
    sys.exit(main())
