"""The ``titan_*`` steps of ``benchmarks/gpu_lease.sh``: TorchTitan on one GPU, a ~1B llama3,
one optimizer. Run through the lease's one entry:

    python benchmarks/gpu_lease.py titan --optimizer DMuon --dump DIR     # one GPU
    python benchmarks/gpu_lease.py titan --optimizer AdamW --dump DIR
    python benchmarks/gpu_lease.py titan --optimizer DMuon --flavor debugmodel \\
        --config train_configs/debug_cpu.toml --seq-len 128 --batch 2 --steps 3 --dump DIR
        # the same on a CPU (one gloo rank): a check without a GPU

Trains with ``torchtitan_dmuon.titan.train``'s trainer in this process as rank 0 of 1
(the environment torchrun gives a rank, without torchrun or ``run_train.sh``, so that it
runs where ``scripts/setup.sh`` cannot: no venv, no network). The config is the repo's GPU
one (``train_configs/llama3_8b_fsdp_z3.toml``: bf16 mixed precision, selective activation
checkpointing, ``torch.compile`` of the model and the loss) at flavor ``1B`` (Llama-3.2
1B's sizes: dim 2048, 16 layers, 32 heads, 8 KV heads, FFN 8192), registered here, on the
offline corpus and tokenizer of ``torchtitan_dmuon/titan/assets.py``; with one data-parallel
rank DMuon is plain Muon + AdamW (no collective of the engine). TorchTitan logs every step
(loss, memory, tokens/s, TFLOP/s, MFU; DMuon's ``dmuon:`` lines): ``gpu_lease.py summary``
reads them from the output. At the end it prints the peak memory torch saw
(``gpu_lease: peak ...``). Arguments after ``--`` go to TorchTitan as overrides.
"""

from __future__ import annotations

import argparse
import os
import socket
from pathlib import Path

# As run_train.sh: fewer out-of-memory errors from fragmentation (read at the first
# CUDA allocation).
os.environ.setdefault("PYTORCH_ALLOC_CONF", "expandable_segments:True")

import torch  # noqa: E402
from torchtitan.config.manager import ConfigManager  # noqa: E402
from torchtitan.models.llama3 import TransformerModelArgs, llama3_args  # noqa: E402

from torchtitan_dmuon.titan import register  # noqa: E402
from torchtitan_dmuon.titan.train import DMuonTrainer  # noqa: E402
from torchtitan_dmuon.titan.train import main as train  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
FLAVOR_1B = TransformerModelArgs(
    dim=2048,
    n_layers=16,
    n_heads=32,
    n_kv_heads=8,
    ffn_dim_multiplier=1.5,
    multiple_of=256,
    rope_theta=500000,
)
"""Llama-3.2 1B's architecture (without its tied embeddings); the vocabulary is the
tokenizer's (2048 for the offline one: ~0.97B parameters, nearly all in the blocks)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def titan_args(args: argparse.Namespace, overrides: list[str]) -> list[str]:
    """TorchTitan's command line for this run."""
    return [
        "--job.config_file", args.config,
        "--job.custom_config_module", "torchtitan_dmuon.titan.config",
        "--job.dump_folder", str(args.dump),
        "--model.flavor", args.flavor,
        "--model.hf_assets_path", str(args.assets / "tokenizer"),
        "--training.dataset", "c4_test",
        "--training.dataset_path", str(args.assets / "corpus"),
        "--training.steps", str(args.steps),
        "--training.seq_len", str(args.seq_len),
        "--training.local_batch_size", str(args.batch),
        "--lr_scheduler.warmup_steps", str(max(1, args.steps // 6)),
        "--optimizer.name", args.optimizer,
        "--metrics.log_freq", "1",
        "--metrics.no-enable_tensorboard",
        "--metrics.disable_color_printing",
        "--checkpoint.no-enable",
        *overrides,
    ]  # fmt: skip


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    ours, overrides = argv, []
    if "--" in argv:
        at = argv.index("--")
        ours, overrides = argv[:at], argv[at + 1 :]
    parser = argparse.ArgumentParser(prog="gpu_lease.py titan", description=__doc__.split("\n")[0])
    parser.add_argument("--optimizer", choices=["DMuon", "AdamW"], required=True)
    parser.add_argument("--dump", type=Path, required=True, help="TorchTitan's dump folder")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--flavor", default="1B", help="a llama3 flavor (1B: registered here)")
    parser.add_argument("--config", default="train_configs/llama3_8b_fsdp_z3.toml")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=2, help="sequences per step")
    parser.add_argument(
        "--assets", type=Path, default=ROOT / "assets", help="titan/assets.py's output"
    )
    return parser.parse_args(ours), overrides


def main(argv: list[str]) -> int:
    args, overrides = parse_args(argv)
    os.chdir(ROOT)  # the config's relative paths
    llama3_args.setdefault("1B", FLAVOR_1B)
    register()
    # Rank 0 of 1, as torchrun would start it.
    for key, value in dict(
        RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", GROUP_RANK="0",
        ROLE_RANK="0", ROLE_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()), TORCHELASTIC_RUN_ID="gpu-lease",
    ).items():  # fmt: skip
        os.environ.setdefault(key, value)
    command = titan_args(args, overrides)
    print("gpu_lease: TorchTitan " + " ".join(command), flush=True)
    # TorchTitan's parse_args reads the sys.argv of when it was imported: this run's.
    ConfigManager.parse_args.__defaults__ = (command,)
    train(DMuonTrainer)
    if torch.cuda.is_available():
        gib = 2**30
        print(
            f"gpu_lease: peak allocated {torch.cuda.max_memory_allocated() / gib:.2f} GiB, "
            f"peak reserved {torch.cuda.max_memory_reserved() / gib:.2f} GiB",
            flush=True,
        )
    return 0
