"""The shipped GPU configs: real data and the model's own tokenizer, as TorchTitan's configs
have them, and dry runs (TorchTitan's fake backend, one process standing for 8 GPUs) with
their own parallelism and [dmuon] sections. A dry run here swaps in the family's debug
flavor, fp32, no compile and the offline corpus and tokenizer: the published sizes take a
GPU (or minutes of CPU each), and c4 streams from the Hugging Face Hub.

One config of each kind is dry-run (HSDP, MoE with expert parallelism, the HF backend;
about 15 s each). The others cannot be on this backend, whatever the optimizer:
DeepSeek-V3's EP-8 all-to-all gets empty inputs from the fake group, gpt-oss's
FlexAttention has no CPU backward, and qwen3's debug flavor ties its embeddings, which
TorchTitan's FSDP wrapping of qwen3 refuses (AdamW alike)."""

from __future__ import annotations

import concurrent.futures
import math
import pathlib
import subprocess
import sys

import pytest
import tomllib

from tests.titan.test_titan_dry_run import FAKE_NOTE, PLAN
from tests.titan.test_titan_integration import LOSS, ROOT, train_env

sys.path.insert(0, str(ROOT / "scripts"))
import fetch_hf_assets  # noqa: E402

CONFIGS = sorted((ROOT / "train_configs").glob("*.toml"))
GPU_CONFIGS = [p for p in CONFIGS if fetch_hf_assets.assets_of(p) is not None]
DEBUG_FLAVORS = {
    ("llama3", "8B"): "debugmodel",
    ("qwen3", "8B"): "debugmodel",
    ("qwen3", "30B-A3B"): "debugmodel_moe",
    ("deepseek_v3", "16B"): "debugmodel",
    ("gpt_oss", "20b"): "debugmodel",
    ("transformers_modeling_backend", "qwen2.5-1.5B"): "qwen2.5-debug",
    ("transformers_modeling_backend", "qwen2.5-7B"): "qwen2.5-debug",
    ("transformers_modeling_backend", "mistral-7B-v0.3"): "mistral-debug",
    ("transformers_modeling_backend", "llama3.2-3B"): "llama3.2-debug",
}
"""The debug flavor of each GPU config's model, for its dry run."""


def _toml(path: pathlib.Path) -> dict:
    return tomllib.loads(path.read_text())


def test_gpu_configs_train_on_c4_with_the_models_tokenizer():
    """Each GPU config (named by its tokenizer folder under ./assets/hf/) trains on c4 with
    the model's own tokenizer, which scripts/fetch_hf_assets.py knows how to fetch, and
    leaves the Muon matrices' lr and weight decay to the recipe; the CPU and debug configs
    keep the offline corpus and tokenizer scripts/setup.sh builds."""
    assert len(GPU_CONFIGS) == 15
    fetched = fetch_hf_assets.plan(GPU_CONFIGS)
    assert len(set(fetched.values())) == 9  # 9 models: llama3 and qwen3 8B in 4 layouts each
    for path in CONFIGS:
        config = _toml(path)
        training, model = config["training"], config["model"]
        if path in GPU_CONFIGS:
            assert training["dataset"] == "c4" and "dataset_path" not in training, path
            assert (model["name"], model["flavor"]) in DEBUG_FLAVORS, path
            assert "scripts/fetch_hf_assets.py" in path.read_text(), path
            # The recipe: [dmuon] leaves the Muon matrices' lr and decay to muon_recipe.
            assert not {"lr", "weight_decay"} & set(config["dmuon"]), path
        elif model["name"] != "vlm":
            assert model["hf_assets_path"] == "./assets/tokenizer", path
            assert training["dataset_path"].startswith("./assets/"), path
    # A folder with no known repository is named, before any download.
    bad = pathlib.Path(__file__).parents[1] / "assets" / "unknown_tokenizer.toml"
    with pytest.raises(ValueError, match=r"hf_assets_path = './assets/hf/Nope-1B' has no Hub"):
        fetch_hf_assets.plan([bad])
    listed = subprocess.run(
        [sys.executable, "scripts/fetch_hf_assets.py", "--list", str(GPU_CONFIGS[0])],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    name = fetch_hf_assets.assets_of(GPU_CONFIGS[0])
    assert listed.stdout == f"{fetched[name]} -> {name}\n"


def _dry_run(path: pathlib.Path, tmp: pathlib.Path) -> tuple[str, str]:
    config = _toml(path)
    flavor = DEBUG_FLAVORS[config["model"]["name"], config["model"]["flavor"]]
    dump = tmp / path.stem
    env = dict(train_env(1, dump), NGPU="8", COMM_MODE="fake_backend")
    env.pop("RANK", None)
    proc = subprocess.run(
        ["./run_train.sh", "--job.config_file", str(path.relative_to(ROOT)),
         "--job.dump_folder", str(dump), "--model.flavor", flavor,
         "--model.hf_assets_path", "./assets/tokenizer", "--training.dataset", "c4_test",
         "--training.dataset_path", "./assets/corpus", "--training.seq_len", "64",
         "--training.mixed_precision_param", "float32", "--compile.no-enable",
         "--checkpoint.no-enable", "--metrics.no-enable_tensorboard",
         "--metrics.disable_color_printing"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    return path.name, f"exit {proc.returncode}\n{proc.stdout}{proc.stderr}"


DRY_RUN = ("llama3_8b_hsdp_z3.toml", "qwen3_30b_a3b_ep8.toml", "hf_qwen2.5_7b_fsdp.toml")


@pytest.mark.slow
def test_gpu_configs_dry_run(tmp_path):
    """A GPU config's sections together: at 8 simulated ranks each builds DMuon's plan over
    its layout (HSDP 2 x 4, EP 8, FSDP 8) and trains its step to a finite loss."""
    configs = [ROOT / "train_configs" / name for name in DRY_RUN]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        runs = dict(pool.map(lambda p: _dry_run(p, tmp_path), configs))
    for name, output in runs.items():
        assert output.startswith("exit 0\n"), (name, output[-4000:])
        assert output.count(FAKE_NOTE) == 1, (name, output[-4000:])
        losses = {int(s): float(v) for s, v in LOSS.findall(output)}
        assert sorted(losses) == [1] and math.isfinite(losses[1]), (name, output[-4000:])
        ranks = PLAN.search(output).groups()[-2:]
        replicas = _toml(ROOT / "train_configs" / name)["parallelism"].get(
            "data_parallel_replicate_degree", 1
        )
        assert int(ranks[0]) * int(ranks[1]) == 8 and int(ranks[0]) == replicas, name


def test_gpu_configs_ship_what_is_known_to_work():
    """No GPU has run DMuon with torch.compile or ns_backend "auto" yet (docs/gpu.md): the
    GPU configs ship without them, each saying how to turn them on."""
    for path in GPU_CONFIGS:
        config, text = _toml(path), path.read_text()
        assert config["dmuon"]["ns_backend"] == "torch", path.name
        assert config.get("compile", {}).get("enable", False) is False, path.name
        assert "docs/gpu.md" in text, path.name
