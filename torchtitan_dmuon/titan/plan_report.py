"""The plan report: what DMuon will cost each rank of a job, read before renting the cluster.

    .venv/bin/python -m torchtitan_dmuon.titan.plan_report --ngpu 1024 --gpu H100 \\
        --job.config_file train_configs/llama3_8b_fsdp_z3.toml [--section.key value ...]

One process builds the job's model on the meta device (no memory) and parallelizes it as
the trainer does, on a fake process group of ``--ngpu`` ranks (TorchTitan's dry-run backend,
seen from global rank ``--rank``: its pipeline stage and tensor-parallel coordinate), then
prints, without running a step, the figures of ``engine/report.py`` for every data-parallel
rank: owned matrices, their Newton-Schulz FLOPs, held bytes, and the collective bytes of one
step with DMuon and with the same layout under AdamW; max, mean and the busiest rank. A real
run logs the same figures for its own rank at start ("dmuon: plan report: ...").

Beside them a modeled per-step floor for a named GPU (``--gpu``, or ``--peak-tflops`` and
``--link-gbytes`` as stated inputs): the busiest rank's Newton-Schulz and collective bytes
against the model's forward and backward (TorchTitan's FLOPs per token) at the config's
tokens per rank. A model, not a measurement: peak FLOP/s, bytes at link bandwidth, no
overlap.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import importlib
import json
import logging
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from torchtitan_dmuon.engine import get_dedication
from torchtitan_dmuon.engine.machine import GPU, GPUS
from torchtitan_dmuon.engine.report import PlanReport, StepCounts, plan_report

logger = logging.getLogger(__name__)

CONFIG_MODULE = "torchtitan_dmuon.titan.config"


def parse(argv: list[str]) -> tuple[argparse.Namespace, object]:
    """This command's own flags, and TorchTitan's JobConfig from the rest."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ngpu", type=int, required=True, help="ranks of the job")
    parser.add_argument("--rank", type=int, default=0, help="the global rank seen from")
    parser.add_argument("--gpu", choices=sorted(GPUS), default="H100")
    parser.add_argument("--peak-tflops", type=float, help="overrides the GPU's")
    parser.add_argument("--link-gbytes", type=float, help="overrides the GPU's")
    parser.add_argument("--out", type=Path, help="write the report as JSON here")
    args, rest = parser.parse_known_args(argv)
    if not 0 <= args.rank < args.ngpu:
        parser.error(f"--rank {args.rank} is not a rank of --ngpu {args.ngpu}")
    flags = ("--job.custom_config_module", "--job.custom-config-module")
    if not any(a.startswith(flags) for a in rest):
        rest += ["--job.custom_config_module", CONFIG_MODULE]
    from torchtitan.config import ConfigManager

    job_config = ConfigManager().parse_args(rest)
    return args, job_config


def build_parts(job_config, ngpu: int, rank: int):
    """The job's model parts on the meta device, parallelized as the trainer does on a fake
    process group. Returns ``(parts, parallel_dims, model_args, model)`` (``model``: the
    whole model, for its FLOPs)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torchtitan.config import TORCH_DTYPE_MAP
    from torchtitan.distributed import ParallelDims
    from torchtitan.protocols.model_converter import build_model_converters
    from torchtitan.tools import utils

    from torchtitan_dmuon.titan import train_spec

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=ngpu)
    p = job_config.parallelism
    parallel_dims = ParallelDims(
        dp_shard=p.data_parallel_shard_degree,
        dp_replicate=p.data_parallel_replicate_degree,
        cp=p.context_parallel_degree,
        tp=p.tensor_parallel_degree,
        pp=p.pipeline_parallel_degree,
        ep=p.expert_parallel_degree,
        etp=p.expert_tensor_parallel_degree,
        world_size=ngpu,
    )
    if job_config.experimental.custom_import:  # a user's spec, as the trainer imports it
        importlib.import_module(job_config.experimental.custom_import)
    spec = train_spec(job_config.model.name)
    model_args = spec.model_args[job_config.model.flavor]
    model_args.update_from_config(job_config)
    with torch.device("meta"), utils.set_default_dtype(TORCH_DTYPE_MAP[job_config.training.dtype]):
        model = spec.model_cls(model_args)
    build_model_converters(job_config, parallel_dims).convert(model)
    whole = copy.deepcopy(model)  # pipelining prunes the model it is given
    if parallel_dims.pp_enabled:
        loss_fn = spec.build_loss_fn(job_config, parallel_dims=parallel_dims)
        _, parts, _, _ = spec.pipelining_fn(
            model, parallel_dims, job_config, torch.device("cpu"), model_args,
            spec.parallelize_fn, loss_fn,
        )  # fmt: skip
    else:
        parts = [spec.parallelize_fn(model, parallel_dims, job_config)]
    return parts, parallel_dims, model_args, whole


def step_counts(job_config, parallel_dims, ns_dtype: torch.dtype | None = None) -> StepCounts:
    """Micro-batches per step as the trainer computes them (gradient accumulation), and
    the Newton-Schulz dtype (``ns_dtype``, the optimizer's verdict; else ``[dmuon]
    ns_dtype``, with ``auto`` counted as bf16, a GPU's)."""
    local = job_config.training.local_batch_size
    global_batch = job_config.training.global_batch_size
    data_parallel = parallel_dims.dp_replicate * parallel_dims.dp_shard
    micro = 1 if global_batch < 0 else global_batch // (local * data_parallel)
    settings = job_config.dmuon
    if ns_dtype is None:
        ns_dtype = getattr(torch, settings.ns_dtype, torch.bfloat16)  # "auto": bf16
    return StepCounts(
        micro_batches=max(1, micro),
        ns_steps=settings.ns_steps,
        normuon=settings.variant == "normuon",
        ns_bytes=ns_dtype.itemsize,
    )


def modeled_floor(report: PlanReport, gpu: GPU, fwd_bwd_flops: float) -> dict:
    """Seconds per step of the busiest rank at peak FLOP/s and link bandwidth (no overlap):
    its forward and backward, its Newton-Schulz, its DMuon bytes and the AdamW layout's."""
    busiest = report.busiest()
    flops, link = gpu.peak_tflops * 1e12, gpu.link_gbytes * 1e9
    most_moved = max(r.dmuon_total for r in report.ranks)
    return dict(
        gpu=gpu.__dict__,
        fwd_bwd_s=fwd_bwd_flops / flops,
        ns_s=busiest.ns_flops / flops,
        dmuon_bytes_s=most_moved / link,
        adamw_bytes_s=max(r.adamw_total for r in report.ranks) / link,
    )


def _ms(seconds: float) -> str:
    return f"{1e3 * seconds:.3g} ms"


def _gib(n: float) -> str:
    return f"{n / 2**30:.3f}"


def render(report: PlanReport, name: str, floor: dict, tokens: int) -> str:
    """A markdown summary of one model part's report."""
    s = report.summary()["figures"]
    busiest = report.busiest()
    lines = [
        f"### {name}: {report.matrices} matrices over {report.replicate_size} x "
        f"{report.shard_size} data-parallel ranks ({report.idle()} run no Newton-Schulz)",
        "",
        "| per rank | max | mean | max/mean | busiest rank |",
        "|---|---|---|---|---|",
    ]
    rows = (
        ("owned matrices", "owned", lambda v: f"{v:.1f}", busiest.owned),
        ("Newton-Schulz TFLOP/step", "ns_flops", lambda v: f"{v / 1e12:.3f}", busiest.ns_flops),
        ("held GiB (values, masters, momentum, NorMuon)", "held_total", _gib, busiest.held_total),
        ("DMuon collective GiB/step", "dmuon_total", _gib, busiest.dmuon_total),
        ("same layout with AdamW, GiB/step", "adamw_total", _gib, busiest.adamw_total),
    )
    for label, key, fmt, mine in rows:
        f = s[key]
        lines.append(
            f"| {label} | {fmt(f['max'])} | {fmt(f['mean'])} | {f['max_over_mean']:.2f} | "
            f"{fmt(mine)} (rank {busiest.rank}) |"
        )
    gpu = floor["gpu"]
    fwd_bwd = floor["fwd_bwd_s"]
    lines += [
        "",
        f"Modeled floor on {gpu['name']} ({gpu['peak_tflops']:.0f} TFLOP/s bf16, "
        f"{gpu['link_gbytes']:.0f} GB/s per GPU; a model, not a measurement), {tokens} tokens "
        f"per rank and step: forward + backward {_ms(fwd_bwd)}; the busiest rank's "
        f"Newton-Schulz {_ms(floor['ns_s'])} ({100 * floor['ns_s'] / fwd_bwd:.1f}%); "
        f"collective bytes at link speed: DMuon {_ms(floor['dmuon_bytes_s'])}, the "
        f"AdamW layout {_ms(floor['adamw_bytes_s'])}.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    args, job_config = parse(sys.argv[1:] if argv is None else argv)
    from torchtitan_dmuon.titan.cpu import enable_cpu_support
    from torchtitan_dmuon.titan.parallelize import DMUON
    from torchtitan_dmuon.titan.patches import PatchRegistry

    if job_config.optimizer.name != DMUON:
        raise SystemExit(
            f"the plan report is of DMuon: [optimizer] name is {job_config.optimizer.name!r}"
        )
    patches = PatchRegistry()
    try:
        enable_cpu_support(patches)
        parts, parallel_dims, model_args, whole = build_parts(job_config, args.ngpu, args.rank)
        counts = step_counts(job_config, parallel_dims)
        seq = job_config.training.seq_len
        _, flops_per_token = model_args.get_nparams_and_flops(whole, seq)
        tokens = job_config.training.local_batch_size * seq * counts.micro_batches
        per_gpu = (
            flops_per_token * tokens / (parallel_dims.tp * parallel_dims.pp * parallel_dims.cp)
        )
        gpu = GPUS[args.gpu]
        gpu = dataclasses.replace(
            gpu,
            peak_tflops=args.peak_tflops or gpu.peak_tflops,
            link_gbytes=args.link_gbytes or gpu.link_gbytes,
        )
        out = dict(
            config=str(job_config.job.config_file),
            ngpu=args.ngpu,
            rank=args.rank,
            model=f"{job_config.model.name} {job_config.model.flavor}",
            degrees=dict(
                dp_replicate=parallel_dims.dp_replicate,
                dp_shard=parallel_dims.dp_shard,
                tp=parallel_dims.tp,
                pp=parallel_dims.pp,
                ep=parallel_dims.ep,
                cp=parallel_dims.cp,
            ),  # fmt: skip
            counts=counts.__dict__,
            parts=[],
        )
        print(
            f"plan report of {out['model']} ({out['config']}) on {args.ngpu} ranks "
            f"{out['degrees']}, seen from rank {args.rank}; {counts.micro_batches} "
            f"micro-batch(es) a step; counted from the plan, no step run"
        )
        for index, part in enumerate(parts):
            if get_dedication(part) is None:
                print(f"\nmodel part {index}: no dedicated matrix (AdamW alone)")
                continue
            report = plan_report(part, counts)
            floor = modeled_floor(report, gpu, per_gpu)
            dedication = get_dedication(part)
            rank = dedication.replicate_rank * dedication.shard_size + dedication.shard_rank
            print()
            print(render(report, f"model part {index}", floor, tokens))
            # What a real run's rank logs at start ("dmuon: plan report of model part ...").
            print(f"\nplan report of model part {index}: {report.line(rank)}")
            out["parts"].append(
                dict(
                    summary=report.summary(),
                    floor=floor,
                    ranks=[r.as_dict() for r in report.ranks],
                )
            )
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(out, indent=1))
            print(f"\nwrote {args.out}")
    finally:
        patches.restore()
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
