"""Every TorchTitan flag that README.md and docs/*.md name is one the trainer's parser takes.

A TorchTitan flag is ``--section.key`` (or ``--section.sub.key``, ``--section.no_key`` for a
bool): a dot after ``--``, so torchrun's, pytest's or pip's flags are left out. The docs are
read in three kinds of place: the lines of fenced code blocks (backslash continuations
joined, ``#`` comments dropped), inline code spans (also across a line break) and table
cells; a flag anywhere else in the prose is checked by name.

A flag followed by a value in its command, code span or cell (``--dmuon.lr 0.02``,
``--a.b=c``), or one given among other arguments, is parsed as written by TorchTitan
0.2.2's ``ConfigManager`` with the ``[dmuon]`` config module, after it and over
``train_configs/debug_cpu.toml``: an unknown name, a bool given a value, a value flag given
none, a value outside a field's type or choices, or one ``[dmuon]`` refuses, fails. A flag
named alone (a code span of just ``--comm.trace_buf_size``) is checked against the parser's
fields by name.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import re
import shlex
from pathlib import Path

import pytest
from torchtitan.config import ConfigManager

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BASE_ARGS = [
    "--job.config_file",
    "train_configs/debug_cpu.toml",
    "--job.custom_config_module",
    "torchtitan_dmuon.titan.config",
]
FLAG = re.compile(r"--[A-Za-z_][\w-]*(?:\.[A-Za-z_][\w-]*)+(?:=\S*)?")
FENCE = re.compile(r"^\s*(```|~~~)")
CODE_SPAN = re.compile(r"(`+)((?:(?!\n[ \t]*\n).)+?)\1", re.S)  # within a paragraph


@dataclasses.dataclass(frozen=True)
class DocFlag:
    where: str  # file:line
    flag: str  # as written, without an "=value"
    value: str | None  # the value the doc gives, if any
    alone: bool  # named on its own (no command around it): checked by name only

    def __str__(self) -> str:
        given = "" if self.value is None else f" {self.value}"
        return f"{self.where}: {self.flag}{given}"


def _segment_flags(where: str, text: str) -> list[DocFlag]:
    """The flags of one command, code span or table cell, each with the token after it."""
    try:
        tokens = shlex.split(text, comments=True)
    except ValueError:  # an unbalanced quote in prose-like code
        tokens = text.split()
    found = []
    for i, token in enumerate(tokens):
        match = FLAG.fullmatch(token)
        if match is None:
            continue
        flag, eq, value = token.partition("=")
        if not eq:
            following = tokens[i + 1] if i + 1 < len(tokens) else None
            value = None if following is None or following.startswith("--") else following
        found.append(DocFlag(where, flag, value, alone=len(tokens) == 1 and not eq))
    return found


def _line_of(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def doc_flags(path: Path) -> list[DocFlag]:
    """Every TorchTitan flag of one markdown file, in the order it names them."""
    text = path.read_text()
    name = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)
    lines = text.split("\n")
    found: list[DocFlag] = []

    # Fenced code blocks: each logical line (continuations joined) is one command.
    prose = list(lines)
    fence, start, command = None, 0, ""
    for number, line in enumerate(lines, start=1):
        opening = FENCE.match(line)
        if fence is None:
            if opening:
                fence = opening.group(1)
                prose[number - 1] = ""
            continue
        prose[number - 1] = ""
        if line.strip().startswith(fence):
            fence = None
            continue
        if not command:
            start = number
        if line.rstrip().endswith("\\"):
            command += line.rstrip()[:-1] + " "
            continue
        found += _segment_flags(f"{name}:{start}", command + line)
        command = ""

    # Inline code spans of the prose; each then becomes blanks, newlines kept.
    rest = "\n".join(prose)
    for span in CODE_SPAN.finditer(rest):
        code = span.group(2)
        for flag in _segment_flags("", code.replace("\n", " ")):
            at = span.start(2) + code.index(flag.flag)
            found.append(dataclasses.replace(flag, where=f"{name}:{_line_of(rest, at)}"))
    rest = CODE_SPAN.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), rest)

    # What is left: a table cell is a command; a flag in prose is named alone.
    for number, line in enumerate(rest.split("\n"), start=1):
        if line.lstrip().startswith("|"):
            for cell in line.split("|"):
                found += _segment_flags(f"{name}:{number}", cell)
        else:
            for match in FLAG.finditer(line):
                flag = match.group(0).partition("=")[0]
                found.append(DocFlag(f"{name}:{number}", flag, None, alone=True))
    return sorted(found, key=lambda f: int(f.where.rpartition(":")[2]))


def all_doc_flags() -> list[DocFlag]:
    return [flag for path in DOCS for flag in doc_flags(path)]


def _parse(args: list[str]) -> str | None:
    """None when TorchTitan's parser takes ``args``, else its message."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            ConfigManager().parse_args(args)
    except SystemExit:
        # tyro draws its message in a box, its title in the top edge: keep the message.
        body = err.getvalue().strip().split("\n")[1:]
        words = " ".join(re.sub(r"[│╭╮╰╯─|+]+|-{3,}", " ", "\n".join(body)).split())
        return words.partition(" For full helptext")[0]
    return None


def _as_written(flag: str, value: str | None) -> list[str]:
    return [flag] if value is None else [flag, value]


def known_name(flag: str, fields: dict[str, object]) -> bool:
    """Whether ``--section.key`` (hyphens or underscores; ``no_`` before a bool) is a field."""
    name = flag[2:].replace("-", "_")
    if name in fields:
        return True
    section, _, key = name.rpartition(".")
    plain = f"{section}.{key.removeprefix('no_')}"
    return key.startswith("no_") and fields.get(plain) in (bool, "bool")


def refusals(flags: list[DocFlag], fields: dict[str, object]) -> list[str]:
    """``file:line: flag [value]: why`` for each flag the parser would refuse."""
    errors = [
        f"{flag}: no such TorchTitan 0.2.2 / [dmuon] field"
        for flag in flags
        if flag.alone and not known_name(flag.flag, fields)
    ]
    given = list(dict.fromkeys((f.flag, f.value) for f in flags if not f.alone))
    # One parse of them all (~0.1 s a parse); only when it fails, one per flag names them.
    together = _parse([*(arg for g in given for arg in _as_written(*g)), *BASE_ARGS])
    if together is None:
        return errors
    refused = {g: _parse([*_as_written(*g), *BASE_ARGS]) for g in given}
    errors += [
        f"{f}: {refused[f.flag, f.value]}"
        for f in flags
        if not f.alone and refused[f.flag, f.value] is not None
    ]
    return errors or [f"each flag is taken alone, not all together: {together}"]


@pytest.fixture(scope="module")
def in_checkout():
    """The docs' commands run from the checkout: relative config paths resolve there."""
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(ROOT)
        yield


@pytest.fixture(scope="module")
def fields_by_name(in_checkout) -> dict[str, object]:
    """Every field of the parsed JobConfig (with ``[dmuon]``) by its dotted name."""
    found: dict[str, object] = {}

    def walk(obj, prefix):
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if dataclasses.is_dataclass(value):
                walk(value, f"{prefix}{f.name}.")
            else:
                found[prefix + f.name] = f.type

    walk(ConfigManager().parse_args(BASE_ARGS), "")
    return found


def test_docs_name_torchtitan_flags():
    """The collector finds the flags, and only TorchTitan's."""
    flags = {f.flag for f in all_doc_flags()}
    assert {"--optimizer.name", "--dmuon.lr", "--job.config_file"} <= flags
    assert not flags & {"--nproc", "--nodes", "--runs", "--dev", "--help"}


def test_every_doc_flag_is_accepted(fields_by_name):
    errors = refusals(all_doc_flags(), fields_by_name)
    assert not errors, "TorchTitan's parser refuses these flags of the docs:\n" + "\n".join(errors)


def test_doc_config_files_exist():
    """A ``--job.config_file`` the docs pass is a file of the checkout."""
    missing = [
        str(f)
        for f in all_doc_flags()
        if f.flag.replace("-", "_") == "--job.config_file"
        and f.value is not None
        and not (ROOT / f.value).is_file()
    ]
    assert not missing, "config files the docs name that do not exist:\n" + "\n".join(missing)


BAD_DOC = """\
Run `./run_train.sh --dmuon.lr 0.01 --float8.emulate` or `--checkpoint.enable true`,
`--dmuon.variant normal`, `--dmuon.lr --training.steps 5`, `--dmuon.momentum=1.5`;
`--quantize.linear.float8.oops` alone; `--metrics.no-enable_tensorboard` and
`--metrics.no_enable_tensorboard` are fine.

```bash
torchrun --nproc_per_node 4 -m train --parallelism.tensor_parallel_degree 2 \\
    --training.steps=ten   # a comment's --comment.flag is not one
```

| run | flags |
| --- | --- |
| a | --optimizer.lr 0.003 |
| b | --optimizer.lrr 0.003 |
"""


def test_refusals_name_file_line_and_flag(tmp_path, fields_by_name):
    """The checker itself: each kind of doc error is caught, with its line."""
    doc = tmp_path / "bad.md"
    doc.write_text(BAD_DOC)
    flags = doc_flags(doc)
    assert [(f.where.rpartition(":")[2], f.flag, f.value) for f in flags] == [
        ("1", "--dmuon.lr", "0.01"),
        ("1", "--float8.emulate", None),
        ("1", "--checkpoint.enable", "true"),
        ("2", "--dmuon.variant", "normal"),
        ("2", "--dmuon.lr", None),
        ("2", "--training.steps", "5"),
        ("2", "--dmuon.momentum", "1.5"),
        ("3", "--quantize.linear.float8.oops", None),
        ("3", "--metrics.no-enable_tensorboard", None),
        ("4", "--metrics.no_enable_tensorboard", None),
        ("7", "--parallelism.tensor_parallel_degree", "2"),
        ("7", "--training.steps", "ten"),
        ("13", "--optimizer.lr", "0.003"),
        ("14", "--optimizer.lrr", "0.003"),
    ]
    refused = refusals(flags, fields_by_name)
    assert [e.split(": ")[0].rpartition("/")[2] + " " + e.split(": ")[1] for e in refused] == [
        "bad.md:3 --quantize.linear.float8.oops",
        "bad.md:1 --float8.emulate",
        "bad.md:1 --checkpoint.enable true",
        "bad.md:2 --dmuon.variant normal",
        "bad.md:2 --dmuon.lr",
        "bad.md:2 --dmuon.momentum 1.5",
        "bad.md:7 --training.steps ten",
        "bad.md:14 --optimizer.lrr 0.003",
    ]


# Words of the project's own bookkeeping that mean nothing to a reader of the docs.
INTERNAL_WORDS = {
    "an issue number": re.compile(r"\bissues? #?\d+|(?<![\w&/])#\d+\b", re.I),
    '"goal"': re.compile(r"\bgoals?\b", re.I),
    '"the seed"': re.compile(r"\bthe seed\b", re.I),
    '"dirty"': re.compile(r"\bdirty\b", re.I),
    '"lent"': re.compile(r"\blent\b", re.I),
}


def internal_words(path: Path) -> list[str]:
    """``file:line: what`` for each internal word of one page."""
    name = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)
    return [
        f"{name}:{number}: {what}: {line.strip()[:100]}"
        for number, line in enumerate(path.read_text().split("\n"), start=1)
        for what, pattern in INTERNAL_WORDS.items()
        if pattern.search(line)
    ]


def test_docs_name_no_internal_words():
    found = [hit for path in DOCS for hit in internal_words(path)]
    assert not found, "internal words on the pages (say what is meant):\n" + "\n".join(found)


# A repository path a page names: under one of these folders, or one of the top-level files.
REPO_PATH = re.compile(
    r"(?<![\w./-])(?:(?:torchtitan_dmuon|tests|benchmarks|scripts|train_configs|docs)/"
    r"[\w./*-]*[\w*]|(?:run_train\.sh|run_tests\.sh|multinode_trainer\.slurm|pyproject\.toml"
    r"|CHANGELOG\.md|README\.md)\b)"
)
# Paths that runs write (git ignores them): named as places to look, not files of the checkout.
WRITTEN_BY_RUNS = ("benchmarks/results/",)
MD_LINK = re.compile(r"\]\(([^)\s]+)\)")


def missing_paths(path: Path) -> list[str]:
    """``file:line: path`` for each repository path or relative link of one page that the
    checkout lacks (a glob must match something; a link resolves from the page's folder)."""
    name = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)
    missing = []
    for number, line in enumerate(path.read_text().split("\n"), start=1):
        for match in REPO_PATH.finditer(line):
            target = match.group(0).split("::")[0].rstrip(".")
            if target.startswith(WRITTEN_BY_RUNS):
                continue
            exists = any(ROOT.glob(target)) if "*" in target else (ROOT / target).exists()
            if not exists:
                missing.append(f"{name}:{number}: {target}")
        for match in MD_LINK.finditer(line):
            target, _, anchor = match.group(1).partition("#")
            if "://" in target or target.startswith("mailto:"):
                continue
            page = path.parent / target if target else path
            if not page.exists():
                missing.append(f"{name}:{number}: link {target}")
            elif anchor and page.suffix == ".md" and anchor not in heading_anchors(page):
                missing.append(f"{name}:{number}: link {match.group(1)}")
    return missing


def heading_anchors(page: Path) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped
    (hyphens and underscores kept), spaces as hyphens."""
    text = re.sub(r"^(```|~~~).*?^\1", "", page.read_text(), flags=re.S | re.M)
    return {
        re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        for heading in re.findall(r"^#{1,6} (.+)$", text, flags=re.M)
    }


def test_docs_name_only_files_that_exist():
    missing = [hit for path in DOCS for hit in missing_paths(path)]
    assert not missing, "paths the pages name that the checkout lacks:\n" + "\n".join(missing)


def test_the_checks_catch_internal_words_and_missing_paths(tmp_path):
    """The two checkers themselves, on a page with one of each kind of error."""
    doc = tmp_path / "bad.md"
    doc.write_text(
        "Fixed in issue 48 (see #12); the goal was met on a dirty tree.\n"
        "As the seed said, on the GPU we were lent.\n"
        "Run `tests/test_nothing.py` or [this](nowhere.md);"
        " `tests/tools/test_doc_flags.py` is fine.\n"
        "[Here](#no-such-heading), [there](#the-heading-here).\n"
        "\n## The heading (here)\n"
    )
    words = [hit.split(": ")[1] for hit in internal_words(doc)]
    assert words == [
        "an issue number", '"goal"', '"dirty"', '"the seed"', '"lent"'
    ]  # fmt: skip
    assert [hit.rpartition(": ")[2] for hit in missing_paths(doc)] == [
        "tests/test_nothing.py",
        "link nowhere.md",
        "link #no-such-heading",
    ]


def test_readme_results_are_quoted_from_their_pages():
    """Every decimal figure of the README's Results table is written on the page it links
    (docs/benchmarks.md or docs/scaling.md), where it lives with its method: a headline
    cannot drift from its table."""
    readme = (ROOT / "README.md").read_text()
    table = readme.split("## Results", 1)[1].split("\n## ", 1)[0]
    pages = (ROOT / "docs" / "benchmarks.md").read_text() + (
        ROOT / "docs" / "scaling.md"
    ).read_text()
    rows = [line for line in table.split("\n") if line.startswith("| ") and "---" not in line]
    assert len(rows) >= 5
    missing = [
        number
        for row in rows[1:]
        for number in re.findall(r"(?<![\w.])\d+\.\d+", row.rpartition("| [")[0])
        if number not in pages
    ]
    assert not missing, f"README figures not on their pages: {missing}"


def test_readme_toml_block_parses(tmp_path, in_checkout):
    """The README's ``[optimizer]`` / ``[dmuon]`` block, as a TOML file of its own, is a
    config TorchTitan's parser takes, with DMuon switched on and ``[dmuon]`` read."""
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```toml\n(.*?)```", readme, flags=re.S)
    assert len(blocks) == 1
    config = tmp_path / "readme.toml"
    config.write_text(blocks[0])
    with contextlib.redirect_stdout(io.StringIO()):
        parsed = ConfigManager().parse_args(["--job.config_file", str(config)])
    assert parsed.optimizer.name == "DMuon"
    assert parsed.dmuon.lr == 0.02 and parsed.dmuon.reshard_after_forward is True
