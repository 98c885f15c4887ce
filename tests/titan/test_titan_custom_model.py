"""A model of the user's own (``tests/support/custom_model.py``, registered by
``--experimental.custom_import`` as TorchTitan documents) under DMuon: its default
selection, the trainer run at 2 ranks against one process of torch.optim.Muon + AdamW, and
the refusal of a parallelize function DMuon cannot wrap, before any collective."""

from __future__ import annotations

import copy
import types

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torchtitan.components.loss import cross_entropy_loss
from torchtitan.components.lr_scheduler import build_lr_schedulers

from tests.support import custom_model
from tests.support.workers import reference_setup
from tests.titan.test_titan_dry_run import plan_report
from tests.titan.test_titan_integration import SHORT, run_train
from torchtitan_dmuon.titan import train_spec
from torchtitan_dmuon.titan.config import muon_recipe
from torchtitan_dmuon.titan.parallelize import resolve_selection, with_dedication

CONFIG = "train_configs/debug_cpu.toml"
CUSTOM = ["--experimental.custom_import", "tests.support.custom_model", "--model.flavor", "tiny",
          "--training.local_batch_size", "2", "--training.seq_len", "16"]  # fmt: skip
STEPS = 6
SELECTED = [
    f"layers.{i}.{name}.weight" for i in range(2) for name in ("mix", "w_in", "w_out")
]  # fmt: skip


def _job_config(*args: str):
    from torchtitan.config import ConfigManager

    return ConfigManager().parse_args(
        ["--job.config_file", CONFIG, *CUSTOM, *args,
         "--job.custom_config_module", "torchtitan_dmuon.titan.config"]
    )  # fmt: skip


def _meta_model(name: str = custom_model.NAME):
    spec = train_spec(name)
    with torch.device("meta"):
        return spec.model_cls(spec.model_args["tiny"])


def test_default_selection_of_an_unknown_model_is_its_block_linears(caplog):
    """A model without a selection of its own takes the 2-D weights of the nn.Linear
    layers inside its blocks (not the blocks' raw 2-D gate, the biases, embeddings or
    output head), as patterns over the block index, and says so in the log; a model with
    no such weight is refused, naming the flag."""
    cfg = _job_config("--model.name", custom_model.NAME)
    model = _meta_model()
    with caplog.at_level("INFO", logger="torchtitan_dmuon.titan.parallelize"):
        resolved = resolve_selection(model, cfg)
    patterns = ["layers.*.mix.weight", "layers.*.w_in.weight", "layers.*.w_out.weight"]
    assert resolved.params == patterns and cfg.dmuon is resolved
    assert resolved.hook_boundaries == []
    assert (
        f"[dmuon] params unset and model {custom_model.NAME} (tiny) has no selection of its "
        f"own (MODEL_SELECTIONS): DMuon takes the 2-D weights of the nn.Linear layers inside "
        f"its blocks, 6 matrices: {patterns}" in caplog.text
    )

    bad = _job_config("--model.name", custom_model.NAME, "--dmuon.params", "layers.*.w9.weight")
    with pytest.raises(ValueError, match=r"its default selection \(leave \[dmuon\] params empty\)"):
        resolve_selection(model, bad)

    for layer in model.layers.values():  # no nn.Linear left inside the blocks
        layer.mix, layer.w_in, layer.w_out = nn_identity(), nn_identity(), nn_identity()
    with pytest.raises(ValueError, match=r"no nn.Linear weight inside its blocks.*--dmuon.params"):
        resolve_selection(model, _job_config("--model.name", custom_model.NAME))


def nn_identity() -> torch.nn.Module:
    return torch.nn.Identity()


def _shards_elsewhere(model, parallel_dims, job_config):
    raise AssertionError("DMuon must refuse before the function runs")


def test_parallelize_without_hookable_names_is_refused_before_it_runs():
    """A parallelize function whose module names none of apply_fsdp, fully_shard or
    apply_ddp (FSDP through another module) is refused under data parallelism before it
    runs, naming it and what to change; no process group exists here, so no collective
    could have run. Without DMuon, or with one data-parallel rank, it runs as it is."""
    assert not {"apply_fsdp", "fully_shard", "apply_ddp"} & set(globals())
    assert not torch.distributed.is_initialized()
    cfg = _job_config("--model.name", custom_model.NAME)
    dims = types.SimpleNamespace(
        dp_enabled=True, fsdp_enabled=True, dp_replicate_enabled=False, world_size=2,
        dp_replicate=1, pp_enabled=False, ep_enabled=False, tp_enabled=False,
    )  # fmt: skip
    wrapped = with_dedication(_shards_elsewhere)
    with pytest.raises(ValueError) as error:
        wrapped(_meta_model(), dims, cfg)
    message = str(error.value)
    assert f"cannot train model {custom_model.NAME}" in message
    assert f"{__name__}._shards_elsewhere has none of these names in its module" in message
    assert "from torch.distributed.fsdp import fully_shard" in message
    adamw = copy.deepcopy(cfg)
    adamw.optimizer.name = "AdamW"
    one_rank = types.SimpleNamespace(**vars(dims))
    one_rank.dp_enabled = one_rank.fsdp_enabled = False
    for job_config, parallel_dims in ((adamw, dims), (cfg, one_rank)):
        with pytest.raises(AssertionError, match="must refuse before the function runs"):
            wrapped(_meta_model(), parallel_dims, job_config)


def test_unwrappable_parallelize_fails_on_every_rank_before_training(tmp_path):
    """The spec whose parallelize function shards through ``fsdp.fully_shard`` (an
    attribute DMuon does not replace) stops at 2 ranks: each rank raises the error naming
    the function and the names to use, by itself (exit code 1, not killed for a peer),
    and no step runs."""
    run = run_train(
        [*SHORT[:2], *CUSTOM, "--model.name", custom_model.UNWRAPPABLE], 2, tmp_path / "bad", CONFIG
    )
    assert run.returncode == 1 and not run.losses, run.output[-3000:]
    expected = (
        "tests.support.custom_model.parallelize_unwrappable applied data parallelism without "
        "calling any of these names"
    )
    for rank in range(2):
        log = (tmp_path / "bad_logs" / f"rank{rank}" / "stderr.log").read_text()
        assert expected in log, log[-3000:]
        assert "ValueError: [optimizer] name = 'DMuon' cannot train model" in log


def _reference(steps: int, cfg) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process: torch.optim.Muon on :data:`SELECTED`, AdamW on the rest, TorchTitan's
    LR schedule and clipping, on the whole global batches; from the model's own init."""
    args = custom_model.FLAVORS["tiny"]
    model = custom_model.CustomModel(args)
    model.init_weights()
    muon = [p for n, p in model.named_parameters() if n in SELECTED]
    rest = [p for n, p in model.named_parameters() if n not in SELECTED]
    opt = cfg.optimizer
    recipe = muon_recipe(cfg.dmuon, opt.lr, opt.weight_decay)
    optimizers = [
        torch.optim.Muon(
            muon, lr=recipe.lr, momentum=cfg.dmuon.momentum, nesterov=True,
            weight_decay=recipe.weight_decay, ns_steps=cfg.dmuon.ns_steps,
        ),
        torch.optim.AdamW(
            rest, lr=opt.lr, betas=(opt.beta1, opt.beta2), eps=opt.eps,
            weight_decay=opt.weight_decay, fused=True,
        ),
    ]  # fmt: skip
    schedulers = build_lr_schedulers(optimizers, cfg.lr_scheduler, steps)
    rows = 2 * cfg.training.local_batch_size
    losses = []
    for step in range(steps):
        tokens = custom_model.global_batch(step, rows, cfg.training.seq_len, args.vocab_size)
        for o in optimizers:
            o.zero_grad()
        loss = cross_entropy_loss(model(tokens[:, :-1]), tokens[:, 1:]) / tokens[:, 1:].numel()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.training.max_norm)
        for o in optimizers:
            o.step()
        schedulers.step()
        losses.append(loss.item())
    return losses, {n: p.detach() for n, p in model.named_parameters()}


def test_custom_model_trains_with_dmuon_and_equals_one_process_muon_and_adamw(tmp_path):
    """The model registered by --experimental.custom_import trains with DMuon at 2 ranks
    (FSDP2 applied by its own fully_shard calls, DMuon dedicating its 6 block linears
    before the first): the logged losses and every parameter after 6 steps (its last
    checkpoint) equal torch.optim.Muon + AdamW in one process on the global batches
    (fp32 Newton-Schulz), the LR schedule and clipping TorchTitan's."""
    args = [*SHORT, *CUSTOM, "--model.name", custom_model.NAME, "--checkpoint.enable",
            "--checkpoint.interval", str(STEPS), "--checkpoint.last_save_model_only"]  # fmt: skip
    run = run_train(args, 2, tmp_path / "run", CONFIG)
    assert run.returncode == 0, run.output[-4000:]
    assert sorted(run.losses) == list(range(1, STEPS + 1)), run.output[-3000:]
    assert "DMuon takes the 2-D weights of the nn.Linear layers inside its blocks" in run.output
    assert "dmuon: optimizer step" in run.output

    cfg = _job_config("--model.name", custom_model.NAME, *SHORT[4:])
    with reference_setup(torch.float32):
        expected, reference = _reference(STEPS, cfg)
    assert expected[-1] < expected[0]
    assert [run.losses[s] for s in range(1, STEPS + 1)] == pytest.approx(expected, abs=2e-5)
    saved = {n: torch.empty_like(v) for n, v in reference.items()}
    dcp.load(saved, checkpoint_id=str(tmp_path / "run" / "checkpoint" / f"step-{STEPS}"))
    for name, value in reference.items():
        torch.testing.assert_close(saved[name], value, rtol=1e-4, atol=1e-5, msg=name)


def test_plan_report_reads_the_custom_import(tmp_path):
    """The plan report command imports ``[experimental] custom_import`` as the trainer
    does, and counts the user's model at 8 simulated ranks: its 6 block linears, one
    owner each."""
    line, report = plan_report(8, tmp_path, *CUSTOM, "--model.name", custom_model.NAME)
    assert "of 6 matrices" in line, line
    assert sum(r["owned"] for r in report["parts"][0]["ranks"]) == 6


def test_fully_shard_without_a_data_parallel_mesh_is_refused_by_name():
    """A parallelize function that calls fully_shard without ``mesh=``, or over a mesh DMuon
    cannot dedicate over (dims other than TorchTitan's data-parallel ones), is refused
    naming the function and the mesh; a 1-D mesh and TorchTitan's HSDP mesh are taken."""
    from torchtitan_dmuon.titan.parallelize import _fully_shard_mesh

    cfg = _job_config("--model.name", custom_model.NAME)
    with pytest.raises(ValueError, match="calls fully_shard without mesh=") as error:
        _fully_shard_mesh(None, _shards_elsewhere, cfg)
    assert f"{__name__}._shards_elsewhere" in str(error.value)
    other = types.SimpleNamespace(ndim=2, mesh_dim_names=("dp_shard", "tp"))
    with pytest.raises(ValueError, match=r"mesh of dims \('dp_shard', 'tp'\)"):
        _fully_shard_mesh(other, _shards_elsewhere, cfg)
    for mesh in (
        types.SimpleNamespace(ndim=1, mesh_dim_names=("fsdp",)),
        types.SimpleNamespace(ndim=2, mesh_dim_names=("dp_replicate", "fsdp")),
    ):
        assert _fully_shard_mesh(mesh, _shards_elsewhere, cfg) is mesh
