"""``ns_dtype="auto"``: the Newton-Schulz compute dtype a device runs fastest.

bf16 halves the bytes of every Newton-Schulz matmul and is what tensor cores and CPUs with
native bf16 (AVX512-BF16, AMX) multiply fastest; elsewhere, e.g. a CPU with AVX2 only, a
bf16 matmul is emulated and runs tens of times slower than fp32. So ``"auto"`` is bf16
where the device has native bf16 and one short probe confirms that bf16 is not slower
than fp32, and fp32 everywhere else. The verdict is local to this process (probed once per
device); the engine makes every rank of a job agree on one
(:mod:`torchtitan_dmuon.engine.agreement`).

:data:`VERDICT_ENV` replaces the probe: ``TORCHTITAN_DMUON_AUTO_NS_DTYPE=bfloat16`` makes
this machine choose as one with native bf16 does, ``=float32`` as an AVX2-only CPU does,
so that either kind of machine can run what the other would (the test suite runs its
verdict-sensitive tests both ways).

This module does not import ``torch.distributed``.
"""

from __future__ import annotations

import functools
import os
import platform
import statistics
import time
from dataclasses import dataclass

import torch

__all__ = [
    "VERDICT_ENV",
    "NSDtypeVerdict",
    "cpu_description",
    "forced_ns_dtype",
    "local_ns_dtype",
    "other_verdict",
    "parse_ns_dtype",
]

VERDICT_ENV = "TORCHTITAN_DMUON_AUTO_NS_DTYPE"
"""Environment variable that, when set, is ``"auto"``'s verdict instead of the probe's:
``bfloat16`` or ``float32``."""
_VERDICTS = ("bfloat16", "float32")

_PROBE_SIDE = 256
_PROBE_REPEATS = 5
_X86 = {"x86_64", "amd64", "i386", "i686"}


@dataclass(frozen=True)
class NSDtypeVerdict:
    """A Newton-Schulz dtype and why it was chosen.

    Attributes:
        dtype: The compute dtype.
        reason: One line for the log, naming the device and what decided.
    """

    dtype: torch.dtype
    reason: str


def parse_ns_dtype(value: torch.dtype | str) -> torch.dtype | str:
    """``value`` as a floating ``torch.dtype``, or ``"auto"``.

    Raises:
        ValueError: Neither ``"auto"``, a floating dtype nor the name of one.
    """
    if value == "auto":
        return value
    dtype = getattr(torch, value, None) if isinstance(value, str) else value
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"ns_dtype must be 'auto' or a floating torch.dtype, got {value!r}")
    return dtype


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


def _device_description(device: torch.device) -> str:
    """What a verdict's reason names: the CPU's model and capability, else the device type."""
    return cpu_description() if device.type == "cpu" else device.type


def _matmul_ms(dtype: torch.dtype, device: torch.device) -> float:
    """The median of :data:`_PROBE_REPEATS` timed matmuls (one sample flips the verdict
    under load). Its own generator: the probe leaves the global RNG, and so a model
    initialized after it, as it found them."""
    generator = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(_PROBE_SIDE, _PROBE_SIDE, device=device, generator=generator).to(dtype)
    a @ a  # warm-up: kernel selection, first-touch
    samples = []
    for _ in range(_PROBE_REPEATS):
        start = time.perf_counter()
        a @ a
        if device.type != "cpu":
            torch.accelerator.synchronize(device)
        samples.append(1e3 * (time.perf_counter() - start))
    return statistics.median(samples)


def _native_cpu_bf16() -> bool:
    """Whether this CPU has bf16 instructions torch's kernels use. Only x86 can be asked;
    elsewhere (e.g. ARM's BF16 extension) the probe alone decides."""
    if platform.machine().lower() not in _X86:
        return True
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def forced_ns_dtype() -> torch.dtype | None:
    """The verdict :data:`VERDICT_ENV` sets, or None when it is unset or empty.

    Raises:
        ValueError: It is set to anything but ``bfloat16`` or ``float32``.
    """
    value = os.environ.get(VERDICT_ENV, "")
    if not value:
        return None
    if value not in _VERDICTS:
        raise ValueError(f"{VERDICT_ENV} must be one of {_VERDICTS} (or unset), got {value!r}")
    return getattr(torch, value)


def other_verdict(device: torch.device) -> str:
    """The name of the dtype ``"auto"`` does NOT pick on ``device`` (the probe's verdict,
    or :data:`VERDICT_ENV`'s): the value of :data:`VERDICT_ENV` that makes this machine
    choose as the other kind does."""
    return "float32" if local_ns_dtype(device).dtype == torch.bfloat16 else "bfloat16"


def local_ns_dtype(device: torch.device) -> NSDtypeVerdict:
    """What ``"auto"`` picks on ``device`` in this process.

    :data:`VERDICT_ENV`, when set. Otherwise CUDA: bf16 where the GPU supports it
    natively. CPU: fp32 unless it has native bf16; then, and on other accelerators,
    256^3 matmuls in each dtype decide (bf16 if its median time is not slower). The probe runs once
    per process and device.

    Raises:
        ValueError: :data:`VERDICT_ENV` holds neither ``bfloat16`` nor ``float32``.
    """
    forced = forced_ns_dtype()
    if forced is not None:
        name = str(forced).removeprefix("torch.")
        return NSDtypeVerdict(
            forced, f"{_device_description(device)}: {VERDICT_ENV}={name} (the probe is skipped)"
        )
    return _probed_ns_dtype(device)


@functools.cache
def _probed_ns_dtype(device: torch.device) -> NSDtypeVerdict:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        if torch.cuda.is_bf16_supported(including_emulation=False):
            return NSDtypeVerdict(torch.bfloat16, f"{name} multiplies bf16 natively")
        return NSDtypeVerdict(torch.float32, f"{name} has no native bf16")
    where = _device_description(device)
    if device.type == "cpu" and not _native_cpu_bf16():
        return NSDtypeVerdict(
            torch.float32, f"{where} has no native bf16 (no AVX512-BF16 or AMX): fp32"
        )
    bf16_ms = _matmul_ms(torch.bfloat16, device)
    fp32_ms = _matmul_ms(torch.float32, device)
    probe = f"{_PROBE_SIDE}^3 matmul: bf16 {bf16_ms:.2f} ms, fp32 {fp32_ms:.2f} ms"
    if bf16_ms <= fp32_ms:
        return NSDtypeVerdict(torch.bfloat16, f"{where}: {probe}")
    return NSDtypeVerdict(torch.float32, f"{where}: bf16 is slower ({probe})")
