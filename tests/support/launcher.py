"""A test-only launcher of TorchTitan runs: the ranks of each run are forked from one
process that imported the trainer once.

``./run_train.sh`` starts torchrun, whose every rank imports torch, TorchTitan, its models
and datasets again: about 8 CPU-seconds per process on a 2-core CPU, a third of the
suite's CPU time. The suite's runs go through :func:`launch` instead (``run_train.sh``'s
own logic, its setup and torchrun's rendezvous keep tests of their own): a server
process (``python -m tests.support.launcher``) imports ``torchtitan_dmuon.titan.train``, then
per request forks the ranks with the environment torchrun
gives them (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``, one
OpenMP thread), each writing to ``<logs>/rank<r>/stderr.log``. As torchrun, it stops the
other ranks when one fails, and returns the output of the ranks ``LOG_RANK`` names, each
line prefixed ``[rank<r>]:``. ``TEST_TRAINER=module:Class`` in the request's environment
runs that subclass of ``DMuonTrainer`` instead (a probe).

The server runs no torch operation before forking: a process that started OpenMP or
other thread pools cannot fork safely.
"""

from __future__ import annotations

import faulthandler
import importlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONFIG_MODULE = "torchtitan_dmuon.titan.config"
STOP_GRACE_S = 5.0
PORT_ATTEMPTS = 3
"""How long the other ranks may take to exit by themselves after one failed."""


def split_args(args: list[str]) -> tuple[str, list[str]]:
    """``run_train.sh``'s reading of its arguments: the config file named last, and the
    other arguments with the ``[dmuon]`` config module added unless one is named."""
    config, overrides = "train_configs/debug_cpu.toml", []
    it = iter(args)
    for arg in it:
        if arg in ("--job.config_file", "--job.config-file"):
            config = next(it)
        elif arg.startswith(("--job.config_file=", "--job.config-file=")):
            config = arg.split("=", 1)[1]
        else:
            overrides.append(arg)
    flags = ("--job.custom_config_module", "--job.custom-config-module")
    if not any(a.startswith(flags) for a in overrides):
        overrides += ["--job.custom_config_module", CONFIG_MODULE]
    return config, overrides


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _TimeWithoutSleep:
    """The ``time`` module, whose ``sleep`` returns at once."""

    def __getattr__(self, name: str):
        return getattr(time, name)

    @staticmethod
    def sleep(seconds: float) -> None:
        pass


def _run_rank(rank: int, world: int, port: int, request: dict, log: Path) -> None:
    """The body of a forked rank: never returns."""
    code = 1
    try:
        log.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.environ.clear()
        os.environ.update(request["env"])
        os.environ.update(
            RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
            LOCAL_WORLD_SIZE=str(world), GROUP_RANK="0", ROLE_RANK=str(rank),
            ROLE_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
            TORCHELASTIC_RUN_ID="tests-launcher", OMP_NUM_THREADS="1",
        )  # fmt: skip
        faulthandler.enable()
        config, overrides = split_args(request["args"])
        sys.argv = ["torchtitan_dmuon.titan.train", "--job.config_file", config, *overrides]
        import torchtitan.train
        from torchtitan.config.manager import ConfigManager

        from torchtitan_dmuon.titan.train import DMuonTrainer, main

        trainer = DMuonTrainer
        if os.environ.get("TEST_TRAINER"):
            module, name = os.environ["TEST_TRAINER"].split(":")
            trainer = getattr(importlib.import_module(module), name)

        # TorchTitan's parse_args defaults to the sys.argv[1:] of when it was imported
        # (this server's): the rank's own arguments instead.
        ConfigManager.parse_args.__defaults__ = (sys.argv[1:],)
        # TorchTitan's rank 0 sleeps 2 s after the last step for the others to finish;
        # DMuonTrainer.train's closing barrier already waits for them (2 s of each run).
        torchtitan.train.time = _TimeWithoutSleep()
        main(trainer)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else int(e.code is not None)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _launch(request: dict) -> dict:
    """Run the request's ranks; again on another port when the one :func:`free_port` found
    was taken before rank 0's store bound it (another process may bind it in between)."""
    for _ in range(PORT_ATTEMPTS):
        answer = _launch_on(request, free_port())
        rank0_log = Path(request["logs"]) / "rank0" / "stderr.log"
        lost_port = (
            answer["codes"][0] != 0
            and rank0_log.exists()
            and "EADDRINUSE" in rank0_log.read_text(errors="replace")
        )
        if not lost_port:
            break
    return answer


def _launch_on(request: dict, port: int) -> dict:
    world, logs = request["ngpu"], Path(request["logs"])
    pids = {}
    for rank in range(world):
        pid = os.fork()
        if pid == 0:
            _run_rank(rank, world, port, request, logs / f"rank{rank}" / "stderr.log")
        pids[pid] = rank
    codes: dict[int, int] = {}
    deadline = time.monotonic() + request["timeout"]
    failed_at = None
    while len(codes) < world:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            now = time.monotonic()
            stop = now > deadline or (failed_at is not None and now > failed_at + STOP_GRACE_S)
            if stop:
                for p, r in pids.items():
                    if r not in codes:
                        os.kill(p, signal.SIGKILL)
            time.sleep(0.05)
            continue
        codes[pids[pid]] = os.waitstatus_to_exitcode(status)
        if codes[pids[pid]] != 0 and failed_at is None:
            failed_at = time.monotonic()
    timed_out = time.monotonic() > deadline
    return {"codes": [codes[r] for r in range(world)], "timed_out": timed_out}


def serve() -> None:
    """Read one JSON request per line on stdin, answer one JSON line each."""
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # what the imports print goes to stderr, not into the answers
    import torchtitan_dmuon.titan.train  # noqa: F401

    answers.write(json.dumps({"ready": True}) + "\n")
    answers.flush()
    for line in sys.stdin:
        answers.write(json.dumps(_launch(json.loads(line))) + "\n")
        answers.flush()


class Launcher:
    """The client side: one server per test session, started at the first launch."""

    def __init__(self) -> None:
        self._server: subprocess.Popen | None = None
        self._lock = threading.Lock()

    def _start(self, env: dict[str, str]) -> subprocess.Popen:
        server_env = {k: v for k, v in env.items() if k not in ("NGPU", "LOG_RANK")}
        server_env["OMP_NUM_THREADS"] = "1"
        server = subprocess.Popen(
            [sys.executable, "-m", "tests.support.launcher"],
            cwd=ROOT,
            env=server_env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        ready = server.stdout.readline()
        if not ready:
            raise RuntimeError("tests.support.launcher: the server did not start")
        return server

    def launch(
        self, args: list[str], ngpu: int, env: dict[str, str], logs: Path, timeout: float
    ) -> tuple[int, str]:
        """Run one training; return ``(exit code, output)`` as ``run_train.sh`` would give
        them: the first failing rank's code (-9 after ``timeout`` s), the ``LOG_RANK``
        ranks' output, and on failure the last lines of every failed rank's."""
        with self._lock:
            if self._server is None or self._server.poll() is not None:
                self._server = self._start(env)
            request = {"args": args, "ngpu": ngpu, "env": env, "logs": str(logs),
                       "timeout": timeout}  # fmt: skip
            self._server.stdin.write(json.dumps(request) + "\n")
            self._server.stdin.flush()
            line = self._server.stdout.readline()
            if not line:
                raise RuntimeError(
                    f"tests.support.launcher: the server exited ({self._server.wait()})"
                )
            answer = json.loads(line)
        shown = [int(r) for r in env.get("LOG_RANK", "0").split(",")]
        output = []
        for rank in shown:
            text = (logs / f"rank{rank}" / "stderr.log").read_text(errors="replace")
            output += [f"[rank{rank}]:{line}" for line in text.splitlines()]
        codes = answer["codes"]
        failed = [(r, c) for r, c in enumerate(codes) if c != 0]
        for rank, code in failed:
            if rank not in shown:
                text = (logs / f"rank{rank}" / "stderr.log").read_text(errors="replace")
                output.append(f"--- rank {rank} exited with {code}:")
                output += [f"[rank{rank}]:{line}" for line in text.splitlines()[-60:]]
        if answer["timed_out"]:
            output.append(f"tests.support.launcher: timed out after {timeout} s")
        code = -9 if answer["timed_out"] else next((c for _, c in failed), 0)
        return code, "\n".join(output) + "\n"


if __name__ == "__main__":
    serve()
