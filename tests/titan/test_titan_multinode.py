"""Beyond one machine: ``./run_train.sh`` across two "nodes" on this machine (two launches
of 2 processes each, rendezvous on 127.0.0.1) trains HSDP with the replicate dimension
across the nodes, equal to the same run from one launch of 4 processes; once with a
static rendezvous (``NODE_RANK``, ``MASTER_ADDR``), once through
``multinode_trainer.slurm`` (torchrun's c10d rendezvous) under fake slurm commands."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.support.launcher import free_port
from tests.titan.test_titan_integration import (
    ROOT,
    finished_run,
    run_train,
    train_command,
    train_env,
)

CONFIG = "train_configs/debug_cpu.toml"
# HSDP 2 x 2: each node holds one replica's two shards, the replicate groups cross nodes.
ARGS = [
    "--training.steps", "4", "--metrics.log_freq", "1",
    "--dmuon.ns_dtype", "float32", "--dmuon.ns_backend", "torch",
    "--parallelism.data_parallel_replicate_degree", "2",
    "--parallelism.data_parallel_shard_degree", "2",
    "--dmuon.replicate_async",
]  # fmt: skip
FAKE_SLURM = ROOT / "tests" / "support" / "fake_slurm"


def _wait(procs: list[subprocess.Popen], logs: list[Path], dumps: list[Path]) -> list:
    """Every launch to its end (all of them killed if one times out or the wait fails: a
    node that finished first must not end the others, which may still be exiting)."""
    try:
        for proc in procs:
            proc.wait(timeout=900)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return [
        finished_run(proc.returncode, log.read_text(), dump)
        for proc, log, dump in zip(procs, logs, dumps, strict=True)
    ]


def _two_static_nodes(tmp_path: Path) -> list:
    """Node r: ``NNODES=2 NODE_RANK=r MASTER_ADDR=127.0.0.1`` (global ranks 2r, 2r + 1),
    sharing one dump folder as nodes share a file system."""
    port = str(free_port())
    dump = tmp_path / "static"
    procs, logs, dumps = [], [], []
    for node in range(2):
        node_dump = tmp_path / f"static_node{node}"
        env = train_env(
            2, node_dump, NNODES="2", NODE_RANK=str(node), MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port, LOGLEVEL="INFO",
        )  # fmt: skip
        log = tmp_path / f"static_node{node}.log"
        with open(log, "w") as out:
            procs.append(
                subprocess.Popen(
                    train_command(ARGS, dump, CONFIG),
                    cwd=ROOT,
                    env=env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    text=True,
                )  # fmt: skip
            )
        logs.append(log)
        dumps.append(node_dump)
    return _wait(procs, logs, dumps)


def _slurm_env(tmp_path: Path, dump: Path, **extra: str) -> dict[str, str]:
    """The environment ``sbatch --nodes 2`` gives the script, submitted from ``tmp_path``
    (outside the checkout), with slurm's commands faked on this machine
    (``tests/support/fake_slurm``)."""
    env = train_env(2, dump)
    env.pop("DMUON_ROOT", None)  # only what the test names
    env.update(
        PATH=f"{FAKE_SLURM}{os.pathsep}{env['PATH']}",
        SLURM_JOB_NODELIST="node[0-1]",
        SLURM_JOB_NUM_NODES="2",
        SLURM_JOB_ID="4242",
        SLURM_SUBMIT_DIR=str(tmp_path),
        SLURM_CPUS_ON_NODE="2",
        MASTER_PORT=str(free_port()),
        LOGLEVEL="INFO",  # torchrun's agents log the global ranks of their node
        **extra,
    )
    return env


def _spooled_script(tmp_path: Path) -> Path:
    """sbatch runs a copy of the script from its spool directory, not the checkout's."""
    spool = tmp_path / "spool"
    spool.mkdir(exist_ok=True)
    script = spool / "slurm_script"
    shutil.copy(ROOT / "multinode_trainer.slurm", script)
    return script


def _slurm_job(tmp_path: Path):
    """``multinode_trainer.slurm`` as ``sbatch --nodes 2`` would start it from outside the
    checkout, which ``DMUON_ROOT`` names."""
    dump = tmp_path / "slurm"
    env = _slurm_env(tmp_path, dump, DMUON_ROOT=str(ROOT))
    log = tmp_path / "slurm.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [str(_spooled_script(tmp_path)), "--job.config_file", CONFIG,
             "--job.dump_folder", str(dump), *ARGS],
            cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
    return _wait([proc], [log], [dump])[0]


def test_slurm_script_outside_the_checkout_says_how_to_name_it(tmp_path):
    """Submitted from another directory without DMUON_ROOT, the spooled script stops at
    once naming the three ways to point it at the checkout (it ran ./scripts/setup.sh
    from the submit directory: 'No such file or directory')."""
    env = _slurm_env(tmp_path, tmp_path / "dump")
    done = subprocess.run(
        [str(_spooled_script(tmp_path))], cwd=tmp_path, env=env, capture_output=True,
        text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert f"no torchtitan-dmuon checkout at {tmp_path}" in done.stderr
    assert "sbatch --chdir" in done.stderr and "DMUON_ROOT=" in done.stderr


@pytest.mark.slow
def test_two_nodes_equal_one_launch(tmp_path):
    """Two nodes of 2 processes (replicate 2 across them, shard 2 within each, async
    replicate broadcast) follow one 4-process launch to the printed digits over 4 steps,
    with a static rendezvous (node r holds global ranks 2r and 2r + 1) and through the
    slurm script's c10d rendezvous (the nodes hold ranks 0-1 and 2-3 in join order)."""
    single = run_train(ARGS, 4, tmp_path / "single", CONFIG, via="run_train.sh")
    assert single.returncode == 0, single.output[-3000:]
    assert sorted(single.losses) == [1, 2, 3, 4]
    node0, node1 = _two_static_nodes(tmp_path)
    for node in (node0, node1):
        assert node.returncode == 0, node.output[-3000:]
        assert node.losses == single.losses
    assert "global_ranks=[0, 1]" in node0.output and "global_ranks=[2, 3]" in node1.output
    slurm = _slurm_job(tmp_path)
    assert slurm.returncode == 0, slurm.output[-3000:]
    assert slurm.losses == single.losses
    assert "global_ranks=[0, 1]" in slurm.output and "global_ranks=[2, 3]" in slurm.output


def _fake_checkout(tmp_path: Path) -> Path:
    """A checkout whose ``run_train.sh`` prints the arguments it was given on one line
    (``|`` between them), and whose ``scripts/setup.sh`` does nothing: the slurm script's
    own choices, fast."""
    root = tmp_path / "checkout"
    (root / "scripts").mkdir(parents=True)
    (root / "scripts" / "setup.sh").write_text("#!/usr/bin/env bash\n")
    (root / "run_train.sh").write_text('#!/usr/bin/env bash\n(IFS="|"; echo "args|$*")\n')
    for path in (root / "scripts" / "setup.sh", root / "run_train.sh"):
        path.chmod(0o755)
    return root


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ([], ["--parallelism.data_parallel_replicate_degree", "2"]),
        (["--parallelism.data_parallel_replicate_degree", "1"], []),
        (["--parallelism.data_parallel_replicate_degree=1"], []),
    ],
)
def test_slurm_script_derives_the_replicate_degree_from_the_nodes(tmp_path, given, expected):
    """One HSDP replica per node: the script passes
    ``--parallelism.data_parallel_replicate_degree`` = the job's node count before the
    user's arguments, unless they name one themselves."""
    env = _slurm_env(tmp_path, tmp_path / "dump", DMUON_ROOT=str(_fake_checkout(tmp_path)))
    args = ["--job.config_file", "train_configs/llama3_8b_hsdp_z3.toml", *given]
    done = subprocess.run(
        [str(_spooled_script(tmp_path)), *args], cwd=tmp_path, env=env, capture_output=True,
        text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    per_node = [line.split("|")[1:] for line in lines if line.startswith("args|")]
    assert per_node == [expected + args] * 2  # one task on each of the 2 nodes
