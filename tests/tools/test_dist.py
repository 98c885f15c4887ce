"""The gloo harness itself (tests/support/dist.py): what a test sees of its ranks."""

from __future__ import annotations

import os
import time

import pytest
import torch.distributed as dist

from tests.support.dist import run_distributed


def _environment_worker(rank, world_size, name):
    return os.environ.get(name)


def _hanging_worker(rank, world_size):
    if rank == 0:
        dist.barrier()
    time.sleep(600)


def _failing_worker(rank, world_size):
    if rank == 1:
        raise ValueError("rank 1 failed on purpose")
    dist.barrier()


@pytest.mark.parametrize("value", ["first", "second"])
def test_ranks_see_the_test_environment(monkeypatch, value):
    """Each run's ranks get the environment of the test that starts them (the forkserver
    they fork from was started once, under another test's)."""
    monkeypatch.setenv("DMUON_TEST_HARNESS_VALUE", value)
    assert run_distributed(_environment_worker, 2, "DMUON_TEST_HARNESS_VALUE") == [value] * 2


def _start_forkserver():
    """The timed tests below measure the harness, not the forkserver's one start (importing
    torch, the engine and the workers), which the first distributed test of a session pays."""
    run_distributed(_environment_worker, 2, "HOME")


def test_a_hang_fails_with_every_rank_stack():
    _start_forkserver()
    with pytest.raises(AssertionError, match=r"ranks \[0, 1\] still running after 5s") as e:
        run_distributed(_hanging_worker, 2, timeout=5)
    assert "--- rank 0 stacks ---" in str(e.value)
    assert "_hanging_worker" in str(e.value)


def test_a_failed_rank_ends_the_run_at_once():
    _start_forkserver()
    start = time.monotonic()
    with pytest.raises(AssertionError, match="rank 1 failed on purpose"):
        run_distributed(_failing_worker, 2, timeout=120)
    assert time.monotonic() - start < 30
