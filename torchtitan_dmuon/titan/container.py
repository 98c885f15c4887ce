"""What DMuon's optimizer container does in either TorchTitan, importing neither.

One ``torchtitan_dmuon.Muon`` per model part (pipeline stages), inside TorchTitan's
``OptimizersContainer`` (so LR schedulers, step hooks such as MoE load balancing and
float8 scale precomputation keep working): :class:`DMuonContainer` holds the methods,
each adapter's container class puts them before its TorchTitan's
``OptimizersContainer`` (``titan/optimizer.py``, ``titan03/optimizer.py``). A part with
one data-parallel rank has no dedication: its ``Muon`` steps every selected matrix in
place.

Its state dict is topology-independent: keys are ``state.<param fqn>.<key>`` with wrapper
prefixes removed. An FSDP parameter's AdamW moments are DTensors (DCP reshards them); a
dedicated matrix's momentum is one whole tensor that only its primary owner puts in the
state dict, on save and on load alike, so it is saved once and a new topology's owner
reads it whole. The state a fresh optimizer would create is created here, without a
step: no rank steps (and enters a collective) to make its keys exist (TorchTitan 0.3's
``init_optim_state`` steps where a rank's state is empty).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import numbers
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from torchtitan_dmuon.engine import clip_grad_norm_, get_dedication
from torchtitan_dmuon.engine.checkpoint_geometry import as_saved, load_state_into
from torchtitan_dmuon.engine.param_layout import local_tensor
from torchtitan_dmuon.optim.config import AdamWConfig
from torchtitan_dmuon.optim.muon import SECOND_MOMENT
from torchtitan_dmuon.optim.normuon import second_moment_shape
from torchtitan_dmuon.optimizer import Muon
from torchtitan_dmuon.titan.config import DECAY_KEPT_BOUND, MuonRecipe, muon_recipe
from torchtitan_dmuon.titan.parallelize import clean_fqn, dmuon_settings, muon_predicate
from torchtitan_dmuon.titan.qk_clip import build_qk_clip

logger = logging.getLogger(__name__)

__all__ = [
    "DMuonContainer",
    "build_muon",
    "decay_kept",
    "log_decay",
    "log_recipe",
    "schedule_factors",
]

_MAX_UNLOGGED = 1000
"""Steps whose norms wait for a logging step at most (a loop that never logs reads them
then)."""


def schedule_factors(lr_schedulers, steps: int) -> list[float]:
    """The lr schedule's factor at each of a run's ``steps`` (TorchTitan's schedulers are
    ``LambdaLR``s, step ``s`` trains at factor ``lr_lambda(s - 1)``); 1.0 for each under a
    scheduler of another kind, whose schedule cannot be read ahead."""
    scheduler = lr_schedulers.schedulers[0]
    if isinstance(scheduler, LambdaLR):
        return [scheduler.lr_lambdas[0](step) for step in range(steps)]
    return [1.0] * steps


def decay_kept(lr: float, weight_decay: float, lr_factors: Sequence[float]) -> float:
    """What decoupled weight decay alone leaves of a parameter over steps whose lr is ``lr``
    times each of ``lr_factors``: the product of ``1 - lr x factor x weight_decay``."""
    return math.prod(1 - lr * factor * weight_decay for factor in lr_factors)


def log_decay(
    recipe: MuonRecipe, adamw_lr: float, adamw_weight_decay: float, lr_factors: Sequence[float]
) -> None:
    """Logs each group's lr and weight decay, the decay per step at the peak lr and what
    decay alone leaves of its values over the run, whose lr schedule is ``lr_factors`` (the
    factor of each step); warns, naming the group, where that is less than
    ``DECAY_KEPT_BOUND``."""
    steps = len(lr_factors)
    groups = [
        (who, lr, wd, source, decay_kept(lr, wd, lr_factors))
        for who, lr, wd, source in (
            ("the Muon matrices", recipe.lr, recipe.weight_decay,
             f"lr {recipe.lr_from}; weight_decay {recipe.weight_decay_from}"),
            ("the AdamW parameters", adamw_lr, adamw_weight_decay, "[optimizer]"),
        )
    ]  # fmt: skip
    logger.info(
        "DMuon recipe: %s",
        "; ".join(
            f"{who}: lr {lr:g}, weight decay {wd:g} ({source}): {lr * wd:.2g} a step at the "
            f"peak lr, {kept:.2f} of their values left by decay alone after the {steps} steps"
            for who, lr, wd, source, kept in groups
        ),
    )
    for who, lr, wd, _, kept in groups:
        if kept < DECAY_KEPT_BOUND:
            logger.warning(
                "DMuon: weight decay alone leaves %s %.2f of their values after the %d steps "
                "(lr %g x weight_decay %g over the lr schedule), less than %g, the least the "
                "convergence benchmark measured (docs/benchmarks.md#the-recipe): the recipe is "
                "unmeasured there",
                who, kept, steps, lr, wd, DECAY_KEPT_BOUND,
            )  # fmt: skip


def log_recipe(model: nn.Module, optimizer_config, lr_schedulers, steps: int) -> None:
    """:func:`log_decay` of the recipe a model part trains with: its ``[dmuon]`` section
    and the AdamW settings of ``optimizer_config``, over the run's lr schedule."""
    lr, weight_decay = optimizer_config.lr, optimizer_config.weight_decay
    log_decay(
        muon_recipe(dmuon_settings(model), lr, weight_decay),
        lr,
        weight_decay,
        schedule_factors(lr_schedulers, steps),
    )


def build_muon(model: nn.Module, optimizer_config, parallel_dims) -> Muon:
    """The part's ``Muon``: the ``[dmuon]`` section is its :class:`MuonConfig` (checked at
    parse time; lr and weight decay unset: :func:`muon_recipe`'s); AdamW's settings are
    ``optimizer_config``'s ``lr``, ``beta1``, ``beta2``, ``eps``, ``weight_decay`` and
    ``implementation`` (TorchTitan 0.2.2's ``[optimizer]``, and DMuon's container config
    in 0.3)."""
    settings = dmuon_settings(model)
    recipe = muon_recipe(settings, optimizer_config.lr, optimizer_config.weight_decay)
    settings = dataclasses.replace(settings, lr=recipe.lr, weight_decay=recipe.weight_decay)
    adamw = AdamWConfig(
        lr=optimizer_config.lr,
        betas=(optimizer_config.beta1, optimizer_config.beta2),
        eps=optimizer_config.eps,
        weight_decay=optimizer_config.weight_decay,
        # [optimizer] implementation, mapped as TorchTitan maps it for its own AdamW.
        foreach=optimizer_config.implementation == "foreach",
        fused=optimizer_config.implementation == "fused",
    )
    dedicated = get_dedication(model) is not None
    return Muon(
        model,
        settings,
        adamw=adamw,
        qk_clip=build_qk_clip(model, settings, parallel_dims),
        # One data-parallel rank (no dedication): the [dmuon] patterns select in place.
        predicate=None if dedicated else muon_predicate(settings),
    )


def _new_adamw_state(param: torch.Tensor, group: dict) -> dict:
    """The zero state torch.optim.AdamW creates at its first step (DCP loads into it)."""
    if group["fused"] or group["capturable"]:
        step = torch.zeros((), dtype=torch.float32, device=param.device)
    else:
        step = torch.tensor(0.0, dtype=torch.float32)
    return {
        "step": step,
        "exp_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
        "exp_avg_sq": torch.zeros_like(param, memory_format=torch.preserve_format),
    }


class DMuonContainer:
    """The methods of DMuon's optimizer container (see the module's docstring), over
    ``self.model_parts`` and ``self.optimizers`` (one ``Muon`` each), which the adapter's
    ``__init__`` sets, then :meth:`_start`.

    Attributes:
        step_seconds: See the property.
    """

    def _start(self) -> None:
        self._step_seconds = 0.0
        self._pending_timings: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        # Under "skip": the next step's found_inf, and the (step, norm) pairs whose warning
        # is logged at the next logging step (log_skipped_steps).
        self._found_inf: torch.Tensor | None = None
        self._unlogged_norms: list[tuple[int, torch.Tensor]] = []

    def clip_grad_norm_(
        self, max_norm: float, step: int, pp_group: dist.ProcessGroup | None = None
    ) -> torch.Tensor:
        """Clip the gradients to a global 2-norm of ``max_norm``; on a non-finite norm, do
        what ``[dmuon] nonfinite_grad_norm`` says. A collective: call it on every rank.

        ``"skip"`` (the default) decides on the device: the next :meth:`step` gets the
        norm's non-finiteness as ``found_inf`` and leaves everything bitwise as it was; the
        warning naming the step is logged by :meth:`log_skipped_steps` (the trainer calls
        it at each logging step). No host sync. ``"stop"`` reads the norm (one host sync a
        step) to raise at the step itself.

        Args:
            max_norm: The largest global gradient norm (``[training] max_norm``).
            step: The training step, for the messages.
            pp_group: Under pipeline parallelism, the group over the stages.

        Returns:
            The global gradient norm before clipping, equal on every rank.

        Raises:
            RuntimeError: The norm is not finite and the option is ``"stop"``.
        """
        norm = clip_grad_norm_(self.model_parts, max_norm, pp_group=pp_group)
        policy = dmuon_settings(self.model_parts[0]).nonfinite_grad_norm
        if policy == "continue":
            return norm
        if policy == "stop":
            if not torch.isfinite(norm).item():
                raise RuntimeError(
                    f"step {step}: the global gradient norm is {norm.item()}; stopping, as "
                    "[dmuon] nonfinite_grad_norm = 'stop' asks ('skip' skips such steps)"
                )
            return norm
        self._found_inf = ~torch.isfinite(norm)
        self._unlogged_norms.append((step, norm))
        if len(self._unlogged_norms) >= _MAX_UNLOGGED:  # a loop that never logs: bounded
            self.log_skipped_steps()
        return norm

    def log_skipped_steps(self) -> list[int]:
        """Log the warning of each step that ``"skip"`` skipped since the last call, reading
        their norms at once (one host sync; at a logging step, where TorchTitan reads the
        loss and the norm anyway).

        Returns:
            Those steps.
        """
        if not self._unlogged_norms:
            return []
        steps = [step for step, _ in self._unlogged_norms]
        norms = torch.stack([norm for _, norm in self._unlogged_norms]).tolist()
        self._unlogged_norms.clear()
        skipped = []
        for step, norm in zip(steps, norms, strict=True):
            if math.isfinite(norm):
                continue
            logger.warning(
                "step %d: the global gradient norm is %s; skipping the optimizer step "
                "([dmuon] nonfinite_grad_norm = 'skip')",
                step,
                norm,
            )
            skipped.append(step)
        return skipped

    @torch.no_grad()
    def divide_grads(self, divisor: torch.Tensor | float) -> None:
        """Divide every gradient of this rank by ``divisor`` (a number or a one-element
        tensor): ``p.grad`` (FSDP's and the other parameters') and the reduced gradients
        the owners hold."""
        for model, optimizer in zip(self.model_parts, self.optimizers, strict=True):
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            for g in grads:  # one-element divisor: no host sync, any device
                local_tensor(g).div_(divisor)
            optimizer.matrices.divide_grads(divisor)

    def step(self, *args, **kwargs) -> None:
        # Under "skip", a non-finite norm skips the step on the device (no host sync).
        found_inf, self._found_inf = self._found_inf, None
        if found_inf is not None:
            kwargs = dict(kwargs, found_inf=found_inf)
        if torch.cuda.is_available():
            # Timed by events, read when the figure is logged: no device sync per step.
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            for optimizer in self.optimizers:
                optimizer.step(*args, **kwargs)
            end.record()
            self._pending_timings.append((start, end))
            return
        start_time = time.perf_counter()
        for optimizer in self.optimizers:
            optimizer.step(*args, **kwargs)
        self._step_seconds += time.perf_counter() - start_time

    @property
    def step_seconds(self) -> float:
        """Time spent in ``step()`` (Newton-Schulz on the owned matrices, the Muon and
        AdamW updates, HSDP broadcast launch), summed since construction; on CUDA the
        device time between events, waited for here."""
        for start, end in self._pending_timings:
            end.synchronize()
            self._step_seconds += start.elapsed_time(end) / 1e3
        self._pending_timings.clear()
        return self._step_seconds

    # ---- topology-independent state ------------------------------------------------------
    def _entries(self):
        """``(fqn, state dict of the parameter, (dedication, entry) or None)`` for every
        parameter this rank saves and loads, creating the zero state a fresh optimizer
        would (so keys exist before the first step and DCP can load into them). A
        dedicated matrix's state tensors are saved as :func:`as_saved` says; the others
        as they are."""
        for model, optimizer in zip(self.model_parts, self.optimizers, strict=True):
            fqns = {id(p): clean_fqn(n) for n, p in model.named_parameters()}
            normuon = optimizer.param_groups[0]["variant"] == "normuon"
            dedication = get_dedication(model)
            if dedication is not None:
                owned = [
                    (entry.param, master, (dedication, entry))
                    for entry, master in dedication.primary_params()
                ]
            else:
                owned = [(p, p, None) for p in optimizer.param_groups[0]["params"]]
            for key, master, dedicated in owned:
                state = optimizer.state[key]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(master)
                if normuon and SECOND_MOMENT not in state:
                    state[SECOND_MOMENT] = master.new_zeros(second_moment_shape(master.shape))
                yield fqns[id(key)], state, dedicated
            group = optimizer.param_groups[1]
            for p in group["params"]:
                state = optimizer.state[p]
                if not state:
                    state.update(_new_adamw_state(p, group))
                yield fqns[id(p)], state, None

    @staticmethod
    def _hyperparameters(optimizer: Muon):
        """``(key in the state dict, group, key in the group)`` of the numeric group values."""
        for group, kind in zip(optimizer.param_groups, ("muon", "adamw"), strict=True):
            for key, value in group.items():
                if key == "normuon_beta2" and group["variant"] != "normuon":
                    continue  # Muon's checkpoints stay as they were
                if isinstance(value, numbers.Number) and not isinstance(value, bool):
                    yield f"param_groups.{kind}.{key}", group, key

    def state_dict(self) -> dict:
        sd = {
            # A tensor-parallel matrix's momentum is this rank's shard (saved as a
            # DTensor), a split stack's its piece (a ShardedTensor).
            f"state.{fqn}.{key}": (
                value
                if dedicated is None
                else as_saved(*dedicated, value, per_row=key == SECOND_MOMENT)
            )
            for fqn, state, dedicated in self._entries()
            for key, value in state.items()
        }
        for name, group, key in self._hyperparameters(self.optimizers[0]):
            sd[name] = group[key]
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        # DCP loads tensors in place into those state_dict() returned; a plain dict (not
        # from DCP) is copied.
        for fqn, state, dedicated in self._entries():
            for key, value in state.items():
                loaded = state_dict.get(f"state.{fqn}.{key}")
                if loaded is None or loaded is value:
                    continue
                if dedicated is None:
                    value.copy_(loaded)
                else:
                    load_state_into(*dedicated, value, loaded, per_row=key == SECOND_MOMENT)
        for optimizer in self.optimizers:
            for name, group, key in list(self._hyperparameters(optimizer)):
                if name in state_dict:
                    group[key] = state_dict[name]
