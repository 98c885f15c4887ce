"""The Triton Newton-Schulz autotuning configs compile for an H100 (sm_90) and fit there.

benchmarks/triton_sm90.py compiles them ahead of time, no GPU needed, in subprocesses without
TRITON_INTERPRET: conftest.py sets it off GPU, and triton_ns then lists one fixed config.
fp32 is compiled with TF32 only: full-precision ("ieee") products need less shared memory.
"""

import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]
DTYPES = ("bf16", "fp32-tf32")
KERNELS = ("sym_gram", "sym_poly", "poly_apply")
COMPILE = (
    "import json, sys; sys.path.insert(0, 'benchmarks'); from triton_sm90 import compile_table; "
    "print(json.dumps(compile_table(dtypes=(sys.argv[1],))))"
)


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path_factory.mktemp("triton_cache"))
    # One process per dtype, side by side: about 20 s on 2 cores.
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", COMPILE, dtype],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for dtype in DTYPES
    ]
    rows = []
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"compiling for sm_90 failed:\n{err[-5000:]}"
        rows += json.loads(out.splitlines()[-1])
    return rows


def _fitting(table) -> dict[tuple[str, str], list[str]]:
    fits = defaultdict(list)
    for row in table:
        if row["fits"]:
            fits[row["kernel"], row["dtype"]].append(row["config"])
    return fits


def test_two_configs_fit_per_kernel_and_dtype(table):
    fits = _fitting(table)
    for kernel in KERNELS:
        for dtype in DTYPES:
            assert len(fits[kernel, dtype]) >= 2, (kernel, dtype, fits[kernel, dtype])


def test_every_config_fits_in_some_dtype(table):
    fits = _fitting(table)
    for row in table:
        assert any(row["config"] in fits[row["kernel"], d] for d in DTYPES), row


def test_no_spills_in_bf16(table):
    bf16 = [row for row in table if row["dtype"] == "bf16"]
    assert {row["kernel"] for row in bf16} == set(KERNELS)
    assert [row for row in bf16 if row["spills"]] == []
