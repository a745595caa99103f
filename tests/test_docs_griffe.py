"""The API reference's docstring rewriting (docsbuild/griffe_mixprec.py), on the real code:
Sphinx roles become links to what they name, literal blocks become fenced code, multi-name
``:param:`` fields split, and ``mixprec.<backend>`` resolves to the backend's api module."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

griffe = pytest.importorskip("griffe")

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from docsbuild.griffe_mixprec import MixprecDocs, builtin_backends  # noqa: E402


@pytest.fixture(scope="module")
def loaded() -> griffe.ModulesCollection:
    loader = griffe.GriffeLoader(
        extensions=griffe.load_extensions(MixprecDocs()),
        docstring_parser=griffe.Parser.sphinx,
        search_paths=[str(ROOT)],
    )
    loader.load("mixprec")
    loader.resolve_aliases(implicit=False)
    return loader.modules_collection


def test_the_builtin_backends_are_read_from_the_entry_points() -> None:
    assert builtin_backends() == {"torch": "mixprec_torch", "mxnet": "mixprec_mxnet"}


def test_backends_are_documented_under_the_names_users_import(
    loaded: griffe.ModulesCollection,
) -> None:
    wrap = loaded["mixprec.torch.wrap"]
    assert wrap.path == "mixprec.torch.wrap"
    assert wrap.canonical_path == "mixprec_torch.wrapping.wrap.wrap"
    assert loaded["mixprec.mxnet.Trainer"].canonical_path == "mixprec_mxnet.trainer.Trainer"


def test_roles_become_links_to_what_they_name(loaded: griffe.ModulesCollection) -> None:
    text = loaded["mixprec.policy.value.Policy"].docstring.value
    assert ":func:" not in text and ":class:" not in text and ":mod:" not in text
    # :func:`mixprec.get_policy` -> the object it names, by its canonical path
    assert '<autoref identifier="mixprec.engine.spec.get_policy" optional>' in text
    # :class:`~mixprec.NoScale`: only the last component shown
    noscale = "mixprec.numerics.loss_scale.NoScale"
    assert f'<autoref identifier="{noscale}" optional><code>NoScale</code>' in text
    # :class:`OpRules`: a name of the enclosing module (imported there from mixprec.policy.rules)
    assert '<autoref identifier="mixprec.policy.rules.OpRules" optional>' in text


def test_relative_module_roles_resolve_against_their_package(
    loaded: griffe.ModulesCollection,
) -> None:
    text = loaded["mixprec_mxnet.trainer"].docstring.value
    masters = "mixprec_mxnet.wrapping.masters"
    assert f'<autoref identifier="{masters}" optional><code>masters</code>' in text


def test_literal_blocks_become_fenced_code(loaded: griffe.ModulesCollection) -> None:
    text = loaded["mixprec.engine.spec"].docstring.value
    assert "(jmp-style):\n\n```text\nbase=O1,compute=bfloat16" in text
    assert "::" not in text.split("```", 1)[0]
    loop = loaded["mixprec_torch"].docstring.value
    assert "The loop:\n\n```python\nmodel, optimizer = mixprec.torch.wrap(" in loop


def test_a_field_naming_several_parameters_is_split(loaded: griffe.ModulesCollection) -> None:
    trainer = loaded["mixprec_mxnet.trainer.Trainer"]
    text = trainer.docstring.value
    for name in ("optimizer", "optimizer_params", "kvstore", "compression_params"):
        assert f":param {name}: as for ``gluon.Trainer``." in text
    sections = trainer.docstring.parse(griffe.Parser.sphinx)
    params = next(s for s in sections if s.kind.value == "parameters").value
    assert {"net_or_params", "optimizer", "kvstore", "policy"} <= {p.name for p in params}
