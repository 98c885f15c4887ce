"""``benchmarks/gpu_lease.sh`` (the one-GPU check, docs/gpu.md) without a GPU: its QUICK
mode end to end, the wheel list and ``scripts/gpu_wheels.sh`` (with a stand-in pip), and
the summary's reading of the steps' outputs."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
LEASE = ROOT / "benchmarks" / "gpu_lease.sh"
GPU_STEPS = [
    "engine", "syncs", "ns", "titan_DMuon", "titan_AdamW", "titan_DMuon_compiled",
    "titan_AdamW_compiled", "titan_DMuon_float8",
]  # fmt: skip


def _module():
    spec = importlib.util.spec_from_file_location("gpu_lease", ROOT / "benchmarks" / "gpu_lease.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gpu_lease = _module()


def fake_wheels(folder: Path, pins: dict[str, str]) -> None:
    """Empty files named as the pinned wheels (the QUICK check reads names only)."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, version in pins.items():
        (folder / f"{name.replace('-', '_')}-{version}-py3-none-any.whl").write_bytes(b"")


def test_quick_mode_checks_itself_and_writes_the_summary(tmp_path):
    """QUICK=1 on this CPU machine: exit 0, three result files (as the device tool brings
    back at most 8 files, 2 folders deep), every step in the JSON and the table, the GPU
    steps skipped after their entries' --help ran. (Its time is the machine's load, not
    asserted.)"""
    wheels, out = tmp_path / "wheels", tmp_path / "out"
    fake_wheels(wheels, gpu_lease.pins())
    env = dict(os.environ, QUICK="1", PYTHON=sys.executable, GPU_WHEELS=str(wheels))
    run = subprocess.run(
        ["bash", str(LEASE), str(out)], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    files = sorted(p.relative_to(out).as_posix() for p in out.rglob("*"))
    assert files == ["gpu_lease.json", "gpu_lease.log", "gpu_lease.md"]
    summary = json.loads((out / "gpu_lease.json").read_text())
    assert summary["quick"] is True and summary["failed"] == []
    status = {s["name"]: s for s in summary["steps"]}
    assert list(status) == gpu_lease.STEPS
    assert status["wheels"]["status"] == "passed"
    assert "11 wheels" in status["wheels"]["figures"]
    assert status["env"]["status"] == "passed"
    assert summary["env"]["imports"]["torchtitan_dmuon.titan.train"]["ok"]
    assert summary["env"]["register"] == "ok"
    for name in GPU_STEPS:
        assert status[name]["status"] == "skipped", status[name]
        assert status[name]["reason"].startswith("no GPU"), status[name]
    table = (out / "gpu_lease.md").read_text()
    assert "| step | status | seconds | figures | error |" in table
    for name in gpu_lease.STEPS:
        assert re.search(rf"^\| {name} \| ", table, re.M), name
    assert "== summary" in (out / "gpu_lease.log").read_text()


def test_usage_errors_exit_2(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    for args in ([], ["--help"], ["a", "b"]):
        run = subprocess.run(
            ["bash", str(LEASE), *args], cwd=tmp_path, env=env, capture_output=True, text=True
        )
        assert run.returncode == 2 and "usage:" in run.stderr, args


def test_wheel_pins_match_the_tested_versions():
    """The carried wheels are the tested versions (scripts/constraints.txt), where it pins
    them, and each is within pyproject.toml's range of it."""
    pinned = {}
    for line in (ROOT / "scripts" / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, version = line.split("==")
            pinned[gpu_lease.normalize(name)] = version
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    ranges = {}
    for requirement in pyproject["project"]["dependencies"]:
        name = re.split(r"[<>=!~; ]", requirement, maxsplit=1)[0]
        ranges[gpu_lease.normalize(name)] = requirement[len(name) :]
    assert set(pinned) <= set(ranges)
    for name, version in pinned.items():
        assert ranges[name].startswith(f">={version}"), (name, ranges[name])
    wheels = gpu_lease.pins()
    assert {"torchtitan", "torchdata", "tyro", "datasets"} <= set(wheels)
    shared = set(wheels) & set(pinned)
    assert {"torchtitan", "torchdata", "torchao", "tomli"} <= shared
    assert {n: wheels[n] for n in shared} == {n: pinned[n] for n in shared}
    assert "torch" not in wheels and "triton" not in wheels  # the machine's own


def test_check_wheels_names_missing_and_unexpected(tmp_path):
    pins = {"torchtitan": "0.2.2", "docstring-parser": "0.18.0"}
    fake_wheels(tmp_path, {"torchtitan": "0.2.1", "docstring-parser": "0.18.0", "x": "1"})
    report = gpu_lease.check_wheels(tmp_path, pins)
    assert report["missing"] == ["torchtitan==0.2.2"]
    assert sorted(report["unexpected"]) == [
        "torchtitan-0.2.1-py3-none-any.whl",
        "x-1-py3-none-any.whl",
    ]
    assert not report["ok"]
    fake_wheels(tmp_path / "good", pins)
    assert gpu_lease.check_wheels(tmp_path / "good", pins)["ok"]


FAKE_PIP = """#!/usr/bin/env bash
# A stand-in for `python -m pip download ... -d DIR NAME==VERSION...`: empty wheels.
dir=""; pins=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    -d) dir="$2"; shift 2 ;;
    *==*) pins+=("$1"); shift ;;
    *) shift ;;
  esac
done
for pin in "${pins[@]}"; do
  name="${pin%%==*}"; : >"$dir/${name//-/_}-${pin#*==}-py3-none-any.whl"
done
"""


def test_gpu_wheels_sh_keeps_exactly_the_pinned_wheels(tmp_path):
    """scripts/gpu_wheels.sh (its pip a stand-in): every pin downloaded, a stale wheel
    removed, the sizes and total printed; over GPU_WHEELS_MAX_MIB it fails."""
    pip = tmp_path / "python"
    pip.write_text(FAKE_PIP)
    pip.chmod(0o755)
    folder = tmp_path / "wheels"
    folder.mkdir()
    (folder / "torchtitan-0.1.0-py3-none-any.whl").write_bytes(b"old")
    env = dict(os.environ, PYTHON=str(pip))
    script = ROOT / "scripts" / "gpu_wheels.sh"
    run = subprocess.run([str(script), str(folder)], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "removing torchtitan-0.1.0-py3-none-any.whl" in run.stdout
    assert gpu_lease.check_wheels(folder, gpu_lease.pins())["ok"]
    assert f"{len(gpu_lease.pins())} wheels" in run.stdout and "MiB" in run.stdout
    over = subprocess.run(
        [str(script), str(folder)], env=dict(env, GPU_WHEELS_MAX_MIB="0"),
        capture_output=True, text=True,
    )  # fmt: skip
    assert over.returncode == 1 and "over 0 MiB" in over.stderr


ROOT_LOG = "[titan] 2026-12-05 00:48:23,489 - root - INFO - "
DMUON_LOG = "[titan] 2026-12-05 00:48:23,489 - torchtitan_dmuon.titan.train - INFO - "
OPTIMIZER = (
    "dmuon: optimizer step {} ms  reduce 0.00 MB/step  broadcast 0.00 MB/step  owner balance 1.000"
)
STEP = "step: {:2}  loss: {:8.5f}  grad_norm: {:7.4f}  memory: {:5.2f}GiB({:.2f}%)  tps: {}  "
TITAN_LOG = "\n".join(
    [
        DMUON_LOG + "dmuon: ns_backend='auto' for torch.bfloat16 on 1 rank(s): 2048x2048 triton",
        DMUON_LOG + OPTIMIZER.format(30.0),
        ROOT_LOG
        + STEP.format(1, 8.19936, 1.2426, 20.73, 14.59, "1,200")
        + "tflops: 9.00  mfu: 0.91%",
        DMUON_LOG + OPTIMIZER.format(10.0),
        ROOT_LOG + STEP.format(2, 7.5, 1.0, 22.10, 15.54, "50,000") + "tflops: 370.00  mfu: 37.41%",
        DMUON_LOG + OPTIMIZER.format(12.0),
        ROOT_LOG + STEP.format(3, 7.0, 0.9, 22.10, 15.54, "52,000") + "tflops: 380.00  mfu: 38.42%",
        "gpu_lease: peak allocated 18.50 GiB, peak reserved 22.25 GiB",
    ]
)


def test_summary_reads_the_steps(tmp_path):
    """A TorchTitan step's figures from its log (rates after the first third of the
    steps), and a timed-out step's last error line."""
    work, out = tmp_path / "work", tmp_path / "out"
    (work / "steps").mkdir(parents=True)
    (work / "logs").mkdir()
    status = "status={}\nrc={}\nseconds={}\nlimit={}\nreason=\n"
    (work / "steps" / "titan_DMuon.status").write_text(status.format("passed", 0, 80, 170))
    (work / "logs" / "titan_DMuon.log").write_text(TITAN_LOG)
    (work / "steps" / "engine.status").write_text(status.format("timeout", 124, 150, 150))
    (work / "logs" / "engine.log").write_text("Traceback\nRuntimeError: gloo refused\nwaiting\n")
    args = type("Args", (), dict(work=work, out=out, quick=False, elapsed=230, budget=540))
    assert gpu_lease.cmd_summary(args) == 1
    summary = json.loads((out / "gpu_lease.json").read_text())
    assert summary["failed"] == ["engine"]
    engine, titan = summary["steps"]
    assert engine["error"] == "timed out after 150 s; last: RuntimeError: gloo refused"
    figures = summary["titan"]["DMuon"]
    assert figures["steps"] == 3 and figures["final_loss"] == 7.0
    assert figures["tps"] == 51_000 and figures["mfu"] == pytest.approx(37.915)
    assert figures["optimizer_step_ms"] == 11.0
    assert figures["peak_reserved_gib"] == 22.25 and figures["max_reserved_gib"] == 22.1
    assert figures["dmuon_lines"][0].startswith("dmuon: ns_backend='auto'")
    assert "51,000 tok/s" in titan["figures"] and "MFU 37.9%" in titan["figures"]
    assert "| engine | timeout |" in (out / "gpu_lease.md").read_text()


def test_what_this_torch_cannot_run_is_unsupported_not_failed(tmp_path):
    """torch 2.11 (the GPU machine's) has no FSDP2 reset_iter_state, and triton 3.6's
    interpreter cannot run the kernels with numpy 2.4: cases recorded unsupported, with
    why, count as neither passed nor failed."""
    work, out = tmp_path / "work", tmp_path / "out"
    (work / "steps").mkdir(parents=True)
    (work / "ns").mkdir()
    status = "status=passed\nrc=0\nseconds=9\nlimit=120\nreason=\n"
    for name in ("engine", "ns"):
        (work / "steps" / f"{name}.status").write_text(status)
    why = "FSDP2 in torch 2.11.0 has no FSDPModule.reset_iter_state (2.13)"
    engine = {"cases": [
        {"case": "gloo1_fsdp_z3", "world": 1, "ok": True, "loss_diff": 0.0},
        {"case": "gloo1_failed_backward_recovery", "world": 1, "ok": None, "unsupported": why},
    ]}  # fmt: skip
    (work / "engine.json").write_text(json.dumps(engine))
    ns = {"records": [
        {"preset": "quintic", "shape": [64, 128], "mode": "bf16", "backend": "torch",
         "ok": True, "rel_err": 0.01, "ms": 1.0, "speedup_vs_torch": 1.0},
        {"preset": "quintic", "shape": [64, 128], "mode": "bf16", "backend": "triton",
         "ok": None, "unsupported": "triton 3.6.0's interpreter with numpy 2.4.6: ..."},
    ]}  # fmt: skip
    (work / "ns" / "ns.json").write_text(json.dumps(ns))
    args = type("Args", (), dict(work=work, out=out, quick=False, elapsed=30, budget=420))
    assert gpu_lease.cmd_summary(args) == 0
    summary = json.loads((out / "gpu_lease.json").read_text())
    figures = {s["name"]: s["figures"] for s in summary["steps"]}
    assert figures["engine"].startswith("1/1 ok, 1 unsupported here")
    assert figures["ns"].startswith("1/1 ok, 1 unsupported here")
    table = (out / "gpu_lease.md").read_text()
    assert why in table and "triton 3.6.0's interpreter" in table
