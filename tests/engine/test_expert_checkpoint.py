"""Checkpoints of split expert stacks: saved through DCP on 4 ranks (pieces of 2, 2, 1, 1
experts), loaded on 2 ranks (pieces of 3 and 3): every expert's value, momentum and
NorMuon second moment (one value per row) arrive where the new owners expect them, and
so do the whole matrices' second moments."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from tests.support.dist import run_distributed
from tests.support.models import ExpertBlock, loss_fn, make_model, proj_or_experts_predicate
from tests.support.workers import (
    ADAMW_KW,
    MUON_KW,
    as_muon_adamw_kwargs,
    data_for,
    saved_optimizer_state,
)
from torchtitan_dmuon import Muon, dedicate_params, get_full_param

STACKS = [f"layers.{i}.experts_proj" for i in range(2)]


def _model_and_optimizer(world: int, seed: int):
    mesh = init_device_mesh("cpu", (world,))
    model = make_model(seed=seed, block=ExpertBlock)
    dedication = dedicate_params(model, mesh, proj_or_experts_predicate)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = Muon(
        model,
        **MUON_KW,
        **as_muon_adamw_kwargs(ADAMW_KW),
        ns_dtype=torch.float32,
        variant="normuon",
    )
    return model, dedication, opt


def _optimizer_state(dedication, opt) -> dict:
    """The saved momenta and second moments, views of the local state (a load fills it)."""
    return {key: saved for key, (_, _, saved) in saved_optimizer_state(dedication, opt).items()}


def _pieces(dedication, opt, key="momentum_buffer") -> dict:
    return {
        (entry.name, entry.layout.experts): opt.state[entry.param][key].clone()
        for entry, _ in dedication.primary_params()
        if entry.layout.is_piece
    }


def _whole_moments(dedication, opt) -> dict:
    return {
        entry.name: opt.state[entry.param]["second_moment"].clone()
        for entry, _ in dedication.primary_params()
        if not entry.layout.is_piece
    }


def _states(dedication, opt) -> dict:
    return dict(
        momentum=_pieces(dedication, opt),
        moments=_pieces(dedication, opt, "second_moment"),
        whole_moments=_whole_moments(dedication, opt),
    )


def _save(rank, world, path):
    model, dedication, opt = _model_and_optimizer(world, seed=0)
    for step in range(2):
        opt.zero_grad()
        loss_fn(model, *data_for(step, rank, world, False)).backward()
        opt.step()
    state = get_model_state_dict(model)
    state.update(_optimizer_state(dedication, opt))
    dcp.save(state, checkpoint_id=path)
    values = {name: get_full_param(model, name) for name in STACKS}
    result = dict(values=values, **_states(dedication, opt))
    del opt, model
    return result


def _load(rank, world, path):
    model, dedication, opt = _model_and_optimizer(world, seed=1)  # other initial values
    state = get_model_state_dict(model)
    state.update(_optimizer_state(dedication, opt))
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state, options=StateDictOptions(strict=False))
    model(data_for(0, rank, world, False)[0])  # the first forward binds the loaded values
    values = {name: get_full_param(model, name) for name in STACKS}
    result = dict(values=values, **_states(dedication, opt))
    dist.barrier()
    del opt, model
    return result


def _assemble(by_rank, key="momentum") -> dict:
    full = {}
    for result in by_rank:
        for (name, (start, stop)), piece in result[key].items():
            full.setdefault(name, {})[start] = (stop, piece)
    out = {}
    for name, pieces in full.items():
        expected_start, parts = 0, []
        for start in sorted(pieces):
            assert start == expected_start, f"{name}: pieces do not tile the stack"
            stop, piece = pieces[start]
            parts.append(piece)
            expected_start = stop
        assert expected_start == ExpertBlock.experts
        out[name] = torch.cat(parts)
    return out


def test_split_stacks_checkpoint_reshards_from_4_to_2_ranks(tmp_path):
    path = str(tmp_path / "checkpoint")
    saved = run_distributed(_save, 4, path)
    loaded = run_distributed(_load, 2, path)
    assert sorted(len(r["momentum"]) for r in saved) == [2, 2, 2, 2]  # one piece a stack
    assert sorted(len(r["momentum"]) for r in loaded) == [2, 2]
    for key in ("momentum", "moments"):
        saved_state, loaded_state = _assemble(saved, key), _assemble(loaded, key)
        for name in STACKS:
            assert torch.count_nonzero(saved_state[name]) > 0
            torch.testing.assert_close(loaded_state[name], saved_state[name], rtol=0, atol=0)
    assert _assemble(saved, "moments")[STACKS[0]].shape == (ExpertBlock.experts, 32, 1)
    for name in STACKS:
        for result in loaded:
            torch.testing.assert_close(
                result["values"][name], saved[0]["values"][name], rtol=0, atol=0
            )
    # The whole matrices' second moments, each saved by its owner, loaded by the new one.
    saved_whole = {k: v for r in saved for k, v in r["whole_moments"].items()}
    loaded_whole = {k: v for r in loaded for k, v in r["whole_moments"].items()}
    assert sorted(loaded_whole) == sorted(saved_whole) and len(saved_whole) == 12
    for name, moment in saved_whole.items():
        assert torch.count_nonzero(moment) > 0
        torch.testing.assert_close(loaded_whole[name], moment, rtol=0, atol=0)
