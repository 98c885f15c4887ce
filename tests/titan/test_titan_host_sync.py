"""Host syncs through TorchTitan's train step: DMuon's against TorchTitan's AdamW's."""

import json


def test_titan_train_step_syncs_no_more_than_adamw(tmp_path, monkeypatch):
    """Through TorchTitan's train step (2 ranks, FSDP2, the default ``[dmuon]
    nonfinite_grad_norm = "skip"``), counted up to its logging section: DMuon's steps
    sync the host no more often than TorchTitan's AdamW's (which reads the global token
    count once a step)."""
    from tests.titan.test_titan_integration import run_train

    monkeypatch.setenv("TEST_TRAINER", "tests.support.titan_host_sync_probe:HostSyncTrainer")
    args = ["--training.steps", "4", "--dmuon.ns_dtype", "float32", "--dmuon.ns_backend", "torch"]
    counts = {}
    for name, extra in (("dmuon", []), ("adamw", ["--optimizer.name", "AdamW"])):
        run = run_train([*args, *extra], 2, tmp_path / name, "train_configs/debug_cpu.toml")
        assert run.returncode == 0, run.output[-3000:]
        (line,) = [x for x in run.output.splitlines() if "HOST_SYNCS " in x]
        counts[name] = json.loads(line.split("HOST_SYNCS ", 1)[1])
    assert counts["dmuon"]["per_step"] <= counts["adamw"]["per_step"], counts
