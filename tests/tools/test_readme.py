"""The parallelism snippets of docs/parallelism.md, run as written: each one prepares
``model`` on 4 gloo ranks and builds ``optimizer``; four steps of it then equal one-process
torch.optim.Muon + torch.optim.AdamW (Muon's defaults) on the whole batch. And the cluster
guide's commands (docs/cluster.md) each name their test or say they need a GPU."""

from __future__ import annotations

import re

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

import torchtitan_dmuon as dmuon
from tests.support.dist import run_distributed
from tests.support.models import TokenModel, batch, loss_fn, proj_predicate
from tests.support.workers import (
    full_params,
    loss_tolerance,
    reference_setup,
    train_one_process,
    trained_tolerance,
)
from tests.titan.test_titan_integration import ROOT

# The snippets leave ns_dtype at "auto": run with each kind of CPU's verdict.
pytestmark = pytest.mark.ns_verdict

STEPS, SAMPLES, SEQ, VOCAB = 4, 8, 8, 64
WORLD = 4
# Muon's defaults, as the snippets build it.
MUON_DEFAULTS = dict(lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.0)
ADAMW_DEFAULTS = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, fused=True)


def guide_snippets() -> dict[str, str]:
    """The Python blocks of docs/parallelism.md's parallelism guide, by their first word."""
    page = (ROOT / "docs" / "parallelism.md").read_text()
    guide = page[page.index("## Parallelism guide") :].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", guide, flags=re.S)
    return {block.split()[1].rstrip(":"): block for block in blocks}


def _model() -> TokenModel:
    torch.manual_seed(0)
    return TokenModel(VOCAB)


def snippet_worker(rank: int, world: int, snippets: dict[str, str]) -> dict[str, dict]:
    results = {}
    for name, code in snippets.items():
        model = _model()
        scope = dict(
            dmuon=dmuon,
            init_device_mesh=init_device_mesh,
            fully_shard=fully_shard,
            parallelize_module=parallelize_module,
            ColwiseParallel=ColwiseParallel,
            RowwiseParallel=RowwiseParallel,
            model=model,
            predicate=proj_predicate,
            world_size=world,
        )
        exec(code, scope)
        optimizer, dedication = scope["optimizer"], dmuon.get_dedication(model)
        dp_size = dedication.shard_size * dedication.replicate_size
        dp_rank = dedication.replicate_rank * dedication.shard_size + dedication.shard_rank
        per = SAMPLES // dp_size
        losses = []
        for step in range(STEPS):
            inputs, targets = batch(100 + step, SAMPLES, SEQ, VOCAB)
            mine = slice(dp_rank * per, (dp_rank + 1) * per)
            optimizer.zero_grad()
            loss = loss_fn(model, inputs[mine], targets[mine])
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        names = {n for n, p in model.named_parameters() if proj_predicate(n, p)}
        results[name] = {
            "losses": losses,
            "dp": (dp_rank, dp_size),
            "params": full_params(model, names),
            "ns_dtype": optimizer.ns.dtype,
            "ns_backend": optimizer.ns.backend,
        }
        dedication.wait_replicas()
    return results


@pytest.fixture(scope="module")
def snippet_runs() -> list[dict[str, dict]]:
    return run_distributed(snippet_worker, WORLD, guide_snippets(), timeout=300)


def test_guide_has_its_snippets():
    assert sorted(guide_snippets()) == ["DDP", "FSDP", "HSDP", "TP"]


@pytest.mark.parametrize("name", ["DDP", "FSDP", "HSDP", "TP"])
def test_guide_snippet_trains_like_one_process(name, snippet_runs):
    by_rank = [r[name] for r in snippet_runs]
    ns_dtype = by_rank[0]["ns_dtype"]
    with reference_setup(ns_dtype):
        model = _model()
        expected = train_one_process(
            model,
            STEPS,
            lambda m, step: loss_fn(m, *batch(100 + step, SAMPLES, SEQ, VOCAB)),
            muon_kw=MUON_DEFAULTS,
            adamw_kw=ADAMW_DEFAULTS,
        )
    # Each data-parallel rank's loss once (TP peers compute the same one).
    firsts = {r["dp"]: r["losses"] for r in by_rank}
    dp_size = by_rank[0]["dp"][1]
    assert len(firsts) == dp_size
    losses = [sum(step) / dp_size for step in zip(*firsts.values(), strict=True)]
    torch.testing.assert_close(losses, expected, **loss_tolerance(ns_dtype))
    # The largest shape-adjusted lr (torch.optim.Muon's sqrt(max(1, rows / cols))).
    reference = dict(model.named_parameters())
    lr = max(
        MUON_DEFAULTS["lr"] * max(1.0, p.shape[0] / p.shape[1]) ** 0.5
        for n, p in reference.items()
        if proj_predicate(n, p)
    )
    tolerance = trained_tolerance(ns_dtype, lr=lr, steps=STEPS, ns_backend=by_rank[0]["ns_backend"])
    for r in by_rank:
        for param, value in r["params"].items():
            torch.testing.assert_close(value, reference[param].detach(), **tolerance)


def test_cluster_guide_commands_are_tested_or_need_a_gpu():
    """Every command of docs/cluster.md's cluster guide either names the test that runs it
    (``# tested: tests/LAYER/FILE::TEST``, and that test exists) or says it needs a GPU."""
    page = (ROOT / "docs" / "cluster.md").read_text()
    guide = page.split("## From a laptop to a cluster", 1)[1].split("\n## ", 1)[0]
    commands = [
        line
        for block in re.findall(r"```bash\n(.*?)```", guide, re.S)
        for line in block.splitlines()
        if line.strip()
    ]
    assert len(commands) >= 8
    for command in commands:
        tested = re.search(r"# .*tested: (tests/[\w/]+\.py)::(\w+)", command)
        assert tested or "# needs a GPU" in command, command
        if tested:
            path, name = tested.groups()
            assert f"\ndef {name}(" in (ROOT / path).read_text(), command
