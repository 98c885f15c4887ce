"""docs/configuration.md is generated from the ``[dmuon]`` field docstrings
(``python -m torchtitan_dmuon.titan.config_doc``): the committed page equals what the code
says now, and it names every field of every section the project adds."""

from __future__ import annotations

import dataclasses

from tests.titan.test_titan_integration import ROOT
from torchtitan_dmuon.titan import config_doc


def test_configuration_page_is_the_generated_one():
    committed = (ROOT / "docs" / "configuration.md").read_text()
    assert committed == config_doc.render(), (
        "docs/configuration.md is stale: run "
        "`python -m torchtitan_dmuon.titan.config_doc > docs/configuration.md`"
    )


def test_every_field_has_its_docstring_on_the_page():
    page = config_doc.render()
    for section, cls in config_doc.SECTIONS:
        docs = config_doc.field_docstrings(cls)
        for f in dataclasses.fields(cls):
            assert docs[f.name][1], f"[{section}] {f.name} has no docstring"
            assert f"TOML `[{section}] {f.name}`" in page
