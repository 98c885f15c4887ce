"""Fetches the tokenizers the GPU configs train with, as TorchTitan's own configs do.

Each GPU config in ``train_configs/`` points ``[model] hf_assets_path`` at
``./assets/hf/<model>`` (the model's own tokenizer, whose vocabulary the flavor has) and
trains on TorchTitan's ``c4`` dataset, which streams ``allenai/c4`` from the Hugging Face
Hub at run time (``--training.dataset_path`` names a local copy instead). This script
downloads each named config's tokenizer files (and the model's ``config.json``) from the
Hub into its ``hf_assets_path``; Llama's repositories are gated: accept their license on
the Hub and pass ``--hf-token`` or set ``HF_TOKEN``.

Usage::

    .venv/bin/python scripts/fetch_hf_assets.py                        # every GPU config
    .venv/bin/python scripts/fetch_hf_assets.py train_configs/llama3_8b_fsdp_z3.toml
    .venv/bin/python scripts/fetch_hf_assets.py --list                 # what, no download
"""

from __future__ import annotations

import argparse
import logging
import os
import pathlib
import sys

import tomllib

logger = logging.getLogger("fetch_hf_assets")

ROOT = pathlib.Path(__file__).resolve().parent.parent
ASSETS = "./assets/hf/"
"""Where the GPU configs' tokenizer folders live (``./assets/hf/<model>``, TorchTitan's
layout); the CPU and debug configs use the offline ``./assets/tokenizer``."""

REPOS = {
    "Llama-3.1-8B": "meta-llama/Llama-3.1-8B",
    "Llama-3.2-3B": "meta-llama/Llama-3.2-3B",
    "Qwen3-8B": "Qwen/Qwen3-8B",
    "Qwen3-30B-A3B": "Qwen/Qwen3-30B-A3B",
    "Qwen2.5-1.5B": "Qwen/Qwen2.5-1.5B",
    "Qwen2.5-7B": "Qwen/Qwen2.5-7B",
    "Mistral-7B-v0.3": "mistralai/Mistral-7B-v0.3",
    "deepseek-moe-16b-base": "deepseek-ai/deepseek-moe-16b-base",
    "gpt-oss-20b": "openai/gpt-oss-20b",
}
"""The Hub repository of each tokenizer folder a shipped config names."""

PATTERNS = [
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "special_tokens_map.json",
    "config.json",
    "generation_config.json",
]
"""The files fetched: the tokenizer in any of its formats, and the model's config."""


def assets_of(config: pathlib.Path) -> str | None:
    """The ``[model] hf_assets_path`` of a config when it is a Hub model's folder, else None."""
    path = tomllib.loads(config.read_text())["model"].get("hf_assets_path", "")
    return path if path.startswith(ASSETS) else None


def plan(configs: list[pathlib.Path]) -> dict[str, str]:
    """The folders to fill, each with its repository.

    Args:
        configs: TOML files; those whose tokenizer is not under ``./assets/hf/`` are skipped.

    Returns:
        ``{hf_assets_path: repo_id}``.

    Raises:
        ValueError: A config names a folder with no repository in ``REPOS``.
    """
    wanted = {}
    for config in configs:
        path = assets_of(config)
        if path is None:
            continue
        name = path.removeprefix(ASSETS).rstrip("/")
        if name not in REPOS:
            raise ValueError(
                f"{config}: [model] hf_assets_path = {path!r} has no Hub repository in "
                f"scripts/fetch_hf_assets.py REPOS (known: {', '.join(sorted(REPOS))})"
            )
        wanted[path] = REPOS[name]
    return wanted


def main(argv: list[str] | None = None) -> int:
    """Downloads the tokenizers of the named configs (default: every config).

    Returns:
        0, or 1 when a download failed.
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("configs", nargs="*", type=pathlib.Path)
    parser.add_argument("--hf-token", default=os.environ.get("HF_TOKEN"))
    parser.add_argument("--list", action="store_true", help="print what would be fetched")
    args = parser.parse_args(argv)
    configs = args.configs or sorted((ROOT / "train_configs").glob("*.toml"))
    try:
        wanted = plan(configs)
    except ValueError as error:
        parser.error(str(error))
    failed = False
    for path, repo in sorted(wanted.items()):
        target = ROOT / path
        if args.list:
            print(f"{repo} -> {path}")
            continue
        from huggingface_hub import snapshot_download

        try:
            snapshot_download(repo, allow_patterns=PATTERNS, local_dir=target, token=args.hf_token)
        except Exception as error:  # the Hub's errors have no common base worth naming
            logger.error("%s -> %s failed: %s", repo, path, error)
            failed = True
            continue
        logger.info("%s -> %s: %s", repo, path, sorted(p.name for p in target.iterdir()))
    return 1 if failed else 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="[fetch_hf_assets] %(message)s")
    sys.exit(main())
