"""CPU support for TorchTitan 0.2.2: the patches that let its trainer run on gloo.

TorchTitan targets accelerators. On a machine without one (CI, laptops) this layer:

* selects the ``"cpu"`` device (TorchTitan falls back to ``"cuda"``), hence the gloo
  backend, in every module that copied ``device_type`` at import;
* gives the memory monitor, profiler and process-group code a ``device_module`` with the
  few functions they call (memory is the process's peak resident set);
* makes FSDP2 reduce with plain SUM: TorchTitan disables FSDP's gradient division (the
  loss is already normalized over the global batch), which FSDP2 implements with
  ``PREMUL_SUM``, an op gloo does not have (in llama3's, llama4's, the vlm experiment's
  and, where ``transformers`` is installed, the HF backend's parallelize modules);
* profiles the CPU alone: TorchTitan's profiler asks for its GPU activity, ``None``
  without a GPU, which ``torch.profiler.profile`` refuses;
* lets MoE routers count tokens (``torch.histc`` has no integer CPU kernel), keeps
  qwen3's MoE off the Triton-only grouped-GEMM padding path and permutes the tokens of
  expert parallelism with TorchTitan's CPU implementation, not its Triton kernel;
* turns the c10d flight recorder off unless the user sized it (it fragments the heap),
  and asks for gloo once under CPU offloading;

:func:`enable_cpu_support` applies it only when no CUDA device is present (GPU runs never
go through it), and refuses to on a machine with NVIDIA GPUs that torch cannot see (a CPU
build of torch set up on a login node: the job would train on the CPUs), through the
trainer's :class:`~torchtitan_dmuon.titan.patches.PatchRegistry`,
which undoes all of it when the trainer ends.
"""

from __future__ import annotations

import functools
import logging
import os
import resource
import shutil
import subprocess
import types

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from torchtitan_dmuon.titan import hf, vlm
from torchtitan_dmuon.titan.patches import PatchRegistry

logger = logging.getLogger(__name__)

__all__ = [
    "cpu_device_module",
    "disable_fsdp_gradient_division_with_sum",
    "enable_cpu_support",
    "refuse_unused_gpus",
]


def _process_memory_stats(*args, **kwargs) -> dict[str, int]:
    """The process's peak resident memory, in the keys TorchTitan's monitor reads (the
    peak is never reset on CPU: it is the peak since the process started)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    return {"active_bytes.all.peak": peak, "reserved_bytes.all.peak": peak}


def cpu_device_module() -> types.SimpleNamespace:
    """The functions of a ``device_module`` TorchTitan calls, for the CPU."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return types.SimpleNamespace(
        set_device=lambda *args, **kwargs: None,
        current_device=lambda: 0,
        device_count=lambda: 1,
        synchronize=lambda *args, **kwargs: None,
        get_device_name=lambda *args, **kwargs: "cpu",
        get_device_properties=lambda *args, **kwargs: types.SimpleNamespace(total_memory=total),
        memory_stats=_process_memory_stats,
        reset_peak_memory_stats=lambda *args, **kwargs: None,
        empty_cache=lambda *args, **kwargs: None,
    )


def disable_fsdp_gradient_division_with_sum(model: nn.Module) -> None:
    """TorchTitan's ``disable_fsdp_gradient_division``, reducing with SUM (gloo)."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


def _permute_indices_on_cpu(generate_permute_indices):
    """TorchTitan's ``generate_permute_indices`` (expert-parallel token permutation) with
    its CPU implementation for CPU tensors: the default path launches a Triton kernel."""

    @functools.wraps(generate_permute_indices)
    def wrapper(tokens_per_expert_group, *args, use_cpu: bool = False, **kwargs):
        use_cpu = use_cpu or tokens_per_expert_group.device.type == "cpu"
        return generate_permute_indices(tokens_per_expert_group, *args, use_cpu=use_cpu, **kwargs)

    return wrapper


def _histc_any_dtype(histc):
    @functools.wraps(histc)
    def wrapper(input, *args, **kwargs):
        if input.is_floating_point():
            return histc(input, *args, **kwargs)
        return histc(input.float(), *args, **kwargs).to(input.dtype)

    return wrapper


class _ProfileWithoutMissingActivities(torch.profiler.profile):
    """``torch.profiler.profile`` that drops ``None`` activities (TorchTitan's
    ``maybe_enable_profiling`` passes ``[CPU, None]`` where there is no GPU)."""

    def __init__(self, *args, activities=None, **kwargs) -> None:
        if activities is not None:
            activities = [a for a in activities if a is not None]
        super().__init__(*args, activities=activities, **kwargs)


def _cpu_init_distributed(init_distributed):
    """TorchTitan's ``init_distributed`` for CPU: gloo alone, and the c10d flight recorder
    off unless the user sized it (``--comm.trace_buf_size`` other than TorchTitan's
    default).

    CPU offloading (``--training.enable_cpu_offload``) asks for a CPU backend beside the
    device's, ``"cpu:gloo,cpu:gloo"`` when the device is the CPU, which torch refuses: on
    CPU the device's gloo serves both.

    The recorder keeps a small entry per collective for the next ``trace_buf_size``
    collectives. On CPU those long-lived entries land between the blocks a step frees
    and allocates again (gathered parameters, gradients, activations) and fragment
    glibc's heap, which then keeps the freed memory: the process grows step after step,
    the more the more collectives a step issues. Its use, dumps of NCCL hangs, does not
    apply to gloo. (Mapping every large block on its own also stops the growth, but
    costs a third of the CPU throughput in page faults.)
    """
    from torchtitan.config.job_config import Comm

    default_size = Comm().trace_buf_size

    @functools.wraps(init_distributed)
    def wrapper(comm_config, enable_cpu_backend=False, *args, **kwargs):
        del enable_cpu_backend  # on CPU the device's gloo serves offloading too
        if comm_config.trace_buf_size == default_size:
            comm_config.trace_buf_size = 0
            logger.info(
                "CPU: the c10d flight recorder is off (it fragments the heap on CPU); "
                "--comm.trace_buf_size N other than %d turns it on",
                default_size,
            )
        return init_distributed(comm_config, False, *args, **kwargs)

    return wrapper


ALLOW_CPU_ENV = "DMUON_ALLOW_CPU"
"""Set to 1 to train on the CPUs of a machine whose NVIDIA GPUs torch cannot use."""


def _unused_nvidia_gpus() -> int:
    """How many GPUs ``nvidia-smi -L`` lists (0 without the tool or a driver)."""
    tool = shutil.which("nvidia-smi")
    if tool is None:
        return 0
    try:
        listed = subprocess.run([tool, "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return 0
    if listed.returncode != 0:
        return 0
    return sum(line.startswith("GPU ") for line in listed.stdout.splitlines())


def refuse_unused_gpus() -> None:
    """Refuse to train on the CPUs of a machine whose NVIDIA GPUs torch cannot use.

    Raises:
        RuntimeError: ``nvidia-smi -L`` lists GPUs, ``DMUON_ALLOW_CPU`` is not 1.
    """
    gpus = _unused_nvidia_gpus()
    if gpus and os.environ.get(ALLOW_CPU_ENV) != "1":
        raise RuntimeError(
            f"this machine has {gpus} NVIDIA GPU(s) (nvidia-smi -L), but torch "
            f"{torch.__version__} cannot use them (torch.cuda.is_available() is False: a CPU "
            "build, e.g. set up on a node without GPUs): run ./scripts/setup.sh on this node "
            "(it installs CUDA torch; DMUON_TORCH_INDEX_URL names the wheel index, e.g. "
            f"https://download.pytorch.org/whl/cu128), or set {ALLOW_CPU_ENV}=1 to train on "
            "the CPUs"
        )


def enable_cpu_support(patches: PatchRegistry) -> bool:
    """Apply the CPU layer through ``patches`` if there is no CUDA device. Returns whether
    it is active.

    Raises:
        RuntimeError: The machine has NVIDIA GPUs that this torch cannot use (a CPU build,
            or one without a matching driver), unless ``DMUON_ALLOW_CPU=1``.
    """
    if torch.cuda.is_available():
        return False
    refuse_unused_gpus()
    import torchtitan.components.metrics as metrics
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.distributed.utils as dist_utils
    import torchtitan.models.llama3.infra.parallelize as llama3_parallelize
    import torchtitan.models.llama4.infra.parallelize as llama4_parallelize
    import torchtitan.models.moe.utils as moe_utils
    import torchtitan.tools.profiling as profiling
    import torchtitan.tools.utils as tools_utils
    from torchtitan.models.qwen3 import qwen3_args

    device_module = cpu_device_module()
    for module in (tools_utils, dist_utils, metrics):
        patches.setattr(module, "device_type", "cpu")
        patches.setattr(module, "device_module", device_module)
    patches.setattr(parallel_dims, "device_type", "cpu")
    patches.setattr(profiling, "device_module", device_module)
    fsdp_modules = [llama3_parallelize, llama4_parallelize]
    if hf.available():
        # The HF backend imported llama3's function under the same name into its own module.
        import torchtitan.experiments.transformers_modeling_backend.infra.parallelize as hf_par

        fsdp_modules.append(hf_par)
    if vlm.available():
        # The vlm experiment imported it too (from llama3's module) into its own.
        import torchtitan.experiments.vlm.infra.parallelize as vlm_par

        fsdp_modules.append(vlm_par)
    for module in fsdp_modules:
        patches.setattr(
            module, "disable_fsdp_gradient_division", disable_fsdp_gradient_division_with_sum
        )
    patches.setattr(torch, "histc", _histc_any_dtype(torch.histc))
    patches.setattr(
        moe_utils,
        "generate_permute_indices",
        _permute_indices_on_cpu(moe_utils.generate_permute_indices),
    )
    patches.setattr(torch.profiler, "profile", _ProfileWithoutMissingActivities)
    for args in qwen3_args.values():
        patches.setattr(args.moe_args, "use_grouped_mm", False)
    patches.setattr(
        dist_utils,
        "init_distributed",
        _cpu_init_distributed(dist_utils.init_distributed),
    )
    logger.info("TorchTitan CPU support enabled: device cpu, gloo, SUM reductions")
    return True
