"""Which parameters Muon takes (one rule set for ``dedicate_params`` and one-process Muon),
and the modules whose hooks move them."""

from __future__ import annotations

import logging
from collections.abc import Callable

from torch import nn

__all__ = [
    "BoundaryPredicate",
    "Predicate",
    "boundary_name",
    "default_boundary_modules",
    "select_matrices",
]

logger = logging.getLogger(__name__)

Predicate = Callable[[str, nn.Parameter], bool]
BoundaryPredicate = Callable[[str, nn.Module], bool]


def default_boundary_modules(model: nn.Module) -> set[nn.Module]:
    """Blocks: modules held in an ``nn.ModuleList``/``nn.ModuleDict`` (what
    ``fully_shard`` is applied to in TorchTitan and most training scripts)."""
    blocks = set()
    for module in model.modules():
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            blocks.update(module.children())
    return blocks


def boundary_name(param_name: str, model: nn.Module, accepts: BoundaryPredicate) -> str:
    """The innermost ancestor module of ``param_name`` that ``accepts`` ("" for the root
    when none does)."""
    parts = param_name.split(".")[:-1]
    for depth in range(len(parts), 0, -1):
        module_name = ".".join(parts[:depth])
        if accepts(module_name, model.get_submodule(module_name)):
            return module_name
    return ""


def _embedding_like(model: nn.Module) -> dict[int, str]:
    """Parameters that Muon should not take: token embeddings, and output heads (a linear
    layer outside the blocks that maps to a vocabulary an embedding also has)."""
    found: dict[int, str] = {}
    vocabularies = set()
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            found[id(module.weight)] = "an embedding"
            vocabularies.add(module.num_embeddings)
    in_blocks = {id(m) for block in default_boundary_modules(model) for m in block.modules()}
    for module in model.modules():
        if (
            isinstance(module, nn.Linear)
            and id(module) not in in_blocks
            and module.out_features in vocabularies
        ):
            found.setdefault(id(module.weight), "an output head")
    return found


def select_matrices(model: nn.Module, predicate: Predicate) -> list[tuple[str, nn.Parameter]]:
    """The trainable parameters ``predicate(name, param)`` selects, as ``(name, param)``.

    Every selected parameter must be a 2-D matrix or a 3-D stack of matrices (MoE
    experts) and have one name (tied weights cannot have one owner per use). Frozen
    matches are left out with a log line; embeddings and output heads are accepted with
    a warning (Muon is meant for hidden matrices).

    Raises:
        ValueError: a selected parameter is tied or not a matrix.
    """
    names_of: dict[int, list[str]] = {}
    params: dict[int, nn.Parameter] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(p), []).append(name)
        params[id(p)] = p
    embedding_like = _embedding_like(model)
    selected, frozen = [], []
    for key, names in names_of.items():
        name, p = names[0], params[key]
        if not predicate(name, p):
            continue
        if len(names) > 1:
            raise ValueError(
                f"parameter {name!r} is shared with {names[1:]} (tied weights) and cannot be "
                "given to Muon; exclude it in the predicate"
            )
        if p.ndim not in (2, 3):
            raise ValueError(
                f"predicate selected {name!r} of shape {tuple(p.shape)}; only 2-D matrices "
                "and 3-D stacks of matrices (MoE experts) can be given to Muon"
            )
        if not p.requires_grad:
            frozen.append(name)
            continue
        if key in embedding_like:
            logger.warning(
                "Muon was given %r, which looks like %s: Muon is meant for hidden matrices; "
                "embeddings and output heads usually train better with AdamW",
                name,
                embedding_like[key],
            )
        selected.append((name, p))
    if frozen:
        logger.info("Muon: %d frozen matrices left out: %s", len(frozen), frozen)
    return selected
