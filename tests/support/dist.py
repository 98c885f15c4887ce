"""Spawn gloo process groups from inside a test (no torchrun needed).

``run_distributed(fn, world_size, *args)`` starts ``world_size`` processes that each init a
gloo group over a file store, run ``fn(rank, world_size, *args)`` and send back its return
value. A rank that raises fails the test with its traceback; a run that does not finish
in ``timeout`` seconds (a hang) is killed and fails the test. ``pg_timeout`` sets the
group's own timeout (``init_process_group(timeout=...)``); ``leave_together=False`` skips
the barrier and teardown after ``fn``, for a test that leaves the group broken.
``backend="nccl"`` (the GPU check, ``benchmarks/gpu_engine_check.py``) gives each rank
the GPU ``rank % device_count`` first; gloo ranks may hold CUDA tensors too, all on one GPU.

The ranks are forked from multiprocessing's forkserver, which imports torch, the engine
and the test workers once per session: a spawned rank imports them again, ~6 CPU-seconds
per process, more than most of these tests compute. A forkserver runs no torch operation,
so its children fork before any thread pool exists, as spawned ones start without one.
"""

from __future__ import annotations

import faulthandler
import gc
import multiprocessing as mp
import os
import signal
import tempfile
import time
import traceback
from datetime import timedelta

import torch

DEFAULT_TIMEOUT = 240
_CONTEXT = mp.get_context("forkserver")
_CONTEXT.set_forkserver_preload(["torch", "torch.distributed", "tests.support.workers"])


def _worker(
    fn, rank, world_size, store_path, result_path, env, args, pg_timeout, leave_together, backend
):
    import torch.distributed as dist

    # The test's environment now, as a spawned rank would get it, not the forkserver's
    # (started by whichever test first ran ranks, under its monkeypatched variables).
    os.environ.clear()
    os.environ.update(env)

    # On a hang the parent sends SIGUSR1 and reports where every thread of every rank waits.
    stacks = open(result_path + ".stacks", "w")  # noqa: SIM115 - open until the process ends
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    torch.set_num_threads(1)
    try:
        timeout = {} if pg_timeout is None else {"timeout": timedelta(seconds=pg_timeout)}
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(
            backend, init_method=f"file://{store_path}", rank=rank, world_size=world_size, **timeout
        )
        result = fn(rank, world_size, *args)
        torch.save({"ok": True, "result": result}, result_path)
    except BaseException:  # noqa: BLE001 - report anything to the parent
        torch.save({"ok": False, "error": traceback.format_exc()}, result_path)
        os._exit(1)
    if not leave_together:
        stacks.flush()
        os._exit(0)
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def _dump_stacks(procs, paths) -> str:
    """Python stacks of the live ranks, read through their SIGUSR1 faulthandler."""
    live = [(r, p) for r, p in enumerate(procs) if p.is_alive()]
    for _, p in live:
        os.kill(p.pid, signal.SIGUSR1)
    time.sleep(2.0)
    dumps = []
    for r, _ in live:
        with open(paths[r] + ".stacks") as f:
            dumps.append(f"--- rank {r} stacks ---\n{f.read()}")
    return "\n".join(dumps)


def run_distributed(
    fn,
    world_size: int,
    *args,
    timeout: float = DEFAULT_TIMEOUT,
    pg_timeout: float | None = None,
    leave_together: bool = True,
    backend: str = "gloo",
) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks of ``backend`` (gloo);
    return the results by rank."""
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        paths = [os.path.join(tmp, f"rank{r}.pt") for r in range(world_size)]
        env = dict(os.environ)
        procs = [
            _CONTEXT.Process(
                target=_worker,
                args=(
                    fn,
                    r,
                    world_size,
                    store,
                    paths[r],
                    env,
                    args,
                    pg_timeout,
                    leave_together,
                    backend,
                ),
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        # Poll, so that one failed rank ends the run at once instead of leaving its peers
        # blocked in a collective until the timeout.
        while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
            if any(p.exitcode not in (None, 0) for p in procs):
                break
            time.sleep(0.05)
        failed_early = any(p.exitcode not in (None, 0) for p in procs)
        hung = [r for r, p in enumerate(procs) if p.is_alive() and not failed_early]
        stacks = _dump_stacks(procs, paths) if hung else ""
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        outcomes = [
            torch.load(path, weights_only=False) if os.path.exists(path) else None for path in paths
        ]
        errors = [
            f"--- rank {r} ---\n{o['error']}"
            for r, o in enumerate(outcomes)
            if o is not None and not o["ok"]
        ]
        if errors:
            raise AssertionError("distributed run failed:\n" + "\n".join(errors))
        if hung:
            raise AssertionError(
                f"distributed run hung: ranks {hung} still running after {timeout}s\n{stacks}"
            )
        missing = [r for r, o in enumerate(outcomes) if o is None]
        if missing:
            codes = [p.exitcode for p in procs]
            raise AssertionError(f"ranks {missing} returned nothing (exit codes {codes})")
        return [o["result"] for o in outcomes]
