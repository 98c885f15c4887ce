"""The on-disk cache of ``ns_backend="auto"`` timings, so a second run measures nothing.

One JSON file, ``ns_backend_timings.json``, in ``$TORCHTITAN_DMUON_CACHE_DIR`` or else
``$XDG_CACHE_HOME/torchtitan_dmuon`` (``~/.cache/torchtitan_dmuon``), as Triton and
Inductor keep theirs. Each entry holds the milliseconds of every correct backend for one
(batched) matrix shape, keyed by what the timing and the correctness check depend on: the
device (GPU name, or CPU model and torch's capability string), the torch and Triton
versions, the shape, the dtype, the steps, the coefficients and eps. Ranks sharing a
machine write it under a file lock; a missing, unreadable or corrupt file is an empty
cache, a malformed entry (not every backend's milliseconds, torch's among them) a missing
one: both logged and measured again.

This module does not import ``torch.distributed``.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib.metadata
import json
import logging
import math
import os
import pathlib
import platform
from collections.abc import Sequence

import torch

from torchtitan_dmuon.optim.newton_schulz import NSSchedule

__all__ = [
    "cache_path",
    "cpu_description",
    "device_key",
    "load_timings",
    "save_timings",
    "timing_key",
]

logger = logging.getLogger(__name__)

Timings = dict[str, float]
"""Milliseconds of one Newton-Schulz run per backend name."""

_FILE = "ns_backend_timings.json"


def cache_path() -> pathlib.Path:
    """Where the timings live (see the module docstring)."""
    folder = os.environ.get("TORCHTITAN_DMUON_CACHE_DIR")
    if not folder:
        base = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
        folder = pathlib.Path(base) / "torchtitan_dmuon"
    return pathlib.Path(folder) / _FILE


def cpu_description() -> str:
    """The CPU's model name and torch's capability string, e.g. ``"AMD EPYC (AVX2)"``."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            model = next(
                (line.split(":", 1)[1].strip() for line in f if line.startswith("model name")),
                model,
            )
    except OSError:
        pass
    return f"{model} ({torch.backends.cpu.get_cpu_capability()})"


def device_key(device: torch.device) -> str:
    """The device part of a key: the GPU's name and compute capability, or the CPU's
    model and torch's capability string."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"{torch.cuda.get_device_name(device)} sm{major}{minor}"
    return cpu_description() if device.type == "cpu" else device.type


@functools.cache
def _triton_version() -> str:
    """The installed Triton's version, read without importing it, or ``"none"``."""
    for name in ("triton", "pytorch-triton"):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "none"


def timing_key(
    device: str, shape: Sequence[int], dtype: torch.dtype, schedule: NSSchedule, eps: float
) -> str:
    """One entry's key: everything its timings and its backends' correctness check depend
    on: ``device_key``, the torch and Triton versions, the (batched) shape as
    ``[batch x ]rows x cols``, dtype, steps, the coefficients (a digest of every step's
    triple and the norm scale) and eps."""
    dims = "x".join(str(int(d)) for d in shape)
    digest = hashlib.sha1(repr((schedule.coefficients, schedule.norm_scale)).encode()).hexdigest()
    return (
        f"{device} | torch {torch.__version__} | triton {_triton_version()} | {dims} | "
        f"{dtype} | {schedule.steps} steps, coefficients {digest[:12]}, eps {eps:g}"
    )


def _read(path: pathlib.Path) -> dict[str, Timings]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as err:
        logger.warning("ns_backend='auto': ignoring the unreadable timing cache %s: %s", path, err)
        return {}
    if not isinstance(data, dict):
        logger.warning("ns_backend='auto': ignoring the timing cache %s: not an object", path)
        return {}
    entries = {}
    for key, timings in data.items():
        if _is_timings(timings):
            entries[key] = timings
        else:
            logger.warning(
                "ns_backend='auto': ignoring the malformed timing cache entry %r in %s: %r "
                "(measured again)",
                key, path, timings,
            )  # fmt: skip
    return entries


def _is_timings(value) -> bool:
    """Milliseconds per backend name, finite and positive, torch's among them."""
    return (
        isinstance(value, dict)
        and "torch" in value
        and all(
            isinstance(name, str)
            and isinstance(ms, (int, float))
            and not isinstance(ms, bool)
            and math.isfinite(ms)
            and ms > 0
            for name, ms in value.items()
        )
    )


def load_timings(path: pathlib.Path | None = None) -> dict[str, Timings]:
    """Every cached entry (empty if there is no usable cache)."""
    return _read(path or cache_path())


def save_timings(entries: dict[str, Timings], path: pathlib.Path | None = None) -> None:
    """Add ``entries`` to the cache (read, merged and replaced under a lock, so ranks on
    one machine can save at once). A cache that cannot be written only costs a warning:
    the next run measures again."""
    if not entries:
        return
    path = path or cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            merged = {**_read(path), **entries}
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(merged, indent=1, sort_keys=True) + "\n", encoding="utf-8")
            os.replace(tmp, path)
    except OSError as err:
        with contextlib.suppress(OSError):
            path.with_suffix(f".{os.getpid()}.tmp").unlink()
        logger.warning("ns_backend='auto': could not write the timing cache %s: %s", path, err)
