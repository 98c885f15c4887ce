"""Build the offline training assets: an English text corpus and a tokenizer for it.

Nothing is downloaded. The corpus is the docstrings of the Python standard library on
this machine (about 1 MB of real English prose, read with ``ast``, never imported); the
tokenizer is a byte-level BPE with TorchTitan's debug vocabulary size (2048), trained on
that corpus. ``scripts/setup.sh`` runs this once; the train configs point at the output::

    assets/corpus/stdlib_docstrings.jsonl   {"text": ...} per line (TorchTitan's
                                            dataset = "c4_test" with dataset_path = assets/corpus)
    assets/tokenizer/tokenizer.json         [model] hf_assets_path = assets/tokenizer
    assets/tokenizer/tokenizer_config.json

Usage: ``python -m torchtitan_dmuon.titan.assets [--out assets]``.
"""

from __future__ import annotations

import argparse
import ast
import json
import logging
import pathlib
import random
import sysconfig

logger = logging.getLogger(__name__)

VOCAB_SIZE = 2048
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


def build(out: pathlib.Path) -> None:
    docs = stdlib_docstrings()
    # File order groups documents by module; a fixed shuffle makes batches alike.
    random.Random(0).shuffle(docs)
    corpus = out / "corpus"
    corpus.mkdir(parents=True, exist_ok=True)
    with open(corpus / "stdlib_docstrings.jsonl", "w", encoding="utf-8") as f:
        for doc in docs:
            f.write(json.dumps({"text": doc}) + "\n")
    train_tokenizer(docs, out / "tokenizer")
    logger.info(
        "wrote %d documents (%d chars) and a %d-token tokenizer to %s",
        len(docs),
        sum(map(len, docs)),
        VOCAB_SIZE,
        out,
    )


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="[assets] %(message)s")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("assets"))
    build(parser.parse_args().out)
