"""A tiny transformer with "proj" matrices, shared by the tests."""

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.k_proj = nn.Linear(dim, dim, bias=False)
        self.v_proj = nn.Linear(dim, dim, bias=False)
        self.o_proj = nn.Linear(dim, dim, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        q, k, v = self.q_proj(h), self.k_proj(h), self.v_proj(h)
        att = torch.softmax(q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5, dim=-1)
        x = x + self.o_proj(att @ v)
        return x + self.down_proj(torch.relu(self.up_proj(self.norm(x))))


class BranchBlock(Block):
    """A block with a branch only some ranks take, a matrix no rank uses and a frozen one."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__(dim, hidden)
        self.branch_proj = nn.Linear(dim, dim, bias=False)
        self.unused_proj = nn.Linear(dim, dim, bias=False)
        self.frozen_proj = nn.Linear(dim, dim, bias=False)
        self.frozen_proj.weight.requires_grad_(False)
        self.use_branch = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = super().forward(x)
        x = x + 0.1 * self.frozen_proj(x)
        if self.use_branch:
            x = x + self.branch_proj(x)
        return x


class ExpertBlock(Block):
    """A block with a soft mixture of experts whose matrices are stored stacked, as
    TorchTitan's MoE layers store them: ``experts_proj`` is ``(experts, dim, hidden)``.

    ``split=True`` holds the same values as one 2-D parameter per expert instead (the
    same function and gradients): what torch.optim.Muon, which only takes matrices, steps
    as the reference.
    """

    experts = 6

    def __init__(self, dim: int, hidden: int, split: bool = False) -> None:
        super().__init__(dim, hidden)
        self.router = nn.Linear(dim, self.experts, bias=False)
        stacked = torch.randn(self.experts, dim, hidden) / dim**0.5
        self.expert_out = nn.Linear(hidden, dim, bias=False)
        if split:
            self.experts_proj_split = nn.ParameterList(nn.Parameter(w.clone()) for w in stacked)
        else:
            self.experts_proj = nn.Parameter(stacked)

    def stacked_experts(self) -> torch.Tensor:
        if hasattr(self, "experts_proj_split"):
            return torch.stack(list(self.experts_proj_split))
        return self.experts_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = super().forward(x)
        gate = torch.softmax(self.router(x), dim=-1)
        experts = self.stacked_experts()
        if isinstance(experts, DTensor):
            return x + self.expert_out(_expert_parallel_mix(x, gate, experts))
        # Smooth (as SwiGLU experts are): equality tests need no ReLU kink that rounding
        # noise can cross.
        hidden = nn.functional.silu(torch.einsum("bsd,edh->bseh", x, experts))
        return x + self.expert_out(torch.einsum("bse,bseh->bsh", gate, hidden))


def _expert_parallel_mix(x: torch.Tensor, gate: torch.Tensor, experts: DTensor) -> torch.Tensor:
    """The gate-weighted expert outputs under expert parallelism (``experts`` sharded
    along dim 0 over the ep mesh): the ep group's tokens are gathered, each rank runs
    them through its local experts, and each rank's tokens get the sum of the partial
    mixtures (autograd-aware collectives). What EP's token dispatch computes, for a soft mixture;
    each expert's gradient then holds every token of the ep group."""
    mesh = experts.device_mesh
    group, rank = mesh.get_group(), mesh.get_local_rank()
    local = experts.to_local()
    first = rank * local.shape[0]
    # The *_tensor_autograd collectives: torch 2.11 has them (not the *_single_autograd ones).
    tokens = funcol.wait_tensor(funcol.all_gather_tensor_autograd(x.contiguous(), 0, group))
    gates = funcol.wait_tensor(funcol.all_gather_tensor_autograd(gate.contiguous(), 0, group))
    gates = gates[..., first : first + local.shape[0]]
    hidden = nn.functional.silu(torch.einsum("bsd,edh->bseh", tokens, local))
    partial = torch.einsum("bse,bseh->bsh", gates, hidden)
    return funcol.wait_tensor(funcol.reduce_scatter_tensor_autograd(partial, "sum", 0, group))


def shard_experts(model: nn.Module, ep_mesh) -> None:
    """Expert parallelism: each ExpertBlock's stack sharded along dim 0 over ``ep_mesh``
    (as TorchTitan's ExpertParallel lays out routed experts; every rank has the same
    values, so each keeps its slice without communication)."""
    for block in model.layers:
        if isinstance(block, ExpertBlock):
            stack = distribute_tensor(
                block.experts_proj.detach(), ep_mesh, [Shard(0)], src_data_rank=None
            )
            block.experts_proj = nn.Parameter(stack)


class SplitExpertBlock(ExpertBlock):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__(dim, hidden, split=True)


class Attend(nn.Module):
    """Causal attention on ``(batch, heads, seq, dim)`` query, key and value: the module
    QK-clip watches (TorchTitan's inner attention wrappers take the same arguments)."""

    def forward(self, q, k, v, *, scale=None, is_causal=True):
        return nn.functional.scaled_dot_product_attention(
            q, k, v, scale=scale, is_causal=is_causal, enable_gqa=q.shape[1] != k.shape[1]
        )


class HeadsBlock(Block):
    """Causal multi-head attention with grouped keys (heads of 8 dims, two query heads per
    key head), laid out as TorchTitan's (heads read from the local width, so q, k, v
    Colwise and o Rowwise under TP work), then an MLP. The query and key projections start
    4x larger than nn.Linear's default, so the logits are large enough to clip."""

    head_dim = 8

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__(dim, hidden)
        self.k_proj = nn.Linear(dim, dim // 2, bias=False)
        self.v_proj = nn.Linear(dim, dim // 2, bias=False)
        self.attend = Attend()
        with torch.no_grad():
            self.q_proj.weight.mul_(4)
            self.k_proj.weight.mul_(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        h = self.norm(x)

        def heads(t):
            return t.view(b, s, -1, self.head_dim).transpose(1, 2)

        out = self.attend(heads(self.q_proj(h)), heads(self.k_proj(h)), heads(self.v_proj(h)))
        x = x + self.o_proj(out.transpose(1, 2).reshape(b, s, -1))
        return x + self.down_proj(torch.relu(self.up_proj(self.norm(x))))


class BiasHeadsBlock(HeadsBlock):
    """:class:`HeadsBlock` with biases on the query and key projections (Qwen2.5's layout),
    large enough that they make most of the logits: a clip that scaled only the weights'
    rows would leave them above the threshold. The key bias is frozen: its gradient is zero
    in exact arithmetic (softmax ignores what adds ``q_i . b_k`` to every logit of query
    ``i``), so AdamW would step rounding noise, which differs between equal runs."""

    bias_scale = 3.0

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__(dim, hidden)
        self.q_proj.bias = nn.Parameter(self.bias_scale * torch.randn(dim))
        self.k_proj.bias = nn.Parameter(
            self.bias_scale * torch.randn(dim // 2), requires_grad=False
        )


class TinyTransformer(nn.Module):
    def __init__(
        self, vocab: int = 64, dim: int = 32, hidden: int = 64, layers: int = 2, block=Block
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(block(dim, hidden) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.skip_layers: set[int] = set()
        """Blocks this rank skips (rank-dependent control flow in tests)."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for i, layer in enumerate(self.layers):
            if i not in self.skip_layers:
                x = layer(x)
        return self.head(self.norm(x))


class TokenBlock(nn.Module):
    def __init__(self, dim: int = 32, hidden: int = 64) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down_proj(torch.relu(self.up_proj(self.norm(x))))


class TokenModel(nn.Module):
    """Every token is computed on its own (a sequence chunk needs no other chunk, for context
    parallelism), and its blocks are Megatron MLPs (up Colwise, down Rowwise, for tensor
    parallelism)."""

    def __init__(self, vocab: int = 64, dim: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(TokenBlock(dim) for _ in range(3))
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def proj_predicate(name: str, param: nn.Parameter) -> bool:
    return "proj" in name and param.ndim == 2


def proj_or_experts_predicate(name: str, param: nn.Parameter) -> bool:
    """The projection matrices and the stacked experts (2-D or 3-D)."""
    return "proj" in name and param.ndim >= 2


def make_model(seed: int = 0, **kwargs) -> TinyTransformer:
    torch.manual_seed(seed)
    return TinyTransformer(**kwargs)


def batch(
    seed: int, batch_size: int = 4, seq: int = 8, vocab: int = 64
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (batch_size, seq + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def loss_fn(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model(inputs)
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
