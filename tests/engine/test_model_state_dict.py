"""A dedicated model's own ``state_dict`` and ``load_state_dict`` (the engine's state-dict
hooks, ``register_state_dict_hooks``): each dedicated matrix is in the state dict of its
primary owner only, as its full value; a load puts a value where the owner keeps it, and
every rank's next forward uses it; a matrix a rank does not own is never missing there,
one it owns is. 2 gloo ranks, Z3 (the values other ranks hold are freed between uses),
and HSDP 2 x 2 (a replica's copy comes from its primary after a load)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from tests.support.dist import run_distributed
from tests.support.models import batch, loss_fn, make_model, proj_predicate
from tests.support.workers import MUON_KW, full_params
from torchtitan_dmuon import Muon, dedicate_params

LAYERS = 2


def _shifted(values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """New values for every parameter, the same on every rank."""
    return {name: value * 0.5 + 0.01 for name, value in values.items()}


def state_dict_worker(rank, world, replicate):
    if replicate > 1:
        mesh = init_device_mesh("cpu", (replicate, world // replicate), mesh_dim_names=("r", "s"))
        dedication = dedicate_params(
            make_model(seed=0, layers=LAYERS), mesh["s"], proj_predicate,
            replicate_mesh=mesh["r"],
        )  # fmt: skip
    else:
        mesh = init_device_mesh("cpu", (world,))
        dedication = dedicate_params(make_model(seed=0, layers=LAYERS), mesh, proj_predicate)
    model = dedication.model
    names = {d.name for d in dedication.plan.params}
    opt = Muon(model, **MUON_KW, ns_dtype=torch.float32)
    loss_fn(model, *batch(rank, 2)).backward()
    opt.step()
    opt.zero_grad()
    full = full_params(model, names)
    state = model.state_dict()
    saved = {name: state[name].clone() for name in names if name in state}
    primary = {entry.name for entry, _ in dedication.primary_params()}
    new = _shifted(full)
    loaded = model.load_state_dict(new, strict=True)
    after = full_params(model, names)
    with torch.no_grad():
        loss = float(loss_fn(model, *batch(99, 2)))
    partial = model.load_state_dict(
        {k: v for k, v in new.items() if k not in primary}, strict=False
    )
    result = {
        "full": full,
        "saved": saved,
        "others": sorted(k for k in state if k not in names),
        "primary": primary,
        "loaded_missing": loaded.missing_keys,
        "after": after,
        "loss": loss,
        "partial_missing": sorted(partial.missing_keys),
    }
    del opt, model, dedication
    return result


@pytest.mark.parametrize(("world", "replicate"), [(2, 1), (4, 2)], ids=["fsdp", "hsdp"])
def test_each_matrix_is_saved_by_its_owner_and_loaded_where_it_is_kept(world, replicate):
    by_rank = run_distributed(state_dict_worker, world, replicate, timeout=240)
    names = {
        n for n, p in make_model(seed=0, layers=LAYERS).named_parameters() if proj_predicate(n, p)
    }
    full = by_rank[0]["full"]
    # Saved once, by the primary owner, as the full value; the rest by every rank.
    saved_by = {}
    for rank, result in enumerate(by_rank):
        assert set(result["saved"]) == result["primary"]
        for name, value in result["saved"].items():
            assert name not in saved_by, f"{name} saved by ranks {saved_by[name]} and {rank}"
            saved_by[name] = rank
            assert torch.equal(value, full[name]), name
        assert result["others"] == by_rank[0]["others"]
    assert set(saved_by) == names
    # Every rank is the primary owner of some (HSDP spreads them over the replicas too).
    assert set(saved_by.values()) == set(range(world))
    # Loaded where the owner keeps it: every rank's full values and next loss are the new
    # values' (one process: the same model holding them).
    reference = make_model(seed=0, layers=LAYERS)
    new = _shifted(full)
    reference.load_state_dict(new)
    with torch.no_grad():
        expected_loss = float(loss_fn(reference, *batch(99, 2)))
    for result in by_rank:
        assert result["loaded_missing"] == []
        for name, value in new.items():
            assert torch.equal(result["after"][name], value), name
        assert result["loss"] == pytest.approx(expected_loss, rel=1e-6)
        # A matrix this rank saves is missing when left out; one it does not own never.
        assert result["partial_missing"] == sorted(result["primary"])
