"""Convergence of DMuon against FSDP2 + fused AdamW at two model sizes: the learning rate
and weight decay sweep behind DMuon's defaults, on held-out loss, through TorchTitan.

Every run is ``./run_train.sh`` (TorchTitan 0.2.2's trainer as users run it, on
``train_configs/debug_cpu.toml``: FSDP2 Z3, 2 processes, 4 x 128 tokens per rank and step,
linear warmup over 10 steps then linear decay to 0) launched as a subprocess; its rank-0
log is parsed. ``--size`` picks the model:

* ``debug``: llama3 ``debugmodel`` (dim 256, 6 layers; 6.2M parameters);
* ``large``: llama3 at dim 512, 8 layers (29.4M, 4.8x; ``benchmarks/convergence_model.py``).

The groups of runs (``--runs``):

* ``check``: AdamW at lr 0 (the model never changes) for 10 steps, evaluated at steps 1,
  5 and 10; the three held-out losses must be equal: every evaluation sees the same batches.
* ``sweep``: AdamW (``--optimizer.name AdamW``, TorchTitan's fused implementation) at
  ``--adamw-lrs`` x ``--adamw-wds``; DMuon (``adjust_lr_fn = "original"``) at
  ``--muon-lrs`` x ``--muon-wds`` (``--dmuon.lr``, ``--dmuon.weight_decay``: the Muon
  matrices; its AdamW part keeps the config's lr 3e-3 and weight decay 0). Seed 42.
* ``dropin``: DMuon with ``adjust_lr_fn = "match_rms_adamw"`` and the best AdamW run's lr
  and weight decay for every parameter: "keep your AdamW settings".
* ``normuon``: NorMuon (``--dmuon.variant normuon``) at the best DMuon run's settings.
* ``seed2``: the best AdamW, the best DMuon and the drop-in again with a second seed.
* ``timing``: the best AdamW, the best DMuon and the drop-in for ``--timing-steps`` steps
  without evaluation, in ``--timing-rounds`` interleaved rounds, so that their step times
  come from one stretch of time on a machine left quiet; the report's wall times use the
  fastest round of each (without it, each run's own step time).
* ``qkclip``: QK-clip (``--dmuon.qk_clip_threshold``) at the best DMuon run's settings (not
  in ``all``).

Held-out loss: ``scripts/setup.sh`` builds ``assets/heldout/`` (5% of the documents,
never in the training corpus; ``torchtitan_dmuon/titan/assets.py``), and TorchTitan's own
``[validation]`` evaluates on it every ``--eval-every`` steps (and at step 1). TorchTitan
does not restart its validation data by itself: each evaluation goes on where the last
one stopped (a non-infinite dataset, ``--validation.steps -1``, is empty the second time,
and its two ranks hold different numbers of batches, so it would hang). With
``--validation.dataloader.num_workers 1`` the loader's worker process is started afresh
for each evaluation from a copy of the untouched dataset, so every evaluation reads the
same first ``--val-batches`` batches of each rank's share; ``check`` verifies it.

Wall time: a run's step time is the median over its logged intervals (5 steps each, an
evaluation's time taken out), so a few minutes of other load on the machine move it
little; "wall s to reach" is steps to reach x that step time. Each record keeps
the machine it ran on (a sweep can be run in parts, on different days).

Runs are cached by their arguments: ``<out>/<size>/runs/<name>.json`` holds a finished
run with the exact TorchTitan overrides it ran with; a run whose record exists is skipped,
and a record made with other overrides (other ``--steps``, say) stops the benchmark
rather than mixing them. Logs and TorchTitan's dump folders go under ``--work``. The
report (``table.md``, ``convergence.json``, ``convergence.png``) goes to ``<out>/<size>/``.

Usage::

    .venv/bin/python benchmarks/bench_convergence.py --size debug            # every group
    .venv/bin/python benchmarks/bench_convergence.py --size large --runs sweep
    .venv/bin/python benchmarks/bench_convergence.py --size debug --list
    .venv/bin/python benchmarks/bench_convergence.py --size debug --report-only
    .venv/bin/python benchmarks/bench_convergence.py --quick --out /tmp/q --work /tmp/q
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
import statistics
import subprocess
import sys
import time

import torch

from torchtitan_dmuon.titan.config import ORIGINAL_LR, ORIGINAL_WEIGHT_DECAY

logger = logging.getLogger("bench_convergence")

ROOT = pathlib.Path(__file__).resolve().parent.parent
CONFIG = "train_configs/debug_cpu.toml"
NPROC = 2
# From the config: tokens per step are local_batch_size * seq_len * NPROC.
LOCAL_BATCH_SIZE, SEQ_LEN = 4, 128
LOG_FREQ = 5  # [metrics] log_freq of the config: the training loss is logged every 5 steps
SEED, SEED2 = 42, 1
DEFAULT_GROUPS = ("check", "sweep", "dropin", "normuon", "seed2", "timing")
GROUPS = (*DEFAULT_GROUPS, "qkclip")
DEPENDENT = ("dropin", "normuon", "seed2", "timing", "qkclip")
"""The groups chosen from finished runs, in the order they are run (each may need the last)."""
_TIME = r"\[rank0\]:\[titan\] (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) - root - \w+ - "
_NUM = r"(-?[\d.]+|nan|inf|-inf)"
STEP_RE = re.compile(
    _TIME + r"step:\s*(\d+)\s+loss:\s*" + _NUM + r"\s+grad_norm:\s*" + _NUM + r".*?tps:\s*([\d,]+)"
)
VAL_RE = re.compile(_TIME + r"validate step:\s*(\d+)\s+loss:\s*" + _NUM)
START_RE = re.compile(_TIME + r"Training starts at step")
QK_RE = re.compile(r"qk max logit " + _NUM + r" clipped heads (\d+)")
NS_DTYPE_RE = re.compile(r"ns_dtype='auto' chose torch\.(\w+)")


@dataclasses.dataclass(frozen=True)
class ModelSize:
    """A model the sweep runs at.

    Attributes:
        flags: The TorchTitan overrides that select it.
        description: What it is, for the report.
        adamw_lrs: AdamW's lr grid (``--adamw-lrs`` unset), the best lr inside it: AdamW's
            best lr falls as the width grows (1e-3 beat 3e-3 at dim 512, where 3e-3 had
            beaten 1e-3 by 0.28 at dim 256), Muon's is meant not to, so its grid stays.
    """

    flags: tuple[str, ...]
    description: str
    adamw_lrs: tuple[float, ...]


SIZES = {
    "debug": ModelSize(
        (), "llama3 debugmodel (dim 256, 6 layers, 6.2M parameters)", (3e-3, 1e-3, 1e-2)
    ),
    "large": ModelSize(
        (
            "--experimental.custom_import",
            "benchmarks.convergence_model",
            "--model.name",
            "llama3_bench",
            "--model.flavor",
            "dim512_l8",
        ),
        "llama3 at dim 512, 8 layers (29.4M parameters, 4.8x debugmodel)",
        (1e-3, 3e-4, 3e-3),
    ),
}


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """One training run.

    Attributes:
        kind: What trains: ``adamw``, ``dmuon`` (``adjust_lr_fn = "original"``), ``dropin``
            (``match_rms_adamw`` with AdamW's settings), or a variant of one of the DMuon
            kinds (``normuon``, ``normuon_dropin``, ``qkclip10``, ...).
        group: One of ``GROUPS``.
        seed: ``--debug.seed``.
        lr: The swept learning rate: AdamW's, or the Muon matrices'.
        weight_decay: The swept weight decay, of the same parameters as ``lr``.
        flags: The optimizer's TorchTitan overrides.
    """

    kind: str
    group: str
    seed: int
    lr: float
    weight_decay: float
    flags: tuple[str, ...]

    @property
    def name(self) -> str:
        """File stem of the run's outputs, e.g. ``dmuon_lr0.02_wd0.01_s42``."""
        return f"{self.kind}_lr{_fmt(self.lr)}_wd{_fmt(self.weight_decay)}_s{self.seed}"

    @property
    def optimizer(self) -> str:
        """``"AdamW"`` or ``"DMuon"``."""
        return "AdamW" if self.kind == "adamw" else "DMuon"

    def overrides(self, settings: Settings) -> list[str]:
        """The TorchTitan overrides of this run.

        Args:
            settings: What every run of the benchmark shares.

        Returns:
            The arguments for ``./run_train.sh`` after the config file.
        """
        args = ["--training.steps", str(settings.steps), "--debug.seed", str(self.seed)]
        args += [*SIZES[settings.size].flags, *self.flags]
        if not settings.val_batches:  # a timing run
            return args + list(settings.extra)
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
            str(settings.eval_every),
            "--validation.steps",
            str(settings.val_batches),
            "--validation.dataloader.num_workers",
            "1",
        ]
        return args + list(settings.extra)


@dataclasses.dataclass(frozen=True)
class Settings:
    """What every run of one benchmark command shares.

    Attributes:
        size: A key of ``SIZES``.
        steps: ``--training.steps``.
        eval_every: ``--validation.freq``.
        val_batches: ``--validation.steps``: batches per rank at each evaluation; 0: no
            evaluation (a ``timing`` run).
        extra: Further TorchTitan overrides, last on the line.
    """

    size: str
    steps: int
    eval_every: int
    val_batches: int
    extra: tuple[str, ...] = ()


def _fmt(value: float) -> str:
    """A number as it appears in run names and flags (``0.003``, ``0.02``, ``1e-4``)."""
    text = f"{value:g}"
    return re.sub(r"e-0(\d)", r"e-\1", text)


def adamw_run(lr: float, weight_decay: float, seed: int, group: str) -> RunSpec:
    """TorchTitan's fused AdamW for every parameter."""
    flags = ("--optimizer.name", "AdamW", "--optimizer.lr", _fmt(lr))
    flags += ("--optimizer.weight_decay", _fmt(weight_decay))
    return RunSpec("adamw", group, seed, lr, weight_decay, flags)


def dmuon_run(lr: float, weight_decay: float, seed: int, group: str) -> RunSpec:
    """DMuon, ``adjust_lr_fn = "original"``: the Muon matrices at ``lr`` and
    ``weight_decay``, the rest on the config's AdamW (lr 3e-3, weight decay 0)."""
    flags = ("--dmuon.lr", _fmt(lr), "--dmuon.weight_decay", _fmt(weight_decay))
    return RunSpec("dmuon", group, seed, lr, weight_decay, flags)


def dropin_run(lr: float, weight_decay: float, seed: int, group: str) -> RunSpec:
    """DMuon as a drop-in for an AdamW run: ``match_rms_adamw``, and AdamW's lr and weight
    decay for every parameter, the Muon matrices included."""
    value = (_fmt(lr), _fmt(weight_decay))
    flags = ("--optimizer.lr", value[0], "--optimizer.weight_decay", value[1])
    flags += ("--dmuon.adjust_lr_fn", "match_rms_adamw")
    flags += ("--dmuon.lr", value[0], "--dmuon.weight_decay", value[1])
    return RunSpec("dropin", group, seed, lr, weight_decay, flags)


def variant_run(base: RunSpec, tag: str, flags: tuple[str, ...], group: str) -> RunSpec:
    """``base`` (a DMuon run) with ``flags`` added, named ``<tag>`` or ``<tag>_dropin``."""
    kind = tag if base.kind == "dmuon" else f"{tag}_{base.kind}"
    return dataclasses.replace(base, kind=kind, group=group, flags=base.flags + flags)


def reseeded(base: RunSpec, seed: int) -> RunSpec:
    """``base`` with another seed, in group ``seed2``."""
    return dataclasses.replace(base, seed=seed, group="seed2")


def sweep_specs(args: argparse.Namespace) -> list[RunSpec]:
    """The sweep (seed ``SEED``), AdamW first, each lr with weight decay 0 first."""
    specs = [adamw_run(lr, wd, SEED, "sweep") for lr in args.adamw_lrs for wd in args.adamw_wds]
    specs += [dmuon_run(lr, wd, SEED, "sweep") for lr in args.muon_lrs for wd in args.muon_wds]
    return specs


def quick_specs() -> list[RunSpec]:
    """``--quick``: one AdamW run and one DMuon run, both with weight decay."""
    return [adamw_run(3e-3, 0.1, SEED, "sweep"), dmuon_run(0.02, 0.01, SEED, "sweep")]


def check_spec() -> RunSpec:
    """AdamW at lr 0, evaluated at 1, 5 and 10: the held-out losses must be equal."""
    return adamw_run(0.0, 0.0, SEED, "check")


def _final(record: dict) -> float:
    loss = record["final_val_loss"]
    return loss if math.isfinite(loss) else math.inf


def best_run(results: list[dict], kinds: tuple[str, ...], groups: tuple[str, ...]) -> dict | None:
    """The run of ``kinds`` in ``groups`` with the lowest final held-out loss, or None."""
    runs = [r for r in results if r["kind"] in kinds and r["group"] in groups]
    return min(runs, key=_final, default=None)


def spec_of(record: dict) -> RunSpec:
    """The :class:`RunSpec` a record was made from."""
    return RunSpec(
        record["kind"],
        record["group"],
        record["seed"],
        record["lr"],
        record["weight_decay"],
        tuple(record["flags"]),
    )


def dependent_specs(args: argparse.Namespace, results: list[dict], group: str) -> list[RunSpec]:
    """The runs of a group that depends on finished runs.

    Args:
        args: The command line.
        results: The finished runs.
        group: One of ``DEPENDENT``.

    Returns:
        The runs of ``group`` whose inputs are finished (what is missing is logged).
    """
    done = {r["name"] for r in results}
    missing = {
        optimizer: sorted(
            s.name for s in sweep_specs(args) if s.optimizer == optimizer and s.name not in done
        )
        for optimizer in ("AdamW", "DMuon")
    }
    needs = {
        "dropin": ("AdamW",),
        "normuon": ("AdamW", "DMuon"),
        "seed2": ("AdamW", "DMuon"),
        "timing": ("AdamW", "DMuon"),
        "qkclip": ("AdamW", "DMuon"),
    }[group]
    for optimizer in needs:
        if missing[optimizer]:
            logger.warning(
                "%s: the %s sweep is incomplete (%d runs missing, e.g. %s)",
                group,
                optimizer,
                len(missing[optimizer]),
                missing[optimizer][0],
            )
            return []
    best_adamw = best_run(results, ("adamw",), ("sweep",))
    dropin = dropin_run(best_adamw["lr"], best_adamw["weight_decay"], SEED, "dropin")
    if group == "dropin":
        return [dropin]
    if dropin.name not in done:
        logger.warning("%s: needs the drop-in run %s first", group, dropin.name)
        return []
    best_dmuon = spec_of(best_run(results, ("dmuon", "dropin"), ("sweep", "dropin")))
    if group == "normuon":
        return [variant_run(best_dmuon, "normuon", ("--dmuon.variant", "normuon"), group)]
    if group == "qkclip":
        threshold = _fmt(args.qk_clip_threshold)
        flags = ("--dmuon.qk_clip_threshold", threshold)
        return [variant_run(best_dmuon, f"qkclip{threshold}", flags, group)]
    best_original = spec_of(best_run(results, ("dmuon",), ("sweep",)))
    bases = [spec_of(best_adamw), best_original, dropin]
    if group == "timing":
        return [
            dataclasses.replace(base, kind=f"timing{n}_{base.kind}", group="timing")
            for n in range(1, args.timing_rounds + 1)
            for base in bases
        ]
    return [reseeded(base, SEED2) for base in bases]


def parse_log(text: str) -> dict:
    """Training and validation entries of a rank-0 TorchTitan log.

    Args:
        text: The log.

    Returns:
        ``start`` (the "Training starts" time, seconds since the epoch), ``train`` (per
        logged step: step, time, loss, grad_norm, tps), ``val`` (per evaluation: step,
        time, loss) and ``ns_dtype`` (what ``ns_dtype = "auto"`` chose, or None).
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
    ns_dtype = next((m.group(1) for m in NS_DTYPE_RE.finditer(text)), None)
    return {"start": start, "train": train, "val": val, "ns_dtype": ns_dtype}


def step_seconds(train: list[dict], eval_seconds: dict[int, float]) -> float:
    """The median seconds per training step over the logged intervals.

    An evaluation at step ``s`` runs after step ``s``'s log line, in the interval that
    starts at ``s``: its time is taken out of that interval.

    Args:
        train: The logged steps (step, time).
        eval_seconds: Seconds of the evaluation at each evaluated step.
    """
    per_step = [
        (
            b["time"]
            - a["time"]
            - sum(t for s, t in eval_seconds.items() if a["step"] <= s < b["step"])
        )
        / (b["step"] - a["step"])
        for a, b in zip(train, train[1:], strict=False)
    ]
    return statistics.median(per_step) if per_step else math.nan


def summarize(spec: RunSpec, settings: Settings, parsed: dict, wall_s: float) -> dict:
    """The result record of a run from its parsed log.

    Wall-clock is training time only: seconds since "Training starts" at the step's log
    line, less the evaluations before it (an evaluation lasts from the log line of its
    step to its ``validate`` line; every evaluation step is a logged step).

    Args:
        spec: The run.
        settings: What the benchmark's runs share.
        parsed: :func:`parse_log`'s output.
        wall_s: Seconds the whole subprocess took.

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
        "kind": spec.kind,
        "optimizer": spec.optimizer,
        "group": spec.group,
        "seed": spec.seed,
        "lr": spec.lr,
        "weight_decay": spec.weight_decay,
        "flags": list(spec.flags),
        "size": settings.size,
        "config": {
            "config_file": CONFIG,
            "nproc": NPROC,
            "steps": settings.steps,
            "eval_every": settings.eval_every,
            "val_batches_per_rank": settings.val_batches,
            "val_tokens_per_eval": settings.val_batches * LOCAL_BATCH_SIZE * SEQ_LEN * NPROC,
            "tokens_per_step": tokens_per_step,
            "overrides": spec.overrides(settings),
        },
        "ns_dtype": parsed["ns_dtype"],
        "steps_done": last["step"],
        "val": evals,
        "train": train,
        "final_val_loss": evals[-1]["loss"] if evals else float("nan"),
        "best_val_loss": min(losses) if losses else float("nan"),
        "step_s": round(step_seconds(parsed["train"], {e["step"]: e["eval_s"] for e in evals}), 4),
        "train_wall_s": round(train_s, 3),
        "eval_wall_s": round(eval_seconds, 3),
        "process_wall_s": round(wall_s, 3),
        "tokens_per_s": round(last["step"] * tokens_per_step / train_s, 1),
    }


class CacheMismatch(RuntimeError):
    """A finished run's record was made with other TorchTitan overrides."""


def cached(spec: RunSpec, settings: Settings, runs_dir: pathlib.Path) -> dict | None:
    """The finished record of ``spec``, or None.

    Raises:
        CacheMismatch: The record exists but ran with other overrides.
    """
    path = runs_dir / f"{spec.name}.json"
    if not path.exists():
        return None
    record = json.loads(path.read_text())
    if record["config"]["overrides"] != spec.overrides(settings):
        raise CacheMismatch(
            f"{path} ran with {' '.join(record['config']['overrides'])}; this command would "
            f"run {' '.join(spec.overrides(settings))}: give another --out, or move the record"
        )
    return record


def run_one(spec: RunSpec, args: argparse.Namespace, settings: Settings, meta: dict) -> dict | None:
    """Trains ``spec`` through ``./run_train.sh`` unless its record exists.

    Args:
        spec: The run.
        args: The command line (``--out``, ``--work``, ``--timeout``).
        settings: What the benchmark's runs share.
        meta: :func:`machine`'s output, kept in the record.

    Returns:
        The run's record, or None when it failed (its log stays under ``--work``).
    """
    runs_dir = args.out / settings.size / "runs"
    record = cached(spec, settings, runs_dir)
    if record is not None:
        logger.info("%s: done before, skipped", spec.name)
        return record
    work = args.work / settings.size
    log_path = work / "logs" / f"{spec.name}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    dump = work / "dumps" / spec.name
    cmd = ["./run_train.sh", "--job.config_file", CONFIG, "--job.dump_folder", str(dump)]
    cmd += spec.overrides(settings)
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
    if returncode != 0 or steps != settings.steps or parsed["start"] is None:
        logger.error(
            "%s: failed (return code %s, %d of %d steps); see %s",
            spec.name,
            returncode,
            steps,
            settings.steps,
            log_path,
        )
        return None
    record = summarize(spec, settings, parsed, wall_s)
    record["machine"] = meta
    record["loadavg_start"], record["loadavg_end"] = list(load_start), list(os.getloadavg())
    record["finished"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    runs_dir.mkdir(parents=True, exist_ok=True)
    path = runs_dir / f"{spec.name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(tmp, path)
    held_out = (
        f"final held-out loss {record['final_val_loss']:.4f}"
        if record["val"]
        else "no evaluation (a timing run)"
    )
    logger.info(
        "%s: %s, %.3f s a step, %.0f s training",
        spec.name,
        held_out,
        record["step_s"],
        record["train_wall_s"],
    )
    return record


def steps_to_reach(run: dict, target: float) -> float | None:
    """The step at which ``run``'s held-out loss first reaches ``target``.

    Linear interpolation between the two evaluations around the crossing; None when the
    run never reaches it.
    """
    previous = None
    for e in run["val"]:
        if e["loss"] <= target:
            if previous is None or previous["loss"] == e["loss"]:
                return float(e["step"])
            frac = (previous["loss"] - target) / (previous["loss"] - e["loss"])
            return previous["step"] + frac * (e["step"] - previous["step"])
        previous = e
    return None


def machine() -> dict:
    """The CPU model, torch's CPU capability, versions and the git commit."""
    model = platform.processor() or "unknown"
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass

    def git(*command: str) -> str:
        result = subprocess.run(
            ["git", "-C", str(ROOT), *command], text=True, capture_output=True, check=False
        )
        return result.stdout.strip()

    return {
        "cpu_model": model,
        "cpu_count": os.cpu_count(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
        "git_commit": git("rev-parse", "HEAD"),
        "git_dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
    }


def _table(rows: list[list[str]], header: list[str]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def _loss(value: float | None) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value:.4f}"


def _machine_key(record: dict) -> tuple:
    m = record.get("machine", {})
    return (m.get("cpu_model"), m.get("cpu_count"), m.get("cpu_capability"), m.get("torch"))


RECIPES = (
    ("AdamW, best of the sweep", ("adamw",), ("sweep",), None),
    ("DMuon original, best of the sweep", ("dmuon",), ("sweep",), None),
    (
        f"DMuon as shipped ([dmuon] lr and weight_decay unset: {ORIGINAL_LR:g}, "
        f"{ORIGINAL_WEIGHT_DECAY:g})",
        ("dmuon",),
        ("sweep",),
        (ORIGINAL_LR, ORIGINAL_WEIGHT_DECAY),
    ),
    ("DMuon drop-in (match_rms_adamw, AdamW's settings)", ("dropin",), ("dropin",), None),
    ("NorMuon at the best DMuon settings", ("normuon", "normuon_dropin"), ("normuon",), None),
    ("QK-clip at the best DMuon settings", None, ("qkclip",), None),
)
"""The report's recipe rows: label, kinds (None: any), the group of the seed-42 run, and
its (lr, weight decay) (None: the best such run)."""


def _seeds_of(results: list[dict], run: dict) -> list[dict]:
    """``run`` and its reseeded twins, seed ``SEED`` first."""
    same = [
        r
        for r in results
        if (r["kind"], r["lr"], r["weight_decay"]) == (run["kind"], run["lr"], run["weight_decay"])
        and (r is run or r["group"] == "seed2")
    ]
    return sorted(same, key=lambda r: r["seed"] != SEED)


def _timed_step_s(results: list[dict], run: dict) -> float | None:
    """The fastest ``timing`` round's step time of ``run``'s settings, or None."""
    rounds = [
        r["step_s"]
        for r in results
        if r["group"] == "timing"
        and r["kind"].split("_", 1)[1] == run["kind"]
        and (r["lr"], r["weight_decay"]) == (run["lr"], run["weight_decay"])
    ]
    return min(rounds, default=None)


def _grid(results: list[dict], kind: str, lrs: list[float], wds: list[float]) -> list[str]:
    cells = {
        (r["lr"], r["weight_decay"]): r
        for r in results
        if r["kind"] == kind and r["group"] == "sweep"
    }
    best = min(cells.values(), key=_final, default=None)
    wds = sorted(wds)  # the sweep runs its centre first; the table reads in order
    rows = []
    for lr in sorted(lrs):
        row = [_fmt(lr)]
        for wd in wds:
            r = cells.get((lr, wd))
            text = _loss(r["final_val_loss"]) if r else "not run"
            row.append(f"**{text}**" if r is not None and r is best else text)
        rows.append(row)
    return _table(rows, ["lr \\ weight decay", *(_fmt(wd) for wd in wds)])


def report(
    results: list[dict], check: dict | None, settings: Settings, args: argparse.Namespace
) -> tuple[str, dict]:
    """The markdown report of one size and its summary.

    Args:
        results: The size's finished training runs (no ``check`` run).
        check: The ``check`` run, if done.
        settings: What the runs share.
        args: The command line (the sweep's points).

    Returns:
        The markdown text and the summary dict for the JSON.
    """
    size = SIZES[settings.size]
    tokens_per_step = LOCAL_BATCH_SIZE * SEQ_LEN * NPROC
    lines = [
        f"## DMuon vs FSDP2 + fused AdamW, {size.description}: held-out loss",
        "",
        f"{CONFIG}, {NPROC} gloo ranks, {settings.steps} steps of {tokens_per_step} tokens "
        f"(warmup 10, linear decay to 0), held-out evaluation every {settings.eval_every} "
        f"steps on the same {settings.val_batches * tokens_per_step} tokens.",
        "",
    ]
    machines: dict[tuple, list[dict]] = {}
    for r in results:
        machines.setdefault(_machine_key(r), []).append(r)
    for key, runs in machines.items():
        dtypes = sorted({str(r.get("ns_dtype")) for r in runs if r["optimizer"] == "DMuon"})
        commits = sorted({r.get("machine", {}).get("git_commit", "")[:7] for r in runs})
        lines.append(
            f"- {len(runs)} runs on {key[0]} ({key[1]} cores), cpu capability {key[2]}, torch "
            f"{key[3]}; Newton-Schulz dtype (`auto`): {', '.join(dtypes) or '-'}; commits "
            f"{', '.join(commits)}"
        )
    summary: dict = {"size": settings.size, "steps": settings.steps}
    if check:
        losses = [e["loss"] for e in check["val"]]
        same = len(set(losses)) == 1 and len(losses) >= 2
        summary["fixed_eval_check"] = {"losses": losses, "same": same}
        lines.append(
            f"- fixed-batch check (AdamW lr 0, unchanged model): held-out losses {losses} at "
            f"steps {[e['step'] for e in check['val']]}: {'identical' if same else 'DIFFERENT'}"
        )
    lines += ["", "Final held-out loss of the sweep (seed 42; best in bold):", ""]
    lines += ["AdamW (every parameter):", ""]
    lines += _grid(results, "adamw", args.adamw_lrs, args.adamw_wds)
    lines += ["", 'DMuon, `adjust_lr_fn = "original"` (Muon matrices\' lr and weight decay):', ""]
    lines += _grid(results, "dmuon", args.muon_lrs, args.muon_wds)
    lines.append("")

    adamw = best_run(results, ("adamw",), ("sweep",))
    timed = adamw is not None and _timed_step_s(results, adamw) is not None
    rows = []
    for label, kinds, group, pinned in RECIPES:
        run = next(
            (
                r
                for r in sorted(results, key=_final)
                if r["group"] in group
                and (kinds is None or r["kind"] in kinds)
                and (pinned is None or (r["lr"], r["weight_decay"]) == pinned)
            ),
            None,
        )
        if run is None:
            continue
        seeds = _seeds_of(results, run)
        finals = [r["final_val_loss"] for r in seeds]
        entry = {
            "name": run["name"],
            "lr": run["lr"],
            "weight_decay": run["weight_decay"],
            "final_val_loss": {str(r["seed"]): r["final_val_loss"] for r in seeds},
            "step_s": run["step_s"],
            "timed_step_s": _timed_step_s(results, run),
        }
        reach = ["-", "-"]
        if adamw is not None:
            target = adamw["final_val_loss"]
            own = steps_to_reach(adamw, target)
            steps = steps_to_reach(run, target)
            entry["steps_to_adamw_final"] = steps
            if steps is None:
                reach = ["not reached", "not reached"]
            else:
                ratio = steps / own
                step_s, own_step_s = run["step_s"], adamw["step_s"]
                note = "" if _machine_key(run) == _machine_key(adamw) else " (other machine)"
                if timed and entry["timed_step_s"] is not None:
                    step_s, own_step_s = entry["timed_step_s"], _timed_step_s(results, adamw)
                elif timed:  # not in the timing rounds: both runs' own step times
                    note += " (runs' own s/step)"
                wall, own_wall = steps * step_s, own * own_step_s
                reach = [
                    f"{steps:.0f} ({ratio:.2f}x)",
                    f"{wall:.0f} ({wall / own_wall:.2f}x){note}",
                ]
                entry.update(
                    steps_ratio=ratio, wall_s_to_adamw_final=wall, wall_ratio=wall / own_wall
                )
        summary.setdefault("recipes", {})[run["name"]] = entry
        rows.append(
            [
                label,
                f"lr {_fmt(run['lr'])}, wd {_fmt(run['weight_decay'])}",
                _loss(sum(finals) / len(finals)),
                ", ".join(f"{r['seed']}: {_loss(r['final_val_loss'])}" for r in seeds),
                *reach,
                f"{run['step_s']:.3f}",
                "-" if entry["timed_step_s"] is None else f"{entry['timed_step_s']:.3f}",
            ]
        )
    if adamw is not None:
        source = "the timing rounds' fastest" if timed else "each run's own (median)"
        lines.append(
            f"Steps and training wall time (steps x s/step, {source}) to reach the best AdamW "
            f"run's final held-out loss {_loss(adamw['final_val_loss'])}:"
        )
        lines.append("")
    lines += _table(
        rows,
        ["recipe", "settings", "final held-out (mean)", "per seed", "steps to AdamW's final",
         "wall s to it", "s/step", "s/step timed"],
    )  # fmt: skip
    lines += ["", "Every run:", ""]
    rows = [
        [
            r["name"],
            r["group"],
            _loss(r["final_val_loss"]),
            _loss(r["best_val_loss"]),
            f"{r['step_s']:.3f}",
            f"{r['train_wall_s']:.0f}",
            str(r.get("ns_dtype") or "-"),
        ]
        for r in sorted(results, key=lambda r: (r["group"] != "sweep", r["name"]))
    ]
    lines += _table(
        rows,
        ["run", "group", "final held-out", "best held-out", "s/step", "train wall s",
         "NS dtype"],
    )  # fmt: skip
    return "\n".join(lines) + "\n", summary


def plot(results: list[dict], path: pathlib.Path, title: str, highlight: set[str]) -> None:
    """Held-out loss against steps and against training wall time, one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 5), sharey=True)
    colors = {"adamw": "tab:blue", "dmuon": "tab:orange", "dropin": "tab:green"}
    for r in sorted(results, key=lambda r: r["name"] in highlight):
        if not r["val"]:  # a timing run
            continue
        bold = r["name"] in highlight or r["group"] == "seed2"
        kind = r["kind"]
        color = colors.get(kind, "tab:red" if kind.startswith("qkclip") else "tab:purple")
        kw = {
            "color": color,
            "linestyle": "--" if r["group"] == "seed2" else "-",
            "linewidth": 2.4 if bold else 0.9,
            "alpha": 1.0 if bold else 0.35,
            "label": r["name"] if bold else None,
        }
        steps = [e["step"] for e in r["val"]]
        losses = [e["loss"] for e in r["val"]]
        axes[0].plot(steps, losses, **kw)
        axes[1].plot([s * r["step_s"] for s in steps], losses, **kw)
    axes[0].set_xlabel("step")
    axes[1].set_xlabel("training wall time (s: steps x median s/step)")
    axes[0].set_ylabel("held-out loss")
    finite = [e["loss"] for r in results for e in r["val"] if math.isfinite(e["loss"])]
    if finite:
        low = min(finite)
        axes[0].set_ylim(low - 0.1, min(max(finite), low + 2.0))
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7, loc="upper right")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _load_done(runs_dir: pathlib.Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(runs_dir.glob("*.json"))]


def main(argv: list[str] | None = None) -> int:
    """Runs the selected runs (skipping finished ones), then writes the size's report.

    Args:
        argv: The command line (``sys.argv[1:]`` when None).

    Returns:
        0, or 1 when a run failed.
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="debug")
    parser.add_argument(
        "--out",
        type=pathlib.Path,
        default=ROOT / "docs/figures/convergence",
        help="records and report: <out>/<size>/",
    )
    parser.add_argument(
        "--work",
        type=pathlib.Path,
        default=ROOT / "outputs/convergence",
        help="logs and TorchTitan dump folders: <work>/<size>/",
    )
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument(
        "--val-batches",
        type=int,
        default=10,
        help="held-out batches per rank at each evaluation (rank 1 of the 2 holds 20 "
        "whole batches of 4 x 128 tokens)",
    )
    parser.add_argument(
        "--runs",
        default="all",
        help=f"comma-separated groups ({', '.join(GROUPS)}; all: {', '.join(DEFAULT_GROUPS)}) "
        "and/or run names (see --list)",
    )
    parser.add_argument(
        "--adamw-lrs",
        type=float,
        nargs="+",
        help="AdamW's lr grid (default: the size's; "
        + ", ".join(f"{k} {' '.join(map(_fmt, v.adamw_lrs))}" for k, v in SIZES.items())
        + ")",
    )
    parser.add_argument("--adamw-wds", type=float, nargs="+", default=[0.0, 0.1])
    parser.add_argument("--muon-lrs", type=float, nargs="+", default=[0.02, 0.01, 0.04])
    parser.add_argument("--muon-wds", type=float, nargs="+", default=[0.0, 0.01, 0.1])
    parser.add_argument("--qk-clip-threshold", type=float, default=10.0)
    parser.add_argument("--timing-steps", type=int, default=60)
    parser.add_argument("--timing-rounds", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=7200, help="seconds per run")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="10 steps, evaluated every 5 on 2 batches: one AdamW and one DMuon run (the "
        "test suite's check of this benchmark)",
    )
    parser.add_argument("--list", action="store_true", help="list the runs and exit")
    parser.add_argument("--report-only", action="store_true", help="run nothing, report")
    parser.add_argument(
        "--extra",
        nargs=argparse.REMAINDER,
        default=[],
        help="TorchTitan overrides for every run (last on the line)",
    )
    args = parser.parse_args(argv)
    if args.adamw_lrs is None:
        args.adamw_lrs = list(SIZES[args.size].adamw_lrs)
    if args.quick:
        args.steps, args.eval_every, args.val_batches = 10, 5, 2
    args.out, args.work = args.out.resolve(), args.work.resolve()
    if args.steps % args.eval_every or args.eval_every % LOG_FREQ:
        parser.error(
            f"--steps must be a multiple of --eval-every, and --eval-every of {LOG_FREQ}"
            " (the config's log_freq), so the last step is evaluated and timed"
        )
    settings = Settings(args.size, args.steps, args.eval_every, args.val_batches, tuple(args.extra))
    wanted = set(args.runs.split(","))
    if "all" in wanted:
        wanted |= set(DEFAULT_GROUPS)
    runs_dir = args.out / args.size / "runs"
    meta = machine()

    check_settings = dataclasses.replace(settings, steps=10, eval_every=5)
    timing_settings = dataclasses.replace(settings, steps=args.timing_steps, val_batches=0)

    def settings_of(group: str) -> Settings:
        return timing_settings if group == "timing" else settings

    queue = quick_specs() if args.quick else sweep_specs(args)
    selected = [s for s in queue if args.quick or s.group in wanted or s.name in wanted]
    try:
        if args.list:
            done = [r for r in _load_done(runs_dir) if r["group"] != "check"]
            print(
                check_spec().name,
                "check",
                "done" if cached(check_spec(), check_settings, runs_dir) else "",
            )
            for s in queue:
                print(s.name, s.group, "done" if cached(s, settings, runs_dir) else "")
            for group in DEPENDENT:
                for s in dependent_specs(args, done, group):
                    known = cached(s, settings_of(group), runs_dir)
                    print(s.name, s.group, "done" if known else "")
            return 0
        failed = False
        if not args.report_only:
            if "check" in wanted and not args.quick:
                failed |= run_one(check_spec(), args, check_settings, meta) is None
            for spec in selected:
                failed |= run_one(spec, args, settings, meta) is None
            for group in DEPENDENT if not args.quick else ():
                done = [r for r in _load_done(runs_dir) if r["group"] != "check"]
                for spec in dependent_specs(args, done, group):
                    if group in wanted or spec.name in wanted:
                        failed |= run_one(spec, args, settings_of(group), meta) is None
    except CacheMismatch as error:
        logger.error("%s", error)
        return 2

    everything = _load_done(runs_dir)
    check = next((r for r in everything if r["group"] == "check"), None)
    results = [r for r in everything if r["group"] != "check"]
    text, summary = report(results, check, settings, args)
    out = args.out / args.size
    out.mkdir(parents=True, exist_ok=True)
    if results:
        highlight = set(summary.get("recipes", {}))
        title = f"DMuon vs FSDP2 + fused AdamW, {SIZES[args.size].description}, held-out loss"
        plot(results, out / "convergence.png", title, highlight)
    (out / "table.md").write_text(text)
    payload = {
        "machine": meta,
        "summary": summary,
        "check": check,
        "runs": results,
        "command": [sys.executable, *sys.argv],
    }
    (out / "convergence.json").write_text(json.dumps(payload, indent=1) + "\n")
    print(text)
    logger.info("wrote %s (table.md, convergence.json, convergence.png)", out)
    return 1 if failed else 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="[bench_convergence] %(asctime)s %(message)s")
    sys.exit(main())
