"""The one Python entry of ``benchmarks/gpu_lease.sh``: every step it runs is a command here.

    python benchmarks/gpu_lease.py wheels --dir .gpu_wheels [--install SITE]
    python benchmarks/gpu_lease.py env --out env.json [--site SITE]
    python benchmarks/gpu_lease.py engine|syncs ARGS...   # benchmarks/gpu_engine_check.py
    python benchmarks/gpu_lease.py ns ARGS...             # benchmarks/gpu_ns_check.py
    python benchmarks/gpu_lease.py titan ARGS...          # benchmarks/gpu_titan_check.py
    python benchmarks/gpu_lease.py summary --work WORK --out OUT [--quick]

The GPU checks live in a module each (``ARGS --help`` lists a check's arguments).

``wheels`` checks that the folder holds exactly the wheels of ``scripts/gpu_wheels.txt``
(one per pin) and, with ``--install``, installs them with ``pip install --no-index
--no-deps --target SITE``. ``env`` records the machine (GPU, Python, torch, triton), the
version and origin of every package the steps need, and whether each step's imports
work; it exits 1 when torch cannot be imported. ``summary`` reads what the steps left in
WORK (``steps/NAME.status``, ``logs/NAME.log`` and their JSON) and writes
``gpu_lease.json`` and ``gpu_lease.md`` (a table: each step's status, figures and error)
into OUT. Only the standard library is imported at the top: ``summary`` works where torch
does not.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WHEEL_LIST = ROOT / "scripts" / "gpu_wheels.txt"
STEPS = [
    "wheels", "assets", "env", "engine", "syncs", "ns", "titan_DMuon", "titan_AdamW",
    "titan_DMuon_compiled", "titan_AdamW_compiled", "titan_DMuon_float8",
]  # fmt: skip
"""gpu_lease.sh's steps, in the order it runs them."""
PROVIDED = [
    "numpy", "safetensors", "tokenizers", "tensorboard", "einops", "pillow", "pyarrow",
    "pandas", "xxhash", "requests", "httpx", "tqdm", "pyyaml", "huggingface-hub",
    "typing-extensions", "rich", "aiohttp", "transformers",
]  # fmt: skip
"""Packages the steps use that the GPU machine's image is expected to provide."""
IMPORTS = [
    "torch", "triton", "torchtitan", "torchdata", "datasets", "tyro", "torchao",
    "torchtitan.train", "torchtitan.models.llama3", "torchtitan_dmuon",
    "torchtitan_dmuon.titan.train", "tests.support.workers",
]  # fmt: skip
"""What the steps import, checked one by one in the order a failure would show."""
CHECKS = {
    "engine": ("gpu_engine_check", ["engine"], "the engine on one GPU"),
    "syncs": ("gpu_engine_check", ["syncs"], "host syncs per step"),
    "ns": ("gpu_ns_check", [], "the Newton-Schulz backends"),
    "titan": ("gpu_titan_check", [], "TorchTitan on one GPU, one optimizer"),
}
"""The GPU steps' commands: (module in benchmarks/, leading arguments, help)."""
SHADOWING = ("test",)
"""Top-level folders a wheel ships that would shadow the standard library on PYTHONPATH
(torchao's wheel carries its tests as a package ``test``): removed after installing."""


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(path: Path = WHEEL_LIST) -> dict[str, str]:
    """``{normalized name: version}`` of the wheel list."""
    out = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            out[normalize(name)] = version
    return out


def check_wheels(folder: Path, wanted: dict[str, str]) -> dict:
    """The wheels of ``folder`` against the pins: missing, unexpected, sizes."""
    found = {}
    for wheel in sorted(folder.glob("*.whl")):
        name, version = wheel.name.split("-")[:2]
        found.setdefault(normalize(name), []).append((version, wheel))
    missing = [f"{n}=={v}" for n, v in wanted.items() if v not in [f[0] for f in found.get(n, [])]]
    extra = [
        w.name for n, versions in found.items() for v, w in versions if wanted.get(n) != v
    ]  # fmt: skip
    sizes = {w.name: w.stat().st_size for versions in found.values() for _, w in versions}
    return {
        "folder": str(folder),
        "wheels": sorted(sizes),
        "bytes": sum(sizes.values()),
        "missing": missing,
        "unexpected": extra,
        "ok": not missing and not extra,
    }


def cmd_wheels(args: argparse.Namespace) -> int:
    if not args.dir.is_dir():
        print(
            f"gpu_lease: no wheel folder {args.dir}: run scripts/gpu_wheels.sh on a machine "
            "with PyPI and carry it (the device tool's carry: ['.gpu_wheels'])",
            file=sys.stderr,
        )
        return 1
    report = check_wheels(args.dir, pins(args.list))
    print(
        f"gpu_lease: {len(report['wheels'])} wheels, {report['bytes'] / 2**20:.2f} MiB in "
        f"{args.dir}; missing {report['missing'] or 'none'}, unexpected "
        f"{report['unexpected'] or 'none'}",
        flush=True,
    )
    if not report["ok"]:
        return 1
    if args.install:
        wheels = [str(args.dir / w) for w in report["wheels"]]
        command = [
            sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check",
            "--no-index", "--no-deps", "--no-compile", "--no-cache-dir", "--upgrade",
            "--target", str(args.install), *wheels,
        ]  # fmt: skip
        print("gpu_lease: " + " ".join(command[:13]) + " ...", flush=True)
        done = subprocess.run(command)
        if done.returncode != 0:
            return done.returncode
        for name in SHADOWING:
            shutil.rmtree(args.install / name, ignore_errors=True)
        print(f"gpu_lease: installed into {args.install}", flush=True)
    return 0


# ---- env -----------------------------------------------------------------------------


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _origin(module: str, site: Path | None) -> str | None:
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None or spec.origin is None:
        return None
    if site is not None and spec.origin.startswith(str(site)):
        return "carried"
    return "repo" if spec.origin.startswith(str(ROOT)) else "machine"


def _nvidia_smi() -> str | None:
    if shutil.which("nvidia-smi") is None:
        return None
    done = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
    return done.stdout.strip() or done.stderr.strip()


def cmd_env(args: argparse.Namespace) -> int:
    env = {
        "python": sys.version.split()[0],
        "executable": sys.executable,
        "platform": platform.platform(),
        "nvidia_smi": _nvidia_smi(),
        "pythonpath": os.environ.get("PYTHONPATH", ""),
        "carried": {n: _version(n) for n in pins(args.list)},
        "provided": {n: _version(n) for n in PROVIDED},
        "imports": {},
        "cuda": False,
    }
    for module in IMPORTS:
        started = time.monotonic()
        try:
            importlib.import_module(module)
            outcome = {"ok": True, "origin": _origin(module, args.site)}
        except BaseException as error:  # noqa: BLE001 - a missing package, an old torch...
            outcome = {"ok": False, "error": f"{type(error).__name__}: {error}"[:400]}
        outcome["seconds"] = round(time.monotonic() - started, 2)
        env["imports"][module] = outcome
        print(f"gpu_lease: import {module}: {outcome}", flush=True)
    if env["imports"]["torchtitan_dmuon.titan.train"]["ok"]:
        try:
            from torchtitan_dmuon.titan import register

            register()
            env["register"] = "ok"
        except Exception as error:  # noqa: BLE001
            env["register"] = f"{type(error).__name__}: {error}"[:400]
    if env["imports"]["torch"]["ok"]:
        import torch

        env["torch"] = torch.__version__
        env["torch_cuda"] = torch.version.cuda
        env["cuda"] = torch.cuda.is_available()
        if env["cuda"]:
            props = torch.cuda.get_device_properties(0)
            env["device"] = torch.cuda.get_device_name(0)
            env["capability"] = list(torch.cuda.get_device_capability(0))
            env["memory_gib"] = round(props.total_memory / 2**30, 1)
            env["devices"] = torch.cuda.device_count()
            env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    if env["imports"]["triton"]["ok"]:
        import triton

        env["triton"] = triton.__version__
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(env, indent=1))
    shown = {k: env.get(k) for k in ("python", "torch", "triton", "cuda", "device", "register")}
    print(f"gpu_lease: {shown}", flush=True)
    return 0 if env["imports"]["torch"]["ok"] else 1


# ---- summary -------------------------------------------------------------------------

TITAN_STEP = re.compile(
    r"step:\s*(\d+)\s+loss:\s*([\d.naninf]+)\s+grad_norm:\s*([\d.naninf]+)\s+"
    r"memory:\s*([\d.]+)GiB\(([\d.]+)%\)\s+tps:\s*([\d,]+)\s+tflops:\s*([\d,.]+)\s+"
    r"mfu:\s*([\d.]+)%"
)
TITAN_PEAK = re.compile(r"gpu_lease: peak allocated ([\d.]+) GiB, peak reserved ([\d.]+) GiB")
OPTIMIZER_MS = re.compile(r"dmuon: optimizer step ([\d.]+) ms")
ERROR_LINE = re.compile(r"\b\w*(Error|Exception|error)\b:")


def read_status(path: Path) -> dict:
    fields = {}
    for line in path.read_text().splitlines():
        key, _, value = line.partition("=")
        fields[key] = value
    for key in ("rc", "seconds", "limit"):
        if fields.get(key, "") not in ("", None):
            fields[key] = int(fields[key])
    return fields


def last_error(log: Path) -> str | None:
    """The last error line of a step's log (its exception), else its last line."""
    if not log.exists():
        return None
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    errors = [line for line in lines if ERROR_LINE.search(line) and "Traceback" not in line]
    found = errors[-1] if errors else (lines[-1] if lines else None)
    return found[:400] if found else None


def load_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def titan_figures(log: Path) -> dict | None:
    """Loss, tokens/s, TFLOP/s, MFU and memory of a TorchTitan run's log; rates are the
    medians of the steps after the first third (compilation, warm-up)."""
    if not log.exists():
        return None
    text = log.read_text(errors="replace")
    steps = {}
    for m in TITAN_STEP.finditer(text):
        steps[int(m.group(1))] = {
            "loss": float(m.group(2)),
            "grad_norm": float(m.group(3)),
            "memory_gib": float(m.group(4)),
            "memory_pct": float(m.group(5)),
            "tps": float(m.group(6).replace(",", "")),
            "tflops": float(m.group(7).replace(",", "")),
            "mfu": float(m.group(8)),
        }
    dmuon = [line.split(" - INFO - ", 1)[-1] for line in text.splitlines() if "dmuon:" in line]
    optimizer_ms = [float(x) for x in OPTIMIZER_MS.findall(text)]
    out: dict = {"steps": len(steps)}
    if steps:
        order = sorted(steps)
        steady = [steps[s] for s in order[len(order) // 3 :]] or [steps[order[-1]]]
        out.update(
            first_loss=steps[order[0]]["loss"],
            final_loss=steps[order[-1]]["loss"],
            losses=[steps[s]["loss"] for s in order],
            tps=statistics.median(s["tps"] for s in steady),
            tflops=statistics.median(s["tflops"] for s in steady),
            mfu=statistics.median(s["mfu"] for s in steady),
            max_reserved_gib=max(s["memory_gib"] for s in steps.values()),
            max_reserved_pct=max(s["memory_pct"] for s in steps.values()),
        )
    if optimizer_ms:
        steady_ms = optimizer_ms[len(optimizer_ms) // 3 :] or optimizer_ms
        out["optimizer_step_ms"] = statistics.median(steady_ms)
    if peak := TITAN_PEAK.search(text):
        out["peak_allocated_gib"], out["peak_reserved_gib"] = map(float, peak.groups())
    other = [line for line in dmuon if "optimizer step" not in line]
    out["dmuon_lines"] = (
        list(dict.fromkeys(other))[:12] + [line for line in dmuon if "optimizer step" in line][-2:]
    )
    return out


def _fmt(x, digits=2) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def _verdicts(rows: list[dict]) -> str:
    """ "P/N ok" of rows whose ``ok`` is True, False or None (unsupported on this torch or
    triton: not a failure), with the unsupported and failed ones counted."""
    judged = [r for r in rows if r.get("ok") is not None]
    text = f"{sum(bool(r['ok']) for r in judged)}/{len(judged)} ok"
    if unsupported := len(rows) - len(judged):
        text += f", {unsupported} unsupported here"
    return text


def ns_figures(ns: dict) -> str:
    records = ns.get("records", [])
    best = {}
    for t in records:
        key = ("x".join(map(str, t.get("shape", []))), t.get("mode"))
        if "ms" in t and t["backend"] != "torch" and (key not in best or t["ms"] < best[key]["ms"]):
            best[key] = t
    parts = [
        f"{shape} {mode}: {t['backend']} x{t['speedup_vs_torch']:.2f}"
        for (shape, mode), t in best.items()
        if t.get("speedup_vs_torch")
    ]
    worst = max((c["rel_err"] for c in records if "rel_err" in c), default=None)
    return (
        f"{_verdicts(records)}, max rel.err {_fmt(worst, 4)}; "
        f"fastest vs torch: {'; '.join(parts) or '-'}"
    )


def engine_figures(engine: dict) -> str:
    cases = engine.get("cases", [])
    failed = [c["case"] for c in cases if c["ok"] is False]
    text = f"{_verdicts(cases)}: cases against torch.optim.Muon"
    return text + (f"; failed: {', '.join(failed)}" if failed else "")


def syncs_figures(syncs: dict) -> str:
    parts = []
    for mode, r in syncs.get("modes", {}).items():
        if "per_step" in r:
            phases = "/".join(_fmt(r["per_step"].get(p, 0), 1) for p in PHASES)
            parts.append(f"{mode} {phases}")
        else:
            parts.append(f"{mode} error")
    return "syncs per step (fwd/bwd/step/zero_grad): " + "; ".join(parts)


PHASES = ("forward", "backward", "step", "zero_grad")


def titan_text(t: dict) -> str:
    if not t.get("steps"):
        return "no step logged"
    return (
        f"{t['steps']} steps, loss {t['first_loss']:.3f} -> {t['final_loss']:.3f}, "
        f"{t['tps']:,.0f} tok/s, {t['tflops']:.0f} TFLOP/s, MFU {t['mfu']:.1f}%, "
        f"peak {t.get('peak_reserved_gib', t['max_reserved_gib']):.1f} GiB reserved"
        + (f", optimizer step {t['optimizer_step_ms']:.1f} ms" if "optimizer_step_ms" in t else "")
    )


def cmd_summary(args: argparse.Namespace) -> int:
    work, out = args.work, args.out
    steps = []
    results: dict = {}
    for name in STEPS:
        status_file = work / "steps" / f"{name}.status"
        if not status_file.exists():
            continue
        step = {"name": name, **read_status(status_file)}
        log = work / "logs" / f"{name}.log"
        if step["status"] in ("failed", "timeout"):
            step["error"] = last_error(log)
            if step["status"] == "timeout":
                step["error"] = f"timed out after {step.get('limit')} s; last: {step['error']}"
        figures = None
        if name == "wheels" and log.exists():
            found = re.search(r"gpu_lease: (\d+ wheels, .*)", log.read_text(errors="replace"))
            figures = found.group(1) if found else None
        elif name == "env" and (env := load_json(work / "env.json")):
            results["env"] = env
            figures = ", ".join(
                f"{k} {env[k]}" for k in ("device", "torch", "triton", "nccl") if env.get(k)
            )
            failed = [m for m, r in env.get("imports", {}).items() if not r["ok"]]
            if failed:
                figures += f"; imports failing: {', '.join(failed)}"
        elif name == "ns" and (ns := load_json(work / "ns" / "ns.json")):
            results["ns"] = ns
            figures = ns_figures(ns)
        elif name == "engine" and (engine := load_json(work / "engine.json")):
            results["engine"] = engine
            figures = engine_figures(engine)
        elif name == "syncs" and (syncs := load_json(work / "syncs.json")):
            results["syncs"] = syncs
            figures = syncs_figures(syncs)
        elif (
            name.startswith("titan_")
            and step["status"] != "skipped"
            and (titan := titan_figures(log))
        ):
            results.setdefault("titan", {})[name.removeprefix("titan_")] = titan
            figures = titan_text(titan)
        step["figures"] = figures
        steps.append(step)
    failed = [s["name"] for s in steps if s["status"] in ("failed", "timeout")]
    summary = {
        "quick": args.quick,
        "written": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "elapsed_s": args.elapsed,
        "budget_s": args.budget,
        "steps": steps,
        "failed": failed,
        **results,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_lease.json").write_text(json.dumps(summary, indent=1, default=str))
    table = markdown(summary)
    (out / "gpu_lease.md").write_text(table)
    print(table)
    return 1 if failed else 0


def _cell(text) -> str:
    return "" if text is None else str(text).replace("|", "\\|").replace("\n", " ")


def markdown(summary: dict) -> str:
    env = summary.get("env", {})
    machine = env.get("device") or ("no GPU" if env else "unknown machine")
    lines = [
        f"# GPU lease check ({'QUICK: no GPU run' if summary['quick'] else machine})",
        "",
        f"Written {summary['written']}, {summary['elapsed_s']} s of a {summary['budget_s']} s "
        f"budget; torch {env.get('torch', '-')}, triton {env.get('triton', '-')}, "
        f"Python {env.get('python', '-')}.",
        "",
        "| step | status | seconds | figures | error |",
        "| --- | --- | --- | --- | --- |",
    ]
    for s in summary["steps"]:
        status = s["status"] + (f": {s['reason']}" if s.get("reason") else "")
        lines.append(
            f"| {s['name']} | {_cell(status)} | {s.get('seconds', '')} | "
            f"{_cell(s.get('figures'))} | {_cell(s.get('error'))} |"
        )
    if ns := summary.get("ns"):
        lines += ["", "## Newton-Schulz backends (on a GPU: Llama-3 8B's shapes)", ""]
        lines += [
            "| shape | mode | backend | first call s | ms | TFLOP/s | x torch | rel.err | ok |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for t in ns.get("records", []):
            shape = "x".join(map(str, t.get("shape", [])))
            backend = t.get("backend", t.get("check", "")) + (
                f" ({t['picked']})" if t.get("picked") else ""
            )
            verdict = t.get("error") or t.get("unsupported") or t.get("ok")
            lines.append(
                f"| {shape} | {t.get('mode', '')} | {backend} | {_fmt(t.get('first_call_s'))} | "
                f"{_fmt(t.get('ms'), 3)} | {_fmt(t.get('tflops'), 1)} | "
                f"{_fmt(t.get('speedup_vs_torch'))} | {_fmt(t.get('rel_err'), 4)} | "
                f"{_cell(verdict)} |"
            )
    if engine := summary.get("engine"):
        lines += ["", "## The engine against one-process torch.optim.Muon", ""]
        lines += [
            "| case | world | ok | loss diff | max param diff (atol) | error or why not run |"
        ]
        lines += ["| --- | --- | --- | --- | --- | --- |"]
        for c in engine.get("cases", []):
            error = c.get("error") or c.get("unsupported") or "; ".join(c.get("problems", []))
            if c.get("plan_report_errors"):
                error += f" (plan_report: {c['plan_report_errors'][0]})"
            lines.append(
                f"| {c['case']} | {c['world']} | {c['ok']} | {_fmt(c.get('loss_diff'), 7)} | "
                f"{_fmt(c.get('param_max_abs_diff'), 7)} ({_fmt(c.get('param_atol'), 5)}) | "
                f"{_cell(error)} |"
            )
    if syncs := summary.get("syncs"):
        lines += ["", "## Host syncs per step (torch.cuda.set_sync_debug_mode)", ""]
        lines += ["| mode | forward | backward | step | zero_grad | where |"]
        lines += ["| --- | --- | --- | --- | --- | --- |"]
        for mode, r in syncs.get("modes", {}).items():
            if "per_step" not in r:
                lines.append(f"| {mode} | | | | | {_cell(r.get('error'))} |")
                continue
            where = "; ".join(f"{k} x{v}" for c in r["where"].values() for k, v in c.items())
            counts = " | ".join(_fmt(r["per_step"].get(p, 0), 1) for p in PHASES)
            lines.append(f"| {mode} | {counts} | {_cell(where)} |")
    if titan := summary.get("titan"):
        lines += ["", "## TorchTitan, ~1B llama3 on one GPU", ""]
        for optimizer, t in titan.items():
            lines.append(f"- {optimizer}: {titan_text(t)}")
            lines += [f"  - `{line}`" for line in t.get("dmuon_lines", [])]
    return "\n".join(lines) + "\n"


def run_check(command: str, argv: list[str]) -> int:
    """A GPU step: its module's ``main``, imported only now (it imports torch)."""
    module, leading, _ = CHECKS[command]
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    return importlib.import_module(module).main([*leading, *argv])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (_, _, helptext) in CHECKS.items():  # their arguments are their modules'
        sub.add_parser(name, help=helptext, add_help=False)
    wheels = sub.add_parser("wheels", help="check (and install) the carried wheels")
    wheels.add_argument("--dir", type=Path, default=ROOT / ".gpu_wheels")
    wheels.add_argument("--list", type=Path, default=WHEEL_LIST)
    wheels.add_argument("--install", type=Path, help="pip install --target this folder")
    env = sub.add_parser("env", help="the machine and the steps' imports")
    env.add_argument("--out", type=Path, required=True)
    env.add_argument("--site", type=Path, help="where the wheels were installed")
    env.add_argument("--list", type=Path, default=WHEEL_LIST)
    summary = sub.add_parser("summary", help="gpu_lease.json and gpu_lease.md")
    summary.add_argument("--work", type=Path, required=True)
    summary.add_argument("--out", type=Path, required=True)
    summary.add_argument("--quick", action="store_true")
    summary.add_argument("--elapsed", type=int)
    summary.add_argument("--budget", type=int)
    args, rest = parser.parse_known_args()
    if args.command in CHECKS:
        return run_check(args.command, rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return {"wheels": cmd_wheels, "env": cmd_env, "summary": cmd_summary}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
