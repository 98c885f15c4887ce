"""Every replacement of a torch or TorchTitan name is scoped to the trainer: after
``DMuonTrainer`` ends, whether it trained to the end or failed while being built, each
name is the original again (``tests/support/trainer_patches_probe.py`` runs both in one process)."""

import json
import subprocess
import sys

from tests.support.launcher import free_port
from tests.titan.test_titan_integration import ROOT, train_env

ONE_STEP = ["--training.steps", "1", "--dmuon.ns_dtype", "float32", "--dmuon.ns_backend", "torch"]


def test_trainer_undoes_every_patch_after_training_and_after_an_error(tmp_path):
    dump = tmp_path / "run"
    env = train_env(1, dump, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    args = [
        "--job.config_file", "train_configs/debug_cpu.toml",
        "--job.custom_config_module", "torchtitan_dmuon.titan.config",
        "--job.dump_folder", str(dump), *ONE_STEP,
    ]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "tests/support/trainer_patches_probe.py", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("PROBE ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    probe = json.loads(lines[-1].removeprefix("PROBE "))
    # What the trainer replaced while it ran (the CPU layer and its own), all of it
    # replaced then, and all of it back after the completed run and after the failed one.
    for name in (
        "torch.histc",
        "torch.profiler.profile",
        "torchtitan.distributed.utils.clip_grad_norm_",
        "torchtitan.distributed.utils.init_distributed",
        "torchtitan.distributed.utils.set_pg_timeouts",
        "torchtitan.protocols.train_spec.get_train_spec",
        "MetricsProcessor.log",
    ):
        assert name in probe["replaced"], probe["replaced"]
    assert probe["were_patched"]
    for after in ("after_completed", "after_failing"):  # the names not back, if any
        assert probe[after] and all(probe[after].values()), [
            name for name, back in probe[after].items() if not back
        ]
    assert "ns_backend='triton' needs" in (probe["failing_error"] or ""), probe
    assert probe["torch_originals"]


def test_cpu_offload_asks_for_gloo_once():
    """On CPU, --training.enable_cpu_offload's extra CPU backend made TorchTitan ask for
    "cpu:gloo,cpu:gloo", which torch refuses ("Duplicate device type cpu"): the CPU layer
    asks for the device's backend (gloo) alone, and passes everything else on."""
    from torchtitan.config.job_config import Comm

    from torchtitan_dmuon.titan.cpu import _cpu_init_distributed

    seen = {}

    def init_distributed(comm_config, enable_cpu_backend=False, base_folder="", ranks=None):
        seen.update(enable_cpu_backend=enable_cpu_backend, base_folder=base_folder)
        return 2

    wrapped = _cpu_init_distributed(init_distributed)
    assert wrapped(Comm(), enable_cpu_backend=True, base_folder="dump") == 2
    assert seen == {"enable_cpu_backend": False, "base_folder": "dump"}
    assert wrapped(Comm(), True, "dump2") == 2
    assert seen == {"enable_cpu_backend": False, "base_folder": "dump2"}
