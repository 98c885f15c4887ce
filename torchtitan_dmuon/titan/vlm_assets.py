"""Build the offline image-text(-action) set and the image tokenizer of the VLM / VLA.

Nothing is downloaded. The images are generated: a coloured square or disc on a noisy
background, at a random place and size. Each sample's caption names what the image shows
("a red disc in the top left.") followed by a snippet of the project's text corpus
(``assets/corpus``, built by ``titan/assets.py``), cut so that the whole sample (image
tokens, caption, end of text) fits the sequence length; its action is three numbers read
off the image (the shape's centre x and y and its size, each in [-1, 1]), the continuous
target the VLA's action head regresses. The samples are written as webdataset shards, the
format of TorchTitan's ``cc12m-test`` loader (``<key>.jpg``, ``<key>.txt``, and here
``<key>.json`` with the action)::

    assets/vlm/data/shard-00000.tar        [training] dataset = "dmuon-vlm" (or
                                           TorchTitan's "cc12m-test": no actions),
                                           dataset_path
    assets/vlm/tokenizer/tokenizer.json    [model] hf_assets_path: the project's tokenizer
    assets/vlm/tokenizer/tokenizer_config.json  with the vlm experiment's four added
                                           tokens <|image|>, <|begin_of_image|>,
                                           <|end_of_image|>, <|pad|> (ids 2048-2051)

Usage: ``python -m torchtitan_dmuon.titan.vlm_assets [--out assets/vlm]`` (``scripts/
setup.sh`` runs it); the tests build their own copy with :func:`build`.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import os
import pathlib
import random
import tarfile

logger = logging.getLogger(__name__)

IMAGE_TOKENS = ("<|image|>", "<|begin_of_image|>", "<|end_of_image|>", "<|pad|>")
"""The tokens ``torchtitan.experiments.vlm``'s ``SpecialTokens.from_tokenizer`` looks up."""

IMAGE_SIZE = 64
"""Side of the generated images, in pixels: 4 x 4 patches of 16 (the encoder's patch)."""

COLORS = {
    "red": (220, 40, 40),
    "green": (40, 180, 60),
    "blue": (40, 70, 220),
    "yellow": (230, 210, 40),
}
SHAPES = ("square", "disc")


def _place(cx: float, cy: float) -> str:
    vertical = "top" if cy < 0 else "bottom"
    horizontal = "left" if cx < 0 else "right"
    return f"{vertical} {horizontal}"


def make_image(rng: random.Random):
    """One generated image and what it shows.

    Args:
        rng: The source of the image's randomness.

    Returns:
        ``(image, description, action)``: a PIL RGB image of :data:`IMAGE_SIZE`, a phrase
        naming its colour, shape and quarter, and ``[x, y, size]`` in [-1, 1] (centre and
        side of the shape).
    """
    from PIL import Image, ImageDraw

    size = IMAGE_SIZE
    noise = bytes(rng.randrange(60, 120) for _ in range(size * size * 3))
    image = Image.frombytes("RGB", (size, size), noise)
    color = rng.choice(sorted(COLORS))
    shape = rng.choice(SHAPES)
    side = rng.uniform(0.2, 0.45) * size
    x = rng.uniform(side / 2, size - side / 2)
    y = rng.uniform(side / 2, size - side / 2)
    box = (x - side / 2, y - side / 2, x + side / 2, y + side / 2)
    draw = ImageDraw.Draw(image)
    (draw.rectangle if shape == "square" else draw.ellipse)(box, fill=COLORS[color])
    action = [2 * x / size - 1, 2 * y / size - 1, 2 * (side / size - 0.2) / 0.25 - 1]
    description = f"a {color} {shape} in the {_place(action[0], action[1])}."
    return image, description, action


def build_tokenizer(base: pathlib.Path, out: pathlib.Path) -> None:
    """The project's tokenizer with :data:`IMAGE_TOKENS` added (special: never split,
    ids after the base vocabulary).

    Args:
        base: Folder of the project's ``tokenizer.json`` and ``tokenizer_config.json``.
        out: Folder to write the extended tokenizer to.
    """
    from tokenizers import AddedToken, Tokenizer

    tokenizer = Tokenizer.from_file(str(base / "tokenizer.json"))
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in IMAGE_TOKENS])
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"))
    config = json.loads((base / "tokenizer_config.json").read_text())
    config["pad_token"] = "<|pad|>"
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def _texts(corpus: pathlib.Path) -> list[str]:
    docs = []
    for path in sorted(corpus.glob("*.jsonl")):
        with open(path, encoding="utf-8") as f:
            docs += [json.loads(line)["text"] for line in f]
    if not docs:
        raise FileNotFoundError(
            f"no corpus under {corpus}: run ./scripts/setup.sh (or python -m "
            "torchtitan_dmuon.titan.assets) first"
        )
    return docs


def build(
    out: pathlib.Path,
    assets: pathlib.Path = pathlib.Path("assets"),
    samples: int = 256,
    text_tokens: int = 32,
    seed: int = 0,
) -> None:
    """Write the tokenizer and one webdataset shard under ``out``.

    Args:
        out: The VLM assets folder (``assets/vlm``).
        assets: The project's assets (its ``corpus`` and ``tokenizer``).
        samples: How many image-text-action samples the shard holds.
        text_tokens: The most tokens of a caption (description and corpus snippet), so
            that a sample (16 image tokens, 2 image delimiters, caption, end of text) fits
            a sequence of ``text_tokens + 19``.
        seed: Seed of the images and of the snippets' choice.
    """
    from tokenizers import Tokenizer

    build_tokenizer(assets / "tokenizer", out / "tokenizer")
    tokenizer = Tokenizer.from_file(str(out / "tokenizer" / "tokenizer.json"))
    docs = _texts(assets / "corpus")
    rng = random.Random(seed)
    shard = out / "data" / "shard-00000.tar"
    shard.parent.mkdir(parents=True, exist_ok=True)
    tmp = shard.with_name(f".{shard.name}.tmp")  # hidden: the loader's *.tar skips it
    with tarfile.open(tmp, "w") as tar:
        for index in range(samples):
            image, description, action = make_image(rng)
            words = " ".join(rng.choice(docs).split()[:64])
            ids = tokenizer.encode(f"{description} {words}").ids[:text_tokens]
            caption = tokenizer.decode(ids)
            jpg = io.BytesIO()
            image.save(jpg, format="JPEG", quality=95)
            for ext, data in (
                ("jpg", jpg.getvalue()),
                ("txt", caption.encode()),
                ("json", json.dumps({"action": action}).encode()),
            ):
                info = tarfile.TarInfo(f"{index:06d}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    os.replace(tmp, shard)
    logger.info(
        "wrote %d generated image-caption-action samples to %s and the tokenizer with %s to %s",
        samples,
        shard,
        ", ".join(IMAGE_TOKENS),
        out / "tokenizer",
    )


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="[vlm assets] %(message)s")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("assets/vlm"))
    parser.add_argument("--assets", type=pathlib.Path, default=pathlib.Path("assets"))
    parser.add_argument("--samples", type=int, default=256)
    args = parser.parse_args()
    build(args.out, args.assets, args.samples)
