"""DMuon against TorchTitan 0.3's own DistMuon, inside 0.3's own trainer.

The same model (TorchTitan's debug llama3 with separate q, k, v projections: DistMuon has
no layout that runs Muon on the three matrices of a fused projection), data (the offline
corpus of ``scripts/setup.sh``), math (Muon on every block matrix: lr 0.02, momentum 0.95,
Nesterov, weight decay 0.1, Newton-Schulz in bf16; AdamW lr 3e-3 on the rest, foreach on
both sides) and ranks (FSDP2 Z3 on gloo), each side through TorchTitan's ``torchtitan.train``
(DistMuon as the Kimi recipe configures it: every matrix ``Owned``, one bucket per layer).
Each run is a fresh ``torchrun``; the two sides take turns, ``--rounds`` times. Per rank
and step it records the step's wall time, forward and backward's, the optimizer step's
(``optimizers.step()``), the bytes the rank received in collectives (FSDP2's, the
engine's, DistMuon's all-to-alls: at the least, whatever the algorithm: ``_received``),
and at the end its peak resident memory; the table
takes the slowest rank of each step, the median over steps after ``--warmup``, the median
over rounds.

Run it in TorchTitan 0.3's venv (``TORCHTITAN_VERSION=0.3.0 ./scripts/setup.sh``):

    .venvs/torchtitan-0.3.0/bin/python benchmarks/bench_titan03.py --nproc 2 4 --out DIR

It prints the table (markdown) and writes ``DIR/bench_titan03.json``. Each process of a run
imports this file as the config module (``--module bench_titan03``).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import inspect
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
import types
import zlib
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
# Each collective a step may enter, and the argument holding its payload (FSDP2 of torch
# 2.14 gathers and reduce-scatters through the *_single names).
COLLECTIVES = {
    "all_gather_single": "input_tensor",
    "all_gather_into_tensor": "input_tensor",
    "reduce_scatter_single": "input",
    "reduce_scatter_tensor": "input",
    "all_to_all_single": "output",
    "all_reduce": "tensor",
    "broadcast": "tensor",
    "reduce": "tensor",
    "all_gather": "tensor",
}


def _received(name: str, arguments: dict, payload: torch.Tensor) -> int:
    """The bytes a rank must receive at the least in one collective of ``world`` ranks,
    whatever its algorithm: an all-gather the others' ``world - 1`` inputs, a
    reduce-scatter the others' parts of its output, an all-reduce both, an all-to-all the
    ``(world - 1) / world`` of its output the others send, a broadcast the tensor on the
    ranks but the root, a reduce the tensor (of partial sums) on the root."""
    group = arguments.get("group")
    world, me = dist.get_world_size(group), dist.get_rank(group)
    size = payload.numel() * payload.element_size()
    if name.startswith("all_gather"):
        return size * (world - 1)
    if name.startswith("reduce_scatter") or name == "all_to_all_single":
        return size * (world - 1) // world
    if name == "all_reduce":
        return 2 * size * (world - 1) // world
    root = arguments.get("group_src" if name == "broadcast" else "group_dst")
    if root is None:
        root = arguments.get("src" if name == "broadcast" else "dst", 0)
        root = dist.get_group_rank(group, root) if group is not None else root
    return size if (me == root) == (name == "reduce") else 0


MUON = dict(lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.1, ns_steps=5)
ADAMW = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)


# ---- the config module both sides' processes import ----------------------------------


def _unfused(config):
    """The debug llama3 with separate q, k, v projections (TorchTitan's own init)."""
    from torchtitan.models.common.attention import FusedQKVLinear, QKVLinear
    from torchtitan.models.common.linear import Linear

    init = {"weight": functools.partial(nn.init.trunc_normal_, std=0.02), "bias": nn.init.zeros_}
    for _, fused, parent, attr in config.model_spec.model.traverse(FusedQKVLinear.Config):
        dim, hd = fused.wqkv.in_features, fused.head_dim
        qkv = QKVLinear.Config(
            head_dim=hd,
            wq=Linear.Config(in_features=dim, out_features=fused.n_heads * hd, param_init=init),
            wkv=Linear.Config(in_features=dim, out_features=fused.n_kv_heads * hd, param_init=init),
        )
        setattr(parent, attr, qkv)
    return config


def _base():
    from torchtitan_dmuon.titan03.config_registry import llama3_debug_cpu

    config = _unfused(llama3_debug_cpu())
    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    values["metrics"].log_freq = 1
    return values


def dmuon():
    """DMuon's side: ``llama3_debug_cpu`` unfused, bf16 Newton-Schulz, foreach AdamW."""
    values = _base()
    values["dmuon"] = dataclasses.replace(
        values["dmuon"],
        lr=MUON["lr"],
        weight_decay=MUON["weight_decay"],
        momentum=MUON["momentum"],
        nesterov=MUON["nesterov"],
        ns_steps=MUON["ns_steps"],
        ns_dtype="bfloat16",
    )
    optimizer = values["optimizer"]
    optimizer.lr, optimizer.eps, optimizer.weight_decay = ADAMW["lr"], ADAMW["eps"], 0.0
    optimizer.beta1, optimizer.beta2 = ADAMW["betas"]
    optimizer.implementation = "foreach"
    return TimedDMuonTrainer.Config(**values)


def distmuon():
    """DistMuon's side: the same config, TorchTitan's trainer and optimizer container."""
    from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig
    from torchtitan.distributed.flex_shard.optimizer_reshard import (
        BucketConfig,
        ComputeLayout,
        Owned,
    )

    values = _base()
    del values["dmuon"]
    with torch.device("meta"):
        model = values["model_spec"].model.build()
    matrices = [n for n, p in model.named_parameters() if p.ndim == 2 and n.startswith("layers.")]
    owned = ComputeLayout(shardings_by_mesh_axis={"dp_shard": Owned()})
    layers = sorted({n.split(".")[1] for n in matrices}, key=int)
    values["optimizer"] = OptimizersContainer.Config(
        implementation="foreach",
        param_groups=[
            ParamGroupConfig(
                pattern=r"^layers\.\d+\.(attention\.(qkv_linear\.w[qkv]|wo)|feed_forward\.w[123])\.weight$",
                optimizer_name="DistMuon",
                optimizer_kwargs={**MUON, "foreach": False, "adjust_lr_fn": "original"},
            ),
            ParamGroupConfig(pattern=r".*", optimizer_name="AdamW", optimizer_kwargs=ADAMW),
        ],
        optimizer_factory_kwargs_by_name={
            "DistMuon": {
                "compute_sharding_by_fqn": {n: owned for n in matrices},
                "bucket_configs": tuple(
                    BucketConfig(
                        name=f"layers.{i}",
                        patterns=tuple(n for n in matrices if n.split(".")[1] == i),
                    )
                    for i in layers
                ),
            }
        },
    )
    return TimedTrainer.Config(**values)


def _initial_value(name: str, shape: torch.Size) -> torch.Tensor:
    """The same initial value on both sides: drawn from a generator seeded by the name
    (each side's own initialization differs: DMuon initializes its matrices as plain
    tensors, FSDP2's DTensors draw from DTensor's generator)."""
    generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    if len(shape) == 1:  # the norms
        return torch.ones(shape)
    std = 1.0 if "embeddings" in name else shape[-1] ** -0.5 if "lm_head" in name else 0.02
    return torch.randn(shape, generator=generator) * std


@torch.no_grad()
def _same_init(model: nn.Module) -> None:
    """Every parameter of ``model`` (FSDP2's shards, DMuon's owned matrices) set to
    :func:`_initial_value`."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    from torchtitan_dmuon import get_dedication

    dedication = get_dedication(model)
    dedicated = set()
    if dedication is not None:
        dedication.lazy_init()
        for entry, master in dedication.primary_params():
            master.copy_(_initial_value(entry.name, entry.param.shape))
        dedication.refresh_from_masters()
        dedicated = {d.name for d in dedication.plan.params}
    for name, param in model.named_parameters():
        if name in dedicated:
            continue
        value = _initial_value(name, param.shape)
        if isinstance(param, DTensor):
            value = distribute_tensor(value, param.device_mesh, param.placements).to_local()
            param.to_local().copy_(value)
        else:
            param.copy_(value)


class _Timing:
    """Per step: wall time, optimizer step, collective bytes; at the end, peak RSS."""

    def _start_timing(self, record_to: str) -> None:
        _same_init(self.model_parts[0])
        self._record_to = record_to
        self._rows: list[dict] = []
        self._bytes = 0
        step = self.optimizers.step

        def timed_step(*args, **kwargs):
            start = time.perf_counter()
            result = step(*args, **kwargs)
            self._optimizer_seconds = time.perf_counter() - start
            return result

        self.optimizers.step = timed_step
        for name, sent in COLLECTIVES.items():
            original = getattr(dist, name)
            signature = inspect.signature(original)

            def counted(
                *args, _name=name, _original=original, _signature=signature, _sent=sent, **kwargs
            ):
                arguments = _signature.bind(*args, **kwargs).arguments
                self._bytes += _received(_name, arguments, arguments[_sent])
                return _original(*args, **kwargs)

            setattr(dist, name, counted)

    def forward_backward_step(self, **kwargs):
        start = time.perf_counter()
        result = super().forward_backward_step(**kwargs)
        self._forward_backward_seconds += time.perf_counter() - start
        return result

    def train_step(self, data_iterator):
        self._bytes, start = 0, time.perf_counter()
        self._forward_backward_seconds = 0.0
        result = super().train_step(data_iterator)
        self._rows.append(
            dict(
                step=self.step,
                step_ms=1e3 * (time.perf_counter() - start),
                forward_backward_ms=1e3 * self._forward_backward_seconds,
                optimizer_ms=1e3 * self._optimizer_seconds,
                bytes=self._bytes,
            )
        )
        return result

    def _write(self) -> None:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        path = Path(self._record_to) / f"rank{dist.get_rank()}.json"
        path.write_text(json.dumps({"steps": self._rows, "peak_rss": peak}))


try:  # the classes exist only where TorchTitan 0.3 is installed (the runs' processes)
    from torchtitan.trainer import Trainer

    from torchtitan_dmuon.titan.patches import PatchRegistry
    from torchtitan_dmuon.titan03.cpu import enable_cpu_support
    from torchtitan_dmuon.titan03.trainer import DMuonTrainer

    def _storage_device(optimizer) -> torch.device:
        """DistMuon's check of its parameters' storage, but for the device type: it refuses
        any but CUDA at construction, and runs on the CPU (its collectives on gloo, its
        streams and events the CPU's no-op ones, below) with nothing else changed."""
        devices = {p.to_local().device for g in optimizer.param_groups for p in g["params"]}
        if len(devices) != 1:
            raise ValueError("DistMuon requires one device per process")
        return devices.pop()

    class _CpuEvent:
        """What DistMuon's runtime does with an event; on the CPU every operation has
        finished when the next one starts."""

        def record(self, stream=None) -> None:
            pass

        def wait(self, stream=None) -> None:
            pass

        def synchronize(self) -> None:
            pass

    _CPU_HANDLE = types.SimpleNamespace(
        Stream=lambda device=None, priority=0: torch.cpu.Stream(),
        Event=lambda *args, **kwargs: _CpuEvent(),
        stream=torch.cpu.stream,
        current_stream=lambda device=None: torch.cpu.current_stream(),
    )

    def _device_module(get_device_module):
        """``torch.get_device_module`` with, for the CPU, the stream and event calls of
        DistMuon's runtime (``torch.cpu``'s take no ``device``/``priority`` and it has no
        events)."""

        def device_module(device=None):
            if device is not None and torch.device(device).type == "cpu":
                return _CPU_HANDLE
            return get_device_module(device)

        return device_module

    class TimedTrainer(_Timing, Trainer):
        @dataclasses.dataclass(kw_only=True, slots=True)
        class Config(Trainer.Config):
            record_to: str = ""

        def __init__(self, config):
            from torchtitan.distributed.flex_shard.dist_muon import DistMuon

            self.patches = PatchRegistry()  # the CPU layer DMuonTrainer applies itself
            if enable_cpu_support(self.patches, config):
                self.patches.setattr(DistMuon, "_validate_parameter_storage", _storage_device)
                self.patches.setattr(
                    torch, "get_device_module", _device_module(torch.get_device_module)
                )
            super().__init__(config)
            self._start_timing(config.record_to)

        def train(self):
            super().train()
            self._write()

        def close(self):
            super().close()
            self.patches.restore()

    class TimedDMuonTrainer(_Timing, DMuonTrainer):
        @dataclasses.dataclass(kw_only=True, slots=True)
        class Config(DMuonTrainer.Config):
            record_to: str = ""

        def __init__(self, config):
            super().__init__(config)
            self._start_timing(config.record_to)

        def train(self):
            super().train()
            self._write()

except ImportError:  # the driver, in any venv
    pass


# ---- the driver ----------------------------------------------------------------------


def _run(side: str, nproc: int, steps: int, out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "benchmarks")]))
    command = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
        "--rdzv_backend", "c10d", "--rdzv_endpoint", "localhost:0",
        "--local-ranks-filter", "0", "-m", "torchtitan.train",
        "--module", "bench_titan03", "--config", side, "--record_to", str(out),
        "--dump_folder", str(out / "dump"), "--training.steps", str(steps),
    ]  # fmt: skip
    run = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(
            f"{side} at {nproc} ranks failed:\n{run.stdout[-3000:]}\n{run.stderr[-5000:]}"
        )
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]
    return {"ranks": ranks, "log": [line for line in run.stdout.splitlines() if "step:" in line]}


def _summary(run: dict, warmup: int) -> dict:
    """The slowest rank of each step, median over the steps after ``warmup``."""
    ranks = run["ranks"]
    steps = [row["step"] for row in ranks[0]["steps"] if row["step"] > warmup]

    def slowest(key: str) -> float:
        return statistics.median(max(r["steps"][s - 1][key] for r in ranks) for s in steps)

    return {
        "step_ms": slowest("step_ms"),
        "forward_backward_ms": slowest("forward_backward_ms"),
        "optimizer_ms": slowest("optimizer_ms"),
        "bytes_per_rank": statistics.median(
            statistics.mean(r["steps"][s - 1]["bytes"] for r in ranks) for s in steps
        ),
        "peak_rss_gib": max(r["peak_rss"] for r in ranks) / 2**30,
        "losses": [line.split("loss:")[1].split()[0] for line in run["log"]],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    results = {
        "machine": {
            "cpu": _cpu_model(),
            "capability": torch.backends.cpu.get_cpu_capability(),
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip(),
        "runs": {},
    }
    for nproc in args.nproc:
        for side in ("dmuon", "distmuon"):
            results["runs"][f"{side}@{nproc}"] = []
        for round_ in range(args.rounds):
            for side in ("dmuon", "distmuon"):  # taking turns
                run = _run(side, nproc, args.steps, args.out / f"{side}_{nproc}_{round_}")
                results["runs"][f"{side}@{nproc}"].append(_summary(run, args.warmup))
    (args.out / "bench_titan03.json").write_text(json.dumps(results, indent=2))
    print(f"{results['machine']}, commit {results['commit']}")
    print(
        "| ranks | side | step ms | forward + backward ms | optimizer ms "
        "| MiB received a rank a step | peak RSS GiB | last losses |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for key, rounds in results["runs"].items():
        side, nproc = key.split("@")
        median = {k: statistics.median(r[k] for r in rounds) for k in rounds[0] if k != "losses"}
        print(
            f"| {nproc} | {side} | {median['step_ms']:.1f} | {median['forward_backward_ms']:.1f} | "
            f"{median['optimizer_ms']:.1f} | "
            f"{median['bytes_per_rank'] / 2**20:.2f} | {median['peak_rss_gib']:.2f} | "
            f"{' '.join(rounds[0]['losses'][-3:])} |"
        )


def _cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


if __name__ == "__main__":
    main()
