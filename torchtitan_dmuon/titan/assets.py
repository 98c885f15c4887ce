"""Build the offline training assets: an English text corpus, its held-out split and a tokenizer.

Nothing is downloaded. The corpus is the docstrings of the Python standard library on
this machine (about 1 MB of real English prose, read with ``ast``, never imported), in a
fixed shuffle. The last ``HELDOUT_FRACTION`` (5%) of the shuffled documents are a held-out
split that training never sees: they are written to their own folder and left out of the
training corpus, and the tokenizer (a byte-level BPE with TorchTitan's debug vocabulary
size, 2048) is trained on the training documents only. ``scripts/setup.sh`` runs this
once (again when the held-out file is missing, i.e. for ``assets/`` built before the
split existed); the train configs point at the output::

    assets/corpus/stdlib_docstrings.jsonl   {"text": ...} per line, the training documents
                                            (TorchTitan's dataset = "c4_test" with
                                            dataset_path = assets/corpus)
    assets/heldout/stdlib_docstrings.jsonl  the held-out documents, same format
                                            ([validation] dataset = "c4_test",
                                            dataset_path = assets/heldout)
    assets/tokenizer/tokenizer.json         [model] hf_assets_path = assets/tokenizer
    assets/tokenizer/tokenizer_config.json

Usage: ``python -m torchtitan_dmuon.titan.assets [--out assets]``, or with the file's path
(what setup does: it imports only the standard library and ``tokenizers``).
"""

from __future__ import annotations

import argparse
import ast
import json
import logging
import os
import pathlib
import random
import sysconfig

logger = logging.getLogger(__name__)

VOCAB_SIZE = 2048
# The held-out share of the shuffled documents (the last ones), never trained on.
HELDOUT_FRACTION = 0.05
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
_SKIPPED = {"site-packages", "test", "tests", "idlelib", "lib2to3", "turtledemo", "tkinter"}


def stdlib_docstrings(min_chars: int = 200) -> list[str]:
    """Module, class and function docstrings of the standard library, in file order."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    docs = []
    for path in sorted(root.rglob("*.py")):
        if _SKIPPED & set(path.relative_to(root).parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) >= min_chars:
                    docs.append(doc)
    return docs


def train_tokenizer(docs: list[str], out: pathlib.Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(docs, trainer)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"))
    config = {"bos_token": BOS, "eos_token": EOS, "model_max_length": 1 << 20}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def split_heldout(docs: list[str]) -> tuple[list[str], list[str]]:
    """Splits the shuffled documents into (training, held-out): the last 5% are held out.

    Args:
        docs: The documents, already in their fixed shuffle.

    Returns:
        The training documents and the held-out documents (at least one), in order.
    """
    n_heldout = max(1, round(HELDOUT_FRACTION * len(docs)))
    return docs[:-n_heldout], docs[-n_heldout:]


def _write_jsonl(docs: list[str], path: pathlib.Path) -> None:
    """Writes ``{"text": doc}`` per line, replacing ``path`` at once (readers never see a part)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")  # hidden: dataset loaders skip it
    with open(tmp, "w", encoding="utf-8") as f:
        for doc in docs:
            f.write(json.dumps({"text": doc}) + "\n")
    os.replace(tmp, path)


def build(out: pathlib.Path) -> None:
    """Writes the training corpus, the held-out split and the tokenizer under ``out``.

    Args:
        out: The assets folder (``assets`` in the repository root).
    """
    docs = stdlib_docstrings()
    # File order groups documents by module; a fixed shuffle makes batches alike.
    random.Random(0).shuffle(docs)
    train, heldout = split_heldout(docs)
    _write_jsonl(train, out / "corpus" / "stdlib_docstrings.jsonl")
    _write_jsonl(heldout, out / "heldout" / "stdlib_docstrings.jsonl")
    train_tokenizer(train, out / "tokenizer")
    logger.info(
        "wrote %d training documents (%d chars), %d held-out documents (%d chars) and a "
        "%d-token tokenizer (trained on the training documents) to %s",
        len(train),
        sum(map(len, train)),
        len(heldout),
        sum(map(len, heldout)),
        VOCAB_SIZE,
        out,
    )


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="[assets] %(message)s")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("assets"))
    build(parser.parse_args().out)
