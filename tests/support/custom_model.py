"""A model TorchTitan does not know, registered as TorchTitan documents it: this module
calls ``register_train_spec`` when imported, and a run names it with ``--experimental.custom_import
tests.support.custom_model --model.name dmuon_test_custom`` (TorchTitan's Trainer imports it).

The model is defined only here: token embeddings, blocks in an ``nn.ModuleDict`` (each a
norm, a biased ``mix`` linear, a raw 2-D ``gate`` parameter and a two-layer MLP), a
final norm and an output head. Its parallelize function calls ``fully_shard`` itself.
``init_weights`` draws every parameter from a generator of its own, seeded by the
parameter's name, so every layout (FSDP shards, DMuon's owners, one process) starts from
the same values. The data are synthetic: each row follows ``t -> (5 t + 3) mod vocab``
from a random start, the same global batch per step for any number of data-parallel
ranks (rank r takes rows r, r + ranks, ...).

A second spec, ``dmuon_test_unwrappable``, shards through the attribute
``fsdp.fully_shard``, a path DMuon cannot see: DMuon must refuse it.
"""

from __future__ import annotations

import dataclasses
import zlib

import torch
import torch.distributed.fsdp as fsdp
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
from torchtitan.components.dataloader import BaseDataLoader
from torchtitan.components.loss import build_cross_entropy_loss
from torchtitan.components.lr_scheduler import build_lr_schedulers
from torchtitan.components.optimizer import build_optimizers
from torchtitan.protocols.model import BaseModelArgs, ModelProtocol
from torchtitan.protocols.train_spec import TrainSpec, register_train_spec

NAME = "dmuon_test_custom"
UNWRAPPABLE = "dmuon_test_unwrappable"


@dataclasses.dataclass
class CustomArgs(BaseModelArgs):
    """The sizes of the model."""

    vocab_size: int = 64
    """Token vocabulary."""
    dim: int = 32
    """Width of the residual stream."""
    hidden: int = 48
    """Width of each block's MLP."""
    n_layers: int = 2
    """Number of blocks."""

    def update_from_config(self, job_config, **kwargs) -> None:
        """Nothing in the job config changes the sizes."""

    def get_nparams_and_flops(self, model: nn.Module, seq_len: int) -> tuple[int, int]:
        """Parameters, and 6 FLOPs per parameter and token."""
        count = sum(p.numel() for p in model.parameters())
        return count, 6 * count


FLAVORS = {"tiny": CustomArgs()}


class Block(nn.Module):
    """Residual block: ``x + mix(x) @ gate + w_out(gelu(w_in(norm(x))))``."""

    def __init__(self, args: CustomArgs) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(args.dim)
        self.mix = nn.Linear(args.dim, args.dim, bias=True)
        self.gate = nn.Parameter(torch.empty(args.dim, args.dim))
        self.w_in = nn.Linear(args.dim, args.hidden, bias=False)
        self.w_out = nn.Linear(args.hidden, args.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mix(x) @ self.gate + self.w_out(F.gelu(self.w_in(self.norm(x))))


class CustomModel(ModelProtocol):
    """Embeddings, blocks (``layers``), final norm and output head."""

    def __init__(self, args: CustomArgs) -> None:
        super().__init__(args)
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): Block(args) for i in range(args.n_layers)})
        self.norm = nn.RMSNorm(args.dim)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor, **kwargs) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h)
        return self.output(self.norm(h))

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """Every parameter from a generator seeded by its name (norms at 1): the same
        values in any layout. One parameter at a time, as DMuon's plan-size start needs."""
        for name, param in self.named_parameters():
            value = initial_value(name, tuple(param.shape))
            if isinstance(param, DTensor):  # an FSDP shard: this rank's piece, no collective
                value = distribute_tensor(
                    value, param.device_mesh, param.placements, src_data_rank=None
                )
            param.copy_(value)


def initial_value(name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The initial value of parameter ``name``."""
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return 0.1 * torch.randn(shape, generator=generator)


def _sum_gradients(model: nn.Module) -> None:
    """TorchTitan's convention: the loss is divided by the global token count, so FSDP
    sums gradients (SUM on the wire: gloo has no PREMUL_SUM)."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


def _dp_mesh(parallel_dims):
    names = ["dp_replicate", "fsdp"] if parallel_dims.dp_replicate_enabled else ["fsdp"]
    return parallel_dims.get_mesh(names)


def parallelize_custom(model: CustomModel, parallel_dims, job_config) -> CustomModel:
    """FSDP2 per block, then the root, through the module's ``fully_shard``."""
    if parallel_dims.fsdp_enabled:
        mesh = _dp_mesh(parallel_dims)
        for layer in model.layers.values():
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        _sum_gradients(model)
    return model


def parallelize_unwrappable(model: CustomModel, parallel_dims, job_config) -> CustomModel:
    """The same FSDP2, through the attribute ``fsdp.fully_shard``."""
    if parallel_dims.fsdp_enabled:
        mesh = _dp_mesh(parallel_dims)
        for layer in model.layers.values():
            fsdp.fully_shard(layer, mesh=mesh)
        fsdp.fully_shard(model, mesh=mesh)
        _sum_gradients(model)
    return model


def global_batch(step: int, rows: int, seq_len: int, vocab: int) -> torch.Tensor:
    """Step ``step``'s tokens, ``rows`` sequences of ``seq_len + 1``."""
    generator = torch.Generator().manual_seed(1000 + step)
    tokens = torch.empty(rows, seq_len + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(vocab, (rows,), generator=generator)
    for i in range(seq_len):
        tokens[:, i + 1] = (5 * tokens[:, i] + 3) % vocab
    return tokens


class SyntheticLoader(BaseDataLoader):
    """This rank's rows of :func:`global_batch`, step after step."""

    def __init__(self, dp_rank: int, dp_world_size: int, job_config) -> None:
        self.rank, self.world = dp_rank, dp_world_size
        self.rows = job_config.training.local_batch_size
        self.seq_len = job_config.training.seq_len
        self.step = 0

    def __iter__(self):
        vocab = FLAVORS["tiny"].vocab_size
        while True:
            tokens = global_batch(self.step, self.rows * self.world, self.seq_len, vocab)
            tokens = tokens[self.rank :: self.world]
            self.step += 1
            yield {"input": tokens[:, :-1]}, tokens[:, 1:]

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state_dict: dict) -> None:
        self.step = state_dict["step"]


def build_synthetic_loader(dp_world_size, dp_rank, tokenizer, job_config, **kwargs):
    """TorchTitan's dataloader builder signature."""
    return SyntheticLoader(dp_rank, dp_world_size, job_config)


def _spec(parallelize_fn) -> TrainSpec:
    return TrainSpec(
        model_cls=CustomModel,
        model_args=FLAVORS,
        parallelize_fn=parallelize_fn,
        pipelining_fn=None,
        build_optimizers_fn=build_optimizers,
        build_lr_schedulers_fn=build_lr_schedulers,
        build_dataloader_fn=build_synthetic_loader,
        build_tokenizer_fn=None,
        build_loss_fn=build_cross_entropy_loss,
    )


register_train_spec(NAME, _spec(parallelize_custom))
register_train_spec(UNWRAPPABLE, _spec(parallelize_unwrappable))
