"""Memory-growth benchmark: worker memory of a TorchTitan run with DMuon beside AdamW.

    .venv/bin/python benchmarks/bench_memory.py --steps 300 --out outputs/bench_memory

runs ``./run_train.sh`` (the default config, train_configs/debug_cpu.toml, unless
overridden) once per mode: ``adamw`` (``--optimizer.name AdamW``, same train spec),
``dmuon_z3`` (the config as is) and, if asked, ``dmuon_z2``
(``--dmuon.reshard_after_forward False``). Any argument this script does not know is passed
to ``run_train.sh`` as a TorchTitan override.

While a run trains, every ``--interval`` seconds it reads the resident set (``VmRSS`` of
``/proc/<pid>/status``) of each torchrun worker (the descendants of the launched process
that carry a ``RANK``), and every ``--heap-interval`` seconds each worker records glibc's
heap figures (``mallinfo2``: bytes in use, ``uordblks`` plus mmapped ``hblkhd``, and bytes
free but kept, ``fordblks``) through a ``sitecustomize`` put first on ``PYTHONPATH``: a
daemon thread, no change to the package. Python's small objects live in pymalloc arenas,
outside ``mallinfo2``: they count in RSS only. Samples are placed on the step axis by the
times of TorchTitan's step lines (rank 0), and each interval between two logged steps is
represented by its lowest sample (memory between steps, without the activations).

It reports, per mode (mean over ranks; every rank in the JSON), RSS at the end of the
warm-up (``--warmup-step``) and at the last step, the growth in between, the growth per
step (least-squares slope over the intervals in between), the same for glibc's in-use
bytes, the free bytes the heap keeps at the end, and each DMuon mode's growth minus
AdamW's. The benchmark sets no allocator variable: the default runs see the caller's
environment (any ``MALLOC_*`` variable found there is reported). ``--diagnostics`` adds
runs of every mode that tell retained free memory from memory in use: ``arena2``
(``MALLOC_ARENA_MAX=2``), ``mmap`` (``MALLOC_MMAP_THRESHOLD_=131072``: a fixed threshold,
so large blocks are mmapped and unmapped on free), ``trim`` (the worker thread calls
``malloc_trim(0)`` before each sample) and ``fr0`` (``--comm.trace_buf_size 0``: without
the c10d flight recorder that TorchTitan turns on, whose entries live for 20000
collectives; on CPU the CPU layer already turns it off at TorchTitan's default size, so
there ``fr0`` differs from the default run only when ``--comm.trace_buf_size`` is
passed). It prints a table and writes ``results.json`` and ``memory.png`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEP = re.compile(r"step:\s*(\d+)\s+loss:")
MODES = {
    "adamw": ["--optimizer.name", "AdamW"],
    "dmuon_z3": [],
    "dmuon_z2": ["--dmuon.reshard_after_forward", "False"],
}
# name: (environment, TorchTitan overrides) of a diagnostic run.
DIAGNOSTICS = {
    "arena2": ({"MALLOC_ARENA_MAX": "2"}, []),
    "mmap": ({"MALLOC_MMAP_THRESHOLD_": "131072"}, []),
    "trim": ({"DMUON_BENCH_MALLOC_TRIM": "1"}, []),
    "fr0": ({}, ["--comm.trace_buf_size", "0"]),
}
MiB = 2**20

# Imported by every Python process of the run (first on PYTHONPATH); it does something
# only in torchrun workers (they have LOCAL_RANK) of a benchmark run.
SITECUSTOMIZE = """
import os

if os.environ.get("DMUON_BENCH_MALLOC_DIR") and "LOCAL_RANK" in os.environ:
    import ctypes
    import threading
    import time

    class _Mallinfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd",
            "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

    def _sample(libc, path, interval, trim):
        with open(path, "w", buffering=1) as f:
            while True:
                if trim:
                    libc.malloc_trim(0)
                m = libc.mallinfo2()
                f.write(f"{time.time():.3f} {m.uordblks + m.hblkhd} {m.fordblks} {m.hblkhd}\\n")
                time.sleep(interval)

    def _start():
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _Mallinfo2
        path = os.path.join(
            os.environ["DMUON_BENCH_MALLOC_DIR"], f"rank{os.environ['RANK']}.txt")
        interval = float(os.environ.get("DMUON_BENCH_MALLOC_INTERVAL", "0.5"))
        trim = os.environ.get("DMUON_BENCH_MALLOC_TRIM") == "1"
        threading.Thread(
            target=_sample, args=(libc, path, interval, trim), daemon=True,
            name="dmuon-bench-malloc").start()

    _start()
"""


def _children(pid: int) -> list[int]:
    kids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        # The command name (field 2) may hold spaces: the parent pid follows its ')'.
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            kids.append(int(entry))
    return kids


def _worker_ranks(root: int, known: dict[int, int | None]) -> dict[int, int]:
    """``{pid: rank}`` of the torchrun workers under ``root`` (cached in ``known``)."""
    stack, found = [root], {}
    while stack:
        pid = stack.pop()
        for kid in _children(pid):
            stack.append(kid)
            if kid not in known:
                try:
                    env = Path(f"/proc/{kid}/environ").read_bytes().split(b"\0")
                except OSError:
                    continue
                ranks = [e[5:] for e in env if e.startswith(b"RANK=")]
                known[kid] = int(ranks[0]) if ranks else None
            if known[kid] is not None:
                found[kid] = known[kid]
    return found


def _rss_bytes(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def run(label: str, mode: str, diagnostic: tuple, args, overrides, tmp: Path) -> dict:
    """One training run; returns its step times and memory samples."""
    malloc_dir = tmp / f"{label}_malloc"
    malloc_dir.mkdir()
    site_dir = tmp / "site"
    site_dir.mkdir(exist_ok=True)
    (site_dir / "sitecustomize.py").write_text(SITECUSTOMIZE)
    extra_env, extra_args = diagnostic
    env = dict(os.environ, **extra_env)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site_dir), env.get("PYTHONPATH")]))
    env["DMUON_BENCH_MALLOC_DIR"] = str(malloc_dir)
    env["DMUON_BENCH_MALLOC_INTERVAL"] = str(args.heap_interval)
    env["LOG_RANK"] = "0"
    cmd = [
        "./run_train.sh",
        "--job.dump_folder", str(tmp / f"{label}_dump"),
        "--training.steps", str(args.steps),
        *MODES[mode],
        *extra_args,
        *overrides,
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    log_lines: list[str] = []
    step_times: list[tuple[float, int]] = []

    def read() -> None:
        for line in proc.stdout:
            log_lines.append(line)
            match = STEP.search(line)
            if match:
                step_times.append((time.time(), int(match.group(1))))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    known: dict[int, int | None] = {}
    rss: dict[int, list[tuple[float, int]]] = {}
    while proc.poll() is None:
        for pid, rank in _worker_ranks(proc.pid, known).items():
            value = _rss_bytes(pid)
            if value is not None:
                rss.setdefault(rank, []).append((time.time(), value))
        time.sleep(args.interval)
    reader.join()
    (args.out / f"{label}.log").write_text("".join(log_lines))
    if proc.returncode != 0:
        raise RuntimeError(f"{label} failed ({proc.returncode}):\n{''.join(log_lines[-40:])}")
    heap = {}
    for path in sorted(malloc_dir.glob("rank*.txt")):
        rows = [line.split() for line in path.read_text().splitlines()]
        # The last line may be cut short by the worker's exit.
        heap[int(path.stem[4:])] = [
            (float(r[0]), int(r[1]), int(r[2])) for r in rows if len(r) == 4
        ]
    return {"step_times": step_times, "rss": rss, "heap": heap}


def _step_of(t: float, step_times: list[tuple[float, int]]) -> float | None:
    """The (fractional) step at wall time ``t``, between two logged steps."""
    for (t0, s0), (t1, s1) in zip(step_times, step_times[1:], strict=False):
        if t0 <= t <= t1:
            return s0 + (s1 - s0) * (t - t0) / (t1 - t0)
    return None


def _floors(series: list[tuple[float, float]], steps) -> list[tuple[int, float]]:
    """``(step, lowest sample)`` for each interval between two logged steps (the step
    that ends it): the value between steps, without the step's transient tensors."""
    floors = []
    for (t0, _), (t1, s1) in zip(steps, steps[1:], strict=False):
        inside = [v for t, v in series if t0 <= t <= t1]
        if inside:
            floors.append((s1, min(inside)))
    return floors


def _slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of value over step."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0


def _growth(series: list[tuple[float, float]], steps, warm: int, end: int) -> dict:
    floors = [(s, v) for s, v in _floors(series, steps) if warm <= s <= end]
    start, last = floors[0][1], floors[-1][1]
    return {
        "warm_mib": start / MiB,
        "end_mib": last / MiB,
        "growth_mib": (last - start) / MiB,
        "kib_per_step": _slope(floors) / 1024,
    }


def summarize(raw: dict, warmup_step: int) -> dict:
    steps = raw["step_times"]
    if not steps or steps[-1][1] <= warmup_step:
        raise RuntimeError(f"the run logged no step after --warmup-step {warmup_step}")
    # The first logged step after the warm-up (its interval ends there), and the last.
    s_warm = next(s for _, s in steps[1:] if s >= warmup_step)
    s_end = steps[-1][1]
    ranks = {}
    for rank in sorted(raw["rss"]):
        row = {"rss": _growth(raw["rss"][rank], steps, s_warm, s_end)}
        heap = raw["heap"].get(rank)
        if heap:
            row["in_use"] = _growth([(t, u) for t, u, _ in heap], steps, s_warm, s_end)
            # Free bytes kept, at the last interval's lowest in-use sample.
            t0 = steps[-2][0]
            last = [h for h in heap if t0 <= h[0]] or heap[-1:]
            row["heap_free_end_mib"] = min(last, key=lambda h: h[1])[2] / MiB
        ranks[rank] = row

    def mean(*keys):
        values = []
        for row in ranks.values():
            value = row
            for k in keys:
                value = value.get(k) if isinstance(value, dict) else None
            if value is not None:
                values.append(value)
        return statistics.fmean(values) if values else None

    return {
        "warm_step": s_warm,
        "end_step": s_end,
        "ranks": ranks,
        "mean": {
            "rss_warm_mib": mean("rss", "warm_mib"),
            "rss_end_mib": mean("rss", "end_mib"),
            "rss_growth_mib": mean("rss", "growth_mib"),
            "rss_kib_per_step": mean("rss", "kib_per_step"),
            "in_use_warm_mib": mean("in_use", "warm_mib"),
            "in_use_growth_mib": mean("in_use", "growth_mib"),
            "in_use_kib_per_step": mean("in_use", "kib_per_step"),
            "heap_free_end_mib": mean("heap_free_end_mib"),
        },
    }


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_table(rows: dict[str, dict], differences: dict[str, dict]) -> None:
    header = (
        f"{'run':<20} {'steps':>7} {'RSS warm':>9} {'RSS end':>8} {'growth':>7} "
        f"{'KiB/step':>9} {'in-use warm':>11} {'growth':>7} {'KiB/step':>9} {'heap free':>9}"
    )
    print(
        "memory per worker between steps (lowest sample of each logged interval), MiB, mean "
        "over ranks; KiB/step: least-squares slope"
    )
    print(header)
    print("-" * len(header))
    for label, row in rows.items():
        m = row["mean"]
        print(
            f"{label:<20} {row['warm_step']:>3}-{row['end_step']:<3} "
            f"{m['rss_warm_mib']:9.1f} {m['rss_end_mib']:8.1f} {m['rss_growth_mib']:7.1f} "
            f"{m['rss_kib_per_step']:9.1f} {_fmt(m['in_use_warm_mib'], '11.1f')} "
            f"{_fmt(m['in_use_growth_mib'], '7.1f')} {_fmt(m['in_use_kib_per_step'], '9.1f')} "
            f"{_fmt(m['heap_free_end_mib'], '9.1f')}"
        )
    for label, d in differences.items():
        in_use = _fmt(d["in_use_kib_per_step"], "+.1f")
        print(
            f"{label}: RSS growth {d['rss_growth_mib']:+.1f} MiB "
            f"({d['rss_kib_per_step']:+.1f} KiB/step), in use {in_use} KiB/step"
        )


def plot(raws: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_rss, ax_heap) = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, (label, raw) in enumerate(raws.items()):
        steps = raw["step_times"]
        for ax, per_rank in (
            (ax_rss, raw["rss"]),
            (ax_heap, {r: [(t, u) for t, u, _ in h] for r, h in raw["heap"].items()}),
        ):
            for rank, series in sorted(per_rank.items()):
                floors = _floors(series, steps)
                if floors:
                    ax.plot(
                        [s for s, _ in floors],
                        [v / MiB for _, v in floors],
                        color=f"C{i}",
                        linestyle="-" if rank == 0 else "--",
                        label=f"{label} rank {rank}",
                    )
    ax_rss.set_title("Resident set per worker (between steps)")
    ax_heap.set_title("glibc heap in use per worker (mallinfo2, between steps)")
    for ax in (ax_rss, ax_heap):
        ax.set_xlabel("training step")
        ax.set_ylabel("MiB")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup-step", type=int, default=20)
    parser.add_argument("--interval", type=float, default=0.5, help="seconds between RSS samples")
    parser.add_argument(
        "--heap-interval", type=float, default=0.1, help="seconds between mallinfo2 samples"
    )
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=["adamw", "dmuon_z3"])
    parser.add_argument("--diagnostics", nargs="*", choices=list(DIAGNOSTICS), default=[])
    parser.add_argument("--out", type=Path, default=Path("outputs/bench_memory"))
    args, overrides = parser.parse_known_args()
    args.out.mkdir(parents=True, exist_ok=True)
    inherited = {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")}
    if inherited:
        print(f"note: the caller's environment sets {inherited}; every run inherits it")
    runs = [(mode, mode, ({}, [])) for mode in args.modes]
    runs += [
        (f"{mode} [{diag}]", mode, DIAGNOSTICS[diag])
        for diag in args.diagnostics
        for mode in args.modes
    ]
    raws, rows = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for label, mode, env in runs:
            file_label = re.sub(r"\W+", "_", label).strip("_")
            raws[label] = run(file_label, mode, env, args, overrides, Path(tmp))
            rows[label] = summarize(raws[label], args.warmup_step)
    differences = {}
    for label, row in rows.items():
        mode = next(m for lbl, m, _ in runs if lbl == label)
        reference = label.replace(mode, "adamw", 1)
        if mode == "adamw" or reference not in rows:
            continue
        a, b = rows[reference]["mean"], row["mean"]
        differences[f"{label} - {reference}"] = {
            key: None if a[key] is None or b[key] is None else b[key] - a[key]
            for key in ("rss_growth_mib", "rss_kib_per_step", "in_use_kib_per_step")
        }
    print_table(rows, differences)
    record = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.libc_ver()}",
        "command": " ".join(sys.argv),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "overrides": overrides,
        "inherited_malloc_env": inherited,
        "runs": {
            label: {"env": env, "extra_args": extra, **rows[label]}
            for label, _, (env, extra) in runs
        },
        "differences": differences,
        "samples": {
            label: {
                "step_times": raw["step_times"],
                "rss": raw["rss"],
                "heap": raw["heap"],
            }
            for label, raw in raws.items()
        },
    }
    (args.out / "results.json").write_text(json.dumps(record, indent=1))
    plot(raws, args.out / "memory.png")
    print(f"wrote {args.out / 'results.json'} and {args.out / 'memory.png'}")


if __name__ == "__main__":
    main()
