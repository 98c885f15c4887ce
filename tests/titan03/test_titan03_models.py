"""TorchTitan 0.3's own MoE model through its own trainer with DMuon: deepseek_v3's debug
model with multi-token prediction (FSDP through ``apply_fsdp_to_mtp_decoder``; MLA,
shared and routed experts), its routed experts' stacks split among the owners, on 2 gloo
ranks; a checkpoint of the split stacks (each piece saved by its owner) resumes bit-exact.
"""

from __future__ import annotations

from pathlib import Path

from tests.support.titan03_recording import run_titan03


def _train(dump: Path, *flags: str) -> tuple[str, dict[int, float]]:
    run = run_titan03(
        2, "torchtitan_dmuon.titan03", "deepseek_v3_debugmodel_mtp",
        "--hf_assets_path", "./assets/tokenizer", "--dataloader.dataset_path", "./assets/corpus",
        "--training.seq_len", "64", "--training.local_batch_size", "2", "--training.steps", "3",
        "--metrics.disable_color_printing", "--validator.no-enable",
        "--dmuon.ns_dtype", "float32", "--dump_folder", str(dump), *flags,
    )  # fmt: skip
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-6000:]
    losses = {
        int(line.split("step:")[1].split()[0]): float(line.split("loss:")[1].split()[0])
        for line in output.splitlines()
        if "step:" in line and "loss:" in line
    }
    return output, losses


def test_deepseek_v3_with_split_experts_trains_and_resumes_bit_exact(tmp_path):
    output, losses = _train(tmp_path / "a", "--checkpoint.enable", "--checkpoint.interval", "2")
    # 5 MoE layers and the MTP layer's: MLA, FFN, shared experts' and eh_proj matrices and
    # the routed experts' 3 stacks of 8 per MoE module (18); routers and norms on AdamW.
    assert "dedicate_params: 68 parameters (194 matrices)" in output
    assert "18 stacks split into 36 pieces" in output
    assert losses[3] < losses[1]
    checkpoint = tmp_path / "a" / "checkpoint" / "step-2"
    _, resumed = _train(
        tmp_path / "b", "--checkpoint.enable", "--checkpoint.initial_load_path", str(checkpoint),
        "--checkpoint.no-initial_load_model_only",
    )  # fmt: skip
    assert resumed == {3: losses[3]}
